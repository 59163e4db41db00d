"""Sampling parameters of one request: how each next token is chosen and when generation stops.

Names and defaults follow vLLM's ``SamplingParams`` (and so the OpenAI API the server exposes):
``temperature=0`` is greedy decoding; ``top_k`` of 0 or -1 and ``top_p`` of 1 switch those filters
off; ``max_tokens=None`` means "until max_model_len".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagedkv.errors import InvalidRequestError
from pagedkv.validation import check_int, check_number, is_int, is_number

#: Temperatures below this are treated as 0 (greedy): dividing logits by ~0 overflows.
GREEDY_EPSILON = 1e-5


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """How to sample the output tokens of one request.

    Args:
        n: number of independent samples of the prompt (>= 1). The samples are separate requests
            that share the prompt's cached KV blocks through the prefix cache.
        temperature: softmax temperature (>= 0); 0 = greedy (argmax).
        top_p: nucleus sampling: keep the smallest set of tokens whose probability mass reaches
            top_p, in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 or -1 = off.
        presence_penalty: subtracted once from the logit of every token already generated,
            in [-2, 2] (OpenAI semantics; prompt tokens do not count).
        frequency_penalty: subtracted from a token's logit per time it was generated, in [-2, 2].
        max_tokens: most output tokens (>= 1); None = up to max_model_len.
        stop: strings that end generation when they appear in the output text; the text is cut
            before the stop string unless include_stop_str_in_output.
        stop_token_ids: token ids that end generation (kept in the output token ids).
        ignore_eos: keep generating after the model's end-of-sequence token (benchmarks).
        include_stop_str_in_output: keep a matched stop string at the end of the text.
        skip_special_tokens: leave special tokens (end-of-turn markers ...) out of the text.
        seed: seed of this request's own random generator; equal seeds give equal samples.

    Raises:
        InvalidRequestError: a value out of its range or of the wrong type (``stop`` not a str or
            list, a non-bool flag, an infinite temperature), with the name and the valid range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, list | tuple):
            self.stop = list(self.stop)
        else:
            raise InvalidRequestError(
                f"stop must be a str or a list of str, got {type(self.stop).__name__}"
            )
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise InvalidRequestError(
                f"stop_token_ids must be a list of ints, got {type(self.stop_token_ids).__name__}"
            )
        self._validate()

    def _validate(self) -> None:
        check_int("n", self.n, 1, error=InvalidRequestError)
        check_number("temperature", self.temperature, 0, finite=True, error=InvalidRequestError)
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            check_number(name, getattr(self, name), -2, maximum=2, error=InvalidRequestError)
        check_int("max_tokens", self.max_tokens, 1, optional=True, error=InvalidRequestError)
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise InvalidRequestError(f"stop strings must be non-empty str, got {stop!r}")
        for i, token_id in enumerate(self.stop_token_ids):
            check_int(f"stop_token_ids[{i}]", token_id, 0, error=InvalidRequestError)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be a bool, got {value!r}")
        check_int("seed", self.seed, optional=True, error=InvalidRequestError)
        # Sample i of an n > 1 request is seeded with seed + i; torch.Generator takes 64-bit seeds.
        if self.seed is not None and not _MIN_SEED <= self.seed <= _MAX_SEED - (self.n - 1):
            raise InvalidRequestError(
                f"seed must be in [{_MIN_SEED}, {_MAX_SEED - (self.n - 1)}] (a 64-bit seed for "
                f"each of the n={self.n} samples), got {self.seed!r}"
            )

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature ~ 0)."""
        return self.temperature < GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        """True when presence or frequency penalties change the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of an ``n > 1`` request: n = 1, and the seed (when
        given) offset by the index so the samples differ yet stay reproducible."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


_MIN_SEED = -(2**63)
_MAX_SEED = 2**64 - 1
