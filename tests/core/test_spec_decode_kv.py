"""Draft tokens and rollback (speculative decoding) in the KV-cache core: only verified tokens
are hashed, cached, paged out to the KV tier and reported in KV events; a rollback leaves the
slots of rejected drafts allocated, and the next step reuses them; sliding windows free blocks by
verified tokens only; fork and copy-on-write hold while a request holds draft slots.

The scheduler's side, as in vLLM V1 (docs/core.md, "Draft tokens and rollback"): schedule the
last verified token plus ``k`` drafts (``allocate_slots(request, 1 + k)``), advance
``num_computed_tokens`` by ``1 + k``; after verification ``reject_draft_tokens(k - j)`` and
append the ``j`` accepted drafts and the bonus token.
"""

from __future__ import annotations

import pytest
from _kv_helpers import KVContent, admit, make_request, snapshot

from pagedkv.core import FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from pagedkv.core.events import BlockStored
from pagedkv.core.invariants import check_invariants
from pagedkv.core.offload import tier_key
from pagedkv.errors import CacheStateError, InvalidRequestError

BLOCK_SIZE = 4
FULL = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1)
PROMPT = [100, 101, 102, 103, 104, 105]  # 6 tokens: block 0 full, block 1 half
DRAFTS = [900, 901, 902, 903, 904, 905]


def spec_step(kv, request, drafts, num_accepted, bonus, *, as_lookahead=False, content=None):
    """One speculative decoding step as the scheduler drives it: slots for the last verified
    token and the drafts, the KV written, then ``num_accepted`` drafts kept and a bonus token
    appended. Returns the new blocks (None: refused, nothing changed)."""
    k = len(drafts)
    c = request.num_computed_tokens
    assert c == request.num_tokens - 1  # the last verified token is not yet computed
    if as_lookahead:
        new_blocks = kv.allocate_slots(request, 1, num_lookahead_tokens=k)
    else:
        new_blocks = kv.allocate_slots(request, 1 + k)
    if new_blocks is None:
        return None
    if content is not None:
        content.apply(kv.take_blocks_to_copy())
        content.write(kv, request, c, c + 1 + k, drafts)
    request.num_computed_tokens += 1 + k
    request.reject_draft_tokens(k - num_accepted)
    request.append_output_token_ids([*drafts[:num_accepted], bonus])
    assert request.num_computed_tokens == request.num_tokens - 1
    return new_blocks


def start(kv, request_id="a"):
    """A request whose prompt is computed and whose first sampled token (200) is appended."""
    request = make_request(kv, request_id, PROMPT)
    admit(kv, request)
    request.append_output_token_ids(200)
    return request


def cached_ids(kv, group=0):
    """block hash -> block id of the group's prefix cache."""
    return {h: b.block_id for h, b in kv.block_pool.cached_block_hash_to_block[group].items()}


