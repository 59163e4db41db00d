"""Does a seeded request reproduce across prefix-cache states and batch compositions? Measured.

For each dtype, one seeded chat request (n=2, temperature 1, 12 tokens, the case from issue 12) is
run on one engine: cold (empty prefix cache), warm (its prompt cached by the cold run), batched
(cold again, with other requests in the same steps), again cold after ``reset_prefix_cache``, and on
an engine without prefix caching. It prints whether each run's tokens equal the cold run's and the
largest difference of the first step's logits against the cold run.

    .venv/bin/python benchmarks/seed_reproducibility.py [--dtypes bfloat16 float32] [--json]

Also shows why: the rows of oneDNN's packed GEMM (the model's linear layers) for the last row of a
64-row input, computed with fewer rows (a warm prefix cache computes fewer prompt rows; a
different batch, a different number of decode rows).
"""

from __future__ import annotations

import argparse
import json

import torch

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.model.loader import load_model
from pagedkv.model.packed_linear import PackedLinear, linear_mode
from pagedkv.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]
OTHERS = ["The capital of France is", "def fib(n):", "Once upon a time"]


def measure(dtype: str, seed: int) -> dict:
    loaded = load_model(dtype=getattr(torch, dtype))
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=seed)

    def run(engine: LLMEngine, request_id: str, others=()):
        logits: list[torch.Tensor] = []
        model = engine.runner.model
        compute_logits = model.compute_logits

        def record(hidden):
            out = compute_logits(hidden)
            if not logits:
                logits.append(out[:1].clone())  # the request's first sampled row
            return out

        model.compute_logits = record
        try:
            engine.add_request(request_id, MESSAGES, params)
            for i, prompt in enumerate(others):
                engine.add_request(f"{request_id}-{i}", prompt, SamplingParams(temperature=0))
            final = {}
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        final[output.request_id] = output
        finally:
            model.compute_logits = compute_logits
        return [c.token_ids for c in final[request_id].outputs], logits[0]

    engine = LLMEngine(loaded_model=loaded, max_model_len=512)
    cold, cold_logits = run(engine, "cold")
    runs = {"warm": run(engine, "warm")}
    engine.reset_prefix_cache()
    runs["batched"] = run(engine, "batched", OTHERS)
    engine.reset_prefix_cache()
    runs["cold again"] = run(engine, "again")
    uncached = LLMEngine(loaded_model=loaded, max_model_len=512, enable_prefix_caching=False)
    runs["no prefix caching"] = run(uncached, "uncached")
    return {
        name: {
            "same_tokens": tokens == cold,
            "first_logits_max_diff": float((logits - cold_logits).abs().max()),
        }
        for name, (tokens, logits) in runs.items()
    }


def gemm_row_dependence(dtype: str) -> dict[int, float]:
    """Max |diff| of the last output row of a packed [960 x 576] GEMM (the fused q/k/v shape of
    SmolLM2-135M) computed with M rows vs with 64 rows."""
    torch.manual_seed(0)
    d = getattr(torch, dtype)
    linear = PackedLinear(torch.randn(960, 576, dtype=d), None, mode=linear_mode("cpu", d))
    x = torch.randn(64, 576, dtype=d)
    reference = linear(x)[-1]
    return {m: float((linear(x[64 - m :])[-1] - reference).abs().max()) for m in (1, 8, 16, 33, 40)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {
        dtype: {"runs": measure(dtype, args.seed), "gemm_rows": gemm_row_dependence(dtype)}
        for dtype in args.dtypes
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for dtype, result in results.items():
        print(f"{dtype}: against the cold run")
        for name, r in result["runs"].items():
            print(
                f"  {name:18s} same tokens: {r['same_tokens']!s:5s}  "
                f"first-step logits max |diff|: {r['first_logits_max_diff']:.3g}"
            )
        rows = ", ".join(f"{m}: {v:.3g}" for m, v in result["gemm_rows"].items())
        print(f"  packed GEMM last row, M rows vs 64 rows, max |diff|: {rows}")


if __name__ == "__main__":
    main()
