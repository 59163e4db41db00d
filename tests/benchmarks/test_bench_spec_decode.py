"""benchmarks/bench_spec_decode.py's cell: the configurations take turns conversation by
conversation (or run one after another with ``--sequential``), each on its own fresh engine,
and each row's rate, speedup and token check come from its own runs. A stand-in LLM records
the order of the calls; no model is loaded."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("bench_spec_decode")
    finally:
        sys.path.remove(str(BENCHMARKS))
        for name in ("bench_spec_decode", "_spec_replay"):
            sys.modules.pop(name, None)


class FakeLLM:
    """``LLM`` as the cell uses it: ``chat`` answers each conversation with its index (the same
    tokens under every configuration unless ``wrong``), ``get_stats`` counts steps; each engine
    built is appended to ``log.built``, each call to ``log.calls`` as ``(label, first
    conversation index, conversations)``."""

    log: SimpleNamespace  # set on the subclass each test makes

    def __init__(self, *, loaded_model, speculative_config, **engine_args):
        self.label = "off" if speculative_config is None else speculative_config["label"]
        self.wrong = speculative_config is not None and speculative_config.get("wrong", False)
        self.steps = 0
        self.log.built.append(self.label)

    def chat(self, conversations, params, use_tqdm=False):
        self.log.calls.append((self.label, conversations[0]["index"], len(conversations)))
        self.steps += len(conversations)
        return [
            SimpleNamespace(
                prompt_token_ids=[c["index"]],
                outputs=[SimpleNamespace(token_ids=[c["index"], 1 if self.wrong else 0])],
            )
            for c in conversations
        ]

    def get_stats(self):
        return SimpleNamespace(scheduler=SimpleNamespace(num_steps=self.steps, spec_decoding=None))


@pytest.fixture
def fake(bench, monkeypatch):
    log = SimpleNamespace(calls=[], built=[])
    monkeypatch.setattr(bench, "LLM", type("LoggedLLM", (FakeLLM,), {"log": log}))
    return log


CONFIGS = {"off": None, "a": {"label": "a"}, "b": {"label": "b", "wrong": True}}
CONVERSATIONS = [{"index": i} for i in range(4)]


def cell(bench, *, batch, round_index, interleave=True):
    return bench.measure_cell(
        CONFIGS, None, {}, "w", CONVERSATIONS, None, batch, round_index, {}, interleave=interleave
    )


def test_interleaved_turns_alternate_per_conversation(bench, fake):
    rows = cell(bench, batch=1, round_index=0)
    assert fake.built == ["off", "a", "b"]  # every engine fresh, built before the first run
    assert fake.calls == [
        ("off", 0, 1), ("a", 0, 1), ("b", 0, 1),
        ("b", 1, 1), ("a", 1, 1), ("off", 1, 1),
        ("off", 2, 1), ("a", 2, 1), ("b", 2, 1),
        ("b", 3, 1), ("a", 3, 1), ("off", 3, 1),
    ]  # fmt: skip
    assert [r["config"] for r in rows] == ["off", "a", "b"]
    assert [r["output_tokens"] for r in rows] == [8, 8, 8]
    assert [r["steps"] for r in rows] == [4, 4, 4]
    assert [r["same_tokens"] for r in rows] == [True, True, False]
    assert all(r["interleaved"] for r in rows)
    assert rows[0]["speedup"] == 1.0


def test_interleaved_second_round_starts_reversed_and_batches_chunk(bench, fake):
    cell(bench, batch=2, round_index=1)
    assert fake.calls == [
        ("b", 0, 2), ("a", 0, 2), ("off", 0, 2),
        ("off", 2, 2), ("a", 2, 2), ("b", 2, 2),
    ]  # fmt: skip


def test_sequential_runs_each_configuration_whole(bench, fake):
    rows = cell(bench, batch=1, round_index=1, interleave=False)
    labels = [label for label, _, _ in fake.calls]
    assert labels == ["a"] * 4 + ["b"] * 4 + ["off"] * 4  # "off" last in odd rounds
    assert [r["same_tokens"] for r in rows] == [True, True, False]
    assert not any(r["interleaved"] for r in rows)