@pytest.mark.parametrize("as_lookahead", [False, True])
@pytest.mark.parametrize("num_groups", [1, 2], ids=["fast path", "general path"])
def test_drafts_are_never_cached_and_rollback_reuses_slots(as_lookahead, num_groups):
    kv = KVCacheManager(10, [FULL] * num_groups, hash_seed=0)
    request = start(kv)
    # Groups allocate in turn: one group [1, 2]; two groups [1, 2] and [3, 4].
    tables = tuple([2 * g + 1, 2 * g + 2] for g in range(num_groups))
    assert kv.get_block_ids("a") == tables
    assert cached_ids(kv) == {request.block_hashes[0]: 1}
    # Step 1: token 200 (position 6) + drafts 900..902 (positions 7..9): 10 slots, 3 blocks.
    blocks = spec_step(kv, request, DRAFTS[:3], 1, 300, as_lookahead=as_lookahead)
    new_ids = tuple([2 * num_groups + g + 1] for g in range(num_groups))
    assert blocks.get_block_ids() == new_ids
    tables = tuple(t + n for t, n in zip(tables, new_ids, strict=True))
    assert kv.num_free_blocks == 9 - 3 * num_groups
    # Block 1 held tokens 104 105 200 and draft 900 when it was allocated: not cached then.
    assert cached_ids(kv) == {request.block_hashes[0]: 1}
    assert kv.get_blocks("a").blocks[0][1].block_hash is None
    # 1 of 3 accepted: num_computed 10 - 2 = 8; tokens ... 200 900 | 300.
    assert request.num_computed_tokens == 8
    assert request.all_token_ids[4:] == [104, 105, 200, 900, 300]
    assert len(request.block_hashes) == 2  # block 1 is now verified (and computed)
    # Step 2 from c = 8: token 300 + 3 drafts need 12 slots = the 3 blocks held: nothing new.
    blocks = spec_step(kv, request, DRAFTS[3:6], 3, 301, as_lookahead=as_lookahead)
    assert blocks.get_block_ids() == ([],) * num_groups
    assert kv.get_block_ids("a") == tables
    assert kv.num_free_blocks == 9 - 3 * num_groups
    # Block 1, verified, enters the cache now; block 2 held token 300 and drafts: not cached.
    for g in range(num_groups):
        assert cached_ids(kv, g) == {
            request.block_hashes[0]: tables[g][0],
            request.block_hashes[1]: tables[g][1],
        }
        assert kv.get_blocks("a").blocks[g][2].block_hash is None
    # All 3 accepted: c = 12, tokens ... 300 903 904 905 | 301: block 2 verified, not yet cached.
    assert request.num_computed_tokens == 12
    assert len(request.block_hashes) == 3
    check_invariants(kv, [request])
    kv.free(request)
    assert kv.num_free_blocks == 9
    check_invariants(kv)


def test_both_spellings_allocate_and_cache_the_same():
    tables, caches = [], []
    for as_lookahead in (False, True):
        kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0)
        request = start(kv)
        spec_step(kv, request, DRAFTS[:5], 2, 300, as_lookahead=as_lookahead)
        spec_step(kv, request, DRAFTS[:2], 0, 301, as_lookahead=as_lookahead)
        tables.append(kv.get_block_ids("a"))
        caches.append(snapshot(kv))
    # c = 6 + 1 + 5 - 3 = 9, then 9 + 1 + 2 - 2 = 10: 12 slots at most, 3 blocks.
    assert tables[0] == tables[1] == ([1, 2, 3],)
    assert caches[0] == caches[1]


def test_cached_blocks_hold_verified_kv_only():
    """The KV model: every cached block holds the tokens of its hash, though drafts were
    written into the same blocks and then rejected."""
    kv = KVCacheManager(12, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    request = make_request(kv, "a", PROMPT)
    admit(kv, request)
    content.write(kv, request, 0, 6)
    request.append_output_token_ids(200)
    spec_step(kv, request, [900, 901, 902], 0, 300, content=content)  # all rejected
    # Position 7 held draft 900 (rejected); 300 is now token 7, not yet computed.
    assert content.blocks[2] == [104, 105, 200, 900]
    assert request.all_token_ids[4:8] == [104, 105, 200, 300]
    assert 2 not in cached_ids(kv).values()
    spec_step(kv, request, [901, 902], 2, 301, content=content)
    assert content.blocks[2] == [104, 105, 200, 300]  # the next step overwrote the draft
    assert cached_ids(kv)[request.block_hashes[1]] == 2
    content.check(kv, request)
    tokens_of_hash = {
        h: request.all_token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        for i, h in enumerate(request.block_hashes)
    }
    content.check_cached(kv, tokens_of_hash)


def test_kv_events_carry_verified_tokens_only():
    kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0, enable_kv_cache_events=True)
    request = start(kv)
    kv.take_events()
    spec_step(kv, request, DRAFTS[:3], 0, 300)
    assert kv.take_events() == []  # block 1 held drafts: no BlockStored
    spec_step(kv, request, DRAFTS[3:5], 0, 301)
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (request.block_hashes[1],)
    assert stored.parent_block_hash == request.block_hashes[0]
    assert stored.token_ids == (104, 105, 200, 300)


