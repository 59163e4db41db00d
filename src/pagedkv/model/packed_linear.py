"""Linear layers with weights prepacked for oneDNN, and their fused epilogues.

On the CPUs this project targets, oneDNN's GEMM with a weight reordered once at load time into its
blocked layout is faster than ``F.linear`` (MKL), most of all in fp32 (docs/perf.md: fp32 decode
41 -> 17 ms per step). oneDNN also fuses an elementwise epilogue into the GEMM, which saves a
Python-level op and a pass over memory: ``silu(x W^T)`` or tanh-``gelu(x W^T)`` (gate),
``(x W^T) * other`` (up, times the activated gate) and ``(x W^T) + other`` (the residual add after
o_proj and down_proj).

The ops are ``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise`` (the ones
inductor's freezing pass emits). How a layer runs (:func:`linear_mode`) follows what this CPU has
(:mod:`pagedkv.cpu_caps`):

    packed        oneDNN, weight prepacked in the compute dtype: float32 anywhere oneDNN runs,
                  bfloat16 where the CPU computes bf16 natively (AMX, AVX-512-BF16,
                  AVX-NE-CONVERT)
    fp32_compute  a bfloat16 / float16 model on a CPU without native support for it: the weight
                  is rounded to the model dtype (the model's numbers stay those of a bf16 model)
                  and prepacked in float32; inputs go in as float32, outputs come back in the
                  model dtype. oneDNN refuses to prepack bf16 without AVX-512 or AVX-NE-CONVERT
                  (the AVX2 crash this replaces), and where it emulates bf16 on an AVX-512 core
                  its GEMM measured 62 vs 263 GFLOP/s for fp32 (512^3, 2 threads; docs/perf.md)
    plain         ``F.linear`` in the model dtype: another device, a torch without oneDNN, or
                  float16 where oneDNN runs it

A layer may also hold its weight quantized (:mod:`pagedkv.model.quantization`: the GGUF file's
4-bit blocks, or int4 / int8 made at load): a step of at most ``QUANT_MAX_TOKENS`` tokens (a
decode of a few requests) then runs the weight-only quantized product and the epilogue as a
separate op, reading a quarter to an eighth of the bytes; larger steps run the dense weight.

Or it holds no dense weight at all: a GGUF weight kept as the file stores it
(:class:`~pagedkv.model.gguf_weight.GGUFWeight`, or several stacked: q, k and v) runs every
step through :class:`~pagedkv.model.gguf_weight.GGUFMatmul`, its epilogue a separate op.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pagedkv.cpu_caps import CpuCapabilities, probe_cpu
from pagedkv.errors import ConfigError
from pagedkv.model.gguf_weight import GGUFMatmul, GGUFWeight
from pagedkv.model.quantization import QUANT_MAX_TOKENS, QuantizedMatmul, QuantizedWeight

logger = logging.getLogger(__name__)

#: Values of :func:`linear_mode` (see the module docs).
LINEAR_MODES = ("packed", "fp32_compute", "plain")


def onednn_available(device: torch.device | str) -> bool:
    """Whether prepacked oneDNN linears can run on ``device`` with this torch build."""
    return (
        torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def linear_mode(
    device: torch.device | str, dtype: torch.dtype, caps: CpuCapabilities | None = None
) -> str:
    """How a model's linears run on ``device`` in ``dtype`` (one of :data:`LINEAR_MODES`).

    Args:
        device: where the weights live.
        dtype: the model's compute dtype.
        caps: the CPU's capabilities; None = :func:`pagedkv.cpu_caps.probe_cpu`.
    """
    if not onednn_available(device) or not onednn_packs(torch.float32):
        return "plain"
    if dtype == torch.float32:
        return "packed"
    caps = probe_cpu() if caps is None else caps
    if dtype == torch.bfloat16 and caps.native_bf16 and onednn_packs(dtype):
        return "packed"
    if dtype == torch.float16 and caps.onednn_fp16:
        return "plain"
    return "fp32_compute"


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks and runs a linear in ``dtype`` on this CPU: a tiny one is tried
    (what oneDNN will actually run, whatever the flags say; an ARM64 or old x86 build may
    refuse)."""
    try:
        weight = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        out = torch.ops.mkldnn._linear_pointwise(weight, packed, None, "none", [], "")
    except RuntimeError:
        return False
    return bool((out == 8).all())


def log_linear_mode(mode: str, dtype: torch.dtype, caps: CpuCapabilities | None = None) -> None:
    """One warning when ``mode`` is the slow ``fp32_compute`` (a model loads once: once per
    load), naming the CPU and the faster choice."""
    if mode != "fp32_compute":
        return
    caps = probe_cpu() if caps is None else caps
    name = str(dtype).removeprefix("torch.")
    logger.warning(
        "%s: no native %s here, so the linears compute in float32 on %s-rounded weights "
        "(slower than --dtype float32, which is what --dtype auto picks on this CPU)",
        caps.summary(),
        name,
        name,
    )


