"""Built-in workloads: deterministic, real shared token ids, within max_model_len."""

from __future__ import annotations

import pytest

from pagedkv.errors import ConfigError
from pagedkv.sim.workloads import SIXTEEN_LENGTHS, WORKLOADS, make_workload


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_deterministic_and_within_limits(name):
    a = make_workload(name, seed=5, num_requests=50, max_model_len=512)
    b = make_workload(name, seed=5, num_requests=50, max_model_len=512)
    c = make_workload(name, seed=6, num_requests=50, max_model_len=512)
    ids = [(r.prompt_token_ids, r.output_token_ids, r.arrival_time) for r in a.requests]
    assert ids == [(r.prompt_token_ids, r.output_token_ids, r.arrival_time) for r in b.requests]
    assert ids != [(r.prompt_token_ids, r.output_token_ids, r.arrival_time) for r in c.requests]
    for r in a.requests:
        assert r.num_prompt_tokens >= 1 and r.num_output_tokens >= 1
        if name != "sixteen-lengths":
            assert r.num_prompt_tokens + r.num_output_tokens <= 512
        assert all(0 < t < 49152 for t in r.prompt_token_ids)


def test_sixteen_lengths():
    workload = make_workload("sixteen-lengths")
    assert [r.num_prompt_tokens for r in workload.requests] == list(SIXTEEN_LENGTHS)
    # 128 usable blocks (DESIGN's pool) plus the null block.
    assert workload.defaults["num_blocks"] == 129 and workload.defaults["max_model_len"] == 512


def test_shared_prefix_requests_share_their_system_prompt_ids():
    workload = make_workload("shared-prefix", seed=0, num_requests=40, max_model_len=2048)
    by_group: dict[str, list] = {}
    for r in workload.requests:
        by_group.setdefault(r.prefix_group, []).append(r)
    assert len(by_group) > 1
    for requests in by_group.values():
        first = requests[0].prompt_token_ids
        for other in requests[1:]:
            assert other.prompt_token_ids[:300] == first[:300]


def test_multi_turn_extends_the_previous_turn():
    workload = make_workload("multi-turn", seed=0, num_requests=30, max_model_len=2048)
    follow_ups = [r for r in workload.requests if r.parent_index is not None]
    assert follow_ups
    for r in follow_ups:
        parent = workload.requests[r.parent_index]
        history = parent.prompt_token_ids + parent.output_token_ids
        assert r.prompt_token_ids[: len(history)] == history
        assert r.num_prompt_tokens > len(history)


def test_poisson_arrivals_increase():
    workload = make_workload("sharegpt", seed=0, num_requests=20, request_rate=10.0)
    times = [r.arrival_time for r in workload.requests]
    assert times == sorted(times) and times[-1] > 0


def test_unknown_workload():
    with pytest.raises(ConfigError, match="unknown workload"):
        make_workload("nope")
