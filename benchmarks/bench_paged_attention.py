"""Decode (or prefill) attention of each attention backend vs the same over a contiguous cache.

For each (batch, context, heads/kv_heads/head_size, dtype), every request has ``context`` tokens
(physical blocks shuffled) and one decode query, or with ``--query-len N`` its last N tokens as
the step's causal queries (``--query-len`` = context: a whole prompt's prefill; then ``dense``
and ``dense_sdpa`` are both SDPA with the causal mask). Timed per call (one layer):

  dense       q * scale -> bmm(q, K^T) -> softmax (fp32 inside) -> bmm(P, V) on contiguous K/V
              ``[batch * kv_heads, context, head_size]``: the torch path's math without paging
  dense_sdpa  torch's scaled_dot_product_attention on the contiguous K/V (enable_gqa)
  <backend>   backend.forward on its own paged cache (written by its own write_kv), with a
              prebuilt metadata, at its default block size or ``name:block_size``
  metadata    backend.build_metadata for the step (+ the torch path's gather plan): once per
              step, not per layer

Every backend runs in the same process, interleaved round by round, so the ratios
(``<backend>/dense``) compare like with like on a noisy machine. As in a real forward, consecutive
calls read different layers' caches: at least ``--cold-bytes`` of K/V per method (default 512 MiB,
above the 300 MiB L3 of the Xeon this was written on), so no call reads data its previous call
left in cache. Medians of ``--repeats`` rounds. Examples::

    .venv/bin/python benchmarks/bench_paged_attention.py                  # issue-14 grid
    .venv/bin/python benchmarks/bench_paged_attention.py --threads 2 --context 1024 \\
        --backends torch torch:32 vllm-cpu vllm-cpu:16
    .venv/bin/python benchmarks/bench_paged_attention.py --threads 2 --batch 1 --context 2000 \\
        --query-len 2000 --dtype fp32 --backends torch native vllm-cpu   # a long prompt
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedkv.engine.cpu_runtime import tune_malloc
from pagedkv.ops.backends import (
    BACKENDS,
    AttentionLayerSpec,
    CommonAttentionMetadata,
    TorchBackend,
)
from pagedkv.ops.backends._torch.gather_plan import get_gather_plan  # to time it per step

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def dense_grouped(q, k, v, scale):
    """q [B, H, D]; k, v [B * kv_heads, ctx, D] contiguous -> [B, H, D]."""
    b, h, d = q.shape
    qs = (q * scale).view(k.shape[0], h * b // k.shape[0], d)
    scores = torch.bmm(qs, k.transpose(1, 2))
    return torch.bmm(torch.softmax(scores, -1), v).view(b, h, d)


def dense_causal(q, k, v, scale):
    """q [B, q_len, H, D] (the last q_len positions); k, v [B * kv_heads, ctx, D].

    Returns [B * q_len, H, D]."""
    b, q_len, h, d = q.shape
    ctx = k.shape[1]
    k = k.view(b, -1, ctx, d)
    v = v.view(b, -1, ctx, d)
    pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
    mask = torch.arange(ctx).unsqueeze(0) <= pos  # [q_len, ctx], bottom-right aligned
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(b * q_len, h, d)


def dense_sdpa(q, k, v, scale):
    b, _, d = q.shape
    k = k.view(b, -1, k.shape[1], d)
    v = v.view(b, -1, v.shape[1], d)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
    return out.squeeze(2)


class Method:
    """One backend at one block size, with its caches and step metadata."""

    def __init__(
        self, label, backend, block_size, batch, context, shape, dtype, denses, gen, query_len=1
    ):
        num_heads, num_kv_heads, head_size = shape
        self.label, self.backend = label, backend
        self.spec = AttentionLayerSpec(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            block_size=block_size,
            dtype=dtype,
        )
        blocks_per_req = -(-context // block_size)
        num_blocks = batch * blocks_per_req + 1
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, blocks_per_req)
        pos = torch.arange(context)
        slots = (perm.long()[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
        seq_lens = torch.full((batch,), context, dtype=torch.int32)
        write_step = CommonAttentionMetadata(
            block_tables=perm.to(torch.int32),
            seq_lens=seq_lens,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32) * context,
            slot_mapping=slots,
        )
        self.common = CommonAttentionMetadata(
            block_tables=perm.to(torch.int32),
            seq_lens=seq_lens,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32) * query_len,
            slot_mapping=slots.view(batch, context)[:, context - query_len :].reshape(-1),
        )
        write_md = backend.build_metadata(write_step, self.spec, validate=False)
        self.caches = []
        for k, v in denses:  # [B * kv_heads, ctx, D] -> tokens [B * ctx, kv_heads, D]
            cache = backend.allocate_kv_cache(num_blocks, self.spec)
            tokens = (batch, num_kv_heads, context, head_size)
            key = k.view(tokens).transpose(1, 2).reshape(-1, num_kv_heads, head_size)
            value = v.view(tokens).transpose(1, 2).reshape(-1, num_kv_heads, head_size)
            backend.write_kv(key, value, cache, write_md)
            self.caches.append(cache)
        self.md = self.build()

    def build(self):
        md = self.backend.build_metadata(self.common, self.spec, validate=False)
        if isinstance(self.backend, TorchBackend):  # its first layer builds the gather plan
            spec = self.spec
            get_gather_plan(
                md.paged,
                spec.num_kv_heads,
                spec.head_size,
                spec.kv_cache_dtype.itemsize,
                None if spec.kv_cache_dtype.itemsize == 1 else spec.num_heads // spec.num_kv_heads,
            )
        return md

    def __call__(self, i, queries):
        return self.backend.forward(queries[i], self.caches[i], self.md)


def round_ms(fn, num_layers: int) -> float:
    start = time.perf_counter()
    for layer in range(num_layers):
        fn(layer)
    return (time.perf_counter() - start) / num_layers * 1e3


def run_config(args, batch, context, shape, dtype_name):
    num_heads, num_kv_heads, head_size = shape
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(0)
    layer_bytes = 2 * batch * context * num_kv_heads * head_size * dtype.itemsize
    num_layers = max(2, min(args.max_layers, -(-args.cold_bytes // layer_bytes)))
    denses = [
        torch.randn(2, batch * num_kv_heads, context, head_size, generator=gen).to(dtype)
        for _ in range(num_layers)
    ]
    q_len = args.query_len
    queries = [
        torch.randn(batch * q_len, num_heads, head_size, generator=gen).to(dtype)
        for _ in range(num_layers)
    ]
    scale = head_size**-0.5
    if q_len > 1:
        methods = {
            "dense": lambda i: dense_causal(
                queries[i].view(batch, q_len, num_heads, head_size), *denses[i], scale
            )
        }
    else:
        methods = {"dense": lambda i: dense_grouped(queries[i], denses[i][0], denses[i][1], scale)}
    if not args.no_sdpa and q_len == 1:
        methods["dense_sdpa"] = lambda i: dense_sdpa(queries[i], denses[i][0], denses[i][1], scale)
    backends = {}
    for text in args.backends:
        name, _, size = text.partition(":")
        cls = BACKENDS[name]
        if cls.unavailable_reason("cpu") is not None:
            print(f"# {name}: {cls.unavailable_reason('cpu')}")
            continue
        backend = cls("cpu")
        block_size = int(size) if size else backend.default_block_size(head_size, dtype)
        label = f"{name}:{block_size}"
        m = Method(label, backend, block_size, batch, context, shape, dtype, denses, gen, q_len)
        backends[label] = m
        methods[label] = lambda i, m=m: m(i, queries)
    times = {label: [] for label in methods}
    meta = {label: [] for label in backends}
    for fn in methods.values():  # warm-up
        for layer in range(num_layers):
            fn(layer)
    for _ in range(args.repeats):  # interleaved rounds
        for label, fn in methods.items():
            times[label].append(round_ms(fn, num_layers))
        for label, m in backends.items():
            start = time.perf_counter()
            m.build()
            meta[label].append((time.perf_counter() - start) * 1e3)
    expected = methods["dense"](0).float()
    row = {label: statistics.median(t) for label, t in times.items()}
    diffs = {label: (methods[label](0).float() - expected).abs().max().item() for label in backends}
    metas = {label: statistics.median(t) for label, t in meta.items()}
    return row, diffs, metas, num_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--shape", nargs="+", default=["9/3/64"], help="heads/kv_heads/head_size")
    parser.add_argument("--dtype", nargs="+", default=["bf16"], choices=list(DTYPES))
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["torch", "vllm-cpu"],
        help="name or name:block_size (default block size: the backend's fastest)",
    )
    parser.add_argument(
        "--query-len",
        type=int,
        default=1,
        help="the last N tokens of each request are the step's causal queries (1: decode)",
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--cold-bytes", type=int, default=512 << 20, help="K/V bytes cycled per method per round"
    )
    parser.add_argument("--max-layers", type=int, default=48)
    parser.add_argument("--no-sdpa", action="store_true")
    args = parser.parse_args()
    if not 1 <= args.query_len <= min(args.context):
        parser.error(f"--query-len must be 1 .. the smallest --context ({min(args.context)})")
    torch.set_num_threads(args.threads)
    tune_malloc()
    print(
        f"torch {torch.__version__}, threads {args.threads}, medians of {args.repeats} "
        "interleaved rounds; ms per call (one layer); ratio = time / dense"
    )
    with torch.inference_mode():
        for dtype_name in args.dtype:
            for shape_text in args.shape:
                shape = tuple(int(x) for x in shape_text.split("/"))
                for batch in args.batch:
                    for context in args.context:
                        row, diffs, metas, layers = run_config(
                            args, batch, context, shape, dtype_name
                        )
                        print(
                            f"\n{dtype_name} {shape_text} batch {batch} context {context} "
                            f"({layers} layers cycled)"
                        )
                        print("| method | ms | / dense | metadata/step ms | max diff |")
                        print("|---|---|---|---|---|")
                        for label, ms in row.items():
                            meta = f"{metas[label]:.2f}" if label in metas else "-"
                            diff = f"{diffs[label]:.1e}" if label in diffs else "-"
                            print(
                                f"| {label} | {ms:.2f} | {ms / row['dense']:.2f}x | {meta} "
                                f"| {diff} |",
                                flush=True,
                            )


if __name__ == "__main__":
    main()
