"""The OpenAI-compatible server on the real default model (SmolLM2-135M, fp32): one uvicorn
server on a free loopback port for the whole module, real clients, short outputs.

Greedy outputs through the server must equal ``LLM.generate`` / ``LLM.chat`` on the same weights
(the two engines share one loaded model)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from _server_fakes import wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_MODEL_LEN = 512
MAX_TOKENS = 12

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Paging in operating systems means",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colours."},
    ],
]


@pytest.fixture(scope="module")
def loaded_model(loaded_fp32):
    """The session's fp32 default model (tests/conftest.py; skips when it is not installed)."""
    return loaded_fp32


@pytest.fixture(scope="module")
def llm(loaded_model):
    from pagedkv.engine.llm import LLM

    return LLM(
        dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32, loaded_model=loaded_model
    )


@pytest.fixture(scope="module")
def engine(loaded_model):
    from pagedkv.engine.llm_engine import LLMEngine

    return LLMEngine(  # blocks of 16: the cache-salt prompt spans several (auto's backend)
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=32,
        block_size=16,
        loaded_model=loaded_model,
    )


@pytest.fixture(scope="module")
def server(engine):
    from pagedkv.engine.engine_loop import EngineLoop
    from pagedkv.entrypoints.openai.app import create_app
    from pagedkv.entrypoints.openai.launch import ThreadedServer

    app = create_app(EngineLoop(engine), model_name=MODEL)
    with ThreadedServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def greedy(max_tokens: int = MAX_TOKENS):
    from pagedkv.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens)


