"""Tool calling on the real default model (SmolLM2-135M, fp32) with our Hermes template
(examples/tool_chat_template_hermes.jinja): the round trip assistant tool call -> tool message ->
final answer through /v1/chat/completions, streamed and not, equal to what the engine generates
greedily for the same rendered prompt, read by the same parser; and ``tool_choice`` "required" /
a named function, whose grammar forces the model's own output into valid calls (arguments
checked with jsonschema), streamed and not, through the openai client and LangChain's
``bind_tools``, up to a full round trip on the model's own call; the server is configured by the
README's command line (``--chat-template examples/tool_chat_template_hermes.jinja
--enable-auto-tool-choice --tool-call-parser hermes``)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from pagedkv.entrypoints.openai.tool_parsers import get_tool_parser

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).parents[2] / "examples" / "tool_chat_template_hermes.jinja"
MAX_TOKENS = 8
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
ROUND_TRIP = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21, "sky": "clear"}'},
]


@pytest.fixture(scope="module")
def engine(loaded_fp32):
    """An engine on the session's fp32 default model (tests/conftest.py; skips without it)."""
    from pagedkv.engine.llm_engine import LLMEngine

    return LLMEngine(dtype="float32", max_model_len=1024, max_num_seqs=4, loaded_model=loaded_fp32)


@pytest.fixture(scope="module")
def server(engine):
    from pagedkv.engine.engine_loop import EngineLoop
    from pagedkv.entrypoints.cli import build_parser
    from pagedkv.entrypoints.openai.app import create_app
    from pagedkv.entrypoints.openai.chat_options import ChatOptions, load_chat_template
    from pagedkv.entrypoints.openai.launch import ThreadedServer

    # The README's tool-calling command line.
    flags = ["--chat-template", str(TEMPLATE), "--enable-auto-tool-choice"]
    args = build_parser().parse_args(["serve", *flags, "--tool-call-parser", "hermes"])
    options = ChatOptions.from_cli_args(args)
    assert options.chat_template == load_chat_template(str(TEMPLATE))
    app = create_app(EngineLoop(engine), model_name="smollm2", chat_options=options)
    with ThreadedServer(app) as running:
        yield running


def test_template_renders_tools_calls_and_results(server):
    body = {"messages": ROUND_TRIP, "return_token_strs": False}
    ids = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in (
        text
    )
    assert '<tool_response>\n{"celsius": 21, "sky": "clear"}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_round_trip_answer_streamed_and_not(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        kwargs = {
            "model": "smollm2",
            "messages": ROUND_TRIP,
            "tools": [TOOL],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        # tool_choice "none": the same prompt (tools rendered), the raw greedy text.
        raw = client.chat.completions.create(tool_choice="none", **kwargs).choices[0]
        reply = client.chat.completions.create(**kwargs).choices[0]
        streamed_content, streamed_calls = "", {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                streamed_content += choice.delta.content or ""
                for piece in choice.delta.tool_calls or ():
                    entry = streamed_calls.setdefault(piece.index, ["", ""])
                    entry[0] += piece.function.name or ""
                    entry[1] += piece.function.arguments or ""
    assert raw.message.content  # the model answers the tool's result
    expected = get_tool_parser("hermes").extract(raw.message.content)
    assert reply.message.content == expected.content
    calls = [(c.name, c.arguments) for c in expected.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or ()] == (
        calls
    )
    assert (streamed_content or None) == expected.content
    assert [tuple(v) for v in streamed_calls.values()] == calls
    for _, arguments in streamed_calls.values():
        json.loads(arguments)


# ---- tool_choice "required" / a named function: the model's own output, constrained ----------

CONSTRAINED_MAX_TOKENS = 64
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _parameters(name: str) -> dict:
    return next(t for t in (TOOL, TIME_TOOL) if t["function"]["name"] == name)["function"][
        "parameters"
    ]


def _calls_streamed_and_not(client, **kwargs):
    """(finish_reason, [(name, arguments)]) of the non-streamed reply and of the streamed one
    (its deltas put back together by index)."""
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert all(c.id.startswith("call_") and c.type == "function" for c in whole.message.tool_calls)
    streamed: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or ():
                entry = streamed.setdefault(piece.index, ["", ""])
                entry[0] += piece.function.name or ""
                entry[1] += piece.function.arguments or ""
    assert content == "" and whole.message.content is None
    return (whole.finish_reason, calls), (finish, [tuple(v) for v in streamed.values()])


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.mark.parametrize(
    ("tools", "parallel", "max_tokens"),
    # Issue 34's request: one tool, parallel calls allowed (OpenAI's default), 250 tokens. It
    # used to end "length" with the same call 7 times as content; greedy, the compact grammar
    # now closes the array after one call (21 tokens), and a repeat would end it.
    [([TOOL], True, 250), ([TOOL, TIME_TOOL], False, CONSTRAINED_MAX_TOKENS)],
    ids=["one-tool-parallel", "two-tools-single"],
)
def test_required_forces_a_valid_call(client, tools, parallel, max_tokens):
    jsonschema = pytest.importorskip("jsonschema")
    kwargs = {
        "model": "smollm2",
        "messages": QUESTION,
        "tools": tools,
        "tool_choice": "required",
        "parallel_tool_calls": parallel,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    whole, streamed = _calls_streamed_and_not(client, **kwargs)
    finish, calls = whole
    assert finish == "tool_calls"
    assert calls == [("get_weather", '{"city": "Paris"}')]
    usage = client.chat.completions.create(**kwargs).usage
    assert usage.completion_tokens < 64  # ended by the grammar, far before max_tokens
    names = {t["function"]["name"] for t in tools}
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), _parameters(name))
    assert streamed == whole


