"""The paged KV cache of one attention layer: its layout, allocation, and the slot-mapped write.

Layout (one tensor per layer), shared by the ``torch`` and ``triton`` attention backends::

    kv_cache[2, num_blocks, num_kv_heads, block_size, head_size]
             |  |           |             |
             |  |           |             +-- token offset inside the block
             |  |           +-- KV head: each (block, head) is one contiguous
             |  |               block_size x head_size run
             |  +-- physical block id (block 0 = the null block, never written by the runner)
             +-- 0 = keys, 1 = values

A token's *slot* is ``block_id * block_size + offset``; its key for KV head ``h`` is
``kv_cache[0, slot // block_size, h, slot % block_size]``. This is vLLM's "HND" layout
(``[num_blocks, num_kv_heads, block_size, head_size]`` per K and V, the one its CPU backend reads).
Why head-major inside a block: a request's keys for one KV head are whole ``block_size x head_size``
runs, so one ``index_select`` over ``(block, head)`` rows lands them as ``[num_kv_heads, kv_len,
head_size]`` ready for the matmuls, with no transpose copy (docs/ops.md measures it).

fp8 caches (``torch.float8_e4m3fn`` / ``float8_e5m2``) store ``x / scale`` with one per-tensor scale
for K (``k_scale``) and one for V (``v_scale``); reads multiply back.

Other backends may hold other layouts (``pagedkv.ops.backends``); nothing above the ops layer
reads a cache's layout.
"""

from __future__ import annotations

import torch

from pagedkv.errors import OpsInputError
from pagedkv.validation import check_int

#: dtype names accepted by :func:`allocate_kv_cache` (pagedkv.core.spec.KV_DTYPE_BYTES's names).
KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_kv_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Map a dtype name ("bfloat16", "fp8", ...) or torch dtype to a KV-cache torch dtype.

    Raises:
        OpsInputError: a dtype the KV cache cannot hold.
    """
    if isinstance(dtype, str):
        if dtype not in KV_CACHE_DTYPES:
            raise OpsInputError(
                f"unknown KV-cache dtype {dtype!r}; use one of {sorted(KV_CACHE_DTYPES)}"
            )
        return KV_CACHE_DTYPES[dtype]
    if dtype not in KV_CACHE_DTYPES.values():
        raise OpsInputError(
            f"KV-cache dtype {dtype} unsupported; use float32, bfloat16, float16 or float8"
        )
    return dtype


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype | str = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Allocate one layer's paged KV cache, zero-filled.

    Zero-filling matters: attention reads whole blocks and masks the slots a request does not
    own, and a masked value still enters ``probs @ V`` times zero, so every slot must hold a finite
    number (uninitialised memory may hold NaN bit patterns).

    Args:
        num_blocks: physical blocks in the pool, including the null block 0 (>= 1).
        block_size: tokens per block (>= 1).
        num_kv_heads: KV heads (>= 1).
        head_size: elements per head (>= 1).
        dtype: torch dtype or name (see :data:`KV_CACHE_DTYPES`); fp8 stores scaled values.
        device: torch device.

    Returns:
        Tensor ``[2, num_blocks, num_kv_heads, block_size, head_size]`` of zeros.

    Raises:
        OpsInputError: a size < 1 or an unsupported dtype.
    """
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
    ):
        check_int(name, value, 1, error=OpsInputError)
    torch_dtype = resolve_kv_dtype(dtype)
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    if torch_dtype in FP8_DTYPES:
        # torch.zeros cannot fill fp8 on every build; the zero bit pattern is +0.0 in both formats.
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(torch_dtype)
    return torch.zeros(shape, dtype=torch_dtype, device=device)


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, int, int, int, int]:
    """Shape of one layer's cache in this layout: ``(2, num_blocks, num_kv_heads, block_size,
    head_size)``."""
    return (2, num_blocks, num_kv_heads, block_size, head_size)


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
