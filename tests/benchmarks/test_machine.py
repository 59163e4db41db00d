"""benchmarks/_machine.py: the steal share read from /proc/stat's ``cpu`` line (written
here), the load average beside it, and what is reported where the counters are missing."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def machine(import_benchmarks):
    return import_benchmarks("_machine")[0]


def stat(path: Path, user: int, idle: int, steal: int) -> Path:
    # user nice system idle iowait irq softirq steal guest guest_nice
    path.write_text(f"cpu  {user} 0 10 {idle} 0 0 0 {steal} 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    return path


def test_ticks_steal_and_total(machine, tmp_path):
    path = stat(tmp_path / "stat", user=100, idle=880, steal=10)
    assert machine.cpu_ticks(path) == (10, 1000)  # guest time is in user already: not added


def test_steal_share_between_readings(machine, tmp_path):
    path = tmp_path / "stat"
    meter = machine.BusyMeter(stat(path, user=100, idle=880, steal=10))
    stat(path, user=400, idle=1480, steal=110)  # 1000 ticks more, 100 of them stolen
    result = meter.stop()
    assert result["steal_pct"] == 10.0
    assert len(result["load_1m"]) == 2
    stat(path, user=900, idle=1480, steal=110)
    assert meter.stop()["steal_pct"] == 10.0  # the first stop's readings are kept
    assert "steal 10.0%" in meter.describe()


def test_missing_or_odd_counters_give_none(machine, tmp_path):
    assert machine.cpu_ticks(tmp_path / "absent") is None
    (tmp_path / "short").write_text("cpu 1 2 3\n")
    assert machine.cpu_ticks(tmp_path / "short") is None
    (tmp_path / "text").write_text("cpu a b c d e f g h\n")
    assert machine.cpu_ticks(tmp_path / "text") is None
    assert machine.steal_pct(None, (1, 2)) is None
    assert machine.steal_pct((1, 5), (1, 5)) is None  # no tick passed
    meter = machine.BusyMeter(tmp_path / "absent")
    assert meter.stop()["steal_pct"] is None
    assert "steal ?" in meter.describe()


def test_steal_tally_sums_separate_intervals(machine, tmp_path):
    path = stat(tmp_path / "stat", user=100, idle=880, steal=10)
    tally = machine.StealTally(path)
    assert tally.pct is None  # no interval yet
    with tally.measure():
        stat(path, user=200, idle=980, steal=10)  # 200 ticks, none stolen
    stat(path, user=5000, idle=980, steal=5000)  # between the intervals: not counted
    with tally.measure():
        stat(path, user=5100, idle=1080, steal=5200)  # 400 ticks, 200 stolen
    assert tally.pct == 33.3  # 200 of 600
    missing = machine.StealTally(tmp_path / "absent")
    with missing.measure():
        pass
    assert missing.pct is None
