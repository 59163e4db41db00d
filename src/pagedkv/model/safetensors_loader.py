"""Read a Hugging Face model folder (config.json + *.safetensors) into weights and a ModelConfig."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.errors import ModelLoadError
from pagedkv.model.config import ModelConfig
from pagedkv.model.fused_weights import split_fused_weights


@dataclass(slots=True)
class HFCheckpoint:
    """What a Hugging Face folder holds: model config, weights, extra end-of-sequence ids."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    #: eos ids of generation_config.json (chat models often stop on several).
    generation_eos_token_ids: tuple[int, ...]


def load_hf_folder(folder: str | Path) -> HFCheckpoint:
    """Load every ``*.safetensors`` file of ``folder`` and its ``config.json``.

    Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` come back split into the Llama names
    (:func:`pagedkv.model.fused_weights.split_fused_weights`).

    Raises:
        ModelLoadError: no config.json, no safetensors files, an unreadable file, or an
            unsupported or malformed model.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder} has no config.json; it is not a Hugging Face model folder")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{folder} has no *.safetensors weights (pytorch_model.bin is not supported; "
            "convert it with save_pretrained(..., safe_serialization=True))"
        )
    try:
        hf_config = json.loads(config_path.read_text())
        state_dict: dict[str, torch.Tensor] = {}
        for file in files:
            state_dict.update(load_file(str(file)))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the model in {folder}: {e}") from e
    config = ModelConfig.from_hf_config(hf_config, has_lm_head="lm_head.weight" in state_dict)
    split_fused_weights(state_dict, config)  # Phi-3's qkv_proj and gate_up_proj
    eos: tuple[int, ...] = ()
    generation_path = folder / "generation_config.json"
    if generation_path.is_file():
        value = json.loads(generation_path.read_text()).get("eos_token_id")
        if value is not None:
            eos = (value,) if isinstance(value, int) else tuple(value)
    return HFCheckpoint(config=config, state_dict=state_dict, generation_eos_token_ids=eos)
