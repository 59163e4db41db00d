"""benchmarks/bench_spec_decode.py's cell: the configurations take turns conversation by
conversation (or run one after another with ``--sequential``), each on its own fresh engine,
and each row's rate, speedup and token check come from its own runs. A stand-in LLM records
the order of the calls; no model is loaded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def bench(import_benchmarks):
    return import_benchmarks("bench_spec_decode")[0]


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
        # a proposer's counters (SpecDecodingStats' fields), nonzero at build as an engine's
        # may be: the row must take the difference
        self.spec = None
        if speculative_config is not None:
            self.spec = SimpleNamespace(
                num_drafts=5, num_draft_tokens=9, num_accepted_tokens=3,
                num_drafts_per_len=[1, 1, 1, 0, 0, 0, 2],
            )  # fmt: skip
            costs = {1: (0.010, 1.0), 4: (0.0125, 1.0)}
            self.engine = SimpleNamespace(
                scheduler=SimpleNamespace(
                    drafts=SimpleNamespace(step_costs=SimpleNamespace(snapshot=lambda: costs))
                )
            )
        self.log.built.append(self.label)

    def chat(self, conversations, params, use_tqdm=False):
        self.log.calls.append((self.label, conversations[0]["index"], len(conversations)))
        self.steps += len(conversations)
        if self.spec is not None:  # each conversation: 2 drafts of 3 tokens, 4 accepted
            self.spec.num_drafts += 2 * len(conversations)
            self.spec.num_draft_tokens += 6 * len(conversations)
            self.spec.num_accepted_tokens += 4 * len(conversations)
            self.spec.num_drafts_per_len[2] += 2 * len(conversations)
        return [
            SimpleNamespace(
                prompt_token_ids=[c["index"]],
                outputs=[SimpleNamespace(token_ids=[c["index"], 1 if self.wrong else 0, *[0] * 6])],
            )
            for c in conversations
        ]

    def get_stats(self):
        spec = None
        if self.spec is not None:  # a snapshot, as the engine's stats are
            spec = SimpleNamespace(**vars(self.spec))
            spec.num_drafts_per_len = list(self.spec.num_drafts_per_len)
        return SimpleNamespace(scheduler=SimpleNamespace(num_steps=self.steps, spec_decoding=spec))


@pytest.fixture
def fake(bench, monkeypatch):
    log = SimpleNamespace(calls=[], built=[])
    monkeypatch.setattr(bench, "LLM", type("LoggedLLM", (FakeLLM,), {"log": log}))
    return log


CONFIGS = {"off": None, "a": {"label": "a"}, "b": {"label": "b", "wrong": True}}
CONVERSATIONS = [{"index": i} for i in range(4)]


def cell(bench, *, batch, round_index, interleave=True, saved=None):
    return bench.measure_cell(
        CONFIGS, None, {}, "w", CONVERSATIONS, None, batch, round_index,
        {} if saved is None else saved, interleave=interleave,
    )  # fmt: skip


def test_each_row_counts_its_own_drafts_and_off_is_saved(bench, fake):
    saved = {}
    rows = cell(bench, batch=1, round_index=0, saved=saved)
    off, a, b = rows
    assert "acceptance_rate" not in off
    for row in (a, b):  # counted over this cell's runs only (build-time counts subtracted)
        assert row["draft_tokens"] == 24 and row["accepted_tokens"] == 16
        assert row["acceptance_rate"] == round(16 / 24, 3)
        assert row["mean_acceptance_length"] == 3.0
        assert row["num_drafts_per_len"] == [0, 0, 8, 0, 0, 0, 0]
        assert row["step_costs_ms"] == {1: 10.0, 4: 12.5}
        assert row["decode_steps"] == 32 - 4 - 16  # batch 1: tokens - requests - accepted
    assert saved == {
        "w": [{"prompt_token_ids": [i], "output_token_ids": [i, *[0] * 7]} for i in range(4)]
    }  # "off"'s tokens, in conversation order


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
    assert [r["output_tokens"] for r in rows] == [32, 32, 32]
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
