"""KVCacheManager.fork and copy-on-write of the shared, partially filled last block: scenarios
checked against a model of the KV content (every request reads back exactly its own tokens)."""

from __future__ import annotations

import pytest
from _kv_helpers import KVContent, admit, make_request, snapshot

from pagedkv.core import FullAttentionSpec, KVCacheManager, KVCacheRequest, SlidingWindowSpec
from pagedkv.core.invariants import check_invariants
from pagedkv.errors import CacheStateError, InvalidRequestError

BLOCK_SIZE = 4
FULL = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1)
WINDOW_8 = SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, sliding_window=8)


def start(kv: KVCacheManager, request_id: str, tokens: list[int], content: KVContent):
    """Admit a request with its whole prompt and write its KV."""
    request = make_request(kv, request_id, tokens)
    num_hit, blocks = admit(kv, request)
    assert blocks is not None
    content.apply(kv.take_blocks_to_copy())
    content.write(kv, request, num_hit, request.num_tokens)
    return request


def fork(kv: KVCacheManager, parent: KVCacheRequest, child_id: str) -> KVCacheRequest:
    """A child with the parent's computed tokens, forked."""
    c = parent.num_computed_tokens
    child = make_request(kv, child_id, parent.all_token_ids[:c], num_computed_tokens=c)
    assert kv.fork(parent, child) is not None
    return child


def decode(kv: KVCacheManager, content: KVContent, request: KVCacheRequest, token: int):
    """One step of one request: append ``token``, allocate its slot, perform the step's copies,
    write its KV. Returns the copies."""
    request.append_output_token_ids(token)
    assert kv.allocate_slots(request, 1) is not None
    copies = kv.take_blocks_to_copy()
    content.apply(copies)
    content.write(kv, request, request.num_computed_tokens, request.num_computed_tokens + 1)
    request.num_computed_tokens += 1
    return copies


def check(kv: KVCacheManager, content: KVContent, *requests: KVCacheRequest) -> None:
    check_invariants(kv, requests)
    for request in requests:
        content.check(kv, request)


def test_fork_at_a_block_boundary_never_copies():
    kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(8)), content)
    child = fork(kv, parent, "c")
    assert kv.get_block_ids("c") == kv.get_block_ids("p") == ([1, 2],)
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2)] == [2, 2]
    for step in range(6):  # both sides cross the next block boundary too
        assert decode(kv, content, parent, 100 + step) == ([],)
        assert decode(kv, content, child, 200 + step) == ([],)
        check(kv, content, parent, child)
    assert kv.get_block_ids("p") == ([1, 2, 3, 5],)
    assert kv.get_block_ids("c") == ([1, 2, 4, 6],)
    assert kv.num_blocks_copied == 0


@pytest.mark.parametrize("first", ["parent", "child"])
def test_fork_mid_block_copies_once_for_the_first_writer(first):
    kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(6)), content)  # block 2 holds tokens 4, 5
    child = fork(kv, parent, "c")
    assert kv.get_block_ids("c") == kv.get_block_ids("p") == ([1, 2],)
    assert kv.block_pool.blocks[2].ref_cnt == 2
    check(kv, content, parent, child)
    writer, other = (parent, child) if first == "parent" else (child, parent)

    # The first writer gets block 3, a copy of block 2; its table points at it.
    assert decode(kv, content, writer, 100) == ([(2, 3)],)
    assert kv.get_block_ids(writer.request_id) == ([1, 3],)
    assert kv.get_block_ids(other.request_id) == ([1, 2],)
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 1, 1]
    check(kv, content, parent, child)

    # The other one now holds block 2 alone: it writes in place.
    assert decode(kv, content, other, 200) == ([],)
    assert kv.get_block_ids(other.request_id) == ([1, 2],)
    for step in range(4):
        assert decode(kv, content, parent, 300 + step) == ([],)
        assert decode(kv, content, child, 400 + step) == ([],)
        check(kv, content, parent, child)
    assert kv.num_blocks_copied == 1
    assert parent.all_token_ids[:6] == child.all_token_ids[:6]
    assert parent.all_token_ids[6:] != child.all_token_ids[6:]


