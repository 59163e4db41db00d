"""When a seeded request reproduces (docs/server.md, "Reproducible seeds"), tested as stated.

- Guaranteed, in any dtype: the same seeded request, run alone on an engine in the same prefix
  cache state (cold after ``reset_prefix_cache``, or with prefix caching off) with the same
  options, gives the same tokens; a fresh engine with the same options gives them too.
- Measured, float32 only: the issue's request (chat, n=2, temperature 1, 12 tokens) gives the
  same tokens cold, warm and batched with other requests.
- Not promised: bfloat16 across cache states or batch compositions (the GEMM kernel, hence the
  rounding, depends on how many rows a step computes): measured by
  benchmarks/seed_reproducibility.py, not tested.
"""

from __future__ import annotations

import pytest

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]
PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=1234)
OTHERS = ["The capital of France is", "def fib(n):", "Once upon a time"]


def engine_for(loaded, **options) -> LLMEngine:
    return LLMEngine(loaded_model=loaded, max_model_len=512, num_threads=2, **options)


def run(engine: LLMEngine, request_id: str, others=()) -> list[list[int]]:
    """The request's sample token ids (with ``others`` greedy requests in the same steps)."""
    engine.add_request(request_id, MESSAGES, PARAMS)
    for i, prompt in enumerate(others):
        engine.add_request(f"{request_id}-{i}", prompt, SamplingParams(temperature=0))
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    return [c.token_ids for c in final[request_id].outputs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_same_request_same_cache_state_same_tokens(dtype, loaded_bf16, loaded_fp32):
    loaded = loaded_bf16 if dtype == "bfloat16" else loaded_fp32
    engine = engine_for(loaded)
    first = run(engine, "a")
    assert len({tuple(s) for s in first}) == 2  # the two samples differ (seed, seed + 1)
    assert engine.reset_prefix_cache()
    assert run(engine, "b") == first
    # Without prefix caching every run starts from the same (empty) cache state.
    uncached = engine_for(loaded, enable_prefix_caching=False)
    assert run(uncached, "d") == run(uncached, "e") == first


def test_float32_is_the_same_cold_warm_and_batched(loaded_fp32):
    engine = engine_for(loaded_fp32)
    cold = run(engine, "cold")
    assert run(engine, "warm") == cold  # the prompt's blocks now come from the prefix cache
    assert engine.reset_prefix_cache()
    assert run(engine, "batched", OTHERS) == cold
