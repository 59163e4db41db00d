"""Built-in models (published shapes) and devices (memory sizes) for ``pagedkv plan``.

Model shapes are copied from each model's Hugging Face ``config.json`` (the repository id is in
``source``); parameter counts follow from the shapes and match the published counts (for example
Llama-3.1-8B: 8,030,261,248). Device sizes are the totals the NVIDIA driver reports
(``nvidia-smi --query-gpu=memory.total``), which is what an engine that asks the device sees;
the marketing names round them (an "80GB" H100 reports 81,559 MiB = 79.6 GiB).
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

from pagedkv.errors import ConfigError
from pagedkv.plan.shapes import ModelShape, load_gguf, load_hf_config
from pagedkv.units import MiB, parse_memory_size


def _alternate(num_layers: int, window: int) -> tuple[int | None, ...]:
    """Gemma-2's layer pattern: even layers slide, odd layers are full attention."""
    return tuple(window if i % 2 == 0 else None for i in range(num_layers))


MODELS = MappingProxyType(
    {
        "SmolLM2-135M": ModelShape(
            name="SmolLM2-135M",
            source="HuggingFaceTB/SmolLM2-135M",
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            hidden_size=576,
            intermediate_size=1536,
            vocab_size=49152,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
        "Llama-3.1-8B": ModelShape(
            name="Llama-3.1-8B",
            source="meta-llama/Llama-3.1-8B",
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            hidden_size=4096,
            intermediate_size=14336,
            vocab_size=128256,
            max_position_embeddings=131072,
        ),
        "Llama-3.1-70B": ModelShape(
            name="Llama-3.1-70B",
            source="meta-llama/Llama-3.1-70B",
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            hidden_size=8192,
            intermediate_size=28672,
            vocab_size=128256,
            max_position_embeddings=131072,
        ),
        "Qwen2.5-7B": ModelShape(
            name="Qwen2.5-7B",
            source="Qwen/Qwen2.5-7B (use_sliding_window: false)",
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            head_dim=128,
            hidden_size=3584,
            intermediate_size=18944,
            vocab_size=152064,
            max_position_embeddings=131072,
            attention_bias=True,
        ),
        # v0.1 is the Mistral-7B with a 4096-token sliding window on every layer; v0.2 and
        # later dropped the window (sliding_window: null) and use full attention over 32k.
        "Mistral-7B-v0.1": ModelShape(
            name="Mistral-7B-v0.1",
            source="mistralai/Mistral-7B-v0.1",
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            hidden_size=4096,
            intermediate_size=14336,
            vocab_size=32000,
            max_position_embeddings=32768,
            layer_windows=(4096,) * 32,
        ),
        "Gemma-2-9B": ModelShape(
            name="Gemma-2-9B",
            source="google/gemma-2-9b",
            num_hidden_layers=42,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            hidden_size=3584,
            intermediate_size=14336,
            vocab_size=256000,
            max_position_embeddings=8192,
            layer_windows=_alternate(42, 4096),
            tie_word_embeddings=True,
            num_norms_per_layer=4,
        ),
    }
)

#: Other names that resolve to a catalog model.
MODEL_ALIASES = MappingProxyType({"Mistral-7B": "Mistral-7B-v0.1"})

#: Device memory in bytes, as the driver reports it.
DEVICES = MappingProxyType(
    {
        "H100-80GB": 81559 * MiB,
        "H200-141GB": 143771 * MiB,
        "A100-40GB": 40960 * MiB,
        "A100-80GB": 81920 * MiB,
        "L4": 23034 * MiB,
        "RTX-4090": 24564 * MiB,
    }
)


def resolve_device(device: str) -> tuple[str, int]:
    """(name, bytes) of a catalog device (case-insensitive) or a memory size like ``24GiB``.

    Raises:
        ConfigError: neither; the message lists the devices.
    """
    for name, size in DEVICES.items():
        if name.lower() == device.strip().lower():
            return name, size
    try:
        size = parse_memory_size(device)
    except ConfigError:
        raise ConfigError(
            f"unknown device {device!r}; choose one of {', '.join(DEVICES)} "
            "or a memory size such as 24GiB"
        ) from None
    if size < 1:
        raise ConfigError(f"device memory must be positive, got {device!r}")
    return device.strip(), size


def resolve_model(model: str | Path) -> ModelShape:
    """A model shape from a catalog name (case-insensitive), a ``config.json`` (or a folder
    holding one) or a ``.gguf`` file.

    Raises:
        ConfigError: an unknown name; the message lists the catalog.
        ModelLoadError: a file that cannot be read.
    """
    text = str(model).strip()
    names = {name.lower(): name for name in MODELS}
    names.update({alias.lower(): name for alias, name in MODEL_ALIASES.items()})
    if text.lower() in names:
        return MODELS[names[text.lower()]]
    path = Path(text).expanduser()
    if path.suffix.lower() == ".gguf":
        return load_gguf(path)
    if path.suffix.lower() == ".json" or (path / "config.json").is_file():
        return load_hf_config(path)
    raise ConfigError(
        f"unknown model {text!r}; choose one of {', '.join([*MODELS, *MODEL_ALIASES])}, "
        "a config.json path or a .gguf file"
    )
