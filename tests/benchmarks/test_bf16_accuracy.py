"""The metric functions of benchmarks/bf16_accuracy.py on toy distributions, and its prompt set."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bf16_accuracy.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bf16_accuracy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_kl_of_known_distributions(bench):
    p = torch.tensor([0.5, 0.25, 0.25])
    q = torch.tensor([0.25, 0.5, 0.25])
    # Logits are any shift of the log-probabilities: the softmax removes it.
    ref, cand = (p.log() + 3.0)[None], (q.log() - 1.0)[None]
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # sum p log(p / q) = 0.25 ln 2
    assert bench.kl_divergence(ref, cand).tolist() == pytest.approx([expected], rel=1e-6)
    # The direction: KL(p || r) weighs by the reference p (r puts almost nothing on token 2).
    r = torch.tensor([0.9, 0.1, 1e-9])
    kl_pr = float((p * (p / r).log()).sum())
    kl_rp = float((r * (r / p).log()).sum())
    assert kl_pr > 10 * kl_rp
    assert bench.kl_divergence(p.log()[None], r.log()[None]).item() == pytest.approx(kl_pr)


def test_kl_is_zero_for_equal_logits_and_per_row(bench):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    kl = bench.kl_divergence(logits, logits.clone())
    assert kl.shape == (4,) and kl.dtype == torch.float64
    assert torch.all(kl == 0)
    # bf16 rounding of the candidate: small, positive.
    kl = bench.kl_divergence(logits, logits.bfloat16())
    assert torch.all(kl > 0) and torch.all(kl < 1e-3)


def test_top1_agreement_and_summary(bench):
    cand = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    ref_tokens = torch.tensor([1, 0, 1, 0])
    agree = bench.top1_agreement(cand, ref_tokens)
    assert agree.tolist() == [True, True, False, True]
    kl = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    row = bench.summarize(kl, agree.view(2, 2), [True, False])
    assert row["mean_kl"] == pytest.approx(1.5)
    assert row["p95_kl"] == pytest.approx(2.85)  # linear interpolation between 2 and 3
    assert row["top1_agreement"] == pytest.approx(0.75)
    assert row["exact_match"] == pytest.approx(0.5)
    assert bench.summarize(kl, agree.view(2, 2), None)["exact_match"] is None


def test_prompt_set(bench):
    records = [json.loads(line) for line in bench.DATA.read_text().splitlines()]
    assert len(records) == 64
    assert len({r["prompt"] for r in records}) == 64
    categories = {r["category"] for r in records}
    assert categories == {"facts", "math", "code", "instructions", "multilingual", "short", "long"}
    lengths = sorted(len(r["prompt"]) for r in records)
    assert lengths[0] < 10 and lengths[-1] > 500
    # A subset spreads over the categories.
    subset = bench.load_prompts(bench.DATA, 8)
    assert len(subset) == 8 and len({r["category"] for r in subset}) >= 5
