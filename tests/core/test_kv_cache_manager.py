"""KVCacheManager scenarios (block_size 4 unless said), errors, stats and events."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _kv_helpers import admit, decode, make_request, snapshot

from pagedkv.core import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    KVCacheRequest,
)
from pagedkv.core.invariants import check_invariants
from pagedkv.errors import CacheStateError, ConfigError, InvalidRequestError


def manager(num_usable: int, **kw) -> KVCacheManager:
    kw.setdefault("block_size", 4)
    kw.setdefault("hash_seed", 0)
    return KVCacheManager(num_usable + 1, **kw)


def test_hit_is_capped_below_num_tokens():
    kv = manager(10)
    first = make_request(kv, "a", range(1, 9))
    assert admit(kv, first)[0] == 0
    kv.free(first)
    # The same 8 tokens: the last token must be computed, so only 1 of 2 cached blocks hits.
    same = make_request(kv, "b", range(1, 9))
    blocks, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 4
    assert blocks.get_block_ids() == ([1],)
    assert kv.allocate_slots(same, 8 - num_hit, num_hit, blocks).get_block_ids() == ([3],)
    kv.free(same)
    longer = make_request(kv, "c", range(1, 10))
    assert kv.get_computed_blocks(longer)[1] == 8
    num_hit, _ = admit(kv, longer)
    assert num_hit == 8 and longer.num_tokens - num_hit == 1
    assert kv.get_block_ids("c")[0][:2] == [1, 2]
    short = make_request(kv, "d", range(1, 5))
    assert kv.get_computed_blocks(short)[1] == 0
    check_invariants(kv)


def test_hits_of_another_longer_request_are_refused_and_change_nothing():
    kv = manager(10)
    first = make_request(kv, "a", range(1, 14))
    admit(kv, first)
    kv.free(first)
    long_hit, num_hit = kv.get_computed_blocks(make_request(kv, "b", range(1, 14)))
    assert num_hit == 12
    short = make_request(kv, "c", range(1, 6))
    before = snapshot(kv)
    with pytest.raises(InvalidRequestError, match="only 1 full blocks"):
        kv.allocate_slots(short, 0, num_hit, long_hit)
    assert snapshot(kv) == before
    check_invariants(kv)


def test_refused_admission_counts_evictable_hits_and_changes_nothing():
    kv = manager(7)
    prompt = list(range(1, 9))
    finished = make_request(kv, "p", prompt)
    admit(kv, finished)
    cached = [kv.block_pool.blocks[i] for i in kv.get_block_ids("p")[0]]
    kv.free(finished)
    assert [b.ref_cnt for b in cached] == [0, 0] and all(b.block_hash for b in cached)
    holder = make_request(kv, "h", range(100, 108))
    admit(kv, holder)
    assert kv.num_free_blocks == 5
    big = make_request(kv, "big", prompt + list(range(200, 216)))
    before = snapshot(kv)
    blocks, num_hit = kv.get_computed_blocks(big)
    assert num_hit == 8
    # 4 new blocks + 2 evictable hits = 6 > 5 free.
    assert kv.allocate_slots(big, big.num_tokens - num_hit, num_hit, blocks) is None
    assert snapshot(kv) == before
    assert kv.num_free_blocks == 5
    kv.free(holder)
    num_hit, new_blocks = admit(kv, big)
    assert num_hit == 8 and new_blocks is not None
    assert [b.ref_cnt for b in cached] == [1, 1]
    check_invariants(kv)


def test_running_request_that_cannot_grow_keeps_its_blocks():
    kv = manager(5)
    running = make_request(kv, "r", range(1, 9))
    admit(kv, running)
    other = make_request(kv, "o", range(50, 62))
    admit(kv, other)
    assert kv.num_free_blocks == 0
    held = [kv.block_pool.blocks[i] for i in kv.get_block_ids("r")[0]]
    before = snapshot(kv)
    assert decode(kv, running, 9) is None
    assert snapshot(kv) == before
    assert [b.ref_cnt for b in held] == [1, 1]
    kv.free(running)
    kv.free(other)
    assert kv.num_free_blocks == 5 and kv.usage == 0.0
    check_invariants(kv)


def test_shared_blocks_stay_held_until_the_last_holder_frees():
    kv = manager(10)
    first = make_request(kv, "a", range(1, 13))
    admit(kv, first)
    second = make_request(kv, "b", range(1, 17))
    num_hit, _ = admit(kv, second)
    assert num_hit == 12
    shared = [kv.block_pool.blocks[i] for i in kv.get_block_ids("a")[0]]
    assert [b.ref_cnt for b in shared] == [2, 2, 2]
    kv.free(first)
    assert [b.ref_cnt for b in shared] == [1, 1, 1]
    # Fill the rest of the pool: the shared blocks are never handed out.
    fillers = []
    for i in range(kv.num_free_blocks):
        filler = make_request(kv, f"f{i}", range(1000 + 4 * i, 1004 + 4 * i))
        assert admit(kv, filler)[1] is not None
        fillers.append(filler)
    assert kv.num_free_blocks == 0
    filler_ids = {i for f in fillers for i in kv.get_block_ids(f.request_id)[0]}
    assert filler_ids.isdisjoint(b.block_id for b in shared)
    for filler in fillers:
        kv.free(filler)
    kv.free(second)
    queue_ids = [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]
    assert len(queue_ids) == len(set(queue_ids)) == 10
    assert all(b.block_hash is not None and b.ref_cnt == 0 for b in shared)
    before = snapshot(kv)
    kv.free(second)
    assert snapshot(kv) == before
    check_invariants(kv)


def test_request_larger_than_the_pool_is_refused():
    kv = manager(4)
    huge = make_request(kv, "huge", range(17))
    before = snapshot(kv)
    assert admit(kv, huge) == (0, None)
    assert snapshot(kv) == before
    assert kv.get_block_ids("huge") == ([],)
    assert kv.max_num_blocks_per_request(17) == 5 > kv.num_blocks - 1


LENGTHS = [40, 128, 300, 64, 210, 96, 180, 48, 150, 80, 60, 420, 33, 256, 90, 110]


def test_sixteen_lengths_contiguous_vs_paged():
    block_size, num_usable, max_len = 16, 128, 512
    assert num_usable * block_size // max_len == 4  # contiguous reservation

    def run(skip_unfit: bool) -> int:
        kv = KVCacheManager(num_usable + 1, block_size=block_size, hash_seed=0)
        num_admitted = 0
        for i, length in enumerate(LENGTHS):
            request = make_request(kv, str(i), range(i * 1000, i * 1000 + length))
            if admit(kv, request)[1] is None:
                if skip_unfit:
                    continue
                break
            num_admitted += 1
        check_invariants(kv)
        return num_admitted

    assert run(skip_unfit=False) == 13  # FCFS: stops at the 14th (256 tokens)
    assert run(skip_unfit=True) == 14  # skipping: 90 fits, 110 does not


def test_decode_caches_blocks_as_they_fill():
    kv = manager(10)
    request = make_request(kv, "a", range(1, 4))
    admit(kv, request)
    assert kv.block_pool.blocks[1].block_hash is None
    decode(kv, request, 4)
    assert request.block_hashes[0] == kv.block_pool.blocks[1].block_hash
    for token in range(5, 9):
        decode(kv, request, token)
    assert kv.get_block_ids("a") == ([1, 2],)
    assert kv.block_pool.blocks[2].block_hash == request.block_hashes[1]
    kv.free(request)
    follow_up = make_request(kv, "b", [*range(1, 9), 99])
    assert kv.get_computed_blocks(follow_up)[1] == 8


def test_lookahead_and_max_model_len():
    kv = manager(10, max_model_len=10)
    request = make_request(kv, "a", range(5))
    blocks = kv.allocate_slots(request, 5, num_lookahead_tokens=3)
    assert len(blocks.get_block_ids()[0]) == 2
    request.num_computed_tokens = 5
    # 5 + 4 + 100 lookahead is capped at max_model_len = 10 -> 3 blocks.
    assert len(kv.allocate_slots(request, 4, num_lookahead_tokens=100).get_block_ids()[0]) == 1


def test_caching_disabled():
    kv = manager(10, enable_caching=False)
    assert kv.block_hasher is None
    request = KVCacheRequest("a", list(range(8)))
    admit(kv, request)
    kv.free(request)
    again = KVCacheRequest("b", list(range(9)))
    assert kv.get_computed_blocks(again)[1] == 0
    assert all(b.block_hash is None for b in kv.block_pool.blocks)


def test_request_without_hasher_neither_hits_nor_fills():
    kv = manager(10)
    plain = KVCacheRequest("a", list(range(8)))
    admit(kv, plain)
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    hashed = make_request(kv, "b", range(8))
    admit(kv, hashed)
    assert kv.get_computed_blocks(KVCacheRequest("c", list(range(9))))[1] == 0


def test_reset_prefix_cache_only_when_no_block_is_in_use():
    kv = manager(10)
    first = make_request(kv, "a", range(1, 9))
    admit(kv, first)
    second = make_request(kv, "b", range(1, 13))
    assert admit(kv, second)[0] == 8
    assert not kv.reset_prefix_cache()  # blocks in use
    kv.free(first)
    kv.free(second)
    assert kv.reset_prefix_cache()
    assert all(not m for m in kv.block_pool.cached_block_hash_to_block)
    assert kv.get_computed_blocks(make_request(kv, "c", range(1, 13)))[1] == 0
    check_invariants(kv)


def test_kv_cache_events():
    kv = manager(3, enable_kv_cache_events=True)
    first = make_request(kv, "a", range(1, 10), lora_id=7)
    admit(kv, first)
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == tuple(first.block_hashes)
    assert stored.parent_block_hash is None
    assert stored.token_ids == tuple(range(1, 9))
    assert (stored.block_size, stored.lora_id) == (4, 7)
    assert kv.take_events() == []
    for token in range(10, 13):
        decode(kv, first, token)
    (stored,) = kv.take_events()
    assert stored.parent_block_hash == first.block_hashes[1]
    assert stored.block_hashes == (first.block_hashes[2],)
    kv.free(first)
    other = make_request(kv, "b", range(50, 54))
    admit(kv, other)
    removed, stored = kv.take_events()
    assert removed == BlockRemoved((first.block_hashes[2],))
    assert stored.block_hashes == tuple(other.block_hashes)
    kv.free(other)
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]


def test_events_off_by_default():
    kv = manager(3)
    admit(kv, make_request(kv, "a", range(9)))
    assert kv.take_events() == []


def test_bad_configuration_raises():
    with pytest.raises(ConfigError, match="block_size"):
        KVCacheManager(10, block_size=0)
    with pytest.raises(ConfigError, match="num_blocks"):
        KVCacheManager(1)
    with pytest.raises(ConfigError, match="hash algorithm"):
        KVCacheManager(10, hash_algo="md5")
    with pytest.raises(ConfigError, match="max_model_len"):
        KVCacheManager(10, max_model_len=0)


def test_bad_calls_raise_and_change_nothing():
    kv = manager(10)
    request = make_request(kv, "a", range(8))
    before = snapshot(kv)
    with pytest.raises(InvalidRequestError):
        kv.allocate_slots(request, -1)
    with pytest.raises(InvalidRequestError):
        kv.allocate_slots(request, 4, num_lookahead_tokens=-2)
    with pytest.raises(InvalidRequestError):
        kv.allocate_slots(request, 4, num_new_computed_tokens=4)
    assert snapshot(kv) == before
    admit(kv, request)
    kv.free(request)
    again = make_request(kv, "b", range(9))
    blocks, num_hit = kv.get_computed_blocks(again)
    with pytest.raises(InvalidRequestError):
        kv.allocate_slots(again, 1, num_hit - 4, blocks)
    kv.allocate_slots(again, 1, num_hit, blocks)
    before = snapshot(kv)
    with pytest.raises(CacheStateError):
        kv.allocate_slots(again, 1, num_hit, blocks)
    assert snapshot(kv) == before
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        KVCacheRequest("x", [])


def test_foreign_block_hasher_is_rejected():
    kv = manager(10)
    other = KVCacheManager(11, block_size=4, hash_seed=1)
    request = make_request(other, "a", range(9))
    with pytest.raises(InvalidRequestError, match="block_hasher"):
        kv.get_computed_blocks(request)


def test_import_core_does_not_import_torch():
    code = "import sys, pagedkv.core; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_kv_cache_blocks_add_and_ids():
    kv = manager(10)
    request = make_request(kv, "a", range(6))
    first = kv.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    second = kv.allocate_slots(request, 4)
    assert (first + second).get_block_ids() == kv.get_block_ids("a") == ([1, 2, 3],)
    assert (kv.empty_kv_cache_blocks + first).get_block_ids() == ([1, 2],)
    assert kv.get_blocks("a").get_block_ids() == ([1, 2, 3],)
    # No new block needed: the shared empty blocks come back.
    request.num_computed_tokens = 10
    assert kv.allocate_slots(request, 1) is kv.empty_kv_cache_blocks


def test_token_ids_must_be_int64():
    kv = manager(10)
    with pytest.raises(InvalidRequestError, match="int64"):
        make_request(kv, "a", [1, 2, 3, 2**64])
    with pytest.raises(InvalidRequestError, match="int64"):
        make_request(kv, "b", [1, 2, 3, "x"])


def test_hits_after_an_empty_allocation():
    kv = manager(10)
    first = make_request(kv, "a", range(9))
    admit(kv, first)
    kv.free(first)
    second = make_request(kv, "b", range(9))
    assert kv.allocate_slots(second, 0) is kv.empty_kv_cache_blocks  # registers, holds nothing
    num_hit, new_blocks = admit(kv, second)
    assert num_hit == 8 and new_blocks.get_block_ids() == ([4],)
    check_invariants(kv)


def test_stale_hit_blocks_are_refused():
    kv = manager(3)
    first = make_request(kv, "a", range(9))
    admit(kv, first)
    kv.free(first)
    second = make_request(kv, "b", range(9))
    blocks, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 8
    admit(kv, make_request(kv, "c", range(100, 112)))  # reuses (evicts) every free block
    before = snapshot(kv)
    with pytest.raises(CacheStateError, match="evicted"):
        kv.allocate_slots(second, 1, num_hit, blocks)
    assert snapshot(kv) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_cache_specs": [object()]}, "KVCacheSpec"),
        ({"max_model_len": True}, "max_model_len"),
    ],
)
def test_bad_manager_arguments_raise_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        KVCacheManager(10, **kwargs)


def test_sliding_window_true_is_rejected():
    from pagedkv.core.spec import SlidingWindowSpec

    with pytest.raises(ConfigError, match="sliding_window"):
        SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, sliding_window=True)


@pytest.mark.parametrize("num_new_tokens", [1.5, "3", True])
def test_non_int_token_count_is_rejected_and_changes_nothing(num_new_tokens):
    kv = manager(4)
    request = make_request(kv, "a", range(1, 6))
    before = snapshot(kv)
    with pytest.raises(InvalidRequestError, match="num_new_tokens must be an int >= 0"):
        kv.allocate_slots(request, num_new_tokens)
    assert snapshot(kv) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lora_id": 2**70}, "lora_id"),
        ({"lora_id": "x"}, "lora_id"),
        ({"cache_salt": 5}, "cache_salt"),
        ({"num_computed_tokens": -5}, "num_computed_tokens"),
    ],
)
def test_bad_request_fields_raise_invalid_request_error(kwargs, message):
    kv = manager(4)
    with pytest.raises(InvalidRequestError, match=message):
        KVCacheRequest("a", [1, 2, 3, 4, 5], block_hasher=kv.block_hasher, **kwargs)


def test_text_prompt_is_rejected_without_a_hasher():
    with pytest.raises(InvalidRequestError, match="not text"):
        KVCacheRequest("a", "hello")
