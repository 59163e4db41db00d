"""Triton decode attention (one query token per request), split over the context, flash-decoding
style.

Grid ``(num_reqs, num_kv_heads, num_partitions)``: each program attends the query heads of one KV
head (GQA: the ``num_heads // num_kv_heads`` query heads that share it are the rows of one
``tl.dot``, so each K/V tile is read once per KV head) to one partition of ``PARTITION_SIZE``
positions of its request's context, gathered tile by tile through the block table::

    context   |---- partition 0 ----|---- partition 1 ----|-- partition 2 --|     (seq_len)
    program   (req, kv_head, 0)     (req, kv_head, 1)     (req, kv_head, 2)
    writes    o_0, m_0, l_0         o_1, m_1, l_1         o_2, m_2, l_2
    reduce    out = sum_p w_p o_p / sum_p w_p,  w_p = l_p * 2^(m_p - max m)

With one partition (short contexts) the first kernel writes the output itself and the reduce is
skipped. Long contexts and small batches thus still fill the GPU (Dao et al., "Flash-Decoding for
long-context inference", 2023; vLLM's paged_attention_v2). The partition count comes from the block
table's width, not from the seq_lens values, so launching needs no device-to-host copy; programs
past a request's end return at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedkv.ops.backends._triton.paging import token_offsets


@triton.jit
def _decode_partition_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,  # [num_reqs, num_heads, num_partitions, HEAD_SIZE_PADDED] fp32
    partial_max_ptr,  # [num_reqs, num_heads, num_partitions] fp32 (log2 domain)
    partial_sum_ptr,  # [num_reqs, num_heads, num_partitions] fp32
    scale_log2,  # softmax scale * log2(e)
    k_scale,
    v_scale,
    sliding_window,  # 0 = none
    num_partitions,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_bt_req,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,  # NUM_QUERIES_PER_KV padded to a power of two >= 16 (tl.dot)
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no TF32 rounding), else "tf32" (unused)
    SINGLE_PARTITION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    # The query is the last position; a window keeps positions > seq_len - 1 - sliding_window.
    kv_start = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
    part_start = partition * PARTITION_SIZE
    part_end = tl.minimum(part_start + PARTITION_SIZE, seq_len)
    lo = tl.maximum(part_start, kv_start)
    if lo >= part_end:
        return  # nothing of this partition is visible; the reduce skips it too
    lo = part_start + ((lo - part_start) // TILE_N) * TILE_N

    rows = tl.arange(0, BLOCK_M)
    heads = kv_head * NUM_QUERIES_PER_KV + rows
    row_mask = rows < NUM_QUERIES_PER_KV
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    dim_mask = dims < HEAD_SIZE
    q = tl.load(
        query_ptr + req * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    block_table_ptr = block_tables_ptr + req * stride_bt_req
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], tl.float32)
    for tile_start in range(lo, part_end, TILE_N):
        positions = tile_start + tl.arange(0, TILE_N)
        pos_mask = (positions >= kv_start) & (positions < part_end)
        offs = token_offsets(
            block_table_ptr,
            positions,
            pos_mask,
            BLOCK_SIZE,
            stride_cache_block,
            stride_cache_token,
        )
        offs = offs[:, None] + kv_head * stride_cache_head + dims[None, :]
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + offs, mask=kv_mask, other=0.0)
        if IS_FP8:
            k = k.to(tl.float32) * k_scale
            v = v.to(tl.float32) * v_scale
        scores = (
            tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * scale_log2
        )  # [BLOCK_M, TILE_N]
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        m_i = m_new
    # The first tile holds position lo, visible to every row, so l_i > 0 and m_i is finite.
    acc = acc / l_i[:, None]

    if SINGLE_PARTITION:
        tl.store(
            out_ptr + req * stride_o_token + heads[:, None] * stride_o_head + dims[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & dim_mask[None, :],
        )
    else:
        stat = (req * tl.num_programs(1) * NUM_QUERIES_PER_KV + heads) * num_partitions + partition
        tl.store(partial_max_ptr + stat, m_i, mask=row_mask)
        tl.store(partial_sum_ptr + stat, l_i, mask=row_mask)
        tl.store(
            partial_out_ptr + stat[:, None] * HEAD_SIZE_PADDED + dims[None, :],
            acc,
            mask=row_mask[:, None],
        )


@triton.jit
def _decode_reduce_kernel(
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    sliding_window,
    num_partitions,
    stride_o_token,
    stride_o_head,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    PARTITIONS_PADDED: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    kv_start = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
    # The partitions the first kernel wrote: those overlapping [kv_start, seq_len).
    first = kv_start // PARTITION_SIZE
    last = tl.cdiv(seq_len, PARTITION_SIZE)
    parts = tl.arange(0, PARTITIONS_PADDED)
    part_mask = (parts >= first) & (parts < last)
    stat = (req * tl.num_programs(1) + head) * num_partitions + parts
    m = tl.load(partial_max_ptr + stat, mask=part_mask, other=float("-inf"))
    l = tl.load(partial_sum_ptr + stat, mask=part_mask, other=0.0)  # noqa: E741
    weights = l * tl.exp2(m - tl.max(m, axis=0))
    weights = tl.where(part_mask, weights, 0.0)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    o = tl.load(
        partial_out_ptr + stat[:, None] * HEAD_SIZE_PADDED + dims[None, :],
        mask=part_mask[:, None],
        other=0.0,
    )
    out = tl.sum(o * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(
        out_ptr + req * stride_o_token + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_SIZE,
    )
