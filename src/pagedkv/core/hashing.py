"""Block hashing for prefix caching: a chain of hashes over full blocks.

The hash of full block ``i`` of a request covers everything that determines its KV::

    block_hash[i] = H(block_hash[i - 1] | NONE_HASH,   # parent: the whole prefix before block i
                      token ids of block i,             # block_size int64, little-endian
                      extra keys of block i)            # LoRA id, multimodal inputs, cache_salt

so equal hashes mean equal prefixes (up to a hash collision), and a prefix-cache lookup is a walk
along the request's hashes. ``NONE_HASH`` (the root) is derived from the hash seed: the same seed
gives the same hashes in every process; no seed gives a random root per hasher.

Canonical byte encoding (never pickle)::

    parent (digest bytes) | tokens (block_size x int64 LE)
        | [b"L" lora_id int64] | [b"M" offset int64, len uint32, mm_hash utf-8]...
        | [b"S" len uint32, salt utf-8]        (first block only)

The parent and the tokens have a fixed length, and every extra key starts with a tag, so no two
different inputs encode to the same bytes. ``cache_salt`` goes into the first block only: it changes
that block's hash and through the chain every descendant's.

Algorithms: ``"sha256"`` (default, collision-resistant: a prefix hit trusts the hash) and
``"xxh3_128"`` (several times cheaper per block, NOT cryptographic: inputs that collide can be
crafted, so with it the block pool also keeps each cached block's token ids and checks them on
every hit).

Idea from vLLM V1 (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``, ``NONE_HASH``).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NewType

from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.validation import check_int, is_int

if TYPE_CHECKING:
    from pagedkv.core.request import KVCacheRequest

#: The digest of one full block's hash chain (32 bytes for sha256, 16 for xxh3_128).
BlockHash = NewType("BlockHash", bytes)


def _hash_constructor(algo: str) -> Callable[[bytes], Any]:
    """``algo``'s hash object constructor: ``ctor(data).digest()`` is the digest of data."""
    if algo == "sha256":
        return hashlib.sha256
    import xxhash  # imported only when asked for

    return xxhash.xxh3_128


#: algorithm name -> whether it is collision-resistant.
HASH_ALGOS = MappingProxyType({"sha256": True, "xxh3_128": False})

_LORA_KEY = struct.Struct("<cq")
_MM_KEY = struct.Struct("<cqI")
_SALT_KEY = struct.Struct("<cI")


def _seed_bytes(seed: int | str | bytes) -> bytes:
    if isinstance(seed, bytes):
        return b"b" + seed
    if isinstance(seed, str):
        return b"s" + seed.encode()
    if is_int(seed):
        return b"i" + str(seed).encode()
    raise ConfigError(f"hash_seed must be an int, str, bytes or None, got {type(seed).__name__}")


