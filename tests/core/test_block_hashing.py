"""Block hash chain: canonical bytes, seeds, extra keys, incremental hashing, fast-hash checks."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest
from _kv_helpers import admit, make_request

from pagedkv.core import BlockHasher, KVCacheManager, KVCacheRequest
from pagedkv.errors import ConfigError, InvalidRequestError


def request(hasher: BlockHasher, token_ids, **kw) -> KVCacheRequest:
    return KVCacheRequest("r", list(token_ids), block_hasher=hasher, **kw)


def test_hash_is_sha256_over_canonical_bytes():
    hasher = BlockHasher(4, seed=3)
    expected = hashlib.sha256(hasher.none_hash + struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert hasher.hash_block(None, [1, 2, 3, 4]) == expected
    second = hashlib.sha256(expected + struct.pack("<4q", 5, 6, 7, 8)).digest()
    assert request(hasher, range(1, 10)).block_hashes == [expected, second]


def test_only_full_blocks_are_hashed_and_incrementally():
    hasher = BlockHasher(4, seed=0)
    grown = request(hasher, range(3))
    assert grown.block_hashes == []
    grown.append_output_token_ids(3)
    assert len(grown.block_hashes) == 1
    first = grown.block_hashes[0]
    grown.append_output_token_ids([4, 5, 6, 7, 8, 9, 10])
    assert grown.block_hashes[0] is first  # computed once, never redone
    assert grown.block_hashes == request(hasher, range(11)).block_hashes
    assert grown.num_tokens == 11 and grown.num_prompt_tokens == 3
    assert grown.output_token_ids == list(range(3, 11)) and grown.num_output_tokens == 8


def test_parent_hash_chains_the_prefix():
    hasher = BlockHasher(4, seed=0)
    a = request(hasher, [1, 2, 3, 4, 9, 9, 9, 9]).block_hashes
    b = request(hasher, [1, 2, 3, 5, 9, 9, 9, 9]).block_hashes
    assert a[0] != b[0] and a[1] != b[1]


def test_seed_makes_hashes_reproducible_across_processes():
    code = (
        "from pagedkv.core import BlockHasher, KVCacheRequest\n"
        "h = BlockHasher(16, seed=1234)\n"
        "r = KVCacheRequest('x', list(range(100)), block_hasher=h, cache_salt='s', lora_id=2)\n"
        "print(','.join(x.hex() for x in r.block_hashes))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = KVCacheRequest(
        "y", list(range(100)), block_hasher=BlockHasher(16, seed=1234), cache_salt="s", lora_id=2
    )
    assert out.stdout.strip() == ",".join(x.hex() for x in here.block_hashes)
    assert BlockHasher(16, seed=1235).none_hash != BlockHasher(16, seed=1234).none_hash
    assert BlockHasher(16, seed="1234").none_hash != BlockHasher(16, seed=1234).none_hash


def test_no_seed_gives_a_private_random_root():
    assert BlockHasher(16).none_hash != BlockHasher(16).none_hash


def test_extra_keys_separate_caches():
    hasher = BlockHasher(4, seed=0)
    tokens = list(range(12))
    plain = request(hasher, tokens).block_hashes
    lora = request(hasher, tokens, lora_id=1).block_hashes
    assert all(x != y for x, y in zip(plain, lora, strict=True))
    assert request(hasher, tokens, lora_id=2).block_hashes[0] != lora[0]
    salted = request(hasher, tokens, cache_salt="tenant-a")
    assert all(x != y for x, y in zip(plain, salted.block_hashes, strict=True))
    assert request(hasher, tokens, cache_salt="tenant-b").block_hashes[2] != salted.block_hashes[2]
    # The salt is an extra key of the first block only; descendants differ through the chain.
    assert hasher.extra_keys(salted, 1) == b""
    image = request(hasher, tokens, mm_features=(("img0", 5, 2),)).block_hashes
    assert image[0] == plain[0] and image[1] != plain[1] and image[2] != plain[2]
    other_image = request(hasher, tokens, mm_features=(("img1", 5, 2),)).block_hashes
    moved_image = request(hasher, tokens, mm_features=(("img0", 6, 2),)).block_hashes
    assert len({image[1], other_image[1], moved_image[1]}) == 3
    spans = request(hasher, tokens, mm_features=(("img0", 3, 2),)).block_hashes
    assert spans[0] != plain[0] and spans[1] != plain[1]


def test_xxh3_128_is_an_option():
    hasher = BlockHasher(4, algo="xxh3_128", seed=0)
    assert not hasher.collision_resistant
    hashes = request(hasher, range(8)).block_hashes
    assert len(hashes[0]) == 16 and hashes == request(hasher, range(8)).block_hashes


def test_fast_hash_hits_are_checked_against_token_ids():
    kv = KVCacheManager(11, block_size=4, hash_algo="xxh3_128", hash_seed=0)
    first = make_request(kv, "a", range(1, 10))
    admit(kv, first)
    kv.free(first)
    assert kv.get_computed_blocks(make_request(kv, "b", range(1, 10)))[1] == 8
    # Pretend block 2's hash collided with a different block: the token check refuses the hit.
    kv.block_pool.get_cached_block(first.block_hashes[1]).prefix.token_ids = [0, 0, 0, 0]
    assert kv.get_computed_blocks(make_request(kv, "c", range(1, 10)))[1] == 4


def test_bad_hasher_arguments():
    with pytest.raises(ConfigError, match="hash algorithm"):
        BlockHasher(4, algo="md5")
    with pytest.raises(ConfigError, match="block_size"):
        BlockHasher(0)
    with pytest.raises(ConfigError, match="hash_seed"):
        BlockHasher(4, seed=1.5)
    with pytest.raises(ConfigError, match="4 tokens"):
        BlockHasher(4, seed=0).hash_block(None, [1, 2, 3])


def test_append_of_an_unhashable_token_id_raises_and_appends_nothing():
    hasher = BlockHasher(4, "sha256", 0)
    request = KVCacheRequest("r", [1, 2, 3], block_hasher=hasher)
    with pytest.raises(InvalidRequestError, match="cannot hash"):
        request.append_output_token_ids(2**70)
    assert request.all_token_ids == [1, 2, 3] and request.block_hashes == []
    request.append_output_token_ids(4)
    assert len(request.block_hashes) == 1
