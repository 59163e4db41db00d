"""Sampling parameters of one request: how each next token is chosen and when generation stops.

Names, defaults and semantics follow vLLM's ``SamplingParams`` (and so the OpenAI API the server
exposes): ``temperature=0`` is greedy decoding; ``top_k`` of 0 or -1, ``top_p`` of 1, ``min_p`` of
0 and ``repetition_penalty`` of 1 switch those transforms off; ``max_tokens=None`` means "until
max_model_len".

The order in which the sampler applies them is vLLM V1's::

    logprobs, prompt_logprobs   read here: the raw model distribution (log_softmax, fp32)
    min_tokens                  EOS and stop_token_ids -> -inf until min_tokens are generated
    logit_bias                  + bias per token id
    repetition_penalty          tokens of the prompt or the output: logit / p if > 0, else * p
    frequency, presence         - frequency * count - presence * (count > 0), output tokens only
    greedy?                     argmax (temperature ~ 0): nothing below changes it
    temperature                 logits / temperature
    min_p                       drop tokens with prob < min_p * the top token's prob
    top_k, top_p                keep the k best, then the smallest set reaching mass p
    sample                      exponential race (Gumbel-max), the request's own seed if any

Ranges of the float fields. Each keeps every step above finite in float32 (the sampler's dtype)
for any logits a model produces, so that an accepted request never samples from NaN. With
|logit| <= L (a model's logits stay within ~1e4)::

    logit_bias          clamped to [-100, 100]           |x| <= L + 100
    repetition_penalty  [0.01, 100]: x / p or x * p      |x| <= 100 (L + 100)
    frequency, presence [-2, 2], times counts <= N       |x| <= 100 (L + 100) + 2 (N + 1)
    temperature         [0, float32 max]; < 1e-5 greedy  |x| <= 1e5 (100 (L + 100) + 2 (N + 1))
    min_p, top_p        [0, 1] and [1.2e-38, 1]          compared with probabilities in [0, 1]

(N = max_model_len, the most times a token can have been generated; temperatures below 1e-5 are
greedy: their logits are not divided.) For L = 1e4 and N = 1e6 the largest magnitude is ~3e11, 27
orders below float32's 3.4e38; the bounds hold for any logits up to ~3e31. A repetition penalty
near 0 is what breaks it without a floor (vLLM only asks for > 0): p = 1e-40 turns a logit of 1
into +inf, softmax into NaN, and the sampler then picks token 0. 0.01 and 100 are reciprocal, so a
seen token's logit moves by at most 100x either way, a change no practical setting reaches (the
CTRL paper uses 1.2); the arithmetic alone would allow about [3e-30, 3e29].
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pagedkv.errors import InvalidRequestError
from pagedkv.validation import SEED_MAX, SEED_MIN, is_int, is_number, utf8_error

#: Most output tokens of a request that does not say (vLLM's and OpenAI's completions default).
DEFAULT_MAX_TOKENS = 16

#: Temperatures below this are treated as 0 (greedy): dividing logits by ~0 overflows.
GREEDY_EPSILON = 1e-5


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """How to sample the output tokens of one request.

    Args:
        n: number of independent samples of the prompt (>= 1). The samples are separate requests;
            the first prefills the prompt (all but its last token) once and the others fork from
            it, sharing its KV blocks (copy-on-write of the last, partially filled one).
        temperature: softmax temperature, in [0, 3.4e38] (the largest float32); 0 = greedy
            (argmax), and so is anything below 1e-5 (``GREEDY_EPSILON``: dividing by ~0
            overflows).
        top_p: nucleus sampling: keep the smallest set of tokens whose probability mass reaches
            top_p, in (0, 1] (at least 1.2e-38, the smallest normal float32: a smaller value is
            0 in float32 and would drop every token); 1 = off.
        top_k: keep the k most likely tokens; 0 or -1 = off.
        min_p: drop tokens whose probability (after temperature) is below min_p times the most
            likely token's, in [0, 1]; 0 = off.
        presence_penalty: subtracted once from the logit of every token already generated,
            in [-2, 2] (OpenAI semantics; prompt tokens do not count).
        frequency_penalty: subtracted from a token's logit per time it was generated, in [-2, 2].
        repetition_penalty: in [0.01, 100]; 1 = off. Every token seen in the prompt or the
            output has its logit divided by it when positive, multiplied when negative (vLLM,
            after the CTRL paper: > 1 discourages repeats, < 1 encourages them). vLLM takes any
            value > 0; the bounds keep ``logit / p`` finite (the module docstring has the
            arithmetic: 1e-40 makes a logit of 1 +inf in float32, and the sampler NaN).
        max_tokens: most output tokens (>= 1; default :data:`DEFAULT_MAX_TOKENS`); None = up to
            max_model_len, resolved once by :func:`resolve_max_tokens` before the request is
            queued (the engine's ``add_request``).
        min_tokens: EOS and stop_token_ids cannot be sampled (their logits are -inf), and stop
            strings are not looked for, until this many tokens are generated (>= 0, at most
            max_tokens).
        stop: strings that end generation when they appear in the output text; the text is cut
            before the stop string unless include_stop_str_in_output.
        stop_token_ids: token ids that end generation (kept in the output token ids; their text
            is left out unless include_stop_str_in_output).
        ignore_eos: keep generating after the model's end-of-sequence token (benchmarks).
        include_stop_str_in_output: keep a matched stop string (or the text of the stop token)
            at the end of the text.
        skip_special_tokens: leave special tokens (end-of-turn markers ...) out of the text.
        logit_bias: token id -> bias added to its logit before sampling; biases are clamped to
            [-100, 100] (OpenAI's range; 100 all but forces a token, -100 all but bans it; vLLM
            clamps the same way), so any finite bias is accepted. The engine checks the ids
            against the vocabulary.
        logprobs: with each output token, also return the log-probabilities of this many most
            likely tokens (0 = only the sampled token's); None = no logprobs. Values are the
            model's raw distribution (see the module docstring).
        prompt_logprobs: the same for every prompt token (the first has none). A request that
            asks computes its whole prompt: it does not read the prefix cache (it still fills
            it).
        seed: seed of this request's own random generator; equal seeds give equal samples.
        best_of: generate this many samples (>= n; None = n) and return the n with the highest
            cumulative logprob (vLLM V0's and OpenAI's ``best_of``). The samples fork from one
            prefill of the prompt; the request's output comes once, when all have finished.
        structured_outputs: constrain the output to a JSON schema, a regex, a choice of strings
            or an EBNF grammar (:class:`StructuredOutputsParams`, vLLM's); None = free text.
            Each sample of an ``n > 1`` request follows the constraint on its own.

    Raises:
        InvalidRequestError: a value out of its range or of the wrong type (``stop`` not a str or
            list, a non-bool flag, NaN or an infinite float, an int beyond int64, a stop string
            that is not valid Unicode, min_tokens > max_tokens, structured_outputs that is not a
            StructuredOutputsParams), with the name (also as the error's ``param``), the valid
            range and the value given.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seed: int | None = None
    best_of: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, list | tuple):
            self.stop = list(self.stop)
        else:
            raise InvalidRequestError(
                f"stop must be a str or a list of str, got {type(self.stop).__name__}",
                param="stop",
            )
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise InvalidRequestError(
                f"stop_token_ids must be a list of ints, got {type(self.stop_token_ids).__name__}",
                param="stop_token_ids",
            )
        if self.logit_bias is not None:
            self.logit_bias = _clamped_logit_bias(self.logit_bias)
        self._validate()

    def _validate(self) -> None:
        # Every bound is what the code behind takes: int64 for ids and counts (torch tensors,
        # the block hash), a positive float32 for top_p and a finite float32 for temperature (the
        # sampler's dtype), UTF-8 text for strings (the tokenizer). Checked here so that a
        # request the engine cannot represent is refused before it is queued, never mid-step.
        if not is_int(self.n) or not 1 <= self.n <= INT64_MAX:
            raise InvalidRequestError(f"n must be an int >= 1, got {self.n!r}", param="n")
        if self.best_of is not None and (
            not is_int(self.best_of) or not self.n <= self.best_of <= INT64_MAX
        ):
            raise InvalidRequestError(
                f"best_of must be an int >= n ({self.n}) or None, got {self.best_of!r}",
                param="best_of",
            )
        _check_float(
            "temperature",
            self.temperature,
            f"0 or below {GREEDY_EPSILON:g} is greedy; at most the largest float32",
        )
        _check_float(
            "top_p",
            self.top_p,
            "above 0: the smallest normal float32 at least, a smaller one is 0 in float32",
        )
        if not is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (off) or an int >= 1 (at most the vocabulary size), "
                f"got {self.top_k!r}",
                param="top_k",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), "OpenAI's range")
        if self.max_tokens is not None and (
            not is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX
        ):
            raise InvalidRequestError(
                f"max_tokens must be an int >= 1 (at most max_model_len) or None, "
                f"got {self.max_tokens!r}",
                param="max_tokens",
            )
        _check_float("min_p", self.min_p, "a fraction of the top token's probability")
        _check_float(
            "repetition_penalty",
            self.repetition_penalty,
            "1 = off; a seen token's logit is divided or multiplied by it, which must stay finite",
        )
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            raise InvalidRequestError(
                f"min_tokens must be an int >= 0, got {self.min_tokens!r}", param="min_tokens"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= INT64_MAX):
                raise InvalidRequestError(
                    f"{name} must be an int >= 0 or None, got {value!r}", param=name
                )
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise InvalidRequestError(
                    f"stop strings must be non-empty str, got {stop!r}", param="stop"
                )
            check_text(stop, "stop")
        for token_id in self.stop_token_ids:
            if not is_int(token_id) or not 0 <= token_id <= INT64_MAX:
                raise InvalidRequestError(
                    f"stop_token_ids must be ints in [0, 2**63), got {token_id!r}",
                    param="stop_token_ids",
                )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be a bool, got {value!r}", param=name)
        if self.seed is not None and not is_int(self.seed):
            raise InvalidRequestError(
                f"seed must be an int or None, got {self.seed!r}", param="seed"
            )
        num_samples = self.num_samples
        # Sample i of an n > 1 request is seeded with seed + i; torch.Generator takes 64-bit seeds.
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX - (num_samples - 1):
            raise InvalidRequestError(
                f"seed must be in [{SEED_MIN}, {SEED_MAX - (num_samples - 1)}] (a 64-bit seed "
                f"for each of the {num_samples} samples), got {self.seed!r}",
                param="seed",
            )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise InvalidRequestError(
                f"structured_outputs must be a StructuredOutputsParams or None, got "
                f"{type(self.structured_outputs).__name__}",
                param="structured_outputs",
            )

    @property
    def num_samples(self) -> int:
        """Samples generated: ``best_of`` when given, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature ~ 0)."""
        return self.temperature < GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        """True when presence, frequency or repetition penalties change the logits."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """True when the request must compute its whole prompt (it asks for prompt logprobs,
        which need the logits of every prompt position), so prefix-cache hits are not used."""
        return self.prompt_logprobs is not None

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of an ``n > 1`` request: n = 1, and the seed (when
        given) offset by the index so the samples differ yet stay reproducible. Prompt logprobs
        are computed once, by sample 0 (the prompt is the same for all)."""
        seed = None if self.seed is None else self.seed + index
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        logprobs = self.logprobs
        if self.num_samples > self.n and logprobs is None:
            logprobs = 0  # best_of ranks by the sampled tokens' logprobs
        return dataclasses.replace(
            self, n=1, best_of=None, seed=seed, prompt_logprobs=prompt_logprobs, logprobs=logprobs
        )


#: The constraint kinds of :class:`StructuredOutputsParams`, in the order its fields come.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True, kw_only=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``StructuredOutputsParams``, the same field names):
    every sampled token keeps the output a prefix of a string the constraint accepts, and once
    the output is complete only the end-of-sequence token may follow. The engine compiles the
    constraint with xgrammar (:mod:`pagedkv.engine.structured_output`).

    Exactly one kind is given:

    Args:
        json: a JSON Schema (a dict, or its JSON text): the output is a JSON value that
            validates against it.
        regex: a regular expression the whole output matches.
        choice: the output is one of these strings (a non-empty list).
        grammar: an EBNF grammar (GBNF / xgrammar's dialect, the rule ``root`` first) the
            output is a sentence of.
        json_object: True: the output is any JSON object (OpenAI's
            ``response_format={"type": "json_object"}``).
        disable_any_whitespace: with ``json`` / ``json_object``: no whitespace between JSON
            tokens beyond a single space after ``:`` and ``,`` (a compact output; small models
            otherwise tend to emit runs of newlines).

    Raises:
        InvalidRequestError: no kind or more than one, or a value of the wrong type (``json``
            neither a dict nor JSON text of an object, an empty ``regex`` / ``grammar`` /
            ``choice``, a choice that is not a str, ``json_object`` not True / False / None),
            naming the field (``param`` is ``"structured_outputs"``). Whether a schema, regex
            or grammar compiles is checked by the engine when the request is added.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidRequestError(
                    f"structured_outputs.{name} must be a bool, got {value!r}",
                    param="structured_outputs",
                )
        given = [k for k in STRUCTURED_OUTPUT_KINDS if self._given(k)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs must give exactly one of json, regex, choice, grammar and "
                f"json_object, got {', '.join(given) if given else 'none'}",
                param="structured_outputs",
            )
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(
                    f"structured_outputs.json is not valid JSON text: {e}",
                    param="structured_outputs",
                ) from None
            if not isinstance(parsed, dict):
                raise InvalidRequestError(
                    "structured_outputs.json must be a JSON Schema object, got JSON text of "
                    f"a {type(parsed).__name__}",
                    param="structured_outputs",
                )
        elif self.json is not None and not isinstance(self.json, dict):
            raise InvalidRequestError(
                f"structured_outputs.json must be a dict or JSON text, got "
                f"{type(self.json).__name__}",
                param="structured_outputs",
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(
                    f"structured_outputs.{name} must be a non-empty str, got {value!r}",
                    param="structured_outputs",
                )
            if value is not None:
                check_text(value, "structured_outputs")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not isinstance(self.choice, list) or not self.choice:
                raise InvalidRequestError(
                    f"structured_outputs.choice must be a non-empty list of str, got "
                    f"{self.choice!r}",
                    param="structured_outputs",
                )
            for item in self.choice:
                if not isinstance(item, str):
                    raise InvalidRequestError(
                        f"structured_outputs.choice must hold str only, got {item!r}",
                        param="structured_outputs",
                    )
                check_text(item, "structured_outputs")

    def _given(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is True if kind == "json_object" else value is not None

    @property
    def kind(self) -> str:
        """The constraint's kind: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if self._given(k))

    @property
    def key(self) -> tuple[str, str, bool]:
        """``(kind, spec, disable_any_whitespace)``, hashable: equal constraints have equal keys
        (a schema dict as canonical JSON text), what compiled grammars are cached by."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            spec = json.dumps(
                json.loads(value) if isinstance(value, str) else value,
                sort_keys=True,
                separators=(",", ":"),
            )
        elif kind == "choice":
            spec = json.dumps(value)
        elif kind == "json_object":
            spec = ""
        else:
            spec = value
        return kind, spec, self.disable_any_whitespace


#: Largest int64 (token ids, counts and top_k become int64 tensors).
INT64_MAX = 2**63 - 1
#: Largest finite float32 and smallest positive normal float32 (the sampler computes in float32).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38
#: Range of repetition_penalty: a seen token's logit is divided (or multiplied) by at most 100
#: (the module docstring has the arithmetic that keeps the sampler finite with these bounds).
REPETITION_PENALTY_MIN = 0.01
REPETITION_PENALTY_MAX = 100.0
#: The closed range ``[low, high]`` of each float field, the one copy of them (the server's
#: OpenAPI schema states them too); the module docstring has why each bound is where it is.
FLOAT_RANGES: Mapping[str, tuple[float, float]] = MappingProxyType(
    {
        "temperature": (0.0, FLOAT32_MAX),
        "top_p": (FLOAT32_MIN_NORMAL, 1.0),
        "min_p": (0.0, 1.0),
        "presence_penalty": (-2.0, 2.0),
        "frequency_penalty": (-2.0, 2.0),
        "repetition_penalty": (REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX),
    }
)


def _check_float(name: str, value: object, why: str) -> None:
    """Raise InvalidRequestError (``param`` = ``name``) unless ``value`` is an int or float (not
    a bool, not NaN) in ``FLOAT_RANGES[name]``; the message gives the range, ``why`` and the
    value."""
    low, high = FLOAT_RANGES[name]
    if not is_number(value) or not low <= value <= high:
        raise InvalidRequestError(
            f"{name} must be a number in [{low:g}, {high:g}] ({why}), got {value!r}", param=name
        )


def resolve_max_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """A request's output-token limit: ``max_tokens``, or for None the room the prompt leaves
    in max_model_len (``max_model_len - num_prompt_tokens``: < 1 when it leaves none; the
    caller refuses that). The one home of the rule, for every request kind (sampling, n > 1,
    beam search); its one caller is the engine's
    :meth:`~pagedkv.engine.input_processor.InputProcessor.resolve_max_tokens`, once per request
    before it is queued (the HTTP layer passes the client's value through, None when absent)."""
    return max_model_len - num_prompt_tokens if max_tokens is None else max_tokens


def check_text(value: str, name: str) -> None:
    """Raise InvalidRequestError (naming ``name``) unless ``value`` is valid Unicode text
    (:func:`pagedkv.validation.utf8_error`)."""
    error = utf8_error(value)
    if error is not None:
        raise InvalidRequestError(f"{name} is not valid Unicode text: {error}", param=name)


#: logit_bias values are clamped to this range (OpenAI's documented range of the field).
LOGIT_BIAS_LIMIT = 100.0


def _clamped_logit_bias(logit_bias: object) -> dict[int, float]:
    """``{token id: bias}`` with ids checked (ints in int64; the engine checks the vocabulary)
    and biases checked (finite numbers) and clamped to [-100, 100]."""
    if not isinstance(logit_bias, dict):
        raise InvalidRequestError(
            f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}",
            param="logit_bias",
        )
    clamped = {}
    for token_id, bias in logit_bias.items():
        if not is_int(token_id) or not 0 <= token_id <= INT64_MAX:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (ints >= 0), got {token_id!r}",
                param="logit_bias",
            )
        if not is_number(bias) or not math.isfinite(bias):
            raise InvalidRequestError(
                f"logit_bias[{token_id}] must be a finite number, got {bias!r}",
                param="logit_bias",
            )
        clamped[token_id] = float(min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, bias)))
    return clamped


