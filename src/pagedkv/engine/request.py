"""The engine's request: the core's KV-cache view of a request plus sampling, status and timing.

Lifecycle (vLLM V1)::

    add_request -> WAITING --schedule--> RUNNING --eos / stop / max_tokens--> FINISHED_STOPPED
                     ^                      |                                 FINISHED_LENGTH_CAPPED
                     +----- PREEMPTED <-----+ (blocks freed, num_computed_tokens = 0)
    abort at any point -> FINISHED_ABORTED;  can never fit -> FINISHED_ERROR
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.core.request import KVCacheRequest
from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.engine.beam_search import BeamSearchGroup


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    #: holds its KV blocks while the workers load them from the KV tier (vLLM's name); not
    #: scheduled until the loads are reported done.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        """True for the four finished statuses."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason ("stop", "length", "abort", "error"), None if running."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False, kw_only=True)
class Request(KVCacheRequest):
    """One sequence being generated (one of the ``n`` samples of a prompt).

    Fields beyond :class:`~pagedkv.core.request.KVCacheRequest`:
        sampling_params: how to sample and when to stop.
        eos_token_ids: the model's end-of-sequence token ids (ignored when ``ignore_eos``).
        priority: lower value = scheduled first under the "priority" policy.
        arrival_time: ``time.monotonic()`` when the request was made (FCFS order, metrics).
        status: see :class:`RequestStatus`.
        stop_reason: the stop token id or stop string that ended the request, if any.
        error: why the request was rejected (status FINISHED_ERROR).
        num_cached_tokens: prompt tokens served from the prefix cache at first admission
            (-1 until admitted).
        num_preemptions: times this request was preempted.
        num_sent_tokens: how many of its token ids the workers hold (sent in
            ``NewRequestData`` / ``CachedRequestData``); 0 until first scheduled. Tokens from
            there on go with its next scheduling.
        first_scheduled_time / first_token_time / finished_time: ``time.monotonic()`` stamps.
        fork_children: the sibling samples of an ``n > 1`` request, not yet scheduled: the
            scheduler forks them from this request (the parent) once it has computed
            ``fork_at`` tokens (all its prompt but the last token), sharing its blocks.
        fork_at: tokens the parent computes before it forks its children.
        beam_group: the beam search this request is a beam of (None for other requests): the
            scheduler hands its sampled candidates to the group instead of appending a token
            (:mod:`pagedkv.engine.beam_search`).
        spec_token_ids: its draft tokens for the next step (speculative decoding; vLLM's name):
            proposed by the scheduler's :class:`~pagedkv.engine.spec_decode.drafts.
            SpecDecodeDrafts`, never part of ``all_token_ids`` until accepted.
        structured_output: the sequence's constraint state when its sampling params have
            ``structured_outputs`` (a
            :class:`~pagedkv.engine.structured_output.StructuredOutputRequest`: its grammar
            and its own matcher), else None. The scheduler calls its ``ready`` / ``error`` /
            ``accept`` / ``is_terminated`` / ``free`` without importing it (it stays
            torch-free).
        pooling_params: a pooling (embedding) request's parameters, else None: it samples no
            token and finishes once its prompt is computed (FINISHED_STOPPED), with
            ``pooled_output`` set; its ``sampling_params`` are unused. Mean and cls pooling
            skip the prefix-cache lookup (every position's state is needed).
        pooled_output: the workers' pooled vector of a finished pooling request (a float32
            numpy array ``[hidden_size]``, opaque here), else None.
    """

    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    pooling_params: PoolingParams | None = None
    pooled_output: Any = field(default=None, repr=False)
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    num_sent_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    fork_children: list[Request] = field(default_factory=list)
    fork_at: int = 0
    beam_group: BeamSearchGroup | None = field(default=None, repr=False)
    structured_output: Any = field(default=None, repr=False)
    spec_token_ids: list[int] = field(default_factory=list, repr=False)
    _stop_token_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        # NOTE: explicit base call: zero-argument super() does not work in slots dataclasses.
        KVCacheRequest.__post_init__(self)
        self.eos_token_ids = frozenset(self.eos_token_ids)
        self._stop_token_ids = frozenset(self.sampling_params.stop_token_ids)
        if self.sampling_params.skip_reading_prefix_cache:
            self.skip_reading_prefix_cache = True
        if self.pooling_params is not None and self.pooling_params.skip_reading_prefix_cache:
            self.skip_reading_prefix_cache = True

    def fork(self, request_id: str) -> Request:
        """A new request with this one's token ids (prompt and output so far), block hashes,
        sampling params, identity (cache salt, LoRA, priority, arrival time) and beam group;
        nothing computed, no blocks, waiting. O(tokens) list copies, no hashing. A beam search
        forks beams with it (the KV blocks are shared by ``KVCacheManager.fork``)."""
        child = Request(
            request_id=request_id,
            prompt_token_ids=self.prompt_token_ids,
            lora_id=self.lora_id,
            cache_salt=self.cache_salt,
            mm_features=self.mm_features,
            skip_reading_prefix_cache=self.skip_reading_prefix_cache,
            sampling_params=self.sampling_params,
            eos_token_ids=self.eos_token_ids,
            priority=self.priority,
            arrival_time=self.arrival_time,
            beam_group=self.beam_group,
        )
        child.block_hasher = self.block_hasher
        child.all_token_ids = list(self.all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.num_cached_tokens = self.num_cached_tokens
        return child

    @property
    def is_finished(self) -> bool:
        """True once the request reached a finished status."""
        return self.status > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The finish reason ("stop", "length", "abort", "error") once finished, else None."""
        return _FINISH_REASONS.get(self.status)

    def check_stop(self, token_id: int) -> bool:
        """Set the finished status if ``token_id`` (just appended) ends the request.

        Order: end-of-sequence (unless ignore_eos), then stop_token_ids, then
        ``sampling_params.max_tokens`` (resolved before the request was queued); the
        first two only once ``min_tokens`` are generated (the sampler masks them before, so
        this only matters for a caller that appends tokens itself). Stop strings need the
        text, so the engine checks those. Returns True when finished.
        """
        params = self.sampling_params
        if self.num_output_tokens < params.min_tokens:
            if self.num_output_tokens >= params.max_tokens:
                self.status = RequestStatus.FINISHED_LENGTH_CAPPED
                return True
            return False
        if not params.ignore_eos and token_id in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif token_id in self._stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = token_id
        elif self.num_output_tokens >= params.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
        else:
            return False
        return True
