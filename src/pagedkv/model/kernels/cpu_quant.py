"""pagedkv's AVX2 weight-only int4 / int8 products for small steps, built at first use.

torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) on an AVX2 CPU unpacks the nibbles
to bf16 and reads SmolLM2's 67 MB of 4-bit weights at about 6-7 GB/s with 2 threads, under a
third of what the memory gives (docs/perf.md, issue 33). ``quant_gemv.c`` (next to this file)
reads the GGUF blocks as they are stored, unpacks each block once for all of a step's rows
(at most 8), and accumulates in fp32 from fp32 activations: the numbers are those of the
dequantized weights, as the accuracy tables measured (no activation quantization)::

    int4   w = q * scale + min   q in [0, 16), fp32 scale and min per group of 32 (Q4_0, Q4_1,
                                 Q4_K as :class:`~pagedkv.model.quantization.QuantizedWeight`
                                 holds them); x . w = sum_g scale * (q . x) + min * sum(x_g)
    int8   w = q * scale         q int8, one fp32 scale per output row (the LM head)

Repacked at load (:func:`pack_int4`)::

    qs     uint8 [N, K/32, 16]  byte j of a group: element j (low nibble), j + 16 (high)
    scale  fp32  [N, K/32]
    min    fp32  [N, K/32]       (absent for Q4_0-like weights without one: min = 0)

GGUF tensors as the file stores them (``gguf_blocks.c``; :data:`GGML_TYPES`: F32, F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), read in place (a read-only memory map of the
file will do): :meth:`CpuQuantKernels.gguf_gemm` (the product of at most 8 fp32 rows, fp32
accumulation, AVX2 and AVX-512 bodies), :meth:`~CpuQuantKernels.gguf_dequant` (rows into fp32
or bf16, bit-identical to ``gguf.quants.dequantize``) and :meth:`~CpuQuantKernels.gguf_get_rows`
(an embedding lookup). :class:`LlamaLayerWeights` takes each product as int4 parts, GGUF parts
(:class:`GGUFPart`) or a mix, so a Q4_K_M file's layers run fused as stored.

The library is built at first use by :mod:`pagedkv.ops.c_build` (the system C compiler,
``-O3 -mavx2 -mfma -fopenmp``, into ``$PAGEDKV_CACHE_DIR/kernels/``, keyed by a hash of the
sources; OpenMP on torch's own thread pool) and loaded with ctypes. It runs where the CPU has
AVX2 and FMA (caps of :mod:`pagedkv.cpu_caps` applied), the build succeeded and a tiny
self-check is exact; otherwise the quantized linears keep torch's kernels.
``PAGEDKV_QUANT_KERNEL=torch`` turns it off. Each product has an AVX2 body and an AVX-512 one
(16 lanes, half the instructions per weight; compiled by a target pragma in the same library);
:attr:`CpuQuantKernels.isa` says which runs: "avx512" where the CPU has AVX-512 F/BW/VL/DQ and
no hold caps it (``ATEN_CPU_CAPABILITY=avx2`` or ``ONEDNN_MAX_CPU_ISA=AVX2`` give "avx2").

int8 activations, the default (``PAGEDKV_GGUF_ACTIVATIONS``, :attr:`CpuQuantKernels.activations`
"q8"), as llama.cpp's: the products of every quantized type (:data:`Q8_TYPES`: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, and the AVX2 body's Q4_0 / Q4_1 interleaved by 8 rows,
:data:`INTERLEAVED_TYPES`) round each activation row to int8 once per call, in blocks of 32
with one fp32 scale (``max |x| / 127``, round to nearest even) and the block's sum (for the
offset terms of Q4_1, Q5_1), and multiply the blocks in exact integer arithmetic, a float per
group of 32: fewer instructions per weight than converting every weight to fp32, at the cost of
the activations' rounding (each product off by at most ``sum_k |w_k| * xd_block / 2``). The
K-types (Q4_K, Q5_K, Q6_K) round in blocks of 256 instead, one per weight super-block, with the
int16 sums of each 16 int8 values (llama.cpp's ``block_q8_K``): a super-block's integer dot is
summed whole in int32 (the sub-block scales as 16-bit multipliers) and takes one float step,
the Q4_K / Q5_K mins and Q6_K's -32 offset coming from those sums; ``xd_block`` is then the
coarser scale of the block of 256. This holds for :meth:`CpuQuantKernels.gguf_gemm`, the fused
layers and :meth:`CpuQuantKernels.gguf_gemm_invariant` / ``gguf_gemm_large`` (every row the
decode step's bits); :meth:`CpuQuantKernels.gguf_gemm_fast` (large steps) keeps blocks of 32
(but for the interleaved types, whose large steps are their decode steps' products).
Two bodies (:attr:`CpuQuantKernels.q8_isa`, :func:`q8_body`): AVX2 ``maddubs`` / ``madd``, and
AVX-512 VNNI (``dpbusd``; the K-types ``maddubs`` then ``dpwssd``) where ``isa`` is "avx512" and
the CPU has :data:`VNNI_FLAGS`. ``PAGEDKV_GGUF_ACTIVATIONS=fp32`` is the exact opt-out (fp32 up to
summation order); the float types always take fp32 activations.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from pagedkv.cpu_caps import CpuCapabilities, cpu_flags, probe_cpu
from pagedkv.ops import c_build
from pagedkv.ops.c_build import KernelUnavailableError

logger = logging.getLogger(__name__)

#: Environment variable choosing the quantized products: "auto" (default: pagedkv's kernels
#: and its fused decoder layers where they run, else torch's), "products" (pagedkv's products,
#: the rest of each layer as torch ops: to compare the two) or "torch" (torch's always).
KERNEL_ENV = "PAGEDKV_QUANT_KERNEL"
KERNEL_CHOICES = ("auto", "products", "torch")
#: Environment variable choosing the activations of the GGUF products: "q8" (default: int8
#: blocks of 32 for :data:`Q8_TYPES`) or "fp32" (exact up to fp32 summation).
ACTIVATIONS_ENV = "PAGEDKV_GGUF_ACTIVATIONS"
#: :attr:`CpuQuantKernels.activations` by name, and the code decode_layer.c's layer struct
#: gives each (``activations``: 0 fp32, 1 int8).
ACTIVATION_CODES = {"fp32": 0, "q8": 1}
#: GGML type ids of the int8-activation products: every quantized type of :data:`GGML_TYPES`
#: (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and the interleaved Q4_0_X8, Q4_1_X8
#: (:data:`INTERLEAVED_TYPES`, 0x102, 0x103); the float types keep fp32 activations.
Q8_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14, 0x102, 0x103})
#: The C sources of the kernels, compiled into one library (the header is part of the build
#: key): the products, and the decoder layer built on them.
SOURCES = tuple(
    Path(__file__).with_name(n) for n in ("quant_gemv.c", "decode_layer.c", "gguf_blocks.c")
)
HEADERS = tuple(Path(__file__).with_name(n) for n in ("quant_gemv.h", "gguf_blocks_isa.h"))
#: Most activation rows one call takes.
MAX_ROWS = 8
#: Input features per int4 group the kernel reads.
GROUP_SIZE = 32
#: The products' bodies, by name, and the code quant_gemv.h gives each (``PAGEDKV_ISA_*``).
ISA_CODES = {"avx2": 0, "avx512": 1}
#: The int8-activation products' bodies, by name, and their ``PAGEDKV_ISA_*`` codes: AVX2
#: (``maddubs`` / ``madd``) and AVX-512 VNNI (``dpbusd``).
Q8_ISA_CODES = {"avx2": 0, "avx512_vnni": 2}
#: The int8 body of :meth:`CpuQuantKernels.gguf_gemm_large` by default (its ``q8_isa=None``):
#: "avx2". Measured on a shared 2-core Zen 4 (1 thread, random blocks at Llama-3.2-1B's
#: K = 2048, N = 2048 / 8192, M = 16 / 64 / 512; best of 25, the machine loaded): Q4_K ran
#: 5-24% faster on the AVX2 body at every shape, Q6_K 1.2-2x faster on VNNI up to 64 rows and
#: even at 512; Q4_K carries most of a Q4_K_M file's bytes, so AVX2 stays the default. The
#: batch-invariant product (:meth:`CpuQuantKernels.gguf_gemm_invariant`) does not use this: it
#: takes :attr:`CpuQuantKernels.q8_isa`, the decode steps' body.
LARGE_Q8_ISA = "avx2"
#: GGML type id of Q8_0 (its 8-bit codes overflow the AVX2 fast product's int16 sums).
Q8_0_ID = 8
#: Most rows of a large step that :meth:`CpuQuantKernels.gguf_gemm_fast` runs on the VNNI body,
#: per GGML type id (beyond: bf16 / fp32 tiles and torch's GEMM; 2048 is the default step
#: budget, ``max_num_batched_tokens``, and the largest step measured). Measured on a shared
#: 2-core Zen 4 against a bf16 model's tiles (best of 5 calls, 2 threads, load 1.1-1.5;
#: ``benchmarks/bench_gguf_large_steps.py FILE --dtype bfloat16``, docs/perf.md's History
#: 2026-12-06 "large steps on whole groups"): SmolLM2-135M's Q4_1 products 1.9-2.3x the tiles at
#: 64 rows, 1.04-1.4x at 2048, its Q8_0 LM head 1.5x / 1.08x; Llama-3.2-1B's Q4_K 1.7x / 1.15-
#: 1.27x; random Q4_0, Q5_0, Q5_1, Q5_K, Q8_0 blocks at both models' shapes 1.7-2.0x at 64 rows,
#: 1.4-1.5x at 512-2048. Q6_K (its sub-blocks of 16 take a float step each, and a tile of
#: K = 8192 no longer fits L1): 1.08-1.5x at 64 rows, at 128-2048 rows 1.0-1.26x at K = 2048 but
#: 0.73-0.94x at K = 8192, so 64.
FAST_LARGE_MAX_ROWS = MappingProxyType(
    {2: 2048, 3: 2048, 6: 2048, 7: 2048, 8: 2048, 12: 2048, 13: 2048, 14: 64}
)
#: CPU flags (``/proc/cpuinfo``) the VNNI body needs beside :attr:`CpuQuantKernels.isa`
#: "avx512".
VNNI_FLAGS = ("avx512bw", "avx512_vnni")

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


@dataclass(frozen=True)
class GGMLType:
    """A GGUF tensor type that gguf_blocks.c reads as the file stores it.

    Attributes:
        name: GGML's name ("Q4_K"); type_id: its ``GGMLQuantizationType`` value;
        block_elems: weights per block (1 for the float types); block_bytes: bytes per block.
    """

    name: str
    type_id: int
    block_elems: int
    block_bytes: int


#: The GGUF types of :meth:`CpuQuantKernels.gguf_gemm` / ``gguf_dequant`` / ``gguf_get_rows``,
#: by name (gguf's ``GGML_QUANT_SIZES`` for each).
GGML_TYPES: dict[str, GGMLType] = {
    t.name: t
    for t in (
        GGMLType("F32", 0, 1, 4),
        GGMLType("F16", 1, 1, 2),
        GGMLType("Q4_0", 2, 32, 18),
        GGMLType("Q4_1", 3, 32, 20),
        GGMLType("Q5_0", 6, 32, 22),
        GGMLType("Q5_1", 7, 32, 24),
        GGMLType("Q8_0", 8, 32, 34),
        GGMLType("Q4_K", 12, 256, 144),
        GGMLType("Q5_K", 13, 256, 176),
        GGMLType("Q6_K", 14, 256, 210),
        GGMLType("BF16", 30, 1, 2),
    )
}
#: pagedkv's layouts of a file's Q4_0 / Q4_1 blocks in bands of 8 rows (gguf_blocks.c, "4-bit
#: blocks interleaved by 8 rows"; made at load by :meth:`CpuQuantKernels.interleave`, for the
#: AVX2 body's int8 products), by the file's type id. The same bytes per block, moved.
INTERLEAVED_TYPES: Mapping[int, GGMLType] = MappingProxyType(
    {2: GGMLType("Q4_0_X8", 0x102, 32, 18), 3: GGMLType("Q4_1_X8", 0x103, 32, 20)}
)
_BY_ID = {t.type_id: t for t in (*GGML_TYPES.values(), *INTERLEAVED_TYPES.values())}
#: The file's type id of each interleaved one.
_FILE_TYPE = {t.type_id: base for base, t in INTERLEAVED_TYPES.items()}


def ggml_type(type_id: int) -> GGMLType:
    """The :class:`GGMLType` of a GGML type id.

    Raises:
        KernelUnavailableError: a type the kernels do not read.
    """
    if type_id not in _BY_ID:
        raise KernelUnavailableError(f"GGML type {type_id} is not one of the kernels' types")
    return _BY_ID[type_id]


def row_bytes(type_id: int, K: int) -> int:
    """Bytes of one row of K weights of a GGML type.

    Raises:
        KernelUnavailableError: an unknown type, or K not a positive multiple of its block.
    """
    t = ggml_type(type_id)
    if K <= 0 or K % t.block_elems:
        raise KernelUnavailableError(f"{t.name}: K = {K} is not a multiple of {t.block_elems}")
    return K // t.block_elems * t.block_bytes


def isa_code(isa: str) -> int:
    """quant_gemv.h's ``PAGEDKV_ISA_*`` code of a products' body name (:data:`ISA_CODES`).

    Raises:
        KernelUnavailableError: an unknown name.
    """
    return _code("isa", isa, ISA_CODES)


def q8_body(isa: str, flags: frozenset[str] | None = None) -> str:
    """The int8-activation products' body that goes with the products' body ``isa``:
    "avx512_vnni" where ``isa`` is "avx512" (so no AVX2 hold applies) and the CPU has
    :data:`VNNI_FLAGS` (``flags``; None = :func:`pagedkv.cpu_caps.cpu_flags`), else "avx2"."""
    flags = cpu_flags() if flags is None else flags
    return "avx512_vnni" if isa == "avx512" and all(f in flags for f in VNNI_FLAGS) else "avx2"


def q8_isa_code(q8_isa: str) -> int:
    """quant_gemv.h's code of an int8-activation body name (:data:`Q8_ISA_CODES`).

    Raises:
        KernelUnavailableError: an unknown name.
    """
    return _code("q8_isa", q8_isa, Q8_ISA_CODES)


def activations_code(activations: str) -> int:
    """decode_layer.c's ``activations`` code of a name (:data:`ACTIVATION_CODES`).

    Raises:
        KernelUnavailableError: an unknown name.
    """
    return _code("activations", activations, ACTIVATION_CODES)


def _code(what: str, name: str, codes: dict[str, int]) -> int:
    """``codes[name]``, or KernelUnavailableError naming ``what`` and the known names."""
    if name not in codes:
        raise KernelUnavailableError(f"{what} {name!r} is not one of {tuple(codes)}")
    return codes[name]


def pack_int4(
    q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The kernel's layout of an int4 weight with groups of 32.

    Args:
        q: ``[N, K]`` integers in [0, 16) (any integer dtype), K a multiple of 32.
        scale: ``[N, K / 32]``; minimum: ``[N, K / 32]`` or None.

    Returns:
        ``(qs, scale, min)``: qs uint8 ``[N, K / 32, 16]`` (element j of a group in the low
        nibble of byte j, element j + 16 in its high nibble: GGUF's order), scale and min fp32
        contiguous (min None stays None).
    """
    n, k = q.shape
    groups = q.to(torch.uint8).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    qs = (groups[..., :16] | (groups[..., 16:] << 4)).contiguous()
    scale = scale.float().contiguous()
    minimum = None if minimum is None else minimum.float().contiguous()
    return qs, scale, minimum


