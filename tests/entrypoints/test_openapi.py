"""/openapi.json says what the app does (src/pagedkv/entrypoints/openai/openapi.py), one lie of
the old schema at a time; test_server_fuzz.py runs schemathesis with every check over all of it.

The app runs over the fake engine (_server_fakes.py): one token per character, vocabulary
0x110000 (the code points), max_model_len 64 here.
"""

from __future__ import annotations

import json
import re
import warnings

import httpx
import pytest
from _server_fakes import FakeEngine

from pagedkv.engine.engine_loop import EngineLoop
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.launch import ThreadedServer
from pagedkv.entrypoints.openai.openapi import (
    BEYOND_SCHEMA,
    DocumentedError,
    decimal_below,
    install_openapi,
)
from pagedkv.entrypoints.openai.server_options import ServerOptions
from pagedkv.sampling_params import FLOAT32_MIN_NORMAL, INT64_MAX

MODEL = "schema-model"
MAX_MODEL_LEN = 64
VOCAB = FakeEngine.vocab_size
ERROR_REF = "#/components/schemas/ErrorResponse"


def serve(**engine_options) -> ThreadedServer:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, **engine_options)
    admin = ServerOptions(enable_admin_routes=True)  # POST /reset_prefix_cache documented too
    return ThreadedServer(create_app(EngineLoop(engine), model_name=MODEL, options=admin))


@pytest.fixture(scope="module")
def server():
    with serve() as running:
        yield running


@pytest.fixture(scope="module")
def schema(server):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of duplicate operation ids
        return httpx.get(server.url + "/openapi.json").json()


def operations(schema):
    return {
        (method.upper(), path): operation
        for path, item in schema["paths"].items()
        for method, operation in item.items()
    }


def request_properties(schema, model: str) -> dict:
    return schema["components"]["schemas"][model]["properties"]


def integer_member(prop: dict) -> dict:
    (member,) = [m for m in prop.get("anyOf", [prop]) if m.get("type") == "integer"]
    return member


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


# ---- statuses and bodies ------------------------------------------------------------------------


