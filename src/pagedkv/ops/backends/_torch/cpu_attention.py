"""Fast CPU paged attention (pure torch): the ``torch`` backend's forward.

Decode group (q_len 1), chunk by chunk of requests (see ``gather_plan.py``), no Python loop over
requests inside a chunk::

    K       = index_select(kv_cache[0] as (block, head) rows, chunk.rows)
                                                    [n * kv_heads, kv_len, head]  (no transpose)
    q       = query rows * scale, viewed as         [n * kv_heads, group, head]   (GQA: no repeat)
    scores  = bmm(q, K^T), mask padding with -inf   [n * kv_heads, group, kv_len] (query dtype)
    probs   = softmax(scores)                       fp32 inside, rounded to the query dtype
    out     = embedding_bag(kv_cache[1] as token rows, chunk.value_tokens, mode="sum",
                            per_sample_weights=probs)
                                                    [n * heads, head]: sum_t probs[t] * V[t]

The values are never copied: ``embedding_bag`` is a gather and a weighted sum in one pass, so it
reads each value row once from the cache (an ``index_select`` of the values followed by
``bmm(probs, V)`` wrote every value byte and read it again; measured in docs/ops.md). It
accumulates in fp32 and rounds once, as ``bmm`` does. fp8 caches (no fp8 ``embedding_bag``)
gather their values and dequantise them for ``bmm(probs, V)``.

A grouped matmul-softmax-matmul rather than ``scaled_dot_product_attention``: on the AMD EPYC
of the first measurements bf16 SDPA with one query token was 4-10x slower; on the Intel Xeon of
docs/ops.md it is 1.0-1.5x the grouped matmul's time. ``bmm`` on 3-D views rather than
``matmul`` on 4-D ones (10-25% faster: matmul's 4-D path reshapes); the scale applied to the
query (``head_size ** -0.5`` is a power of two for the usual head sizes, so exact) instead of a
pass over the fp32 scores; CPU ``softmax`` of bf16/fp16 scores computes in fp32 and rounds once,
equal to Hugging Face's ``softmax(scores, dtype=float32).to(dtype)`` without the two copies.

Prefill group (q_len > 1): one SDPA call per request on its gathered K/V (``enable_gqa``) with the
precomputed causal / sliding-window mask.

Logit soft-capping (``soft_cap``, Gemma 2): the scaled scores become ``cap * tanh(s / cap)``
before the mask and the softmax; the decode path caps its score tensor in place, the prefill
path (SDPA has no cap) computes its scores with ``matmul`` and a masked softmax instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.ops.backends._torch.gather_plan import (
    DecodeChunk,
    GatherPlan,
    ZeroSlots,
    get_gather_plan,
)
from pagedkv.ops.backends._torch.metadata import PagedAttentionMetadata
from pagedkv.ops.backends.base import FP8_DTYPES


def cpu_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Paged attention, vectorised over decode requests (see module docs).

    Args:
        query: ``[num_tokens, num_heads, head_size]`` float32 / bfloat16 / float16.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]``, query's dtype or fp8.
        metadata: the step's :class:`PagedAttentionMetadata`.
        scale: softmax scale.
        k_scale, v_scale: fp8 dequantisation scales (ignored for other dtypes).
        soft_cap: logit soft-cap (scores ``cap * tanh(s / cap)`` before the softmax); None =
            none.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype``.
    """
    num_heads = query.shape[1]
    _, _, num_kv_heads, bs, head_size = kv_cache.shape
    group = num_heads // num_kv_heads
    dtype = query.dtype
    fp8 = kv_cache.dtype in FP8_DTYPES
    if not fp8:
        k_scale = v_scale = 1.0
    plan = get_gather_plan(
        metadata, num_kv_heads, head_size, kv_cache.element_size(), None if fp8 else group
    )
    out = torch.empty_like(query)
    if plan.decode_chunks:
        # Decode rows in the group's sorted order: scaled once per layer, attended chunk by
        # chunk, put back in place by one index_copy_ per chunk.
        rows = _DecodeRows(kv_cache, plan, dtype)
        q_sorted = query.index_select(0, metadata.decode_token_ids).mul_(scale * k_scale)
        start = 0
    for chunk in plan.decode_chunks:
        n, kv_len = chunk.num_reqs, chunk.num_blocks * bs
        q = q_sorted[start : start + n]
        start += n
        if chunk.part_blocks is not None:
            o = _decode_in_parts(q, rows, chunk, num_kv_heads, soft_cap)
        else:
            k = rows.gather(chunk.rows, key=True).view(n * num_kv_heads, kv_len, head_size)
            scores = torch.bmm(q.view(n * num_kv_heads, group, head_size), k.transpose(1, 2))
            if soft_cap is not None:
                _cap_(scores, soft_cap)
            if chunk.key_mask is not None:
                scores.view(n, num_kv_heads, group, kv_len).masked_fill_(
                    chunk.key_mask, float("-inf")
                )
            probs = torch.softmax(scores, dim=-1)
            if chunk.value_tokens is not None:
                o = rows.value_bags(chunk.value_tokens, probs.view(-1, kv_len))
            else:
                v = rows.gather(chunk.rows, key=False, value_zero=chunk.value_zero)
                o = torch.bmm(probs, v.view(n * num_kv_heads, kv_len, head_size))
        if fp8:
            o = o * v_scale
        out.index_copy_(0, chunk.token_ids, o.view(n, num_heads, head_size))

    if plan.prefill_rows:
        rows_shape = (plan.max_prefill_rows, head_size)
        key_buf = plan.buffer("key_tokens", rows_shape, kv_cache.dtype, kv_cache.device)
        value_buf = plan.buffer("value_tokens", rows_shape, kv_cache.dtype, kv_cache.device)
        key_tokens = kv_cache[0].view(-1, head_size)
        value_tokens = kv_cache[1].view(-1, head_size)
    for p, token_rows in zip(metadata.prefills, plan.prefill_rows, strict=True):
        num_rows = token_rows.numel()
        k = torch.index_select(key_tokens, 0, token_rows, out=key_buf[:num_rows])
        v = torch.index_select(value_tokens, 0, token_rows, out=value_buf[:num_rows])
        if fp8:
            k, v = k.to(dtype) * k_scale, v.to(dtype) * v_scale
        k = k.view(1, num_kv_heads, -1, head_size)
        v = v.view(1, num_kv_heads, -1, head_size)
        q = query[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)
        if soft_cap is not None:
            o = _capped_attention(q, k, v, p.attn_mask, scale, soft_cap)
            out[p.token_start : p.token_end] = o[0].transpose(0, 1)
            continue
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=p.attn_mask,
            is_causal=p.attn_mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[p.token_start : p.token_end] = o[0].transpose(0, 1)
    return out


