"""Replay a chat-like request trace against KVCacheManager: ops/s, us per op, prefix hit rate.

Trace (issue 2): 2000 requests, block_size 16, at most 64 in flight; each request is admitted
with its whole prompt, then gets 64 decode tokens one at a time, then is freed.
    50% shared:    a shared 512-token system prompt + a unique 32-512 token suffix
    20% follow-up: a recently finished request's prompt + its 64 generated tokens + 16-256 new
    30% unique:    64-1024 fresh tokens
Two pools: large enough that nothing is evicted, and 1.1 x the peak of live blocks.

Ops/s = ops / wall time of the timed calls; ops/cpu-s = ops / CPU time of this process over the
same calls (less disturbed by other jobs sharing the cores).
Ops = admits (request construction with its block hashes + get_computed_blocks + allocate_slots)
+ decode appends (append_output_token_ids + allocate_slots(req, 1)) + frees. Only these calls
are timed; building the trace is not.

    .venv/bin/python benchmarks/bench_kv_manager.py               # both pools, median of 3
    .venv/bin/python benchmarks/bench_kv_manager.py --profile     # cProfile of one replay
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from pagedkv.core import KVCacheManager, KVCacheRequest
from pagedkv.core.spec import cdiv

VOCAB_SIZE = 49152


@dataclass(slots=True)
class TraceRequest:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    kind: str


def build_trace(
    num_requests: int = 2000,
    max_in_flight: int = 64,
    num_decode_tokens: int = 64,
    system_prompt_len: int = 512,
    seed: int = 0,
) -> list[TraceRequest]:
    """The request trace. A follow-up's parent is one of the 64 requests that finished most
    recently before it is admitted: requests finish in admission order, so with at most
    ``max_in_flight`` in flight, request ``i - max_in_flight - 1`` and older are done."""
    rng = random.Random(seed)
    population = range(VOCAB_SIZE)

    def tokens(n: int) -> list[int]:
        return rng.choices(population, k=n)

    system_prompt = tokens(system_prompt_len)
    trace: list[TraceRequest] = []
    for i in range(num_requests):
        r = rng.random()
        newest_done = i - max_in_flight - 1
        if r < 0.5:
            prompt = system_prompt + tokens(rng.randint(32, 512))
            kind = "shared"
        elif r < 0.7 and newest_done >= 0:
            parent = trace[rng.randint(max(0, newest_done - max_in_flight + 1), newest_done)]
            prompt = (
                parent.prompt_token_ids + parent.output_token_ids + tokens(rng.randint(16, 256))
            )
            kind = "follow-up"
        else:
            prompt = tokens(rng.randint(64, 1024))
            kind = "unique"
        trace.append(TraceRequest(prompt, tokens(num_decode_tokens), kind))
    return trace


def replay(
    trace: list[TraceRequest],
    num_blocks: int,
    *,
    block_size: int = 16,
    max_in_flight: int = 64,
    hash_algo: str = "sha256",
) -> dict:
    """Replay ``trace`` round by round (admit up to max_in_flight FCFS, one decode token for
    every running request, free the finished ones) and time the manager calls."""
    kv = KVCacheManager(num_blocks, block_size=block_size, hash_algo=hash_algo, hash_seed=0)
    hasher = kv.block_hasher
    perf_counter = time.perf_counter
    process_time = time.process_time  # CPU time: less sensitive to other jobs on the machine
    cpu_time = 0.0
    # (trace index, request): the request is None until built (its hashes are part of the
    # admit), and kept when admission is refused or the request is preempted.
    pending: deque[tuple[int, KVCacheRequest | None]] = deque((i, None) for i in range(len(trace)))
    # (request, iterator over its scripted output tokens, num_tokens when done)
    running: list[tuple[KVCacheRequest, Iterator[int], int]] = []
    output_iters: dict[int, Iterator[int]] = {}
    t_admit = t_decode = t_free = 0.0
    num_admits = num_decodes = num_frees = num_preemptions = 0
    num_queried_tokens = num_hit_tokens = 0
    peak_live_blocks = 0
    num_usable = num_blocks - 1

    while pending or running:
        # Admit FCFS until max_in_flight or the first request that does not fit.
        t0, c0 = perf_counter(), process_time()
        while pending and len(running) < max_in_flight:
            index, request = pending[0]
            item = trace[index]
            if request is None:
                request = KVCacheRequest(str(index), item.prompt_token_ids, block_hasher=hasher)
            blocks, num_hit = kv.get_computed_blocks(request)
            if kv.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks) is None:
                pending[0] = (index, request)
                break
            request.num_computed_tokens = request.num_tokens
            pending.popleft()
            outputs = output_iters.get(index)
            if outputs is None:  # first admission: the prefix-cache counters (as the engine's)
                outputs = output_iters[index] = iter(item.output_token_ids)
                num_queried_tokens += request.num_tokens
                num_hit_tokens += num_hit
            num_final = len(item.prompt_token_ids) + len(item.output_token_ids)
            running.append((request, outputs, num_final))
            num_admits += 1
        t_admit += perf_counter() - t0
        cpu_time += process_time() - c0
        live = num_usable - kv.num_free_blocks
        if live > peak_live_blocks:
            peak_live_blocks = live

        # One decode token for every running request.
        t0, c0 = perf_counter(), process_time()
        failed = None
        for request, outputs, _ in running:
            request.append_output_token_ids(next(outputs))
            if kv.allocate_slots(request, 1) is None:
                failed = request
                break
            request.num_computed_tokens += 1
        t_decode += perf_counter() - t0
        cpu_time += process_time() - c0
        if failed is None:
            num_decodes += len(running)
        else:
            # Rare (the small pool is 1.1 x the peak): preempt the request that does not fit;
            # it is re-admitted first, with all its tokens, and goes on decoding.
            position = next(i for i, entry in enumerate(running) if entry[0] is failed)
            num_decodes += position
            num_preemptions += 1
            del running[position]
            kv.free(failed)
            failed.num_computed_tokens = 0
            pending.appendleft((int(failed.request_id), failed))
        live = num_usable - kv.num_free_blocks
        if live > peak_live_blocks:
            peak_live_blocks = live

        # Free the requests that have all their decode tokens.
        t0, c0 = perf_counter(), process_time()
        still_running = []
        for entry in running:
            request = entry[0]
            if request.num_computed_tokens == entry[2]:
                kv.free(request)
                num_frees += 1
            else:
                still_running.append(entry)
        running = still_running
        t_free += perf_counter() - t0
        cpu_time += process_time() - c0

    total_time = t_admit + t_decode + t_free
    num_ops = num_admits + num_decodes + num_frees
    return {
        "num_blocks": num_blocks,
        "ops_per_s": num_ops / total_time,
        "ops_per_cpu_s": num_ops / cpu_time,
        "us_per_admit": 1e6 * t_admit / num_admits,
        "us_per_decode": 1e6 * t_decode / num_decodes,
        "us_per_free": 1e6 * t_free / num_frees,
        "hit_rate": num_hit_tokens / num_queried_tokens,
        "num_ops": num_ops,
        "seconds": total_time,
        "num_preemptions": num_preemptions,
        "peak_live_blocks": peak_live_blocks,
    }


def no_eviction_num_blocks(trace: list[TraceRequest], block_size: int) -> int:
    """A pool that never reuses a block: every request's blocks, plus the null block."""
    total = sum(cdiv(len(t.prompt_token_ids) + len(t.output_token_ids), block_size) for t in trace)
    return total + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hash-algo", default="sha256", choices=["sha256", "xxh3_128"])
    parser.add_argument("--repeat", type=int, default=3, help="runs per pool; median reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="cProfile one small-pool replay")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    trace = build_trace(args.num_requests, seed=args.seed)
    large = no_eviction_num_blocks(trace, args.block_size)
    probe = replay(trace, large, block_size=args.block_size, hash_algo=args.hash_algo)
    small = int(1.1 * probe["peak_live_blocks"]) + 1
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(replay, trace, small, block_size=args.block_size)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
        return

    results = {}
    for name, num_blocks in (("no eviction", large), ("1.1 x peak", small)):
        runs = [
            replay(trace, num_blocks, block_size=args.block_size, hash_algo=args.hash_algo)
            for _ in range(args.repeat)
        ]
        median = dict(runs[0])
        for key in (
            "ops_per_s",
            "ops_per_cpu_s",
            "us_per_admit",
            "us_per_decode",
            "us_per_free",
            "seconds",
        ):
            median[key] = statistics.median(run[key] for run in runs)
        median["ops_per_s_runs"] = [round(run["ops_per_s"]) for run in runs]
        results[name] = median

    if args.json:
        print(json.dumps(results, indent=2))
        return
    kinds = {kind: sum(t.kind == kind for t in trace) for kind in ("shared", "follow-up", "unique")}
    print(f"trace: {len(trace)} requests {kinds}, block_size {args.block_size}, {args.hash_algo}")
    header = (
        f"{'pool':<12} {'num_blocks':>10} {'ops/s':>9} {'ops/cpu-s':>9} {'admit us':>9} "
        f"{'decode us':>9} {'free us':>8} {'hit rate':>8} {'preempt':>7}  runs (ops/s)"
    )
    print(header)
    for name, r in results.items():
        print(
            f"{name:<12} {r['num_blocks']:>10} {r['ops_per_s']:>9,.0f} {r['ops_per_cpu_s']:>9,.0f} "
            f"{r['us_per_admit']:>9.1f} "
            f"{r['us_per_decode']:>9.2f} {r['us_per_free']:>8.2f} {r['hit_rate']:>8.1%} "
            f"{r['num_preemptions']:>7}  {r['ops_per_s_runs']}"
        )


if __name__ == "__main__":
    main()
