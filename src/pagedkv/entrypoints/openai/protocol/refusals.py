"""The known request fields pagedkv does not implement, and the error that refuses them.

A known field (OpenAI's or vLLM's) that pagedkv does not implement is refused with a 400 naming
it when it asks for something (``suffix``, ``audio``, ``logits_processors``, ...): each request
model lists them in ``REFUSED`` (the tables below) with the values that ask for nothing, which
``check_supported`` lets through and the OpenAPI schema states (schema.py). Known fields without
effect on the output (``user``, ``metadata``...: ``IGNORED``) are accepted and named in one
warning log line per request, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class UnsupportedFieldError(Exception):
    """A request field pagedkv refuses (the server answers 400 naming ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


#: JSON Schema of null (these schemas are copied into every generated schema, never changed).
NULL_SCHEMA: dict[str, Any] = {"type": "null"}
#: null, [] or {}: what an empty list or map field accepts.
EMPTY_SCHEMA: dict[str, Any] = {
    "anyOf": [NULL_SCHEMA, {"type": "array", "maxItems": 0}, {"type": "object", "maxProperties": 0}]
}


@dataclass(frozen=True, slots=True)
class NoOp:
    """The values of a refused field that ask for nothing: ``test(value, request)`` says it, and
    ``schema`` says it as JSON Schema (the request's OpenAPI schema, so that it accepts exactly
    what the server does; None: the model's ``SCHEMA_RULES`` state it, as it depends on another
    field)."""

    test: Callable[[Any, Any], bool]  # (value, the whole request) -> ok
    schema: dict[str, Any] | None

    def __call__(self, value: Any, request: Any) -> bool:
        return self.test(value, request)


@dataclass(frozen=True, slots=True)
class Refused:
    """A known field pagedkv does not implement: ``accepts(value, request)`` is True for the
    values that ask for nothing (the field's no-op), anything else is a 400 naming the field and
    ``why``; ``example`` is a refused value (the contract test sends it)."""

    accepts: NoOp
    why: str
    example: Any


_absent = NoOp(lambda value, request: value is None, NULL_SCHEMA)
_false = NoOp(lambda value, request: value is None or value is False, {"enum": [None, False]})
_empty = NoOp(lambda value, request: value is None or value == [] or value == {}, EMPTY_SCHEMA)
_text_modality = NoOp(
    lambda value, request: value is None or value == ["text"],
    {"anyOf": [NULL_SCHEMA, {"type": "array", "const": ["text"]}]},
)
_function_call = NoOp(
    lambda value, request: value is None or value == "none", {"enum": [None, "none"]}
)

_NOT_IMPLEMENTED = "is not supported by pagedkv"

#: Known fields of both endpoints that pagedkv refuses when they ask for something.
REFUSED_COMMON: dict[str, Refused] = {
    "allowed_token_ids": Refused(_absent, "allowed_token_ids " + _NOT_IMPLEMENTED, [1, 2]),
    "bad_words": Refused(_empty, "bad_words " + _NOT_IMPLEMENTED, ["bad"]),
    "truncate_prompt_tokens": Refused(_absent, "prompt truncation " + _NOT_IMPLEMENTED, 8),
    "logits_processors": Refused(_empty, "custom logits processors " + _NOT_IMPLEMENTED, ["x"]),
    "return_tokens_as_token_ids": Refused(
        _false, "return_tokens_as_token_ids " + _NOT_IMPLEMENTED, True
    ),
    "prompt_embeds": Refused(_absent, "prompt embeddings " + _NOT_IMPLEMENTED, "AAAA"),
    "kv_transfer_params": Refused(_absent, "KV transfer " + _NOT_IMPLEMENTED, {"x": 1}),
    "vllm_xargs": Refused(_empty, "vllm_xargs " + _NOT_IMPLEMENTED, {"x": 1}),
    # Ignoring it would return text nobody moderated as if it had been.
    "moderation": Refused(_absent, "moderation " + _NOT_IMPLEMENTED, {"model": "x"}),
}

#: Known fields of /v1/completions that pagedkv refuses when they ask for something.
REFUSED_COMPLETION: dict[str, Refused] = {
    **REFUSED_COMMON,
    "suffix": Refused(_absent, "suffix (insertion) " + _NOT_IMPLEMENTED, "tail"),
}

#: Known fields of /v1/chat/completions that pagedkv refuses when they ask for something.
REFUSED_CHAT: dict[str, Refused] = {
    **REFUSED_COMMON,
    "functions": Refused(_empty, "function calling " + _NOT_IMPLEMENTED, [{"name": "f"}]),
    "function_call": Refused(_function_call, "function calling " + _NOT_IMPLEMENTED, "auto"),
    "audio": Refused(_absent, "audio output " + _NOT_IMPLEMENTED, {"voice": "alloy"}),
    "modalities": Refused(_text_modality, "only text output is supported", ["text", "audio"]),
    "prediction": Refused(_absent, "predicted outputs " + _NOT_IMPLEMENTED, {"type": "content"}),
    "web_search_options": Refused(_absent, "web search " + _NOT_IMPLEMENTED, {}),
    "echo": Refused(_false, "echo on chat completions " + _NOT_IMPLEMENTED, True),
    "documents": Refused(_empty, "documents " + _NOT_IMPLEMENTED, [{"text": "x"}]),
    "mm_processor_kwargs": Refused(_empty, "multimodal input " + _NOT_IMPLEMENTED, {"x": 1}),
}

#: Known fields without any effect on the output of a local server: accepted, named in the
#: warning line (docs/server.md's table gives each one's reason): an end user's id for abuse
#: monitoring (``user``, ``safety_identifier``), tags (``metadata``), OpenAI's storage of
#: completions (``store``), its processing tiers (``service_tier``), the caller's id (the server
#: makes its own), and how long OpenAI keeps a prompt cache (``prompt_cache_retention``,
#: ``prompt_cache_options``: pagedkv's prefix cache keeps blocks until they are evicted, LRU).
IGNORED_COMMON = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "request_id",
    "safety_identifier",
    "prompt_cache_retention",
    "prompt_cache_options",
)
#: Chat's, besides: ``verbosity`` and ``reasoning_effort`` steer reasoning models' lengths and
#: thinking budgets, which the models pagedkv runs do not take (Qwen3's thinking is switched by
#: ``chat_template_kwargs``' ``enable_thinking``).
IGNORED_CHAT = (*IGNORED_COMMON, "verbosity", "reasoning_effort")

