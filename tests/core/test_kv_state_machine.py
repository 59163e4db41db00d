"""Hypothesis state machines: random admits (many sharing prefixes), prefill chunks, decode steps,
forks of running requests (then diverging appends), speculative decoding steps (k draft tokens
scheduled, j <= k accepted, num_computed_tokens rolled back by k - j), finishes, preemptions,
double frees, refused forks and resets; the pool's invariants are checked after every step, and a
model of the KV content (the manager's copies applied before each step's writes, each request's
tokens and drafts written into its slots) must read every request's own tokens back, and every
block in the prefix cache must hold exactly the verified tokens of its hash (never a draft). One
machine with a single full-attention group, one with full + sliding-window groups."""

from __future__ import annotations

import pytest
from _kv_helpers import KVContent, make_request, snapshot
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.core import FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from pagedkv.core.invariants import check_invariants
from pagedkv.core.spec import cdiv
from pagedkv.errors import InvalidRequestError

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
        # Subclasses' specs carry the block size; the default spec takes it.
        block_size = BLOCK_SIZE if self.specs is None else None
        self.kv = KVCacheManager(NUM_BLOCKS, self.specs, block_size=block_size, hash_seed=0)
        self.running = {}
        self.preempted = []
        self.finished = []
        self.next_id = 0
        self.next_token = 10**6
        self.content = KVContent(BLOCK_SIZE)
        self.num_groups = self.kv.num_kv_cache_groups
        self.families: list[tuple[str, str]] = []  # (parent id, child id) of every fork
        self.requests = []  # every request made (their block hashes name the cached tokens)

    def _fresh_tokens(self, n: int) -> list[int]:
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    def _schedule(self, request, num_new_tokens: int, with_hit: bool, lookahead: int = 0) -> bool:
        """One allocation (``lookahead``: extra slots, never written, as for rejected draft
        tokens); a refused call must change nothing."""
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
        num_copied = self.kv.num_blocks_copied
        new_blocks = self.kv.allocate_slots(request, num_new_tokens, num_hit, blocks, lookahead)
        copies = self.kv.take_blocks_to_copy()
        if new_blocks is None:
            assert snapshot(self.kv) == before
            assert copies == ([],) * self.num_groups
            return False
        # The step: the worker copies first, then writes the new tokens' KV into their slots.
        num_copies = sum(map(len, copies))
        assert num_copies in (0, self.num_groups)  # every group shares the same last block
        assert self.kv.num_blocks_copied == num_copied + num_copies
        if num_copies:
            event("copy-on-write")
        self.content.apply(copies)
        start = request.num_computed_tokens + num_hit
        self.content.write(self.kv, request, start, start + num_new_tokens)
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
        self.requests.append(request)
        if self._schedule(request, chunk, with_hit=True):
            self.running[request.request_id] = request

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def readmit_preempted(self, data):
        request = data.draw(st.sampled_from(self.preempted))
        if self._schedule(request, request.num_tokens, with_hit=True):
            self.preempted.remove(request)
            self.running[request.request_id] = request

    def _advance(self, request, chunk: int, lookahead: int = 0) -> None:
        """Next prefill chunk, or one decode token (a fresh one) once the prompt is computed."""
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining > 0:
            self._schedule(request, min(chunk, remaining), False, lookahead)
            return
        request.append_output_token_ids(self._fresh_tokens(1))
        self._schedule(request, 1, False, lookahead)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 64), lookahead=st.sampled_from([0, 0, 3]))
    def step(self, data, chunk, lookahead):
        """Next prefill chunk, or one decode token once the prompt is computed; sometimes
        with lookahead slots (so a parent may hold blocks past its computed tokens)."""
        request = data.draw(st.sampled_from(sorted(self.running.values(), key=_id)))
        self._advance(request, chunk, lookahead)

    def _decoding(self):
        """Running requests past their prompt: at most their last verified token uncomputed."""
        return sorted(
            (r for r in self.running.values() if r.num_computed_tokens >= r.num_tokens - 1),
            key=_id,
        )

    @precondition(lambda self: self._decoding())
    @rule(
        data=st.data(),
        num_drafts=st.integers(1, 6),
        as_lookahead=st.booleans(),
    )
    def speculate(self, data, num_drafts, as_lookahead):
        """One speculative decoding step: the last verified token plus ``k`` draft tokens (not in
        ``all_token_ids``) get slots and are written; ``j <= k`` drafts are accepted: the
        request rolls back by ``k - j`` and appends the ``j`` drafts and a bonus token. The slots
        of rejected drafts stay allocated; the next step reuses them."""
        request = data.draw(st.sampled_from(self._decoding()))
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(self._fresh_tokens(1))  # last step's sampled token
        c = request.num_computed_tokens
        k = num_drafts
        drafts = self._fresh_tokens(k)
        cached_before = [dict(m) for m in self.kv.block_pool.cached_block_hash_to_block]
        tables_before = self.kv.get_block_ids(request.request_id)
        before = snapshot(self.kv)
        # Both spellings are the same allocation (the scheduler schedules drafts as new tokens).
        new_blocks = (
            self.kv.allocate_slots(request, 1, num_lookahead_tokens=k)
            if as_lookahead
            else self.kv.allocate_slots(request, 1 + k)
        )
        copies = self.kv.take_blocks_to_copy()
        if new_blocks is None:
            assert snapshot(self.kv) == before
            assert copies == ([],) * self.num_groups
            event("speculate refused")
            return
        # Nothing past the verified tokens entered the prefix cache.
        num_verified_blocks = request.num_tokens // BLOCK_SIZE
        for g, blocks in enumerate(self.kv.get_blocks(request.request_id).blocks):
            assert all(block.block_hash is None for block in blocks[num_verified_blocks:])
            for block_hash in self.kv.block_pool.cached_block_hash_to_block[g]:
                assert block_hash in cached_before[g] or block_hash in request.block_hashes
            # The table grew only as far as the new slots need: the slots held for rolled-back
            # drafts are reused, not allocated twice.
            assert len(blocks) == max(len(tables_before[g]), cdiv(c + 1 + k, BLOCK_SIZE))
        self.content.apply(copies)
        self.content.write(self.kv, request, c, c + 1 + k, drafts)
        request.num_computed_tokens += 1 + k  # the scheduler advances by what it scheduled
        j = data.draw(st.integers(0, k), label="num_accepted")
        event("all drafts accepted" if j == k else "some drafts rejected")
        request.reject_draft_tokens(k - j)
        request.append_output_token_ids([*drafts[:j], *self._fresh_tokens(1)])
        assert request.num_computed_tokens == request.num_tokens - 1 == c + j + 1

    @precondition(lambda self: self._decoding())
    @rule(data=st.data(), extra=st.integers(1, 3))
    def reject_too_many(self, data, extra):
        """Rolling back more than the drafts computed past the verified tokens is refused."""
        request = data.draw(st.sampled_from(self._decoding()))
        num_computed = request.num_computed_tokens
        with pytest.raises(InvalidRequestError):
            request.reject_draft_tokens(extra)
        assert request.num_computed_tokens == num_computed

    def _running_families(self):
        return [
            (parent, child)
            for parent, child in self.families
            if parent in self.running and child in self.running
        ]

    @precondition(lambda self: self._running_families())
    @rule(data=st.data(), child_first=st.booleans(), chunk=st.integers(1, 6))
    def diverge(self, data, child_first, chunk):
        """A forked parent and its child both take a step, each with its own new tokens."""
        parent, child = data.draw(st.sampled_from(self._running_families()))
        pair = (self.running[child], self.running[parent])
        for request in pair if child_first else pair[::-1]:
            self._advance(request, chunk)

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

    @precondition(lambda self: any(r.num_computed_tokens for r in self.running.values()))
    @rule(data=st.data(), tail=st.sampled_from(["none", "parent's", "fresh"]), n=st.integers(1, 9))
    def fork(self, data, tail, n):
        """A child of a running request: its computed tokens, then nothing (the child samples
        its own next token), the parent's uncomputed tokens, or fresh ones."""
        parents = sorted((r for r in self.running.values() if r.num_computed_tokens), key=_id)
        parent = data.draw(st.sampled_from(parents))
        c = parent.num_computed_tokens
        tokens = parent.all_token_ids[:c]
        if tail == "parent's":
            tokens += parent.all_token_ids[c:]
        elif tail == "fresh":
            tokens += self._fresh_tokens(n)
        child = make_request(self.kv, f"r{self.next_id}", tokens, num_computed_tokens=c)
        self.next_id += 1
        self.requests.append(child)
        before = snapshot(self.kv)
        blocks = self.kv.fork(parent, child)
        if blocks is None:
            assert snapshot(self.kv) == before
            assert self.kv.num_free_blocks < self.num_groups
            event("fork refused")
            return
        event("fork mid-block" if c % BLOCK_SIZE else "fork at a block boundary")
        child_tables = self.kv.get_block_ids(child.request_id)
        assert blocks.get_block_ids() == child_tables
        for spec, child_table, parent_table in zip(
            self.kv.kv_cache_specs,
            child_tables,
            self.kv.get_block_ids(parent.request_id),
            strict=True,
        ):
            assert len(child_table) == cdiv(c, BLOCK_SIZE)
            for child_block, parent_block in zip(child_table, parent_table, strict=False):
                assert child_block in (parent_block, 0)
                assert child_block or isinstance(spec, SlidingWindowSpec)
        self.running[child.request_id] = child
        self.families.append((parent.request_id, child.request_id))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), kind=st.sampled_from(["holds blocks", "holds none", "count", "tokens"]))
    def refused_fork(self, data, kind):
        """A fork that breaks a precondition raises and changes nothing."""
        parent = data.draw(st.sampled_from(sorted(self.running.values(), key=_id)))
        c = parent.num_computed_tokens
        tokens = parent.all_token_ids[:c] or self._fresh_tokens(1)
        if kind == "holds blocks":
            others = [r for r in self.running.values() if r is not parent]
            if not others:
                return
            child = data.draw(st.sampled_from(sorted(others, key=_id)))
        elif kind == "holds none":
            if not self.finished:
                return
            child = make_request(self.kv, "x", tokens, num_computed_tokens=c)
            parent = data.draw(st.sampled_from(self.finished))
        elif kind == "count":
            child = make_request(self.kv, "x", [*tokens, 1], num_computed_tokens=c + 1)
        else:
            if not c:
                return
            tokens = [*tokens[:-1], -1]
            child = make_request(self.kv, "x", tokens, num_computed_tokens=c)
        before = snapshot(self.kv)
        with pytest.raises(InvalidRequestError):
            self.kv.fork(parent, child)
        assert snapshot(self.kv) == before
        assert self.kv.take_blocks_to_copy() == ([],) * self.num_groups

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
        # ref_cnt == number of block tables holding the block; no block has two writers (a
        # block shared partially filled sits at the same index of every holder's table, with
        # the same computed tokens); shared blocks hold computed tokens (never bare slots).
        check_invariants(self.kv, self.running.values())
        assert 0.0 <= self.kv.usage <= 1.0

    @invariant()
    def cache_holds_verified_tokens_only(self):
        # A block with a hash in a request's table is one of its verified, computed blocks: its
        # hash is the request's own for that index; every cached block (held or free) holds the
        # tokens of its hash.
        for request in self.running.values():
            for blocks in self.kv.get_blocks(request.request_id).blocks:
                for index, block in enumerate(blocks):
                    if block.block_hash is not None:
                        assert index < len(request.block_hashes)
                        assert block.block_hash == request.block_hashes[index]
                        assert (index + 1) * BLOCK_SIZE <= request.num_computed_tokens
        tokens_of_hash = {}
        for request in self.requests:
            for i, block_hash in enumerate(request.block_hashes):
                tokens_of_hash[block_hash] = request.all_token_ids[
                    i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE
                ]
        self.content.check_cached(self.kv, tokens_of_hash)

    @invariant()
    def every_request_reads_back_its_own_tokens(self):
        for request in self.running.values():
            self.content.check(self.kv, request)

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
