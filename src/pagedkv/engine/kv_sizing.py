"""The engine's KV-cache size and max_model_len, from the model's shape and the engine's options.

Runs before any weight is loaded (the engine reads the shape from the model's header:
:func:`pagedkv.model.loader.load_model_config`), so a cache that cannot hold one request, or a
max_model_len beyond the model's context, fails in a fraction of a second. Each error says which
limit was hit and which options (and their CLI flags, shared by ``generate``, ``serve`` and
``bench``) change it.

Sizing, in order of precedence::

    num_blocks given          -> that many blocks (block 0 is the null block)
    kv_cache_memory given     -> floor(kv_cache_memory / bytes_per_block)
    neither                   -> enough for max_num_seqs requests of max_model_len tokens
                                 (+ the null block), at most DEFAULT_MAX_KV_CACHE_MEMORY

    bytes_per_block = block_size x num_kv_heads x head_dim x 2 (K and V) x dtype bytes x group_size

dtype bytes are the KV cache's (``EngineConfig.kv_cache_dtype``, ``--kv-cache-dtype``): 4 for
float32, 2 for bf16 / fp16, 1 for fp8 (e4m3 or e5m2), so the same kv_cache_memory holds twice the
blocks in fp8 as in bf16.

block_size is the one the attention backend runs (decided once by
:func:`pagedkv.engine.attention_backend.choose_attention_backend` before sizing, and passed in;
the specs carry it from here on); no backend pads its cache, so these bytes are what the backend
allocates.

With tensor parallelism (``tensor_parallel_size`` > 1) every size here is one rank's:
num_kv_heads is the rank's share (``max(1, num_kv_heads / tp)``,
:func:`pagedkv.model.parallel.check_tensor_parallel`), kv_cache_memory is per rank (as vLLM's
per-GPU budget), and num_blocks is the same on every rank.

The layers' specs come from the model (:func:`pagedkv.model.config.kv_cache_layer_specs`): one
full-attention group for the Llama family; for a model with sliding-window layers (Gemma 3) one
group per ``group_size`` layers of a type, where a request of max_model_len holds
``max_num_blocks_per_request`` blocks (its window's blocks, not its length's, in the
sliding-window groups). ``disable_hybrid_kv_cache_manager`` holds every layer as full attention.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from pagedkv.core.config import KVCacheConfig, group_layers
from pagedkv.core.spec import KVCacheSpec, max_num_blocks_per_request, unify_kv_cache_specs
from pagedkv.cpu_caps import probe_cpu, resolve_dtype
from pagedkv.engine.config import (
    DEFAULT_MAX_KV_CACHE_MEMORY,
    DEFAULT_MAX_MODEL_LEN_CAP,
    EngineConfig,
    resolve_kv_cache_dtype,
)
from pagedkv.errors import CacheSizingError, ConfigError
from pagedkv.model.config import kv_cache_layer_specs
from pagedkv.model.parallel import check_tensor_parallel

#: What to change when the pool is too small, as option (flag).
_MORE_KV = (
    "give the KV cache more room: kv_cache_memory (--kv-cache-memory, e.g. 2GiB) or num_blocks "
    "(--num-blocks)"
)


class ModelShape(Protocol):
    """The fields of :class:`pagedkv.model.config.ModelConfig` that sizing reads."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int

    @property
    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """Per layer, its sliding window in tokens, or None for full attention."""
        ...


def resolve_max_model_len(
    model_config: ModelShape, config: EngineConfig, draft_model_config: ModelShape | None = None
) -> int:
    """The engine's max_model_len: ``config.max_model_len``, or the model's context (and the
    draft model's, with speculative decoding's draft_model) capped at DEFAULT_MAX_MODEL_LEN_CAP.

    Raises:
        ConfigError: max_model_len beyond the model's context (``max_position_embeddings``)
            without ``allow_long_max_model_len`` (vLLM refuses it the same way unless
            ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set).
    """
    context = model_config.max_position_embeddings
    if draft_model_config is not None:
        context = min(context, draft_model_config.max_position_embeddings)
    if config.max_model_len is None:
        return min(context, DEFAULT_MAX_MODEL_LEN_CAP)
    if config.max_model_len > context and not config.allow_long_max_model_len:
        raise ConfigError(
            f"max_model_len {config.max_model_len} is larger than the model's context of "
            f"{context} tokens (max_position_embeddings in its config): positions past it were "
            f"never trained. Lower max_model_len (--max-model-len {context}), or set "
            "allow_long_max_model_len=True (--allow-long-max-model-len) to run anyway, knowing "
            "that outputs past the context may be garbage"
        )
    return config.max_model_len


