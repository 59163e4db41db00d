"""n samples of one prompt, with the fork and without it, on the real engine and model.

One run compares, on the same engine settings and prompt (``--prompt-len`` token ids, seeded):

  fork         one request with ``SamplingParams(n=N)``: the parent computes all its prompt but
               the last token, then its N - 1 siblings fork its blocks (copy-on-write of the
               shared partial block); the path since the fork (docs/core.md, "Fork and
               copy-on-write")
  independent  N requests of n = 1, request i seeded as sample i would be
               (``params.for_sample(i)``), prefix caching on: the path before the fork
  no-cache     the same N requests with prefix caching off: N full copies (skip it with
               ``--no-baseline-without-cache``)

Measured per path, from the engine's own calls (``engine.scheduler.schedule`` is wrapped):

  peak blocks     KV blocks held right after a step's schedule() (its allocations made, nothing
                  freed yet), the most over the run
  prefill tokens  tokens computed at prompt positions (the scheduled tokens below each
                  request's prompt length), summed over the requests
  total tokens    every scheduled token (prefill + decode)
  steps, forks, CoW copies (the scheduler's num_forks / num_cow_copies), end-to-end seconds
  (add_request to the last output, wall clock; with ``--repeats R`` the paths run R times,
  interleaved, and the median and range are shown: the counts are the same every time), CPU
  seconds of the process over the same span (all threads: steadier than wall time on a
  machine shared with other jobs), and
  whether every sample's tokens equal those of the independent path (in float32 they do; in
  bfloat16 a batch of another shape rounds differently and the samples drift apart)

Expected for the fork path: peak blocks = the prompt's full blocks once + N x (the copied
partial block + the output's blocks); prefill tokens = prompt_len - 1 + N.

    .venv/bin/python benchmarks/bench_fork.py            # 8 x (1,000-token prompt + 128 out)
    .venv/bin/python benchmarks/bench_fork.py --n 4 --prompt-len 500 --max-tokens 64 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from pagedkv.cpu_caps import cpu_model_name
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sampling_params import SamplingParams

PATHS = ("fork", "independent", "no-cache")


@dataclasses.dataclass(slots=True)
class PathResult:
    """What one path did (see the module docstring)."""

    path: str
    peak_blocks: int
    prefill_tokens: int
    total_tokens: int
    num_steps: int
    num_forks: int
    num_cow_copies: int
    e2e_s: float
    cpu_s: float
    samples: list[list[int]]

    def row(self) -> dict[str, Any]:
        """The result without the sampled tokens."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "samples"}


