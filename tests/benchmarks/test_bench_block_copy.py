"""benchmarks/bench_block_copy.py on a tiny pool: it runs, times what it says, and its pairs are
valid copies (distinct blocks, never the null block)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_block_copy.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_block_copy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_pairs_are_valid_copies(bench):
    from pagedkv.ops.backends import check_block_mapping

    pairs = bench.random_pairs(20, 8, torch.Generator().manual_seed(0))
    assert len(pairs) == 8
    assert check_block_mapping(pairs, 20).shape == (8, 2)  # raises on a bad pair


def test_runs_and_prints_the_table(bench, capsys):
    argv = ["--backends", "torch", "--num-layers", "2", "--pool-mib", "1", "--repeats", "2"]
    assert bench.main([*argv, "--num-pairs", "1", "3"]) == 0
    out = capsys.readouterr().out
    assert "2 layers x 3 KV heads x 64 bf16" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("torch ")]
    assert [row[3] for row in rows] == ["1", "3"]  # one row per pair count


def test_bad_counts_are_usage_errors(bench):
    with pytest.raises(SystemExit):
        bench.main(["--num-pairs", "0"])
