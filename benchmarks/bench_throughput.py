"""Offline throughput, pagedkv vs Hugging Face generate, on the committed 64-chat workload.

    .venv/bin/python benchmarks/bench_throughput.py [extra `pagedkv bench throughput` flags]
    .venv/bin/python benchmarks/bench_throughput.py --attention-backend torch   # one backend

Runs both backends in one process on benchmarks/data/chat_prompts.jsonl (64 chat prompts, 35-464
tokens after the chat template, 8,079 prompt tokens), 128 output tokens each with ignore_eos,
greedy, bf16 by default; prints output tokens/s, time to first token and the ratio, and writes
benchmarks/results/throughput.json (pagedkv's attention backend and block size in its extra
fields; ``--attention-backend`` defaults to auto). Results and the command are recorded in
docs/engine.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pagedkv.entrypoints.cli import main

HERE = Path(__file__).resolve().parent


if __name__ == "__main__":
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    argv = [
        "bench",
        "throughput",
        "--backend",
        "both",
        "--input",
        str(HERE / "data" / "chat_prompts.jsonl"),
        "--max-tokens",
        "128",
        "--json",
        str(results / "throughput.json"),
        *sys.argv[1:],
    ]
    sys.exit(main(argv))
