"""Datasets of the pagedkv test tasks: read from the JSON-lines files beside this module (no hub,
no cache), for lm-eval's ``custom_dataset`` hook."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _load(name: str) -> datasets.DatasetDict:
    lines = (HERE / name).read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_mc(**kwargs) -> datasets.DatasetDict:
    """The multiple-choice items (question, choices, answer index)."""
    return _load("mc.jsonl")


def load_gen(**kwargs) -> datasets.DatasetDict:
    """The generate-until items (question, answer)."""
    return _load("gen.jsonl")
