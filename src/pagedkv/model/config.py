"""The config of a decoder the engine runs (Llama family with Qwen3 and Phi-3, Gemma 2 and 3), read
from GGUF metadata or a Hugging Face config.json, and the KV-cache spec of each of its layers.

(The model's architecture; the engine's options as typed are :mod:`pagedkv.engine.config`, its
resolved config :mod:`pagedkv.config`, the core's KV cache shape :mod:`pagedkv.core.config`.)

The keys shared with capacity planning (layers, heads, sizes, context, tied embeddings, q/k/v
bias, and which layers slide over which window) are parsed once, by
:mod:`pagedkv.modelinfo.shape`, with one set of defaults and errors; this module adds what only
running the model needs (rope, norm epsilon, token ids, Gemma's local rope base, query scale
and logit softcapping, Phi-3's LongRoPE).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.core.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedkv.errors import ModelLoadError
from pagedkv.modelinfo.shape import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelShape,
    shape_from_gguf_metadata,
    shape_from_hf_config,
)

#: Model types (GGUF ``general.architecture`` / HF ``model_type``) pagedkv runs: the Llama family
#: (:mod:`pagedkv.model.llama`: Llama, Mistral, Qwen2, Qwen3 with its q/k norms, Phi-3 with its
#: fused weights split at load) and Gemma 2 / 3 (:mod:`pagedkv.model.gemma3`; Gemma 3's Hugging
#: Face model_type is ``gemma3_text``).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
#: Architectures run by :class:`pagedkv.model.gemma3.Gemma3ForCausalLM`.
GEMMA_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
#: Hugging Face model_type -> our architecture name, where they differ.
_HF_ARCHITECTURES = {"gemma3_text": "gemma3"}
#: Architectures that always have sliding-window layers (the Llama family's has them only when
#: its config says so: Mistral-7B-v0.1's window on every layer, Qwen2's from max_window_layers).
_ALWAYS_WINDOWED_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
#: Gemma 2 27B (46 layers) scales queries by (hidden_size / num_heads) ** -0.5 in llama.cpp (its
#: GGUF files do not store query_pre_attn_scalar), the other sizes by head_dim ** -0.5.
_GEMMA2_27B_NUM_LAYERS = 46

#: Gemma 3's local (sliding-window) layers' rope base when GGUF metadata does not store it
#: (llama.cpp hard-codes the same value).
GEMMA3_ROPE_LOCAL_THETA = 10000.0
#: Gemma 3 27B (62 layers) scales queries by (hidden_size / num_heads) ** -0.5, the other sizes
#: by head_dim ** -0.5 (its config's query_pre_attn_scalar; llama.cpp keys it on the layer count).
_GEMMA3_27B_NUM_LAYERS = 62


@dataclass(slots=True)
class ModelConfig:
    """Hyperparameters of a decoder (names as in Hugging Face's LlamaConfig / Gemma3TextConfig).

    ``architecture`` is the model type (:data:`SUPPORTED_ARCHITECTURES`). ``rope_scaling`` is
    None or a dict in Hugging Face's form (``{"rope_type": "llama3", "factor": ..., ...}``,
    ``{"rope_type": "linear", "factor": ...}``), ``{"rope_type": "freq_factors", "factors":
    [...]}`` for GGUF files that store llama3-style per-frequency divisors (``rope_freqs.weight``),
    or Phi-3's ``{"rope_type": "longrope", "short_factor": [...], "long_factor": [...],
    "original_max_position_embeddings": n, "attention_factor": f}`` (:func:`longrope_scaling`).
    ``eos_token_id`` is an int or a list of ints. ``qk_norm``: a per-head RMSNorm on q and k
    after the projection, before rotary (Qwen3, Gemma 3).

    Gemma fields (defaults leave a Llama-family model as it was):

    - ``layer_types``: per layer ``"full_attention"`` or ``"sliding_attention"``; None = every
      layer full attention.
    - ``sliding_window``: tokens a sliding-window layer attends to (itself and the
      ``sliding_window - 1`` before it).
    - ``rope_local_theta``: rope base of the sliding-window layers (None = ``rope_theta``);
      ``rope_theta`` and ``rope_scaling`` are the full-attention layers'.
    - ``query_pre_attn_scalar``: queries are scaled by ``query_pre_attn_scalar ** -0.5`` (None =
      ``head_dim``).
    - ``final_logit_softcapping``: logits = cap * tanh(logits / cap) when set.
    - ``attn_logit_softcapping``: attention scores = cap * tanh(scores / cap) before the
      softmax when set (Gemma 2; the attention backend applies it, see
      :class:`~pagedkv.ops.backends.AttentionLayerSpec`'s ``logits_soft_cap``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"model architecture {self.architecture!r} is not supported; "
                f"pagedkv runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.num_hidden_layers:
                raise ModelLoadError(
                    f"{len(self.layer_types)} layer_types for {self.num_hidden_layers} layers"
                )
            unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
            if unknown:
                raise ModelLoadError(
                    f"layer types {sorted(unknown)} are not supported; pagedkv runs "
                    f"{FULL_ATTENTION!r} and {SLIDING_ATTENTION!r} layers"
                )
            window = self.sliding_window
            if SLIDING_ATTENTION in self.layer_types and (
                not isinstance(window, int) or isinstance(window, bool) or window < 1
            ):
                raise ModelLoadError(
                    f"sliding-window layers need a sliding_window >= 1, got {window!r}"
                )
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(self, name)
            if cap is None:
                continue
            if self.architecture not in GEMMA_ARCHITECTURES:
                raise ModelLoadError(f"{name} is not supported for {self.architecture} models")
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
                raise ModelLoadError(f"{name} must be a number > 0, got {cap!r}")
            setattr(self, name, float(cap))

    @property
    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """Per layer, its sliding window in tokens, or None for full attention."""
        if self.layer_types is None:
            return (None,) * self.num_hidden_layers
        return tuple(
            self.sliding_window if kind == SLIDING_ATTENTION else None for kind in self.layer_types
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple (empty when the model names none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @classmethod
    def from_shape(cls, shape: ModelShape, *, architecture: str, **fields: Any) -> ModelConfig:
        """Build from a parsed :class:`~pagedkv.modelinfo.shape.ModelShape` plus the fields only
        running the model needs (``rms_norm_eps``, ``rope_theta``, ``rope_scaling``,
        ``bos_token_id``, ``eos_token_id``, Gemma 3's ``rope_local_theta``, ...;
        ``tie_word_embeddings`` may be overridden). For Gemma 3, ``layer_types`` and
        ``sliding_window`` come from the shape's per-layer windows.

        Raises:
            ModelLoadError: an unsupported architecture or head layout.
        """
        shared = {
            "vocab_size": shape.vocab_size,
            "hidden_size": shape.hidden_size,
            "intermediate_size": shape.intermediate_size,
            "num_hidden_layers": shape.num_hidden_layers,
            "num_attention_heads": shape.num_attention_heads,
            "num_key_value_heads": shape.num_key_value_heads,
            "head_dim": shape.head_dim,
            "max_position_embeddings": shape.max_position_embeddings,
            "tie_word_embeddings": shape.tie_word_embeddings,
            "attention_bias": shape.attention_bias,
            "qk_norm": shape.qk_norm,
        }
        shared |= _layer_type_fields(shape, architecture)
        return cls(architecture=architecture, **{**shared, **fields})

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, has_lm_head: bool = True) -> ModelConfig:
        """Build from the dict of a Hugging Face ``config.json``.

        Gemma 3 (``gemma3_text``) configs come in transformers 5's form (``layer_types``,
        ``rope_parameters`` per layer type) or the older one (``sliding_window_pattern``,
        ``rope_theta``, ``rope_local_base_freq``, ``rope_scaling`` for the global layers).

        Args:
            config: the parsed config.json.
            has_lm_head: whether the checkpoint stores ``lm_head.weight``; when it does not, the
                embeddings are tied whatever the config says.

        Raises:
            ModelLoadError: an unsupported architecture (multimodal Gemma 3 included);
                ModelConfigError (a ModelLoadError) for a missing or malformed key.
        """
        model_type = config.get("model_type")
        if model_type == "gemma3":
            raise ModelLoadError(
                "multimodal Gemma 3 checkpoints (model_type 'gemma3') are not supported; "
                "pagedkv runs the text model (model_type 'gemma3_text')"
            )
        architecture = _HF_ARCHITECTURES.get(model_type, model_type)
        _check_architecture(architecture)
        shape = shape_from_hf_config(config)
        fields: dict[str, Any] = {
            "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "tie_word_embeddings": shape.tie_word_embeddings or not has_lm_head,
            "bos_token_id": config.get("bos_token_id"),
            "eos_token_id": config.get("eos_token_id"),
        }
        if architecture == "gemma3":
            fields |= _gemma3_hf_fields(config, shape)
        else:
            rope_params = config.get("rope_parameters") or {}
            rope_scaling = config.get("rope_scaling") or None
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
            rope_theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
            fields |= {"rope_theta": float(rope_theta), "rope_scaling": rope_scaling}
        if architecture == "gemma2":
            fields |= _gemma2_hf_fields(config, shape)
        if architecture == "phi3":
            fields["rope_scaling"] = _phi3_hf_rope_scaling(config, fields["rope_scaling"], shape)
        return cls.from_shape(shape, architecture=architecture, **fields)

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tensor_names: Collection[str]
    ) -> ModelConfig:
        """Build from GGUF key/value metadata (``{arch}.block_count``, ...) and tensor names.

        Args:
            metadata: GGUF fields as Python values (``general.architecture`` -> "llama", ...).
            tensor_names: GGUF tensor names; they tell whether the embeddings are tied (no
                ``output.weight``) and whether q/k/v have a bias.

        Raises:
            ModelLoadError: an unsupported architecture or rope scaling; ModelConfigError (a
                ModelLoadError) for a missing or malformed key.
        """
        arch = metadata.get("general.architecture")
        if arch is None:
            raise ModelLoadError("GGUF file lacks general.architecture")
        _check_architecture(arch)
        shape = shape_from_gguf_metadata(metadata, tensor_names)
        rope_scaling = None
        scaling_type = metadata.get(f"{arch}.rope.scaling.type")
        if scaling_type == "linear":
            factor = metadata.get(f"{arch}.rope.scaling.factor")
            if factor is None:
                raise ModelLoadError(f"GGUF file lacks the required key {arch}.rope.scaling.factor")
            rope_scaling = {"rope_type": "linear", "factor": float(factor)}
        elif scaling_type not in (None, "none"):
            raise ModelLoadError(f"GGUF rope scaling {scaling_type!r} is not supported")
        gemma: dict[str, Any] = {}
        if arch == "gemma3":
            gemma = _gemma3_gguf_fields(metadata, shape)
        elif arch == "gemma2":
            gemma = _gemma2_gguf_fields(metadata, shape)
        return cls.from_shape(
            shape,
            architecture=arch,
            rms_norm_eps=float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
            **gemma,
        )


def _check_architecture(architecture: Any) -> None:
    """Raises ModelLoadError unless this decoder runs ``architecture`` (checked before the
    shared shape parser, so the message lists what the engine runs)."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"model architecture {architecture!r} is not supported; "
            f"pagedkv runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _layer_type_fields(shape: ModelShape, architecture: str) -> dict[str, Any]:
    """``layer_types`` and ``sliding_window`` from the shape's per-layer windows; {} when every
    layer is full attention.

    Raises:
        ModelLoadError: a Gemma 3 shape without sliding-window layers, or layers with two
            different windows.
    """
    windows = {w for w in shape.layer_windows if w is not None}
    if not windows and architecture not in _ALWAYS_WINDOWED_ARCHITECTURES:
        return {}
    if len(windows) != 1:
        raise ModelLoadError(
            f"{architecture} needs one sliding window for its local layers, got "
            f"{sorted(windows) or 'none'} (config.json sliding_window / GGUF "
            f"{architecture}.attention.sliding_window)"
        )
    return {
        "layer_types": tuple(
            FULL_ATTENTION if w is None else SLIDING_ATTENTION for w in shape.layer_windows
        ),
        "sliding_window": windows.pop(),
    }


def _gemma3_hf_fields(config: Mapping[str, Any], shape: ModelShape) -> dict[str, Any]:
    """The model-only Gemma 3 fields of a ``gemma3_text`` config.json: rope of the global and
    local layers, query scale, softcapping (the layer pattern is the shape's).

    Raises:
        ModelLoadError: an activation other than tanh GELU, or rope scaling on local layers.
    """
    activation = config.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(
            f"Gemma 3 hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)"
        )
    rope_params = config.get("rope_parameters") or {}
    full = dict(rope_params.get(FULL_ATTENTION) or {})
    local = dict(rope_params.get(SLIDING_ATTENTION) or {})
    if config.get("rope_scaling"):
        full.update(config["rope_scaling"])
    rope_theta = float(full.pop("rope_theta", config.get("rope_theta", 1_000_000.0)))
    rope_local_theta = float(
        local.get("rope_theta", config.get("rope_local_base_freq", GEMMA3_ROPE_LOCAL_THETA))
    )
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(
            f"rope scaling {local['rope_type']!r} on sliding-window layers is not supported"
        )
    return {
        "rope_theta": rope_theta,
        "rope_scaling": full if full.get("rope_type", "default") != "default" else None,
        "rope_local_theta": rope_local_theta,
        "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar", shape.head_dim)),
        "final_logit_softcapping": config.get("final_logit_softcapping"),
        "attn_logit_softcapping": config.get("attn_logit_softcapping"),
        "bos_token_id": config.get("bos_token_id", 2),
        "eos_token_id": config.get("eos_token_id", 1),
    }


def _gemma3_gguf_fields(metadata: Mapping[str, Any], shape: ModelShape) -> dict[str, Any]:
    """The model-only Gemma 3 fields of a GGUF file's metadata (the layer pattern is the
    shape's).

    GGUF files written by llama.cpp's converter store neither the local rope base nor the query
    scale; llama.cpp (and transformers' GGUF loader) then use Gemma 3's fixed values, as we do.
    Newer files may store ``gemma3.rope.freq_base_swa``: it wins.
    """
    if shape.num_hidden_layers == _GEMMA3_27B_NUM_LAYERS:
        scalar = shape.hidden_size // shape.num_attention_heads
    else:
        scalar = shape.head_dim
    softcap = metadata.get("gemma3.final_logit_softcapping")
    return {
        "rope_local_theta": float(
            metadata.get("gemma3.rope.freq_base_swa", GEMMA3_ROPE_LOCAL_THETA)
        ),
        "query_pre_attn_scalar": float(scalar),
        "final_logit_softcapping": None if softcap is None else float(softcap),
    }


def _gemma2_hf_fields(config: Mapping[str, Any], shape: ModelShape) -> dict[str, Any]:
    """The model-only Gemma 2 fields of a ``gemma2`` config.json: query scale and both
    softcaps (one rope base for every layer; the alternating layer pattern is the shape's).

    Raises:
        ModelLoadError: an activation other than tanh GELU.
    """
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(
            f"Gemma 2 hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)"
        )
    return {
        "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar", shape.head_dim)),
        "final_logit_softcapping": config.get("final_logit_softcapping"),
        "attn_logit_softcapping": config.get("attn_logit_softcapping"),
        "bos_token_id": config.get("bos_token_id", 2),
        "eos_token_id": config.get("eos_token_id", 1),
    }


def _gemma2_gguf_fields(metadata: Mapping[str, Any], shape: ModelShape) -> dict[str, Any]:
    """The model-only Gemma 2 fields of a GGUF file's metadata: both softcaps
    (``gemma2.attn_logit_softcapping``, ``gemma2.final_logit_softcapping``) and the query scale,
    which llama.cpp's converter does not store (llama.cpp keys it on the layer count, as we do).
    """
    if shape.num_hidden_layers == _GEMMA2_27B_NUM_LAYERS:
        scalar = shape.hidden_size // shape.num_attention_heads
    else:
        scalar = shape.head_dim
    caps = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = metadata.get(f"gemma2.{name}")
        caps[name] = None if value is None else float(value)
    return {"query_pre_attn_scalar": float(scalar), **caps}


def longrope_scaling(
    short_factor: Any,
    long_factor: Any,
    *,
    head_dim: int,
    max_position_embeddings: int,
    original_max_position_embeddings: Any,
    factor: Any = None,
    attention_factor: Any = None,
) -> dict[str, Any]:
    """Phi-3's LongRoPE scaling as a ``rope_scaling`` dict (what :mod:`pagedkv.model.rotary`
    reads): per-frequency divisors of the inverse frequencies, ``short_factor`` for positions
    below ``original_max_position_embeddings``, ``long_factor`` from there on, and cos/sin
    multiplied by ``attention_factor`` (when not given: ``sqrt(1 + ln(s) / ln(original))`` with
    ``s = factor`` or ``max_position_embeddings / original``, 1 when ``s <= 1``).

    Raises:
        ModelLoadError: factors missing, not ``head_dim / 2`` numbers each, or a missing or
            non-positive original context.
    """
    factors = {"short_factor": short_factor, "long_factor": long_factor}
    for name, values in factors.items():
        if (
            not isinstance(values, (list, tuple))
            or len(values) != head_dim // 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        ):
            raise ModelLoadError(
                f"longrope {name} must be {head_dim // 2} numbers (head_dim / 2), got {values!r}"
            )
    original = original_max_position_embeddings
    if isinstance(original, bool) or not isinstance(original, (int, float)) or original < 1:
        raise ModelLoadError(
            f"longrope needs original_max_position_embeddings >= 1, got {original!r}"
        )
    if attention_factor is None:
        scale = float(factor) if factor else max_position_embeddings / original
        attention_factor = (
            1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
        )
    return {
        "rope_type": "longrope",
        "short_factor": [float(v) for v in short_factor],
        "long_factor": [float(v) for v in long_factor],
        "original_max_position_embeddings": int(original),
        "attention_factor": float(attention_factor),
    }


def _phi3_hf_rope_scaling(
    config: Mapping[str, Any], rope_scaling: dict[str, Any] | None, shape: ModelShape
) -> dict[str, Any] | None:
    """A Phi-3 config.json's rope scaling: None or LongRoPE (``longrope``; ``su`` and ``yarn``
    are its older names in Phi-3 configs, as transformers reads them).

    Raises:
        ModelLoadError: partial rotary (``partial_rotary_factor`` < 1) or another rope type.
    """
    params = {**(config.get("rope_parameters") or {}), **(rope_scaling or {})}
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"Phi-3 partial_rotary_factor {partial} is not supported (only 1.0)")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default" or not rope_scaling:
        return None
    if rope_type not in ("longrope", "su", "yarn"):
        raise ModelLoadError(f"Phi-3 rope scaling {rope_type!r} is not supported (longrope)")
    return longrope_scaling(
        params.get("short_factor"),
        params.get("long_factor"),
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        original_max_position_embeddings=params.get(
            "original_max_position_embeddings", config.get("original_max_position_embeddings")
        ),
        factor=params.get("factor"),
        attention_factor=params.get("attention_factor"),
    )


def gguf_longrope_scaling(
    config: ModelConfig, metadata: Mapping[str, Any], short_factor: Any, long_factor: Any
) -> dict[str, Any]:
    """LongRoPE scaling of a Phi-3 GGUF file: the factors are its ``rope_factors_short`` and
    ``rope_factors_long`` tensors, the original context
    ``phi3.rope.scaling.original_context_length`` and the cos/sin factor
    ``phi3.rope.scaling.attn_factor`` (llama.cpp's converter writes both).

    Raises:
        ModelLoadError: a missing key or a factor tensor of the wrong size.
    """
    arch = config.architecture
    if short_factor is None or long_factor is None:
        raise ModelLoadError(
            "GGUF file has only one of rope_factors_short.weight / rope_factors_long.weight"
        )
    return longrope_scaling(
        short_factor,
        long_factor,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        original_max_position_embeddings=metadata.get(
            f"{arch}.rope.scaling.original_context_length"
        ),
        attention_factor=metadata.get(f"{arch}.rope.scaling.attn_factor"),
    )


def kv_cache_layer_specs(
    config: ModelConfig, block_size: int, dtype: str = "bfloat16"
) -> list[KVCacheSpec]:
    """The KV-cache spec of every attention layer, in layer order (what ``KVCacheConfig``'s
    constructors take): a :class:`~pagedkv.core.spec.SlidingWindowSpec` for each sliding-window
    layer, a :class:`~pagedkv.core.spec.FullAttentionSpec` for the others.

    Gemma 3 270M (15 sliding-window layers of window 512, 3 full): ``KVCacheConfig`` groups them
    into 5 sliding-window groups and 1 full-attention group of 3 layers each (group_size 3), one
    block table per group.

    Args:
        config: the model's config.
        block_size: tokens per block.
        dtype: KV-cache dtype name (:data:`pagedkv.core.spec.KV_DTYPE_BYTES`).

    Raises:
        ConfigError: a bad block_size or dtype.
    """
    common = {
        "block_size": block_size,
        "num_kv_heads": config.num_key_value_heads,
        "head_size": config.head_dim,
        "dtype": dtype,
    }
    full = FullAttentionSpec(**common)
    specs: list[KVCacheSpec] = []
    for window in config.layer_sliding_windows:
        specs.append(full if window is None else SlidingWindowSpec(**common, sliding_window=window))
    return specs
