"""Serving benchmark: a bounded load on an OpenAI-compatible server at several concurrencies.

For each concurrency (default 1, 8, 32, 64) it sends a fixed number of streamed chat requests
(temperature 0, a fixed max_tokens with ignore_eos so that every request does the same work),
keeping exactly ``concurrency`` requests in flight, and reports requests/s, output tokens/s, and
the p50/p90/p99 of time to first token (TTFT) and inter-token latency (ITL, the gaps between
streamed tokens).

By default it starts its own `pagedkv serve` on a free loopback port (and stops it afterwards);
``--url`` measures a server that is already running instead. Loopback only: the URL must point
at 127.0.0.1, ::1 or localhost.

    python benchmarks/bench_serving.py                            # own server, default model
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000
    python benchmarks/bench_serving.py --server-args "--dtype bfloat16 --max-num-seqs 64"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import numpy as np

LOOPBACK_HOSTS = {"127.0.0.1", "::1", "localhost"}

# A fixed prompt set: short questions and longer ones with context, so prompt lengths vary
# (40 to 179 tokens with the SmolLM2 chat template).
_QUESTIONS = [
    "What is a hash table?",
    "Explain how a CPU cache works.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "What does a compiler do?",
    "How do vaccines train the immune system?",
    "Summarise the plot of Hamlet.",
    "What is the difference between TCP and UDP?",
]
_CONTEXT = (
    "You are reviewing notes for a study group. The notes cover operating systems, networks, "
    "databases and a little history of computing. Keep answers short and concrete, give one "
    "example, and avoid jargon where a plain word will do. "
)


def make_prompts(num_requests: int) -> list[list[dict[str, str]]]:
    """``num_requests`` chat conversations, the same on every run."""
    conversations = []
    for i in range(num_requests):
        question = _QUESTIONS[i % len(_QUESTIONS)]
        context = _CONTEXT * (i % 4)  # 0..3 copies of the context
        messages = [{"role": "user", "content": f"{context}Question {i}: {question}"}]
        conversations.append(messages)
    return conversations


@dataclass(slots=True)
class RequestResult:
    ok: bool
    latency: float = 0.0  # seconds, send to last byte
    ttft: float = 0.0  # seconds, send to first content token
    itls: list[float] = field(default_factory=list)  # seconds between streamed tokens
    num_output_tokens: int = 0
    error: str = ""


async def run_request(
    http: httpx.AsyncClient, model: str, messages, max_tokens: int
) -> RequestResult:
    """One streamed chat completion; token times are taken as chunks arrive."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    num_content_chunks = 0
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0]["delta"].get("content"):
                    continue
                now = time.perf_counter()
                num_content_chunks += 1
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = num_content_chunks > 0
    if not result.ok:
        result.error = "no content streamed"
    return result


async def run_level(
    url: str, model: str, concurrency: int, num_requests: int, max_tokens: int, timeout: float
) -> dict:
    """``num_requests`` requests with ``concurrency`` in flight; returns the summary."""
    prompts = make_prompts(num_requests)
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:

        async def bounded(messages):
            async with semaphore:
                return await run_request(http, model, messages, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(m) for m in prompts))
        duration = time.perf_counter() - start
    return summarize(results, concurrency, duration)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p50, p90, p99 = np.percentile(np.asarray(values) * 1000.0, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(results: list[RequestResult], concurrency: int, duration: float) -> dict:
    ok = [r for r in results if r.ok]
    num_output_tokens = sum(r.num_output_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "num_requests": len(results),
        "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": num_output_tokens / duration,
        "num_output_tokens": num_output_tokens,
        "ttft_ms": _percentiles([r.ttft for r in ok]),
        "itl_ms": _percentiles([gap for r in ok for gap in r.itls]),
    }


def format_table(summaries: list[dict]) -> str:
    header = (
        "| concurrency | requests | failed | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) "
        "| ITL p50 / p90 / p99 (ms) |"
    )
    lines = [header, "|---:|---:|---:|---:|---:|---|---|"]
    for s in summaries:
        ttft, itl = s["ttft_ms"], s["itl_ms"]
        lines.append(
            f"| {s['concurrency']} | {s['num_requests']} | {s['num_failed']} "
            f"| {s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.1f} "
            f"| {ttft['p50']:.0f} / {ttft['p90']:.0f} / {ttft['p99']:.0f} "
            f"| {itl['p50']:.0f} / {itl['p90']:.0f} / {itl['p99']:.0f} |"
        )
    return "\n".join(lines)


# ---- the server under test ------------------------------------------------------------------


@contextlib.contextmanager
def own_server(server_args: list[str], startup_timeout: float):
    """Start `pagedkv serve --host 127.0.0.1 --port 0 ...` and yield its URL."""
    command = [
        sys.executable,
        "-m",
        "pagedkv.entrypoints.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--log-level",
        "warning",
        *server_args,
    ]
    print("starting:", shlex.join(command), file=sys.stderr, flush=True)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + startup_timeout
        assert process.stdout is not None
        for line in process.stdout:
            print("  server:", line.rstrip(), file=sys.stderr, flush=True)
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                url = match.group(1)
                break
            if time.monotonic() > deadline:
                break
        if url is None:
            raise RuntimeError("the server did not start (see its output above)")
        # Keep reading its output so that a chatty server never blocks on a full pipe.
        threading.Thread(target=_echo, args=(process.stdout,), daemon=True).start()
        _wait_healthy(url, deadline)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _echo(stream) -> None:
    for line in stream:
        print("  server:", line.rstrip(), file=sys.stderr, flush=True)


def _wait_healthy(url: str, deadline: float) -> None:
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health never answered 200")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (loopback); default: start one")
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
            if urlparse(args.url).hostname not in LOOPBACK_HOSTS:
                parser.error(f"--url must be a loopback address, got {args.url}")
            url = args.url.rstrip("/")
        else:
            url = stack.enter_context(
                own_server(shlex.split(args.server_args), args.startup_timeout)
            )
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        # Warm-up: first-call costs (allocations, lazy init) stay out of the numbers.
        asyncio.run(run_level(url, model, 1, 1, 4, args.timeout))
        summaries = []
        for concurrency in levels:
            summary = asyncio.run(
                run_level(url, model, concurrency, args.num_requests, args.max_tokens, args.timeout)
            )
            summary["load_average_1m"] = os.getloadavg()[0]  # the CPU is shared: context
            summaries.append(summary)
            print(
                f"concurrency {concurrency:>3}: {summary['requests_per_s']:.2f} req/s, "
                f"{summary['output_tokens_per_s']:.1f} tok/s, "
                f"TTFT p50 {summary['ttft_ms']['p50']:.0f} ms, "
                f"ITL p50 {summary['itl_ms']['p50']:.0f} ms, failed {summary['num_failed']}, "
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
    return 1 if any(s["num_failed"] for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