def test_three_way_fork_copies_for_all_but_the_last_writer():
    kv = KVCacheManager(12, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(5)), content)
    child_1 = fork(kv, parent, "c1")
    child_2 = fork(kv, child_1, "c2")  # a fork of a fork shares the same blocks
    assert kv.block_pool.blocks[2].ref_cnt == 3
    assert kv.block_pool.blocks[1].ref_cnt == 3
    check(kv, content, parent, child_1, child_2)
    assert decode(kv, content, child_1, 10) == ([(2, 3)],)
    assert decode(kv, content, parent, 20) == ([(2, 4)],)
    assert decode(kv, content, child_2, 30) == ([],)  # last holder of block 2
    assert kv.get_block_ids("c1") == ([1, 3],)
    assert kv.get_block_ids("p") == ([1, 4],)
    assert kv.get_block_ids("c2") == ([1, 2],)
    assert kv.block_pool.blocks[1].ref_cnt == 3
    check(kv, content, parent, child_1, child_2)
    assert kv.num_blocks_copied == 2


def test_fork_then_abort_parent():
    kv = KVCacheManager(8, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(7)), content)
    child = fork(kv, parent, "c")
    free_before = kv.num_free_blocks
    kv.free(parent)  # aborted: only its references go
    assert kv.num_free_blocks == free_before
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2)] == [1, 1]
    assert kv.get_block_ids("p") == ([],)
    # The child is the last holder of the partial block: in place, no copy.
    assert decode(kv, content, child, 50) == ([],)
    assert decode(kv, content, child, 51) == ([],)
    assert kv.get_block_ids("c") == ([1, 2, 3],)
    check(kv, content, child)
    kv.free(child)
    assert kv.num_free_blocks == 7
    check_invariants(kv, [])


def test_free_of_a_forked_child_keeps_the_parent_blocks():
    kv = KVCacheManager(8, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(6)), content)
    child = fork(kv, parent, "c")
    decode(kv, content, child, 9)  # the child copied block 2 into block 3
    kv.free(child)  # preempted
    child.num_computed_tokens = 0
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 0]
    assert decode(kv, content, parent, 7) == ([],)
    check(kv, content, parent)
    # Re-admitted: its full block 0 is a prefix-cache hit, the rest is computed again.
    num_hit, blocks = admit(kv, child)
    assert num_hit == 4 and blocks is not None
    content.apply(kv.take_blocks_to_copy())
    content.write(kv, child, num_hit, child.num_tokens)
    assert kv.get_block_ids("c")[0][0] == 1
    check(kv, content, parent, child)


def test_copy_that_does_not_fit_is_refused_and_changes_nothing():
    kv = KVCacheManager(5, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(6)), content)  # blocks 1, 2; 2 free
    child = fork(kv, parent, "c")
    other = start(kv, "o", [7, 7, 7, 7, 7], content)  # takes the 2 free blocks
    assert kv.num_free_blocks == 0
    child.append_output_token_ids(8)
    before = snapshot(kv)
    assert kv.allocate_slots(child, 1) is None  # needs a copy of block 2: no block
    assert snapshot(kv) == before
    assert kv.take_blocks_to_copy() == ([],)
    kv.free(other)
    assert kv.allocate_slots(child, 1) is not None
    assert kv.take_blocks_to_copy() == ([(2, 4)],)


def test_copy_is_counted_with_the_new_blocks():
    """A chunk that crosses a block boundary needs the copy and the new block together."""
    kv = KVCacheManager(6, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(6)), content)  # 3 free
    child = make_request(kv, "c", [0, 1, 2, 3, 4, 5, 40, 41, 42, 43], num_computed_tokens=6)
    assert kv.fork(parent, child) is not None
    start(kv, "o", [7, 7, 7, 7, 7], content)  # 1 free
    before = snapshot(kv)
    assert kv.allocate_slots(child, 4) is None  # copy + 1 new block = 2
    assert snapshot(kv) == before
    assert kv.allocate_slots(child, 2) is not None  # copy only
    assert kv.take_blocks_to_copy() == ([(2, 5)],)
    assert kv.get_block_ids("c") == ([1, 5],)


def test_fast_and_general_paths_copy_alike():
    results = []
    for fast in (True, False):
        kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0)
        if not fast:
            kv._single_full_attention_manager = None
        content = KVContent(BLOCK_SIZE)
        parent = start(kv, "p", list(range(7)), content)
        child = make_request(kv, "c", [*range(7), 50, 51, 52, 53, 54], num_computed_tokens=7)
        assert kv.fork(parent, child) is not None
        new = kv.allocate_slots(child, 5, num_lookahead_tokens=2)
        copies = kv.take_blocks_to_copy()
        content.apply(copies)
        content.write(kv, child, 7, 12)
        child.num_computed_tokens = 12
        check(kv, content, parent, child)
        results.append((new.get_block_ids(), copies, kv.get_block_ids("c"), snapshot(kv)))
    assert results[0] == results[1]
    assert results[0][:3] == (([4, 5],), ([(2, 3)],), ([1, 3, 4, 5],))


