"""The server's ``/openapi.json``, made to say what the app does.

FastAPI's generated schema documents a 422 for every body (the app answers 400, see errors.py),
JSON bodies for routes that answer none or text, no event streams, and none of the limits the
engine checks. :func:`install_openapi` replaces ``app.openapi`` with a schema built from
FastAPI's (paths, operation ids, parameters) and this module's table of every operation:

- **Responses**: each status an operation answers, with its body: OpenAI's error body
  (``ErrorResponse``) for every error, ``text/event-stream`` beside JSON for the completion
  routes (``stream: true``; each event's ``data`` is a chunk, an error body or ``[DONE]``),
  ``text/plain`` for ``/metrics``, no body for ``/health`` and ``/ping``, and
  ``{"success": false}`` with 409 for a refused ``/reset_prefix_cache``. No 422 anywhere.
- **Request bodies**: pydantic's schemas of the request models (protocol/schema.py adds what
  their validators check: null for a default, the values a refused field accepts, the rules
  between fields), plus what the engine checks, read from the engine client's
  :class:`~pagedkv.engine.input_processor.InputProcessor` when the app is made: token ids below
  ``vocab_size``, ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs`` at most
  ``max_logprobs`` (``serve --max-logprobs``), ``top_k`` at most the vocabulary, prompts within
  ``max_model_len`` (as many token ids, as many characters as could fit), ``priority`` 0 unless
  the engine schedules by priority, and SamplingParams' float ranges.
- **What no schema can say**: a request valid by the schema can still get a 400 for a rule
  between values (prompt + max_tokens beyond max_model_len, min_tokens above max_tokens, a chat
  template that refuses the messages...). Each such 400 names its field (``error.param``), and
  the operation's 400 response lists those fields in ``x-params-beyond-schema``, so that a
  schema fuzzer can tell these refusals from a schema that lies (tests/entrypoints/
  _openapi_fuzz.py does).

The integers are exact (FastAPI's own document turns ``2**63 - 1`` into the float ``2**63``,
which would allow one id too many).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagedkv.engine.input_processor import InputProcessor
from pagedkv.entrypoints.openai.protocol.embeddings import EmbeddingRequest, EmbeddingResponse
from pagedkv.entrypoints.openai.protocol.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedkv.entrypoints.openai.protocol.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from pagedkv.entrypoints.openai.protocol.responses_api import (
    ResponsesDeleted,
    ResponsesObject,
    ResponsesRequest,
    ResponsesStreamEvent,
)
from pagedkv.sampling_params import FLOAT_RANGES

JSON = "application/json"
EVENT_STREAM = "text/event-stream"
TEXT = "text/plain"
#: The extension of a 400 response that lists the fields whose rules go beyond the schema.
BEYOND_SCHEMA = "x-params-beyond-schema"

_REF = "#/components/schemas/{model}"
_REQUESTS = (
    CompletionRequest,
    ChatCompletionRequest,
    ResponsesRequest,
    TokenizeRequest,
    DetokenizeRequest,
    EmbeddingRequest,
)
_RESPONSES = (
    EmbeddingResponse,
    CompletionResponse,
    ChatCompletionResponse,
    ChatCompletionChunk,
    TokenizeResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ErrorResponse,
    ResponsesObject,
    ResponsesStreamEvent,
    ResponsesDeleted,
)


@dataclass(frozen=True, slots=True)
class DocumentedError:
    """An error status that something other than the routes answers (a middleware: 401 without
    the API key, 413 for a body too large...), to document on the operations it guards.

    Attributes:
        status: the HTTP status.
        description: when it is answered.
        applies: ``(method, path) -> bool``: the operations it can answer; default all.
    """

    status: int
    description: str
    applies: Callable[[str, str], bool] = lambda method, path: True


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What the engine checks that the schema states, read once from the input processor
    (:meth:`from_processor`, when the app is made: the tokenizer is not read later, from
    another thread than the input thread)."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    #: priority other than 0 needs --policy priority
    priority_scheduling: bool
    #: characters of the longest text that can fit in max_model_len tokens (None: no bound)
    max_prompt_chars: int | None
    #: the tokenizer turns "" into no tokens (no BOS): an empty text prompt is refused
    empty_text_is_empty: bool

    @classmethod
    def from_processor(cls, processor: InputProcessor) -> EngineLimits:
        return cls(
            vocab_size=processor.vocab_size,
            max_model_len=processor.max_model_len,
            max_logprobs=processor.max_logprobs,
            priority_scheduling=processor.policy == "priority",
            max_prompt_chars=processor.max_prompt_chars,
            empty_text_is_empty=processor.empty_text_is_empty,
        )


def install_openapi(
    app: FastAPI, processor: InputProcessor, *, extra_errors: Iterable[DocumentedError] = ()
) -> None:
    """Make ``app.openapi()`` (and so ``/openapi.json``) return this module's schema, built on
    first use, so that routes and middleware added after this call are in it.

    Args:
        app: the app whose routes are documented (each must be in :func:`_operations`; one
            that is not keeps FastAPI's documentation, without the 422).
        processor: the engine client's input processor, whose limits the schema states.
        extra_errors: statuses answered in front of the routes, documented on the operations
            they apply to.
    """
    limits = EngineLimits.from_processor(processor)
    extra = tuple(extra_errors)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, limits, extra)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_openapi(
    app: FastAPI, limits: EngineLimits, extra_errors: tuple[DocumentedError, ...] = ()
) -> dict[str, Any]:
    """The OpenAPI document of ``app`` (see the module docstring)."""
    document = get_openapi(
        title=app.title,
        version=app.version,
        openapi_version=app.openapi_version,
        description=app.description,
        routes=app.routes,
    )
    refs, schemas = _component_schemas()
    _state_engine_limits(schemas, limits)
    operations = _operations(refs)
    for path, path_item in document.get("paths", {}).items():
        for method, operation in path_item.items():
            doc = operations.get((method.upper(), path))
            if doc is None:
                operation.get("responses", {}).pop("422", None)
                continue
            operation.pop("requestBody", None)
            operation.update(copy.deepcopy(doc))
            for error in extra_errors:
                if error.applies(method.upper(), path):
                    operation["responses"][str(error.status)] = _error(error.description)
    document["components"] = {"schemas": schemas}
    return document


# --------------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------------


def _component_schemas() -> tuple[dict[type[BaseModel], str], dict[str, Any]]:
    """Every request and response model's schema, by pydantic (exact integers), and the
    ``$ref`` of each model."""
    keys, definitions = models_json_schema(
        [(model, "validation") for model in _REQUESTS]
        + [(model, "serialization") for model in _RESPONSES],
        ref_template=_REF,
    )
    refs = {model: keys[(model, mode)]["$ref"] for (model, mode) in keys}
    return refs, definitions.get("$defs", {})


def _integer_members(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The integer schemas of a property (itself, or its anyOf members)."""
    members = schema.get("anyOf", [schema])
    return [member for member in members if member.get("type") == "integer"]


def _bound(
    schema: dict[str, Any], *, minimum: float | None = None, maximum: float | None = None
) -> None:
    """Narrow a number schema's [minimum, maximum] (never widen it)."""
    if minimum is not None:
        schema["minimum"] = max(schema.get("minimum", minimum), minimum)
    if maximum is not None:
        schema["maximum"] = min(schema.get("maximum", maximum), maximum)


def decimal_below(limit: int) -> str:
    """A regular expression of the decimal strings (leading zeros allowed) of the integers in
    ``[0, limit)``: the token-id keys of ``logit_bias`` (JSON object keys are strings)."""
    top = str(limit - 1)
    alternatives = [f"[0-9]{{1,{len(top) - 1}}}"] if len(top) > 1 else []
    for i, digit in enumerate(top):
        low = 1 if i == 0 and len(top) > 1 else 0
        high = int(digit) - 1
        if high >= low:
            rest = len(top) - i - 1
            head = str(low) if high == low else f"[{low}-{high}]"
            tail = "" if rest == 0 else "[0-9]" if rest == 1 else f"[0-9]{{{rest}}}"
            alternatives.append(f"{top[:i]}{head}{tail}")
    alternatives.append(top)
    return f"^0*(?:{'|'.join(alternatives)})$"


def _state_engine_limits(schemas: dict[str, Any], limits: EngineLimits) -> None:
    """Add what the engine checks (InputProcessor and SamplingParams) to the request schemas."""
    max_id = limits.vocab_size - 1
    # A prompt leaves room for at least one generated token (echo with max_tokens 0 still
    # computes one), so it has at most max_model_len - 1 tokens; so has max_tokens.
    max_prompt_tokens = limits.max_model_len - 1

    def text(schema: dict[str, Any], *, generating: bool) -> None:
        if limits.max_prompt_chars is not None:
            schema["maxLength"] = limits.max_prompt_chars
        if generating and limits.empty_text_is_empty:
            schema["minLength"] = 1

    def token_ids(schema: dict[str, Any], max_items: int | None) -> None:
        _bound(schema["items"], maximum=max_id)
        if max_items is not None:
            schema["maxItems"] = max_items

    def sampling(props: dict[str, Any]) -> None:
        for name, (low, high) in FLOAT_RANGES.items():
            for member in props[name]["anyOf"]:
                if member.get("type") == "number":
                    _bound(member, minimum=low, maximum=high)
        for name in ("max_tokens", "max_completion_tokens"):
            for member in _integer_members(props.get(name, {})):
                _bound(member, maximum=max_prompt_tokens)
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            for member in _integer_members(props.get(name, {})):
                _bound(member, maximum=limits.max_logprobs)
        for member in _integer_members(props["top_k"]):
            _bound(member, maximum=limits.vocab_size)
        for member in props["stop_token_ids"]["anyOf"]:
            if member.get("type") == "array":
                token_ids(member, None)
        for member in props["logit_bias"]["anyOf"]:
            if member.get("type") == "object":
                number = member.pop("additionalProperties")
                member["patternProperties"] = {decimal_below(limits.vocab_size): number}
                member["additionalProperties"] = False
        if not limits.priority_scheduling:
            for member in _integer_members(props["priority"]):
                _bound(member, minimum=0, maximum=0)

    completion = schemas["CompletionRequest"]["properties"]
    sampling(completion)
    for member in completion["prompt"]["anyOf"]:
        if member.get("type") == "string":
            text(member, generating=True)
        elif member["items"].get("type") == "string":
            text(member["items"], generating=True)
        elif member["items"].get("type") == "integer":
            token_ids(member, max_prompt_tokens)
        else:
            token_ids(member["items"], max_prompt_tokens)

    sampling(schemas["ChatCompletionRequest"]["properties"])

    responses = schemas["ResponsesRequest"]["properties"]
    for name in ("temperature", "top_p"):
        low, high = FLOAT_RANGES[name]
        for member in responses[name]["anyOf"]:
            if member.get("type") == "number":
                _bound(member, minimum=low, maximum=high)
    for member in _integer_members(responses["max_output_tokens"]):
        _bound(member, maximum=max_prompt_tokens)

    for member in schemas["TokenizeRequest"]["properties"]["prompt"]["anyOf"]:
        if member.get("type") == "string":
            text(member, generating=False)
    token_ids(schemas["DetokenizeRequest"]["properties"]["tokens"], None)
    _state_embedding_limits(schemas["EmbeddingRequest"]["properties"], limits)


def _state_embedding_limits(props: dict[str, Any], limits: EngineLimits) -> None:
    """/v1/embeddings' inputs: texts that could fit, token ids in the vocabulary, at most
    max_model_len of them (nothing is generated: an input may fill it); priority 0 unless the
    engine schedules by priority."""
    max_id = limits.vocab_size - 1
    for member in props["input"]["anyOf"]:
        items = member.get("items", {})
        if member.get("type") == "string" or items.get("type") == "string":
            text = member if member.get("type") == "string" else items
            if limits.max_prompt_chars is not None:
                text["maxLength"] = limits.max_prompt_chars
            continue
        ids = member if items.get("type") == "integer" else items
        _bound(ids["items"], maximum=max_id)
        ids["maxItems"] = limits.max_model_len
    if not limits.priority_scheduling:
        for member in _integer_members(props["priority"]):
            _bound(member, minimum=0, maximum=0)


# --------------------------------------------------------------------------------------------
# Operations
# --------------------------------------------------------------------------------------------


def _error(description: str, **extensions: Any) -> dict[str, Any]:
    return {
        "description": description,
        "content": {JSON: {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
        **extensions,
    }


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _typed_events(event_ref: str) -> dict[str, Any]:
    """One server-sent event of a Responses stream: ``event`` names its type and ``data`` is
    its JSON (a typed event with its ``sequence_number``; an ``error`` event ends a failed
    stream). No ``[DONE]``, as OpenAI's."""
    return {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"type": "string"},
            "data": {"contentMediaType": JSON, "contentSchema": {"$ref": event_ref}},
        },
    }


def _events(chunk_ref: str) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.1 describes an event stream by its events):
    ``data`` is ``[DONE]`` (the last), or JSON: a chunk, or the error that ended the stream."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string"}},
        "if": {"properties": {"data": {"const": "[DONE]"}}},
        "else": {
            "properties": {
                "data": {
                    "contentMediaType": JSON,
                    "contentSchema": {
                        "anyOf": [
                            {"$ref": chunk_ref},
                            {"$ref": _REF.format(model="ErrorResponse")},
                        ]
                    },
                }
            }
        },
    }


