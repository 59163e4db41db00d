"""``pagedkv plan``: how many requests of a model fit on a device, paged versus contiguous.

    pagedkv plan Llama-3.1-8B --device H100-80GB --max-model-len 8192 --mean-len 1024
    pagedkv plan path/to/config.json --device 24GiB --kv-cache-dtype fp8 --json

Pure arithmetic on the model's shapes (no weights are loaded, no torch is imported).
"""

from __future__ import annotations

import argparse
import json

from pagedkv.units import parse_memory_size
from pagedkv.validation import positive_int_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` subcommand."""
    parser = subparsers.add_parser(
        "plan",
        help="how many requests fit in the KV cache of a device",
        description=(
            "Size the paged KV cache of MODEL on DEVICE and report how many requests fit at "
            "max_model_len (and at --mean-len), against a contiguous max-length reservation."
        ),
    )
    parser.add_argument(
        "model",
        help="catalog name (SmolLM2-135M, Llama-3.1-8B, Llama-3.1-70B, Qwen2.5-7B, "
        "Mistral-7B(-v0.1), Gemma-2-9B, Mixtral-8x7B, Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B, "
        "DeepSeek-V2-Lite, DeepSeek-V3), a Hugging Face id sharing one's shape "
        "(meta-llama/Llama-3.1-8B-Instruct), a config.json path or folder, or a .gguf file",
    )
    parser.add_argument(
        "--device",
        default="H100-80GB",
        help="H100-80GB, H200-141GB (H200), B200-180GB (B200), A100-40GB, A100-80GB, L4, L40S, "
        "A10G, RTX-4090, MI300X, apple-<unified memory> (e.g. apple-64GB, M3-Max-128GB), or a "
        "memory size such as 24GiB (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model's dtype), bfloat16, float16, float32 or fp8 (default: auto)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of device memory to use (0.9)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest request in tokens (default: the model's max_position_embeddings; longer "
        "is refused without --allow-long-max-model-len)",
    )
    parser.add_argument(
        "--allow-long-max-model-len",
        action="store_true",
        help="plan a --max-model-len beyond the model's context anyway (vLLM: "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int_arg,
        default=1,
        help="devices the model is split over; KV heads and weights split (1)",
    )
    parser.add_argument(
        "--weight-bytes",
        default=None,
        help="whole-model weight size, e.g. 16GB (default: parameters x dtype bytes; exact for "
        ".gguf)",
    )
    parser.add_argument(
        "--activation-bytes",
        default=None,
        help="peak activation memory per device, e.g. 2GiB (default: a rough estimate)",
    )
    parser.add_argument(
        "--overhead-bytes",
        default="0",
        help="other memory per device (CUDA context, graphs), e.g. 1.2GiB (default: 0)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per step: activations, sliding-window live blocks (2048)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most running requests (256)")
    parser.add_argument(
        "--mean-len",
        type=int,
        default=None,
        help="typical request length in tokens: also report paged concurrency at it",
    )
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="size sliding-window layers as full attention (one KV cache group), as vLLM's flag "
        "of the same name: what the sliding windows save, by comparison",
    )
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="explicit block count (wins over memory)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``pagedkv plan``; returns 0 (errors are raised as ConfigError subclasses)."""
    # Lazy: the model catalog (~35 ms) loads only for `pagedkv plan`.
    from pagedkv.plan.planner import plan_capacity

    def size(text: str | None) -> int | None:
        return None if text is None else parse_memory_size(text)

    plan = plan_capacity(
        args.model,
        args.device,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        weight_bytes=size(args.weight_bytes),
        activation_bytes=size(args.activation_bytes),
        overhead_bytes=size(args.overhead_bytes) or 0,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        mean_len=args.mean_len,
        num_blocks=args.num_blocks,
        allow_long_max_model_len=args.allow_long_max_model_len,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
    )
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.format_table())
    return 0