def wait_until_idle(server, engine, timeout: float = 30.0) -> None:
    """Until no request is left in the engine and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(server.url + "/metrics").text
        lines = [line for line in text.splitlines() if not line.startswith("#")]
        busy = [
            line
            for line in lines
            if line.startswith(
                (
                    "pagedkv:num_requests_running",
                    "pagedkv:num_requests_waiting",
                    "pagedkv:kv_cache_usage_perc",
                )
            )
        ]
        if len(busy) == 3 and all(line.endswith(" 0.0") for line in busy):
            break
        assert time.monotonic() < deadline, busy
        time.sleep(0.05)
    # The engine thread is idle now, so reading the pool from here is safe.
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == engine.kv_cache_config.num_blocks - 1  # all but the null


def test_completions_equal_llm_generate(client, llm):
    expected = [out.text for out in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    got = []
    for prompt in PROMPTS:
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        got.append(result.choices[0].text)
        assert result.usage.completion_tokens <= MAX_TOKENS
    assert got == expected
    batch = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0
    )
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected


def test_chat_and_streaming_chat_equal_llm_chat(client, llm):
    expected = [out.text for out in llm.chat(CHATS, greedy(), use_tqdm=False)]
    for messages, text in zip(CHATS, expected, strict=True):
        result = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert result.choices[0].message.content == text
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens == result.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == result.usage.prompt_tokens


def test_logprobs_through_the_openai_client_equal_the_offline_ones(client, llm):
    from pagedkv.sampling_params import SamplingParams

    prompt = PROMPTS[2]
    # echo + max_tokens 0: the prompt's logprobs, as evaluation harnesses ask for them.
    offline = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )[0]
    ids = offline.prompt_token_ids
    result = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2
    )
    (choice,) = result.choices
    assert choice.text == prompt and result.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None
    want = [offline.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert "".join(choice.logprobs.tokens) == prompt
    # Chat: logprobs + top_logprobs of the sampled tokens, streamed and not.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3)
    sample = llm.chat(CHATS[0], params, use_tqdm=False)[0].outputs[0]
    want = [p[t].logprob for p, t in zip(sample.logprobs, sample.token_ids, strict=True)]
    kwargs = dict(
        model=MODEL, messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=True
    )
    reply = client.chat.completions.create(**kwargs, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(want, abs=1e-4)
    assert all(len(c.top_logprobs) == 3 for c in content)
    # The EOS token has a logprob too (its text is left out of the content).
    assert "".join(c.token for c in content).startswith(reply.choices[0].message.content)
    chunks = list(client.chat.completions.create(**kwargs, top_logprobs=3, stream=True))
    streamed = [
        c.logprob
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for c in ch.choices[0].logprobs.content
    ]
    assert streamed == pytest.approx(want, abs=1e-4)


def test_n2_and_seed(client):
    messages = [{"role": "user", "content": "Write a word."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=8, n=2, temperature=1.0, seed=7)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1]
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == texts
    assert first.usage.completion_tokens > 0


def test_best_of_returns_the_best_of_its_samples(client, llm, server):
    """best_of=3, n=1 through the API equals the offline engine's best_of (forked samples,
    ranked by cumulative logprob); with stream it is a 400 naming best_of."""
    from pagedkv.sampling_params import SamplingParams

    prompt = "Write one sentence about the sea."
    kwargs = {"temperature": 1.0, "seed": 4, "max_tokens": MAX_TOKENS}
    reply = client.completions.create(
        model=MODEL, prompt=prompt, n=1, extra_body={"best_of": 3}, **kwargs
    )
    (offline,) = llm.generate(prompt, SamplingParams(n=1, best_of=3, **kwargs), use_tqdm=False)
    assert [c.text for c in reply.choices] == [offline.outputs[0].text]
    streamed = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "best_of": 3, "stream": True, **kwargs},
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "best_of"


def test_stop_string(client, llm):
    prompt = PROMPTS[2]
    full = llm.generate([prompt], greedy(), use_tqdm=False)[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    result = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert result.choices[0].text == full[: full.index(stop)]
    assert result.choices[0].finish_reason == "stop"


def test_cache_salt_isolates_the_prefix_cache(client):
    prompt = "A block is sixteen tokens. " * 6  # several full blocks

    def cached(salt):
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt}
        )
        return result.usage.prompt_tokens_details.cached_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 0  # same salt: the prompt's blocks are hits
    assert cached("tenant-b") == 0  # another tenant never sees them


def test_prompt_longer_than_max_model_len(server):
    response = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "word " * 600, "max_tokens": 4},
    )
    assert response.status_code == 400
    assert "max_model_len" in response.json()["error"]["message"]


async def _stream(base_url: str, i: int, disconnect_after: int | None) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    num_deltas = 0
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                num_deltas += bool(choices and choices[0]["delta"].get("content"))
                if disconnect_after is not None and num_deltas >= disconnect_after:
                    return num_deltas  # closes the connection mid-stream
    return num_deltas


class StepGate:
    """Stands in for ``engine.step`` (the engine thread calls it) so that the test, not the
    machine's speed, decides when requests finish: no step until ``num_requests`` requests are
    in, then steps until each has ``num_tokens`` output tokens, then none until
    ``released`` is set. A held call returns no outputs after a 10 ms wait, so the engine loop
    still runs aborts between calls."""

    def __init__(self, engine, num_requests: int, num_tokens: int) -> None:
        self.engine, self.step = engine, engine.step
        self.num_requests, self.num_tokens = num_requests, num_tokens
        self.released = threading.Event()

    def __call__(self):
        requests = [r for r, _ in self.engine.scheduler.request_states()]
        if not self.released.is_set() and (
            len(requests) < self.num_requests
            or all(r.num_output_tokens >= self.num_tokens for r in requests)
        ):
            self.released.wait(0.01)
            return []
        return self.step()


def test_32_concurrent_streams_some_disconnecting(server, engine, client):
    # All 32 start together and stop at 8 of their 16 tokens until the 8 clients that leave
    # after 2 deltas have been seen to leave (their requests aborted in the scheduler).
    gate = StepGate(engine, num_requests=32, num_tokens=8)

    async def run_all():
        tasks = [
            asyncio.ensure_future(_stream(server.url, i, 2 if i % 4 == 0 else None))
            for i in range(32)
        ]
        await asyncio.gather(*tasks[::4])
        await asyncio.to_thread(
            wait_for, lambda: engine.scheduler.get_num_unfinished_requests() == 24, "8 aborts", 300
        )
        gate.released.set()
        return await asyncio.gather(*tasks)

    engine.step = gate  # the instance attribute shadows the method
    try:
        counts = asyncio.run(run_all())
    finally:
        gate.released.set()
        del engine.step
    assert all(c >= 2 for c in counts)
    wait_until_idle(server, engine)  # nothing leaked: every block is free again
    metrics = httpx.get(server.url + "/metrics").text
    assert 'finished_reason="abort"' in metrics
    result = client.completions.create(model=MODEL, prompt="Still here?", max_tokens=2)
    assert result.usage.completion_tokens == 2


# ---- one bad request never stops the server (issue 12) -----------------------------------------


def test_unrepresentable_values_are_400s_and_the_server_keeps_serving(server, engine, client):
    vocab = engine.model_config.vocab_size
    cases = [
        # The input: it answered 500 ("Overflow when unpacking long long"), then 503.
        (
            {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_k": 9223372036854775808},
            "top_k",
        ),
        ({"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_k": vocab + 1}, "top_k"),
        ({"prompt": [vocab], "max_tokens": 2}, "prompt"),
        ({"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"prompt": "Hi", "top_p": 1e-45, "max_tokens": 2}, "top_p"),
        ('{"prompt": "a surrogate \\ud800", "max_tokens": 2}', "prompt"),
        ('{"prompt": "Hi", "cache_salt": "\\udfff", "max_tokens": 2}', "cache_salt"),
    ]
    for body, param in cases:
        if isinstance(body, str):
            response = httpx.post(
                server.url + "/v1/completions",
                content=body.encode(),
                headers={"content-type": "application/json"},
            )
        else:
            response = httpx.post(server.url + "/v1/completions", json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param
        assert httpx.get(server.url + "/health").status_code == 200
    result = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=2, temperature=1, extra_body={"top_k": vocab}
    )
    assert result.usage.completion_tokens == 2
    wait_until_idle(server, engine)


def test_a_step_failing_for_one_request_fails_only_that_step(server, engine, client):
    """A fault injected into the model runner for one request (seed 4242): that request gets a
    500 with the engine's message; the probe finds the model healthy, the engine goes on."""
    runner = engine.runner
    execute_model = runner.execute_model

    def faulty(scheduler_output):
        new = scheduler_output.scheduled_new_reqs
        if any(r.sampling_params.seed == 4242 for r in new):
            raise RuntimeError("Overflow when unpacking long long (injected)")
        return execute_model(scheduler_output)

    runner.execute_model = faulty
    try:
        response = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": CHATS[0], "max_tokens": 4, "seed": 4242, "n": 2},
            timeout=60,
        )
        assert response.status_code == 500
        assert "injected" in response.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 200
        result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3)
        assert result.usage.completion_tokens == 3
    finally:
        runner.execute_model = execute_model
    wait_until_idle(server, engine)
