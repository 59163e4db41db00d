"""What else the machine did while a benchmark measured: the 1-minute load average and the
share of CPU time the hypervisor gave to other guests (steal time), so a figure says when the
machine was busy.

The load average counts this machine's runnable tasks only; on a cloud VM the neighbours that
share its physical cores show up as *steal*: time a virtual CPU wanted to run and the host ran
someone else (``/proc/stat``'s eighth CPU field, in clock ticks, summed over the CPUs). A run
whose steal share is a few percent or more ran on a slower machine than one at 0%, whatever
its load average said (on this project's 2-core EPYC VMs it moved between 0 and 15% within an
hour).

    meter = BusyMeter()          # at the start of a run
    ...
    meter.stop()                 # {"load_1m": [before, after], "steal_pct": 3.2}
    meter.describe()             # "load 0.85 -> 1.93, steal 3.2%"
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

#: where the kernel's CPU time counters are (Linux)
PROC_STAT = Path("/proc/stat")


def cpu_ticks(path: Path = PROC_STAT) -> tuple[int, int] | None:
    """``(steal, total)`` clock ticks of all CPUs since boot from ``path``'s ``cpu`` line
    (total: user, nice, system, idle, iowait, irq, softirq, steal; guest time is already in
    user and nice), or None where the file or the field is missing (not Linux, an old kernel)."""
    try:
        line = path.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = line.split()
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    try:
        ticks = [int(x) for x in fields[1:9]]
    except ValueError:
        return None
    return ticks[7], sum(ticks)


def steal_pct(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Percent of the CPU time between two :func:`cpu_ticks` readings that was stolen (None
    where either reading is missing or no tick passed)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round(100.0 * (after[0] - before[0]) / (after[1] - before[1]), 1)


def load_1m() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


class BusyMeter:
    """The load average and the steal share over one run: built at its start, :meth:`stop`
    at its end (the readings of the first call are kept)."""

    def __init__(self, path: Path = PROC_STAT) -> None:
        self._path = path
        self._load_before = load_1m()
        self._ticks = cpu_ticks(path)
        self.result: dict | None = None

    def stop(self) -> dict:
        """``{"load_1m": [before, after], "steal_pct": float | None}``."""
        if self.result is None:
            self.result = {
                "load_1m": [self._load_before, load_1m()],
                "steal_pct": steal_pct(self._ticks, cpu_ticks(self._path)),
            }
        return self.result

    def describe(self) -> str:
        """``load 0.85 -> 1.93, steal 3.2%`` (``?`` for what is not known)."""
        result = self.stop()
        before, after = ("?" if x is None else f"{x:.2f}" for x in result["load_1m"])
        steal = result["steal_pct"]
        return f"load {before} -> {after}, steal {'?' if steal is None else f'{steal:.1f}%'}"


class StealTally:
    """The steal share over many separate intervals (one leg's turns, say), summed: each
    interval is a ``with tally.measure():`` block; :attr:`pct` is the stolen share of all their
    CPU time together (None before any interval or where /proc/stat is unreadable)."""

    def __init__(self, path: Path = PROC_STAT) -> None:
        self._path = path
        self._steal = 0
        self._total = 0
        self._known = True

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        before = cpu_ticks(self._path)
        try:
            yield
        finally:
            after = cpu_ticks(self._path)
            if before is None or after is None:
                self._known = False
            else:
                self._steal += after[0] - before[0]
                self._total += after[1] - before[1]

    @property
    def pct(self) -> float | None:
        if not self._known or self._total <= 0:
            return None
        return round(100.0 * self._steal / self._total, 1)
