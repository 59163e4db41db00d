"""Beam search inside the engine: a group of beam requests that fork their KV blocks.

A beam-search request (``LLMEngine.add_request`` with :class:`~pagedkv.sampling_params.
BeamSearchParams`) is a :class:`BeamSearchGroup` of beams, each beam a scheduler
:class:`~pagedkv.engine.request.Request` of its own. Every step each live beam computes one token
(its last), and the model runner returns the ``K`` most likely next tokens of that position with
their log-probabilities (the beams' sampling params ask for ``logprobs=K``, ``K = 2 * beam_width``
for a model with one end-of-sequence token). When every live beam has reported its row, the
scheduler calls :meth:`BeamSearchGroup.step`, which chooses the next beams exactly as Hugging Face
transformers' ``_beam_search`` does (``generate(num_beams=w, do_sample=False,
early_stopping=False)``, transformers 5.x), for one prompt::

    candidates  each beam b's K tokens t: score = score_b + logprob_b(t)  (float32)
    top         the K best candidates of all beams (score descending)
    hits        a candidate ends its sequence: t is an end-of-sequence token, or it is the
                max_tokens-th generated token
    running     the w best candidates of ``top`` that do not end: the next beams, in order
    finished    the candidates among the first w of ``top`` that end become hypotheses, scored
                ``score / L ** length_penalty`` (L: generated tokens, the end token included);
                the w best hypotheses so far are kept
    stop        after max_tokens tokens, or once w hypotheses are kept and the best running
                beam's ``score / L ** length_penalty`` (L: tokens generated so far) is not above
                the worst kept hypothesis (transformers' heuristic for early_stopping=False)

The result is the kept hypotheses, best first. Every float step above is done in float32 as
transformers does it on its tensors (a sum or quotient of two float32 values rounded to float32;
the length penalty ``L ** length_penalty`` computed in double, then rounded to float32 before the
division, as torch does with a Python scalar), so ties and near-ties break the same way. The top
K of all ``w * vocab`` candidates are among the beams' own top K, which is all the runner sends.

What the scheduler does with a step's choice (:class:`BeamStep`), between two steps:

- a beam chosen once takes its token in place (it computes it next step);
- a beam chosen k > 1 times forks k - 1 children (``KVCacheManager.fork``: they map its blocks,
  the shared partially filled last block is copied on write), each with its own token;
- a beam not chosen is freed.

So no beam ever recomputes KV it had: a step computes one token per live beam. Beams are not
batched in lockstep by the scheduler: a beam that reported waits (it has nothing to compute, so
the scheduler passes over it) until its siblings have reported too (one may have been preempted
and be recomputing, or not have fitted in the step's token budget). The scheduler's side
(seats, preemption, abort) is described in docs/engine.md, "Beam search".

The outputs have vLLM's shape (:class:`BeamSearchSequence`, :class:`BeamSearchOutput`, from
``vllm/beam_search.py``); the search itself is not vLLM's (vLLM V1 runs each beam as a new
one-token request that re-reads the prefix cache).

Pure Python (no torch, no numpy): the scheduler imports it.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.engine.outputs import Logprob, PositionLogprobs, RequestOutput
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.engine.request import Request

_PACK_F32 = struct.Struct("<f")
#: Doubles at or beyond this round to infinity in float32 (the largest float32 plus half a unit
#: in the last place: round-to-nearest-even rounds exactly there up to infinity).
_F32_OVERFLOW = 3.4028235677973366e38


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (ties to even), as a Python float; beyond the float32
    range, an infinity of its sign. A sum or quotient of two float32 values computed in double
    and rounded once to float32 equals the float32 operation (53 >= 2 * 24 + 2 bits)."""
    if x >= _F32_OVERFLOW:
        return math.inf
    if x <= -_F32_OVERFLOW:
        return -math.inf
    return _PACK_F32.unpack(_PACK_F32.pack(x))[0]


def length_penalty_divisor(num_tokens: int, length_penalty: float) -> float:
    """``num_tokens ** length_penalty`` as transformers divides a float32 score by it: computed
    in double (Python's ``int ** float``), then rounded to float32; infinity when it overflows."""
    try:
        return f32(num_tokens**length_penalty)
    except OverflowError:
        return math.inf


def penalised_score(score: float, divisor: float) -> float:
    """``score / divisor`` in float32 as torch divides: a divisor that underflowed to 0 (a
    negative ``length_penalty`` such as -200 makes ``L ** length_penalty`` smaller than the
    least float32) gives -inf for a negative score, +inf for a positive one; 0 / 0 (torch's NaN)
    gives -inf, so that the ranking stays a total order."""
    if divisor == 0.0:
        return math.inf if score > 0 else -math.inf
    return f32(score / divisor)


