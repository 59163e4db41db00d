"""The naive baseline: one contiguous KV region of max_model_len tokens per request, for its life.

The same usable pool as the paged policies (``num_blocks - 1`` blocks: block 0 is the paged pools'
null block, so it is left out here too), cut into ``num_slots = (num_blocks - 1) * block_size //
max_model_len`` equal regions::

    | block 0 | slot 0: max_model_len tokens | slot 1 | ... |  (tail < max_model_len unused)

Equal-sized regions leave no external fragmentation, but every token a request does not reach is
reserved and wasted (internal fragmentation). The class implements
:class:`~pagedkv.core.interface.KVCacheInterface`, what the engine's
:class:`~pagedkv.engine.scheduler.Scheduler` calls (no prefix cache, no fork, no tier: those
methods do nothing), so every policy runs through one scheduling loop; a slot's "block ids" are
the blocks its region spans (for the block map).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.core.kv_cache_blocks import KVCacheBlocks
from pagedkv.core.offload import KVTierOps
from pagedkv.core.request import KVCacheRequest
from pagedkv.core.spec import FullAttentionSpec, cdiv
from pagedkv.errors import ConfigError
from pagedkv.validation import check_int


class ContiguousKVCache:
    """Reserve max_model_len tokens per request at its first allocation; free them at the end.

    Args:
        num_blocks: blocks of the same pool the paged policies get, block 0 included (it is not
            used, as the paged pools' null block holds no tokens).
        block_size: tokens per block.
        max_model_len: tokens reserved per request.

    Raises:
        ConfigError: a value < 1, or a pool smaller than one region.
    """

    block_hasher = None

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("max_model_len", max_model_len),
        ):
            check_int(name, value, 1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_usable_blocks = num_blocks - 1
        self.num_slots = self.num_usable_blocks * block_size // max_model_len
        if self.num_slots < 1:
            raise ConfigError(
                f"a pool of {num_blocks} blocks of {block_size} tokens (block 0 unused) cannot "
                f"hold even one contiguous region of max_model_len={max_model_len} tokens"
            )
        self.blocks_per_slot = cdiv(max_model_len, block_size)
        # What the engine's Scheduler reads to reject requests that can never fit.
        self.kv_cache_specs = (
            FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1),
        )
        self.empty_kv_cache_blocks = KVCacheBlocks(((),))
        self._free_slots = list(range(self.num_slots - 1, -1, -1))  # pop() gives the lowest
        self._slot_of: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Usable blocks not reserved by any request (the tail too short for a region included)."""
        return self.num_usable_blocks - len(self._slot_of) * self.blocks_per_slot

    @property
    def usage(self) -> float:
        """Fraction of regions in use, 0..1."""
        return len(self._slot_of) / self.num_slots

    @property
    def num_reserved_tokens(self) -> int:
        """Tokens reserved by running requests: max_model_len each."""
        return len(self._slot_of) * self.max_model_len

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int]:
        """No prefix cache: never a hit."""
        return self.empty_kv_cache_blocks, 0

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Reserve a region at the first call (later calls always fit); None if none is free.
        Returns no new blocks: the region's are all the request's from the start."""
        if request.request_id in self._slot_of:
            return self.empty_kv_cache_blocks
        if not self._free_slots:
            return None
        self._slot_of[request.request_id] = self._free_slots.pop()
        return self.empty_kv_cache_blocks

    def free(self, request: KVCacheRequest) -> None:
        """Give the request's region back (no-op if it holds none)."""
        slot = self._slot_of.pop(request.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
            self._free_slots.sort(reverse=True)

    def fork(self, parent_request: KVCacheRequest, child_request: KVCacheRequest) -> None:
        """A contiguous region cannot be shared: never forks (the child queues as a plain
        request, with its own region)."""
        return None

    def take_blocks_to_copy(self) -> tuple[list[tuple[int, int]], ...]:
        """Nothing is ever shared, so nothing is copied on write."""
        return ([],)

    @property
    def num_shared_blocks(self) -> int:
        """Regions are never shared."""
        return 0

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The blocks the request's region spans (empty if it holds none)."""
        slot = self._slot_of.get(request_id)
        if slot is None:
            return ([],)
        start = 1 + slot * self.blocks_per_slot
        return (list(range(start, start + self.blocks_per_slot)),)

    # ---- no KV tier: the tier's methods do nothing

    @property
    def has_kv_tier(self) -> bool:
        """No tier below the regions."""
        return False

    def take_tier_ops(self) -> KVTierOps | None:
        """No tier: no instructions."""
        return None

    def swap_out(self, request: KVCacheRequest) -> int:
        """No tier: nothing is paged out."""
        return 0

    def discard_tier_entries(self, keys: Iterable[str], failed_load: bool = True) -> None:
        """No tier: no entries."""

    def finish_tier_loads(self, request_id: str) -> None:
        """No tier: no loads."""
