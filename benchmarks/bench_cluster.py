"""Cluster benchmark: 2 engine replicas on Ray Serve, a shared-prefix chat workload, the
prefix-aware router against round robin in one run.

Workload: ``--num-prefixes`` system prompts of 300-700 tokens (fixed text, seeded), then
``--num-requests`` chat requests, each one of those system prompts (chosen at random, seeded)
plus a short question, streamed with temperature 0 and ``--max-tokens`` tokens (ignore_eos),
``--concurrency`` in flight. Each policy gets a fresh deployment (cold caches) of the same
replicas, sized with ``--num-blocks`` KV blocks each: by default a replica holds about half of
the system prompts, so the router decides whether the cluster caches each prompt once (prefix)
or every prompt on every replica (round robin, whose replicas then evict each other's reuse).

Reports per policy: prefix-cache hit rate (cached prompt tokens / prompt tokens, from each
response's usage), requests/s and output tokens/s over the run's wall time, TTFT p50/p90, and
the ratio prefix / round robin. JSON goes to ``--output``.

    python benchmarks/bench_cluster.py                      # 256 requests, ~10 min on 2 cores
    python benchmarks/bench_cluster.py --num-requests 64    # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

import httpx
import numpy as np

_WORD_TEXT = (
    "system policy answer request model cache block token memory prefix router replica "
    "engine latency throughput queue batch schedule kernel tensor layer attention head value "
    "key page table slot sequence output prompt user assistant review summary detail example "
    "rule format concise accurate friendly careful source context document section paragraph"
)
_WORDS = _WORD_TEXT.split()
_QUESTIONS = [
    "What should I check first?",
    "Summarise the rules in one line.",
    "Give one example.",
    "What is the most common mistake?",
    "How long should an answer be?",
    "Which rule matters most?",
]


def make_system_prompts(tokenizer, num_prefixes: int, seed: int) -> list[str]:
    """``num_prefixes`` distinct system prompts of 300-700 tokens each (seeded)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for k in range(num_prefixes):
        target = int(rng.integers(300, 701))
        words = [f"You are assistant number {k}. Follow these notes:"]
        while len(tokenizer.encode(" ".join(words))) < target:
            words.extend(rng.choice(_WORDS, size=8).tolist())
        prompts.append(" ".join(words))
    return prompts


def make_requests(system_prompts: list[str], num_requests: int, seed: int) -> list[list[dict]]:
    rng = np.random.default_rng(seed + 1)
    groups = rng.integers(0, len(system_prompts), size=num_requests)
    return [
        [
            {"role": "system", "content": system_prompts[g]},
            {"role": "user", "content": f"Question {i}: {_QUESTIONS[i % len(_QUESTIONS)]}"},
        ]
        for i, g in enumerate(groups)
    ]


