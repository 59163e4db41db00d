"""Model shapes: what sizing a decoder's KV cache and weights needs, parsed once.

A :class:`ModelShape` is read from a Hugging Face ``config.json`` (:func:`shape_from_hf_config`)
or from GGUF metadata (:func:`shape_from_gguf_metadata`). Both the planner (``pagedkv plan``,
which only sizes) and the engine's model config (``pagedkv.model.config.ModelConfig``, which
adds the numerics: rope, norms' epsilon, token ids) build on it, so the two agree on every shared
key, its default and its error. It lives in the core because it is torch-free and produces the
core's layer specs (:meth:`ModelShape.layer_specs`); the planner may import only the core.

Families it sizes (anything else is refused with the reason, never sized as the nearest dense
model):

- dense decoders: Llama, Mistral, Qwen2/Qwen3, Phi-3, Gemma 1/2/3 (full and sliding-window
  layers);
- mixture of experts: Mixtral, Qwen-MoE (Qwen1.5/2 with shared experts, Qwen3), DeepSeek-V2/V3:
  every expert's weights count, though a token only runs ``num_experts_per_tok`` of them;
- multi-head latent attention (DeepSeek-V2/V3): the cache holds one latent of ``kv_lora_rank +
  qk_rope_head_dim`` values per token and layer (:class:`~pagedkv.core.spec.MLAAttentionSpec`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.core.spec import (
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)
from pagedkv.errors import ConfigError, ModelConfigError

#: Bytes per weight element of the dtypes a config.json names (``torch_dtype`` / ``dtype``).
WEIGHT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: Hugging Face ``model_type`` values whose shapes this module knows how to count.
HF_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "deepseek_v2",
    "deepseek_v3",
)
#: GGUF ``general.architecture`` values it knows, with their Hugging Face model_type.
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen2moe": "qwen2_moe",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "deepseek2": "deepseek_v2",
}

#: Model types whose word embeddings are tied to the LM head unless the config says otherwise.
_TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})
#: Model types with four RMSNorms per layer (pre/post attention and pre/post MLP).
_FOUR_NORMS = frozenset({"gemma2", "gemma3", "gemma3_text"})
#: Model types with q/k/v projection biases by default.
_QKV_BIAS = frozenset({"qwen2", "qwen2_moe"})
#: Model types with a per-head RMSNorm on q and k.
_QK_NORM = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text"})
#: Model types with multi-head latent attention.
_MLA = frozenset({"deepseek_v2", "deepseek_v3"})
#: ``layer_types`` entries (Hugging Face's names for a layer's attention).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: Gemma-3's layer pattern when neither GGUF metadata nor config.json store it: every sixth layer
#: is full attention, the five before it slide (llama.cpp and transformers fix it at 6).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
#: Model types that follow Gemma-3's layer pattern.
_GEMMA3_TYPES = frozenset({"gemma3", "gemma3_text"})


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """The shapes of a decoder-only transformer that sizing needs.

    Args:
        name: display name.
        model_type: Hugging Face model type ("llama", "mixtral", "deepseek_v3", ...).
        num_hidden_layers: decoder layers (all with attention).
        num_attention_heads: query heads.
        num_key_value_heads: KV heads (GQA: fewer than query heads; MLA: unused).
        head_dim: elements per K/V head (MLA: qk_nope_head_dim + qk_rope_head_dim).
        hidden_size / intermediate_size / vocab_size: for the weight and activation estimates;
            intermediate_size is the dense MLP's (Mixtral: each expert's).
        max_position_embeddings: longest context the model was trained for, tokens.
        layer_windows: per layer, its sliding window in tokens or None for full attention.
        tie_word_embeddings: LM head shares the embedding matrix.
        attention_bias: q/k/v projections have biases.
        num_norms_per_layer: RMSNorm vectors per layer (2 for Llama, 4 for Gemma-2).
        qk_norm: a per-head RMSNorm on q and k (Qwen3, Gemma-3).
        dtype: weight dtype name (also the KV-cache dtype for ``auto``).
        num_experts: routed experts per MoE layer (0: a dense model).
        num_experts_per_tok: experts each token runs (activations only; weights count them all).
        moe_intermediate_size: each routed expert's MLP width.
        shared_expert_intermediate_size: MLP width of the always-on shared experts together
            (DeepSeek: n_shared_experts x moe_intermediate_size; 0 = none).
        shared_expert_gate: a sigmoid gate of hidden_size weights on the shared expert (Qwen-MoE).
        router_bias: the router has a per-expert score bias (DeepSeek-V3).
        moe_layers: per layer, True where the MLP is a mixture of experts.
        kv_lora_rank / q_lora_rank / qk_nope_head_dim / qk_rope_head_dim / v_head_dim: multi-head
            latent attention (kv_lora_rank 0: not MLA; q_lora_rank 0: q is not compressed).
        quantization: "fp8" when config.json stores fp8 linear weights (1 byte each plus scales),
            else None.
        weight_block_size: fp8 scale block ``(rows, cols)``; None = one scale per matrix.
        weights_not_counted: why the weights cannot be estimated from the shapes (a quantization
            method or a vision tower this module does not count); empty when they can.
        num_parameters: exact parameter count when known (GGUF); else estimated from shapes.
        weight_bytes: exact bytes of stored weights when known (GGUF, quantized); else estimated.
        source: where the shape came from (catalog id, file path).

    Raises:
        ModelConfigError: per-layer tuples of the wrong length, or MLA mixed with sliding windows.
    """

    name: str
    model_type: str = ""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    layer_windows: tuple[int | None, ...] = ()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_norms_per_layer: int = 2
    qk_norm: bool = False
    dtype: str = "bfloat16"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    router_bias: bool = False
    moe_layers: tuple[bool, ...] = ()
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    quantization: str | None = None
    weight_block_size: tuple[int, int] | None = None
    weights_not_counted: str = ""
    num_parameters: int | None = None
    weight_bytes: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * layers)
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (self.num_experts > 0,) * layers)
        for field in ("layer_windows", "moe_layers"):
            if len(getattr(self, field)) != layers:
                raise ModelConfigError(
                    f"{self.name}: {len(getattr(self, field))} {field} for {layers} layers"
                )
        if self.is_mla and any(w is not None for w in self.layer_windows):
            raise ModelConfigError(f"{self.name}: MLA with sliding-window layers is not supported")

    # ---- what kind of model -----------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        """Some layer's MLP is a mixture of experts."""
        return any(self.moe_layers)

    @property
    def is_mla(self) -> bool:
        """Attention is multi-head latent attention (one cached latent per token)."""
        return self.kv_lora_rank > 0

    @property
    def attention_summary(self) -> str:
        """``"full attention"``, ``"sliding window 4096"``, ``"21 sliding 4096 / 21 full"`` or
        ``"MLA, latent 512 + rope 64"``."""
        if self.is_mla:
            return f"MLA, latent {self.kv_lora_rank} + rope {self.qk_rope_head_dim}"
        windows = [w for w in self.layer_windows if w is not None]
        if not windows:
            return "full attention"
        kinds = sorted(set(windows))
        label = "/".join(str(w) for w in kinds)
        if len(windows) == self.num_hidden_layers:
            return f"sliding window {label}"
        return f"{len(windows)} sliding {label} / {self.num_hidden_layers - len(windows)} full"

    @property
    def moe_summary(self) -> str:
        """``"MoE: 8 experts (2 per token) in 32 of 32 layers"`` (+ shared experts); ``""`` for
        a dense model."""
        if not self.is_moe:
            return ""
        text = (
            f"MoE: {self.num_experts} experts ({self.num_experts_per_tok} per token) in "
            f"{sum(self.moe_layers)} of {self.num_hidden_layers} layers"
        )
        if self.shared_expert_intermediate_size:
            text += f", shared expert width {self.shared_expert_intermediate_size}"
        return text

    @property
    def mlp_activation_size(self) -> int:
        """The widest MLP intermediate one token computes (activations): a dense layer's
        intermediate_size, or experts per token x expert width + shared width."""
        widths = []
        if not all(self.moe_layers):
            widths.append(self.intermediate_size)
        if self.is_moe:
            widths.append(
                self.num_experts_per_tok * self.moe_intermediate_size
                + self.shared_expert_intermediate_size
            )
        return max(widths)

    # ---- weights ----------------------------------------------------------------------------

    def _linear_matrices(self) -> list[tuple[int, int, int]]:
        """``(count, rows, cols)`` of every projection matrix of the model (the weights fp8
        checkpoints quantize); embeddings and the LM head are not among them."""
        hidden, heads = self.hidden_size, self.num_attention_heads
        layers = self.num_hidden_layers
        if self.is_mla:
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            attention = [
                (self.kv_lora_rank + self.qk_rope_head_dim, hidden),  # kv_a_proj_with_mqa
                (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),  # kv_b
                (hidden, heads * self.v_head_dim),  # o_proj
            ]
            if self.q_lora_rank:
                attention += [(self.q_lora_rank, hidden), (heads * qk_head, self.q_lora_rank)]
            else:
                attention.append((heads * qk_head, hidden))
        else:
            q_size = heads * self.head_dim
            kv_size = self.num_key_value_heads * self.head_dim
            attention = [(q_size, hidden), (kv_size, hidden), (kv_size, hidden), (hidden, q_size)]
        matrices = [(layers, rows, cols) for rows, cols in attention]
        num_moe = sum(self.moe_layers)
        num_dense = layers - num_moe
        inter = self.intermediate_size
        if num_dense:
            matrices += [(2 * num_dense, inter, hidden), (num_dense, hidden, inter)]
        if num_moe:
            experts = num_moe * self.num_experts
            moe_inter = self.moe_intermediate_size
            matrices += [(2 * experts, moe_inter, hidden), (experts, hidden, moe_inter)]
            shared = self.shared_expert_intermediate_size
            if shared:
                matrices += [(2 * num_moe, shared, hidden), (num_moe, hidden, shared)]
        return matrices

    def _other_parameters(self) -> int:
        """Parameters outside the projection matrices: embeddings, LM head, norms, biases,
        routers (kept in 16 bits by fp8 checkpoints)."""
        hidden, layers = self.hidden_size, self.num_hidden_layers
        per_layer = self.num_norms_per_layer * hidden
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.is_mla:
            per_layer += self.kv_lora_rank + self.q_lora_rank  # kv_a / q_a layernorms
        elif self.attention_bias:
            per_layer += (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
        num_moe = sum(self.moe_layers)
        router = self.num_experts * hidden + (self.num_experts if self.router_bias else 0)
        if self.shared_expert_gate:
            router += hidden
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + num_moe * router + embeddings + hidden

    def estimate_num_parameters(self) -> int:
        """Parameters of the whole model (every expert counted), from the shapes; the exact
        count when known (GGUF)."""
        if self.num_parameters is not None:
            return self.num_parameters
        linear = sum(count * rows * cols for count, rows, cols in self._linear_matrices())
        return linear + self._other_parameters()

    def estimate_weight_bytes(self) -> int:
        """Bytes of all weights (one copy, before tensor parallelism): the exact bytes when known,
        parameters x dtype bytes, or for fp8 checkpoints 1 byte per projection weight plus its
        float32 scales and the rest in the dtype.

        Raises:
            ModelConfigError: the weights cannot be counted from the shapes
                (:attr:`weights_not_counted`); the message says to give the weight bytes.
        """
        if self.weight_bytes is not None:
            return self.weight_bytes
        if self.weights_not_counted:
            raise ModelConfigError(
                f"{self.name}: cannot estimate the weight bytes: {self.weights_not_counted}; "
                "give them (pagedkv plan --weight-bytes, e.g. the checkpoint's size on disk)"
            )
        dtype_bytes = WEIGHT_DTYPE_BYTES.get(self.dtype, 2)
        if self.quantization != "fp8":
            return self.estimate_num_parameters() * dtype_bytes
        total = self._other_parameters() * dtype_bytes
        for count, rows, cols in self._linear_matrices():
            if self.weight_block_size is None:
                scales = 1
            else:
                scales = cdiv(rows, self.weight_block_size[0]) * cdiv(
                    cols, self.weight_block_size[1]
                )
            total += count * (rows * cols + 4 * scales)
        return total

    def describe_weights(self) -> str:
        """How :meth:`estimate_weight_bytes` counts: ``"46.70 B params x 2 bytes"`` or the fp8
        rule."""
        params = f"{self.estimate_num_parameters() / 1e9:.2f} B params"
        if self.quantization == "fp8":
            block = (
                "{}x{} block".format(*self.weight_block_size)
                if self.weight_block_size
                else "per-matrix"
            )
            return (
                f"{params}; fp8 projections (1 byte + {block} scales), the rest "
                f"{WEIGHT_DTYPE_BYTES.get(self.dtype, 2)} bytes"
            )
        return f"{params} x {WEIGHT_DTYPE_BYTES.get(self.dtype, 2)} bytes"

    # ---- KV cache ---------------------------------------------------------------------------

    def num_kv_heads_per_device(self, tensor_parallel_size: int = 1) -> int:
        """KV heads each device holds: split evenly, or one replicated head when there are
        fewer KV heads than devices (as vLLM does); 1 for MLA (every device keeps the latent).

        Raises:
            ConfigError: tensor_parallel_size does not divide the query heads, the KV heads
                cannot be split or replicated evenly, or it does not divide the MLP widths
                (column-parallel gate/up, each expert's too, as vLLM splits them); the message
                lists valid sizes.
        """
        tp = tensor_parallel_size
        heads = self.num_attention_heads
        kv = 1 if self.is_mla else self.num_key_value_heads
        mlp = (
            self.intermediate_size,
            self.moe_intermediate_size,
            self.shared_expert_intermediate_size,
        )
        widths = sorted({w for w in mlp if w > 0})

        def splits(n: int) -> bool:
            return (
                heads % n == 0 and (kv % n == 0 or n % kv == 0) and all(w % n == 0 for w in widths)
            )

        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or not splits(tp):
            valid = [n for n in range(1, heads + 1) if splits(n)]
            what = f"{heads} attention" if self.is_mla else f"{heads} attention / {kv} KV"
            mlp = "/".join(map(str, widths))
            raise ConfigError(
                f"tensor_parallel_size {tp!r} does not split {self.name}'s {what} heads and MLP "
                f"width {mlp}; choose one of " + ", ".join(map(str, valid))
            )
        return max(1, kv // tp)

    def layer_specs(
        self, *, block_size: int, kv_cache_dtype: str, tensor_parallel_size: int = 1
    ) -> tuple[KVCacheSpec, ...]:
        """One KV-cache spec per layer, as one device of ``tensor_parallel_size`` holds it.

        Raises:
            ConfigError: a bad tensor_parallel_size, block_size or dtype.
        """
        num_kv_heads = self.num_kv_heads_per_device(tensor_parallel_size)
        if self.is_mla:
            mla = MLAAttentionSpec(
                block_size=block_size,
                head_size=self.kv_lora_rank + self.qk_rope_head_dim,
                dtype=kv_cache_dtype,
            )
            return (mla,) * self.num_hidden_layers
        full = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=self.head_dim,
            dtype=kv_cache_dtype,
        )
        specs: list[KVCacheSpec] = []
        for window in self.layer_windows:
            if window is None:
                specs.append(full)
            else:
                specs.append(
                    SlidingWindowSpec(
                        block_size=block_size,
                        num_kv_heads=num_kv_heads,
                        head_size=self.head_dim,
                        dtype=kv_cache_dtype,
                        sliding_window=window,
                    )
                )
        return tuple(specs)


# ---- shared parsing helpers ------------------------------------------------------------------

_REQUIRED = object()


def _get_int(get: Any, key: str, where: str, default: Any = _REQUIRED, *, label: str = "") -> int:
    """``int(get(key))`` with a ModelConfigError naming the key when it is missing or not an int;
    ``default`` when the key is missing or null (required when no default)."""
    value = get(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelConfigError(f"{where} has no {label or key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ModelConfigError(f"{where}: {label or key!r} must be an int, got {value!r}")
    return int(value)


def pattern_windows(num_layers: int, window: int, pattern: int) -> tuple[int | None, ...]:
    """Gemma-3's per-layer windows: ``pattern - 1`` sliding-window layers, then one
    full-attention layer (None), repeated (``pattern`` 6: layers 5, 11, 17, ... are full).

    Raises:
        ModelConfigError: ``pattern`` < 1.
    """
    if pattern < 1:
        raise ModelConfigError(f"sliding_window_pattern must be >= 1, got {pattern}")
    return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))


def _alternating_windows(num_layers: int, window: int) -> tuple[int | None, ...]:
    """Gemma-2: even layers slide, odd layers are full attention."""
    return tuple(window if i % 2 == 0 else None for i in range(num_layers))


# ---- Hugging Face config.json ----------------------------------------------------------------


def _hf_layer_windows(
    config: Mapping[str, Any], num_layers: int, where: str
) -> tuple[int | None, ...]:
    """Per-layer sliding windows from the several ways configs say it."""
    model_type = config.get("model_type", "")
    if config.get("sliding_window") is None or config.get("use_sliding_window") is False:
        # Qwen2 sets sliding_window but turns it off with use_sliding_window: false.
        return (None,) * num_layers
    if model_type == "llama" and config.get("layer_types") is None:
        # Llama's attention has no window (transformers and vLLM ignore a stray sliding_window
        # there; only layer_types names sliding layers).
        return (None,) * num_layers
    window = _get_int(config.get, "sliding_window", where)
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ModelConfigError(
                f"{where}: layer_types has {len(layer_types)} entries for {num_layers} layers"
            )
        windows: list[int | None] = []
        for kind in layer_types:
            if kind == FULL_ATTENTION:
                windows.append(None)
            elif kind == SLIDING_ATTENTION:
                windows.append(window)
            else:
                raise ModelConfigError(
                    f"{where}: unsupported layer type {kind!r}; choose full_attention or "
                    "sliding_attention"
                )
        return tuple(windows)
    pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern"))
    if pattern is None and model_type in _GEMMA3_TYPES:
        pattern = GEMMA3_SLIDING_WINDOW_PATTERN  # transformers' default for Gemma-3
    if pattern:
        period = _get_int(lambda _: pattern, "sliding_window_pattern", where)
        return pattern_windows(num_layers, window, period)
    if model_type == "gemma2":
        return _alternating_windows(num_layers, window)
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        # Qwen2 with use_sliding_window: layers from max_window_layers on slide.
        first = _get_int(config.get, "max_window_layers", where, num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers  # Mistral-7B-v0.1 style: every layer slides


def _hf_moe(
    config: Mapping[str, Any], model_type: str, num_layers: int, where: str
) -> dict[str, Any]:
    """The ModelShape MoE fields of a config.json ({} for a dense model)."""

    def get(key: str, default: Any = _REQUIRED) -> int:
        return _get_int(config.get, key, where, default)

    if model_type == "mixtral":
        return {
            "num_experts": get("num_local_experts"),
            "num_experts_per_tok": get("num_experts_per_tok"),
            "moe_intermediate_size": get("intermediate_size"),
        }
    if model_type in ("qwen2_moe", "qwen3_moe"):
        num_experts = get("num_experts")
        step = get("decoder_sparse_step", 1)
        dense = set(config.get("mlp_only_layers") or ())
        shared = get("shared_expert_intermediate_size", 0)
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": get("num_experts_per_tok"),
            "moe_intermediate_size": get("moe_intermediate_size"),
            "shared_expert_intermediate_size": shared,
            "shared_expert_gate": shared > 0,
            "moe_layers": tuple(
                num_experts > 0 and i not in dense and (i + 1) % step == 0
                for i in range(num_layers)
            ),
        }
    if model_type in ("deepseek_v2", "deepseek_v3"):
        num_experts = get("n_routed_experts", 0)
        if not num_experts:
            return {}
        first_dense = get("first_k_dense_replace", 0)
        freq = get("moe_layer_freq", 1)
        moe_inter = get("moe_intermediate_size")
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": get("num_experts_per_tok"),
            "moe_intermediate_size": moe_inter,
            "shared_expert_intermediate_size": get("n_shared_experts", 0) * moe_inter,
            "router_bias": config.get("topk_method") == "noaux_tc",
            "moe_layers": tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
        }
    return {}


