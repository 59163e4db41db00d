"""Verify draft tokens against the target model: speculative sampling's rejection rule.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and Chen et
al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling"); vLLM V1's
``RejectionSampler``. A request with k draft tokens ``x_1..x_k`` (proposed from a distribution q)
gets k + 1 rows of target logits in one forward: row i scores the token after ``x_1..x_i``::

    rows of one request   draft 1   draft 2  ...  draft k   bonus
    target p              p_1       p_2           p_k       p_{k+1}

- greedy requests accept ``x_i`` while it equals ``argmax p_i``, and emit ``argmax`` of the
  first row that disagrees (or of the bonus row when all agree): exactly the tokens greedy
  decoding would have produced, one forward for up to k + 1 of them;
- random requests accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
  rejection they sample from ``normalize(max(0, p_i - q_i))``, and when all are accepted from
  the bonus row's ``p_{k+1}``. Each emitted token is then distributed exactly as ``p``
  (Leviathan et al., Theorem 1), whatever q is.

pagedkv's drafts have no distribution: n-gram and suffix copy tokens and the draft model takes
its argmax, so q is one-hot on the draft token (``draft_probs`` None), a draft is accepted with
probability ``p(x)`` and a rejection samples from ``p`` with ``x`` removed.

Each row's p is what :class:`~pagedkv.worker.sampler.Sampler` would sample that row from
(logit_bias, temperature, min_p, top-k / top-p: :func:`apply_sampling_filters`, shared).
Penalties and min_tokens are not applied: the scheduler does not draft for requests with them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedkv.errors import OpsInputError
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.sampler import Sampler, apply_logit_bias, apply_sampling_filters, row_argmax


def rejection_sample(
    logits: torch.Tensor,
    sampling_params: Sequence[SamplingParams],
    num_draft_tokens: Sequence[int],
    draft_token_ids: torch.Tensor | np.ndarray | Sequence[int],
    draft_probs: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
    sampler: Sampler,
) -> list[list[int]]:
    """The tokens each request emits this step: its accepted drafts, then one token of the
    target's (module docstring). Batched over all rows; Python work per request only.

    Args:
        logits: ``[sum(num_draft_tokens) + num_reqs, vocab_size]`` float32 target logits
            (modified in place): per request, in order, its k_i draft rows then its bonus row.
        sampling_params: one per request (no penalties, no min_tokens: not applied here).
        num_draft_tokens: k_i >= 0 per request.
        draft_token_ids: ``[sum(num_draft_tokens)]`` int draft ids, the requests' drafts in
            order (a tensor, numpy array or list).
        draft_probs: ``[sum(num_draft_tokens), vocab_size]`` float q of each draft row, or None:
            one-hot on the draft token (every method pagedkv has: n-gram, suffix, a draft
            model's greedy drafts).
        generators: one per request: its own generator (seeded requests: their uniforms and
            samples come from it, so they repeat run to run) or None (the sampler's).
        sampler: whose generator serves the unseeded requests.

    Returns:
        per request, ``1..k_i + 1`` token ids: the accepted drafts, then the recovered or bonus
        token.

    Raises:
        OpsInputError: shapes that do not fit ``num_draft_tokens`` (nothing is sampled).
    """
    num_reqs = len(sampling_params)
    device = logits.device
    num_drafts = sum(num_draft_tokens)
    draft_ids = torch.as_tensor(draft_token_ids, device=device).to(torch.int64)
    _check_inputs(logits, num_reqs, num_draft_tokens, draft_ids, draft_probs, generators)
    vocab_size = logits.shape[1]
    if num_reqs == 0:
        return []

    counts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)  # k_i
    first_row = torch.cumsum(counts + 1, 0) - (counts + 1)  # each request's first row
    first_draft = torch.cumsum(counts, 0) - counts  # each request's first draft index
    draft_req = torch.repeat_interleave(torch.arange(num_reqs, device=device), counts)
    draft_pos = torch.arange(num_drafts, device=device) - first_draft[draft_req]
    draft_rows = first_row[draft_req] + draft_pos  # the logits row scoring each draft

    if any(p.logit_bias for p in sampling_params):
        row_params = [
            p for p, k in zip(sampling_params, num_draft_tokens, strict=True) for _ in range(k + 1)
        ]
        apply_logit_bias(logits, row_params)
    greedy = torch.tensor([p.greedy for p in sampling_params], dtype=torch.bool, device=device)
    random_reqs = [i for i, p in enumerate(sampling_params) if not p.greedy]
    reqs = torch.nonzero(~greedy).squeeze(1)  # random_reqs as a tensor

    # Greedy requests: the argmax of each of their rows.
    row_req = torch.repeat_interleave(torch.arange(num_reqs, device=device), counts + 1)
    argmax = torch.zeros(logits.shape[0], dtype=torch.int64, device=device)
    greedy_rows = torch.nonzero(greedy[row_req]).squeeze(1)
    if len(greedy_rows):
        argmax[greedy_rows] = row_argmax(logits[greedy_rows])
    accepted = argmax[draft_rows] == draft_ids

    # Random requests: the target distributions of their rows, one uniform per draft.
    probs = None
    if random_reqs:
        random_rows = torch.nonzero(~greedy[row_req]).squeeze(1)
        row_in_probs = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=device)
        row_in_probs[random_rows] = torch.arange(len(random_rows), device=device)
        random_params = [sampling_params[i] for i in random_reqs]
        filtered = apply_sampling_filters(logits[random_rows], random_params, (counts + 1)[reqs])
        probs = torch.softmax(filtered, dim=-1)
        uniforms = _per_request_draws(
            num_drafts,
            counts,
            first_draft,
            draft_req,
            greedy,
            random_reqs,
            generators,
            sampler,
            device,
        )
        random_drafts = torch.nonzero(~greedy[draft_req]).squeeze(1)
        if len(random_drafts):
            ids = draft_ids[random_drafts]
            p_x = probs[row_in_probs[draft_rows[random_drafts]], ids]
            q_x = 1.0 if draft_probs is None else draft_probs[random_drafts, ids].float()
            accepted[random_drafts] = uniforms[random_drafts] * q_x < p_x

    # Accepted prefix per request: drafts in a [num_reqs, max k] grid, counted until the first
    # rejection (cells past k_i stay False).
    grid = torch.zeros(num_reqs, max(num_draft_tokens, default=0), dtype=torch.int64, device=device)
    grid[draft_req, draft_pos] = accepted.to(torch.int64)
    num_accepted = grid.cumprod(dim=1).sum(dim=1)
    final_row = first_row + num_accepted  # the row the extra token comes from
    tokens = argmax[final_row]

    if random_reqs:
        target = probs[row_in_probs[final_row[reqs]]]  # [num_random, vocab_size]
        residual = target.clone()
        rejected = num_accepted[reqs] < counts[reqs]
        if bool(rejected.any()):
            which = reqs[rejected]
            bad = first_draft[which] + num_accepted[which]  # index of the rejected draft
            rows = torch.nonzero(rejected).squeeze(1)
            if draft_probs is None:
                residual[rows, draft_ids[bad]] = 0.0
            else:
                residual[rows] = (residual[rows] - draft_probs[bad].float()).clamp_(min=0.0)
            # All mass removed (p <= q everywhere, only by rounding): sample from p itself.
            empty = residual.sum(dim=-1) <= 0
            if bool(empty.any()):
                residual[empty] = target[empty]
        noise = _per_request_noise(
            len(random_reqs), vocab_size, random_reqs, generators, sampler, device
        )
        tokens[reqs] = row_argmax(residual.div_(noise))  # exponential race: ~ residual

    drafts = draft_ids.tolist()
    starts = first_draft.tolist()
    return [
        [*drafts[s : s + a], t]
        for s, a, t in zip(starts, num_accepted.tolist(), tokens.tolist(), strict=True)
    ]


def _check_inputs(
    logits: torch.Tensor,
    num_reqs: int,
    num_draft_tokens: Sequence[int],
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
) -> None:
    num_drafts = sum(num_draft_tokens)
    if len(num_draft_tokens) != num_reqs or len(generators) != num_reqs:
        raise OpsInputError(
            f"rejection_sample: {num_reqs} sampling_params, {len(num_draft_tokens)} "
            f"num_draft_tokens and {len(generators)} generators: one of each per request"
        )
    if any(k < 0 for k in num_draft_tokens):
        raise OpsInputError(
            f"rejection_sample: num_draft_tokens must be >= 0, got {num_draft_tokens}"
        )
    if logits.dim() != 2 or logits.shape[0] != num_drafts + num_reqs:
        raise OpsInputError(
            f"rejection_sample: logits must be [{num_drafts + num_reqs}, vocab_size] "
            f"(drafts + one bonus row per request), got {list(logits.shape)}"
        )
    if draft_ids.shape != (num_drafts,):
        raise OpsInputError(
            f"rejection_sample: draft_token_ids must be [{num_drafts}], got {list(draft_ids.shape)}"
        )
    if num_drafts and not (int(draft_ids.min()) >= 0 and int(draft_ids.max()) < logits.shape[1]):
        raise OpsInputError(f"rejection_sample: draft_token_ids must be in [0, {logits.shape[1]})")
    if draft_probs is not None and draft_probs.shape != (num_drafts, logits.shape[1]):
        raise OpsInputError(
            f"rejection_sample: draft_probs must be [{num_drafts}, {logits.shape[1]}] or None, "
            f"got {list(draft_probs.shape)}"
        )


def _per_request_draws(
    num_drafts: int,
    counts: torch.Tensor,
    first_draft: torch.Tensor,
    draft_req: torch.Tensor,
    greedy: torch.Tensor,
    random_reqs: Sequence[int],
    generators: Sequence[torch.Generator | None],
    sampler: Sampler,
    device: torch.device,
) -> torch.Tensor:
    """``[num_drafts]`` uniforms in [0, 1): one draw for all the unseeded random requests'
    drafts, one per seeded request from its generator (its draws do not depend on the rest of
    the batch). Greedy requests' cells stay 0 (unused)."""
    uniforms = torch.zeros(num_drafts, device=device)
    seeded = [i for i in random_reqs if generators[i] is not None]
    unseeded = torch.tensor([g is None for g in generators], device=device)
    unseeded[greedy] = False
    index = torch.nonzero(unseeded[draft_req]).squeeze(1)
    if len(index):
        uniforms[index] = torch.rand(len(index), generator=sampler.generator, device=device)
    for i in seeded:
        start, k = int(first_draft[i]), int(counts[i])
        if k:
            uniforms[start : start + k] = torch.rand(k, generator=generators[i], device=device)
    return uniforms


def _per_request_noise(
    num_rows: int,
    vocab_size: int,
    random_reqs: Sequence[int],
    generators: Sequence[torch.Generator | None],
    sampler: Sampler,
    device: torch.device,
) -> torch.Tensor:
    """``[num_rows, vocab_size]`` Exp(1) noise of the exponential race, row j for request
    ``random_reqs[j]``: the unseeded rows in one draw, each seeded row from its generator."""
    noise = torch.empty(num_rows, vocab_size, device=device)
    unseeded = [j for j, i in enumerate(random_reqs) if generators[i] is None]
    if len(unseeded) == num_rows:
        return noise.exponential_(generator=sampler.generator)
    if unseeded:
        rows = torch.tensor(unseeded, device=device)
        fresh = torch.empty(len(unseeded), vocab_size, device=device)
        noise.index_copy_(0, rows, fresh.exponential_(generator=sampler.generator))
    for j, i in enumerate(random_reqs):
        if generators[i] is not None:
            noise[j].exponential_(generator=generators[i])
    return noise
