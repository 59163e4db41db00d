"""Beam search on the engine (beams fork their KV blocks) against transformers' beam search, same
run, same weights (the default model's GGUF, read by both), same prompts.

For each beam width (``--widths 4,8``), ``--num-prompts`` prompts of ``--prompt-len`` token ids
(seeded, all the same length so that transformers batches them without padding) are searched
for ``--max-tokens`` tokens with ``length_penalty`` 1:

  pagedkv       ``LLM.beam_search(prompts, BeamSearchParams(w, max_tokens))``: every prompt's
                beams in one batch (``max_num_seqs`` = prompts x w); a beam chosen k times forks
                k - 1 children that map its blocks (copy-on-write of the shared last block)
  transformers  ``model.generate(num_beams=w, do_sample=False, early_stopping=False,
                num_return_sequences=w)`` on all prompts at once (one batch of prompts x w rows;
                its KV cache is dense, one row per beam, reordered every step)

Measured per width and path:

  peak KV (tokens)  pagedkv: blocks held right after a step's schedule(), the most over the run,
                    times the block size; transformers: rows x (prompt + generated tokens) at the
                    end (its cache at its largest). "independent" is what beams that share
                    nothing would hold: prompts x w x (prompt + max_tokens) tokens.
  seconds           wall clock of the whole search (the model already loaded), and tokens/s =
                    the tokens of all returned sequences / seconds (the same numerator for both
                    paths when their sequences are equal, so the ratio is the time ratio)
  equal             prompts whose w sequences equal transformers' token for token (in float32 they
                    all should: the search follows transformers' rules)

    .venv/bin/python benchmarks/bench_beam_search.py                  # w = 4 and 8, 64 prompts
    .venv/bin/python benchmarks/bench_beam_search.py --widths 2 --num-prompts 4 --max-tokens 8
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from pagedkv.cpu_caps import cpu_model_name
from pagedkv.engine.llm import LLM
from pagedkv.model.loader import default_model_path, load_model
from pagedkv.sampling_params import BeamSearchParams


def prompts_of(num_prompts: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num_prompts`` prompts of ``prompt_len`` token ids from ``[1000, vocab_size)`` (ordinary
    tokens, past the special ones), deterministic in ``seed``."""
    rng = random.Random(seed)
    return [
        [rng.randrange(1000, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)
    ]


def run_pagedkv(llm: LLM, prompts: list[list[int]], width: int, max_tokens: int) -> dict[str, Any]:
    """The engine's beam search of every prompt in one batch; the peak of blocks held."""
    engine = llm.engine
    scheduler, kv = engine.scheduler, engine.kv_cache_manager
    schedule = scheduler.schedule
    peak = 0

    def counting():
        nonlocal peak
        out = schedule()
        peak = max(peak, kv.num_blocks - 1 - kv.num_free_blocks)
        return out

    scheduler.schedule = counting
    try:
        started = time.perf_counter()
        outputs = llm.beam_search(
            [{"prompt_token_ids": p} for p in prompts], BeamSearchParams(width, max_tokens)
        )
        seconds = time.perf_counter() - started
    finally:
        scheduler.schedule = schedule
    sequences = [
        [s.tokens[len(p) :] for s in out.sequences] for p, out in zip(prompts, outputs, strict=True)
    ]
    block_size = engine.config.cache_config.block_size
    return {
        "peak_blocks": peak,
        "peak_kv_tokens": peak * block_size,
        "seconds": seconds,
        "sequences": sequences,
    }


def run_transformers(
    model, prompts: list[list[int]], width: int, max_tokens: int, eos: int | None
) -> dict[str, Any]:
    """transformers' beam search of every prompt in one batch (equal lengths: no padding)."""
    input_ids = torch.tensor(prompts)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=1.0,
            early_stopping=False,
        )
    seconds = time.perf_counter() - started
    prompt_len = len(prompts[0])
    rows = out.tolist()
    sequences = []
    for i in range(len(prompts)):
        beams = []
        for row in rows[i * width : (i + 1) * width]:
            generated = row[prompt_len:]
            if eos is not None and eos in generated:
                generated = generated[: generated.index(eos) + 1]
            beams.append(generated)
        sequences.append(beams)
    return {
        "peak_kv_tokens": len(prompts) * width * out.shape[1],
        "seconds": seconds,
        "sequences": sequences,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="4,8", help="beam widths, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=32, help="most generated tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--attention-backend", default="torch", help="the engine's backend")
    parser.add_argument("--num-threads", type=int, default=None, help="default: the engine's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    if min(*widths, args.num_prompts, args.prompt_len, args.max_tokens) < 1:
        parser.error("widths, --num-prompts, --prompt-len and --max-tokens must be >= 1")
    path = default_model_path()
    loaded = load_model(path, dtype=torch.float32)  # float32: transformers' equal
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    hf = None
    if not args.skip_transformers:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    rows = []
    for width in widths:
        num_seqs = args.num_prompts * width
        seq_blocks = -(-(args.prompt_len + args.max_tokens) // args.block_size)
        llm = LLM(
            loaded_model=loaded,
            dtype="float32",
            attention_backend=args.attention_backend,
            block_size=args.block_size,
            num_blocks=num_seqs * seq_blocks + 16,
            max_model_len=args.prompt_len + args.max_tokens,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(8192, num_seqs),
            num_threads=args.num_threads,
        )
        prompts = prompts_of(
            args.num_prompts, args.prompt_len, loaded.config.vocab_size, args.seed + width
        )
        ours = run_pagedkv(llm, prompts, width, args.max_tokens)
        tokens = sum(len(s) for beams in ours["sequences"] for s in beams)
        row: dict[str, Any] = {
            "width": width,
            "prompts": args.num_prompts,
            "independent_kv_tokens": num_seqs * (args.prompt_len + args.max_tokens),
            "pagedkv_peak_blocks": ours["peak_blocks"],
            "pagedkv_peak_kv_tokens": ours["peak_kv_tokens"],
            "pagedkv_s": round(ours["seconds"], 2),
            "pagedkv_tok_s": round(tokens / ours["seconds"], 1),
        }
        if hf is not None:
            eos = hf.generation_config.eos_token_id
            eos = eos[0] if isinstance(eos, list) else eos
            theirs = run_transformers(hf, prompts, width, args.max_tokens, eos)
            their_tokens = sum(len(s) for beams in theirs["sequences"] for s in beams)
            equal = sum(a == b for a, b in zip(ours["sequences"], theirs["sequences"], strict=True))
            row |= {
                "hf_peak_kv_tokens": theirs["peak_kv_tokens"],
                "hf_s": round(theirs["seconds"], 2),
                "hf_tok_s": round(their_tokens / theirs["seconds"], 1),
                "speedup": round(theirs["seconds"] / ours["seconds"], 2),
                "kv_ratio": round(theirs["peak_kv_tokens"] / ours["peak_kv_tokens"], 2),
                "equal_prompts": equal,
            }
        rows.append(row)
        del llm
    header = {
        "cpu": cpu_model_name(),
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "attention_backend": args.attention_backend,
        "dtype": "float32",
    }
    if args.json:
        print(json.dumps({**header, "rows": rows}, indent=2))
        return 0
    print(" ".join(f"{k}={v}" for k, v in header.items()))
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