def size_kv_cache(
    model_config: ModelShape,
    config: EngineConfig,
    *,
    block_size: int | None = None,
    kv_dtype: str | None = None,
    draft_model_config: ModelShape | None = None,
) -> KVCacheConfig:
    """The KV cache the engine allocates for ``model_config`` under ``config``.

    Args:
        model_config: the model's shape (layer windows from ``layer_sliding_windows``).
        config: the engine's options.
        block_size: tokens per block, as the attention backend decided it (the engine passes
            it); None: ``config.block_size``, which must then be given.
        draft_model_config: speculative decoding's draft model, whose layers follow the
            model's in the KV cache config (layer ``num_hidden_layers + i`` is its layer ``i``):
            layers with the model's spec join its KV cache groups (one block id then holds a
            token's KV in both models), others form groups of their own; one pool, so the
            manager sizes, shares, preempts and frees both models' blocks together.
        kv_dtype: dtype of the KV cache (a :data:`~pagedkv.core.spec.KV_DTYPE_BYTES` name: fp8
            is one byte); default ``config.kv_cache_dtype``, "auto" being ``config.dtype``
            resolved for this CPU (:func:`pagedkv.cpu_caps.resolve_dtype`; the engine passes
            the KV dtype it runs).

    Returns:
        A :class:`KVCacheConfig` whose ``max_model_len`` is the engine's (see
        :func:`resolve_max_model_len`) and checked to fit once.

    Raises:
        ConfigError: max_model_len beyond the model's context (see resolve_max_model_len).
        CacheSizingError: fewer than 2 blocks, or max_model_len does not fit once (the message
            says the largest max_model_len that fits and which options to change).
    """
    max_model_len = resolve_max_model_len(model_config, config, draft_model_config)
    layer_specs = engine_layer_specs(model_config, config, block_size=block_size, kv_dtype=kv_dtype)
    if draft_model_config is not None:
        layer_specs += engine_layer_specs(
            draft_model_config, config, block_size=block_size, kv_dtype=kv_dtype
        )
    kv_cache_memory = config.kv_cache_memory
    if config.num_blocks is None and kv_cache_memory is None:
        groups, group_size = group_layers(layer_specs)
        blocks = max_num_blocks_per_request(
            [g.kv_cache_spec for g in groups], max_model_len, config.max_num_batched_tokens
        )
        bytes_per_block = groups[0].kv_cache_spec.page_size_bytes * group_size
        wanted = (config.max_num_seqs * blocks + 1) * bytes_per_block  # + the null block
        kv_cache_memory = min(wanted, DEFAULT_MAX_KV_CACHE_MEMORY)

    def build(length: int | None) -> KVCacheConfig:
        if config.num_blocks is not None:
            return KVCacheConfig.from_num_blocks(
                layer_specs,
                config.num_blocks,
                max_model_len=length,
                max_num_batched_tokens=config.max_num_batched_tokens,
            )
        return KVCacheConfig.from_kv_cache_memory(
            layer_specs,
            kv_cache_memory,
            max_model_len=length,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )

    try:
        build(None)  # the pool alone: at least one usable block
    except CacheSizingError as e:
        raise CacheSizingError(f"{e}; {_MORE_KV}") from None
    try:
        return build(max_model_len)
    except CacheSizingError as e:
        raise CacheSizingError(
            f"{e}. Lower max_model_len (--max-model-len), or {_MORE_KV}"
        ) from None


def engine_layer_specs(
    model_config: ModelShape,
    config: EngineConfig,
    *,
    block_size: int | None = None,
    kv_dtype: str | None = None,
) -> list[KVCacheSpec]:
    """The KV-cache spec of each layer the engine allocates: the model's
    (:func:`~pagedkv.model.config.kv_cache_layer_specs`), every layer full attention under
    ``config.disable_hybrid_kv_cache_manager``; with tensor parallelism, one rank's (its share of
    the KV heads).

    ``block_size`` (the attention backend's decision; None: ``config.block_size``) is every
    spec's.

    Raises:
        ConfigError: a bad or missing block_size, a bad dtype, or a model that does not
            split ``config.tensor_parallel_size`` ways (the message names the head counts).
    """
    if block_size is None:
        block_size = config.block_size
    if block_size is None:
        raise ConfigError(
            "block_size is None: the engine decides it with the attention backend before "
            "sizing the KV cache (pagedkv.engine.attention_backend.choose_attention_backend)"
        )
    tp = config.tensor_parallel_size
    if tp > 1:
        per_rank = check_tensor_parallel(model_config, tp).num_kv_heads
        model_config = dataclasses.replace(model_config, num_key_value_heads=per_rank)
    if kv_dtype is None:  # the engine passes its resolved KV dtype; "auto" follows this CPU
        dtype = resolve_dtype(config.dtype, probe_cpu() if config.dtype == "auto" else None)
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    specs = kv_cache_layer_specs(model_config, block_size, kv_dtype)
    if config.disable_hybrid_kv_cache_manager:
        specs = unify_kv_cache_specs(specs)
    return specs
