"""The block map: which request owns each physical block, sampled over the simulation's steps.

    block id
      ^   | r3 r3 r3 .. .. c  c  r9 r9 |      rN = owned by request N (colour)
      |   | r7 F  F  F  F  r7 .. .. .. |      S  = shared by several requests, ref_cnt > 1
      |   | r1 r1 r1 r1 r1 r1 .. .. .. |           (cross-hatched over its oldest holder's colour)
      |   | r1 r1 S  S  S  r5 r5 .. .. |      F  = shared by the samples of one request only
      |   | r1 r1 S  S  S  r5 r5 .. .. |           (n > 1: forked; hatched over its colour)
      |   | r1 r1 r1 r1 r1 r5 r5 .. .. |      c  = free but still cached (evictable hit)
      0   | null block ................ |      .. = free
          +--------------------------> step (sampled)

For the contiguous baseline the recorder also marks the part of each region that holds no token
yet (``unused``): reserved for max_model_len, written only up to the request's length, which is
the waste the metrics report.

Ownership comes from the manager's public ``get_block_ids`` for each running request; a block listed
by several requests is shared; when all those requests are samples of one trace request (they
carry its index) the block is shared by samples (a fork's prompt blocks, or a prefix hit between
siblings), else by several requests (a common prefix). Cached-free blocks need the pool's view
(``ref_cnt == 0`` with a block hash), read through ``kv_cache.block_pool.blocks`` when the cache
has one.

To stay cheap on long traces, the recorder keeps at most ``2 * max_columns`` samples: when full it
drops every other one and samples half as often.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedkv.core.spec import cdiv
from pagedkv.sim.contiguous import ContiguousKVCache

#: Owner codes below 0 (owners >= 0 are request indices in the trace).
FREE = -1
CACHED_FREE = -2
NULL_BLOCK = -3


@dataclass(frozen=True, slots=True)
class BlockMap:
    """Sampled ownership of every block.

    Attributes:
        steps: the sampled steps, int64 ``[num_columns]``.
        owners: int32 ``[num_blocks, num_columns]``: a request index, or FREE / CACHED_FREE /
            NULL_BLOCK.
        shared: bool ``[num_blocks, num_columns]``: the block had ref_cnt > 1.
        stride: steps between samples at the end of the run.
        unused: bool ``[num_blocks, num_columns]`` or None: the block is reserved by its owner but
            holds no token yet (contiguous regions beyond the request's length).
        shared_by_samples: bool ``[num_blocks, num_columns]`` or None: shared, and every holder
            is a sample of the same trace request (``owners`` gives which); a subset of
            ``shared``.
        num_holders: int32 ``[num_blocks, num_columns]`` or None: running requests holding the
            block (its ref_cnt from the running requests; 0 for free blocks); ``owners`` is the
            oldest of them.
    """

    steps: np.ndarray
    owners: np.ndarray
    shared: np.ndarray
    stride: int
    unused: np.ndarray | None = None
    shared_by_samples: np.ndarray | None = None
    num_holders: np.ndarray | None = None


def pool_blocks(kv_cache) -> list | None:
    """The pool's block objects (read only) when the cache exposes them, else None."""
    pool = getattr(kv_cache, "block_pool", None)
    blocks = getattr(pool, "blocks", None)
    return blocks if isinstance(blocks, list | tuple) else None


class BlockMapRecorder:
    """Samples block ownership every ``stride`` busy steps, halving the rate when full.

    Args:
        num_blocks: blocks in the pool.
        max_columns: keep between ``max_columns`` and ``2 * max_columns`` samples (>= 1).
        has_null_block: block 0 is the null block (every policy leaves it out of the pool).
        block_size: tokens per block (to mark the unwritten part of contiguous regions).
    """

    def __init__(
        self,
        num_blocks: int,
        max_columns: int,
        has_null_block: bool = True,
        *,
        block_size: int = 16,
    ) -> None:
        self.num_blocks = num_blocks
        self.has_null_block = has_null_block
        self.block_size = block_size
        self.max_columns = max(1, max_columns)
        self.stride = 1
        self._num_calls = 0
        self._steps: list[int] = []
        self._owners: list[np.ndarray] = []
        self._shared: list[np.ndarray] = []
        self._unused: list[np.ndarray] = []
        self._by_samples: list[np.ndarray] = []
        self._holders: list[np.ndarray] = []

    def maybe_record(self, step: int, kv_cache, running: list) -> None:
        """Record a sample if this busy step is on the stride."""
        call = self._num_calls
        self._num_calls += 1
        if call % self.stride:
            return
        owners = np.full(self.num_blocks, FREE, dtype=np.int32)
        counts = np.zeros(self.num_blocks, dtype=np.int32)
        blocks = pool_blocks(kv_cache)
        if blocks is not None:
            owners[[b.block_id for b in blocks if b.ref_cnt == 0 and b.block_hash is not None]] = (
                CACHED_FREE
            )
        if self.has_null_block:
            owners[0] = NULL_BLOCK
        unused = np.zeros(self.num_blocks, dtype=bool)
        mixed = np.zeros(self.num_blocks, dtype=bool)  # held by two trace requests
        contiguous = isinstance(kv_cache, ContiguousKVCache)
        # Oldest request first in `running`: iterate newest first so the oldest owner wins.
        for request in reversed(running):
            for ids in kv_cache.get_block_ids(request.request_id):  # each KV cache group
                if not contiguous:
                    ids = [b for b in ids if b]  # sliding-window groups: null block 0
                if ids:
                    before = owners[ids]
                    mixed[ids] |= (before >= 0) & (before != request.index)
                    owners[ids] = request.index
                    np.add.at(counts, ids, 1)
                    if contiguous:
                        unused[ids[cdiv(request.num_computed_tokens, self.block_size) :]] = True
        self._steps.append(step)
        self._owners.append(owners)
        self._shared.append(counts > 1)
        self._unused.append(unused)
        self._by_samples.append((counts > 1) & ~mixed)
        self._holders.append(counts)
        if len(self._steps) >= 2 * self.max_columns:
            del self._steps[1::2], self._owners[1::2], self._shared[1::2], self._unused[1::2]
            del self._by_samples[1::2], self._holders[1::2]
            self.stride *= 2

    def finish(self) -> BlockMap | None:
        """The recorded map (None if nothing was recorded)."""
        if not self._steps:
            return None
        return BlockMap(
            steps=np.asarray(self._steps, dtype=np.int64),
            owners=np.stack(self._owners, axis=1),
            shared=np.stack(self._shared, axis=1),
            stride=self.stride,
            unused=np.stack(self._unused, axis=1),
            shared_by_samples=np.stack(self._by_samples, axis=1),
            num_holders=np.stack(self._holders, axis=1),
        )
