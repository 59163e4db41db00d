"""KVCacheManager: the facade the scheduler uses (vLLM V1's contract).

A scheduling step, for one request::

    blocks, num_hit = kv.get_computed_blocks(req)        # new requests: longest prefix hit
    new = kv.allocate_slots(req, num_new_tokens,          # None: does not fit, nothing changed
                            num_hit, blocks)
    ...                                                   # model writes KV into the slots
    kv.free(req)                                          # finished or preempted

Idea from vLLM V1 (``vllm/v1/core/kv_cache_manager.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pagedkv.config import CacheConfig
from pagedkv.core.block import KVCacheBlock
from pagedkv.core.block_pool import BlockPool
from pagedkv.core.config import KVCacheConfig
from pagedkv.core.coordinator import BlocksPerGroup, KVCacheCoordinator
from pagedkv.core.events import KVCacheEvent
from pagedkv.core.hashing import BlockHasher
from pagedkv.core.request import KVCacheRequest
from pagedkv.core.single_type import FullAttentionManager
from pagedkv.core.spec import FullAttentionSpec, KVCacheSpec, max_num_blocks_per_request
from pagedkv.errors import CacheStateError, ConfigError, InvalidRequestError
from pagedkv.validation import check_int


class KVCacheBlocks:
    """Blocks handed to (or held by) a request, one list per KV cache group. Opaque to the
    scheduler: it only combines them (``+``) and reads their ids.

    Attributes:
        blocks: one sequence of blocks per KV cache group (a list, or ``()`` when empty).
            Treat as read-only.
    """

    __slots__ = ("blocks",)

    def __init__(self, blocks: BlocksPerGroup) -> None:
        self.blocks = blocks

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple([*a, *b] for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per KV cache group (0 = null block)."""
        return tuple([block.block_id for block in blocks] for blocks in self.blocks)

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"


