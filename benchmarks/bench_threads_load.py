"""Thread settings under load: the same short generate run idle and beside one CPU burner.

    .venv/bin/python benchmarks/bench_threads_load.py [--prompts 8] [--max-tokens 64]
        [--candidates default threads=1 spin=0 spin=300000 ...]

Each candidate is a thread count and/or an OpenMP setting, applied in a fresh subprocess
(OpenMP reads its environment once, when torch loads): ``default`` (pagedkv's defaults, nothing
set), ``threads=N`` (``--num-threads N``), ``spin=N`` (``GOMP_SPINCOUNT=N``: how long libgomp's
idle threads spin before they sleep; libgomp's own default is 300000, and 0 is what
``OMP_WAIT_POLICY=PASSIVE`` means), ``passive`` (``OMP_WAIT_POLICY=PASSIVE``), and combinations
joined by ``+`` (``threads=2+spin=0``). Each subprocess builds the engine, warms up, then times
``LLM.generate`` on the first ``--prompts`` chats of benchmarks/data/chat_prompts.jsonl
(greedy, ``--max-tokens`` each, ignore_eos). Every candidate runs idle and then loaded, where
"loaded" is one more process spinning on the CPU for the run's duration (a bounded busy loop,
killed afterwards, ending itself after ``--burner-max-s`` in any case). Prints each time, the
loaded / idle ratio and the load average; writes benchmarks/results/threads_load.json.
Results and the command: docs/perf.md.
"""

from __future__ import annotations

import argparse
import json
import os
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


def run_child(args: argparse.Namespace, name: str, timeout_s: float) -> float | None:
    """Seconds of the timed generate in a fresh process; None when it ran past timeout_s."""
    extra_env, flags = candidate_settings(name)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")
    }
    env.update(extra_env)
    cmd = [sys.executable, __file__, "--child", "--prompts", str(args.prompts)]
    cmd += ["--max-tokens", str(args.max_tokens), *flags]
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=True
        )
    except subprocess.TimeoutExpired:
        return None
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"{name}: child failed:\n{exc.stderr[-3000:]}") from None
    return json.loads(done.stdout.strip().splitlines()[-1])["elapsed_s"]


def child(args: argparse.Namespace, flags: list[str]) -> int:
    """The timed workload (runs in the subprocess)."""
    from pagedkv.engine.llm import LLM
    from pagedkv.entrypoints.generate import load_prompts
    from pagedkv.sampling_params import SamplingParams

    num_threads = int(flags[flags.index("--num-threads") + 1]) if flags else None
    conversations = [m for m, _ in load_prompts(HERE / "data" / "chat_prompts.jsonl")]
    llm = LLM(num_threads=num_threads)
    warmup = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(conversations[:2], warmup, use_tqdm=False)
    llm.engine.kv_cache_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    import torch

    start = time.perf_counter()
    llm.generate(conversations[: args.prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print(json.dumps({"elapsed_s": elapsed, "threads": torch.get_num_threads()}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--candidates",
        nargs="+",
        default=["default", "spin=300000", "passive", "threads=1"],
    )
    parser.add_argument("--timeout-factor", type=float, default=10.0, help="x idle time")
    parser.add_argument("--max-run-s", type=float, default=300.0, help="cap on any one run")
    parser.add_argument("--burner-max-s", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "threads_load.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        return child(args, rest)
    rows = []
    print(f"{'candidate':24s} {'idle s':>8s} {'loaded s':>9s} {'ratio':>6s}  load avg")
    for name in args.candidates:
        load_idle = os.getloadavg()[0]
        idle = run_child(args, name, timeout_s=args.max_run_s)
        if idle is None:
            print(f"{name:24s} idle run past {args.max_run_s:.0f} s; skipped", flush=True)
            continue
        burner = subprocess.Popen([sys.executable, "-c", BURNER, str(args.burner_max_s)])
        try:
            time.sleep(0.5)  # let it get its CPU
            load_loaded = os.getloadavg()[0]
            loaded = run_child(
                args, name, timeout_s=min(args.timeout_factor * idle + 30, args.max_run_s)
            )
        finally:
            burner.kill()
            burner.wait()
        ratio = f"{loaded / idle:6.2f}" if loaded is not None else f">{args.timeout_factor:.0f}"
        loaded_text = f"{loaded:9.2f}" if loaded is not None else "  timeout"
        print(
            f"{name:24s} {idle:8.2f} {loaded_text} {ratio:>6s}  "
            f"{load_idle:.2f} / {load_loaded:.2f}",
            flush=True,
        )
        rows.append(
            {
                "candidate": name,
                "idle_s": idle,
                "loaded_s": loaded,
                "loadavg_idle": load_idle,
                "loadavg_loaded": load_loaded,
            }
        )
    args.json.parent.mkdir(exist_ok=True)
    args.json.write_text(
        json.dumps({"args": vars(args), "rows": rows}, indent=2, default=str) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
