"""The machine's roofs: large-GEMM throughput (compute) and large-tensor read bandwidth (memory).

A decode step cannot beat ``flops / GEMM roof`` nor ``bytes read / read bandwidth``; throughput
figures elsewhere (tok/s) are reported against these, measured in the same run as them where
possible. Medians of ``--repeats``. Also a decode-shaped linear (``[64, 576] x [576, 1536]``, the
default model's MLP at batch 64) through oneDNN's prepacked kernel, in each dtype: on a CPU
without native bf16 (AVX2) bf16 falls to a few percent of fp32 there, which is why dtype auto
follows the CPU (pagedkv.cpu_caps; docs/perf.md#cpu-classes). Example::

    .venv/bin/python benchmarks/bench_machine_roof.py --threads 1 2
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python benchmarks/bench_machine_roof.py      # the same machine held to AVX2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def gemm_gflops(n: int, dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of ``[n, n] @ [n, n]`` in ``dtype`` (2 n^3 flops per product)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up (oneDNN / MKL pick their kernel)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def read_gbps(num_bytes: int, repeats: int) -> float:
    """GB/s of summing a ``num_bytes`` float32 tensor (reads it once; far above any L3)."""
    x = torch.ones(num_bytes // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


def copy_gbps(num_bytes: int, repeats: int) -> float:
    """GB/s of copying a ``num_bytes`` tensor into another (STREAM's convention: bytes read plus
    bytes written, ``2 * num_bytes`` per copy)."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * num_bytes / statistics.median(times) / 1e9


def linear_gflops(dtype: torch.dtype, repeats: int, m: int = 64, n: int = 1536, k: int = 576):
    """GFLOP/s of a decode-shaped ``[m, k] x [k, n]`` linear, weight prepacked for oneDNN where
    it takes this dtype (else ``F.linear``)."""
    w = torch.randn(n, k).to(dtype)
    x = torch.randn(m, k).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w)

        def run():
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:  # oneDNN cannot prepack this dtype here (bf16 on AVX2)

        def run():
            return torch.nn.functional.linear(x, w)

    run()
    times = []
    for _ in range(max(repeats, 20)):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 2 * m * n * k / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--size", type=int, default=2048, help="GEMM n (n x n x n)")
    parser.add_argument("--read-mib", type=int, default=1024, help="tensor read for bandwidth")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from pagedkv.cpu_caps import probe_cpu

    caps = probe_cpu()
    # a bf16 GEMM without native bf16 runs at ~2 GFLOP/s: a smaller one says as much
    bf16_size = args.size if caps.native_bf16 else min(args.size, 512)
    print(caps.summary())
    print(
        f"torch {torch.__version__}; GEMM {args.size}^3 (bf16 {bf16_size}^3); read "
        f"{args.read_mib} MiB; decode-shaped linear [64, 576] x [576, 1536]"
    )
    print(
        "| threads | bf16 GEMM GFLOP/s | fp32 GEMM GFLOP/s | bf16 linear | fp32 linear "
        "| read GB/s |"
    )
    print("|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        bf16 = gemm_gflops(bf16_size, torch.bfloat16, args.repeats)
        fp32 = gemm_gflops(args.size, torch.float32, args.repeats)
        bf16_linear = linear_gflops(torch.bfloat16, args.repeats)
        fp32_linear = linear_gflops(torch.float32, args.repeats)
        gbps = read_gbps(args.read_mib << 20, args.repeats)
        print(
            f"| {threads} | {bf16:.1f} | {fp32:.0f} | {bf16_linear:.1f} | {fp32_linear:.1f} "
            f"| {gbps:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
