"""``paged_attention_triton``: picks the decode or the prefill kernel and launches it.

Decode-only batches (every request has one query token) go to the split-context decode kernel
(``decode.py``); anything else (prefill, prefill after a prefix cache hit, chunked prefill, mixed
batches) to the varlen causal kernel (``prefill.py``), which handles q_len 1 rows too.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedkv.ops.backends._triton.config import DEFAULT_CONFIG, TritonAttentionConfig
from pagedkv.ops.backends._triton.decode import _decode_partition_kernel, _decode_reduce_kernel
from pagedkv.ops.backends._triton.prefill import _prefill_kernel
from pagedkv.ops.backends.base import FP8_DTYPES

_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    decode_only: bool | None = None,
    max_seq_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    config: TritonAttentionConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Causal paged attention of a mixed batch with Triton kernels: the triton backend's forward
    (:class:`~pagedkv.ops.backends.TritonBackend`, which validates the inputs first; the same
    maths as the torch backend's).

    Args:
        query: ``[num_tokens, num_heads, head_size]`` fp32/bf16/fp16, last dim contiguous.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]``, contiguous, the query's
            dtype or fp8 (``float8_e4m3fn`` / ``float8_e5m2``; values are ``stored * scale``).
        block_tables: ``[num_reqs, max_num_blocks]`` int32/int64, padded with the null block 0.
        seq_lens: ``[num_reqs]`` int32/int64, tokens in the cache per request (this step's
            included).
        query_start_loc: ``[num_reqs + 1]`` int32/int64, cumulative query lengths from 0; every
            request has q_len >= 1.
        scale: softmax scale.
        sliding_window: attend to the last ``sliding_window`` positions only (None = all).
        decode_only: every request has exactly one query token (the backend's metadata knows
            this); None = infer from ``num_tokens == num_reqs`` (true iff all q_len are 1, given
            q_len >= 1).
        max_seq_len: the largest seq_len of the batch, a host int (sizes the decode grid and its
            scratch buffers); None = the block table's capacity, ``max_num_blocks * block_size``.
        k_scale, v_scale: fp8 dequantisation scales (ignored for other cache dtypes).
        config: tile sizes.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype``.
    """
    num_tokens, num_heads, head_size = query.shape
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    num_reqs = block_tables.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_queries_per_kv = num_heads // num_kv_heads
    # [num_blocks, block_size, num_kv_heads, head_size] views: the kernels index (block, token,
    # head) through these strides, whatever the layout behind them.
    key_cache, value_cache = kv_cache[0].transpose(1, 2), kv_cache[1].transpose(1, 2)
    is_fp8 = kv_cache.dtype in FP8_DTYPES
    # NOTE: Triton's interpreter (CPU tensors) computes tl.dot on bf16 wrongly; use fp32 there.
    interpreted = query.device.type != "cuda" or triton.knobs.runtime.interpret
    dot_dtype = tl.float32 if interpreted else _DOT_DTYPES[query.dtype]
    dot_precision = "ieee" if dot_dtype == tl.float32 else "tf32"
    common = {
        "scale_log2": scale * math.log2(math.e),
        "k_scale": float(k_scale) if is_fp8 else 1.0,
        "v_scale": float(v_scale) if is_fp8 else 1.0,
        "sliding_window": sliding_window or 0,
    }
    strides = (
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
    )
    head_size_padded = triton.next_power_of_2(max(head_size, 16))
    if decode_only is None:
        decode_only = num_tokens == num_reqs
    if not decode_only:
        block_m = max(config.prefill_block_m, triton.next_power_of_2(num_queries_per_kv))
        block_q = block_m // num_queries_per_kv
        grid = (num_tokens // block_q + num_reqs, num_kv_heads)
        _prefill_kernel[grid](
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            out,
            common["scale_log2"],
            common["k_scale"],
            common["v_scale"],
            common["sliding_window"],
            num_reqs,
            *strides,
            NUM_QUERIES_PER_KV=num_queries_per_kv,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=head_size_padded,
            BLOCK_SIZE=block_size,
            TILE_N=config.prefill_tile_n,
            IS_FP8=is_fp8,
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION=dot_precision,
            num_warps=config.num_warps,
        )
        return out

    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    num_partitions = max(triton.cdiv(max_seq_len, config.partition_size), 1)
    single = num_partitions == 1
    if single:
        partial_out = partial_max = partial_sum = out  # unused
    else:
        partial_out = torch.empty(
            (num_reqs, num_heads, num_partitions, head_size_padded),
            dtype=torch.float32,
            device=query.device,
        )
        partial_max = torch.empty(
            (num_reqs, num_heads, num_partitions), dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
    _decode_partition_kernel[(num_reqs, num_kv_heads, num_partitions)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_max,
        partial_sum,
        common["scale_log2"],
        common["k_scale"],
        common["v_scale"],
        common["sliding_window"],
        num_partitions,
        *strides,
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        BLOCK_M=max(16, triton.next_power_of_2(num_queries_per_kv)),
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_size_padded,
        BLOCK_SIZE=block_size,
        PARTITION_SIZE=config.partition_size,
        TILE_N=config.decode_tile_n,
        IS_FP8=is_fp8,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        SINGLE_PARTITION=single,
        num_warps=config.num_warps,
    )
    if not single:
        _decode_reduce_kernel[(num_reqs, num_heads)](
            seq_lens,
            out,
            partial_out,
            partial_max,
            partial_sum,
            common["sliding_window"],
            num_partitions,
            out.stride(0),
            out.stride(1),
            HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=head_size_padded,
            PARTITION_SIZE=config.partition_size,
            PARTITIONS_PADDED=triton.next_power_of_2(num_partitions),
        )
    return out
