"""The multi-replica simulation: N real KV-cache managers behind the cluster router's ranking,
against round robin, and its `pagedkv simulate --num-replicas` front."""

from __future__ import annotations

import json

import pytest

from pagedkv.entrypoints.cli import main
from pagedkv.errors import ConfigError
from pagedkv.sim.cluster import simulate_cluster
from pagedkv.sim.simulator import SimConfig
from pagedkv.sim.workloads import make_workload


@pytest.fixture(scope="module")
def workload():
    # 8 system prompts of 300-700 tokens; a replica's 150 blocks (2400 tokens) hold about 4.
    return make_workload(
        "shared-prefix",
        seed=0,
        num_requests=120,
        max_model_len=2048,
        num_prefix_groups=8,
        output_median=8.0,
    )


CONFIG = SimConfig(num_blocks=150, block_size=16, max_num_seqs=8, block_map_columns=0)


def test_prefix_routing_caches_each_prompt_once_round_robin_everywhere(workload):
    prefix = simulate_cluster(workload, CONFIG, num_replicas=2, router="prefix")
    robin = simulate_cluster(workload, CONFIG, num_replicas=2, router="round_robin")
    assert prefix.num_rejected == robin.num_rejected == 0
    assert prefix.prefix_hit_rate > robin.prefix_hit_rate + 0.15
    assert prefix.num_steps < robin.num_steps
    assert robin.max_replica_share == 1.0  # 60 / 60
    assert prefix.max_replica_share < 1.5  # hot spots are spread


def test_one_replica_is_the_same_whatever_the_router(workload):
    a = simulate_cluster(workload, CONFIG, num_replicas=1, router="prefix").to_dict()
    b = simulate_cluster(workload, CONFIG, num_replicas=1, router="round_robin").to_dict()
    for row in (a, b):
        del row["router"], row["wall_time_s"]
    assert a == b


def test_bad_arguments(workload):
    with pytest.raises(ConfigError, match="router"):
        simulate_cluster(workload, CONFIG, num_replicas=2, router="random")
    with pytest.raises(ConfigError, match="num_replicas"):
        simulate_cluster(workload, CONFIG, num_replicas=0)


def test_cli_json(capsys):
    argv = ["simulate", "--workload", "shared-prefix", "--num-requests", "60", "--json"]
    argv += ["--num-prefix-groups", "4", "--num-replicas", "2", "--num-blocks", "150", "--quiet"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["routers"]) == {"prefix", "round_robin"}
    assert report["num_replicas"] == 2 and report["num_blocks_per_replica"] == 150


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--routers", "prefix"], "--routers needs --num-replicas"),
        (["--num-prefix-groups", "4", "--workload", "sharegpt"], "shared-prefix only"),
        (["--num-replicas", "2", "--routers", "random"], "unknown random"),
    ],
)
def test_cli_errors(capsys, extra, message):
    assert main(["simulate", "--num-requests", "10", "--quiet", *extra]) == 2
    assert message in capsys.readouterr().err
