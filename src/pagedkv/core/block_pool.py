"""The block pool: every KV-cache block, the free block queue and the prefix-cache map.

    blocks:      [null][ 1 ][ 2 ][ 3 ][ 4 ][ 5 ][ 6 ] ...   made once, block 0 = null block
    ref_cnt:       -     2    1    0    0    1    0
    free queue:  head -> 3 -> 6 -> 4 -> tail              (ref_cnt 0; head is reused first)
    cache map:   {hash_a: 1, hash_b: 2, hash_c: 3}        (3 is free but still hit-able)

Lazy eviction: a freed block keeps its hash and can still be hit (``touch`` takes it back out of
the queue) until ``get_new_blocks`` pops it for reuse, which is when its hash is dropped.
Idea from vLLM V1 (``vllm/v1/core/block_pool.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from pagedkv.core.block import FreeBlockQueue, KVCacheBlock, PrefixNode
from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.core.hashing import BlockHash
from pagedkv.errors import CacheStateError
from pagedkv.validation import check_int

if TYPE_CHECKING:
    from pagedkv.core.request import KVCacheRequest


class BlockPool:
    """All KV-cache blocks of one pool, shared by every KV cache group.

    Args:
        num_blocks: blocks in the pool including the null block (>= 2).
        enable_caching: keep full blocks in the prefix cache.
        num_kv_cache_groups: groups sharing the pool; each has its own prefix-cache map, so the
            same block hash in two groups names two different blocks.
        enable_kv_cache_events: record :mod:`pagedkv.core.events` (drain with ``take_events``).
        keep_token_ids: store what each cached block was computed from (a :class:`PrefixNode`:
            tokens, extra keys, parent) so that hits can be checked without trusting the hash
            (used with a non-cryptographic block hash).

    Raises:
        ConfigError: ``num_blocks`` < 2 (no usable block) or ``num_kv_cache_groups`` < 1.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_caching: bool = True,
        num_kv_cache_groups: int = 1,
        enable_kv_cache_events: bool = False,
        keep_token_ids: bool = False,
    ) -> None:
        check_int("num_blocks", num_blocks, 2, why="block 0 is the null block")
        check_int("num_kv_cache_groups", num_kv_cache_groups, 1)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.keep_token_ids = keep_token_ids
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block: list[dict[BlockHash, KVCacheBlock]] = [
            {} for _ in range(num_kv_cache_groups)
        ]
        self.kv_event_queue: list[KVCacheEvent] = []
        #: called with each cached block the pool evicts (hands to someone else), before its
        #: hash is dropped: the KV tier pages it out (:mod:`pagedkv.core.offload`). None: off.
        self.evict_hook: Callable[[KVCacheBlock], object] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached or not); excludes the null block."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks in use (0..1); the null block does not count."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_id: int = 0):
        """The cached block with ``block_hash`` in the group, or ``None``."""
        return self.cached_block_hash_to_block[kv_cache_group_id].get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue (ref_cnt -> 1), evicting
        their old hashes.

        Raises:
            CacheStateError: fewer free blocks than asked for (nothing changes).
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            for block in blocks:
                if block.block_hash is not None:
                    self._evict(block)
                block.ref_cnt = 1
        else:
            for block in blocks:
                block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if self.evict_hook is not None:
            self.evict_hook(block)
        del self.cached_block_hash_to_block[block.cache_group_id][block.block_hash]
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockRemoved((block.block_hash,), block.cache_group_id))
        block.block_hash = None
        block.cache_group_id = -1
        block.prefix = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take hold of cache-hit blocks: ref_cnt += 1, out of the free queue if it was 0.
        The null block is skipped."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                if block.is_null:
                    continue
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; those reaching 0 go to the queue tail in the given
        order (so the first of them is evicted first). The null block is skipped."""
        freed = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        self.free_block_queue.append_n(freed)

    def cache_full_blocks(
        self,
        request: KVCacheRequest,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int = 0,
        parent_prefix: PrefixNode | None = None,
    ) -> PrefixNode | None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` (now full) in the prefix cache
        under ``request.block_hashes``.

        NOTE: if another block already holds the same hash (two requests computed the same
        prefix at once), the new block stays uncached: the map keeps one block per hash, and
        hits go to the first one.

        Args:
            parent_prefix: with ``keep_token_ids``, the :class:`PrefixNode` of the request's
                block ``num_cached_blocks - 1`` (``None`` when it is 0); the single-type
                managers keep it per request. When ``None`` for a later block, the node of
                ``blocks[num_cached_blocks - 1]`` is used; if that block has none either, the
                blocks stay uncached (a hit on them could not be checked).

        Returns:
            With ``keep_token_ids``, the node of block ``num_full_blocks - 1`` (the parent for
            the next call); else ``None``.
        """
        cached = self.cached_block_hash_to_block[kv_cache_group_id]
        block_hashes = request.block_hashes
        keep_token_ids = self.keep_token_ids
        if keep_token_ids:
            node = parent_prefix
            if node is None and num_cached_blocks > 0:
                node = blocks[num_cached_blocks - 1].prefix
                if node is None:
                    return None
            hasher = request.block_hasher
            has_extra = hasher is not None and (
                request.lora_id is not None
                or bool(request.mm_features)
                or request.cache_salt is not None
            )
            tokens = request.all_token_ids
        events = self.enable_kv_cache_events
        stored_from = -1
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            block_hash = block_hashes[i]
            if keep_token_ids:
                if block.prefix is not None and not block.is_null:
                    node = block.prefix  # a hit: this request's KV is the cached block's
                else:
                    extra = hasher.extra_keys(request, i) if has_extra else b""
                    node = PrefixNode(node, tokens[i * block_size : (i + 1) * block_size], extra)
            if block.is_null or block.block_hash is not None or block_hash in cached:
                if events and stored_from >= 0:
                    self._record_stored(request, stored_from, i, block_size, kv_cache_group_id)
                    stored_from = -1
                continue
            block.block_hash = block_hash
            block.cache_group_id = kv_cache_group_id
            cached[block_hash] = block
            if keep_token_ids:
                block.prefix = node
            if events and stored_from < 0:
                stored_from = i
        if events and stored_from >= 0:
            self._record_stored(
                request, stored_from, num_full_blocks, block_size, kv_cache_group_id
            )
        return node if keep_token_ids else None

    def _record_stored(
        self, request: KVCacheRequest, start: int, end: int, block_size: int, group_id: int
    ) -> None:
        self.kv_event_queue.append(
            BlockStored(
                block_hashes=tuple(request.block_hashes[start:end]),
                parent_block_hash=request.block_hashes[start - 1] if start else None,
                token_ids=tuple(request.all_token_ids[start * block_size : end * block_size]),
                block_size=block_size,
                lora_id=request.lora_id,
                kv_cache_group_id=group_id,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only possible when no block is in use.

        Returns:
            True if the cache was reset, False if some block is in use (nothing changes).
        """
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for cached in self.cached_block_hash_to_block:
            for block in cached.values():
                block.block_hash = None
                block.cache_group_id = -1
                block.prefix = None
            cached.clear()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return the recorded events and start a new list."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def check_invariants(self) -> None:
        """Raise CacheStateError if the pool's structures disagree (O(num_blocks); for tests)."""
        queue = self.free_block_queue.get_all_free_blocks()
        ids = [block.block_id for block in queue]
        if len(queue) != self.free_block_queue.num_free_blocks:
            raise CacheStateError(f"free count {self.num_free_blocks} != queue walk {len(queue)}")
        if len(set(ids)) != len(ids):
            raise CacheStateError("a block is in the free queue twice")
        if any(block.ref_cnt != 0 or block.is_null for block in queue):
            raise CacheStateError("a block in use (or the null block) is in the free queue")
        num_in_use = sum(1 for block in self.blocks if block.ref_cnt > 0 and not block.is_null)
        if len(queue) + num_in_use + 1 != self.num_blocks:
            raise CacheStateError(
                f"free {len(queue)} + in use {num_in_use} + null 1 != {self.num_blocks}"
            )
        for group_id, cached in enumerate(self.cached_block_hash_to_block):
            for block_hash, block in cached.items():
                if block.block_hash != block_hash or block.cache_group_id != group_id:
                    raise CacheStateError(f"map entry for block {block.block_id} disagrees")
                if block.is_null:
                    raise CacheStateError("the null block is cached")
                if self.keep_token_ids and block.prefix is None:
                    raise CacheStateError(f"cached block {block.block_id} has no prefix node")
        num_hashed = sum(1 for block in self.blocks if block.block_hash is not None)
        if num_hashed != sum(len(cached) for cached in self.cached_block_hash_to_block):
            raise CacheStateError("a block carries a hash that is not in the cache map")
        if self.null_block.block_hash is not None or self.null_block.prev_free_block is not None:
            raise CacheStateError("the null block is cached or queued")

    def __len__(self) -> int:
        return self.num_blocks
