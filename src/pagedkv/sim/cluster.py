"""Several replicas, each with its own KV pool, behind a router: what prefix-aware routing gains
over round robin, on a trace, without the machines.

Each replica is the real :class:`~pagedkv.core.manager.KVCacheManager` (prefix caching on, KV
events on) under the engine's :class:`~pagedkv.engine.scheduler.Scheduler`, with the simulator's
zero-cost model (one step = ``config.step_time``; a step computes at most
``max_num_batched_tokens`` tokens per replica, so a prefix miss costs steps). All replicas step in
lock step. A request is routed when it arrives:

- ``round_robin``: replica ``i mod N`` for the i-th arrival;
- ``prefix``: the cluster router's decision (:func:`~pagedkv.cluster.prefix_index.rank_replicas`
  over a :class:`~pagedkv.cluster.prefix_index.PrefixIndex` fed by every replica's events after
  each step, plus the hashes of requests just routed, for ``routed_ttl_s``); queue length =
  running + waiting requests.

Same caveats as the single-replica simulator (no model cost beyond the token budget, no network),
plus: events reach the router with no delay, and replicas never fail.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pagedkv.cluster.prefix_index import PrefixIndex, rank_replicas
from pagedkv.core.manager import KVCacheManager
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.sim.arrivals import ArrivalClock, to_steps
from pagedkv.sim.simulator import SimConfig, _EngineDriver
from pagedkv.sim.workloads import Workload

ROUTERS = ("prefix", "round_robin")
_HASH_SEED = "pagedkv-sim-cluster"


@dataclass(slots=True)
class ClusterMetrics:
    """One router on one trace.

    Attributes:
        router: "prefix" or "round_robin".
        num_replicas: replicas, each with ``num_blocks`` blocks.
        num_requests / num_rejected: requests in the trace / refused (never fit).
        prefix_hit_rate: prompt tokens served from a replica's prefix cache / prompt tokens
            looked up, over all replicas.
        num_prompt_tokens / num_computed_prompt_tokens: prompt tokens looked up / not served
            from a cache (the prefill work done).
        num_steps: steps until the last request finished (the makespan).
        mean_latency_s / p90_latency_s: arrival to finish, simulated seconds.
        num_preemptions: over all replicas.
        max_replica_share: most requests one replica got / mean per replica (1.0 = even).
        wall_time_s: real seconds the simulation took.
    """

    router: str
    num_replicas: int
    num_requests: int
    num_rejected: int
    prefix_hit_rate: float
    num_prompt_tokens: int
    num_computed_prompt_tokens: int
    num_steps: int
    mean_latency_s: float
    p90_latency_s: float
    num_preemptions: int
    max_replica_share: float
    wall_time_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def simulate_cluster(
    workload: Workload,
    config: SimConfig,
    *,
    num_replicas: int,
    router: str = "prefix",
    max_imbalance: int = 8,
    min_match_fraction: float = 0.1,
    routed_ttl_s: float = 10.0,
    on_finish: Callable[[int], None] | None = None,
) -> ClusterMetrics:
    """Replay ``workload`` over ``num_replicas`` replicas of ``config`` (each its own pool).

    Args:
        workload: the trace.
        config: one replica's pool and scheduler (its admission policy too).
        num_replicas: replicas (>= 1).
        router: one of :data:`ROUTERS`.
        max_imbalance / min_match_fraction: see :func:`rank_replicas`.
        routed_ttl_s: how long a routed prompt's hashes count before its replica's events.
        on_finish: called with the number of requests finished after each step that finished
            some (a progress bar).

    Raises:
        ConfigError: a bad router or replica count; a request with n > 1 samples; a trace that
            stalls.
    """
    if router not in ROUTERS:
        raise ConfigError(f"router must be one of {ROUTERS}, got {router!r}")
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ConfigError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if any(r.n > 1 for r in workload.requests):
        raise ConfigError(
            "requests with n > 1 samples are simulated on one pool (--policies), not over "
            "replicas; drop --n (or the trace's n)"
        )
    started = time.perf_counter()
    kwargs = {} if config.hash_algo is None else {"hash_algo": config.hash_algo}
    managers = [
        KVCacheManager(
            config.num_blocks,
            block_size=config.block_size,
            enable_caching=True,
            hash_seed=_HASH_SEED,
            enable_kv_cache_events=True,
            max_model_len=config.max_model_len,
            **kwargs,
        )
        for _ in range(num_replicas)
    ]
    drivers = [_EngineDriver(m, config) for m in managers]
    hasher = managers[0].block_hasher
    index = PrefixIndex()
    for key in range(num_replicas):
        index.add_replica(key)
    ttl_steps = to_steps(routed_ttl_s, config.step_time)
    last_routed: dict[int, int] = {}
    requests = workload.requests
    clock = ArrivalClock(requests, config.step_time)
    arrival_step: dict[int, int] = {}
    latencies: list[int] = []
    per_replica = [0] * num_replicas
    num_rejected = 0
    num_arrived = 0
    step = 0

    def busy() -> bool:
        return any(d.running or d.num_waiting for d in drivers)

    while clock or busy():
        step = clock.skip_idle(step, busy=busy())
        for i in clock.due(step):
            sim_request = requests[i]
            request = drivers[0].make_request(
                sim_request.request_id,
                sim_request.prompt_token_ids,
                hasher,
                i,
                sim_request.output_token_ids,
            )
            if router == "round_robin":
                key = num_arrived % num_replicas
            else:
                hashes = request.block_hashes
                matched = index.match(hashes, range(num_replicas), now=step)
                queue = {k: len(d.running) + d.num_waiting for k, d in enumerate(drivers)}
                key = rank_replicas(
                    list(range(num_replicas)),
                    matched,
                    queue,
                    num_prompt_blocks=len(hashes),
                    max_imbalance=max_imbalance,
                    min_match_fraction=min_match_fraction,
                    last_routed=last_routed,
                )[0][0]
                if ttl_steps:
                    index.note_routed(key, hashes, expires_at=step + ttl_steps)
            num_arrived += 1
            last_routed[key] = num_arrived
            try:
                drivers[key].add(request)
            except InvalidRequestError:
                num_rejected += 1
                clock.finished(i, step)
                continue
            per_replica[key] += 1
            arrival_step[i] = step
        num_finished = 0
        num_scheduled = 0
        for key, driver in enumerate(drivers):
            scheduled, _ = driver.schedule()
            num_scheduled += len(scheduled)
            finished = driver.complete(scheduled) if scheduled else []
            index.apply(key, managers[key].take_events())
            for request in finished:
                latencies.append(step + 1 - arrival_step.pop(request.index))
                clock.finished(request.index, step)
            num_finished += len(finished)
        if num_finished and on_finish:
            on_finish(num_finished)
        if ttl_steps and step % ttl_steps == 0:
            index.expire(step)
        step += 1
        clock.check_stalled(
            num_scheduled,
            sum(len(d.running) for d in drivers),
            sum(d.num_waiting for d in drivers),
        )

    hits = sum(d.num_hit_tokens for d in drivers)
    queried = sum(d.num_queried_tokens for d in drivers)
    ordered = sorted(latencies)
    mean_share = sum(per_replica) / num_replicas
    return ClusterMetrics(
        router=router,
        num_replicas=num_replicas,
        num_requests=len(requests),
        num_rejected=num_rejected,
        prefix_hit_rate=hits / queried if queried else 0.0,
        num_prompt_tokens=queried,
        num_computed_prompt_tokens=queried - hits,
        num_steps=step,
        mean_latency_s=(sum(ordered) / len(ordered) * config.step_time) if ordered else 0.0,
        p90_latency_s=(ordered[int(0.9 * (len(ordered) - 1))] * config.step_time)
        if ordered
        else 0.0,
        num_preemptions=sum(d.num_preemptions for d in drivers),
        max_replica_share=max(per_replica) / mean_share if mean_share else 0.0,
        wall_time_s=time.perf_counter() - started,
    )
