"""Decode paged attention vs dense attention on a contiguous cache of the same data (issue 4).

For each (batch, context, heads/kv_heads/head_size, dtype), every request has ``context`` tokens
in a paged cache (block 16, physical blocks shuffled) and the same K/V in a contiguous dense cache
``[batch, num_kv_heads, context, head_size]``. One decode query per request. Timed per call:

  dense       grouped matmul -> fp32 softmax -> matmul on the contiguous K/V (the same math as the
              fast path, minus the paging; no gather)
  dense_sdpa  torch's scaled_dot_product_attention on the contiguous K/V (enable_gqa)
  fast        paged_attention(impl="cpu", validate=False) with a prebuilt metadata
  reference   paged_attention(impl="reference") (per-request gather, fp32 math)
  metadata    PagedAttentionMetadata.build + the gather plan: once per step, not per layer

As in a real forward, consecutive calls read different layers' caches (enough of them to exceed
the L3 cache), so no method is timed on data left hot in cache by its previous call.
Medians of ``--repeats`` runs. Example::

    .venv/bin/python benchmarks/bench_paged_attention.py            # the issue-4 grid
    .venv/bin/python benchmarks/bench_paged_attention.py --batch 16 --context 1024 --dtype bf16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedkv.engine.cpu_runtime import tune_malloc
from pagedkv.ops import PagedAttentionMetadata, allocate_kv_cache, paged_attention
from pagedkv.ops.gather_plan import get_gather_plan

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def dense_grouped(q, k, v, scale):
    """q [B, H, D]; k, v [B, kv_heads, ctx, D] contiguous."""
    b, h, d = q.shape
    kvh = k.shape[1]
    scores = torch.matmul(q.view(b, kvh, h // kvh, d), k.transpose(2, 3)).float().mul_(scale)
    return torch.matmul(torch.softmax(scores, -1).to(q.dtype), v).view(b, h, d)


def dense_sdpa(q, k, v, scale):
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def median_ms(fn, num_layers: int, repeats: int) -> float:
    for layer in range(num_layers):  # warm-up
        fn(layer)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in range(num_layers):
            fn(layer)
        times.append((time.perf_counter() - start) / num_layers)
    return statistics.median(times) * 1e3


def run_config(args, batch, context, shape, dtype_name):
    num_heads, num_kv_heads, head_size = shape
    dtype = DTYPES[dtype_name]
    bs = args.block_size
    gen = torch.Generator().manual_seed(0)
    blocks_per_req = -(-context // bs)
    num_blocks = batch * blocks_per_req + 1
    layer_bytes = 2 * batch * context * num_kv_heads * head_size * dtype.itemsize
    num_layers = max(1, min(args.max_layers, -(-args.cold_bytes // layer_bytes)))
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, blocks_per_req)
    block_tables = perm.to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    caches, denses, queries = [], [], []
    for _ in range(num_layers):
        kv = allocate_kv_cache(num_blocks, bs, num_kv_heads, head_size, dtype)
        kv.copy_(torch.randn(kv.shape, generator=gen))
        # Dense copy: block-table order, KV-head-major, cut to the context.
        dense = kv[:, perm.reshape(-1)].view(2, batch, blocks_per_req * bs, num_kv_heads, head_size)
        dense = dense[:, :, :context].permute(0, 1, 3, 2, 4).contiguous()
        caches.append(kv)
        denses.append(dense)
        queries.append(torch.randn(batch, num_heads, head_size, generator=gen).to(dtype))
    scale = head_size**-0.5

    def build():
        md = PagedAttentionMetadata.build(
            block_tables, seq_lens, qsl, bs, validate=False, decode_chunk_bytes=args.chunk_bytes
        )
        get_gather_plan(md, num_kv_heads, 2 * num_kv_heads * head_size * dtype.itemsize)
        return md

    md = build()
    row = {"layers": num_layers}
    row["dense"] = median_ms(
        lambda i: dense_grouped(queries[i], denses[i][0], denses[i][1], scale),
        num_layers,
        args.repeats,
    )
    if not args.no_sdpa:
        row["dense_sdpa"] = median_ms(
            lambda i: dense_sdpa(queries[i], denses[i][0], denses[i][1], scale),
            num_layers,
            args.repeats,
        )
    row["fast"] = median_ms(
        lambda i: paged_attention(
            queries[i], caches[i], scale=scale, metadata=md, validate=False, impl="cpu"
        ),
        num_layers,
        args.repeats,
    )
    if batch * context <= args.reference_max_tokens:
        row["reference"] = median_ms(
            lambda i: paged_attention(
                queries[i], caches[i], scale=scale, metadata=md, validate=False, impl="reference"
            ),
            num_layers,
            max(1, args.repeats // 2),
        )
    row["metadata"] = median_ms(lambda i: build(), 1, args.repeats)
    # Correctness guard: the fast path equals dense on layer 0.
    fast = paged_attention(queries[0], caches[0], scale=scale, metadata=md, impl="cpu")
    expected = dense_grouped(queries[0], denses[0][0], denses[0][1], scale)
    row["max_abs_diff"] = (fast.float() - expected.float()).abs().max().item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument(
        "--shape", nargs="+", default=["9/3/64", "32/8/128"], help="heads/kv_heads/head_size"
    )
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--cold-bytes", type=int, default=96 << 20, help="K/V bytes cycled through per repeat"
    )
    parser.add_argument("--max-layers", type=int, default=16)
    parser.add_argument(
        "--reference-max-tokens", type=int, default=64 * 1024, help="skip reference above"
    )
    parser.add_argument("--no-sdpa", action="store_true")
    parser.add_argument(
        "--chunk-bytes", type=int, default=None, help="decode_chunk_bytes (default: the ops')"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tune_malloc()
    print(
        f"torch {torch.__version__}, threads {args.threads}, block {args.block_size}, "
        f"medians of {args.repeats}; times in ms per call (one layer)"
    )
    header = (
        "| dtype | heads | batch | ctx | dense | dense_sdpa | fast | fast/dense | reference "
        "| ref/dense | metadata/step | max diff |"
    )
    print(header)
    print("|---" * 12 + "|")
    with torch.inference_mode():
        for dtype_name in args.dtype:
            for shape_text in args.shape:
                shape = tuple(int(x) for x in shape_text.split("/"))
                for batch in args.batch:
                    for context in args.context:
                        r = run_config(args, batch, context, shape, dtype_name)
                        print(format_row(dtype_name, shape_text, batch, context, r), flush=True)


def format_row(dtype_name: str, shape_text: str, batch: int, context: int, r: dict) -> str:
    def opt(value, fmt):
        return "-" if value is None else format(value, fmt)

    ref, sdpa, dense = r.get("reference"), r.get("dense_sdpa"), r["dense"]
    return (
        f"| {dtype_name} | {shape_text} | {batch} | {context} | {dense:.2f} | {opt(sdpa, '.2f')} "
        f"| {r['fast']:.2f} | {r['fast'] / dense:.2f}x | {opt(ref, '.1f')} "
        f"| {opt(None if ref is None else ref / dense, '.1f')} | {r['metadata']:.2f} "
        f"| {r['max_abs_diff']:.1e} |"
    )


if __name__ == "__main__":
    main()
