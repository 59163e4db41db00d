"""Run pytest on some tests again in a fresh interpreter held to AVX2
(``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``): oneDNN's, ATen's and pagedkv's own
kernels then take their 8-lane paths, as an AVX2-only CPU runs them (docs/perf.md, "Holding a
machine to AVX2"). A fresh interpreter, since the ISA is chosen when the libraries load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

#: The repository's root (pytest runs from there, so test ids are relative to it).
ROOT = Path(__file__).resolve().parents[2]


def run_pytest_held_to_avx2(*args: str, timeout: float = 900) -> str:
    """``python -m pytest -q -p no:cacheprovider ARGS...`` held to AVX2; returns its stdout.
    Skips where this interpreter is already held (the caller's tests ran the 8-lane paths);
    fails with the run's output tail when it fails or passes nothing."""
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
        pytest.skip("already held to AVX2: the tests above ran the 8-lane paths")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]
    return done.stdout
