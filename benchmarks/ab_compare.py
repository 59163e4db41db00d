"""Run one benchmark command against an earlier revision and the working tree, alternating.

    .venv/bin/python benchmarks/ab_compare.py --rev 750adb8 [--rounds 2] -- \
        benchmarks/bench_step_cost.py --contexts 256 2048 8192
    .venv/bin/python benchmarks/ab_compare.py --rev 750adb8 -- -m pagedkv.entrypoints.cli \
        bench throughput --backend pagedkv --input benchmarks/data/chat_prompts.jsonl \
        --max-tokens 128

The revision is checked out once into a temporary git worktree; each round runs the command with
this interpreter, once with that revision's ``src`` first on ``PYTHONPATH`` ("before") and once
with the working tree's ("after"), "before" first in odd rounds and "after" first in even ones,
so both share the machine's state of the moment (side by side, as docs/perf.md asks of speed
figures); each run's label gives the load average when it started and a line after it the
load average and the share of CPU time the hypervisor stole meanwhile (a busy machine, or busy
neighbours on its host, show: benchmarks/_machine.py). The
command's scripts and data come from the working tree:
it must use only APIs both revisions have. Outputs are printed as they come, labelled; a run
that exits with an error is reported and the rounds go on (the exit status is the first error).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _machine import BusyMeter

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="the earlier revision (a commit or tag)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then python arguments")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    with tempfile.TemporaryDirectory(prefix="pagedkv-ab-") as tmp:
        tree = Path(tmp) / "before"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), args.rev],
            check=True,
        )
        status = 0
        try:
            sides = [("before", tree / "src"), ("after", ROOT / "src")]
            for round_ in range(1, args.rounds + 1):
                # odd rounds run "before" first, even rounds "after" first: a machine that
                # warms or fills up during a round favours neither side
                for label, src in sides if round_ % 2 else sides[::-1]:
                    env = {**os.environ, "PYTHONPATH": str(src)}
                    where = args.rev if label == "before" else "working tree"
                    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
                    print(f"=== round {round_}, {label} ({where}); load average {load}", flush=True)
                    meter = BusyMeter()
                    result = subprocess.run([sys.executable, *command], cwd=ROOT, env=env)
                    print(f"=== {label}: {meter.describe()}", flush=True)
                    if result.returncode:  # reported; the rounds go on (a benchmark may exit
                        # 1 for what it checks, e.g. bench_spec_decode's tokens)
                        print(f"=== {label} exited with status {result.returncode}", flush=True)
                        status = status or result.returncode
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False
            )
    return status


if __name__ == "__main__":
    sys.exit(main())