def prompt_token_ids(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """``num_tokens`` token ids drawn from ``[1, vocab_size)`` (deterministic in ``seed``)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, vocab_size) for _ in range(num_tokens)]


def run_path(engine: LLMEngine, path: str, prompt: list[int], params: SamplingParams) -> PathResult:
    """Run one path to the end on a fresh ``engine``; see the module docstring."""
    scheduler = engine.scheduler
    kv = engine.kv_cache_manager
    schedule = scheduler.schedule
    seen = {"peak": 0, "prefill": 0, "total": 0, "steps": 0}
    num_prompt = len(prompt)

    def counting():
        out = schedule()
        seen["peak"] = max(seen["peak"], kv.num_blocks - 1 - kv.num_free_blocks)
        seen["total"] += out.total_num_scheduled_tokens
        seen["steps"] += bool(out.total_num_scheduled_tokens)
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            start = scheduler.get_request(request_id).num_computed_tokens - num_tokens
            seen["prefill"] += max(0, min(num_tokens, num_prompt - start))
        return out

    scheduler.schedule = counting
    try:
        started = time.perf_counter()
        cpu_started = time.process_time()
        if path == "fork":
            engine.add_request("s", prompt, params)
        else:
            for i in range(params.n):
                engine.add_request(f"s{i}", prompt, params.for_sample(i))
        finals: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finals[output.request_id] = output
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
    finally:
        scheduler.schedule = schedule
    if path == "fork":
        samples = [list(c.token_ids) for c in finals["s"].outputs]
    else:
        samples = [list(finals[f"s{i}"].outputs[0].token_ids) for i in range(params.n)]
    stats = engine.get_stats().scheduler
    return PathResult(
        path,
        seen["peak"],
        seen["prefill"],
        seen["total"],
        seen["steps"],
        stats.num_forks,
        stats.num_cow_copies,
        elapsed,
        cpu,
        samples,
    )


def compare(
    make_engine: Callable[[bool], LLMEngine],
    prompt: list[int],
    params: SamplingParams,
    paths: tuple[str, ...] = PATHS,
) -> dict[str, PathResult]:
    """Each of ``paths`` on a fresh engine from ``make_engine(enable_prefix_caching)``."""
    return {path: run_path(make_engine(path != "no-cache"), path, prompt, params) for path in paths}


def expected_fork_blocks(prompt_len: int, max_tokens: int, n: int, block_size: int) -> int:
    """The fork path's peak: the computed prompt's full blocks once, plus per sample its blocks
    from the fork point on (the copied partial block, or a new one on a block boundary, and the
    output's)."""
    fork_at = prompt_len - 1
    shared = fork_at // block_size
    per_sample = -(-(prompt_len + max_tokens - 1) // block_size) - shared
    return shared + n * per_sample


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8, help="samples of the prompt")
    parser.add_argument("--prompt-len", type=int, default=1000, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per sample")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="auto", help="auto (default), float32, bfloat16")
    parser.add_argument("--num-threads", type=int, default=None, help="default: the engine's")
    parser.add_argument("--num-blocks", type=int, default=None, help="default: the engine's")
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0, help="prompt ids and sampling seed")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every path (e2e median)")
    parser.add_argument(
        "--no-baseline-without-cache",
        action="store_true",
        help="skip the N-copies path (prefix caching off)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if min(args.n, args.prompt_len, args.max_tokens, args.block_size, args.repeats) < 1:
        parser.error("--n, --prompt-len, --max-tokens, --block-size and --repeats must be >= 1")
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        num_threads=args.num_threads,
        max_model_len=args.prompt_len + args.max_tokens,
        max_num_seqs=max(64, args.n),
    )
    first = LLMEngine(config)
    loaded = first.loaded_model
    vocab_size = first.model_config.vocab_size
    dtype = first.config.model_config.dtype
    num_blocks = first.kv_cache_config.num_blocks
    made = [first]  # the first path runs on it (the engines are not kept: each holds a pool)
    del first

    def make_engine(enable_prefix_caching: bool) -> LLMEngine:
        engine = made.pop() if made and enable_prefix_caching else None
        if engine is None:
            engine = LLMEngine(
                dataclasses.replace(config, enable_prefix_caching=enable_prefix_caching),
                loaded_model=loaded,
            )
        return engine

    prompt = prompt_token_ids(args.prompt_len, vocab_size, args.seed)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=True,
    )
    paths = PATHS[:2] if args.no_baseline_without_cache else PATHS
    runs = [compare(make_engine, prompt, params, paths) for _ in range(args.repeats)]
    results = runs[0]
    e2e = {path: sorted(run[path].e2e_s for run in runs) for path in paths}
    cpu = {path: statistics.median(run[path].cpu_s for run in runs) for path in paths}
    expected = expected_fork_blocks(args.prompt_len, args.max_tokens, args.n, args.block_size)
    same = {
        path: r.samples == results["independent"].samples
        for path, r in results.items()
        if path != "independent"
    }
    import os

    import torch

    header = {
        "cpu": cpu_model_name(),
        "torch_threads": torch.get_num_threads(),
        "dtype": dtype,
        "model": loaded.source,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "num_blocks": num_blocks,
        "expected_fork_peak_blocks": expected,
        "expected_fork_prefill_tokens": args.prompt_len - 1 + args.n,
        "repeats": args.repeats,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    if args.json:
        report = {
            **header,
            "paths": {
                p: {
                    **r.row(),
                    "e2e_s": statistics.median(e2e[p]),
                    "e2e_s_all": e2e[p],
                    "cpu_s": cpu[p],
                }
                for p, r in results.items()
            },
            "same_samples_as_independent": same,
        }
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{header['cpu']}, {header['torch_threads']} threads, {header['dtype']}; "
        f"{args.n} samples of a {args.prompt_len}-token prompt, {args.max_tokens} output tokens "
        f"each, blocks of {args.block_size} ({header['num_blocks']} in the pool); "
        f"{args.repeats} run(s), load average {header['load_average_1m']}"
    )
    print(
        f"{'path':>12} {'peak blocks':>11} {'prefill tok':>11} {'total tok':>9} {'steps':>5} "
        f"{'forks':>5} {'CoW':>4} {'e2e s (median, range)':>22} {'CPU s':>6}  same samples"
    )
    for path, r in results.items():
        times = e2e[path]
        spread = f"{statistics.median(times):.2f} ({times[0]:.2f}-{times[-1]:.2f})"
        print(
            f"{path:>12} {r.peak_blocks:>11} {r.prefill_tokens:>11} {r.total_tokens:>9} "
            f"{r.num_steps:>5} {r.num_forks:>5} {r.num_cow_copies:>4} {spread:>22} "
            f"{cpu[path]:>6.1f}  "
            f"{same.get(path, '-')}"
        )
    print(
        f"expected for fork: {expected} peak blocks ({args.prompt_len - 1} // {args.block_size} "
        f"shared + {args.n} x own), {args.prompt_len - 1 + args.n} prefill tokens"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
