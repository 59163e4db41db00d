"""Per-step timeline of a simulation and the summary metrics computed from it.

Definitions (all over the steps that computed something, "busy steps", unless said otherwise):

- concurrency: requests holding KV (running) in a step; ``peak_concurrency`` its maximum,
  ``mean_concurrency`` its mean.
- KV utilization: tokens whose KV is written / tokens' worth of KV reserved, summed over steps
  (a time-weighted ratio; bytes and tokens give the same ratio). Reserved = blocks with
  ref_cnt > 0 x block_size (paged; a shared block counts once) or max_model_len per running request
  (contiguous). Real = reserved minus the unfilled tail of each request's last block (paged) or the
  sum of computed tokens (contiguous).
- waste %: 100 x (1 - KV utilization): reserved KV holding no token (internal fragmentation).
- peak KV usage: the most tokens reserved in one step / the usable pool; ``peak_blocks`` the most
  blocks held in one step (ref_cnt > 0, a shared block once; contiguous: its regions' blocks).
- blocks per sequence: KV blocks reserved / sequences running, summed over steps (a
  time-weighted mean; a block shared by k sequences counts 1/k to each).
- sequences: engine requests, ``n`` per trace request (its samples); concurrency counts these.
- forks / copy-on-write copies: samples forked from their parent's blocks, and blocks copied
  because a sample wrote into a shared partially filled block (the scheduler's ``num_forks`` and
  ``num_cow_copies``).
- preemptions: requests evicted from running to make room (recompute on resume).
- prefix hit rate: prompt tokens served from the prefix cache / prompt tokens looked up, at each
  request's first admission.
- prompt tokens: prompt tokens of the requests admitted (each request once, at its first
  admission; a forked sample's prompt is its parent's). Of those, served from the pool's prefix
  cache (pool hits), loaded from the KV tier (tier hits), and computed (the rest); of the
  computed, recomputed: those in full blocks whose KV an earlier step had computed already (the
  pool had forgotten them: the work a big enough tier saves; counted with prefix caching only).
- tier loads / stores: blocks loaded from and stored to the KV tier (every KV cache group's;
  loads of preempted requests resuming included), the bytes loaded (x bytes per block), and the
  load time (bytes / the tier's bandwidth).
- time: steps to drain x step_time + tokens computed x time_per_token (0 unless set: the
  zero-cost model) + the tier's load time (loads run inside their step); compute time: the
  middle term.
- steps to drain: steps from 0 until the last request finished, idle steps included.
- tokens per step: tokens computed (prompt chunks and decode tokens, cache hits excluded) per busy
  step.
- output tokens per step: output tokens (every sample's) / steps to drain (the throughput proxy
  of the sweeps).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

_COLUMNS = (
    "step",
    "num_running",
    "num_waiting",
    "num_reserved_tokens",
    "num_real_tokens",
    "num_scheduled_tokens",
    "num_preemptions",
)


@dataclass(slots=True)
class Timeline:
    """One row per busy step; columns are lists while recording, int64 arrays after freeze()."""

    step: list | np.ndarray = field(default_factory=list)
    num_running: list | np.ndarray = field(default_factory=list)
    num_waiting: list | np.ndarray = field(default_factory=list)
    num_reserved_tokens: list | np.ndarray = field(default_factory=list)
    num_real_tokens: list | np.ndarray = field(default_factory=list)
    num_scheduled_tokens: list | np.ndarray = field(default_factory=list)
    #: preemptions in the step (victims the scheduler freed to make room).
    num_preemptions: list | np.ndarray = field(default_factory=list)

    def append(self, **row: int) -> None:
        for name in _COLUMNS:
            getattr(self, name).append(row[name])

    def freeze(self) -> Timeline:
        """The same columns as int64 numpy arrays."""
        return Timeline(
            **{name: np.asarray(getattr(self, name), dtype=np.int64) for name in _COLUMNS}
        )

    def __len__(self) -> int:
        return len(self.step)


@dataclass(frozen=True, slots=True)
class PolicyMetrics:
    """Summary of one policy on one trace (see the module docstring for definitions)."""

    policy: str
    num_requests: int
    num_rejected: int
    peak_concurrency: int
    mean_concurrency: float
    kv_utilization: float
    waste_pct: float
    peak_kv_usage: float
    num_preemptions: int
    prefix_hit_rate: float
    num_steps: int
    num_busy_steps: int
    tokens_per_step: float
    output_tokens_per_step: float
    num_scheduled_tokens: int
    wall_time_s: float
    num_sequences: int = 0
    peak_blocks: int = 0
    num_forks: int = 0
    num_cow_copies: int = 0
    mean_blocks_per_sequence: float = 0.0
    num_prompt_tokens: int = 0
    num_pool_hit_tokens: int = 0
    num_tier_hit_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_recomputed_tokens: int | None = None
    num_tier_loaded_blocks: int = 0
    num_tier_stored_blocks: int = 0
    tier_loaded_bytes: int = 0
    tier_load_time_s: float = 0.0
    compute_time_s: float = 0.0
    time_s: float = 0.0

    @property
    def pool_hit_rate(self) -> float:
        """Pool hits / prompt tokens looked up (0 when none)."""
        total = self.num_pool_hit_tokens + self.num_tier_hit_tokens
        total += self.num_computed_prompt_tokens
        return self.num_pool_hit_tokens / total if total else 0.0

    @property
    def tier_hit_rate(self) -> float:
        """Tier hits / prompt tokens looked up (0 when none)."""
        total = self.num_pool_hit_tokens + self.num_tier_hit_tokens
        total += self.num_computed_prompt_tokens
        return self.num_tier_hit_tokens / total if total else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def compute_metrics(
    timeline: Timeline,
    *,
    policy: str,
    num_requests: int,
    num_rejected: int,
    num_output_tokens: int,
    num_steps: int,
    num_preemptions: int,
    num_hit_tokens: int,
    num_queried_tokens: int,
    num_usable_tokens: int,
    wall_time_s: float,
    num_sequences: int | None = None,
    peak_blocks: int = 0,
    num_forks: int = 0,
    num_cow_copies: int = 0,
    block_size: int | None = None,
    num_prompt_tokens: int = 0,
    num_tier_hit_tokens: int = 0,
    num_recomputed_tokens: int | None = None,
    num_tier_loaded_blocks: int = 0,
    num_tier_stored_blocks: int = 0,
    tier_loaded_bytes: int = 0,
    tier_load_time_s: float = 0.0,
    step_time: float = 0.0,
    time_per_token: float = 0.0,
) -> PolicyMetrics:
    """Summarize a recorded timeline (lists or arrays) into :class:`PolicyMetrics`."""
    running = np.asarray(timeline.num_running, dtype=np.int64)
    reserved = np.asarray(timeline.num_reserved_tokens, dtype=np.int64)
    real = np.asarray(timeline.num_real_tokens, dtype=np.int64)
    scheduled = np.asarray(timeline.num_scheduled_tokens, dtype=np.int64)
    num_busy = len(running)
    total_reserved = int(reserved.sum())
    utilization = float(real.sum()) / total_reserved if total_reserved else 0.0
    return PolicyMetrics(
        policy=policy,
        num_requests=num_requests,
        num_rejected=num_rejected,
        peak_concurrency=int(running.max()) if num_busy else 0,
        mean_concurrency=float(running.mean()) if num_busy else 0.0,
        kv_utilization=utilization,
        waste_pct=100.0 * (1.0 - utilization) if total_reserved else 0.0,
        peak_kv_usage=float(reserved.max()) / num_usable_tokens if num_busy else 0.0,
        num_preemptions=num_preemptions,
        prefix_hit_rate=num_hit_tokens / num_queried_tokens if num_queried_tokens else 0.0,
        num_steps=num_steps,
        num_busy_steps=num_busy,
        tokens_per_step=float(scheduled.sum()) / num_busy if num_busy else 0.0,
        output_tokens_per_step=num_output_tokens / num_steps if num_steps else 0.0,
        num_scheduled_tokens=int(scheduled.sum()),
        wall_time_s=wall_time_s,
        num_sequences=num_requests if num_sequences is None else num_sequences,
        peak_blocks=peak_blocks,
        num_forks=num_forks,
        num_cow_copies=num_cow_copies,
        mean_blocks_per_sequence=total_reserved / block_size / int(running.sum())
        if block_size and num_busy and running.sum()
        else 0.0,
        num_prompt_tokens=num_prompt_tokens,
        num_pool_hit_tokens=num_hit_tokens - num_tier_hit_tokens,
        num_tier_hit_tokens=num_tier_hit_tokens,
        num_computed_prompt_tokens=num_prompt_tokens - num_hit_tokens,
        num_recomputed_tokens=num_recomputed_tokens,
        num_tier_loaded_blocks=num_tier_loaded_blocks,
        num_tier_stored_blocks=num_tier_stored_blocks,
        tier_loaded_bytes=tier_loaded_bytes,
        tier_load_time_s=tier_load_time_s,
        compute_time_s=float(scheduled.sum()) * time_per_token,
        time_s=num_steps * step_time + float(scheduled.sum()) * time_per_token + tier_load_time_s,
    )
