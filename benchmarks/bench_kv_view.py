"""What the /kv page costs the engine: a KV snapshot next to a decode step, at 10,000 blocks and
64 running requests.

    .venv/bin/python benchmarks/bench_kv_view.py [--num-blocks 10000] [--batch 64] [--steps 10]
        [--json out.json]

The real engine on the default model (SmolLM2-135M) runs ``--batch`` requests that share a
128-token prefix (each with 32 tokens of its own) in a pool of ``--num-blocks`` blocks; after the
prefill, each of ``--steps`` decode steps is timed, and so is ``engine.kv_snapshot()`` (what the
server's engine thread takes between two steps while a /kv page listens) on the state the step
left. With no page open no snapshot is taken at all. With one open, the engine loop takes at most
one snapshot per ``max(1 / KV_SNAPSHOT_RATE, snapshot time / KV_SNAPSHOT_MAX_SHARE)`` seconds, so
the share of the engine thread's time is bounded by construction; this prints the measured times,
the share per step if a snapshot were taken after every step, and the share at the loop's rate.
Results: docs/server.md ("KV cache view").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedkv.cpu_caps import probe_cpu
from pagedkv.engine.engine_loop import KV_SNAPSHOT_MAX_SHARE, KV_SNAPSHOT_RATE
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-blocks", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    engine = LLMEngine(
        num_blocks=args.num_blocks, max_num_seqs=args.batch, max_model_len=1024, block_size=16
    )
    tokenizer = engine.tokenizer
    prefix = tokenizer.encode("Paged attention keeps the KV cache in fixed-size blocks. " * 16)
    prefix = prefix[:128]
    for i in range(args.batch):
        own = tokenizer.encode(f" Request number {i} asks its own question about paging, ")[:32]
        engine.add_request(
            f"r{i}",
            {"prompt_token_ids": prefix + own},
            SamplingParams(max_tokens=args.steps + 64, ignore_eos=True, temperature=0),
        )
    while any(r.num_output_tokens == 0 for r, _ in engine.scheduler.request_states()):
        engine.step()  # the prefills
    step_times, snapshot_times = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        snapshot = engine.kv_snapshot()
        snapshot_times.append(time.perf_counter() - start)
    step = statistics.median(step_times)
    snap = statistics.median(snapshot_times)
    interval = max(1.0 / KV_SNAPSHOT_RATE, snap / KV_SNAPSHOT_MAX_SHARE)
    result = {
        "cpu": probe_cpu().name,
        "num_blocks": args.num_blocks,
        "num_running": len(engine.scheduler.get_running_requests()),
        "num_used_blocks": snapshot["num_used_blocks"],
        "num_shared_blocks": snapshot["stats"]["num_shared_blocks"],
        "decode_step_ms": round(step * 1e3, 2),
        "snapshot_ms": round(snap * 1e3, 3),
        "share_if_every_step": round(snap / step, 4),
        "snapshot_interval_s": round(interval, 3),
        "share_at_loop_rate": round(snap / interval, 4),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
