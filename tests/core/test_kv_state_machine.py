"""Hypothesis state machines: random admits (many sharing prefixes), prefill chunks, decode steps,
finishes, preemptions, double frees and resets; the pool's invariants are checked after every
step. One machine with a single full-attention group, one with full + sliding-window groups."""

from __future__ import annotations

from _kv_helpers import make_request, snapshot
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.core import FullAttentionSpec, KVCacheManager, SlidingWindowSpec

BLOCK_SIZE = 4
NUM_BLOCKS = 24
PREFIXES = [list(range(1000 * p, 1000 * p + 40)) for p in range(3)]
#: Examples, seed, deadline: the profile in tests/conftest.py (derandomized unless exploring).
SETTINGS = settings(stateful_step_count=40)


class KVCacheMachine(RuleBasedStateMachine):
    """Drives a KVCacheManager like a scheduler would and checks it after every step."""

    specs = None

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, self.specs, block_size=BLOCK_SIZE, hash_seed=0)
        self.running = {}
        self.preempted = []
        self.finished = []
        self.next_id = 0
        self.next_token = 10**6

    def _fresh_tokens(self, n: int) -> list[int]:
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    def _schedule(self, request, num_new_tokens: int, with_hit: bool) -> bool:
        """One allocation; a refused call must change nothing."""
        blocks, num_hit = None, 0
        if with_hit:
            blocks, num_hit = self.kv.get_computed_blocks(request)
            assert num_hit % BLOCK_SIZE == 0 and num_hit <= request.num_tokens - 1
            for group_blocks in blocks.blocks:
                assert len(group_blocks) == num_hit // BLOCK_SIZE
            for i, block in enumerate(blocks.blocks[0]):
                assert block.block_hash == request.block_hashes[i]
            num_new_tokens = min(num_new_tokens, request.num_tokens - num_hit)
        before = snapshot(self.kv)
        new_blocks = self.kv.allocate_slots(request, num_new_tokens, num_hit, blocks)
        if new_blocks is None:
            assert snapshot(self.kv) == before
            return False
        request.num_computed_tokens += num_hit + num_new_tokens
        return True

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.integers(0, 40),
        suffix_len=st.integers(0, 24),
        chunk=st.integers(1, 64),
    )
    def admit(self, prefix, prefix_len, suffix_len, chunk):
        tokens = PREFIXES[prefix][:prefix_len] + self._fresh_tokens(suffix_len)
        if not tokens:
            tokens = self._fresh_tokens(1)
        request = make_request(self.kv, f"r{self.next_id}", tokens)
        self.next_id += 1
        if self._schedule(request, chunk, with_hit=True):
            self.running[request.request_id] = request

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def readmit_preempted(self, data):
        request = data.draw(st.sampled_from(self.preempted))
        if self._schedule(request, request.num_tokens, with_hit=True):
            self.preempted.remove(request)
            self.running[request.request_id] = request

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 64))
    def step(self, data, chunk):
        """Next prefill chunk, or one decode token once the prompt is computed."""
        request = data.draw(st.sampled_from(sorted(self.running.values(), key=_id)))
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining > 0:
            self._schedule(request, min(chunk, remaining), with_hit=False)
            return
        request.append_output_token_ids(self._fresh_tokens(1))
        self._schedule(request, 1, with_hit=False)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        request = data.draw(st.sampled_from(sorted(self.running.values(), key=_id)))
        self.kv.free(request)
        del self.running[request.request_id]
        self.finished.append(request)
        assert not any(self.kv.get_block_ids(request.request_id))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        request = data.draw(st.sampled_from(sorted(self.running.values(), key=_id)))
        self.kv.free(request)
        del self.running[request.request_id]
        request.num_computed_tokens = 0
        self.preempted.append(request)

    @precondition(lambda self: self.finished)
    @rule(data=st.data())
    def free_again(self, data):
        request = data.draw(st.sampled_from(self.finished))
        before = snapshot(self.kv)
        self.kv.free(request)
        assert snapshot(self.kv) == before

    @rule()
    def reset_prefix_cache(self):
        ok = self.kv.reset_prefix_cache()
        assert ok == (not self.running)
        if ok:
            assert all(b.block_hash is None for b in self.kv.block_pool.blocks)

    @invariant()
    def pool_is_consistent(self):
        # free count == queue walk; free + in use + null == num_blocks; no block in use or
        # twice in the queue; map entries carry their hash; null never queued nor cached;
        # ref_cnt == number of block tables holding the block.
        self.kv.check_invariants()
        assert 0.0 <= self.kv.usage <= 1.0

    @invariant()
    def block_tables_cover_computed_tokens(self):
        for request in self.running.values():
            for blocks in self.kv.get_block_ids(request.request_id):
                assert len(blocks) * BLOCK_SIZE >= request.num_computed_tokens
            full_blocks = self.kv.get_block_ids(request.request_id)[0]
            assert 0 not in full_blocks or self.specs is not None


def _id(request) -> str:
    return request.request_id


class HybridKVCacheMachine(KVCacheMachine):
    """The same machine over a full-attention and a sliding-window (window 8) group."""

    specs = (
        FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1),
        SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, sliding_window=8),
    )

    @invariant()
    def full_group_has_no_null_block(self):
        for request in self.running.values():
            assert 0 not in self.kv.get_block_ids(request.request_id)[0]


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = SETTINGS
TestHybridKVCacheMachine = HybridKVCacheMachine.TestCase
TestHybridKVCacheMachine.settings = SETTINGS
