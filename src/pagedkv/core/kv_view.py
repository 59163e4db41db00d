"""A snapshot of the KV cache as plain data: what the web view (`/kv`) and the simulator's replay
draw.

::

    block ids:   0   1   2   3   4   5   6   7   8   9  ...
    state:       N   s   s   u   w   c   c   f   f   u  ...     one letter per block (BLOCK_STATES)
    ref_cnt:     0   2   2   1   1   0   0   0   0   1
    num_tokens:  0  16  16   9   9  16  16   0   0   4      tokens written into each block
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
        ``ref_cnt``, ``group`` (-1: none) and ``num_tokens`` (tokens written into a block in use, the most any
        holder wrote; 0 for a free block): lists of ``num_blocks`` ints), ``free_queue`` (free block ids, head =
        next to evict, first), ``requests`` (``request_id``, ``status``, ``num_prompt_tokens``,
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
    group = [block.cache_group_id for block in blocks]
    num_tokens = [0] * num_blocks
    # Blocks in use, then free ones: the cached ones keep their letter until evicted.
    state = ["u" if count == 1 else "s" if count > 1 else "f" for count in ref_cnt]
    free_queue = [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]
    num_cached_free_blocks = 0
    for block_id in free_queue:
        if group[block_id] >= 0:
            state[block_id] = "c"
            num_cached_free_blocks += 1
    null_id = pool.null_block.block_id
    state[null_id] = "N"
    scheduled = num_scheduled_tokens or {}
    has_draft = False
    table_rows = []
    for request, status in requests:
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        tables = manager.get_block_ids(request_id)
        for group_id, table in enumerate(tables):
            for index, block_id in enumerate(table):
                if block_id == null_id:
                    continue
                group[block_id] = group_id
                start = index * block_size
                filled = num_computed - start
                if filled > 0:
                    if filled > block_size:
                        filled = block_size
                    if filled > num_tokens[block_id]:
                        num_tokens[block_id] = filled
                elif start >= request.num_tokens:
                    state[block_id] = "d"
                    has_draft = True
        table_rows.append(
            {
                "request_id": request_id,
                "status": status,
                "num_prompt_tokens": request.num_prompt_tokens,
                "num_tokens": request.num_tokens,
                "num_computed_tokens": num_computed,
                "num_scheduled_tokens": scheduled.get(request_id, 0),
                "block_ids": [list(table) for table in tables],
            }
        )
    if has_draft:  # a block holding some token of another holder is not draft-only
        for row in table_rows:
            for table in row["block_ids"]:
                for index, block_id in enumerate(table):
                    if state[block_id] == "d" and index * block_size < row["num_tokens"]:
                        state[block_id] = "u" if ref_cnt[block_id] == 1 else "s"
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
            "num_tokens": num_tokens,
        },
        "free_queue": free_queue,
        "requests": table_rows,
        "num_used_blocks": num_used_blocks,
        "num_used_slots": sum(num_tokens),
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
