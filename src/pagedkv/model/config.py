"""The shape of a Llama-family decoder, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
        )
