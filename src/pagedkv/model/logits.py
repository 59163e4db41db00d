"""The logits of a reduced-precision model, with the top of each row recomputed in fp32.

A bf16 ``lm_head`` GEMM accumulates in fp32 but rounds its output to bf16: a logit between 16
and 32 moves by up to 0.06 (half a bf16 step of 0.125 there), which accounts for about a quarter
of the bf16 model's deviation from fp32 on chat prompts. Hugging Face widens the rounded logits
(``logits.float()``), and so did pagedkv. Recomputing in fp32 the few largest logits of each row
(from the same bf16 hidden state and weight rows) removes that rounding where the probability
mass is, for the cost of a top-k over the row (mostly one max pass, :func:`top_k_indices`) and
``k`` dot products: over 64 chat prompts x 32 tokens (``benchmarks/bf16_accuracy.py``,
docs/perf.md) the mean KL from the fp32 reference fell from 9.7e-4 to 7.2e-4 and the greedy
outputs equal to the reference rose from 61% to 67% of the prompts; an fp32 ``lm_head`` (6.7e-4,
67%) takes 5x the time of the bf16 GEMM.
"""

from __future__ import annotations

import torch

#: Logits recomputed per row: the largest ones, where the probability mass is.
REFINE_TOP_K = 8
#: Width of the column blocks whose maxima preselect the top-k (:func:`top_k_indices`).
_BLOCK = 64


def top_k_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Column indices ``[num_rows, k]`` of each row's ``k`` largest values (any order; ties
    broken either way), as ``logits.topk(k).indices`` but about 3x faster on a long row: the
    ``k`` blocks of 64 columns with the largest maxima hold the ``k`` largest values (a value
    outside them would have ``k`` larger block maxima above it), so one max pass over the row
    and a top-k over ``k * 64`` candidates replace the top-k over the row.

    Args:
        logits: ``[num_rows, vocab_size]``, ``k <= vocab_size``.
    """
    num_rows, vocab_size = logits.shape
    num_blocks = vocab_size // _BLOCK
    if num_blocks <= k:
        return logits.topk(k, dim=-1, sorted=False).indices
    body = logits[:, : num_blocks * _BLOCK].view(num_rows, num_blocks, _BLOCK)
    blocks = body.amax(dim=-1).topk(k, dim=-1, sorted=False).indices  # [num_rows, k]
    offsets = torch.arange(_BLOCK, device=logits.device)
    candidates = (blocks.unsqueeze(-1) * _BLOCK + offsets).view(num_rows, k * _BLOCK)
    if num_blocks * _BLOCK < vocab_size:  # the last, partial block: always a candidate
        tail = torch.arange(num_blocks * _BLOCK, vocab_size, device=logits.device)
        candidates = torch.cat([candidates, tail.expand(num_rows, -1)], dim=1)
    best = logits.gather(1, candidates).topk(k, dim=-1, sorted=False).indices
    return candidates.gather(1, best)


def refine_top_logits(
    logits: torch.Tensor,
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    k: int = REFINE_TOP_K,
    row_by_row: bool = False,
) -> torch.Tensor:
    """Recompute in fp32, in place, the ``k`` largest logits of each row.

    Args:
        logits: ``[num_rows, vocab_size]`` float32, widened from a reduced-precision
            ``hidden_states @ weight.T``.
        hidden_states: ``[num_rows, hidden_size]`` the GEMM's input (model dtype).
        weight: ``[vocab_size, hidden_size]`` the GEMM's weight (model dtype).
        k: logits recomputed per row (at most vocab_size).
        row_by_row: each row's dot products in a product of its own (a row's bits then do not
            depend on the other rows: torch's batched product rounds by the batch's size).

    Returns:
        ``logits``, refined: each recomputed entry is the fp32 dot product of the row's hidden
        state and the token's weight row (both widened from the model dtype, accumulated in
        fp32), the value an fp32 GEMM of the same operands gives.
    """
    if logits.shape[0] == 0:
        return logits
    top = top_k_indices(logits, min(k, logits.shape[1]))  # [num_rows, k]
    rows = weight[top].float()  # [num_rows, k, hidden_size]
    columns = hidden_states.float().unsqueeze(-1)  # [num_rows, hidden_size, 1]
    if row_by_row:
        exact = torch.cat([torch.bmm(rows[i : i + 1], columns[i : i + 1]) for i in range(len(top))])
    else:
        exact = torch.bmm(rows, columns)
    return logits.scatter_(1, top, exact.squeeze(-1))
