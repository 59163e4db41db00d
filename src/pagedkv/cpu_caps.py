"""What this CPU computes fast, as torch and oneDNN will run it, and the dtype that follows.

The bf16 fast path of a CPU engine exists only where the CPU has bf16 arithmetic (Intel AMX,
AVX-512-BF16, AVX-NE-CONVERT): there oneDNN's prepacked bf16 GEMM is about 3x fp32. On an
AVX2-only CPU (most laptops, AMD before Zen 4) the same bf16 GEMM runs a scalar fallback at
1-2% of fp32's speed, and oneDNN refuses to prepack bf16 weights at all
(``mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw...``).
So the compute dtype and every CPU-specific fast path follow this probe (docs/perf.md).

Caps: ``ONEDNN_MAX_CPU_ISA`` (oneDNN's) and ``ATEN_CPU_CAPABILITY`` (ATen's kernel dispatch)
hold those libraries to a lower instruction set (``MKL_ENABLE_INSTRUCTIONS`` holds MKL, which
runs fp32 ``F.linear`` for transformers and vLLM but not pagedkv's linears: it is reported, and
changes nothing here). torch's own feature checks
(``torch.cpu._is_avx512_bf16_supported()``, ``_is_amx_tile_supported()``) read the CPU's flags
and ignore them, so the probe treats these variables as a cap on what the CPU has: with
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` an AMX machine takes exactly the code paths
of an AVX2-only CPU (how the tests prove the AVX2 default on any machine).

:func:`resolve_dtype` turns ``dtype="auto"`` (vLLM's ``--dtype auto``) into bfloat16 where the
CPU computes bf16 natively (or on CUDA) and float32 elsewhere. The module imports no torch;
:func:`probe_cpu` imports it when called.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pagedkv.errors import ConfigError

#: Compute dtypes the engine runs, and "auto".
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")

#: oneDNN's ``ONEDNN_MAX_CPU_ISA`` values, lowest first (oneDNN's ``cpu_isa_t`` order; the
#: AVX10 names are aliases of the AVX512_CORE_FP16 / AMX ones). ALL and DEFAULT cap nothing.
ONEDNN_ISA_ORDER = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX512_CORE_AMX",
    "AVX512_CORE_AMX_FP16",
)
_ONEDNN_ALIASES = {
    "AVX10_1_512": "AVX512_CORE_FP16",
    "AVX10_1_512_AMX": "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16": "AVX512_CORE_AMX_FP16",
}
#: The least ``ONEDNN_MAX_CPU_ISA`` at which each feature stays usable.
_ONEDNN_NEEDS = {
    "avx2": "AVX2",
    "avx_ne_convert": "AVX2_VNNI_2",
    "avx512": "AVX512_CORE",
    "avx512_bf16": "AVX512_CORE_BF16",
    "amx": "AVX512_CORE_AMX",
}
#: ATen's ``ATEN_CPU_CAPABILITY`` values (x86), lowest first.
ATEN_CAPABILITY_ORDER = ("default", "avx2", "avx512")
_ATEN_NEEDS = {
    "avx2": "avx2",
    "avx_ne_convert": "avx2",
    "avx512": "avx512",
    "avx512_bf16": "avx512",
    "amx": "avx512",
}
#: MKL's ``MKL_ENABLE_INSTRUCTIONS`` values below AVX-512 (MKL runs torch's fp32 ``F.linear``).
_MKL_BELOW_AVX512 = ("SSE4_2", "AVX", "AVX2")


@dataclass(frozen=True, slots=True)
class CpuCapabilities:
    """What the CPU offers to torch and oneDNN in this process, caps applied.

    Attributes:
        name: the CPU's model name (``/proc/cpuinfo``), or the machine type where unknown.
        arch: ``platform.machine()`` ("x86_64", "aarch64", "arm64", ...).
        avx2, avx512, avx512_bf16, amx, avx_ne_convert: x86 features (AVX-512 here means the
            F/BW/VL/DQ core that oneDNN's bf16 emulation needs; amx means AMX-BF16 tiles).
        onednn_bf16: oneDNN runs bf16 GEMMs here (natively or emulated on an AVX-512 core);
            where False a bf16 weight cannot be prepacked.
        onednn_fp16: oneDNN runs float16 GEMMs here.
        aten_capability: ATen's vector kernel level (``torch.backends.cpu.get_cpu_capability()``:
            "AVX2", "AVX512", "DEFAULT", "SVE256", ...).
        caps: the cap variables in force (``{"ONEDNN_MAX_CPU_ISA": "AVX2", ...}``), empty when
            none.
    """

    name: str
    arch: str
    avx2: bool = False
    avx512: bool = False
    avx512_bf16: bool = False
    amx: bool = False
    avx_ne_convert: bool = False
    onednn_bf16: bool = False
    onednn_fp16: bool = False
    aten_capability: str = "DEFAULT"
    caps: tuple[tuple[str, str], ...] = ()

    @property
    def native_bf16(self) -> bool:
        """The CPU computes bf16 in hardware (AMX, AVX-512-BF16 or AVX-NE-CONVERT) and oneDNN
        uses it: where bf16 is the fast dtype."""
        return self.onednn_bf16 and (self.amx or self.avx512_bf16 or self.avx_ne_convert)

    @property
    def isa(self) -> str:
        """The best instruction-set level in one word: "AMX", "AVX512_BF16", "AVX512", "AVX2",
        or ATen's level on other architectures ("SVE256", "DEFAULT", ...)."""
        for flag, word in (
            ("amx", "AMX"),
            ("avx512_bf16", "AVX512_BF16"),
            ("avx512", "AVX512"),
            ("avx2", "AVX2"),
        ):
            if getattr(self, flag):
                return word
        if self.arch in ("x86_64", "AMD64", "i686"):
            return "below AVX2"
        return self.aten_capability

    def describe(self, dtype: str | None = None) -> str:
        """``AMD EPYC 7B13, AVX2, no native bf16 -> float32 compute`` (the dtype part only
        when ``dtype`` is given; the caps in force are named after the ISA)."""
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        capped = ""
        if self.caps:
            capped = " (capped by " + " ".join(f"{k}={v}" for k, v in self.caps) + ")"
        line = f"{self.name}, {self.isa}{capped}, {bf16}"
        if dtype is None:
            return line
        slow = (dtype == "bfloat16" and not self.native_bf16) or (
            dtype == "float16" and not self.onednn_fp16
        )
        return f"{line} -> {dtype} compute" + (", linears in float32 (slow path)" if slow else "")

    def summary(self, dtype: str | None = None) -> str:
        """The start-up log line: ``CPU: `` and :meth:`describe`."""
        return "CPU: " + self.describe(dtype)

    def as_dict(self) -> dict[str, object]:
        """Plain data for JSON (the bench commands' results)."""
        return {
            "summary": self.describe(),
            "name": self.name,
            "arch": self.arch,
            "isa": self.isa,
            "native_bf16": self.native_bf16,
            "onednn_bf16": self.onednn_bf16,
            "aten_capability": self.aten_capability,
            "caps": dict(self.caps),
        }


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name ("AMD EPYC 7B13", "Intel(R) Xeon(R) Processor"), from
    ``/proc/cpuinfo`` where it exists, else ``platform.processor()`` or the machine type."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where it does not exist)."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def isa_caps(environ: Mapping[str, str]) -> dict[str, str]:
    """The cap variables in ``environ`` that hold a library below what it would run: values the
    library knows and that cap something (oneDNN's ALL / DEFAULT, ATen's ``avx512``, MKL's
    AVX-512 levels, and values a library ignores, such as ATen's ``AVX2`` in capitals, are left
    out, as the libraries leave them)."""
    out = {}
    onednn = environ.get("ONEDNN_MAX_CPU_ISA", "").strip()
    if _ONEDNN_ALIASES.get(onednn.upper(), onednn.upper()) in ONEDNN_ISA_ORDER:
        out["ONEDNN_MAX_CPU_ISA"] = onednn
    aten = environ.get("ATEN_CPU_CAPABILITY", "").strip()
    if aten in ATEN_CAPABILITY_ORDER[:-1]:  # torch reads lower case only; avx512 is its top
        out["ATEN_CPU_CAPABILITY"] = aten
    mkl = environ.get("MKL_ENABLE_INSTRUCTIONS", "").strip()
    if mkl.upper() in _MKL_BELOW_AVX512:
        out["MKL_ENABLE_INSTRUCTIONS"] = mkl
    return out


def feature_allowed(feature: str, caps: Mapping[str, str]) -> bool:
    """Whether the caps in ``caps`` (:func:`isa_caps`) leave ``feature`` ("avx2", "avx512",
    "avx512_bf16", "amx", "avx_ne_convert") usable to pagedkv's fast paths. oneDNN's and ATen's
    caps count; MKL's does not (MKL runs only fp32 ``F.linear``, which pagedkv's linears do not
    use: it is reported, for the benchmarks that compare against MKL users)."""
    onednn = caps.get("ONEDNN_MAX_CPU_ISA", "").upper()
    onednn = _ONEDNN_ALIASES.get(onednn, onednn)
    if onednn in ONEDNN_ISA_ORDER and ONEDNN_ISA_ORDER.index(onednn) < ONEDNN_ISA_ORDER.index(
        _ONEDNN_NEEDS[feature]
    ):
        return False
    aten = caps.get("ATEN_CPU_CAPABILITY", "")
    return not (
        aten in ATEN_CAPABILITY_ORDER
        and ATEN_CAPABILITY_ORDER.index(aten) < ATEN_CAPABILITY_ORDER.index(_ATEN_NEEDS[feature])
    )


def probe_cpu(environ: Mapping[str, str] | None = None) -> CpuCapabilities:
    """Ask torch, oneDNN and the CPU's flags what this process can use (imports torch; cheap:
    the engine and the vllm-cpu backend each ask at start).

    Args:
        environ: where the cap variables are read; None = ``os.environ`` (they take effect when
            torch loads, so they must be set before that; a test sets them in a subprocess).

    Returns:
        The capabilities, each feature capped by ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY``.
    """
    import torch

    caps = isa_caps(os.environ if environ is None else environ)
    arch = platform.machine()
    x86 = arch in ("x86_64", "AMD64", "i686")
    flags = cpu_flags()
    raw = {
        "avx2": x86 and torch.cpu._is_avx2_supported(),
        "avx512": x86 and torch.cpu._is_avx512_supported(),
        "avx512_bf16": x86 and torch.cpu._is_avx512_bf16_supported(),
        "amx": x86 and torch.cpu._is_amx_tile_supported(),
        "avx_ne_convert": x86 and "avx_ne_convert" in flags,
    }
    features = {k: v and feature_allowed(k, caps) for k, v in raw.items()}
    mkldnn_ok = torch.backends.mkldnn.is_available()
    return CpuCapabilities(
        name=cpu_model_name(),
        arch=arch,
        onednn_bf16=mkldnn_ok and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        onednn_fp16=mkldnn_ok and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
        aten_capability=torch.backends.cpu.get_cpu_capability(),
        caps=tuple(caps.items()),
        **features,
    )


