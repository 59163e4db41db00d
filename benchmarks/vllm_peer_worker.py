"""vLLM's offline engine as a line-driven worker; run by bench_vllm_peer.py in vLLM's own venv.

    <vllm venv>/bin/python benchmarks/vllm_peer_worker.py MODEL_DIR PROMPTS_JSON MAX_TOKENS

Imports nothing of pagedkv (it runs in another interpreter). Builds ``vllm.LLM`` once (timed:
the start-up figure), warms it up, prints ``{"event": "ready", ...}`` as one JSON line on stdout,
then for each ``run`` line on stdin generates the whole workload (prompts given as token ids,
greedy, ``max_tokens`` each with ``ignore_eos``), after resetting the prefix cache, and prints
``{"event": "result", ...}``; ``quit`` (or end of input) exits. Anything else vLLM prints goes to
stderr, so stdout carries only these JSON lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time


def main() -> int:
    model_dir, prompts_path, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dtype = sys.argv[4] if len(sys.argv) > 4 else "bfloat16"
    # The protocol gets its own copy of stdout; fd 1 itself then points at stderr, so that
    # nothing vLLM or its engine-core process prints can reach the protocol's stream.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with open(prompts_path) as f:
        token_prompts = json.load(f)
    start = time.perf_counter()
    import vllm  # here, not at the top: its import is part of the timed start-up

    llm = vllm.LLM(model=model_dir, dtype=dtype, seed=0)
    prompts = [{"prompt_token_ids": ids} for ids in token_prompts]
    warmup = vllm.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts[:4], warmup, use_tqdm=False)
    startup_s = time.perf_counter() - start
    config = llm.llm_engine.vllm_config
    ready = {
        "event": "ready",
        "startup_s": startup_s,
        "vllm": vllm.__version__,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "block_size": config.cache_config.block_size,
    }
    print(json.dumps(ready), file=out, flush=True)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        with contextlib.suppress(Exception):  # older releases: no prefix cache to reset
            llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
        result = {
            "event": "result",
            "elapsed_s": elapsed,
            "num_output_tokens": num_output,
            "output_tokens_per_s": num_output / elapsed,
        }
        print(json.dumps(result), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
