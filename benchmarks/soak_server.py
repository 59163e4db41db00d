"""Soak test of the OpenAI-compatible server: many clients, mixed and hostile traffic, bounded.

``--clients`` concurrent clients (default 64) send requests back to back for ``--duration``
seconds (default 180) or until ``--max-requests`` (default 20000) have been sent, whichever comes
first. Each request is drawn (seeded) from a mix:

    complete / chat              non-streamed, n 1..3, random stop strings, random max_tokens
    stream_complete / stream_chat streamed, the same parameters
    disconnect                   streamed, the client hangs up after 1..4 events
    abort                        non-streamed, the client gives up after 0.05..1 s
    bad                          invalid input (wrong types, out of range, int64 overflow, lone
                                 surrogates, malformed JSON, unknown model): must be a 4xx

Reported: requests served, statuses by kind (errors by status), p50/p99 latency of completed
requests, KV blocks in use once the server is idle again (``pagedkv:kv_cache_used_blocks``, must
be 0), /health afterwards, and the server process's resident memory (RSS, from /proc): after a
warm-up phase of the same traffic (``--warmup`` seconds, not counted: the first steps at full
concurrency grow buffers and allocator pools once), sampled every 5 s during the run, and after.
Exit status 1 if a block leaked, a 5xx was seen, a bad request was not a 4xx, a good request
failed, or /health is not 200.

    .venv/bin/python benchmarks/soak_server.py                      # own server, default model
    .venv/bin/python benchmarks/soak_server.py --duration 60 --clients 16
    .venv/bin/python benchmarks/soak_server.py --url http://127.0.0.1:8000   # no RSS then

By default it starts its own `pagedkv serve` on a free loopback port (``--server-args`` for its
options); ``--url`` soaks a running server instead. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shlex
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np

from _server import own_server

LOOPBACK_HOSTS = {"127.0.0.1", "::1", "localhost"}
KINDS = {
    "complete": 3,
    "chat": 3,
    "stream_complete": 3,
    "stream_chat": 3,
    "disconnect": 2,
    "abort": 2,
    "bad": 2,
}
WORDS = ["the", "a", "and", "is", "of", "to", "in", "it", "cat", "sea", "paging", "memory"]
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain paging in operating systems in two sentences.",
    "List three colours:",
    "Once upon a time, a small robot",
    "Translate to French: good morning, how are you?",
    "Ünïcödé, 日本語, emoji 🚀 and more:",
]
#: Invalid requests: (path, JSON body or raw bytes).
BAD = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "top_k": 9223372036854775808}),
    ("/v1/completions", {"prompt": "Hi", "seed": 2**64}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**9}),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}),
    ("/v1/completions", {"prompt": [[]]}),
    ("/v1/completions", {"prompt": [-1, 5]}),
    ("/v1/completions", {"prompt": [10**12]}),
    ("/v1/completions", {"model": "gpt-4", "prompt": "Hi"}),
    ("/v1/completions", b'{"prompt": "\\ud800 surrogate", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "Hi", "top_p": NaN}'),
    ("/v1/completions", b'{"prompt": "Hi", '),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 1000}),
]


@dataclass(slots=True)
class Result:
    kind: str
    status: str  # HTTP status, "disconnected" (client hung up), "gave_up" (client timeout), ...
    latency: float = 0.0
    ok: bool = True  # what this kind should get


def good_body(rng: random.Random, chat: bool, stream: bool) -> dict:
    body = {
        "max_tokens": rng.randint(1, 24),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "n": rng.choice([1, 1, 1, 2, 3]),
        "stream": stream,
    }
    if rng.random() < 0.5:
        body["stop"] = rng.sample([*WORDS, "\n", ".", "!"], rng.randint(1, 3))
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(2**32)
    prompt = rng.choice(PROMPTS)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def one_request(http: httpx.AsyncClient, rng: random.Random, kind: str) -> Result:
    start = time.perf_counter()
    if kind == "bad":
        path, body = rng.choice(BAD)
        if isinstance(body, bytes):
            headers = {"content-type": "application/json"}
            response = await http.post(path, content=body, headers=headers)
        else:
            response = await http.post(path, json=body)
        status = response.status_code
        return Result(kind, str(status), time.perf_counter() - start, 400 <= status < 500)
    chat = kind in ("chat", "stream_chat") or (
        kind in ("disconnect", "abort") and rng.random() < 0.5
    )
    stream = kind.startswith("stream") or kind == "disconnect"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = good_body(rng, chat, stream)
    if kind == "abort":
        try:
            response = await http.post(path, json=body, timeout=rng.uniform(0.05, 1.0))
        except httpx.TimeoutException:
            return Result(kind, "gave_up", time.perf_counter() - start)
        return Result(
            kind,
            str(response.status_code),
            time.perf_counter() - start,
            response.status_code == 200,
        )
    if not stream:
        response = await http.post(path, json=body)
        ok = response.status_code == 200 and len(response.json()["choices"]) == body["n"]
        return Result(kind, str(response.status_code), time.perf_counter() - start, ok)
    hang_up_after = rng.randint(1, 4) if kind == "disconnect" else None
    num_events = 0
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return Result(kind, str(response.status_code), time.perf_counter() - start, False)
        last = ""
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            num_events += 1
            last = line
            if '"error"' in line:
                return Result(kind, "error_event", time.perf_counter() - start, False)
            if hang_up_after is not None and num_events >= hang_up_after:
                return Result(kind, "disconnected", time.perf_counter() - start)
    if last != "data: [DONE]":
        return Result(kind, "no_done", time.perf_counter() - start, False)
    return Result(kind, "200", time.perf_counter() - start)


async def client_loop(
    url: str, rng: random.Random, deadline: float, budget: list[int], results: list[Result]
) -> None:
    names, weights = list(KINDS), list(KINDS.values())
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while time.monotonic() < deadline and budget[0] > 0:
            budget[0] -= 1
            kind = rng.choices(names, weights)[0]
            try:
                results.append(await one_request(http, rng, kind))
            except httpx.HTTPError as exc:
                results.append(Result(kind, type(exc).__name__, 0.0, False))


async def soak(url: str, clients: int, duration: float, max_requests: int, seed: int):
    results: list[Result] = []
    budget = [max_requests]
    deadline = time.monotonic() + duration
    start = time.perf_counter()
    await asyncio.gather(
        *(
            client_loop(url, random.Random(f"{seed}-{i}"), deadline, budget, results)
            for i in range(clients)
        )
    )
    return results, time.perf_counter() - start


# ---- the server ------------------------------------------------------------------------------


def metric(url: str, name: str) -> float | None:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_idle(url: str, timeout: float) -> float:
    """Wait until no request runs or waits; return the KV blocks still in use."""
    deadline = time.monotonic() + timeout
    while True:
        busy = (metric(url, "pagedkv:num_requests_running") or 0) + (
            metric(url, "pagedkv:num_requests_waiting") or 0
        )
        used = metric(url, "pagedkv:kv_cache_used_blocks")
        if (busy == 0 and used == 0) or time.monotonic() > deadline:
            return used if used is not None else float("nan")
        time.sleep(0.2)


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of ``pid`` in MiB (Linux /proc), None if unknown."""
    if pid is None:
        return None
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        return None
    match = re.search(r"VmRSS:\s+(\d+) kB", status.read_text())
    return int(match.group(1)) / 1024 if match else None


