"""Cost of one step's copy-on-write block copies: ``backend.copy_blocks`` over one KV cache
group's layers, at the default model's shapes (SmolLM2-135M: 30 layers, 3 KV heads of 64, bf16)
and each backend's default block size, ``--num-pairs`` (src, dst) pairs a call (default 8).

Timed per call (medians of ``--repeats``, each on fresh random pairs, so sources are mostly cold
in the caches: the pool is ``--pool-mib`` MiB, default 1024, above the L3 of the machines this ran
on):

  copy_blocks    the backend's call, its checks included (what the runner pays per group)
  check          :func:`pagedkv.ops.backends.check_block_mapping` alone (the ids' checks)
  per-pair loop  a baseline without vectorising: ``cache[:, dst].copy_(cache[:, src])`` for each
                 pair and layer (what one op per group per step replaces)

``GB/s`` counts the bytes read and written (2 x pairs x page x layers). Examples::

    .venv/bin/python benchmarks/bench_block_copy.py
    .venv/bin/python benchmarks/bench_block_copy.py --threads 1 --num-pairs 1 8 64
    .venv/bin/python benchmarks/bench_block_copy.py --device cuda --backends triton torch
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedkv.cpu_caps import cpu_model_name
from pagedkv.ops.backends import BACKENDS, AttentionLayerSpec, check_block_mapping

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def random_pairs(num_blocks: int, num_pairs: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """``num_pairs`` copies between distinct blocks of ``[1, num_blocks)``."""
    ids = (torch.randperm(num_blocks - 1, generator=gen)[: 2 * num_pairs] + 1).tolist()
    return list(zip(ids[:num_pairs], ids[num_pairs:], strict=True))


def per_pair_loop(caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    for cache in caches:
        for src, dst in pairs:
            cache[:, dst].copy_(cache[:, src])


def time_calls(fn, make_args, repeats: int, sync) -> float:
    """Median seconds of ``fn(*make_args())`` (arguments made outside the timing)."""
    times = []
    for _ in range(repeats):
        args = make_args()
        sync()
        start = time.perf_counter()
        fn(*args)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(backend, caches, num_pairs: int, repeats: int, gen, sync) -> dict[str, float]:
    """Median seconds per call of copy_blocks, check_block_mapping and the per-pair loop."""
    num_blocks = caches[0].shape[1]

    def pairs():
        return (random_pairs(num_blocks, num_pairs, gen),)

    backend.copy_blocks(caches, pairs()[0])  # warm-up
    return {
        "copy": time_calls(lambda p: backend.copy_blocks(caches, p), pairs, repeats, sync),
        "check": time_calls(lambda p: check_block_mapping(p, num_blocks), pairs, repeats, sync),
        "loop": time_calls(lambda p: per_pair_loop(caches, p), pairs, repeats, sync),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=None, help="default: every one here")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-pairs", type=int, nargs="+", default=[8])
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--block-size", type=int, default=None, help="default: the backend's")
    parser.add_argument("--pool-mib", type=int, default=1024, help="all layers' caches, MiB")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    counts = [args.num_layers, args.num_kv_heads, args.head_size, args.pool_mib, args.repeats]
    if min(counts + args.num_pairs) < 1 or (args.block_size is not None and args.block_size < 1):
        parser.error("sizes, counts and --repeats must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    names = args.backends or [
        n for n, cls in BACKENDS.items() if not cls.unavailable_reason(device)
    ]
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    where = torch.cuda.get_device_name(device) if cuda else cpu_model_name()
    print(
        f"{where}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.num_layers} layers x {args.num_kv_heads} KV heads x {args.head_size} "
        f"{args.dtype}, pool {args.pool_mib} MiB; medians of {args.repeats} calls"
    )
    print(
        f"{'backend':>10} {'block':>5} {'blocks':>6} {'pairs':>5} {'MiB':>6} "
        f"{'copy_blocks us':>14} {'us/layer':>8} {'GB/s':>6} {'check us':>8} {'loop us':>8}"
    )
    gen = torch.Generator().manual_seed(args.seed)
    for name in names:
        cls = BACKENDS[name]
        reason = cls.unavailable_reason(device)
        if reason is not None:
            print(f"{name:>10}: unavailable ({reason})")
            continue
        backend = cls(device)
        block_size = args.block_size or backend.default_block_size(args.head_size, dtype)
        spec = AttentionLayerSpec(
            num_heads=args.num_kv_heads,
            num_kv_heads=args.num_kv_heads,
            head_size=args.head_size,
            block_size=block_size,
            dtype=dtype,
        )
        backend.check_layer(spec)
        page = 2 * block_size * args.num_kv_heads * args.head_size * dtype.itemsize
        layer_bytes = args.pool_mib * 2**20 // args.num_layers
        num_blocks = max(2 * max(args.num_pairs) + 1, layer_bytes // page)
        caches = [backend.allocate_kv_cache(num_blocks, spec) for _ in range(args.num_layers)]
        for cache in caches:
            cache.normal_()
        for num_pairs in args.num_pairs:
            t = measure(backend, caches, num_pairs, args.repeats, gen, sync)
            moved = num_pairs * page * args.num_layers
            print(
                f"{name:>10} {block_size:>5} {num_blocks:>6} {num_pairs:>5} "
                f"{moved / 2**20:>6.2f} {t['copy'] * 1e6:>14.0f} "
                f"{t['copy'] * 1e6 / args.num_layers:>8.1f} {2 * moved / t['copy'] / 1e9:>6.1f} "
                f"{t['check'] * 1e6:>8.0f} {t['loop'] * 1e6:>8.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
