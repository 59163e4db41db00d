"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``) on the
fake engine whose "model" replies with a scripted text: every response object and stream event
validates against the openai SDK's own types; the prompt a Responses request renders is the one
the same conversation renders through /v1/chat/completions (instructions, message items, function
calls and their outputs, a previous response's turn); tool calls read back whole and streamed;
the store (LRU, disabled, store false, GET, DELETE); the 400s that name refused fields and the
warning line that names ignored ones. The real model, the openai client, the Agents SDK,
LangChain and litellm: test_responses_api_model.py."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
from _server_fakes import ScriptedEngine
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pagedkv.engine.engine_loop import EngineLoop
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.chat_options import ChatOptions
from pagedkv.entrypoints.openai.launch import ThreadedServer
from pagedkv.entrypoints.openai.protocol.refusals import REFUSED_RESPONSES
from pagedkv.entrypoints.openai.protocol.responses_api import ResponsesRequest
from pagedkv.entrypoints.openai.serving_responses import ResponseStore, StoredResponse

MODEL = "fake-model"
EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(num_blocks=1024, block_size=4, max_model_len=1024)


def serve(engine, **kwargs) -> ThreadedServer:
    chat_options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    app = create_app(EngineLoop(engine), model_name=MODEL, chat_options=chat_options, **kwargs)
    return ThreadedServer(app)


@pytest.fixture(scope="module")
def server(engine):
    with serve(engine) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def post(server, body: dict, **kwargs) -> httpx.Response:
    # JSON text escaped to ASCII, as json.dumps writes it: a lone surrogate travels as \ud800
    content = json.dumps({"model": MODEL, **body})
    headers = {"Content-Type": "application/json"}
    return httpx.post(server.url + "/v1/responses", content=content, headers=headers, **kwargs)


def create(server, engine, reply: str, body: dict) -> dict:
    """A response object (validated by the SDK's type) and the prompt it rendered."""
    engine.reply = reply
    response = post(server, body)
    assert response.status_code == 200, response.text
    data = response.json()
    Response.model_validate(data)
    return data


def last_prompt_ids(engine) -> list[int]:
    prompt = engine.added[-1][1]
    return list(prompt.token_ids if hasattr(prompt, "token_ids") else prompt["prompt_token_ids"])


def chat_prompt_ids(server, engine, messages: list[dict], **extra) -> list[int]:
    """The prompt /v1/chat/completions renders for ``messages``."""
    engine.reply = "x"
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return last_prompt_ids(engine)


def output_text(data: dict) -> str:
    return "".join(
        part["text"]
        for item in data["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def sse_events(response: httpx.Response) -> list[dict]:
    """The events of a Responses stream, each checked: its ``event:`` line names its type,
    and it validates as one of the SDK's stream events."""
    events = []
    for block in response.text.split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        data = json.loads(lines[1].removeprefix("data: "))
        assert lines[0] == f"event: {data['type']}"
        EVENTS.validate_python(data)
        events.append(data)
    return events


# ---- the response object, and the prompt it renders ----------------------------------------


def test_string_input_with_instructions(server, engine):
    data = create(
        server,
        engine,
        "Hello there",
        {"input": "Hi", "instructions": "Be brief", "temperature": 0.5, "top_p": 0.9},
    )
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    assert last_prompt_ids(engine) == chat_prompt_ids(server, engine, messages)
    prompt_tokens = len(chat_prompt_ids(server, engine, messages))
    assert data["id"].startswith("resp_") and data["object"] == "response"
    assert data["status"] == "completed" and data["incomplete_details"] is None
    assert data["model"] == MODEL and data["instructions"] == "Be brief"
    assert (data["temperature"], data["top_p"]) == (0.5, 0.9)
    [message] = data["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_") and message["status"] == "completed"
    assert message["content"] == [
        {"type": "output_text", "text": "Hello there", "annotations": [], "logprobs": []}
    ]
    assert data["usage"] == {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": prompt_tokens},
        "output_tokens": len("Hello there"),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + len("Hello there"),
    }
    assert data["tools"] == [] and data["tool_choice"] == "auto" and data["store"] is True


def test_message_items_render_as_chat_messages(server, engine):
    items = [
        {"role": "developer", "content": "Rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "A"}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "B", "annotations": [], "logprobs": []}],
        },
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "C"}, {"type": "input_text", "text": "D"}],
        },
    ]
    create(server, engine, "ok", {"input": items})
    messages = [
        {"role": "developer", "content": "Rules"},
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B"},
        {"role": "user", "content": "CD"},
    ]
    assert last_prompt_ids(engine) == chat_prompt_ids(server, engine, messages)