def report(results: list[Result], elapsed: float) -> dict:
    completed = [r.latency for r in results if r.status == "200" and r.kind != "bad"]
    p50, p99 = (np.percentile(completed, [50, 99]) * 1000).tolist() if completed else (0, 0)
    by_kind: dict[str, Counter] = {}
    for r in results:
        by_kind.setdefault(r.kind, Counter())[r.status] += 1
    statuses = Counter(r.status for r in results)
    return {
        "requests": len(results),
        "seconds": round(elapsed, 1),
        "served_200": statuses["200"],
        "statuses": dict(sorted(statuses.items())),
        "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
        "unexpected": sum(not r.ok for r in results),
        "num_5xx": sum(r.status.startswith("5") for r in results),
        "latency_ms_p50": round(p50),
        "latency_ms_p99": round(p99),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (loopback); default: start one")
    parser.add_argument("--server-args", default="", help="options of the server it starts")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of traffic")
    parser.add_argument(
        "--warmup", type=float, default=30.0, help="seconds of the same traffic before RSS is read"
    )
    parser.add_argument("--max-requests", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-timeout", type=float, default=120.0)
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    if min(args.clients, args.max_requests) < 1 or args.duration <= 0:
        parser.error("--clients and --max-requests must be >= 1 and --duration > 0")

    with contextlib.ExitStack() as stack:
        if args.url:
            if urlparse(args.url).hostname not in LOOPBACK_HOSTS:
                parser.error("--url must be a loopback address")
            url, pid = args.url.rstrip("/"), None
        else:
            server = own_server(shlex.split(args.server_args), 600, log_level="error", echo=False)
            url, pid = stack.enter_context(server)
        for prompt in PROMPTS[:4]:  # warm-up
            httpx.post(
                url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=300
            )
        if args.warmup > 0:
            asyncio.run(soak(url, args.clients, args.warmup, args.max_requests, args.seed + 1))
            wait_idle(url, args.idle_timeout)
        rss_before = rss_mib(pid)
        samples: list[float] = []
        stop = threading.Event()

        def sample_rss() -> None:
            while not stop.wait(5.0):
                value = rss_mib(pid)
                if value is not None:
                    samples.append(value)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        try:
            results, elapsed = asyncio.run(
                soak(url, args.clients, args.duration, args.max_requests, args.seed)
            )
        finally:
            stop.set()
            sampler.join()
        used_blocks = wait_idle(url, args.idle_timeout)
        health = httpx.get(url + "/health", timeout=30).status_code
        summary = report(results, elapsed)
        summary.update(
            kv_blocks_in_use_after=used_blocks,
            health_after=health,
            rss_mib_before=rss_before,
            rss_mib_max_during=max(samples) if samples else None,
            rss_mib_every_5s=[round(v) for v in samples],
            rss_mib_after=rss_mib(pid),
            clients=args.clients,
            command=shlex.join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        )
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    failed = used_blocks != 0 or health != 200 or summary["num_5xx"] or summary["unexpected"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
