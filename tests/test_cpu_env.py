"""pagedkv.cpu_env and the engine's thread count: OpenMP's wait default is in the environment
before torch loads (and the user's settings win), and the thread count follows the CPUs this
process may use (affinity mask, cgroup quota). No timing here: the speed is measured by
benchmarks/bench_threads_load.py (docs/perf.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv.cpu_env import (
    DEFAULT_GOMP_SPINCOUNT,
    apply_openmp_env_defaults,
    available_cpu_count,
    cgroup_cpu_limit,
)
from pagedkv.engine.cpu_runtime import release_openmp_threads, tune_cpu_runtime


def test_default_set_when_unset():
    env: dict[str, str] = {"PATH": "/bin"}
    assert apply_openmp_env_defaults(env, loaded_modules=()) == {
        "GOMP_SPINCOUNT": DEFAULT_GOMP_SPINCOUNT
    }
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": DEFAULT_GOMP_SPINCOUNT}


@pytest.mark.parametrize(
    "user", [{"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": ""}]
)
def test_user_setting_wins(user):
    env = dict(user)
    assert apply_openmp_env_defaults(env, loaded_modules=()) == {}
    assert env == user


def test_nothing_set_once_torch_is_loaded():
    env: dict[str, str] = {}
    assert apply_openmp_env_defaults(env, loaded_modules=("torch", "pagedkv")) == {}
    assert env == {}


def _run(code: str, **env_changes: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update({k: v for k, v in env_changes.items() if v is not None})
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


# What libgomp sees when it loads: the C environment (getenv), read after torch is imported.
_C_GETENV = (
    "import ctypes, sys; import torch; libc = ctypes.CDLL(None); "
    "libc.getenv.restype = ctypes.c_char_p; "
    "print(libc.getenv(b'GOMP_SPINCOUNT'), 'torch' in sys.modules)"
)


@pytest.mark.parametrize("entry", ["import pagedkv", "import pagedkv.entrypoints.cli"])
def test_import_sets_it_before_torch_loads(entry):
    # Neither `import pagedkv` nor the CLI's module imports torch themselves, so the value is in
    # the process's environment before torch (and libgomp) first load.
    assert _run(f"{entry}; import sys; print('torch' in sys.modules)") == "False"
    assert _run(f"{entry}; {_C_GETENV}") == f"b'{DEFAULT_GOMP_SPINCOUNT}' True"


def test_import_respects_the_user_and_an_earlier_torch():
    assert _run(f"import pagedkv; {_C_GETENV}", GOMP_SPINCOUNT="42") == "b'42' True"
    assert _run(f"import pagedkv; {_C_GETENV}", OMP_WAIT_POLICY="PASSIVE") == "None True"
    assert _run(f"import torch; import pagedkv; {_C_GETENV}") == "None True"


def _cgroup(tmp_path: Path, proc_line: str, files: dict[str, str]) -> float | None:
    proc = tmp_path / "cgroup"
    proc.write_text(proc_line + "\n")
    root = tmp_path / "fs"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return cgroup_cpu_limit(proc, root)


def test_cgroup_v2_quota_tightest_ancestor_wins(tmp_path):
    files = {"a/b/cpu.max": "150000 100000\n", "a/cpu.max": "max 100000\n"}
    assert _cgroup(tmp_path, "0::/a/b", files) == 1.5
    files["a/cpu.max"] = "50000 100000\n"
    assert _cgroup(tmp_path, "0::/a/b", files) == 0.5


def test_cgroup_v2_unlimited_or_missing(tmp_path):
    assert _cgroup(tmp_path, "0::/a", {"a/cpu.max": "max 100000\n"}) is None
    assert _cgroup(tmp_path, "0::/a", {}) is None
    assert cgroup_cpu_limit(tmp_path / "no-such-file", tmp_path) is None


def test_cgroup_v1_quota(tmp_path):
    files = {"cpu/x/cpu.cfs_quota_us": "200000\n", "cpu/x/cpu.cfs_period_us": "100000\n"}
    assert _cgroup(tmp_path, "4:cpu,cpuacct:/x", files) == 2.0
    files["cpu/x/cpu.cfs_quota_us"] = "-1\n"
    assert _cgroup(tmp_path, "4:cpu,cpuacct:/x", files) is None


@pytest.mark.parametrize(
    ("affinity", "limit", "expected"),
    [({0, 1, 2, 3}, None, 4), ({0, 1, 2, 3}, 1.5, 2), ({0, 1}, 8.0, 2), ({0, 1, 2}, 0.2, 1)],
)
def test_available_cpu_count(affinity, limit, expected):
    assert available_cpu_count(affinity, limit) == expected


def test_engine_threads_default_to_available_cpus():
    before = torch.get_num_threads()
    try:
        assert tune_cpu_runtime(None) == available_cpu_count() == torch.get_num_threads()
        assert tune_cpu_runtime(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_releasing_the_openmp_threads_of_one_thread_leaves_the_runtime_working():
    """release_openmp_threads frees this thread's OpenMP pool (libgomp's
    omp_pause_resource_all); parallel work on this thread and on another one still runs and
    gives the same numbers after it (the next region builds a pool again)."""
    import threading

    x = torch.randn(1 << 16)
    expected = x.double().sum().item()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.exp(x).sum()  # a parallel region: this thread has a pool now
        released = release_openmp_threads()
        if os.uname().sysname == "Linux":
            assert released  # torch's CPU build loads libgomp with OpenMP 5.0's pause
        assert abs(x.sum().item() - expected) < 1e-2
        got = []
        worker = threading.Thread(target=lambda: got.append(x.sum().item()))
        worker.start()
        worker.join()
        assert abs(got[0] - expected) < 1e-2
        assert release_openmp_threads() == released  # again, with no pool: still fine
    finally:
        torch.set_num_threads(before)