def test_the_openai_client_reads_output_text(client, engine):
    engine.reply = "client text"
    response = client.responses.create(model=MODEL, input="Hi")
    assert response.output_text == "client text" and response.status == "completed"


def test_max_output_tokens_cut_is_incomplete(server, engine):
    data = create(server, engine, "a long reply", {"input": "Hi", "max_output_tokens": 4})
    assert data["status"] == "incomplete"
    assert data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert output_text(data) == "a lo" and data["output"][0]["status"] == "incomplete"
    assert data["usage"]["output_tokens"] == 4 and data["max_output_tokens"] == 4


# ---- streaming --------------------------------------------------------------------------------


def test_stream_events_in_order_and_equal_to_the_whole_response(server, engine):
    engine.reply = "Hello world"
    response = post(server, {"input": "Hi", "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in response.text
    events = sse_events(response)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    final = events[-1]["response"]
    Response.model_validate(final)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Hello world" == output_text(final) == events[-4]["text"]
    item_id = final["output"][0]["id"]
    assert all(e["item_id"] == item_id for e in events if "item_id" in e)
    assert events[-2]["item"] == final["output"][0]
    # The stored response is the streamed one.
    assert httpx.get(f"{server.url}/v1/responses/{final['id']}").json() == final


def test_streamed_cut_ends_with_response_incomplete(server, engine):
    engine.reply = "a long reply"
    events = sse_events(post(server, {"input": "Hi", "stream": True, "max_output_tokens": 3}))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert output_text(events[-1]["response"]) == "a l"


def test_the_openai_client_streams(client, engine):
    engine.reply = "streamed"
    with client.responses.stream(model=MODEL, input="Hi") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == "streamed" == final.output_text


# ---- tools ------------------------------------------------------------------------------------


def test_function_call_and_its_output_fed_back(server, engine):
    data = create(server, engine, CALL, {"input": "Weather in Paris?", "tools": [WEATHER]})
    assert data["tool_choice"] == "auto" and data["tools"][0]["name"] == "get_weather"
    [call] = data["output"]
    assert call["type"] == "function_call" and call["id"].startswith("fc_")
    assert call["call_id"].startswith("call_") and call["status"] == "completed"
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    # Fed back with its output: the chat round trip's prompt.
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "21 C, clear"},
    ]
    data = create(server, engine, "It is 21 C.", {"input": items, "tools": [WEATHER]})
    assert output_text(data) == "It is 21 C."
    chat_call = {
        "id": call["call_id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": call["arguments"]},
    }
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "21 C, clear"},
    ]
    expected = chat_prompt_ids(server, engine, messages, tools=[CHAT_WEATHER])
    create(server, engine, "x", {"input": items, "tools": [WEATHER]})
    assert last_prompt_ids(engine) == expected


def test_text_then_call_gives_a_message_and_a_call(server, engine):
    data = create(server, engine, "Let me look.\n" + CALL, {"input": "Hi", "tools": [WEATHER]})
    assert [item["type"] for item in data["output"]] == ["message", "function_call"]
    assert output_text(data) == "Let me look.\n"


def test_streamed_function_call_events(server, engine):
    engine.reply = CALL
    events = sse_events(post(server, {"input": "Hi", "tools": [WEATHER], "stream": True}))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2]["item"]["type"] == "function_call" and events[2]["item"]["arguments"] == ""
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    arguments = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    assert json.loads(arguments) == {"city": "Paris"} and events[-3]["arguments"] == arguments
    assert events[-1]["response"]["output"] == [events[-2]["item"]]


def test_named_tool_choice_is_the_call_arguments(server, engine):
    body = {
        "input": "Hi",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    data = create(server, engine, '{"city": "Rome"}', body)
    [call] = data["output"]
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Rome"}')
    assert data["tool_choice"] == {"type": "function", "name": "get_weather"}


def test_required_tool_choice_reads_the_calls(server, engine):
    reply = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    data = create(
        server, engine, reply, {"input": "Hi", "tools": [WEATHER], "tool_choice": "required"}
    )
    assert [(c["name"], json.loads(c["arguments"])) for c in data["output"]] == [
        ("get_weather", {"city": "Oslo"})
    ]


# ---- previous_response_id and the store ----------------------------------------------------


def test_previous_response_id_continues_the_conversation(server, engine):
    first = create(
        server, engine, "Paris.", {"input": "Capital of France?", "instructions": "Terse"}
    )
    second = create(
        server, engine, "Berlin.", {"input": "And Germany?", "previous_response_id": first["id"]}
    )
    assert second["previous_response_id"] == first["id"] and output_text(second) == "Berlin."
    # The earlier turn, not its instructions (OpenAI's rule), then the new input.
    messages = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And Germany?"},
    ]
    expected = chat_prompt_ids(server, engine, messages)
    create(server, engine, "x", {"input": "And Germany?", "previous_response_id": first["id"]})
    assert last_prompt_ids(engine) == expected
    # A third turn goes on from the second.
    create(server, engine, "x", {"input": "And Italy?", "previous_response_id": second["id"]})
    messages += [
        {"role": "assistant", "content": "Berlin."},
        {"role": "user", "content": "And Italy?"},
    ]
    assert last_prompt_ids(engine) == chat_prompt_ids(server, engine, messages)


