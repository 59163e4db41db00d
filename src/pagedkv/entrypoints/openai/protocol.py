"""Request and response bodies of the OpenAI API subset pagedkv serves, and its error format.

The contract (docs/server.md has the table of every field):

- A field the server accepts is honoured: it reaches
  :class:`~pagedkv.sampling_params.SamplingParams` or the response with vLLM's meaning.
- A known field (OpenAI's or vLLM's) that pagedkv does not implement is refused with a 400 naming
  it when it asks for something (``tools``, ``response_format`` other than text, ``suffix``,
  ``best_of`` > n, ...): each request model lists them in ``REFUSED`` with the values that ask for
  nothing (``check_supported``).
- Known fields without effect on the output (``user``, ``metadata``...: ``IGNORED``) are accepted
  and named in one warning log line per request (``ignored_fields``), as vLLM does.
- A field no model here declares, at any depth (``foo_bar``, ``messages[0].foo``), is a 400
  naming it, as OpenAI answers ("Unrecognized request argument supplied"; errors.py): each
  model forbids extra keys, which its JSON Schema states (``additionalProperties: false``).

Types are strict: JSON ``null`` for an optional field means its default, but strings are not
numbers (``"max_tokens": "8"`` is a 400, as in OpenAI) and numbers are not booleans; a number
with no fractional part is an integer (``8.0``, as JSON Schema has it), any other is not. Values are
checked against what the engine can represent (ints within int64, token ids >= 0, finite floats,
strings that are valid Unicode, i.e. no lone surrogates, which JSON can carry but UTF-8 cannot),
with a 400 naming the field. What needs the model (token ids and top_k against the vocabulary,
prompt + max_tokens against max_model_len) is checked by the engine before the request is queued,
also a 400. New fields take one of the annotated types below (``Text``, ``Int64``, ``TokenId``,
``FiniteFloat``...), so they get the same checks.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import INT64_MAX, BeamSearchParams, StructuredOutputsParams

#: Most samples one request may ask for (``n``); each sample is a sequence in the engine.
MAX_N = 128
INT64_MIN = -(2**63)
#: torch.Generator takes seeds in [-2**63, 2**64).
SEED_MAX = 2**64 - 1


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"not valid Unicode text: {e.reason} at index {e.start} (a lone surrogate such as "
            "\\ud800 cannot be tokenized)"
        ) from None
    return value


def _integral(value: Any) -> Any:
    """JSON has one number type: ``8.0`` is the integer 8 (as JSON Schema's ``integer`` says,
    and as some clients write it); any other float stays a float, which an int field refuses."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: Put last in an int type's Annotated (after its Field: pydantic's JSON schema keeps the bounds
#: only then): a float with no fractional part counts as an int.
_INTEGRAL = BeforeValidator(_integral)
#: A string the tokenizer and the block hash can take (valid Unicode: no lone surrogates).
Text = Annotated[str, AfterValidator(_valid_unicode)]
#: Text of at least one character (stop strings).
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
#: An int within int64 (what torch tensors and the block hash hold).
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), _INTEGRAL]
#: A token id: >= 0 and within int64 (the engine also checks it against the vocabulary).
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX), _INTEGRAL]

# Bounds on what one request may hold, so that one body cannot make the server build millions of
# objects (a 28 MB body of 7M one-token prompts used to grow the server to 18 GB): checked by
# pydantic while it reads the list, so a longer one stops early; also in the schema (maxItems).
#: Most prompts in one completion request.
MAX_PROMPTS = 1024
#: Most sequences (prompts x samples) one request may start.
MAX_SEQUENCES = 4096
#: Most token ids in one list (a prompt, /detokenize's tokens): 2**20, beyond any max_model_len.
MAX_TOKEN_IDS = 2**20
#: Most chat messages in one request.
MAX_MESSAGES = 4096
#: Most stop strings, stop token ids and logit_bias entries (each is checked every step).
MAX_STOPS = 64
MAX_LOGIT_BIAS = 4096
#: Most tools one chat request may offer, and tool calls one message may hold.
MAX_TOOLS = 1024
#: A count >= 1 within int64 (max_tokens: the engine also checks it against max_model_len).
PositiveInt64 = Annotated[int, Field(ge=1, le=INT64_MAX), _INTEGRAL]
#: A count >= 0 within int64 (logprobs: the engine checks it against its max_logprobs, which
#: ``serve --max-logprobs`` sets; the OpenAPI schema states that limit, see openapi.py).
NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX), _INTEGRAL]
#: A finite float (JSON parsers accept NaN and Infinity).
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def random_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-<32 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in whole seconds, the ``created`` field of every response."""
    return int(time.time())


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``, the OpenAI error body."""

    error: ErrorInfo


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


