"""Tool calling and the `vllm serve` options around it, on the fake engine whose "model" replies
with a scripted text (so `tool_choice: "auto"` is tested with the exact output a model would give):
tool calls read back (whole and streamed, through the openai client and LangChain's
`bind_tools`), the round trip assistant tool call -> tool message -> answer, malformed calls as
content, several served names, per-request chat templates, CORS options and vLLM's metric names.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from _server_fakes import ScriptedEngine

from pagedkv.engine.engine_loop import EngineLoop
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.chat_options import ChatOptions, load_chat_template
from pagedkv.entrypoints.openai.launch import ThreadedServer
from pagedkv.entrypoints.openai.metrics import ServerMetrics
from pagedkv.entrypoints.openai.protocol.requests import ChatCompletionRequest
from pagedkv.entrypoints.openai.server_options import ServerOptions
from pagedkv.entrypoints.openai.tool_calling import (
    RequiredCallsReader,
    parameters_schema,
    parse_required,
    required_schema,
)
from pagedkv.errors import ConfigError

NAMES = ["fake-model", "alias"]
ORIGIN = "http://app.example"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(num_blocks=1024, block_size=4, max_model_len=1024)


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(
        EngineLoop(engine),
        model_name=NAMES,
        options=ServerOptions(
            allowed_origins=(ORIGIN,),
            allowed_methods=("GET", "POST"),
            allowed_headers=("content-type", "authorization"),
            allow_credentials=True,
        ),
        chat_options=ChatOptions(
            enable_auto_tool_choice=True,
            tool_call_parser="hermes",
            trust_request_chat_template=True,
        ),
        metrics_prefix="vllm",
    )
    with ThreadedServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def last_prompt(engine) -> str:
    prompt = engine.added[-1][1]
    ids = prompt.token_ids if hasattr(prompt, "token_ids") else prompt["prompt_token_ids"]
    return engine.tokenizer.decode(ids)


def test_auto_tool_call_round_trip(client, engine):
    engine.reply = CALL
    first = client.chat.completions.create(
        model="alias", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=200
    )
    assert "<tools>['get_weather']" in last_prompt(engine)  # the tools reach the template
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    # The tool's answer goes back; the model's answer is plain content.
    engine.reply = "It is 21 C in Paris."
    messages = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    second = client.chat.completions.create(
        model="alias", messages=messages, tools=[WEATHER_TOOL], max_tokens=200
    )
    prompt = last_prompt(engine)
    assert f"<tool {call.id}>" + '{"celsius": 21}' in prompt
    assert '"arguments": {"city": "Paris"}' in prompt  # the call, arguments as a dict
    assert second.choices[0].message.content == "It is 21 C in Paris."
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason == "stop"
    assert second.model == "fake-model"  # the first served name is reported


def stream_calls(client, **kwargs):
    """(content, {index: (id, name, arguments)}, finish_reason) of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for piece in delta.tool_calls or ():
                if piece.index not in calls:
                    assert piece.id and piece.type == "function" and piece.function.name
                    calls[piece.index] = [piece.id, piece.function.name, ""]
                else:
                    assert piece.id is None and piece.function.name is None
                calls[piece.index][2] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_streamed_tool_calls(client, engine):
    engine.reply = "Checking." + TWO_CALLS
    content, calls, finish = stream_calls(
        client, model="fake-model", messages=QUESTION, tools=[WEATHER_TOOL, TIME_TOOL]
    )
    assert content == "Checking."
    assert finish == "tool_calls"
    assert [(c[1], json.loads(c[2])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    # Non-streamed, the same text gives the same calls.
    reply = client.chat.completions.create(
        model="fake-model", messages=QUESTION, tools=[WEATHER_TOOL, TIME_TOOL]
    )
    message = reply.choices[0].message
    assert message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c[1], c[2]) for c in calls.values()
    ]