def test_get_and_delete_a_stored_response(server, engine):
    data = create(server, engine, "kept", {"input": "Hi"})
    url = f"{server.url}/v1/responses/{data['id']}"
    assert httpx.get(url).json() == data
    deleted = httpx.delete(url)
    assert deleted.status_code == 200
    assert deleted.json() == {"id": data["id"], "object": "response", "deleted": True}
    for response in (httpx.get(url), httpx.delete(url)):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "response_not_found"
    missing = post(server, {"input": "Hi", "previous_response_id": data["id"]})
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "previous_response_id"


def test_store_false_keeps_nothing(server, engine):
    data = create(server, engine, "not kept", {"input": "Hi", "store": False})
    assert data["store"] is False
    assert httpx.get(f"{server.url}/v1/responses/{data['id']}").status_code == 404


def test_the_store_drops_the_least_recently_used(engine):
    with serve(engine, responses_store_size=2) as small:
        ids = [create(small, engine, "x", {"input": str(i)})["id"] for i in range(2)]
        assert httpx.get(f"{small.url}/v1/responses/{ids[0]}").status_code == 200  # used
        ids.append(create(small, engine, "x", {"input": "2"})["id"])
        found = [httpx.get(f"{small.url}/v1/responses/{i}").status_code for i in ids]
        assert found == [200, 404, 200]


def test_a_disabled_store_refuses_previous_response_id_and_logs_store(engine, caplog):
    with serve(engine, responses_store_size=0) as off:
        with caplog.at_level(logging.WARNING):
            data = create(off, engine, "x", {"input": "Hi", "store": True})
        assert "store (the server keeps no responses" in caplog.text
        assert data["store"] is False  # nothing was kept
        assert httpx.get(f"{off.url}/v1/responses/{data['id']}").status_code == 404
        refused = post(off, {"input": "Hi", "previous_response_id": data["id"]})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "previous_response_id"
        assert "--responses-store-size 0" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("metadata", {"k": 5}),  # values are strings
        ("metadata", "x"),
        ("metadata", {f"k{i}": "v" for i in range(17)}),  # at most 16 pairs
        ("metadata", {"\ud800": "v"}),  # echoed: a key must be valid Unicode too
        ("service_tier", 3),
        ("safety_identifier", ["s"]),
        ("prompt_cache_retention", "forever"),
        ("reasoning", {"effort": "ultra"}),
    ],
)
def test_fields_without_effect_still_have_openais_types(server, field, value):
    """Accepted without effect is not accepted whatever it holds: a 400 naming the field, as
    OpenAI answers (and the response's echo of metadata stays valid for the SDK)."""
    response = post(server, {"input": "Hi", field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_response_store_unit():
    store = ResponseStore(2)
    stored = [StoredResponse({"id": str(i)}, ()) for i in range(3)]
    for i, s in enumerate(stored):
        store.put(str(i), s)
    assert len(store) == 2 and store.get("0") is None and store.get("2") is stored[2]
    assert store.delete("1") and not store.delete("1") and len(store) == 1
    off = ResponseStore(0)
    off.put("x", stored[0])
    assert not off.enabled and off.get("x") is None
    with pytest.raises(Exception, match="responses-store-size"):
        ResponseStore(-1)


# ---- refused, ignored and unknown fields --------------------------------------------------


@pytest.mark.parametrize("field", sorted(REFUSED_RESPONSES))
def test_refused_fields_are_a_400_naming_them(server, field):
    response = post(server, {"input": "Hi", field: REFUSED_RESPONSES[field].example})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_field"
    assert f"`{field}`" in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "built-in tool 'web_search'"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools", "file_search"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools", "'mcp'"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools", "code_interpreter"),
        ({"tools": [{"type": "image_generation"}]}, "tools", "image_generation"),
        ({"tools": [{"type": "computer_use_preview"}]}, "tools", "computer_use_preview"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
        ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice", "allowed_tools"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "'reasoning'"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input",
            "only text content",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "input",
            "only text content",
        ),
        ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning", "summar"),
        ({"include": ["file_search_call.results"]}, "include", "include"),
        ({"background": True}, "background", "background"),
        ({"tool_choice": "required"}, "tool_choice", "needs a non-empty `tools`"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "tool_choice",
            "`text.format`",
        ),
        ({"max_output_tokens": 5000}, "max_output_tokens", "max_output_tokens"),
        ({"input": []}, "input", "`input` is required"),
        ({"foo_bar": 1}, "foo_bar", "Unrecognized request argument supplied: foo_bar"),
        ({"input": [{"role": "user", "content": "x", "foo": 1}]}, "input", "input[0].foo"),
        ({"tools": [{**WEATHER, "extra": 1}]}, "tools", "tools[0].extra"),
        ({"model": "other"}, "model", "other"),
    ],
)
def test_what_is_not_served_is_a_400_naming_the_field(server, body, param, words):
    response = post(server, {"input": "Hi", **body})
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    "body",
    [
        {"include": ["reasoning.encrypted_content"]},
        {"include": []},
        {"reasoning": {"effort": "low"}},
        {"truncation": "disabled"},
        {"background": False},
        {"top_logprobs": 0},
        {"text": {"format": {"type": "text"}, "verbosity": "low"}},
        {"parallel_tool_calls": False, "tools": [WEATHER], "tool_choice": "none"},
        {"seed": 7},
    ],
)
def test_no_op_values_are_accepted(server, engine, body):
    create(server, engine, "ok", {"input": "Hi", **body})


