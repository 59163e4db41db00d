"""Tensor parallel against one process, side by side: decode tokens/s of one batch.

For each size in ``--tp`` (default ``1 3``: SmolLM2-135M has 9 query / 3 KV heads, so 3 is its
smallest size above 1), an engine is built, ``pagedkv bench latency``'s measurement runs on it
(``--batch-size`` random prompts of ``--input-len`` tokens, ``--output-len`` greedy tokens each,
warm-up run first), and the engine is shut down; the sizes alternate for ``--rounds`` rounds so
that a busy machine slows each alike. Reported per size: the median decode step (ms), decode
tokens/s (batch / median step), and the ratio to the first size. Threads per rank: the usable
CPUs / tp (at least 1) unless ``--num-threads`` is given.

    python benchmarks/bench_tensor_parallel.py                        # tp 1 vs 3, bf16
    python benchmarks/bench_tensor_parallel.py --tp 1 3 --dtype float32 --output tp.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

from pagedkv.cpu_env import available_cpu_count
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.entrypoints.bench_latency import measure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3], help="sizes (1 3)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (2)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-iters", type=int, default=1, help="timed runs per round (1)")
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--output", default=None, help="write the JSON report here")
    args = parser.parse_args(argv)

    base = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=args.batch_size,
        num_threads=args.num_threads,
    )
    steps: dict[int, list[float]] = {tp: [] for tp in args.tp}
    for _ in range(args.rounds):
        for tp in args.tp:
            engine = LLMEngine(dataclasses.replace(base, tensor_parallel_size=tp))
            try:
                report = measure(engine, args)
            finally:
                engine.shutdown()
            steps[tp].append(report["decode_step"]["median_ms"])
            print(f"tp={tp}: decode step median {steps[tp][-1]:.2f} ms", file=sys.stderr)
    cpus = available_cpu_count()
    rows = []
    first = None
    for tp in args.tp:
        step_ms = statistics.median(steps[tp])
        tok_s = args.batch_size / step_ms * 1000.0
        first = first or tok_s
        threads = args.num_threads or max(1, cpus // tp)
        rows.append(
            {
                "tp": tp,
                "threads_per_rank": threads,
                "decode_step_ms": step_ms,
                "decode_tokens_per_s": tok_s,
                "ratio_to_first": tok_s / first,
            }
        )
    print(
        f"{cpus} usable CPUs, {args.dtype}, batch {args.batch_size}, "
        f"{args.input_len} + {args.output_len} tokens, {args.rounds} rounds"
    )
    print("tp  threads/rank  decode step ms  decode tok/s  ratio")
    for r in rows:
        print(
            f"{r['tp']:<3} {r['threads_per_rank']:<13} {r['decode_step_ms']:<15.2f} "
            f"{r['decode_tokens_per_s']:<13.1f} {r['ratio_to_first']:.2f}"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