class PackedLinear:
    """``y = x W^T (+ b)`` with optional fused epilogues; weight packed once for oneDNN.

    Args:
        weight: ``[out_features, in_features]`` in the compute dtype; or a GGUF weight as the
            file stores it, or a sequence of them stacked on the output features (every step
            then runs :class:`~pagedkv.model.gguf_weight.GGUFMatmul`, no dense copy).
        bias: ``[out_features]`` or None.
        mode: one of :data:`LINEAR_MODES` (:func:`linear_mode` chooses it for a CPU).
        quant: the same weight quantized, run for steps of at most
            :data:`~pagedkv.model.quantization.QUANT_MAX_TOKENS` tokens; None = dense only.

    Raises:
        ConfigError: an unknown mode, or a quantized weight of another shape or one the
            kernels cannot take.
    """

    __slots__ = ("bias", "dtype", "gguf", "out_features", "packed", "quant", "upcast", "weight")

    def __init__(
        self,
        weight: torch.Tensor | GGUFWeight | Sequence[GGUFWeight],
        bias: torch.Tensor | None = None,
        mode: str = "packed",
        quant: QuantizedWeight | None = None,
    ):
        if mode not in LINEAR_MODES:
            raise ConfigError(f"mode must be one of {LINEAR_MODES}, got {mode!r}")
        #: the product on the file's blocks (every step), or None for a dense weight.
        self.gguf = None
        if isinstance(weight, GGUFWeight) or (
            isinstance(weight, Sequence) and weight and isinstance(weight[0], GGUFWeight)
        ):
            if quant is not None:
                raise ConfigError("a GGUF weight kept as stored takes no second quantized form")
            self.gguf = GGUFMatmul([weight] if isinstance(weight, GGUFWeight) else weight)
            self.quant = None
            self.out_features = self.gguf.out_features
            self.dtype = self.gguf.dtype
            self.upcast = False
            self.bias = bias
            self.packed = self.weight = None
            return
        if quant is not None and quant.shape != tuple(weight.shape):
            raise ConfigError(
                f"quantized weight {quant.shape} does not match the weight {tuple(weight.shape)}"
            )
        #: the quantized product for small steps, or None.
        self.quant = None if quant is None else QuantizedMatmul(quant, quant.kernels)
        self.out_features = weight.shape[0]
        self.dtype = weight.dtype
        #: inputs go in as float32 and outputs come back in ``dtype`` (mode fp32_compute).
        self.upcast = mode == "fp32_compute" and weight.dtype != torch.float32
        if self.upcast and bias is not None:
            bias = bias.float()
        self.bias = bias
        if mode == "plain":
            self.packed = None
            self.weight = weight
        else:
            packed = weight.float() if self.upcast else weight
            self.packed = torch.ops.mkldnn._reorder_linear_weight(packed.contiguous())
            self.weight = None  # the packed copy replaces it

    def _run(self, x, attr: str, scalars: list, algorithm: str) -> torch.Tensor:
        if self.upcast:
            y = torch.ops.mkldnn._linear_pointwise(
                x.float(), self.packed, self.bias, attr, scalars, algorithm
            )
            return y.to(self.dtype)
        return torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, attr, scalars, algorithm
        )

    def _binary(self, x, other, op: str) -> torch.Tensor:
        if self.upcast:
            y = torch.ops.mkldnn._linear_pointwise.binary(
                x.float(), other.float(), self.packed, self.bias, op
            )
            return y.to(self.dtype)
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, op)

    def _small(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x W^T + b`` through the GGUF weight (every step), or the quantized weight when
        this step is small enough; else None."""
        if self.gguf is not None:
            y = self.gguf(x)
            return y if self.bias is None else y.add_(self.bias)
        if self.quant is None or x.shape[0] > QUANT_MAX_TOKENS:
            return None
        y = self.quant(x, self.dtype)
        return y if self.bias is None else y.add_(self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` for x ``[num_tokens, in_features]``."""
        if (y := self._small(x)) is not None:
            return y
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return self._run(x, "none", [], "")

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x W^T + b)``."""
        if (y := self._small(x)) is not None:
            return F.silu(y, inplace=True)
        if self.packed is None:
            return F.silu(F.linear(x, self.weight, self.bias))
        return self._run(x, "swish", [], "")

    def gelu_tanh(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(x W^T + b)`` with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
        if (y := self._small(x)) is not None:
            return F.gelu(y, approximate="tanh")
        if self.packed is None:
            return F.gelu(F.linear(x, self.weight, self.bias), approximate="tanh")
        return self._run(x, "gelu", [], "tanh")

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``(x W^T + b) * other``; other ``[num_tokens, out_features]``."""
        if (y := self._small(x)) is not None:
            return y.mul_(other)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias).mul_(other)
        return self._binary(x, other, "mul")

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``(x W^T + b) + other``; other ``[num_tokens, out_features]`` (the residual)."""
        if (y := self._small(x)) is not None:
            return y.add_(other)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias).add_(other)
        return self._binary(x, other, "add")
