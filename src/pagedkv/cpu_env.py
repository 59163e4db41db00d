"""CPU settings that must be in place before torch loads (pure Python: imports no torch).

OpenMP reads its environment once, when torch's library loads it, so these defaults are set by
``import pagedkv`` (and so by the ``pagedkv`` command), before anything of pagedkv imports
torch; :mod:`pagedkv.engine.cpu_runtime` applies the rest at engine start-up.

- ``GOMP_SPINCOUNT`` (torch's CPU build uses GNU OpenMP, libgomp): how long an OpenMP thread
  that has finished its share of a parallel region spins before it sleeps. libgomp's default
  (300,000 spins, when ``OMP_WAIT_POLICY`` is unset) keeps a thread spinning through the short
  gaps between the thousands of small parallel ops of a decode step, which is fast on an idle
  machine; but beside another busy process a spinning thread burns the CPU its descheduled
  partner needs, and every barrier waits for that partner. A bounded spin keeps most of the
  idle speed and degrades gracefully (the measurement: docs/perf.md,
  benchmarks/bench_threads_load.py). ``OMP_WAIT_POLICY=PASSIVE`` (no spin at all) cost 1.5-2x
  on an idle machine.
- The user's environment always wins: nothing is set when the user set ``GOMP_SPINCOUNT`` or
  ``OMP_WAIT_POLICY``, and nothing when torch was imported before pagedkv (too late to matter).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, MutableMapping
from pathlib import Path

#: libgomp spin count pagedkv sets when the user set none (docs/perf.md: the measurement).
DEFAULT_GOMP_SPINCOUNT = "1000"
#: The variables that, when the user set any of them, make pagedkv leave OpenMP's wait alone.
USER_WAIT_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def apply_openmp_env_defaults(
    environ: MutableMapping[str, str] | None = None,
    loaded_modules: Iterable[str] | None = None,
) -> dict[str, str]:
    """Set pagedkv's OpenMP wait default in ``environ`` where the user set none.

    Args:
        environ: the environment to update; None = ``os.environ``.
        loaded_modules: names of imported modules; None = ``sys.modules``. When ``torch`` is
            among them OpenMP has read its environment already, and nothing is set.

    Returns:
        The variables set (empty when the user's settings or an early torch import won).
    """
    environ = os.environ if environ is None else environ
    loaded = sys.modules if loaded_modules is None else loaded_modules
    if "torch" in loaded or any(name in environ for name in USER_WAIT_VARIABLES):
        return {}
    applied = {"GOMP_SPINCOUNT": DEFAULT_GOMP_SPINCOUNT}
    environ.update(applied)
    return applied


def cgroup_cpu_limit(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (``cpu.max`` of cgroup v2, or
    ``cpu.cfs_quota_us / cpu.cfs_period_us`` of v1), or None when unlimited or unknown."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # v2: walk up from the process's cgroup, the tightest wins
            here = root / rel
            while True:
                limits.append(_read_v2_quota(here / "cpu.max"))
                if here == root or root not in here.parents:
                    break
                here = here.parent
        elif "cpu" in controllers.split(","):
            base = root / "cpu" / rel
            if not base.is_dir():
                base = root / controllers / rel
            limits.append(_read_v1_quota(base))
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None


def _read_v2_quota(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def _read_v1_quota(base: Path) -> float | None:
    try:
        quota = int((base / "cpu.cfs_quota_us").read_text())
        period = int((base / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cpu_count(
    affinity: set[int] | None = None, cpu_limit: float | bool | None = True
) -> int:
    """CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota (rounded
    up: a quota of 1.5 CPUs still runs 2 threads part of the time), at least 1.

    Args:
        affinity: the CPU set; None = ``os.sched_getaffinity(0)`` (``os.cpu_count()`` where
            that does not exist).
        cpu_limit: the quota in CPUs; True = read it (:func:`cgroup_cpu_limit`), None = none.
    """
    if affinity is None:
        try:
            count = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            count = os.cpu_count() or 1
    else:
        count = len(affinity)
    limit = cgroup_cpu_limit() if cpu_limit is True else cpu_limit
    if limit is not None:
        count = min(count, math.ceil(limit))
    return max(1, count)
