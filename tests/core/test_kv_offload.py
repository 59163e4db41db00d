"""The KV tier's bookkeeping (pagedkv.core.offload) and its use by the KV-cache manager: stores
when the pool evicts a cached block (once per key), LRU within its own capacity, tier hits that
extend a prefix hit, loads into the first new blocks, failed loads discarded; and a hypothesis
state machine that drives the manager with a fake worker holding the content of every pool
block and tier slot: every stored slot must hold the KV of its key, and every request must read
its own blocks' KV back."""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv.core import FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from pagedkv.core.events import BlockRemoved, BlockStored
from pagedkv.core.invariants import check_invariants
from pagedkv.core.offload import (
    KVTierOps,
    OffloadingManager,
    TierDrop,
    TierLoad,
    TierStore,
    tier_key,
)
from pagedkv.core.request import KVCacheRequest
from pagedkv.errors import CacheStateError, ConfigError, InvalidRequestError

BS = 4


def make_manager(num_blocks=6, tier_blocks=4, **kw) -> KVCacheManager:
    return KVCacheManager(
        num_blocks, block_size=BS, hash_seed=0, kv_offloading_blocks=tier_blocks, **kw
    )


def req(kv, rid, tokens) -> KVCacheRequest:
    return KVCacheRequest(rid, list(tokens), block_hasher=kv.block_hasher)


def run(kv, r) -> None:
    blocks, hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    r.num_computed_tokens = r.num_tokens


# ---- OffloadingManager alone -------------------------------------------------------------------


def test_offloading_manager_lru_and_once_per_key():
    tier = OffloadingManager(2)
    assert tier.store(0, "a", 5) and tier.store(0, "b", 6)
    assert not tier.store(0, "a", 7)  # held: refreshed, not stored again
    assert tier.take_ops() == KVTierOps([TierStore(0, "a", 0, 5), TierStore(0, "b", 1, 6)], [])
    assert tier.lru_keys() == ["b", "a"]
    assert tier.store(0, "c", 8)  # full: evicts b (least recently used)
    assert tier.lru_keys() == ["a", "c"]
    assert tier.take_ops().writes == [TierDrop("b", 1), TierStore(0, "c", 1, 8)]
    assert tier.stats.num_evicted_blocks == 1
    tier.check_invariants()


def test_offloading_manager_pins_this_steps_entries():
    tier = OffloadingManager(1)
    tier.store(0, "a", 5)
    assert not tier.store(0, "b", 6)  # a is in this step's instructions: skipped
    assert tier.stats.num_skipped_stores == 1
    tier.take_ops()
    tier.load("r", 0, "a", 9)
    assert not tier.store(0, "b", 6)  # a is being loaded this step
    tier.take_ops()
    assert not tier.store(0, "b", 6)  # ... and stays pinned until its load ends
    assert tier.num_loading_requests == 1
    tier.finish_loads("r")
    tier.finish_loads("r")  # unknown by now: ignored
    assert tier.num_loading_requests == 0
    assert tier.store(0, "b", 6)
    assert tier.lru_keys() == ["b"]


def test_offloading_manager_checks():
    with pytest.raises(ConfigError):
        OffloadingManager(0)
    with pytest.raises(ConfigError):
        OffloadingManager(1, "TAPE")
    tier = OffloadingManager(2)
    with pytest.raises(CacheStateError):
        tier.load("r", 0, "missing", 1)
    assert tier.take_ops() is None  # the failed call recorded nothing
    assert tier.restore(["x", "y", "z"]) == ["x"]  # the oldest left out
    assert tier.lru_keys() == ["y", "z"]
    with pytest.raises(CacheStateError):
        tier.restore(["w"])
    tier.discard(["y", "unknown"])
    assert tier.lru_keys() == ["z"] and tier.stats.num_failed_loads == 1
    tier.check_invariants()


# ---- the manager with a tier -------------------------------------------------------------------


def test_manager_refuses_tier_it_cannot_serve():
    with pytest.raises(ConfigError, match="prefix caching"):
        make_manager(enable_caching=False)
    with pytest.raises(ConfigError, match="collision-resistant"):
        make_manager(hash_algo="xxh3_128")
    specs = [
        FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1),
        SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, sliding_window=8),
    ]
    with pytest.raises(ConfigError, match="full-attention"):
        KVCacheManager(8, specs, hash_seed=0, kv_offloading_blocks=4)


