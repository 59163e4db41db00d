"""Where one engine step goes: schedule, input building, forward, logits, sampling, outputs.

    .venv/bin/python benchmarks/profile_engine_step.py [--batch 64] [--threads 2] [--steps 10]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python benchmarks/profile_engine_step.py --ops     # held to AVX2

Adds the first ``--batch`` chats of benchmarks/data/chat_prompts.jsonl (greedy, ignore_eos),
runs until every prompt is prefilled plus ``--warmup`` decode steps, then times each phase of
``--steps`` decode steps separately. ``--ops`` then profiles as many whole steps with
torch.profiler and splits the time by kind of op: linears (oneDNN / F.linear, the quantized
products: torch's and pagedkv's own; ``PAGEDKV_QUANT_KERNEL=torch`` for torch's only),
attention (the backend's kernels and gathers), other torch ops, and what is left: Python and
the interpreter between ops. The CPU line (pagedkv.cpu_caps) says which CPU class ran. Results
are in docs/engine.md and docs/perf.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.outputs import ModelRunnerOutput

WORKLOAD = Path(__file__).resolve().parent / "data" / "chat_prompts.jsonl"
PHASES = ("schedule", "prepare", "forward", "logits", "sample", "update", "outputs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--ops", action="store_true", help="split the step by kind of op")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    engine = LLMEngine(
        dtype=args.dtype, num_threads=args.threads, attention_backend=args.attention_backend
    )
    print(engine.cpu_capabilities.summary(engine.config.model_config.dtype))
    lines = WORKLOAD.read_text().splitlines()[: args.batch]
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i, line in enumerate(lines):
        engine.add_request(str(i), json.loads(line)["messages"], params)
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.get_running_requests()
    ):
        engine.step()
    for _ in range(args.warmup):
        engine.step()

    runner, scheduler = engine.runner, engine.scheduler
    totals = dict.fromkeys(PHASES, 0.0)
    for _ in range(args.steps):
        t = [time.perf_counter()]
        out = scheduler.schedule()
        t.append(time.perf_counter())
        batch = runner.input_batch
        batch.update(out)
        inputs = batch.prepare(out)
        t.append(time.perf_counter())
        with torch.inference_mode():
            hidden = runner.model.forward(
                inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attn_metadata
            )
            t.append(time.perf_counter())
            logits = runner.model.compute_logits(hidden[torch.from_numpy(inputs.logits_rows)])
            t.append(time.perf_counter())
            req_ids = batch.req_ids[: batch.num_reqs]  # a decode step: every row samples
            params_list = [batch.requests[r].sampling_params for r in req_ids]
            sampled = runner.sampler(logits, params_list, [None] * len(req_ids)).tolist()
            t.append(time.perf_counter())
        sampled = ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=sampled)
        changed = scheduler.update_from_output(out, sampled)
        t.append(time.perf_counter())
        engine._process_outputs(changed)
        t.append(time.perf_counter())
        for name, a, b in zip(PHASES, t[:-1], t[1:], strict=True):
            totals[name] += b - a
    running = scheduler.get_running_requests()
    context = sum(r.num_tokens for r in running) / max(len(running), 1)
    step = sum(totals.values()) / args.steps
    print(
        f"batch {args.batch}, mean context {context:.0f} tokens, {torch.get_num_threads()} "
        f"threads, {engine.config.model_config.dtype}, {engine.attention_backend.name} attention: "
        f"{step * 1e3:.1f} ms/step"
    )
    for name in PHASES:
        print(f"  {name:9s} {totals[name] / args.steps * 1e3:7.2f} ms")
    if args.ops:
        profile_ops(engine, args.steps, step * 1e3)


#: torch.profiler op names (prefixes) by kind.
LINEAR_OPS = (
    "mkldnn::_linear_pointwise",
    "aten::addmm",
    "aten::mm",
    "aten::linear",
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::_weight_int8pack_mm",
    "pagedkv::",  # pagedkv's own quantized products (pagedkv.model.kernels.cpu_quant)
)
ATTENTION_OPS = (
    "_C::cpu_attention_with_kv_cache",
    "_C::cpu_attn_reshape_and_cache",
    "_C::get_scheduler_metadata",
    "aten::bmm",
    "aten::index_select",
    "aten::_embedding_bag",
    "aten::embedding_bag",
    "aten::_softmax",
    "aten::index_copy_",
    "aten::_index_put_impl_",
    "aten::masked_fill_",
)


def profile_ops(engine: LLMEngine, steps: int, step_ms: float) -> None:
    """Profile ``steps`` whole engine steps; print each kind of op's share of the profiled
    time, and that share of ``step_ms`` (the step measured without the profiler, whose own cost
    per op inflates the profiled time)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from pagedkv.model.kernels.cpu_quant import CpuQuantKernels

    # pagedkv's kernels are ctypes calls, which the profiler does not see: name them
    for method in ("int4", "int8"):
        plain = getattr(CpuQuantKernels, method)

        def named(self, *args, _plain=plain, _name=f"pagedkv::{method}_gemm"):
            with record_function(_name):
                return _plain(self, *args)

        setattr(CpuQuantKernels, method, named)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()  # inside: the profiler's exit processes its events
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps * 1e3
    kinds = {"linears": 0.0, "attention": 0.0, "other torch ops": 0.0}
    num_ops = 0
    for event in prof.key_averages():
        self_ms = event.self_cpu_time_total / 1e3 / steps
        num_ops += event.count
        if event.key.startswith(LINEAR_OPS):
            kinds["linears"] += self_ms
        elif event.key.startswith(ATTENTION_OPS):
            kinds["attention"] += self_ms
        else:
            kinds["other torch ops"] += self_ms
    kinds["python, between ops"] = max(wall - sum(kinds.values()), 0.0)
    if os.environ.get("PAGEDKV_PROFILE_TOP"):  # the busiest ops by name
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    total = sum(kinds.values())
    print(
        f"by kind of op (torch.profiler over {steps} steps, {num_ops / steps:.0f} ops and "
        f"{wall:.1f} ms a step with the profiler; shares applied to the {step_ms:.1f} ms above):"
    )
    for name, ms in kinds.items():
        share = ms / total
        print(f"  {name:21s} {100 * share:5.1f}%  {share * step_ms:7.2f} ms")


if __name__ == "__main__":
    main()
