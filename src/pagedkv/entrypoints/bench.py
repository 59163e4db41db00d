"""``pagedkv bench``: ``throughput`` (offline, pagedkv vs Hugging Face generate), ``latency`` (one
batch, per step: :mod:`pagedkv.entrypoints.bench_latency`) and ``serving`` (any OpenAI-compatible
server: :mod:`pagedkv.entrypoints.bench_serving`).

    pagedkv bench throughput --backend pagedkv
    pagedkv bench throughput --backend hf
    pagedkv bench throughput --backend both          (both on one workload, in one run)
    pagedkv bench latency --input-len 32 --output-len 128 --batch-size 8
    pagedkv bench serving --port 8000 --num-prompts 64 --max-concurrency 8

Workload: chat prompts from a JSONL file (default: the committed 64-prompt set
``benchmarks/data/chat_prompts.jsonl``), all submitted at once, ``max_tokens`` output tokens each
with ``ignore_eos`` so both backends do the same work, greedy. Reported: output tokens/s, mean and
median time to first token (from submission), and the pagedkv / HF ratio. The HF baseline is
transformers' ``generate`` on the same GGUF weights, in batches of ``--hf-batch-size`` with left
padding (the usual way to batch it). A base model without a chat template (``--model
gemma3-270m``) gets each chat's last user message as a plain completion prompt (BOS added, as
both tokenizers do), on both backends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.cpu_caps import probe_cpu, resolve_dtype
from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints import bench_latency, bench_serving
from pagedkv.entrypoints.generate import load_prompts
from pagedkv.entrypoints.output_paths import check_output_file, write_text_or_print
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import SamplingParams
from pagedkv.validation import check_int, positive_int_arg

#: The committed workload, found from the source tree (editable install / checkout).
DEFAULT_WORKLOAD = (
    Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "chat_prompts.jsonl"
)


@dataclass(slots=True)
class BenchResult:
    """One backend's numbers on the workload; ``cpu`` is :meth:`CpuCapabilities.as_dict` of
    the machine it ran on (speed figures name their CPU)."""

    backend: str
    dtype: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float
    output_tokens_per_s: float
    mean_ttft_s: float
    median_ttft_s: float
    extra: dict[str, Any]
    cpu: dict[str, Any] = field(default_factory=dict)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand with its `throughput`, `latency` and `serving` benchmarks."""
    parser = subparsers.add_parser(
        "bench", help="benchmarks: throughput (vs Hugging Face), latency, serving"
    )
    benches = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    tp = benches.add_parser("throughput", help="offline output tokens/s and TTFT")
    tp.add_argument("--backend", choices=("pagedkv", "hf", "both"), default="pagedkv")
    tp.add_argument("--input", type=Path, default=DEFAULT_WORKLOAD, help="JSONL chat prompts")
    tp.add_argument(
        "--num-prompts", type=positive_int_arg, default=None, help="first N prompts only (N >= 1)"
    )
    tp.add_argument("--max-tokens", type=positive_int_arg, default=128)
    tp.add_argument("--hf-batch-size", type=positive_int_arg, default=16)
    tp.add_argument(
        "--json", type=Path, default=None, help="write the results here (checked before the run)"
    )
    EngineConfig.add_cli_args(tp)
    tp.set_defaults(func=run)
    bench_latency.add_parser(benches, positive_int_arg)
    bench_serving.add_parser(benches, positive_int_arg)
    for bench in benches.choices.values():  # `pagedkv bench latency: error: ...` for its flags
        bench.set_defaults(subcommand_parser=bench)


def run(args: argparse.Namespace) -> int:
    """Run `pagedkv bench throughput`."""
    # Lazy (here and below): torch and the model load only when a benchmark runs, not at every
    # `pagedkv` start.
    from pagedkv.engine.cpu_runtime import tune_cpu_runtime
    from pagedkv.model.loader import resolve_model_path

    if not args.input.is_file():
        raise InvalidRequestError(f"workload file {args.input} not found; pass --input FILE")
    if args.json is not None:
        check_output_file(args.json, "--json")  # before minutes of benchmarking
    conversations = [messages for messages, _ in load_prompts(args.input)]
    if args.num_prompts is not None:
        conversations = conversations[: args.num_prompts]
    tune_cpu_runtime(args.num_threads)
    model_path = resolve_model_path(args.model)
    results = []
    if args.backend in ("pagedkv", "both"):
        results.append(bench_pagedkv(args, conversations))
        _print_result(results[-1])
    if args.backend in ("hf", "both"):
        results.append(bench_hf(args, conversations, model_path))
        _print_result(results[-1])
    if len(results) == 2:
        ratio = results[0].output_tokens_per_s / results[1].output_tokens_per_s
        print(f"\npagedkv / hf output tokens/s: {ratio:.2f}x")
    if args.json is not None and not write_text_or_print(
        args.json, json.dumps([asdict(r) for r in results], indent=2) + "\n", "--json"
    ):
        return 2  # the results are on stdout instead
    return 0


