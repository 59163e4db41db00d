"""Capacity planning: how many requests of a model fit on a device, paged versus contiguous.

    kv_cache_memory = gpu_memory_utilization x device_memory - weights / tp - activations - overhead
    num_blocks      = floor(kv_cache_memory / (page_size x group_size))     (pagedkv.core.config)
    max concurrency = floor((num_blocks - 1) / blocks one max_model_len request holds)
    contiguous      = floor(num_blocks x bytes_per_block / (max_model_len x bytes_per_token))

A contiguous allocator reserves max_model_len tokens in every layer for every request, so at
max_model_len paging matches it (minus the null block and rounding); the gain shows when requests
are shorter than max_model_len (``mean_len``): paging holds only the blocks a request has filled,
and sliding-window layers only the blocks inside the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.core.config import KVCacheConfig, MemoryBudget
from pagedkv.core.spec import (
    KV_DTYPE_BYTES,
    MLAAttentionSpec,
    SlidingWindowSpec,
    unify_kv_cache_specs,
)
from pagedkv.errors import ConfigError
from pagedkv.modelinfo.shape import WEIGHT_DTYPE_BYTES, ModelShape
from pagedkv.plan.catalog import device_source, resolve_device, resolve_model
from pagedkv.units import format_bytes
from pagedkv.validation import check_int, is_int

#: KV-cache dtypes ``pagedkv plan`` accepts; ``auto`` = the model's weight dtype.
KV_CACHE_DTYPES = ("auto", *KV_DTYPE_BYTES)


def estimate_activation_bytes(
    shape: ModelShape,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    tensor_parallel_size: int = 1,
) -> int:
    """A rough peak-activation estimate for one forward pass, bytes.

    Per batched token: the residual stream and its normed copy, attention input and output
    (4 x hidden_size), and the gated MLP's gate, up and product (3 x the MLP width / tp; for a
    mixture of experts the experts one token runs plus the shared expert), in the weight dtype
    (2 bytes for GGUF); plus fp32 logits for up to ``max_num_seqs`` sampled tokens. Real engines
    profile this; pass a measured number when you have one.
    """
    dtype_bytes = WEIGHT_DTYPE_BYTES.get(shape.dtype, 2)
    per_token = 4 * shape.hidden_size + 3 * shape.mlp_activation_size // tensor_parallel_size
    logits = min(max_num_seqs, max_num_batched_tokens) * shape.vocab_size * 4
    return max_num_batched_tokens * per_token * dtype_bytes + logits


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """What fits: the memory budget, the KV cache config, and concurrency paged vs contiguous.

    Build with :func:`plan_capacity`. Sizes are bytes, lengths tokens, all per device.
    ``weight_source``: ``"estimated"`` (parameters x dtype bytes), ``"given"`` or
    ``"tensor bytes in the file"`` (GGUF).
    """

    model: ModelShape
    device_name: str
    tensor_parallel_size: int
    budget: MemoryBudget
    weight_source: str
    activation_bytes_estimated: bool
    kv_cache_dtype: str
    kv_cache_config: KVCacheConfig
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    mean_len: int | None = None

    @property
    def max_concurrency(self) -> int:
        """Requests of max_model_len that the paged pool holds at once."""
        return self.kv_cache_config.max_concurrency()

    @property
    def contiguous_max_concurrency(self) -> int:
        """Requests a contiguous allocator (max_model_len reserved in every layer) holds in the
        same memory, whatever their real lengths."""
        config = self.kv_cache_config
        return config.kv_cache_memory // (self.max_model_len * config.bytes_per_token)

    @property
    def paged_concurrency_at_mean_len(self) -> int | None:
        """Requests of ``mean_len`` tokens the paged pool holds at once (None without one)."""
        if self.mean_len is None:
            return None
        return self.kv_cache_config.max_concurrency(self.mean_len)

    def to_dict(self) -> dict[str, Any]:
        """Every input and result as plain JSON-ready values (bytes, tokens, counts)."""
        config = self.kv_cache_config
        budget = self.budget
        groups = [
            {
                "type": type(group.kv_cache_spec).__name__,
                "sliding_window": getattr(group.kv_cache_spec, "sliding_window", None),
                "num_layers": len(group.layer_ids),
            }
            for group in config.kv_cache_groups
        ]
        return {
            "model": self.model.name,
            "model_source": self.model.source,
            "num_parameters": self.model.estimate_num_parameters(),
            "attention": self.model.attention_summary,
            "num_experts": self.model.num_experts,
            "num_experts_per_tok": self.model.num_experts_per_tok,
            "num_moe_layers": sum(self.model.moe_layers),
            "max_position_embeddings": self.model.max_position_embeddings,
            "device": self.device_name,
            "device_memory_source": device_source(self.device_name),
            "device_memory_bytes": budget.device_memory,
            "gpu_memory_utilization": budget.gpu_memory_utilization,
            "tensor_parallel_size": self.tensor_parallel_size,
            "weight_bytes": budget.weight_bytes,
            "weight_source": self.weight_source,
            "activation_bytes": budget.activation_bytes,
            "activation_bytes_estimated": self.activation_bytes_estimated,
            "overhead_bytes": budget.overhead_bytes,
            "available_kv_cache_bytes": budget.kv_cache_memory,
            "kv_cache_bytes": config.kv_cache_memory,
            "kv_cache_dtype": self.kv_cache_dtype,
            "block_size": config.block_size,
            "num_kv_heads_per_device": config.kv_cache_specs[0].num_kv_heads,
            "head_size": config.kv_cache_specs[0].head_size,
            "kv_cache_groups": groups,
            "group_size": config.group_size,
            "bytes_per_token": config.bytes_per_token,
            "page_size_bytes": config.page_size_bytes,
            "bytes_per_block": config.bytes_per_block,
            "num_blocks": config.num_blocks,
            "num_kv_tokens": config.num_kv_tokens,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "blocks_per_request_at_max_model_len": config.max_num_blocks_per_request(),
            "max_concurrency": self.max_concurrency,
            "contiguous_max_concurrency": self.contiguous_max_concurrency,
            "mean_len": self.mean_len,
            "paged_concurrency_at_mean_len": self.paged_concurrency_at_mean_len,
        }

    def format_table(self) -> str:
        """A readable two-column table of the plan."""
        config = self.kv_cache_config
        budget = self.budget
        model = self.model
        spec = config.kv_cache_specs[0]
        if self.weight_source == "estimated":
            weights_note = f"estimated: {model.describe_weights()}"
        else:
            weights_note = self.weight_source
        if self.tensor_parallel_size > 1:
            weights_note += f" / tp {self.tensor_parallel_size}"
        activations_note = (
            f"estimated for {self.max_num_batched_tokens:,} batched tokens"
            if self.activation_bytes_estimated
            else "given"
        )
        groups = ", ".join(
            f"{len(g.layer_ids)} x "
            + (
                f"sliding {g.kv_cache_spec.sliding_window}"
                if isinstance(g.kv_cache_spec, SlidingWindowSpec)
                else "MLA"
                if isinstance(g.kv_cache_spec, MLAAttentionSpec)
                else "full"
            )
            for g in config.kv_cache_groups
        )
        if isinstance(spec, MLAAttentionSpec):
            per_device = f"one latent of {spec.head_size} per token, on every device"
        else:
            per_device = f"{spec.num_kv_heads} KV heads x {spec.head_size} per device"
        rows = [
            ("model", f"{model.name} ({model.source})"),
            ("layers", f"{config.num_layers}, {model.attention_summary}; {per_device}"),
        ]
        if model.is_moe:
            rows.append(("experts", model.moe_summary + "; every expert's weights are held"))
        source = device_source(self.device_name)
        rows += [
            (
                "device",
                f"{self.device_name}: {format_bytes(budget.device_memory)}"
                + (f", tp {self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""),
            ),
            *([("memory source", source)] if source else []),
            (
                "usable memory",
                f"{format_bytes(budget.usable_memory)} "
                f"(gpu_memory_utilization {budget.gpu_memory_utilization:g})",
            ),
            ("- weights", f"{format_bytes(budget.weight_bytes)} ({weights_note})"),
            ("- activations", f"{format_bytes(budget.activation_bytes)} ({activations_note})"),
            ("- overhead", format_bytes(budget.overhead_bytes)),
            ("= KV cache memory", format_bytes(budget.kv_cache_memory)),
            (
                "KV cache dtype",
                f"{self.kv_cache_dtype} ({spec.dtype_bytes} byte"
                + ("s)" if spec.dtype_bytes != 1 else ")"),
            ),
            ("block size", f"{config.block_size} tokens"),
            ("KV cache groups", f"{groups}; a block spans {config.group_size} layers"),
            (
                "bytes per token",
                f"{config.bytes_per_token:,} ({format_bytes(config.bytes_per_token)})",
            ),
            (
                "bytes per block",
                f"{config.bytes_per_block:,} ({format_bytes(config.bytes_per_block)})",
            ),
            ("num_blocks", f"{config.num_blocks:,} (incl. the null block)"),
            ("KV tokens", f"{config.num_kv_tokens:,}"),
            ("max_model_len", f"{self.max_model_len:,} tokens"),
            (
                "max concurrency",
                f"{_requests(self.max_concurrency)} at max_model_len "
                f"({config.max_num_blocks_per_request():,} blocks each)",
            ),
            (
                "contiguous",
                f"{_requests(self.contiguous_max_concurrency)} (max_model_len reserved each)",
            ),
        ]
        if self.mean_len is not None:
            rows.append(
                (
                    f"at mean len {self.mean_len:,}",
                    f"paged {_requests(self.paged_concurrency_at_mean_len or 0)} vs contiguous "
                    f"{self.contiguous_max_concurrency:,}",
                )
            )
        width = max(len(label) for label, _ in rows)
        return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _requests(count: int) -> str:
    return f"{count:,} request" + ("" if count == 1 else "s")


def plan_capacity(
    model: ModelShape | str | Path,
    device: str | int,
    *,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    weight_bytes: int | None = None,
    activation_bytes: int | None = None,
    overhead_bytes: int = 0,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    mean_len: int | None = None,
    num_blocks: int | None = None,
    allow_long_max_model_len: bool = False,
    disable_hybrid_kv_cache_manager: bool = False,
) -> CapacityPlan:
    """Plan how many requests of ``model`` fit on one device of ``device``.

    Args:
        model: a ModelShape, a catalog name, a config.json path or a .gguf path.
        device: a catalog device name, a memory size (``"24GiB"``) or bytes.
        kv_cache_dtype: one of :data:`KV_CACHE_DTYPES`; ``auto`` = the model's dtype.
        block_size: tokens per block.
        gpu_memory_utilization: fraction of device memory to use, (0, 1].
        max_model_len: longest request, tokens; default the model's max_position_embeddings.
            Longer than that is refused unless ``allow_long_max_model_len`` (the model was not
            trained for it; vLLM asks for ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``).
        tensor_parallel_size: devices the model is split over (KV heads and weights split;
            fewer KV heads than devices -> one replicated head per device).
        weight_bytes: weights of the whole model, bytes; default parameters x dtype bytes
            (exact for GGUF). Each device holds weight_bytes / tensor_parallel_size.
        activation_bytes: peak activations per device, bytes; default
            :func:`estimate_activation_bytes`.
        overhead_bytes: other memory per device (CUDA context, graphs), bytes.
        max_num_batched_tokens: tokens per step (activations; sliding-window live blocks).
        max_num_seqs: most running requests (logits in the activation estimate).
        mean_len: a typical request length for the paged-vs-contiguous comparison, tokens.
        num_blocks: explicit block count; wins over the memory budget.
        allow_long_max_model_len: plan a max_model_len beyond the model's context anyway.
        disable_hybrid_kv_cache_manager: size sliding-window layers as full attention (one
            group; :func:`~pagedkv.core.spec.unify_kv_cache_specs`), for comparison.

    Raises:
        ConfigError: an unknown model, device or dtype, a value out of range (the message
            lists valid choices), or a max_model_len beyond the model's context.
        ModelConfigError: a model whose weights cannot be counted from its shapes (quantized
            other than fp8, multimodal) and no ``weight_bytes``.
        CacheSizingError: no blocks fit, or max_model_len does not fit even once (the message
            says the largest max_model_len that fits).
        ModelLoadError: a model file that cannot be read.
    """
    shape = model if isinstance(model, ModelShape) else resolve_model(model)
    if is_int(device):
        device_name, device_memory = f"{format_bytes(device)} device", device
    else:
        device_name, device_memory = resolve_device(str(device))
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    resolved_dtype = shape.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    check_int("weight_bytes", weight_bytes, 0, optional=True, why="bytes")
    check_int("activation_bytes", activation_bytes, 0, optional=True, why="bytes")
    check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
    check_int("max_num_seqs", max_num_seqs, 1)
    if max_model_len is None:
        max_model_len = shape.max_position_embeddings
    else:
        check_int("max_model_len", max_model_len, 1)
        if max_model_len > shape.max_position_embeddings and not allow_long_max_model_len:
            raise ConfigError(
                f"max_model_len {max_model_len} is longer than {shape.name}'s context of "
                f"{shape.max_position_embeddings} tokens (max_position_embeddings): the model was "
                "not trained for it; pass --allow-long-max-model-len "
                "(allow_long_max_model_len=True) to plan it anyway"
            )
    check_int("mean_len", mean_len, 1, optional=True)
    if mean_len is not None and isinstance(max_model_len, int) and mean_len > max_model_len:
        raise ConfigError(f"mean_len {mean_len} exceeds max_model_len {max_model_len}")

    # Validates tensor_parallel_size, block_size and the dtype before any arithmetic.
    layer_specs = shape.layer_specs(
        block_size=block_size,
        kv_cache_dtype=resolved_dtype,
        tensor_parallel_size=tensor_parallel_size,
    )
    if disable_hybrid_kv_cache_manager:
        layer_specs = tuple(unify_kv_cache_specs(layer_specs))
    total_weight_bytes = shape.estimate_weight_bytes() if weight_bytes is None else weight_bytes
    if activation_bytes is None:
        activation_bytes_per_device = estimate_activation_bytes(
            shape,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size,
        )
    else:
        activation_bytes_per_device = activation_bytes
    budget = MemoryBudget(
        device_memory=device_memory,
        gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes=-(-total_weight_bytes // tensor_parallel_size),
        activation_bytes=activation_bytes_per_device,
        overhead_bytes=overhead_bytes,
    )
    kv_cache_config = KVCacheConfig.from_memory_budget(
        layer_specs,
        budget,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    return CapacityPlan(
        model=shape,
        device_name=device_name,
        tensor_parallel_size=tensor_parallel_size,
        budget=budget,
        weight_source=(
            "given"
            if weight_bytes is not None
            else "estimated"
            if shape.weight_bytes is None
            else "tensor bytes in the file"
        ),
        activation_bytes_estimated=activation_bytes is None,
        kv_cache_dtype=resolved_dtype,
        kv_cache_config=kv_cache_config,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        mean_len=mean_len,
    )
