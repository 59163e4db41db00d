"""Thread settings under load: the same short generate run idle and beside one CPU burner.

    .venv/bin/python benchmarks/bench_threads_load.py [--prompts 4] [--max-tokens 32]
        [--pairs 3] [--candidates default spin=300000 spin=0 threads=1 ...]

Each candidate is a thread count and/or an OpenMP setting, applied in a fresh subprocess
(OpenMP reads its environment once, when torch loads): ``default`` (pagedkv's defaults, nothing
set), ``threads=N`` (``--num-threads N``), ``spin=N`` (``GOMP_SPINCOUNT=N``: how long libgomp's
idle threads spin before they sleep; libgomp's own default is 300000, and 0 is what
``OMP_WAIT_POLICY=PASSIVE`` means), ``passive`` / ``active`` (``OMP_WAIT_POLICY``), and
combinations joined by ``+`` (``threads=2+spin=0``). Each subprocess builds the engine, warms
up, then ``--pairs`` times: times ``LLM.generate`` on the first ``--prompts`` chats of
benchmarks/data/chat_prompts.jsonl (greedy, ``--max-tokens`` each, ignore_eos) idle, then the
same beside one more process spinning on the CPU (a bounded busy loop, killed afterwards, ending
itself in any case), so that the two runs of a pair see the same background load. A run past
``--max-run-s`` ends the candidate (counted at the cap). Prints the medians, the median
loaded / idle ratio and the load average of each pair; writes
benchmarks/results/threads_load.json. Results and the command: docs/perf.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BURNER = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass\n"


def candidate_settings(name: str) -> tuple[dict[str, str], list[str]]:
    """``(environment, pagedkv flags)`` of one candidate name (see the module docstring)."""
    env: dict[str, str] = {}
    flags: list[str] = []
    for part in name.split("+"):
        key, _, value = part.partition("=")
        if key == "default":
            continue
        if key == "threads":
            flags += ["--num-threads", value]
        elif key == "spin":
            env["GOMP_SPINCOUNT"] = value
        elif key == "passive":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        elif key == "active":
            env["OMP_WAIT_POLICY"] = "ACTIVE"
        else:
            raise SystemExit(f"unknown candidate part {part!r}")
    return env, flags


def run_child(args: argparse.Namespace, name: str) -> dict:
    """Run one candidate's child process; returns its JSON result (``pairs``: [idle, loaded]
    seconds, None for a run past ``--max-run-s``)."""
    extra_env, flags = candidate_settings(name)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")
    }
    env.update(extra_env)
    cmd = [sys.executable, __file__, "--child", "--prompts", str(args.prompts)]
    cmd += ["--max-tokens", str(args.max_tokens), "--pairs", str(args.pairs)]
    cmd += ["--max-run-s", str(args.max_run_s), *flags]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"{name}: child failed:\n{exc.stderr[-3000:]}") from None
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(args: argparse.Namespace, flags: list[str]) -> int:
    """The timed workload (runs in the subprocess): ``--pairs`` times an idle run, then the same
    run beside a burner process, so that each pair sees the same background load."""
    import threading

    from pagedkv.engine.llm import LLM
    from pagedkv.entrypoints.generate import load_prompts
    from pagedkv.sampling_params import SamplingParams

    num_threads = int(flags[flags.index("--num-threads") + 1]) if flags else None
    conversations = [m for m, _ in load_prompts(HERE / "data" / "chat_prompts.jsonl")]
    llm = LLM(num_threads=num_threads)
    warmup = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(conversations[:2], warmup, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    pairs: list[list] = []

    def give_up(pair: list) -> None:
        """A run past --max-run-s: report what there is (None for that run) and exit."""
        idle = pair[0] if pair else None
        print(json.dumps({"pairs": [*pairs, [idle, None, os.getloadavg()[0]]]}))
        sys.stdout.flush()
        os._exit(0)

    def timed_run(pair: list) -> float:
        llm.engine.kv_cache_manager.reset_prefix_cache()
        timer = threading.Timer(args.max_run_s, give_up, (pair,))
        timer.start()
        start = time.perf_counter()
        llm.generate(conversations[: args.prompts], params, use_tqdm=False)
        timer.cancel()
        return time.perf_counter() - start

    for _ in range(args.pairs):
        pair: list = []
        pair.append(timed_run(pair))
        burner = subprocess.Popen([sys.executable, "-c", BURNER, str(args.max_run_s + 10)])
        try:
            time.sleep(0.3)  # the burner is spinning
            pair.append(timed_run(pair))
        finally:
            burner.kill()
            burner.wait()
        pairs.append([*pair, os.getloadavg()[0]])
        print(json.dumps({"pairs": pairs}), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=3, help="idle + loaded runs per candidate")
    parser.add_argument(
        "--candidates",
        nargs="+",
        default=["default", "spin=300000", "spin=0", "threads=1"],
    )
    parser.add_argument("--max-run-s", type=float, default=120.0, help="cap on any one run")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "threads_load.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        return child(args, rest)
    rows = []
    print("median seconds of each candidate's runs; ratio = median of loaded / idle per pair")
    print(f"{'candidate':20s} {'idle s':>7s} {'loaded s':>9s} {'ratio':>6s}  load avg, each pair")
    for name in args.candidates:
        pairs = run_child(args, name)["pairs"]
        cap = args.max_run_s  # a run that gave up counts as the cap (a lower bound)
        idle = statistics.median(p[0] or cap for p in pairs)
        loaded = statistics.median(p[1] or cap for p in pairs)
        ratio = statistics.median((p[1] or cap) / (p[0] or cap) for p in pairs)
        gave_up = " (a run hit the cap)" if any(None in p for p in pairs) else ""
        loads = " ".join(f"{p[2]:.1f}" for p in pairs)
        print(f"{name:20s} {idle:7.2f} {loaded:9.2f} {ratio:6.2f}  {loads}{gave_up}", flush=True)
        rows.append({"candidate": name, "pairs": pairs, "idle_s": idle, "loaded_s": loaded})
    args.json.parent.mkdir(exist_ok=True)
    text = json.dumps({"args": vars(args), "rows": rows}, indent=2, default=str)
    args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