def test_kv_tier_pages_out_verified_blocks_only():
    kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0, kv_offloading_blocks=8)
    request = start(kv)
    spec_step(kv, request, DRAFTS[:6], 3, 300)  # c = 10; 13 slots: the 4th block holds drafts
    assert kv.get_block_ids("a") == ([1, 2, 3, 4],)
    assert request.all_token_ids[4:] == [104, 105, 200, 900, 901, 902, 300]
    # Only block 0 is cached: block 1 held draft 900 when the step cached (it is verified now,
    # and enters the cache with the next step), so neither it nor a draft block goes to the tier.
    assert kv.swap_out(request) == 1
    assert [(w.key, w.block_id) for w in kv.take_tier_ops().writes] == [
        (tier_key(0, request.block_hashes[0]), 1)
    ]
    # From c = 10 (11 verified tokens): block 1 is cached, block 2 (tokens 8..10 + a draft) not.
    spec_step(kv, request, DRAFTS[:2], 0, 301)
    assert kv.swap_out(request) == 1  # block 0 is only refreshed
    assert [(w.key, w.block_id) for w in kv.take_tier_ops().writes] == [
        (tier_key(0, request.block_hashes[1]), 2)
    ]
    assert kv.page_out_cached() == 0  # the tier holds both already


def test_rollback_is_checked():
    kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0)
    request = start(kv)
    kv.allocate_slots(request, 1 + 3)
    request.num_computed_tokens += 4  # 10 computed, 7 verified: 3 drafts computed
    for bad in (4, -1, 1.0, None):
        with pytest.raises(InvalidRequestError, match="num_rejected_tokens"):
            request.reject_draft_tokens(bad)
        assert request.num_computed_tokens == 10
    request.reject_draft_tokens(3)
    assert request.num_computed_tokens == 7
    request.append_output_token_ids(300)
    # No draft computed now (c = 7 = num_tokens - 1): only 0 may be rejected.
    with pytest.raises(InvalidRequestError, match=r"\[0, 0\]"):
        request.reject_draft_tokens(1)
    request.reject_draft_tokens(0)
    assert request.num_computed_tokens == 7


def test_sliding_window_frees_by_verified_tokens_only():
    """Window 4, block 4: a step from c frees the blocks wholly before c - 3; a rollback keeps
    every block the next token's window needs."""
    kv = KVCacheManager(
        16,
        [FULL, SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, sliding_window=4)],
        hash_seed=0,
    )
    content = KVContent(BLOCK_SIZE)
    request = make_request(kv, "a", PROMPT)
    admit(kv, request)
    content.write(kv, request, 0, 6)
    request.append_output_token_ids(200)
    assert kv.get_block_ids("a") == ([1, 2], [3, 4])
    # c = 6: tokens 3.. are live, nothing freed; 1 + 5 tokens need 12 slots: one block each.
    spec_step(kv, request, DRAFTS[:5], 1, 300, content=content)
    assert kv.get_block_ids("a") == ([1, 2, 5], [3, 4, 6])
    # Rolled back to c = 8 (positions 7 = 900 accepted, 8 = 300 next): the next token's window
    # is 5..8, so the block of tokens 4..7 is live though drafts were written past it.
    assert request.num_computed_tokens == 8
    content.check(kv, request)
    # Next step from c = 8: block 0 (tokens 0..3) is dead and given back, block 1 is kept.
    spec_step(kv, request, DRAFTS[:2], 0, 301, content=content)
    assert kv.get_block_ids("a") == ([1, 2, 5], [0, 4, 6])
    assert request.num_computed_tokens == 9
    content.check(kv, request)
    check_invariants(kv, [request])
    assert kv.num_free_blocks == 15 - 5


