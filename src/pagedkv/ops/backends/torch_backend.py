"""The ``torch`` attention backend: pagedkv's own pure-torch paths, available everywhere.

Cache layout ``[2, num_blocks, num_kv_heads, block_size, head_size]``
(:mod:`pagedkv.ops.backends.hnd_layout`), any block size, any head size, float32 / bfloat16 /
float16 and fp8 caches. Its paths are its own (the private package ``_torch``, imported by no other
module of pagedkv: ``.importlinter``):

- ``impl="cpu"``, the fast path (``_torch/cpu_attention.py``, ``_torch/gather_plan.py``: chunked
  block gathers, grouped bmm-softmax-embedding_bag for decodes, SDPA per prefill);
- ``impl="reference"``, the plain per-request path the others are tested against
  (``_torch/reference.py``);
- its write (``_torch/write.py``) and per-step index work (``_torch/metadata.py``).

Both paths run on any torch device (the fast path is tuned for CPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.errors import OpsInputError
from pagedkv.ops.backends._torch.cpu_attention import cpu_paged_attention
from pagedkv.ops.backends._torch.metadata import PagedAttentionMetadata
from pagedkv.ops.backends._torch.reference import reference_paged_attention
from pagedkv.ops.backends._torch.write import write_kv_torch
from pagedkv.ops.backends.base import AttentionLayerSpec, CommonAttentionMetadata
from pagedkv.ops.backends.hnd_layout import HNDLayoutBackend
from pagedkv.validation import check_int

#: Block size of the torch backend's fastest decode on the machines measured (docs/ops.md).
TORCH_DEFAULT_BLOCK_SIZE = 16


@dataclass(slots=True)
class TorchAttentionMetadata:
    """The torch backend's per-step metadata for one layer spec.

    Attributes:
        spec: the layers it serves.
        slot_mapping: ``[num_tokens]`` int64.
        paged: the index work of the step (:class:`PagedAttentionMetadata`; it caches the fast
            path's gather plan and scratch buffers for the step's layers).
    """

    spec: AttentionLayerSpec
    slot_mapping: torch.Tensor
    paged: PagedAttentionMetadata

    @property
    def num_tokens(self) -> int:
        return self.paged.num_tokens


class TorchBackend(HNDLayoutBackend):
    """pagedkv's pure-torch paged attention (see module docs).

    Args:
        device: where caches and metadata live.
        impl: ``"cpu"`` (fast path) or ``"reference"``.
        decode_chunk_bytes: gathered bytes per decode chunk, >= 1 (keys; keys and values for
            fp8 caches); None = the default of :meth:`PagedAttentionMetadata.build`.

    Raises:
        OpsInputError: an unknown ``impl``, or ``decode_chunk_bytes < 1``.
    """

    name = "torch"

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        impl: str = "cpu",
        decode_chunk_bytes: int | None = None,
    ) -> None:
        if impl not in ("cpu", "reference"):
            raise OpsInputError(f"impl must be 'cpu' or 'reference', got {impl!r}")
        check_int("decode_chunk_bytes", decode_chunk_bytes, 1, optional=True, error=OpsInputError)
        super().__init__(device)
        self.impl = impl
        self.decode_chunk_bytes = decode_chunk_bytes

    @classmethod
    def unavailable_reason(cls, device: torch.device | str) -> str | None:
        return None

    def default_block_size(self, head_size, dtype, kv_cache_dtype=None) -> int:
        return TORCH_DEFAULT_BLOCK_SIZE

    def build_metadata(
        self, common: CommonAttentionMetadata, spec: AttentionLayerSpec, *, validate: bool = True
    ) -> TorchAttentionMetadata:
        if validate:
            common.validate(spec.block_size, spec.sliding_window)
        paged = PagedAttentionMetadata.build(
            common.block_tables,
            common.seq_lens,
            common.query_start_loc,
            spec.block_size,
            sliding_window=spec.sliding_window,
            decode_chunk_bytes=self.decode_chunk_bytes,
        )
        return TorchAttentionMetadata(spec, common.slot_mapping.long(), paged)

    def write_kv(
        self,
        key,
        value,
        kv_cache,
        metadata: TorchAttentionMetadata,
        *,
        k_scale=1.0,
        v_scale=1.0,
        validate=False,
    ) -> None:
        if validate:
            self._check(metadata, kv_cache, key=key, value=value)
        write_kv_torch(
            key, value, kv_cache, metadata.slot_mapping, k_scale=k_scale, v_scale=v_scale
        )

    def forward(
        self,
        query,
        kv_cache,
        metadata: TorchAttentionMetadata,
        *,
        k_scale=1.0,
        v_scale=1.0,
        validate=False,
    ) -> torch.Tensor:
        if validate:
            self._check(metadata, kv_cache, query=query)
        run = cpu_paged_attention if self.impl == "cpu" else reference_paged_attention
        spec = metadata.spec
        return run(
            query,
            kv_cache,
            metadata.paged,
            spec.scale,
            k_scale=k_scale,
            v_scale=v_scale,
            soft_cap=spec.logits_soft_cap,
        )

    def _check(self, metadata: TorchAttentionMetadata, kv_cache, **tensors) -> None:
        self._check_tensors(metadata.spec, metadata.num_tokens, kv_cache, **tensors)
        if metadata.paged.max_block_id >= kv_cache.shape[1]:
            raise OpsInputError(
                f"block_tables refers to block {metadata.paged.max_block_id}, beyond the "
                f"pool's {kv_cache.shape[1]}"
            )
