"""fp8 KV cache accuracy: ``--kv-cache-dtype`` fp8_e4m3 / fp8_e5m2 against the compute dtype.

For each attention backend that runs here and each fp8 KV dtype, the default model (float32
compute) runs the same chat prompts as with ``kv_cache_dtype="auto"``:

- teacher-forced: the logprob of every prompt token given the ones before
  (``prompt_logprobs=0``); mean and max absolute difference against auto's, in nats;
- free-running: ``--num-tokens`` greedy tokens; "exact" counts the prompts whose tokens equal
  auto's.

    .venv/bin/python benchmarks/kv_cache_dtype_accuracy.py --num-prompts 8 --num-tokens 16

Prompts: ``benchmarks/data/bf16_prompts.jsonl`` (``--num-prompts`` of them, evenly spaced over
its categories). Results in docs/engine.md (KV-cache dtype).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

DATA = Path(__file__).parent / "data" / "bf16_prompts.jsonl"


def run(llm, prompts, num_tokens):
    """Greedy tokens and per-prompt logprobs of the prompt tokens (tensors)."""
    from pagedkv.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=num_tokens, temperature=0, ignore_eos=True, prompt_logprobs=0
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    logprobs = [
        torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)])
        for o, p in zip(outs, prompts, strict=True)
    ]
    return [o.outputs[0].token_ids for o in outs], logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--num-tokens", type=int, default=16)
    args = parser.parse_args()

    from pagedkv.cpu_caps import probe_cpu
    from pagedkv.engine.llm import LLM
    from pagedkv.model.loader import default_model_path, load_model
    from pagedkv.ops.backends import available_backends

    loaded = load_model(default_model_path(), dtype=torch.float32)
    lines = DATA.read_text().splitlines()  # spread over the categories
    lines = lines[:: max(1, len(lines) // args.num_prompts)][: args.num_prompts]
    prompts = [
        loaded.tokenizer.apply_chat_template([{"role": "user", "content": json.loads(x)["prompt"]}])
        for x in lines
    ]
    print(f"cpu: {probe_cpu().summary('float32')}; {len(prompts)} prompts")
    backends = [n for n, why in available_backends("cpu").items() if why is None]
    for backend in backends:
        common = {"dtype": "float32", "loaded_model": loaded, "attention_backend": backend}
        ref_tokens, ref_lps = run(LLM(**common), prompts, args.num_tokens)
        for kv in ("fp8_e4m3", "fp8_e5m2"):
            llm = LLM(kv_cache_dtype=kv, **common)
            tokens, lps = run(llm, prompts, args.num_tokens)
            diff = torch.cat([(a - b).abs() for a, b in zip(lps, ref_lps, strict=True)])
            exact = sum(t == r for t, r in zip(tokens, ref_tokens, strict=True))
            print(
                f"{llm.engine.attention_backend.name:9s} {kv}: prompt logprobs |diff| mean "
                f"{diff.mean():.3f} max {diff.max():.2f} nats; greedy {args.num_tokens} tokens "
                f"exact {exact}/{len(prompts)}"
            )


if __name__ == "__main__":
    main()
