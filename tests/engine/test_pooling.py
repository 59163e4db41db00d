"""Pooling (embedding) requests against Hugging Face transformers' hidden states on the same GGUF
weights (fp32): the pooled vector of ``last``, ``mean`` and ``cls`` pooling equals the one pooled
from transformers' ``last_hidden_state`` (after the final norm) within ``ATOL`` per component
(measured: about 1e-6), and equals itself batched with generation requests, chunked over many
steps, from a prefix-cache hit (last pooling) and after a preemption.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.engine.llm import LLM
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.errors import InvalidRequestError
from pagedkv.pooling_params import POOLING_TYPES, PoolingParams
from pagedkv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

#: Largest difference of one component of a normalized vector from transformers' (fp32 both;
#: the engine's attention and products sum in another order).
ATOL = 1e-5

TEXTS = [
    "Hi!",
    "What is the capital of France? What is the capital of Italy?",
    "Explain in simple words how a hash table handles collisions, and when chaining is better "
    "than open addressing. " * 5,
]


@pytest.fixture(scope="module")
def prompt_ids(loaded_fp32):
    ids = [loaded_fp32.tokenizer.encode(text) for text in TEXTS]
    assert [len(i) for i in ids] == [2, 14, 106]  # the preemption test's sizes
    return ids


@pytest.fixture(scope="module")
def hf_states(hf_model, prompt_ids):
    """transformers' final-norm hidden states ``[num_tokens, hidden_size]`` of each prompt."""
    with torch.no_grad():
        return [hf_model.model(torch.tensor([ids])).last_hidden_state[0] for ids in prompt_ids]


