"""Fast CPU paged attention.

Decode group (q_len 1), all requests at once, no Python loop over requests::

    blocks  = index_select(kv_cache[0], decode_block_ids)     [D * nb, block_size, kv_heads, head]
    K       = blocks viewed as [D, nb * block_size, kv_heads, head] -> [D, kv_heads, L, head]
    q       = query rows viewed as [D, kv_heads, group, head]       (GQA: no K/V repeat)
    scores  = q @ K^T  -> fp32, scale, mask (padding / other requests' tail slots), softmax
    out     = probs (query dtype) @ V                         [D, kv_heads, group, head]

A grouped matmul-softmax-matmul rather than ``scaled_dot_product_attention``: on this CPU bf16 SDPA
with one query token was 4-10x slower than this (docs/ops.md, PERF-NOTES).

Prefill group (q_len > 1): one SDPA call per request on its gathered K/V (``enable_gqa``), with the
precomputed causal / sliding-window mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.ops.attention_metadata import PagedAttentionMetadata
from pagedkv.ops.kv_cache import FP8_DTYPES


def cpu_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Paged attention, vectorised over decode requests (see module docs).

    Args:
        query: ``[num_tokens, num_heads, head_size]`` float32 / bfloat16 / float16.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``, query's dtype or fp8.
        metadata: the step's :class:`PagedAttentionMetadata`.
        scale: softmax scale.
        k_scale, v_scale: fp8 dequantisation scales (ignored for other dtypes).

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype``.
    """
    fp8 = kv_cache.dtype in FP8_DTYPES
    if not fp8:
        k_scale = v_scale = 1.0
    if metadata.decode_only:
        return _decode(query, kv_cache, metadata, scale, fp8, k_scale, v_scale)
    out = torch.empty_like(query)
    if metadata.num_decodes:
        q = query.index_select(0, metadata.decode_token_ids)
        out.index_copy_(
            0,
            metadata.decode_token_ids,
            _decode(q, kv_cache, metadata, scale, fp8, k_scale, v_scale),
        )
    for p in metadata.prefills:
        out[p.token_start : p.token_end] = _prefill(
            query[p.token_start : p.token_end], kv_cache, p, scale, fp8, k_scale, v_scale
        )
    return out


def _decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    md: PagedAttentionMetadata,
    scale: float,
    fp8: bool,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """Attention of ``query`` ``[num_decodes, num_heads, head]`` over the decode group's K/V."""
    num_decodes, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    ctx = md.decode_num_blocks * md.block_size
    ids = md.decode_block_ids
    k = kv_cache[0].index_select(0, ids).view(num_decodes, ctx, num_kv_heads, head_size)
    v = kv_cache[1].index_select(0, ids).view(num_decodes, ctx, num_kv_heads, head_size)
    if fp8:
        k = k.to(query.dtype)
        v = v.to(query.dtype)
    k = k.transpose(1, 2)  # [D, kv_heads, ctx, head]
    v = v.transpose(1, 2)
    q = query.view(num_decodes, num_kv_heads, group, head_size)
    scores = torch.matmul(q, k.transpose(2, 3)).float()  # [D, kv_heads, group, ctx]
    scores.mul_(scale * k_scale)
    if md.decode_mask is not None:
        scores.masked_fill_(md.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    out = torch.matmul(probs, v)  # [D, kv_heads, group, head]
    if fp8:
        out.mul_(v_scale)
    return out.view(num_decodes, num_heads, head_size)


def _prefill(query, kv_cache, p, scale, fp8, k_scale, v_scale) -> torch.Tensor:
    """Attention of one prefill request's ``query`` ``[q_len, num_heads, head]``."""
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    kv = kv_cache[:, p.block_ids].view(2, -1, num_kv_heads, head_size)
    kv = kv[:, p.kv_offset : p.kv_offset + p.kv_len]
    if fp8:
        kv = kv.to(query.dtype)
        k, v = kv[0] * k_scale, kv[1] * v_scale
    else:
        k, v = kv[0], kv[1]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=p.attn_mask,
        is_causal=p.attn_mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)
