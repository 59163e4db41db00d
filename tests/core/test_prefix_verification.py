"""With the fast hash (xxh3_128) a prefix hit never serves KV computed after another prefix.

The block hash is replaced by a forced bad one (a constant: every block collides; or one over the
block's own tokens only, ignoring its parent and extra keys), so only the PrefixNode check stands
between a request and another prompt's KV. For each KV cache group manager (full attention, which
walks from block 0; sliding window, which scans from the end; both groups together) requests that
share a block's tokens but not its prefix must get 0 false hits, and random workloads are checked
against the ground truth of which prefix each physical block was computed for.
"""

from __future__ import annotations

import pytest
import xxhash
from _kv_helpers import admit, decode, make_request
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedkv.core import FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from pagedkv.core.invariants import check_invariants

BLOCK_SIZE = 4
FULL = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1)


def window(w: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, sliding_window=w)


SPECS = {
    "full": [FULL],
    "window4": [window(4)],  # a hit needs 1 cached block at its end
    "window9": [window(9)],  # ... 2 cached blocks at its end
    "full+window": [FULL, window(4)],
}


class _ConstantDigest:
    """A "hash" under which every block collides."""

    def __init__(self, data: bytes) -> None:
        pass

    def digest(self) -> bytes:
        return b"\x00" * 16


def _tokens_only(block_size: int):
    """A "hash" of the block's own tokens: ignores the parent (prefix) and the extra keys."""

    def new_hash(data: bytes):
        return xxhash.xxh3_128(data[16 : 16 + 8 * block_size])

    return new_hash


HASHES = {"constant": lambda bs: _ConstantDigest, "tokens-only": _tokens_only}


def manager(specs: str, bad_hash: str, num_blocks: int = 40) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, SPECS[specs], hash_algo="xxh3_128", hash_seed=0)
    kv.block_hasher._new_hash = HASHES[bad_hash](BLOCK_SIZE)
    return kv


def run_and_free(kv: KVCacheManager, request_id: str, tokens, **kw) -> int:
    """Admit a request with its whole prompt, free it; return its hit length in tokens."""
    request = make_request(kv, request_id, tokens, **kw)
    num_hit, blocks = admit(kv, request)
    assert blocks is not None
    kv.free(request)
    check_invariants(kv)
    return num_hit


@pytest.mark.parametrize("bad_hash", sorted(HASHES))
@pytest.mark.parametrize("specs", sorted(SPECS))
def test_same_block_tokens_after_another_prefix_never_hit(specs, bad_hash):
    kv = manager(specs, bad_hash)
    run_and_free(kv, "a", [5, 6, 7, 8, 5, 6, 7, 8, 99])
    # Block 1 of "b" holds "a"'s tokens 5..8, but after the prefix 1..4.
    assert run_and_free(kv, "b", [1, 2, 3, 4, 5, 6, 7, 8, 99]) == 0
    # A block repeated at another position: only block 0 (the same position) may hit.
    kv = manager(specs, bad_hash)
    run_and_free(kv, "a", [1, 2, 3, 4, 99])
    assert run_and_free(kv, "b", [1, 2, 3, 4, 1, 2, 3, 4, 99]) == 4
    # The true prefix still hits (a constant hash keeps one block per group: block 0).
    kv = manager(specs, bad_hash)
    run_and_free(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 99])
    expected = 8 if bad_hash == "tokens-only" else 4
    assert run_and_free(kv, "b", [1, 2, 3, 4, 5, 6, 7, 8, 99]) == expected


@pytest.mark.parametrize("bad_hash", sorted(HASHES))
@pytest.mark.parametrize("specs", sorted(SPECS))
def test_extra_keys_are_checked_too(specs, bad_hash):
    tokens = [*range(1, 13), 99]
    kv = manager(specs, bad_hash)
    run_and_free(kv, "plain", tokens)
    assert run_and_free(kv, "salted", tokens, cache_salt="tenant-b") == 0
    assert run_and_free(kv, "lora", tokens, lora_id=3) == 0
    assert run_and_free(kv, "other-salt", tokens, cache_salt="tenant-c") == 0
    # Salted blocks are hit by the same salt (a fresh pool: the bad hash keeps one block per
    # hash, and "plain" took them above).
    kv = manager(specs, bad_hash)
    run_and_free(kv, "salted", tokens, cache_salt="tenant-b")
    assert run_and_free(kv, "salted-again", tokens, cache_salt="tenant-b") > 0
    assert run_and_free(kv, "plain", tokens) == 0


# ---- random workloads against the ground truth ------------------------------------------------

_prompts = st.lists(
    st.lists(st.integers(1, 2), min_size=1, max_size=5).map(
        lambda blocks: [t for b in blocks for t in [b] * BLOCK_SIZE]
    ),
    min_size=2,
    max_size=12,
)


def _record_truth(kv: KVCacheManager, request, truth: dict) -> None:
    """Remember the prefix each full block of the request was computed for."""
    for group_id, blocks in enumerate(kv.get_block_ids(request.request_id)):
        for i, block_id in enumerate(blocks):
            end = (i + 1) * BLOCK_SIZE
            if block_id != 0 and end <= request.num_computed_tokens:
                truth.setdefault(group_id, {})[block_id] = tuple(request.all_token_ids[:end])


@pytest.mark.parametrize("bad_hash", sorted(HASHES))
@pytest.mark.parametrize("specs", sorted(SPECS))
@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(prompts=_prompts, num_decodes=st.integers(0, 6))
@example(prompts=[[5] * 4 + [1] * 4, [1] * 4 + [5] * 4 + [1] * 4], num_decodes=0)
def test_hits_serve_only_kv_of_the_same_prefix(specs, bad_hash, prompts, num_decodes):
    kv = manager(specs, bad_hash, num_blocks=16)
    truth: dict[int, dict[int, tuple]] = {}
    for n, tokens in enumerate(prompts):
        request = make_request(kv, f"r{n}", [*tokens, 7])
        blocks, num_hit = kv.get_computed_blocks(request)
        for group_id, group_blocks in enumerate(blocks.blocks):
            for i, block in enumerate(group_blocks):
                if not block.is_null:
                    prefix = tuple(request.all_token_ids[: (i + 1) * BLOCK_SIZE])
                    assert truth[group_id][block.block_id] == prefix, "false prefix hit"
        new_blocks = kv.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
        if new_blocks is None:
            continue
        request.num_computed_tokens = request.num_tokens
        _record_truth(kv, request, truth)
        for step in range(num_decodes):
            if decode(kv, request, 1 + (n + step) % 2) is None:
                break
            _record_truth(kv, request, truth)
        kv.free(request)
        check_invariants(kv)
