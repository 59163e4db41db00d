"""The KV-cache coordinator: one KV cache group per attention type over one shared block pool.

    request r1      group 0 (full)            group 1 (sliding window 8, block 4)
    block table:    [b1][b2][b3][b4]          [null][b7][b8][b9]
                      \\___ both groups take blocks from the same BlockPool ___/

All groups share one ``block_size``, so every group's block index i covers the same tokens and
a prefix-hit length that is a whole number of blocks is one for every group. (vLLM also allows
different block sizes and rounds hits to their LCM; pagedkv keeps one size and checks it.)

Idea from vLLM V1 (``vllm/v1/core/kv_cache_coordinator.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.core.block import KVCacheBlock
from pagedkv.core.block_pool import BlockPool
from pagedkv.core.single_type import SingleTypeKVCacheManager, make_single_type_manager
from pagedkv.core.spec import KVCacheSpec
from pagedkv.errors import ConfigError

if TYPE_CHECKING:
    from pagedkv.core.request import KVCacheRequest

BlocksPerGroup = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator:
    """Drives one single-type manager per KV cache group, all allocating from ``block_pool``.

    Args:
        kv_cache_specs: one spec per KV cache group (>= 1), all with the same block_size.
        block_pool: the shared pool (made with ``num_kv_cache_groups=len(kv_cache_specs)``).

    Raises:
        ConfigError: no specs, block sizes that differ, or a pool with the wrong group count.
    """

    def __init__(self, kv_cache_specs: Sequence[KVCacheSpec], block_pool: BlockPool) -> None:
        if not kv_cache_specs:
            raise ConfigError("at least one KV cache spec (KV cache group) is needed")
        block_sizes = {spec.block_size for spec in kv_cache_specs}
        if len(block_sizes) != 1:
            raise ConfigError(
                f"all KV cache groups must share one block_size, got {sorted(block_sizes)}"
            )
        if len(block_pool.cached_block_hash_to_block) != len(kv_cache_specs):
            raise ConfigError("the block pool was made for a different number of KV cache groups")
        self.block_size = kv_cache_specs[0].block_size
        self.block_pool = block_pool
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_single_type_manager(spec, block_pool, group_id)
            for group_id, spec in enumerate(kv_cache_specs)
        )
        self.num_groups = len(self.single_type_managers)

    def find_longest_cache_hit(
        self, request: KVCacheRequest, max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        """Longest prefix hit valid in every group.

        The groups' hits are intersected to a fixed point: each group is asked for its longest
        hit no longer than the current length, which only shrinks, until no group shrinks it.
        A full-attention hit can be cut shorter; a sliding-window one must be looked up again
        (a shorter hit needs its own window of cached blocks at its end).

        Returns:
            (hit blocks per group, all of the same length; hit length in tokens).
        """
        managers = self.single_type_managers
        block_size = self.block_size
        if self.num_groups == 1:
            blocks = managers[0].find_longest_cache_hit(request, max_cache_hit_length)
            return (blocks,), len(blocks) * block_size
        num_blocks = max_cache_hit_length // block_size
        hits: list[list[KVCacheBlock] | None] = [None] * self.num_groups
        changed = True
        while changed:
            changed = False
            for group_id, manager in enumerate(managers):
                hit = hits[group_id]
                if hit is not None and len(hit) == num_blocks:
                    continue
                if hit is not None and manager.prefix_closed and len(hit) > num_blocks:
                    hits[group_id] = hit[:num_blocks]
                    continue
                hit = manager.find_longest_cache_hit(request, num_blocks * block_size)
                hits[group_id] = hit
                if len(hit) < num_blocks:
                    num_blocks = len(hit)
                    changed = True
        return tuple(hits), num_blocks * block_size  # type: ignore[return-value]

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: BlocksPerGroup,
        num_computed_tokens: int,
    ) -> int:
        """Net free blocks an allocation would take, summed over the groups."""
        total = 0
        for manager, blocks in zip(self.single_type_managers, new_computed_blocks, strict=True):
            total += manager.get_num_blocks_to_allocate(
                request_id, num_tokens, blocks, num_computed_tokens
            )
        return total

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: BlocksPerGroup
    ) -> None:
        for manager, blocks in zip(self.single_type_managers, new_computed_blocks, strict=True):
            manager.save_new_computed_blocks(request_id, blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_computed_tokens: int
    ) -> BlocksPerGroup:
        """New blocks per group; a group whose block of token ``num_computed_tokens`` is
        partially filled and shared copies it first (copy-on-write)."""
        return tuple(
            manager.allocate_new_blocks(request_id, num_tokens, num_computed_tokens)
            for manager in self.single_type_managers
        )

    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int) -> BlocksPerGroup:
        """Map the child's table in every group onto the parent's blocks of its first
        ``num_computed_tokens`` tokens (checked by ``KVCacheManager.fork``)."""
        return tuple(
            manager.fork(parent_id, child_id, num_computed_tokens)
            for manager in self.single_type_managers
        )

    def take_blocks_to_copy(self) -> tuple[list[tuple[int, int]], ...]:
        """Each group's copy-on-write copies since the last call."""
        return tuple(manager.take_blocks_to_copy() for manager in self.single_type_managers)

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def get_blocks(self, request_id: str) -> BlocksPerGroup:
        return tuple(manager.get_blocks(request_id) for manager in self.single_type_managers)
