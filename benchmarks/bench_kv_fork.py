"""Cost of one decode ``allocate_slots(request, 1)`` on the one-group fast path, with and without
forks, and of ``fork`` itself (CPU ns per call, the minimum over repeats).

    unforked     64 requests decode 1024 tokens each; nothing was ever forked (runs on any
                 revision, so benchmarks/ab_compare.py can put it side by side with one before
                 fork existed)
    forked       the same after each request was forked mid-block and the first token of both
                 sides was written (one copy each): the rest of the decode is the plain path
    cow-pending  every decode request is a side of a fork not yet written past it (the one
                 ref_cnt look per call; half of them copy on their first token)
    fork         KVCacheManager.fork of a 1024-token request (64 blocks of 16)

    .venv/bin/python benchmarks/bench_kv_fork.py [--repeat 9]
"""

from __future__ import annotations

import argparse
import time

from pagedkv.core import KVCacheManager, KVCacheRequest

BLOCK_SIZE = 16


def _manager(num_requests: int, num_tokens: int) -> KVCacheManager:
    num_blocks = 2 * num_requests * (num_tokens // BLOCK_SIZE + 2) + 1
    return KVCacheManager(num_blocks, block_size=BLOCK_SIZE, hash_seed=0, enable_caching=False)


def _prefill(kv: KVCacheManager, request_id: str, num_tokens: int) -> KVCacheRequest:
    request = KVCacheRequest(request_id, [1] * num_tokens)
    kv.allocate_slots(request, num_tokens)
    request.num_computed_tokens = num_tokens
    return request


def _decode(kv: KVCacheManager, requests: list[KVCacheRequest], num_steps: int) -> float:
    """CPU ns per allocate_slots(request, 1) call (plus the num_computed_tokens bump)."""
    allocate = kv.allocate_slots
    t0 = time.process_time()
    for _ in range(num_steps):
        for request in requests:
            allocate(request, 1)
            request.num_computed_tokens += 1
    return 1e9 * (time.process_time() - t0) / (num_steps * len(requests))


def unforked(num_requests: int = 64, num_steps: int = 1024) -> float:
    kv = _manager(num_requests, num_steps + BLOCK_SIZE)
    requests = [_prefill(kv, str(i), BLOCK_SIZE) for i in range(num_requests)]
    return _decode(kv, requests, num_steps)


def forked(num_requests: int = 32, num_steps: int = 1024) -> float:
    kv = _manager(2 * num_requests, num_steps + BLOCK_SIZE)
    requests = []
    for i in range(num_requests):
        parent = _prefill(kv, f"p{i}", BLOCK_SIZE + 5)
        child = KVCacheRequest(f"c{i}", [1] * (BLOCK_SIZE + 5), num_computed_tokens=BLOCK_SIZE + 5)
        kv.fork(parent, child)
        requests += [parent, child]
    _decode(kv, requests, 1)  # each side writes its first token: one copy per family
    kv.take_blocks_to_copy()
    return _decode(kv, requests, num_steps)


def cow_pending(num_requests: int = 32, num_rounds: int = 64) -> float:
    """One decode token per fork side right after its fork (the ref_cnt look, half the time a
    copy), over many forks: CPU ns per allocate_slots call."""
    total = 0.0
    for _ in range(num_rounds):
        kv = _manager(2 * num_requests, 2 * BLOCK_SIZE)
        requests = []
        for i in range(num_requests):
            parent = _prefill(kv, f"p{i}", BLOCK_SIZE + 5)
            child = KVCacheRequest(
                f"c{i}", [1] * (BLOCK_SIZE + 5), num_computed_tokens=BLOCK_SIZE + 5
            )
            kv.fork(parent, child)
            requests += [parent, child]
        total += _decode(kv, requests, 1)
    return total / num_rounds


def fork_cost(num_tokens: int = 1024, num_forks: int = 2000) -> float:
    kv = KVCacheManager(
        num_tokens // BLOCK_SIZE + 2, block_size=BLOCK_SIZE, hash_seed=0, enable_caching=False
    )
    parent = _prefill(kv, "p", num_tokens)
    children = [
        KVCacheRequest(f"c{i}", [1] * num_tokens, num_computed_tokens=num_tokens)
        for i in range(num_forks)
    ]
    t0 = time.process_time()
    for child in children:
        kv.fork(parent, child)
    return 1e9 * (time.process_time() - t0) / num_forks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=9, help="runs per case; minimum reported")
    args = parser.parse_args()
    cases = {"unforked decode": unforked}
    if hasattr(KVCacheManager, "fork"):
        cases.update(
            {
                "forked decode (after the copy)": forked,
                "first token after a fork": cow_pending,
                "fork of 1024 tokens": fork_cost,
            }
        )
    for name, case in cases.items():
        runs = [case() for _ in range(args.repeat)]
        print(f"{name:<32} {min(runs):>9.1f} ns/call (min of {args.repeat})")


if __name__ == "__main__":
    main()
