"""The response bodies: completions and chat completions (whole and streamed chunks), usage,
logprobs, tool calls, /tokenize and /detokenize, /v1/models, and OpenAI's error body.

Plain pydantic models (the server builds them; nothing is validated against them), named and
shaped as OpenAI's and vLLM's responses.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field


def random_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-<32 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in whole seconds, the ``created`` field of every response."""
    return int(time.time())


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``, the OpenAI error body."""

    error: ErrorInfo


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