def test_evicted_block_is_stored_then_hits_from_the_tier():
    kv = make_manager(num_blocks=6, tier_blocks=4)  # 5 usable blocks
    a = req(kv, "a", range(9))  # 2 full blocks + 1 token
    run(kv, a)
    a_table = kv.get_block_ids("a")[0]
    assert kv.take_tier_ops() is None  # nothing evicted yet
    kv.free(a)
    b = req(kv, "b", range(100, 117))  # 5 blocks: evicts a's cached blocks
    run(kv, b)
    ops = kv.take_tier_ops()
    hashes = a.block_hashes
    # freed last block first, so the tail is evicted (and stored) first
    assert [(w.key, w.block_id) for w in ops.writes] == [
        (tier_key(0, hashes[1]), a_table[1]),
        (tier_key(0, hashes[0]), a_table[0]),
    ]
    assert ops.loads == []
    kv.free(b)
    # a again: the pool lost its blocks, the tier has both full blocks
    a2 = req(kv, "a2", range(9))
    blocks, hit = kv.get_computed_blocks(a2)
    assert hit == 8 and blocks.tier_hashes == tuple(hashes) and not blocks.blocks[0]
    new = kv.allocate_slots(a2, 1, hit, blocks)
    table = kv.get_block_ids("a2")[0]
    assert len(table) == 3 and new.get_block_ids()[0] == table
    ops = kv.take_tier_ops()
    assert ops.loads == [
        TierLoad("a2", 0, tier_key(0, h), kv.offloader.slot_of(tier_key(0, h)), table[i])
        for i, h in enumerate(hashes)
    ]
    # loaded blocks enter the prefix cache one step later (after the load is known good)
    assert kv.block_pool.get_cached_block(hashes[0]) is None
    a2.num_computed_tokens = 9
    kv.allocate_slots(a2, 0)
    assert kv.block_pool.get_cached_block(hashes[0]).block_id == table[0]
    assert kv.offloader.stats.num_loaded_blocks == 2
    check_invariants(kv)


def test_tier_hit_extends_a_pool_hit_and_stores_once():
    kv = make_manager(num_blocks=5, tier_blocks=8)
    a = req(kv, "a", range(13))  # 3 full blocks + 1
    run(kv, a)
    kv.free(a)  # freed last block first: the chain's tail is evicted first
    b = req(kv, "b", range(200, 205))  # 2 blocks: evicts a's blocks 3 (partial) and 2
    run(kv, b)
    stored = [w.key for w in kv.take_tier_ops().writes]
    assert stored == [tier_key(0, a.block_hashes[2])]
    c = req(kv, "c", range(13))
    blocks, hit = kv.get_computed_blocks(c)
    assert hit == 12 and len(blocks.blocks[0]) == 2 and blocks.tier_hashes == (a.block_hashes[2],)
    kv.free(b)
    assert kv.allocate_slots(c, 1, hit, blocks) is not None
    ops = kv.take_tier_ops()
    assert [load.key for load in ops.loads] == [tier_key(0, a.block_hashes[2])]
    assert ops.loads[0].block_id == kv.get_block_ids("c")[0][2]
    c.num_computed_tokens = 13
    kv.free(c)
    # every block of c is cached now (pool hit 2, the loaded one still uncached): evicting
    # block 2 again does not store it twice
    d = req(kv, "d", range(300, 316))
    run(kv, d)
    ops = kv.take_tier_ops()
    assert tier_key(0, a.block_hashes[2]) not in [
        w.key for w in ops.writes if isinstance(w, TierStore)
    ]
    check_invariants(kv)


def test_allocate_checks_tier_hits_before_changing_anything():
    kv = make_manager(num_blocks=6, tier_blocks=4)
    a = req(kv, "a", range(9))
    run(kv, a)
    kv.free(a)
    run(kv, req(kv, "b", range(100, 117)))
    kv.take_tier_ops()
    kv.free_all = None
    c = req(kv, "c", range(9))
    blocks, hit = kv.get_computed_blocks(c)
    other = req(kv, "o", range(50, 59))
    with pytest.raises(InvalidRequestError, match="not its own"):
        kv.allocate_slots(other, 1, hit, blocks)
    with pytest.raises(InvalidRequestError):
        kv.allocate_slots(c, 1, hit - BS, blocks)
    kv.offloader.discard([tier_key(0, c.block_hashes[1])])
    with pytest.raises(CacheStateError, match="left the tier"):
        kv.allocate_slots(c, 1, hit, blocks)
    assert kv.get_block_ids("c") == ([],)
    assert kv.take_tier_ops().loads == []  # only the discard's drop
    check_invariants(kv)


def test_swap_out_stores_a_requests_cached_blocks_now():
    kv = make_manager(num_blocks=8, tier_blocks=8)
    a = req(kv, "a", range(10))
    run(kv, a)
    assert kv.swap_out(a) == 2
    assert kv.swap_out(a) == 0  # once per key
    kv.free(a)
    keys = [w.key for w in kv.take_tier_ops().writes]
    assert keys == [tier_key(0, h) for h in a.block_hashes]