def test_sliding_window_group_forks_too():
    kv = KVCacheManager(30, [FULL, WINDOW_8], hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(18)), content)  # c = 18: tokens 0..10 dead, blocks 0, 1
    full, window = kv.get_block_ids("p")
    assert 0 not in window  # the parent gives its dead blocks back at its next allocation
    child = fork(kv, parent, "c")
    child_full, child_window = kv.get_block_ids("c")
    assert child_full == full
    assert child_window == [0, 0, *window[2:]]
    assert [kv.block_pool.blocks[b].ref_cnt for b in window] == [1, 1, 2, 2, 2]
    check(kv, content, parent, child)
    copies = decode(kv, content, child, 99)  # block 4 (tokens 16, 17) is copied in both groups
    assert copies == ([(full[4], copies[0][0][1])], [(window[4], copies[1][0][1])])
    assert decode(kv, content, parent, 98) == ([], [])
    assert kv.get_block_ids("p")[1][:2] == [0, 0]
    for step in range(5):
        decode(kv, content, parent, 200 + step)
        decode(kv, content, child, 300 + step)
        check(kv, content, parent, child)
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 29
    check_invariants(kv, [])


def test_fork_returns_the_child_table_and_keeps_cached_blocks_shared():
    kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(10)), content)
    child = make_request(kv, "c", list(range(10)), num_computed_tokens=10)
    blocks = kv.fork(parent, child)
    assert blocks.get_block_ids() == ([1, 2, 3],)
    assert kv.block_pool.blocks[1].block_hash == parent.block_hashes[0] == child.block_hashes[0]
    # A third request hits the shared full blocks like any cached block.
    other = make_request(kv, "o", list(range(9)))
    _, num_hit = kv.get_computed_blocks(other)
    assert num_hit == 8


def test_fork_does_not_fit_without_a_block_for_the_childs_next_token():
    kv = KVCacheManager(4, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(6)), content)
    start(kv, "o", [5] * 3, content)
    assert kv.num_free_blocks == 0
    child = make_request(kv, "c", list(range(6)), num_computed_tokens=6)
    before = snapshot(kv)
    assert kv.fork(parent, child) is None
    assert snapshot(kv) == before


def test_fork_at_max_model_len_always_fits():
    kv = KVCacheManager(3, block_size=BLOCK_SIZE, hash_seed=0, max_model_len=8)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(8)), content)
    assert kv.num_free_blocks == 0
    child = make_request(kv, "c", list(range(8)), num_computed_tokens=8)
    assert kv.fork(parent, child) is not None


def _bad_forks(kv: KVCacheManager, parent: KVCacheRequest, finished: KVCacheRequest):
    tokens = parent.all_token_ids[:6]
    fresh = make_request(kv, "fresh", list(range(100, 106)))
    yield "itself", parent, parent
    yield "holds no blocks", finished, make_request(kv, "c1", tokens, num_computed_tokens=6)
    yield "already holds blocks", parent, fresh
    yield "num_computed_tokens", parent, make_request(kv, "c2", tokens, num_computed_tokens=5)
    yield (
        "do not start with",
        parent,
        make_request(kv, "c3", [*tokens[:5], 99], num_computed_tokens=6),
    )
    yield "do not start with", parent, make_request(kv, "c4", tokens[:4], num_computed_tokens=6)
    yield "lora_id", parent, make_request(kv, "c5", tokens, num_computed_tokens=6, lora_id=3)
    yield (
        "cache_salt",
        parent,
        make_request(kv, "c6", tokens, num_computed_tokens=6, cache_salt="s"),
    )
    yield (
        "multimodal",
        parent,
        make_request(kv, "c7", tokens, num_computed_tokens=6, mm_features=(("img", 1, 2),)),
    )
    foreign = KVCacheManager(4, block_size=BLOCK_SIZE, hash_seed=1)
    yield "block hashes", parent, make_request(foreign, "c8", tokens, num_computed_tokens=6)
    unstarted = make_request(kv, "u", list(range(3)))
    assert kv.allocate_slots(unstarted, 3) is not None  # slots, nothing computed yet
    yield "no computed tokens", unstarted, make_request(kv, "c9", [0, 1, 2])


