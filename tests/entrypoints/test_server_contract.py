"""The request contract of the server, on the tiny random model (fast): every field honoured or
refused with a 400 naming it, the rest in one warning line; each sampling field changes the output
exactly as the offline API does; logprobs, prompt logprobs and echo in the OpenAI shapes, streamed
and not; strict types; the vLLM routes; and docs/server.md's field table against the models."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx
import pytest
from _tiny_model import EOS, tiny_loaded_model

from pagedkv.engine.engine_loop import EngineLoop
from pagedkv.engine.llm import LLM
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.launch import ThreadedServer
from pagedkv.entrypoints.openai.protocol.requests import ChatCompletionRequest, CompletionRequest
from pagedkv.entrypoints.openai.protocol.responses_api import ResponsesRequest
from pagedkv.sampling_params import BeamSearchParams, SamplingParams

MODEL = "tiny"
PROMPT = "the quick brown fox jumps over the lazy dog. " * 2
MESSAGES = [{"role": "user", "content": "hi there"}]
DOCS = Path(__file__).parents[2] / "docs" / "server.md"
ENGINE_OPTIONS = {"num_blocks": 80, "max_model_len": 256, "block_size": 4, "num_threads": 1}


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(loaded_model=tiny, dtype="float32", **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def server(tiny):
    engine = LLMEngine(loaded_model=tiny, dtype="float32", **ENGINE_OPTIONS)
    with ThreadedServer(create_app(EngineLoop(engine), model_name=MODEL)) as running:
        yield running


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def complete(server, **fields) -> dict:
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def chat(server, **fields) -> dict:
    response = post(server, "/v1/chat/completions", {"messages": MESSAGES, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def events(server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response (the final ``[DONE]`` checked and dropped)."""
    response = post(server, path, {**body, "stream": True})
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- each sampling field: the output changes exactly as offline -------------------------------

FIELDS = [
    ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
    ({"frequency_penalty": 1.5}, {"frequency_penalty": 1.5}),
    ({"repetition_penalty": 3.0}, {"repetition_penalty": 3.0}),
    ({"logit_bias": {"90": 100}}, {"logit_bias": {90: 100.0}}),
    ({"logit_bias": {"6": -100, "56": -3}}, {"logit_bias": {6: -100.0, 56: -3.0}}),
    (
        {"min_tokens": 4, "ignore_eos": False, "logit_bias": {str(EOS): 100}},
        {"min_tokens": 4, "ignore_eos": False, "logit_bias": {EOS: 100.0}},
    ),
    (
        {"stop_token_ids": [65], "logit_bias": {"65": 100}, "min_tokens": 2},
        {"stop_token_ids": [65], "logit_bias": {65: 100.0}, "min_tokens": 2},
    ),
    (
        {"stop_token_ids": [65], "logit_bias": {"65": 100}, "include_stop_str_in_output": True},
        {"stop_token_ids": [65], "logit_bias": {65: 100.0}, "include_stop_str_in_output": True},
    ),
    ({"min_p": 0.3, "temperature": 1.0, "seed": 3}, {"min_p": 0.3, "temperature": 1.0, "seed": 3}),
]


@pytest.mark.parametrize(("http", "offline"), FIELDS)
def test_each_field_changes_the_output_as_offline(server, llm, http, offline):
    base = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    params = SamplingParams(**{**base, **offline})
    (expected,) = llm.generate(PROMPT, params, use_tqdm=False)
    (plain,) = llm.generate(
        PROMPT, SamplingParams(**{**base, **offline, **_neutral(offline)}), False
    )
    assert expected.text != plain.text or expected.token_ids != plain.token_ids
    (choice,) = complete(server, **{**base, **http})["choices"]
    assert choice["text"] == expected.text
    assert choice["finish_reason"] == expected.finish_reason
    assert choice["stop_reason"] == expected.outputs[0].stop_reason
    # The same through chat.
    (expected_chat,) = llm.chat(MESSAGES, params, use_tqdm=False)
    (chat_choice,) = chat(server, **{**base, **http})["choices"]
    assert chat_choice["message"]["content"] == expected_chat.text


def _neutral(fields: dict) -> dict:
    """The fields' no-op values (the output without them)."""
    neutral = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logit_bias": None,
        "min_tokens": 0,
        "stop_token_ids": [],
        "include_stop_str_in_output": False,
        "min_p": 0.0,
    }
    return {k: neutral[k] for k in fields if k in neutral}


