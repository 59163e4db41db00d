"""Rotary position embeddings (RoPE, Su et al. 2021) in Hugging Face's rotate-half layout.

Dimension ``j`` of a head is rotated together with dimension ``j + head_dim/2``::

    out = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]

The cos/sin tables cover every position up to max_position_embeddings and are built once; a
forward only gathers the rows of its positions. ``sin`` is stored sign-folded (``[-sin, sin]``)
so that ``rotate_half(x) * sin == roll(x, head_dim/2) * sin_folded``: one op fewer per layer.

Phi-3's LongRoPE (``rope_type`` "longrope") divides each inverse frequency by a per-frequency
factor, the short ones below ``original_max_position_embeddings``, the long ones from there on,
and multiplies cos and sin by its ``attention_factor``. The choice is per position: a token's
key is rotated once, with its own position's factors, which is what transformers gives a
sequence that grows past the original context one forward at a time (transformers picks the
factors per forward from its longest position, so a single prompt longer than the original
context rotates its early tokens with the long factors there; vLLM likewise per batch).
"""

from __future__ import annotations

import math

import torch

from pagedkv.errors import ModelLoadError
from pagedkv.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` fp32, with the config's rope scaling applied.

    Supports no scaling, "linear" (positions divided by ``factor``), "llama3" (Llama 3.1's
    wavelength-dependent scaling), "freq_factors" (GGUF's per-frequency divisors) and
    "longrope" (the short factors' frequencies here; see :func:`longrope_long_inv_freq`).

    Raises:
        ModelLoadError: an unsupported rope_scaling type.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if rope_type == "longrope":
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"rope_scaling type {rope_type!r} is not supported")


def longrope_long_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, int, float] | None:
    """For a LongRoPE config: the long factors' inverse frequencies ``[head_dim / 2]`` fp32, the
    first position that uses them (``original_max_position_embeddings``) and the cos/sin
    ``attention_factor``; None for any other rope."""
    scaling = config.rope_scaling
    if not scaling or scaling.get("rope_type") != "longrope":
        return None
    dim = config.head_dim
    base = config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * base)
    return (
        long,
        int(scaling["original_max_position_embeddings"]),
        float(scaling["attention_factor"]),
    )


class RotaryEmbedding:
    """Precomputed cos / sign-folded sin tables and their application to q and k.

    Args:
        config: the model config (head_dim, rope_theta, rope_scaling, max_position_embeddings).
        dtype: compute dtype of the model (tables are computed in fp32, then cast).
        device: where the tables live.
    """

    __slots__ = ("cos", "half", "inv_freq", "longrope", "sin")

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        self.inv_freq = rope_inv_freq(config)
        #: LongRoPE's (long inverse frequencies, first position using them, cos/sin factor)
        self.longrope = longrope_long_inv_freq(config)
        self.half = config.head_dim // 2
        self._build(config.max_position_embeddings, dtype, torch.device(device))

    @property
    def max_positions(self) -> int:
        """Positions the tables cover (``max_position_embeddings`` unless extended)."""
        return self.cos.shape[0]

    def extend(self, num_positions: int) -> None:
        """Cover positions up to ``num_positions`` (an engine allowed a max_model_len beyond the
        model's context); the same formula, extrapolated. Never shrinks."""
        if num_positions > self.max_positions:
            self._build(num_positions, self.cos.dtype, self.cos.device)

    def _build(self, num_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        positions = torch.arange(num_positions, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]  # [num_positions, head_dim / 2]
        factor = 1.0
        if self.longrope is not None:
            long_inv_freq, start, factor = self.longrope
            freqs[start:] = positions[start:, None] * long_inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()  # each half of a row: the same angles
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        #: [num_positions, head_dim]
        self.cos = torch.cat([cos, cos], dim=-1).to(dtype=dtype, device=device)
        self.sin = torch.cat([-sin, sin], dim=-1).to(dtype=dtype, device=device)

    def cast(self, dtype: torch.dtype) -> RotaryEmbedding:
        """The same tables in ``dtype`` (cast from these: a bf16 model's tables and its fused
        path's fp32 ones are computed once, at a 128k context a tenth of a second each)."""
        other = object.__new__(RotaryEmbedding)
        other.inv_freq, other.longrope, other.half = self.inv_freq, self.longrope, self.half
        other.cos, other.sin = self.cos.to(dtype), self.sin.to(dtype)
        return other

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and folded sin of ``positions`` ``[num_tokens]``, each ``[num_tokens, 1, head_dim]``
        (broadcast over heads); gathered once per forward, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` (q and k heads may be stacked)."""
        return torch.addcmul(x * cos, x.roll(self.half, -1), sin)
