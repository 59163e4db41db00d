"""Counters of the scheduler and the engine, as plain snapshots (for the CLI summary, the server's
metrics and the simulator)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    """Speculative decoding's counters since start (vLLM's ``spec_decode_*`` metrics).

    Attributes:
        num_drafts: verification steps of a request with drafts.
        num_draft_tokens: draft tokens scheduled.
        num_accepted_tokens: draft tokens accepted.
        num_accepted_tokens_per_pos: per draft position, how many were accepted there.
        num_drafts_per_len: per draft length k (index k - 1), verification steps of a request
            with k drafts: with a per-k step cost, what the drafts cost (the benchmark's
            estimate, docs/engine.md "Speculative decoding: measured").
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_drafts_per_len: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """num_accepted_tokens / num_draft_tokens (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields on average: 1 + accepted drafts per draft (vLLM's
        "mean acceptance length"; 0 when nothing was drafted)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodingStats:
        """A snapshot (later steps do not change it)."""
        return SpecDecodingStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
            list(self.num_drafts_per_len),
        )


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot of the scheduler.

    Attributes:
        num_running: requests holding KV blocks now.
        num_waiting: requests queued (new or preempted).
        kv_cache_usage: fraction of usable blocks in use now, 0..1.
        num_used_blocks: KV blocks held by requests now (0 once every request has finished:
            the soak and fuzz tests check it; cached free blocks do not count).
        peak_kv_cache_usage: highest kv_cache_usage seen after any step.
        num_preemptions: preemptions since start.
        num_rejected: requests finished with an error because they can never fit.
        num_steps: schedule() calls that scheduled at least one token.
        prefix_cache_queries: prompt tokens looked up in the prefix cache, counted once per
            request at its first admission (not when a lookup is retried because the request
            did not fit, nor when a preempted request resumes); 0 with prefix caching off.
        prefix_cache_hits: of those, tokens served from the cache.
        num_prompt_tokens: prompt tokens of admitted requests (first admission only).
        num_generation_tokens: tokens sampled since start.
        num_forks: samples of ``n > 1`` requests forked from their parent (sharing its
            blocks) since start.
        num_cow_copies: copy-on-write block copies since start (a forked sample writing into
            a partially filled block it shared).
        num_shared_blocks: blocks held by more than one request now (forks and prefix hits).
        num_kv_tier_load_failures: requests sent back to recompute because a KV tier load
            failed (a missing, truncated or corrupt entry).
        num_kv_tier_loads: admissions that waited for KV tier loads (WAITING_FOR_REMOTE_KVS)
            before running.
        spec_decoding: speculative decoding's counters, or None when it is off.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    peak_kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_rejected: int = 0
    num_steps: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_forks: int = 0
    num_cow_copies: int = 0
    num_shared_blocks: int = 0
    num_kv_tier_load_failures: int = 0
    num_kv_tier_loads: int = 0
    spec_decoding: SpecDecodingStats | None = None

    def count_first_admission(self, request, num_computed_tokens: int) -> None:
        """The one definition of the prefix-cache counters (docs/engine.md): each request
        (an engine ``Request``) counts once, at its first admission (not a resumption), with
        its ``num_computed_tokens`` prefix-cache hit tokens, if it can hit at all."""
        if request.num_cached_tokens >= 0:
            return
        request.num_cached_tokens = num_computed_tokens
        if request.block_hasher is not None and not request.skip_reading_prefix_cache:
            self.prefix_cache_queries += request.num_prompt_tokens
            self.prefix_cache_hits += num_computed_tokens
        self.num_prompt_tokens += request.num_prompt_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        """prefix_cache_hits / prefix_cache_queries (0 when nothing was queried)."""
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


@dataclass(slots=True)
class KVTierStats:
    """A snapshot of the KV tier below the block pool (docs/core.md), since start.

    Attributes:
        medium: ``"CPU"`` or ``"DISK"``.
        num_blocks: capacity, blocks (each one pool block's bytes).
        num_used_blocks: entries held now.
        num_hit_blocks: tier hits: blocks the tier was asked to load back into the pool
            (counted when allocated; ``num_failed_loads`` of them failed and were recomputed).
        num_stored_blocks: blocks paged out to the tier.
        num_evicted_blocks: entries dropped by LRU.
        num_failed_loads: loads that found a missing, truncated or corrupt entry (recomputed).
        bytes_stored: bytes written to the tier.
        bytes_loaded: bytes read back from it.
        load_seconds: time the loads took (the reads, off the step for disk, and the copies
            into the pool).
        num_dropped_stores: stores dropped because the disk writer's queue was full.
    """

    medium: str
    num_blocks: int
    num_used_blocks: int = 0
    num_hit_blocks: int = 0
    num_stored_blocks: int = 0
    num_evicted_blocks: int = 0
    num_failed_loads: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    num_dropped_stores: int = 0