def test_out_of_range_penalty_and_vocabulary_are_400s(server):
    for body, param in (
        ({"frequency_penalty": 5.0}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 2}, "min_p"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"500": 1}}, "logit_bias"),
        ({"stop_token_ids": [500]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ):
        response = post(server, "/v1/completions", {"prompt": "hi", **body})
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("repetition_penalty", 1e-40, "[0.01, 100]"),
        ("repetition_penalty", 1000.0, "[0.01, 100]"),
        ("top_p", 1e-45, "[1.17549e-38, 1]"),
        ("min_p", -0.5, "[0, 1]"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("temperature", -1e-9, "[0, "),
    ],
)
def test_sampling_float_out_of_range_is_a_400_with_the_range(server, field, value, valid):
    """The ranges are SamplingParams' (one copy): 1e-40 as repetition_penalty was a 200 with
    token 0 drawn from NaN probabilities."""
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        response = post(server, path, {**body, "max_tokens": 2, field: value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and error["type"] == "invalid_request_error"
        assert valid in error["message"] and repr(value) in error["message"], error
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200


# ---- logprobs, prompt logprobs, echo ---------------------------------------------------------


def offline_logprobs(llm, k: int, **fields):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=k, **fields)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    return out


def test_completion_logprobs_equal_the_offline_ones(server, llm):
    expected = offline_logprobs(llm, 3)
    sample = expected.outputs[0]
    (choice,) = complete(server, temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)[
        "choices"
    ]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [chr(t) for t in sample.token_ids]
    want = [p[t].logprob for p, t in zip(sample.logprobs, sample.token_ids, strict=True)]
    assert logprobs["token_logprobs"] == pytest.approx(want, abs=1e-6)
    for top, position in zip(logprobs["top_logprobs"], sample.logprobs, strict=True):
        best = sorted(position.values(), key=lambda lp: lp.rank)[:3]
        assert {lp.decoded_token for lp in best} <= set(top) and len(top) <= 4
    assert logprobs["text_offset"] == list(range(6))
    # Streamed: the same values, chunk by chunk, finish_reason null until the last.
    chunks = events(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 3},
    )
    streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(want, abs=1e-6)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]


def test_chat_logprobs_equal_the_offline_ones(server, llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    sample = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
    body = {"temperature": 0, "max_tokens": 5, "ignore_eos": True, "logprobs": True}
    (choice,) = chat(server, **body, top_logprobs=2)["choices"]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [chr(t) for t in sample.token_ids]
    for entry, position, token in zip(content, sample.logprobs, sample.token_ids, strict=True):
        assert entry["logprob"] == pytest.approx(position[token].logprob, abs=1e-6)
        assert entry["bytes"] == list(chr(token).encode())
        ranks = sorted((lp.rank, lp.decoded_token) for lp in position.values() if lp.rank <= 2)
        assert [t["token"] for t in entry["top_logprobs"]] == [text for _, text in ranks]
    # logprobs without top_logprobs: no alternatives; streamed: one entry per token.
    (bare,) = chat(server, **body)["choices"]
    assert all(c["top_logprobs"] == [] for c in bare["logprobs"]["content"])
    chunks = events(server, "/v1/chat/completions", {"messages": MESSAGES, **body})
    tokens = [
        c["token"]
        for ch in chunks
        for c in (ch["choices"][0].get("logprobs") or {}).get("content", [])
    ]
    assert tokens == [chr(t) for t in sample.token_ids]
    reasons = [ch["choices"][0]["finish_reason"] for ch in chunks]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}


def test_echo_and_max_tokens_zero_give_the_prompt_and_its_logprobs(server, llm):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    expected = llm.generate(PROMPT, params, use_tqdm=False)[0]
    ids = expected.prompt_token_ids
    want = [None] + [expected.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]
    response = complete(server, max_tokens=0, echo=True, logprobs=2)
    (choice,) = response["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == list(PROMPT)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(want[1:], abs=1e-6)
    assert response["usage"]["completion_tokens"] == 0
    # echo with generation: the prompt, then the completion (text and logprobs).
    (full,) = complete(server, max_tokens=3, echo=True, logprobs=0, temperature=0)["choices"]
    gen = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert full["text"] == PROMPT + gen.text
    assert len(full["logprobs"]["tokens"]) == len(PROMPT) + 3
    assert full["logprobs"]["text_offset"][len(PROMPT)] == len(PROMPT)
    # Streamed: the echo chunk first, then the completion; echo without logprobs too.
    chunks = events(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True})
    assert chunks[0]["choices"][0]["text"] == PROMPT
    chunks = events(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    )
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # Token-id prompts are echoed as their text.
    (ids_choice,) = post(
        server, "/v1/completions", {"prompt": ids[:5], "max_tokens": 0, "echo": True}
    ).json()["choices"]
    assert ids_choice["text"] == PROMPT[:5]


