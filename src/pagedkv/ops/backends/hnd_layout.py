"""What the ``torch`` and ``triton`` backends share: pagedkv's own cache layout.

One tensor per layer, ``[2, num_blocks, num_kv_heads, block_size, head_size]`` (vLLM's "HND":
each (block, KV head) one contiguous ``block_size x head_size`` run; ``pagedkv.ops.kv_cache``),
any block size, any head size, every cache dtype the ops support.
"""

from __future__ import annotations

import torch

from pagedkv.ops.backends.base import AttentionBackend, AttentionLayerSpec, check_layer_tensors
from pagedkv.ops.kv_cache import allocate_kv_cache, kv_cache_shape


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

    def _check_tensors(
        self, spec: AttentionLayerSpec, num_tokens: int, kv_cache: torch.Tensor, **tensors
    ) -> None:
        """Validate one layer call's tensors against ``spec`` (see ``check_layer_tensors``)."""
        shape = self.kv_cache_shape(
            kv_cache.shape[1], spec.block_size, spec.num_kv_heads, spec.head_size
        )
        check_layer_tensors(spec, num_tokens, kv_cache, shape, **tensors)
