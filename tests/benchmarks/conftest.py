"""Importing the benchmark scripts as they run: their folder first on ``sys.path`` for the
import, and every module loaded from that folder forgotten afterwards (the scripts import each
other by bare name: ``_machine``, ``_spec_replay``, ``bench_llama_cpp_peer``...)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def import_benchmarks():
    """A function ``(*names) -> modules``: the benchmark modules ``names``
    (``"bench_spec_decode"``) imported from benchmarks/, all forgotten after the test module."""
    before = set(sys.modules)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield lambda *names: tuple(importlib.import_module(name) for name in names)
    finally:
        sys.path.remove(str(BENCHMARKS))
        for name in set(sys.modules) - before:
            module_file = getattr(sys.modules[name], "__file__", None) or ""
            if Path(module_file).parent == BENCHMARKS:
                sys.modules.pop(name, None)
