"""The KV cache snapshot (pagedkv.core.kv_view): what the web view draws, checked with the pool."""

from __future__ import annotations

import json

from _kv_helpers import admit, decode, make_request

from pagedkv.core import KVCacheManager
from pagedkv.core.kv_view import BLOCK_STATES, snapshot_kv_cache


def _counts(snap):
    state = snap["blocks"]["state"]
    return {letter: state.count(letter) for letter in BLOCK_STATES}


def test_empty_pool_is_free_but_the_null_block():
    manager = KVCacheManager(9, block_size=4)
    snap = snapshot_kv_cache(manager, [])
    assert snap["blocks"]["state"] == "N" + "f" * 8
    assert snap["free_queue"] == list(range(1, 9))
    assert snap["num_used_blocks"] == 0
    assert snap["num_used_slots"] == 0
    assert snap["requests"] == []
    json.dumps(snap)  # plain data


def test_shared_prefix_counts_match_the_pool_and_token_slots_count_half_blocks():
    manager = KVCacheManager(17, block_size=4)
    prefix = list(range(100, 108))  # two full blocks
    a = make_request(manager, "a", [*prefix, 1, 2])
    b = make_request(manager, "b", [*prefix, 3])
    admit(manager, a)
    num_hit, _ = admit(manager, b)
    assert num_hit == 8
    snap = snapshot_kv_cache(
        manager, [(a, "running"), (b, "running")], num_scheduled_tokens={"a": 10, "b": 1}
    )
    counts = _counts(snap)
    assert counts["s"] == manager.num_shared_blocks == 2
    assert counts["u"] == 2  # each one's last, partially filled block
    ids_a, ids_b = (row["block_ids"][0] for row in snap["requests"])
    assert ids_a[:2] == ids_b[:2]
    assert [snap["blocks"]["ref_cnt"][i] for i in ids_a] == [2, 2, 1]
    # 8 shared tokens once, then 2 + 1 tokens in the two last blocks: half-filled = half used
    assert snap["num_used_slots"] == 8 + 2 + 1
    assert snap["num_used_blocks"] == 4
    assert snap["blocks"]["partial"] == {str(ids_a[2]): 2, str(ids_b[2]): 1}
    assert [row["num_scheduled_tokens"] for row in snap["requests"]] == [10, 1]
    text = json.dumps(snap)
    assert "100" not in text.replace("1000", "")  # no token id leaks (they start at 100)


def test_freed_blocks_stay_cached_in_eviction_order():
    manager = KVCacheManager(9, block_size=4)
    a = make_request(manager, "a", list(range(9)))
    admit(manager, a)
    held = manager.get_block_ids("a")[0]
    manager.free(a)
    snap = snapshot_kv_cache(manager, [])
    state = snap["blocks"]["state"]
    assert [state[i] for i in held] == ["c", "c", "f"]  # two full blocks stay hit-able
    assert snap["num_cached_free_blocks"] == 2
    # freed blocks go to the tail, the last block of a request first (evicted first)
    assert snap["free_queue"][-3:] == held[::-1]
    assert snap["num_used_blocks"] == 0


def test_copy_on_write_and_lookahead_blocks_are_marked():
    manager = KVCacheManager(17, block_size=4)
    a = make_request(manager, "a", [1, 2, 3, 4, 5, 6])
    admit(manager, a)
    child = make_request(manager, "c", [1, 2, 3, 4, 5, 6])
    child.num_computed_tokens = a.num_computed_tokens
    assert manager.fork(a, child) is not None
    decode(manager, child, 7)  # writes into the shared, partially filled block: a copy
    copies = manager.take_blocks_to_copy()
    assert copies == ([(manager.get_block_ids("a")[0][1], manager.get_block_ids("c")[0][1])],)
    snap = snapshot_kv_cache(manager, [(a, "running"), (child, "running")], blocks_to_copy=copies)
    src, dst = copies[0][0]
    assert snap["blocks"]["state"][src] == snap["blocks"]["state"][dst] == "w"
    b = make_request(manager, "b", [9, 9])
    manager.allocate_slots(b, 2, num_lookahead_tokens=8)
    b.num_computed_tokens = 2
    snap = snapshot_kv_cache(manager, [(b, "running")])
    table = snap["requests"][0]["block_ids"][0]
    assert [snap["blocks"]["state"][i] for i in table] == ["u", "d", "d"]