def test_fork_preconditions_raise_and_change_nothing():
    kv = KVCacheManager(12, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(6)), content)
    finished = start(kv, "f", list(range(6)), content)
    kv.free(finished)
    start(kv, "fresh", list(range(100, 106)), content)
    for match, bad_parent, bad_child in _bad_forks(kv, parent, finished):
        before = snapshot(kv)
        with pytest.raises(InvalidRequestError, match=match):
            kv.fork(bad_parent, bad_child)
        assert snapshot(kv) == before, match
        assert kv.take_blocks_to_copy() == ([],)


def test_check_invariants_finds_two_writers():
    """A holder that wrote into the shared block without copying it is caught."""
    kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(6)), content)
    child = fork(kv, parent, "c")
    check_invariants(kv, [parent, child])
    parent.append_output_token_ids(9)
    parent.num_computed_tokens += 1  # wrote token 6 into block 2 behind the manager's back
    with pytest.raises(CacheStateError, match="two writers"):
        check_invariants(kv, [parent, child])
    with pytest.raises(CacheStateError, match="not given"):
        check_invariants(kv, [parent])
    check_invariants(kv)  # the ref counts themselves are right


def test_check_invariants_finds_shared_slots_and_wrong_ref_counts():
    kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(8)), content)
    child = fork(kv, parent, "c")
    child.num_computed_tokens = 4  # block 2 would then be only slots for the child, yet shared
    with pytest.raises(CacheStateError, match="no computed token"):
        check_invariants(kv, [parent, child])
    child.num_computed_tokens = 8
    kv.block_pool.blocks[2].ref_cnt += 1
    with pytest.raises(CacheStateError, match="ref_cnt 3 but held 2 times"):
        check_invariants(kv)


def test_hybrid_copy_counts_one_block_per_group():
    """The general path (two groups): the child's first token needs a copy in each group."""
    kv = KVCacheManager(8, [FULL, WINDOW_8], hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(6)), content)  # 2 blocks per group, 3 free
    child = fork(kv, parent, "c")
    filler = start(kv, "f", [7], content)  # 1 block per group, 1 free
    child.append_output_token_ids(50)
    before = snapshot(kv)
    assert kv.allocate_slots(child, 1) is None
    assert snapshot(kv) == before
    assert kv.take_blocks_to_copy() == ([], [])
    kv.free(filler)
    assert kv.allocate_slots(child, 1) is not None
    full, window = kv.get_block_ids("p")
    child_full, child_window = kv.get_block_ids("c")
    assert kv.take_blocks_to_copy() == ([(full[1], child_full[1])], [(window[1], child_window[1])])
    assert child_full[0] == full[0] and child_window[0] == window[0]
    assert len({full[1], child_full[1], window[1], child_window[1]}) == 4


def test_fork_leaves_the_parents_lookahead_slots_alone():
    kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = make_request(kv, "p", list(range(6)))
    assert kv.allocate_slots(parent, 6, num_lookahead_tokens=5) is not None  # slots 0..10
    content.write(kv, parent, 0, 6)
    parent.num_computed_tokens = 6
    assert kv.get_block_ids("p") == ([1, 2, 3],)
    child = fork(kv, parent, "c")
    assert kv.get_block_ids("c") == ([1, 2],)  # block 3 holds no computed token: not shared
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 1]
    check(kv, content, parent, child)
    # The parent's next token goes into the shared block 2: copied, though it has slots there.
    assert decode(kv, content, parent, 60) == ([(2, 4)],)
    assert kv.get_block_ids("p") == ([1, 4, 3],)
    check(kv, content, parent, child)


def test_fork_with_verified_hashes_caches_each_sides_chain():
    """With xxh3_128 every hit is checked against prefix nodes: both sides' new full blocks
    are cached after the shared prefix and hit by requests with the same tokens."""
    kv = KVCacheManager(16, block_size=BLOCK_SIZE, hash_algo="xxh3_128", hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = start(kv, "p", list(range(6)), content)
    child = fork(kv, parent, "c")
    for step in range(6):
        decode(kv, content, parent, 100 + step)
        decode(kv, content, child, 200 + step)
    check(kv, content, parent, child)
    for source in (parent, child):
        probe = make_request(kv, f"probe-{source.request_id}", [*source.all_token_ids, 7])
        blocks, num_hit = kv.get_computed_blocks(probe)
        assert num_hit == 12
        assert blocks.get_block_ids()[0] == kv.get_block_ids(source.request_id)[0]
