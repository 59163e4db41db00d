"""n > 1 in the simulator: one prefill, then the samples fork the parent's blocks (as the
engine's LLMEngine.add_request and Scheduler do), against the same trace with every sample its own
request."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedkv.errors import ConfigError
from pagedkv.sim.cluster import simulate_cluster
from pagedkv.sim.plots import fig_block_map, metrics_table_rows
from pagedkv.sim.simulator import (
    SimConfig,
    fork_saving_lines,
    simulate,
    simulate_fork_baselines,
)
from pagedkv.sim.trace import read_trace
from pagedkv.sim.workloads import SimRequest, Workload, make_workload, with_samples

STEP = 0.025


def _config(**kwargs) -> SimConfig:
    settings = dict(
        num_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=256, step_time=STEP
    )
    settings.update(kwargs)
    return SimConfig(**settings)


def _one_request_n4() -> Workload:
    # A 30-token prompt (7 full blocks of 4 + 2 tokens), 8 output tokens, 4 samples.
    return with_samples(
        Workload("n4", [SimRequest("A", list(range(1, 31)), list(range(100, 108)))]), 4
    )


def test_n4_forks_and_holds_fewer_peak_blocks_than_the_expanded_trace():
    workload = _one_request_n4()
    forked = simulate(workload, _config(), "paged")
    expanded = simulate(workload, _config(), "paged", fork=False)
    m, base = forked.metrics, expanded.metrics
    # Fork: the parent computes 29 tokens (8 blocks, the 8th holding 1 token); the 3 samples
    # share them; each of the 4 writes its 30th token: 3 copy-on-write copies (the last holder
    # writes in place). At the end each holds 38 tokens = 10 blocks, 7 of them shared:
    # 7 + 4 x 3 = 19 blocks.
    assert m.num_sequences == 4
    assert (m.num_forks, m.num_cow_copies) == (3, 3)
    assert m.peak_blocks == 19
    # Without fork: 4 requests of 10 blocks each.
    assert base.peak_blocks == 40
    assert (base.num_forks, base.num_cow_copies) == (0, 0)
    assert m.peak_blocks < base.peak_blocks
    # Prefill computed once: 29 + one last prompt token per sample, then 7 decode steps of 4.
    assert forked.timeline.num_scheduled_tokens.tolist() == [29] + [4] * 8
    assert m.num_scheduled_tokens == 29 + 4 + 4 * 7
    assert base.num_scheduled_tokens == 4 * 30 + 4 * 7
    # Every sample's 8 tokens count as output.
    assert m.output_tokens_per_step == pytest.approx(32 / m.num_steps)


def test_a_shared_partial_block_counts_its_empty_slots_once():
    workload = _one_request_n4()
    t = simulate(workload, _config(), "paged").timeline
    # Step 1: 8 original blocks + 3 copies = 44 slots; written: 7 shared full blocks (28 tokens)
    # + 2 tokens in each of the 4 last blocks.
    assert t.num_reserved_tokens[1] == 44
    assert t.num_real_tokens[1] == 28 + 4 * 2
    # A sample that forked but waits (token budget 1 per step after the parent's) still shares
    # the partial block: its empty slots are counted once, so real <= reserved throughout.
    tight = simulate(workload, _config(max_num_batched_tokens=29), "paged").timeline
    assert (tight.num_real_tokens <= tight.num_reserved_tokens).all()
    assert (tight.num_real_tokens >= 0).all()


def test_contiguous_never_forks():
    result = simulate(_one_request_n4(), _config(), "contiguous")
    # 63 usable blocks x 4 = 252 tokens: 3 regions of 64; 4 samples as 4 requests.
    assert result.metrics.peak_concurrency == 3
    assert result.metrics.num_forks == 0
    assert result.metrics.num_sequences == 4


def test_follow_up_turn_waits_for_the_last_sample():
    # max_num_seqs 2: one sample forks, the third finds no seat and queues as a plain request,
    # finishing later; the next turn must wait for it.
    first = SimRequest("t0", list(range(1, 10)), [21, 22], n=3, sample_outputs=[[31, 32], [41, 42]])
    second = SimRequest(
        "t1", [*first.prompt_token_ids, 21, 22, 50], [60], parent_index=0, think_time=STEP
    )
    result = simulate(Workload("chat", [first, second]), _config(max_num_seqs=2), "paged")
    steps = result.timeline.step.tolist()
    running = result.timeline.num_running.tolist()
    # t0#0 prefills 8 tokens (step 0) and forks t0#1; both compute the 9th token (step 1),
    # decode (step 2) and finish; t0#2 then prefills 9 (step 3) and decodes (step 4). t1 arrives
    # one step after that last sample (were it released by the first finished sample, it would
    # run beside t0#2 at step 3).
    assert steps == [0, 1, 2, 3, 4, 5]
    assert running == [1, 2, 2, 1, 1, 1]
    assert result.timeline.num_scheduled_tokens.tolist() == [8, 2, 2, 9, 1, 12]
    assert result.metrics.num_forks == 1


def test_fork_baselines_and_the_saving_line():
    workload = _one_request_n4()
    config = _config()
    results = {p: simulate(workload, config, p) for p in ("paged", "paged+prefix")}
    baselines = simulate_fork_baselines(workload, config, ("contiguous", "paged", "paged+prefix"))
    assert set(baselines) == {"paged", "paged+prefix"}
    assert baselines["paged"].peak_blocks == 40
    lines = fork_saving_lines(results, baselines)
    assert lines[0].startswith(
        "fork under paged: peak 19 KV blocks with fork vs 40 without, each of the 4 samples its "
        "own request (52.5% fewer)"
    )
    # Without n > 1 there is nothing to compare.
    plain = Workload("plain", [SimRequest("A", [1, 2, 3], [4])])
    assert simulate_fork_baselines(plain, config) == {}


def test_fork_rows_only_with_samples():
    config = _config()
    plain = Workload("plain", [SimRequest("A", [1, 2, 3, 4, 5], [6, 7])])
    labels = [
        row[0] for row in metrics_table_rows({"paged": simulate(plain, config, "paged").metrics})
    ]
    assert "forks" not in labels
    forked = simulate(_one_request_n4(), config, "paged").metrics
    rows = {row[0]: row[1] for row in metrics_table_rows({"paged": forked})}
    assert (rows["forks"], rows["copy-on-write copies"], rows["peak KV blocks"]) == ("3", "3", "19")


def _legend_labels(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def test_block_map_marks_blocks_shared_by_samples_and_the_legend_only_when_present():
    forked = simulate(_one_request_n4(), _config(), "paged")
    block_map = forked.block_map
    # Step 1: the 7 full prompt blocks are shared by the 4 samples of trace request 0.
    assert int(block_map.shared_by_samples[:, 1].sum()) == 7
    assert (block_map.owners[block_map.shared_by_samples[:, 1], 1] == 0).all()
    labels = " | ".join(_legend_labels(fig_block_map(forked)))
    assert "shared by the samples of one request" in labels
    assert "shared by requests" not in labels
    # The same trace without fork and without prefix caching shares nothing: no shared entry.
    expanded = simulate(_one_request_n4(), _config(), "paged", fork=False)
    assert not expanded.block_map.shared.any()
    labels = " | ".join(_legend_labels(fig_block_map(expanded)))
    assert "shared" not in labels


def test_prefix_shared_blocks_are_shared_by_requests_not_samples():
    prefix = list(range(1, 9))
    workload = Workload(
        "shared",
        [
            SimRequest("D", [*prefix, 50], [1, 2, 3, 4, 5]),
            SimRequest("E", [*prefix, 60], [7], arrival_time=STEP),
        ],
    )
    result = simulate(workload, _config(num_blocks=20), "paged+prefix")
    block_map = result.block_map
    assert int(block_map.shared[:, 1].sum()) == 2
    assert not block_map.shared_by_samples.any()
    labels = " | ".join(_legend_labels(fig_block_map(result)))
    assert "shared by requests (ref_cnt > 1)" in labels
    assert "samples" not in labels


def test_with_samples_is_deterministic_and_keeps_a_trace_n():
    workload = make_workload("sharegpt", seed=2, num_requests=5, max_model_len=256)
    workload.requests[0] = SimRequest("own", [1, 2], [3, 4], n=2, sample_outputs=[[5, 6]])
    a, b = with_samples(workload, 3, seed=9), with_samples(workload, 3, seed=9)
    assert [r.n for r in a.requests] == [2, 3, 3, 3, 3]
    assert a.requests[0].sample_outputs == [[5, 6]]
    assert a.requests[1].sample_outputs == b.requests[1].sample_outputs
    assert a.requests[1].output_of(2) != a.requests[1].output_of(1) != a.requests[1].output_of(0)
    assert len(a.requests[1].output_of(2)) == a.requests[1].num_output_tokens
    assert with_samples(workload, 1) is workload
    with pytest.raises(ConfigError, match="n must be an int >= 1"):
        with_samples(workload, 0)


def test_sim_request_checks_its_samples():
    with pytest.raises(ConfigError, match="n=3 needs 2 sample_outputs of 2 tokens"):
        SimRequest("x", [1], [2, 3], n=3, sample_outputs=[[4, 5]])
    with pytest.raises(ConfigError, match="n=2 needs 1 sample_outputs of 2 tokens"):
        SimRequest("x", [1], [2, 3], n=2, sample_outputs=[[4]])
    with pytest.raises(ConfigError, match="n must be an int >= 1"):
        SimRequest("x", [1], [2], n=0)


def test_trace_field_n(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"prompt_len": 12, "output_len": 3, "n": 4})
        + "\n"
        + json.dumps({"prompt_len": 5, "output_len": 2})
        + "\n",
        encoding="utf-8",
    )
    workload, _ = read_trace(path, seed=1)
    first, second = workload.requests
    assert (first.n, second.n) == (4, 1)
    assert [len(o) for o in first.sample_outputs] == [3, 3, 3]
    assert len({tuple(first.output_of(i)) for i in range(4)}) == 4
    path.write_text(json.dumps({"prompt_len": 5, "output_len": 2, "n": 0}) + "\n")
    with pytest.raises(ConfigError, match=r"t\.jsonl:1: n must be an int >= 1"):
        read_trace(path)


def test_cluster_refuses_samples():
    with pytest.raises(ConfigError, match="n > 1"):
        simulate_cluster(_one_request_n4(), _config(), num_replicas=2)


def test_sharegpt_n4_same_seed_same_results_and_fork_saves():
    workload = with_samples(
        make_workload("sharegpt", seed=5, num_requests=30, max_model_len=512), 4
    )
    config = SimConfig(num_blocks=2048, block_size=16, max_model_len=512, block_map_columns=0)
    a = simulate(workload, config, "paged").metrics.to_dict()
    b = simulate(workload, config, "paged").metrics.to_dict()
    a.pop("wall_time_s"), b.pop("wall_time_s")
    assert a == b
    base = simulate(workload, config, "paged", fork=False).metrics
    assert a["num_forks"] == 3 * 30
    assert a["peak_blocks"] < base.peak_blocks
    assert np.isclose(
        a["output_tokens_per_step"] * a["num_steps"],
        4 * sum(r.num_output_tokens for r in workload.requests),
    )
