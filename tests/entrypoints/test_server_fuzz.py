"""Schema fuzzing of the HTTP API with schemathesis, against the app's own OpenAPI schema.

A real uvicorn server on a free loopback port; schemathesis generates requests from
``/openapi.json`` for every route, both valid ones (positive) and ones that break the schema
(negative: wrong types, missing fields, values out of range...), 150 in all, derandomized
(the same requests every run). max_tokens and n are capped so that the run stays short.

Checked: no 5xx at all (the documented 5xx, 500 for a request that fails inside an engine step and
503 once the engine has stopped, cannot happen to a healthy engine); every 4xx carries an OpenAI
error body with a message; /health is 200 afterwards and every KV block is free.

Against the fake engine (fast, in every run) and the real default model (slow; fewer requests).

And schemathesis' own run (``st run --checks all``, every check it has: status codes, media
types, response bodies and headers, valid data accepted, invalid data refused, 405 and Allow...)
against the fake engine, derandomized with a fixed budget: the OpenAPI schema must say what the
app does (_openapi_fuzz.py has its one configuration; benchmarks/fuzz_openapi.py runs it longer).
"""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest
from _openapi_fuzz import config_text, fuzz_fake_engine, run_schemathesis
from _server_fakes import FakeEngine
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")  # schemathesis's HTTP client

from pagedkv.engine.engine_loop import EngineLoop  # noqa: E402
from pagedkv.entrypoints.openai.app import create_app  # noqa: E402
from pagedkv.entrypoints.openai.launch import ThreadedServer  # noqa: E402
from pagedkv.entrypoints.openai.server_options import ServerOptions  # noqa: E402

MODEL = "fuzz-model"
MAX_TOKENS = 3
MAX_N = 2


def cap(case) -> None:
    """Keep generation short: max_tokens and n capped, chat without a limit given one."""
    body = case.body
    if not isinstance(body, dict):
        return
    limited = False
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if type(value) is int and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
        limited = limited or type(body.get(key)) is int
    if not limited and "messages" in body:
        body["max_tokens"] = MAX_TOKENS
    if not limited and "input" in body:  # /v1/responses
        body["max_output_tokens"] = MAX_TOKENS
    if type(body.get("n")) is int and body["n"] > MAX_N:
        body["n"] = MAX_N


def operations_strategy(schema) -> st.SearchStrategy:
    """Cases of every operation, valid and invalid; the two completion routes weigh most."""
    strategies = []
    for result in schema.get_all_operations():
        operation = result.ok()
        weight = 6 if operation.method.upper() == "POST" and "completions" in operation.path else 1
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            strategies += [operation.as_strategy(generation_mode=mode)] * weight
    return st.one_of(strategies)


def wait_until_idle(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        lines = httpx.get(url + "/metrics").text.splitlines()
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in lines
            if line.startswith(
                (
                    "pagedkv:num_requests_running",
                    "pagedkv:num_requests_waiting",
                    "pagedkv:kv_cache_used_blocks",
                )
            )
        }
        if len(values) == 3 and not any(values.values()):
            return
        assert time.monotonic() < deadline, values
        time.sleep(0.05)


def fuzz(url: str, max_examples: int) -> Counter:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    statuses: Counter = Counter()
    session = requests.Session()

    # No shrinking: a failing request is reported as generated (each retry of a slow request
    # would cost a timeout), and the same requests are generated on every run.
    @settings(
        max_examples=max_examples,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operations_strategy(schema))
    def run(case):
        cap(case)
        response = case.call(base_url=url, session=session, timeout=300)
        statuses[response.status_code] += 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"], response.text

    run()
    return statuses


def check_fuzzed(url: str, statuses: Counter) -> None:
    # Both kinds of request reached the server: accepted ones and refused ones.
    assert statuses[200] > 0 and statuses[400] > 0, statuses
    assert httpx.get(url + "/health").status_code == 200
    wait_until_idle(url)


def test_fuzzed_api_against_the_fake_engine():
    engine = FakeEngine(num_blocks=512, block_size=4, max_model_len=256, max_num_seqs=64)
    app = create_app(EngineLoop(engine), model_name=MODEL)
    with ThreadedServer(app) as server:
        statuses = fuzz(server.url, max_examples=150)
        check_fuzzed(server.url, statuses)
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.slow  # over a thousand requests
def test_schemathesis_with_every_check_finds_nothing(tmp_path):
    engine = fuzz_fake_engine(max_model_len=256)
    admin = ServerOptions(enable_admin_routes=True)  # /reset_prefix_cache is fuzzed too
    with ThreadedServer(create_app(EngineLoop(engine), model_name=MODEL, options=admin)) as server:
        # 100 cases per operation and phase: over a thousand requests in all (benchmarks/
        # fuzz_openapi.py runs longer budgets and other seeds).
        result = run_schemathesis(server.url, tmp_path, max_examples=100, timeout=900)
        assert result.num_failures == 0 and not result.errors, result.output[-20000:]
        # Every operation was tested in every phase, over a thousand cases in all.
        assert result.report["operations"]["tested"] == 17, result.report["operations"]
        assert {p: v["status"] for p, v in result.report["phases"].items()} == {
            "examples": "skip",  # the schema has no examples
            "coverage": "success",
            "fuzzing": "success",
            "stateful": "success",
        }
        assert result.num_cases > 1000, result.summary()
        assert httpx.get(server.url + "/health").status_code == 200
        wait_until_idle(server.url)
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.slow
def test_schemathesis_on_the_embeddings_route_finds_nothing(tmp_path):
    """/v1/embeddings alone, every check, few cases (the run above covers it too, among all)."""
    engine = fuzz_fake_engine(max_model_len=256)
    with ThreadedServer(create_app(EngineLoop(engine), model_name=MODEL)) as server:
        result = run_schemathesis(
            server.url, tmp_path, max_examples=25, include_paths=("/v1/embeddings",), timeout=600
        )
        assert result.num_failures == 0 and not result.errors, result.output[-20000:]
        assert result.report["operations"]["tested"] == 1, result.report["operations"]
        assert result.report["phases"]["fuzzing"]["status"] == "success", result.summary()
        assert result.num_cases > 100, result.summary()
        wait_until_idle(server.url)
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.slow
def test_fuzzed_api_against_the_real_model(loaded_bf16):
    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine(loaded_model=loaded_bf16, max_model_len=256, max_num_seqs=16)
    app = create_app(EngineLoop(engine), model_name=MODEL)
    with ThreadedServer(app) as server:
        statuses = fuzz(server.url, max_examples=75)
        check_fuzzed(server.url, statuses)
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == engine.kv_cache_config.num_blocks - 1


def test_a_seeded_fuzz_run_is_not_deterministic():
    """schemathesis ignores ``--seed`` in deterministic mode, so a seeded run (fuzz_openapi.py
    --seed N) must turn it off, and an unseeded one keeps it (the same cases every run)."""
    schema = {"paths": {}}
    assert "deterministic = true" in config_text(schema).splitlines()
    assert "deterministic = true" not in config_text(schema, deterministic=False).splitlines()
