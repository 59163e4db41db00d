"""The machine's roofs: large-GEMM throughput (compute) and large-tensor read bandwidth (memory).

A decode step cannot beat ``flops / GEMM roof`` nor ``bytes read / read bandwidth``; throughput
figures elsewhere (tok/s) are reported against these, measured in the same run as them where
possible. Medians of ``--repeats``. Example::

    .venv/bin/python benchmarks/bench_machine_roof.py --threads 1 2
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--size", type=int, default=2048, help="GEMM n (n x n x n)")
    parser.add_argument("--read-mib", type=int, default=1024, help="tensor read for bandwidth")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"torch {torch.__version__}; GEMM {args.size}^3; read {args.read_mib} MiB")
    print("| threads | bf16 GEMM GFLOP/s | fp32 GEMM GFLOP/s | read GB/s |")
    print("|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        bf16 = gemm_gflops(args.size, torch.bfloat16, args.repeats)
        fp32 = gemm_gflops(args.size, torch.float32, args.repeats)
        gbps = read_gbps(args.read_mib << 20, args.repeats)
        print(f"| {threads} | {bf16:.0f} | {fp32:.0f} | {gbps:.1f} |", flush=True)


if __name__ == "__main__":
    main()