def test_every_route_is_documented_once_with_a_unique_operation_id(schema):
    ops = operations(schema)
    assert set(ops) == {
        ("GET", "/v1/models"),
        ("GET", "/v1/models/{model_id}"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/{response_id}"),
        ("DELETE", "/v1/responses/{response_id}"),
        ("POST", "/v1/embeddings"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/tokenizer_info"),
        ("GET", "/version"),
        ("GET", "/health"),
        ("GET", "/ping"),
        ("POST", "/ping"),
        ("GET", "/metrics"),
        ("POST", "/reset_prefix_cache"),
    }
    ids = [op["operationId"] for op in ops.values()]
    assert len(ids) == len(set(ids)), ids
    assert {ops["GET", "/ping"]["operationId"], ops["POST", "/ping"]["operationId"]} == {
        "ping_get",
        "ping_post",
    }


def test_no_422_and_every_error_is_an_openai_error_body(schema):
    for key, op in operations(schema).items():
        assert "422" not in op["responses"], key
        for status, response in op["responses"].items():
            if status.startswith(("4", "5")) and key != ("POST", "/reset_prefix_cache"):
                assert response["content"] == {"application/json": {"schema": {"$ref": ERROR_REF}}}
    assert "HTTPValidationError" not in schema["components"]["schemas"]


@pytest.mark.parametrize(
    ("method", "path", "statuses"),
    [
        ("POST", "/v1/completions", {"200", "400", "404", "500", "503"}),
        ("POST", "/v1/chat/completions", {"200", "400", "404", "500", "503"}),
        ("POST", "/tokenize", {"200", "400", "404"}),
        ("POST", "/detokenize", {"200", "400", "404"}),
        ("GET", "/v1/models/{model_id}", {"200", "404"}),
        ("GET", "/health", {"200", "503"}),
        ("POST", "/ping", {"200", "503"}),
        ("GET", "/metrics", {"200", "503"}),
        ("POST", "/reset_prefix_cache", {"200", "409", "503"}),
        ("GET", "/version", {"200"}),
    ],
)
def test_the_statuses_each_operation_answers(schema, method, path, statuses):
    # The request guard answers in front of the routes (server_options.py): a foreign Origin
    # or Host (403) anywhere, and body limits (408, 413, 415) where a body may come.
    guard = {"403"} | ({"408", "413", "415"} if method == "POST" else set())
    assert set(operations(schema)[method, path]["responses"]) == statuses | guard


def test_a_400_is_answered_and_documented(server, schema):
    # The old schema documented 200 and 422 for these; the app answers 400.
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        headers = {"content-type": "application/json"}
        response = httpx.post(server.url + path, content=b"{", headers=headers, timeout=60)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_json"
        assert "400" in operations(schema)["POST", path]["responses"]
    response = httpx.get(server.url + "/v1/models/other")
    assert response.status_code == 404
    assert "404" in operations(schema)["GET", "/v1/models/{model_id}"]["responses"]


def test_streams_are_documented_as_event_streams(server, schema):
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ):
        ok = operations(schema)["POST", path]["responses"]["200"]["content"]
        assert set(ok) == {"application/json", "text/event-stream"}
        events = ok["text/event-stream"]["schema"]
        assert events["required"] == ["data"] and events["if"]["properties"]["data"]["const"]
        response = post(server, path, {**body, "max_tokens": 2})
        assert response.headers["content-type"].startswith("text/event-stream")
        datas = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert datas[-1] == "[DONE]" and all(json.loads(d)["id"] for d in datas[:-1])


def test_metrics_are_text_and_health_has_no_body(server, schema):
    ops = operations(schema)
    assert set(ops["GET", "/metrics"]["responses"]["200"]["content"]) == {"text/plain"}
    response = httpx.get(server.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        assert "content" not in ops[method, path]["responses"]["200"]
        response = httpx.request(method, server.url + path)
        assert response.status_code == 200 and response.content == b""
        assert "content-type" not in response.headers


def test_a_refused_prefix_cache_reset_is_a_documented_409(schema):
    responses = operations(schema)["POST", "/reset_prefix_cache"]["responses"]
    for status, success in (("200", True), ("409", False)):
        body = responses[status]["content"]["application/json"]["schema"]
        assert body["properties"]["success"] == {"const": success}


def test_405_names_every_method_of_the_path(server):
    # /ping is two routes (GET, POST): the 405 used to say Allow: GET.
    for method in ("DELETE", "PUT", "OPTIONS"):
        response = httpx.request(method, server.url + "/ping")
        assert response.status_code == 405
        assert response.headers["allow"] == "GET, POST"
        assert response.json()["error"]["message"] == "Method Not Allowed"
    assert httpx.get(server.url + "/v1/completions").headers["allow"] == "POST"
    assert httpx.post(server.url + "/health").headers["allow"] == "GET"


# ---- request schemas: what the app accepts -----------------------------------------------------


def test_token_ids_stop_below_the_vocabulary(server, schema):
    prompt = request_properties(schema, "CompletionRequest")["prompt"]["anyOf"]
    ids = [m for m in prompt if m.get("type") == "array" and m["items"].get("type") == "integer"]
    assert ids[0]["items"]["maximum"] == VOCAB - 1
    assert ids[0]["maxItems"] == MAX_MODEL_LEN - 1
    tokens = request_properties(schema, "DetokenizeRequest")["tokens"]
    assert tokens["items"]["maximum"] == VOCAB - 1
    stop_ids = request_properties(schema, "ChatCompletionRequest")["stop_token_ids"]["anyOf"][0]
    assert stop_ids["items"]["maximum"] == VOCAB - 1
    # The app agrees at the edge: the last id is a token, the next is not.
    assert post(server, "/detokenize", {"tokens": [VOCAB - 1]}).status_code == 200
    assert post(server, "/detokenize", {"tokens": [VOCAB]}).status_code == 400
    ok = post(server, "/v1/completions", {"prompt": [VOCAB - 1], "max_tokens": 1})
    assert ok.status_code == 200
    assert post(server, "/v1/completions", {"prompt": [VOCAB], "max_tokens": 1}).status_code == 400


def test_logit_bias_keys_are_token_ids_of_the_vocabulary(server, schema):
    bias = request_properties(schema, "CompletionRequest")["logit_bias"]["anyOf"][0]
    (pattern,) = bias["patternProperties"]
    assert bias["additionalProperties"] is False
    for key, valid in (("0", True), (str(VOCAB - 1), True), (str(VOCAB), False), ("-1", False)):
        assert bool(re.search(pattern, key)) is valid, key
        body = {"prompt": "hi", "max_tokens": 1, "logit_bias": {key: 1.0}}
        assert (post(server, "/v1/completions", body).status_code == 200) is valid, key


def test_decimal_below_matches_exactly_the_ids_below_the_limit():
    for limit in [*range(1, 130), 1000, 1001, 32000, 151936]:
        pattern = re.compile(decimal_below(limit))
        for value in [*range(min(limit + 20, 2000)), limit - 1, limit, limit + 1, 10 * limit]:
            assert bool(pattern.fullmatch(str(value))) is (value < limit), (limit, value)
            assert bool(pattern.fullmatch("00" + str(value))) is (value < limit), (limit, value)
        assert not pattern.fullmatch("") and not pattern.fullmatch("1a")


def test_the_logprobs_limit_is_the_engines():
    # `serve --max-logprobs 50`: 21 used to be a 400 (protocol.py's own bound of 20).
    with serve(max_logprobs=50) as server:
        schema = httpx.get(server.url + "/openapi.json").json()
        for model, field in (
            ("CompletionRequest", "logprobs"),
            ("CompletionRequest", "prompt_logprobs"),
            ("ChatCompletionRequest", "top_logprobs"),
            ("ChatCompletionRequest", "prompt_logprobs"),
        ):
            assert integer_member(request_properties(schema, model)[field])["maximum"] == 50
        body = {"prompt": "hi", "max_tokens": 2}
        response = post(server, "/v1/completions", {**body, "logprobs": 21})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 21
        messages = [{"role": "user", "content": "hi"}]
        chat = {"messages": messages, "max_tokens": 2, "logprobs": True, "top_logprobs": 50}
        response = post(server, "/v1/chat/completions", chat)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 50
        response = post(server, "/v1/completions", {**body, "logprobs": 51})
        assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"


def test_tokenize_messages_need_one_message(server, schema):
    messages = request_properties(schema, "TokenizeRequest")["messages"]["anyOf"][0]
    assert messages["minItems"] == 1
    response = post(server, "/tokenize", {"messages": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    rules = schema["components"]["schemas"]["TokenizeRequest"]["allOf"]
    assert any("oneOf" in rule for rule in rules)  # exactly one of prompt and messages


def test_numbers_are_exact_and_ranges_are_the_engines(schema):
    completion = request_properties(schema, "CompletionRequest")
    top_k = integer_member(completion["top_k"])
    assert top_k["maximum"] == VOCAB and type(top_k["maximum"]) is int
    # Exact int64 bounds: FastAPI's own document wrote 2**63 - 1 as the float 2**63.
    seed = integer_member(completion["seed"])
    assert seed["maximum"] == 2**64 - 1 and type(seed["maximum"]) is int
    assert integer_member(completion["min_tokens"])["maximum"] == INT64_MAX
    top_p = next(m for m in completion["top_p"]["anyOf"] if m.get("type") == "number")
    assert (top_p["minimum"], top_p["maximum"]) == (FLOAT32_MIN_NORMAL, 1.0)
    temperature = next(m for m in completion["temperature"]["anyOf"] if m.get("type") == "number")
    assert (temperature["minimum"], temperature["maximum"]) == (0.0, 2.0)
    # fcfs scheduling: a priority other than 0 is a 400.
    assert integer_member(completion["priority"]) | {"type": "integer"} == {
        "type": "integer",
        "minimum": 0,
        "maximum": 0,
    }
    assert integer_member(completion["max_tokens"])["maximum"] == MAX_MODEL_LEN - 1
    text = next(m for m in completion["prompt"]["anyOf"] if m.get("type") == "string")
    assert (text["minLength"], text["maxLength"]) == (1, MAX_MODEL_LEN)


def test_null_means_the_default_in_the_schema_too(server, schema):
    completion = request_properties(schema, "CompletionRequest")
    for name in ("temperature", "n", "stream", "top_k", "echo"):
        assert {"type": "null"} in completion[name]["anyOf"], name
    body = {"prompt": "hi", "max_tokens": 1, "temperature": None, "n": None, "stream": None}
    assert post(server, "/v1/completions", body).status_code == 200


def test_refused_fields_accept_in_the_schema_what_the_app_accepts(server, schema):
    chat = request_properties(schema, "ChatCompletionRequest")
    assert chat["function_call"]["enum"] == [None, "none"]
    messages = [{"role": "user", "content": "hi"}]
    for extra, status in (
        ({"use_beam_search": False}, 200),
        ({"use_beam_search": True, "n": 2, "max_tokens": 2}, 200),
        ({"use_beam_search": True, "top_p": 0.5}, 400),
        ({"length_penalty": 1.0}, 200),
        ({"length_penalty": 2.0}, 400),  # without use_beam_search
        ({"length_penalty": True}, 400),  # True == 1 in Python: it used to pass as a no-op
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, 200),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, 400),  # no function
        # "auto" (the default with tools) on a server without --enable-auto-tool-choice
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
        ({"function_call": "auto"}, 400),
    ):
        response = post(server, "/v1/chat/completions", {"messages": messages, **extra})
        assert response.status_code == status, (extra, response.text)


def test_integral_floats_are_integers_as_json_schema_says(server, schema):
    # JSON Schema's "integer" takes 2.0; the app used to refuse it (strict pydantic ints).
    assert integer_member(request_properties(schema, "CompletionRequest")["n"])["maximum"] == 128
    body = {"prompt": [104.0, 105], "max_tokens": 2.0, "n": 2.0, "seed": 3.0}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
    response = post(server, "/v1/completions", {"prompt": "hi", "n": 1.5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_refusals_beyond_the_schema_are_listed_and_named(server, schema):
    responses = operations(schema)["POST", "/v1/completions"]["responses"]
    beyond = responses["400"][BEYOND_SCHEMA]
    constraints = {"response_format", "structured_outputs"}
    constraints |= {f"guided_{k}" for k in ("json", "regex", "choice", "grammar")}
    beam_search = {"n", "use_beam_search", "length_penalty"}
    expected = {"prompt", "max_tokens", "min_tokens", "seed", "best_of", *constraints, *beam_search}
    assert expected == set(beyond)
    # Beam search with a sampling field: valid by the schema, refused naming use_beam_search.
    body = {"prompt": "hi", "use_beam_search": True, "top_k": 5}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "use_beam_search"
    # Valid by the schema, refused as xgrammar cannot compile it.
    response = post(server, "/v1/completions", {"prompt": "x", "guided_regex": "(a"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_regex"
    # Valid by the schema (each value within its own range), refused for their sum.
    body = {"prompt": "x" * (MAX_MODEL_LEN - 2), "max_tokens": MAX_MODEL_LEN - 1}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] in beyond
    # A chat request's prompt is its messages (the engine's "prompt" used to leak through).
    chat_beyond = operations(schema)["POST", "/v1/chat/completions"]["responses"]["400"]
    long_chat = {"messages": [{"role": "user", "content": "x" * (MAX_MODEL_LEN - 3)}]}
    response = post(server, "/v1/chat/completions", long_chat)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"
    assert "messages" in chat_beyond[BEYOND_SCHEMA]
    assert BEYOND_SCHEMA not in operations(schema)["POST", "/detokenize"]["responses"]["400"]


def test_errors_answered_in_front_of_the_routes_can_be_documented():
    # A middleware's statuses (401 without the API key on all but the probes...).
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN)
    app = create_app(EngineLoop(engine), model_name=MODEL)
    open_paths = {"/health", "/ping", "/metrics", "/version"}
    install_openapi(
        app,
        engine.input_processor,
        extra_errors=[
            DocumentedError(401, "no API key", lambda method, path: path not in open_paths),
            DocumentedError(413, "body too large", lambda method, path: method == "POST"),
        ],
    )
    ops = operations(app.openapi())
    assert "401" in ops["POST", "/v1/completions"]["responses"]
    assert "401" not in ops["GET", "/health"]["responses"]
    assert "413" in ops["POST", "/ping"]["responses"]
    assert "413" not in ops["GET", "/ping"]["responses"]
    assert ops["GET", "/v1/models"]["responses"]["401"]["content"] == {
        "application/json": {"schema": {"$ref": ERROR_REF}}
    }


def test_request_bodies_allow_no_unknown_field(server, schema):
    """Every request model and the models inside it say `additionalProperties: false`, as the
    app answers a field it does not know with a 400 naming it."""
    components = schema["components"]["schemas"]
    requests = [name for name in components if name.endswith("Request")]
    assert set(requests) >= {
        "CompletionRequest",
        "ChatCompletionRequest",
        "TokenizeRequest",
        "DetokenizeRequest",
    }
    for name in (*requests, "ChatMessage", "ContentPart", "ChatTool", "FunctionDefinition"):
        assert components[name]["additionalProperties"] is False, name
    # name (OpenAI's, passed to the chat template) is a known field of a message.
    assert "name" in components["ChatMessage"]["properties"]
    response = post(server, "/v1/chat/completions", {"messages": [], "foo_bar": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "foo_bar"