#: JSON Schema of null (these schemas are copied into every generated schema, never changed).
_NULL: dict[str, Any] = {"type": "null"}
#: null, [] or {}: what an empty list or map field accepts.
_EMPTY_SCHEMA: dict[str, Any] = {
    "anyOf": [_NULL, {"type": "array", "maxItems": 0}, {"type": "object", "maxProperties": 0}]
}


def _allows_null(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "null" or any(
        member.get("type") == "null" for member in schema.get("anyOf", ())
    )


def _document(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """pydantic's JSON Schema of a request model, told what the validators add on top of the
    types, so that the OpenAPI schema accepts what the server accepts: ``null`` for a field with
    a default (``_null_means_default``), only the no-op values of a refused field (``REFUSED``),
    and the rules between fields (``SCHEMA_RULES``, the schema's side of ``check_supported``)."""
    properties = schema.get("properties", {})
    refused: dict[str, Refused] = getattr(cls, "REFUSED", {})
    for name, field in cls.model_fields.items():
        prop = properties.get(name)
        if prop is None:
            continue
        docs = {k: v for k, v in prop.items() if k in ("title", "description", "default")}
        if name in refused:
            accepted = refused[name].accepts.schema
            properties[name] = {**docs, **copy.deepcopy(accepted or {})}
        elif not field.is_required() and field.default is not None and not _allows_null(prop):
            inner = {k: v for k, v in prop.items() if k not in docs}
            properties[name] = {**docs, "anyOf": [inner, _NULL]}
    rules = getattr(cls, "SCHEMA_RULES", ())
    if rules:
        schema["allOf"] = [*schema.get("allOf", ()), *copy.deepcopy(rules)]


def _is(name: str, value: Any) -> dict[str, Any]:
    """JSON Schema: the field ``name`` is present and equal to ``value``."""
    return {"required": [name], "properties": {name: {"const": value}}}


#: prompt_logprobs only when not streaming, stream_options only when streaming
#: (check_supported). Few if/then rules: schemathesis gives up on a schema with five.
_STREAM_RULE = {
    "if": _is("stream", True),
    "then": {"properties": {"prompt_logprobs": _NULL}},
    "else": {"properties": {"stream_options": _NULL}},
}
#: continue_final_message needs add_generation_prompt false (its default is true).
_CONTINUE_RULE = {
    "if": _is("continue_final_message", True),
    "then": _is("add_generation_prompt", False),
}


class _Strict(BaseModel):
    """Strict types; ``null`` for a field whose default is not None means that default; a
    field the model does not declare is refused (a 400 naming it)."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_document)
    #: JSON Schema rules between fields, added to the model's schema (``allOf``): the rules of
    #: ``check_supported`` that a schema can state.
    SCHEMA_RULES: ClassVar[tuple[dict[str, Any], ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_sizes(data)
            fields = cls.model_fields
            return {
                key: value
                for key, value in data.items()
                if value is not None or key not in fields or fields[key].default is None
            }
        return data


#: Field -> most items its list (or dict) may hold, and its inner lists (prompt: token-id lists).
_SIZE_LIMITS: dict[str, tuple[int, int | None]] = {
    "prompt": (MAX_TOKEN_IDS, MAX_TOKEN_IDS),
    "messages": (MAX_MESSAGES, None),
    "stop": (MAX_STOPS, None),
    "stop_token_ids": (MAX_STOPS, None),
    "logit_bias": (MAX_LOGIT_BIAS, None),
    "tokens": (MAX_TOKEN_IDS, None),
    "tools": (MAX_TOOLS, None),
}


def _check_sizes(data: dict[str, Any]) -> None:
    """Refuse a list longer than its bound before pydantic reads it item by item (a union
    field such as ``prompt`` would be read once per member: 18 s for 7M prompts). A list of
    prompts is bounded by MAX_PROMPTS, token ids by MAX_TOKEN_IDS.

    Raises:
        UnsupportedFieldError: naming the field (a 400).
    """
    for name, (limit, inner_limit) in _SIZE_LIMITS.items():
        value = data.get(name)
        if not isinstance(value, list | dict):
            continue
        if name == "prompt" and value and not isinstance(value[0], int):
            limit = MAX_PROMPTS  # a list of prompts
        if len(value) > limit:
            raise UnsupportedFieldError(
                name, f"`{name}` holds {len(value)} items, more than the {limit} allowed"
            )
        if inner_limit is not None and isinstance(value, list):
            for item in value:
                if isinstance(item, list) and len(item) > inner_limit:
                    raise UnsupportedFieldError(
                        name,
                        f"`{name}`: a prompt of {len(item)} token ids, more than {inner_limit}",
                    )


#: Most strings of a choice constraint (``guided_choice``, ``structured_outputs.choice``).
MAX_CHOICES = 1024
#: A JSON Schema: an object, or its JSON text (xgrammar parses it; a 400 when it cannot).
JsonSchema = dict[str, Any] | Text
Choices = Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)]


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema`` (OpenAI's): the schema the output follows. ``strict``
    is accepted either way: the output always follows the schema (its grammar masks every
    token)."""

    name: Text | None = None
    description: Text | None = None
    json_schema: JsonSchema = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``{"type": "text"}`` (free text), ``{"type":
    "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` request field: one of ``json`` (a JSON Schema), ``regex``,
    ``choice``, ``grammar`` (EBNF) or ``json_object``, as
    :class:`~pagedkv.sampling_params.StructuredOutputsParams`. ``disable_fallback`` and
    ``disable_additional_properties`` are what pagedkv does anyway (one backend, xgrammar,
    whose schemas allow no property they do not list); ``structural_tag`` and
    ``whitespace_pattern`` are refused."""

    json_: JsonSchema | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Choices | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    structural_tag: None = None
    whitespace_pattern: None = None


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage;
    ``continuous_usage_stats`` (vLLM) puts the usage so far in every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


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


_absent = NoOp(lambda value, request: value is None, _NULL)
_false = NoOp(lambda value, request: value is None or value is False, {"enum": [None, False]})
_empty = NoOp(lambda value, request: value is None or value == [] or value == {}, _EMPTY_SCHEMA)

_NOT_IMPLEMENTED = "is not supported by pagedkv"

#: Known fields of both endpoints that pagedkv refuses when they ask for something.
_REFUSED_COMMON: dict[str, Refused] = {
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
}

#: Known fields without any effect on the output: accepted, named in the warning line.
_IGNORED_COMMON = ("user", "metadata", "store", "service_tier", "request_id")


class _SamplingRequest(_Strict):
    """Fields shared by completion and chat requests (OpenAI's names, then vLLM's)."""

    #: Known fields refused with a 400 when they ask for something (see :class:`Refused`).
    REFUSED: ClassVar[dict[str, Refused]] = _REFUSED_COMMON
    #: Known fields without effect on the output (named in the request's warning line).
    IGNORED: ClassVar[tuple[str, ...]] = _IGNORED_COMMON
    SCHEMA_RULES: ClassVar[tuple[dict[str, Any], ...]] = (_STREAM_RULE,)

    model: Text | None = None
    max_tokens: NonNegativeInt64 | None = None
    # The ranges of the sampling floats are SamplingParams' (one copy, checked when the endpoint
    # builds them: a 400 naming the field before anything is queued); temperature's upper bound
    # of 2 is OpenAI's, the server's own on top of it.
    temperature: Annotated[FiniteFloat, Field(le=2.0)] = 1.0
    top_p: FiniteFloat = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N), _INTEGRAL] = 1
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None = Field(
        default=None, validate_default=True
    )
    seed: Annotated[int, Field(ge=INT64_MIN, le=SEED_MAX), _INTEGRAL] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: FiniteFloat = 0.0
    frequency_penalty: FiniteFloat = 0.0
    #: token id (a string, as JSON keys are) -> bias, clamped to [-100, 100].
    logit_bias: Annotated[dict[str, FiniteFloat], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # Extra fields (vLLM has the same names).
    cache_salt: Text | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX), _INTEGRAL] = -1
    min_p: FiniteFloat = 0.0
    repetition_penalty: FiniteFloat = 1.0
    min_tokens: NonNegativeInt64 = 0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOPS)] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: NonNegativeInt64 | None = None
    priority: Int64 = 0
    # Known fields: refused (REFUSED) or without effect (IGNORED); typed loosely on purpose,
    # since any value is named in a 400 or in the warning line.
    #: generate best_of samples, return the n with the highest cumulative logprob (>= n; not
    #: with stream, as vLLM).
    best_of: Annotated[int, Field(ge=1, le=MAX_N), _INTEGRAL] | None = None
    #: vLLM's beam search: ``n`` beams, all returned best first (not with stream; the sampling
    #: fields stay at their defaults: see :meth:`check_beam_search`).
    use_beam_search: bool = False
    #: beam search: a finished beam of L tokens scores ``cumulative logprob / L ** length_penalty``.
    length_penalty: FiniteFloat = 1.0
    # Structured outputs (at most one constraint: structured_output_params).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: JsonSchema | None = None
    guided_regex: Text | None = None
    guided_choice: Choices | None = None
    guided_grammar: Text | None = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    prompt_embeds: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    user: Text | None = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    request_id: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        return [value] if isinstance(value, str) else list(value)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or ():
            if not key.isascii() or not key.isdigit() or int(key) > INT64_MAX:
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def check_supported(self) -> None:
        """Raise :class:`UnsupportedFieldError` (a 400 naming the field) for the first refused
        field that asks for something (``REFUSED``), or fields that do not go together."""
        for name, refused in self.REFUSED.items():
            value = getattr(self, name)
            if not refused.accepts(value, self):
                raise UnsupportedFieldError(name, f"`{name}`: {refused.why} (got {value!r})")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFieldError(
                "stream_options", "`stream_options` is only allowed when `stream` is true"
            )
        if self.prompt_logprobs is not None and self.stream:
            raise UnsupportedFieldError(
                "prompt_logprobs", "`prompt_logprobs` is not available with `stream` (as vLLM)"
            )
        if self.best_of is not None and self.best_of != self.n and self.stream:
            raise UnsupportedFieldError(
                "best_of", "`best_of` > n cannot stream: the best n are known only at the end"
            )
        if self.use_beam_search:
            self.check_beam_search()
        elif self.length_penalty != 1.0:
            raise UnsupportedFieldError(
                "length_penalty",
                "`length_penalty` applies to beam search only (`use_beam_search`: true)",
            )

        self.structured_output_params()

    def top_logprobs_asked(self) -> int | None:
        """The top log-probabilities per generated token the response asks for (None: none)."""
        raise NotImplementedError

    def check_beam_search(self) -> None:
        """Beam search ranks the model's raw log-probabilities and has no stop conditions of its
        own beyond the end-of-sequence token and max_tokens: a field that asks for sampling or
        stopping is a 400 naming ``use_beam_search`` and the field, as is streaming (the beams
        are known only at the end) and top logprobs beyond the ``2 * n`` candidates a step
        ranks. ``temperature`` 1 (raw logprobs) and 0 (no randomness) are what it does."""
        asked = [
            name
            for name, value, no_ops in (
                ("stream", self.stream, (False,)),
                ("temperature", self.temperature, (0.0, 1.0)),
                ("top_p", self.top_p, (1.0,)),
                ("top_k", self.top_k, (-1, 0)),
                ("min_p", self.min_p, (0.0,)),
                ("presence_penalty", self.presence_penalty, (0.0,)),
                ("frequency_penalty", self.frequency_penalty, (0.0,)),
                ("repetition_penalty", self.repetition_penalty, (1.0,)),
                ("min_tokens", self.min_tokens, (0,)),
                ("stop", self.stop, ([],)),
                ("stop_token_ids", self.stop_token_ids, (None, [])),
                ("logit_bias", self.logit_bias, (None, {})),
                ("prompt_logprobs", self.prompt_logprobs, (None,)),
                ("best_of", self.best_of, (None, self.n)),
            )
            if value not in no_ops
        ]
        if asked:
            raise UnsupportedFieldError(
                "use_beam_search",
                f"`use_beam_search` does not go with `{asked[0]}` (got "
                f"{getattr(self, asked[0])!r}): beam search ranks the raw log-probabilities of "
                "n beams and returns them all at the end",
            )
        top = self.top_logprobs_asked()
        if top is not None and top > 2 * self.n:
            raise UnsupportedFieldError(
                "use_beam_search",
                f"`use_beam_search` with {top} top logprobs: a step of beam search ranks "
                f"2 * n = {2 * self.n} candidates, so at most that many",
            )
        _, constraint = self.structured_output_params()
        if constraint is not None:
            raise UnsupportedFieldError(
                "use_beam_search",
                f"`use_beam_search` does not go with a structured output constraint "
                f"(`{constraint}`): beams rank the model's raw log-probabilities",
            )

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """The engine's parameters of a ``use_beam_search`` request (vLLM's
        ``to_beam_search_params``): ``n`` beams of at most ``max_tokens`` tokens."""
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )

    def structured_output_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's output constraint, from whichever field gives it (``response_format``
        json_object / json_schema, ``structured_outputs``, ``guided_json`` / ``guided_regex`` /
        ``guided_choice`` / ``guided_grammar``), and the path of that field as a client wrote
        it (``"response_format.json_schema.schema"``...); ``(None, None)`` without one.

        Raises:
            UnsupportedFieldError: more than one constraint (naming the fields), a json_schema
                response_format without its schema, a constraint of the wrong shape.
        """
        given: list[tuple[str, str, dict[str, Any]]] = []  # (field, path, kwargs)
        whitespace = False
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", "response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise UnsupportedFieldError(
                    "response_format",
                    "`response_format` of type json_schema needs `json_schema` "
                    "({'name': ..., 'schema': {...}})",
                )
            given.append(
                (
                    "response_format",
                    "response_format.json_schema.schema",
                    {"json": fmt.json_schema.json_schema},
                )
            )
        so = self.structured_outputs
        if so is not None:
            whitespace = so.disable_any_whitespace
            for kind, value in (
                ("json", so.json_),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("json_object", so.json_object if so.json_object else None),
            ):
                if value is not None:
                    path = f"structured_outputs.{kind}"
                    given.append(("structured_outputs", path, {kind: value}))
            if not given or given[-1][0] != "structured_outputs":
                raise UnsupportedFieldError(
                    "structured_outputs",
                    "`structured_outputs` needs one of json, regex, choice, grammar and "
                    "json_object",
                )
        for name, kind in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                given.append((name, name, {kind: value}))
        if not given:
            return None, None
        if len(given) > 1:
            paths = ", ".join(f"`{path}`" for _, path, _ in given)
            raise UnsupportedFieldError(
                given[1][0], f"give at most one structured output constraint, got {paths}"
            )
        field_name, path, kwargs = given[0]
        try:
            params = StructuredOutputsParams(**kwargs, disable_any_whitespace=whitespace)
        except InvalidRequestError as e:
            message = _rename_constraint(str(e), params_kind(kwargs), path)
            raise UnsupportedFieldError(field_name, message) from None
        return params, path

    def ignored_fields(self) -> list[str]:
        """The names of the known fields set that have no effect (``IGNORED``)."""
        return [name for name in self.IGNORED if getattr(self, name) is not None]

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields these request fields set (max_tokens, logprobs and
        prompt_logprobs are the endpoint's to set)."""
        return {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": list(self.stop_token_ids or ()),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": (
                None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}
            ),
            "seed": self.seed,
            "best_of": self.best_of,
            "structured_outputs": self.structured_output_params()[0],
        }


def params_kind(kwargs: dict[str, Any]) -> str:
    return next(iter(kwargs))


def _rename_constraint(message: str, kind: str, path: str) -> str:
    """An engine message about ``structured_outputs.<kind>`` told with the request's field."""
    return message.replace(f"structured_outputs.{kind}", f"`{path}`").replace(
        "structured_outputs", f"`{path}`"
    )


def rename_constraint_error(
    exc: InvalidRequestError, request: _SamplingRequest
) -> InvalidRequestError:
    """The engine's refusal of a request's constraint (``param`` ``structured_outputs``) told
    with the field the request gave it in (``guided_regex``, ``response_format``...)."""
    params, path = request.structured_output_params()
    if params is None or exc.param != "structured_outputs":
        return exc
    field_name = path.split(".", 1)[0]
    return InvalidRequestError(_rename_constraint(str(exc), params.kind, path), param=field_name)


class UnsupportedFieldError(Exception):
    """A request field pagedkv refuses (the server answers 400 naming ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, token ids, or a list of
    token-id lists (one completion per prompt, times ``n``). ``max_tokens`` defaults to 16 as in
    the OpenAI API; 0 is allowed only with ``echo`` (the prompt and its logprobs alone, which is
    how evaluation harnesses score a continuation)."""

    REFUSED: ClassVar[dict[str, Refused]] = {
        **_REFUSED_COMMON,
        "suffix": Refused(_absent, "suffix (insertion) " + _NOT_IMPLEMENTED, "tail"),
    }
    SCHEMA_RULES: ClassVar[tuple[dict[str, Any], ...]] = (
        _STREAM_RULE,
        # max_tokens 0 (the prompt alone) only with echo.
        {"if": _is("max_tokens", 0), "then": _is("echo", True)},
    )

    # Lists are not empty, nor hold an empty one (min_length: also in the schema).
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_IDS)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_IDS)]],
            Field(min_length=1, max_length=MAX_PROMPTS),
        ]
    )
    echo: bool = False
    #: top log-probabilities per token (0 = only the chosen token's), up to the engine's
    #: max_logprobs (OpenAI's 0..5, vLLM's default 20).
    logprobs: NonNegativeInt64 | None = None
    add_special_tokens: bool = True
    suffix: Any = None

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def check_beam_search(self) -> None:
        super().check_beam_search()
        if self.echo and self.logprobs is not None:
            raise UnsupportedFieldError(
                "use_beam_search",
                "`use_beam_search` does not go with `echo` and `logprobs` (the prompt's "
                "logprobs): echo the prompt without logprobs",
            )

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedFieldError(
                "max_tokens", "`max_tokens` must be >= 1 (0 is allowed with echo: the prompt alone)"
            )
        num_prompts = (
            1 if isinstance(self.prompt, str) or _is_ids(self.prompt) else len(self.prompt)
        )
        num_sequences = num_prompts * max(self.n, self.best_of or 0)
        if num_sequences > MAX_SEQUENCES:
            raise UnsupportedFieldError(
                "prompt",
                f"{num_prompts} prompts x {max(self.n, self.best_of or 0)} samples = "
                f"{num_sequences} sequences, more than one request may start ({MAX_SEQUENCES})",
            )

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list, each a string or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class ContentPart(_Strict):
    """A part of a message's content: only ``{"type": "text", "text": ...}`` is supported."""

    type: Literal["text"]
    text: Text


