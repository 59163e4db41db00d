"""``pagedkv bench latency``: how long one batch takes, step by step (vLLM's benchmark_latency).

    pagedkv bench latency --input-len 32 --output-len 128 --batch-size 8
    pagedkv bench latency --batch-size 1 --num-iters 5 --output-json latency.json

One batch of ``--batch-size`` prompts of ``--input-len`` random token ids (seeded), each
generating exactly ``--output-len`` tokens (greedy, ``ignore_eos``), all submitted at once;
repeated ``--num-iters`` times after ``--num-iters-warmup`` untimed runs. The prefix cache is
reset before every run, so each one computes its prompts. Reported: the batch's latency (median,
p99), the prefill (from submission until every request has its first token) and the decode steps
(each engine step after that: median, p99), in ms. Flag names as vLLM's ``benchmark_latency``; the
iteration defaults are smaller (a CPU runs one iteration in seconds, not milliseconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import numpy as np

from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.output_paths import check_output_file, write_text_or_print
from pagedkv.errors import ConfigError
from pagedkv.sampling_params import SamplingParams


def add_parser(benches: argparse._SubParsersAction, positive_int) -> None:
    """Add ``bench latency`` to the ``bench`` subcommands."""
    parser = benches.add_parser(
        "latency",
        help="latency of one batch: per run and per engine step (median, p99)",
        description=__doc__.split("\n\n")[2].replace("``", ""),
    )
    parser.add_argument("--input-len", type=positive_int, default=32, help="prompt tokens (32)")
    parser.add_argument(
        "--output-len", type=positive_int, default=128, help="generated tokens per request (128)"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=8, help="requests in the batch (8)"
    )
    parser.add_argument(
        "--num-iters-warmup", type=int, default=1, help="untimed runs first (1; vLLM: 10)"
    )
    parser.add_argument(
        "--num-iters", type=positive_int, default=3, help="timed runs (3; vLLM: 30)"
    )
    parser.add_argument("--output-json", default=None, help="also write the results here (JSON)")
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(func=run)


def percentiles(values_s: list[float]) -> dict[str, float]:
    """Median, p90 and p99 of durations in seconds, as milliseconds (NaN when empty)."""
    if not values_s:
        return {"median_ms": float("nan"), "p90_ms": float("nan"), "p99_ms": float("nan")}
    p50, p90, p99 = np.percentile(np.asarray(values_s) * 1000.0, [50, 90, 99])
    return {"median_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99)}


def run_batch(engine: Any, prompts: list[list[int]], params: Any, tag: str) -> dict[str, Any]:
    """Submit ``prompts`` at once and step the engine until all finish.

    Returns:
        ``{"latency_s", "prefill_s", "decode_step_s": [...], "num_steps", "num_output_tokens"}``:
        prefill = submission until every request has its first token; decode steps = the steps
        after that, each timed alone.
    """
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    first_token: set[str] = set()
    prefill_s = None
    decode_steps: list[float] = []
    num_output = 0
    num_steps = 0
    while engine.has_unfinished_requests():
        decoding = prefill_s is not None
        step_start = time.perf_counter()
        outputs = engine.step()
        step_end = time.perf_counter()
        num_steps += 1
        if decoding:
            decode_steps.append(step_end - step_start)
        for output in outputs:
            if output.outputs[0].token_ids:
                first_token.add(output.request_id)
            if output.finished:
                num_output += sum(len(c.token_ids) for c in output.outputs)
        if prefill_s is None and len(first_token) == len(ids):
            prefill_s = step_end - start
    return {
        "latency_s": time.perf_counter() - start,
        "prefill_s": prefill_s if prefill_s is not None else float("nan"),
        "decode_step_s": decode_steps,
        "num_steps": num_steps,
        "num_output_tokens": num_output,
    }


def summarize(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON report of the timed runs."""
    latencies = [r["latency_s"] for r in runs]
    decode = [s for r in runs for s in r["decode_step_s"]]
    num_output = sum(r["num_output_tokens"] for r in runs)
    return {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "batch_size": args.batch_size,
        "num_iters": len(runs),
        "latency": percentiles(latencies),
        "avg_latency_s": float(np.mean(latencies)),
        "prefill": percentiles([r["prefill_s"] for r in runs]),
        "decode_step": percentiles(decode),
        "num_decode_steps": len(decode),
        "output_tokens_per_s": num_output / sum(latencies),
        "latencies_s": latencies,
    }


def measure(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up and timed runs of one batch of random prompts on ``engine``; the report."""
    rng = np.random.default_rng(engine.config.model_config.seed)
    vocab_size = engine.loaded_model.config.vocab_size
    prompts = [
        rng.integers(1, vocab_size, size=args.input_len).tolist() for _ in range(args.batch_size)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    runs = []
    for i in range(args.num_iters_warmup + args.num_iters):
        engine.reset_prefix_cache()  # every run computes its prompts
        result = run_batch(engine, prompts, params, tag=f"run{i}")
        if i >= args.num_iters_warmup:
            runs.append(result)
    report = summarize(runs, args)
    report["dtype"] = engine.config.model_config.dtype
    report["kv_cache_dtype"] = engine.config.cache_config.cache_dtype
    report["cpu"] = engine.cpu_capabilities.as_dict()  # speed figures name their CPU
    return report


def format_report(report: dict[str, Any], model: str) -> str:
    """The lines printed for a report."""
    lat, pre, dec = report["latency"], report["prefill"], report["decode_step"]
    return "\n".join(
        [
            f"model {model}: batch {report['batch_size']} x ({report['input_len']} prompt + "
            f"{report['output_len']} output tokens), {report['num_iters']} runs",
            f"batch latency   median {lat['median_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms",
            f"prefill         median {pre['median_ms']:.1f} ms, p99 {pre['p99_ms']:.1f} ms "
            "(submission to every first token)",
            f"decode step     median {dec['median_ms']:.2f} ms, p99 {dec['p99_ms']:.2f} ms "
            f"({report['num_decode_steps']} steps)",
            f"throughput      {report['output_tokens_per_s']:.1f} output tokens/s",
            f"cpu             {report['cpu']['summary']} -> {report['dtype']} compute",
        ]
    )


def run(args: argparse.Namespace) -> int:
    """Run ``pagedkv bench latency``."""
    # Lazy: torch and the model load only when the benchmark runs, not at every `pagedkv` start.
    from pagedkv.engine.llm_engine import LLMEngine

    if args.num_iters_warmup < 0:
        raise ConfigError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    if args.output_json is not None:
        check_output_file(args.output_json, "--output-json")
    config = EngineConfig.from_cli_args(args)
    # The whole batch runs at once, each request at its full length.
    config = dataclasses.replace(
        config,
        max_model_len=config.max_model_len or args.input_len + args.output_len,
        max_num_seqs=max(config.max_num_seqs, args.batch_size),
    )
    engine = LLMEngine(config)
    try:
        report = measure(engine, args)
    finally:
        engine.shutdown()  # stops tensor-parallel worker processes
    report["model"] = engine.loaded_model.source
    print(format_report(report, engine.loaded_model.source), flush=True)
    if args.output_json is not None and not write_text_or_print(
        args.output_json, json.dumps(report, indent=2) + "\n", "--output-json"
    ):
        return 2
    return 0