def num_beam_candidates(beam_width: int, num_eos_token_ids: int) -> int:
    """K, the candidates kept per step (and the logprobs each beam asks for): transformers'
    ``max(2, 1 + number of EOS ids) * num_beams``, so that at least ``beam_width`` of them do not
    end with an end-of-sequence token (each beam's row holds each EOS id at most once)."""
    return max(2, 1 + num_eos_token_ids) * beam_width


def beam_sampling_params(params: BeamSearchParams, num_candidates: int) -> SamplingParams:
    """The sampling params of every beam request: greedy (the sampled token is not used), the
    top ``num_candidates`` raw logprobs, no stop condition of its own (the group decides when a
    beam ends), at most ``params.max_tokens`` tokens (the scheduler's length checks)."""
    return SamplingParams(
        temperature=0.0,
        max_tokens=params.max_tokens,
        ignore_eos=True,
        logprobs=num_candidates,
        skip_special_tokens=False,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )


@dataclass(slots=True, frozen=True)
class _Token:
    """One generated token of a beam's history, linked to the one before (beams share their
    common past: a fork copies nothing here)."""

    parent: _Token | None
    token_id: int
    logprob: float
    #: the K candidates of the position it was chosen at: token ids and logprobs (raw rows from
    #: the runner, shared by every token chosen from the same beam at the same step)
    row_ids: list[int]
    row_logprobs: list[float]


def _history(last: _Token | None) -> list[_Token]:
    """The tokens ending with ``last``, first to last."""
    tokens = []
    while last is not None:
        tokens.append(last)
        last = last.parent
    tokens.reverse()
    return tokens


@dataclass(slots=True)
class _Beam:
    """A live beam: its request, float32 score (sum of its logprobs) and last token."""

    request: Request
    score: float
    last: _Token | None
    #: the K candidates it reported for the current step (None until it reports)
    row: tuple[list[int], list[float]] | None = None


@dataclass(slots=True, frozen=True)
class BeamHypothesis:
    """A finished sequence of a beam search.

    Attributes:
        token_ids: the generated tokens (the end-of-sequence token included when it ended one).
        cum_logprob: the sum of their logprobs (float32 accumulation, transformers' beam score).
        score: ``cum_logprob / len(token_ids) ** length_penalty`` in float32 (transformers'
            ``sequences_scores``); hypotheses are ranked by it.
        finish_reason: "stop" (it ended with an end-of-sequence token) or "length".
        stop_reason: the end-of-sequence token id for "stop", else None.
        logprobs: per generated token, ``(token id, logprob, the K candidate ids, their
            logprobs)`` of the step that chose it.
    """

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str
    stop_reason: int | None
    logprobs: list[tuple[int, float, list[int], list[float]]]


@dataclass(slots=True)
class BeamStep:
    """What one :meth:`BeamSearchGroup.step` decided, for the scheduler to apply.

    Attributes:
        continuations: the next beams, best first, as ``(request, parent, token id)``: the
            request is the parent itself (it takes the token in place) or a new child request
            (a fork of the parent, holding the parent's token ids and no blocks yet).
        dropped: the beams not chosen (all live beams once the search is done): free them.
        done: the search is over; :attr:`BeamSearchGroup.hypotheses` holds the result.
    """

    continuations: list[tuple[Request, Request, int]] = field(default_factory=list)
    dropped: list[Request] = field(default_factory=list)
    done: bool = False


