"""The KV cache as the scheduler sees it: one ``typing.Protocol``, two implementations.

:class:`~pagedkv.core.manager.KVCacheManager` (the paged cache, with prefix caching and an
optional KV tier) and the simulator's :class:`~pagedkv.sim.contiguous.ContiguousKVCache` (one
max_model_len region per request, no sharing, no tier) both implement it, so the scheduler
calls the same methods on either and never asks which one it holds. A cache without a tier
implements the tier's methods as no-ops (``has_kv_tier`` False, no ops, nothing to page out).

Idea from vLLM V1, whose scheduler sees the KV cache only through ``KVCacheManager``'s
methods and an opaque ``KVCacheBlocks``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagedkv.core.hashing import BlockHasher
    from pagedkv.core.kv_cache_blocks import KVCacheBlocks
    from pagedkv.core.offload import KVTierOps
    from pagedkv.core.request import KVCacheRequest
    from pagedkv.core.spec import KVCacheSpec


class KVCacheInterface(Protocol):
    """What the scheduler calls on the KV cache (see :mod:`pagedkv.core.manager` for the
    contract of each method: check then mutate, ``None`` when blocks do not fit).

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks in the pool, the null block 0 included.
        kv_cache_specs: one spec per KV cache group (sizes the scheduler's admission checks).
        block_hasher: the hasher new requests hash their blocks with (None: no prefix cache).
        empty_kv_cache_blocks: "no blocks", shared (a hit of length 0).
    """

    block_size: int
    num_blocks: int
    kv_cache_specs: Sequence[KVCacheSpec]
    block_hasher: BlockHasher | None
    empty_kv_cache_blocks: KVCacheBlocks

    # ---- state
    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, 0..1."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now."""
        ...

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one request now (for stats)."""
        ...

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block table per KV cache group of ``request_id``."""
        ...

    # ---- the step
    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of a request being admitted: (hit blocks, hit tokens)."""
        ...

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Slots for ``num_new_tokens`` more tokens (plus lookahead slots); None: no room."""
        ...

    def free(self, request: KVCacheRequest) -> None:
        """Release every block of ``request``."""
        ...

    def fork(
        self, parent_request: KVCacheRequest, child_request: KVCacheRequest
    ) -> KVCacheBlocks | None:
        """Share the parent's computed blocks with the child; None: it does not fit."""
        ...

    def take_blocks_to_copy(self) -> tuple[list[tuple[int, int]], ...]:
        """Copy-on-write ``(src, dst)`` pairs per KV cache group since the last call."""
        ...

    # ---- the KV tier (no-ops without one)
    @property
    def has_kv_tier(self) -> bool:
        """True when a KV tier sits below the pool (``preemption_mode="swap"`` needs one)."""
        ...

    def take_tier_ops(self) -> KVTierOps | None:
        """The tier's instructions since the last call (None: none, or no tier)."""
        ...

    def swap_out(self, request: KVCacheRequest) -> int:
        """Page ``request``'s cached full blocks out to the tier; blocks stored."""
        ...

    def discard_tier_entries(self, keys: Iterable[str], failed_load: bool = True) -> None:
        """Forget tier entries whose load failed or whose store was dropped."""
        ...

    def finish_tier_loads(self, request_id: str) -> None:
        """The workers reported ``request_id``'s tier loads done (good or failed)."""
        ...


__all__ = ["KVCacheInterface"]
