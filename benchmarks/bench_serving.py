"""Serving benchmark: a bounded load on an OpenAI-compatible server at several concurrencies.

For each concurrency (default 1, 8, 32, 64) it sends a fixed number of streamed chat requests
(temperature 0, a fixed max_tokens with ignore_eos so that every request does the same work),
keeping exactly ``concurrency`` requests in flight, and reports requests/s, output tokens/s, and
the p50/p90/p99 of time to first token (TTFT) and inter-token latency (ITL, the gaps between
streamed tokens). The load itself is ``pagedkv bench serving``'s
(:mod:`pagedkv.entrypoints.bench_serving`); this script adds the server and the sweep.

By default it starts its own `pagedkv serve` on a free loopback port (and stops it afterwards);
``--url`` measures a server that is already running instead (any OpenAI-compatible server: vLLM,
llama.cpp's, ...; for one load at one concurrency use ``pagedkv bench serving``).

    python benchmarks/bench_serving.py                            # own server, default model
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000
    python benchmarks/bench_serving.py --server-args "--dtype bfloat16 --max-num-seqs 64"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys

import httpx

from _server import own_server
from pagedkv.entrypoints.bench_serving import make_prompts, run_benchmark


def run_level(
    url: str, model: str, concurrency: int, num_requests: int, max_tokens: int, timeout: float
) -> dict:
    """``num_requests`` requests with ``concurrency`` in flight; returns the summary."""
    summary = run_benchmark(
        base_url=url,
        model=model,
        prompts=make_prompts(num_requests),
        output_len=max_tokens,
        max_concurrency=concurrency,
        timeout=timeout,
    )
    summary["concurrency"] = concurrency
    return summary


def format_table(summaries: list[dict]) -> str:
    header = (
        "| concurrency | requests | failed | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) "
        "| ITL p50 / p90 / p99 (ms) |"
    )
    lines = [header, "|---:|---:|---:|---:|---:|---|---|"]
    for s in summaries:
        ttft, itl = s["ttft_ms"], s["itl_ms"]
        lines.append(
            f"| {s['concurrency']} | {s['num_prompts']} | {s['failed']} "
            f"| {s['request_throughput']:.2f} | {s['output_throughput']:.1f} "
            f"| {ttft['median']:.0f} / {ttft['p90']:.0f} / {ttft['p99']:.0f} "
            f"| {itl['median']:.0f} / {itl['p90']:.0f} / {itl['p99']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server; default: start one")
    parser.add_argument(
        "--server-args",
        default="",
        help="extra arguments for the `pagedkv serve` this script starts",
    )
    parser.add_argument(
        "--concurrency",
        default="1,8,32,64",
        help="comma-separated concurrency levels (default 1,8,32,64)",
    )
    parser.add_argument(
        "--num-requests", type=int, default=64, help="requests per concurrency level (default 64)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="output tokens per request (ignore_eos; default 32)",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds one request may take (default 600)"
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--json", dest="json_path", help="also write the results here")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if min(levels) < 1 or args.num_requests < 1 or args.max_tokens < 1:
        parser.error("concurrency, --num-requests and --max-tokens must be >= 1")

    with contextlib.ExitStack() as stack:
        if args.url:
            url = args.url.rstrip("/")
        else:
            server = own_server(shlex.split(args.server_args), args.startup_timeout)
            url = stack.enter_context(server).url
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        # Warm-up: first-call costs (allocations, lazy init) stay out of the numbers.
        run_level(url, model, 1, 1, 4, args.timeout)
        summaries = []
        for concurrency in levels:
            summary = run_level(
                url, model, concurrency, args.num_requests, args.max_tokens, args.timeout
            )
            summary["load_average_1m"] = os.getloadavg()[0]  # the CPU is shared: context
            summaries.append(summary)
            print(
                f"concurrency {concurrency:>3}: {summary['request_throughput']:.2f} req/s, "
                f"{summary['output_throughput']:.1f} tok/s, "
                f"TTFT p50 {summary['ttft_ms']['median']:.0f} ms, "
                f"ITL p50 {summary['itl_ms']['median']:.0f} ms, failed {summary['failed']}, "
                f"load average {summary['load_average_1m']:.1f}",
                file=sys.stderr,
                flush=True,
            )
    print(format_table(summaries))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(
                {"model": model, "max_tokens": args.max_tokens, "levels": summaries}, f, indent=2
            )
    return 1 if any(s["failed"] for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
