"""The OpenAI-compatible server against a fake engine: a real uvicorn server on a free loopback
port, real clients (the official openai client, httpx). Fast and torch-free; the same server
on the real model is in test_server_model.py."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import openai
import pytest
from _server_fakes import SENTENCE, FakeEngine, wait_for

from pagedkv.engine.engine_loop import EngineLoop
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.launch import ThreadedServer
from pagedkv.entrypoints.openai.server_options import ServerOptions

MODEL = "fake-model"


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(num_blocks=512, block_size=4, max_model_len=256, max_num_seqs=64)


@pytest.fixture(scope="module")
def server(engine):
    options = ServerOptions(enable_admin_routes=True)  # POST /reset_prefix_cache
    app = create_app(EngineLoop(engine), model_name=MODEL, options=options)
    with ThreadedServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def expected_text(prompt_ids: list[int], num_tokens: int) -> str:
    """What the fake engine generates greedily for a prompt."""
    offset = sum(prompt_ids)
    return "".join(SENTENCE[(offset + i) % len(SENTENCE)] for i in range(num_tokens))


def chat_ids(engine, messages) -> list[int]:
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def metric_value(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_until_idle(server, timeout: float = 60.0) -> str:
    """Poll /metrics until no request runs or waits and no KV block is used (the timeout only
    bounds a hung server)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(server.url + "/metrics").text
        busy = (
            metric_value(text, "pagedkv:num_requests_running"),
            metric_value(text, "pagedkv:num_requests_waiting"),
            metric_value(text, "pagedkv:kv_cache_usage_perc"),
        )
        if busy == (0.0, 0.0, 0.0):
            return text
        assert time.monotonic() < deadline, f"still busy: {busy}"
        time.sleep(0.02)


# ---- happy paths with the official client -----------------------------------------------------


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion(client, engine):
    result = client.completions.create(model=MODEL, prompt="Hello", max_tokens=7, temperature=0)
    assert result.object == "text_completion"
    assert result.choices[0].text == expected_text(engine.tokenizer.encode("Hello"), 7)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == 5
    assert result.usage.completion_tokens == 7
    assert result.usage.total_tokens == 12


def test_completion_batch_of_prompts(client, engine):
    result = client.completions.create(
        model=MODEL, prompt=["ab", "xyz"], max_tokens=3, temperature=0, n=2
    )
    texts = [c.text for c in sorted(result.choices, key=lambda c: c.index)]
    first, second = (expected_text(engine.tokenizer.encode(p), 3) for p in ("ab", "xyz"))
    assert texts == [first, first, second, second]
    assert result.usage.prompt_tokens == 5  # each prompt once, whatever n is
    assert result.usage.completion_tokens == 12


def test_chat(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    result = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=9, temperature=0
    )
    ids = chat_ids(engine, messages)
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected_text(ids, 9)
    assert result.usage.prompt_tokens == len(ids)
    assert result.usage.completion_tokens == 9


def test_base_model_refuses_chat_and_serves_completions():
    """A model without a chat template (Gemma 3 270M, a base model): chat requests get a 400
    naming /v1/completions before anything is queued; completions are served."""
    engine = FakeEngine()
    engine.tokenizer.has_chat_template = False
    app = create_app(EngineLoop(engine), model_name=MODEL)
    with ThreadedServer(app) as running:
        chat = httpx.post(
            running.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
        )
        completion = httpx.post(
            running.url + "/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0},
        )
    assert chat.status_code == 400
    error = chat.json()["error"]
    assert "no chat template" in error["message"] and "/v1/completions" in error["message"]
    assert (error["param"], error["code"]) == ("messages", "no_chat_template")
    assert engine.added == [] or all(r[0].startswith("cmpl") for r in engine.added)
    assert completion.status_code == 200
    assert completion.json()["choices"][0]["text"] == expected_text(
        engine.tokenizer.encode("Hi"), 3
    )


def test_chat_without_max_tokens_runs_to_max_model_len(client, engine):
    messages = [{"role": "user", "content": "x" * 100}]
    result = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    num_prompt = len(chat_ids(engine, messages))
    assert result.usage.completion_tokens == engine.max_model_len - num_prompt
    assert result.choices[0].finish_reason == "length"


def test_streaming_chat(client, engine):
    messages = [{"role": "user", "content": "Stream please"}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected_text(chat_ids(engine, messages), 12)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_streaming_completion_without_usage(client, engine):
    stream = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=5, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected_text([97, 98, 99], 5)
    assert all(c.usage is None for c in chunks)


def test_sse_wire_format(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event[len("data: ") :])["object"] == "text_completion"


def test_n2_with_seed(client):
    messages = [{"role": "user", "content": "Two please"}]
    result = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, n=2, seed=3
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    texts = [c.message.content for c in sorted(result.choices, key=lambda c: c.index)]
    assert texts == [SENTENCE[3:11], SENTENCE[4:12]]  # seed + sample index
    again = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, n=2, seed=3
    )
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == texts
    assert result.usage.completion_tokens == 16