@dataclass(slots=True)
class BeamSearchParams:
    """Parameters of a beam-search request (vLLM's ``BeamSearchParams``: the same fields, names
    and defaults; ``LLM.beam_search`` takes them, and so does ``LLMEngine.add_request``).

    Beam search keeps the ``beam_width`` most likely partial sequences (beams); each step every
    beam computes one token, the ``2 * beam_width`` best continuations of all beams are ranked by
    their summed log-probability, and the best ``beam_width`` of them that did not end become
    the next beams. The choice follows Hugging Face transformers' beam search exactly (its
    ``generate(num_beams=beam_width, do_sample=False, early_stopping=False)``):
    :mod:`pagedkv.engine.beam_search` has the rules.

    Args:
        beam_width: beams kept per step, and sequences returned (>= 1; at most the engine's
            ``max_num_seqs``, each beam being a running sequence; 2 * beam_width at most the
            vocabulary size). transformers runs greedy search for one beam, not beam search:
            the equality with it holds from 2 beams on.
        max_tokens: most generated tokens per sequence (>= 1; prompt + max_tokens at most
            max_model_len); None = up to max_model_len, resolved by the engine when the
            request is added (:func:`resolve_max_tokens`, as for :class:`SamplingParams`).
        ignore_eos: keep generating after the end-of-sequence token (no sequence ends before
            max_tokens).
        temperature: accepted for vLLM compatibility (in [0, largest float32]) and not used:
            beams are ranked by the model's raw log-probabilities, as vLLM V1 ranks them (its
            logprobs are raw by default), so the search is deterministic whatever its value.
        length_penalty: a finished sequence of L generated tokens (its end-of-sequence token
            included) scores ``sum of logprobs / L ** length_penalty`` (a finite number;
            transformers' definition: > 0 favours longer sequences, < 0 shorter ones).
        include_stop_str_in_output: keep the end-of-sequence token's text at the end of the
            text (its id is in the token ids either way).
        skip_special_tokens: leave special tokens out of the text (not in vLLM's
            ``BeamSearchParams``, whose texts keep them: False by default, as there; the
            server's ``use_beam_search`` passes the request's ``skip_special_tokens``).

    Raises:
        InvalidRequestError: a value out of its range or of the wrong type, naming the field
            (also as the error's ``param``).
    """

    beam_width: int
    max_tokens: int | None
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_tokens":
                continue
            if not is_int(value) or not 1 <= value <= INT64_MAX:
                raise InvalidRequestError(f"{name} must be an int >= 1, got {value!r}", param=name)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be a bool, got {value!r}", param=name)
        _check_float("temperature", self.temperature, "not used by beam search: see above")
        if not is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise InvalidRequestError(
                f"length_penalty must be a finite number, got {self.length_penalty!r}",
                param="length_penalty",
            )