def _cap_(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """``scores = cap * tanh(scores / cap)`` in place (any shape and float dtype)."""
    return scores.div_(cap).tanh_().mul_(cap)


def _capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    cap: float,
) -> torch.Tensor:
    """One prefill request's attention with soft-capped scores (what SDPA cannot do).

    Args:
        q: ``[1, num_heads, q_len, head_size]``.
        k, v: ``[1, num_kv_heads, kv_len, head_size]`` in the query dtype.
        attn_mask: ``[q_len, kv_len]`` bool (True = attend), or None for a square causal mask.
        scale: softmax scale.
        cap: the soft-cap.

    Returns:
        ``[1, num_heads, q_len, head_size]`` in the query dtype (softmax in fp32, as the decode
        path's CPU softmax).
    """
    _, num_heads, q_len, head_size = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    qg = q.reshape(num_kv_heads, group * q_len, head_size) * scale
    scores = torch.bmm(qg, k[0].transpose(1, 2)).view(num_kv_heads, group, q_len, kv_len)
    _cap_(scores, cap)
    if attn_mask is None:
        attn_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril_()
    scores.masked_fill_(~attn_mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    o = torch.bmm(probs.view(num_kv_heads, group * q_len, kv_len), v[0])
    return o.view(1, num_heads, q_len, head_size)


class _DecodeRows:
    """Gathers (block, head) rows of one layer's cache into the plan's reused buffers."""

    __slots__ = (
        "key_buf",
        "key_conv",
        "key_rows",
        "value_buf",
        "value_conv",
        "value_rows",
        "value_table",
    )

    def __init__(self, kv_cache: torch.Tensor, plan: GatherPlan, dtype: torch.dtype):
        _, _, _, bs, head_size = kv_cache.shape
        self.key_rows = kv_cache[0].view(-1, bs, head_size)
        self.value_rows = kv_cache[1].view(-1, bs, head_size)
        self.value_table = kv_cache[1].view(-1, head_size)  # one row per (block, head, slot)
        shape = (plan.max_decode_rows, bs, head_size)
        device = kv_cache.device
        self.key_buf = plan.buffer("key_rows", shape, kv_cache.dtype, device)
        self.value_buf = self.key_conv = self.value_conv = None
        if kv_cache.dtype in FP8_DTYPES:  # no fp8 matmul on CPU: dequantise after the gather
            self.value_buf = plan.buffer("value_rows", shape, kv_cache.dtype, device)
            self.key_conv = plan.buffer("key_conv", shape, dtype, device)
            self.value_conv = plan.buffer("value_conv", shape, dtype, device)

    def gather(
        self, rows: torch.Tensor, key: bool, value_zero: ZeroSlots | None = None
    ) -> torch.Tensor:
        """K (``key``) or V rows ``[len(rows), block_size, head_size]`` in the query dtype.

        Slots outside a request's keys may hold anything (even NaN): ``value_zero`` zeroes those
        values, since a masked probability of 0 times NaN would still be NaN.
        """
        num_rows = rows.numel()
        src, buf, conv = (
            (self.key_rows, self.key_buf, self.key_conv)
            if key
            else (self.value_rows, self.value_buf, self.value_conv)
        )
        x = torch.index_select(src, 0, rows, out=buf[:num_rows])
        if value_zero is not None:
            value_zero.apply(x)
        if conv is not None:
            x = conv[:num_rows].copy_(x)
        return x

    def value_bags(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``sum_t probs[b, t] * V[tokens[b, t]]`` per bag ``b``: ``[num_bags, head_size]``.

        Args:
            tokens: ``[num_bags, kv_len]`` int32/int64 token rows of the value cache.
            probs: ``[num_bags, kv_len]`` in the cache dtype (0 where a token is not attended).
        """
        return F.embedding_bag(tokens, self.value_table, mode="sum", per_sample_weights=probs)


def _decode_in_parts(
    q: torch.Tensor,
    rows: _DecodeRows,
    chunk: DecodeChunk,
    num_kv_heads: int,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """One decode request too big for one gather: scores from K parts, softmax over the whole
    row, then the output from the value bags (or, for gathered values, from V parts), each part
    small enough to stay in cache.

    Args:
        q: ``[1, num_heads, head_size]``, already scaled.

    Returns:
        ``[num_heads, head_size]`` in the query dtype.
    """
    _, num_heads, head_size = q.shape
    bs = rows.key_rows.shape[1]
    group = num_heads // num_kv_heads
    kv_len = chunk.num_blocks * bs
    q = q.view(num_kv_heads, group, head_size)
    scores = torch.empty(num_kv_heads, group, kv_len, dtype=torch.float32, device=q.device)
    t0 = 0
    for part_rows in chunk.part_rows:
        k = rows.gather(part_rows, key=True).view(num_kv_heads, -1, head_size)
        scores[:, :, t0 : t0 + k.shape[1]] = torch.bmm(q, k.transpose(1, 2))
        t0 += k.shape[1]
    if soft_cap is not None:
        _cap_(scores, soft_cap)
    if chunk.key_mask is not None:
        scores.view(1, num_kv_heads, group, kv_len).masked_fill_(chunk.key_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if chunk.value_tokens is not None:
        return rows.value_bags(chunk.value_tokens, probs.view(num_heads, kv_len))
    acc = torch.zeros(num_kv_heads, group, head_size, dtype=torch.float32, device=q.device)
    t0 = 0
    for part_rows, zero in zip(chunk.part_rows, chunk.part_value_zero, strict=True):
        v = rows.gather(part_rows, key=False, value_zero=zero).view(num_kv_heads, -1, head_size)
        acc += torch.bmm(probs[:, :, t0 : t0 + v.shape[1]], v)
        t0 += v.shape[1]
    return acc.to(q.dtype).view(num_heads, head_size)