def test_streaming_n2(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=6,
        n=2,
        seed=0,
        stream=True,
    )
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == {0: SENTENCE[0:6], 1: SENTENCE[1:7]}
    assert finished == {0, 1}


def test_stop_strings(client):
    # seed 0 spells "the quick brown fox"; stop before "brown", and at "ck" (a two-char stop).
    result = client.completions.create(
        model=MODEL, prompt="s", max_tokens=30, seed=0, stop=["brown", "zz"]
    )
    assert result.choices[0].text == "the quick "
    assert result.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL, prompt="s", max_tokens=30, seed=0, stop="ck", stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == "the qui"


def test_cache_salt_and_params_reach_the_engine(client, engine):
    client.completions.create(
        model=MODEL,
        prompt="salted",
        max_tokens=2,
        temperature=0.5,
        top_p=0.9,
        extra_body={"cache_salt": "tenant-a", "top_k": 5},
    )
    _, prompt, params, cache_salt = engine.added[-1]
    assert prompt["prompt"] == "salted" and cache_salt == "tenant-a"
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.9, 5, 2)


# ---- health, metrics, prefix cache reset --------------------------------------------------------


def test_health(server):
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics(server, client):
    before = httpx.get(server.url + "/metrics").text
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=4, temperature=0)
    text = wait_until_idle(server)
    assert (
        metric_value(text, "pagedkv:generation_tokens_total")
        - metric_value(before, "pagedkv:generation_tokens_total")
    ) == 4
    assert (
        metric_value(text, "pagedkv:prompt_tokens_total")
        - metric_value(before, "pagedkv:prompt_tokens_total")
    ) == 7
    for name in (
        "pagedkv:time_to_first_token_seconds_count",
        "pagedkv:inter_token_latency_seconds_count",
        "pagedkv:prefix_cache_queries_total",
        "pagedkv:prefix_cache_hits_total",
        "pagedkv:num_preemptions_total",
    ):
        metric_value(text, name)
    assert (
        metric_value(text, "pagedkv:inter_token_latency_seconds_count")
        - metric_value(before, "pagedkv:inter_token_latency_seconds_count")
    ) == 3
    assert metric_value(text, "pagedkv:request_success_total", 'finished_reason="length"') >= 1


def test_reset_prefix_cache(server):
    wait_until_idle(server)
    response = httpx.post(server.url + "/reset_prefix_cache")
    assert response.status_code == 200 and response.json() == {"success": True}


# ---- abort on disconnect, under concurrency -----------------------------------------------------


async def _stream_chat(base_url: str, i: int, disconnect_after: int | None) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"client {i}"}],
        "max_tokens": 60,
        "stream": True,
        "temperature": 0,
    }
    text = ""
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        num_events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            num_events += 1
            delta = json.loads(line[6:])["choices"][0]["delta"]
            text += delta.get("content") or ""
            if disconnect_after is not None and num_events >= disconnect_after:
                return text  # leaving the block closes the connection mid-stream
    return text


def test_32_concurrent_streams_some_disconnecting(server, client, engine):
    # Every request stops at 40 of its 60 tokens until the 11 clients that leave after at most
    # 33 events have been seen to leave (their requests aborted): the test decides, not the
    # relative speed of the engine thread and the server.
    num_aborted = engine.num_aborted

    async def run_all():
        tasks = [
            asyncio.ensure_future(_stream_chat(server.url, i, 3 + i if i % 3 == 0 else None))
            for i in range(32)
        ]
        await asyncio.gather(*tasks[::3])
        await asyncio.to_thread(
            wait_for, lambda: engine.num_aborted == num_aborted + 11, "11 aborts"
        )
        engine.release()
        return await asyncio.gather(*tasks)

    engine.hold(after_tokens=40)
    try:
        texts = asyncio.run(run_all())
    finally:
        engine.release()
    for i, text in enumerate(texts):
        ids = chat_ids(engine, [{"role": "user", "content": f"client {i}"}])
        full = expected_text(ids, 60)
        if i % 3 == 0:
            assert full.startswith(text) and len(text) < len(full)
        else:
            assert text == full
    wait_until_idle(server)  # every block free again: the disconnected requests were aborted
    assert server.server.config.app.state.engine_client.num_streams == 0
    text = httpx.get(server.url + "/metrics").text
    assert metric_value(text, "pagedkv:request_success_total", 'finished_reason="abort"') >= 11
    result = client.completions.create(model=MODEL, prompt="still there?", max_tokens=2)
    assert result.usage.completion_tokens == 2


