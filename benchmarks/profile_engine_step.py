"""Where one engine step goes: schedule, input building, forward, logits, sampling, outputs.

    .venv/bin/python benchmarks/profile_engine_step.py [--batch 64] [--threads 2] [--steps 10]

Adds the first ``--batch`` chats of benchmarks/data/chat_prompts.jsonl (greedy, ignore_eos),
runs until every prompt is prefilled plus ``--warmup`` decode steps, then times each phase of
``--steps`` decode steps separately. Results are in docs/engine.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sampling_params import SamplingParams

WORKLOAD = Path(__file__).resolve().parent / "data" / "chat_prompts.jsonl"
PHASES = ("schedule", "prepare", "forward", "logits", "sample", "update", "outputs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    engine = LLMEngine(dtype=args.dtype, num_threads=args.threads)
    lines = WORKLOAD.read_text().splitlines()[: args.batch]
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i, line in enumerate(lines):
        engine.add_request(str(i), json.loads(line)["messages"], params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
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
        inputs = runner.prepare_inputs(out)
        t.append(time.perf_counter())
        with torch.inference_mode():
            hidden = runner.model.forward(
                inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attn_metadata
            )
            t.append(time.perf_counter())
            logits = runner.model.compute_logits(hidden[torch.from_numpy(inputs.logits_rows)])
            t.append(time.perf_counter())
            params_list = [r.sampling_params for r in out.requests]
            sampled = runner.sampler(logits, params_list, [None] * out.num_reqs).tolist()
            t.append(time.perf_counter())
        changed = scheduler.update_from_output(out, sampled)
        t.append(time.perf_counter())
        engine._process_outputs(changed)
        t.append(time.perf_counter())
        for name, a, b in zip(PHASES, t[:-1], t[1:], strict=True):
            totals[name] += b - a
    context = sum(r.num_tokens for r in scheduler.running) / max(len(scheduler.running), 1)
    step = sum(totals.values()) / args.steps
    print(
        f"batch {args.batch}, mean context {context:.0f} tokens, {torch.get_num_threads()} "
        f"threads, {args.dtype}: {step * 1e3:.1f} ms/step"
    )
    for name in PHASES:
        print(f"  {name:9s} {totals[name] / args.steps * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
