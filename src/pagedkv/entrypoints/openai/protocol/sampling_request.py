"""What completion and chat requests share: the sampling fields, the checks between them, and the
engine parameters they give.

:class:`SamplingRequest` is the base of ``CompletionRequest`` and ``ChatCompletionRequest``
(requests.py). ``check_supported`` refuses what pagedkv does not do (refusals.py) and what does
not go together, builds the request's output constraint once (structured_outputs.py), and
``sampling_kwargs`` / ``beam_search_params`` give the engine's
:class:`~pagedkv.sampling_params.SamplingParams` fields or
:class:`~pagedkv.sampling_params.BeamSearchParams`.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator

from pagedkv.entrypoints.openai.protocol.fields import (
    INT64_MIN,
    INTEGRAL,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOPS,
    SEED_MAX,
    Choices,
    FiniteFloat,
    Identifier,
    Int64,
    JsonSchema,
    Metadata,
    NonEmptyText,
    NonNegativeInt64,
    PromptCacheRetention,
    Text,
    TokenId,
)
from pagedkv.entrypoints.openai.protocol.refusals import (
    IGNORED_COMMON,
    REFUSED_COMMON,
    Refused,
    UnsupportedFieldError,
)
from pagedkv.entrypoints.openai.protocol.schema import STREAM_RULE, StrictModel
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
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: Identifier | None = None
    request_id: Identifier | None = None
    safety_identifier: Identifier | None = None
    prompt_cache_retention: PromptCacheRetention | None = None
    prompt_cache_options: dict[str, Any] | None = None
    moderation: Any = None
    #: OpenAI's key for requests that share a prefix: across replicas (``--data-parallel-size``)
    #: the router sends requests with one key to the replica that has their blocks; one engine's
    #: prefix cache serves every request already.
    prompt_cache_key: Text | None = None

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
        # Builds the output constraint (a 400 when it is wrong), kept for every later reader.
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

    def beam_search_params(self, max_tokens: int | None) -> BeamSearchParams:
        """The engine's parameters of a ``use_beam_search`` request (vLLM's
        ``to_beam_search_params``): ``n`` beams of at most ``max_tokens`` tokens (the client's
        value; None: the engine resolves it to the room the prompt leaves, as for sampling)."""
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
        # NOTE: cached on the instance; a request is not changed after it is read from its body.
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
