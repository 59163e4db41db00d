"""Model shapes for capacity planning, read from files: a Hugging Face ``config.json`` or a GGUF
file's metadata.

The shape itself and the parsing of config keys live in :mod:`pagedkv.modelinfo.shape` (one
parser shared with the engine's model config); this module only reads the files. No torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedkv.errors import ModelLoadError
from pagedkv.modelinfo.shape import (
    WEIGHT_DTYPE_BYTES,
    ModelShape,
    shape_from_gguf_metadata,
    shape_from_hf_config,
)

#: GGUF arrays longer than this (vocabulary, merges) are not read into the metadata dict.
_MAX_ARRAY_LEN = 4096


def load_hf_config(path: str | Path) -> ModelShape:
    """A model shape from a ``config.json`` file or a folder holding one.

    Raises:
        ModelLoadError: the file is missing or is not JSON.
        ModelConfigError: as :func:`~pagedkv.modelinfo.shape.shape_from_hf_config`.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read Hugging Face config {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"Hugging Face config {path} is not a JSON object")
    return shape_from_hf_config(config, name=str(path))


def load_gguf(path: str | Path) -> ModelShape:
    """A model shape from a GGUF file's metadata; parameters and weight bytes summed exactly
    from its tensors. Uses the ``gguf`` package's GGUFReader, imported here.

    Raises:
        ModelLoadError: the file is missing or is not GGUF.
        ModelConfigError: as :func:`~pagedkv.modelinfo.shape.shape_from_gguf_metadata`.
    """
    from gguf import GGUFReader  # heavy (numpy); only when a GGUF file is planned

    path = Path(path)
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    metadata: dict[str, Any] = {
        key: field.contents()
        for key, field in reader.fields.items()
        if len(field.data) <= _MAX_ARRAY_LEN
    }
    arch = metadata.get("general.architecture")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if f"{arch}.vocab_size" not in metadata and tokens is not None:
        metadata[f"{arch}.vocab_size"] = len(tokens.data)
    return shape_from_gguf_metadata(
        metadata,
        {tensor.name for tensor in reader.tensors},
        name=path.name,
        num_parameters=sum(int(t.n_elements) for t in reader.tensors),
        weight_bytes=sum(int(t.n_bytes) for t in reader.tensors),
        source=str(path),
    )


__all__ = [
    "WEIGHT_DTYPE_BYTES",
    "ModelShape",
    "load_gguf",
    "load_hf_config",
    "shape_from_hf_config",
]
