"""Decode attention on the GPU: the Triton paged kernel vs dense SDPA on a contiguous cache.

For each batch size and context length (every request at the same context): one query token per
request, 32 query heads / 8 KV heads / head size 128, bf16, block size 16, blocks in shuffled
physical order. Reports the time of the triton backend's ``forward`` and of
``torch.nn.functional.scaled_dot_product_attention`` over the same K/V laid out contiguously
(``[batch, num_kv_heads, context, head_size]``, ``enable_gqa``), the K/V bytes each reads per
call divided by its time (achieved bandwidth), and that as a share of the device's measured copy
bandwidth (``dst.copy_(src)`` of a 2 GiB buffer: read + write bytes / time). Target (issue 8):
>= 80% of copy bandwidth at long contexts and no slower than SDPA.

    .venv/bin/python benchmarks/bench_triton_decode.py                 # the issue's grid
    .venv/bin/python benchmarks/bench_triton_decode.py --batch 64 --context 4096 \
        --partition-size 256 512 1024                                   # tune the split

Needs a CUDA GPU and triton (``pip install 'pagedkv[gpu]'``); exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def _time_ms(fn, *, warmup: int = 5, iters: int = 20) -> float:
    """Median milliseconds of fn() measured with CUDA events (each call timed alone)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes per second)."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def bench_case(batch: int, context: int, partition_size: int, args) -> dict:
    import torch
    import torch.nn.functional as F

    from pagedkv.ops.backends import (
        AttentionLayerSpec,
        CommonAttentionMetadata,
        TritonAttentionConfig,
        TritonBackend,
    )

    dtype, block_size = torch.bfloat16, args.block_size
    num_heads, num_kv_heads, head_size = args.num_heads, args.num_kv_heads, args.head_size
    blocks_per_req = -(-context // block_size)
    num_blocks = batch * blocks_per_req + 1  # + the null block
    gen = torch.Generator(device="cuda").manual_seed(0)
    backend = TritonBackend("cuda", config=TritonAttentionConfig(partition_size=partition_size))
    spec = AttentionLayerSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
    )
    kv_cache = backend.allocate_kv_cache(num_blocks, spec)
    kv_cache.normal_(generator=gen)
    block_tables = (
        (torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1)
        .view(batch, blocks_per_req)
        .to(torch.int32)
    )
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, num_heads, head_size, dtype=dtype, device="cuda", generator=gen)
    scale = spec.scale
    common = CommonAttentionMetadata(
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device="cuda"),  # no write
        num_blocks=num_blocks,
        seq_lens_cpu=seq_lens.cpu(),
        query_start_loc_cpu=query_start_loc.cpu(),
    )
    # Once per step (validated here): decode-only, longest sequence = context.
    md = backend.build_metadata(common, spec)

    def paged():
        return backend.forward(query, kv_cache, md)

    paged_ms = _time_ms(paged)
    out_paged = paged()

    # The same K/V, contiguous per request: [batch, num_kv_heads, context, head_size].
    def contiguous(i: int) -> torch.Tensor:
        x = kv_cache[i][block_tables.long()]  # [batch, blocks, num_kv_heads, block, head]
        x = x.transpose(1, 2).reshape(batch, num_kv_heads, -1, head_size)
        return x[:, :, :context].contiguous()

    key, value = contiguous(0), contiguous(1)
    q4 = query.view(batch, num_heads, 1, head_size)

    def dense():
        return F.scaled_dot_product_attention(q4, key, value, scale=scale, enable_gqa=True)

    dense_ms = _time_ms(dense)
    max_diff = (dense().view(batch, num_heads, head_size) - out_paged).abs().max().item()
    kv_bytes = 2 * batch * context * num_kv_heads * head_size * kv_cache.element_size()
    return {
        "batch": batch,
        "context": context,
        "partition_size": partition_size,
        "paged_ms": paged_ms,
        "sdpa_ms": dense_ms,
        "paged_gbs": kv_bytes / (paged_ms * 1e-3) / 1e9,
        "sdpa_gbs": kv_bytes / (dense_ms * 1e-3) / 1e9,
        "max_abs_diff": max_diff,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--partition-size", type=int, nargs="+", default=[512])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench_triton_decode: no CUDA GPU here; this benchmark needs one.", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print(
            "bench_triton_decode: triton is not installed: pip install 'pagedkv[gpu]'",
            file=sys.stderr,
        )
        return 2

    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {copy_gbs:.0f} GB/s")
    print(
        f"decode, {args.num_heads}/{args.num_kv_heads} heads, head {args.head_size}, bf16, "
        f"block {args.block_size}\n"
    )
    print(
        "| batch | context | partition | paged ms | SDPA ms | paged/SDPA | paged GB/s "
        "| % of copy | SDPA GB/s | max diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for batch in args.batch:
        for context in args.context:
            for partition_size in args.partition_size:
                r = bench_case(batch, context, partition_size, args)
                torch.cuda.empty_cache()  # the case's caches are garbage now
                results.append(r)
                print(
                    f"| {batch} | {context} | {partition_size} | {r['paged_ms']:.3f} "
                    f"| {r['sdpa_ms']:.3f} | {r['paged_ms'] / r['sdpa_ms']:.2f} "
                    f"| {r['paged_gbs']:.0f} | {100 * r['paged_gbs'] / copy_gbs:.0f}% "
                    f"| {r['sdpa_gbs']:.0f} | {r['max_abs_diff']:.1e} |",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "results": results},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
