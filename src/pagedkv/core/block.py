"""KV-cache blocks and the free block queue (an intrusive doubly linked list).

    head sentinel <-> b7 <-> b3 <-> b9 <-> ... <-> b4 <-> tail sentinel
                      ^ next to reuse (evict)         ^ most recently freed

The links live in the blocks themselves, so popleft / remove (from the middle) / append are O(1)
and allocate nothing; a block is in the queue exactly when its ``prev_free_block`` is set.
Idea from vLLM V1 (``vllm/v1/core/kv_cache_utils.py``: ``FreeKVCacheBlockQueue``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.core.hashing import BlockHash
from pagedkv.errors import CacheStateError


class PrefixNode:
    """What the KV of one cached block was computed from: its token ids, its extra keys and the
    node of the block before it in the sequence that computed it (``None`` for block 0).

    The nodes of a sequence form a chain back to block 0, shared by every block computed after
    the same prefix, so a hit can be checked without trusting the block hash: block ``i`` of a
    request matches a cached block when the node's tokens and extra keys equal the request's
    block ``i`` and its parent is the node already matched for block ``i - 1`` (or, for a hit that
    starts after null blocks, when the parent chain matches the request's blocks ``i - 1 .. 0``).
    Kept only with a non-cryptographic hash. Nodes are never reused, so identity (``is``) is
    meaningful: a reallocated block gets a new node.

    Attributes:
        parent: the node of block ``i - 1``, or ``None`` for block 0.
        token_ids: the block's ``block_size`` token ids.
        extra_keys: the block's encoded extra keys (LoRA id, multimodal hashes, cache_salt), as
            ``BlockHasher.extra_keys`` gives them; ``b""`` if none.
    """

    __slots__ = ("extra_keys", "parent", "token_ids")

    def __init__(
        self, parent: PrefixNode | None, token_ids: Sequence[int], extra_keys: bytes = b""
    ) -> None:
        self.parent = parent
        self.token_ids = token_ids
        self.extra_keys = extra_keys

    def __repr__(self) -> str:
        return f"PrefixNode(token_ids={list(self.token_ids)!r}, extra_keys={self.extra_keys!r})"


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical KV-cache block (its data lives in the ops' cache tensor).

    Attributes:
        block_id: index of the block in the pool and in the KV-cache tensor.
        ref_cnt: requests holding the block; 0 = free (in the queue, maybe still cached).
        block_hash: set while the block is in the prefix cache (full, registered and not yet
            evicted), else ``None``.
        cache_group_id: KV cache group whose prefix-cache map holds the block (-1: none).
        prefix: what the block's KV was computed from (tokens, extra keys, parent block's node),
            kept only with a non-cryptographic hash so that every hit can be checked (see
            :class:`PrefixNode`).
        prev_free_block / next_free_block: free block queue links (``None`` outside it).
        is_null: the null block (block 0) that stands in for skipped blocks.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    cache_group_id: int = -1
    prefix: PrefixNode | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        hash_hex = None if self.block_hash is None else self.block_hash[:4].hex()
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={hash_hex})"


class FreeBlockQueue:
    """Free blocks in eviction order: the head is reused first, freed blocks go to the tail.

    Args:
        blocks: initial free blocks, head first.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block.

        Raises:
            CacheStateError: the queue is empty.
        """
        block = self._head.next_free_block
        if block is self._tail:
            raise CacheStateError("no free block left")
        nxt = block.next_free_block
        self._head.next_free_block = nxt
        nxt.prev_free_block = self._head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the ``n`` head blocks, head first.

        Raises:
            CacheStateError: fewer than ``n`` free blocks (the queue is unchanged).
        """
        if n > self.num_free_blocks:
            raise CacheStateError(f"asked for {n} blocks, {self.num_free_blocks} free")
        if n <= 0:
            return []
        blocks = []
        append = blocks.append
        block = self._head.next_free_block
        for _ in range(n):
            append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue, O(1).

        Raises:
            CacheStateError: the block is not in the queue.
        """
        prev = block.prev_free_block
        if prev is None:
            raise CacheStateError(f"block {block.block_id} is not in the free block queue")
        nxt = block.next_free_block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (reused last)."""
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the tail in order (the first of them is reused first)."""
        if not blocks:
            return
        last = self._tail.prev_free_block
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Walk the queue head to tail (O(n); for tests and debugging)."""
        blocks = []
        block = self._head.next_free_block
        while block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks
