"""KV-cache sizing: how many blocks fit in a memory budget, and how layers share them.

(The core's KV cache shape; the options as typed are :mod:`pagedkv.engine.config`, the resolved
engine config :mod:`pagedkv.config`, the model's architecture :mod:`pagedkv.model.config`. The
block size lives in the specs here, set from ``CacheConfig.block_size``.)

Start-up sizing (the engine, ``pagedkv plan``) and run-time admission (the manager) both read page
sizes and per-request block counts from the layer specs in :mod:`pagedkv.core.spec`; this module
only adds the memory arithmetic and the grouping of layers into KV cache groups.

Memory budget (vLLM V1 ``determine_available_memory`` in spirit, with the profiled numbers
replaced by given or estimated ones)::

    kv_cache_memory = gpu_memory_utilization x device_memory
                      - weights - peak activations - other overhead

KV cache groups (vLLM V1 ``kv_cache_utils``: layers of one spec form groups of equal size)::

    Gemma-2-9B: 42 layers, 21 sliding-window (s) and 21 full (f), group_size = 21

    layer        0   1   2   3   4  ...  40  41
    spec         s   f   s   f   s  ...   s   f
    group        0   1   0   1   0  ...   0   1        group 0 = sliding, group 1 = full
    tensor       0   0   1   1   2  ...  20  20        tensor t holds layer t of every group

    tensor t: [2, num_blocks, block_size, num_kv_heads, head_size]   (t = 0 .. group_size - 1)

One block id names one page in each of the ``group_size`` tensors. A block belongs to one group
at a time (the pool hands it out to one group's manager), so the groups never write the same
page, and one block id costs ``page_size x group_size`` bytes. A uniform model is the special
case of one group holding every layer: ``num_blocks = floor(kv_cache_memory / (page_size x
num_layers))``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.core.spec import KVCacheSpec, max_num_blocks_per_request
from pagedkv.errors import CacheSizingError, ConfigError
from pagedkv.units import format_bytes
from pagedkv.validation import check_int

#: A type with more layers than this times the smallest type's count is padded up to its own
#: count instead of being cut into groups of the smallest size (vLLM: 12 sw + 13 full -> 13 + 13).
_PAD_TO_LARGEST_RATIO = 1.25


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """The device memory that is left for the KV cache once everything else has its share.

    Args:
        device_memory: total memory of one device, bytes.
        gpu_memory_utilization: fraction of ``device_memory`` pagedkv may use, in (0, 1].
        weight_bytes: model weights held by one device, bytes.
        activation_bytes: peak activations of one forward pass at max_num_batched_tokens, bytes.
        overhead_bytes: everything else (CUDA context, CUDA graphs, communication buffers), bytes.

    Raises:
        ConfigError: a negative size or a utilization outside (0, 1].
    """

    device_memory: int
    gpu_memory_utilization: float = 0.9
    weight_bytes: int = 0
    activation_bytes: int = 0
    overhead_bytes: int = 0

    def __post_init__(self) -> None:
        check_int("device_memory", self.device_memory, 1)
        for name in ("weight_bytes", "activation_bytes", "overhead_bytes"):
            check_int(name, getattr(self, name), 0)
        utilization = self.gpu_memory_utilization
        if not isinstance(utilization, (int, float)) or not 0.0 < utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")

    @property
    def usable_memory(self) -> int:
        """``gpu_memory_utilization x device_memory``, bytes (rounded down)."""
        return int(self.gpu_memory_utilization * self.device_memory)

    @property
    def kv_cache_memory(self) -> int:
        """Bytes left for the KV cache; negative when the rest does not even fit."""
        return self.usable_memory - self.weight_bytes - self.activation_bytes - self.overhead_bytes

    def describe(self) -> str:
        """One line with the arithmetic, for error messages."""
        return (
            f"{self.gpu_memory_utilization:g} x {format_bytes(self.device_memory)} - weights "
            f"{format_bytes(self.weight_bytes)} - activations "
            f"{format_bytes(self.activation_bytes)} - overhead {format_bytes(self.overhead_bytes)}"
            f" = {format_bytes(self.kv_cache_memory)}"
        )


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """One KV cache group: layers with one spec that share one block table per request.

    Args:
        layer_ids: model layer indices in this group, in order; ``layer_ids[t]`` uses tensor
            ``t``. May be shorter than the group size (the rest is padding).
        kv_cache_spec: the spec every layer of the group has.
    """

    layer_ids: tuple[int, ...]
    kv_cache_spec: KVCacheSpec


def group_layers(
    layer_specs: Sequence[KVCacheSpec],
) -> tuple[tuple[KVCacheGroupSpec, ...], int]:
    """Group layers into KV cache groups of equal size that share one block pool.

    Layers with equal specs form one type. With a single type, one group holds every layer.
    Otherwise the group size is the smallest type's layer count (or the largest's, when the
    counts differ by under 25 %), each type is cut into groups of that size in layer order, and
    a short last group is padded. Idea from vLLM V1 ``_get_kv_cache_groups_uniform_page_size``.

    Args:
        layer_specs: one spec per attention layer, in layer order.

    Returns:
        (groups, group_size): groups in order of each type's first layer; ``group_size`` is the
        number of tensors, hence the layers' pages one block id covers.

    Raises:
        ConfigError: no layers, or types whose page sizes differ (they could not share a pool).
    """
    if not layer_specs:
        raise ConfigError("a model needs at least one attention layer to size a KV cache")
    layers_by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer_id, spec in enumerate(layer_specs):
        layers_by_spec.setdefault(spec, []).append(layer_id)
    if len(layers_by_spec) == 1:
        ((spec, layer_ids),) = layers_by_spec.items()
        return (KVCacheGroupSpec(tuple(layer_ids), spec),), len(layer_ids)

    page_sizes = {spec.page_size_bytes for spec in layers_by_spec}
    if len(page_sizes) > 1:
        raise ConfigError(
            "hybrid layers must share one page size to share a block pool; got "
            + ", ".join(f"{type(s).__name__}: {s.page_size_bytes} B" for s in layers_by_spec)
        )
    counts = [len(ids) for ids in layers_by_spec.values()]
    group_size = min(counts)
    if max(counts) < _PAD_TO_LARGEST_RATIO * group_size:
        group_size = max(counts)
    groups = tuple(
        KVCacheGroupSpec(tuple(layer_ids[start : start + group_size]), spec)
        for spec, layer_ids in layers_by_spec.items()
        for start in range(0, len(layer_ids), group_size)
    )
    return groups, group_size


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The KV cache's shape: a block count, the groups that share it, and what that allows.

    Build with :meth:`from_memory_budget`, :meth:`from_kv_cache_memory` or
    :meth:`from_num_blocks`; the engine then does
    ``KVCacheManager(cfg.num_blocks, cfg.kv_cache_specs)`` and allocates ``cfg.group_size``
    tensors of ``[2, num_blocks, block_size, num_kv_heads, head_size]``, layer ``i`` using
    tensor ``cfg.tensor_ids[i]``.

    Args:
        num_blocks: blocks in the pool, including block 0, the null block.
        kv_cache_groups: one group per block table.
        group_size: tensors, hence layer pages per block id.
        max_model_len: longest request (tokens) the config was checked for, or None.
        max_num_batched_tokens: most tokens one step computes (bounds a sliding-window
            request's live blocks); None = max_model_len (the worst case).
    """

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    group_size: int
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_num_blocks(
        cls,
        layer_specs: Sequence[KVCacheSpec],
        num_blocks: int,
        *,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> KVCacheConfig:
        """A config with an explicit block count.

        Args:
            layer_specs: one spec per attention layer, in layer order.
            num_blocks: blocks in the pool including the null block (>= 2).
            max_model_len: if given, checked: one request of this many tokens must fit.
            max_num_batched_tokens: tokens per step, for sliding-window layers; None = the
                request length (the worst case).

        Raises:
            CacheSizingError: fewer than 2 blocks, or max_model_len does not fit even once (the
                message says the largest max_model_len that fits).
            ConfigError: invalid specs or lengths.
        """
        groups, group_size = group_layers(layer_specs)
        config = cls(num_blocks, groups, group_size, max_model_len, max_num_batched_tokens)
        config._validate(budget=None)
        return config

    @classmethod
    def from_kv_cache_memory(
        cls,
        layer_specs: Sequence[KVCacheSpec],
        kv_cache_memory: int,
        *,
        num_blocks: int | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> KVCacheConfig:
        """A config from the bytes given to the KV cache alone (all layers together).

        ``num_blocks = floor(kv_cache_memory / (page_size x group_size))``; an explicit
        ``num_blocks`` wins. Other arguments and errors as :meth:`from_num_blocks`.
        """
        check_int("kv_cache_memory", kv_cache_memory, why="bytes")
        return cls._from_bytes(
            layer_specs, kv_cache_memory, None, num_blocks, max_model_len, max_num_batched_tokens
        )

    @classmethod
    def from_memory_budget(
        cls,
        layer_specs: Sequence[KVCacheSpec],
        budget: MemoryBudget,
        *,
        num_blocks: int | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> KVCacheConfig:
        """A config from a device's memory budget (see :class:`MemoryBudget`).

        Example: 0.9 x 80 GiB - 15 - 2 - 0.5 - 0.7 GiB = 53.8 GiB; 32 layers of
        (block 16, 8 KV heads, head 128, bf16) = 2 MiB a block -> 27,545 blocks.
        Other arguments and errors as :meth:`from_num_blocks`; error messages show the budget.
        """
        return cls._from_bytes(
            layer_specs,
            budget.kv_cache_memory,
            budget,
            num_blocks,
            max_model_len,
            max_num_batched_tokens,
        )

    @classmethod
    def _from_bytes(
        cls,
        layer_specs: Sequence[KVCacheSpec],
        kv_cache_memory: int,
        budget: MemoryBudget | None,
        num_blocks: int | None,
        max_model_len: int | None,
        max_num_batched_tokens: int | None,
    ) -> KVCacheConfig:
        groups, group_size = group_layers(layer_specs)
        if num_blocks is not None:
            # Explicit blocks: errors name num_blocks, not the memory they did not come from.
            config = cls(num_blocks, groups, group_size, max_model_len, max_num_batched_tokens)
            config._validate(budget=None)
            return config
        bytes_per_block = groups[0].kv_cache_spec.page_size_bytes * group_size
        num_blocks = max(kv_cache_memory, 0) // bytes_per_block
        config = cls(num_blocks, groups, group_size, max_model_len, max_num_batched_tokens)
        config._validate(budget=budget, kv_cache_memory=kv_cache_memory)
        return config

    def _validate(self, budget: MemoryBudget | None, kv_cache_memory: int | None = None) -> None:
        check_int("num_blocks", self.num_blocks, 0)
        check_int("max_model_len", self.max_model_len, 1, optional=True)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        if self.num_usable_blocks < 1:
            if budget is not None:
                source = f"memory budget {budget.describe()}"
            elif kv_cache_memory is not None:
                source = f"kv_cache_memory {format_bytes(kv_cache_memory)}"
            else:
                raise CacheSizingError(
                    f"num_blocks is {self.num_blocks}; the KV cache needs at least 2 (block 0 is "
                    "the null block)"
                )
            message = (
                f"the KV cache gets {self.num_blocks} blocks of "
                f"{format_bytes(self.bytes_per_block)} from {source}; it needs at least 2 (block 0 "
                "is the null block)"
            )
            if budget is not None:
                # The budget's own terms; callers sized by kv_cache_memory add their own advice.
                message += (
                    ": free memory (smaller weights, activations or overhead, or more devices "
                    "with tensor parallelism), raise gpu_memory_utilization, or use a smaller "
                    "KV-cache dtype"
                )
            raise CacheSizingError(message)
        if self.max_model_len is not None and self.max_concurrency() < 1:
            raise CacheSizingError(
                f"max_model_len {self.max_model_len} needs "
                f"{self.max_num_blocks_per_request()} blocks but the KV cache has "
                f"{self.num_usable_blocks} ({self.num_blocks} - the null block); the largest "
                f"max_model_len that fits is {self.largest_max_model_len()} tokens"
            )

    # ---- shape --------------------------------------------------------------------------
    @property
    def kv_cache_specs(self) -> tuple[KVCacheSpec, ...]:
        """One spec per KV cache group, in group order (what KVCacheManager takes)."""
        return tuple(group.kv_cache_spec for group in self.kv_cache_groups)

    @property
    def num_layers(self) -> int:
        """Attention layers across all groups (padding excluded)."""
        return sum(len(group.layer_ids) for group in self.kv_cache_groups)

    @property
    def num_padding_layers(self) -> int:
        """Layer slots reserved in every block but used by no layer (short last groups)."""
        return len(self.kv_cache_groups) * self.group_size - self.num_layers

    @property
    def tensor_ids(self) -> tuple[int, ...]:
        """For each layer (by layer index), the tensor that holds its pages."""
        tensor_ids = [0] * self.num_layers
        for group in self.kv_cache_groups:
            for tensor_id, layer_id in enumerate(group.layer_ids):
                tensor_ids[layer_id] = tensor_id
        return tuple(tensor_ids)

    @property
    def block_size(self) -> int:
        """Tokens per block of the first group (pagedkv groups share one block size)."""
        return self.kv_cache_groups[0].kv_cache_spec.block_size

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (equal across groups)."""
        return self.kv_cache_groups[0].kv_cache_spec.page_size_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs: one page in each of ``group_size`` tensors."""
        return self.page_size_bytes * self.group_size

    @property
    def kv_cache_memory(self) -> int:
        """Bytes the KV cache tensors take: ``num_blocks x bytes_per_block``."""
        return self.num_blocks * self.bytes_per_block

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token across every layer."""
        return sum(
            group.kv_cache_spec.bytes_per_token * len(group.layer_ids)
            for group in self.kv_cache_groups
        )

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_kv_tokens(self) -> int:
        """Tokens the pool holds when every group stores every token (vLLM's "KV cache size")."""
        blocks_per_group = self.num_usable_blocks // len(self.kv_cache_groups)
        return blocks_per_group * self.block_size

    # ---- capacity -----------------------------------------------------------------------
    def max_num_blocks_per_request(
        self, max_model_len: int | None = None, max_num_batched_tokens: int | None = None
    ) -> int:
        """Most blocks one request of ``max_model_len`` tokens holds at once, all groups
        (:func:`pagedkv.core.spec.max_num_blocks_per_request` with the config's defaults).

        Args:
            max_model_len: tokens; default the config's.
            max_num_batched_tokens: tokens per step; default the config's, else max_model_len.

        Raises:
            ConfigError: no max_model_len given or configured.
        """
        num_tokens = self.max_model_len if max_model_len is None else max_model_len
        if num_tokens is None:
            raise ConfigError("max_model_len is needed to count a request's blocks")
        batched = max_num_batched_tokens or self.max_num_batched_tokens
        return max_num_blocks_per_request(self.kv_cache_specs, num_tokens, batched)

    def max_concurrency(
        self, max_model_len: int | None = None, max_num_batched_tokens: int | None = None
    ) -> int:
        """Requests of ``max_model_len`` tokens that fit in the pool at once (may be 0).

        Sliding-window groups count only the blocks a request keeps inside its window (the
        spec's ``max_num_blocks_per_request``). Arguments as :meth:`max_num_blocks_per_request`.
        """
        blocks = self.max_num_blocks_per_request(max_model_len, max_num_batched_tokens)
        return self.num_usable_blocks // blocks

    def largest_max_model_len(self, max_num_batched_tokens: int | None = None) -> int:
        """The longest request (tokens) that fits in the pool once; 0 when none does.

        Searches lengths up to ``num_usable_blocks x block_size`` (or up to the configured
        max_model_len when that is larger; sliding-window-only models can exceed it).
        """
        upper = max(self.num_usable_blocks * self.block_size, self.max_model_len or 0)
        low, high = 0, upper  # invariant: low fits (0 trivially), answer <= high
        while low < high:
            mid = (low + high + 1) // 2
            if self.max_num_blocks_per_request(mid, max_num_batched_tokens) <= (
                self.num_usable_blocks
            ):
                low = mid
            else:
                high = mid - 1
        return low
