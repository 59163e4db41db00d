"""The request bodies: /v1/completions, /v1/chat/completions, /tokenize and /detokenize
(completions and chat on the shared fields of sampling_request.py).

The contract (docs/server.md has the table of every field):

- A field the server accepts is honoured: it reaches
  :class:`~pagedkv.sampling_params.SamplingParams` or the response with vLLM's meaning.
- A known field pagedkv does not implement is refused with a 400 naming it when it asks for
  something, and a known field without effect is named in a warning line (refusals.py).
- A field no model here declares, at any depth, is a 400 naming it (schema.py).

Types are strict, and values are checked against what the engine can represent (fields.py), with
a 400 naming the field. What needs the model (token ids and top_k against the vocabulary, prompt
+ max_tokens against max_model_len) is checked by the engine before the request is queued, also a
400. ``check_supported`` checks what goes between fields; a sampling request's output constraint
(structured_outputs.py) is built there once and kept for every later reader.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from pagedkv.entrypoints.openai.protocol.fields import (
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_SEQUENCES,
    MAX_TOKEN_IDS,
    MAX_TOOLS,
    NonNegativeInt64,
    PositiveInt64,
    ReasoningEffort,
    Text,
    TokenId,
    Verbosity,
)
from pagedkv.entrypoints.openai.protocol.messages import (
    RESERVED_TEMPLATE_KWARGS,
    ChatMessage,
    ChatTool,
    NamedToolChoice,
)
from pagedkv.entrypoints.openai.protocol.refusals import (
    IGNORED_CHAT,
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    Refused,
    UnsupportedFieldError,
)
from pagedkv.entrypoints.openai.protocol.sampling_request import SamplingRequest
from pagedkv.entrypoints.openai.protocol.schema import (
    CONTINUE_RULE,
    STREAM_RULE,
    StrictModel,
    field_is,
)
from pagedkv.sampling_params import DEFAULT_MAX_TOKENS


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, token ids, or a list of
    token-id lists (one completion per prompt, times ``n``). ``max_tokens`` defaults to 16 as in
    the OpenAI API; 0 is allowed only with ``echo`` (the prompt and its logprobs alone, which is
    how evaluation harnesses score a continuation)."""

    REFUSED: ClassVar[dict[str, Refused]] = REFUSED_COMPLETION
    SCHEMA_RULES: ClassVar[tuple[dict[str, Any], ...]] = (
        STREAM_RULE,
        # max_tokens 0 (the prompt alone) only with echo.
        {"if": field_is("max_tokens", 0), "then": field_is("echo", True)},
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
    #: OpenAI's default of the completions API (16, :data:`~pagedkv.sampling_params.
    #: DEFAULT_MAX_TOKENS`; null means it too), passed to the engine as it is.
    max_tokens: NonNegativeInt64 | None = DEFAULT_MAX_TOKENS
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


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: the chat template of the model is applied to ``messages``.
    Without ``max_tokens`` (or ``max_completion_tokens``) the reply may run to max_model_len."""

    REFUSED: ClassVar[dict[str, Refused]] = REFUSED_CHAT
    IGNORED: ClassVar[tuple[str, ...]] = IGNORED_CHAT
    SCHEMA_RULES: ClassVar[tuple[dict[str, Any], ...]] = (
        STREAM_RULE,
        CONTINUE_RULE,
        {
            "if": {
                "required": ["top_logprobs"],
                "properties": {"top_logprobs": {"type": "integer"}},
            },
            "then": field_is("logprobs", True),
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
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Verbosity | None = None
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

    def ignored_fields(self) -> list[str]:
        names = super().ignored_fields()
        for i, tool in enumerate(self.tools or ()):
            if tool.function.strict and self.effective_tool_choice == "auto":
                names.append(f"tools[{i}].function.strict (not enforced under tool_choice auto)")
        return names

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_dict() for m in self.messages]


class TokenizeRequest(StrictModel):
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
        CONTINUE_RULE,
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


class DetokenizeRequest(StrictModel):
    """``POST /detokenize`` (vLLM): token ids -> text."""

    REFUSED: ClassVar[dict[str, Refused]] = {}
    IGNORED: ClassVar[tuple[str, ...]] = ()

    model: Text | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS)]

    def check_supported(self) -> None:
        """Nothing to refuse."""

    def ignored_fields(self) -> list[str]:
        return []


def _is_ids(prompt: object) -> bool:
    """True for one prompt of token ids (a list of ints), as opposed to a list of prompts."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
