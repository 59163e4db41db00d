"""benchmarks/bench_beam_search.py at its smallest, on the default model: the engine's beams equal
transformers' beam search for every prompt, and hold less KV than beams that share nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.mark.slow
def test_beams_equal_transformers_and_share_blocks(gguf_path, capsys, monkeypatch):
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_beam_search

    try:
        args = ["--widths", "3", "--num-prompts", "2", "--prompt-len", "20", "--max-tokens", "6"]
        assert bench_beam_search.main([*args, "--json"]) == 0
    finally:
        sys.modules.pop("bench_beam_search", None)
        sys.modules.pop("bench_fork", None)
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["equal_prompts"] == 2
    # 2 prompts x 3 beams x 2 blocks of 16 each when nothing is shared; the prompt's first
    # (full) block is shared by a prompt's beams.
    assert row["pagedkv_peak_blocks"] < 2 * 3 * 2
    assert row["pagedkv_peak_kv_tokens"] < row["independent_kv_tokens"]
