"""Multi-turn chat whose history outgrows the KV pool: the KV tier (issue 26) off vs cpu vs disk.

Each of ``--conversations`` conversations starts with its own document (``--doc-tokens``
tokens) and a question, then has ``--turns - 1`` returning turns: a short question
(``--turn-tokens``) after the whole history (earlier prompts and the replies). The turns go
round robin (turn 1 of every conversation, then turn 2 ...), one request at a time, on a pool
that holds ``--pool-fraction`` of the conversations' final histories, so a returning turn finds
its history evicted from the pool: recomputed (tier off) or loaded back (tier on).

Per configuration: mean and median time to first token of the returning turns, prompt tokens
recomputed (prompt tokens minus prefix hits, pool or tier) over the returning turns, tier hits;
the outputs of every configuration must equal the tier-off ones token for token (greedy).

With ``--preemption``: instead, ``--conversations`` requests at once (each a document and a
question, ``--max-tokens`` output tokens) on a pool that holds about a third of them, so they
preempt each other: recompute without a tier, recompute with a cpu tier (evicted blocks page
out), swap with a cpu tier (a victim's blocks page out at preemption); tokens computed beyond
each request's own prompt (minus its prefix hits) and output, and throughput.

Example (the default model, SmolLM2-135M; disk tier in a temporary directory)::

    .venv/bin/python benchmarks/bench_kv_tier.py
    .venv/bin/python benchmarks/bench_kv_tier.py --conversations 8 --turns 8 --doc-tokens 1800
    .venv/bin/python benchmarks/bench_kv_tier.py --preemption --conversations 6 --doc-tokens 600 \
        --max-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from pagedkv.cpu_caps import cpu_model_name
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.model.loader import load_model
from pagedkv.sampling_params import SamplingParams


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    """``n`` deterministic token ids (a linear congruential walk over the vocabulary)."""
    out, x = [], seed * 7919 + 17
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2**31
        out.append(100 + x % (vocab - 200))
    return out


def run(args, loaded, backend: str | None, directory: str | None) -> dict:
    options = {}
    if backend is not None:
        options = {"kv_offloading_size": args.tier_mib * 2**20, "kv_offloading_backend": backend}
        if backend == "disk":
            options["kv_offloading_dir"] = directory
    vocab = loaded.config.vocab_size
    final_len = args.doc_tokens + args.turns * (args.turn_tokens + args.max_tokens)
    block_size = 16
    num_blocks = max(
        int(args.conversations * final_len * args.pool_fraction) // block_size,
        -(-(final_len + 64) // block_size),
    )
    engine = LLMEngine(
        loaded_model=loaded,
        block_size=block_size,
        num_blocks=num_blocks + 1,
        max_model_len=final_len + 64,
        max_num_seqs=1,
        max_num_batched_tokens=4096,
        hash_seed=0,
        **options,
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    histories = [
        tokens(c, args.doc_tokens, vocab) + tokens(1000 + c, args.turn_tokens, vocab)
        for c in range(args.conversations)
    ]
    outputs, ttfts, recomputed = [], [], 0
    start = time.perf_counter()
    for turn in range(args.turns):
        for c in range(args.conversations):
            prompt = histories[c]
            engine.add_request(f"c{c}t{turn}", {"prompt_token_ids": prompt}, params)
            done = None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done = out
            reply = list(done.outputs[0].token_ids)
            outputs.append(reply)
            if turn:
                ttfts.append(done.time_to_first_token)
                recomputed += len(prompt) - done.num_cached_tokens
            histories[c] = prompt + reply + tokens(100 * turn + c, args.turn_tokens, vocab)
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    engine.shutdown()
    return {
        "outputs": outputs,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_median": statistics.median(ttfts),
        "recomputed": recomputed,
        "returning_prompt_tokens": sum(
            args.doc_tokens + t * (args.turn_tokens + args.max_tokens) + args.turn_tokens
            for t in range(1, args.turns)
        )
        * args.conversations,
        "tier": stats.kv_tier,
        "elapsed": elapsed,
        "num_blocks": num_blocks,
        "final_len": final_len,
    }


def run_preemption(args, loaded, tier: bool, mode: str) -> dict:
    """``--conversations`` requests at once on a pool of about a third of their tokens."""
    vocab = loaded.config.vocab_size
    length = args.doc_tokens + args.turn_tokens + args.max_tokens
    num_blocks = max(args.conversations * length // 3 // 16, -(-length // 16) + 1)
    options = {"kv_offloading_size": args.tier_mib * 2**20} if tier else {}
    engine = LLMEngine(
        loaded_model=loaded,
        block_size=16,
        num_blocks=num_blocks + 1,
        max_model_len=length + 16,
        max_num_seqs=args.conversations,
        hash_seed=0,
        preemption_mode=mode,
        **options,
    )
    scheduled = 0
    schedule = engine.scheduler.schedule

    def counting():
        nonlocal scheduled
        out = schedule()
        scheduled += out.total_num_scheduled_tokens
        return out

    engine.scheduler.schedule = counting
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [
        tokens(c, args.doc_tokens, vocab) + tokens(1000 + c, args.turn_tokens, vocab)
        for c in range(args.conversations)
    ]
    start = time.perf_counter()
    for c, prompt in enumerate(prompts):
        engine.add_request(f"p{c}", {"prompt_token_ids": prompt}, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    elapsed = time.perf_counter() - start
    needed = sum(
        len(o.prompt_token_ids) - o.num_cached_tokens + len(o.outputs[0].token_ids) - 1
        for o in finished.values()
    )
    stats = engine.get_stats()
    engine.shutdown()
    return {
        "outputs": [finished[f"p{c}"].outputs[0].token_ids for c in range(len(prompts))],
        "recomputed": scheduled - needed,
        "preemptions": stats.scheduler.num_preemptions,
        "throughput": sum(len(o.outputs[0].token_ids) for o in finished.values()) / elapsed,
        "elapsed": elapsed,
        "tier": stats.kv_tier,
        "num_blocks": num_blocks,
    }


def main_preemption(args, loaded) -> None:
    base = None
    for name, tier, mode in (
        ("recompute, no tier", False, "recompute"),
        ("recompute, cpu tier", True, "recompute"),
        ("swap, cpu tier", True, "swap"),
    ):
        result = run_preemption(args, loaded, tier, mode)
        if base is None:
            base = result
            print(
                f"{args.conversations} requests of {args.doc_tokens + args.turn_tokens} + "
                f"{args.max_tokens} tokens at once, pool {result['num_blocks']} blocks of 16"
            )
            print(
                f"{'preemption':<21}{'preemptions':>12}{'recomputed':>12}{'tier hits':>11}"
                f"{'out tok/s':>11}{'total s':>9}  same outputs"
            )
        hits = result["tier"].num_hit_blocks if result["tier"] else 0
        print(
            f"{name:<21}{result['preemptions']:>12}{result['recomputed']:>12}{hits:>11}"
            f"{result['throughput']:>11.1f}{result['elapsed']:>9.1f}  "
            f"{result['outputs'] == base['outputs']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF or HF folder (default: SmolLM2)")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=1800)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--pool-fraction", type=float, default=0.25)
    parser.add_argument("--tier-mib", type=int, default=1024)
    parser.add_argument("--backends", nargs="+", default=["off", "cpu", "disk"])
    parser.add_argument("--preemption", action="store_true", help="swap vs recompute instead")
    args = parser.parse_args()
    loaded = load_model(args.model)
    print(f"cpu: {cpu_model_name()}")
    if args.preemption:
        main_preemption(args, loaded)
        return
    base = None
    with tempfile.TemporaryDirectory(prefix="pagedkv-tier-") as directory:
        for name in args.backends:
            result = run(args, loaded, None if name == "off" else name, directory)
            if base is None:
                base = result
                print(
                    f"{args.conversations} conversations x {args.turns} turns, histories up to "
                    f"{result['final_len']} tokens, pool {result['num_blocks']} blocks of 16 "
                    f"({args.pool_fraction:.0%} of the final histories)"
                )
                print(
                    f"{'tier':<6}{'TTFT mean':>11}{'median':>9}{'x off':>7}"
                    f"{'recomputed':>12}{'of':>8}{'tier hits':>11}{'loaded MiB':>12}"
                    f"{'load s':>8}{'total s':>9}  same outputs"
                )
            tier = result["tier"]
            print(
                f"{name:<6}{result['ttft_mean']:>10.3f}s{result['ttft_median']:>8.3f}s"
                f"{result['ttft_mean'] / base['ttft_mean']:>7.2f}"
                f"{result['recomputed']:>12}{result['returning_prompt_tokens']:>8}"
                f"{(tier.num_hit_blocks if tier else 0):>11}"
                f"{(tier.bytes_loaded / 2**20 if tier else 0):>12.1f}"
                f"{(tier.load_seconds if tier else 0):>8.3f}{result['elapsed']:>9.1f}  "
                f"{result['outputs'] == base['outputs']}"
            )


if __name__ == "__main__":
    main()
