"""Read a GGUF file (llama.cpp's format) into Hugging Face-named weights and a ModelConfig.

By default (``--quantization gguf``) every 2-D weight stays as the file stores it
(:class:`~pagedkv.model.gguf_weight.GGUFWeight`, any of the GGML types pagedkv's kernels run:
its bytes computed on in place in the mapped file where the page cache maps it with 2 MiB
pages, else read unchanged into anonymous memory, :class:`WeightArena`; see
:data:`MMAP_ENV`), so the model's memory is the file's; norms and biases
are dequantized to fp32. With ``--quantization none`` every tensor is dequantized to fp32 with
the ``gguf`` package. Three things differ from a Hugging Face checkpoint and are undone here:

- Names: ``blk.{i}.attn_q.weight`` -> ``model.layers.{i}.self_attn.q_proj.weight``, ... (Gemma 2
  and 3 have their own table: four norms per layer, and Gemma 3's q/k norms; Qwen3 adds
  ``attn_q_norm`` / ``attn_k_norm``; Phi-3's fused ``attn_qkv`` and ``ffn_up``, which holds gate
  then up, are split like its Hugging Face checkpoints' by
  :func:`pagedkv.model.fused_weights.split_fused_weights`, and its LongRoPE factors are the
  ``rope_factors_short`` / ``rope_factors_long`` tensors).
- Gemma norm weights (gemma2 and gemma3 architectures). Gemma's RMSNorm scales by ``1 + weight``;
  llama.cpp's converter stores ``weight + 1`` for every ``*norm.weight`` so that its plain RMSNorm
  applies. We subtract 1 back (as transformers' GGUF loader does), so the weights equal the
  Hugging Face ones and :mod:`pagedkv.model.gemma3` applies ``1 + weight`` as transformers does.
- Q/K row order (llama architecture only). Hugging Face's rotary embedding pairs dimension ``j``
  of a head with dimension ``j + head_dim/2`` ("rotate half"); llama.cpp's pairs ``2j`` with
  ``2j + 1``. llama.cpp's converter therefore permutes the rows of q_proj and k_proj, per head, from
  ``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]`` to ``[x_0, y_0, x_1, y_1, ...]``. We apply the inverse so
  that the weights equal the Hugging Face ones and the rotate-half rotary applies. (Qwen2, Qwen3
  and Phi-3 GGUFs use llama.cpp's NeoX rotary, which already pairs ``j`` with ``j + d/2``, and
  its converter does not permute them: nothing to undo; nor for Gemma 2 and 3, also NeoX in
  llama.cpp.)
"""

from __future__ import annotations

import logging
import os
import re
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.errors import ConfigError, HostMemoryError, ModelLoadError
from pagedkv.model.config import ModelConfig, gguf_longrope_scaling
from pagedkv.model.fused_weights import split_fused_weights, split_rows
from pagedkv.model.gguf_metadata import read_gguf_header
from pagedkv.model.gguf_weight import GGUFWeight, ggml_type_name, ggml_type_sizes
from pagedkv.model.kernels.cpu_quant import CpuQuantKernels
from pagedkv.ops.host_memory import (
    HUGE_PAGE,
    anonymous_zeros,
    drop_cached_pages,
    huge_mapped_bytes,
    huge_page_setting,
    map_file_read_only,
    populate_mapped_pages,
    release_mapped_pages,
)
from pagedkv.units import format_bytes

logger = logging.getLogger(__name__)

