"""The shape of a Llama-family decoder, read from GGUF metadata or a Hugging Face config.json.

The keys shared with capacity planning (layers, heads, sizes, context, tied embeddings, q/k/v
bias) are parsed once, by :mod:`pagedkv.core.model_shape`, with one set of defaults and errors;
this module adds what only running the model needs (rope, norm epsilon, token ids).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.core.model_shape import ModelShape, shape_from_gguf_metadata, shape_from_hf_config
from pagedkv.errors import ModelLoadError

#: Model types (GGUF ``general.architecture`` / HF ``model_type``) this decoder runs.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(slots=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (names as in Hugging Face's LlamaConfig).

    ``architecture`` is the model type ("llama", "mistral", "qwen2"). ``rope_scaling`` is None or
    a dict in Hugging Face's form (``{"rope_type": "llama3", "factor": ..., ...}``,
    ``{"rope_type": "linear", "factor": ...}``), or ``{"rope_type": "freq_factors", "factors":
    [...]}`` for GGUF files that store llama3-style per-frequency divisors (``rope_freqs.weight``).
    ``eos_token_id`` is an int or a list of ints.
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
        """Build from a parsed :class:`~pagedkv.core.model_shape.ModelShape` plus the fields only
        running the model needs (``rms_norm_eps``, ``rope_theta``, ``rope_scaling``,
        ``bos_token_id``, ``eos_token_id``; ``tie_word_embeddings`` may be overridden).

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
        }
        return cls(architecture=architecture, **{**shared, **fields})

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, has_lm_head: bool = True) -> ModelConfig:
        """Build from the dict of a Hugging Face ``config.json``.

        Args:
            config: the parsed config.json.
            has_lm_head: whether the checkpoint stores ``lm_head.weight``; when it does not, the
                embeddings are tied whatever the config says.

        Raises:
            ModelLoadError: an unsupported architecture; ModelConfigError (a ModelLoadError) for
                a missing or malformed key.
        """
        _check_architecture(config.get("model_type"))
        shape = shape_from_hf_config(config)
        rope_params = config.get("rope_parameters") or {}
        rope_scaling = config.get("rope_scaling") or None
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        rope_theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        return cls.from_shape(
            shape,
            architecture=shape.model_type,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=shape.tie_word_embeddings or not has_lm_head,
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
        )

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
        return cls.from_shape(
            shape,
            architecture=arch,
            rms_norm_eps=float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        )


def _check_architecture(architecture: Any) -> None:
    """Raises ModelLoadError unless this decoder runs ``architecture`` (checked before the
    shared shape parser, so the message lists what the engine runs)."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"model architecture {architecture!r} is not supported; "
            f"pagedkv runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