class BeamSearchGroup:
    """The beams of one beam-search request and the rules that choose them (see the module
    docstring).

    Args:
        request_id: the request's id (``add_request``'s); beams are ``{request_id}#beam{n}``.
        params: the beam-search parameters.
        eos_token_ids: the model's end-of-sequence ids (ignored with ``params.ignore_eos``).
        make_root: builds the first beam's request from its id and sampling params (the engine
            gives the prompt, hashing, salt, priority...).

    Attributes:
        root: the first beam (it computes the prompt); the engine's outputs are keyed by it.
        beams: the live beams' requests, in transformers' running order (best first).
        hypotheses: the result, best first, once :attr:`done` (None before).
        num_generated: tokens generated per beam so far.
        error: why the search failed (the engine reports finish_reason "error"), or None.
    """

    def __init__(
        self,
        request_id: str,
        params: BeamSearchParams,
        eos_token_ids: frozenset[int],
        make_root,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.beam_width = params.beam_width
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.num_candidates = num_beam_candidates(params.beam_width, len(self.eos_token_ids))
        self.sampling_params = beam_sampling_params(params, self.num_candidates)
        self._num_ids = 0
        self.root: Request = make_root(self._next_id(), self.sampling_params)
        self.root.beam_group = self
        self._beams: list[_Beam] = [_Beam(self.root, 0.0, None)]
        self._by_id: dict[str, _Beam] = {self.root.request_id: self._beams[0]}
        self._num_reported = 0
        self._finished: list[BeamHypothesis] = []
        self._improvable = True
        self.num_generated = 0
        self.done = False
        self.hypotheses: list[BeamHypothesis] | None = None
        self.error: str | None = None

    def _next_id(self) -> str:
        request_id = f"{self.request_id}#beam{self._num_ids}"
        self._num_ids += 1
        return request_id

    @property
    def beams(self) -> list[Request]:
        """The live beams' requests, best first."""
        return [beam.request for beam in self._beams]

    def has_reported(self, request: Request) -> bool:
        """True when ``request`` (a live beam) has reported its candidates for this step."""
        beam = self._by_id.get(request.request_id)
        return beam is not None and beam.row is not None

    def report(self, request: Request, token_ids: list[int], logprobs: list[float]) -> bool:
        """Take the K candidates a beam computed (its top-K token ids and raw logprobs, most
        likely first). A second report of the same step (a beam recomputed after preemption)
        is ignored. Returns True once every live beam has reported: call :meth:`step`.

        Raises:
            InvalidRequestError: fewer than K candidates, or ``request`` is not a live beam.
        """
        beam = self._by_id.get(request.request_id)
        if beam is None or self.done:
            raise InvalidRequestError(f"{request.request_id!r} is not a live beam")
        if len(token_ids) < self.num_candidates or len(logprobs) < self.num_candidates:
            raise InvalidRequestError(
                f"beam {request.request_id!r} reported {len(token_ids)} candidates, the search "
                f"needs {self.num_candidates}"
            )
        if beam.row is None:
            beam.row = (token_ids[: self.num_candidates], logprobs[: self.num_candidates])
            self._num_reported += 1
        return self._num_reported == len(self._beams)

    def step(self) -> BeamStep:
        """Choose the next beams from every beam's reported candidates (transformers' rules:
        see the module docstring), record new hypotheses, and decide whether the search ends.

        Returns:
            The continuations (children already made as requests), the dropped beams, done.

        Raises:
            InvalidRequestError: a live beam has not reported yet.
        """
        if self.done or self._num_reported != len(self._beams):
            raise InvalidRequestError("BeamSearchGroup.step: not every live beam has reported")
        width = self.beam_width
        eos = self.eos_token_ids
        # 1) Every beam's candidates; the K best overall (ties: lower beam, then lower token id,
        # that is the lower index into transformers' flattened [beam, vocab] scores).
        candidates = []
        for index, beam in enumerate(self._beams):
            ids, logprobs = beam.row
            base = beam.score
            for token_id, logprob in zip(ids, logprobs, strict=True):
                candidates.append((f32(base + logprob), index, token_id, logprob))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = candidates[: self.num_candidates]
        num_generated = self.num_generated + 1
        at_max = num_generated >= self.params.max_tokens
        ends = [at_max or c[2] in eos for c in top]

        # 2) New hypotheses: the ending candidates among the first beam_width (transformers'
        # top_num_beam_mask), scored with the length penalty; keep the best beam_width (the old
        # ones first among equal scores: transformers concatenates old, then new).
        divisor = length_penalty_divisor(num_generated, self.params.length_penalty)
        for (score, index, token_id, logprob), ended in zip(top[:width], ends, strict=False):
            if ended:
                beam = self._beams[index]
                last = _Token(beam.last, token_id, logprob, *beam.row)
                self._finished.append(
                    self._hypothesis(last, score, penalised_score(score, divisor))
                )
        self._finished.sort(key=lambda h: -h.score)
        del self._finished[width:]

        # 3) The next beams: the best beam_width candidates that did not end.
        chosen = [c for c, ended in zip(top, ends, strict=True) if not ended][:width]
        self.num_generated = num_generated
        if chosen:
            # transformers' early-stop heuristic (early_stopping=False): can the best running
            # beam, scored at the current length, still beat the worst kept hypothesis (-1e9
            # while fewer than beam_width are kept)? Never stop with fewer than beam_width
            # kept (transformers' BeamHypotheses.is_done): a score at or below -1e9 (a huge
            # negative length_penalty makes it -inf) would otherwise end the search with no
            # result at all.
            best = penalised_score(chosen[0][0], divisor)
            full = len(self._finished) == width
            worst = min(h.score for h in self._finished) if full else -1e9
            self._improvable = best > worst or not full
        if at_max or not self._improvable or not chosen:
            return self._finish()

        result = BeamStep()
        new_beams: list[_Beam] = []
        taken: set[int] = set()
        for score, index, token_id, logprob in chosen:
            parent = self._beams[index]
            last = _Token(parent.last, token_id, logprob, *parent.row)
            if index in taken:  # chosen again: a child forked from it
                request = parent.request.fork(self._next_id())
            else:
                taken.add(index)
                request = parent.request
            result.continuations.append((request, parent.request, token_id))
            new_beams.append(_Beam(request, score, last))
        result.dropped = [b.request for i, b in enumerate(self._beams) if i not in taken]
        self._beams = new_beams
        self._by_id = {beam.request.request_id: beam for beam in new_beams}
        self._num_reported = 0
        return result

    def _hypothesis(self, last: _Token, cum_logprob: float, score: float) -> BeamHypothesis:
        tokens = _history(last)
        ended_by_eos = last.token_id in self.eos_token_ids
        return BeamHypothesis(
            token_ids=[t.token_id for t in tokens],
            cum_logprob=cum_logprob,
            score=score,
            finish_reason="stop" if ended_by_eos else "length",
            stop_reason=last.token_id if ended_by_eos else None,
            logprobs=[(t.token_id, t.logprob, t.row_ids, t.row_logprobs) for t in tokens],
        )

    def _finish(self) -> BeamStep:
        """End the search: every live beam is dropped; the kept hypotheses are the result."""
        result = BeamStep(dropped=self.beams, done=True)
        self.done = True
        self.hypotheses = list(self._finished)
        self._beams = []
        self._by_id = {}
        return result

    def abort(self, error: str | None = None) -> list[Request]:
        """End the search without a result (abort, or ``error``); returns the live beams, for
        the scheduler to free."""
        beams = self.beams
        self.done = True
        self.error = error
        self._beams = []
        self._by_id = {}
        return beams


# ---------------------------------------------------------------------------- outputs (vLLM's)


@dataclass(slots=True)
class BeamSearchSequence:
    """One sequence of a beam search's result (vLLM's ``BeamSearchSequence``).

    Attributes:
        tokens: the prompt's token ids, then the generated ones (an ending end-of-sequence
            token included).
        logprobs: per generated token, ``{token id: Logprob}``: the chosen token (with its rank
            among the candidates) and the K candidates of that step.
        cum_logprob: the sum of the generated tokens' logprobs.
        text: the generated text (the end-of-sequence token's text left out unless
            ``include_stop_str_in_output``; special tokens kept, as vLLM decodes).
        finish_reason: "stop" (end-of-sequence token) or "length" (max_tokens).
        stop_reason: the end-of-sequence token id that ended it, else None.
    """

    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The result of one beam-search prompt (vLLM's ``BeamSearchOutput``).

    Attributes:
        sequences: ``beam_width`` sequences, best first (by transformers' score, the length
            penalty applied).
    """

    sequences: list[BeamSearchSequence]


def beam_search_output(output: RequestOutput) -> BeamSearchOutput:
    """A finished beam-search :class:`RequestOutput` (what ``LLMEngine.step`` reports once for
    a request added with :class:`BeamSearchParams`) as vLLM's :class:`BeamSearchOutput`.

    Raises:
        InvalidRequestError: the output is not finished, or the search ended without a result
            (finish_reason "abort" or "error": its ``outputs[0].error`` says why).
    """
    if not output.finished:
        raise InvalidRequestError(f"request {output.request_id!r} has not finished")
    failed = [o for o in output.outputs if o.finish_reason in ("abort", "error")]
    if failed:
        raise InvalidRequestError(
            f"beam search {output.request_id!r} ended with finish_reason "
            f"{failed[0].finish_reason!r}: {failed[0].error or 'no result'}"
        )
    prompt = list(output.prompt_token_ids)
    return BeamSearchOutput(
        [
            BeamSearchSequence(
                tokens=prompt + list(o.token_ids),
                logprobs=list(o.logprobs or []),
                cum_logprob=o.cumulative_logprob or 0.0,
                text=o.text,
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
            )
            for o in output.outputs
        ]
    )


def hypothesis_logprobs(hypothesis: BeamHypothesis, decode_tokens) -> list[PositionLogprobs]:
    """The hypothesis' logprobs in vLLM's shape: per token ``{chosen: Logprob(rank among the
    candidates), then each candidate: Logprob(rank 1..K)}``, token texts from
    ``decode_tokens(ids)`` (each token's text on its own)."""
    flat = [t for token_id, _, ids, _ in hypothesis.logprobs for t in (token_id, *ids)]
    texts = iter(decode_tokens(flat))
    positions = []
    for token_id, logprob, ids, values in hypothesis.logprobs:
        chosen_text = next(texts)
        rank = ids.index(token_id) + 1 if token_id in ids else len(ids) + 1
        entry = {token_id: Logprob(logprob, rank, chosen_text)}
        for candidate_rank, (candidate, value) in enumerate(zip(ids, values, strict=True), 1):
            text = next(texts)
            if candidate not in entry:
                entry[candidate] = Logprob(value, candidate_rank, text)
        positions.append(entry)
    return positions
