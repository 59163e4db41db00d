"""Read a GGUF file (llama.cpp's format) into Hugging Face-named fp32 weights and a ModelConfig.

The weights are dequantized with the ``gguf`` package (Q4_0/1, Q4_K, Q5_0, Q6_K, Q8_0, F16, F32,
...). Three things differ from a Hugging Face checkpoint and are undone here:

- Names: ``blk.{i}.attn_q.weight`` -> ``model.layers.{i}.self_attn.q_proj.weight``, ... (Gemma 2
  and 3 have their own table: four norms per layer, and Gemma 3's q/k norms; Qwen3 adds
  ``attn_q_norm`` / ``attn_k_norm``; Phi-3's fused ``attn_qkv`` and ``ffn_up``, which holds gate
  then up, are split like its Hugging Face checkpoints' by
  :func:`pagedkv.model.fused_weights.split_fused_weights`, and its LongRoPE factors are the
  ``rope_factors_short`` / ``rope_factors_long`` tensors).
- Gemma norm weights (gemma2 and gemma3 architectures). Gemma's RMSNorm scales by ``1 + weight``;
  llama.cpp's converter stores ``weight + 1`` for every ``*norm.weight`` so that its plain RMSNorm
  applies. We subtract 1 back (as transformers' GGUF loader does), so the weights equal the
  Hugging Face ones and :mod:`pagedkv.model.gemma3` applies ``1 + weight`` as transformers does.
- Q/K row order (llama architecture only). Hugging Face's rotary embedding pairs dimension ``j``
  of a head with dimension ``j + head_dim/2`` ("rotate half"); llama.cpp's pairs ``2j`` with
  ``2j + 1``. llama.cpp's converter therefore permutes the rows of q_proj and k_proj, per head, from
  ``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]`` to ``[x_0, y_0, x_1, y_1, ...]``. We apply the inverse so
  that the weights equal the Hugging Face ones and the rotate-half rotary applies. (Qwen2, Qwen3
  and Phi-3 GGUFs use llama.cpp's NeoX rotary, which already pairs ``j`` with ``j + d/2``, and
  its converter does not permute them: nothing to undo; nor for Gemma 2 and 3, also NeoX in
  llama.cpp.)
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.errors import ModelLoadError
from pagedkv.model.config import ModelConfig, gguf_longrope_scaling
from pagedkv.model.fused_weights import split_fused_weights
from pagedkv.model.gguf_quant import GGUF_QUANTIZED_BITS, unpack_gguf_tensor
from pagedkv.model.quantization import QuantizedWeight, quantize_int8

#: Architectures whose GGUF q/k rows are interleaved for llama.cpp's normal (GPT-J style) rotary.
_PERMUTED_ARCHITECTURES = ("llama", "mistral")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA3_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QWEN3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
#: Phi-3's fused q/k/v and gate/up (split after loading, see the module docstring)
_PHI3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_qkv.bias": "self_attn.qkv_proj.bias",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
_LAYER_NAMES_BY_ARCHITECTURE = {
    "gemma2": _GEMMA3_LAYER_NAMES,
    "gemma3": _GEMMA3_LAYER_NAMES,
    "qwen3": _QWEN3_LAYER_NAMES,
    "phi3": _PHI3_LAYER_NAMES,
}
#: Architectures whose GGUF norm weights hold ``1 + weight`` (llama.cpp's Gemma converters).
_NORM_PLUS_ONE_ARCHITECTURES = ("gemma2", "gemma3")
#: Phi-3's LongRoPE factor tensors -> rope_scaling keys.
_LONGROPE_TENSORS = {
    "rope_factors_short.weight": "short_factor",
    "rope_factors_long.weight": "long_factor",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# Array fields larger than this (the vocabulary, merges) are not turned into Python values.
_MAX_ARRAY_LEN = 4096


@dataclass(slots=True)
class GGUFCheckpoint:
    """What a GGUF file holds: model config, fp32 weights under HF names, raw metadata, and
    (when asked for) the linear weights kept as the file's quantized blocks."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    #: HF name -> the weight's integers and scales (:func:`gguf_quantized`); empty unless
    #: ``load_gguf(..., quantized=True)``.
    quantized: dict[str, QuantizedWeight] = dataclasses.field(default_factory=dict)


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor name of ``architecture`` (GGUF
    ``general.architecture``), or None for tensors with no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _LAYER_NAMES_BY_ARCHITECTURE.get(architecture, _LAYER_NAMES)
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_names:
        return None
    return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of q/k rows (see the module docstring).

    Args:
        weight: ``[num_heads * head_dim, ...]`` q or k projection weight (or bias) in GGUF order.
        num_heads: heads of that projection (num_attention_heads for q, num_key_value_heads for k).

    Returns:
        The same tensor in Hugging Face (rotate-half) row order.
    """
    half = weight.shape[0] // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def read_metadata(reader: Any) -> dict[str, Any]:
    """GGUF key/value fields as Python values; long arrays (vocabulary, merges) are skipped."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if len(field.data) > _MAX_ARRAY_LEN:
            continue
        metadata[key] = field.contents()
    return metadata