_400 = (
    "The request is refused: malformed JSON, a field of the wrong type or out of range, a field "
    "pagedkv does not implement, or values that do not go together; `error.param` names the "
    "field."
)
_404 = "`model` names a model this server does not serve (`error.code`: `model_not_found`)."
_503 = "The engine is not running (it stopped after a fault); the message says why."
_500 = (
    "The engine failed this request inside a step (`error.code`: `engine_error`); the server "
    "goes on serving the others."
)


def _beyond(fields: tuple[str, ...], rules: str) -> dict[str, Any]:
    return _error(
        f"{_400} A request valid by this schema can still be refused for rules between values "
        f"that no schema states: {rules}. These name one of: "
        + ", ".join(f"`{f}`" for f in fields)
        + ".",
        **{BEYOND_SCHEMA: list(fields)},
    )


_GENERATION_RULES = (
    "the prompt's tokens + max_tokens beyond max_model_len or the KV cache, min_tokens above "
    "max_tokens (16 by default on completions), seed + n - 1 beyond 2**64 - 1, best_of other "
    "than n, use_beam_search with stream or a sampling field other than its default (or n "
    "beyond max_num_seqs), length_penalty other than 1 without use_beam_search, more than one "
    "structured output constraint (response_format json_object / json_schema, "
    "structured_outputs, guided_json / guided_regex / guided_choice / guided_grammar) or one "
    "that xgrammar cannot compile (a schema, regex or grammar), use_beam_search with one"
)
#: The fields of a structured output constraint (one at most; each must compile).
_CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
#: The fields the generation rules above name (both endpoints).
_GENERATION_FIELDS = (
    "max_tokens",
    "min_tokens",
    "seed",
    "best_of",
    "n",
    "use_beam_search",
    "length_penalty",
    *_CONSTRAINT_FIELDS,
)