def resolve_dtype(requested: str, caps: CpuCapabilities | None, device_type: str = "cpu") -> str:
    """The compute dtype for ``requested`` (vLLM's ``--dtype``).

    "auto" is bfloat16 on CUDA and on a CPU that computes bf16 natively
    (:attr:`CpuCapabilities.native_bf16`), else float32: held to AVX2, 2 cores ran an fp32 GEMM
    at 198 GFLOP/s and a bf16 one at 2 (a decode-shaped linear: 163 vs 30; docs/perf.md). Any
    other value is
    returned as given (an explicit bfloat16 on such a CPU still runs: the linears compute in
    fp32 on bf16-rounded weights, see :mod:`pagedkv.model.packed_linear`).

    Args:
        requested: one of :data:`DTYPE_CHOICES`.
        caps: this CPU's capabilities (:func:`probe_cpu`); read only for "auto" on the CPU.
        device_type: "cpu" or "cuda".

    Raises:
        ConfigError: an unknown dtype name.
    """
    if requested not in DTYPE_CHOICES:
        raise ConfigError(f"dtype must be one of {DTYPE_CHOICES}, got {requested!r}")
    if requested != "auto":
        return requested
    if device_type != "cpu":
        return "bfloat16"
    return "bfloat16" if caps is not None and caps.native_bf16 else "float32"
