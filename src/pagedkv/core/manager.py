"""KVCacheManager: the facade the scheduler uses (vLLM V1's contract), the paged
implementation of :class:`~pagedkv.core.interface.KVCacheInterface`.

A scheduling step, for one request::

    blocks, num_hit = kv.get_computed_blocks(req)        # new requests: longest prefix hit
    new = kv.allocate_slots(req, num_new_tokens,          # None: does not fit, nothing changed
                            num_hit, blocks)
    copies = kv.take_blocks_to_copy()                     # once per step: copy-on-write pairs
    ...                                                   # copies, then KV writes into the slots
    kv.fork(req, child)                                   # between steps: share req's blocks
    kv.free(req)                                          # finished or preempted

Idea from vLLM V1 (``vllm/v1/core/kv_cache_manager.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

from pagedkv.config import CacheConfig
from pagedkv.core.block import KVCacheBlock
from pagedkv.core.block_pool import BlockPool
from pagedkv.core.config import KVCacheConfig
from pagedkv.core.coordinator import BlocksPerGroup, KVCacheCoordinator
from pagedkv.core.events import BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.core.hashing import BlockHash, BlockHasher
from pagedkv.core.kv_cache_blocks import KVCacheBlocks
from pagedkv.core.offload import KVTierOps, OffloadingManager, tier_key
from pagedkv.core.request import KVCacheRequest
from pagedkv.core.single_type import FullAttentionManager
from pagedkv.core.spec import FullAttentionSpec, KVCacheSpec, max_num_blocks_per_request
from pagedkv.errors import CacheStateError, ConfigError, InvalidRequestError
from pagedkv.validation import check_int


class KVCacheManager:
    """Allocates KV-cache blocks to requests, with prefix caching, over one block pool.

    Args:
        num_blocks: blocks in the pool, including the null block 0 (>= 2); this is
            num_gpu_blocks as sized by ``pagedkv.core.config``.
        kv_cache_specs: one spec per KV cache group (all with one block_size: the specs carry
            it); default: one full-attention group of ``block_size``.
        block_size: tokens per block of the default spec (default 16); only without
            ``kv_cache_specs`` (the specs' own block size is the one value).
        enable_caching: prefix caching on/off.
        hash_algo: ``"sha256"`` (default) or ``"xxh3_128"`` (fast, non-cryptographic; every hit is
            then checked against what the cached block was computed from: tokens, extra keys
            and parent chain, see :class:`pagedkv.core.block.PrefixNode`).
        hash_seed: seeds the root hash so that block hashes agree across processes; ``None``:
            a random root.
        enable_kv_cache_events: record BlockStored / BlockRemoved / AllBlocksCleared events.
        max_model_len: cap on slots allocated for one request, in tokens (``None``: no cap).
        kv_offloading_blocks: capacity of the KV tier below the pool, in blocks (each one pool
            block's bytes); 0 = no tier (:mod:`pagedkv.core.offload`).
        kv_offloading_medium: the tier's medium, ``"CPU"`` or ``"DISK"`` (KV events).

    Raises:
        ConfigError: num_blocks < 2, block_size < 1, block_size with kv_cache_specs, a spec
            that is not a KVCacheSpec, specs whose block sizes differ, an unknown hash
            algorithm, max_model_len < 1; a tier without prefix caching, with a
            non-cryptographic hash (a tier hit trusts the hash), or with a sliding-window KV
            cache group (see docs/core.md).
    """

    @classmethod
    def from_config(
        cls, kv_cache_config: KVCacheConfig, cache_config: CacheConfig
    ) -> KVCacheManager:
        """The manager of a sized KV cache (:mod:`pagedkv.core.config`: its specs carry the
        block size, ``cache_config.block_size``) with the engine's cache options (block hashing,
        events, the KV tier)."""
        return cls(
            kv_cache_config.num_blocks,
            list(kv_cache_config.kv_cache_specs),
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
            hash_seed=cache_config.hash_seed,
            enable_kv_cache_events=cache_config.enable_kv_cache_events,
            max_model_len=kv_cache_config.max_model_len,
            kv_offloading_blocks=cache_config.kv_offloading_blocks,
            kv_offloading_medium="DISK" if cache_config.kv_offloading_backend == "disk" else "CPU",
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
        kv_offloading_blocks: int = 0,
        kv_offloading_medium: str = "CPU",
    ) -> None:
        if kv_cache_specs is None:
            size = 16 if block_size is None else block_size
            check_int("block_size", size, 1)
            kv_cache_specs = [FullAttentionSpec(block_size=size, num_kv_heads=1, head_size=1)]
        elif block_size is not None:
            raise ConfigError(
                "block_size is for the default spec: with kv_cache_specs, the specs carry the "
                "block size"
            )
        kv_cache_specs = list(kv_cache_specs)
        if not kv_cache_specs:
            raise ConfigError("kv_cache_specs is empty: give at least one KV cache group")
        for spec in kv_cache_specs:
            if not isinstance(spec, KVCacheSpec):
                raise ConfigError(f"kv_cache_specs must hold KVCacheSpec objects, got {spec!r}")
        check_int("max_model_len", max_model_len, 1, optional=True)
        check_int("kv_offloading_blocks", kv_offloading_blocks, 0)
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
        #: the KV tier's index (None: no tier).
        self.offloader: OffloadingManager | None = None
        if kv_offloading_blocks:
            if not enable_caching:
                raise ConfigError(
                    "KV offloading needs prefix caching (tier entries are keyed by block hash)"
                )
            if not hasher.collision_resistant:
                raise ConfigError(
                    f"KV offloading needs a collision-resistant block hash (a tier hit trusts "
                    f"the hash), not {hash_algo!r}"
                )
            if any(not isinstance(m, FullAttentionManager) for m in managers):
                raise ConfigError(
                    "KV offloading supports full-attention KV cache groups only (set "
                    "disable_hybrid_kv_cache_manager for a sliding-window model)"
                )
            self.offloader = OffloadingManager(
                kv_offloading_blocks, kv_offloading_medium, record_events=enable_kv_cache_events
            )
            self.block_pool.evict_hook = self._page_out
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

    @property
    def has_kv_tier(self) -> bool:
        """True when a KV tier sits below the pool (``kv_offloading_blocks`` > 0)."""
        return self.offloader is not None

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
        if self.offloader is not None:
            tier_hashes = self._find_tier_hit(request, num_hit_tokens, num_tokens - 1)
            if tier_hashes:
                return (
                    KVCacheBlocks(blocks if num_hit_tokens else self._no_blocks, tier_hashes),
                    num_hit_tokens + len(tier_hashes) * self.block_size,
                )
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
        ``min(num_computed_tokens + num_new_tokens, num_tokens)`` (and hashed: every token in
        ``all_token_ids``) enter the prefix cache.

        Speculative decoding (vLLM V1): schedule the last verified token and ``k`` draft tokens
        as ``num_new_tokens = 1 + k`` (or ``1`` with ``num_lookahead_tokens = k``: the same
        slots, the same caching); drafts are not in ``all_token_ids``, so no block holding one
        is hashed, cached, paged out or reported in a KV event. After verification the
        scheduler rolls back with ``request.reject_draft_tokens``; the slots of rejected
        drafts stay allocated and the next call reuses them (docs/core.md, "Draft tokens and
        rollback").

        Args:
            request: the request (``request.num_computed_tokens`` not yet advanced).
            num_new_tokens: tokens to compute in this step (>= 0).
            num_new_computed_tokens: prefix-hit tokens from ``get_computed_blocks`` (new
                requests only).
            new_computed_blocks: the hit blocks from ``get_computed_blocks``.
            num_lookahead_tokens: extra slots past the new tokens (speculative decoding's
                draft tokens), never cached.

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
        tier_hashes = () if new_computed_blocks is None else new_computed_blocks.tier_hashes
        if tier_hashes:
            self._check_tier_hit(request, new_computed_blocks, num_new_computed_tokens)
        if new_computed_blocks is None or not new_computed_blocks.blocks[0]:
            hit_blocks = self._no_blocks
            if num_new_computed_tokens and not tier_hashes:
                raise InvalidRequestError("num_new_computed_tokens > 0 without hit blocks")
        else:
            hit_blocks = new_computed_blocks.blocks
            num_hit = len(hit_blocks[0]) + len(tier_hashes)
            if num_new_computed_tokens != num_hit * self.block_size:
                raise InvalidRequestError(
                    f"num_new_computed_tokens={num_new_computed_tokens} != "
                    f"{num_hit} hit blocks x block_size {self.block_size}"
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
        if tier_hashes:
            # The new blocks may evict pool blocks into the tier: keep the hits there.
            keys = [[tier_key(g, h) for h in tier_hashes] for g in range(self.num_kv_cache_groups)]
            for group_keys in keys:
                self.offloader.pin(group_keys)
        new_blocks = coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, num_computed_tokens
        )
        if tier_hashes:
            # The tier hits are the first new blocks of each group (the table started at the
            # pool hit). They enter the prefix cache with the request's next allocate_slots,
            # once their loads are known good (a failed load must not leave a hash on garbage
            # KV); the scheduler holds the request back until then.
            for g, group_keys in enumerate(keys):
                for key, block in zip(group_keys, new_blocks[g], strict=False):
                    self.offloader.load(request_id, g, key, block.block_id)
            coordinator.cache_blocks(
                request, num_computed_tokens - len(tier_hashes) * self.block_size
            )
        elif self.enable_caching:
            num_tokens_to_cache = num_computed_tokens + num_new_tokens
            num_tokens = len(request.all_token_ids)
            coordinator.cache_blocks(
                request, num_tokens if num_tokens_to_cache > num_tokens else num_tokens_to_cache
            )
        return KVCacheBlocks(new_blocks)

    def free(self, request: KVCacheRequest) -> None:
        """Release every block of ``request`` (finished or preempted), last block first, so a
        chain's tail is evicted before its prefix. Freeing a request that holds nothing is a
        no-op. Its cached blocks stay hit-able until reused. Only the request's own references
        go: blocks it shares with a forked sibling stay held by the sibling."""
        self.coordinator.free(request.request_id)

    # ---- fork and copy-on-write --------------------------------------------------------------

    def fork(
        self, parent_request: KVCacheRequest, child_request: KVCacheRequest
    ) -> KVCacheBlocks | None:
        """Give ``child_request`` the KV of its parent's computed tokens by sharing the parent's
        blocks (check, then mutate; call it between steps).

        The block table is a page table: in every KV cache group the child's table maps the
        parent's blocks of its first ``c = parent.num_computed_tokens`` tokens (``cdiv(c,
        block_size)`` blocks), each held once more (ref_cnt + 1). Full blocks stay shared for good
        (nobody writes into them again). The last one is partially filled when ``c`` is not a
        multiple of block_size: it stays shared until one holder writes into it; that
        ``allocate_slots`` gives the writer a new block and records a (src, dst) copy (see
        :meth:`take_blocks_to_copy`); the last holder left writes into it in place. Blocks the
        parent holds past its computed tokens (lookahead slots) are not shared; sliding-window
        blocks that left the window of token ``c`` are the null block in the child's table.
        The fork allocates nothing and records no event. Idea from vLLM V0's
        ``BlockSpaceManager.fork`` and copy-on-write (``blocks_to_copy``); vLLM V1 dropped it.

        Fit: the fork is refused (``None``, nothing changed) unless the pool has a free block for
        each KV cache group now, that is, what the child's first one-token step will take (a
        copy of the shared partial block, or a new block when ``c`` is on a block boundary); the
        check reserves nothing. With ``c`` at ``max_model_len`` (no further token) it always
        fits.

        Args:
            parent_request: a request holding blocks, with ``num_computed_tokens`` >= 1 tokens
                whose KV is in its blocks (every slot handed out to it written: between steps).
            child_request: a request holding no blocks, with the parent's
                ``num_computed_tokens``, its token ids starting with the parent's first
                ``num_computed_tokens`` ones, the same ``lora_id`` and ``cache_salt``, the same
                multimodal inputs among those tokens and, when both hash blocks, the same block
                hashes for them (the shared KV must be the KV the child would compute).

        Returns:
            The child's blocks (its whole block table), or ``None`` if it does not fit.

        Raises:
            InvalidRequestError: a precondition above does not hold (nothing changed).
        """
        parent_id = parent_request.request_id
        child_id = child_request.request_id
        coordinator = self.coordinator
        if parent_id == child_id:
            raise InvalidRequestError(f"cannot fork request {parent_id!r} into itself")
        parent_blocks = coordinator.get_blocks(parent_id)
        if not any(parent_blocks):
            raise InvalidRequestError(
                f"cannot fork request {parent_id!r}: it holds no blocks (allocate its slots first)"
            )
        if any(coordinator.get_blocks(child_id)):
            raise InvalidRequestError(
                f"cannot fork into request {child_id!r}: it already holds blocks (free it first)"
            )
        num_computed_tokens = parent_request.num_computed_tokens
        if num_computed_tokens < 1:
            raise InvalidRequestError(
                f"cannot fork request {parent_id!r}: it has no computed tokens to share"
            )
        if child_request.num_computed_tokens != num_computed_tokens:
            raise InvalidRequestError(
                f"fork child {child_id!r} has num_computed_tokens="
                f"{child_request.num_computed_tokens}, its parent {parent_id!r} "
                f"{num_computed_tokens}: they must be equal"
            )
        num_blocks = -(-num_computed_tokens // self.block_size)
        if any(len(blocks) < num_blocks for blocks in parent_blocks):
            raise InvalidRequestError(
                f"cannot fork request {parent_id!r}: num_computed_tokens={num_computed_tokens} "
                f"is beyond its slots ({len(parent_blocks[0])} blocks of {self.block_size})"
            )
        if (
            len(child_request.all_token_ids) < num_computed_tokens
            or child_request.all_token_ids[:num_computed_tokens]
            != parent_request.all_token_ids[:num_computed_tokens]
        ):
            raise InvalidRequestError(
                f"fork child {child_id!r}'s token ids do not start with the "
                f"{num_computed_tokens} computed token ids of its parent {parent_id!r}"
            )
        for name in ("lora_id", "cache_salt"):
            if getattr(child_request, name) != getattr(parent_request, name):
                raise InvalidRequestError(
                    f"fork child {child_id!r} has another {name} than its parent {parent_id!r} "
                    "(the shared KV would not be its own)",
                    param=name,
                )
        if _features_before(child_request, num_computed_tokens) != _features_before(
            parent_request, num_computed_tokens
        ):
            raise InvalidRequestError(
                f"fork child {child_id!r} has other multimodal inputs than its parent "
                f"{parent_id!r} among the first {num_computed_tokens} tokens"
            )
        if parent_request.block_hasher is not None and child_request.block_hasher is not None:
            num_full = num_computed_tokens // self.block_size
            if child_request.block_hashes[:num_full] != parent_request.block_hashes[:num_full]:
                raise InvalidRequestError(
                    f"fork child {child_id!r}'s block hashes differ from its parent "
                    f"{parent_id!r}'s: hash both with the manager's block_hasher"
                )
        if (
            num_computed_tokens < self._max_num_slots
            and self.num_kv_cache_groups > self.block_pool.free_block_queue.num_free_blocks
        ):
            return None
        # Checked: from here on everything succeeds.
        tables = coordinator.fork(parent_id, child_id, num_computed_tokens)
        return KVCacheBlocks(tuple(list(blocks) for blocks in tables))  # not the live tables

    def take_blocks_to_copy(self) -> tuple[list[tuple[int, int]], ...]:
        """The copy-on-write copies recorded since the last call (drains them): one list per KV
        cache group of ``(src_block_id, dst_block_id)``, in the order they were made.

        The worker must copy every block ``src`` to ``dst`` (all layers of the group, whole
        block) after the previous step's KV writes and before this step's: take them once per
        step, after the step's ``allocate_slots`` calls, and send them with the step. ``dst``
        replaced ``src`` in the table of the request that is about to write (at index
        ``num_computed_tokens // block_size``): the scheduler finds that request by looking
        for ``dst`` in the step's block tables and sends its table whole.
        """
        return self.coordinator.take_blocks_to_copy()

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one request now (forks and prefix hits); O(num_blocks),
        for stats."""
        return sum(1 for block in self.block_pool.blocks if block.ref_cnt > 1)

    @property
    def num_blocks_copied(self) -> int:
        """Copy-on-write copies recorded since the manager was made, over all KV cache groups
        (it only grows; for stats and tests)."""
        return sum(manager.num_blocks_copied for manager in self.coordinator.single_type_managers)

    # ---- prefix cache ----------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (for example after new weights are loaded).

        Returns:
            True on success; False if some block is in use (nothing changes).
        """
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.offloader is not None:
            self.offloader.clear()
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """KV cache events since the last call (empty unless events are enabled); with a KV
        tier, its stores and drops follow the pool's events (``medium`` ``"CPU"`` /
        ``"DISK"``; a tier ``BlockStored`` carries no token ids: the pool's event for the same
        hash had them)."""
        events = self.block_pool.take_events()
        if self.offloader is not None:
            events.extend(self._tier_events())
        return events

    # ---- the KV tier (pagedkv.core.offload): hits, page-outs, loads, events ------------------

    def _find_tier_hit(
        self, request: KVCacheRequest, num_hit_tokens: int, max_length: int
    ) -> tuple[BlockHash, ...]:
        """The block hashes right after a pool hit of ``num_hit_tokens`` that the tier holds
        in every KV cache group (a run: it stops at the first block some group lacks), within
        ``max_length`` tokens. Looks only: nothing changes."""
        block_size = self.block_size
        hashes = request.block_hashes
        end = min(max_length // block_size, len(hashes))
        entries = self.offloader
        num_groups = self.num_kv_cache_groups
        i = num_hit_tokens // block_size
        start = i
        while i < end:
            block_hash = hashes[i]
            if any(tier_key(g, block_hash) not in entries for g in range(num_groups)):
                break
            i += 1
        return tuple(hashes[start:i])

    def _page_out(self, block: KVCacheBlock) -> None:
        """The pool's evict hook: page a cached block out to the tier (once per key)."""
        group = block.cache_group_id
        self.offloader.store(group, tier_key(group, block.block_hash), block.block_id)

    def take_tier_ops(self) -> KVTierOps | None:
        """The KV tier's instructions since the last call (stores of blocks the pool evicted,
        loads of tier hits, drops), or ``None`` (none, or no tier). Take them once per step,
        after the step's ``allocate_slots`` calls, and send them with the step: the workers
        copy the stored blocks out before the step's KV writes and load before its forward."""
        if self.offloader is None:
            return None
        return self.offloader.take_ops()

    def discard_tier_entries(self, keys: Iterable[str], failed_load: bool = True) -> None:
        """Forget tier entries whose load failed (their request recomputes) or whose store
        the workers dropped (``failed_load=False``); no-op without a tier."""
        if self.offloader is not None:
            self.offloader.discard(keys, failed_load)

    def finish_tier_loads(self, request_id: str) -> None:
        """The workers reported ``request_id``'s tier loads done (good or failed): the entries
        they read may be evicted again. No-op without a tier or loads."""
        if self.offloader is not None:
            self.offloader.finish_loads(request_id)

    def swap_out(self, request: KVCacheRequest) -> int:
        """Page ``request``'s cached full blocks out to the KV tier now (preemption by swap:
        its resumption then finds them in the pool or the tier); keys the tier holds are only
        refreshed. Call it before :meth:`free`.

        Returns:
            Blocks newly stored (0 without a tier).
        """
        offloader = self.offloader
        if offloader is None:
            return 0
        num_stored = 0
        for blocks in self.coordinator.get_blocks(request.request_id):
            for block in blocks:
                if block.block_hash is not None:
                    group = block.cache_group_id
                    key = tier_key(group, block.block_hash)
                    num_stored += offloader.store(group, key, block.block_id)
        return num_stored

    def page_out_cached(self) -> int:
        """Page every block the prefix cache holds out to the KV tier (keys it holds are only
        refreshed): before a persistent tier's process ends, so a restart finds them too.

        Returns:
            Blocks newly stored (0 without a tier; stores beyond its free room are skipped
            once every entry is one of this call's).
        """
        offloader = self.offloader
        if offloader is None:
            return 0
        num_stored = 0
        for group, cached in enumerate(self.block_pool.cached_block_hash_to_block):
            for block_hash, block in cached.items():
                num_stored += offloader.store(group, tier_key(group, block_hash), block.block_id)
        return num_stored

    def _check_tier_hit(
        self,
        request: KVCacheRequest,
        new_computed_blocks: KVCacheBlocks,
        num_new_computed_tokens: int,
    ) -> None:
        """The checks of ``allocate_slots`` on a hit with tier blocks."""
        tier_hashes = new_computed_blocks.tier_hashes
        if self.offloader is None:
            raise InvalidRequestError("tier hit blocks given to a manager without a KV tier")
        num_pool = len(new_computed_blocks.blocks[0]) if new_computed_blocks.blocks else 0
        num_hit = num_pool + len(tier_hashes)
        if num_new_computed_tokens != num_hit * self.block_size:
            raise InvalidRequestError(
                f"num_new_computed_tokens={num_new_computed_tokens} != {num_hit} hit blocks "
                f"x block_size {self.block_size}"
            )
        if tuple(request.block_hashes[num_pool:num_hit]) != tuple(tier_hashes):
            raise InvalidRequestError(
                f"the tier hit of request {request.request_id!r} is not its own; use this "
                "request's get_computed_blocks result"
            )
        if any(self.coordinator.get_blocks(request.request_id)):
            raise CacheStateError(
                f"request {request.request_id!r} already holds blocks; prefix hits are for new "
                "requests"
            )
        for g in range(self.num_kv_cache_groups):
            for block_hash in tier_hashes:
                if tier_key(g, block_hash) not in self.offloader:
                    raise CacheStateError(
                        f"a tier hit of request {request.request_id!r} left the tier after "
                        "get_computed_blocks; look the hits up again"
                    )

    def _tier_events(self) -> list[KVCacheEvent]:
        """The tier's stores and drops since the last call, as KV cache events."""
        offloader = self.offloader
        stored, dropped = offloader.take_event_keys()
        events: list[KVCacheEvent] = []
        medium = offloader.medium
        for keys, removed in ((stored, False), (dropped, True)):
            for key in keys:
                group, _, hex_hash = key.partition("-")
                block_hash = BlockHash(bytes.fromhex(hex_hash))
                events.append(
                    BlockRemoved((block_hash,), int(group), medium)
                    if removed
                    else BlockStored(
                        (block_hash,),
                        None,
                        (),
                        self.block_size,
                        kv_cache_group_id=int(group),
                        medium=medium,
                    )
                )
        return events


def _features_before(request: KVCacheRequest, num_tokens: int) -> list[tuple[str, int, int]]:
    """The request's multimodal inputs that start within its first ``num_tokens`` tokens."""
    return [tuple(feature) for feature in request.mm_features if feature[1] < num_tokens]


__all__ = ["KVCacheBlock", "KVCacheBlocks", "KVCacheManager"]
