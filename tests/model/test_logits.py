"""refine_top_logits: the largest logits of a bf16 lm_head recomputed in fp32."""

from __future__ import annotations

import torch

from pagedkv.model.logits import refine_top_logits


def _bf16_case(num_rows=5, vocab=300, hidden=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, hidden, generator=g) * 0.5).bfloat16()
    hidden_states = (torch.randn(num_rows, hidden, generator=g) * 2).bfloat16()
    exact = hidden_states.float() @ weight.float().T  # what an fp32 GEMM of the operands gives
    rounded = (hidden_states @ weight.T).float()  # the bf16 GEMM, widened
    return weight, hidden_states, exact, rounded


def test_top_k_entries_become_the_fp32_values_and_the_rest_stay():
    weight, hidden_states, exact, rounded = _bf16_case()
    assert not torch.equal(rounded, exact)  # bf16 output rounding is visible at this scale
    refined = refine_top_logits(rounded.clone(), hidden_states, weight, k=8)
    top = rounded.topk(8, dim=-1).indices
    changed = torch.zeros_like(rounded, dtype=torch.bool).scatter_(1, top, True)
    torch.testing.assert_close(refined[changed], exact[changed], rtol=1e-6, atol=1e-5)
    assert torch.equal(refined[~changed], rounded[~changed])
    # The top of the distribution is now much closer to fp32's.
    err_rounded = (rounded[changed] - exact[changed]).abs().max()
    err_refined = (refined[changed] - exact[changed]).abs().max()
    assert err_refined < err_rounded / 100


def test_argmax_of_a_rounding_tie_follows_fp32():
    # Two tokens whose exact logits 16.01 and 16.02 both round to 16.0 in bf16 (step 0.125).
    hidden_states = torch.tensor([[1.0, 1.0]]).bfloat16()
    weight = torch.tensor([[16.0, 0.0], [16.0, 0.01], [16.0, 0.02], [1.0, 0.0]]).bfloat16()
    rounded = (hidden_states @ weight.T).float()
    assert rounded[0, 0] == rounded[0, 1] == rounded[0, 2]
    refined = refine_top_logits(rounded.clone(), hidden_states, weight, k=3)
    assert int(refined.argmax()) == 2
    assert refined[0, 3] == rounded[0, 3]


def test_in_place_empty_and_k_larger_than_vocab():
    weight, hidden_states, exact, rounded = _bf16_case(num_rows=2, vocab=6)
    logits = rounded.clone()
    assert refine_top_logits(logits, hidden_states, weight, k=50) is logits
    torch.testing.assert_close(logits, exact, rtol=1e-6, atol=1e-5)
    empty = torch.empty(0, 6)
    assert refine_top_logits(empty, hidden_states[:0], weight).shape == (0, 6)


def test_blocked_top_k_equals_topk_including_the_partial_last_block():
    from pagedkv.model.logits import top_k_indices

    g = torch.Generator().manual_seed(1)
    for num_rows, vocab in ((3, 64 * 20), (4, 64 * 20 + 37), (2, 100), (1, 7)):
        logits = torch.randn(num_rows, vocab, generator=g)
        logits[0, -1] = 10.0  # the largest value in the (partial) last block
        logits[-1, :8] = 9.0 + torch.arange(float(min(8, vocab)))  # all in the first block
        k = min(8, vocab)
        got = top_k_indices(logits, k).sort(dim=-1).values
        expected = logits.topk(k, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(got, expected), (num_rows, vocab)
