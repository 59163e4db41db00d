"""One bad request never stops the server (fake engine, real uvicorn on a free loopback port).

(1) Values the engine cannot represent are refused at the boundary with a 400 naming the field,
before anything is queued; (2) a request that still fails inside a step gets a 500 (or an error
event mid-stream) while the others are served and /health stays 200; (3) only engine faults
(out of memory, a model that fails its probe too) stop the engine, and /health says why.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from _server_fakes import FAIL_MARKER, FakeEngine

from pagedkv.engine import engine_loop
from pagedkv.engine.engine_loop import EngineLoop
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.launch import ThreadedServer
from pagedkv.errors import CacheStateError

MODEL = "fake-model"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(num_blocks=512, block_size=4, max_model_len=256, max_num_seqs=64)


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(EngineLoop(engine), model_name=MODEL)
    with ThreadedServer(app) as running:
        yield running


def post(server, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        return httpx.post(server.url + path, content=body, headers=headers, timeout=30)
    return httpx.post(server.url + path, json=body, timeout=30)


def assert_serving(server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    ok = post(server, COMPLETIONS, {"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text


def chat(content: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}


# ---- (1) the boundary ----------------------------------------------------------------------

#: (path, body, the field the 400 must name). Raw bytes carry what json= cannot (NaN, surrogates).
BOUNDARY = [
    # The input: it used to answer 500, then 503 forever.
    (
        COMPLETIONS,
        {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_k": 9223372036854775808},
        "top_k",
    ),
    (CHAT, chat("Hi", top_k=2**63), "top_k"),
    (COMPLETIONS, {"prompt": "Hi", "top_k": -2}, "top_k"),
    (COMPLETIONS, {"prompt": "Hi", "seed": 2**64}, "seed"),
    (COMPLETIONS, {"prompt": "Hi", "seed": -(2**63) - 1}, "seed"),
    (COMPLETIONS, {"prompt": "Hi", "seed": 2**64 - 1, "n": 2}, "seed"),  # seed + 1 overflows
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2**63}, "max_tokens"),
    (CHAT, chat("Hi", max_completion_tokens=2**63), "max_completion_tokens"),
    (COMPLETIONS, {"prompt": [2**63]}, "prompt"),
    (COMPLETIONS, {"prompt": [[5, -1]]}, "prompt"),
    (COMPLETIONS, {"prompt": [[5], []]}, "prompt"),
    (COMPLETIONS, b'{"prompt": "Hi", "temperature": NaN}', "temperature"),
    (COMPLETIONS, b'{"prompt": "Hi", "top_p": Infinity}', "top_p"),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 1e-45}, "top_p"),  # 0 in float32
    (COMPLETIONS, b'{"prompt": "\\ud800 lone surrogate"}', "prompt"),
    (COMPLETIONS, b'{"prompt": ["ok", "\\udfff"]}', "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages"),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        "messages",
    ),
    (COMPLETIONS, b'{"prompt": "Hi", "stop": ["\\udc00"]}', "stop"),
    (COMPLETIONS, b'{"prompt": "Hi", "cache_salt": "\\ud800"}', "cache_salt"),
    (COMPLETIONS, b'{"prompt": "Hi", "user": "\\ud800"}', "user"),
    (COMPLETIONS, b'{"prompt": "Hi", "model": "\\ud800"}', "model"),
]


@pytest.mark.parametrize(("path", "body", "param"), BOUNDARY)
def test_unrepresentable_values_are_a_400_naming_the_field(server, engine, path, body, param):
    num_added = len(engine.added)
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert len(engine.added) == num_added  # nothing was queued
    assert_serving(server)


# ---- (2) a fault inside a step fails only its requests ---------------------------------------


def test_a_request_failing_inside_a_step_gets_a_500_and_the_others_are_served(server, engine):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            good = [
                client.post(
                    COMPLETIONS, json={"prompt": f"good {i}", "max_tokens": 30, "temperature": 0}
                )
                for i in range(4)
            ]
            bad = client.post(COMPLETIONS, json={"prompt": f"x {FAIL_MARKER}", "max_tokens": 5})
            return await asyncio.gather(bad, *good)

    num_failed = engine.num_failed_steps
    bad, *good = asyncio.run(main())
    assert bad.status_code == 500
    error = bad.json()["error"]
    assert error["type"] == "internal_server_error" and error["code"] == "engine_error"
    assert "fake step failure" in error["message"]
    assert [r.status_code for r in good] == [200] * 4
    assert engine.num_failed_steps == num_failed + 1
    assert_serving(server)
    # Chat and n > 1: every sample of the failed request is failed, one 500.
    response = post(server, CHAT, chat(FAIL_MARKER, n=3))
    assert response.status_code == 500 and "fake step failure" in response.text
    assert_serving(server)


def test_a_streamed_request_failing_inside_a_step_ends_with_an_error_event(server):
    for path, body in (
        (COMPLETIONS, {"prompt": FAIL_MARKER, "max_tokens": 5, "stream": True}),
        (CHAT, {**chat(FAIL_MARKER), "stream": True}),
    ):
        with httpx.stream("POST", server.url + path, json=body, timeout=30) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "internal_server_error" and "fake step failure" in error["message"]
    assert_serving(server)


def test_every_block_is_free_after_the_faults(server, engine):
    assert_serving(server)
    text = httpx.get(server.url + "/metrics").text
    assert "pagedkv:kv_cache_used_blocks" in text
    for _ in range(500):  # the last aborts are applied between two steps
        if engine.num_used_blocks == 0:
            break
        time.sleep(0.01)
    assert engine.num_used_blocks == 0


# ---- (3) engine faults stop it, and /health says why -------------------------------------------


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (lambda e: setattr(e, "fail_with", MemoryError("cannot allocate 2 GiB")), "MemoryError"),
        (lambda e: setattr(e, "fail_with", CacheStateError("free count 3 != 4")), "CacheState"),
        (lambda e: setattr(e, "fail_after_steps", 1), "fails even with no client request"),
    ],
)
def test_engine_faults_stop_the_engine_and_health_says_why(setup, reason):
    engine = FakeEngine()
    app = create_app(EngineLoop(engine), model_name=MODEL)
    with ThreadedServer(app) as broken:
        setup(engine)
        response = post(broken, COMPLETIONS, {"prompt": "x", "max_tokens": 20})
        assert response.status_code == 503
        health = httpx.get(broken.url + "/health")
        assert health.status_code == 503
        assert reason in health.json()["error"]["message"]
        again = post(broken, COMPLETIONS, {"prompt": "x"})
        assert again.status_code == 503 and reason in again.json()["error"]["message"]


class _Probe:
    def __init__(self, healthy: bool) -> None:
        self.healthy = healthy

    def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError("probe failed")


def test_engine_fault_classification():
    fault = engine_loop.engine_fault
    healthy, sick = _Probe(True), _Probe(False)
    assert fault(healthy, RuntimeError("Overflow when unpacking long long"), 1) is None
    assert fault(healthy, ValueError("bad row"), 1) is None
    assert fault(object(), ValueError("no probe: a request's fault"), 1) is None
    assert "MemoryError" in fault(healthy, MemoryError(), 1)

    class OutOfMemoryError(RuntimeError):  # torch's, matched by name
        pass

    assert "OutOfMemoryError" in fault(healthy, OutOfMemoryError("CUDA out of memory"), 1)
    assert "CacheStateError" in fault(healthy, CacheStateError("a block is queued twice"), 1)
    assert "probe failed" in fault(sick, RuntimeError("step"), 1)
    limit = engine_loop.MAX_CONSECUTIVE_FAILED_STEPS
    assert fault(healthy, RuntimeError("x"), limit - 1) is None
    assert "in a row" in fault(healthy, RuntimeError("x"), limit)
