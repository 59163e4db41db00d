"""The n > 1 fork's counts where users read them: /metrics (the engine-stats collector) and
`pagedkv generate`'s summary, from fake stats and from the real engine on a tiny model."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

import pytest
from _tiny_model import tiny_loaded_model

from pagedkv.engine.llm import LLM
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.stats import SchedulerStats
from pagedkv.entrypoints.generate import print_summary
from pagedkv.entrypoints.openai.metrics import ServerMetrics
from pagedkv.sampling_params import SamplingParams

#: 30 tokens with the tiny model's one-character tokenizer: the parent computes 29 (7 full blocks
#: of 4 + 1 token), then its samples fork.
PROMPT = "the samples share this prompt."


def _value(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


def test_metrics_expose_the_fork_counts_from_the_stats():
    stats = SchedulerStats(num_forks=7, num_cow_copies=5, num_shared_blocks=12)
    text = ServerMetrics("m").render(SimpleNamespace(scheduler=stats)).decode()
    assert _value(text, "pagedkv:num_forks_total") == 7
    assert _value(text, "pagedkv:num_cow_copies_total") == 5
    assert _value(text, "pagedkv:num_shared_blocks") == 12
    assert "# TYPE pagedkv:num_forks_total counter" in text
    assert "# TYPE pagedkv:num_cow_copies_total counter" in text
    assert "# TYPE pagedkv:num_shared_blocks gauge" in text


def test_metrics_from_the_real_engine_during_and_after_a_fork(tiny):
    assert len(PROMPT) == 30
    engine = LLMEngine(
        loaded_model=tiny, dtype="float32", num_threads=1, block_size=4, num_blocks=80,
        max_model_len=128,
    )  # fmt: skip
    metrics = ServerMetrics("tiny")
    engine.add_request("s", PROMPT, SamplingParams(n=4, max_tokens=6, ignore_eos=True))
    engine.step()  # the parent computes 29 tokens
    engine.step()  # 3 samples fork; each of the 4 writes token 30 (3 copies, one in place)
    text = metrics.render(engine.get_stats()).decode()
    assert _value(text, "pagedkv:num_forks_total") == 3
    assert _value(text, "pagedkv:num_cow_copies_total") == 3
    assert _value(text, "pagedkv:num_shared_blocks") == 7  # the prompt's full blocks
    while engine.has_unfinished_requests():
        engine.step()
    text = metrics.render(engine.get_stats()).decode()
    assert _value(text, "pagedkv:num_forks_total") == 3  # running totals
    assert _value(text, "pagedkv:num_shared_blocks") == 0  # nothing held once idle


def test_generate_summary_prints_the_fork_counts(tiny):
    llm = LLM(
        dtype="float32", block_size=4, num_blocks=80, max_model_len=128, loaded_model=tiny,
        num_threads=1,
    )  # fmt: skip
    outputs = llm.generate([PROMPT], SamplingParams(n=4, max_tokens=6, ignore_eos=True))
    buffer = io.StringIO()
    print_summary(llm, outputs, 1.0, 0.0, file=buffer)
    text = buffer.getvalue()
    # 4 sequences of 30 prompt tokens; the cache was asked once (the 3 others forked).
    assert (
        "prompt tokens    120 (30 in the prompts x 4 samples; counted per sequence; 3 forked "
        "samples shared their prompt's blocks, not looked up in the cache)" in text
    )
    assert "(0/30, each request once)" in text
    assert (
        "fork             3 samples forked (prompt prefilled once, its blocks shared), "
        "3 blocks copied on write" in text
    )
    # n = 1 forks nothing: no fork line.
    fresh = LLM(
        dtype="float32", block_size=4, num_blocks=80, max_model_len=128, loaded_model=tiny,
        num_threads=1,
    )  # fmt: skip
    outputs = fresh.generate(["plain"], SamplingParams(max_tokens=2, ignore_eos=True))
    buffer = io.StringIO()
    print_summary(fresh, outputs, 1.0, 0.0, file=buffer)
    assert "fork " not in buffer.getvalue()