class KVCacheManager:
    """Allocates KV-cache blocks to requests, with prefix caching, over one block pool.

    Args:
        num_blocks: blocks in the pool, including the null block 0 (>= 2); this is
            num_gpu_blocks as sized by ``pagedkv.core.config``.
        kv_cache_specs: one spec per KV cache group (all with one block_size); default: one
            full-attention group of ``block_size``.
        block_size: tokens per block (default 16, or the specs' block size).
        enable_caching: prefix caching on/off.
        hash_algo: ``"sha256"`` (default) or ``"xxh3_128"`` (fast, non-cryptographic; every hit is
            then checked against what the cached block was computed from: tokens, extra keys
            and parent chain, see :class:`pagedkv.core.block.PrefixNode`).
        hash_seed: seeds the root hash so that block hashes agree across processes; ``None``:
            a random root.
        enable_kv_cache_events: record BlockStored / BlockRemoved / AllBlocksCleared events.
        max_model_len: cap on slots allocated for one request, in tokens (``None``: no cap).

    Raises:
        ConfigError: num_blocks < 2, block_size < 1, a spec that is not a KVCacheSpec, block
            sizes that disagree, an unknown hash algorithm, max_model_len < 1.
    """

    @classmethod
    def from_config(
        cls, kv_cache_config: KVCacheConfig, cache_config: CacheConfig
    ) -> KVCacheManager:
        """The manager of a sized KV cache (:mod:`pagedkv.core.config`) with the engine's cache
        options (block hashing, events)."""
        return cls(
            kv_cache_config.num_blocks,
            list(kv_cache_config.kv_cache_specs),
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
            hash_seed=cache_config.hash_seed,
            enable_kv_cache_events=cache_config.enable_kv_cache_events,
            max_model_len=kv_cache_config.max_model_len,
        )

    def __init__(
        self,
        num_blocks: int,
        kv_cache_specs: Sequence[KVCacheSpec] | None = None,
        *,
        block_size: int | None = None,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        hash_seed: int | str | bytes | None = None,
        enable_kv_cache_events: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        if kv_cache_specs is None:
            size = 16 if block_size is None else block_size
            check_int("block_size", size, 1)
            kv_cache_specs = [FullAttentionSpec(block_size=size, num_kv_heads=1, head_size=1)]
        kv_cache_specs = list(kv_cache_specs)
        if not kv_cache_specs:
            raise ConfigError("kv_cache_specs is empty: give at least one KV cache group")
        for spec in kv_cache_specs:
            if not isinstance(spec, KVCacheSpec):
                raise ConfigError(f"kv_cache_specs must hold KVCacheSpec objects, got {spec!r}")
        if block_size is not None and block_size != kv_cache_specs[0].block_size:
            raise ConfigError(
                f"block_size={block_size} disagrees with the specs' block_size "
                f"{kv_cache_specs[0].block_size}"
            )
        check_int("max_model_len", max_model_len, 1, optional=True)
        hasher = BlockHasher(kv_cache_specs[0].block_size, hash_algo, hash_seed)
        self.kv_cache_specs = tuple(kv_cache_specs)
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self._max_num_slots = sys.maxsize if max_model_len is None else max_model_len
        self.block_hasher: BlockHasher | None = hasher if enable_caching else None
        self.block_pool = BlockPool(
            num_blocks,
            enable_caching=enable_caching,
            num_kv_cache_groups=len(kv_cache_specs),
            enable_kv_cache_events=enable_kv_cache_events,
            keep_token_ids=enable_caching and not hasher.collision_resistant,
        )
        self.coordinator = KVCacheCoordinator(kv_cache_specs, self.block_pool)
        self.block_size = self.coordinator.block_size
        self.num_blocks = num_blocks
        self.num_kv_cache_groups = len(kv_cache_specs)
        # Shared and immutable (tuples): "no blocks" without allocating.
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in kv_cache_specs))
        self._no_blocks: BlocksPerGroup = self.empty_kv_cache_blocks.blocks
        # The one group's manager when the model has a single full-attention group (then decode
        # steps and prefill chunks take its one-pass ``grow``); None for hybrid models.
        managers = self.coordinator.single_type_managers
        self._single_full_attention_manager: FullAttentionManager | None = (
            managers[0]
            if len(managers) == 1 and isinstance(managers[0], FullAttentionManager)
            else None
        )

    # ---- state -----------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, 0..1 (cached free blocks count as free)."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, including cached ones)."""
        return self.block_pool.num_free_blocks

    def max_num_blocks_per_request(
        self, num_tokens: int, max_num_batched_tokens: int | None = None
    ) -> int:
        """Most blocks a request of ``num_tokens`` tokens holds at once, summed over KV cache
        groups (compare with ``num_blocks - 1`` to reject a request that can never fit); see
        :func:`pagedkv.core.spec.max_num_blocks_per_request`. ``max_num_batched_tokens``: tokens
        per step (``None``: all ``num_tokens`` in one call)."""
        return max_num_blocks_per_request(self.kv_cache_specs, num_tokens, max_num_batched_tokens)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The blocks ``request_id`` holds (empty if none)."""
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block table per KV cache group for ``request_id`` (0 = null block)."""
        return tuple(
            [block.block_id for block in blocks]
            for blocks in self.coordinator.get_blocks(request_id)
        )

    # ---- scheduling ------------------------------------------------------------------------

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int]:
        """Longest prefix of ``request`` whose KV is cached, for a request being admitted
        (none for a request with ``skip_reading_prefix_cache``).

        NOTE: the hit is capped at ``num_tokens - 1``: the last token must be computed to get
        the logits that sample the next one, even if its block is cached. The manager keeps no
        hit counters: the scheduler counts each request once, at its first admission
        (``SchedulerStats.prefix_cache_hits``), so retried lookups do not count twice.

        Returns:
            (hit blocks, not yet touched: pass them to ``allocate_slots``; hit length in tokens,
            a multiple of block_size).

        Raises:
            InvalidRequestError: the request's block hasher is not compatible with this
                manager's (another seed, algorithm or block size).
        """
        hasher = request.block_hasher
        if not self.enable_caching or hasher is None or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        own = self.block_hasher
        if hasher is not own and (
            hasher.none_hash != own.none_hash or hasher.block_size != own.block_size
        ):
            raise InvalidRequestError(
                f"request {request.request_id!r} was hashed by {hasher!r}; use the manager's "
                "block_hasher"
            )
        num_tokens = len(request.all_token_ids)
        blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(request, num_tokens - 1)
        if not num_hit_tokens:
            return self.empty_kv_cache_blocks, 0
        return KVCacheBlocks(blocks), num_hit_tokens

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens (check, then mutate).

        Block layout of a request after this call::

            | computed (num_computed_tokens) | new hits | new tokens | lookahead |
            |<------ blocks already held ---->|<- touched ->|<-- new blocks ------>|

        Admission counts the new blocks plus the hit blocks that are currently free (touching
        them takes them out of the free queue); sliding-window blocks that left the window are
        given back first (and counted as available). Full blocks up to
        ``num_computed_tokens + num_new_tokens`` enter the prefix cache.

        Args:
            request: the request (``request.num_computed_tokens`` not yet advanced).
            num_new_tokens: tokens to compute in this step (>= 0).
            num_new_computed_tokens: prefix-hit tokens from ``get_computed_blocks`` (new
                requests only).
            new_computed_blocks: the hit blocks from ``get_computed_blocks``.
            num_lookahead_tokens: extra slots (speculative decoding), not cached.

        Returns:
            The newly allocated blocks, or ``None`` if they do not fit; then nothing changed.

        Raises:
            InvalidRequestError: a count that is not an int or is negative, or hit tokens that
                disagree with the hit blocks.
            CacheStateError: hit blocks for a request that already holds blocks, or hit blocks
                evicted (reused) since ``get_computed_blocks``: call the two back to back.
        """
        fast = self._single_full_attention_manager
        if (
            fast is not None
            and (new_computed_blocks is None or new_computed_blocks is self.empty_kv_cache_blocks)
            and num_new_computed_tokens == 0
            and type(num_new_tokens) is int
            and num_new_tokens >= 0
            and type(num_lookahead_tokens) is int
            and num_lookahead_tokens >= 0
        ):
            # Fast path (one full-attention group, no new hits: decode steps and prefill chunks):
            # one check-then-allocate pass. Caching stops at the hashed (full) blocks.
            num_computed_tokens = request.num_computed_tokens
            num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
            if num_tokens_need_slot > self._max_num_slots:
                num_tokens_need_slot = self._max_num_slots
            new_blocks = fast.grow(
                request,
                num_tokens_need_slot,
                num_computed_tokens + num_new_tokens if self.enable_caching else -1,
            )
            if new_blocks is None:
                return None
            return KVCacheBlocks((new_blocks,)) if new_blocks else self.empty_kv_cache_blocks

        for name, count in (
            ("num_new_tokens", num_new_tokens),
            ("num_new_computed_tokens", num_new_computed_tokens),
            ("num_lookahead_tokens", num_lookahead_tokens),
        ):
            check_int(name, count, 0, error=InvalidRequestError)
        request_id = request.request_id
        coordinator = self.coordinator
        if new_computed_blocks is None or not new_computed_blocks.blocks[0]:
            hit_blocks = self._no_blocks
            if num_new_computed_tokens:
                raise InvalidRequestError("num_new_computed_tokens > 0 without hit blocks")
        else:
            hit_blocks = new_computed_blocks.blocks
            if num_new_computed_tokens != len(hit_blocks[0]) * self.block_size:
                raise InvalidRequestError(
                    f"num_new_computed_tokens={num_new_computed_tokens} != "
                    f"{len(hit_blocks[0])} hit blocks x block_size {self.block_size}"
                )
            if len(hit_blocks[0]) > len(request.block_hashes):
                raise InvalidRequestError(
                    f"{len(hit_blocks[0])} hit blocks for request {request_id!r}, which has only "
                    f"{len(request.block_hashes)} full blocks; use this request's own "
                    "get_computed_blocks result"
                )
            if any(coordinator.get_blocks(request_id)):
                raise CacheStateError(
                    f"request {request_id!r} already holds blocks; prefix hits are for new requests"
                )
            # A hit block reused since get_computed_blocks would hand out someone else's KV.
            block_hashes = request.block_hashes
            for blocks in hit_blocks:
                for i, block in enumerate(blocks):
                    if not block.is_null and block.block_hash != block_hashes[i]:
                        raise CacheStateError(
                            f"hit block {block.block_id} of request {request_id!r} was evicted "
                            "after get_computed_blocks; look the hits up again"
                        )

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if num_tokens_need_slot > self._max_num_slots:
            num_tokens_need_slot = self._max_num_slots
        num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hit_blocks, num_computed_tokens
        )
        if num_blocks_to_allocate > self.block_pool.free_block_queue.num_free_blocks:
            return None

        # Checked: from here on everything succeeds.
        coordinator.remove_skipped_blocks(request_id, num_computed_tokens)
        if hit_blocks is not self._no_blocks:
            touch = self.block_pool.touch
            for blocks in hit_blocks:
                touch(blocks)
            coordinator.save_new_computed_blocks(request_id, hit_blocks)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
        if self.enable_caching:
            num_tokens_to_cache = num_computed_tokens + num_new_tokens
            num_tokens = len(request.all_token_ids)
            coordinator.cache_blocks(
                request, num_tokens if num_tokens_to_cache > num_tokens else num_tokens_to_cache
            )
        return KVCacheBlocks(new_blocks)

    def free(self, request: KVCacheRequest) -> None:
        """Release every block of ``request`` (finished or preempted), last block first, so a
        chain's tail is evicted before its prefix. Freeing a request that holds nothing is a
        no-op. Its cached blocks stay hit-able until reused."""
        self.coordinator.free(request.request_id)

    # ---- prefix cache ----------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (for example after new weights are loaded).

        Returns:
            True on success; False if some block is in use (nothing changes).
        """
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """KV cache events since the last call (empty unless events are enabled)."""
        return self.block_pool.take_events()

    def check_invariants(self) -> None:
        """Raise CacheStateError if the pool or the block tables are inconsistent (O(blocks);
        for tests)."""
        self.block_pool.check_invariants()
        ref_cnts: dict[int, int] = {}
        for manager in self.coordinator.single_type_managers:
            for blocks in manager.req_to_blocks.values():
                for block in blocks:
                    if not block.is_null:
                        ref_cnts[block.block_id] = ref_cnts.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks:
            if block.is_null:
                continue
            if block.ref_cnt != ref_cnts.get(block.block_id, 0):
                raise CacheStateError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but held "
                    f"{ref_cnts.get(block.block_id, 0)} times"
                )


__all__ = ["KVCacheBlock", "KVCacheBlocks", "KVCacheManager"]
