"""Turn last-position logits into next tokens, and read log-probabilities off the raw logits.

One call per step for the whole batch, vectorised over requests. Per-request Python work is done
only for the rows that need it: requests with their own seed (their noise comes from their own
``torch.Generator``, so a seeded request samples the same tokens whatever else is in the batch),
and rows with penalties, ``min_tokens`` or ``logit_bias`` (their token ids are gathered into one
padded array; the logits are then changed by one batched op per transform).

Order of the transforms (vLLM V1's): min_tokens, logit_bias, penalties (repetition, frequency,
presence), then greedy argmax, or temperature, min_p, top-k / top-p and the draw. Sampling uses
the exponential race (Gumbel-max in another form, as vLLM does): with ``q ~ Exp(1)`` i.i.d. per
token, ``argmax(p / q)`` is distributed as ``p``, with no CDF search.

Logprobs (:func:`compute_logprobs`, :func:`gather_logprobs`) are the model's raw distribution:
``log_softmax`` in float32 over the full vocabulary of the logits BEFORE any of the transforms
above (vLLM's ``logprobs_mode="raw_logprobs"``, its default), so they do not depend on the
request's temperature, penalties or filters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import SamplingParams


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Raw log-probabilities ``[num_rows, vocab_size]`` float32 of logits ``[num_rows,
    vocab_size]`` (a new tensor: the sampler may then change the logits in place)."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chosen tokens' logprobs and ranks and the top-k of each row, batched.

    Args:
        logprobs: ``[num_rows, vocab_size]`` float32 (:func:`compute_logprobs`).
        token_ids: ``[num_rows]`` int64: the chosen token of each row.
        num_logprobs: k, the top-k size (>= 0; rows that asked for fewer slice their row).

    Returns:
        ``(ids [num_rows, 1 + k] int64, logprobs [num_rows, 1 + k] float32, ranks [num_rows]
        int64)``: column 0 is the chosen token.
    """
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1)
    top_values, top_ids = logprobs.topk(num_logprobs, dim=-1)
    ids = torch.cat([token_ids[:, None], top_ids], dim=1)
    values = torch.cat([chosen, top_values], dim=1)
    return ids, values, ranks