def _operations(refs: dict[type[BaseModel], str]) -> dict[tuple[str, str], dict[str, Any]]:
    """Every operation of the app: its request body and its responses."""

    def body(model: type[BaseModel]) -> dict[str, Any]:
        return {"required": True, "content": {JSON: {"schema": {"$ref": refs[model]}}}}

    def generation(
        request: type[BaseModel], response: type[BaseModel], chunk: type[BaseModel]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        ok = {
            "description": "The completion: JSON, or with `stream: true` server-sent events "
            "(each `data:` a chunk, an error that ended the stream, or `[DONE]` last).",
            "content": {
                JSON: {"schema": {"$ref": refs[response]}},
                EVENT_STREAM: {"schema": _events(refs[chunk])},
            },
        }
        return ok, body(request)

    completion_ok, completion_body = generation(
        CompletionRequest, CompletionResponse, CompletionResponse
    )
    chat_ok, chat_body = generation(
        ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk
    )
    responses_ok = {
        "description": "The response object: JSON, or with `stream: true` server-sent events "
        "(`event:` its type, `data:` the event: `response.created`, `response.in_progress`, "
        "the output items' events, then `response.completed` or `response.incomplete`; an "
        "`error` event ends a failed stream).",
        "content": {
            JSON: {"schema": {"$ref": refs[ResponsesObject]}},
            EVENT_STREAM: {"schema": _typed_events(refs[ResponsesStreamEvent])},
        },
    }
    response_not_found = _error(
        "No response of this id is kept (never made, `store: false`, deleted or dropped from "
        "the server's store; `error.code`: `response_not_found`)."
    )
    health = {
        "responses": {
            "200": {"description": "The engine runs (no body)."},
            "503": _error(_503),
        }
    }
    return {
        ("GET", "/v1/models"): {
            "responses": {"200": _json("The served model.", {"$ref": refs[ModelList]})}
        },
        ("GET", "/v1/models/{model_id}"): {
            "responses": {
                "200": _json("The model's card.", {"$ref": refs[ModelCard]}),
                "404": _error("No model of this name is served (`model_not_found`)."),
            }
        },
        ("POST", "/v1/completions"): {
            "requestBody": completion_body,
            "responses": {
                "200": completion_ok,
                "400": _beyond(
                    ("prompt", *_GENERATION_FIELDS),
                    _GENERATION_RULES + ", a prompt text that tokenizes to no tokens",
                ),
                "404": _error(_404),
                "500": _error(_500),
                "503": _error(_503),
            },
        },
        ("POST", "/v1/chat/completions"): {
            "requestBody": chat_body,
            "responses": {
                "200": chat_ok,
                "400": _beyond(
                    (
                        "messages",
                        *_GENERATION_FIELDS,
                        "max_completion_tokens",
                        "continue_final_message",
                        "tool_choice",
                        "chat_template",
                        "chat_template_kwargs",
                    ),
                    _GENERATION_RULES + ", messages the model's chat template refuses or a "
                    "model without one, messages longer than could fit in max_model_len, "
                    "continue_final_message without an assistant's message last, tool_choice "
                    "'auto' without the server's --enable-auto-tool-choice, 'required' or a "
                    "named function without tools or the engine's structured outputs, a "
                    "function name not in tools, tool_calls on a message that is not the "
                    "assistant's, a request chat_template without --trust-request-chat-template, "
                    "chat_template_kwargs setting a request field",
                ),
                "404": _error(_404),
                "500": _error(_500),
                "503": _error(_503),
            },
        },
        ("POST", "/v1/responses"): {
            "requestBody": body(ResponsesRequest),
            "responses": {
                "200": responses_ok,
                "400": _beyond(
                    (
                        "input",
                        "instructions",
                        "max_output_tokens",
                        "text",
                        "tools",
                        "tool_choice",
                        "seed",
                        "previous_response_id",
                    ),
                    "the input's tokens + max_output_tokens beyond max_model_len or the KV "
                    "cache, input the model's chat template refuses (or a model without one) "
                    "or none at all, a text.format schema xgrammar cannot compile, "
                    "tool_choice 'auto' without the server's --enable-auto-tool-choice, "
                    "'required' or a named function without tools (or combined with a "
                    "text.format json), a function name not in tools, seed + 1 beyond "
                    "2**64 - 1, previous_response_id on a server that keeps no responses",
                ),
                "404": _error(
                    _404 + " Or `previous_response_id` names no kept response "
                    "(`response_not_found`)."
                ),
                "500": _error(_500),
                "503": _error(_503),
            },
        },
        ("POST", "/v1/embeddings"): {
            "requestBody": body(EmbeddingRequest),
            "responses": {
                "200": _json(
                    "One embedding per input, in input order: numbers, or with "
                    "`encoding_format: base64` the base64 of little-endian float32 bytes.",
                    {"$ref": refs[EmbeddingResponse]},
                ),
                "400": _beyond(
                    ("input",),
                    "an input text of more than max_model_len tokens, or one that needs more KV "
                    "blocks than the whole pool",
                ),
                "404": _error(_404),
                "500": _error(_500),
                "503": _error(_503),
            },
        },
        ("GET", "/v1/responses/{response_id}"): {
            "responses": {
                "200": _json("The kept response object.", {"$ref": refs[ResponsesObject]}),
                "404": response_not_found,
            }
        },
        ("DELETE", "/v1/responses/{response_id}"): {
            "responses": {
                "200": _json("The response was forgotten.", {"$ref": refs[ResponsesDeleted]}),
                "404": response_not_found,
            }
        },
        ("POST", "/tokenize"): {
            "requestBody": body(TokenizeRequest),
            "responses": {
                "200": _json("The token ids.", {"$ref": refs[TokenizeResponse]}),
                "400": _beyond(
                    ("prompt", "messages"),
                    "a text of more than max_model_len tokens, messages the model's chat "
                    "template refuses or a model without one",
                ),
                "404": _error(_404),
            },
        },
        ("POST", "/detokenize"): {
            "requestBody": body(DetokenizeRequest),
            "responses": {
                "200": _json("The text.", {"$ref": refs[DetokenizeResponse]}),
                "400": _error(_400),
                "404": _error(_404),
            },
        },
        ("GET", "/tokenizer_info"): {
            "responses": {
                "200": _json(
                    "The tokenizer's class, limits, special tokens and chat template.",
                    {"type": "object"},
                )
            }
        },
        ("GET", "/version"): {
            "responses": {
                "200": _json(
                    "pagedkv's version.",
                    {
                        "type": "object",
                        "required": ["version"],
                        "properties": {"version": {"type": "string"}},
                    },
                )
            }
        },
        ("GET", "/health"): health,
        ("GET", "/ping"): health,
        ("POST", "/ping"): health,
        ("GET", "/metrics"): {
            "responses": {
                "200": {
                    "description": "Prometheus metrics, text exposition format 0.0.4.",
                    "content": {TEXT: {"schema": {"type": "string"}}},
                },
                "503": _error(_503),
            }
        },
        ("GET", "/kv/state"): {
            "responses": {
                "200": _json(
                    "A snapshot of the KV cache: block states, free block queue, block tables, "
                    "counters.",
                    {"type": "object"},
                ),
                "503": _error(_503),
            }
        },
        ("GET", "/kv/events"): {
            "responses": {
                "200": {
                    "description": "KV cache snapshots as server-sent events (`event: state`, "
                    "`data:` a snapshot as /kv/state gives it), a few a second while the "
                    "engine runs, a keep-alive comment when it idles; the stream ends when the "
                    "engine stops.",
                    "content": {
                        EVENT_STREAM: {
                            "schema": {
                                "type": "object",
                                "required": ["event", "data"],
                                "properties": {
                                    "event": {"const": "state"},
                                    "data": {
                                        "type": "string",
                                        "contentMediaType": JSON,
                                        "contentSchema": {"type": "object"},
                                    },
                                },
                            }
                        }
                    },
                },
                "503": _error(_503),
            }
        },
        ("POST", "/reset_prefix_cache"): {
            "responses": {
                "200": _json("Every cached block was dropped.", _success(True)),
                "409": _json("Blocks are in use; nothing was dropped.", _success(False)),
                "503": _error(_503),
            }
        },
    }


def _success(value: bool) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["success"],
        "properties": {"success": {"const": value}},
    }
