"""The scheduler's KV tier loads: requests that hold blocks while the workers load their hits.

A waiting request whose prefix hit runs into the KV tier (``KVCacheBlocks.tier_hashes``) gets
pool blocks for the whole hit at admission; the workers read the tier's part into them. Until
they report the loads done, the request waits in ``WAITING_FOR_REMOTE_KVS`` (vLLM's status for
a KV connector's loads): neither waiting nor running, it keeps its seat, and the rest of the
batch runs::

    WAITING --admitted, tier hit--> WAITING_FOR_REMOTE_KVS --loads done--> RUNNING
                                                           --a load failed--> WAITING (front,
                                                                              blocks freed)

A driver without workers (the simulator) sets ``wait_for_kv_loads=False``: its loads are instant
and never fail, so the request runs in the step that allocates it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagedkv.core.kv_cache_blocks import KVCacheBlocks
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.worker.outputs import ModelRunnerOutput

if TYPE_CHECKING:
    from pagedkv.engine.scheduler import Scheduler


class KVTierLoads:
    """Requests waiting for their KV tier loads, and the loaded ones to resume.

    Shares the scheduler's queues (``running``, ``waiting``, ``requests``), its KV cache and
    its counters; owns the requests in flight.

    Args:
        scheduler: the scheduler it serves.
        wait_for_kv_loads: hold a tier hit until the workers report its loads (the engine);
            False: loads are instant (the simulator).
    """

    def __init__(self, scheduler: Scheduler, wait_for_kv_loads: bool) -> None:
        self._scheduler = scheduler
        self.wait_for_kv_loads = wait_for_kv_loads
        #: requests holding blocks while the workers load their tier hits, by id.
        self.loading: dict[str, Request] = {}
        #: loaded requests the workers held before (preempted): their first step after the
        #: load sends their whole block table.
        self.resume_after_load: set[str] = set()

    def take_resumed(self, request: Request) -> bool:
        """Whether ``request`` resumes from a preemption with KV loaded from the tier (the
        workers freed its table: they take it whole); forgotten once asked."""
        if request.request_id in self.resume_after_load:
            self.resume_after_load.discard(request.request_id)
            return True
        return False

    def __len__(self) -> int:
        return len(self.loading)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, bool]:
        """The KV cache's prefix hit for ``request``: ``(blocks, hit tokens, loads)``, loads
        True when it must wait for the tier's part. A beam recomputes its tier part instead
        (its seats are reserved with its group's; its pool hit stays)."""
        kv_cache = self._scheduler.kv_cache_manager
        blocks, num_computed_tokens = kv_cache.get_computed_blocks(request)
        tier_hashes = blocks.tier_hashes
        if not tier_hashes or not self.wait_for_kv_loads:
            return blocks, num_computed_tokens, False
        if request.beam_group is None:
            return blocks, num_computed_tokens, True
        num_computed_tokens -= len(tier_hashes) * kv_cache.block_size
        if not num_computed_tokens:
            return kv_cache.empty_kv_cache_blocks, 0, False
        return KVCacheBlocks(blocks.blocks), num_computed_tokens, False

    def admitted(self, request: Request, blocks: KVCacheBlocks, loads: bool) -> bool:
        """``request`` got its blocks. Returns True when it now waits for its loads (it does
        not run in this step); without workers a tier hit's loads are done at once."""
        if loads:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.loading[request.request_id] = request
            self._scheduler.stats.num_kv_tier_loads += 1
            return True
        if blocks.tier_hashes and not self.wait_for_kv_loads:
            self._scheduler.kv_cache_manager.finish_tier_loads(request.request_id)
        return False

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Finish a request still loading (abort): the workers are writing its blocks, so they
        are freed when the loads end (:meth:`update`)."""
        request.status = status
        request.finished_time = time.monotonic()
        if request.structured_output is not None:
            request.structured_output.free()
        self._scheduler.requests.pop(request.request_id, None)

    def update(self, runner_output: ModelRunnerOutput) -> None:
        """Apply the workers' tier reports: stores they dropped are forgotten; requests whose
        loads are all good run from their loaded prefix (with the seat they kept; their loaded
        blocks enter the prefix cache with their next allocation). Some failed: the tier
        forgets the bad entries and the request goes back to the front of the waiting queue
        with its blocks freed (never cached), so it recomputes what the tier could not give;
        its output does not change. One finished meanwhile (aborted): its blocks are freed."""
        scheduler = self._scheduler
        kv_cache = scheduler.kv_cache_manager
        if runner_output.dropped_kv_stores:
            kv_cache.discard_tier_entries(runner_output.dropped_kv_stores, failed_load=False)
        failed = runner_output.failed_kv_loads
        if not self.loading or not (runner_output.finished_kv_loads or failed):
            return
        for keys in failed.values():
            kv_cache.discard_tier_entries(keys)
        for request_id in (*runner_output.finished_kv_loads, *failed):
            request = self.loading.pop(request_id, None)
            if request is None:
                continue
            kv_cache.finish_tier_loads(request_id)
            if request.is_finished:
                kv_cache.free(request)
                scheduler.finished_req_ids.add(request_id)
            elif request_id in failed:
                kv_cache.free(request)
                request.status = (
                    RequestStatus.PREEMPTED if request.num_sent_tokens else RequestStatus.WAITING
                )
                request.num_computed_tokens = 0
                scheduler.stats.num_kv_tier_load_failures += 1
                scheduler.waiting.add_front(request)
            else:
                request.status = RequestStatus.RUNNING
                scheduler.running.append(request)
                if request.num_sent_tokens:
                    self.resume_after_load.add(request_id)


__all__ = ["KVTierLoads"]