async def one_request(http: httpx.AsyncClient, messages, max_tokens: int) -> dict:
    body = {
        "model": "bench",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result = {"ok": False, "ttft": None, "usage": None}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            result["error"] = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                result["usage"] = chunk["usage"]
            choices = chunk.get("choices") or []
            if choices and choices[0]["delta"].get("content") and result["ttft"] is None:
                result["ttft"] = time.perf_counter() - start
    result["ok"] = result["usage"] is not None and result["ttft"] is not None
    return result


async def run_workload(url: str, requests, concurrency: int, max_tokens: int) -> dict:
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as http:

        async def bounded(messages):
            async with semaphore:
                return await one_request(http, messages, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(m) for m in requests))
        wall = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum(
        (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in ok
    )
    output = sum(r["usage"]["completion_tokens"] for r in ok)
    ttfts = np.asarray([r["ttft"] for r in ok]) * 1000
    return {
        "num_requests": len(results),
        "num_failed": len(results) - len(ok),
        "errors": sorted({r.get("error", "") for r in results if not r["ok"]})[:3],
        "wall_s": wall,
        "num_prompt_tokens": prompt,
        "num_cached_tokens": cached,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": output / wall,
        "ttft_ms_p50": float(np.percentile(ttfts, 50)) if len(ttfts) else float("nan"),
        "ttft_ms_p90": float(np.percentile(ttfts, 90)) if len(ttfts) else float("nan"),
        "ttft_ms_mean": float(ttfts.mean()) if len(ttfts) else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--num-replicas", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=200, help="KV blocks per replica")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--policies", default="prefix,round_robin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "cluster.json"))
    args = parser.parse_args(argv)
    for name in ("num_requests", "num_prefixes", "num_replicas", "concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    import ray
    from ray import serve

    from pagedkv.cluster import ray_serve
    from pagedkv.engine.config import EngineConfig
    from pagedkv.entrypoints.cluster.ray_ingress import OpenAIIngress
    from pagedkv.model.loader import resolve_model_path
    from pagedkv.model.tokenizer import Tokenizer

    path = resolve_model_path(args.model)
    tokenizer = (
        Tokenizer.from_gguf(path) if path.suffix == ".gguf" else Tokenizer.from_hf_folder(path)
    )
    system_prompts = make_system_prompts(tokenizer, args.num_prefixes, args.seed)
    lengths = [len(tokenizer.encode(p)) for p in system_prompts]
    requests = make_requests(system_prompts, args.num_requests, args.seed)
    print(f"system prompts (tokens): {lengths}; {args.num_requests} requests", flush=True)

    config = EngineConfig(
        model=str(path),
        dtype="bfloat16",
        num_blocks=args.num_blocks,
        max_model_len=1024,
        max_num_seqs=args.max_num_seqs,
        num_threads=1,
        hash_seed="bench-cluster",
    )
    ray.init(
        num_cpus=args.num_replicas,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    results = {}
    port = ray_serve.free_port("127.0.0.1")  # Serve's HTTP options hold for the whole Ray run
    try:
        for policy in args.policies.split(","):
            started = time.perf_counter()
            url = ray_serve.start_cluster(
                config,
                ingress=OpenAIIngress,
                num_replicas=args.num_replicas,
                policy=policy,
                model_name="bench",
                port=port,
            )
            print(
                f"{policy}: {args.num_replicas} replicas up in "
                f"{time.perf_counter() - started:.0f} s",
                flush=True,
            )
            results[policy] = asyncio.run(
                run_workload(url, requests, args.concurrency, args.max_tokens)
            )
            print(f"{policy}: {json.dumps(results[policy])}", flush=True)
            serve.delete(ray_serve.APP_NAME)
    finally:
        ray_serve.stop_cluster()

    lines = [
        "| router | hit rate | req/s | output tok/s | TTFT p50 / p90 (ms) | failed | wall (s) |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for policy, r in results.items():
        lines.append(
            f"| {policy} | {r['prefix_hit_rate']:.1%} | {r['requests_per_s']:.2f} "
            f"| {r['output_tokens_per_s']:.1f} | {r['ttft_ms_p50']:.0f} / {r['ttft_ms_p90']:.0f} "
            f"| {r['num_failed']} | {r['wall_s']:.0f} |"
        )
    print("\n".join(lines))
    if {"prefix", "round_robin"} <= results.keys():
        p, rr = results["prefix"], results["round_robin"]
        print(
            f"prefix / round robin: throughput x{p['requests_per_s'] / rr['requests_per_s']:.2f}, "
            f"TTFT p50 x{p['ttft_ms_p50'] / rr['ttft_ms_p50']:.2f}, hit rate "
            f"{p['prefix_hit_rate']:.1%} vs {rr['prefix_hit_rate']:.1%}"
        )
    output = {
        "command": " ".join(["python", "benchmarks/bench_cluster.py", *sys.argv[1:]]),
        "system_prompt_tokens": lengths,
        "args": {k: v for k, v in vars(args).items() if k != "output"},
        "results": results,
    }
    Path(args.output).write_text(json.dumps(output, indent=2) + "\n")
    return 0 if all(r["num_failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
