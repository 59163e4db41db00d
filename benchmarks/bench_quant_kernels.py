"""pagedkv's AVX2 weight-only kernels against torch's, per linear of SmolLM2-135M.

    .venv/bin/python benchmarks/bench_quant_kernels.py [--threads 2] [--rounds 3]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python \
        benchmarks/bench_quant_kernels.py                       # torch held to AVX2

For each shape (q/k/v stacked 576 -> 960, o 576 -> 576, gate/up stacked 576 -> 3072, down
1536 -> 576 as int4 groups of 32; the LM head 576 -> 49152 as int8 per row) and M = 1, 4, 8
activation rows, times ``QuantizedMatmul`` with pagedkv's kernels (fp32 activations) and with
torch's (``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``, bf16 activations), the two
alternating round by round (the machine may be shared: only ratios of adjacent runs mean
much). Each timing is the median of ``--repeats`` calls cycling through copies of the weight
that together exceed the last-level cache (64 MB), so that a call reads its weight from memory
as in a decode step (whose 4-bit weights are 67 MB). Prints one line per shape and M: ms per
call, ours and torch's, and torch / ours per round; ``--output-json`` writes them.

``--gguf`` instead times the kernels on GGUF blocks as the file stores them (gguf_blocks.c) on
a Llama-3.2-1B-sized layer (gate_up 16384 x 2048, down 2048 x 8192), for each type of
``--types`` and each body the CPU runs (``--isas``): the product at M = 1 (``--rows``) and
dequantization to fp32 in tiles of 64 rows, in GB/s of weight bytes read. "cold" cycles
through copies of the weight that exceed the last-level cache (as a decode step reads its
weights), "hot" reuses one copy (it stays in the last-level cache); each is the best and the
median of ``--repeats`` calls (the machine may be shared: the best is what the kernel does when
it gets the cores)::

    .venv/bin/python benchmarks/bench_quant_kernels.py --gguf [--threads 2] [--types Q4_K Q6_K]

``--activations fp32 q8`` times each product with fp32 activations (the default) and with
int8 ones (``CpuQuantKernels(activations="q8")``, the default: every quantized type; the float
types run fp32 either way; "avx512" runs the VNNI body where the CPU has it).

``--engine`` instead builds two engines on the default model (SmolLM2-135M, the GGUF's 4-bit
weights), one with pagedkv's kernels and one with ``PAGEDKV_QUANT_KERNEL=torch``, gives each
one greedy chat (batch 1, ``ignore_eos``), and alternates blocks of ``--repeats`` decode steps
between them for ``--rounds`` rounds: median ms per step of each, and torch / ours per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from pagedkv.cpu_caps import probe_cpu
from pagedkv.model.kernels.cpu_quant import load_cpu_quant_kernels
from pagedkv.model.packaged_models import cache_dir
from pagedkv.model.quantization import QuantizedMatmul, quantize_int4, quantize_int8

#: (name, out_features, in_features, bits): SmolLM2-135M's products of a decode step
SHAPES = (
    ("qkv", 960, 576, 4),
    ("o", 576, 576, 4),
    ("gate_up", 3072, 576, 4),
    ("down", 576, 1536, 4),
    ("lm_head", 49152, 576, 8),
)
#: bytes of weight copies cycled through per shape: more than a last-level cache (32 MB on
#: the EPYC measured), as a decode step's 67 MB of 4-bit weights are
WORKING_SET = 64 << 20


def time_calls(calls, x, repeats: int) -> float:
    """Median ms of one call, cycling through ``calls`` (one per weight copy)."""
    for call in calls:
        call(x)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        calls[i % len(calls)](x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--shapes", nargs="+", default=[shape[0] for shape in SHAPES])
    parser.add_argument("--output-json", type=Path)
    parser.add_argument("--engine", action="store_true", help="whole decode steps, batch 1")
    parser.add_argument("--gguf", action="store_true", help="GGUF blocks: GB/s per type")
    parser.add_argument("--types", nargs="+", default=None, help="--gguf: GGML type names")
    parser.add_argument("--isas", nargs="+", default=["avx512", "avx2"])
    parser.add_argument(
        "--activations", nargs="+", default=["fp32"], choices=["fp32", "q8"], help="--gguf"
    )
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="--gguf: Q4_0 / Q4_1 also laid out in bands of 8 rows (the AVX2 body's layout)",
    )
    parser.add_argument(
        "--gguf-shapes",
        nargs="+",
        default=None,
        metavar="NAME:N:K",
        help="--gguf: weight shapes (default gate_up:16384:2048 down:2048:8192)",
    )
    args = parser.parse_args()
    if args.engine:
        compare_engines(args)
        return
    if args.gguf:
        bench_gguf(args)
        return
    torch.set_num_threads(args.threads)
    kernels = load_cpu_quant_kernels(cache_dir() / "kernels")
    print(f"{probe_cpu().summary()}; {args.threads} threads; kernels {kernels.path.name}")
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, out_features, in_features, bits in SHAPES:
        if name not in args.shapes:
            continue
        dense = torch.randn(out_features, in_features, generator=gen)
        weight = quantize_int8(dense) if bits == 8 else quantize_int4(dense)
        # int4: half a byte per weight and 8 bytes of scale and min per 32; int8: a byte
        nbytes = out_features * in_features * (1 if bits == 8 else 0.75)
        copies = max(1, round(WORKING_SET / nbytes))
        ours = [QuantizedMatmul(weight, kernels) for _ in range(copies)]
        theirs = [QuantizedMatmul(weight) for _ in range(copies)]
        with torch.inference_mode():
            for rows in args.rows:
                x = torch.randn(rows, in_features, generator=gen)
                ours_ms, torch_ms = [], []
                for _ in range(args.rounds):
                    ours_ms.append(time_calls(ours, x, args.repeats))
                    torch_ms.append(time_calls(theirs, x, args.repeats))
                ratios = [t / o for t, o in zip(torch_ms, ours_ms, strict=True)]
                row = {
                    "shape": name,
                    "out_features": out_features,
                    "in_features": in_features,
                    "bits": bits,
                    "rows": rows,
                    "ours_ms": ours_ms,
                    "torch_ms": torch_ms,
                    "speedup": ratios,
                }
                results.append(row)
                print(
                    f"{name:8s} {in_features:5d} -> {out_features:5d} int{bits} M={rows}: "
                    f"ours {statistics.median(ours_ms):.3f} ms, torch "
                    f"{statistics.median(torch_ms):.3f} ms, torch/ours "
                    + " / ".join(f"{r:.2f}" for r in ratios)
                )
    if args.output_json:
        args.output_json.write_text(json.dumps({"threads": args.threads, "results": results}))


#: (name, out_features, in_features): Llama-3.2-1B's widest products
GGUF_SHAPES = (("gate_up", 16384, 2048), ("down", 2048, 8192))


def random_gguf_weight(type_name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Raw blocks uint8 ``[n, row_bytes]`` of a GGML type: random bits with each f16 scale
    field in (0, 0.01) (the float types: random normal values)."""
    from pagedkv.model.kernels.cpu_quant import _SCALE_FIELDS, GGML_TYPES

    t = GGML_TYPES[type_name]
    if t.block_elems == 1:
        dense = torch.randn(n, k, generator=gen)
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
        return dense.to(dtype).view(torch.uint8).reshape(n, -1).contiguous()
    blocks = torch.randint(0, 256, (n, k // t.block_elems, t.block_bytes), generator=gen)
    blocks = blocks.to(torch.uint8)
    for offset in _SCALE_FIELDS[t.type_id]:
        scale = (torch.rand(n, k // t.block_elems, 1, generator=gen) * 0.01).half()
        blocks[..., offset : offset + 2] = scale.view(torch.uint8)
    return blocks.reshape(n, -1).contiguous()


def best_and_median(call, copies: int, repeats: int) -> tuple[float, float]:
    """Seconds of one call (best, median), cycling through ``copies`` inputs."""
    for i in range(copies):
        call(i)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        call(i % copies)
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def bench_gguf(args) -> None:
    """GB/s of weight bytes of the GGUF products (M = ``args.rows``) and dequantization."""
    from pagedkv.model.kernels.cpu_quant import GGML_TYPES

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    kernels = {
        (isa, act): load_cpu_quant_kernels(cache_dir() / "kernels", isa=isa, activations=act)
        for isa in args.isas
        for act in args.activations
    }
    print(f"{probe_cpu().summary()}; {args.threads} threads; GB/s of weight bytes, best / median")
    results = []
    for type_name in args.types or list(GGML_TYPES):
        t = GGML_TYPES[type_name]
        shapes = GGUF_SHAPES
        if args.gguf_shapes:
            shapes = tuple(
                (a, int(b), int(c)) for a, b, c in (v.split(":") for v in args.gguf_shapes)
            )
        for shape, n, k in shapes:
            w = random_gguf_weight(type_name, n, k, gen)
            nbytes = w.numel()
            cold = [w] + [w.clone() for _ in range(max(1, round(WORKING_SET / nbytes)) - 1)]
            layouts = [(isa, act, kern, t.type_id, cold) for (isa, act), kern in kernels.items()]
            for (isa, act), kern in kernels.items():
                if args.interleaved and kern.interleaved_type(t.type_id, n) is not None:
                    x8 = [c.clone() for c in cold]
                    ids = {kern.interleave(t.type_id, c) for c in x8}
                    layouts.append((isa + "-x8", act, kern, ids.pop(), x8))
            for isa, act, kern, type_id, weights in layouts:
                for rows in args.rows:
                    x = torch.randn(rows, k, generator=gen)
                    for where, ws in (("cold", weights), ("hot", weights[:1])):
                        best, median = best_and_median(
                            lambda i, ws=ws, x=x, kern=kern, tid=type_id: kern.gguf_gemm(
                                tid, x, ws[i]
                            ),
                            len(ws),
                            args.repeats,
                        )
                        row = dict(type=type_name, shape=shape, isa=isa, rows=rows, where=where)
                        row["activations"] = act
                        row.update(best_gbs=nbytes / best / 1e9, median_gbs=nbytes / median / 1e9)
                        results.append(row)
                        print(
                            f"{type_name:5s} {shape:8s} {n:5d}x{k:<5d} {isa:6s} {act:4s} "
                            f"gemm M={rows} {where}: "
                            f"{row['best_gbs']:6.1f} / {row['median_gbs']:6.1f}"
                        )
            # dequantization to fp32 in tiles of 64 rows (a prompt's weight tile), any body
            tile = torch.empty(64, k)
            kern = next(iter(kernels.values()))

            def dequant(i, w=w, tile=tile, kern=kern, tid=t.type_id, n=n):
                for start in range(0, n, 64):
                    kern.gguf_dequant(tid, w, tile, start)

            best, median = best_and_median(dequant, 1, max(3, args.repeats // 20))
            row = dict(type=type_name, shape=shape, isa="-", rows=0, where="dequant")
            row.update(best_gbs=nbytes / best / 1e9, median_gbs=nbytes / median / 1e9)
            results.append(row)
            print(
                f"{type_name:5s} {shape:8s} {n:5d}x{k:<5d} dequant fp32 (64-row tiles): "
                f"{row['best_gbs']:6.1f} / {row['median_gbs']:6.1f}"
            )
    if args.output_json:
        args.output_json.write_text(json.dumps({"threads": args.threads, "gguf": results}))


def compare_engines(args) -> None:
    """Decode steps at batch 1 of an engine with pagedkv's kernels and one with torch's,
    alternating blocks of ``args.repeats`` steps."""
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.model.kernels.cpu_quant import KERNEL_ENV
    from pagedkv.sampling_params import SamplingParams

    engines = {}
    for choice in ("auto", "torch"):
        os.environ[KERNEL_ENV] = choice  # read when the model's layers are built
        engine = LLMEngine(num_threads=args.threads)
        params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
        engine.add_request("0", [{"role": "user", "content": "Tell me about paging."}], params)
        for _ in range(8):  # the prefill, then a few decode steps
            engine.step()
        engines["ours" if choice == "auto" else "torch"] = engine
    print(f"{engines['ours'].cpu_capabilities.summary()}; {args.threads} threads")
    times = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            steps = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            times[name].append(statistics.median(steps) * 1e3)
    ratios = [t / o for t, o in zip(times["torch"], times["ours"], strict=True)]
    print(
        f"decode step, batch 1: ours {statistics.median(times['ours']):.2f} ms, torch "
        f"{statistics.median(times['torch']):.2f} ms; torch / ours per round "
        + " / ".join(f"{r:.2f}" for r in ratios)
    )
    if args.output_json:
        args.output_json.write_text(json.dumps({"threads": args.threads, "step_ms": times}))


if __name__ == "__main__":
    main()
