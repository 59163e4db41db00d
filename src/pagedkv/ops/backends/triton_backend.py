"""The ``triton`` attention backend: pagedkv's Triton kernels on CUDA.

Same cache layout as the torch backend (``[2, num_blocks, num_kv_heads, block_size, head_size]``;
the kernels read it through its strides), any block size, float32 / bfloat16 / float16 queries
and fp8 caches. Needs the ``gpu`` extra (``pip install 'pagedkv[gpu]'``) and a CUDA device, or
CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported;
for tests only). docs/gpu.md says what was verified where.

The kernels are this backend's own (the private package ``_triton``, imported by no other module
of pagedkv: ``.importlinter``); it imports them, and so ``triton``, only when it first writes or
attends, so that selecting a backend never loads triton.

Block copies (``copy_blocks``, copy-on-write) are torch's ``index_select`` + ``index_copy_`` on
the device, one pair per layer (:class:`~pagedkv.ops.backends.hnd_layout.HNDLayoutBackend`'s):
whole blocks need no kernel of their own.

The metadata is the step's device tensors plus two host facts the launch needs (whether every
request is a decode, and the longest sequence); it does no index work on the host.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from pagedkv.errors import ConfigError
from pagedkv.ops.backends._triton.config import DEFAULT_CONFIG, TritonAttentionConfig
from pagedkv.ops.backends.base import AttentionLayerSpec, CommonAttentionMetadata
from pagedkv.ops.backends.hnd_layout import HNDLayoutBackend

__all__ = ["TRITON_DEFAULT_BLOCK_SIZE", "TritonAttentionConfig", "TritonBackend"]

TRITON_DEFAULT_BLOCK_SIZE = 16


@dataclass(slots=True)
class TritonAttentionMetadata:
    """The triton backend's per-step metadata (device tensors; see module docs)."""

    spec: AttentionLayerSpec
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    num_tokens: int
    decode_only: bool
    max_seq_len: int


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend(HNDLayoutBackend):
    """Paged attention with pagedkv's Triton kernels (see module docs).

    Args:
        device: where caches and metadata live (CUDA; CPU only under the interpreter).
        config: the kernels' tile sizes (:class:`TritonAttentionConfig`; the default is untuned
            until a GPU run, docs/gpu.md).

    Raises:
        ConfigError: a ``config`` that is not a :class:`TritonAttentionConfig`.
    """

    name = "triton"

    def __init__(
        self, device: torch.device | str = "cuda", *, config: TritonAttentionConfig = DEFAULT_CONFIG
    ) -> None:
        if not isinstance(config, TritonAttentionConfig):
            raise ConfigError(
                f"config must be a TritonAttentionConfig, got {type(config).__name__}"
            )
        super().__init__(device)
        self.config = config

    @classmethod
    def unavailable_reason(cls, device: torch.device | str) -> str | None:
        device = torch.device(device)
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'pagedkv[gpu]')"
        if device.type == "cuda":
            return None if torch.cuda.is_available() else "no CUDA device"
        if device.type == "cpu" and _interpreting():
            return None
        return f"needs a CUDA device, not {device.type} (or TRITON_INTERPRET=1 for tests)"

    def default_block_size(self, head_size, dtype, kv_cache_dtype=None) -> int:
        return TRITON_DEFAULT_BLOCK_SIZE

    def unsupported_reason(self, spec: AttentionLayerSpec) -> str | None:
        if spec.logits_soft_cap is not None:
            return f"attention logit soft-capping ({spec.logits_soft_cap}; the kernels have none)"
        return None

    def build_metadata(
        self, common: CommonAttentionMetadata, spec: AttentionLayerSpec, *, validate: bool = True
    ) -> TritonAttentionMetadata:
        if validate:
            common.validate(spec.block_size, spec.sliding_window)
        qsl = common.host_query_start_loc()
        num_tokens = int(qsl[-1])
        return TritonAttentionMetadata(
            spec=spec,
            block_tables=common.block_tables,
            seq_lens=common.seq_lens,
            query_start_loc=common.query_start_loc,
            slot_mapping=common.slot_mapping,
            num_tokens=num_tokens,
            decode_only=num_tokens == common.num_reqs,  # every q_len >= 1
            max_seq_len=int(common.host_seq_lens().max()),
        )

    def write_kv(
        self,
        key,
        value,
        kv_cache,
        metadata: TritonAttentionMetadata,
        *,
        k_scale=1.0,
        v_scale=1.0,
        validate=False,
    ) -> None:
        # Lazy: triton is optional (a GPU backend); importing it costs seconds.
        from pagedkv.ops.backends._triton.cache import write_kv_triton

        if validate:
            self._check(metadata, kv_cache, key=key, value=value)
        write_kv_triton(
            key, value, kv_cache, metadata.slot_mapping, k_scale=k_scale, v_scale=v_scale
        )

    def forward(
        self,
        query,
        kv_cache,
        metadata: TritonAttentionMetadata,
        *,
        k_scale=1.0,
        v_scale=1.0,
        validate=False,
    ) -> torch.Tensor:
        # Lazy: triton is optional (see write_kv).
        from pagedkv.ops.backends._triton.attention import paged_attention_triton

        if validate:
            self._check(metadata, kv_cache, query=query)
        spec = metadata.spec
        return paged_attention_triton(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            spec.scale,
            spec.sliding_window,
            decode_only=metadata.decode_only,
            max_seq_len=metadata.max_seq_len,
            k_scale=k_scale,
            v_scale=v_scale,
            config=self.config,
        )

    def _check(self, metadata: TritonAttentionMetadata, kv_cache, **tensors) -> None:
        self._check_tensors(metadata.spec, metadata.num_tokens, kv_cache, **tensors)
