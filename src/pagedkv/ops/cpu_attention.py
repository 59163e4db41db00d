"""Fast CPU paged attention (pure torch).

Decode group (q_len 1), chunk by chunk of requests (see ``gather_plan.py``), no Python loop over
requests inside a chunk::

    blocks  = index_select(kv_cache[0], chunk.block_ids)     [n * num_blocks, block, kv_heads, head]
    K, V    = blocks -> [n, kv_heads, kv_len, head] contiguous (copy while still in cache)
    q       = query rows viewed as [n, kv_heads, group, head]   (GQA: no K/V repeat)
    scores  = q @ K^T -> fp32, scale, mask padding, softmax     [n, kv_heads, group, kv_len]
    out     = probs (query dtype) @ V                         [n, kv_heads, group, head]

A grouped matmul-softmax-matmul rather than ``scaled_dot_product_attention``: on this CPU bf16 SDPA
with one query token was 4-10x slower (docs/ops.md, docs/perf.md). Both matmuls accumulate in fp32;
the scores are rounded to the query dtype before the fp32 softmax (as Hugging Face's eager
attention does).

Prefill group (q_len > 1): one SDPA call per request on its gathered K/V (``enable_gqa``) with the
precomputed causal / sliding-window mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.ops.attention_metadata import PagedAttentionMetadata
from pagedkv.ops.gather_plan import get_gather_plan
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
    num_heads = query.shape[1]
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    dtype = query.dtype
    fp8 = kv_cache.dtype in FP8_DTYPES
    if not fp8:
        k_scale = v_scale = 1.0
    plan = get_gather_plan(
        metadata, num_kv_heads, 2 * num_kv_heads * head_size * kv_cache.element_size()
    )
    out = torch.empty_like(query)
    bs = kv_cache.shape[2]
    if plan.decode_chunks:
        block_shape = (plan.max_decode_blocks, bs, num_kv_heads, head_size)
        key_blocks = plan.buffer("key_blocks", block_shape, kv_cache.dtype)
        value_blocks = plan.buffer("value_blocks", block_shape, kv_cache.dtype)
        major_shape = (plan.max_decode_blocks * bs * num_kv_heads * head_size,)
        key_major = plan.buffer("key_major", major_shape, dtype)
        value_major = plan.buffer("value_major", major_shape, dtype)
    for chunk in plan.decode_chunks:
        if chunk.part_blocks is not None:
            out.index_copy_(
                0,
                chunk.token_ids,
                _decode_in_parts(
                    query,
                    kv_cache,
                    chunk,
                    scale * k_scale,
                    v_scale,
                    (key_blocks, value_blocks, key_major, value_major),
                ),
            )
            continue
        n, kv_len = chunk.num_reqs, chunk.num_blocks * bs
        num_blocks = n * chunk.num_blocks
        kb = torch.index_select(kv_cache[0], 0, chunk.block_ids, out=key_blocks[:num_blocks])
        vb = torch.index_select(kv_cache[1], 0, chunk.block_ids, out=value_blocks[:num_blocks])
        if chunk.value_zero is not None:
            # Slots outside a request's keys may hold anything (even NaN): zero their values,
            # since a masked probability of 0 times NaN would still be NaN. Only those slots are
            # touched, whole padding blocks at once (a full-tensor where() cost 14x the copy).
            chunk.value_zero.apply(vb)
        # Token-major -> KV-head-major while the blocks are still in cache (and fp8 -> dtype).
        kb = kb.view(n, kv_len, num_kv_heads, head_size).transpose(1, 2)
        vb = vb.view(n, kv_len, num_kv_heads, head_size).transpose(1, 2)
        size = n * kv_len * num_kv_heads * head_size
        k = key_major[:size].view(n, num_kv_heads, kv_len, head_size).copy_(kb)
        v = value_major[:size].view(n, num_kv_heads, kv_len, head_size).copy_(vb)
        q = query.index_select(0, chunk.token_ids).view(n, num_kv_heads, group, head_size)
        scores = torch.matmul(q, k.transpose(2, 3)).float().mul_(scale * k_scale)
        if chunk.key_mask is not None:
            scores.masked_fill_(chunk.key_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(dtype)
        chunk_out = torch.matmul(probs, v).view(n, num_heads, head_size)
        if fp8:
            chunk_out.mul_(v_scale)
        out.index_copy_(0, chunk.token_ids, chunk_out)

    if plan.prefill_rows:
        rows_shape = (plan.max_prefill_rows, head_size)
        key_buf = plan.buffer("key_rows", rows_shape, kv_cache.dtype)
        value_buf = plan.buffer("value_rows", rows_shape, kv_cache.dtype)
        key_rows = kv_cache[0].view(-1, head_size)
        value_rows = kv_cache[1].view(-1, head_size)
    for p, rows in zip(metadata.prefills, plan.prefill_rows, strict=True):
        num_rows = rows.numel()
        k = torch.index_select(key_rows, 0, rows, out=key_buf[:num_rows])
        v = torch.index_select(value_rows, 0, rows, out=value_buf[:num_rows])
        if fp8:
            k, v = k.to(dtype) * k_scale, v.to(dtype) * v_scale
        k = k.view(1, num_kv_heads, -1, head_size)
        v = v.view(1, num_kv_heads, -1, head_size)
        q = query[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)
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


def _decode_in_parts(query, kv_cache, chunk, scale, v_scale, buffers) -> torch.Tensor:
    """One decode request too big for one gather: scores from K parts, softmax over the whole
    row, then the output from V parts, each part small enough to stay in cache.

    Returns ``[1, num_heads, head_size]``.
    """
    key_blocks, value_blocks, key_major, value_major = buffers
    _, _, bs, num_kv_heads, head_size = kv_cache.shape
    num_heads, dtype = query.shape[1], query.dtype
    group = num_heads // num_kv_heads
    kv_len = chunk.num_blocks * bs
    q = query.index_select(0, chunk.token_ids).view(1, num_kv_heads, group, head_size)
    parts = range(0, chunk.num_blocks, chunk.part_blocks)

    def gather(cache, blocks_buf, major_buf, b0, zero=None):
        ids = chunk.block_ids[b0 : b0 + chunk.part_blocks]
        blocks = torch.index_select(cache, 0, ids, out=blocks_buf[: ids.numel()])
        if zero is not None:
            zero.apply(blocks)
        t = ids.numel() * bs
        blocks = blocks.view(1, t, num_kv_heads, head_size).transpose(1, 2)
        return major_buf[: t * num_kv_heads * head_size].view(1, num_kv_heads, t, head_size), blocks

    scores = torch.empty(1, num_kv_heads, group, kv_len, dtype=torch.float32)
    for b0 in parts:
        k, blocks = gather(kv_cache[0], key_blocks, key_major, b0)
        k.copy_(blocks)
        t0 = b0 * bs
        scores[..., t0 : t0 + k.shape[2]] = torch.matmul(q, k.transpose(2, 3))
    scores.mul_(scale)
    if chunk.key_mask is not None:
        scores.masked_fill_(chunk.key_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(dtype)
    acc = torch.zeros(1, num_kv_heads, group, head_size, dtype=torch.float32)
    for i, b0 in enumerate(parts):
        zero = chunk.part_value_zero[i] if chunk.part_value_zero is not None else None
        v, blocks = gather(kv_cache[1], value_blocks, value_major, b0, zero)
        t0, t1 = b0 * bs, b0 * bs + v.shape[2]
        v.copy_(blocks)
        acc += torch.matmul(probs[..., t0:t1], v)
    return acc.mul_(v_scale).to(dtype).view(1, num_heads, head_size)
