"""The shape of a decoder (Llama family, Gemma 3), read from GGUF metadata or a Hugging Face
config.json, and the KV-cache spec of each of its layers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.core.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedkv.errors import ModelLoadError

#: Model types (GGUF ``general.architecture`` / HF ``model_type``) pagedkv runs: the Llama family
#: (:mod:`pagedkv.model.llama`) and Gemma 3 (:mod:`pagedkv.model.gemma3`).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3")

#: ``layer_types`` entries (Hugging Face's names).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

#: Gemma 3 defaults that GGUF files do not store (llama.cpp hard-codes the same values): every
#: sixth layer is global, the others slide; the local layers' rope base.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_LOCAL_THETA = 10000.0
#: Gemma 3 27B (62 layers) scales queries by (hidden_size / num_heads) ** -0.5, the other sizes
#: by head_dim ** -0.5 (its config's query_pre_attn_scalar; llama.cpp keys it on the layer count).
_GEMMA3_27B_NUM_LAYERS = 62


@dataclass(slots=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (names as in Hugging Face's LlamaConfig).

    ``architecture`` is the model type ("llama", "mistral", "qwen2"). ``rope_scaling`` is None or
    a dict in Hugging Face's form (``{"rope_type": "llama3", "factor": ..., ...}``,
    ``{"rope_type": "linear", "factor": ...}``), or ``{"rope_type": "freq_factors", "factors":
    [...]}`` for GGUF files that store llama3-style per-frequency divisors (``rope_freqs.weight``).
    ``eos_token_id`` is an int or a list of ints.

    Gemma 3 fields (defaults leave a Llama-family model as it was):

    - ``layer_types``: per layer ``"full_attention"`` or ``"sliding_attention"``; None = every
      layer full attention.
    - ``sliding_window``: tokens a sliding-window layer attends to (itself and the
      ``sliding_window - 1`` before it).
    - ``rope_local_theta``: rope base of the sliding-window layers (None = ``rope_theta``);
      ``rope_theta`` and ``rope_scaling`` are the full-attention layers'.
    - ``query_pre_attn_scalar``: queries are scaled by ``query_pre_attn_scalar ** -0.5`` (None =
      ``head_dim``).
    - ``final_logit_softcapping``: logits = cap * tanh(logits / cap) when set.
    - ``attn_logit_softcapping``: must be None (Gemma 2's score capping is not implemented).
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
        if self.attn_logit_softcapping is not None:
            raise ModelLoadError(
                f"attention logit softcapping ({self.attn_logit_softcapping}) is not supported "
                "(Gemma 2); paged_attention has no score cap"
            )

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
    def from_hf_config(cls, config: Mapping[str, Any], *, has_lm_head: bool = True) -> ModelConfig:
        """Build from the dict of a Hugging Face ``config.json``.

        Args:
            config: the parsed config.json.
            has_lm_head: whether the checkpoint stores ``lm_head.weight``; when it does not, the
                embeddings are tied whatever the config says.

        Raises:
            ModelLoadError: a missing required key or an unsupported architecture.
        """
        try:
            architecture = config["model_type"]
            if architecture == "gemma3_text":
                return cls._from_hf_gemma3(config, has_lm_head=has_lm_head)
            if architecture == "gemma3":
                raise ModelLoadError(
                    "multimodal Gemma 3 checkpoints (model_type 'gemma3') are not supported; "
                    "pagedkv runs the text model (model_type 'gemma3_text')"
                )
            hidden_size = int(config["hidden_size"])
            num_heads = int(config["num_attention_heads"])
            rope_params = config.get("rope_parameters") or {}
            rope_scaling = config.get("rope_scaling") or None
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
            rope_theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
            return cls(
                architecture=architecture,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(config["intermediate_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
                head_dim=int(config.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False))
                or not has_lm_head,
                # Qwen2 always has a bias on q/k/v; its config has no key for it.
                attention_bias=bool(config.get("attention_bias", architecture == "qwen2")),
                bos_token_id=config.get("bos_token_id"),
                eos_token_id=config.get("eos_token_id"),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks the required key {e.args[0]!r}") from None

    @classmethod
    def _from_hf_gemma3(cls, config: Mapping[str, Any], *, has_lm_head: bool) -> ModelConfig:
        """A ``gemma3_text`` config.json, in transformers 5's form (``layer_types``,
        ``rope_parameters`` per layer type) or the older one (``sliding_window_pattern``,
        ``rope_theta``, ``rope_local_base_freq``, ``rope_scaling`` for the global layers)."""
        activation = config.get("hidden_activation", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ModelLoadError(
                f"Gemma 3 hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)"
            )
        num_layers = int(config["num_hidden_layers"])
        layer_types = config.get("layer_types")
        if layer_types is None:
            pattern = int(config.get("sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN))
            layer_types = gemma3_layer_types(num_layers, pattern)
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
        rope_scaling = full if full.get("rope_type", "default") != "default" else None
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden_size // num_heads)
        window = config.get("sliding_window")
        return cls(
            architecture="gemma3",
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)) or not has_lm_head,
            attention_bias=bool(config.get("attention_bias", False)),
            bos_token_id=config.get("bos_token_id", 2),
            eos_token_id=config.get("eos_token_id", 1),
            layer_types=tuple(layer_types),
            sliding_window=None if window is None else int(window),
            rope_local_theta=rope_local_theta,
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", head_dim)),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
        """Build from GGUF key/value metadata (``{arch}.block_count``, ...) and tensor names.

        Args:
            metadata: GGUF fields as Python values (``general.architecture`` -> "llama", ...).
            tensor_names: GGUF tensor names; they tell whether the embeddings are tied (no
                ``output.weight``) and whether q/k/v have a bias.

        Raises:
            ModelLoadError: a missing required key or an unsupported architecture.
        """
        arch = metadata.get("general.architecture")
        if arch is None:
            raise ModelLoadError("GGUF file lacks general.architecture")

        def get(key: str, default: Any = KeyError) -> Any:
            value = metadata.get(f"{arch}.{key}", default)
            if value is KeyError:
                raise ModelLoadError(f"GGUF file lacks the required key {arch}.{key!r}")
            return value

        hidden_size = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        vocab_size = get("vocab_size")
        rope_scaling = None
        scaling_type = get("rope.scaling.type", None)
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        elif scaling_type not in (None, "none"):
            raise ModelLoadError(f"GGUF rope scaling {scaling_type!r} is not supported")
        gemma: dict[str, Any] = {}
        if arch == "gemma3":
            gemma = _gemma3_gguf_fields(get, hidden_size, num_heads)
        return cls(
            architecture=arch,
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", hidden_size // num_heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
            **gemma,
        )


def gemma3_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Gemma 3's layer types: ``pattern - 1`` sliding-window layers, then one full-attention
    layer, repeated (``pattern`` 6: layers 5, 11, 17, ... are full attention).

    Raises:
        ModelLoadError: ``pattern`` < 1.
    """
    if pattern < 1:
        raise ModelLoadError(f"sliding_window_pattern must be >= 1, got {pattern}")
    return tuple(
        FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers)
    )


