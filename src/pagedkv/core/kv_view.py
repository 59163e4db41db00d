"""A snapshot of the KV cache as plain data: what the web view (`/kv`) and the simulator's replay
draw.

::

    block ids:   0   1   2   3   4   5   6   7   8   9  ...
    state:       N   s   s   u   w   c   c   f   f   u  ...     one letter per block (BLOCK_STATES)
    ref_cnt:     0   2   2   1   1   0   0   0   0   1
    partial:     {3: 9, 4: 9, 9: 4}                        blocks in use not full: tokens written
    free_queue:  [5, 6, 7, 8, ...]                         head first: the next to be evicted
    requests:    [{"request_id": "a", "block_ids": [[1, 2, 3]], ...}, {"request_id": "b",
                  "block_ids": [[1, 2, 4]], ...}]          one block table per KV cache group

The snapshot reads the pool, the free block queue and the block tables through their public
methods, between two steps (nothing changes while it runs); it copies numbers only: no block hash
and no token id leaves it (a request's text must not leave the server through the view), only
token counts. Its cost is O(num_blocks + block table entries): about a millisecond at 10,000 blocks
(docs/server.md, "KV cache view", has the measured figure).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pagedkv.core.spec import SlidingWindowSpec

if TYPE_CHECKING:
    from pagedkv.core.manager import KVCacheManager
    from pagedkv.core.request import KVCacheRequest

#: The letter of each block state in ``snapshot["blocks"]["state"]``, and what it means.
BLOCK_STATES = {
    "N": "the null block (stands in for blocks a sliding window skipped)",
    "f": "free: in the free block queue, holding no cached prefix",
    "c": "free but cached: in the free block queue with a prefix-cache hash, hit-able until "
    "it is evicted (free_queue gives the eviction order)",
    "u": "in use by one request (ref_cnt 1)",
    "s": "shared: ref_cnt > 1 (a prefix-cache hit or a fork)",
    "w": "copied on write in the last step (the destination of a copy, or its source if "
    "still in use)",
    "d": "draft: lookahead slots only (speculative decoding), past every token of its request",
}

#: Snapshot format version (a reader checks it).
KV_SNAPSHOT_VERSION = 1


def snapshot_kv_cache(
    manager: KVCacheManager,
    requests: Iterable[tuple[KVCacheRequest, str]],
    *,
    num_scheduled_tokens: Mapping[str, int] | None = None,
    blocks_to_copy: Sequence[Sequence[tuple[int, int]]] = (),
    stats: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The KV cache of ``manager`` and the block tables of ``requests`` as JSON-ready plain data.

    Call it between two steps (the engine's loop thread does; the simulator after each step).

    Args:
        manager: the KV cache manager; read only.
        requests: ``(request, status)`` pairs, in the order to show them; ``status`` is a
            short word (``"running"``, ``"waiting"``, ``"loading"``). A request that holds no
            block yet gets empty tables.
        num_scheduled_tokens: the last step's batch, tokens per request id (the scheduler
            output's ``num_scheduled_tokens``); ``None``: no step yet.
        blocks_to_copy: the last step's copy-on-write pairs, per KV cache group
            (``(src_block_id, dst_block_id)``); those blocks show as ``"w"``.
        stats: counters to pass through unchanged (the engine's scheduler stats).

    Returns:
        A dict: ``version``, ``time`` (Unix seconds), ``num_blocks`` (null block included),
        ``block_size`` (tokens), ``groups`` (one ``{"kind", "sliding_window"}`` per KV cache
        group), ``blocks`` (``state``: one letter per block, see :data:`BLOCK_STATES`;
        ``ref_cnt``: a list of ``num_blocks`` ints; ``group``: the KV cache group of each
        block (-1: none; ``None`` with one group: every block is group 0's); ``partial``: the
        blocks in use that are not full, block id (a str) -> tokens written; the others in use
        are full), ``free_queue`` (free block ids,
        the next to evict first), ``requests`` (``request_id``, ``status``, ``num_prompt_tokens``,
        ``num_tokens``, ``num_computed_tokens``, ``num_scheduled_tokens``, ``block_ids``: one
        list per group), ``num_used_blocks``, ``num_used_slots`` (tokens written into blocks
        in use: a half-filled block counts half), ``num_cached_free_blocks``, ``kv_tier``
        (``{"medium", "num_blocks", "num_used_blocks"}`` or ``None``) and ``stats``.
    """
    pool = manager.block_pool
    blocks = pool.blocks
    block_size = manager.block_size
    num_blocks = len(blocks)
    ref_cnt = [block.ref_cnt for block in blocks]
    state = ["u" if count == 1 else "s" if count > 1 else "f" for count in ref_cnt]
    free_blocks = pool.free_block_queue.get_all_free_blocks()
    free_queue = [block.block_id for block in free_blocks]
    num_cached_free_blocks = 0
    for block in free_blocks:
        if block.block_hash is not None:
            state[block.block_id] = "c"
            num_cached_free_blocks += 1
    single_group = len(manager.kv_cache_specs) == 1
    # With several groups: a free cached block's is the group whose prefix-cache map holds it,
    # a block in use's the group whose tables hold it (filled in below).
    group = None if single_group else [block.cache_group_id for block in blocks]
    null_id = pool.null_block.block_id
    state[null_id] = "N"
    # A block in use is full for every holder, or partially filled with the same tokens for
    # every holder (a writer copies it first: pagedkv.core.invariants), or slots only:
    # so one look at each table's boundary block finds every block that is not full, O(1) per
    # request instead of O(table).
    partial: dict[int, int] = {}  # block id -> tokens written, for blocks in use not full
    scheduled = num_scheduled_tokens or {}
    table_rows = []
    for request, status in requests:
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        tables = manager.get_block_ids(request_id)
        num_full, num_rest = divmod(num_computed, block_size)
        first_draft = -(-request.num_tokens // block_size)
        for group_id, table in enumerate(tables):
            if group is not None:
                for block_id in table:
                    if block_id != null_id:
                        group[block_id] = group_id
            for index in range(num_full, len(table)):
                block_id = table[index]
                if block_id == null_id:
                    continue
                partial[block_id] = num_rest if index == num_full else 0
                if index >= first_draft and state[block_id] == "u":
                    state[block_id] = "d"
        table_rows.append(
            {
                "request_id": request_id,
                "status": status,
                "num_prompt_tokens": request.num_prompt_tokens,
                "num_tokens": request.num_tokens,
                "num_computed_tokens": num_computed,
                "num_scheduled_tokens": scheduled.get(request_id, 0),
                "block_ids": tables,
            }
        )
    for pairs in blocks_to_copy:
        for src, dst in pairs:
            for block_id in (src, dst):
                if ref_cnt[block_id] > 0:
                    state[block_id] = "w"
    num_used_blocks = num_blocks - 1 - len(free_queue)
    offloader = manager.offloader
    return {
        "version": KV_SNAPSHOT_VERSION,
        "time": time.time(),
        "num_blocks": num_blocks,
        "block_size": block_size,
        "groups": [_group_info(spec) for spec in manager.kv_cache_specs],
        "blocks": {
            "state": "".join(state),
            "ref_cnt": ref_cnt,
            "group": group,
            "partial": {str(block_id): filled for block_id, filled in partial.items()},
        },
        "free_queue": free_queue,
        "requests": table_rows,
        "num_used_blocks": num_used_blocks,
        "num_used_slots": num_used_blocks * block_size
        - sum(block_size - filled for filled in partial.values()),
        "num_cached_free_blocks": num_cached_free_blocks,
        "kv_tier": None
        if offloader is None
        else {
            "medium": offloader.medium,
            "num_blocks": offloader.num_blocks,
            "num_used_blocks": len(offloader),
        },
        "stats": dict(stats) if stats is not None else {},
    }


def _group_info(spec: object) -> dict[str, Any]:
    if isinstance(spec, SlidingWindowSpec):
        return {"kind": "sliding_window", "sliding_window": spec.sliding_window}
    return {"kind": "full_attention", "sliding_window": None}


__all__ = ["BLOCK_STATES", "KV_SNAPSHOT_VERSION", "snapshot_kv_cache"]
