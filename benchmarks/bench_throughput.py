"""Offline throughput, pagedkv vs Hugging Face generate, on the committed 64-chat workload.

    .venv/bin/python benchmarks/bench_throughput.py [extra `pagedkv bench throughput` flags]
    .venv/bin/python benchmarks/bench_throughput.py --attention-backend torch   # one backend

Runs both backends in one process on benchmarks/data/chat_prompts.jsonl (64 chat prompts, 35-464
tokens after the chat template, 8,079 prompt tokens), 128 output tokens each with ignore_eos,
greedy, in ``--dtype`` (default auto: bf16 where the CPU computes bf16 natively, else fp32; both
engines run the same dtype); prints output tokens/s, time to first token and the ratio, and writes
benchmarks/results/throughput.json (pagedkv's attention backend and block size in its extra
fields; ``--attention-backend`` defaults to auto). Then, in the same process and at the
engine's thread count, it times a large GEMM in that dtype (bench_machine_roof.py) and prints
each backend's matmul work per second against it: the compute roof. A decode token costs
2 x (linear-layer and LM-head weights) flops plus attention (4 x heads x head size x context
per layer); a prompt token the same without the LM head. Results and the command are recorded
in docs/engine.md and docs/perf.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pagedkv.entrypoints.cli import main

HERE = Path(__file__).resolve().parent


def model_flops(num_prompt: int, num_requests: int, output_len: int) -> tuple[float, float]:
    """(flops of the prompts, flops of the output tokens) of the default model's forward,
    counting matmuls only (weights x 2, attention QK and PV at each token's context)."""
    from pagedkv.model.loader import load_model_config

    c = load_model_config(None)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    body, lm_head = 2 * c.num_hidden_layers * per_layer, 2 * c.hidden_size * c.vocab_size
    attn = 4 * c.num_hidden_layers * q  # x context
    mean_prompt = num_prompt / num_requests
    prompt = num_prompt * (body + attn * mean_prompt / 2)  # causal: half the prompt on average
    ctx = mean_prompt + output_len / 2
    output = num_requests * output_len * (body + lm_head + attn * ctx)
    return prompt, output


def report_roof(results_file: Path) -> None:
    """Print the GEMM peak and each backend's matmul GFLOP/s against it (ignore_eos: every
    request has the same output length)."""
    import torch

    from bench_machine_roof import gemm_gflops

    results = json.loads(results_file.read_text())
    dtype = results[0]["dtype"]  # the engines' compute dtype (auto resolves per CPU)
    peak = gemm_gflops(2048, getattr(torch, dtype), repeats=7)
    print(f"\n{results[0]['cpu']['name']}, {results[0]['cpu']['isa']}{_caps(results[0])}")
    print(f"{dtype} GEMM 2048^3 at {torch.get_num_threads()} threads: {peak:.0f} GFLOP/s")
    for r in results:
        output_len = r["num_output_tokens"] // r["num_requests"]
        prompt, output = model_flops(r["num_prompt_tokens"], r["num_requests"], output_len)
        per_token = output / r["num_output_tokens"]
        decode = per_token * r["output_tokens_per_s"] / 1e9
        total = (prompt + output) / r["elapsed_s"] / 1e9
        print(
            f"{r['backend']:8s}: {per_token / 1e6:.0f} MFLOP per output token x "
            f"{r['output_tokens_per_s']:.1f} tok/s = {decode:.1f} GFLOP/s = "
            f"{100 * decode / peak:.1f}% of the GEMM peak; with the prompts' work "
            f"{total:.1f} GFLOP/s = {100 * total / peak:.1f}%"
        )


def _caps(result: dict) -> str:
    caps = result["cpu"]["caps"]
    return " (capped by " + " ".join(f"{k}={v}" for k, v in caps.items()) + ")" if caps else ""


if __name__ == "__main__":
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    argv = [
        "bench",
        "throughput",
        "--backend",
        "both",
        "--input",
        str(HERE / "data" / "chat_prompts.jsonl"),
        "--max-tokens",
        "128",
        "--json",
        str(results / "throughput.json"),
        *sys.argv[1:],
    ]
    code = main(argv)
    if code == 0:
        last_json = len(argv) - 1 - argv[::-1].index("--json")  # a later --json wins
        report_roof(Path(argv[last_json + 1]))
    sys.exit(code)
