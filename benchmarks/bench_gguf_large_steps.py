"""Large steps (more than 8 rows) on a GGUF file's blocks: the int8 products against
dequantized tiles and torch's GEMM, per weight of one layer of a real-size file.

    .venv/bin/python benchmarks/bench_gguf_large_steps.py FILE [--rows 16 64 512] [--threads 2]
    .venv/bin/python benchmarks/bench_gguf_large_steps.py FILE --dtype bfloat16   # a bf16 model
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python benchmarks/bench_gguf_large_steps.py FILE      # both held to AVX2

For each 2-D weight of ``blk.0`` whose type has an int8-activation product (``--tensors``
narrows them) and each row count, times ``CpuQuantKernels.gguf_gemm_large`` (the step's rows
rounded to int8 once, the small steps' products over groups of 8 rows) and
``GGUFMatmul._tiled`` (a tile of rows dequantized into a scratch in ``--dtype``, torch's GEMM
on it) and, where the kernels take the type, ``CpuQuantKernels.gguf_gemm_fast`` (each
weight group's integer dot summed whole), in turn, best of ``--repeats`` calls each (the
machine may be shared: the best is what the code does when it gets the cores). Prints ms per
call and tiled / int8, tiled / fast (> 1: the int8 products are faster).
``CpuQuantKernels.q8_large_max_rows`` and ``cpu_quant.FAST_LARGE_MAX_ROWS`` are chosen from
these figures.
Files: ``benchmarks/make_shaped_model.py llama-3.2-1b``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from pagedkv.model.gguf_metadata import read_gguf_header
from pagedkv.model.gguf_weight import GGUFMatmul, GGUFWeight
from pagedkv.model.kernels.cpu_quant import GGML_TYPES, Q8_TYPES, default_cpu_quant_kernels


def best_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a GGUF file")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tensors", nargs="+", default=None, help="GGUF names (default: blk.0)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernels = default_cpu_quant_kernels()
    if kernels is None or kernels.activations != "q8":
        raise SystemExit("needs pagedkv's kernels with int8 activations (the default)")
    by_id = {t.type_id: name for name, t in GGML_TYPES.items()}
    header = read_gguf_header(args.model)
    mapped = np.memmap(args.model, mode="c")
    print(f"{args.model.name}: kernels {kernels.isa}, q8 body {kernels.q8_isa}, "
          f"{args.threads} threads, q8_large_max_rows {kernels.q8_large_max_rows}")  # fmt: skip
    for info in header.tensors:
        wanted = info.name in args.tensors if args.tensors else info.name.startswith("blk.0.")
        if not wanted or len(info.dims) != 2 or info.ggml_type not in Q8_TYPES:
            continue
        name = by_id[info.ggml_type]
        t = GGML_TYPES[name]
        cols, rows = info.dims
        row_bytes = cols // t.block_elems * t.block_bytes
        raw = mapped[info.offset : info.offset + rows * row_bytes].reshape(rows, row_bytes)
        weight = GGUFWeight(
            name, torch.from_numpy(np.ascontiguousarray(raw)), (rows, cols), kernels, dtype
        )
        matmul = GGUFMatmul([weight])
        for m in args.rows:
            x = torch.randn(m, cols, dtype=dtype)
            xf = x.float()
            tiled = best_ms(lambda: matmul._tiled(x), args.repeats)  # noqa: B023
            large = best_ms(
                lambda: kernels.gguf_gemm_large(weight.type_id, xf, weight.data),  # noqa: B023
                args.repeats,
            )
            line = (
                f"{info.name:24s} {name:5s} {rows:6d}x{cols:<6d} M={m:4d}: tiled {tiled:8.2f} ms,"
                f" int8 {large:8.2f} ms"
            )
            if weight.type_id in kernels.fast_large_rows:
                fast = best_ms(
                    lambda: kernels.gguf_gemm_fast(weight.type_id, xf, weight.data),  # noqa: B023
                    args.repeats,
                )
                line += f", fast {fast:8.2f} ms, tiled / fast {tiled / fast:5.2f}x"
            print(f"{line}, tiled / int8 {tiled / large:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