def _hf_quantization(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """fp8 weights are counted (1 byte + scales); other quantization methods are not."""
    quant = config.get("quantization_config")
    if not quant:
        return {}
    method = quant.get("quant_method", "unknown") if isinstance(quant, Mapping) else "unknown"
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ModelConfigError(f"{where}: fp8 weight_block_size {block!r} is not [r, c]")
            block = (block[0], block[1])
        return {"quantization": "fp8", "weight_block_size": block}
    return {"weights_not_counted": f"its weights are quantized ({method})"}


def shape_from_hf_config(config: Mapping[str, Any], *, name: str = "config.json") -> ModelShape:
    """A model shape from a parsed Hugging Face ``config.json``.

    Reads num_hidden_layers, num_attention_heads, hidden_size, intermediate_size, vocab_size
    (required), num_key_value_heads (default: the attention heads), head_dim (default
    hidden_size / num_attention_heads), max_position_embeddings (default 2048), sliding_window and
    which layers use it (layer_types, sliding_window_pattern, Gemma-2's alternation, Qwen2's
    use_sliding_window / max_window_layers), tie_word_embeddings (default: tied for Gemma),
    attention_bias (default: on for Qwen2), the experts of Mixtral (num_local_experts), Qwen-MoE
    (num_experts, moe_intermediate_size, shared_expert_intermediate_size, decoder_sparse_step,
    mlp_only_layers) and DeepSeek (n_routed_experts, n_shared_experts, first_k_dense_replace,
    moe_layer_freq), DeepSeek's MLA ranks (kv_lora_rank, q_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim) and an fp8 ``quantization_config``. A multimodal config's
    ``text_config`` is used (its vision tower's weights are not counted).

    Raises:
        ModelConfigError: a required key is missing, a value is not understood, or the model
            type is not one of :data:`HF_MODEL_TYPES`.
    """
    extra: dict[str, Any] = {}
    if isinstance(config.get("text_config"), Mapping):
        if any(key in config for key in ("vision_config", "audio_config")):
            extra["weights_not_counted"] = "the vision/audio tower of this multimodal model"
        config = {"model_type": config.get("model_type", ""), **config["text_config"]}

    def get(key: str, default: Any = _REQUIRED) -> int:
        return _get_int(config.get, key, f"{name}: config.json", default)

    num_layers = get("num_hidden_layers")
    num_heads = get("num_attention_heads")
    hidden_size = get("hidden_size")
    intermediate_size = get("intermediate_size")
    vocab_size = get("vocab_size")
    model_type = config.get("model_type")
    if not model_type:
        raise ModelConfigError(f"{name}: config.json has no 'model_type'")
    if model_type not in HF_MODEL_TYPES:
        raise ModelConfigError(
            f"{name}: model_type {model_type!r} is not supported: its KV cache and weights "
            f"cannot be sized from the shapes of {', '.join(HF_MODEL_TYPES)}"
        )
    if num_heads < 1 or num_layers < 1:
        raise ModelConfigError(f"{name}: needs at least one layer and one attention head")
    if model_type in _MLA:
        rope = get("qk_rope_head_dim")
        nope = get("qk_nope_head_dim")
        extra |= {
            "kv_lora_rank": get("kv_lora_rank"),
            "q_lora_rank": get("q_lora_rank", 0),
            "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope,
            "v_head_dim": get("v_head_dim"),
        }
        head_dim = nope + rope
    else:
        head_dim = get("head_dim", hidden_size // num_heads)
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return ModelShape(
        name=name,
        model_type=model_type,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=get("num_key_value_heads", num_heads),
        head_dim=head_dim,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=get("max_position_embeddings", 2048),
        layer_windows=_hf_layer_windows(config, num_layers, name),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
        attention_bias=bool(config.get("attention_bias", model_type in _QKV_BIAS)),
        num_norms_per_layer=4 if model_type in _FOUR_NORMS else 2,
        qk_norm=model_type in _QK_NORM,
        dtype=dtype if dtype in WEIGHT_DTYPE_BYTES else "bfloat16",
        source=name,
        **_hf_moe(config, model_type, num_layers, name),
        **_hf_quantization(config, name),
        **extra,
    )


# ---- GGUF metadata ---------------------------------------------------------------------------


def _gguf_gemma3_windows(
    metadata: Mapping[str, Any], num_layers: int, window: int, where: str
) -> tuple[int | None, ...]:
    """Gemma-3's per-layer windows from ``gemma3.attention.sliding_window_pattern``: a period
    (every n-th layer full), one bool per layer (True = sliding), or absent: llama.cpp's converter
    does not write it and llama.cpp (like transformers' GGUF loader) then uses period 6."""
    key = "gemma3.attention.sliding_window_pattern"
    pattern = metadata.get(key)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ModelConfigError(
                f"{where}: {key} has {len(pattern)} entries for {num_layers} layers"
            )
        return tuple(window if sliding else None for sliding in pattern)
    period = _get_int(metadata.get, key, where, GEMMA3_SLIDING_WINDOW_PATTERN)
    return pattern_windows(num_layers, window, period)


def shape_from_gguf_metadata(
    metadata: Mapping[str, Any],
    tensor_names: Collection[str],
    *,
    name: str = "GGUF file",
    num_parameters: int | None = None,
    weight_bytes: int | None = None,
    source: str = "",
) -> ModelShape:
    """A model shape from GGUF key/value metadata (as Python values) and tensor names.

    Reads ``{arch}.block_count``, ``.attention.head_count(_kv)``, ``.attention.key_length``
    (default embedding_length / head_count), ``.embedding_length``, ``.feed_forward_length``,
    ``.vocab_size`` (required: readers fill it from the token list), ``.context_length``
    (default 2048), ``.attention.sliding_window`` (Gemma-2 alternates; Gemma-3 every
    ``.attention.sliding_window_pattern``-th layer, 6 when absent, is full), the experts
    (``.expert_count``, ``.expert_used_count``, ``.expert_feed_forward_length``,
    ``.expert_shared_count``, ``.expert_shared_feed_forward_length``,
    ``.leading_dense_block_count``) and DeepSeek's MLA ranks (``.attention.kv_lora_rank``,
    ``.attention.q_lora_rank``, ``.rope.dimension_count``). Tied embeddings: no
    ``output.weight`` tensor; q/k/v biases: a ``blk.0.attn_q.bias`` tensor. The KV-cache dtype
    for ``auto`` is float16 (llama.cpp's default).

    Args:
        metadata: GGUF fields (``general.architecture`` -> "llama", ...).
        tensor_names: the file's tensor names.
        name: display name (and error prefix).
        num_parameters / weight_bytes: exact counts summed from the tensors, when known.
        source: where it came from.

    Raises:
        ModelConfigError: a required key is missing, or an architecture not in
            :data:`GGUF_ARCHITECTURES`.
    """
    arch = metadata.get("general.architecture")
    if arch is None:
        raise ModelConfigError(f"{name}: GGUF metadata has no general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelConfigError(
            f"{name}: GGUF architecture {arch!r} is not supported: its KV cache cannot be sized "
            f"from the shapes of {', '.join(GGUF_ARCHITECTURES)}"
        )
    model_type = GGUF_ARCHITECTURES[arch]
    where = f"{name}: GGUF metadata"

    def get(key: str, default: Any = _REQUIRED) -> int:
        return _get_int(
            lambda k: metadata.get(f"{arch}.{k}"), key, where, default, label=f"{arch}.{key}"
        )

    num_layers = get("block_count")
    num_heads = get("attention.head_count")
    num_kv_heads = metadata.get(f"{arch}.attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts in some files
        num_kv_heads = max(num_kv_heads)
    hidden_size = get("embedding_length")
    intermediate_size = get("feed_forward_length")
    # 0 = none (llama.cpp's Phi-3 converter writes 0 for a model without a window: Phi-4)
    window = get("attention.sliding_window", None) or None
    if window is None:
        windows: tuple[int | None, ...] = (None,) * num_layers
    elif arch == "gemma2":
        windows = _alternating_windows(num_layers, window)
    elif arch == "gemma3":
        windows = _gguf_gemma3_windows(metadata, num_layers, window, where)
    else:
        windows = (window,) * num_layers
    extra: dict[str, Any] = {}
    num_experts = get("expert_count", 0)
    if num_experts:
        moe_inter = get("expert_feed_forward_length", intermediate_size)
        shared = get("expert_shared_feed_forward_length", 0) or (
            get("expert_shared_count", 0) * moe_inter
        )
        first_dense = get("leading_dense_block_count", 0)
        extra |= {
            "num_experts": num_experts,
            "num_experts_per_tok": get("expert_used_count"),
            "moe_intermediate_size": moe_inter,
            "shared_expert_intermediate_size": shared,
            "moe_layers": tuple(i >= first_dense for i in range(num_layers)),
        }
    head_dim = get("attention.key_length", hidden_size // num_heads)
    if arch == "deepseek2":
        rope = get("rope.dimension_count")
        key_length = get("attention.key_length_mla", head_dim)
        extra |= {
            "kv_lora_rank": get("attention.kv_lora_rank"),
            "q_lora_rank": get("attention.q_lora_rank", 0),
            "qk_nope_head_dim": key_length - rope,
            "qk_rope_head_dim": rope,
            "v_head_dim": get("attention.value_length_mla", None) or get("attention.value_length"),
        }
        head_dim = key_length
    return ModelShape(
        name=name,
        model_type=model_type,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(num_kv_heads),
        head_dim=head_dim,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        vocab_size=get("vocab_size"),
        max_position_embeddings=get("context_length", 2048),
        layer_windows=windows,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        num_norms_per_layer=4 if model_type in _FOUR_NORMS else 2,
        qk_norm=model_type in _QK_NORM,
        dtype="float16",
        num_parameters=num_parameters,
        weight_bytes=weight_bytes,
        source=source or name,
        **extra,
    )


__all__ = [
    "FULL_ATTENTION",
    "GEMMA3_SLIDING_WINDOW_PATTERN",
    "GGUF_ARCHITECTURES",
    "HF_MODEL_TYPES",
    "SLIDING_ATTENTION",
    "WEIGHT_DTYPE_BYTES",
    "ModelShape",
    "pattern_windows",
    "shape_from_gguf_metadata",
    "shape_from_hf_config",
]
