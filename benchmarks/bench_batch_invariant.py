"""What ``--batch-invariant`` costs, and what it buys, side by side in one run.

    python benchmarks/bench_batch_invariant.py [--model smollm2] [--rounds 2]
        [--batches 1 16 64] [--max-tokens 64] [--prompt-len 512] [--json FILE]
    python benchmarks/bench_batch_invariant.py --distinct 1000 [--model smollm2]
        [--concurrency 16] [--max-tokens 48]

**Cost** (the default): for each round, an engine without the switch and one with it (the
order alternates by round, each engine built fresh, prefix caching off), each timing the same
work: ``--batches`` chats of short held-out prompts decoding ``--max-tokens`` greedy tokens
each (output tokens per second of the whole ``generate``), and one ``--prompt-len``-token
prompt (prompt tokens per second of its prefill, one output token). Prints every round's
tok/s, the ratio on/off per measurement (the spread over rounds), the CPU and the load
average.

**What it buys** (``--distinct N``): one prompt sent N times at temperature 0 through
``pagedkv serve``, each copy alongside random other traffic (``--concurrency`` requests in
flight, prompts of random lengths and max_tokens, some sharing the prompt's prefix, so steps
mix sizes, prefix hits and chunks), without and with ``--batch-invariant``; prints the number
of distinct completions (token ids and logprobs) of the prompt in each mode (goal: 1 with the
switch). Thinking Machines' count on a stock GPU engine was 80 in 1,000.

Nothing here runs in CI (timed work).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

SHORT_PROMPTS = [
    "Explain why the sky is blue to a ten-year-old.",
    "Write a haiku about a lighthouse in winter.",
    "List three ways to keep bread fresh longer.",
    "What does a compiler's register allocator do?",
    "Give me a two-line summary of the water cycle.",
    "Suggest a name for a bakery that sells only rye bread.",
    "How do bees decide where to build a new hive?",
    "Describe the smell of rain on hot asphalt.",
]


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _cpu() -> str:
    from pagedkv.cpu_caps import probe_cpu

    caps = probe_cpu()
    return caps.summary()


def _chat_prompts(n: int) -> list[str]:
    return [f"{SHORT_PROMPTS[i % len(SHORT_PROMPTS)]} (#{i})" for i in range(n)]


def _long_prompt(tokenizer, length: int) -> list[int]:
    words = " ".join(SHORT_PROMPTS) + " "
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer.encode(words)
    return ids[:length]


def measure(model: str, invariant: bool, batches: list[int], max_tokens: int, prompt_len: int):
    """``{"batch B": output tok/s, "prompt": prompt tok/s}`` of one fresh engine."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(model, batch_invariant=invariant, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(_chat_prompts(2), SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    out = {}
    for batch in batches:
        start = time.perf_counter()
        results = llm.generate(_chat_prompts(batch), greedy)
        elapsed = time.perf_counter() - start
        tokens = sum(len(r.outputs[0].token_ids) for r in results)
        out[f"batch {batch}"] = tokens / elapsed
    ids = _long_prompt(llm.get_tokenizer(), prompt_len)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": ids}, one)
    out[f"prompt {prompt_len}"] = prompt_len / (time.perf_counter() - start)
    del llm
    return out


def run_cost(args) -> dict:
    rows: dict[str, dict[str, list[float]]] = {}
    loads = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for invariant in order:
            got = measure(args.model, invariant, args.batches, args.max_tokens, args.prompt_len)
            for name, value in got.items():
                rows.setdefault(name, {"off": [], "on": []})["on" if invariant else "off"].append(
                    value
                )
        loads.append(_load())
        print(f"round {r + 1}: load average {loads[-1]}", flush=True)
    print(f"\n{args.model} on {_cpu()}; {args.rounds} rounds, order alternating")
    print(f"{'work':<14} {'off tok/s':>20} {'on tok/s':>20} {'on/off':>16}")
    result = {"model": args.model, "cpu": _cpu(), "load": loads, "rows": {}}
    for name, sides in rows.items():
        ratios = [on / off for on, off in zip(sides["on"], sides["off"], strict=True)]
        print(
            f"{name:<14} {' / '.join(f'{v:.1f}' for v in sides['off']):>20} "
            f"{' / '.join(f'{v:.1f}' for v in sides['on']):>20} "
            f"{min(ratios):.2f}-{max(ratios):.2f}x".rjust(16)
        )
        result["rows"][name] = {**sides, "ratio": ratios}
    return result


class _Traffic:
    """The runs of the one prompt still to send, and the completions they got."""

    def __init__(self, runs: int):
        self.lock = threading.Lock()
        self.left = runs
        self.completions: list[tuple] = []


def _client(state: _Traffic, url: str, args, prompt: str, seed: int) -> None:
    """One client: the prompt (greedy, logprobs) or other traffic, at random, until the
    prompt's runs are all sent."""
    import httpx

    local = random.Random(seed)
    with httpx.Client(timeout=600) as client:
        while True:
            with state.lock:
                take = state.left > 0 and local.random() < 0.5
                if take:
                    state.left -= 1
                elif state.left <= 0:
                    return
            if take:
                body = {
                    "model": args.model,
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "logprobs": 1,
                }
            else:  # other traffic: sizes, prefixes and chunks vary the steps
                extra = " ".join(local.choice(SHORT_PROMPTS) for _ in range(local.randint(0, 12)))
                body = {
                    "model": args.model,
                    "prompt": (prompt + " " if local.random() < 0.5 else "") + extra,
                    "max_tokens": local.randint(1, args.max_tokens),
                    "temperature": local.choice([0, 0.8]),
                }
            reply = client.post(url, json=body).json()
            if take:
                choice = reply["choices"][0]
                key = (choice["text"], tuple(choice["logprobs"]["token_logprobs"]))
                with state.lock:
                    state.completions.append(key)


def run_distinct(args) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from _server import own_server

    prompt = "Write one sentence about the history of paper."
    result = {"model": args.model, "cpu": _cpu(), "runs": args.distinct}
    for invariant in (False, True):
        flags = ["--model", args.model, "--max-num-seqs", str(args.concurrency * 2)]
        if invariant:
            flags.append("--batch-invariant")
        state = _Traffic(args.distinct)
        rng = random.Random(0)
        with own_server(flags, 300, echo=False) as server:
            threads = [
                threading.Thread(
                    target=_client,
                    args=(
                        state,
                        server.url + "/v1/completions",
                        args,
                        prompt,
                        rng.randint(0, 2**31),
                    ),
                )
                for _ in range(args.concurrency)
            ]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - start
        completions = state.completions
        distinct = len(set(completions))
        texts = len({c[0] for c in completions})
        mode = "on" if invariant else "off"
        print(
            f"--batch-invariant {mode}: {distinct} distinct completions (token logprobs "
            f"included; {texts} distinct texts) in {len(completions)} runs, {elapsed:.0f} s, "
            f"load average {_load()}",
            flush=True,
        )
        result[mode] = {"distinct": distinct, "distinct_texts": texts, "runs": len(completions)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--distinct", type=int, default=0, help="runs of the one prompt")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = run_distinct(args) if args.distinct else run_cost(args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
