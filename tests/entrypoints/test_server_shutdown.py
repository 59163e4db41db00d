"""Graceful shutdown: on SIGTERM / Ctrl-C the server stops accepting connections, lets running
requests finish within --shutdown-timeout, then fails the rest cleanly (a stream gets an error
event and ``data: [DONE]``, a non-streamed request a 503, their engine requests are aborted)
with no traceback in the log. Fake engine held mid-request (no sleeps); one real ``pagedkv
serve`` process with a real SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading

import httpx
import pytest
from _serve_process import start_serve_process
from _server_fakes import FakeEngine, wait_for

from pagedkv.cluster.protocol import ClusterRequest
from pagedkv.engine.engine_loop import EngineDeadError, EngineLoop, EngineRequest
from pagedkv.engine.input_processor import ProcessedPrompt
from pagedkv.entrypoints.cluster.frontend import ClusterEngineLoop
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.launch import SHUTTING_DOWN, ThreadedServer, make_server
from pagedkv.errors import ConfigError
from pagedkv.sampling_params import SamplingParams

MODEL = "fake-model"
BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 20, "temperature": 0}


class StreamReader(threading.Thread):
    """A streamed completion read in a thread: ``events`` (the ``data:`` payloads) grows as
    they arrive."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            body = {**BODY, "stream": True}
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
        except BaseException as exc:  # reported by the test
            self.error = exc


