"""Sliding-window manager and the coordinator over full + sliding-window KV cache groups."""

from __future__ import annotations

import pytest
from _kv_helpers import admit, decode, make_request, snapshot

from pagedkv.core import FullAttentionSpec, KVCacheManager, SlidingWindowManager, SlidingWindowSpec
from pagedkv.core.invariants import check_invariants
from pagedkv.errors import ConfigError

FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1)


def window(w: int = 8, block_size: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, sliding_window=w)


def evict(kv: KVCacheManager, block_id: int) -> None:
    """Drop a free cached block's hash, as reuse would."""
    pool = kv.block_pool
    block = pool.blocks[block_id]
    assert block.ref_cnt == 0 and block.block_hash is not None
    pool._evict(block)


def test_free_schedule_block_4_window_8():
    kv = KVCacheManager(11, [window()], hash_seed=0)
    request = make_request(kv, "a", range(20))
    admit(kv, request)
    stm = kv.coordinator.single_type_managers[0]
    assert isinstance(stm, SlidingWindowManager)
    expected = {12: 1, 13: 1, 15: 2, 16: 2, 19: 3}
    for c, num_freed in expected.items():
        for _ in range(2):  # again at the same c frees nothing more
            stm.remove_skipped_blocks("a", c)
            assert kv.get_block_ids("a")[0][:num_freed] == [0] * num_freed
            assert 0 not in kv.get_block_ids("a")[0][num_freed:]
            assert kv.num_free_blocks == 5 + num_freed
            check_invariants(kv)


def test_decode_frees_blocks_that_left_the_window():
    kv = KVCacheManager(6, [window()], hash_seed=0)
    request = make_request(kv, "a", range(16))
    admit(kv, request)
    assert kv.num_free_blocks == 1
    # Slot for token 16: with c = 16 tokens 0..8 are dead, blocks 0 and 1 are given back first.
    assert decode(kv, request, 16) is not None
    assert kv.get_block_ids("a")[0][:2] == [0, 0]
    assert kv.num_free_blocks == 2
    check_invariants(kv)


def test_admission_counts_blocks_freed_by_the_window():
    kv = KVCacheManager(5, [window()], hash_seed=0)
    request = make_request(kv, "a", range(16))
    admit(kv, request)
    assert kv.num_free_blocks == 0
    # Needs 1 new block; 2 dead blocks only this request holds make room.
    assert decode(kv, request, 16) is not None
    assert kv.num_free_blocks == 1
    check_invariants(kv)


def test_refused_call_frees_no_dead_block():
    kv = KVCacheManager(7, [window()], hash_seed=0)
    request = make_request(kv, "a", range(12))
    admit(kv, request)
    hog = make_request(kv, "hog", range(100, 112))
    admit(kv, hog)
    assert kv.num_free_blocks == 0
    before = snapshot(kv)
    # c = 12: block 0 is dead (frees 1), but 8 more tokens need 2 new blocks.
    assert kv.allocate_slots(request, 8) is None
    assert snapshot(kv) == before
    assert kv.get_block_ids("a")[0][0] != 0


def test_window_hit_needs_cached_blocks_at_its_end():
    kv = KVCacheManager(11, [window()], hash_seed=0)
    first = make_request(kv, "a", range(16))
    admit(kv, first)
    ids = kv.get_block_ids("a")[0]
    kv.free(first)
    probe = make_request(kv, "b", range(17))
    blocks, num_hit = kv.get_computed_blocks(probe)
    # Token 16 attends to 9..16: blocks 2 and 3 must be cached; blocks 0, 1 become null.
    assert num_hit == 16 and blocks.get_block_ids() == ([0, 0, ids[2], ids[3]],)
    evict(kv, ids[3])
    blocks, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 12 and blocks.get_block_ids() == ([0, ids[1], ids[2]],)
    evict(kv, ids[1])
    # Only block 0 starts a valid run; block 2 alone does not cover a window.
    blocks, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 4 and blocks.get_block_ids() == ([ids[0]],)
    check_invariants(kv)


def test_window_hit_admission_counts_exactly():
    kv = KVCacheManager(11, [window()], hash_seed=0)
    first = make_request(kv, "a", range(16))
    admit(kv, first)
    kv.free(first)
    assert kv.num_free_blocks == 10
    second = make_request(kv, "b", range(17))
    num_hit, new_blocks = admit(kv, second)
    assert num_hit == 16 and len(new_blocks.get_block_ids()[0]) == 1
    assert kv.num_free_blocks == 10 - 1 - 2  # one new block, two hits taken from the queue
    check_invariants(kv)


def test_coordinator_agrees_on_one_hit_length():
    kv = KVCacheManager(21, [FULL, window()], hash_seed=0)
    first = make_request(kv, "a", range(16))
    admit(kv, first)
    full_ids, window_ids = kv.get_block_ids("a")
    kv.free(first)
    probe = make_request(kv, "b", range(17))
    blocks, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 16
    assert blocks.get_block_ids() == (full_ids, [0, 0, *window_ids[2:]])
    # The window group loses block 3: both groups fall back to 12 tokens.
    evict(kv, window_ids[3])
    blocks, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 12
    assert blocks.get_block_ids() == (full_ids[:3], [0, *window_ids[1:3]])
    # The full group loses block 1: 4 tokens; the window group must be looked up again.
    evict(kv, full_ids[1])
    blocks, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 4 and blocks.get_block_ids() == ([full_ids[0]], [window_ids[0]])
    num_hit, _ = admit(kv, probe)
    assert num_hit == 4
    check_invariants(kv)


def test_allocation_is_atomic_across_groups():
    kv = KVCacheManager(8, [FULL, window()], hash_seed=0)
    first = make_request(kv, "a", range(8))
    admit(kv, first)
    kv.free(first)
    hog = make_request(kv, "hog", range(100, 104))
    admit(kv, hog)
    assert kv.num_free_blocks == 5
    # 12 tokens: hit 8 in both groups (4 evictable hits) + 1 new block per group = 6 > 5.
    probe = make_request(kv, "b", range(12))
    before = snapshot(kv)
    blocks, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 8
    assert kv.allocate_slots(probe, 4, num_hit, blocks) is None
    assert snapshot(kv) == before
    kv.free(hog)
    assert admit(kv, probe)[1] is not None
    check_invariants(kv)


def test_groups_must_share_one_block_size():
    with pytest.raises(ConfigError, match="block_size"):
        KVCacheManager(10, [FULL, window(block_size=8)])
    with pytest.raises(ConfigError, match="the specs carry the block size"):
        KVCacheManager(10, [FULL], block_size=FULL.block_size)  # one value: the specs'

    with pytest.raises(ConfigError, match="empty"):
        KVCacheManager(10, [])