def test_prompt_logprobs_field(server, llm):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    expected = llm.generate(PROMPT, params, use_tqdm=False)[0]
    (choice,) = complete(server, max_tokens=2, temperature=0, prompt_logprobs=1)["choices"]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected.prompt_token_ids)
    for j in range(1, len(got)):
        want = expected.prompt_logprobs[j]
        assert set(got[j]) == {str(t) for t in want}
        for token_id, entry in got[j].items():
            assert entry["logprob"] == pytest.approx(want[int(token_id)].logprob, abs=1e-6)
            assert entry["rank"] == want[int(token_id)].rank
    response = chat(server, max_tokens=2, prompt_logprobs=0)
    assert response["prompt_logprobs"][0] is None and len(response["prompt_logprobs"]) > 5
    bad = post(server, "/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


# ---- chat options, streams, usage ----------------------------------------------------------------


def test_continue_final_message_and_add_generation_prompt(server, llm):
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure, the"}]
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = llm.chat(
        messages, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )[0]
    body = {"messages": messages, "temperature": 0, "max_tokens": 6}
    response = chat(
        server,
        **{k: v for k, v in body.items() if k != "messages"},
        messages=messages,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert response["choices"][0]["message"]["content"] == expected.text
    assert response["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    plain = llm.chat(messages, params, use_tqdm=False, add_generation_prompt=False)[0]
    response = chat(
        server,
        **{k: v for k, v in body.items() if k != "messages"},
        messages=messages,
        add_generation_prompt=False,
    )
    assert response["usage"]["prompt_tokens"] == len(plain.prompt_token_ids)
    for extra, param in (
        ({"continue_final_message": True}, "continue_final_message"),
        (
            {"continue_final_message": True, "add_generation_prompt": False, "messages": MESSAGES},
            "continue_final_message",
        ),
    ):
        bad = post(server, "/v1/chat/completions", {**body, **extra})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param


def test_stream_usage_options_and_stop_reason(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2}
    chunks = events(
        server,
        "/v1/completions",
        {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert all("usage" in c for c in chunks)
    for index in (0, 1):
        reasons = [
            c["choices"][0]["finish_reason"]
            for c in chunks[:-1]
            if c["choices"][0]["index"] == index
        ]
        assert reasons == [None] * (len(reasons) - 1) + ["length"]
    plain = events(server, "/v1/completions", body)
    assert all("usage" not in c for c in plain)
    # stop_reason: the stop string or the stop token id.
    force_o = {"max_tokens": 20, "temperature": 0, "ignore_eos": True, "logit_bias": {"111": 100}}
    (choice,) = complete(server, **force_o, stop=["o"])["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "o"
    (choice,) = complete(server, **force_o, stop_token_ids=[111])["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == 111
    chunks = events(server, "/v1/completions", {"prompt": PROMPT, **force_o, "stop": ["o"]})
    assert chunks[-1]["choices"][0]["stop_reason"] == "o"


# ---- refused, ignored, types ---------------------------------------------------------------------


REFUSED = [("/v1/completions", name) for name in CompletionRequest.REFUSED] + [
    ("/v1/chat/completions", name) for name in ChatCompletionRequest.REFUSED
]


@pytest.mark.parametrize(("path", "field"), REFUSED)
def test_refused_fields_are_a_400_naming_them(server, path, field):
    model = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
    base = {"prompt": "hi"} if model is CompletionRequest else {"messages": MESSAGES}
    response = post(server, path, {**base, "max_tokens": 2, field: model.REFUSED[field].example})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert error["code"] == "unsupported_field"


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (
            "/v1/completions",
            {
                "best_of": 1,
                "use_beam_search": False,
                "response_format": {"type": "text"},
                "suffix": None,
                "length_penalty": 1,
            },
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "none",
                "modalities": ["text"],
                "echo": False,
            },
        ),
    ],
)
def test_no_op_values_of_refused_fields_are_accepted(server, path, fields):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MESSAGES}
    assert post(server, path, {**base, "max_tokens": 2, **fields}).status_code == 200


def test_ignored_fields_in_one_warning_line(server, caplog):
    caplog.set_level(logging.WARNING, logger="pagedkv.entrypoints.openai.app")
    body = {
        "messages": [{"role": "user", "content": "hi", "name": "bob"}],  # name: honoured
        "max_tokens": 2,
        "user": "u1",
        "metadata": {"k": "v"},
        "stream_options": None,
        # fields of today's openai SDK (3.6x) that have no effect on a local server
        "safety_identifier": "s1",
        "verbosity": "low",
        "reasoning_effort": "low",
        "prompt_cache_key": "tenant-1",  # honoured (routing across replicas): not named
    }
    assert post(server, "/v1/chat/completions", body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "without effect" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].endswith(
        "ignored: user, metadata, safety_identifier, verbosity, reasoning_effort"
    )


@pytest.mark.parametrize(
    ("path", "fields", "named", "param"),
    [
        ("/v1/chat/completions", {"foo_bar": 1}, "foo_bar", "foo_bar"),
        ("/v1/completions", {"foo_bar": None}, "foo_bar", "foo_bar"),
        ("/tokenize", {"foo_bar": 1}, "foo_bar", "foo_bar"),
        ("/detokenize", {"foo_bar": 1}, "foo_bar", "foo_bar"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
            "messages[0].content[0].x",
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"stream": True, "stream_options": {"include_usage": True, "x": 1}},
            "stream_options.x",
            "stream_options",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f", "x": 1}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}, "y": 2},
            },
            "tools[0].function.x, tool_choice.y",
            "tools",
        ),
        # Checked before the types: all the unknown names, none of the type errors.
        ("/v1/completions", {"max_tokens": "8", "b": 1, "a": 2}, "b, a", "b"),
    ],
)
def test_unknown_fields_are_a_400_naming_them(server, path, fields, named, param):
    """As OpenAI answers (vLLM only warns, we did too): our rule is honoured or refused."""
    base = {
        "/v1/completions": {"prompt": "hi", "max_tokens": 2},
        "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 2},
        "/tokenize": {"prompt": "hi"},
        "/detokenize": {"tokens": [104]},
    }[path]
    response = post(server, path, {**base, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    plural = "s" if ", " in named else ""
    assert error["message"] == f"Unrecognized request argument{plural} supplied: {named}"
    assert (error["param"], error["code"]) == (param, "unrecognized_argument")


def test_types_are_strict_and_null_means_default(server):
    ok = complete(server, temperature=None, top_p=None, n=None, max_tokens=2, stop=None, seed=None)
    assert len(ok["choices"]) == 1
    # JSON has one number type: 2.0 is the integer 2 (JSON Schema's "integer"), 1.5 is not.
    two = complete(server, n=2.0, max_tokens=2.0, seed=7.0, prompt=[104.0, 105])
    assert len(two["choices"]) == 2 and two["usage"]["completion_tokens"] == 4
    for body, param in (
        ({"max_tokens": "8"}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"n": 1.5}, "n"),
        ({"n": True}, "n"),
        ({"echo": 1}, "echo"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": 0}, "max_tokens"),
    ):
        response = post(server, "/v1/completions", {"prompt": "hi", **body})
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param, response.text
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    for part in (image, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}):
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]}
        response = post(server, "/v1/chat/completions", body)
        assert response.status_code == 400
        assert "only text content is supported" in response.json()["error"]["message"]
    response = post(server, "/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    response = post(server, "/v1/completions", {"prompt": "hi", "priority": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"


# ---- routes --------------------------------------------------------------------------------------


def test_tokenizer_routes_and_the_small_ones(server, llm):
    tokenizer = llm.get_tokenizer()
    response = post(server, "/tokenize", {"prompt": "hello", "return_token_strs": True}).json()
    assert response == {
        "count": 5,
        "max_model_len": 256,
        "tokens": tokenizer.encode("hello"),
        "token_strs": list("hello"),
    }
    chat_ids = post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert chat_ids == tokenizer.apply_chat_template(MESSAGES)
    assert post(server, "/detokenize", {"tokens": chat_ids}).json() == {
        "prompt": tokenizer.decode(chat_ids)
    }
    bad = post(server, "/detokenize", {"tokens": [1, 500]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"prompt": "a", "messages": MESSAGES}).status_code == 400
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["model_max_length"] == 256 and info["vocab_size"] == 128
    assert httpx.get(server.url + "/version").json() == {"version": "0.1.0"}
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200
    card = httpx.get(server.url + f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["max_model_len"] == 256
    assert httpx.get(server.url + "/v1/models/other").status_code == 404


# ---- the docs table ------------------------------------------------------------------------------


def docs_table() -> dict[str, tuple[str, str]]:
    """field -> (completions cell, chat cell) of docs/server.md's request-field table."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## Request fields") :]
    section = section[: section.index("\n### ")]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `([a-z_]+)` \| ([^|]+) \| ([^|]+) \|", line)
        if match:
            rows[match.group(1)] = (match.group(2).strip(), match.group(3).strip())
    return rows


def status(model, name: str) -> str:
    if name not in model.model_fields:
        return "—"
    if name in model.REFUSED:
        return "refused"
    if name in model.IGNORED:
        return "ignored"
    return "honoured"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("store", "yes"),
        ("metadata", {"k": 5}),
        ("service_tier", 1),
        ("safety_identifier", {"id": 1}),
        ("reasoning_effort", 5),
        ("reasoning_effort", "ultra"),
        ("verbosity", "loud"),
        ("prompt_cache_retention", "forever"),
        ("prompt_cache_key", 7),
    ],
)
def test_fields_without_effect_still_have_openais_types(server, field, value):
    response = post(server, "/v1/chat/completions", {"messages": MESSAGES, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_every_field_of_the_openai_sdk_is_declared():
    """No field the current openai client can send is "unrecognized": each is honoured, ignored
    (named in the warning line) or refused by name, by the table above."""
    openai = pytest.importorskip("openai")
    from openai.types import completion_create_params, embedding_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from openai.types.responses import response_create_params

    from pagedkv.entrypoints.openai.protocol.embeddings import EmbeddingRequest
    from pagedkv.entrypoints.openai.protocol.responses_api import ResponsesRequest

    pairs = [
        (CompletionRequest, completion_create_params.CompletionCreateParamsBase),
        (ChatCompletionRequest, chat_create_params.CompletionCreateParamsBase),
        (ResponsesRequest, response_create_params.ResponseCreateParamsBase),
        (EmbeddingRequest, embedding_create_params.EmbeddingCreateParams),
    ]
    for model, params in pairs:
        missing = set(params.__annotations__) - set(model.model_fields)
        assert not missing, f"openai {openai.__version__}: {model.__name__} lacks {missing}"


def test_docs_table_matches_the_request_models():
    rows = docs_table()
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert set(rows) == fields, set(rows) ^ fields
    for name, (completions, chat_cell) in rows.items():
        assert completions == status(CompletionRequest, name), name
        assert chat_cell == status(ChatCompletionRequest, name), name
    # Every refused field is declared as a field (so a test sends its example) and vice versa.
    for model in (CompletionRequest, ChatCompletionRequest):
        assert set(model.REFUSED) <= set(model.model_fields)
        assert set(model.IGNORED) <= set(model.model_fields)


# ---- beam search ---------------------------------------------------------------------------------


def test_use_beam_search_equals_the_offline_beam_search(server, llm):
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5)
    (offline,) = llm.beam_search([PROMPT], params)
    body = complete(server, use_beam_search=True, n=3, max_tokens=8, length_penalty=0.5, logprobs=2)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == [s.text for s in offline.sequences]
    for choice, sequence in zip(choices, offline.sequences, strict=True):
        generated = sequence.tokens[len(sequence.tokens) - len(sequence.logprobs) :]
        assert choice["finish_reason"] == sequence.finish_reason
        positions = zip(generated, sequence.logprobs, strict=True)
        expected = [position[t].logprob for t, position in positions]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected)
        assert all(len(top) <= 3 for top in choice["logprobs"]["top_logprobs"])
    assert body["usage"]["completion_tokens"] == sum(len(s.logprobs) for s in offline.sequences)
    # The length penalty changes the order (or not) exactly as offline; chat runs the same search.
    (chat_offline,) = llm.beam_search(
        [{"prompt_token_ids": llm.get_tokenizer().apply_chat_template(MESSAGES)}],
        BeamSearchParams(beam_width=2, max_tokens=6),
    )
    reply = chat(server, use_beam_search=True, n=2, max_tokens=6, temperature=0)
    assert [c["message"]["content"] for c in reply["choices"]] == [
        s.text for s in chat_offline.sequences
    ]


def test_max_tokens_resolves_alike_for_every_request_kind(server, llm):
    """One rule, in the engine: without max_tokens, sampling (n = 1 and n > 1) and beam search
    run to max_model_len (prompt + output = 256) through chat, Responses and LLM alike; the
    completions API's own default (16) is the request model's, for both kinds."""
    room = 256 - len(llm.get_tokenizer().apply_chat_template(LONG_MESSAGES))
    assert 0 < room < 40
    common = {"messages": LONG_MESSAGES, "ignore_eos": True, "temperature": 0}
    sampled = chat(server, **common)
    samples = chat(server, **{**common, "temperature": 1.0, "n": 2, "seed": 1})
    # One beam: each beam may hold a whole max_model_len of blocks (64 of the pool's 79).
    beams = chat(server, **common, use_beam_search=True, n=1)
    for body in (sampled, samples, beams):
        assert body["usage"]["completion_tokens"] == room * len(body["choices"])
        assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    ids = llm.get_tokenizer().apply_chat_template(LONG_MESSAGES)
    # Responses (no ignore_eos there) is a chat request that passes the absent limit on.
    responses = ResponsesRequest(input="hi")
    assert responses.chat_request(responses.input_messages()).max_completion_tokens is None
    (offline,) = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=None, ignore_eos=True)
    )
    (offline_beams,) = llm.beam_search(
        [{"prompt_token_ids": ids}],
        BeamSearchParams(beam_width=1, max_tokens=None, ignore_eos=True),
    )
    assert len(offline.outputs[0].token_ids) == room
    assert [len(s.logprobs) for s in offline_beams.sequences] == [room]
    # Completions: OpenAI's default of 16 for both kinds; an explicit null is the engine's None.
    for beam in ({}, {"use_beam_search": True, "n": 1}):
        for absent in ({}, {"max_tokens": None}):  # null means the default, as OpenAI's
            body = complete(server, ignore_eos=True, temperature=0, **beam, **absent)
            assert body["usage"]["completion_tokens"] == 16


#: A chat that leaves 256 - (its tokens) < 40 tokens of room (one token per character): short
#: runs.
LONG_MESSAGES = [{"role": "user", "content": "x" * 210}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream": True}, "use_beam_search"),
        ({"temperature": 0.7}, "use_beam_search"),
        ({"top_p": 0.9}, "use_beam_search"),
        ({"stop": ["x"]}, "use_beam_search"),
        ({"best_of": 4}, "use_beam_search"),
        ({"logprobs": 7}, "use_beam_search"),  # more than the 2 * n = 6 candidates of a step
        ({"echo": True, "logprobs": 1}, "use_beam_search"),
        ({"n": 100}, "n"),  # beyond the engine's max_num_seqs (64)
    ],
)
def test_use_beam_search_refuses_what_it_does_not_do(server, fields, param):
    body = {"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, "n": 3, **fields}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    # length_penalty means something only to beam search.
    response = post(server, "/v1/completions", {"prompt": PROMPT, "length_penalty": 0.5})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "length_penalty"


_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    ("path", "fields", "named"),
    [
        ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"guided_regex": "[a-z]+"}, "guided_regex"),
        (
            "/v1/chat/completions",
            {"tools": [_WEATHER_TOOL], "tool_choice": "required"},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [_WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            "tool_choice",
        ),
    ],
)
def test_use_beam_search_refuses_a_constrained_output(server, path, fields, named):
    """Beams rank the raw log-probabilities: a structured-output constraint (the request's own,
    or the one tool_choice "required" / a named function sets) is a 400 naming
    use_beam_search that says which."""
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    body = {**base, "max_tokens": 4, "n": 2, **fields}
    response = post(server, path, {**body, "use_beam_search": True})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "use_beam_search"
    assert named in error["message"]
