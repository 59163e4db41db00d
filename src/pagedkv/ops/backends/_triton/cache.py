"""Triton ``write_kv``: scatter a step's keys and values into their cache slots.

One program per token copies all of that token's K and V heads (``num_kv_heads * head_size``
elements each) to slot ``slot_mapping[token]`` of ``kv_cache[0]`` / ``kv_cache[1]``; slot -1 skips
the token (padding). For an fp8 cache the values are divided by the per-tensor scale and rounded on
the store, the same convention as the torch backend's write (vLLM's ``reshape_and_cache`` with
``k_scale`` / ``v_scale``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.ops.backends.base import FP8_DTYPES


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ELEMENTS_PADDED: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, ELEMENTS_PADDED)
    mask = offs < NUM_KV_HEADS * HEAD_SIZE
    head = offs // HEAD_SIZE
    dim = offs % HEAD_SIZE
    key = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + dim, mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_token + head * stride_value_head + dim, mask=mask
    )
    if IS_FP8:
        key = key.to(tl.float32) / k_scale
        value = value.to(tl.float32) / v_scale
    cache_offs = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_token
        + head * stride_cache_head
        + dim
    )
    tl.store(key_cache_ptr + cache_offs, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offs, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write keys and values into their slots of the paged KV cache, in place (Triton).

    Inputs are not validated here: this is the triton backend's write
    (:meth:`~pagedkv.ops.backends.TritonBackend.write_kv`, which validates with
    ``validate=True``).

    Args:
        key: ``[num_tokens, num_kv_heads, head_size]`` fp32/bf16/fp16; the last dim contiguous
            (a view split from a fused QKV projection is fine).
        value: same shape as ``key``.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]``, contiguous, the key's
            dtype or fp8 (``torch.float8_e4m3fn`` / ``float8_e5m2``, stores ``x / scale``).
        slot_mapping: ``[num_tokens]`` int32/int64; slot = block_id * block_size + offset;
            -1 = skip.
        k_scale, v_scale: fp8 per-tensor scales (ignored for other cache dtypes).
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, num_kv_heads, block_size, head_size = kv_cache.shape
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    # [num_blocks, block_size, num_kv_heads, head_size] views: the kernels index (block, token,
    # head) through these strides, whatever the layout behind them.
    key_cache, value_cache = kv_cache[0].transpose(1, 2), kv_cache[1].transpose(1, 2)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size,
        ELEMENTS_PADDED=triton.next_power_of_2(num_kv_heads * head_size),
        IS_FP8=kv_cache.dtype in FP8_DTYPES,
    )
