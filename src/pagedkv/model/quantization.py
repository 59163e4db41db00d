"""Weight-only quantized linears: int4 with group scales, int8 per output channel.

At batch 1 a CPU decode step is bound by the bytes of weight it reads: SmolLM2-135M's linears
are 424 MB in float32, 212 MB in bfloat16, 70 MB as the GGUF file's 4-bit blocks. llama.cpp
computes on those blocks as stored; pagedkv does the same through torch's CPU weight-only
kernels, which unpack the weight inside the product:

    int4    ``torch.ops.aten._weight_int4pack_mm_for_cpu``: ``w = (q - 8) * scale + zero``,
            q in [0, 16), one (scale, zero) per group of ``group_size`` input features of an
            output row; activations, scales and output in bfloat16
    int8    ``torch.ops.aten._weight_int8pack_mm``: ``w = q * scale``, q in [-128, 128), one
            scale per output row; activations, scales and output in bfloat16 or float32

These forms are made at load (``--quantization int4`` / ``int8``, any model). A GGUF file's
blocks are not converted to them: they stay as the file stores them and run on pagedkv's own
products (:mod:`pagedkv.model.gguf_weight`). torch's kernels take their scales in bfloat16, so
a scale is rounded to bfloat16: a weight moves by at most 1/64 of its group's quantization step.

On an AVX2 CPU pagedkv runs its own kernels for these small steps instead
(:mod:`pagedkv.model.kernels.cpu_quant`: fp32 activations, the blocks read as stored, 1.4-1.6x
torch's AVX2 speed for int4 and 2x for int8; docs/perf.md); torch's stay the fallback.

These kernels win at batch 1 and lose at larger batches (a product of 64 rows ran at half the
speed of oneDNN's packed float32 on an AVX2 EPYC): a :class:`~pagedkv.model.packed_linear.
PackedLinear` keeps its dense packed weight and uses the quantized one only for steps of at
most :data:`QUANT_MAX_TOKENS` tokens (docs/perf.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.errors import ConfigError
from pagedkv.model.kernels.cpu_quant import MAX_ROWS, CpuQuantKernels, pack_int4

#: Steps of at most this many tokens run the quantized weights; larger ones the dense packed
#: weights (measured crossover on a 2-core AVX2 EPYC: 16 rows ran 1.2x slower quantized, 64 rows
#: 1.8x; docs/perf.md).
QUANT_MAX_TOKENS = 8
#: Input features per int4 group (GGUF's 4-bit formats use 32).
INT4_GROUP_SIZE = 32


@dataclass(slots=True)
class QuantizedWeight:
    """A linear weight ``[out_features, in_features]`` as integers and scales (plain tensors).

    ``w[n, k] = q[n, k] * scale[n, k // group_size] + min[n, k // group_size]`` (``min`` None:
    0). int4: q uint8 in [0, 16), group_size 32. int8: q int8, group_size = in_features (one
    scale per row), ``min`` None.

    Attributes:
        bits: 4 or 8.
        q: ``[out_features, in_features]`` uint8 (4 bits) or int8 (8 bits).
        scale: ``[out_features, num_groups]`` float32.
        min: ``[out_features, num_groups]`` float32, or None.
        group_size: input features per group.
        kernels: pagedkv's loaded kernels that run this weight's small steps
            (:mod:`pagedkv.model.kernels.cpu_quant`; the loader attaches them), or None for
            torch's; kept by :meth:`rows` and :meth:`cat`.
    """

    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    group_size: int
    kernels: CpuQuantKernels | None = field(default=None, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out_features, in_features]`` these integers stand for."""
        scale = self.scale.repeat_interleave(self.group_size, dim=1)
        w = self.q.float() * scale
        if self.min is not None:
            w += self.min.repeat_interleave(self.group_size, dim=1)
        return w

    def rows(self, index: slice | torch.Tensor) -> QuantizedWeight:
        """The same weight restricted to output rows ``index``."""
        return QuantizedWeight(
            self.bits,
            self.q[index],
            self.scale[index],
            None if self.min is None else self.min[index],
            self.group_size,
            self.kernels,
        )

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Output rows of ``parts`` stacked (q, k and v into one product).

        Raises:
            ConfigError: parts of different bits or group sizes.
        """
        first = parts[0]
        if any(p.bits != first.bits or p.group_size != first.group_size for p in parts):
            raise ConfigError("cannot stack quantized weights of different formats")
        mins = [p.min for p in parts]
        if any(m is None for m in mins) and not all(m is None for m in mins):
            mins = [torch.zeros_like(p.scale) if p.min is None else p.min for p in parts]
        return QuantizedWeight(
            first.bits,
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            None if mins[0] is None else torch.cat(mins),
            first.group_size,
            first.kernels,
        )


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> QuantizedWeight:
    """Group-wise asymmetric int4 of a float weight ``[out_features, in_features]``: each group's
    range ``[min, max]`` in 15 steps (round to nearest; what ``--quantization int4`` does to a
    safetensors model at load).

    Raises:
        ConfigError: in_features not a multiple of ``group_size``.
    """
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ConfigError(
            f"int4 quantization needs in_features ({in_features}) to be a multiple of {group_size}"
        )
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    lo = groups.amin(dim=-1)
    hi = groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((groups - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15)
    return QuantizedWeight(4, q.to(torch.uint8).reshape(weight.shape), scale, lo, group_size)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 with one scale per output row (``max |w| / 127``) of a float weight
    ``[out_features, in_features]`` (round to nearest)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w / scale).round_().clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(8, q, scale, None, w.shape[1])


def int4_kernel_available() -> bool:
    """Whether torch's CPU int4 weight-only product runs here (a tiny one is tried and
    checked)."""
    try:
        q = torch.arange(64, dtype=torch.int32).remainder(16).reshape(2, 32).repeat(8, 2)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scales = torch.ones(2, 16, 2, dtype=torch.bfloat16)
        scales[..., 1] = 0
        x = torch.ones(1, 64, dtype=torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales)
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out.float(), (q.float() - 8).sum(dim=1)[None]))


def int8_kernel_available() -> bool:
    """Whether torch's CPU int8 weight-only product runs here (a tiny one is tried)."""
    try:
        q = torch.ones(8, 16, dtype=torch.int8)
        out = torch.ops.aten._weight_int8pack_mm(
            torch.ones(1, 16, dtype=torch.bfloat16), q, torch.ones(8, dtype=torch.bfloat16)
        )
    except (RuntimeError, AttributeError):
        return False
    return bool((out.float() == 16).all())