def _json_object_text(value: str) -> str:
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise ValueError(f"not JSON text: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError("not the JSON text of an object")
    return value


class FunctionCall(_Strict):
    """A call's function: its name and its arguments as the JSON text of an object."""

    name: Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
    arguments: Annotated[str, AfterValidator(_valid_unicode), AfterValidator(_json_object_text)]


class MessageToolCall(_Strict):
    """A tool call of an earlier assistant message (OpenAI's ``tool_calls[i]``)."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One message. An assistant's may hold ``tool_calls`` (its content then may be null); a
    ``tool`` message answers one of them (``tool_call_id``). Both, and ``name``, reach the chat
    template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    #: the participant's name (OpenAI's), passed to the template as vLLM does.
    name: Text | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise PydanticCustomError(
                        "content_type",
                        "only text content is supported (got a content part of type {kind})",
                        {"kind": repr(kind)},
                    )
        return value

    def as_template_dict(self) -> dict[str, Any]:
        """The ``{"role", "content"}`` dict a chat template expects (text parts joined), with
        ``name``, ``tool_calls`` (arguments as a dict, as templates read them, vLLM likewise) and
        ``tool_call_id`` when the message has them."""
        if self.content is None:
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(part.text or "" for part in self.content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Strict):
    """A function the model may call: ``parameters`` is a JSON Schema of its arguments
    (an object schema; none = no arguments)."""

    name: Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_valid_unicode)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    #: OpenAI's exact-schema flag; the schema is enforced (grammar) under tool_choice
    #: "required" or a named function whatever it says, never under "auto".
    strict: bool | None = None


class ChatTool(_Strict):
    """One of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the function the model must call."""

    type: Literal["function"]
    function: NamedFunction


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """``tools`` as the chat template takes them (OpenAI's form); None when there are none."""
    if not tools:
        return None
    rendered = []
    for tool in tools:
        function = tool.function
        entry: dict[str, Any] = {"name": function.name}
        if function.description is not None:
            entry["description"] = function.description
        entry["parameters"] = function.parameters or {"type": "object", "properties": {}}
        rendered.append({"type": "function", "function": entry})
    return rendered


#: Keyword arguments of the template render that chat_template_kwargs may not set (the request's
#: own fields set them).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


_text_modality = NoOp(
    lambda value, request: value is None or value == ["text"],
    {"anyOf": [_NULL, {"type": "array", "const": ["text"]}]},
)
_function_call = NoOp(
    lambda value, request: value is None or value == "none", {"enum": [None, "none"]}
)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: the chat template of the model is applied to ``messages``.
    Without ``max_tokens`` (or ``max_completion_tokens``) the reply may run to max_model_len."""

    REFUSED: ClassVar[dict[str, Refused]] = {
        **_REFUSED_COMMON,
        "functions": Refused(_empty, "function calling " + _NOT_IMPLEMENTED, [{"name": "f"}]),
        "function_call": Refused(_function_call, "function calling " + _NOT_IMPLEMENTED, "auto"),
        "audio": Refused(_absent, "audio output " + _NOT_IMPLEMENTED, {"voice": "alloy"}),
        "modalities": Refused(_text_modality, "only text output is supported", ["text", "audio"]),
        "prediction": Refused(
            _absent, "predicted outputs " + _NOT_IMPLEMENTED, {"type": "content"}
        ),
        "web_search_options": Refused(_absent, "web search " + _NOT_IMPLEMENTED, {}),
        "reasoning_effort": Refused(_absent, "reasoning_effort " + _NOT_IMPLEMENTED, "low"),
        "echo": Refused(_false, "echo on chat completions " + _NOT_IMPLEMENTED, True),
        "documents": Refused(_empty, "documents " + _NOT_IMPLEMENTED, [{"text": "x"}]),
        "mm_processor_kwargs": Refused(_empty, "multimodal input " + _NOT_IMPLEMENTED, {"x": 1}),
    }
    IGNORED: ClassVar[tuple[str, ...]] = _IGNORED_COMMON
    SCHEMA_RULES: ClassVar[tuple[dict[str, Any], ...]] = (
        _STREAM_RULE,
        _CONTINUE_RULE,
        {
            "if": {
                "required": ["top_logprobs"],
                "properties": {"top_logprobs": {"type": "integer"}},
            },
            "then": _is("logprobs", True),
        },
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    #: no echo here, so no 0
    max_tokens: PositiveInt64 | None = None
    max_completion_tokens: PositiveInt64 | None = None
    #: return the sampled tokens' log-probabilities (with ``top_logprobs`` alternatives each).
    logprobs: bool = False
    top_logprobs: NonNegativeInt64 | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    #: functions the model may call (rendered through the chat template).
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    #: "none", "auto" (the default with tools; needs the server's --enable-auto-tool-choice and
    #: --tool-call-parser), "required" (at least one call) or a named function.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    #: false: at most one tool call per choice (the first).
    parallel_tool_calls: bool = True
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    echo: Any = None
    #: a Jinja chat template for this request (only with the server's
    #: --trust-request-chat-template, as vLLM).
    chat_template: Text | None = None
    #: extra variables of the chat template render (``{"enable_thinking": false}``...).
    chat_template_kwargs: dict[str, Any] | None = None
    documents: Any = None
    mm_processor_kwargs: Any = None

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "`top_logprobs` needs `logprobs`: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise UnsupportedFieldError(
                "continue_final_message",
                "`continue_final_message` and `add_generation_prompt` cannot both be true "
                "(set add_generation_prompt to false to continue the last message)",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise UnsupportedFieldError(
                "continue_final_message",
                "`continue_final_message` needs the last message to be the assistant's",
            )
        for i, message in enumerate(self.messages):
            if message.tool_calls and message.role != "assistant":
                raise UnsupportedFieldError(
                    "messages", f"messages[{i}]: only an assistant's message has `tool_calls`"
                )
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or ()))
        if reserved:
            raise UnsupportedFieldError(
                "chat_template_kwargs",
                f"`chat_template_kwargs` may not set {', '.join(reserved)} (request fields or "
                "the server set them)",
            )
        choice = self.effective_tool_choice
        if choice not in ("none", "auto") and not self.tools:
            raise UnsupportedFieldError(
                "tool_choice", f"`tool_choice` {choice!r} needs a non-empty `tools`"
            )
        if isinstance(choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools or ()]
            if choice.function.name not in names:
                raise UnsupportedFieldError(
                    "tool_choice",
                    f"`tool_choice` names the function {choice.function.name!r}, which is not "
                    "one of `tools`",
                )

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice``, with OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as the chat template takes them (OpenAI's form); None when there are none."""
        return template_tools(self.tools)

    def ignored_fields(self) -> list[str]:
        names = super().ignored_fields()
        for i, tool in enumerate(self.tools or ()):
            if tool.function.strict and self.effective_tool_choice == "auto":
                names.append(f"tools[{i}].function.strict (not enforced under tool_choice auto)")
        return names

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_dict() for m in self.messages]


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM): ``prompt`` text, or chat ``messages`` through the template."""

    REFUSED: ClassVar[dict[str, Refused]] = {}
    IGNORED: ClassVar[tuple[str, ...]] = ()
    SCHEMA_RULES: ClassVar[tuple[dict[str, Any], ...]] = (
        # Exactly one of prompt and messages.
        {
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        },
        _CONTINUE_RULE,
        # tools go through the chat template: with messages only.
        {
            "if": {
                "required": ["tools"],
                "properties": {"tools": {"type": "array", "minItems": 1}},
            },
            "then": {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
        },
    )

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = (
        None
    )
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    #: with ``messages``: rendered through the template as /v1/chat/completions renders them.
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None

    def check_supported(self) -> None:
        """400s for inputs that do not go together."""
        if (self.prompt is None) == (self.messages is None):
            raise UnsupportedFieldError("prompt", "give exactly one of `prompt` and `messages`")
        if self.continue_final_message and self.add_generation_prompt:
            raise UnsupportedFieldError(
                "continue_final_message",
                "`continue_final_message` and `add_generation_prompt` cannot both be true",
            )
        if self.tools and self.messages is None:
            raise UnsupportedFieldError(
                "tools", "`tools` are rendered through the chat template: send `messages`"
            )

    def ignored_fields(self) -> list[str]:
        return []


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM): token ids -> text."""

    REFUSED: ClassVar[dict[str, Refused]] = {}
    IGNORED: ClassVar[tuple[str, ...]] = ()

    model: Text | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS)]

    def check_supported(self) -> None:
        """Nothing to refuse."""

    def ignored_fields(self) -> list[str]:
        return []


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


def make_usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None):
    """Usage with ``prompt_tokens_details.cached_tokens`` (prefix-cache hits) when known."""
    details = None if num_cached_tokens is None else {"cached_tokens": num_cached_tokens}
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=details,
    )


class PromptLogprob(BaseModel):
    """One token's entry in vLLM's ``prompt_logprobs``: ``{token id: PromptLogprob}``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: vLLM's ``prompt_logprobs``: one entry per prompt token, the first null.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogProbs(BaseModel):
    """OpenAI's legacy completions ``logprobs``: per token its text, its logprob (null for the
    first prompt token under echo), the top alternatives ``{text: logprob}`` and the character
    offset of the token in the choice's text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """A tool call of the response (``message.tool_calls[i]``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    #: null when the reply is only tool calls
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first of a call has its ``id``, ``type`` and
    ``function.name``; ``function.arguments`` pieces follow (concatenated by the client)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


def chunk_json(body: BaseModel) -> str:
    """A stream chunk as JSON: None fields left out, except each choice's ``finish_reason``,
    which is ``null`` until the choice's last chunk (as OpenAI's chunks)."""
    data = body.model_dump(exclude_none=True)
    for choice in data.get("choices", ()):
        choice.setdefault("finish_reason", None)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None = None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedkv"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _is_ids(prompt: object) -> bool:
    """True for one prompt of token ids (a list of ints), as opposed to a list of prompts."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