def test_parallel_tool_calls_false_keeps_the_first(client, engine):
    engine.reply = TWO_CALLS
    reply = client.chat.completions.create(
        model="fake-model",
        messages=QUESTION,
        tools=[WEATHER_TOOL, TIME_TOOL],
        parallel_tool_calls=False,
    )
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_weather"]
    _, calls, _ = stream_calls(
        client,
        model="fake-model",
        messages=QUESTION,
        tools=[WEATHER_TOOL, TIME_TOOL],
        parallel_tool_calls=False,
    )
    assert [c[1] for c in calls.values()] == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_tool_call_comes_back_as_content(client, engine, stream):
    engine.reply = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'
    kwargs = {"model": "fake-model", "messages": QUESTION, "tools": [WEATHER_TOOL]}
    if stream:
        content, calls, finish = stream_calls(client, **kwargs)
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, None
        finish = choice.finish_reason
    assert content == engine.reply
    assert not calls
    assert finish == "stop"


def test_tool_choice_none_shows_tools_but_reads_no_calls(client, engine):
    engine.reply = CALL
    reply = client.chat.completions.create(
        model="fake-model", messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="none"
    )
    assert "<tools>" in last_prompt(engine)
    assert reply.choices[0].message.content == CALL
    assert reply.choices[0].message.tool_calls is None


def test_langchain_bind_tools(server, engine):
    langchain_openai = pytest.importorskip("langchain_openai")

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "21 C"

    engine.reply = CALL
    model = langchain_openai.ChatOpenAI(
        model="alias", base_url=server.url + "/v1", api_key="unused", max_retries=0
    )
    result = model.bind_tools([get_weather]).invoke("Weather in Paris?")
    assert [(c["name"], c["args"]) for c in result.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        # required / named constrain the output: not with the request's own constraint
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
    ],
)
def test_tool_requests_refused(server, extra, param):
    body = {"messages": QUESTION, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tool_calls_only_on_assistant_messages(server):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"messages": [{"role": "user", "content": "x", "tool_calls": [call]}]}
    response = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    call["function"]["arguments"] = "[1]"  # not an object
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}
    assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 400


def test_request_chat_template_and_kwargs(client, engine):
    engine.reply = "fine"
    reply = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hello"}],
        extra_body={
            "chat_template": "{{ greeting }}, {{ messages[0].content }}!",
            "chat_template_kwargs": {"greeting": "Hi"},
        },
    )
    assert last_prompt(engine) == "Hi, hello!"
    assert reply.choices[0].message.content == "fine"
    # A message's name (OpenAI's) reaches the template, as vLLM passes it.
    client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hello", "name": "bob"}],
        extra_body={"chat_template": "{{ messages[0].name }}: {{ messages[0].content }}"},
    )
    assert last_prompt(engine) == "bob: hello"


