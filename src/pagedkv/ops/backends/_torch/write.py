"""The torch backend's write: a step's keys and values into their slots of the paged cache
(``[2, num_blocks, num_kv_heads, block_size, head_size]``, :mod:`pagedkv.ops.backends.hnd_layout`),
in plain torch on the cache's device."""

from __future__ import annotations

import torch

from pagedkv.ops.backends.base import FP8_DTYPES


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write a step's keys and values into their slots of the paged KV cache, in place: the
    torch backend's write (it validates first). Plain torch on the cache's device, vectorised:
    one ``index_put_`` per K and V, no Python loop over tokens.

    Args:
        key: ``[num_tokens, num_kv_heads, head_size]``, the cache's dtype (any float dtype for an
            fp8 cache: it is divided by ``k_scale`` and rounded to nearest fp8). May be a strided
            view (split from a fused QKV projection).
        value: same shape and dtype as ``key``.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` (see module docs).
        slot_mapping: ``[num_tokens]`` int32/int64; slot = block_id * block_size + offset;
            -1 = skip this token (padding). No slot twice.
        k_scale: per-tensor scale of fp8 keys (ignored for other dtypes).
        v_scale: per-tensor scale of fp8 values (ignored for other dtypes).
    """
    block_size = kv_cache.shape[3]
    slots = slot_mapping.long()
    skip = slots < 0
    if bool(skip.any()):
        keep = ~skip
        slots, key, value = slots[keep], key[keep], value[keep]
    if kv_cache.dtype in FP8_DTYPES:
        # index_put_ has no fp8 kernel on CPU: copy the bytes through a uint8 view.
        key = (key.float() / k_scale).to(kv_cache.dtype).view(torch.uint8)
        value = (value.float() / v_scale).to(kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    index = (slots // block_size, slots % block_size)
    # [num_blocks, block_size, num_kv_heads, head_size] views: element [b, o] is one token's
    # [num_kv_heads, head_size], written by one indexed assignment per K and V.
    kv_cache[0].transpose(1, 2).index_put_(index, key)
    kv_cache[1].transpose(1, 2).index_put_(index, value)
