"""The paged Llama decoder against Hugging Face transformers on the same GGUF weights (fp32)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

CHATS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List five prime numbers and say what makes a number prime.",
    "Translate to French: 'The cat sleeps on the warm windowsill while the rain falls outside.'",
    "You are reviewing code. "
    + "The function reads a file, parses each line as JSON, " * 6
    + "What could go wrong?",
    "Summarise this story: " + "Once upon a time a small robot learned to paint the sunrise. " * 20,
]
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def prompts(loaded_fp32):
    tokenizer = loaded_fp32.tokenizer
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def test_prompt_lengths_vary(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(set(lengths)) == len(prompts)
    assert lengths[0] < 40 and lengths[-1] > 250


def test_last_position_logits_match_transformers(loaded_fp32, hf_model, prompts, paged_runner):
    runner = paged_runner(loaded_fp32.model)
    for seq_id, token_ids in enumerate(prompts):
        (logits,) = runner.step([(seq_id, token_ids)])
        reference = hf_logits(hf_model, token_ids)
        assert logits.shape == reference.shape
        assert logits.dtype == torch.float32
        error = (logits[-1] - reference[-1]).abs().max().item()
        assert error < TOLERANCE, (len(token_ids), error)
        # The whole prompt, not only the last position.
        assert (logits - reference).abs().max().item() < TOLERANCE


def test_chunked_prefill_then_decode_matches_transformers(
    loaded_fp32, hf_model, prompts, paged_runner
):
    runner = paged_runner(loaded_fp32.model)
    prompt = prompts[6]
    # Chunks that cross block boundaries at odd offsets: 7, 16 (block-aligned end 23 -> 39), rest.
    chunks = [prompt[:7], prompt[7:23], prompt[23:39], prompt[39:]]
    for chunk in chunks:
        (logits,) = runner.step([(0, chunk)])
    sequence = list(prompt)
    step_logits = [logits[-1]]
    for _ in range(6):  # greedy decode steps, one token per forward
        sequence.append(int(step_logits[-1].argmax()))
        (logits,) = runner.step([(0, sequence[-1:])])
        step_logits.append(logits[-1])
    reference = hf_logits(hf_model, sequence)[len(prompt) - 1 :]
    error = (torch.stack(step_logits) - reference).abs().max().item()
    assert error < TOLERANCE


def test_mixed_batch_equals_one_at_a_time(loaded_fp32, prompts, paged_runner):
    """One forward with a decode, a first prefill chunk and a later prefill chunk together gives
    each request the logits it gets alone (the runner's mixed batches)."""
    model = loaded_fp32.model
    a, b, c = prompts[1], prompts[3], prompts[7]
    alone = []
    for token_ids, first_chunk in ((a, len(a) - 1), (b, 0), (c, 40)):
        runner = paged_runner(model)
        if first_chunk:
            runner.step([(0, token_ids[:first_chunk])])
        alone.append(runner.step([(0, token_ids[first_chunk:])]))
    batched = paged_runner(model)
    batched.step([(0, a[:-1]), (2, c[:40])])
    together = batched.step([(0, a[-1:]), (1, b), (2, c[40:])])
    for (expected,), got in zip(alone, together, strict=True):
        assert (expected - got).abs().max().item() < 1e-4


def test_bf16_model_tracks_fp32(loaded_bf16, loaded_fp32, prompts, paged_runner):
    bf16 = loaded_bf16.model
    assert bf16.dtype == torch.bfloat16
    for token_ids in prompts[:3]:
        (reference,) = paged_runner(loaded_fp32.model).step([(0, token_ids)])
        (logits,) = paged_runner(bf16).step([(0, token_ids)])
        assert logits.dtype == torch.float32
        top = reference[-1].topk(5).indices
        assert int(logits[-1].argmax()) in top.tolist()
        assert torch.nn.functional.cosine_similarity(logits[-1], reference[-1], dim=0) > 0.99


def test_rotary_tables_cast_from_fp32_equal_ones_built_in_the_dtype(loaded_fp32):
    """A bf16 model's rotary tables are cast from the fused path's fp32 ones (computed once):
    the same as building them in bf16, before and after extending past the model's context."""
    from pagedkv.model.rotary import RotaryEmbedding

    config = loaded_fp32.config
    fp32 = RotaryEmbedding(config, torch.float32, "cpu")
    cast, built = fp32.cast(torch.bfloat16), RotaryEmbedding(config, torch.bfloat16, "cpu")
    for rotary in (cast, built):
        assert rotary.cos.dtype == torch.bfloat16
    assert torch.equal(cast.cos, built.cos) and torch.equal(cast.sin, built.sin)
    assert torch.equal(cast.cos, fp32.cos.to(torch.bfloat16))
    for rotary in (cast, built):
        rotary.extend(config.max_position_embeddings + 100)
    assert cast.max_positions == config.max_position_embeddings + 100
    assert torch.equal(cast.cos, built.cos) and torch.equal(cast.sin, built.sin)
