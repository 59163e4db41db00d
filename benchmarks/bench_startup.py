"""Engine start-up on a GGUF file: a first start (the tokenizer never converted) and a later one.

    python benchmarks/bench_startup.py [--model FILE] [--repeats 2] [--threads 2] [--json F]
    python benchmarks/ab_compare.py --rev REV --rounds 2 -- benchmarks/bench_startup.py \
        --model FILE

Each repeat makes a new cache folder (``PAGEDKV_CACHE_DIR``) holding only what pagedkv keeps per
machine, not per file (a link to the compiled kernels of pagedkv's cache, a copy of
transformers' GGUF tables: benchmarks/_first_start.py), then builds the engine twice in fresh
processes: the **first start** converts the file's tokenizer and caches it, the **later
start** reads it back. The time is ``LLMEngine(config)`` alone (as bench_real_sizes.py's load
time: the Python and torch imports before it are not counted), in seconds. The file's page
cache is left as it is (read the file once before, as a later start finds it). Never in CI
(seconds per start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _first_start import seed_first_start_cache


def worker(model: str, threads: int) -> None:
    """Build the engine once and print ``{"startup_s": ...}``."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine

    config = EngineConfig(model=model, num_threads=threads, max_model_len=1024)
    start = time.perf_counter()
    engine = LLMEngine(config)
    startup_s = time.perf_counter() - start
    engine.shutdown()
    print(json.dumps({"startup_s": startup_s}), flush=True)


def start_once(model: str, threads: int, cache: Path) -> float:
    """One engine start in a fresh process with ``cache`` as pagedkv's cache folder (s)."""
    env = {**os.environ, "PAGEDKV_CACHE_DIR": str(cache)}
    command = [sys.executable, __file__, "--worker", "--model", model, f"--threads={threads}"]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["startup_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from pagedkv.config import cache_dir
    from pagedkv.model.loader import default_model_path

    model = args.model or str(default_model_path())
    if args.worker:
        worker(model, args.threads)
        return 0
    with open(model, "rb") as f:  # the page cache as a later start finds it
        while f.read(1 << 24):
            pass
    first: list[float] = []
    later: list[float] = []
    for repeat in range(1, args.repeats + 1):
        with tempfile.TemporaryDirectory(prefix="pagedkv-startup-") as folder:
            seed_first_start_cache(Path(folder), cache_dir())
            first.append(start_once(model, args.threads, Path(folder)))
            later.append(start_once(model, args.threads, Path(folder)))
        print(f"repeat {repeat}: first start {first[-1]:.2f} s, later start {later[-1]:.2f} s",
              flush=True)  # fmt: skip
    summary = {
        "model": model,
        "threads": args.threads,
        "load_average_1m": os.getloadavg()[0],
        "first_start_s": first,
        "later_start_s": later,
        "first_start_median_s": statistics.median(first),
        "later_start_median_s": statistics.median(later),
    }
    print(json.dumps(summary), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