def bench_pagedkv(args: argparse.Namespace, conversations: list) -> BenchResult:
    """Run the workload through pagedkv's LLM (after a short warm-up on another prompt)."""
    from pagedkv.engine.llm import LLM

    config = EngineConfig.from_cli_args(args)
    llm = LLM(**{name: getattr(config, name) for name in config.__slots__})
    tokenizer = llm.tokenizer
    if tokenizer.has_chat_template:
        prompts = [tokenizer.apply_chat_template(c) for c in conversations]
        warmup_prompt: Any = [{"role": "user", "content": "Warm up."}]
    else:
        prompts = [tokenizer.encode(completion_text(c)) for c in conversations]
        warmup_prompt = "Warm up."
    warmup = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([warmup_prompt] * 4, warmup, use_tqdm=False)
    llm.engine.kv_cache_manager.reset_prefix_cache()
    before = llm.get_stats()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()  # stops tensor-parallel worker processes
    elapsed = time.perf_counter() - start
    stats = llm.get_stats()
    ttfts = [o.time_to_first_token for o in outputs]
    num_output = sum(len(o.token_ids) for o in outputs)
    return BenchResult(
        backend="pagedkv",
        dtype=llm.engine.config.model_config.dtype,
        cpu=llm.engine.cpu_capabilities.as_dict(),
        num_requests=len(prompts),
        num_prompt_tokens=sum(map(len, prompts)),
        num_output_tokens=num_output,
        elapsed_s=elapsed,
        output_tokens_per_s=num_output / elapsed,
        mean_ttft_s=statistics.fmean(ttfts),
        median_ttft_s=statistics.median(ttfts),
        extra={
            "attention_backend": llm.engine.attention_backend.name,
            "block_size": llm.engine.config.cache_config.block_size,
            "kv_cache_dtype": llm.engine.config.cache_config.cache_dtype,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "num_steps": stats.num_steps - before.num_steps,
            "num_preemptions": stats.scheduler.num_preemptions,
            "peak_kv_cache_usage": stats.scheduler.peak_kv_cache_usage,
            "prefix_cache_hit_rate": stats.scheduler.prefix_cache_hit_rate,
        },
    )


def bench_hf(args: argparse.Namespace, conversations: list, model_path: Path) -> BenchResult:
    """Run the workload through transformers' generate in batches with left padding."""
    import torch
    import transformers

    if model_path.is_dir():
        load_args: dict[str, Any] = {}
        source = str(model_path)
    else:
        load_args = {"gguf_file": model_path.name}
        source = str(model_path.parent)
    caps = probe_cpu()
    dtype_name = resolve_dtype(args.dtype, caps)
    dtype = getattr(torch, dtype_name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, **load_args)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **load_args)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    # The chat template writes BOS itself; a plain completion prompt gets it from the tokenizer.
    chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        prompts = [
            tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
            for c in conversations
        ]
    else:
        prompts = [completion_text(c) for c in conversations]
    check_int("--hf-batch-size", args.hf_batch_size, 1, error=InvalidRequestError)

    def generate(batch: list[str], max_tokens: int, on_first_token=None):
        enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=not chat)
        processors = transformers.LogitsProcessorList()
        if on_first_token is not None:
            processors.append(_FirstCallTimer(on_first_token))
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,  # ignore EOS: the same work as pagedkv
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                logits_processor=processors,
            )
        return enc["input_ids"].shape[1], out

    generate(prompts[:4], 8)  # warm-up
    ttfts: list[float] = []
    num_output = 0
    num_prompt = 0
    start = time.perf_counter()
    for b in range(0, len(prompts), args.hf_batch_size):
        batch = prompts[b : b + args.hf_batch_size]
        first: list[float] = []
        input_len, out = generate(batch, args.max_tokens, first.append)
        ttfts += [first[0] - start] * len(batch)
        num_output += (out.shape[1] - input_len) * len(batch)
        num_prompt += sum(
            len(tokenizer(p, add_special_tokens=not chat)["input_ids"]) for p in batch
        )
    elapsed = time.perf_counter() - start
    return BenchResult(
        backend="hf",
        dtype=dtype_name,
        cpu=caps.as_dict(),
        num_requests=len(prompts),
        num_prompt_tokens=num_prompt,
        num_output_tokens=num_output,
        elapsed_s=elapsed,
        output_tokens_per_s=num_output / elapsed,
        mean_ttft_s=statistics.fmean(ttfts),
        median_ttft_s=statistics.median(ttfts),
        extra={"batch_size": args.hf_batch_size, "transformers": transformers.__version__},
    )


def completion_text(conversation: list[dict[str, str]]) -> str:
    """The prompt a base model (no chat template) completes: the chat's last user message."""
    return next(m["content"] for m in reversed(conversation) if m["role"] == "user")


class _FirstCallTimer:
    """A logits processor that records when generate first asks for logits processing (right
    after the prefill forward: the batch's first token)."""

    def __init__(self, record) -> None:
        self.record = record
        self.called = False

    def __call__(self, input_ids, scores):
        if not self.called:
            self.called = True
            self.record(time.perf_counter())
        return scores


def _print_result(result: BenchResult) -> None:
    print(
        f"{result.backend:8s} {result.dtype}: {result.num_requests} requests, "
        f"{result.num_prompt_tokens} prompt + {result.num_output_tokens} output tokens in "
        f"{result.elapsed_s:.1f} s -> {result.output_tokens_per_s:.1f} output tokens/s; "
        f"TTFT mean {result.mean_ttft_s:.2f} s, median {result.median_ttft_s:.2f} s"
        + (f"; CPU: {result.cpu['summary']}" if result.cpu else "")
        + (f"; {json.dumps(result.extra)}" if result.extra else ""),
        flush=True,
    )