def apply_grammar_bitmask(
    logits: torch.Tensor,
    row_req_ids: Sequence[str],
    bitmask_req_ids: Sequence[str],
    bitmask: np.ndarray,
) -> None:
    """Set to -inf, in place and in one op for the whole batch, the logits of the tokens each
    constrained request may not sample (structured outputs; xgrammar's
    ``apply_token_bitmask_inplace``, its CPU kernel on a CPU).

    A request may have several consecutive logits rows (speculative decoding: one per draft
    and the bonus row); it then has as many consecutive bitmask rows, which go to its logits
    rows in order.

    Args:
        logits: ``[num_rows, vocab_size]`` float (float32, bfloat16 or float16).
        row_req_ids: the request of each logits row (a request's rows consecutive).
        bitmask_req_ids: the request of each bitmask row (each one of ``row_req_ids``, a
            request's rows consecutive and as many as its logits rows).
        bitmask: ``[len(bitmask_req_ids), ceil(vocab_size / 32)]`` int32 numpy array: bit
            ``t % 32`` of word ``t // 32`` is 1 when token ``t`` is allowed.

    Raises:
        InvalidRequestError: a bitmask of another shape or dtype, a bitmask row for a
            request that does not sample in this step, or a request with another number of
            bitmask rows than logits rows (the scheduler output does not fit the worker's
            batch); the logits are unchanged then.
    """
    num_rows, vocab_size = logits.shape
    width = -(-vocab_size // 32)
    if (
        not isinstance(bitmask, np.ndarray)
        or bitmask.dtype != np.int32
        or bitmask.shape != (len(bitmask_req_ids), width)
    ):
        got = getattr(bitmask, "shape", None), getattr(bitmask, "dtype", type(bitmask).__name__)
        raise InvalidRequestError(
            f"grammar_bitmask must be an int32 array [{len(bitmask_req_ids)}, {width}], got {got}"
        )
    first_row: dict[str, int] = {}  # each request's first logits row, and its count of rows
    num_logits_rows: dict[str, int] = {}
    for i, req_id in enumerate(row_req_ids):
        first_row.setdefault(req_id, i)
        num_logits_rows[req_id] = num_logits_rows.get(req_id, 0) + 1
    missing = [r for r in bitmask_req_ids if r not in first_row]
    if missing:
        raise InvalidRequestError(
            f"grammar_bitmask has rows for requests that do not sample this step: {missing}"
        )
    rows = []
    num_mask_rows: dict[str, int] = {}
    for req_id in bitmask_req_ids:  # the j-th row of a request goes to its j-th logits row
        j = num_mask_rows.get(req_id, 0)
        rows.append(first_row[req_id] + j)
        num_mask_rows[req_id] = j + 1
    wrong = [
        f"{r!r}: {n} for {num_logits_rows[r]}"
        for r, n in num_mask_rows.items()
        if n != num_logits_rows[r]
    ]
    if wrong:
        raise InvalidRequestError(
            "grammar_bitmask needs one row per logits row of each request, got "
            f"({', '.join(wrong)})"
        )
    if rows == list(range(num_rows)):
        aligned = bitmask
    else:  # bitmask row j goes to logits row rows[j] (the kernel indexes both alike)
        aligned = np.empty((num_rows, width), dtype=np.int32)
        aligned[rows] = bitmask
    import xgrammar as xgr

    mask = torch.from_numpy(np.ascontiguousarray(aligned))
    if mask.device != logits.device:
        mask = mask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(
        logits, mask, vocab_size=vocab_size, indices=None if aligned is bitmask else rows
    )


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
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        stop_token_ids: Sequence[Iterable[int]] | None = None,
    ) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: ``[num_reqs, vocab_size]`` float32 (modified in place).
            sampling_params: one per row.
            generators: one per row: the request's own generator (seeded requests) or None.
            output_token_ids: tokens each request generated so far (read for rows with
                penalties or ``min_tokens``; None = no tokens yet).
            prompt_token_ids: each request's prompt (read for rows with a repetition penalty;
                None = empty).
            stop_token_ids: per row, the token ids masked while fewer than ``min_tokens`` are
                generated: the model's EOS ids (unless ignore_eos) and the request's
                stop_token_ids (read for rows with ``min_tokens``; None = the params'
                stop_token_ids only).

        Returns:
            ``[num_reqs]`` int64 token ids.
        """
        num_reqs = logits.shape[0]
        _apply_min_tokens(logits, sampling_params, output_token_ids, stop_token_ids)
        apply_logit_bias(logits, sampling_params)
        _apply_penalties(logits, sampling_params, output_token_ids, prompt_token_ids)
        greedy = [p.greedy for p in sampling_params]
        if all(greedy):
            return row_argmax(logits)

        greedy_tokens = row_argmax(logits) if any(greedy) else None
        logits = apply_sampling_filters(logits, sampling_params)

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
        sampled = row_argmax(probs.div_(noise))
        if greedy_tokens is not None:
            sampled = torch.where(
                torch.tensor(greedy, device=logits.device), greedy_tokens, sampled
            )
        return sampled


def apply_sampling_filters(
    logits: torch.Tensor,
    sampling_params: Sequence[SamplingParams],
    num_rows_per_request: torch.Tensor | None = None,
) -> torch.Tensor:
    """Turn logits (after logit_bias / penalties) into the logits of the distribution each row
    samples from: divide by the temperature (1 for greedy rows), then min_p, then top-k / top-p
    (-inf outside). The one home of these transforms, for the :class:`Sampler` and the rejection
    sampler's target distributions.

    Args:
        logits: ``[num_rows, vocab_size]`` float (modified in place; the result may be a new
            tensor).
        sampling_params: one per request.
        num_rows_per_request: ``[num_requests]`` int64 rows of each request, consecutive (the
            rejection sampler's draft rows + bonus row); None = one row each.

    Returns:
        ``[num_rows, vocab_size]`` logits; ``softmax`` of a row is its distribution.
    """
    greedy = [p.greedy for p in sampling_params]
    temperature = [
        1.0 if g else p.temperature for g, p in zip(greedy, sampling_params, strict=True)
    ]
    min_p = [0.0 if g else p.min_p for g, p in zip(greedy, sampling_params, strict=True)]
    top_k = [p.top_k if p.top_k > 0 else 0 for p in sampling_params]
    top_p = [p.top_p for p in sampling_params]

    def per_row(values: list, dtype: torch.dtype) -> torch.Tensor:
        column = torch.tensor(values, dtype=dtype, device=logits.device)
        if num_rows_per_request is None:
            return column
        return column.repeat_interleave(num_rows_per_request.to(logits.device))

    logits.div_(per_row(temperature, logits.dtype)[:, None])
    if any(min_p):
        _apply_min_p(logits, per_row(min_p, logits.dtype))
    if any(top_k) or any(p < 1.0 for p in top_p):
        logits = _apply_top_k_top_p(
            logits, per_row(top_k, torch.int64), per_row(top_p, logits.dtype)
        )
    return logits


#: Width of the column blocks :func:`row_argmax` takes the maxima of.
_ARGMAX_BLOCK = 64


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """``values.argmax(dim=-1)`` for ``[num_rows, vocab_size]``, the same indices (the first
    maximum of each row; NaN counts as the maximum), about 6x faster on a CPU for a vocabulary
    row: torch's argmax over a long row runs one thread per row with an index comparison per
    element (3.2 ms for 64 x 49152 float32 on 2 threads), while a max over blocks of 64 columns
    vectorises (0.3 ms). The first block holding the row's maximum holds its first maximum; one
    argmax over the block maxima and one over that block's 64 values finish it.

    Args:
        values: ``[num_rows, vocab_size]`` float tensor.

    Returns:
        ``[num_rows]`` int64 column indices.
    """
    num_rows, vocab_size = values.shape
    width = _ARGMAX_BLOCK
    num_blocks = vocab_size // width
    if num_blocks < 2 or num_rows == 0:
        return values.argmax(dim=-1)
    block_max = values[:, : num_blocks * width].reshape(num_rows, num_blocks, width).amax(-1)
    if num_blocks * width < vocab_size:  # the partial last block
        tail = values[:, num_blocks * width :].amax(-1, keepdim=True)
        block_max = torch.cat([block_max, tail], dim=1)
    first = block_max.argmax(dim=-1, keepdim=True) * width  # [num_rows, 1]
    columns = first + torch.arange(width, device=values.device)  # [num_rows, width]
    inside = columns < vocab_size
    candidates = values.gather(1, columns.clamp_(max=vocab_size - 1))
    candidates.masked_fill_(~inside, float("-inf"))
    return columns.gather(1, candidates.argmax(dim=-1, keepdim=True)).squeeze(1)


def _scatter_indices(
    rows: Sequence[int], columns: Sequence[Iterable[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (row, column) int64 index tensors of the ids ``columns[j]`` in row ``rows[j]``:
    one numpy pass over the ids, no tensor per row. Columns that are numpy arrays (the model
    runner's views of its token rows) are concatenated without a Python step per id."""
    lengths = np.fromiter((len(c) for c in columns), dtype=np.int64, count=len(columns))
    row_index = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    if columns and all(isinstance(c, np.ndarray) for c in columns):
        col_index = np.concatenate(columns).astype(np.int64, copy=False)
    else:
        col_index = np.fromiter(
            (t for c in columns for t in c), dtype=np.int64, count=int(lengths.sum())
        )
    return torch.as_tensor(row_index, device=device), torch.as_tensor(col_index, device=device)


def _apply_min_tokens(
    logits: torch.Tensor,
    sampling_params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]] | None,
    stop_token_ids: Sequence[Iterable[int]] | None,
) -> None:
    """Stop tokens -> -inf in rows that generated fewer than ``min_tokens``, in place."""
    rows, columns = [], []
    for i, params in enumerate(sampling_params):
        if params.min_tokens == 0:
            continue
        num_generated = 0 if output_token_ids is None else len(output_token_ids[i])
        if num_generated >= params.min_tokens:
            continue
        ids = params.stop_token_ids if stop_token_ids is None else list(stop_token_ids[i])
        if ids:
            rows.append(i)
            columns.append(ids)
    if rows:
        logits[_scatter_indices(rows, columns, logits.device)] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, sampling_params: Sequence[SamplingParams]) -> None:
    """``logits[i, token] += bias`` for every row's logit_bias, in place, one indexed add
    (``sampling_params``: one per row)."""
    rows, columns, biases = [], [], []
    for i, params in enumerate(sampling_params):
        if params.logit_bias:
            rows.append(i)
            columns.append(params.logit_bias.keys())
            biases.extend(params.logit_bias.values())
    if rows:
        values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
        logits.index_put_(_scatter_indices(rows, columns, logits.device), values, accumulate=True)