def test_request_chat_template_needs_trust(engine):
    app = create_app(EngineLoop(ScriptedEngine()), model_name="m")
    with ThreadedServer(app) as other:
        body = {"messages": QUESTION, "chat_template": "{{ messages }}"}
        response = httpx.post(other.url + "/v1/chat/completions", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "chat_template"
        # A server-wide template serves a model without one.
    bare = ScriptedEngine()
    bare.tokenizer.has_chat_template = False
    options = ChatOptions(chat_template="[{{ messages[-1].content }}]")
    with ThreadedServer(create_app(EngineLoop(bare), model_name="m", chat_options=options)) as s:
        response = httpx.post(s.url + "/v1/chat/completions", json={"messages": QUESTION})
        assert response.status_code == 200, response.text
        assert last_prompt(bare) == "[Weather in Paris?]"


def test_served_model_names(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == NAMES
    assert httpx.get(server.url + "/v1/models/alias").json()["id"] == "alias"
    body = {"model": "other", "prompt": "x", "max_tokens": 1}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 404
    body["model"] = "alias"
    response = httpx.post(server.url + "/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["model"] == "fake-model"


def test_cors_options(server):
    preflight = httpx.options(
        server.url + "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert set(preflight.headers["access-control-allow-methods"].split(", ")) >= {"GET", "POST"}
    assert "PUT" not in preflight.headers["access-control-allow-methods"]
    refused = httpx.options(
        server.url + "/v1/models",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "DELETE"},
    )
    assert refused.status_code == 400  # starlette: method not allowed by CORS
    with pytest.raises(ConfigError, match="allow-credentials"):
        ServerOptions(allowed_origins=("*",), allow_credentials=True)
    with pytest.raises(ConfigError, match="allowed-methods"):
        ServerOptions(allowed_methods=("GET POST",))


def test_vllm_metric_names(server, client, engine):
    engine.reply = "abc"
    client.chat.completions.create(model="fake-model", messages=QUESTION)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_success_total",
        "vllm:prefix_cache_queries_total",
        "vllm:num_preemptions_total",
    ):
        assert f"\n{name}{{" in text, name
    assert "pagedkv:" not in text
    with pytest.raises(ConfigError):
        ServerMetrics("m", prefix="other")


def test_chat_options_from_flags(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}", encoding="utf-8")
    assert load_chat_template(str(template)) == "{{ messages }}"
    assert load_chat_template("{{ x }}") == "{{ x }}"  # inline
    with pytest.raises(ConfigError, match="not a readable file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="needs --tool-call-parser"):
        ChatOptions(enable_auto_tool_choice=True)
    from pagedkv.entrypoints.cli import build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "--served-model-name",
            "a",
            "b",
            "--chat-template",
            str(template),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "llama3_json",
            "--metrics-prefix",
            "vllm",
            "--allowed-methods",
            "GET,POST",
            "--allow-credentials",
        ]
    )
    assert args.served_model_name == ["a", "b"] and args.metrics_prefix == "vllm"
    options = ChatOptions.from_cli_args(args)
    assert options.chat_template == "{{ messages }}" and options.parser.name == "llama3_json"
    server = ServerOptions.from_cli_args(args, environ={})
    assert server.allowed_methods == ("GET", "POST") and server.allow_credentials


def test_required_schema_accepts_exactly_the_calls():
    jsonschema = pytest.importorskip("jsonschema")
    request = ChatCompletionRequest.model_validate(
        {"messages": QUESTION, "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "required"}
    )
    schema = required_schema(request)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "other", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    calls = parse_required(json.dumps(good))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert parse_required('[{"name": "get_weather", "parameters": {') is None


# A tool as pydantic writes it (openai.pydantic_function_tool, LangChain): the nested model in
# `$defs`, referenced from the tool's root as `#/$defs/City`.
DEFS_TOOL = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "parameters": {
            "$defs": {
                "City": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
                    "required": ["name", "country"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/City"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
FORECAST_ARGS = {"city": {"name": "Paris", "country": "FR"}, "days": 2}


def test_required_schema_moves_each_tools_defs_to_its_root():
    """`#/$defs/City` of a tool points at the root of the whole "required" schema once the
    tool's parameters sit inside it: the tool's `$defs` go there (before: xgrammar refused it,
    "Cannot find field '$defs'", a 400 for any pydantic tool with a nested model)."""
    jsonschema = pytest.importorskip("jsonschema")
    from pagedkv.engine.structured_output import parse_constraint
    from pagedkv.sampling_params import StructuredOutputsParams

    body = {"messages": QUESTION, "tools": [WEATHER_TOOL, DEFS_TOOL], "tool_choice": "required"}
    request = ChatCompletionRequest.model_validate(body)
    schema = required_schema(request)
    assert schema["$defs"] == DEFS_TOOL["function"]["parameters"]["$defs"]
    assert "$defs" in request.tools[1].function.parameters  # the request is not changed
    parse_constraint(StructuredOutputsParams(json=schema))  # compiles
    jsonschema.validate([{"name": "get_forecast", "parameters": FORECAST_ARGS}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            [{"name": "get_forecast", "parameters": {"city": {"name": "Paris"}, "days": 2}}],
            schema,
        )


def test_required_call_with_a_defs_tool(client, engine):
    engine.reply = json.dumps([{"name": "get_forecast", "parameters": FORECAST_ARGS}])
    for stream in (False, True):
        kwargs = {
            "model": "fake-model",
            "messages": QUESTION,
            "tools": [WEATHER_TOOL, DEFS_TOOL],
            "tool_choice": "required",
        }
        if stream:
            finish, calls = None, {}
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    for piece in choice.delta.tool_calls or ():
                        entry = calls.setdefault(piece.index, ["", ""])
                        entry[0] += piece.function.name or ""
                        entry[1] += piece.function.arguments or ""
            got = [(name, json.loads(arguments)) for name, arguments in calls.values()]
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            finish = choice.finish_reason
            got = [
                (c.function.name, json.loads(c.function.arguments))
                for c in choice.message.tool_calls
            ]
        assert finish == "tool_calls"
        assert got == [("get_forecast", FORECAST_ARGS)]


def _with_parameters(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize(
    ("tools", "tool_choice", "reason"),
    [
        (  # the same $defs name, two meanings
            [
                DEFS_TOOL,
                _with_parameters(
                    "other",
                    {"$defs": {"City": {"type": "string"}}, "$ref": "#/$defs/City"},
                ),
            ],
            "required",
            "define `$defs` `City` differently",
        ),
        (  # a reference to nothing
            [_with_parameters("broken", {"type": "object", "properties": {"x": {"$ref": "#/no"}}})],
            "required",
            "the schema `tool_choice` required builds from `tools` cannot be compiled",
        ),
        (
            [_with_parameters("broken", {"type": "object", "properties": {"x": {"$ref": "#/no"}}})],
            {"type": "function", "function": {"name": "broken"}},
            "the schema `tool_choice` named builds from `tools` cannot be compiled",
        ),
    ],
)
def test_tool_schemas_that_cannot_be_enforced_are_a_400_naming_tools(
    server, tools, tool_choice, reason
):
    body = {"messages": QUESTION, "tools": tools, "tool_choice": tool_choice}
    response = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools"
    assert reason in error["message"]


def test_tokenize_renders_tools_as_chat_does(server, client, engine):
    """/tokenize with `messages` and `tools` counts the prompt /v1/chat/completions runs (the
    tools used to be ignored there, with a warning line, so the count left them out)."""
    engine.reply = "ok"
    body = {"messages": QUESTION, "tools": [WEATHER_TOOL]}
    tokenized = httpx.post(server.url + "/tokenize", json=body).json()
    reply = client.chat.completions.create(model="fake-model", tool_choice="none", **body)
    assert tokenized["count"] == reply.usage.prompt_tokens
    ids = engine.added[-1][1]
    ids = ids.token_ids if hasattr(ids, "token_ids") else ids["prompt_token_ids"]
    assert tokenized["tokens"] == list(ids)
    assert "<tools>['get_weather']" in engine.tokenizer.decode(tokenized["tokens"])
    refused = httpx.post(server.url + "/tokenize", json={"prompt": "x", "tools": [WEATHER_TOOL]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


WEATHER_ITEM = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
TIME_ITEM = '{"name": "get_time", "parameters": {}}'


def _required_reply(client, stream, **kwargs):
    """(finish_reason, [(name, arguments)], content, completion_tokens) of one "required"
    choice, streamed (calls put together by index) or not."""
    kwargs = {"model": "fake-model", "messages": QUESTION, "tool_choice": "required", **kwargs}
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.finish_reason, calls, choice.message.content, reply.usage.completion_tokens
    options = {"include_usage": True}
    content, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, stream_options=options, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or ():
                entry = calls.setdefault(piece.index, ["", ""])
                entry[0] += piece.function.name or ""
                entry[1] += piece.function.arguments or ""
    calls = [tuple(entry) for entry in calls.values()]
    return finish, calls, content or None, usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_required_ends_at_a_repeated_call(client, engine, stream):
    """A greedy model that repeats its call never closes the array (SmolLM2 wrote the same
    call 7 times in 250 tokens, then "length" with the raw array as content): the choice ends
    at the first repeat, with the calls before it, and its engine request is aborted."""
    engine.reply = f"[{WEATHER_ITEM}, {TIME_ITEM}, {WEATHER_ITEM}, {WEATHER_ITEM}, {TIME_ITEM}"
    num_aborted = engine.num_aborted
    engine.hold(after_tokens=len(engine.reply) - 1)  # the engine would never end it alone
    try:
        finish, calls, content, num_tokens = _required_reply(
            client, stream, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=500
        )
        # The abort is a command to the engine thread, run before the next request's add.
        client.chat.completions.create(model="fake-model", messages=QUESTION, max_tokens=1)
    finally:
        engine.release()
    assert finish == "tool_calls" and content is None
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    # One character a token: generation stopped at the end of the repeat.
    assert num_tokens == len(f"[{WEATHER_ITEM}, {TIME_ITEM}, {WEATHER_ITEM}")
    assert engine.num_aborted == num_aborted + 1


def test_required_repeat_ends_each_of_n_choices(client, engine):
    engine.reply = f"[{TIME_ITEM}, {TIME_ITEM}, {TIME_ITEM}, {TIME_ITEM}"
    reply = client.chat.completions.create(
        model="fake-model",
        messages=QUESTION,
        tools=[TIME_TOOL],
        tool_choice="required",
        n=2,
        max_tokens=500,
    )
    assert [c.finish_reason for c in reply.choices] == ["tool_calls", "tool_calls"]
    for choice in reply.choices:
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            ("get_time", "{}")
        ]
    assert reply.usage.completion_tokens == 2 * len(f"[{TIME_ITEM}, {TIME_ITEM}")


@pytest.mark.parametrize("stream", [False, True])
def test_required_keeps_the_calls_complete_before_a_length_cut(client, engine, stream):
    engine.reply = f"[{WEATHER_ITEM}, {TIME_ITEM}]"
    cut = len(f"[{WEATHER_ITEM}, ") + 5  # inside the second call
    finish, calls, content, num_tokens = _required_reply(
        client, stream, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=cut
    )
    assert (finish, calls, content, num_tokens) == (
        "length",
        [("get_weather", '{"city": "Paris"}')],
        None,
        cut,
    )
    # Cut before the first call is complete: the text is the content, as before.
    finish, calls, content, _ = _required_reply(
        client, stream, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=10
    )
    assert (finish, calls, content) == ("length", [], engine.reply[:10])


@pytest.mark.parametrize("stream", [False, True])
def test_required_closed_array_gives_every_call(client, engine, stream):
    engine.reply = f"[{WEATHER_ITEM}, {TIME_ITEM}]"
    finish, calls, content, num_tokens = _required_reply(
        client, stream, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=500
    )
    assert finish == "tool_calls" and content is None and num_tokens == len(engine.reply)
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_required_calls_reader_any_split():
    text = f" [ {WEATHER_ITEM} ,\n{TIME_ITEM} , {TIME_ITEM}, {WEATHER_ITEM}"
    expected = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    for size in range(1, len(text) + 1):
        reader = RequiredCallsReader()
        got = []
        for start in range(0, len(text), size):
            got += [(c.name, c.arguments) for c in reader.feed(text[start : start + size])]
        assert got == expected and reader.repeated and not reader.closed, size
    reader = RequiredCallsReader()
    assert [c.name for c in reader.feed(f"[{TIME_ITEM}]{TIME_ITEM}")] == ["get_time"]
    assert reader.closed and not reader.repeated
    reader = RequiredCallsReader()
    reader.feed("not json")
    assert reader.invalid and reader.calls == []
    # The same arguments in another key order are the same call.
    reader = RequiredCallsReader()
    two = '[{"name": "f", "parameters": {"a": 1, "b": 2}}, '
    two += '{"name": "f", "parameters": {"b": 2, "a": 1}}'
    assert len(reader.feed(two)) == 1 and reader.repeated


@pytest.mark.parametrize(
    "parameters",
    [None, {}, {"type": "object"}, {"type": "object", "properties": {}}],
    ids=["none", "empty", "object", "no-properties"],
)
def test_a_tool_without_parameters_takes_no_arguments(parameters):
    """Such a tool's arguments are `{}` (OpenAI: an empty parameter list); xgrammar would
    compile `{}` to any JSON value and `{"type": "object"}` to any object, free keys that a
    model wrote until max_tokens."""
    from pagedkv.engine.structured_output import parse_constraint
    from pagedkv.sampling_params import StructuredOutputsParams

    schema = parameters_schema(parameters)
    assert schema["properties"] == {} and schema["additionalProperties"] is False
    grammar = parse_constraint(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert 'root ::= (("{" "}"))' in str(grammar).splitlines()
    keep = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert parameters_schema(keep) is keep
    assert parameters_schema({"type": "string"}) == {"type": "string"}
