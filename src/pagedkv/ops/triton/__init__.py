"""Triton kernels for the paged KV cache (the GPU path of :mod:`pagedkv.ops`; optional ``gpu``
extra, ``pip install 'pagedkv[gpu]'``).

- :func:`write_kv_triton`: the slot-mapped cache write.
- :func:`paged_attention_triton`: a split-context decode kernel and a varlen causal prefill kernel
  reading K/V through block tables (GQA, sliding window, fp16/bf16/fp32, fp8 KV with per-tensor
  scales).

Importing this package imports ``triton``; :func:`pagedkv.ops.paged_attention` and
:func:`pagedkv.ops.write_kv` route CUDA tensors here when it is installed. On a machine without a
GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` set before this package is
imported) on CPU tensors; docs/gpu.md says what was verified where.
"""

from pagedkv.ops.triton.attention import (
    DEFAULT_CONFIG,
    TritonAttentionConfig,
    paged_attention_triton,
)
from pagedkv.ops.triton.cache import write_kv_triton

__all__ = [
    "DEFAULT_CONFIG",
    "TritonAttentionConfig",
    "paged_attention_triton",
    "write_kv_triton",
]
