"""Phi-3's fused projections split into the names the Llama-family decoder builds its linears
from.

Phi-3 checkpoints store q, k and v as one ``self_attn.qkv_proj`` (rows: the q heads, then the k
heads, then the v heads) and gate and up as one ``mlp.gate_up_proj`` (rows: gate, then up);
llama.cpp's converter keeps both fused (``attn_qkv``; ``ffn_up`` holding gate then up, split in
two halves by its SwiGLU). :func:`split_fused_weights` cuts them by rows into
``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj``, so that
:class:`~pagedkv.model.llama.LlamaDecoderLayer` builds its linears as for any Llama (the split
is exact: rows are copied, not recomputed; quantized weights are split the same way).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from pagedkv.errors import ModelLoadError
from pagedkv.model.config import ModelConfig

#: The fused weights' names under ``model.layers.{i}.`` (qkv: a weight and maybe a bias).
FUSED_QKV = "self_attn.qkv_proj"
FUSED_GATE_UP = "mlp.gate_up_proj.weight"


def _rows(weight: Any, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of a tensor or a quantized weight (its ``rows``)."""
    if hasattr(weight, "rows"):
        return weight.rows(slice(start, stop))
    return weight[start:stop].contiguous()


def split_rows(name: str | None, config: ModelConfig) -> tuple[int, ...]:
    """The rows at which :func:`split_fused_weights` cuts the weight or bias Hugging Face
    ``name`` (a layer's fused ``qkv_proj``: the q size and q + kv size; ``gate_up_proj``: the
    intermediate size); empty for any other name (the loader keeps a weight's layout in bands
    of 8 rows only where every cut falls between bands)."""
    if name is None:
        return ()
    if f".{FUSED_QKV}." in name:
        q_size = config.num_attention_heads * config.head_dim
        return (q_size, q_size + config.num_key_value_heads * config.head_dim)
    if name.endswith("." + FUSED_GATE_UP):
        return (config.intermediate_size,)
    return ()


def split_fused_weights(weights: MutableMapping[str, Any], config: ModelConfig) -> None:
    """Replace every layer's fused ``qkv_proj`` (weight and bias) and ``gate_up_proj`` in
    ``weights`` (in place) by the unfused Llama names; a model without them is left as it is.

    Args:
        weights: Hugging Face-named tensors (``[out_features, ...]``), or quantized weights
            (anything with ``rows(slice)`` and ``shape``).
        config: the model's head layout and MLP width.

    Raises:
        ModelLoadError: a fused weight whose rows do not match the config
            (``(num_heads + 2 * num_kv_heads) * head_dim``, ``2 * intermediate_size``).
    """
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            name = f"{prefix}{FUSED_QKV}.{kind}"
            if name not in weights:
                continue
            fused = weights.pop(name)
            _check_rows(name, fused, q_size + 2 * kv_size)
            bounds = (0, q_size, q_size + kv_size, q_size + 2 * kv_size)
            for p, start, stop in zip("qkv", bounds, bounds[1:], strict=False):
                weights[f"{prefix}self_attn.{p}_proj.{kind}"] = _rows(fused, start, stop)
        name = prefix + FUSED_GATE_UP
        if name in weights:
            fused = weights.pop(name)
            _check_rows(name, fused, 2 * inter)
            weights[prefix + "mlp.gate_proj.weight"] = _rows(fused, 0, inter)
            weights[prefix + "mlp.up_proj.weight"] = _rows(fused, inter, 2 * inter)


def _check_rows(name: str, weight: Any, expected: int) -> None:
    rows = weight.shape[0]
    if rows != expected:
        raise ModelLoadError(
            f"{name} has {rows} rows; the config's heads and sizes need {expected}"
        )