class QuantizedMatmul:
    """``x W^T`` on a :class:`QuantizedWeight`, packed once for the kernel that runs it.

    With ``kernels`` (:mod:`pagedkv.model.kernels.cpu_quant`, AVX2): int4 weights with groups
    of 32 and int8 weights with one scale per row run pagedkv's kernels on fp32 activations
    (the dequantized weights' numbers); anything else, or ``kernels`` None, torch's kernels
    with bf16 activations and scales.

    Args:
        weight: int4 with groups of 32, 64, 128 or 256 input features, or int8 with one scale
            per row.
        kernels: pagedkv's loaded kernels, or None for torch's
            (:func:`~pagedkv.model.kernels.cpu_quant.default_cpu_quant_kernels` gives this
            process's choice).

    Raises:
        ConfigError: a weight the kernels cannot take.
    """

    __slots__ = ("bits", "group_size", "kernels", "min", "packed", "scales")

    def __init__(self, weight: QuantizedWeight, kernels: CpuQuantKernels | None = None):
        self.bits = weight.bits
        self.group_size = weight.group_size
        in_features = weight.shape[1]
        if weight.bits not in (4, 8):
            raise ConfigError(f"quantized weights have 4 or 8 bits, got {weight.bits}")
        if weight.bits == 4 and (
            weight.group_size not in (32, 64, 128, 256) or in_features % weight.group_size
        ):
            raise ConfigError(f"int4 group size {weight.group_size} is not supported")
        if weight.bits == 8 and weight.scale.shape[1] != 1:
            raise ConfigError("int8 weights need one scale per row")
        ours = in_features % INT4_GROUP_SIZE == 0 and (
            weight.bits == 8 or weight.group_size == INT4_GROUP_SIZE
        )
        #: pagedkv's kernels when they run this weight, else None (torch's).
        self.kernels = kernels if ours else None
        #: int4 for pagedkv's kernels: fp32 ``[out_features, num_groups]`` or None.
        self.min = None
        if self.kernels is not None and weight.bits == 4:
            self.packed, self.scales, self.min = pack_int4(weight.q, weight.scale, weight.min)
        elif self.kernels is not None:
            self.packed = weight.q.contiguous()
            self.scales = weight.scale[:, 0].float().contiguous()
        elif weight.bits == 4:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weight.q.to(torch.int32).contiguous(), 1
            )
            # the kernel's form: (q - 8) * scale + zero, [num_groups, out_features, 2] bf16
            minimum = torch.zeros_like(weight.scale) if weight.min is None else weight.min
            zero = minimum + 8 * weight.scale
            self.scales = torch.stack([weight.scale, zero], dim=-1).transpose(0, 1)
            self.scales = self.scales.to(torch.bfloat16).contiguous()
        else:
            self.packed = weight.q.contiguous()
            self.scales = weight.scale[:, 0].to(torch.bfloat16).contiguous()

    @property
    def kernel_dtype(self) -> torch.dtype:
        """The dtype the kernel returns without a conversion: float32 for pagedkv's, bfloat16
        for torch's."""
        return torch.bfloat16 if self.kernels is None else torch.float32

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x W^T`` ``[num_tokens, out_features]`` for x ``[num_tokens, in_features]``,
        returned in ``out_dtype`` (None: x's dtype). pagedkv's kernels compute from fp32
        activations, torch's from bf16 ones."""
        out_dtype = x.dtype if out_dtype is None else out_dtype
        if self.kernels is not None:
            y = self._ours(x.float().contiguous())
        else:
            xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
            if self.bits == 4:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    xb, self.packed, self.group_size, self.scales
                )
            else:
                y = torch.ops.aten._weight_int8pack_mm(xb, self.packed, self.scales)
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def _ours(self, x: torch.Tensor) -> torch.Tensor:
        """pagedkv's kernel on fp32 contiguous x, at most :data:`MAX_ROWS` rows a call."""
        if x.shape[0] == 0:
            return x.new_empty(0, self.packed.shape[0])
        if x.shape[0] > MAX_ROWS:
            return torch.cat([self._ours(part) for part in x.split(MAX_ROWS)])
        if self.bits == 4:
            return self.kernels.int4(x, self.packed, self.scales, self.min)
        return self.kernels.int8(x, self.packed, self.scales)