NO_ARGUMENTS_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "The current time", "parameters": {}},
}


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_a_tool_without_parameters_is_called_with_no_arguments(client, tool_choice):
    """`parameters: {}` used to let the model write free keys (named: runs of newlines inside
    the braces) until max_tokens; now its arguments are `{}` and the reply ends."""
    kwargs = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "What time is it?"}],
        "tools": [NO_ARGUMENTS_TOOL],
        "tool_choice": tool_choice,
        "max_tokens": 250,
        "temperature": 0,
    }
    whole, streamed = _calls_streamed_and_not(client, **kwargs)
    assert whole == ("stop" if tool_choice != "required" else "tool_calls", [("get_time", "{}")])
    assert streamed == whole
    assert client.chat.completions.create(**kwargs).usage.completion_tokens < 64


def test_named_function_forces_that_call(client):
    jsonschema = pytest.importorskip("jsonschema")
    whole, streamed = _calls_streamed_and_not(
        client,
        model="smollm2",
        messages=QUESTION,
        tools=[TIME_TOOL, TOOL],
        tool_choice=NAMED,
        max_tokens=CONSTRAINED_MAX_TOKENS,
        temperature=0,
    )
    finish, calls = whole
    assert finish == "stop"  # OpenAI's for a named function
    [(name, arguments)] = calls
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), TOOL["function"]["parameters"])
    assert streamed == whole


def test_required_with_a_pydantic_tool_and_its_defs(client):
    """openai.pydantic_function_tool keeps a nested model in `$defs` (strict schema): the
    "required" schema moves it to its root, and the model's call matches the tool's schema."""
    jsonschema = pytest.importorskip("jsonschema")
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    class GetForecast(BaseModel):
        """The weather forecast for a city."""

        city: City

    tool = openai.pydantic_function_tool(GetForecast)
    assert "$defs" in tool["function"]["parameters"]
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Forecast for Paris, France?"}],
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=CONSTRAINED_MAX_TOKENS,
        temperature=0,
    ).choices[0]
    assert reply.finish_reason == "tool_calls"
    [call] = reply.message.tool_calls
    assert call.function.name == "GetForecast"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_round_trip_with_the_models_own_call(client):
    """user -> the model's (required) call -> the tool's result -> the model's answer, each leg
    streamed and not (greedy: the streamed legs give what the whole ones give)."""
    kwargs = {"model": "smollm2", "tools": [TOOL], "temperature": 0}
    first_kwargs = {
        "messages": QUESTION,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": CONSTRAINED_MAX_TOKENS,
        **kwargs,
    }
    first = client.chat.completions.create(**first_kwargs).choices[0]
    assert first.finish_reason == "tool_calls"
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather"
    # The streamed call, put together from its deltas as a client does: the same call.
    streamed_call = {"id": "", "name": "", "arguments": ""}
    for chunk in client.chat.completions.create(stream=True, **first_kwargs):
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or ():
                assert piece.index == 0
                streamed_call["id"] += piece.id or ""
                streamed_call["name"] += piece.function.name or ""
                streamed_call["arguments"] += piece.function.arguments or ""
    assert streamed_call["id"].startswith("call_")
    assert (streamed_call["name"], streamed_call["arguments"]) == (
        call.function.name,
        call.function.arguments,
    )
    messages = [
        *QUESTION,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21, "sky": "clear"}'},
    ]
    final_kwargs = {"messages": messages, "tool_choice": "none", "max_tokens": 16, **kwargs}
    answer = client.chat.completions.create(**final_kwargs).choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content and answer.message.content.strip()
    assert answer.finish_reason in ("stop", "length")
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **final_kwargs):
        for choice in chunk.choices:
            assert not choice.delta.tool_calls
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert (content, finish) == (answer.message.content, answer.finish_reason)


@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    # Issue 34: bind_tools(..., tool_choice="required") with parallel calls allowed got no
    # tool_calls (the array never closed, "length").
    [("required", None), ("required", False), ("get_weather", False)],
)
def test_langchain_bind_tools_forced(server, tool_choice, parallel):
    langchain_openai = pytest.importorskip("langchain_openai")
    jsonschema = pytest.importorskip("jsonschema")

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "21 C"

    model = langchain_openai.ChatOpenAI(
        model="smollm2",
        base_url=server.url + "/v1",
        api_key="x",
        temperature=0,
        max_tokens=250,
        max_retries=0,
    )
    bound = model.bind_tools([get_weather], tool_choice=tool_choice, parallel_tool_calls=parallel)
    result = bound.invoke("What is the weather in Paris?")
    [call] = result.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], TOOL["function"]["parameters"])
