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

from pagedkv.core.interface import KVCacheInterface
from pagedkv.core.kv_cache_blocks import KVCacheBlocks
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.request_queues import RequestQueues
from pagedkv.engine.stats import SchedulerStats
from pagedkv.worker.outputs import ModelRunnerOutput


class KVTierLoads:
    """When a request waits for its KV tier loads, what their reports do, and the loaded
    requests to resume.

    Moves requests through the scheduler's queues (their loading set holds the requests in
    flight), asks its KV cache and counts into its counters; owns the resumptions.

    Args:
        queues: the scheduler's requests.
        kv_cache: the KV cache (prefix hits, tier entries, frees).
        stats: the scheduler's counters (``num_kv_tier_loads``, ``num_kv_tier_load_failures``).
        wait_for_kv_loads: hold a tier hit until the workers report its loads (the engine);
            False: loads are instant (the simulator).
    """

    def __init__(
        self,
        queues: RequestQueues,
        kv_cache: KVCacheInterface,
        stats: SchedulerStats,
        wait_for_kv_loads: bool,
    ) -> None:
        self._queues = queues
        self._kv_cache = kv_cache
        self._stats = stats
        self.wait_for_kv_loads = wait_for_kv_loads
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

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, bool]:
        """The KV cache's prefix hit for ``request``: ``(blocks, hit tokens, loads)``, loads
        True when it must wait for the tier's part. A beam recomputes its tier part instead
        (its seats are reserved with its group's; its pool hit stays)."""
        kv_cache = self._kv_cache
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
            self._queues.wait_for_loads(request)
            self._stats.num_kv_tier_loads += 1
            return True
        if blocks.tier_hashes and not self.wait_for_kv_loads:
            self._kv_cache.finish_tier_loads(request.request_id)
        return False

    def update(self, runner_output: ModelRunnerOutput) -> None:
        """Apply the workers' tier reports: stores they dropped are forgotten; requests whose
        loads are all good run from their loaded prefix (with the seat they kept; their loaded
        blocks enter the prefix cache with their next allocation). Some failed: the tier
        forgets the bad entries and the request goes back to the front of the waiting queue
        with its blocks freed (never cached), so it recomputes what the tier could not give;
        its output does not change. One released meanwhile (aborted): its blocks are freed
        (:meth:`~pagedkv.engine.request_queues.RequestQueues.loads_ended`)."""
        queues = self._queues
        kv_cache = self._kv_cache
        if runner_output.dropped_kv_stores:
            kv_cache.discard_tier_entries(runner_output.dropped_kv_stores, failed_load=False)
        failed = runner_output.failed_kv_loads
        if not queues.loading or not (runner_output.finished_kv_loads or failed):
            return
        for keys in failed.values():
            kv_cache.discard_tier_entries(keys)
        for request_id in (*runner_output.finished_kv_loads, *failed):
            request = queues.loads_ended(request_id)
            if request is None:
                continue
            if request_id in failed:
                kv_cache.free(request)
                request.status = (
                    RequestStatus.PREEMPTED if request.num_sent_tokens else RequestStatus.WAITING
                )
                request.num_computed_tokens = 0
                self._stats.num_kv_tier_load_failures += 1
                queues.requeue(request)
            else:
                queues.run(request)
                if request.num_sent_tokens:
                    self.resume_after_load.add(request_id)


__all__ = ["KVTierLoads"]
