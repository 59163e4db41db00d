"""The batched sampler: greedy, top-k / top-p limits, seeded reproducibility, penalties."""

from __future__ import annotations

import pytest
import torch

from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.sampler import Sampler, row_argmax

VOCAB = 50


def logits_batch(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = logits_batch(4)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 2
    out = Sampler(0)(logits.clone(), params, [None] * 4)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = logits_batch(6)
    params = [SamplingParams(temperature=2.0, top_k=1)] * 3 + [
        SamplingParams(temperature=2.0, top_p=1e-6)
    ] * 3
    out = Sampler(0)(logits.clone(), params, [None] * 6)
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_top_k_samples_stay_in_the_top_k():
    logits = logits_batch(1).repeat(200, 1)
    params = [SamplingParams(temperature=5.0, top_k=3)] * 200
    out = Sampler(1)(logits.clone(), params, [None] * 200)
    top3 = set(logits[0].topk(3).indices.tolist())
    assert set(out.tolist()) <= top3 and len(set(out.tolist())) > 1


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = logits_batch(5)
    params = [SamplingParams(temperature=1.0, seed=11)] + [SamplingParams(temperature=1.0)] * 4

    def first_row(batch_logits, batch_params):
        gens = [torch.Generator().manual_seed(11)] + [None] * (len(batch_params) - 1)
        return Sampler(123)(batch_logits.clone(), batch_params, gens)[0].item()

    assert first_row(logits, params) == first_row(logits[:1], params[:1])


def test_penalties_lower_generated_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 1.0
    params = [SamplingParams(temperature=0, presence_penalty=0.6, frequency_penalty=0.3)]
    out = Sampler(0)(logits.clone(), params, [None], output_token_ids=[[7, 7]])
    assert out.item() != 7  # 1.0 - 0.6 - 2 * 0.3 < 0


@pytest.mark.parametrize("shape", [(64, 49152), (3, 49152 + 17), (5, 130), (1, 64), (7, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_torch_argmax(shape, dtype):
    """The block-max argmax gives torch's indices exactly: random rows, rows full of ties
    (the first maximum wins), NaN (counted as the maximum) and rows of -inf."""
    generator = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=generator).to(dtype)
    ties = (x * 2).round().clamp(-3, 3)
    nan = x.clone()
    nan[0, shape[1] - 1] = float("nan")
    nan[-1, 5] = nan[-1, min(70, shape[1] - 1)] = float("nan")
    ninf = torch.full_like(x, float("-inf"))
    for values in (x, ties, nan, ninf):
        assert torch.equal(row_argmax(values), values.argmax(dim=-1))
