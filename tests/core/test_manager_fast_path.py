"""The one-group fast path of ``KVCacheManager.allocate_slots`` (``FullAttentionManager.grow``)
against the general coordinator path: a hypothesis state machine drives two managers with the
same operations, one of them with the fast path switched off, and after every step their block
tables, hit lengths, returned blocks, copy-on-write copies (after forks), free queues, ref counts
and prefix-cache maps must agree; speculative decoding steps (drafts scheduled as new tokens or
as lookahead, then a rollback) included."""

from __future__ import annotations

from _kv_helpers import snapshot
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.core import KVCacheManager, KVCacheRequest
from pagedkv.core.invariants import check_invariants

BLOCK_SIZE = 4
NUM_BLOCKS = 20
MAX_MODEL_LEN = 64
PREFIXES = [list(range(1000 * p, 1000 * p + 32)) for p in range(2)]


class FastVsGeneralMachine(RuleBasedStateMachine):
    """Each request exists twice, once per manager; every call goes to both."""

    enable_caching = True

    def __init__(self) -> None:
        super().__init__()
        kwargs = dict(
            block_size=BLOCK_SIZE,
            enable_caching=self.enable_caching,
            hash_seed=0,  # equal block hashes in both managers
            max_model_len=MAX_MODEL_LEN,
        )
        self.fast = KVCacheManager(NUM_BLOCKS, **kwargs)
        self.general = KVCacheManager(NUM_BLOCKS, **kwargs)
        assert self.fast._single_full_attention_manager is not None
        self.general._single_full_attention_manager = None  # every call takes the general path
        self.running: dict[str, tuple[KVCacheRequest, KVCacheRequest]] = {}
        self.preempted: list[tuple[KVCacheRequest, KVCacheRequest]] = []
        self.next_id = 0
        self.next_token = 10**6

    def _fresh_tokens(self, n: int) -> list[int]:
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    def _allocate(self, pair, num_new_tokens: int, lookahead: int, with_hits: bool) -> bool:
        results = []
        for kv, request in zip((self.fast, self.general), pair, strict=True):
            blocks, num_hit = None, 0
            if with_hits:
                blocks, num_hit = kv.get_computed_blocks(request)
            # A scheduler never schedules past max_model_len (the request finishes there).
            num_new = min(
                num_new_tokens,
                request.num_tokens - num_hit - request.num_computed_tokens,
                MAX_MODEL_LEN - num_hit - request.num_computed_tokens,
            )
            new_blocks = kv.allocate_slots(request, num_new, num_hit, blocks, lookahead)
            if new_blocks is not None:
                request.num_computed_tokens += num_hit + num_new
            results.append(
                (
                    num_hit,
                    None if new_blocks is None else new_blocks.get_block_ids(),
                    kv.take_blocks_to_copy(),
                )
            )
        assert results[0] == results[1]
        return results[0][1] is not None

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.integers(0, 32),
        suffix_len=st.integers(0, 12),
        chunk=st.integers(1, 48),
        with_hits=st.booleans(),
    )
    def admit(self, prefix, prefix_len, suffix_len, chunk, with_hits):
        tokens = PREFIXES[prefix][:prefix_len] + self._fresh_tokens(suffix_len)
        if not tokens:
            tokens = self._fresh_tokens(1)
        request_id = f"r{self.next_id}"
        self.next_id += 1
        pair = tuple(
            KVCacheRequest(request_id, list(tokens), block_hasher=kv.block_hasher)
            for kv in (self.fast, self.general)
        )
        if self._allocate(pair, chunk, 0, with_hits):
            self.running[request_id] = pair

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resume_preempted(self, data):
        pair = data.draw(st.sampled_from(self.preempted))
        if self._allocate(pair, pair[0].num_tokens, 0, with_hits=True):
            self.preempted.remove(pair)
            self.running[pair[0].request_id] = pair

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 48), lookahead=st.integers(0, 3))
    def step(self, data, chunk, lookahead):
        """Next prefill chunk, or one decode token once the prompt is computed."""
        pair = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if pair[0].num_computed_tokens >= MAX_MODEL_LEN:
            return  # finished at max_model_len: the scheduler schedules nothing more
        if pair[0].num_computed_tokens >= pair[0].num_tokens:
            token = self._fresh_tokens(1)
            for request in pair:
                request.append_output_token_ids(token)
            chunk = 1
        self._allocate(pair, chunk, lookahead, with_hits=False)

    def _decoding(self):
        return sorted(
            k for k, p in self.running.items() if p[0].num_computed_tokens >= p[0].num_tokens - 1
        )

    @precondition(lambda self: self._decoding())
    @rule(data=st.data(), num_drafts=st.integers(1, 5), as_lookahead=st.booleans())
    def speculate(self, data, num_drafts, as_lookahead):
        """A speculative decoding step: the last verified token plus ``k`` drafts (not in
        ``all_token_ids``; ``k`` cut so the slots stay within max_model_len, as the scheduler
        must), then ``j <= k`` accepted, a rollback by ``k - j`` and ``j + 1`` tokens appended."""
        pair = self.running[data.draw(st.sampled_from(self._decoding()))]
        if pair[0].num_computed_tokens >= MAX_MODEL_LEN:
            return  # finished at max_model_len
        if pair[0].num_computed_tokens == pair[0].num_tokens:
            token = self._fresh_tokens(1)
            for request in pair:
                request.append_output_token_ids(token)
        c = pair[0].num_computed_tokens
        k = min(num_drafts, MAX_MODEL_LEN - c - 1)
        if k < 1:
            return
        drafts = self._fresh_tokens(k)
        results = []
        for kv, request in zip((self.fast, self.general), pair, strict=True):
            if as_lookahead:
                new_blocks = kv.allocate_slots(request, 1, num_lookahead_tokens=k)
            else:
                new_blocks = kv.allocate_slots(request, 1 + k)
            ids = None if new_blocks is None else new_blocks.get_block_ids()
            results.append((ids, kv.take_blocks_to_copy()))
        assert results[0] == results[1]
        if results[0][0] is None:
            event("speculate refused")
            return
        event("speculate")
        j = data.draw(st.integers(0, k), label="num_accepted")
        accepted = drafts[:j] + self._fresh_tokens(1)
        for request in pair:
            request.num_computed_tokens += 1 + k
            request.reject_draft_tokens(k - j)
            request.append_output_token_ids(accepted)

    @precondition(lambda self: any(p[0].num_computed_tokens for p in self.running.values()))
    @rule(data=st.data(), fresh=st.integers(0, 3))
    def fork(self, data, fresh):
        """A child of a running request (its computed tokens, then ``fresh`` new ones)."""
        parents = sorted(k for k, p in self.running.items() if p[0].num_computed_tokens)
        pair = self.running[data.draw(st.sampled_from(parents))]
        c = pair[0].num_computed_tokens
        tokens = pair[0].all_token_ids[:c] + self._fresh_tokens(fresh)
        request_id = f"r{self.next_id}"
        self.next_id += 1
        children = tuple(
            KVCacheRequest(
                request_id, list(tokens), block_hasher=kv.block_hasher, num_computed_tokens=c
            )
            for kv in (self.fast, self.general)
        )
        results = [
            kv.fork(parent, child)
            for kv, parent, child in zip((self.fast, self.general), pair, children, strict=True)
        ]
        ids = [None if blocks is None else blocks.get_block_ids() for blocks in results]
        assert ids[0] == ids[1]
        if ids[0] is not None:
            self.running[request_id] = children

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        pair = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        for kv, request in zip((self.fast, self.general), pair, strict=True):
            kv.free(request)
            request.num_computed_tokens = 0
        if preempt:
            self.preempted.append(pair)

    @invariant()
    def same_state(self):
        assert snapshot(self.fast) == snapshot(self.general)
        for request_id in self.running:
            assert self.fast.get_block_ids(request_id) == self.general.get_block_ids(request_id)
        check_invariants(self.fast, [pair[0] for pair in self.running.values()])
        check_invariants(self.general, [pair[1] for pair in self.running.values()])


class FastVsGeneralWithoutCachingMachine(FastVsGeneralMachine):
    enable_caching = False


#: Examples, seed, deadline: the profile in tests/conftest.py (derandomized unless exploring).
TestFastVsGeneral = FastVsGeneralMachine.TestCase
TestFastVsGeneral.settings = settings(stateful_step_count=40)
TestFastVsGeneralWithoutCaching = FastVsGeneralWithoutCachingMachine.TestCase
TestFastVsGeneralWithoutCaching.settings = settings(stateful_step_count=40)
