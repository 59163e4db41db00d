"""Turn last-position logits into next tokens: greedy, temperature, top-k, top-p, penalties.

One call per step for the whole batch, vectorised over requests; the only per-request Python work
is for requests with their own seed (their noise comes from their own ``torch.Generator``, so a
seeded request samples the same tokens whatever else is in the batch) and for penalties.

Sampling uses the exponential race (Gumbel-max in another form, as vLLM does): with
``q ~ Exp(1)`` i.i.d. per token, ``argmax(p / q)`` is distributed as ``p``, with no CDF search.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.sampling_params import SamplingParams


class Sampler:
    """Batched sampler.

    Args:
        seed: seed of the generator that serves requests without their own seed.
        device: where the logits live (the generators must live there too).
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        sampling_params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        output_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: ``[num_reqs, vocab_size]`` float32 (modified in place).
            sampling_params: one per row.
            generators: one per row: the request's own generator (seeded requests) or None.
            output_token_ids: tokens each request generated so far (only read for rows with
                presence / frequency penalties).

        Returns:
            ``[num_reqs]`` int64 token ids.
        """
        num_reqs = logits.shape[0]
        greedy = [p.greedy for p in sampling_params]
        if any(p.has_penalties for p in sampling_params):
            _apply_penalties(logits, sampling_params, output_token_ids)
        if all(greedy):
            return logits.argmax(dim=-1)

        temperatures = torch.tensor(
            [1.0 if g else p.temperature for g, p in zip(greedy, sampling_params, strict=True)],
            dtype=logits.dtype,
            device=logits.device,
        )
        greedy_tokens = logits.argmax(dim=-1) if any(greedy) else None
        logits.div_(temperatures[:, None])
        top_k = [p.top_k if p.top_k > 0 else 0 for p in sampling_params]
        top_p = [p.top_p for p in sampling_params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = _apply_top_k_top_p(logits, top_k, top_p)

        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i in range(num_reqs) if generators[i] is None]
        if len(unseeded) == num_reqs:
            noise.exponential_(generator=self.generator)
        else:
            if unseeded:
                rows = torch.tensor(unseeded, device=probs.device)
                fresh = torch.empty_like(probs[: len(unseeded)])
                noise.index_copy_(0, rows, fresh.exponential_(generator=self.generator))
            for i, generator in enumerate(generators):
                if generator is not None:
                    noise[i].exponential_(generator=generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        if greedy_tokens is not None:
            sampled = torch.where(
                torch.tensor(greedy, device=logits.device), greedy_tokens, sampled
            )
        return sampled


def _apply_penalties(
    logits: torch.Tensor,
    sampling_params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]] | None,
) -> None:
    """OpenAI presence / frequency penalties over the generated tokens, in place."""
    if output_token_ids is None:
        return
    for i, params in enumerate(sampling_params):
        if not params.has_penalties or not output_token_ids[i]:
            continue
        counts = torch.zeros_like(logits[i])
        tokens = torch.tensor(output_token_ids[i], dtype=torch.long, device=logits.device)
        counts.index_add_(0, tokens, torch.ones_like(tokens, dtype=logits.dtype))
        logits[i] -= counts * params.frequency_penalty + (counts > 0) * params.presence_penalty


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf.

    top-k keeps the k largest logits (0 = all); top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches p (always at least the most likely token).
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    if any(top_k):
        k = torch.tensor([kk if kk > 0 else vocab_size for kk in top_k], device=logits.device)
        k = k.clamp_(max=vocab_size)
        ranks = torch.arange(vocab_size, device=logits.device)[None, :]
        sorted_logits.masked_fill_(ranks >= k[:, None], float("-inf"))
    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, dtype=sorted_logits.dtype, device=logits.device)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits.masked_fill_(mass_before >= p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