#: Architectures whose GGUF q/k rows are interleaved for llama.cpp's normal (GPT-J style) rotary.
_PERMUTED_ARCHITECTURES = ("llama", "mistral")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA3_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QWEN3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
#: Phi-3's fused q/k/v and gate/up (split after loading, see the module docstring)
_PHI3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_qkv.bias": "self_attn.qkv_proj.bias",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
_LAYER_NAMES_BY_ARCHITECTURE = {
    "gemma2": _GEMMA3_LAYER_NAMES,
    "gemma3": _GEMMA3_LAYER_NAMES,
    "qwen3": _QWEN3_LAYER_NAMES,
    "phi3": _PHI3_LAYER_NAMES,
}
#: Architectures whose GGUF norm weights hold ``1 + weight`` (llama.cpp's Gemma converters).
_NORM_PLUS_ONE_ARCHITECTURES = ("gemma2", "gemma3")
#: Phi-3's LongRoPE factor tensors -> rope_scaling keys.
_LONGROPE_TENSORS = {
    "rope_factors_short.weight": "short_factor",
    "rope_factors_long.weight": "long_factor",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# Array fields larger than this (the vocabulary, merges) are not turned into Python values.
_MAX_ARRAY_LEN = 4096


@dataclass(slots=True)
class GGUFCheckpoint:
    """What a GGUF file holds: model config, weights under HF names (fp32 tensors, and GGUF
    weights kept as stored when asked for), and the header's metadata."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor | GGUFWeight]
    metadata: dict[str, Any]


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor name of ``architecture`` (GGUF
    ``general.architecture``), or None for tensors with no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _LAYER_NAMES_BY_ARCHITECTURE.get(architecture, _LAYER_NAMES)
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_names:
        return None
    return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of q/k rows (see the module docstring).

    Args:
        weight: ``[num_heads * head_dim, ...]`` q or k projection weight (or bias) in GGUF order.
        num_heads: heads of that projection (num_attention_heads for q, num_key_value_heads for k).

    Returns:
        The same tensor in Hugging Face (rotate-half) row order.
    """
    half = weight.shape[0] // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def read_metadata(reader: Any) -> dict[str, Any]:
    """GGUF key/value fields as Python values; long arrays (vocabulary, merges) are skipped."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if len(field.data) > _MAX_ARRAY_LEN:
            continue
        metadata[key] = field.contents()
    return metadata


def load_gguf(
    path: str | Path,
    *,
    quantized: bool = False,
    kernels: CpuQuantKernels | None = None,
    on_sampled: Callable[[], None] | None = None,
) -> GGUFCheckpoint:
    """Read a GGUF file's config and weights.

    The file is memory-mapped (read-only, faulted in: :func:`~pagedkv.ops.host_memory.
    map_file_read_only`; the small tensors and a lookup-only embedding table are read from
    the mapping) and its header walked without the
    ``gguf`` package's reader (:func:`~pagedkv.model.gguf_metadata.read_gguf_header`: it
    builds an object per vocabulary entry, tens of seconds for a 128k vocabulary).

    Args:
        path: the ``.gguf`` file.
        quantized: keep every 2-D weight (the layers' linears, the embedding, the LM head) as
            the file stores it (:class:`~pagedkv.model.gguf_weight.GGUFWeight`: views of the
            mapping, or its bytes read into a :class:`WeightArena`, by :data:`MMAP_ENV`; q / k
            rows read into the arena either way and reordered there for llama's rotary; an
            embedding table that is not also the LM head stays a view of the mapping, only
            its looked-up rows ever read; Q4_0 / Q4_1 weights of whole bands of 8 rows laid
            out anew in the arena where ``kernels`` interleave, :data:`REPACK_ENV`, and then
            every kept weight is read into it, as with :data:`MMAP_ENV` = 0), computed on
            by ``kernels``; the rest (norms, biases) is dequantized to fp32. False: every
            tensor dequantized to fp32 (``--quantization none``, tensor parallelism).
        kernels: pagedkv's kernels (needed with ``quantized``; a type they do not run is
            dequantized instead).
        on_sampled: called once the page cache's sample is taken and timed (before the rest
            of the file is faulted in; at once where nothing is sampled): ``load_model`` holds
            its tokenizer thread until then, whose Python work would otherwise take the GIL
            inside the timed read back and make the disk look slow.

    Returns:
        A :class:`GGUFCheckpoint`; ``state_dict`` holds fp32 tensors (and with ``quantized``
        GGUF weights) under Hugging Face names (no ``lm_head.weight`` when the embeddings are
        tied).

    Raises:
        ModelLoadError: the file cannot be read, holds an unsupported architecture or a tensor
            with no place in the decoder.
        ConfigError: :data:`MMAP_ENV` or :data:`REPACK_ENV` other than unset, 0 or 1.
    """
    setting = gguf_mmap_setting()  # a bad value is refused before anything is read
    repack_setting = gguf_repack_setting()
    from gguf.quants import dequantize

    header = read_gguf_header(path)
    metadata = dict(header.metadata)
    arch = metadata.get("general.architecture")
    if f"{arch}.vocab_size" not in metadata and "tokenizer.ggml.tokens" in header.array_lengths:
        metadata[f"{arch}.vocab_size"] = header.array_lengths["tokenizer.ggml.tokens"]
    config = ModelConfig.from_gguf_metadata(metadata, header.tensor_names)
    permute = config.architecture in _PERMUTED_ARCHITECTURES
    norm_plus_one = config.architecture in _NORM_PLUS_ONE_ARCHITECTURES
    try:
        mapped = map_file_read_only(path)  # read-only: no commit charge
    except HostMemoryError as e:
        raise ModelLoadError(f"cannot map GGUF file {path}: {e}") from e
    runs = kernels.gguf_types if quantized and kernels is not None else frozenset()
    # Q4_0 / Q4_1 weights laid out in bands of 8 rows for the AVX2 body's products (in the
    # arena: the mapping is read-only), unless the mapped file itself is asked for
    repack = runs and repack_setting != "0" and setting != "1"

    def interleaved(info: Any) -> bool:
        rows = info.dims[1] if len(info.dims) == 2 else 0
        if not repack or kernels.interleaved_type(info.ggml_type, rows) is None:
            return False
        # Phi-3's fused weights are cut by rows after the load: between bands only
        return all(cut % 8 == 0 for cut in split_rows(hf_name(info.name, arch), config))

    # the kept weights a decode step reads whole: computed in place where the page cache maps
    # them with 2 MiB pages, else read into anonymous memory (WeightArena); q / k rows that
    # llama's rotary reorders are read into it either way (the mapping is read-only)
    lookup_only = "token_embd.weight" if "output.weight" in header.tensor_names else None
    kept = [
        info
        for info in header.tensors
        if len(info.dims) == 2 and info.ggml_type in runs and info.name != lookup_only
    ]
    if kept and any(interleaved(info) for info in kept):
        # laid out anew, so copied (as PAGEDKV_GGUF_MMAP=0): nothing of the mapping faulted in
        in_place, pages = _place_weights(mapped, "0", path, on_sampled)
        pages = (
            f"Q4_0 / Q4_1 interleaved by 8 rows for this CPU's products; {REPACK_ENV}=0 "
            "keeps the file's layout"
        )
    elif kept:
        in_place, pages = _place_weights(mapped, setting, path, on_sampled)
    else:  # every tensor is read (dequantized) below: fault the file in at once
        in_place, pages = False, ""
        if on_sampled is not None:
            on_sampled()
        populate_mapped_pages(mapped)
    resident = [
        info for info in kept if not in_place or (permute and _is_q_or_k(hf_name(info.name, arch)))
    ]
    extents = [(info.offset, _tensor_layout(info, mapped.shape[0], path)[2]) for info in resident]
    arena = WeightArena(path, extents, num_threads=2)
    read = {info.name: data for info, data in zip(resident, arena.tensors, strict=True)}
    copied = format_bytes(sum(size for _, size in extents))
    if in_place:
        logger.info(
            "weights: computed in place on the mapped file (%s)%s",
            pages,
            f"; {copied} of q / k rows reordered into this process's memory" if extents else "",
        )
    elif kept:
        logger.info(
            "weights: %s read into this process's memory (%s; transparent huge pages: %s%s)",
            copied,
            pages,
            huge_page_setting(),
            "" if setting else f"; {MMAP_ENV}=1 computes on the mapped file instead",
        )

    state_dict: dict[str, torch.Tensor | GGUFWeight] = {}
    longrope: dict[str, list[float]] = {}
    for info in header.tensors:
        type_name = ggml_type_name(info.ggml_type)
        cols = info.dims[0]
        rows, row_bytes, _ = _tensor_layout(info, mapped.shape[0], path)
        raw = mapped[info.offset : info.offset + rows * row_bytes].reshape(rows, row_bytes)
        factors = info.name == "rope_freqs.weight" or info.name in _LONGROPE_TENSORS
        name = None if factors else hf_name(info.name, arch)
        if not factors and name is None:
            raise ModelLoadError(
                f"GGUF tensor {info.name!r} has no place in a {config.architecture} decoder"
            )
        heads = None
        if permute and _is_q_or_k(name):
            is_q = ".q_proj." in name
            heads = config.num_attention_heads if is_q else config.num_key_value_heads
        if len(info.dims) == 2 and info.ggml_type in runs and name is not None:
            order = None if heads is None else unpermute_rotary_rows(torch.arange(rows), heads)
            layout = False
            if info.name in read:
                data = read[info.name].view(rows, row_bytes)
                if order is not None:  # in place (a temporary of their size)
                    data[:] = data[order]
                if interleaved(info):
                    kernels.interleave(info.ggml_type, data)
                    layout = True
            else:  # never q / k rows to reorder: those are always read
                with warnings.catch_warnings():  # read-only: nothing writes the weights
                    warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                    data = torch.from_numpy(raw)
            state_dict[name] = GGUFWeight(
                type_name, data, (rows, cols), kernels, interleaved=layout
            )
            continue
        array = np.asarray(dequantize(raw, info.ggml_type), dtype=np.float32)
        tensor = torch.from_numpy(array.reshape(tuple(reversed(info.dims))).copy())
        if info.name == "rope_freqs.weight":  # llama3-style per-frequency divisors
            config.rope_scaling = {"rope_type": "freq_factors", "factors": tensor.tolist()}
            continue
        if info.name in _LONGROPE_TENSORS:
            longrope[_LONGROPE_TENSORS[info.name]] = tensor.tolist()
            continue
        if norm_plus_one and info.name.endswith("norm.weight"):
            tensor = tensor - 1.0
        if heads is not None:
            tensor = unpermute_rotary_rows(tensor, heads)
        state_dict[name] = tensor
    if longrope:
        config.rope_scaling = gguf_longrope_scaling(
            config, metadata, longrope.get("short_factor"), longrope.get("long_factor")
        )
    split_fused_weights(state_dict, config)  # Phi-3's attn_qkv and ffn_up
    return GGUFCheckpoint(config=config, state_dict=state_dict, metadata=metadata)


#: Where the GGUF weights a step reads are computed on: unset, the mapped file when the page
#: cache maps it with 2 MiB pages (:data:`IN_PLACE_SHARE` of it), else a copy read into
#: anonymous huge pages (:class:`WeightArena`); 1, always the mapped file (processes mapping one
#: file share its pages: data-parallel replicas on one machine, ``pagedkv serve
#: --data-parallel-size`` sets it for them unless the environment does; slower decode steps
#: where the page cache holds 4 KiB pages); 0, always the copy (docs/model.md).
MMAP_ENV = "PAGEDKV_GGUF_MMAP"
#: The share of the file's bytes the page cache must map with 2 MiB pages for the weights to be
#: computed in place when :data:`MMAP_ENV` is unset.
IN_PLACE_SHARE = 0.8


#: Windows of the file the page cache's page size is first sampled in (2 MiB each, spread
#: evenly): a file whose sample is not in 2 MiB pages is copied without faulting in the rest.
SAMPLE_WINDOWS = 16
#: The least rate (bytes/s) at which the sample, dropped from the page cache, must read back
#: from the disk in 2 MiB folios for the whole file to be read back so (and computed in place)
#: rather than copied. On the 2-core VM of docs/perf.md a 1B file's sample read back at
#: 1.9-2.5 GiB/s and whole files at 1.1-2.7 GiB/s, where a copy from the page cache ran at
#: 0.2-8 GB/s (the low end where the VM must first back the copy's memory: 762 MiB once took
#: 4 s). A read back is paid once, where the copy is paid on every start, so it is taken down
#: to SATA SSD speeds; a hard disk keeps the copy.
READ_BACK_MIN_RATE = 256 << 20


def _place_weights(
    mapped: np.ndarray, setting: str, path: Path, on_sampled: Callable[[], None] | None = None
) -> tuple[bool, str]:
    """Whether the kept weights are computed on ``mapped`` (the mapping of the GGUF file at
    ``path``), by :data:`MMAP_ENV`'s ``setting``, and the start-up line's words on the page
    cache.

    Unset: :data:`SAMPLE_WINDOWS` 2 MiB windows of the file are faulted in first (what the
    page cache lacks is read in 2 MiB folios: the mapping is advised ``MADV_HUGEPAGE``). Where
    the page cache holds them in smaller folios (a file written, or read with read(2), since
    it was last read through a mapping: a download, ``llama-quantize``'s output) they are
    dropped from it and read back from the disk, timed (:func:`_read_back`: the first window
    alone first; a filesystem without large folios stops there): if they come back in 2 MiB
    folios at :data:`READ_BACK_MIN_RATE` or faster, the rest of the file is dropped too (once:
    later starts find it in 2 MiB folios); slower, the sample is dropped again and the weights
    copied (the next start measures again); a sample in 2 MiB folios whose file is not (an
    earlier start's sample) is dropped before the copy, for the same. If the page cache maps
    :data:`IN_PLACE_SHARE` of the sample with 2 MiB pages the whole file is faulted in and
    must be so mapped as well.
    Whatever is not computed in place leaves this process's resident set (the arena holds the
    weights); "1" faults everything in, "0" nothing. ``on_sampled`` is called once the sample
    is decided (see :func:`load_gguf`).
    """
    called = False

    def sampled() -> None:  # on_sampled once
        nonlocal called
        if not called and on_sampled is not None:
            called = True
            on_sampled()

    try:
        return _place_sampled(mapped, setting, path, sampled)
    finally:  # at the latest
        sampled()


def _place_sampled(
    mapped: np.ndarray, setting: str, path: Path, decided: Callable[[], None]
) -> tuple[bool, str]:
    """:func:`_place_weights`' body (``decided`` called here where the sample is decided)."""
    size = mapped.shape[0]
    total = format_bytes(size)
    if setting == "0":
        return False, f"{MMAP_ENV}=0"
    if setting == "1":
        populate_mapped_pages(mapped)
        huge = huge_mapped_bytes(mapped)
        shown = "an unknown share" if huge is None else format_bytes(huge)
        return True, f"the page cache maps {shown} of {total} with 2 MiB pages; {MMAP_ENV}=1"
    count = max(1, min(SAMPLE_WINDOWS, size // HUGE_PAGE))
    starts = sorted({i * size // count // HUGE_PAGE * HUGE_PAGE for i in range(count)})
    windows = [(start, min(HUGE_PAGE, size - start)) for start in starts]
    populate_mapped_pages(mapped, windows)
    sampled = sum(length for _, length in windows)
    huge = huge_mapped_bytes(mapped)
    read_back, slow = "", False
    if huge is not None and huge < IN_PLACE_SHARE * sampled and size >= HUGE_PAGE:
        rate = _read_back(mapped, path, windows)
        huge = huge_mapped_bytes(mapped)
        if rate is not None and huge is not None and huge >= IN_PLACE_SHARE * sampled:
            if rate >= READ_BACK_MIN_RATE:
                drop_cached_pages(path)  # the sample stays: this mapping maps it
                read_back = f"; read back from the disk at {format_bytes(rate)}/s"
            else:  # a slow disk: the copy; the sample dropped again, so the next start
                slow = True  # samples small folios again and measures again
                release_mapped_pages(mapped)
                drop_cached_pages(path, windows)
                read_back = (
                    f"; its sample read back from the disk at {format_bytes(rate)}/s, below "
                    f"{format_bytes(READ_BACK_MIN_RATE)}/s"
                )
        elif rate is None:
            read_back = (
                "; its first window did not read back in a 2 MiB folio (pages not yet written "
                "back to the disk, or a filesystem without large folios)"
            )
    decided()
    if huge is None:  # not Linux, or no smaps: the copy
        in_place, words = False, "the page cache's page size unknown"
    elif slow or huge < IN_PLACE_SHARE * sampled:  # the rest of the file is never faulted in
        in_place = False
        words = (
            f"the page cache maps {format_bytes(huge)} of {format_bytes(sampled)} sampled in "
            f"{total} with 2 MiB pages{read_back}"
        )
    else:
        populate_mapped_pages(mapped)
        huge = huge_mapped_bytes(mapped) or 0
        in_place = huge >= IN_PLACE_SHARE * size
        words = f"the page cache maps {format_bytes(huge)} of {total} with 2 MiB pages{read_back}"
        if not in_place and not read_back and size >= HUGE_PAGE:
            # the sample in 2 MiB folios, the rest not (an earlier start's sample): the copy,
            # and the sample dropped, so the next start reads the file back (measured)
            release_mapped_pages(mapped)
            drop_cached_pages(path, windows)
            words += "; its sample dropped from the page cache, read back on the next start"
    if not in_place:
        release_mapped_pages(mapped)
    return in_place, words


def _read_back(mapped: np.ndarray, path: Path, windows: list[tuple[int, int]]) -> float | None:
    """Drop the sample ``windows`` of the file at ``path`` from the page cache and read them
    back through ``mapped`` (its mapping, released first: pages a process maps stay in the
    page cache); the rate of the read back (bytes/s), or None where the first window, read
    back alone first, did not come back in a 2 MiB folio (a filesystem or kernel without
    large folios: 2 MiB read again a start, not the whole sample)."""
    release_mapped_pages(mapped)
    drop_cached_pages(path, windows[:1])
    start = time.perf_counter()  # only the reads are timed (they hold the GIL: 2 MiB windows)
    populate_mapped_pages(mapped, windows[:1])
    seconds = time.perf_counter() - start
    if (huge_mapped_bytes(mapped) or 0) < IN_PLACE_SHARE * windows[0][1]:
        return None
    drop_cached_pages(path, windows[1:])
    start = time.perf_counter()
    populate_mapped_pages(mapped, windows[1:])
    seconds += time.perf_counter() - start
    return sum(length for _, length in windows) / max(seconds, 1e-9)


def _is_q_or_k(name: str | None) -> bool:
    """Whether HF weight ``name`` is a q_proj / k_proj weight (rows llama's rotary reorders)."""
    return name is not None and (".q_proj." in name or ".k_proj." in name)


#: Whether Q4_0 / Q4_1 weights are laid out in bands of 8 rows at load for the AVX2 body's int8
#: products (:meth:`~pagedkv.model.kernels.cpu_quant.CpuQuantKernels.interleave`, as llama.cpp
#: repacks Q4_0 on AVX2): unset or 1, yes where those products run (int8 activations, no VNNI,
#: and not :data:`MMAP_ENV` = 1, which computes on the read-only mapped file); 0, never (the
#: file's layout; llama.cpp's ``--no-repack``).
REPACK_ENV = "PAGEDKV_GGUF_REPACK"


def _switch_setting(name: str) -> str:
    """Environment variable ``name``'s value: "" (unset or empty), "0" or "1".

    Raises:
        ConfigError: any other value.
    """
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {value!r}")
    return value


def gguf_repack_setting() -> str:
    """:data:`REPACK_ENV`'s value: "" (unset or empty), "0" or "1".

    Raises:
        ConfigError: any other value.
    """
    return _switch_setting(REPACK_ENV)


def gguf_mmap_setting() -> str:
    """:data:`MMAP_ENV`'s value: "" (unset or empty), "0" or "1".

    Raises:
        ConfigError: any other value.
    """
    return _switch_setting(MMAP_ENV)


def _tensor_layout(info: Any, file_bytes: int, path: str | Path) -> tuple[int, int, int]:
    """A GGUF tensor's ``(rows, row_bytes, bytes)`` as the file stores it.

    Raises:
        ModelLoadError: rows that are not whole blocks of its type, or bytes past the end of
            the file (``file_bytes`` long).
    """
    type_name = ggml_type_name(info.ggml_type)
    block_elems, block_bytes = ggml_type_sizes(type_name)
    cols = info.dims[0]
    rows = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
    if cols % block_elems:
        raise ModelLoadError(
            f"GGUF tensor {info.name!r}: rows of {cols} elements are not whole "
            f"{block_elems}-element {type_name} blocks ({path})"
        )
    row_bytes = cols // block_elems * block_bytes
    if info.offset + rows * row_bytes > file_bytes:
        raise ModelLoadError(f"GGUF tensor {info.name!r} lies outside the file {path}")
    return rows, row_bytes, rows * row_bytes


class WeightArena:
    """Anonymous memory that a GGUF file's kept weights are read into, as the file stores them
    (where the page cache does not map the file with 2 MiB pages; and the q / k rows llama's
    rotary reorders, always).

    Why not the mapped file itself there: a batch-1 decode step reads every weight once, and it
    reads them markedly faster from transparent huge pages (2 MiB: far fewer TLB misses, which
    cost more in a virtual machine) than from the page cache's 4 KiB pages of a mapped file.
    Measured on a 2-core AMD EPYC Zen 4 VM, a Llama-3.2-1B Q4_K_M decode step: 32.1 ms from the
    mapping, 30.0-31.6 ms from anonymous 4 KiB pages, 24.3-25.8 ms from huge pages (llama.cpp's
    ``--no-mmap`` / ``-lm none`` is faster here for the same reason). The bytes are copied
    unchanged, read with ``os.preadv`` (the file's pages stay in the page cache, outside this
    process's resident set), so the process holds the weights once, as before: the file's
    size. What is lost is sharing those pages with other processes that map the same file.

    One anonymous private mapping for all of them
    (:func:`~pagedkv.ops.host_memory.anonymous_zeros`: 2 MiB-aligned, on huge pages where the
    platform has them); each weight starts on a 4096-byte boundary, in the order given. The
    extents are read in chunks of :attr:`CHUNK` bytes by up to ``num_threads`` threads
    (the reads release the GIL, so the page faults and copies of the chunks overlap).

    Args:
        path: the GGUF file.
        extents: ``(offset, size)`` in bytes of each weight in the file.
        num_threads: reading threads (at least 1).

    Raises:
        ModelLoadError: the file cannot be read or ends inside an extent, or the memory for
            the weights cannot be mapped (the first chunk to fail stops the reads not started).
    """

    #: Where a weight starts in the arena (bytes): a page boundary.
    ALIGN = 4096
    #: Bytes one thread reads at a time.
    CHUNK = 16 << 20

    def __init__(
        self, path: str | Path, extents: list[tuple[int, int]], num_threads: int = 2
    ) -> None:
        self.path = Path(path)
        starts, total = [], 0
        for _, size in extents:
            starts.append(total)
            total += -(-size // self.ALIGN) * self.ALIGN
        #: uint8 ``[size]`` per extent, views of the arena (which they keep alive)
        self.tensors = [torch.empty(0, dtype=torch.uint8) for _ in extents]
        if total == 0:
            return
        try:
            arena = anonymous_zeros(total)
        except HostMemoryError as e:
            raise ModelLoadError(
                f"cannot hold the weights of {self.path}: {e} ({MMAP_ENV}=1 computes on the "
                "mapped file instead, without a copy)"
            ) from e
        chunks = [
            (offset + done, arena[start + done : start + min(size, done + self.CHUNK)])
            for (offset, size), start in zip(extents, starts, strict=True)
            for done in range(0, size, self.CHUNK)
        ]
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as e:
            raise ModelLoadError(f"cannot read {self.path}: {e}") from e
        pool = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="pagedkv-weights")
        try:  # one descriptor, positioned reads: every chunk from the same file
            for future in [pool.submit(self._read_chunk, fd, *chunk) for chunk in chunks]:
                future.result()
        finally:  # on an error, the chunks not started are dropped, not read
            pool.shutdown(wait=True, cancel_futures=True)
            os.close(fd)
        self.tensors = [
            arena[start : start + size] for (_, size), start in zip(extents, starts, strict=True)
        ]

    def _read_chunk(self, fd: int, offset: int, view: torch.Tensor) -> None:
        buffer = memoryview(view.numpy())
        done = 0
        while done < len(buffer):
            try:
                n = _pread_into(fd, buffer[done:], offset + done)
            except OSError as e:
                raise ModelLoadError(f"cannot read {self.path}: {e}") from e
            if not n:
                raise ModelLoadError(f"{self.path} ends inside a tensor at byte {offset + done}")
            done += n


def _pread_into(fd: int, buffer: memoryview, offset: int) -> int:
    """Read into ``buffer`` from ``offset`` of ``fd`` without moving its position (thread-safe):
    ``os.preadv`` where the platform has it, else ``os.pread`` and a copy. Returns the bytes
    read (0 at the end of the file)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [buffer], offset)
    data = os.pread(fd, len(buffer), offset)
    buffer[: len(data)] = data
    return len(data)


def stored_types(state_dict: dict[str, torch.Tensor | GGUFWeight]) -> dict[str, int]:
    """How many of a checkpoint's weights run as each GGML type kept as stored
    (``{"Q4_K": 97, "Q6_K": 17}``)."""
    counts: dict[str, int] = {}
    for weight in state_dict.values():
        if isinstance(weight, GGUFWeight):
            counts[weight.type_name] = counts.get(weight.type_name, 0) + 1
    return dict(sorted(counts.items()))


def is_layer_linear(name: str) -> bool:
    """Whether HF weight ``name`` is a decoder layer's linear (q, k, v, o, gate, up, down)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")
