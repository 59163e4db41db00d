"""KV-cache events: what entered and left the prefix cache, for an external index (a router
that sends requests where their prefix is cached). Switched on with ``enable_kv_cache_events``
and drained with ``KVCacheManager.take_events()``.

Idea from vLLM V1 (``vllm/distributed/kv_events.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.core.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of consecutive blocks of one chain entered the prefix cache.

    Attributes:
        block_hashes: hashes of the stored blocks, in chain order.
        parent_block_hash: hash of the block before the first one (``None``: chain start).
        token_ids: the blocks' token ids, ``len(block_hashes) * block_size`` of them.
        block_size: tokens per block.
        lora_id: LoRA adapter of the request that stored them.
        kv_cache_group_id: KV cache group the blocks belong to.
        medium: where the blocks are: ``"GPU"`` (the block pool, whatever the device),
            ``"CPU"`` or ``"DISK"`` (the KV tier, :mod:`pagedkv.core.offload`); vLLM's field.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    kv_cache_group_id: int = 0
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted for reuse) or, with ``medium`` ``"CPU"`` /
    ``"DISK"``, the KV tier."""

    block_hashes: tuple[BlockHash, ...]
    kv_cache_group_id: int = 0
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
