"""Request and response bodies of the OpenAI API subset pagedkv serves, and its error format.

Requests are validated here (ranges as in the OpenAI API reference, and every value within what
the engine can represent: ints within int64, token ids >= 0, finite floats, strings that are valid
Unicode, i.e. no lone surrogates, which JSON can carry but UTF-8 cannot); anything that fails comes
back to the client as an :class:`ErrorResponse` with status 400 naming the field. What needs the
model (top_k and token ids against the vocabulary, prompt + max_tokens against max_model_len) is
checked by the engine before the request is queued, also a 400. New fields take one of the
annotated types below (``Text``, ``Int64``, ``TokenId``, ``FiniteFloat``...), so they get the same
checks. Fields the API has but pagedkv
does not implement (logprobs, tools, ...) are ignored rather than rejected, as vLLM does, so that
ordinary clients keep working. Extra fields beyond the OpenAI API: ``cache_salt`` (tenant
isolation of the prefix cache: requests with different salts never share cached blocks),
``top_k`` and ``ignore_eos``.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from pagedkv.sampling_params import INT64_MAX

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


#: A string the tokenizer and the block hash can take (valid Unicode: no lone surrogates).
Text = Annotated[str, AfterValidator(_valid_unicode)]
#: An int within int64 (what torch tensors and the block hash hold).
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
#: A token id: >= 0 and within int64 (the engine also checks it against the vocabulary).
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
#: A count >= 1 within int64 (max_tokens: the engine also checks it against max_model_len).
PositiveInt64 = Annotated[int, Field(ge=1, le=INT64_MAX)]
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


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completion and chat requests."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    max_tokens: PositiveInt64 | None = None
    temperature: Annotated[FiniteFloat, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[FiniteFloat, Field(gt=0.0, le=1.0)] = 1.0  # >= 1.2e-38: SamplingParams
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: Text | list[Text] | None = Field(default=None, validate_default=True)
    seed: Annotated[int, Field(ge=INT64_MIN, le=SEED_MAX)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # Extra fields (vLLM has the same names).
    cache_salt: Text | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] = -1
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else list(value)
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, token ids, or a list of
    token-id lists (one completion per prompt, times ``n``). ``max_tokens`` defaults to 16 as in
    the OpenAI API."""

    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and (not value or any(p == [] for p in value)):
            raise ValueError("prompt must not be an empty list (nor hold one)")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list, each a string or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None

    def as_template_dict(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict a chat template expects (text parts joined)."""
        if self.content is None:
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(part.text for part in self.content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text}


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: the chat template of the model is applied to ``messages``.
    Without ``max_tokens`` (or ``max_completion_tokens``) the reply may run to max_model_len."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt64 | None = None

    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_dict() for m in self.messages]


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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedkv"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