# ---- the Responses API (POST /v1/responses; protocol/responses_api.py) -------------------------

#: The ``include`` value that asks for nothing here: there are no reasoning items to include.
INCLUDE_NO_OP = "reasoning.encrypted_content"
#: ``reasoning.effort`` values (accepted, without effect: the model does not reason).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")

_include_no_op = NoOp(
    lambda value, request: value is None or all(v == INCLUDE_NO_OP for v in value),
    {"anyOf": [NULL_SCHEMA, {"type": "array", "items": {"const": INCLUDE_NO_OP}}]},
)
_no_summary = NoOp(
    lambda value, request: (
        value is None or (value.summary is None and value.generate_summary is None)
    ),
    {
        "anyOf": [
            NULL_SCHEMA,
            {
                "type": "object",
                "properties": {
                    "effort": {"enum": [*REASONING_EFFORTS, None]},
                    "summary": NULL_SCHEMA,
                    "generate_summary": NULL_SCHEMA,
                },
                "additionalProperties": False,
            },
        ]
    },
)
_truncation_disabled = NoOp(
    lambda value, request: value is None or value == "disabled", {"enum": [None, "disabled"]}
)
_no_logprobs = NoOp(lambda value, request: value is None or value == 0, {"enum": [None, 0]})

#: Known fields of /v1/responses that pagedkv refuses when they ask for something (built-in
#: tools and input items other than text are refused where they are read: responses_api.py).
REFUSED_RESPONSES: dict[str, Refused] = {
    "background": Refused(_false, "background mode " + _NOT_IMPLEMENTED, True),
    "conversation": Refused(_absent, "a stored conversation " + _NOT_IMPLEMENTED, "conv_1"),
    "prompt": Refused(_absent, "a stored prompt template " + _NOT_IMPLEMENTED, {"id": "pmpt_1"}),
    "include": Refused(
        _include_no_op,
        "only `reasoning.encrypted_content` (a no-op: there are no reasoning items) can be "
        "included; logprobs and built-in tools' results are not available",
        ["message.output_text.logprobs"],
    ),
    "reasoning": Refused(
        _no_summary,
        "reasoning summaries are not available: the model does not reason (`effort` alone is "
        "accepted without effect)",
        {"summary": "auto"},
    ),
    "truncation": Refused(
        _truncation_disabled,
        'truncation "auto" ' + _NOT_IMPLEMENTED + " (an input too long is a 400)",
        "auto",
    ),
    "top_logprobs": Refused(_no_logprobs, "logprobs on /v1/responses " + _NOT_IMPLEMENTED, 2),
    "context_management": Refused(
        _empty, "context management (compaction) " + _NOT_IMPLEMENTED, [{"x": 1}]
    ),
    "background_options": Refused(
        _empty, "background mode " + _NOT_IMPLEMENTED, {"completion_window": "2h"}
    ),
    "access_programs": Refused(_empty, "OpenAI's access programs do not exist here", {"x": 1}),
    "image": Refused(_empty, "image generation " + _NOT_IMPLEMENTED, {"size": "1024x1024"}),
    "moderation": REFUSED_COMMON["moderation"],
}

#: Known fields of /v1/responses without any effect on the output: accepted, named in the
#: warning line (``store`` is honoured: the server keeps the response for
#: ``previous_response_id``; ``reasoning.effort`` and ``text.verbosity`` are named too).
IGNORED_RESPONSES = (
    "user",
    "metadata",
    "service_tier",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
    "max_tool_calls",
    "stream_options",
)