class Post(threading.Thread):
    """A non-streamed completion in a thread."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.response: httpx.Response | None = None

    def run(self) -> None:
        self.response = httpx.post(self.url + "/v1/completions", json=BODY, timeout=60)


def refuses_connections(server: ThreadedServer) -> bool:
    try:
        socket.create_connection((server.host, server.port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_requests_still_running_at_the_deadline_fail_cleanly(capfd):
    engine = FakeEngine()
    app = create_app(EngineLoop(engine), model_name=MODEL)
    loop = app.state.engine_client
    server = ThreadedServer(app, shutdown_timeout=0.2).start()
    try:
        engine.hold(after_tokens=2)  # never released: both requests are running at the deadline
        stream, post = StreamReader(server.url), Post(server.url)
        stream.start()
        post.start()
        wait_for(lambda: len(stream.events) == 2 and loop.num_streams == 2, "two held requests")
        server.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's SIGTERM handler does
        stream.join(60)
        post.join(60)
    finally:
        server.stop()
    assert stream.error is None, stream.error
    assert len(stream.events) == 4 and stream.events[-1] == "[DONE]"
    assert all(json.loads(e)["choices"][0]["text"] for e in stream.events[:2])
    error = json.loads(stream.events[2])["error"]
    assert (error["message"], error["type"]) == (SHUTTING_DOWN, "service_unavailable")
    assert post.response.status_code == 503
    assert post.response.json()["error"]["message"] == SHUTTING_DOWN
    # Their engine requests were aborted: no blocks held.
    assert engine.num_aborted == 2 and engine.running == [] and engine.num_used_blocks == 0
    log = capfd.readouterr().err
    assert "Traceback" not in log and "CancelledError" not in log
    assert "timeout graceful shutdown exceeded" not in log


def test_a_request_that_finishes_within_the_deadline_completes():
    engine = FakeEngine()
    app = create_app(EngineLoop(engine), model_name=MODEL)
    server = ThreadedServer(app, shutdown_timeout=120).start()  # a bound, never reached
    try:
        engine.hold(after_tokens=2)
        stream = StreamReader(server.url)
        stream.start()
        wait_for(lambda: len(stream.events) == 2, "the first two events")
        server.server.handle_exit(signal.SIGTERM, None)
        wait_for(lambda: refuses_connections(server), "the server to stop listening")
        assert stream.is_alive()  # draining: the stream is still open
        engine.release()
        stream.join(60)
    finally:
        engine.release()
        server.stop()
    assert stream.error is None, stream.error
    assert stream.events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in stream.events[:-1]]
    assert all("error" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) and len(chunks) == 20
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert engine.num_aborted == 0


def test_make_server_refuses_a_bad_shutdown_timeout():
    app = create_app(FakeEngine(), model_name=MODEL)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="shutdown-timeout"):
            make_server(app, shutdown_timeout=bad)


# ---- fail_streams on the engine loops --------------------------------------------------------


def test_engine_loop_fail_streams_ends_the_streams_and_aborts_their_requests():
    async def main():
        engine = FakeEngine()
        engine.hold(after_tokens=1)
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        try:
            params = SamplingParams(max_tokens=50)
            both = await loop.add_requests(
                [
                    EngineRequest("a", ProcessedPrompt([120]), params),
                    EngineRequest("b", ProcessedPrompt([121]), params),
                ]
            )
            one = await loop.add_requests([EngineRequest("c", ProcessedPrompt([122]), params)])
            assert loop.num_streams == 3
            loop.fail_streams(EngineDeadError("going away"))
            assert loop.num_streams == 0
            for stream in (both, one):
                with pytest.raises(EngineDeadError, match="going away"):
                    while True:
                        await stream.get()
            await loop.call(lambda e: None)  # the aborts ran before this command
            assert engine.num_aborted == 3
            engine.release()
            served = await loop.add_requests(
                [EngineRequest("d", ProcessedPrompt([119]), SamplingParams(max_tokens=2))]
            )
            while not served.finished:
                await served.get()  # the engine goes on serving
        finally:
            loop.stop()

    asyncio.run(main())


def test_engine_loop_applies_the_aborts_of_fail_streams_even_if_stopped_at_once():
    async def main():
        engine = FakeEngine()
        engine.hold(after_tokens=1)
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        await loop.add_requests(
            [EngineRequest("a", ProcessedPrompt([120]), SamplingParams(max_tokens=50))]
        )
        loop.fail_streams(EngineDeadError("going away"))
        loop.stop()
        return engine

    engine = asyncio.run(main())
    assert engine.num_aborted == 1 and engine.running == engine.waiting == []


class _HangingDispatcher:
    """A cluster whose replicas accept requests and never answer; records the closed ones."""

    is_alive = True

    def __init__(self) -> None:
        self.closed: list[str] = []

    def submit(self, request: ClusterRequest):
        async def outputs():
            try:
                yield None  # accepted
                await asyncio.Event().wait()
            finally:
                self.closed.append(request.request_id)

        return outputs()

    async def broadcast(self, fn):
        return []


def test_cluster_engine_loop_fail_streams():
    async def main():
        dispatcher = _HangingDispatcher()
        loop = ClusterEngineLoop(dispatcher, FakeEngine().input_processor)
        loop.start(asyncio.get_running_loop())
        params = SamplingParams(max_tokens=5)
        stream = await loop.add_requests(
            [
                EngineRequest("a", ProcessedPrompt([120]), params),
                EngineRequest("b", ProcessedPrompt([121]), params),
            ]
        )
        await asyncio.sleep(0)  # the pumps start
        assert loop.num_streams == 2
        loop.fail_streams(EngineDeadError("going away"))
        with pytest.raises(EngineDeadError, match="going away"):
            await stream.get()
        while len(dispatcher.closed) < 2:  # the cancelled pumps close the replicas' streams
            await asyncio.sleep(0.01)
        assert sorted(dispatcher.closed) == ["a", "b"] and loop.num_streams == 0
        loop.stop()

    asyncio.run(main())


# ---- a real SIGTERM ----------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_to_pagedkv_serve_ends_open_streams_cleanly():
    args = ["--dtype", "float32", "--max-model-len", "2048", "--disable-log-stats"]
    with start_serve_process([*args, "--shutdown-timeout", "0"]) as served:
        body = {
            "prompt": "Count to a thousand:",
            "max_tokens": 1900,  # far longer than the test: the stream is open at SIGTERM
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        events = []
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: ") :])
                if len(events) == 1:
                    served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(timeout=120) == 0
        output = "".join(served.output)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == SHUTTING_DOWN
    assert "failing the requests still running (1, --shutdown-timeout 0 s)" in output
    assert "Traceback" not in output and "CancelledError" not in output
