"""A small step scheduler over a KV-cache manager, for the simulator (vLLM V1's shape).

Each step:

1. Running requests, oldest first, get their next tokens (a decode token, or the next chunk of a
   prompt) within the token budget ``max_num_batched_tokens``. When ``allocate_slots`` refuses, the
   newest running request is preempted (blocks freed, ``num_computed_tokens = 0``, back to the front
   of the waiting queue) and the allocation is retried; a request that must preempt itself waits.
2. If nothing was preempted, waiting requests are admitted in order (``get_computed_blocks`` then
   ``allocate_slots``) while fewer than ``max_num_seqs`` run and budget is left. On a refusal,
   ``admission="fcfs"`` stops (vLLM's behaviour: no request overtakes an earlier one) and
   ``admission="skip"`` tries the next waiting request.

The engine's :class:`~pagedkv.engine.scheduler.Scheduler` is the real thing; this one exists so that
the simulator has an ``admission="skip"`` variant and so that the contiguous baseline, which is not
a KVCacheManager, runs through the same loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedkv.core.request import KVCacheRequest
from pagedkv.errors import ConfigError

ADMISSION_POLICIES = ("fcfs", "skip")


@dataclass(slots=True, eq=False, kw_only=True)
class SimKVRequest(KVCacheRequest):
    """A KV-cache request with the simulator's bookkeeping.

    Fields beyond KVCacheRequest:
        index: position in the trace.
        scripted_output: the token ids the fake model emits, in order.
    """

    index: int = -1
    scripted_output: list[int] = field(default_factory=list)
    num_cached_tokens: int = -1

    def __post_init__(self) -> None:
        KVCacheRequest.__post_init__(self)

    @property
    def is_done(self) -> bool:
        return self.num_output_tokens >= len(self.scripted_output)


@dataclass(slots=True)
class StepPlan:
    """What one step computes: request -> number of tokens (``num_computed_tokens`` already
    advanced by them), the requests preempted, and prefix-cache tokens at first admissions."""

    num_scheduled_tokens: dict[SimKVRequest, int]
    preempted: list[SimKVRequest]
    num_hit_tokens: int = 0
    num_queried_tokens: int = 0


class SimScheduler:
    """Continuous batching with chunked prefill and recompute preemption over ``kv_cache``.

    Args:
        kv_cache: a KVCacheManager or anything with its get_computed_blocks / allocate_slots /
            free methods (the contiguous baseline).
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget per step (>= 1).
        admission: "fcfs" (stop at the first waiting request that does not fit) or "skip".
        enable_caching: look up prefix-cache hits at admission.
    """

    def __init__(
        self,
        kv_cache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        admission: str = "fcfs",
        enable_caching: bool = False,
    ) -> None:
        if admission not in ADMISSION_POLICIES:
            raise ConfigError(
                f"admission must be one of {', '.join(ADMISSION_POLICIES)}, got {admission!r}"
            )
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.admission = admission
        self.enable_caching = enable_caching
        self.waiting: deque[SimKVRequest] = deque()
        self.running: list[SimKVRequest] = []

    def add_request(self, request: SimKVRequest) -> None:
        self.waiting.append(request)

    def schedule(self) -> StepPlan:
        """Pick this step's tokens and allocate their slots (see the module docstring)."""
        budget = self.max_num_batched_tokens
        plan = StepPlan({}, [])
        scheduled = plan.num_scheduled_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv_cache.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled[request] = num_new
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: nobody after it is running any more
        if plan.preempted:
            return plan

        skipped: list[SimKVRequest] = []
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            request = self.waiting.popleft()
            hit_blocks, num_hit = (
                self.kv_cache.get_computed_blocks(request) if self.enable_caching else (None, 0)
            )
            num_new = min(request.num_tokens - num_hit, budget)
            if (
                self.kv_cache.allocate_slots(request, num_new, num_hit, hit_blocks)
                if num_hit
                else self.kv_cache.allocate_slots(request, num_new)
            ) is None:
                if self.admission == "fcfs":
                    self.waiting.appendleft(request)
                    break
                skipped.append(request)
                continue
            if request.num_cached_tokens < 0:  # first admission, as the engine counts it
                request.num_cached_tokens = num_hit
                plan.num_queried_tokens += request.num_prompt_tokens
                plan.num_hit_tokens += num_hit
            request.num_computed_tokens = num_hit
            self.running.append(request)
            scheduled[request] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        for request, num_new in scheduled.items():
            request.num_computed_tokens += num_new
        return plan

    def _preempt(self, request: SimKVRequest) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    def finish(self, requests: list[SimKVRequest]) -> None:
        """Free finished running requests' blocks."""
        gone = {id(r) for r in requests}
        self.running = [r for r in self.running if id(r) not in gone]
        for request in requests:
            self.kv_cache.free(request)
