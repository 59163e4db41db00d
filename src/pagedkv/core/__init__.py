"""pagedkv.core: paged KV-cache block management (pure Python; imports no torch).

KVCacheManager -> KVCacheCoordinator -> per-attention-type managers -> BlockPool
"""

from pagedkv.core.block import FreeBlockQueue, KVCacheBlock
from pagedkv.core.block_pool import BlockPool
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.core.hashing import BlockHash, BlockHasher
from pagedkv.core.manager import KVCacheBlocks, KVCacheManager
from pagedkv.core.request import KVCacheRequest
from pagedkv.core.single_type import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from pagedkv.core.spec import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "AllBlocksCleared",
    "AttentionSpec",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheCoordinator",
    "KVCacheEvent",
    "KVCacheManager",
    "KVCacheRequest",
    "KVCacheSpec",
    "MLAAttentionSpec",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "SlidingWindowSpec",
]