def test_non_streaming_client_disconnect_aborts(server, engine):
    num_aborted = engine.num_aborted
    body = json.dumps({"model": MODEL, "prompt": "slow", "max_tokens": 250}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    engine.hold(after_tokens=5)  # it cannot finish before the client leaves
    try:
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(head + body)
            wait_for(
                lambda: engine.added and engine.added[-1][1]["prompt"] == "slow", "the request"
            )
        # The connection is closed: the client left without reading its answer.
        wait_for(lambda: engine.num_aborted == num_aborted + 1, "the abort")
    finally:
        engine.release()
    wait_until_idle(server)


def test_reset_prefix_cache_fails_while_blocks_are_in_use(server, engine):
    body = {"model": MODEL, "prompt": "busy", "max_tokens": 200, "stream": True}
    engine.hold(after_tokens=1)  # it keeps its blocks until released
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()  # (dropping the iterator would close the connection)
            next(lines)  # the request is running now
            busy = httpx.post(server.url + "/reset_prefix_cache")
    finally:
        engine.release()
    assert busy.status_code == 409 and busy.json() == {"success": False}
    wait_until_idle(server)
    assert httpx.post(server.url + "/reset_prefix_cache").json() == {"success": True}


def test_engine_failure_is_reported_and_health_turns_503():
    engine = FakeEngine()
    engine.fail_after_steps = 2
    app = create_app(EngineLoop(engine), model_name=MODEL)
    with ThreadedServer(app) as broken:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}
        with httpx.stream("POST", broken.url + "/v1/completions", json=body) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert "the fake engine broke" in json.loads(events[-2][6:])["error"]["message"]
        assert httpx.get(broken.url + "/health").status_code == 503
        response = httpx.post(broken.url + "/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503
        assert "not running" in response.json()["error"]["message"]


# ---- bad input: OpenAI error body, 4xx, and the server keeps serving ---------------------------


BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "fake-model", "prompt": ', 400, "malformed JSON"),
    ("/v1/completions", {"model": MODEL}, 400, "missing required field `prompt`"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "missing required field `messages`"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/completions", {"prompt": "x" * 300}, 400, "max_model_len"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x" * 300}]},
        400,
        "max_model_len",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x" * 100}], "max_tokens": 200},
        400,
        "max_model_len",
    ),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "`gpt-4` does not exist"),
    (
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        404,
        "does not exist",
    ),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n: "),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n: "),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": 10**23}, 400, "seed"),
    ("/v1/nothing", {}, 404, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "status", "message"), BAD_REQUESTS)
def test_bad_input(server, path, body, status, message):
    if isinstance(body, bytes):
        response = httpx.post(
            server.url + path, content=body, headers={"content-type": "application/json"}
        )
    else:
        response = httpx.post(server.url + path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200


def test_bad_input_through_the_openai_client(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=3
        )
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).choices


# ---- the `pagedkv serve` command line ---------------------------------------------------------


def test_serve_cli_arguments():
    from pagedkv.entrypoints.cli import build_parser
    from pagedkv.modelinfo.naming import served_model_name

    args = build_parser().parse_args(["serve", "--port", "0", "--max-num-seqs", "8"])
    assert (args.host, args.port, args.max_num_seqs) == ("127.0.0.1", 0, 8)
    assert served_model_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert served_model_name("/models/Qwen2-0.5B") == "Qwen2-0.5B"


# ---- the engine loop on its own -----------------------------------------------------------------


def test_engine_loop_aborts_an_add_cancelled_while_queued():
    from pagedkv.engine.engine_loop import EngineLoop, EngineRequest
    from pagedkv.engine.input_processor import ProcessedPrompt
    from pagedkv.sampling_params import SamplingParams

    async def main():
        engine = FakeEngine()
        engine.hold(after_tokens=1, request_ids={"late"})  # "late" cannot finish before its abort
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        try:
            busy = await loop.add_requests(
                [EngineRequest("busy", ProcessedPrompt([120]), SamplingParams(max_tokens=3))]
            )
            late = asyncio.ensure_future(
                loop.add_requests(
                    [EngineRequest("late", ProcessedPrompt([121]), SamplingParams(max_tokens=100))]
                )
            )
            await asyncio.sleep(0)  # its add command is queued
            late.cancel()
            while not busy.finished:
                await busy.get()
            while await loop.call(lambda e: e.has_unfinished_requests()):
                await asyncio.sleep(0.01)
            assert [r[0] for r in engine.added] == ["busy", "late"]
            assert engine.num_aborted == 1 and loop.num_streams == 0
        finally:
            loop.stop()

    asyncio.run(main())


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        (
            "/v1/completions",
            {"prompt": 123},
            "prompt",
            "prompt: must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists (got 123)",
        ),
        ("/v1/completions", {"prompt": [5, -1]}, "prompt", "prompt.1: Input should be greater"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 7}]},
            "messages",
            "messages.0.content: must be a string or a list of text content parts (got 7)",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "stop": 5},
            "stop",
            "stop: must be a string or a list of strings (got 5)",
        ),
    ],
)
def test_union_field_errors_name_the_field_not_the_validator(server, path, body, param, message):
    """A value that fits no member of a union field gets one message saying what the field
    accepts, without pydantic's member tags; a member that fitted in shape gives its own error."""
    response = httpx.post(server.url + path, json={"model": MODEL, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith(message)
    assert "function-after" not in error["message"] and error["param"] == param
