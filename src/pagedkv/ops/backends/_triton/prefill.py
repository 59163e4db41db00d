"""Triton varlen causal attention over the paged cache: prefill, prefill after a prefix cache hit,
chunked prefill and mixed prefill/decode batches.

Grid ``(num_q_blocks, num_kv_heads)``. A program takes ``BLOCK_Q`` consecutive query tokens of one
request and all ``NUM_QUERIES_PER_KV`` query heads of one KV head, packed as the ``BLOCK_M`` rows of
one ``tl.dot`` (row = token * NUM_QUERIES_PER_KV + head in group; GQA reads each K/V tile once per
KV head), and runs flash attention (online softmax, Dao et al. 2022) over K/V tiles gathered
through the request's block table::

    request i: seq_len positions, the last q_len are this step's queries
    keys       |======== cached prefix (context_len) ========|====== new tokens ======|
    q block b                                                 [b*BLOCK_Q, (b+1)*BLOCK_Q)
    tiles read: from the window start (0 without a window) up to the block's last query position

Request ``i``'s q blocks are numbered from ``query_start_loc[i] // BLOCK_Q + i``; that bound lets
the grid be sized from ``num_tokens`` and ``num_reqs`` alone (no device-to-host copy), and each
program finds its request by binary search over ``query_start_loc`` (the same trick as vLLM's
Triton unified attention). Spare programs return at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedkv.ops.backends._triton.paging import token_offsets


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest request i with query_start_loc[i] // BLOCK_Q + i <= q_block."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = start <= q_block
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


@triton.jit
def _prefill_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,  # softmax scale * log2(e)
    k_scale,
    v_scale,
    sliding_window,  # 0 = none
    num_reqs,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_bt_req,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # BLOCK_M // NUM_QUERIES_PER_KV query tokens per program
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no TF32 rounding), else "tf32" (unused)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = local_block * BLOCK_Q + rows // NUM_QUERIES_PER_KV  # token within the request
    heads = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_mask = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx < q_len)
    # Padding rows take the block's last query position so that no row is fully masked.
    last_q_idx = tl.minimum((local_block + 1) * BLOCK_Q, q_len) - 1
    q_pos = context_len + tl.minimum(q_idx, last_q_idx)  # [BLOCK_M]
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    dim_mask = dims < HEAD_SIZE
    q = tl.load(
        query_ptr
        + (q_start + q_idx)[:, None] * stride_q_token
        + heads[:, None] * stride_q_head
        + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    hi = context_len + last_q_idx + 1  # keys past the block's last query are never visible
    # With a window, the block's first query sees nothing before first_q_pos - sliding_window + 1.
    lo = tl.where(
        sliding_window > 0,
        tl.maximum(context_len + local_block * BLOCK_Q - sliding_window + 1, 0),
        0,
    )
    lo = (lo // TILE_N) * TILE_N
    block_table_ptr = block_tables_ptr + req * stride_bt_req
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], tl.float32)
    for tile_start in range(lo, hi, TILE_N):
        positions = tile_start + tl.arange(0, TILE_N)
        pos_mask = positions < hi
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
        visible = (positions[None, :] <= q_pos[:, None]) & (
            (sliding_window == 0) | (positions[None, :] > q_pos[:, None] - sliding_window)
        )
        scores = (
            tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * scale_log2
        )  # [BLOCK_M, TILE_N]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row may see nothing in a tile before its window: keep it at 0 instead of NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(
        out_ptr
        + (q_start + q_idx)[:, None] * stride_o_token
        + heads[:, None] * stride_o_head
        + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )
