"""Linear layers with weights prepacked for oneDNN, and their fused epilogues.

On the CPUs this project targets, oneDNN's GEMM with a weight reordered once at load time into its
blocked layout is faster than ``F.linear`` (MKL), most of all in fp32 (docs/perf.md: fp32 decode
41 -> 17 ms per step). oneDNN also fuses an elementwise epilogue into the GEMM, which saves a
Python-level op and a pass over memory: ``silu(x W^T)`` or tanh-``gelu(x W^T)`` (gate),
``(x W^T) * other`` (up, times the activated gate) and ``(x W^T) + other`` (the residual add after
o_proj and down_proj).

The ops are ``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise`` (the ones
inductor's freezing pass emits). Where they are missing (another device, a torch without oneDNN)
the same methods fall back to ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_available(device: torch.device | str) -> bool:
    """Whether prepacked oneDNN linears can run on ``device`` with this torch build."""
    return (
        torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear:
    """``y = x W^T (+ b)`` with optional fused epilogues; weight packed once for oneDNN.

    Args:
        weight: ``[out_features, in_features]`` in the compute dtype.
        bias: ``[out_features]`` or None.
        pack: prepack for oneDNN (CPU); False = plain ``F.linear``.
    """

    __slots__ = ("bias", "out_features", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.out_features = weight.shape[0]
        self.bias = bias
        if pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            self.weight = None  # the packed copy replaces it (halves weight memory)
        else:
            self.packed = None
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` for x ``[num_tokens, in_features]``."""
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x W^T + b)``."""
        if self.packed is None:
            return F.silu(F.linear(x, self.weight, self.bias))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "swish", [], "")

    def gelu_tanh(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(x W^T + b)`` with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
        if self.packed is None:
            return F.gelu(F.linear(x, self.weight, self.bias), approximate="tanh")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "gelu", [], "tanh")

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``(x W^T + b) * other``; other ``[num_tokens, out_features]``."""
        if self.packed is None:
            return F.linear(x, self.weight, self.bias).mul_(other)
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "mul")

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``(x W^T + b) + other``; other ``[num_tokens, out_features]`` (the residual)."""
        if self.packed is None:
            return F.linear(x, self.weight, self.bias).add_(other)
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "add")