def hf_pooled(states: torch.Tensor, pooling: str) -> np.ndarray:
    vector = {"last": states[-1], "mean": states.mean(dim=0), "cls": states[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=0).numpy()


def make_llm(loaded_fp32, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 512)
    return LLM(dtype="float32", loaded_model=loaded_fp32, **kwargs)


def run_all(engine: LLMEngine) -> dict:
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output
    return results


@pytest.mark.parametrize("pooling", POOLING_TYPES)
def test_pooled_vector_equals_transformers(loaded_fp32, prompt_ids, hf_states, pooling):
    vectors = make_llm(loaded_fp32).embed(prompt_ids, pooling=pooling)
    hidden_size = loaded_fp32.config.hidden_size
    for vector, states in zip(vectors, hf_states, strict=True):
        assert vector.dtype == np.float32 and vector.shape == (hidden_size,)
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
        np.testing.assert_allclose(vector, hf_pooled(states, pooling), rtol=0, atol=ATOL)


def test_normalize_false_gives_the_raw_state(loaded_fp32, prompt_ids, hf_states):
    (vector,) = make_llm(loaded_fp32).embed([prompt_ids[1]], pooling="mean", normalize=False)
    expected = hf_states[1].mean(dim=0).numpy()
    np.testing.assert_allclose(vector, expected, rtol=0, atol=ATOL * float(np.abs(expected).max()))


@pytest.mark.parametrize("pooling", POOLING_TYPES)
def test_chunked_prefill_gives_the_same_vector(loaded_fp32, prompt_ids, hf_states, pooling):
    # 16 tokens a step: the long prompt is pooled over 8 chunks (mean pooling sums across them).
    llm = make_llm(loaded_fp32, max_num_batched_tokens=16)
    vectors = llm.embed(prompt_ids, pooling=pooling)
    assert llm.get_stats().num_steps >= len(prompt_ids[-1]) // 16
    for vector, states in zip(vectors, hf_states, strict=True):
        np.testing.assert_allclose(vector, hf_pooled(states, pooling), rtol=0, atol=ATOL)


def test_pooling_batched_with_generation(loaded_fp32, prompt_ids, hf_states):
    """Generation and pooling requests in the same steps (chunked): each pooled vector is the
    one computed alone, and each generation's tokens are those generated alone."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    alone = make_llm(loaded_fp32).generate(prompt_ids, greedy, use_tqdm=False)
    engine = make_llm(loaded_fp32, max_num_batched_tokens=48).engine
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"gen-{i}", ids, greedy)
        for pooling in POOLING_TYPES:
            engine.add_request(f"{pooling}-{i}", ids, PoolingParams(pooling_type=pooling))
    results = run_all(engine)
    for i, states in enumerate(hf_states):
        assert results[f"gen-{i}"].token_ids == alone[i].token_ids
        assert results[f"gen-{i}"].embedding is None
        for pooling in POOLING_TYPES:
            output = results[f"{pooling}-{i}"]
            assert output.finish_reason == "stop" and output.token_ids == []
            np.testing.assert_allclose(output.embedding, hf_pooled(states, pooling), atol=ATOL)


def test_last_pooling_uses_a_prefix_hit_mean_and_cls_do_not(loaded_fp32, prompt_ids, hf_states):
    llm = make_llm(loaded_fp32)
    engine = llm.engine
    block_size = engine.config.cache_config.block_size
    long_ids, states = prompt_ids[-1], hf_states[-1]
    engine.add_request("first", long_ids, PoolingParams(pooling_type="last"))
    first = run_all(engine)["first"]
    assert first.num_cached_tokens == 0
    # The blocks the prompt filled are in the prefix cache: a later request hits them.
    hit = (len(long_ids) - 1) // block_size * block_size
    for pooling in POOLING_TYPES:
        engine.add_request(pooling, long_ids, PoolingParams(pooling_type=pooling))
        output = run_all(engine)[pooling]
        assert output.num_cached_tokens == (hit if pooling == "last" else 0), pooling
        np.testing.assert_allclose(output.embedding, hf_pooled(states, pooling), atol=ATOL)
    # A generation request with the same prompt hits the blocks a mean-pooling request filled.
    assert engine.reset_prefix_cache()
    engine.add_request("mean", long_ids, PoolingParams(pooling_type="mean"))
    assert run_all(engine)["mean"].num_cached_tokens == 0
    engine.add_request("gen", long_ids, SamplingParams(temperature=0.0, max_tokens=2))
    assert run_all(engine)["gen"].num_cached_tokens == hit


# Mean pooling: the one whose state (a sum over chunks) a recompute must restart; a minute each.
@pytest.mark.parametrize("pooling", ["mean"])
def test_a_preempted_pooling_request_gives_the_same_vector(
    loaded_fp32, prompt_ids, hf_states, pooling
):
    """Decoding requests take the blocks of a pooling request in the middle of its chunked
    prefill (the newest running request is the victim): it recomputes from position 0.

    A pool of 22 blocks of 16 tokens; two generations of 14 + 130 tokens (9 blocks each at the
    end) have decoded 70 tokens (6 blocks each) when the pooling request of 106 tokens (7
    blocks) comes; a budget of 4 tokens a step leaves it 2 a step, so the generations outgrow
    the pool before its prompt is done."""
    engine = make_llm(
        loaded_fp32,
        block_size=16,
        attention_backend="torch",
        num_blocks=1 + 22,
        max_model_len=256,
        max_num_batched_tokens=4,
        enable_prefix_caching=False,
    ).engine
    greedy = SamplingParams(temperature=0.0, max_tokens=130, ignore_eos=True)
    engine.add_request("gen-0", prompt_ids[1], greedy)
    engine.add_request("gen-1", prompt_ids[1], greedy)
    results = {}
    while engine.scheduler.get_request("gen-0").num_output_tokens < 70:
        engine.step()
    engine.add_request("pool", prompt_ids[-1], PoolingParams(pooling_type=pooling))
    preempted = 0
    while engine.has_unfinished_requests():
        request = engine.scheduler.get_request("pool")
        if request is not None:
            preempted = request.num_preemptions
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output
    assert preempted >= 1
    assert len(results["gen-0"].token_ids) == 130
    np.testing.assert_allclose(
        results["pool"].embedding, hf_pooled(hf_states[-1], pooling), atol=ATOL
    )


def test_a_pooling_prompt_may_fill_max_model_len(loaded_fp32):
    llm = make_llm(loaded_fp32, max_model_len=64)
    (vector,) = llm.embed([[1] * 64])
    assert vector.shape == (loaded_fp32.config.hidden_size,)
    with pytest.raises(InvalidRequestError) as info:
        llm.embed([[1] * 65])
    assert info.value.param == "prompt"
    assert not llm.engine.has_unfinished_requests()


def test_unknown_pooling_is_refused(loaded_fp32):
    llm = make_llm(loaded_fp32)
    with pytest.raises(InvalidRequestError) as info:
        llm.embed(["x"], pooling="max")
    assert info.value.param == "pooling"