def load_gguf(path: str | Path, *, quantized: bool = False) -> GGUFCheckpoint:
    """Dequantize every tensor of a GGUF file and build its ModelConfig.

    Args:
        path: the ``.gguf`` file.
        quantized: also keep the linear weights as the file stores them
            (``GGUFCheckpoint.quantized``, see :func:`gguf_quantized`).

    Returns:
        A :class:`GGUFCheckpoint`; ``state_dict`` holds fp32 tensors under Hugging Face names
        (no ``lm_head.weight`` when the embeddings are tied).

    Raises:
        ModelLoadError: the file cannot be read, or holds an unsupported architecture.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    metadata = read_metadata(reader)
    arch = metadata.get("general.architecture")
    if f"{arch}.vocab_size" not in metadata and "tokenizer.ggml.tokens" in reader.fields:
        metadata[f"{arch}.vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    tensor_names = {t.name for t in reader.tensors}
    config = ModelConfig.from_gguf_metadata(metadata, tensor_names)
    permute = config.architecture in _PERMUTED_ARCHITECTURES
    norm_plus_one = config.architecture in _NORM_PLUS_ONE_ARCHITECTURES

    state_dict: dict[str, torch.Tensor] = {}
    raw: dict[str, QuantizedWeight] = {}
    longrope: dict[str, list[float]] = {}
    for tensor in reader.tensors:
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weight = torch.from_numpy(array.copy() if not array.flags.writeable else array)
        if tensor.name == "rope_freqs.weight":
            config.rope_scaling = {"rope_type": "freq_factors", "factors": weight.tolist()}
            continue
        if tensor.name in _LONGROPE_TENSORS:
            longrope[_LONGROPE_TENSORS[tensor.name]] = weight.tolist()
            continue
        name = hf_name(tensor.name, config.architecture)
        if name is None:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} has no place in a {config.architecture} decoder"
            )
        if norm_plus_one and tensor.name.endswith("norm.weight"):
            weight = weight - 1.0
        heads = None
        if permute and ".q_proj." in name:
            heads = config.num_attention_heads
        elif permute and ".k_proj." in name:
            heads = config.num_key_value_heads
        if heads is not None:
            weight = unpermute_rotary_rows(weight, heads)
        state_dict[name] = weight
        type_name = tensor.tensor_type.name
        if quantized and weight.dim() == 2 and type_name in GGUF_QUANTIZED_BITS:
            qw = unpack_gguf_tensor(tensor.data, type_name, tuple(weight.shape))
            if heads is not None:
                qw = QuantizedWeight(
                    qw.bits,
                    unpermute_rotary_rows(qw.q, heads),
                    unpermute_rotary_rows(qw.scale, heads),
                    None if qw.min is None else unpermute_rotary_rows(qw.min, heads),
                    qw.group_size,
                )
            raw[name] = qw
    if longrope:
        config.rope_scaling = gguf_longrope_scaling(
            config, metadata, longrope.get("short_factor"), longrope.get("long_factor")
        )
    split_fused_weights(state_dict, config)  # Phi-3's attn_qkv and ffn_up
    split_fused_weights(raw, config)
    checkpoint = GGUFCheckpoint(config=config, state_dict=state_dict, metadata=metadata)
    if quantized:
        checkpoint.quantized = gguf_quantized(raw, state_dict, config)
    return checkpoint


def is_layer_linear(name: str) -> bool:
    """Whether HF weight ``name`` is a decoder layer's linear (q, k, v, o, gate, up, down)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def gguf_quantized(
    raw: dict[str, QuantizedWeight], state_dict: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, QuantizedWeight]:
    """Which weights run quantized, and how, from what the file stores.

    The layers' 4-bit linears (Q4_0, Q4_1, Q4_K) run as the file's int4 groups, unchanged; an
    8-bit one (Q8_0, a scale per 32 weights) as int8 with one scale per row (re-quantized: the
    kernel has no groups). The LM head (the embedding table when tied) runs int4 if the file
    stores it in a 4-bit format, else as int8 re-quantized per row from its dequantized
    values, whatever its format: its top logits are recomputed exactly from the dense weight.
    Other formats (Q5, Q6_K, F16, ...) stay dense.
    """
    out: dict[str, QuantizedWeight] = {}
    for name, qw in raw.items():
        if is_layer_linear(name):
            out[name] = qw if qw.bits == 4 else quantize_int8(state_dict[name])
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    if head in state_dict:
        qw = raw.get(head)
        out["lm_head.weight"] = (
            qw if qw is not None and qw.bits == 4 else (quantize_int8(state_dict[head]))
        )
    return out
