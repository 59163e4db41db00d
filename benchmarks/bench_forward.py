"""Time one model forward over the paged KV cache: decode steps and a long prefill.

Measures what the engine's runner does per step: the forward over a flattened batch plus logits
of each request's last position, through an attention backend (its own cache layout, its
metadata, its kernels; several backends side by side in one run). Attention metadata is built
once per shape outside the timed region (the runner builds it once per step; its cost is printed
separately). Medians of repeats.

    .venv/bin/python benchmarks/bench_forward.py                 # fp32 and bf16, default model
    .venv/bin/python benchmarks/bench_forward.py --dtype bf16 --batch-sizes 1 16 64 --context 256
    .venv/bin/python benchmarks/bench_forward.py --dtype bf16 --attention-backend torch vllm-cpu
    .venv/bin/python benchmarks/bench_forward.py --dtype bf16 --threads 1 --compare-logits \
        --cpu-time --repeats 8 --prefill-prompts    # docs/perf.md, "bf16 accuracy"

Results and the reference numbers are in docs/model.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedkv.engine.cpu_runtime import tune_malloc
from pagedkv.model.loader import load_model
from pagedkv.ops.backends import (
    BACKEND_CHOICES,
    CommonAttentionMetadata,
    bind_metadata,
    select_backend,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_step(model, backend, specs, block_size, q_lens, seq_lens):
    """Inputs of one step: requests with q_lens new tokens ending at seq_lens, blocks 1, 2, ..."""
    num_reqs = len(q_lens)
    max_blocks = -(-max(seq_lens) // block_size)
    block_tables = torch.arange(1, num_reqs * max_blocks + 1, dtype=torch.int32).view(
        num_reqs, max_blocks
    )
    positions, slots, qsl = [], [], [0]
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for pos in range(seq_len - q_len, seq_len):
            positions.append(pos)
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
        qsl.append(qsl[-1] + q_len)
    common = CommonAttentionMetadata(
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(slots),
    )
    start = time.perf_counter()
    attn_metadata = bind_metadata(backend, common, specs, validate=False)
    build_ms = (time.perf_counter() - start) * 1e3
    input_ids = torch.randint(100, model.config.vocab_size, (len(positions),))
    last_rows = torch.tensor(qsl[1:]) - 1
    return input_ids, torch.tensor(positions), attn_metadata, last_rows, build_ms


def time_step(model, kv_caches, step, repeats, clock=time.perf_counter):
    input_ids, positions, attn_metadata, last_rows, _ = step
    times = []
    with torch.inference_mode():
        for i in range(repeats + 2):
            start = clock()
            hidden = model.forward(input_ids, positions, kv_caches, attn_metadata)
            model.compute_logits(hidden[last_rows])
            if i >= 2:  # two warm-up runs
                times.append(clock() - start)
    return statistics.median(times)


def compare_logits(model, kv_caches, step, repeats, clock, rounds=6):
    """Median decode step with the logits only widened from bf16 and with the fp32 top-k
    recomputation (pagedkv.model.logits), alternating rounds: (rounded_s, refined_s)."""
    weight = model.lm_head_weight
    rounded, refined = [], []
    try:
        for _ in range(rounds):
            model.lm_head_weight = None
            rounded.append(time_step(model, kv_caches, step, repeats, clock))
            model.lm_head_weight = weight
            refined.append(time_step(model, kv_caches, step, repeats, clock))
    finally:
        model.lm_head_weight = weight
    return statistics.median(rounded), statistics.median(refined)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default SmolLM2)")
    parser.add_argument("--dtype", choices=[*DTYPES, "both"], default="both")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=256, help="tokens per decode request")
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument(
        "--prefill-prompts",
        type=int,
        nargs="*",
        default=[8, 1],
        help="prefill runs: the prefill tokens split into this many prompts of equal length",
    )
    parser.add_argument(
        "--attention-backend",
        nargs="+",
        choices=BACKEND_CHOICES,
        default=["torch"],
        help="backends to time side by side (default torch)",
    )
    parser.add_argument("--block-size", type=int, default=None, help="default: each backend's own")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default all)")
    parser.add_argument("--no-tune-malloc", action="store_true")
    parser.add_argument(
        "--compare-logits",
        action="store_true",
        help="bf16 decode: time rounded vs fp32-refined top logits, alternating rounds",
    )
    parser.add_argument(
        "--cpu-time", action="store_true", help="time process CPU time (a shared machine)"
    )
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter

    tuned = False if args.no_tune_malloc else tune_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, malloc tuned: {tuned}, context {args.context}")
    dtypes = list(DTYPES) if args.dtype == "both" else [args.dtype]
    for name in dtypes:
        start = time.perf_counter()
        model = load_model(args.model, dtype=DTYPES[name]).model
        load_s = time.perf_counter() - start
        config = model.config
        print(f"\n{name}: load {load_s:.1f} s")
        for backend_name in args.attention_backend:
            choice = select_backend(
                backend_name, "cpu", model.dtype, config.head_dim, block_size=args.block_size
            )
            run_backend(model, choice.backend, choice.block_size, args, clock)


def run_backend(model, backend, bs, args, clock=time.perf_counter) -> None:
    """Every decode batch and prefill of ``args`` on ``backend`` with blocks of ``bs``."""
    max_batch = max(args.batch_sizes)
    num_blocks = 1 + max(max_batch * -(-(args.context + 1) // bs), -(-args.prefill_tokens // bs))
    specs = model.attention_layer_specs(bs)
    kv_caches = [backend.allocate_kv_cache(num_blocks, spec) for spec in specs]
    print(f" {backend.name}, block size {bs}:")
    for batch in args.batch_sizes:
        step = make_step(model, backend, specs, bs, [1] * batch, [args.context + 1] * batch)
        if args.compare_logits and getattr(model, "lm_head_weight", None) is not None:
            rounded, refined = compare_logits(model, kv_caches, step, args.repeats, clock)
            print(
                f"  decode batch {batch:3d}: logits rounded {rounded * 1e3:7.1f} ms, "
                f"top-k refined {refined * 1e3:7.1f} ms ({refined / rounded:.3f}x)"
            )
            continue
        seconds = time_step(model, kv_caches, step, args.repeats, clock)
        print(
            f"  decode batch {batch:3d}: {seconds * 1e3:7.1f} ms/step "
            f"({batch / seconds:6.0f} tok/s; metadata build {step[-1]:.2f} ms)"
        )
    n = args.prefill_tokens
    for num_prompts in args.prefill_prompts:
        length = n // num_prompts
        step = make_step(model, backend, specs, bs, [length] * num_prompts, [length] * num_prompts)
        seconds = time_step(model, kv_caches, step, max(2, args.repeats // 4), clock)
        print(
            f"  prefill {num_prompts} x {length} tokens: {seconds:6.2f} s "
            f"({num_prompts * length / seconds:5.0f} tok/s)"
        )


if __name__ == "__main__":
    main()
