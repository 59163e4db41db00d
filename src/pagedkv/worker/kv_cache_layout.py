"""How a runner lays the KV cache config's layers onto cache tensors and attention metadata.

One cache tensor per ``KVCacheConfig.tensor_ids`` entry (layers of different KV cache groups
share a tensor: their block ids differ), and the distinct (KV cache group, layer spec) pairs
the layers read, one attention metadata built per pair each step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pagedkv.core.config import KVCacheConfig
from pagedkv.core.spec import SlidingWindowSpec
from pagedkv.errors import CacheSizingError, ConfigError, HostMemoryError
from pagedkv.model.loader import available_memory
from pagedkv.ops.backends import AttentionBackend, AttentionLayerSpec
from pagedkv.ops.backends.base import resolve_kv_dtype
from pagedkv.units import format_bytes


def allocate_kv_caches(
    backend: AttentionBackend,
    kv_cache_config: KVCacheConfig,
    layer_specs: Sequence[AttentionLayerSpec],
) -> list[torch.Tensor]:
    """One cache tensor per ``kv_cache_config.tensor_ids`` entry, allocated by the backend for
    the spec of the first layer that uses it, and each layer's tensor.

    Raises:
        ConfigError: layers sharing a tensor whose caches would differ in shape or dtype.
        CacheSizingError: CPU caches larger than the memory available
            (:func:`check_kv_host_memory`), or caches the system would not map.
    """
    tensor_specs: dict[int, AttentionLayerSpec] = {}
    for layer, t in enumerate(kv_cache_config.tensor_ids):
        spec = layer_specs[layer]
        first = tensor_specs.setdefault(t, spec)
        shape = (spec.num_kv_heads, spec.head_size, spec.block_size, spec.kv_cache_dtype)
        if shape != (first.num_kv_heads, first.head_size, first.block_size, first.kv_cache_dtype):
            raise ConfigError(f"layer {layer} cannot share KV cache tensor {t}: {spec} vs {first}")
    if backend.device.type == "cpu":
        _check_host_memory(backend, kv_cache_config.num_blocks, list(tensor_specs.values()))
    try:
        tensors = {
            t: backend.allocate_kv_cache(kv_cache_config.num_blocks, spec)
            for t, spec in tensor_specs.items()
        }
    except HostMemoryError as e:
        raise CacheSizingError(
            f"the KV cache of {kv_cache_config.num_blocks - 1} blocks cannot be mapped ({e}); "
            "lower --num-blocks or --kv-cache-memory"
        ) from e
    return [tensors[t] for t in kv_cache_config.tensor_ids]


def _check_host_memory(
    backend: AttentionBackend, num_blocks: int, specs: list[AttentionLayerSpec]
) -> None:
    """:func:`check_kv_host_memory` for the caches of ``specs`` on ``backend``."""
    needed = 0
    for spec in specs:
        shape = backend.kv_cache_shape(
            num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
        )
        needed += math.prod(shape) * resolve_kv_dtype(spec.kv_cache_dtype).itemsize
    check_kv_host_memory(num_blocks, needed)


def check_kv_host_memory(num_blocks: int, num_bytes: int) -> None:
    """Refuse CPU KV caches of ``num_bytes`` larger than the memory this process may still take.

    A CPU cache is mapped, not written, at start-up (:mod:`pagedkv.ops.host_memory`): its
    memory is taken as blocks are first written, so a cache the machine cannot hold would
    otherwise fail only when it fills, mid-serving. The engine checks once its size is known
    (before the block pool and the weights) and the runner again when it lays the caches out
    (after the weights took their memory).

    Args:
        num_blocks: blocks in the pool, the null block included.
        num_bytes: the caches' bytes, every layer.

    Raises:
        CacheSizingError: ``num_bytes`` over :func:`~pagedkv.model.loader.available_memory`
            (both numbers in the message).
    """
    available = available_memory()
    if available is not None and num_bytes > available:
        raise CacheSizingError(
            f"the KV cache of {num_blocks - 1} blocks (and the null block) needs "
            f"{format_bytes(num_bytes)} but only {format_bytes(available)} of memory is "
            "available; lower --num-blocks or --kv-cache-memory"
        )


def attention_groups(
    kv_cache_config: KVCacheConfig, layer_specs: Sequence[AttentionLayerSpec]
) -> tuple[list[tuple[int, AttentionLayerSpec]], list[int]]:
    """The distinct (KV cache group, layer spec) pairs the layers read and each layer's index
    into them. A layer reads its group's block table with its own window: a sliding-window
    group's layers have its window; a full-attention group may hold sliding-window layers too
    (``disable_hybrid_kv_cache_manager``: every block kept, the window still applied).

    Raises:
        ConfigError: see :class:`~pagedkv.worker.model_runner.ModelRunner`.
    """
    if kv_cache_config.num_layers != len(layer_specs):
        raise ConfigError(
            f"the KV cache config has {kv_cache_config.num_layers} layers, the model "
            f"{len(layer_specs)}"
        )
    pairs: list[tuple[int, AttentionLayerSpec]] = []
    layer_pairs = [0] * len(layer_specs)
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        for layer in group.layer_ids[:1]:  # the layers of a group share one cache dtype
            stored = layer_specs[layer].kv_cache_dtype
            if spec.dtype_bytes != stored.itemsize:
                raise ConfigError(
                    f"KV cache group {g} was sized for {spec.dtype} ({spec.dtype_bytes} bytes "
                    f"per element), its layers store {stored} ({stored.itemsize}): pass the "
                    "runner the cache's kv_cache_dtype"
                )
        for layer in group.layer_ids:
            window = layer_specs[layer].sliding_window
            if isinstance(spec, SlidingWindowSpec) and window != spec.sliding_window:
                reach = "every token" if window is None else f"the last {window} tokens"
                raise ConfigError(
                    f"layer {layer} attends to {reach} but its KV cache group keeps only a "
                    f"sliding window of {spec.sliding_window}"
                )
            pair = (g, layer_specs[layer])
            if pair not in pairs:
                pairs.append(pair)
            layer_pairs[layer] = pairs.index(pair)
    return pairs, layer_pairs
