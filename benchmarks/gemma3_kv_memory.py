"""KV cache that Gemma 3 270M holds per request: its sliding-window groups against every layer as
full attention (``disable_hybrid_kv_cache_manager``), from the engine, the planner and the
simulator.

For each request length L (prompt L - max_tokens, then max_tokens greedy tokens, bf16, prompts
prefilled in steps of ``--max-num-batched-tokens``):

- engine: the peak of the blocks in use while one request runs (during its prefill), and the
  blocks in use at its last decode step, in blocks and MiB (a hybrid block id is one page of 3
  layers, a unified one of all 18);
- plan: ``KVCacheConfig.max_num_blocks_per_request`` (what ``pagedkv plan`` reports as "blocks
  each"), the same sizing the engine admits by;
- expected saving at the peak: 15/18 x (1 - live span / L), the live span of a sliding-window
  group being the window plus one step's tokens, rounded to blocks; while decoding the live span
  is the window alone: 15/18 x (1 - 512 / L);
- concurrency in one pool of ``--pool`` bytes: ``pagedkv simulate --model gemma3-270m`` on a trace
  of ``--num-requests`` requests of length L (peak requests running, steps to drain), both forms.

    .venv/bin/python benchmarks/gemma3_kv_memory.py                       # 2k, 4k, 8k
    .venv/bin/python benchmarks/gemma3_kv_memory.py --lengths 2048 --max-tokens 2

Results are in docs/model.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedkv.core.config import KVCacheConfig
from pagedkv.core.spec import cdiv, unify_kv_cache_specs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.model.config import kv_cache_layer_specs
from pagedkv.model.loader import load_model
from pagedkv.sampling_params import SamplingParams
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.workloads import SimRequest, Workload
from pagedkv.units import parse_memory_size

MiB = 1 << 20


def prompt_tokens(tokenizer, length: int) -> list[int]:
    """``length`` token ids of varied sentences (BOS first)."""
    nouns = ["kettle", "canyon", "atlas", "cello", "lantern", "meadow", "turbine", "scarf"]
    text = " ".join(
        f"In week {i}, Tomas found the {nouns[i * 3 % 8]} by gate {i * 29 % 97}."
        for i in range(length // 8 + 2)
    )
    tokens = tokenizer.encode(text)[:length]
    if len(tokens) < length:
        raise ValueError(f"prompt too short: {len(tokens)} < {length}")
    return tokens


def engine_peak(
    loaded, prompt: list[int], args, length: int, *, hybrid: bool
) -> tuple[int, int, int]:
    """(peak blocks in use while the one request runs, blocks in use at its last decode step,
    bytes per block)."""
    engine = LLMEngine(
        loaded_model=loaded,
        max_model_len=length,
        max_num_seqs=1,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_blocks=6 * cdiv(length, 16) + 1,
        enable_prefix_caching=False,
        disable_hybrid_kv_cache_manager=not hybrid,
        num_threads=args.threads,
    )
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    manager = engine.kv_cache_manager
    usable = engine.kv_cache_config.num_usable_blocks
    peak = decoding = 0
    while engine.has_unfinished_requests():
        finished = any(o.finished for o in engine.step())
        in_use = usable - manager.num_free_blocks
        peak = max(peak, in_use)
        if not finished:
            decoding = in_use
    return peak, decoding, engine.kv_cache_config.bytes_per_block


def planned(layer_specs, length: int, max_num_batched_tokens: int) -> tuple[int, int]:
    """(blocks a request of ``length`` holds at most, bytes per block), as the planner sizes."""
    config = KVCacheConfig.from_num_blocks(
        layer_specs, 2, max_num_batched_tokens=max_num_batched_tokens
    )
    return config.max_num_blocks_per_request(length), config.bytes_per_block


def simulated(layer_specs, length: int, args) -> tuple[int, int]:
    """(peak requests running, steps to drain) of the simulator's paged policy on a trace of
    ``--num-requests`` requests of ``length`` tokens, in a pool of ``--pool`` bytes."""
    config = KVCacheConfig.from_kv_cache_memory(
        layer_specs,
        parse_memory_size(args.pool),
        max_model_len=length,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    output_len = 128
    requests = [
        SimRequest(
            request_id=f"r{i}",
            prompt_token_ids=[1 + i] * (length - output_len),
            output_token_ids=[7] * output_len,
        )
        for i in range(args.num_requests)
    ]
    sim = SimConfig(
        num_blocks=config.num_blocks,
        max_model_len=length,
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_map_columns=0,
        kv_cache_specs=config.kv_cache_specs,
    )
    metrics = simulate(Workload("fixed", requests), sim, "paged").metrics
    return metrics.peak_concurrency, metrics.num_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--pool", default="256MiB", help="pool bytes of the simulator runs")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-engine", action="store_true", help="plan and simulate only")
    args = parser.parse_args()

    loaded = None if args.no_engine else load_model("gemma3-270m", dtype=torch.bfloat16)
    if loaded is not None:
        config = loaded.config
    else:
        from pagedkv.model.loader import load_model_config

        config = load_model_config("gemma3-270m")
    hybrid_specs = kv_cache_layer_specs(config, 16, "bfloat16")
    unified_specs = unify_kv_cache_specs(hybrid_specs)
    window = config.sliding_window
    step = args.max_num_batched_tokens
    print(
        f"Gemma 3 270M, bf16, block 16, steps of {step} tokens, {args.max_tokens} generated; "
        f"simulator: {args.num_requests} requests of L tokens in {args.pool}"
    )
    header = (
        "| L | engine peak: hybrid | all full | saving | expected | decoding: hybrid | saving "
        "| 15/18 x (1 - 512/L) | plan blocks: hybrid | all full | simulate peak running: hybrid "
        "| all full | steps: hybrid | all full |"
    )
    print(header)
    print("|---" * 14 + "|")
    for length in args.lengths:
        row = [f"{length:,}"]
        if loaded is not None:
            prompt = prompt_tokens(loaded.tokenizer, length - args.max_tokens)
            start = time.perf_counter()
            peaks = [engine_peak(loaded, prompt, args, length, hybrid=h) for h in (True, False)]
            seconds = time.perf_counter() - start
            (hb, hd, hbytes), (ub, ud, ubytes) = peaks
            row += [
                f"{hb} x 3 pages = {hb * hbytes / MiB:.1f} MiB",
                f"{ub} x 18 pages = {ub * ubytes / MiB:.1f} MiB",
                f"{1 - hb * hbytes / (ub * ubytes):.1%}",
            ]
        else:
            seconds = 0.0
            row += ["-", "-", "-"]
        live = (cdiv(window - 1 + step, 16) + 1) * 16
        row.append(f"{15 / 18 * (1 - min(live, length) / length):.1%}")
        if loaded is not None:
            row += [
                f"{hd} x 3 = {hd * hbytes / MiB:.1f} MiB",
                f"{1 - hd * hbytes / (ud * ubytes):.1%}",
            ]
        else:
            row += ["-", "-"]
        row.append(f"{15 / 18 * (1 - window / length):.1%}")
        (ph, _), (pu, _) = (planned(s, length, step) for s in (hybrid_specs, unified_specs))
        row += [f"{ph} x 3", f"{pu} x 18"]
        sims = [simulated(s, length, args) for s in (hybrid_specs, unified_specs)]
        row += [str(sims[0][0]), str(sims[1][0]), str(sims[0][1]), str(sims[1][1])]
        print("| " + " | ".join(row) + f" |   ({seconds:.0f} s in the engine)", flush=True)


if __name__ == "__main__":
    main()