def _gemma3_gguf_fields(get, hidden_size: int, num_heads: int) -> dict[str, Any]:
    """The Gemma 3 fields of a GGUF file's metadata (``get(key, default)`` reads ``gemma3.*``).

    GGUF files written by llama.cpp's converter store the window but neither the layer pattern,
    the local rope base nor the query scale; llama.cpp (and transformers' GGUF loader) then use
    Gemma 3's fixed values, as we do. Newer files may store ``attention.sliding_window_pattern``
    (a period, or one bool per layer, True = sliding) and ``rope.freq_base_swa``: those win.
    """
    num_layers = int(get("block_count"))
    head_dim = int(get("attention.key_length", hidden_size // num_heads))
    pattern = get("attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ModelLoadError(
                f"gemma3.attention.sliding_window_pattern has {len(pattern)} entries for "
                f"{num_layers} layers"
            )
        layer_types = tuple(SLIDING_ATTENTION if p else FULL_ATTENTION for p in pattern)
    else:
        layer_types = gemma3_layer_types(num_layers, int(pattern))
    window = get("attention.sliding_window", None)
    scalar = head_dim if num_layers != _GEMMA3_27B_NUM_LAYERS else hidden_size // num_heads
    softcap = get("final_logit_softcapping", None)
    return {
        "layer_types": layer_types,
        "sliding_window": None if window is None else int(window),
        "rope_local_theta": float(get("rope.freq_base_swa", GEMMA3_ROPE_LOCAL_THETA)),
        "query_pre_attn_scalar": float(scalar),
        "final_logit_softcapping": None if softcap is None else float(softcap),
    }


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
