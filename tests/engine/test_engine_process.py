"""The engine in a process of its own (pagedkv.engine.engine_process): the same greedy tokens as
the engine stepped here, commands and their errors across the pipe, the KV view, a command that
does not pickle, an engine process that dies, and one that cannot build its engine. Each module
run spawns real engine processes with the default model (a few seconds each)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine_loop import EngineDeadError
from pagedkv.engine.engine_process import EngineProcessClient, EngineProcessError
from pagedkv.engine.input_processor import ProcessedPrompt
from pagedkv.engine.protocol import EngineRequest
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41, 42, 43])


@pytest.fixture(scope="module")
def config(gguf_path):
    return EngineConfig(
        model=str(gguf_path), dtype="float32", max_model_len=MAX_MODEL_LEN, num_threads=1
    )


def request(request_id: str, token_ids: list[int], max_tokens: int = 10) -> EngineRequest:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest(request_id, ProcessedPrompt(list(token_ids)), params)


async def collect(client: EngineProcessClient, requests: list[EngineRequest]) -> dict:
    stream = await client.add_requests(requests)
    tokens: dict[str, list[int]] = {}
    while not stream.finished:
        output, _ = await stream.get()
        tokens[output.request_id] = list(output.outputs[0].token_ids)
    return tokens


def run_on_loop(config, body, new_event_loop=asyncio.new_event_loop):
    """``await body(client)`` on a fresh event loop (``new_event_loop()``) with a launched
    engine process; the client is stopped after (the body may stop or kill it first)."""

    async def main():
        client = EngineProcessClient(config)
        client.launch()
        client.start(asyncio.get_running_loop())
        try:
            return await body(client)
        finally:
            client.stop(timeout=30)

    loop = new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_same_greedy_tokens_as_the_engine_here(config):
    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(
                f"r{i}", {"prompt_token_ids": list(prompt)}, request("x", prompt).sampling_params
            )
        expected: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                expected[output.request_id] = list(output.outputs[0].token_ids)
    finally:
        engine.shutdown()

    async def body(client):
        assert client.is_alive and client.status_reason == ""
        assert client.input_processor.max_model_len == MAX_MODEL_LEN
        got = await collect(client, [request(f"r{i}", p) for i, p in enumerate(PROMPTS)])
        assert client.num_streams == 0
        stats = await client.get_stats()
        snapshot = await client.get_kv_state()
        return got, stats, snapshot

    got, stats, snapshot = run_on_loop(config, body)
    assert got == expected
    assert all(len(t) == 10 for t in got.values())
    assert stats.scheduler.num_running == 0 and stats.scheduler.num_used_blocks == 0
    assert snapshot["block_size"] > 0 and snapshot["num_blocks"] > 0


def test_commands_and_their_errors_cross_the_pipe(config):
    async def body(client):
        too_long = request("long", list(range(1, MAX_MODEL_LEN + 10)))
        with pytest.raises(InvalidRequestError) as info:
            await client.add_requests([request("ok", [1, 2, 3]), too_long])
        assert client.num_streams == 0  # all or none: "ok" was aborted again
        with pytest.raises(EngineProcessError, match="does not pickle"):
            await client.call(lambda engine: engine.get_stats())
        assert await client.reset_prefix_cache() is True
        listener = client.listen_kv_states()
        first = await listener.get(timeout=30)  # a new listener gets one snapshot at once
        listener.close()
        tokens = await collect(client, [request("after", [5, 6, 7], max_tokens=3)])
        return info.value, first, tokens

    error, first, tokens = run_on_loop(config, body)
    assert error.param == "prompt", error  # the engine's error, its field kept across the pipe
    assert first is not None and first["num_blocks"] > 0
    assert len(tokens["after"]) == 3  # the engine serves on after a refused request


def test_an_engine_process_that_dies_fails_its_streams_and_health(config):
    async def body(client):
        stream = await client.add_requests([request("long", [1, 2, 3], max_tokens=200)])
        await stream.get()  # it is running
        os.kill(client._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            while True:
                await asyncio.wait_for(stream.get(), 30)
        deadline = time.monotonic() + 30
        while client.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not client.is_alive
        assert "engine process was killed by signal 9 (SIGKILL)" in client.status_reason
        client.abort(["long"])  # a no-op now, never an error
        with pytest.raises(EngineDeadError):
            await client.add_requests([request("new", [1, 2])])

    run_on_loop(config, body)


def test_an_engine_that_cannot_be_built_is_named_at_launch(config, tmp_path):
    import dataclasses

    missing = dataclasses.replace(config, model=str(tmp_path / "missing.gguf"))
    client = EngineProcessClient(missing)
    with pytest.raises(EngineProcessError, match="could not build the engine"):
        client.launch()
    assert not client.is_alive


# ---- what the review broke: uvloop's non-blocking pipe, unreadable commands and errors -------


def big_answer(size: int, engine) -> bytes:
    """A command whose answer is ``size`` bytes (module level: it pickles by name)."""
    return bytes(range(256)) * (size // 256)


class TwoArgError(Exception):
    """An exception whose class cannot be rebuilt from its ``args`` alone."""

    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def raise_two_arg_error(engine):
    raise TwoArgError(1, 2)


def test_large_answers_under_uvloop_and_unreadable_commands(config):
    import functools
    import sys
    import types

    uvloop = pytest.importorskip("uvloop")
    only_here = types.ModuleType("only_in_the_server_process")

    def local(engine):  # pickles by reference to a module the engine process cannot import
        return 1

    local.__module__ = only_here.__name__
    local.__qualname__ = "local"
    only_here.local = local
    sys.modules[only_here.__name__] = only_here

    async def body(client):
        for size in (20_000, 100_000, 4_000_000):  # over a pipe's buffer: read in pieces
            for _ in range(3):
                assert (
                    len(await client.call(functools.partial(big_answer, size))) == size - size % 256
                )
        with pytest.raises(EngineProcessError, match="cannot read the command"):
            await client.call(local)
        with pytest.raises(EngineProcessError, match="TwoArgError: 1 and 2"):
            await client.call(raise_two_arg_error)
        tokens = await collect(client, [request("after", [5, 6, 7], max_tokens=3)])
        assert client.is_alive
        return tokens

    try:
        tokens = run_on_loop(config, body, uvloop.new_event_loop)
    finally:
        del sys.modules[only_here.__name__]
    assert len(tokens["after"]) == 3


def test_commands_waiting_at_stop_are_answered(config):
    import functools

    async def body(client):
        # a 4 MB answer on its way as the server stops: read and dropped, never a block
        waiting = asyncio.ensure_future(client.call(functools.partial(_slow_big, 1.0)))
        await asyncio.sleep(0.2)
        process = client._process
        client.stop(timeout=30)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiting, 60)
        assert not client.is_alive
        assert process.exitcode == 0  # it stopped, it was not killed

    run_on_loop(config, body)


def _slow_big(seconds: float, engine) -> bytes:
    time.sleep(seconds)
    return bytes(4_000_000)