def test_fork_and_copy_on_write_with_draft_slots():
    kv = KVCacheManager(12, block_size=BLOCK_SIZE, hash_seed=0)
    content = KVContent(BLOCK_SIZE)
    parent = make_request(kv, "p", PROMPT)
    admit(kv, parent)
    content.write(kv, parent, 0, 6)
    parent.append_output_token_ids(200)
    # 1 + 6 slots from c = 6 (13 slots, 4 blocks); 2 accepted: c = 9, block 3 = draft slots only.
    spec_step(kv, parent, DRAFTS[:6], 2, 300, content=content)
    assert kv.get_block_ids("p") == ([1, 2, 3, 4],)
    assert parent.num_computed_tokens == 9
    child = make_request(kv, "c", parent.all_token_ids, num_computed_tokens=9)
    blocks = kv.fork(parent, child)
    # The child shares the blocks of the 9 computed tokens, not the parent's draft block.
    assert blocks.get_block_ids() == ([1, 2, 3],)
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 2, 1]
    check_invariants(kv, [parent, child])
    # The parent writes position 9 into the shared, partially filled block 3: copy-on-write.
    spec_step(kv, parent, DRAFTS[:2], 1, 301, content=content)
    assert kv.take_blocks_to_copy() == ([],)  # taken by spec_step, applied to the KV model
    assert kv.get_block_ids("p") == ([1, 2, 5, 4],)
    assert kv.num_blocks_copied == 1
    assert content.blocks[5][:2] == [901, 300]  # copied from block 3, then written
    # The child, last holder of block 3, writes in place; its stale draft slot is overwritten.
    spec_step(kv, child, DRAFTS[:1], 1, 302, content=content)
    assert kv.get_block_ids("c") == ([1, 2, 3],)  # its 3 blocks cover c + 1 + 1 = 11 slots
    assert kv.num_blocks_copied == 1
    for request in (parent, child):
        content.check(kv, request)
    check_invariants(kv, [parent, child])
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 11


@pytest.mark.parametrize("hash_algo", ["sha256", "xxh3_128"])
def test_prefix_hits_after_rollback_are_verified_tokens(hash_algo):
    """A later request hits the verified blocks; one whose tokens are the rejected drafts
    does not hit the block they were written into."""
    kv = KVCacheManager(12, block_size=BLOCK_SIZE, hash_seed=0, hash_algo=hash_algo)
    request = start(kv)
    spec_step(kv, request, [900, 901, 902], 0, 300)  # position 7: draft 900 rejected, 300 kept
    spec_step(kv, request, [901, 902], 0, 301)  # caches block 1 = 104 105 200 300
    assert request.all_token_ids == [*PROMPT, 200, 300, 301]
    same = make_request(kv, "same", [*PROMPT, 200, 300, 7])
    blocks, num_hit = kv.get_computed_blocks(same)
    assert (blocks.get_block_ids(), num_hit) == (([1, 2],), 8)
    drafted = make_request(kv, "drafted", [*PROMPT, 200, 900, 7])
    blocks, num_hit = kv.get_computed_blocks(drafted)
    assert (blocks.get_block_ids(), num_hit) == (([1],), 4)


def test_check_invariants_finds_a_cached_block_past_the_verified_tokens():
    kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0)
    request = start(kv)
    spec_step(kv, request, DRAFTS[:3], 3, 300)  # c = 10
    spec_step(kv, request, DRAFTS[3:5], 0, 301)  # c = 11, blocks 0 and 1 cached
    assert cached_ids(kv) == {request.block_hashes[0]: 1, request.block_hashes[1]: 2}
    check_invariants(kv, [request])
    request.num_computed_tokens = 7  # rolled back into block 1 (reject_draft_tokens refuses)
    with pytest.raises(CacheStateError, match="in the prefix cache but is not one of its"):
        check_invariants(kv, [request])


def test_slots_stop_at_max_model_len_so_the_scheduler_cuts_the_drafts():
    """Found by the fast-vs-general machine: drafts reach max_model_len fast. The slot count is
    capped there, so a step that schedules past it gets fewer slots than tokens; the scheduler
    must cut ``k`` to ``max_model_len - num_computed_tokens - 1`` first."""
    kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0, max_model_len=12)
    request = start(kv)  # c = 6, 7 tokens
    blocks = kv.allocate_slots(request, 1 + 8)  # 15 slots asked, 12 given: 3 blocks, not 4
    assert blocks.get_block_ids() == ([3],)
    assert kv.get_block_ids("a") == ([1, 2, 3],)
    k = 12 - request.num_computed_tokens - 1  # 5 drafts fit
    assert kv.allocate_slots(request, 1 + k).get_block_ids() == ([],)
    request.num_computed_tokens += 1 + k
    check_invariants(kv, [request])
