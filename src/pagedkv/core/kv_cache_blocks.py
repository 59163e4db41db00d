"""KVCacheBlocks: the blocks a request is handed, opaque to the scheduler (vLLM V1's
``KVCacheBlocks``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.core.coordinator import BlocksPerGroup
    from pagedkv.core.hashing import BlockHash


class KVCacheBlocks:
    """Blocks handed to (or held by) a request, one list per KV cache group. Opaque to the
    scheduler: it only combines them (``+``) and reads their ids.

    Attributes:
        blocks: one sequence of blocks per KV cache group (a list, or ``()`` when empty).
            Treat as read-only.
        tier_hashes: a hit's blocks after ``blocks`` that the KV tier holds (their block
            hashes, in order; ``()`` when none): ``allocate_slots`` gives them new pool blocks
            and records their loads.
    """

    __slots__ = ("blocks", "tier_hashes")

    def __init__(self, blocks: BlocksPerGroup, tier_hashes: tuple[BlockHash, ...] = ()) -> None:
        self.blocks = blocks
        self.tier_hashes = tier_hashes

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple([*a, *b] for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per KV cache group (0 = null block)."""
        return tuple([block.block_id for block in blocks] for blocks in self.blocks)

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"


__all__ = ["KVCacheBlocks"]
