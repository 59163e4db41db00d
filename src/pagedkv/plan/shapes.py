"""Model shapes for capacity planning: what the KV cache and the weights of a model need.

A :class:`ModelShape` comes from the built-in catalog (:mod:`pagedkv.plan.catalog`), from a
Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Gemma-2/3 style) or from a GGUF file's
metadata. It holds no weights and imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.core.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedkv.errors import ConfigError, ModelLoadError

#: Bytes per weight element of the dtypes a config.json names (``torch_dtype`` / ``dtype``).
WEIGHT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: Model types whose word embeddings are tied to the LM head unless the config says otherwise.
_TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})
#: Model types with four RMSNorms per layer (pre/post attention and pre/post MLP).
_FOUR_NORMS = frozenset({"gemma2", "gemma3", "gemma3_text"})
#: Model types with q/k/v projection biases.
_QKV_BIAS = frozenset({"qwen2"})


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """The shapes of a decoder-only transformer that sizing needs.

    Args:
        name: display name.
        num_hidden_layers: decoder layers (all with attention).
        num_attention_heads: query heads.
        num_key_value_heads: KV heads (GQA: fewer than query heads).
        head_dim: elements per head.
        hidden_size / intermediate_size / vocab_size: for the weight and activation estimates.
        max_position_embeddings: longest context the model was trained for, tokens.
        layer_windows: per layer, its sliding window in tokens or None for full attention.
        tie_word_embeddings: LM head shares the embedding matrix.
        attention_bias: q/k/v projections have biases.
        num_norms_per_layer: RMSNorm vectors per layer (2 for Llama, 4 for Gemma-2).
        dtype: weight dtype name (also the KV-cache dtype for ``auto``).
        num_parameters: exact parameter count when known (GGUF); else estimated from shapes.
        weight_bytes: exact bytes of stored weights when known (GGUF, quantized); else
            ``num_parameters x dtype bytes``.
        source: where the shape came from (catalog id, file path).
    """

    name: str
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
    dtype: str = "bfloat16"
    num_parameters: int | None = None
    weight_bytes: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_hidden_layers)
        if len(self.layer_windows) != self.num_hidden_layers:
            raise ConfigError(
                f"{self.name}: {len(self.layer_windows)} layer windows for "
                f"{self.num_hidden_layers} layers"
            )

    @property
    def attention_summary(self) -> str:
        """``"full attention"``, ``"sliding window 4096"`` or ``"21 sliding 4096 / 21 full"``."""
        windows = [w for w in self.layer_windows if w is not None]
        if not windows:
            return "full attention"
        kinds = sorted(set(windows))
        label = "/".join(str(w) for w in kinds)
        if len(windows) == self.num_hidden_layers:
            return f"sliding window {label}"
        return f"{len(windows)} sliding {label} / {self.num_hidden_layers - len(windows)} full"

    def estimate_num_parameters(self) -> int:
        """Parameters of a Llama-style decoder with these shapes (embeddings, attention,
        gated MLP, norms, LM head unless tied); the exact count when known."""
        if self.num_parameters is not None:
            return self.num_parameters
        hidden, inter = self.hidden_size, self.intermediate_size
        q_size = self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        attention = hidden * (q_size + 2 * kv_size) + q_size * hidden
        if self.attention_bias:
            attention += q_size + 2 * kv_size
        per_layer = attention + 3 * hidden * inter + self.num_norms_per_layer * hidden
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeddings + hidden

    def estimate_weight_bytes(self) -> int:
        """Bytes of all weights (one copy, before tensor parallelism)."""
        if self.weight_bytes is not None:
            return self.weight_bytes
        return self.estimate_num_parameters() * WEIGHT_DTYPE_BYTES.get(self.dtype, 2)

    def num_kv_heads_per_device(self, tensor_parallel_size: int = 1) -> int:
        """KV heads each device holds: split evenly, or one replicated head when there are
        fewer KV heads than devices (as vLLM does).

        Raises:
            ConfigError: tensor_parallel_size does not divide the query heads, or the KV heads
                cannot be split or replicated evenly; the message lists valid sizes.
        """
        tp = tensor_parallel_size
        kv = self.num_key_value_heads
        if (
            not isinstance(tp, int)
            or tp < 1
            or self.num_attention_heads % tp
            or (kv % tp and tp % kv)
        ):
            valid = [
                n
                for n in range(1, self.num_attention_heads + 1)
                if self.num_attention_heads % n == 0 and (kv % n == 0 or n % kv == 0)
            ]
            raise ConfigError(
                f"tensor_parallel_size {tp!r} does not split {self.name}'s "
                f"{self.num_attention_heads} attention / {kv} KV heads; choose one of "
                + ", ".join(map(str, valid))
            )
        return max(1, kv // tp)

    def layer_specs(
        self, *, block_size: int, kv_cache_dtype: str, tensor_parallel_size: int = 1
    ) -> tuple[KVCacheSpec, ...]:
        """One KV-cache spec per layer, as one device of ``tensor_parallel_size`` holds it."""
        num_kv_heads = self.num_kv_heads_per_device(tensor_parallel_size)
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


# ---- Hugging Face config.json -------------------------------------------------------------


def _require(config: Mapping[str, Any], key: str, where: str) -> Any:
    value = config.get(key)
    if value is None:
        raise ConfigError(f"{where}: config.json has no {key!r}")
    return value


def _hf_layer_windows(config: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows from the several ways configs say it."""
    model_type = config.get("model_type", "")
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        # Qwen2 sets sliding_window but turns it off with use_sliding_window: false.
        return (None,) * num_layers
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        windows: list[int | None] = []
        for kind in layer_types:
            if kind == "full_attention":
                windows.append(None)
            elif kind == "sliding_attention":
                windows.append(int(window))
            else:
                raise ConfigError(
                    f"unsupported layer type {kind!r}; choose full_attention or sliding_attention"
                )
        return tuple(windows)
    pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern"))
    if pattern:
        # Gemma-3: every pattern-th layer is full attention, the rest slide.
        return tuple(
            None if (i + 1) % int(pattern) == 0 else int(window) for i in range(num_layers)
        )
    if model_type == "gemma2":
        # Gemma-2 alternates: even layers slide, odd layers are full attention.
        return tuple(int(window) if i % 2 == 0 else None for i in range(num_layers))
    if model_type in ("qwen2", "qwen2_moe", "qwen3"):
        # Qwen2 with use_sliding_window: layers from max_window_layers on slide.
        first = int(config.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (int(window),) * num_layers  # Mistral-7B-v0.1 style: every layer slides


def shape_from_hf_config(config: Mapping[str, Any], *, name: str = "config.json") -> ModelShape:
    """A model shape from a parsed Hugging Face ``config.json``.

    Reads num_hidden_layers, num_attention_heads, num_key_value_heads (default: the attention
    heads), head_dim (default hidden_size / num_attention_heads), sliding_window and which
    layers use it (layer_types, sliding_window_pattern, Gemma-2's alternation, Qwen2's
    use_sliding_window / max_window_layers). A multimodal config's ``text_config`` is used.

    Raises:
        ConfigError: a required key is missing or a value is not understood.
    """
    if isinstance(config.get("text_config"), Mapping):
        config = {"model_type": config.get("model_type", ""), **config["text_config"]}
    model_type = config.get("model_type", "")
    num_layers = int(_require(config, "num_hidden_layers", name))
    num_heads = int(_require(config, "num_attention_heads", name))
    hidden_size = int(_require(config, "hidden_size", name))
    head_dim = config.get("head_dim") or hidden_size // num_heads
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return ModelShape(
        name=name,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        hidden_size=hidden_size,
        intermediate_size=int(_require(config, "intermediate_size", name)),
        vocab_size=int(_require(config, "vocab_size", name)),
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        layer_windows=_hf_layer_windows(config, num_layers),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
        attention_bias=bool(config.get("attention_bias", model_type in _QKV_BIAS)),
        num_norms_per_layer=4 if model_type in _FOUR_NORMS else 2,
        dtype=dtype if dtype in WEIGHT_DTYPE_BYTES else "bfloat16",
        source=name,
    )


def load_hf_config(path: str | Path) -> ModelShape:
    """A model shape from a ``config.json`` file or a folder holding one.

    Raises:
        ModelLoadError: the file is missing or is not JSON.
        ConfigError: as :func:`shape_from_hf_config`.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read Hugging Face config {path}: {exc}") from exc
    return shape_from_hf_config(config, name=str(path))


# ---- GGUF ---------------------------------------------------------------------------------


def load_gguf(path: str | Path) -> ModelShape:
    """A model shape from a GGUF file's metadata; weights and parameters counted exactly.

    Reads ``{arch}.block_count``, ``.attention.head_count(_kv)``, ``.attention.key_length``
    (default embedding_length / head_count), ``.embedding_length``, ``.feed_forward_length``,
    ``.context_length``, ``.attention.sliding_window`` (Gemma-2 alternates, Gemma-3 by
    ``.attention.sliding_window_pattern``). The KV-cache dtype for ``auto`` is float16 (llama.cpp's
    default). Uses the ``gguf`` package's GGUFReader, imported here.

    Raises:
        ModelLoadError: the file is missing or is not GGUF.
        ConfigError: required metadata is missing.
    """
    from gguf import GGUFReader  # heavy (numpy); only when a GGUF file is planned

    path = Path(path)
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc

    def field(key: str, default: Any = None) -> Any:
        found = reader.fields.get(key)
        return default if found is None else found.contents()

    arch = field("general.architecture")
    if arch is None:
        raise ConfigError(f"{path}: GGUF metadata has no general.architecture")

    def required(key: str) -> Any:
        value = field(f"{arch}.{key}")
        if value is None:
            raise ConfigError(f"{path}: GGUF metadata has no {arch}.{key}")
        return value

    num_layers = int(required("block_count"))
    num_heads = int(required("attention.head_count"))
    num_kv_heads = field(f"{arch}.attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts in some files
        num_kv_heads = max(num_kv_heads)
    hidden_size = int(required("embedding_length"))
    vocab_size = field(f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens.data) if tokens is not None else 0
    window = field(f"{arch}.attention.sliding_window")
    pattern = field(f"{arch}.attention.sliding_window_pattern")
    if window is None:
        windows: tuple[int | None, ...] = (None,) * num_layers
    elif arch == "gemma2":
        windows = tuple(int(window) if i % 2 == 0 else None for i in range(num_layers))
    elif isinstance(pattern, int) and pattern > 0:
        windows = tuple(None if (i + 1) % pattern == 0 else int(window) for i in range(num_layers))
    else:
        windows = (int(window),) * num_layers
    tensor_names = {tensor.name for tensor in reader.tensors}
    return ModelShape(
        name=path.name,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(num_kv_heads),
        head_dim=int(field(f"{arch}.attention.key_length", hidden_size // num_heads)),
        hidden_size=hidden_size,
        intermediate_size=int(field(f"{arch}.feed_forward_length", 4 * hidden_size)),
        vocab_size=int(vocab_size),
        max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
        layer_windows=windows,
        tie_word_embeddings="output.weight" not in tensor_names,
        dtype="float16",
        num_parameters=sum(int(t.n_elements) for t in reader.tensors),
        weight_bytes=sum(int(t.n_bytes) for t in reader.tensors),
        source=str(path),
    )