class BlockHasher:
    """Computes the block hashes of a request's full blocks, incrementally.

    Args:
        block_size: tokens per block (>= 1); only full blocks are hashed.
        algo: ``"sha256"`` (default) or ``"xxh3_128"`` (fast, non-cryptographic).
        seed: int / str / bytes: the root hash is derived from it, so the same seed gives the
            same hashes across processes; ``None``: a random root (hashes are private to this
            hasher, and nobody outside the process can predict them).

    Raises:
        ConfigError: block_size < 1, an unknown algorithm or a seed of another type.
    """

    __slots__ = (
        "_new_hash",
        "_token_structs",
        "algo",
        "block_size",
        "collision_resistant",
        "none_hash",
        "seed",
    )

    def __init__(
        self, block_size: int, algo: str = "sha256", seed: int | str | bytes | None = None
    ) -> None:
        check_int("block_size", block_size, 1)
        if algo not in HASH_ALGOS:
            raise ConfigError(
                f"unknown hash algorithm {algo!r}; choose one of {', '.join(HASH_ALGOS)}"
            )
        root = os.urandom(32) if seed is None else _seed_bytes(seed)
        self.block_size = block_size
        self.algo = algo
        self.seed = seed
        self.collision_resistant = HASH_ALGOS[algo]
        self._new_hash = _hash_constructor(algo)
        # Compiled packers by token count: packing a run of ints is 3x faster than array().
        self._token_structs: dict[int, struct.Struct] = {}
        self.none_hash = BlockHash(self._new_hash(b"pagedkv-none-hash:" + root).digest())

    def hash_block(
        self,
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: bytes = b"",
    ) -> BlockHash:
        """Hash of one full block.

        Args:
            parent_block_hash: the previous block's hash, or ``None`` for the first block.
            token_ids: exactly ``block_size`` token ids.
            extra_keys: encoded extra keys (see :meth:`extra_keys`), ``b""`` if none.

        Raises:
            ConfigError: ``token_ids`` is not exactly one block long.
        """
        if len(token_ids) != self.block_size:
            raise ConfigError(f"a block has {self.block_size} tokens, got {len(token_ids)}")
        parent = self.none_hash if parent_block_hash is None else parent_block_hash
        data = self._pack_tokens(token_ids)
        return BlockHash(self._new_hash(parent + data + extra_keys).digest())

    def _pack_tokens(self, token_ids: Sequence[int]) -> bytes:
        """Token ids as int64 little-endian bytes, in one call."""
        num_tokens = len(token_ids)
        token_struct = self._token_structs.get(num_tokens)
        if token_struct is None:
            token_struct = self._token_structs[num_tokens] = struct.Struct(f"<{num_tokens}q")
        try:
            return token_struct.pack(*token_ids)
        except struct.error as e:
            raise InvalidRequestError(f"token ids must be ints in the int64 range: {e}") from None

    def extra_keys(self, request: KVCacheRequest, block_index: int) -> bytes:
        """Encoded extra keys of one block of ``request``: what changes its KV besides tokens."""
        keys = b""
        if request.lora_id is not None:
            keys += _LORA_KEY.pack(b"L", request.lora_id)
        if request.mm_features:
            start = block_index * self.block_size
            end = start + self.block_size
            for mm_hash, offset, length in request.mm_features:
                if offset < end and offset + length > start:
                    encoded = mm_hash.encode()
                    keys += _MM_KEY.pack(b"M", offset - start, len(encoded)) + encoded
        if block_index == 0 and request.cache_salt is not None:
            encoded = request.cache_salt.encode()
            keys += _SALT_KEY.pack(b"S", len(encoded)) + encoded
        return keys

    def __call__(self, request: KVCacheRequest) -> list[BlockHash]:
        """Hashes of the full blocks of ``request`` that ``request.block_hashes`` lacks.

        Returns:
            New block hashes, in block order (possibly empty); the caller appends them.
        """
        block_size = self.block_size
        start = len(request.block_hashes)
        end = len(request.all_token_ids) // block_size
        if end <= start:
            return []
        parent = request.block_hashes[-1] if start else self.none_hash
        data = self._pack_tokens(request.all_token_ids[start * block_size : end * block_size])
        nbytes = 8 * block_size
        new_hash = self._new_hash
        has_extra = (
            request.lora_id is not None
            or bool(request.mm_features)
            or (start == 0 and request.cache_salt is not None)
        )
        new_hashes: list[BlockHash] = []
        append = new_hashes.append
        if not has_extra:
            for pos in range(0, len(data), nbytes):
                parent = new_hash(parent + data[pos : pos + nbytes]).digest()
                append(parent)
            return new_hashes
        pos = 0
        for block_index in range(start, end):
            chunk = data[pos : pos + nbytes] + self.extra_keys(request, block_index)
            pos += nbytes
            parent = new_hash(parent + chunk).digest()
            append(parent)
        return new_hashes

    def __repr__(self) -> str:
        return f"BlockHasher(block_size={self.block_size}, algo={self.algo!r}, seed={self.seed!r})"