def test_ignored_fields_in_one_warning_line(server, engine, caplog):
    body = {
        "input": "Hi",
        "user": "u",
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "reasoning": {"effort": "high"},
        "text": {"verbosity": "high"},
    }
    with caplog.at_level(logging.WARNING):
        data = create(server, engine, "ok", body)
    lines = [r.getMessage() for r in caplog.records if data["id"] in r.getMessage()]
    assert len(lines) == 1, lines
    for name in (
        "user",
        "metadata",
        "service_tier",
        "safety_identifier",
        "reasoning.effort",
        "text.verbosity",
    ):
        assert name in lines[0]
    assert "prompt_cache_key" not in lines[0]  # honoured: the cluster's routing key
    assert data["metadata"] == {"k": "v"} and data["user"] == "u"


def test_refused_examples_are_refused_by_the_model_itself():
    """Every refused field's example is refused by ``check_supported`` and its no-op kept."""
    for name, refused in REFUSED_RESPONSES.items():
        request = ResponsesRequest.model_validate({"input": "x", name: refused.example})
        with pytest.raises(Exception, match=name):
            request.check_supported()
        assert name in ResponsesRequest.model_fields


# ---- faults, cuts and the flag ------------------------------------------------------------------


def test_an_engine_failure_is_a_500_or_an_error_event(server, engine):
    from _server_fakes import FAIL_MARKER

    whole = post(server, {"input": FAIL_MARKER})
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "engine_error"
    events = sse_events(post(server, {"input": FAIL_MARKER, "stream": True}))
    assert events[-1]["type"] == "error" and events[-1]["code"] == "engine_error"
    assert "response.completed" not in [e["type"] for e in events]
    create(server, engine, "still serving", {"input": "Hi"})


def test_a_call_cut_by_max_output_tokens_is_incomplete_and_continues(server, engine):
    body = {
        "input": "Hi",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 6,
    }
    data = create(server, engine, '{"city": "Rome"}', body)
    [call] = data["output"]
    assert data["status"] == "incomplete" and call["status"] == "incomplete"
    assert call["arguments"] == '{"city'
    # Its arguments are no JSON object: the turn goes on as the assistant's text.
    create(server, engine, "x", {"input": "Go on", "previous_response_id": data["id"]})
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": '{"city'},
        {"role": "user", "content": "Go on"},
    ]
    assert last_prompt_ids(engine) == chat_prompt_ids(server, engine, messages)


def test_the_store_size_flag(capsys):
    from pagedkv.entrypoints.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--responses-store-size", "8"])
    assert args.responses_store_size == 8
    assert build_parser().parse_args(["serve"]).responses_store_size == 1024
    assert main(["serve", "--responses-store-size", "-1", "--port", "0"]) == 2
    assert "--responses-store-size must be >= 0" in capsys.readouterr().err
