"""The engine's options resolved once, in one documented order, into one frozen config.

:class:`~pagedkv.engine.config.EngineConfig` is what the user typed (``dtype="auto"``,
``block_size=None``, ``max_model_len=None`` ...). :func:`resolve_engine_config` decides every
value left open, each in one step and in this order (a step reads only what the steps before it
decided), and returns them frozen:

====  ======================================  ============================================
step  decides                                 from
====  ======================================  ============================================
1     dtype ("auto": this CPU's), the         the options, :func:`pagedkv.cpu_caps.
      quantization default, torch threads     resolve_dtype`
2     the model (its path) and its shape;     the model file's header (no weight read), or
      a loaded model's dtype                  the loaded model
3     the draft model's path and shape        ``speculative_config.model``
4     attention backend, **block size**       :func:`~pagedkv.engine.attention_backend.
      (the backend's default when not given)  choose_attention_backend`: the one place the
      and the KV-cache dtype                  block size is decided
5     max_model_len and num_gpu_blocks        :func:`~pagedkv.engine.kv_sizing.size_kv_cache`
      (the KV cache's specs, built with the   (the core's :class:`~pagedkv.core.config.
      block size of step 4)                   KVCacheConfig`)
6     the KV tier's blocks (and a disk        ``kv_offloading_size`` / the tier's directory
      tier's block-hash seed)
7     scheduler limits; everything frozen     :class:`~pagedkv.config.PagedKVConfig`
====  ======================================  ============================================

Nothing changes the result afterwards: :class:`~pagedkv.config.PagedKVConfig` and its
sub-configs are frozen dataclasses, and the KV cache manager, the scheduler, the executor and
the model runner read them (``cache_config.block_size`` is the block size; the specs of
``kv_cache_config`` carry the same value, set from it).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.config import (
    CacheConfig,
    ModelRunConfig,
    PagedKVConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedkv.core.config import KVCacheConfig
from pagedkv.cpu_caps import CpuCapabilities, probe_cpu, resolve_dtype
from pagedkv.cpu_env import available_cpu_count
from pagedkv.engine.attention_backend import choose_attention_backend
from pagedkv.engine.config import EngineConfig, default_quantization
from pagedkv.engine.cpu_runtime import tune_cpu_runtime
from pagedkv.engine.kv_sizing import size_kv_cache
from pagedkv.errors import ConfigError, ModelLoadError
from pagedkv.ops.backends import BackendChoice
from pagedkv.worker.kv_cache_layout import check_kv_host_memory
from pagedkv.worker.kv_offload import open_disk_tier, tier_identity

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResolvedEngineConfig:
    """What :func:`resolve_engine_config` decided, frozen.

    Attributes:
        config: every resolved setting (vLLM's ``VllmConfig``): the engine's ``config``.
        options: the options as given (keyword overrides applied, nothing resolved).
        kv_cache_config: the KV cache's blocks, groups and specs (the specs' block size is
            ``config.cache_config.block_size``).
        attention: the attention backend, its block size and why ``auto`` passed over others.
        cpu_capabilities: what this CPU computes fast (decided dtype "auto").
        loaded_model: the model read in step 2 when it was loaded (given, or rank 0's
            ``model_loader`` in one process); None when only its header was read.
        tier_keys: a disk KV tier's entries from an earlier run (empty without one).
    """

    config: PagedKVConfig
    options: EngineConfig
    kv_cache_config: KVCacheConfig
    attention: BackendChoice
    cpu_capabilities: CpuCapabilities
    loaded_model: Any = None
    tier_keys: tuple[str, ...] = ()


def resolve_engine_config(
    options: EngineConfig,
    *,
    loaded_model: Any = None,
    model_loader: Any = None,
    draft_model: Any = None,
) -> ResolvedEngineConfig:
    """Resolve ``options`` in the module's order, once; everything before the weights load.

    Args:
        options: the engine's options (not changed).
        loaded_model: a loaded model to run (its dtype wins over ``options.dtype``).
        model_loader: with tensor parallelism, rank 0's loader (a probe reads its shape).
        draft_model: speculative decoding's draft model, already loaded.

    Returns:
        The frozen :class:`ResolvedEngineConfig`.

    Raises:
        ConfigError / CacheSizingError: invalid options, a max_model_len beyond the model's
            context, a KV cache that cannot hold one request of max_model_len, a block size
            the named backend does not run, a draft model whose KV pages differ in size.
        ModelLoadError: the model or the draft model cannot be found or read.
    """
    tp = options.tensor_parallel_size
    if tp > 1 and loaded_model is not None:
        raise ConfigError(
            "loaded_model cannot be split over tensor_parallel_size > 1 processes: pass "
            "model_loader (each rank loads its shard) or a model path"
        )
    # 1. dtype, quantization, threads (set before anything loads).
    caps = probe_cpu()
    dtype = resolve_dtype(options.dtype, caps)
    quantization = default_quantization(options.quantization, options.dtype)
    num_threads = options.num_threads
    if num_threads is None and tp > 1:
        num_threads = max(1, available_cpu_count() // tp)
    tune_cpu_runtime(num_threads)
    # 2. the model's shape (and path; a loaded model's dtype).
    model_shape, loaded_model, model, dtype = _read_model_shape(
        options, dtype, loaded_model, model_loader
    )
    # 3. the draft model's.
    draft_shape, speculative = _read_draft_model_shape(options, draft_model)
    # 4. attention backend: the block size's one decision, and the KV-cache dtype.
    device = "cpu" if loaded_model is None else loaded_model.model.device
    if torch.device(device).type == "cpu":
        logger.info("%s", caps.summary(dtype))
    if options.batch_invariant:
        for shape in (model_shape, draft_shape):
            _check_batch_invariant_model(shape)
    attention, kv_cache_dtype = choose_attention_backend(
        dataclasses.replace(options, attention_backend="native")
        if options.batch_invariant
        else options,
        model_shape.head_dim,
        dtype,
        device,
        getattr(model_shape, "attn_logit_softcapping", None),
    )
    if options.batch_invariant:
        if attention.backend.name != "native":
            raise ConfigError(
                "batch_invariant runs with the native attention backend, which does not run "
                f"this model here: {attention.fallback_reason}"
            )
        logger.info(
            "batch-invariant: every step on pagedkv's fused C layers with one reduction order "
            "per row (a request's tokens and logprobs do not depend on its batch or its KV "
            "blocks' history)"
        )
    block_size = attention.block_size
    # 5. KV cache sizing: the specs (of that block size), max_model_len, the blocks.
    kv_cache_config = _size_kv_cache(options, model_shape, draft_shape, block_size, kv_cache_dtype)
    if torch.device(device).type == "cpu":  # before the block pool and the weights are built
        check_kv_host_memory(kv_cache_config.num_blocks, kv_cache_config.kv_cache_memory)
    max_model_len = kv_cache_config.max_model_len
    # 6. the KV tier.
    tier_blocks, tier_keys, hash_seed = _open_kv_tier(
        options,
        kv_cache_config,
        model=model,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        attention_backend=attention.backend.name,
    )
    # 7. the scheduler's limits, and the whole frozen.
    config = PagedKVConfig(
        model_config=ModelRunConfig(
            model=model,
            dtype=dtype,
            quantization=quantization,
            max_model_len=max_model_len,
            seed=options.seed,
            max_logprobs=options.max_logprobs,
            batch_invariant=options.batch_invariant,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            num_gpu_blocks=kv_cache_config.num_blocks,
            cache_dtype=kv_cache_dtype,
            enable_prefix_caching=options.enable_prefix_caching,
            prefix_caching_hash_algo=options.hash_algo,
            hash_seed=hash_seed,
            enable_kv_cache_events=options.enable_kv_cache_events,
            kv_offloading_backend=options.kv_offloading_backend if tier_blocks else None,
            kv_offloading_blocks=tier_blocks,
            kv_offloading_dir=options.kv_offloading_dir,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=options.enable_chunked_prefill,
            policy=options.policy,
            preemption_mode=options.preemption_mode,
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, num_threads=num_threads),
        speculative_config=speculative,
    )
    return ResolvedEngineConfig(
        config=config,
        options=options,
        kv_cache_config=kv_cache_config,
        attention=attention,
        cpu_capabilities=caps,
        loaded_model=loaded_model,
        tier_keys=tuple(tier_keys),
    )


def _check_batch_invariant_model(model_shape) -> None:
    """Refuse a model (or draft model; None: none) ``batch_invariant`` does not run, from its
    shape (before its weights).

    Raises:
        ConfigError: a Gemma model (its decoder layers run as torch ops, whose reductions
            depend on the step's size).
    """
    from pagedkv.model.config import GEMMA_ARCHITECTURES

    if model_shape is not None and model_shape.architecture in GEMMA_ARCHITECTURES:
        raise ConfigError(
            f"batch_invariant runs the Llama-family decoders (llama, mistral, qwen2, qwen3, "
            f"phi3), not {model_shape.architecture}"
        )


def _read_model_shape(options: EngineConfig, dtype: str, loaded_model, model_loader):
    """``(model shape, loaded model or None, model path, dtype)``: from a loaded model, the
    model file's header (no weight read), or rank 0's ``model_loader`` (an in-memory model: one
    process keeps it); the dtype becomes the model's when the model is given. A short name or
    Hugging Face id is resolved to its file or folder once, here (the KV tier records it)."""
    if loaded_model is not None:
        model = options.model if options.model is not None else loaded_model.source
        return loaded_model.config, loaded_model, model, _dtype_name(loaded_model)
    if model_loader is None:
        from pagedkv.model.loader import load_model_config, resolve_model_path

        model = str(resolve_model_path(options.model))
        return load_model_config(model), None, model, dtype
    from pagedkv.model.parallel import TensorParallelGroup

    tp = options.tensor_parallel_size
    probe = model_loader(parallel=None if tp == 1 else TensorParallelGroup(0, tp))
    model = options.model if options.model is not None else probe.source
    return probe.config, probe if tp == 1 else None, model, _dtype_name(probe)


def _dtype_name(loaded_model) -> str:
    return str(loaded_model.model.dtype).removeprefix("torch.")


def _read_draft_model_shape(options: EngineConfig, draft_model):
    """``(draft model shape or None, speculative config)``: speculative decoding's draft model,
    read from ``draft_model`` (loaded) or its file's header (no weight read); the config's
    ``model`` becomes the resolved file or folder (the executor loads it, or reuses the model
    when it is the same).

    Raises:
        ConfigError: ``draft_model`` without a speculative_config of method "draft_model".
        ModelLoadError: the draft model cannot be found or read.
    """
    speculative = options.speculative_config
    if speculative is None or not speculative.uses_draft_model:
        if draft_model is not None:
            raise ConfigError("draft_model is for a speculative_config of method 'draft_model'")
        return None, speculative
    if draft_model is not None:
        return draft_model.config, speculative
    from pagedkv.model.loader import load_model_config, resolve_model_path

    try:
        model = str(resolve_model_path(speculative.model))
        shape = load_model_config(model)
    except ModelLoadError as e:
        raise ModelLoadError(f"speculative_config: the draft model: {e}") from None
    return shape, dataclasses.replace(speculative, model=model)


def _size_kv_cache(
    options: EngineConfig, model_shape, draft_shape, block_size: int, kv_cache_dtype: str
) -> KVCacheConfig:
    """The KV cache's blocks and max_model_len (:func:`~pagedkv.engine.kv_sizing.
    size_kv_cache`), with the draft model's layers when speculative decoding has one.

    Raises:
        ConfigError: as ``size_kv_cache``; a draft model whose layers' pages differ in size
            from the model's (they could not share the pool).
    """
    try:
        kv_cache_config = size_kv_cache(
            model_shape,
            options,
            block_size=block_size,
            kv_dtype=kv_cache_dtype,
            draft_model_config=draft_shape,
        )
    except ConfigError as e:
        if draft_shape is None:
            raise
        raise ConfigError(
            f"speculative_config: the draft model's KV cannot share the model's block pool: "
            f"{e} (a draft model is a smaller model of the same family: the same tokenizer "
            "and KV pages of the same size)"
        ) from None
    logger.info(
        "KV cache: %d blocks x %d tokens (%.0f MiB, %s), max_model_len %d",
        kv_cache_config.num_usable_blocks,
        block_size,
        kv_cache_config.kv_cache_memory / 2**20,
        kv_cache_dtype,
        kv_cache_config.max_model_len,
    )
    return kv_cache_config


def _open_kv_tier(
    options: EngineConfig,
    kv_cache_config: KVCacheConfig,
    *,
    model: str | None,
    dtype: str,
    kv_cache_dtype: str,
    attention_backend: str,
) -> tuple[int, list[str], int | str | bytes | None]:
    """``(tier blocks, keys a disk tier holds from an earlier run, block-hash seed)``;
    ``(0, [], options.hash_seed)`` without a tier. A disk tier's seed wins (the hashes must
    agree with the process that wrote its entries).

    Raises:
        ConfigError: a tier too small for one block; a disk tier's directory that cannot be
            written.
    """
    if options.kv_offloading_size is None:
        return 0, [], options.hash_seed
    tier_blocks = options.kv_offloading_size // kv_cache_config.bytes_per_block
    if tier_blocks < 1:
        raise ConfigError(
            f"kv_offloading_size ({options.kv_offloading_size} bytes) holds no KV block "
            f"({kv_cache_config.bytes_per_block} bytes each)"
        )
    tier_keys: list[str] = []
    hash_seed = options.hash_seed
    if options.kv_offloading_backend == "disk":
        identity = tier_identity(
            model=model,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            attention_backend=attention_backend,
            block_size=kv_cache_config.block_size,
            hash_algo=options.hash_algo,
            kv_cache_groups=[
                {"layer_ids": list(g.layer_ids), "spec": repr(g.kv_cache_spec)}
                for g in kv_cache_config.kv_cache_groups
            ],
        )
        hash_seed, tier_keys = open_disk_tier(options.kv_offloading_dir, identity, hash_seed)
    logger.info(
        "KV tier: %s, %d blocks (%.0f MiB)",
        options.kv_offloading_backend,
        tier_blocks,
        tier_blocks * kv_cache_config.bytes_per_block / 2**20,
    )
    return tier_blocks, tier_keys, hash_seed
