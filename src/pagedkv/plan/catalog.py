"""Built-in models (published shapes) and devices (memory sizes) for ``pagedkv plan``.

Model shapes are copied from each model's Hugging Face ``config.json`` (the repository id is in
``source``); parameter counts follow from the shapes and match the published counts (for example
Llama-3.1-8B: 8,030,261,248; Mixtral-8x7B: 46,702,792,704, every expert counted). Device sizes are
the totals the driver reports (``nvidia-smi --query-gpu=memory.total``; ROCm's pool size for
MI300X), which is what an engine that asks the device sees; the marketing names round them (an
"80GB" H100 reports 81,559 MiB = 79.6 GiB). Each device's source is in :data:`DEVICE_SOURCES`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from pagedkv.errors import ConfigError
from pagedkv.modelinfo.shape import pattern_windows
from pagedkv.plan.shapes import ModelShape, load_gguf, load_hf_config
from pagedkv.units import MiB, parse_memory_size


def _alternate(num_layers: int, window: int) -> tuple[int | None, ...]:
    """Gemma-2's layer pattern: even layers slide, odd layers are full attention."""
    return tuple(window if i % 2 == 0 else None for i in range(num_layers))


MODELS = MappingProxyType(
    {
        "SmolLM2-135M": ModelShape(
            name="SmolLM2-135M",
            model_type="llama",
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
            model_type="llama",
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
            model_type="llama",
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
            model_type="qwen2",
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
            model_type="mistral",
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
            model_type="gemma2",
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
        # Gemma 3: five sliding-window layers, then one full-attention layer (pagedkv runs it:
        # `--model gemma3-270m`).
        "Gemma-3-270M": ModelShape(
            name="Gemma-3-270M",
            model_type="gemma3_text",
            source="google/gemma-3-270m",
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            hidden_size=640,
            intermediate_size=2048,
            vocab_size=262144,
            max_position_embeddings=32768,
            layer_windows=pattern_windows(18, 512, 6),
            tie_word_embeddings=True,
            num_norms_per_layer=4,
            qk_norm=True,
        ),
        # Mixture of experts: every expert's weights are held, though a token runs 2 of 8.
        "Mixtral-8x7B": ModelShape(
            name="Mixtral-8x7B",
            model_type="mixtral",
            source="mistralai/Mixtral-8x7B-v0.1",
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            hidden_size=4096,
            intermediate_size=14336,
            vocab_size=32000,
            max_position_embeddings=32768,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=14336,
        ),
        "Qwen1.5-MoE-A2.7B": ModelShape(
            name="Qwen1.5-MoE-A2.7B",
            model_type="qwen2_moe",
            source="Qwen/Qwen1.5-MoE-A2.7B",
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=128,
            hidden_size=2048,
            intermediate_size=5632,
            vocab_size=151936,
            max_position_embeddings=8192,
            attention_bias=True,
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            shared_expert_gate=True,
        ),
        "Qwen3-30B-A3B": ModelShape(
            name="Qwen3-30B-A3B",
            model_type="qwen3_moe",
            source="Qwen/Qwen3-30B-A3B",
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            hidden_size=2048,
            intermediate_size=6144,
            vocab_size=151936,
            max_position_embeddings=40960,
            qk_norm=True,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
        ),
        # Multi-head latent attention: one 512 + 64 latent per token and layer, not per head.
        "DeepSeek-V2-Lite": ModelShape(
            name="DeepSeek-V2-Lite",
            model_type="deepseek_v2",
            source="deepseek-ai/DeepSeek-V2-Lite",
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=192,
            hidden_size=2048,
            intermediate_size=10944,
            vocab_size=102400,
            max_position_embeddings=163840,
            num_experts=64,
            num_experts_per_tok=6,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=2 * 1408,
            moe_layers=(False,) + (True,) * 26,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        # Released with fp8 projection weights in 128 x 128 blocks (quantization_config).
        "DeepSeek-V3": ModelShape(
            name="DeepSeek-V3",
            model_type="deepseek_v3",
            source="deepseek-ai/DeepSeek-V3",
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            head_dim=192,
            hidden_size=7168,
            intermediate_size=18432,
            vocab_size=129280,
            max_position_embeddings=163840,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=2048,
            shared_expert_intermediate_size=2048,
            router_bias=True,
            moe_layers=(False,) * 3 + (True,) * 58,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            quantization="fp8",
            weight_block_size=(128, 128),
        ),
    }
)

#: Other names that resolve to a catalog model.
MODEL_ALIASES = MappingProxyType(
    {
        "Mistral-7B": "Mistral-7B-v0.1",
        "Mixtral-8x7B-v0.1": "Mixtral-8x7B",
        "Meta-Llama-3.1-8B": "Llama-3.1-8B",
        "Meta-Llama-3.1-70B": "Llama-3.1-70B",
        "DeepSeek-V3-0324": "DeepSeek-V3",
        # the engine's short names of its packaged GGUFs (pagedkv.model.packaged_models)
        "smollm2": "SmolLM2-135M",
        "gemma3-270m": "Gemma-3-270M",
    }
)

#: Suffixes of fine-tuned variants that share the base model's shape (``...-Instruct``, ``-it``).
_VARIANT_SUFFIXES = ("-instruct", "-chat", "-it")


@dataclass(frozen=True, slots=True)
class Device:
    """A catalog device: the memory an engine on it sees, and where the number comes from."""

    name: str
    memory_bytes: int
    source: str


_NVIDIA_SMI = "nvidia-smi --query-gpu=memory.total"
_DEVICE_LIST = (
    Device("H100-80GB", 81559 * MiB, f"{_NVIDIA_SMI}: 81559 MiB (modal-labs/modal-client#2797)"),
    Device("H200-141GB", 143771 * MiB, f"{_NVIDIA_SMI}: 143771 MiB"),
    Device("B200-180GB", 183359 * MiB, f"{_NVIDIA_SMI}: 183359 MiB (NVIDIA/TensorRT-LLM#10278)"),
    Device("A100-40GB", 40960 * MiB, f"{_NVIDIA_SMI}: 40960 MiB (modal-labs/modal-client#2797)"),
    Device("A100-80GB", 81920 * MiB, f"{_NVIDIA_SMI}: 81920 MiB (modal-labs/modal-client#2797)"),
    Device("L4", 23034 * MiB, f"{_NVIDIA_SMI}: 23034 MiB (modal-labs/modal-client#2797)"),
    Device("L40S", 46068 * MiB, f"{_NVIDIA_SMI}: 46068 MiB (modal-labs/modal-client#2797)"),
    Device("A10G", 23028 * MiB, f"{_NVIDIA_SMI}: 23028 MiB (NVIDIA/DCGM#232, AWS g5)"),
    Device("RTX-4090", 24564 * MiB, f"{_NVIDIA_SMI}: 24564 MiB (RLinf/RLinf#255)"),
    Device(
        "MI300X",
        196592 * MiB,
        "rocminfo GPU pool size: 201310208 KB = 196592 MiB (ROCm/legacy-rocm-build#4414)",
    ),
)

#: Device memory in bytes, as the driver reports it.
DEVICES = MappingProxyType({d.name: d.memory_bytes for d in _DEVICE_LIST})
#: Where each device's number comes from.
DEVICE_SOURCES = MappingProxyType({d.name: d.source for d in _DEVICE_LIST})
#: Other names of catalog devices (matched ignoring case, spaces, '-' and '_').
DEVICE_ALIASES = MappingProxyType(
    {
        "H100": "H100-80GB",
        "H200": "H200-141GB",
        "B200": "B200-180GB",
        "MI300X-192GB": "MI300X",
        "L40S-48GB": "L40S",
        "A10G-24GB": "A10G",
        "RTX-4090-24GB": "RTX-4090",
    }
)
#: ``apple-64GB``, ``M3-Max-128GB``, ``m2 ultra:192GiB``: Apple silicon, unified memory size.
_APPLE = re.compile(
    r"^\s*(?P<chip>apple|m\d+(?:[\s_-]*(?:pro|max|ultra))?)[\s_:-]*(?P<size>\d.*)$", re.IGNORECASE
)
#: What the plan says about an Apple device's memory.
APPLE_MEMORY_NOTE = (
    "unified memory as given: give the GPU's share, Metal's recommendedMaxWorkingSetSize "
    "(below the RAM size unless `sysctl iogpu.wired_limit_mb` raises it)"
)


def _device_key(name: str) -> str:
    return re.sub(r"[\s_-]", "", name).lower()


def resolve_device(device: str) -> tuple[str, int]:
    """(name, bytes) of a catalog device or alias (case, spaces, '-' and '_' ignored), an Apple
    silicon device with its unified memory size (``apple-64GB``, ``M3-Max-128GB``), or a memory
    size like ``24GiB``.

    Raises:
        ConfigError: none of these; the message lists the devices.
    """
    key = _device_key(device)
    names = {_device_key(name): name for name in DEVICES}
    names.update({_device_key(alias): name for alias, name in DEVICE_ALIASES.items()})
    if key in names:
        name = names[key]
        return name, DEVICES[name]
    apple = _APPLE.match(device)
    text = apple.group("size") if apple else device
    try:
        size = parse_memory_size(text)
    except ConfigError:
        raise ConfigError(
            f"unknown device {device!r}; choose one of {', '.join(DEVICES)}, apple-<unified "
            "memory> (e.g. apple-64GB), or a memory size such as 24GiB"
        ) from None
    if size < 1:
        raise ConfigError(f"device memory must be positive, got {device!r}")
    if apple:
        chip = apple.group("chip")
        chip = "silicon" if chip.lower() == "apple" else chip
        return f"Apple {chip} ({text.strip()} unified)", size
    return device.strip(), size


def device_source(name: str) -> str:
    """Where a resolved device's memory size comes from ("" for a size given by the user)."""
    if name.startswith("Apple "):
        return APPLE_MEMORY_NOTE
    return DEVICE_SOURCES.get(name, "")


def _variant_base(name: str) -> str:
    """``Llama-3.1-8B-Instruct`` -> ``llama-3.1-8b``: the base model a fine-tune shares its
    shape with (suffixes in :data:`_VARIANT_SUFFIXES` removed, lower case)."""
    name = name.lower()
    for suffix in _VARIANT_SUFFIXES:
        name = name.replace(suffix + "-", "-")
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def _resolve_hf_id(text: str) -> ModelShape | None:
    """The catalog model a Hugging Face id (``org/name``) shares its shape with: same
    organisation as the catalog entry's source, same name once ``-Instruct`` / ``-Chat`` /
    ``-it`` are dropped (``meta-llama/Llama-3.1-8B-Instruct`` -> Llama-3.1-8B)."""
    org, _, repo = text.partition("/")
    names = {_variant_base(name): name for name in MODELS}
    names.update({_variant_base(alias): name for alias, name in MODEL_ALIASES.items()})
    name = names.get(_variant_base(repo))
    if name is None:
        return None
    shape = MODELS[name]
    if shape.source.split("/")[0].lower() != org.lower():
        return None
    return shape


def resolve_model(model: str | Path) -> ModelShape:
    """A model shape from a catalog name (case-insensitive), a Hugging Face id that shares a
    catalog model's shape (``meta-llama/Llama-3.1-8B-Instruct``), a ``config.json`` (or a
    folder holding one) or a ``.gguf`` file.

    Raises:
        ConfigError: an unknown name or Hugging Face id; the message lists the catalog.
        ModelLoadError: a file that cannot be read.
        ModelConfigError: a file describing a model the planner cannot size.
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
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not path.exists():
        shape = _resolve_hf_id(text)
        if shape is not None:
            return shape
        raise ConfigError(
            f"unknown model {text!r}: no catalog model shares its shape, and the planner does "
            "not download; save its config.json and pass the path (catalog: "
            f"{', '.join(MODELS)})"
        )
    raise ConfigError(
        f"unknown model {text!r}; choose one of {', '.join([*MODELS, *MODEL_ALIASES])}, "
        "a Hugging Face id of one of them, a config.json path or a .gguf file"
    )
