"""Structured outputs through the OpenAI-compatible server (issue 27): ``response_format``
(json_object, json_schema), vLLM's ``structured_outputs`` and the older ``guided_*`` fields on
both endpoints, streamed and not; the openai client's ``chat.completions.parse`` and LangChain's
``with_structured_output`` against the real default model (offline: a local server); the 400s
of a constraint that cannot compile or of two constraints at once."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from pagedkv.entrypoints.openai.protocol.requests import ChatCompletionRequest, CompletionRequest

MODEL = "smollm2"


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)


# ---------------------------------------------------------------- the request fields (no model)


@pytest.mark.parametrize(
    ("body", "kind", "path"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True},
                }
            },
            "json",
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "structured_outputs.regex"),
        (
            {"structured_outputs": {"json_object": True}},
            "json_object",
            "structured_outputs.json_object",
        ),
        ({"guided_json": '{"type": "object"}'}, "json", "guided_json"),
        ({"guided_regex": "a+"}, "regex", "guided_regex"),
        ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", "guided_grammar"),
    ],
)
def test_each_field_gives_its_constraint(body, kind, path):
    for model, base in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, _MESSAGES)):
        request = model.model_validate({**base, **body})
        request.check_supported()
        params, where = request.structured_output_params()
        assert (params.kind, where) == (kind, path)
        assert request.sampling_kwargs()["structured_outputs"] == params


_MESSAGES = {"messages": [{"role": "user", "content": "x"}]}


def test_text_format_and_no_field_give_no_constraint():
    request = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "text"}})
    assert request.structured_output_params() == (None, None)
    assert request.sampling_kwargs()["structured_outputs"] is None


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"guided_regex": "a", "guided_json": {}}, "guided_regex", "at most one"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "`response_format`, `structured_outputs.regex`",
        ),
        (
            {"structured_outputs": {"regex": "a", "grammar": "x"}},
            "structured_outputs",
            "at most one",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "needs one of"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs `json_schema`"),
        ({"guided_json": "[1]"}, "guided_json", "`guided_json` must be a JSON Schema object"),
    ],
)
def test_constraints_that_do_not_go_together_are_refused(body, param, message):
    from pagedkv.entrypoints.openai.protocol.refusals import UnsupportedFieldError

    request = CompletionRequest.model_validate({"prompt": "x", **body})
    with pytest.raises(UnsupportedFieldError, match=re.escape(message)) as info:
        request.check_supported()
    assert info.value.param == param


# ---------------------------------------------------------------- the server, real model


@pytest.fixture(scope="module")
def engine(loaded_fp32):
    """An engine on the session's fp32 default model (tests/conftest.py; skips without it)."""
    from pagedkv.engine.llm_engine import LLMEngine

    return LLMEngine(dtype="float32", max_model_len=512, max_num_seqs=16, loaded_model=loaded_fp32)


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


def _user(text):
    return [{"role": "user", "content": text}]


@pytest.mark.slow
def test_openai_parse_returns_a_parsed_object(client):
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=_user("Describe a person named Ann aged 31."),
        response_format=Person,
        temperature=0,
        max_tokens=48,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    assert message.parsed == Person.model_validate_json(message.content)


@pytest.mark.slow
def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=48,
        max_retries=0,
    )
    person = chat.with_structured_output(Person).invoke("Describe a person named Bob aged 40.")
    assert isinstance(person, Person)


@pytest.mark.slow
def test_json_object_streamed_chat_is_json(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=_user("Give me a tiny JSON object about a cat."),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=40,
        stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text.startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_completions_follow_guided_fields(client, stream):
    cases = [
        ({"guided_regex": r"[A-Z][a-z]{2,8}, [0-9]{4}"}, r"[A-Z][a-z]{2,8}, [0-9]{4}"),
        ({"guided_choice": ["Paris", "London"]}, r"Paris|London"),
        (
            {"structured_outputs": {"grammar": 'root ::= "It is " ("hot" | "cold")'}},
            r"It is (hot|cold)",
        ),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, r"yes|no"),
    ]
    for extra, pattern in cases:
        kwargs = dict(
            model=MODEL,
            prompt="The capital of France is",
            temperature=0,
            max_tokens=12,
            extra_body=extra,
        )
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.completions.create(**kwargs).choices[0]
            text, finish = choice.text, choice.finish_reason
        assert finish == "stop", (extra, text)
        assert re.fullmatch(pattern, text), (extra, text)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("route", "body", "param", "reason"),
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "response_format",
            'Unsupported type "foo"',
        ),
        ("/v1/completions", {"guided_regex": "(a"}, "guided_regex", "parenthesis is not closed"),
        (
            "/v1/completions",
            {"structured_outputs": {"grammar": "root ::= x"}},
            "structured_outputs",
            "is not defined",
        ),
        (
            "/v1/completions",
            {"guided_choice": ["a"], "guided_regex": "a"},
            "guided_choice",
            "at most one",
        ),
    ],
)
def test_a_constraint_that_cannot_compile_is_a_400_naming_the_field(
    server, route, body, param, reason
):
    base = {"prompt": "x"} if route == "/v1/completions" else {"messages": _user("x")}
    response = httpx.post(server.url + route, json={"model": MODEL, **base, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert reason in error["message"]
