"""FreeBlockQueue and BlockPool: O(1) queue ops, null block, lazy eviction, touch, reset."""

from __future__ import annotations

import pytest

from pagedkv.core import BlockHasher, BlockPool, FreeBlockQueue, KVCacheBlock, KVCacheRequest
from pagedkv.errors import CacheStateError, ConfigError


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_block_queue_operations():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 6 and ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[3])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4, 5]
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None
    assert ids(queue.popleft_n(2)) == [1, 2]
    queue.append(blocks[0])
    queue.append_n([blocks[3], blocks[1]])
    assert ids(queue.get_all_free_blocks()) == [4, 5, 0, 3, 1] and len(queue) == 5
    assert queue.popleft_n(0) == []
    with pytest.raises(CacheStateError):
        queue.popleft_n(6)
    assert len(queue) == 5
    with pytest.raises(CacheStateError):
        queue.remove(blocks[2])
    assert ids(queue.popleft_n(5)) == [4, 5, 0, 3, 1]
    with pytest.raises(CacheStateError):
        queue.popleft()
    queue.append_n([])
    assert len(queue) == 0 and queue.get_all_free_blocks() == []


def test_null_block_is_never_handed_out():
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 3 and pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3] and pool.get_usage() == 1.0
    with pytest.raises(CacheStateError):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block, *reversed(blocks)])
    pool.touch([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and pool.num_free_blocks == 3
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1]
    pool.check_invariants()


def test_lazy_eviction_and_touch():
    pool = BlockPool(4)
    hasher = BlockHasher(2, seed=0)
    request = KVCacheRequest("a", [1, 2, 3, 4], block_hasher=hasher)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 2)
    pool.free_blocks(reversed(blocks))
    # Freed but still cached: a hit can take it back out of the queue.
    hit = pool.get_cached_block(request.block_hashes[0])
    assert hit is blocks[0] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.check_invariants()
    # Reuse evicts: blocks 3 (never cached) then 2 (cached) are popped.
    reused = pool.get_new_blocks(2)
    assert ids(reused) == [3, 2]
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(request.block_hashes[1]) is None
    assert pool.get_cached_block(request.block_hashes[0]) is hit
    pool.check_invariants()


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(4)
    hasher = BlockHasher(2, seed=0)
    a = KVCacheRequest("a", [1, 2], block_hasher=hasher)
    b = KVCacheRequest("b", [1, 2], block_hasher=hasher)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [first], 0, 1, 2)
    pool.cache_full_blocks(b, [second], 0, 1, 2)
    assert pool.get_cached_block(a.block_hashes[0]) is first and second.block_hash is None
    pool.check_invariants()


def test_reset_prefix_cache_needs_every_block_free():
    pool = BlockPool(4)
    request = KVCacheRequest("a", [1, 2], block_hasher=BlockHasher(2, seed=0))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1, 2)
    assert not pool.reset_prefix_cache()
    assert blocks[0].block_hash is not None
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert blocks[0].block_hash is None and not pool.cached_block_hash_to_block[0]
    pool.check_invariants()


def test_bad_pool_sizes():
    with pytest.raises(ConfigError, match="num_blocks"):
        BlockPool(1)
    with pytest.raises(ConfigError, match="num_blocks"):
        BlockPool(2.5)
    with pytest.raises(ConfigError, match="groups"):
        BlockPool(4, num_kv_cache_groups=0)
