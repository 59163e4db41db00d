"""Replay a trace through a KV cache and a scheduler with a model that costs nothing.

One policy per run, on the same usable pool (``num_blocks - 1`` blocks of ``block_size`` tokens;
block 0 is the paged pools' null block):

- ``contiguous``: each request reserves max_model_len tokens for its whole life
  (:class:`~pagedkv.sim.contiguous.ContiguousKVCache`);
- ``paged``: the real :class:`~pagedkv.core.manager.KVCacheManager`, prefix caching off;
- ``paged+prefix``: the same with prefix caching on;
- ``paged+prefix+tier``: the same with a KV tier below the pool
  (``SimConfig.kv_offloading_blocks`` > 0, :mod:`pagedkv.core.offload`): cached blocks the pool
  evicts page out by block hash and a later prefix hit loads them back instead of recomputing.

The tier's capacity is the manager's own (LRU over block hashes); its bandwidth
(``SimConfig.kv_offloading_bandwidth``, bytes/s) prices every load at ``kv_bytes_per_block /
bandwidth`` seconds. Loads run inside the step (as in the engine: the batch waits), so a step
that loads lasts ``step_time`` plus its loads; the schedule itself (and so every hit) is counted
in steps and does not depend on the bandwidth: the bandwidth moves ``time_s`` and
``tier_load_time_s`` only. ``SimConfig.time_per_token`` (seconds per token computed, 0 by
default) adds the compute a step does to its time, the price of the recompute a hit saves.

The paged policies hold one full-attention KV cache group unless ``SimConfig.kv_cache_specs``
names the model's groups (``pagedkv simulate --model gemma3-270m``: five sliding-window groups
that give blocks back as requests grow past the window, and one full-attention group); then a
block id covers one page of ``group_size`` layers in whichever group holds it, and ``contiguous``
(one full-attention reservation) does not apply.

The step loop (the "engine"): add the requests that have arrived, ``schedule()``, record the step,
then let the fake model emit each sampling request's next scripted token. Scheduling is the engine's
own :class:`~pagedkv.engine.scheduler.Scheduler` (its ``admission`` option gives "skip"), so
preemption and admission exist once; the contiguous baseline plugs in as its KV cache.

Samples (``n > 1``, :attr:`SimRequest.n <pagedkv.sim.workloads.SimRequest.n>`): as
:meth:`LLMEngine.add_request <pagedkv.engine.llm_engine.LLMEngine.add_request>` does, a trace
request becomes ``n`` engine requests (``ID#0`` .. ``ID#n-1``), the first one (the parent)
carrying the others in ``fork_children`` with ``fork_at = prompt_len - 1``; the scheduler forks
them once the parent computed that much (:mod:`pagedkv.engine.sample_forks`: shared blocks,
copy-on-write of the shared partial block). ``simulate(..., fork=False)`` adds the ``n`` samples
as independent requests instead: the path before fork, the baseline of
:func:`simulate_fork_baselines`. The contiguous policy never forks (its regions are not
shared). Concurrency counts sequences (each sample is a request of the engine); a trace request
is done when its last sample finished.

Clock: one step = ``step_time`` seconds of simulated time; arrival times (seconds) map to steps, and
when nothing runs or waits the clock jumps to the next arrival. A follow-up turn becomes eligible
once its parent finished, plus its think time (:class:`~pagedkv.sim.arrivals.ArrivalClock`,
shared with the cluster simulator). A request is refused by the scheduler's own admission rules
(``Scheduler.add_request``), not a copy of them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pagedkv.core.kv_view import snapshot_kv_cache
from pagedkv.core.manager import KVCacheManager
from pagedkv.core.offload import TierStore
from pagedkv.core.spec import KVCacheSpec, cdiv
from pagedkv.engine.request import RequestStatus
from pagedkv.engine.request_limits import ADMISSION_POLICIES
from pagedkv.engine.sample_forks import fork_samples, sample_ids
from pagedkv.engine.scheduler import Scheduler
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.sim.arrivals import ArrivalClock
from pagedkv.sim.blockmap import BlockMap, BlockMapRecorder
from pagedkv.sim.contiguous import ContiguousKVCache
from pagedkv.sim.engine_request import make_engine_request
from pagedkv.sim.metrics import PolicyMetrics, Timeline, compute_metrics
from pagedkv.sim.preemption import PreemptionRecorder, PreemptionStats
from pagedkv.sim.workloads import Workload
from pagedkv.units import format_bytes
from pagedkv.validation import check_int, is_number
from pagedkv.worker.outputs import ModelRunnerOutput

POLICIES = ("contiguous", "paged", "paged+prefix", "paged+prefix+tier")
#: Policies with prefix caching (their requests hash their blocks).
CACHING_POLICIES = ("paged+prefix", "paged+prefix+tier")
#: Default tier bandwidth per backend, bytes/s: host RAM over PCIe (a pinned copy, about half
#: of PCIe 4.0 x16's 32 GB/s) and a local NVMe SSD's sequential read.
DEFAULT_KV_OFFLOADING_BANDWIDTH = {"cpu": 16e9, "disk": 2e9}


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """Settings of one simulation.

    Args:
        num_blocks: blocks in the pool (block 0 is the null block for the paged policies).
        block_size: tokens per block.
        max_model_len: most tokens (prompt + output) per request; contiguous reserves this much.
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget per step.
        admission: "fcfs" (stop at the first waiting request that does not fit) or "skip"
            (try later ones); the Scheduler's ``admission``.
        step_time: simulated seconds per step (maps arrival times to steps).
        time_per_token: simulated seconds per token computed (prompt or decode), added to the
            step's time (0 = the zero-cost model: a step lasts ``step_time``); prices the
            recompute a hit saves against the tier's loads. It never moves the schedule.
        block_map_columns: most sampled steps kept for the block map (0 = no block map).
        hash_algo: the manager's block-hash algorithm (None = its default).
        kv_cache_specs: one spec per KV cache group of the paged policies, all with
            ``block_size`` (``KVCacheConfig.kv_cache_specs``); None = one full-attention group.
        kv_offloading_blocks: blocks of the KV tier below the pool of the ``paged+prefix+tier``
            policy (cached blocks the pool evicts page out there by block hash and come back
            on a hit; :mod:`pagedkv.core.offload`); 0 = none (that policy then refuses to run).
        kv_offloading_bandwidth: the tier's load bandwidth, bytes/s (> 0); default host RAM's
            (:data:`DEFAULT_KV_OFFLOADING_BANDWIDTH`).
        kv_bytes_per_block: bytes of one block (every layer of its KV cache group:
            ``KVCacheConfig.bytes_per_block``); prices the tier's loads (0 = loads cost no
            time and no bytes are counted).

    Raises:
        ConfigError: a value out of range or an unknown name, or specs of another block size.
    """

    num_blocks: int
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    admission: str = "fcfs"
    step_time: float = 0.025
    time_per_token: float = 0.0
    block_map_columns: int = 300
    hash_algo: str | None = None
    kv_cache_specs: tuple[KVCacheSpec, ...] | None = None
    kv_offloading_blocks: int = 0
    kv_offloading_bandwidth: float = DEFAULT_KV_OFFLOADING_BANDWIDTH["cpu"]
    kv_bytes_per_block: int = 0

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, 2, why="block 0 is the null block")
        check_int("kv_offloading_blocks", self.kv_offloading_blocks, 0)
        check_int("kv_bytes_per_block", self.kv_bytes_per_block, 0)
        bandwidth = self.kv_offloading_bandwidth
        if not is_number(bandwidth) or not 0 < bandwidth < math.inf:
            raise ConfigError(
                f"kv_offloading_bandwidth must be a number > 0 (bytes/s), got {bandwidth!r}"
            )
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            check_int(name, getattr(self, name), 1)
        if self.admission not in ADMISSION_POLICIES:
            raise ConfigError(
                f"admission must be one of {ADMISSION_POLICIES}, got {self.admission!r}"
            )
        if not is_number(self.step_time) or not self.step_time > 0:
            raise ConfigError(f"step_time must be a number > 0 (seconds), got {self.step_time!r}")
        if not is_number(self.time_per_token) or not 0 <= self.time_per_token < math.inf:
            raise ConfigError(
                f"time_per_token must be a number >= 0 (seconds), got {self.time_per_token!r}"
            )
        check_int("block_map_columns", self.block_map_columns, 0)
        if self.kv_cache_specs is not None:
            if not self.kv_cache_specs:
                raise ConfigError("kv_cache_specs needs one spec per KV cache group, got none")
            sizes = {spec.block_size for spec in self.kv_cache_specs}
            if sizes != {self.block_size}:
                raise ConfigError(
                    f"kv_cache_specs have block sizes {sorted(sizes)}, the config {self.block_size}"
                )

    @property
    def num_kv_cache_groups(self) -> int:
        """Block tables per request in the paged policies."""
        return 1 if self.kv_cache_specs is None else len(self.kv_cache_specs)


@dataclass(slots=True)
class PolicyResult:
    """What one policy did on one trace: summary metrics, per-step timeline, block map, and
    what its preemptions freed (the paged policies)."""

    policy: str
    config: SimConfig
    metrics: PolicyMetrics
    timeline: Timeline
    block_map: BlockMap | None = None
    rejected: list[str] = field(default_factory=list)
    preemptions: PreemptionStats | None = None
    #: KV cache snapshots (:func:`pagedkv.core.kv_view.snapshot_kv_cache`) of steps spread over
    #: the run, for the /kv page's replay; empty unless ``simulate(kv_snapshots=...)`` asked.
    kv_snapshots: list[dict] = field(default_factory=list)


def make_kv_cache(policy: str, config: SimConfig):
    """The KV cache of ``policy``: a ContiguousKVCache or a KVCacheManager.

    Raises:
        ConfigError: unknown policy (or a pool the cache refuses).
    """
    if policy == "contiguous":
        if config.num_kv_cache_groups > 1:
            raise ConfigError(
                "the contiguous policy reserves one full-attention region per request; a model "
                f"with {config.num_kv_cache_groups} KV cache groups runs the paged policies only "
                "(compare with every layer as full attention instead)"
            )
        return ContiguousKVCache(config.num_blocks, config.block_size, config.max_model_len)
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    tier = policy == "paged+prefix+tier"
    if tier and not config.kv_offloading_blocks:
        raise ConfigError("the paged+prefix+tier policy needs kv_offloading_blocks > 0")
    kwargs = {} if config.hash_algo is None else {"hash_algo": config.hash_algo}
    if config.kv_cache_specs is not None:  # the specs carry their block size
        kwargs["kv_cache_specs"] = list(config.kv_cache_specs)
    else:
        kwargs["block_size"] = config.block_size
    return KVCacheManager(
        config.num_blocks,
        enable_caching=policy in CACHING_POLICIES,
        max_model_len=config.max_model_len,
        kv_offloading_blocks=config.kv_offloading_blocks if tier else 0,
        **kwargs,
    )


class _EngineDriver:
    """Drives the engine's Scheduler; the scripted stream is the sampled tokens.

    Also counts, per first admission of a request that hashes its blocks (prefix caching on):
    the prompt tokens the KV tier gave (its loads in that step), and the prompt tokens computed
    in full blocks whose KV an earlier step had computed already (recomputed: the pool forgot
    them); and every tier load and store (resumptions' loads included)."""

    def __init__(self, kv_cache, config: SimConfig) -> None:
        self.scheduler = Scheduler(
            kv_cache,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            admission=config.admission,
        )
        self._out = None
        self._block_size = config.block_size
        self._counted: set[str] = set()  # ids whose first admission was counted (or forked)
        self._seen: set = set()  # block hashes computed in an earlier step
        self._pending: list = []  # block hashes computed in this step
        self.num_tier_hit_tokens = 0
        self.num_recomputed_tokens = 0
        self.num_tier_loaded_blocks = 0
        self.num_tier_stored_blocks = 0
        #: tier blocks loaded by the last schedule() (every KV cache group's).
        self.step_loaded_blocks = 0
        #: what each preemption freed (the paged policies; contiguous never preempts).
        self.preemptions = None if isinstance(kv_cache, ContiguousKVCache) else PreemptionRecorder()

    def make_request(self, request_id, prompt, block_hasher, index, scripted):
        return make_engine_request(request_id, prompt, block_hasher, index, scripted)

    def add(self, request) -> None:
        # Forked samples share their parent's prompt: the parent's admission counts it.
        self._counted.update(child.request_id for child in request.fork_children or ())
        self.scheduler.add_request(request)

    def abort(self, requests: list) -> None:
        """Take back requests added before one of their siblings was refused."""
        self.scheduler.finish_requests(
            [r.request_id for r in requests], RequestStatus.FINISHED_ABORTED
        )

    @property
    def num_forks(self) -> int:
        return self.scheduler.stats.num_forks

    @property
    def num_cow_copies(self) -> int:
        return self.scheduler.stats.num_cow_copies

    @property
    def running(self) -> list:
        return self.scheduler.get_running_requests()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.stats.num_preemptions

    @property
    def num_hit_tokens(self) -> int:
        return self.scheduler.stats.prefix_cache_hits

    @property
    def num_queried_tokens(self) -> int:
        return self.scheduler.stats.prefix_cache_queries

    @property
    def num_prompt_tokens(self) -> int:
        return self.scheduler.stats.num_prompt_tokens

    def schedule(self) -> tuple[list, list[int]]:
        if self.preemptions is not None:
            self.preemptions.before_schedule(self.scheduler.kv_cache_manager, self.running)
        self._out = out = self.scheduler.schedule()
        if self.preemptions is not None:
            self.preemptions.after_schedule(self.running, out.preempted_req_ids)
        scheduled = list(self.scheduler.scheduled_requests)
        ops = out.kv_tier_ops
        loads: dict[str, int] = {}
        self.step_loaded_blocks = 0
        if ops is not None:
            for load in ops.loads:
                if load.group == 0:
                    loads[load.req_id] = loads.get(load.req_id, 0) + 1
            self.step_loaded_blocks = len(ops.loads)
            self.num_tier_loaded_blocks += len(ops.loads)
            self.num_tier_stored_blocks += sum(isinstance(w, TierStore) for w in ops.writes)
        block_size = self._block_size
        for request in scheduled:
            if request.request_id in self._counted:
                continue
            self._counted.add(request.request_id)
            if request.block_hasher is None or request.skip_reading_prefix_cache:
                continue
            self.num_tier_hit_tokens += loads.get(request.request_id, 0) * block_size
            hashes = request.block_hashes
            end = request.num_prompt_tokens // block_size
            seen = self._seen
            self.num_recomputed_tokens += block_size * sum(
                1 for h in hashes[request.num_cached_tokens // block_size : end] if h in seen
            )
            self._pending.extend(hashes[:end])
        return scheduled, list(out.num_scheduled_tokens.values())

    def kv_snapshot(self, kv_cache) -> dict:
        """The KV cache and the block tables now, as the /kv page draws them."""
        scheduler = self.scheduler
        requests = scheduler.request_states()
        stats = dataclasses.asdict(scheduler.get_stats())
        stats["prefix_cache_hit_rate"] = scheduler.stats.prefix_cache_hit_rate
        out = self._out
        return snapshot_kv_cache(
            kv_cache,
            requests,
            num_scheduled_tokens=out.num_scheduled_tokens,
            blocks_to_copy=out.blocks_to_copy,
            stats=stats,
        )

    def complete(self, scheduled: list) -> list:
        # In scheduling order, the requests whose step completed every known token sample.
        sampling = [r for r in scheduled if r.num_computed_tokens >= r.num_tokens]
        sampled = ModelRunnerOutput(
            req_ids=[r.request_id for r in sampling],
            sampled_token_ids=[r.scripted_output[r.num_output_tokens] for r in sampling],
        )
        changed = self.scheduler.update_from_output(self._out, sampled)
        finished = [r for r in changed if r.is_finished]
        self._seen.update(self._pending)
        self._pending.clear()
        for request in finished:
            self._seen.update(request.block_hashes)
        return finished


def _reserved_tokens(kv_cache, block_size: int) -> int:
    """Tokens' worth of KV reserved now (blocks with ref_cnt > 0, or contiguous regions)."""
    if isinstance(kv_cache, ContiguousKVCache):
        return kv_cache.num_reserved_tokens
    return (kv_cache.num_blocks - 1 - kv_cache.num_free_blocks) * block_size


def _distinct_tail_tokens(kv_cache, running: list, block_size: int) -> int:
    """Empty slots of the running requests' last blocks, each physical block counted once.

    After a fork the parent and its samples share the partially filled block at ``fork_at``
    until each writes into it (copy-on-write): summing every request's tail would count that
    block's empty slots once per holder. Keyed by the last block of the first KV cache group
    (the groups of one request fill alike)."""
    tails: dict[int, int] = {}
    for request in running:
        num_computed = request.num_computed_tokens
        tail = cdiv(num_computed, block_size) * block_size - num_computed
        if tail:
            blocks = kv_cache.get_blocks(request.request_id).blocks[0]
            tails[blocks[cdiv(num_computed, block_size) - 1].block_id] = tail
    return sum(tails.values())


def _samples(driver: _EngineDriver, sim_request, block_hasher, index: int, fork: bool) -> list:
    """The engine requests of one trace request: one, or n samples; with ``fork`` the first
    carries the others in ``fork_children``
    (:func:`~pagedkv.engine.sample_forks.fork_samples`, as LLMEngine.add_request does)."""
    n = sim_request.n
    prompt = sim_request.prompt_token_ids
    samples = [
        driver.make_request(seq_id, prompt, block_hasher, index, sim_request.output_of(i))
        for i, seq_id in enumerate(sample_ids(sim_request.request_id, n))
    ]
    return fork_samples(samples) if fork else samples


def simulate(
    workload: Workload,
    config: SimConfig,
    policy: str,
    *,
    fork: bool = True,
    on_finish: Callable[[int], None] | None = None,
    kv_snapshots: int = 0,
) -> PolicyResult:
    """Replay ``workload`` under ``policy``.

    Args:
        workload: the trace.
        config: pool and scheduler settings.
        policy: one of :data:`POLICIES`.
        fork: requests with ``n > 1`` prefill once and fork their samples (the engine's path);
            False: the ``n`` samples run as independent requests (the baseline). The contiguous
            policy never forks.
        on_finish: called with the number of trace requests that finished (all their samples)
            or were rejected after each step that finished some (a progress bar).
        kv_snapshots: keep up to about this many KV cache snapshots spread evenly over the run
            (every step at first; each time twice as many are kept, every other one is
            dropped and the stride doubles) in ``PolicyResult.kv_snapshots``, for the /kv
            page's replay; 0: none. Not for the contiguous policy (no block pool).

    Returns:
        The :class:`PolicyResult`.

    Raises:
        ConfigError: a bad config or policy.
    """
    started = time.perf_counter()
    kv_cache = make_kv_cache(policy, config)
    caching = policy in CACHING_POLICIES
    driver = _EngineDriver(kv_cache, config)
    block_hasher = kv_cache.block_hasher if caching else None
    block_size = config.block_size
    num_usable_blocks = config.num_blocks - 1
    requests = workload.requests
    fork = fork and policy != "contiguous"
    has_samples = any(r.n > 1 for r in requests)
    remaining: dict[int, int] = {}  # index -> samples not finished yet
    peak_blocks = 0
    clock = ArrivalClock(requests, config.step_time)
    timeline = Timeline()
    recorder = (
        BlockMapRecorder(config.num_blocks, config.block_map_columns, block_size=block_size)
        if config.block_map_columns
        else None
    )
    rejected: list[str] = []
    num_rejected_output_tokens = 0
    num_done = 0
    num_loaded_blocks = 0
    step = 0
    snapshots: list[dict] = []
    snapshot_stride = 1
    if policy == "contiguous":
        kv_snapshots = 0

    while clock or driver.running or driver.num_waiting:
        step = clock.skip_idle(step, busy=bool(driver.running or driver.num_waiting))
        num_rejected_now = 0
        for index in clock.due(step):
            sim_request = requests[index]
            added = []
            try:  # the scheduler's own admission rules (max_model_len, the pool's blocks)
                for request in _samples(driver, sim_request, block_hasher, index, fork):
                    driver.add(request)
                    added.append(request)
            except InvalidRequestError as exc:
                driver.abort(added)
                rejected.append(f"{sim_request.request_id}: {exc}")
                num_rejected_output_tokens += sim_request.n * sim_request.num_output_tokens
                num_rejected_now += 1
                clock.finished(index, step)
            else:
                remaining[index] = sim_request.n

        num_preempted_before = driver.num_preemptions
        scheduled, num_scheduled = driver.schedule()
        num_loaded_blocks += driver.step_loaded_blocks
        if not scheduled and not driver.running:
            if num_rejected_now and on_finish:
                on_finish(num_rejected_now)
            num_done += num_rejected_now
            clock.check_stalled(0, 0, driver.num_waiting)
            step += 1
            continue

        # Measure while this step's tokens are computed and before finished requests free.
        running = driver.running
        num_computed = [r.num_computed_tokens for r in running]
        real = sum(num_computed)
        reserved = _reserved_tokens(kv_cache, block_size)
        peak_blocks = max(peak_blocks, kv_cache.num_blocks - 1 - kv_cache.num_free_blocks)
        if policy != "contiguous":
            # Only a request's last block (in each group) is partly filled, and shared blocks are
            # full (but a forked partial block, until copy-on-write): so the reserved-but-empty
            # slots are each request's tail in every group, and real = reserved - tail waste.
            if has_samples and fork:
                tail = _distinct_tail_tokens(kv_cache, running, block_size)
            else:
                tail = sum(cdiv(n, block_size) * block_size - n for n in num_computed)
            real = reserved - tail * config.num_kv_cache_groups
        timeline.append(
            step=step,
            num_running=len(running),
            num_waiting=driver.num_waiting,
            num_reserved_tokens=reserved,
            num_real_tokens=real,
            num_scheduled_tokens=sum(num_scheduled),
            num_preemptions=driver.num_preemptions - num_preempted_before,
        )
        if recorder is not None:
            recorder.maybe_record(step, kv_cache, running)
        if kv_snapshots and step % snapshot_stride == 0:
            snapshots.append(driver.kv_snapshot(kv_cache))
            if len(snapshots) >= 2 * kv_snapshots:
                snapshots = snapshots[::2]
                snapshot_stride *= 2

        num_finished = 0
        for request in driver.complete(scheduled):
            remaining[request.index] -= 1
            if not remaining[request.index]:  # its last sample
                del remaining[request.index]
                clock.finished(request.index, step)
                num_finished += 1
        if num_finished or num_rejected_now:
            num_done += num_finished + num_rejected_now
            if on_finish:
                on_finish(num_finished + num_rejected_now)
        step += 1

    metrics = compute_metrics(
        timeline,
        policy=policy,
        num_requests=len(requests),
        num_sequences=sum(r.n for r in requests),
        num_rejected=len(rejected),
        num_output_tokens=sum(r.n * r.num_output_tokens for r in requests)
        - num_rejected_output_tokens,
        peak_blocks=peak_blocks,
        num_forks=driver.num_forks,
        num_cow_copies=driver.num_cow_copies,
        block_size=block_size,
        num_steps=step,
        num_preemptions=driver.num_preemptions,
        num_hit_tokens=driver.num_hit_tokens,
        num_queried_tokens=driver.num_queried_tokens,
        num_usable_tokens=num_usable_blocks * block_size,
        wall_time_s=time.perf_counter() - started,
        num_prompt_tokens=driver.num_prompt_tokens,
        num_tier_hit_tokens=driver.num_tier_hit_tokens,
        num_recomputed_tokens=driver.num_recomputed_tokens if caching else None,
        num_tier_loaded_blocks=num_loaded_blocks,
        num_tier_stored_blocks=driver.num_tier_stored_blocks,
        tier_loaded_bytes=num_loaded_blocks * config.kv_bytes_per_block,
        tier_load_time_s=num_loaded_blocks
        * config.kv_bytes_per_block
        / config.kv_offloading_bandwidth,
        step_time=config.step_time,
        time_per_token=config.time_per_token,
    )
    return PolicyResult(
        policy,
        config,
        metrics,
        timeline.freeze(),
        recorder.finish() if recorder else None,
        rejected,
        driver.preemptions.finish() if driver.preemptions is not None else None,
        snapshots,
    )


def config_lines(
    config: SimConfig, workload_name: str, num_requests: int, model: str | None = None
) -> list[str]:
    """The run's settings in words (stdout's first lines and the HTML page's): the pool, the
    scheduler, the model's KV cache groups (``model`` with ``config.kv_cache_specs``) and the KV
    tier (capacity, bandwidth)."""
    usable = config.num_blocks - 1
    lines = [
        f"workload {workload_name}: {num_requests} requests; pool {config.num_blocks} "
        f"blocks of {config.block_size} tokens ({usable} usable + the null block: "
        f"{usable * config.block_size} tokens for every policy), max_model_len "
        f"{config.max_model_len}, max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
        f"{config.max_num_batched_tokens}, admission {config.admission}"
        + (f", {config.time_per_token:g} s per token computed" if config.time_per_token else "")
    ]
    if config.kv_cache_specs is not None:
        windows = [getattr(spec, "sliding_window", None) for spec in config.kv_cache_specs]
        kinds: dict[str, int] = {}
        for window in windows:
            label = "full attention" if window is None else f"sliding window {window}"
            kinds[label] = kinds.get(label, 0) + 1
        parts = ", ".join(f"{count} {label}" for label, count in kinds.items())
        plural = "s" if len(windows) > 1 else ""
        lines.append(f"model {model}: {len(windows)} KV cache group{plural}: {parts}")
    if config.kv_offloading_blocks:
        size = ""
        if config.kv_bytes_per_block:
            size = f", {format_bytes(config.kv_offloading_blocks * config.kv_bytes_per_block)}"
        lines.append(
            f"KV tier below the paged+prefix+tier pool: {config.kv_offloading_blocks} blocks "
            f"({config.kv_offloading_blocks * config.block_size} tokens{size}), loads at "
            f"{config.kv_offloading_bandwidth / 1e9:g} GB/s"
            + (
                f" ({config.kv_bytes_per_block / config.kv_offloading_bandwidth * 1e6:.2f} us "
                "per block)"
                if config.kv_bytes_per_block
                else ""
            )
            + f"; a step lasts {config.step_time:g} s plus its loads"
        )
    return lines


def simulate_policies(
    workload: Workload,
    config: SimConfig,
    policies: tuple[str, ...] | None = None,
    *,
    on_finish: Callable[[int], None] | None = None,
) -> dict[str, PolicyResult]:
    """Run every policy on the same trace; results keyed by policy name. ``policies`` None:
    all of :data:`POLICIES`, less ``paged+prefix+tier`` without ``config.kv_offloading_blocks``."""
    if policies is None:
        policies = POLICIES if config.kv_offloading_blocks else POLICIES[:-1]
    return {p: simulate(workload, config, p, on_finish=on_finish) for p in policies}


def simulate_fork_baselines(
    workload: Workload,
    config: SimConfig,
    policies: tuple[str, ...] = ("paged", "paged+prefix"),
) -> dict[str, PolicyMetrics]:
    """The paged ``policies`` once more with every sample an independent request
    (``simulate(..., fork=False)``, no block map): what ``n > 1`` costs without fork. Empty
    when no request of the trace has ``n > 1``; the contiguous policy is left out (it never
    forks). Returns {policy: metrics}."""
    if not any(r.n > 1 for r in workload.requests):
        return {}
    quiet = replace(config, block_map_columns=0)
    return {
        p: simulate(workload, quiet, p, fork=False).metrics for p in policies if p != "contiguous"
    }


def fork_saving_lines(
    results: dict[str, PolicyResult], baselines: dict[str, PolicyMetrics]
) -> list[str]:
    """One line per policy of ``baselines``: peak KV blocks with fork and without (each sample
    its own request), blocks per running sequence, steps to drain and preemptions of both.

    A peak that reached the usable pool says so: the pool, not the trace, set it (grow
    ``num_blocks`` to see the whole saving; blocks per sequence still compare)."""
    lines = []
    for policy, base in baselines.items():
        if policy not in results:
            continue
        result = results[policy]
        forked = result.metrics
        pool = result.config.num_blocks - 1
        saved = 1.0 - forked.peak_blocks / base.peak_blocks if base.peak_blocks else 0.0
        capped = [
            name for name, m in (("with fork", forked), ("without", base)) if m.peak_blocks >= pool
        ]
        note = f"; {' and '.join(capped)} at the pool's {pool} blocks" if capped else ""
        lines.append(
            f"fork under {policy}: peak {forked.peak_blocks} KV blocks with fork vs "
            f"{base.peak_blocks} without, each of the {forked.num_sequences} samples its own "
            f"request ({saved:.1%} fewer{note}); "
            f"{forked.mean_blocks_per_sequence:.1f} vs {base.mean_blocks_per_sequence:.1f} blocks "
            f"per running sequence; steps to drain {forked.num_steps} vs {base.num_steps}; "
            f"preemptions {forked.num_preemptions} vs {base.num_preemptions}"
        )
    return lines


def sweep_block_sizes(
    workload: Workload,
    config: SimConfig,
    block_sizes: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256),
    policies: tuple[str, ...] = ("paged", "paged+prefix"),
) -> dict[str, dict[int, PolicyMetrics]]:
    """Re-run ``policies`` with each block size on pools of the same bytes (no block map).

    The pool keeps ``config.num_blocks * config.block_size`` tokens: ``num_blocks`` becomes
    that divided by each block size. Returns {policy: {block_size: metrics}}.
    """
    total_tokens = config.num_blocks * config.block_size
    results: dict[str, dict[int, PolicyMetrics]] = {p: {} for p in policies}
    for block_size in block_sizes:
        num_blocks = total_tokens // block_size
        if num_blocks < 2:
            continue
        specs = config.kv_cache_specs
        if specs is not None:
            specs = tuple(replace(spec, block_size=block_size) for spec in specs)
        swept = SimConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            admission=config.admission,
            step_time=config.step_time,
            time_per_token=config.time_per_token,
            block_map_columns=0,
            hash_algo=config.hash_algo,
            kv_cache_specs=specs,
            # The tier keeps its bytes too: its tokens over the new block size.
            kv_offloading_blocks=config.kv_offloading_blocks * config.block_size // block_size,
            kv_offloading_bandwidth=config.kv_offloading_bandwidth,
            kv_bytes_per_block=config.kv_bytes_per_block * block_size // config.block_size,
        )
        for policy in policies:
            if policy == "paged+prefix+tier" and not swept.kv_offloading_blocks:
                continue
            results[policy][block_size] = simulate(workload, swept, policy).metrics
    return results


__all__ = [
    "CACHING_POLICIES",
    "DEFAULT_KV_OFFLOADING_BANDWIDTH",
    "POLICIES",
    "PolicyResult",
    "SimConfig",
    "config_lines",
    "fork_saving_lines",
    "make_kv_cache",
    "simulate",
    "simulate_fork_baselines",
    "simulate_policies",
    "sweep_block_sizes",
]