def _apply_penalties(
    logits: torch.Tensor,
    sampling_params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]] | None,
    prompt_token_ids: Sequence[Sequence[int]] | None,
) -> None:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties,
    in place, batched over the rows that have any (vLLM's ``apply_penalties``)."""
    rows = [i for i, p in enumerate(sampling_params) if p.has_penalties]
    if not rows:
        return
    vocab_size = logits.shape[1]
    device = logits.device
    empty: Sequence[int] = ()
    outputs = [empty if output_token_ids is None else output_token_ids[i] for i in rows]
    prompts = [
        prompt_token_ids[i]
        if prompt_token_ids is not None and sampling_params[i].repetition_penalty != 1
        else empty
        for i in rows
    ]
    local = range(len(rows))
    # Counts of each output token per row; a mask of tokens seen in the prompt or the output.
    counts = torch.zeros(len(rows), vocab_size, dtype=logits.dtype, device=device)
    if any(len(o) for o in outputs):
        index = _scatter_indices(local, outputs, device)
        ones = torch.ones(len(index[0]), dtype=logits.dtype, device=device)
        counts.index_put_(index, ones, accumulate=True)
    generated = counts > 0
    seen = generated.clone()
    if any(len(p) for p in prompts):
        seen[_scatter_indices(local, prompts, device)] = True

    def column(name: str) -> torch.Tensor:
        values = [getattr(sampling_params[i], name) for i in rows]
        return torch.tensor(values, dtype=logits.dtype, device=device)[:, None]

    index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, index)
    repetition = column("repetition_penalty").expand_as(sub).masked_fill(~seen, 1.0)
    sub = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub -= column("frequency_penalty") * counts + column("presence_penalty") * generated
    logits.index_copy_(0, index, sub)


def _apply_min_p(logits: torch.Tensor, min_p: Sequence[float] | torch.Tensor) -> None:
    """Tokens whose probability is below ``min_p`` x the row's top probability -> -inf, in
    place (after temperature, as vLLM)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = (
        probs.amax(dim=-1, keepdim=True)
        * torch.as_tensor(min_p, dtype=logits.dtype, device=logits.device)[:, None]
    )
    logits.masked_fill_(probs < threshold, float("-inf"))


def _apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: Sequence[int] | torch.Tensor,
    top_p: Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf.

    top-k keeps the k largest logits (0 = all); top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches p (always at least the most likely token).
    """
    vocab_size = logits.shape[1]
    top_k = torch.as_tensor(top_k, dtype=torch.int64, device=logits.device)
    top_p = torch.as_tensor(top_p, dtype=logits.dtype, device=logits.device)
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, vocab_size).clamp_(max=vocab_size)
        ranks = torch.arange(vocab_size, device=logits.device)[None, :]
        sorted_logits.masked_fill_(ranks >= k[:, None], float("-inf"))
    if bool((top_p < 1.0).any()):
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits.masked_fill_(mass_before >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
