"""benchmarks/bench_kv_events.py on a tiny batch: it runs, and its events are a chain that the
codec round-trips (what it times is what the cluster sends)."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

pytest.importorskip("msgspec", reason="needs pip install 'pagedkv[cluster]'")

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_kv_events.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kv_events", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_events_are_one_chain_and_round_trip(bench):
    from pagedkv.cluster.kv_events import decode_batch, encode_batch

    events = bench.make_events(5, 4)
    assert events[0].parent_block_hash is None
    assert all(b.parent_block_hash == a.block_hashes[0] for a, b in itertools.pairwise(events))
    assert decode_batch(encode_batch(events, ts=1.0)).events == events


def test_runs_and_prints_the_table(bench, capsys):
    assert bench.main(["--num-events", "3", "--number", "1", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 BlockStored events" in out and "this tree" in out


def test_bad_counts_are_usage_errors(bench):
    with pytest.raises(SystemExit):
        bench.main(["--num-events", "0"])