#: decode_layer.c's ``PAGEDKV_PART_*``: a part in :func:`pack_int4`'s layout, or a GGUF tensor
PART_INT4 = 0
PART_GGUF = 1
#: Most stacked parts of one product (q, k, v).
MAX_PARTS = 3


@dataclass(frozen=True)
class GGUFPart:
    """A weight (or one stacked part of one) as the GGUF file stores it.

    Attributes:
        type_id: its GGML type id (:data:`GGML_TYPES`).
        data: uint8 contiguous ``[rows, row_bytes(type_id, in_features)]`` (may be a read-only
            memory map of the file: the kernels never write it).
    """

    type_id: int
    data: torch.Tensor


class _LinearPart(ctypes.Structure):
    """decode_layer.c's ``pagedkv_linear_part``."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("type", ctypes.c_int32),
        ("a", _P),
        ("b", _P),
        ("c", _P),
        ("rows", _I64),
    ]


class _Linear(ctypes.Structure):
    """decode_layer.c's ``pagedkv_linear``: up to :data:`MAX_PARTS` stacked parts."""

    _fields_ = [("num_parts", _I64), ("parts", _LinearPart * MAX_PARTS)]


class _LlamaLayer(ctypes.Structure):
    """decode_layer.c's ``pagedkv_llama_layer``: a decoder layer's weights and shape."""

    _fields_ = [
        ("qkv", _Linear),
        ("qkv_bias", _P),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("input_norm", _P),
        ("post_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("hidden", _I64),
        ("num_heads", _I64),
        ("num_kv_heads", _I64),
        ("head_dim", _I64),
        ("intermediate", _I64),
        ("eps", ctypes.c_float),
        ("isa", ctypes.c_int32),
        ("activations", ctypes.c_int32),
        ("q8_isa", ctypes.c_int32),
        ("batch_invariant", ctypes.c_int32),
    ]


def _parts(weight) -> list:
    """A product's parts: an int4 triple ``(qs, scale, min)`` or a :class:`GGUFPart` is one
    part; a list holds up to :data:`MAX_PARTS` of them, stacked."""
    return list(weight) if isinstance(weight, list) else [weight]


def _part_rows(part) -> int:
    return part.data.shape[0] if isinstance(part, GGUFPart) else part[0].shape[0]


def _linear(name: str, weight, rows: int, cols: int) -> _Linear:
    """The C struct of one product ``[rows, cols]`` (see :class:`LlamaLayerWeights`).

    Raises:
        KernelUnavailableError: parts of other shapes, dtypes or types than the kernels take.
    """
    parts = _parts(weight)
    if not 1 <= len(parts) <= MAX_PARTS:
        raise KernelUnavailableError(f"{name}: {len(parts)} parts (1 to {MAX_PARTS})")
    linear = _Linear(len(parts))
    for i, part in enumerate(parts):
        if isinstance(part, GGUFPart):
            width = row_bytes(part.type_id, cols)
            data = part.data
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != width:
                raise KernelUnavailableError(
                    f"{name}: {ggml_type(part.type_id).name} part of shape "
                    f"{tuple(data.shape)} (rows of {width} bytes for {cols} inputs)"
                )
            if not data.is_contiguous():
                raise KernelUnavailableError(f"{name}: GGUF part must be contiguous")
            linear.parts[i] = _LinearPart(
                PART_GGUF, part.type_id, data.data_ptr(), None, None, data.shape[0]
            )
        else:
            qs, scale, minimum = part
            if (
                qs.dtype != torch.uint8
                or qs.dim() != 3
                or tuple(qs.shape[1:])
                != (
                    cols // GROUP_SIZE,
                    16,
                )
            ):
                raise KernelUnavailableError(f"{name}: int4 weight of shape {tuple(qs.shape)}")
            if cols % GROUP_SIZE or not all(
                t is None or (t.dtype == torch.float32 and t.is_contiguous())
                for t in (scale, minimum)
            ):
                raise KernelUnavailableError(f"{name}: scales must be fp32 contiguous")
            linear.parts[i] = _LinearPart(
                PART_INT4, 0, qs.data_ptr(), scale.data_ptr(), _ptr(minimum), qs.shape[0]
            )
    total = sum(_part_rows(part) for part in parts)
    if total != rows:
        raise KernelUnavailableError(f"{name}: parts of {total} rows, not {rows}")
    return linear


class _LayerAttention(ctypes.Structure):
    """``pagedkv_layer_attention`` of decode_layer.c: a backend's C entry points for a layer
    (:class:`pagedkv.ops.backends.base.CAttention`, field for field)."""

    _fields_ = [("write_kv", _P), ("attention", _P), ("step", _P), ("k_cache", _P), ("v_cache", _P)]


class LlamaLayerWeights:
    """One Llama decoder layer's weights as :meth:`CpuQuantKernels.llama_attn_in` and
    :meth:`~CpuQuantKernels.llama_attn_out` read them: four products, the two RMSNorm weights,
    the optional q/k/v bias and per-head q/k norms. It holds the tensors (the C struct holds
    only their addresses).

    Each product is one of: an int4 weight ``(qs, scale, min)`` in :func:`pack_int4`'s layout,
    a :class:`GGUFPart` (the file's blocks of any :data:`GGML_TYPES` type), or a list of up
    to :data:`MAX_PARTS` of those stacked by output rows (q, k, v; gate, up), each part of its
    own form and type (a Q4_K_M file: q and k Q4_K, v Q6_K).

    Args:
        qkv: q, k and v, ``[(H + 2 KV) D, hidden]`` in all.
        o: ``[hidden, H D]``; gate_up: gate and up, ``[2 I, hidden]``; down: ``[hidden, I]``.
        input_norm, post_norm: fp32 ``[hidden]``.
        qkv_bias: fp32 ``[(H + 2 KV) D]`` or None.
        num_heads, num_kv_heads, head_dim: H, KV, D; eps: the RMSNorm epsilon.
        isa: the products' body, a key of :data:`ISA_CODES` (:attr:`CpuQuantKernels.isa`).
        q_norm, k_norm: fp32 ``[D]``: Qwen3's RMSNorm of each q / k head (after the bias,
            before the rotation, with ``eps``), or None.
        activations: the GGUF parts' activations, a key of :data:`ACTIVATION_CODES`
            (:attr:`CpuQuantKernels.activations`): "q8" runs the parts of :data:`Q8_TYPES`
            on int8 activations, the others stay fp32.
        q8_isa: the int8-activation products' body, a key of :data:`Q8_ISA_CODES`
            (:attr:`CpuQuantKernels.q8_isa`); None = :func:`q8_body` of ``isa``.
        batch_invariant: :attr:`batch_invariant`.

    Raises:
        KernelUnavailableError: shapes, dtypes or types the kernels do not take, an unknown
            ``isa`` / ``activations`` / ``q8_isa``, or an int4 part with ``batch_invariant``
            (no invariant int4 product).
    """

    __slots__ = (
        "_keep",
        "_struct",
        "address",
        "batch_invariant",
        "head_dim",
        "hidden",
        "num_heads",
        "num_kv_heads",
    )

    def __init__(
        self,
        qkv,
        o,
        gate_up,
        down,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        qkv_bias: torch.Tensor | None,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        isa: str = "avx2",
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        activations: str = "fp32",
        q8_isa: str | None = None,
        batch_invariant: bool = False,
    ):
        if batch_invariant and not all(
            isinstance(part, GGUFPart)
            for weight in (qkv, o, gate_up, down)
            for part in _parts(weight)
        ):
            raise KernelUnavailableError("batch_invariant takes GGUF parts only (no int4 product)")
        code = isa_code(isa)
        activations_id = activations_code(activations)
        q8_code = q8_isa_code(q8_body(isa) if q8_isa is None else q8_isa)
        hidden = input_norm.shape[0]
        gate_up_rows = sum(_part_rows(part) for part in _parts(gate_up))
        if gate_up_rows % 2:
            raise KernelUnavailableError(f"gate_up: {gate_up_rows} rows (gate and up alike)")
        intermediate = gate_up_rows // 2
        width = (num_heads + 2 * num_kv_heads) * head_dim
        linears = {
            name: _linear(name, weight, rows, cols)
            for name, weight, rows, cols in (
                ("qkv", qkv, width, hidden),
                ("o", o, hidden, num_heads * head_dim),
                ("gate_up", gate_up, 2 * intermediate, hidden),
                ("down", down, hidden, intermediate),
            )
        }
        vectors = [input_norm, post_norm] + [t for t in (qkv_bias, q_norm, k_norm) if t is not None]
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in vectors):
            raise KernelUnavailableError("norm weights and bias must be fp32 contiguous")
        if any(t is not None and t.shape != (head_dim,) for t in (q_norm, k_norm)):
            raise KernelUnavailableError(f"q_norm and k_norm must be [{head_dim}]")
        if head_dim % 2 or head_dim > 512:
            raise KernelUnavailableError(f"head_dim {head_dim} (even, at most 512)")

        self._struct = _LlamaLayer(
            linears["qkv"],
            _ptr(qkv_bias),
            linears["o"],
            linears["gate_up"],
            linears["down"],
            input_norm.data_ptr(),
            post_norm.data_ptr(),
            _ptr(q_norm),
            _ptr(k_norm),
            hidden,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate,
            eps,
            code,
            activations_id,
            q8_code,
            int(batch_invariant),
        )
        self._keep = (qkv, o, gate_up, down, *vectors)
        #: the struct's address, passed to the C calls.
        self.address = ctypes.addressof(self._struct)
        #: whether the fused calls run every product batch-invariant
        #: (:meth:`CpuQuantKernels.gguf_gemm_invariant`: a row's bits those it gets alone,
        #: whatever else shares the step or the thread count) and take any number of rows;
        #: False: the small steps' products, at most :data:`MAX_ROWS` rows. Fixed at
        #: construction (the C struct holds it).
        self.batch_invariant = bool(batch_invariant)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.hidden = hidden


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuQuantKernels:
    """The loaded library: int4 and int8 weight-only products of at most :data:`MAX_ROWS`
    fp32 activation rows.

    Args:
        path: the built shared library.
        fused_layers: :attr:`fused_layers`.
        isa: :attr:`isa`; the caller checks that the CPU has it (:func:`load_cpu_quant_kernels`
            does).
        activations: :attr:`activations`.

    Raises:
        OSError: the library does not load.
        KernelUnavailableError: an unknown ``isa`` or ``activations``.
    """

    __slots__ = (
        "_attn_in",
        "_attn_out",
        "_forward",
        "_gguf_dequant",
        "_gguf_gemm",
        "_gguf_gemm_invariant",
        "_gguf_gemm_q8",
        "_gguf_gemm_q8_fast",
        "_gguf_gemm_q8_large",
        "_gguf_rows",
        "_int4",
        "_int8",
        "_interleave",
        "_isa_code",
        "_q8_isa_code",
        "_rms_norm",
        "activations",
        "fast_large_rows",
        "fused_layers",
        "gguf_types",
        "interleaves",
        "isa",
        "path",
        "q8_isa",
        "q8_large_max_rows",
    )

    def __init__(
        self,
        path: Path,
        fused_layers: bool = True,
        isa: str = "avx2",
        activations: str = "q8",
        q8_isa: str | None = None,
    ):
        self._isa_code = isa_code(isa)
        activations_code(activations)
        q8_isa = q8_body(isa) if q8_isa is None else q8_isa
        self._q8_isa_code = q8_isa_code(q8_isa)
        #: the int8-activation products' body: "avx2" or "avx512_vnni" (:func:`q8_body`; the
        #: caller checks that the CPU has it)
        self.q8_isa = q8_isa
        #: the GGUF products' activations: "fp32" (exact up to fp32 summation) or "q8" (int8
        #: blocks of 32 for :data:`Q8_TYPES`, in :meth:`gguf_gemm` and the fused layers)
        self.activations = activations
        #: the products' body: "avx2" (8 lanes) or "avx512" (16 lanes)
        self.isa = isa
        #: most rows a large step (more than :data:`MAX_ROWS`) of a float32 model runs on the
        #: int8 products (:meth:`gguf_gemm_large`) rather than dequantized tiles and torch's
        #: fp32 GEMM: 0 with fp32 activations. Measured on a 2-core Zen 4 at Llama-3.2-1B's
        #: shapes (benchmarks/bench_gguf_large_steps.py): held to AVX2, where torch's fp32 GEMM
        #: has 8 lanes, the int8 products win at every size up to a 512-token prompt (Q6_K: a
        #: tie there); with AVX-512's fp32 GEMM they win up to about 64 rows and lose on
        #: prompts. A bfloat16 model keeps its tiles (GGUFMatmul): bf16 GEMM on a CPU with
        #: native bf16 beat these int8 products end to end (64 chats of SmolLM2: 387 against 291
        #: output tok/s). :meth:`gguf_gemm_fast` comes first where it runs (see
        #: :meth:`takes_fast_large`); this is what its types and sizes leave.
        self.q8_large_max_rows = 0 if activations != "q8" else (64 if isa == "avx512" else 1 << 62)
        #: most rows a large step runs on :meth:`gguf_gemm_fast` rather than the tiles or
        #: :meth:`gguf_gemm_large`, by GGML type id (see :meth:`takes_fast_large`): on the
        #: VNNI body :data:`FAST_LARGE_MAX_ROWS`; on the AVX2 body :attr:`q8_large_max_rows`
        #: for every type but Q8_0 (it beat :meth:`gguf_gemm_large` at every shape measured);
        #: empty with fp32 activations.
        self.fast_large_rows: dict[int, int] = {}
        if activations == "q8":
            self.fast_large_rows = (
                dict(FAST_LARGE_MAX_ROWS)
                if q8_isa == "avx512_vnni"
                else {t: self.q8_large_max_rows for t in Q8_TYPES if t != Q8_0_ID}
            )
        self.path = path
        #: whether models run their small steps' decoder layers through the fused calls
        #: (:meth:`llama_attn_in` / :meth:`llama_attn_out`) or as torch ops around the products
        self.fused_layers = fused_layers
        lib = ctypes.CDLL(str(path))
        self._int4 = lib.pagedkv_int4_gemm
        self._int4.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int, ctypes.c_int]
        self._int4.restype = ctypes.c_int
        self._int8 = lib.pagedkv_int8_gemm
        self._int8.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int, ctypes.c_int]
        self._int8.restype = ctypes.c_int
        self._attn_in = lib.pagedkv_llama_attn_in
        self._attn_in.argtypes = [_P, _P, _P, _P, _P, _I64, ctypes.c_int]
        self._attn_in.restype = ctypes.c_int
        self._attn_out = lib.pagedkv_llama_attn_out
        self._attn_out.argtypes = [_P, _P, _P, _I64, ctypes.c_int]
        self._attn_out.restype = ctypes.c_int
        self._forward = lib.pagedkv_llama_forward
        self._forward.argtypes = [_P, _P, _I64, _P, _P, _P, _I64, ctypes.c_int]
        self._forward.restype = ctypes.c_int
        self._gguf_gemm = lib.pagedkv_gguf_gemm
        self._gguf_gemm.argtypes = [
            ctypes.c_int,
            _P,
            _P,
            _P,
            _I64,
            _I64,
            _I64,
            ctypes.c_int,
            ctypes.c_int,
        ]
        self._gguf_gemm.restype = ctypes.c_int
        self._gguf_gemm_q8 = lib.pagedkv_gguf_gemm_q8
        self._gguf_gemm_q8.argtypes = self._gguf_gemm.argtypes
        self._gguf_gemm_q8.restype = ctypes.c_int
        self._gguf_gemm_q8_large = lib.pagedkv_gguf_gemm_q8_large
        self._gguf_gemm_q8_large.argtypes = [
            ctypes.c_int,
            _P,
            _P,
            _P,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.c_int,
        ]
        self._gguf_gemm_q8_large.restype = ctypes.c_int
        self._gguf_gemm_q8_fast = lib.pagedkv_gguf_gemm_q8_fast
        self._gguf_gemm_q8_fast.argtypes = self._gguf_gemm_q8_large.argtypes
        self._gguf_gemm_q8_fast.restype = ctypes.c_int
        self._gguf_gemm_invariant = lib.pagedkv_gguf_gemm_invariant
        self._gguf_gemm_invariant.argtypes = [
            ctypes.c_int,
            _P,
            _P,
            _P,
            _I64,
            _I64,
            _I64,
            _I64,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
        ]
        self._gguf_gemm_invariant.restype = ctypes.c_int
        self._rms_norm = lib.pagedkv_rms_norm
        self._rms_norm.argtypes = [_P, _P, ctypes.c_float, _I64, _I64, _P]
        self._rms_norm.restype = None
        self._gguf_dequant = lib.pagedkv_gguf_dequant
        self._gguf_dequant.argtypes = [
            ctypes.c_int,
            _P,
            _I64,
            _I64,
            _I64,
            _P,
            ctypes.c_int,
            ctypes.c_int,
        ]
        self._gguf_dequant.restype = ctypes.c_int
        self._gguf_rows = lib.pagedkv_gguf_get_rows
        self._gguf_rows.argtypes = [ctypes.c_int, _P, _P, _I64, _I64, _I64, _P]
        self._gguf_rows.restype = ctypes.c_int
        self._interleave = lib.pagedkv_gguf_interleave
        self._interleave.argtypes = [ctypes.c_int, _P, _I64, _I64, ctypes.c_int]
        self._interleave.restype = ctypes.c_int
        #: whether :meth:`interleave` lays out Q4_0 / Q4_1 weights for these kernels: with int8
        #: activations on the AVX2 body (the VNNI body has its own one-row kernels, and the
        #: fp32 products read the file's layout)
        self.interleaves = activations == "q8" and q8_isa != "avx512_vnni"
        #: the GGML type ids the ``gguf_*`` calls take (:data:`GGML_TYPES`, and the
        #: :data:`INTERLEAVED_TYPES` where :attr:`interleaves`): all of them where the CPU has
        #: F16C (every AVX2 CPU made has), none otherwise
        offered = set(_BY_ID) if self.interleaves else set(_BY_ID) - set(_FILE_TYPE)
        self.gguf_types = frozenset(offered) if "f16c" in cpu_flags() else frozenset()

    @staticmethod
    def layer_array(layers: Sequence[LlamaLayerWeights]) -> ctypes.Array:
        """The layers' struct addresses as the C array :meth:`llama_forward` takes (build it
        once: the layers must outlive it)."""
        return (_P * len(layers))(*(layer.address for layer in layers))

    @staticmethod
    def attention_array(entries: Sequence[tuple[int, int, int, int, int]]) -> ctypes.Array:
        """Each layer's attention entry points (:class:`~pagedkv.ops.backends.base.CAttention`
        tuples) as the C array :meth:`llama_forward` takes."""
        return (_LayerAttention * len(entries))(*entries)

    def llama_forward(
        self,
        layers: ctypes.Array,
        attention: ctypes.Array,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_threads: int,
    ) -> None:
        """Every decoder layer of a small step in one call (decode_layer.c): for each layer,
        :meth:`llama_attn_in`, the backend's write and attention through its C entry points,
        :meth:`llama_attn_out`, in place on the residual stream h fp32 ``[M, hidden]``
        (contiguous, 1 <= M <= 8, or any M >= 1 where every layer is
        :attr:`~LlamaLayerWeights.batch_invariant`). ``layers``: :meth:`layer_array`; ``attention``:
        :meth:`attention_array`, one entry per layer; cos and sin as for
        :meth:`llama_attn_in`.

        Raises:
            KernelUnavailableError: the kernels or the backend refused (M out of range, layers
                of different head shapes).
        """
        if len(attention) != len(layers):
            raise KernelUnavailableError(f"{len(layers)} layers, {len(attention)} attentions")
        rc = self._forward(
            layers,
            attention,
            len(layers),
            h.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            h.shape[0],
            num_threads,
        )
        if rc:
            raise KernelUnavailableError(f"llama_forward refused {h.shape[0]} rows")

    def llama_attn_in(
        self,
        layer: LlamaLayerWeights,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        qkv: torch.Tensor,
        num_threads: int,
    ) -> None:
        """The layer before attention (decode_layer.c): ``qkv`` fp32 ``[M, (H + 2 KV) D]`` =
        q, k and v of ``rms_norm(h)``, q and k rotated. h fp32 ``[M, hidden]``, cos and sin
        (sign-folded) fp32 ``[M, D]``, all contiguous, 1 <= M <= 8 (any M >= 1 for a
        :attr:`~LlamaLayerWeights.batch_invariant` layer); the caller holds to these
        (the kernel reads raw pointers).

        Raises:
            KernelUnavailableError: the kernel refused (M out of range).
        """
        rc = self._attn_in(
            layer.address,
            h.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            qkv.data_ptr(),
            h.shape[0],
            num_threads,
        )
        if rc:
            raise KernelUnavailableError(f"llama_attn_in refused {h.shape[0]} rows")

    def llama_attn_out(
        self, layer: LlamaLayerWeights, h: torch.Tensor, attn: torch.Tensor, num_threads: int
    ) -> None:
        """The layer after attention (decode_layer.c), in place on the residual stream h fp32
        ``[M, hidden]``: ``h += attn W_o^T``, then ``h += mlp(rms_norm(h))``. attn fp32
        ``[M, H D]``; both contiguous, 1 <= M <= 8 (any M >= 1 for a
        :attr:`~LlamaLayerWeights.batch_invariant` layer).

        Raises:
            KernelUnavailableError: the kernel refused (M out of range).
        """
        rc = self._attn_out(layer.address, h.data_ptr(), attn.data_ptr(), h.shape[0], num_threads)
        if rc:
            raise KernelUnavailableError(f"llama_attn_out refused {h.shape[0]} rows")

    def int4(
        self, x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None
    ) -> torch.Tensor:
        """``x W^T`` fp32 ``[M, N]`` for x fp32 contiguous ``[M, K]`` (1 <= M <= 8) and a
        weight in :func:`pack_int4`'s layout (``qs [N, K / 32, 16]``). The caller holds to
        these shapes and dtypes (the kernel reads raw pointers).

        Raises:
            KernelUnavailableError: the kernel refused the shapes.
        """
        pointers = (
            qs.data_ptr(),
            scale.data_ptr(),
            None if minimum is None else minimum.data_ptr(),
        )
        return self._run(self._int4, "int4", x, qs.shape[0], pointers)

    def int8(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``x W^T`` fp32 ``[M, N]`` for x fp32 contiguous ``[M, K]`` (1 <= M <= 8, K a
        multiple of 32), q int8 contiguous ``[N, K]`` and scale fp32 contiguous ``[N]``.

        Raises:
            KernelUnavailableError: the kernel refused the shapes.
        """
        return self._run(self._int8, "int8", x, q.shape[0], (q.data_ptr(), scale.data_ptr()))

    def _gguf_weight(self, type_id: int, w: torch.Tensor, in_features: int) -> int:
        """Check a raw GGUF weight ``w`` (uint8 contiguous ``[N, row_bytes]``) of a type these
        kernels take for K = ``in_features``; returns N.

        Raises:
            KernelUnavailableError: a type not in :attr:`gguf_types`, or a weight of another
                dtype, layout or width.
        """
        if type_id not in self.gguf_types:
            raise KernelUnavailableError(f"GGML type {type_id} is not offered here")
        width = row_bytes(type_id, in_features)
        if w.dtype != torch.uint8 or w.dim() != 2 or not w.is_contiguous():
            raise KernelUnavailableError(
                f"a GGUF weight must be uint8 contiguous [N, {width}], got {w.dtype} "
                f"{tuple(w.shape)}"
            )
        if w.shape[1] != width:
            raise KernelUnavailableError(
                f"{ggml_type(type_id).name} rows of K = {in_features} take {width} bytes, "
                f"not {w.shape[1]}"
            )
        return w.shape[0]

    def interleaved_type(self, type_id: int, num_rows: int) -> int | None:
        """The interleaved type (:data:`INTERLEAVED_TYPES`) :meth:`interleave` would make of a
        ``type_id`` weight of ``num_rows`` rows, or None (these kernels do not interleave, a
        type without such a layout, rows not a multiple of 8)."""
        t = INTERLEAVED_TYPES.get(type_id)
        if t is None or not self.interleaves or num_rows % 8 or t.type_id not in self.gguf_types:
            return None
        return t.type_id

    def interleave(self, type_id: int, w: torch.Tensor) -> int:
        """Lay out a Q4_0 / Q4_1 weight's rows in place in bands of 8 (gguf_blocks.c
        ``pagedkv_gguf_interleave``: each band's blocks with 4 bytes of each of its 8 rows side
        by side, as llama.cpp's repacked Q4_0 8x8 blocks on AVX2), the layout of the AVX2
        body's int8 products: a decode step's product, and each extra row of a verification
        step, about twice as fast on an AVX2 core (docs/perf.md, 2026-12-07 "Q4_0 / Q4_1
        interleaved by 8 rows"). The bytes are the file's, moved; :meth:`gguf_dequant` and
        :meth:`gguf_get_rows` still give the file's values bit for bit.

        Args:
            type_id: 2 (Q4_0) or 3 (Q4_1).
            w: uint8 contiguous writable ``[N, row_bytes]``, N a multiple of 8 (rewritten).

        Returns:
            The interleaved type's id (0x102, 0x103) to compute on ``w`` with from now on.

        Raises:
            KernelUnavailableError: these kernels do not interleave (:attr:`interleaves`), or
                a type, shape or dtype without the layout; ``w`` is then unchanged.
        """
        if w.dtype != torch.uint8 or w.dim() != 2 or not w.is_contiguous():
            raise KernelUnavailableError(
                "interleave takes a uint8 contiguous [N, row_bytes] weight"
            )
        new = self.interleaved_type(type_id, w.shape[0])
        if new is None:
            raise KernelUnavailableError(
                f"GGML type {type_id} of {w.shape[0]} rows has no interleaved layout here"
            )
        t = ggml_type(type_id)
        in_features = w.shape[1] // t.block_bytes * t.block_elems
        self._gguf_weight(type_id, w, in_features)
        rc = self._interleave(
            type_id, w.data_ptr(), w.shape[0], in_features, torch.get_num_threads()
        )
        if rc != new:
            raise KernelUnavailableError(f"interleave refused type {type_id} {tuple(w.shape)}")
        return new

    def gguf_gemm(
        self, type_id: int, x: torch.Tensor, w: torch.Tensor, num_outputs: int | None = None
    ) -> torch.Tensor:
        """``x W^T`` fp32 ``[M, N]`` on a GGUF weight as the file stores it (gguf_blocks.c):
        with :attr:`activations` "q8" (the default) and a type of :data:`Q8_TYPES`, x rounded
        to int8 in blocks of 32 and integer block products on the :attr:`q8_isa` body (see the
        module docstring); else fp32 activations, fp32 accumulation.

        Args:
            type_id: the weight's GGML type id (one of :attr:`gguf_types`).
            x: fp32 contiguous ``[M, K]``, 1 <= M <= :data:`MAX_ROWS`, K a multiple of the
                type's block.
            w: uint8 contiguous ``[N, row_bytes(type_id, K)]``, the N rows of raw blocks (may
                be a read-only memory map: it is never written).
            num_outputs: N, checked against ``w`` (None: ``w``'s).

        Raises:
            KernelUnavailableError: a type, shape or dtype the kernel does not take.
        """
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
            raise KernelUnavailableError(f"x must be fp32 contiguous [M, K], got {x.dtype}")
        rows, in_features = x.shape
        if not 1 <= rows <= MAX_ROWS:
            raise KernelUnavailableError(f"{rows} activation rows (1 to {MAX_ROWS})")
        n = self._gguf_weight(type_id, w, in_features)
        if num_outputs is not None and num_outputs != n:
            raise KernelUnavailableError(f"{num_outputs} outputs asked of a weight of {n} rows")
        out = torch.empty(rows, n, dtype=torch.float32)
        q8 = self.activations == "q8" and type_id in Q8_TYPES
        rc = (self._gguf_gemm_q8 if q8 else self._gguf_gemm)(
            type_id,
            x.data_ptr(),
            w.data_ptr(),
            out.data_ptr(),
            rows,
            n,
            in_features,
            torch.get_num_threads(),
            self._q8_isa_code if q8 else self._isa_code,
        )
        if rc:
            raise KernelUnavailableError(f"gguf_gemm refused type {type_id}, x {tuple(x.shape)}")
        return out

    def gguf_gemm_large(
        self, type_id: int, x: torch.Tensor, w: torch.Tensor, q8_isa: str | None = None
    ) -> torch.Tensor:
        """``x W^T`` fp32 ``[M, N]`` for any number of rows M on the int8 products
        (gguf_blocks.c ``pagedkv_gguf_gemm_q8_large``): every row of x rounded to int8 once,
        the weight's rows in blocks kept in cache while many activation rows meet them (the
        VNNI body: tiles of 16 weight rows unpacked once, one row per lane; the K-types, in
        activation blocks of 256, run their row kernels on blocks of 64 weight rows on both
        bodies). A row's result is bit for bit the small steps' q8 product of that row on the
        same body.

        Args:
            type_id: one of :data:`Q8_TYPES`.
            x: fp32 contiguous ``[M, K]``, M >= 1.
            w: uint8 contiguous ``[N, row_bytes(type_id, K)]``.
            q8_isa: the body, a key of :data:`Q8_ISA_CODES`; None = :data:`LARGE_Q8_ISA`
                ("avx2": on the Zen 4 measured, the VNNI body was no faster for large steps,
                see there). The caller checks that the CPU has it.

        Raises:
            KernelUnavailableError: a type, shape or dtype the kernel does not take, or an
                unknown ``q8_isa``.
        """
        code = q8_isa_code(LARGE_Q8_ISA if q8_isa is None else q8_isa)
        return self._q8_product(self._gguf_gemm_q8_large, "gguf_gemm_large", type_id, x, w, code)

    def _q8_product(
        self, fn, name: str, type_id: int, x: torch.Tensor, w: torch.Tensor, code: int
    ) -> torch.Tensor:
        """Call the C product ``fn`` (``name`` in errors) of an int8-activation type on the
        body ``code``: x fp32 contiguous ``[M, K]``, w ``[N, row_bytes]``; fp32 ``[M, N]``.

        Raises:
            KernelUnavailableError: x not fp32 contiguous 2-D, a type without an int8 product,
                a weight of another shape, or the kernel refused them.
        """
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
            raise KernelUnavailableError(f"x must be fp32 contiguous [M, K], got {x.dtype}")
        if type_id not in Q8_TYPES:
            raise KernelUnavailableError(f"type {type_id} has no int8-activation product")
        rows, in_features = x.shape
        n = self._gguf_weight(type_id, w, in_features)
        out = torch.empty(rows, n, dtype=torch.float32)
        args = (x.data_ptr(), w.data_ptr(), out.data_ptr(), rows, n, in_features, n)
        if fn(type_id, *args, torch.get_num_threads(), code):
            raise KernelUnavailableError(f"{name} refused type {type_id}, x {tuple(x.shape)}")
        return out

    def takes_fast_large(self, type_id: int, num_rows: int, dtype: torch.dtype) -> bool:
        """Whether a large step of ``num_rows`` rows of a ``dtype`` model runs a ``type_id``
        weight on :meth:`gguf_gemm_fast`: up to :attr:`fast_large_rows` rows; on the AVX2 body
        a float32 model only (a bfloat16 model keeps its bf16 tiles, as with
        :meth:`gguf_gemm_large`)."""
        if num_rows > self.fast_large_rows.get(type_id, 0):
            return False
        return self.q8_isa == "avx512_vnni" or dtype == torch.float32

    def gguf_gemm_fast(self, type_id: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x W^T`` fp32 ``[M, N]`` for any number of rows M, the default engine's large
        steps (gguf_blocks.c ``pagedkv_gguf_gemm_q8_fast``): every row of x rounded to int8 in
        blocks of 32 once, tiles of weight rows unpacked once, one row per lane (VNNI body: 16
        rows, ``dpbusd``, 8 activation rows at a time; AVX2 body: 8 rows, ``maddubs`` summed in
        int16 while it cannot overflow, 4 activation rows at a time), each weight group's
        integer dot (32 elements; Q6_K 16) summed whole before its one float step, as
        llama.cpp does. The values are :meth:`gguf_gemm_large`'s up to fp32 summation order,
        not its bits (the batch-invariant products keep those), but for the interleaved types
        (:data:`INTERLEAVED_TYPES`), whose large product this is (their decode steps' bits).

        Args:
            type_id: a key of :attr:`fast_large_rows`.
            x: fp32 contiguous ``[M, K]``, M >= 1.
            w: uint8 contiguous ``[N, row_bytes(type_id, K)]``.

        Raises:
            KernelUnavailableError: fp32 activations, a type this body does not take here (not
                in :attr:`fast_large_rows`: the float types, and Q8_0 on the AVX2 body), or a
                shape or dtype the kernel does not take.
        """
        if type_id not in self.fast_large_rows:
            raise KernelUnavailableError(
                f"gguf_gemm_fast does not take type {type_id} with {self.activations} "
                f"activations on the {self.q8_isa} body"
            )
        return self._q8_product(
            self._gguf_gemm_q8_fast, "gguf_gemm_fast", type_id, x, w, self._q8_isa_code
        )

    def gguf_gemm_invariant(
        self, type_id: int, x: torch.Tensor, w: torch.Tensor, num_threads: int | None = None
    ) -> torch.Tensor:
        """The batch-invariant ``x W^T`` fp32 ``[M, N]`` for any number of rows M
        (gguf_blocks.c ``pagedkv_gguf_gemm_invariant``): row i is bit for bit
        ``gguf_gemm(type_id, x[i : i + 1], w)`` (the decode step's product of that row alone,
        on these kernels' :attr:`isa`, :attr:`q8_isa` and :attr:`activations`), whatever M,
        the other rows or the thread count.

        Args:
            type_id: the weight's GGML type id (one of :attr:`gguf_types`).
            x: fp32 contiguous ``[M, K]``, M >= 1, K a multiple of the type's block.
            w: uint8 contiguous ``[N, row_bytes(type_id, K)]`` (never written).
            num_threads: OpenMP threads; None = ``torch.get_num_threads()`` (the result does
                not depend on it).

        Raises:
            KernelUnavailableError: a type, shape or dtype the kernel does not take.
        """
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
            raise KernelUnavailableError(f"x must be fp32 contiguous [M, K], got {x.dtype}")
        rows, in_features = x.shape
        if rows < 1:
            raise KernelUnavailableError("gguf_gemm_invariant needs at least one row")
        n = self._gguf_weight(type_id, w, in_features)
        out = torch.empty(rows, n, dtype=torch.float32)
        rc = self._gguf_gemm_invariant(
            type_id,
            x.data_ptr(),
            w.data_ptr(),
            out.data_ptr(),
            rows,
            n,
            in_features,
            n,
            torch.get_num_threads() if num_threads is None else num_threads,
            self._isa_code,
            self._q8_isa_code,
            ACTIVATION_CODES[self.activations],
        )
        if rc:
            raise KernelUnavailableError(
                f"gguf_gemm_invariant refused type {type_id}, x {tuple(x.shape)}"
            )
        return out

    def rms_norm(self, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The fused layers' RMSNorm (decode_layer.c ``pagedkv_rms_norm``), for the model's
        final norm: ``h / sqrt(mean(h^2) + eps) * weight`` row by row, each row's bits
        independent of the others (batch-invariant).

        Args:
            h: fp32 contiguous ``[M, n]``; weight: fp32 contiguous ``[n]``; eps: the epsilon.

        Returns:
            fp32 ``[M, n]``, a new tensor.

        Raises:
            KernelUnavailableError: other dtypes, shapes or layouts.
        """
        if h.dtype != torch.float32 or h.dim() != 2 or not h.is_contiguous():
            raise KernelUnavailableError(f"h must be fp32 contiguous [M, n], got {h.dtype}")
        if (
            weight.dtype != torch.float32
            or weight.shape != (h.shape[1],)
            or not weight.is_contiguous()
        ):
            raise KernelUnavailableError(f"weight must be fp32 contiguous [{h.shape[1]}]")
        out = torch.empty_like(h)
        self._rms_norm(h.data_ptr(), weight.data_ptr(), eps, h.shape[0], h.shape[1], out.data_ptr())
        return out

    def gguf_dequant(
        self, type_id: int, w: torch.Tensor, out: torch.Tensor, row_start: int = 0
    ) -> torch.Tensor:
        """Rows ``row_start .. row_start + R`` of a GGUF weight dequantized into ``out``
        (gguf_blocks.c), bit for bit what ``gguf.quants.dequantize`` gives (fp32), or that
        rounded to nearest even (bf16).

        Args:
            type_id: the weight's GGML type id (one of :attr:`gguf_types`).
            w: uint8 contiguous ``[N, row_bytes(type_id, K)]`` (never written).
            out: fp32 or bf16 contiguous ``[R, K]``, preallocated; returned.
            row_start: the first row, ``0 <= row_start`` and ``row_start + R <= N``.

        Raises:
            KernelUnavailableError: a type, shape, dtype or row range not taken (``out`` is
                then left as it was).
        """
        if out.dtype not in (torch.float32, torch.bfloat16) or out.dim() != 2:
            raise KernelUnavailableError(f"out must be fp32 or bf16 [R, K], got {out.dtype}")
        if not out.is_contiguous():
            raise KernelUnavailableError("out must be contiguous")
        num_rows, in_features = out.shape
        n = self._gguf_weight(type_id, w, in_features)
        if row_start < 0 or row_start + num_rows > n:
            raise KernelUnavailableError(f"rows {row_start} + {num_rows} of a weight of {n}")
        rc = self._gguf_dequant(
            type_id,
            w.data_ptr(),
            row_start,
            num_rows,
            in_features,
            out.data_ptr(),
            int(out.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        if rc:
            raise KernelUnavailableError(f"gguf_dequant refused type {type_id}")
        return out

    def gguf_get_rows(
        self, type_id: int, w: torch.Tensor, ids: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Rows ``ids`` of a GGUF weight (an embedding lookup) dequantized into ``out``, bit
        for bit what ``gguf.quants.dequantize`` gives.

        Args:
            type_id: the weight's GGML type id (one of :attr:`gguf_types`).
            w: uint8 contiguous ``[N, row_bytes(type_id, K)]`` (never written).
            ids: int64 contiguous ``[num_ids]``, each in ``[0, N)``.
            out: fp32 contiguous ``[num_ids, K]``, preallocated; returned.

        Raises:
            KernelUnavailableError: a type, shape or dtype not taken, or an id outside
                ``[0, N)`` (``out`` is then left as it was).
        """
        if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous():
            raise KernelUnavailableError(f"ids must be int64 contiguous [num_ids], got {ids.dtype}")
        if out.dtype != torch.float32 or out.dim() != 2 or not out.is_contiguous():
            raise KernelUnavailableError(
                f"out must be fp32 contiguous [num_ids, K], got {out.dtype}"
            )
        if out.shape[0] != ids.shape[0]:
            raise KernelUnavailableError(f"{ids.shape[0]} ids, out of {out.shape[0]} rows")
        n = self._gguf_weight(type_id, w, out.shape[1])
        rc = self._gguf_rows(
            type_id, w.data_ptr(), ids.data_ptr(), ids.shape[0], n, out.shape[1], out.data_ptr()
        )
        if rc:
            raise KernelUnavailableError(f"gguf_get_rows refused ids outside [0, {n})")
        return out

    def _run(
        self, kernel, name: str, x: torch.Tensor, num_outputs: int, pointers: tuple
    ) -> torch.Tensor:
        """Call ``kernel(x, *pointers, out, M, N, K, threads, isa)``; ``out`` fp32 ``[M, N]``.

        Raises:
            KernelUnavailableError: the kernel refused the shapes (it returned non-zero).
        """
        num_rows, in_features = x.shape
        out = torch.empty(num_rows, num_outputs, dtype=torch.float32)
        rc = kernel(
            x.data_ptr(),
            *pointers,
            out.data_ptr(),
            num_rows,
            num_outputs,
            in_features,
            torch.get_num_threads(),
            self._isa_code,
        )
        if rc:
            raise KernelUnavailableError(f"{name} kernel refused x {tuple(x.shape)}")
        return out

    def self_check(self) -> None:
        """Run both kernels (this :attr:`isa`'s bodies) on small integer inputs whose products
        are exact in fp32 (every row count 1..8, a partial row block, more groups than one
        AVX-512 min step, min present and absent) and compare with torch.

        Raises:
            KernelUnavailableError: a result differs.
        """
        gen = torch.Generator().manual_seed(0)
        n, k = 37, 544
        q4 = torch.randint(0, 16, (n, k), generator=gen)
        scale = torch.randint(-4, 5, (n, k // GROUP_SIZE), generator=gen).float() / 4
        minimum = torch.randint(-8, 9, (n, k // GROUP_SIZE), generator=gen).float()
        q8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scale8 = torch.randint(1, 9, (n,), generator=gen).float() / 8
        dense4 = q4.float() * scale.repeat_interleave(GROUP_SIZE, 1)
        dense8 = q8.float() * scale8[:, None]
        for rows in range(1, MAX_ROWS + 1):
            x = torch.randint(-3, 4, (rows, k), generator=gen).float()
            for mins in (minimum, None):
                dense = dense4 if mins is None else dense4 + mins.repeat_interleave(32, 1)
                got = self.int4(x, *pack_int4(q4, scale, mins))
                if not torch.equal(got, x.double().matmul(dense.double().T).float()):
                    raise KernelUnavailableError(f"int4 self-check failed ({rows} rows)")
            if not torch.equal(self.int8(x, q8, scale8), (x @ dense8.T)):
                raise KernelUnavailableError(f"int8 self-check failed ({rows} rows)")
        self._gguf_self_check(gen)

    def _gguf_self_check(self, gen: torch.Generator) -> None:
        """Each of :attr:`gguf_types` on a small weight (19 rows: a partial row block; K 256)
        whose products are exact in fp32: dequantization bit-identical to
        ``gguf.quants.dequantize``, the product of 1, 3 and 8 integer rows equal to the float64
        one. With int8 activations (:attr:`activations` "q8") the rows of :data:`Q8_TYPES`
        start each block of 32 with 127, so that their rounding to int8 is exact (scale 1, the
        K-types' blocks of 256 too).

        Raises:
            KernelUnavailableError: a result differs.
        """
        if not self.gguf_types:
            return
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        k = 256
        for type_id in sorted(self.gguf_types):
            # an interleaved type: a file's weight of 24 rows (three bands), laid out
            file_type = _FILE_TYPE.get(type_id, type_id)
            n = 19 if file_type == type_id else 24
            w = _exact_gguf_weight(file_type, n, k, gen)
            reference = torch.from_numpy(
                dequantize(w.numpy(), GGMLQuantizationType(file_type)).reshape(n, k)
            )
            if file_type != type_id:
                self.interleave(file_type, w)
            name = ggml_type(type_id).name
            dense = self.gguf_dequant(type_id, w, torch.empty(n, k))
            if not torch.equal(dense.view(torch.int32), reference.view(torch.int32)):
                raise KernelUnavailableError(f"gguf dequant self-check failed ({name})")
            for rows in (1, 3, MAX_ROWS):
                x = torch.randint(-3, 4, (rows, k), generator=gen).float()
                if self.activations == "q8" and type_id in Q8_TYPES:
                    x[:, ::32] = 127.0
                expected = (x.double() @ reference.double().T).float()
                if not torch.equal(self.gguf_gemm(type_id, x, w), expected):
                    raise KernelUnavailableError(
                        f"gguf gemm self-check failed ({name}, {rows} rows)"
                    )


#: Byte offsets of the f16 scale fields of each quantized type's block (d, then m or dmin).
_SCALE_FIELDS = {
    2: (0,),
    3: (0, 2),
    6: (0,),
    7: (0, 2),
    8: (0,),
    12: (0, 2),
    13: (0, 2),
    14: (208,),
}


def _exact_gguf_weight(type_id: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Raw blocks ``[n, row_bytes]`` of a GGML type whose weights are small multiples of 1/16
    (random bits, every f16 scale field set to 1/8 or -1/16; the float types: integers in
    [-8, 8]), so that products with small integer activations are exact in fp32."""
    t = ggml_type(type_id)
    if t.block_elems == 1:
        values = torch.randint(-8, 9, (n, k), generator=gen).float()
        if t.name == "F32":
            return values.view(torch.uint8).reshape(n, -1).contiguous()
        half = values.half() if t.name == "F16" else values.bfloat16()
        return half.view(torch.uint8).reshape(n, -1).contiguous()
    blocks = torch.randint(0, 256, (n, k // t.block_elems, t.block_bytes), generator=gen)
    blocks = blocks.to(torch.uint8)
    for i, offset in enumerate(_SCALE_FIELDS[type_id]):
        scale = torch.tensor([0.125 if i == 0 else -0.0625], dtype=torch.float16)
        blocks[..., offset : offset + 2] = scale.view(torch.uint8)
    return blocks.reshape(n, -1).contiguous()


def build_library(compiler: str, cache: Path, sources: Path | Sequence[Path] = SOURCES) -> Path:
    """Compile ``sources`` into ``cache`` unless an identical build is there
    (:func:`pagedkv.ops.c_build.build_library`, keyed by the sources, :data:`HEADERS`,
    the flags and the compiler).

    Raises:
        KernelUnavailableError: the compiler is missing or the build failed.
    """
    return c_build.build_library(compiler, cache, sources, name="quant_gemv", headers=HEADERS)


def best_isa(caps: CpuCapabilities) -> str:
    """The widest body of the products that runs on ``caps`` (holds applied): "avx512" where
    :func:`pagedkv.ops.c_build.avx512_available`, else "avx2"."""
    return "avx512" if c_build.avx512_available(caps) else "avx2"


def load_cpu_quant_kernels(
    cache: Path,
    compiler: str | None = None,
    caps: CpuCapabilities | None = None,
    fused_layers: bool = True,
    isa: str | None = None,
    activations: str = "q8",
) -> CpuQuantKernels:
    """Build (if needed), load and self-check the kernels.

    Args:
        cache: where the library is built (``$PAGEDKV_CACHE_DIR/kernels``).
        compiler: the C compiler; None = ``$CC`` or ``cc``.
        caps: the CPU's capabilities; None = :func:`pagedkv.cpu_caps.probe_cpu`.
        fused_layers: :attr:`CpuQuantKernels.fused_layers`.
        isa: the products' body ("avx2" or "avx512"); None = the widest this CPU runs
            (:func:`best_isa`).
        activations: :attr:`CpuQuantKernels.activations` ("q8", the default, or "fp32").

    Raises:
        KernelUnavailableError: no AVX2 or FMA (caps applied), "avx512" asked of a CPU without
            it, no compiler, a failed build, a library that does not load, or a failed
            self-check.
    """
    caps = probe_cpu() if caps is None else caps
    c_build.check_avx2_fma(caps)
    widest = best_isa(caps)
    isa = widest if isa is None else isa
    isa_code(isa)  # an unknown name is refused before anything is built
    activations_code(activations)
    if isa == "avx512" and widest != "avx512":
        raise KernelUnavailableError(f"{caps.summary()}: no AVX-512 F/BW/VL/DQ for isa='avx512'")
    compiler = compiler or c_build.compiler()
    path = build_library(compiler, cache)
    try:
        kernels = CpuQuantKernels(path, fused_layers, isa, activations)
    except OSError as e:
        raise KernelUnavailableError(f"{path} does not load: {e}") from None
    kernels.self_check()
    return kernels


def default_cpu_quant_kernels() -> CpuQuantKernels | None:
    """The kernels for this process's choice, or None where torch's run
    (``PAGEDKV_QUANT_KERNEL=torch``, or :func:`load_cpu_quant_kernels` refused: the reason is
    logged). Called once per model load (:func:`pagedkv.model.loader.load_model` attaches the
    result to the model's quantized weights); a build already in the cache is reused, so a
    call costs a hash of the sources, a ``cc --version`` and the self-check.

    ``PAGEDKV_GGUF_ACTIVATIONS`` (:data:`ACTIVATIONS_ENV`) chooses
    :attr:`CpuQuantKernels.activations`: "q8" (default) or "fp32".

    Raises:
        ConfigError: ``PAGEDKV_QUANT_KERNEL`` is not one of :data:`KERNEL_CHOICES`, or
            ``PAGEDKV_GGUF_ACTIVATIONS`` not one of :data:`ACTIVATION_CODES`.
    """
    from pagedkv.errors import ConfigError

    choice = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"{KERNEL_ENV} must be one of {KERNEL_CHOICES}, got {choice!r}")
    activations = os.environ.get(ACTIVATIONS_ENV, "q8").strip().lower() or "q8"
    if activations not in ACTIVATION_CODES:
        raise ConfigError(
            f"{ACTIVATIONS_ENV} must be one of {tuple(ACTIVATION_CODES)}, got {activations!r}"
        )
    if choice == "torch":
        logger.info("quantized products: torch's kernels (%s=torch)", KERNEL_ENV)
        return None
    try:
        kernels = load_cpu_quant_kernels(
            c_build.kernel_cache(),
            c_build.compiler(),
            fused_layers=choice == "auto",
            activations=activations,
        )
    except KernelUnavailableError as e:
        logger.info("quantized products: torch's kernels (pagedkv's do not run here: %s)", e)
        return None
    logger.info(
        "quantized products: pagedkv's %s kernels%s, GGUF activations %s (%s)",
        kernels.isa.upper().replace("AVX512", "AVX-512"),
        ", fused decoder layers" if kernels.fused_layers else "",
        f"int8 ({kernels.q8_isa.upper().replace('AVX512_', 'AVX-512 ')} body)"
        if kernels.activations == "q8"
        else f"fp32 ({ACTIVATIONS_ENV}=fp32)",
        kernels.path,
    )
    return kernels