def test_tier_events_carry_the_medium_and_reset_clears_the_tier():
    kv = make_manager(num_blocks=6, tier_blocks=1, enable_kv_cache_events=True)
    kv.offloader.medium = "DISK"
    a = req(kv, "a", range(9))
    run(kv, a)
    kv.free(a)
    run(kv, req(kv, "b", range(100, 117)))
    events = kv.take_events()
    tier_events = [e for e in events if e.medium == "DISK"]
    assert tier_events and isinstance(tier_events[0], BlockStored)
    assert all(e.medium == "GPU" for e in events if e not in tier_events)
    kv.take_tier_ops()
    kv.free(kv_request := req(kv, "b", range(100, 117)))  # noqa: F841 (b's id: frees b)
    assert kv.reset_prefix_cache()
    assert len(kv.offloader) == 0
    assert any(isinstance(e, BlockRemoved) and e.medium == "DISK" for e in kv.take_events())


# ---- state machine -----------------------------------------------------------------------------

PREFIXES = [list(range(1000 * p, 1000 * p + 24)) for p in range(4)]


class FakeWorker:
    """The content of every pool block and tier slot: a full block holds the tier key of its
    (group 0) hash, written when computed; stores copy it out, loads copy it in."""

    def __init__(self) -> None:
        self.pool: dict[int, str | None] = {}
        self.tier: dict[int, tuple[str, str | None]] = {}

    def apply(self, ops: KVTierOps | None, fail: set[str]) -> dict[str, list[str]]:
        failed: dict[str, list[str]] = {}
        if ops is None:
            return failed
        for w in ops.writes:
            if isinstance(w, TierStore):
                assert w.slot not in self.tier, "a slot written while held"
                assert self.pool.get(w.block_id) == w.key, "paged out a block of other KV"
                self.tier[w.slot] = (w.key, self.pool[w.block_id])
            else:
                assert self.tier.pop(w.slot)[0] == w.key
        for load in ops.loads:
            key, content = self.tier[load.slot]
            assert key == load.key
            if key in fail:
                failed.setdefault(load.req_id, []).append(key)
                self.pool[load.block_id] = None
            else:
                self.pool[load.block_id] = content
        return failed


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(10, block_size=BS, hash_seed=0, kv_offloading_blocks=5)
        self.worker = FakeWorker()
        self.live: dict[str, KVCacheRequest] = {}
        self.n = 0

    def _compute(self, r: KVCacheRequest, start: int) -> None:
        table = self.kv.get_block_ids(r.request_id)[0]
        for i in range(start // BS, r.num_tokens // BS):
            self.worker.pool[table[i]] = tier_key(0, r.block_hashes[i])
        if r.num_tokens % BS:
            self.worker.pool[table[r.num_tokens // BS]] = None  # partial: no key

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 24), fail=st.booleans())
    def admit(self, prefix, length, fail):
        self.n += 1
        r = KVCacheRequest(
            f"r{self.n}", PREFIXES[prefix][:length], block_hasher=self.kv.block_hasher
        )
        blocks, hit = self.kv.get_computed_blocks(r)
        free_before = self.kv.num_free_blocks
        new = self.kv.allocate_slots(r, r.num_tokens - hit, hit, blocks)
        if new is None:
            assert self.kv.num_free_blocks == free_before
            self.kv.take_tier_ops()  # (nothing recorded by a refused call)
            return
        ops = self.kv.take_tier_ops()
        if ops and ops.loads:
            event("tier hit")
        fail_keys = {ops.loads[0].key} if fail and ops and ops.loads else set()
        failed = self.worker.apply(ops, fail_keys)
        if failed:
            event("failed load")
            assert list(failed) == [r.request_id]
            self.kv.discard_tier_entries(failed[r.request_id])
            self.kv.free(r)
            self.worker.apply(self.kv.take_tier_ops(), set())
            return
        # the hit's blocks hold the request's KV
        table = self.kv.get_block_ids(r.request_id)[0]
        for i in range(hit // BS):
            assert self.worker.pool[table[i]] == tier_key(0, r.block_hashes[i])
        self._compute(r, hit)
        r.num_computed_tokens = r.num_tokens
        self.live[r.request_id] = r

    @rule(data=st.data())
    def finish(self, data):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live.pop(rid)
        if data.draw(st.booleans()):
            self.kv.swap_out(r)
        self.kv.free(r)
        self.worker.apply(self.kv.take_tier_ops(), set())

    @invariant()
    def consistent(self):
        check_invariants(self.kv, self.live.values())
        tier = self.kv.offloader
        assert len(tier) <= tier.num_blocks
        for key in tier.lru_keys():
            held_key, content = self.worker.tier[tier.slot_of(key)]
            assert held_key == key and content == key
        for r in self.live.values():
            table = self.kv.get_block_ids(r.request_id)[0]
            for i in range(r.num_tokens // BS):
                assert self.worker.pool[table[i]] == tier_key(0, r.block_hashes[i])
        # every cached pool block holds the KV of its hash
        for block_hash, block in self.kv.block_pool.cached_block_hash_to_block[0].items():
            assert self.worker.pool.get(block.block_id) == tier_key(0, block_hash)


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(stateful_step_count=40)
