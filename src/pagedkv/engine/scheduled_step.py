"""One scheduling step in the making, and the :class:`SchedulerOutput` built from it.

The scheduler fills a :class:`ScheduledStep` (running requests first, then admitted ones; a
preemption victim is taken out again), then :func:`build_scheduler_output` turns it into the plain
data the workers get and advances every scheduled request's ``num_computed_tokens``. What goes
to the workers is what changed since they last heard of a request::

    first scheduling (num_sent_tokens == 0)  -> NewRequestData: prompt, params, whole block table
    later                                    -> CachedRequestData row: new token ids, new block
                                                ids (None: none), or the whole table when its
                                                blocks were freed (resumed) or copied on write

Building it costs O(1) per scheduled decode request, whatever its context length.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagedkv.core.interface import KVCacheInterface
from pagedkv.core.kv_cache_blocks import KVCacheBlocks
from pagedkv.engine.stats import SchedulerStats
from pagedkv.worker.scheduler_output import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from pagedkv.engine.request import Request


class ScheduledStep:
    """The requests one ``Scheduler.schedule`` call has scheduled so far, in order.

    Attributes:
        requests: the scheduled requests, in scheduling order.
        new_blocks: the blocks each got in this step (None: none, or a resumption).
        resumed: per request, whether the workers must take its block table whole.
        num_scheduled_tokens: request id -> tokens it computes in this step.
        total_num_scheduled_tokens: their sum (the step's token budget used).
        preempted_req_ids: requests preempted in this step.
    """

    __slots__ = (
        "new_blocks",
        "num_lookahead_tokens",
        "num_scheduled_tokens",
        "preempted_req_ids",
        "requests",
        "resumed",
        "total_num_scheduled_tokens",
    )

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.new_blocks: list[KVCacheBlocks | None] = []
        self.resumed: list[bool] = []
        self.num_scheduled_tokens: dict[str, int] = {}
        self.num_lookahead_tokens: dict[str, int] = {}
        self.total_num_scheduled_tokens = 0
        self.preempted_req_ids: set[str] = set()

    def add(
        self,
        request: Request,
        num_new_tokens: int,
        new_blocks: KVCacheBlocks | None,
        resumed: bool,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """Schedule ``num_new_tokens`` tokens of ``request`` (and ``num_lookahead_tokens`` KV
        slots past them for the workers' draft model)."""
        if num_lookahead_tokens:
            self.num_lookahead_tokens[request.request_id] = num_lookahead_tokens
        self.requests.append(request)
        self.new_blocks.append(new_blocks)
        self.resumed.append(resumed)
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.total_num_scheduled_tokens += num_new_tokens

    def unschedule(self, request: Request) -> int:
        """Take ``request`` out of the step (a preemption victim); its tokens, 0 if absent."""
        num_tokens = self.num_scheduled_tokens.pop(request.request_id, 0)
        self.num_lookahead_tokens.pop(request.request_id, None)
        if num_tokens:
            index = self.requests.index(request)
            del self.requests[index], self.new_blocks[index], self.resumed[index]
            self.total_num_scheduled_tokens -= num_tokens
        return num_tokens


def build_scheduler_output(
    step: ScheduledStep,
    kv_cache: KVCacheInterface,
    finished_req_ids: set[str],
    stats: SchedulerStats,
) -> SchedulerOutput:
    """The workers' :class:`SchedulerOutput` of ``step``; advances each scheduled request's
    ``num_computed_tokens`` by its scheduled tokens and ``num_sent_tokens`` to its token count.

    Args:
        step: the step, complete.
        kv_cache: the KV cache the step allocated from (its copy-on-write pairs and KV tier
            instructions since the last step go with the output).
        finished_req_ids: requests finished since the last step (the workers forget them).
        stats: the scheduler's counters (``num_cow_copies`` grows).
    """
    blocks_to_copy = kv_cache.take_blocks_to_copy()
    copied = _copied_tables(step, kv_cache, blocks_to_copy) if any(blocks_to_copy) else None
    if copied is not None:
        stats.num_cow_copies += sum(len(copies) for copies in blocks_to_copy)
    out = SchedulerOutput(
        num_scheduled_tokens=step.num_scheduled_tokens,
        total_num_scheduled_tokens=step.total_num_scheduled_tokens,
        finished_req_ids=finished_req_ids,
        preempted_req_ids=step.preempted_req_ids,
        blocks_to_copy=blocks_to_copy if copied is not None else (),
        kv_tier_ops=kv_cache.take_tier_ops(),
        num_lookahead_tokens=step.num_lookahead_tokens,
    )
    cached = out.scheduled_cached_reqs
    num_scheduled_tokens = out.num_scheduled_tokens
    now = time.monotonic()
    for request, new_blocks, resumed in zip(
        step.requests, step.new_blocks, step.resumed, strict=True
    ):
        num_computed_tokens = request.num_computed_tokens
        num_sent_tokens = request.num_sent_tokens
        num_tokens = request.num_tokens
        if num_sent_tokens == 0:
            out.scheduled_new_reqs.append(
                NewRequestData(
                    request.request_id,
                    list(request.prompt_token_ids),
                    request.sampling_params,
                    kv_cache.get_block_ids(request.request_id),
                    num_computed_tokens,
                    tuple(request.eos_token_ids),
                    request.output_token_ids,  # a forked beam's, else none
                    request.pooling_params,
                )
            )
        else:
            cached.req_ids.append(request.request_id)
            cached.new_token_ids.append(
                request.all_token_ids[num_sent_tokens:num_tokens]
                if num_tokens > num_sent_tokens
                else []
            )
            if copied is not None and request.request_id in copied:
                resumed = True  # copy-on-write replaced a block of its table: send it whole
            cached.resumed_from_preemption.append(resumed)
            if resumed:  # its blocks were freed (or one replaced): the whole table is new
                cached.new_block_ids.append(kv_cache.get_block_ids(request.request_id))
            elif not new_blocks or not any(new_blocks.blocks):
                cached.new_block_ids.append(None)
            else:
                cached.new_block_ids.append(new_blocks.get_block_ids())
            cached.num_computed_tokens.append(num_computed_tokens)
        if request.spec_token_ids:
            out.scheduled_spec_decode_tokens[request.request_id] = request.spec_token_ids
        request.num_sent_tokens = num_tokens
        request.num_computed_tokens = num_computed_tokens + num_scheduled_tokens[request.request_id]
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
    return out


def _copied_tables(step: ScheduledStep, kv_cache: KVCacheInterface, blocks_to_copy) -> set[str]:
    """Ids of the step's requests whose table had a block replaced by copy-on-write (the
    block at their ``num_computed_tokens``, now a copy's ``dst``): their tables go whole."""
    block_size = kv_cache.block_size
    dsts = [{dst for _, dst in copies} for copies in blocks_to_copy]
    copied = set()
    for request in step.requests:
        index = request.num_computed_tokens // block_size
        for g, ids in enumerate(kv_cache.get_block_ids(request.request_id)):
            if dsts[g] and index < len(ids) and ids[index] in dsts[g]:
                copied.add(request.request_id)
                break
    return copied


__all__ = ["ScheduledStep", "build_scheduler_output"]
