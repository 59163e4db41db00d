"""KV-cache specs: what one attention layer needs per block, the single source of truth for both
start-up sizing (bytes per block) and run-time admission (blocks per request).

A page (one block of one layer) holds K and V for ``block_size`` tokens::

    page = [2 (K, V)] x [block_size tokens] x [num_kv_heads] x [head_size] x dtype_bytes

or, for multi-head latent attention (:class:`MLAAttentionSpec`), one latent per token::

    page = [block_size tokens] x [kv_lora_rank + qk_rope_head_dim] x dtype_bytes

Idea from vLLM V1 (``vllm/v1/kv_cache_interface.py``): one spec type per attention type.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType

from pagedkv.errors import ConfigError
from pagedkv.validation import check_int

#: Bytes per element of each KV-cache dtype. fp8 (e4m3 or e5m2) is one byte, half of bf16.
KV_DTYPE_BYTES = MappingProxyType(
    {
        "float32": 4,
        "bfloat16": 2,
        "float16": 2,
        "fp8": 1,
        "fp8_e4m3": 1,
        "fp8_e5m2": 1,
    }
)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: the number of ``b``-sized blocks covering ``a``."""
    return -(-a // b)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionSpec:
    """Shape of one attention layer's KV cache.

    Args:
        block_size: tokens per block (>= 1).
        num_kv_heads: KV heads held by this device (after tensor parallelism), >= 1.
        head_size: elements per head, >= 1.
        dtype: KV-cache dtype name, one of :data:`KV_DTYPE_BYTES`.

    Raises:
        ConfigError: a value out of range or an unknown dtype.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size"):
            check_int(name, getattr(self, name), 1)
        if self.dtype not in KV_DTYPE_BYTES:
            raise ConfigError(
                f"unknown KV-cache dtype {self.dtype!r}; choose one of {', '.join(KV_DTYPE_BYTES)}"
            )

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the KV-cache dtype."""
        return KV_DTYPE_BYTES[self.dtype]

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer, K and V: 2 x block_size x num_kv_heads x head_size x
        dtype_bytes."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token of one layer."""
        return 2 * self.num_kv_heads * self.head_size * self.dtype_bytes

    def max_num_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Most blocks one request of ``max_model_len`` tokens can hold at once in this layer."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full (causal) attention: a request keeps every block of its sequence."""

    def max_num_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: each token attends to itself and the ``sliding_window - 1``
    tokens before it (Mistral / Gemma-2 convention), so older blocks can be freed.

    Args:
        sliding_window: window in tokens, >= 1.
    """

    sliding_window: int

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        check_int("sliding_window", self.sliding_window, 1)

    def max_num_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # A step computes up to max_num_batched_tokens new tokens whose windows reach back
        # sliding_window - 1 tokens; +1 block because the live span need not start on a boundary.
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return min(cdiv(num_tokens, self.block_size) + 1, cdiv(max_model_len, self.block_size))


@dataclass(frozen=True, slots=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): each token caches one compressed latent of
    ``kv_lora_rank`` values plus the ``qk_rope_head_dim`` rotary part, shared by every head, instead
    of K and V per head. The attention layer up-projects the latent to per-head K and V.

    ``head_size`` = kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V2/V3) and
    ``num_kv_heads`` = 1; a page holds ``block_size x head_size x dtype_bytes`` (no factor 2: the
    latent stands for both K and V). Every tensor-parallel device keeps the whole latent (it is not
    split over heads). A request keeps every block, as full attention does. Idea and sizes as
    vLLM's ``MLAAttentionSpec`` (``vllm/v1/kv_cache_interface.py``).

    Raises:
        ConfigError: as :class:`AttentionSpec`, or ``num_kv_heads`` other than 1.
    """

    num_kv_heads: int = 1

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        if self.num_kv_heads != 1:
            raise ConfigError(
                f"an MLA layer caches one latent per token (num_kv_heads 1), "
                f"got {self.num_kv_heads}"
            )

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: block_size x head_size x dtype_bytes (one latent)."""
        return self.block_size * self.head_size * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes of the latent and rope part of one token in one layer."""
        return self.head_size * self.dtype_bytes


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLAAttentionSpec


def max_num_blocks_per_request(
    kv_cache_specs: Iterable[KVCacheSpec],
    num_tokens: int,
    max_num_batched_tokens: int | None = None,
) -> int:
    """Most blocks one request of ``num_tokens`` tokens holds at once, summed over the KV cache
    groups (one spec each). The one place this is counted: start-up sizing
    (``KVCacheConfig``), admission (the scheduler rejects a request above ``num_blocks - 1``)
    and the manager all call it.

    Args:
        kv_cache_specs: one spec per KV cache group.
        num_tokens: the request's prompt + output tokens.
        max_num_batched_tokens: most tokens one step computes (a sliding-window request's live
            span); ``None``: ``num_tokens`` (all in one step, the worst case).
    """
    batched = num_tokens if max_num_batched_tokens is None else max_num_batched_tokens
    return sum(spec.max_num_blocks_per_request(num_tokens, batched) for spec in kv_cache_specs)


def unify_kv_cache_specs(layer_specs: Iterable[KVCacheSpec]) -> list[KVCacheSpec]:
    """The layer specs with every sliding-window layer held as full attention (same page shape):
    one KV cache group for the whole model, no block leaves the pool while a request runs. The
    layers still attend only to their window; only the cache keeps every block. What vLLM does
    with ``--disable-hybrid-kv-cache-manager`` (``unify_hybrid_kv_cache_specs``); pagedkv uses it
    to measure what the sliding-window groups save.
    """
    unified: list[KVCacheSpec] = []
    for spec in layer_specs:
        if isinstance(spec, SlidingWindowSpec):
            spec = FullAttentionSpec(
                block_size=spec.block_size,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                dtype=spec.dtype,
            )
        unified.append(spec)
    return unified
