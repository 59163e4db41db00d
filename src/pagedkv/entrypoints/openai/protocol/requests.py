"""The request bodies: /v1/completions, /v1/chat/completions, /tokenize and /detokenize.

The contract (docs/server.md has the table of every field):

- A field the server accepts is honoured: it reaches
  :class:`~pagedkv.sampling_params.SamplingParams` or the response with vLLM's meaning.
- A known field pagedkv does not implement is refused with a 400 naming it when it asks for
  something, and a known field without effect is named in a warning line (refusals.py).
- A field no model here declares, at any depth, is a 400 naming it (schema.py).

Types are strict, and values are checked against what the engine can represent (fields.py), with
a 400 naming the field. What needs the model (token ids and top_k against the vocabulary, prompt
+ max_tokens against max_model_len) is checked by the engine before the request is queued, also a
400. ``check_supported`` checks what goes between fields; the request's output constraint
(structured_outputs.py) is built there once and kept for every later reader.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from pagedkv.entrypoints.openai.protocol.fields import (
    INT64_MIN,
    INTEGRAL,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_SEQUENCES,
    MAX_STOPS,
    MAX_TOKEN_IDS,
    MAX_TOOLS,
    SEED_MAX,
    Choices,
    FiniteFloat,
    Int64,
    JsonSchema,
    NonEmptyText,
    NonNegativeInt64,
    PositiveInt64,
    Text,
    TokenId,
)
from pagedkv.entrypoints.openai.protocol.messages import (
    RESERVED_TEMPLATE_KWARGS,
    ChatMessage,
    ChatTool,
    NamedToolChoice,
)
from pagedkv.entrypoints.openai.protocol.refusals import (
    IGNORED_COMMON,
    REFUSED_CHAT,
    REFUSED_COMMON,
    REFUSED_COMPLETION,
    Refused,
    UnsupportedFieldError,
)
from pagedkv.entrypoints.openai.protocol.schema import (
    CONTINUE_RULE,
    STREAM_RULE,
    StrictModel,
    field_is,
)
from pagedkv.entrypoints.openai.protocol.structured_outputs import (
    Constraint,
    ResponseFormat,
    StructuredOutputsField,
    output_constraint,
)
from pagedkv.sampling_params import INT64_MAX, BeamSearchParams


class StreamOptions(StrictModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage;
    ``continuous_usage_stats`` (vLLM) puts the usage so far in every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(StrictModel):
    """Fields shared by completion and chat requests (OpenAI's names, then vLLM's)."""

    #: Known fields refused with a 400 when they ask for something (see :class:`Refused`).
    REFUSED: ClassVar[dict[str, Refused]] = REFUSED_COMMON
    #: Known fields without effect on the output (named in the request's warning line).
    IGNORED: ClassVar[tuple[str, ...]] = IGNORED_COMMON
    SCHEMA_RULES: ClassVar[tuple[dict[str, Any], ...]] = (STREAM_RULE,)

    model: Text | None = None
    max_tokens: NonNegativeInt64 | None = None
    # The ranges of the sampling floats are SamplingParams' (one copy, checked when the endpoint
    # builds them: a 400 naming the field before anything is queued); temperature's upper bound
    # of 2 is OpenAI's, the server's own on top of it.
    temperature: Annotated[FiniteFloat, Field(le=2.0)] = 1.0
    top_p: FiniteFloat = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL] = 1
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None = Field(
        default=None, validate_default=True
    )
    seed: Annotated[int, Field(ge=INT64_MIN, le=SEED_MAX), INTEGRAL] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: FiniteFloat = 0.0
    frequency_penalty: FiniteFloat = 0.0
    #: token id (a string, as JSON keys are) -> bias, clamped to [-100, 100].
    logit_bias: Annotated[dict[str, FiniteFloat], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # Extra fields (vLLM has the same names).
    cache_salt: Text | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX), INTEGRAL] = -1
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
    best_of: Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL] | None = None
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

    def structured_output_params(self) -> Constraint:
        """The request's output constraint and the path of the field that gave it (see
        :func:`~.structured_outputs.output_constraint`); ``(None, None)`` without one. Built on
        the first call (``check_supported``'s) and kept: every later reader (beam search, the
        sampling parameters, the chat handler's tool_choice, an engine refusal's message) gets
        the same one.

        Raises:
            UnsupportedFieldError: more than one constraint, or one of the wrong shape.
        """
        return self._constraint

    @cached_property
    def _constraint(self) -> Constraint:
        return output_constraint(self)

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
    IGNORED: ClassVar[tuple[str, ...]] = IGNORED_COMMON
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
