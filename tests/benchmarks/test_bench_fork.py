"""benchmarks/bench_fork.py on a tiny random model: the fork path prefills once and holds the
prompt's full blocks once, the path before fork (independent requests) samples the same tokens,
and the no-cache path computes every copy."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from _tiny_model import tiny_loaded_model

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sampling_params import SamplingParams

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_fork.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_fork", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.mark.parametrize("prompt_len", [37, 33])  # fork point inside a block, on a boundary
def test_paths_on_a_tiny_model(bench, prompt_len):
    tiny = tiny_loaded_model()

    def make_engine(enable_prefix_caching: bool) -> LLMEngine:
        return LLMEngine(
            loaded_model=tiny, dtype="float32", num_threads=1, block_size=4, num_blocks=200,
            max_model_len=64, enable_prefix_caching=enable_prefix_caching,
        )  # fmt: skip

    n, max_tokens = 4, 6
    prompt = bench.prompt_token_ids(prompt_len, 127, seed=1)
    params = SamplingParams(n=n, temperature=0.8, seed=5, max_tokens=max_tokens, ignore_eos=True)
    results = bench.compare(make_engine, prompt, params)
    fork, independent, no_cache = results["fork"], results["independent"], results["no-cache"]
    # Fork: the prompt but its last token once, then each sample's last prompt token.
    assert fork.prefill_tokens == prompt_len - 1 + n
    assert fork.total_tokens == prompt_len - 1 + n * max_tokens
    assert (fork.num_forks, fork.num_cow_copies) == (
        n - 1,
        0 if (prompt_len - 1) % 4 == 0 else n - 1,
    )
    assert fork.peak_blocks == bench.expected_fork_blocks(prompt_len, max_tokens, n, 4)
    # No cache: n full prompts and n full copies of every block.
    assert no_cache.prefill_tokens == n * prompt_len
    assert no_cache.peak_blocks == n * -(-(prompt_len + max_tokens - 1) // 4)
    assert no_cache.num_forks == 0
    assert fork.peak_blocks < no_cache.peak_blocks
    # Independent requests admitted in one step hit the first one's full prompt blocks, cached as
    # they are allocated: each computes only the tokens past them.
    full = prompt_len // 4 * 4
    assert independent.prefill_tokens == prompt_len + (n - 1) * (
        prompt_len - min(full, prompt_len - 1)
    )
    # The fork changes where the KV comes from, not what is sampled.
    assert fork.samples == independent.samples == no_cache.samples
    assert len(fork.samples) == n and all(len(s) == max_tokens for s in fork.samples)


def test_bad_counts_are_usage_errors(bench):
    with pytest.raises(SystemExit):
        bench.main(["--n", "0"])


def test_main_prints_the_table_and_json(bench, monkeypatch, capsys):
    tiny = tiny_loaded_model()

    def tiny_engine(config, loaded_model=None):
        return LLMEngine(
            dataclasses.replace(config, dtype="float32", num_threads=1), loaded_model=tiny
        )

    monkeypatch.setattr(bench, "LLMEngine", tiny_engine)
    argv = ["--n", "3", "--prompt-len", "21", "--max-tokens", "4", "--block-size", "4"]
    argv += ["--num-blocks", "100", "--repeats", "2"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "3 samples of a 21-token prompt, 4 output tokens each, blocks of 4" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:5]}
    assert set(rows) == {"fork", "independent", "no-cache"}
    # fork: 5 shared blocks + 3 x (24 // 4 - 5) = 8 peak blocks; 20 + 3 prefill tokens.
    assert rows["fork"][1:7] == ["8", "23", "32", "5", "2", "0"]  # 32 = 20 + 3 x 4
    assert rows["no-cache"][1:3] == ["18", "63"]
    assert "expected for fork: 8 peak blocks" in out
    assert bench.main([*argv, "--json", "--no-baseline-without-cache"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["paths"]) == {"fork", "independent"}
    assert report["paths"]["fork"]["peak_blocks"] == report["expected_fork_peak_blocks"] == 8
    assert len(report["paths"]["fork"]["e2e_s_all"]) == 2
    assert report["same_samples_as_independent"] == {"fork": True}
