"""The simulator on hand-checked traces and the 16-lengths example (4 / 13 / 14)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.errors import ConfigError
from pagedkv.sim.blockmap import CACHED_FREE, FREE, NULL_BLOCK
from pagedkv.sim.simulator import SimConfig, simulate, simulate_policies, sweep_block_sizes
from pagedkv.sim.workloads import SimRequest, Workload, make_workload

STEP = 0.025


def _tiny_config(**kwargs) -> SimConfig:
    settings = dict(
        num_blocks=20,
        block_size=4,
        max_model_len=32,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        step_time=STEP,
    )
    settings.update(kwargs)
    return SimConfig(**settings)


def _two_requests() -> Workload:
    # A: 6-token prompt, 3 outputs; B: 10-token prompt, 1 output; both at t=0.
    return Workload(
        "tiny",
        [
            SimRequest("A", list(range(1, 7)), [101, 102, 103]),
            SimRequest("B", list(range(11, 21)), [201]),
        ],
    )


def test_sixteen_lengths_fcfs():
    workload = make_workload("sixteen-lengths")
    config = SimConfig(**workload.defaults)
    results = simulate_policies(workload, config)
    assert results["contiguous"].metrics.peak_concurrency == 4
    assert results["paged"].metrics.peak_concurrency == 13
    assert results["paged+prefix"].metrics.peak_concurrency == 13
    for result in results.values():
        assert result.metrics.num_rejected == 0
        assert result.metrics.num_preemptions == 0


def test_sixteen_lengths_skip_admission():
    workload = make_workload("sixteen-lengths")
    config = SimConfig(**workload.defaults, admission="skip")
    results = simulate_policies(workload, config)
    assert results["contiguous"].metrics.peak_concurrency == 4
    assert results["paged"].metrics.peak_concurrency == 14
    assert results["paged+prefix"].metrics.peak_concurrency == 14


def test_unknown_admission_is_a_config_error():
    with pytest.raises(ConfigError, match="admission"):
        SimConfig(num_blocks=10, admission="lifo")


def test_paged_metrics_by_hand():
    # step 0: A computes 6 (2 blocks), B 10 (3 blocks): reserved 20 tokens, real 16; B finishes.
    # step 1: A computes its 7th token: reserved 8, real 7.  step 2: 8th: reserved 8, real 8.
    result = simulate(_two_requests(), _tiny_config(), "paged")
    t, m = result.timeline, result.metrics
    assert t.step.tolist() == [0, 1, 2]
    assert t.num_running.tolist() == [2, 1, 1]
    assert t.num_reserved_tokens.tolist() == [20, 8, 8]
    assert t.num_real_tokens.tolist() == [16, 7, 8]
    assert t.num_scheduled_tokens.tolist() == [16, 1, 1]
    assert m.peak_concurrency == 2
    assert m.mean_concurrency == pytest.approx(4 / 3)
    assert m.kv_utilization == pytest.approx(31 / 36)
    assert m.waste_pct == pytest.approx(100 * 5 / 36)
    assert m.num_steps == 3
    assert m.tokens_per_step == pytest.approx(6.0)
    assert m.output_tokens_per_step == pytest.approx(4 / 3)
    assert m.peak_kv_usage == pytest.approx(20 / (19 * 4))
    assert m.num_preemptions == 0
    assert m.prefix_hit_rate == 0.0


def test_contiguous_metrics_by_hand():
    # 19 usable blocks (block 0 is left out, as the paged pools' null block) x 4 = 76 tokens
    # -> 2 regions of 32 (12 tokens too few for a third); each running request reserves 32.
    result = simulate(_two_requests(), _tiny_config(), "contiguous")
    t, m = result.timeline, result.metrics
    assert t.num_reserved_tokens.tolist() == [64, 32, 32]
    assert t.num_real_tokens.tolist() == [16, 7, 8]
    assert m.kv_utilization == pytest.approx(31 / 128)
    assert m.peak_kv_usage == pytest.approx(64 / 76)  # the same usable pool as paged
    # Regions start after block 0; the unwritten part of each region is marked in the map.
    block_map = result.block_map
    assert (block_map.owners[0] < 0).all()
    a_blocks = block_map.owners[:, 0] == 0  # request A (index 0) at step 0
    assert np.flatnonzero(a_blocks).tolist() == list(range(1, 9))
    assert block_map.unused[:, 0][a_blocks].tolist() == [False, False] + [True] * 6


def test_shared_prefix_counts_shared_blocks_once():
    prefix = list(range(1, 9))  # two full blocks of 4
    workload = Workload(
        "shared",
        [
            SimRequest("D", [*prefix, 50], [1, 2, 3, 4, 5]),
            SimRequest("E", [*prefix, 60], [7], arrival_time=STEP),
        ],
    )
    cached = simulate(workload, _tiny_config(), "paged+prefix")
    t = cached.timeline
    # step 1: D holds 3 blocks (10 tokens), E shares D's 2 full blocks + 1 new block (9 tokens):
    # 4 physical blocks = 16 reserved; distinct real tokens = 8 shared + 2 + 1 = 11.
    assert t.num_reserved_tokens[1] == 16
    assert t.num_real_tokens[1] == 11
    assert t.num_scheduled_tokens[1] == 2  # D's decode token + E's one uncached token
    assert cached.metrics.prefix_hit_rate == pytest.approx(8 / 18)
    block_map = cached.block_map
    assert block_map is not None
    assert block_map.steps.tolist()[:2] == [0, 1]
    assert int(block_map.shared[:, 1].sum()) == 2
    assert int(block_map.shared[:, 2].sum()) == 0
    assert block_map.owners[0, 0] == NULL_BLOCK
    assert int((block_map.owners[:, 0] == 0).sum()) == 3  # D (trace index 0) owns 3 blocks

    plain = simulate(workload, _tiny_config(), "paged")
    assert plain.metrics.prefix_hit_rate == 0.0
    assert plain.timeline.num_reserved_tokens[1] == 24  # no sharing: 3 + 3 blocks
    assert plain.timeline.num_scheduled_tokens[1] == 10


def test_block_map_marks_cached_free_blocks():
    # B (10 tokens) finishes at step 0; from step 1 its 2 full blocks stay cached while free.
    workload = _two_requests()
    cached = simulate(workload, _tiny_config(), "paged+prefix").block_map
    plain = simulate(workload, _tiny_config(), "paged").block_map
    assert int((cached.owners[:, 1] == CACHED_FREE).sum()) == 2
    assert int((plain.owners[:, 1] == CACHED_FREE).sum()) == 0
    assert int((plain.owners[:, 1] == FREE).sum()) == 20 - 1 - 2


def test_preemption_under_a_small_pool():
    # 5 usable blocks of 4 tokens; two requests growing to 12 tokens each (3 blocks) cannot both
    # run to the end: the newer one is preempted and recomputed later.
    workload = Workload(
        "tight",
        [
            SimRequest("P", list(range(1, 5)), list(range(100, 108))),
            SimRequest("Q", list(range(11, 15)), list(range(200, 208))),
        ],
    )
    result = simulate(workload, _tiny_config(num_blocks=6), "paged")
    assert result.metrics.num_preemptions >= 1
    assert result.metrics.num_rejected == 0
    assert result.timeline.num_reserved_tokens.max() <= 5 * 4


def test_requests_that_never_fit_are_rejected():
    workload = Workload(
        "big",
        [
            SimRequest("ok", [1, 2, 3], [4]),
            SimRequest("too-long", list(range(1, 40)), [4]),  # > max_model_len 32
        ],
    )
    result = simulate(workload, _tiny_config(), "paged")
    assert result.metrics.num_rejected == 1
    assert result.rejected[0].startswith("too-long")


def test_multi_turn_follow_up_waits_for_its_parent_and_hits_the_cache():
    first = SimRequest("t0", list(range(1, 9)), [21, 22, 23, 24, 25])
    second = SimRequest(
        "t1",
        first.prompt_token_ids + first.output_token_ids + [31, 32],
        [41],
        parent_index=0,
        think_time=4 * STEP,
    )
    result = simulate(Workload("chat", [first, second]), _tiny_config(), "paged+prefix")
    # t0 runs steps 0-4 (prefill + 4 decode steps) and finishes at step 4; t1 arrives at 4 + 4.
    assert result.timeline.step.tolist() == [0, 1, 2, 3, 4, 8]
    assert result.metrics.num_steps == 9
    # t1's 15 tokens: 12 = 3 full blocks of t0 (prompt 8 + 4 computed outputs) are cache hits.
    assert result.metrics.prefix_hit_rate == pytest.approx(12 / (8 + 15))


@pytest.mark.parametrize("name", ["sharegpt", "shared-prefix", "multi-turn"])
def test_same_seed_same_results(name):
    workload_a = make_workload(name, seed=7, num_requests=60, max_model_len=512)
    workload_b = make_workload(name, seed=7, num_requests=60, max_model_len=512)
    config = SimConfig(num_blocks=96, block_size=16, max_model_len=512, block_map_columns=0)
    a = simulate(workload_a, config, "paged+prefix").metrics.to_dict()
    b = simulate(workload_b, config, "paged+prefix").metrics.to_dict()
    a.pop("wall_time_s"), b.pop("wall_time_s")
    assert a == b


def test_prefix_caching_helps_the_shared_prefix_workload():
    workload = make_workload("shared-prefix", seed=1, num_requests=120, max_model_len=1024)
    config = SimConfig(num_blocks=256, block_size=16, max_model_len=1024, block_map_columns=0)
    results = simulate_policies(workload, config)
    paged, cached = results["paged"].metrics, results["paged+prefix"].metrics
    contiguous = results["contiguous"].metrics
    assert cached.prefix_hit_rate > 0.5
    assert cached.num_steps < paged.num_steps < contiguous.num_steps
    assert contiguous.peak_concurrency == (256 - 1) * 16 // 1024  # the null block left out
    assert contiguous.waste_pct > paged.waste_pct


def test_sweep_keeps_pool_bytes_and_waste_grows_with_block_size():
    workload = make_workload("sharegpt", seed=3, num_requests=40, max_model_len=512)
    config = SimConfig(num_blocks=128, block_size=16, max_model_len=512, block_map_columns=0)
    sweep = sweep_block_sizes(workload, config, block_sizes=(1, 16, 128), policies=("paged",))
    waste = [sweep["paged"][bs].waste_pct for bs in (1, 16, 128)]
    assert waste[0] == pytest.approx(0.0)
    assert waste[0] < waste[1] < waste[2]
    assert np.isfinite([m.output_tokens_per_step for m in sweep["paged"].values()]).all()


def _tier_trace() -> Workload:
    """A (8 tokens: blocks a1 a2 of 4), then B (16 other tokens) evicts a2, then C = A's 8
    tokens + 4 new: a1 still in the pool, a2 only in the tier."""
    a = list(range(1, 9))
    return Workload(
        "tier",
        [
            SimRequest("A", a, [100]),
            SimRequest("B", list(range(20, 36)), [100], arrival_time=1.0),
            SimRequest("C", [*a, 40, 41, 42, 43], [100], arrival_time=2.0),
        ],
    )


def _tier_config(**kwargs) -> SimConfig:
    # 5 usable blocks of 4 tokens; a tier of 8 blocks of 1000 bytes at 1 MB/s.
    settings = dict(num_blocks=6, kv_offloading_blocks=8, kv_bytes_per_block=1000)
    settings.update(kv_offloading_bandwidth=1e6, block_map_columns=0)
    settings.update(kwargs)
    return _tiny_config(**settings)


def test_tier_hits_by_hand():
    # Free queue after A: 3 never-used blocks, then A's freed in reverse (a2, a1). B takes 4:
    # the 3 unused and a2 (stored to the tier). C hits a1 in the pool (4 tokens) and a2 in the
    # tier (4 tokens, 1 load), computes 4; its 2 new blocks evict 2 of B's (2 more stores).
    results = simulate_policies(
        _tier_trace(), _tier_config(), ("paged", "paged+prefix", "paged+prefix+tier")
    )
    tier = results["paged+prefix+tier"].metrics
    assert tier.num_prompt_tokens == 8 + 16 + 12
    assert (tier.num_pool_hit_tokens, tier.num_tier_hit_tokens) == (4, 4)
    assert (tier.num_computed_prompt_tokens, tier.num_recomputed_tokens) == (28, 0)
    assert (tier.num_tier_loaded_blocks, tier.num_tier_stored_blocks) == (1, 3)
    assert tier.tier_loaded_bytes == 1000
    assert tier.tier_load_time_s == pytest.approx(1000 / 1e6)
    assert tier.time_s == pytest.approx(tier.num_steps * STEP + 1000 / 1e6)
    assert tier.prefix_hit_rate == pytest.approx(8 / 36)
    assert (tier.pool_hit_rate, tier.tier_hit_rate) == (pytest.approx(4 / 36),) * 2
    # Without the tier a2 is recomputed (A computed it before); without caching nothing hits.
    prefix = results["paged+prefix"].metrics
    assert (prefix.num_pool_hit_tokens, prefix.num_tier_hit_tokens) == (4, 0)
    assert (prefix.num_computed_prompt_tokens, prefix.num_recomputed_tokens) == (32, 4)
    assert prefix.num_tier_loaded_blocks == prefix.tier_load_time_s == 0
    paged = results["paged"].metrics
    assert (paged.num_computed_prompt_tokens, paged.num_recomputed_tokens) == (36, None)


def test_tier_bandwidth_moves_time_not_hits():
    workload = make_workload("multi-turn", seed=0, num_requests=30, max_model_len=1024)
    base = dict(block_size=16, max_model_len=1024, num_blocks=60, kv_offloading_blocks=500)
    fast, slow = (
        simulate(
            workload,
            SimConfig(**base, kv_bytes_per_block=10**6, kv_offloading_bandwidth=bandwidth),
            "paged+prefix+tier",
        ).metrics
        for bandwidth in (1e10, 1e8)
    )
    assert fast.num_tier_hit_tokens > 0
    for name in (
        "num_tier_hit_tokens",
        "num_pool_hit_tokens",
        "num_recomputed_tokens",
        "num_steps",
        "num_tier_loaded_blocks",
        "num_scheduled_tokens",
    ):
        assert getattr(fast, name) == getattr(slow, name), name
    assert slow.tier_load_time_s == pytest.approx(100 * fast.tier_load_time_s)
    assert slow.time_s - fast.time_s == pytest.approx(99 * fast.tier_load_time_s)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_offloading_bandwidth": 0},
        {"kv_offloading_bandwidth": float("inf")},
        {"kv_bytes_per_block": -1},
    ],
)
def test_bad_tier_settings_raise(kwargs):
    with pytest.raises(ConfigError):
        _tier_config(**kwargs)


def test_tier_policy_needs_a_tier():
    with pytest.raises(ConfigError, match="kv_offloading_blocks"):
        simulate(_tier_trace(), _tiny_config(num_blocks=6), "paged+prefix+tier")


def test_time_per_token_prices_compute_without_moving_the_schedule():
    plain = simulate(_tier_trace(), _tier_config(), "paged+prefix+tier").metrics
    priced = simulate(_tier_trace(), _tier_config(time_per_token=0.01), "paged+prefix+tier").metrics
    assert (priced.num_steps, priced.num_tier_hit_tokens) == (plain.num_steps, 4)
    assert plain.compute_time_s == 0
    assert priced.compute_time_s == pytest.approx(priced.num_scheduled_tokens * 0.01)
    assert priced.time_s == pytest.approx(plain.time_s + priced.compute_time_s)
    with pytest.raises(ConfigError, match="time_per_token"):
        _tier_config(time_per_token=-1)


def test_kv_snapshots_for_the_replay_agree_with_the_timeline():
    prefix = list(range(1, 9))  # two full blocks of 4
    workload = Workload(
        "shared",
        [
            SimRequest("D", [*prefix, 50], [1, 2, 3, 4, 5]),
            SimRequest("E", [*prefix, 60], [7], arrival_time=STEP),
        ],
    )
    result = simulate(workload, _tiny_config(), "paged+prefix", kv_snapshots=100)
    snapshots = result.kv_snapshots
    assert len(snapshots) == len(result.timeline.num_running)  # a short run: every step
    step1 = snapshots[1]  # D and E running, E hit D's two full blocks (the test above)
    assert step1["blocks"]["state"].count("s") == step1["stats"]["num_shared_blocks"] == 2
    assert step1["num_used_slots"] == result.timeline.num_real_tokens[1] == 11
    assert [r["num_scheduled_tokens"] for r in step1["requests"]] == [1, 1]
    assert simulate(workload, _tiny_config(), "paged+prefix").kv_snapshots == []
    assert simulate(workload, _tiny_config(), "contiguous", kv_snapshots=100).kv_snapshots == []


def test_kv_snapshots_are_thinned_to_the_asked_number():
    workload = make_workload("shared-prefix", num_requests=40, seed=0)
    result = simulate(workload, _tiny_config(num_blocks=200, max_model_len=512), "paged+prefix",
                      kv_snapshots=5)  # fmt: skip
    assert 5 <= len(result.kv_snapshots) < 10
    times = [s["stats"]["num_steps"] for s in result.kv_snapshots]
    assert times == sorted(times)


def test_kv_cache_groups_of_specs_run():
    """A paged policy over several KV cache groups (Gemma 3's full + sliding-window layers,
    the way benchmarks/gemma3_kv_memory.py drives it): the specs carry the block size, and a
    sliding-window group never runs fewer requests at once than a second full group."""
    from pagedkv.core.spec import FullAttentionSpec, SlidingWindowSpec

    workload = make_workload("sixteen-lengths")
    shape = {"block_size": 16, "num_kv_heads": 1, "head_size": 64}
    full = (FullAttentionSpec(**shape),) * 2
    mixed = (FullAttentionSpec(**shape), SlidingWindowSpec(**shape, sliding_window=32))
    peak = {}
    for name, specs in (("full", full), ("mixed", mixed)):
        config = SimConfig(**{**workload.defaults, "kv_cache_specs": specs})
        metrics = simulate(workload, config, "paged").metrics
        assert metrics.num_rejected == 0
        peak[name] = metrics.peak_concurrency
    assert peak["mixed"] >= peak["full"] > 0
