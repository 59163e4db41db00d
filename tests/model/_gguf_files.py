"""Test fixtures: GGUF files of mixed block types, as llama.cpp's ``llama-quantize`` makes them.

- :func:`quantize_k`: a plain numpy quantizer to llama.cpp's K-type blocks (Q4_K, Q5_K, Q6_K),
  which the ``gguf`` package can only dequantize. It picks each block's scales from the block's
  min / max (Q4_K, Q5_K) or absolute max (Q6_K), rounded up so that no value is clipped; no
  search for the scales that minimize the error (llama.cpp does one). The blocks are valid
  blocks of those layouts: ``gguf.quants.dequantize`` reads them back.
- :func:`quantize`: any of the types pagedkv computes on (the K-types here, the others by
  ``gguf.quants.quantize``), as the array ``GGUFWriter.add_tensor`` takes.
- :func:`write_mixed_gguf`: a Hugging Face Llama / Qwen2 model written as llama.cpp's converter
  and quantizer would (names, q/k row permutation for ``llama``, a byte-level BPE tokenizer), each
  2-D weight in the type a callback picks; :func:`q4_k_m_like` picks as Q4_K_M does.
- :func:`dequantized_state_dict`: the file's weights as fp32 under Hugging Face names, exactly the
  values the file stores, to give a transformers model the same weights.

Layouts (``gguf/quants.py`` dequantizers; sizes from ``gguf.constants.GGML_QUANT_SIZES``), per
block of 256 weights, little-endian:

- Q4_K, 144 bytes: f16 ``d``, f16 ``dmin``, 12 bytes of eight 6-bit scales ``sc`` and eight 6-bit
  mins ``m`` (packed as :func:`_pack_scales_mins` says), 128 bytes of 4-bit ``q``. Sub-block ``j``
  (weights ``32j .. 32j+31``) is ``d * sc[j] * q - dmin * m[j]``; byte ``i`` of the 32-byte chunk
  ``c`` holds weight ``i`` of sub-block ``2c`` in its low nibble and of ``2c+1`` in its high one.
- Q5_K, 176 bytes: as Q4_K, with 32 bytes of high bits between the scales and the nibbles: bit
  ``j`` of byte ``i`` is bit 4 of weight ``i`` of sub-block ``j`` (``q`` in 0..31).
- Q6_K, 210 bytes: 128 bytes of low nibbles ``ql``, 64 bytes of high bit pairs ``qh``, 16 int8
  scales, f16 ``d``. Sixteen sub-blocks of 16 weights, ``d * scale[j] * (q - 32)``, ``q`` in
  0..63; the weight order within the two halves of 128 is given in :func:`_q6_k_blocks`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.model.gguf_loader import hf_name, read_metadata, unpermute_rotary_rows

#: Weights per K-type block.
QK_K = 256
#: The K-types :func:`quantize_k` makes.
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
#: Every type :func:`quantize` makes (the weight formats pagedkv keeps as stored).
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *K_TYPES)

TypeChooser = Callable[[str, tuple[int, ...]], str]


# ---------------------------------------------------------------------------------------------
# K-type quantizer


def _f16_at_least(value: np.ndarray) -> np.ndarray:
    """The smallest float16 >= each float32 ``value`` (>= 0), as float16 (the same shape)."""
    rounded = value.astype(np.float16)
    low = rounded.astype(np.float32) < value
    return np.where(low, np.nextafter(rounded, np.float16(np.inf)), rounded)


def _block_scale(need: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """A block's f16 super-scale and its sub-blocks' integer scales, each rounded up.

    Args:
        need: float32 ``[n_blocks, n_sub]``, the (non-negative) step each sub-block needs.
        levels: the largest integer scale (63 for 6 bits, 127 for int8).

    Returns:
        ``(d, sc)``: float16 ``[n_blocks]`` and int32 ``[n_blocks, n_sub]`` with
        ``d * sc >= need`` and ``sc <= levels`` (0 where the whole block needs 0).
    """
    d = _f16_at_least(need.max(axis=1) / levels)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.ceil(need / d32), 0.0)
    # need / d32 can round up past an integer that d32 * that integer covers; keep the smallest.
    smaller = np.maximum(sc - 1, 0)
    sc = np.where((sc > 0) & (d32 * smaller >= need), smaller, sc)
    return d, np.minimum(sc, levels).astype(np.int32)


def _pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 scale bytes of eight 6-bit scales and eight 6-bit mins.

    Bytes 0..3: ``sc[j]`` in bits 0..5, bits 4..5 of ``sc[j+4]`` in bits 6..7; bytes 4..7: the
    same for ``m``; bytes 8..11: bits 0..3 of ``sc[j+4]`` low, of ``m[j+4]`` high (j = 0..3).

    Args:
        sc, m: integers 0..63, ``[n_blocks, 8]``.

    Returns:
        uint8 ``[n_blocks, 12]``.
    """
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    lo_sc, hi_sc = sc[:, :4], sc[:, 4:]
    lo_m, hi_m = m[:, :4], m[:, 4:]
    return np.concatenate(
        [
            lo_sc | ((hi_sc >> 4) << 6),
            lo_m | ((hi_m >> 4) << 6),
            (hi_sc & 0x0F) | ((hi_m & 0x0F) << 4),
        ],
        axis=1,
    ).astype(np.uint8)


def _affine_k_blocks(blocks: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (``bits`` 4) or Q5_K (``bits`` 5) blocks of float32 ``[n_blocks, 256]``.

    Each sub-block of 32 spans ``[lo, hi]`` with ``lo = min(0, min x)`` (the mins are stored
    non-negative and subtracted) and ``hi = max x``; its min ``dmin * m >= -lo`` and step
    ``d * sc >= (hi + dmin * m) / (2**bits - 1)`` are rounded up so that every weight lies in
    the grid's range: the error is at most half a step.

    Returns:
        uint8 ``[n_blocks, 144]`` (Q4_K) or ``[n_blocks, 176]`` (Q5_K).
    """
    n = blocks.shape[0]
    top = (1 << bits) - 1
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    hi = sub.max(axis=2)
    dmin, m = _block_scale(-lo, 63)
    offset = dmin.astype(np.float32)[:, None] * m  # >= -lo
    d, sc = _block_scale(np.maximum(hi + offset, 0.0) / top, 63)
    step = (d.astype(np.float32)[:, None] * sc)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((sub + offset[:, :, None]) / step), 0.0)
    q = np.clip(q, 0, top).astype(np.uint8)  # [n, 8, 32]
    nibbles = q & 0x0F
    qs = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).reshape(n, 128)
    parts = [
        d.reshape(n, 1).view(np.uint8),
        dmin.reshape(n, 1).view(np.uint8),
        _pack_scales_mins(sc, m),
    ]
    if bits == 5:
        high = (q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]  # [n, 8, 32]
        parts.append(np.bitwise_or.reduce(high, axis=1).astype(np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _q6_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks of float32 ``[n_blocks, 256]``: uint8 ``[n_blocks, 210]``.

    Sixteen sub-blocks of 16, each symmetric: step ``d * scale >= absmax / 31`` (rounded up),
    ``q - 32`` in -31..31. Weight ``e`` of a block, with ``h = e // 128``, ``r = e % 128 // 32``
    and ``i = e % 32``: its low nibble is in ``ql[64h + 32(r % 2) + i]`` (the high nibble of that
    byte when ``r >= 2``), its two high bits at bit ``2r`` of ``qh[32h + i]``.
    """
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    d, scale = _block_scale(np.abs(sub).max(axis=2) / 31, 127)
    step = (d.astype(np.float32)[:, None] * scale)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint(sub / step), 0.0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [n, h, r, i]
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2
    ).reshape(n, 128)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [
            ql,
            qh.reshape(n, 64),
            scale.astype(np.int8).view(np.uint8),
            d.reshape(n, 1).view(np.uint8),
        ],
        axis=1,
    )


def quantize_k(weights: np.ndarray, type_name: str) -> np.ndarray:
    """Quantize a matrix to llama.cpp's K-type blocks, row by row.

    Args:
        weights: float32 ``[rows, cols]``, ``cols`` a multiple of 256, finite.
        type_name: "Q4_K", "Q5_K" or "Q6_K".

    Returns:
        uint8 ``[rows, cols / 256 * block_bytes]`` (144, 176 or 210 bytes per block), as a GGUF
        file stores the tensor; ``gguf.quants.dequantize(result, GGMLQuantizationType[type_name])``
        gives back float32 ``[rows, cols]`` within half a sub-block's step of ``weights``.

    Raises:
        ValueError: another type, not a finite 2-D matrix, or ``cols`` not a multiple of 256.
    """
    if type_name not in K_TYPES:
        raise ValueError(f"quantize_k makes {K_TYPES}, not {type_name!r}")
    weights = np.asarray(weights)
    if weights.ndim != 2 or weights.shape[1] % QK_K:
        raise ValueError(f"need [rows, cols] with cols a multiple of {QK_K}, got {weights.shape}")
    blocks = weights.astype(np.float32).reshape(-1, QK_K)
    if not np.isfinite(blocks).all():
        raise ValueError("weights must be finite")
    if type_name == "Q6_K":
        packed = _q6_k_blocks(blocks)
    else:
        packed = _affine_k_blocks(blocks, 4 if type_name == "Q4_K" else 5)
    return np.ascontiguousarray(packed.reshape(weights.shape[0], -1))


def quantize(weights: np.ndarray, type_name: str) -> np.ndarray:
    """A matrix in GGML type ``type_name``, as ``GGUFWriter.add_tensor`` takes it.

    Args:
        weights: float32 ``[rows, cols]`` (``cols`` a multiple of the type's block: 32 for
            Q4_0 .. Q8_0, 256 for the K-types).
        type_name: one of :data:`TYPES`.

    Returns:
        float32 ``[rows, cols]`` for F32, float16 ``[rows, cols]`` for F16, else the raw blocks,
        uint8 ``[rows, row_bytes]`` (BF16: 2 bytes a weight).

    Raises:
        ValueError: an unknown type, or a shape the type cannot hold.
    """
    import gguf

    if type_name not in TYPES:
        raise ValueError(f"type must be one of {TYPES}, got {type_name!r}")
    weights = np.asarray(weights, dtype=np.float32)
    if type_name in K_TYPES:
        return quantize_k(weights, type_name)
    block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    if weights.ndim != 2 or weights.shape[1] % block:
        raise ValueError(
            f"{type_name} needs [rows, cols] with cols % {block} == 0, got {weights.shape}"
        )
    if type_name == "F32":
        return np.ascontiguousarray(weights)
    return np.ascontiguousarray(gguf.quants.quantize(weights, gguf.GGMLQuantizationType[type_name]))


# ---------------------------------------------------------------------------------------------
# Which type each tensor gets


_LAYER_INDEX_PREFIX = "blk."
#: A decoder layer's 2-D weights, by GGUF name within ``blk.{i}.``.
_LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _layer_of(gguf_name: str) -> int | None:
    """The layer index of ``blk.{i}.*``; None for a global tensor."""
    if not gguf_name.startswith(_LAYER_INDEX_PREFIX):
        return None
    return int(gguf_name.split(".")[1])


def q4_k_m_like(gguf_name: str, shape: tuple[int, ...]) -> str:
    """The type llama.cpp's Q4_K_M gives a 2-D weight, simplified.

    Q4_K for attention q/k/o and ffn gate/up; attn_v and ffn_down Q6_K on even layers and Q4_K
    on odd ones (Q4_K_M raises some layers' v and down to Q6_K); token_embd and output Q6_K.
    Where the row width ``shape[-1]`` is not a multiple of 256 (a K-type block), llama.cpp
    falls back to a 32-weight type: Q5_0 for the Q4_K ones, Q8_0 for the Q6_K ones (and the
    v / down of every layer).

    Args:
        gguf_name: the GGUF tensor name (``blk.3.attn_v.weight``).
        shape: ``(rows, cols)`` in numpy order (``cols`` = input features).
    """
    k_ok = shape[-1] % QK_K == 0
    base = gguf_name.rsplit(".", 1)[0]
    if base in ("token_embd", "output"):
        return "Q6_K" if k_ok else "Q8_0"
    layer = _layer_of(gguf_name)
    if base.endswith((".attn_v", ".ffn_down")):
        if not k_ok:
            return "Q8_0"
        return "Q6_K" if layer is not None and layer % 2 == 0 else "Q4_K"
    return "Q4_K" if k_ok else "Q5_0"


def every_type(gguf_name: str, shape: tuple[int, ...]) -> str:
    """Each 2-D weight a different type, in turn through :data:`TYPES` (by a fixed order of
    the names), skipping the K-types where the row width is not a multiple of 256: a file that
    holds every type pagedkv keeps as stored."""
    order = [
        "token_embd",
        "output",
        *(f"blk.{i}.{p}" for i in range(64) for p in _LINEAR_PARTS),
    ]
    base = gguf_name.rsplit(".", 1)[0]
    index = order.index(base) if base in order else 0
    candidates = [t for t in TYPES if t not in K_TYPES or shape[-1] % QK_K == 0]
    return candidates[index % len(candidates)]


# ---------------------------------------------------------------------------------------------
# Writing and reading files


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (HF rotate-half -> interleaved pairs, per head).

    Args:
        weight: ``[num_heads * head_dim, ...]`` in Hugging Face order.

    Returns:
        The same rows in GGUF order (:func:`pagedkv.model.gguf_loader.unpermute_rotary_rows`
        is the inverse).
    """
    half = weight.shape[0] // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, 2, half, *rest).swapaxes(1, 2).reshape(weight.shape).copy()


def _gguf_names(num_layers: int, architecture: str) -> dict[str, str]:
    """Hugging Face name -> GGUF name of every tensor a Llama-family decoder may have."""
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    layer = ["attn_norm.weight", "ffn_norm.weight"] + [f"{p}.weight" for p in _LINEAR_PARTS]
    layer += [f"attn_{p}.bias" for p in "qkv"]
    names += [f"blk.{i}.{s}" for i in range(num_layers) for s in layer]
    return {hf_name(name, architecture): name for name in names}


def _byte_level_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of ``vocab_size`` tokens (>= 257): the 256 byte symbols,
    merges of letter pairs, and ``<|endoftext|>`` last (a control token: the EOS).

    Returns:
        ``(tokens, token_types, merges)`` as ``tokenizer.ggml.*`` holds them.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if vocab_size < 257:
        raise ValueError(f"a byte-level vocabulary needs >= 257 tokens, got {vocab_size}")
    symbols = bytes_to_unicode()
    tokens = [symbols[b] for b in range(256)]
    pairs = itertools.product("etaonisrhl", repeat=2)
    merges = [f"{a} {b}" for a, b in itertools.islice(pairs, vocab_size - 257)]
    tokens += [m.replace(" ", "") for m in merges]
    tokens.append("<|endoftext|>")
    types = [1] * (vocab_size - 1) + [3]  # NORMAL, ..., CONTROL
    return tokens, types, merges


def add_shape_metadata(writer, config, head_dim: int | None = None) -> None:
    """The ``{arch}.*`` keys llama.cpp's converter writes for a Hugging Face ``config`` (layers,
    context, widths, heads, norm epsilon, rope base, vocabulary size; with ``head_dim`` also
    the key and value lengths) into a ``gguf.GGUFWriter``."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)


def write_mixed_gguf(path: str | Path, hf_model: Any, arch: str, types: TypeChooser) -> None:
    """Write a Hugging Face Llama-family model as llama.cpp's converter + quantizer would.

    Names as llama.cpp's (``blk.{i}.attn_q.weight``...); for ``llama`` the q/k rows permuted to
    llama.cpp's rotary order before quantizing; a tied LM head not written (no
    ``output.weight``); the norms and biases F32; every other (2-D) weight in
    ``types(gguf_name, (rows, cols))``. The metadata: the config llama.cpp writes (plain rope,
    ``rope_theta`` from the config) and a byte-level BPE tokenizer (:func:`_byte_level_vocab`)
    with the last token as EOS, so that ``pagedkv.model.loader.load_model`` loads the file.

    Args:
        path: the ``.gguf`` file to write.
        hf_model: a transformers ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (any dtype).
        arch: ``"llama"`` or ``"qwen2"`` (GGUF ``general.architecture``).
        types: the GGML type name (one of :data:`TYPES`) for each 2-D weight.

    Raises:
        ValueError: another architecture, a tensor with no GGUF name, or a type that cannot hold
            the weight's shape.
    """
    import gguf

    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_shape_metadata(writer, config)
    tokens, token_types, merges = _byte_level_vocab(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(config.vocab_size - 1)
    writer.add_bos_token_id(config.vocab_size - 1)
    writer.add_add_bos_token(False)

    names = _gguf_names(config.num_hidden_layers, arch)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name not in names:
            raise ValueError(f"{name!r} has no GGUF name")
        gguf_name = names[name]
        weight = tensor.detach().float().cpu().numpy()
        if arch == "llama" and ".q_proj." in name:
            weight = llama_cpp_permute(weight, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            weight = llama_cpp_permute(weight, config.num_key_value_heads)
        if weight.ndim != 2:
            writer.add_tensor(gguf_name, np.ascontiguousarray(weight))
            continue
        type_name = types(gguf_name, tuple(weight.shape))
        data = quantize(weight, type_name)
        if data.dtype == np.uint8:
            # GGUFWriter takes the byte shape [rows, row_bytes] and derives the weight shape.
            writer.add_tensor(gguf_name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tensor_types(path: str | Path) -> dict[str, str]:
    """GGUF tensor name -> its GGML type name (``"Q4_K"``), as the file says."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def dequantized_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The file's weights under Hugging Face names, fp32, exactly as the file stores them.

    Each tensor dequantized by ``gguf.quants.dequantize``; for ``llama`` the q/k rows back in
    Hugging Face order (:func:`pagedkv.model.gguf_loader.unpermute_rotary_rows`). No
    ``lm_head.weight`` when the file has no ``output.weight`` (tied: the model's head is its
    embedding table).

    Returns:
        HF name -> float32 tensor (``[out, in]`` for a matrix), for
        ``hf_model.load_state_dict(..., strict=False)``.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    metadata = read_metadata(reader)
    arch = metadata["general.architecture"]
    heads = {
        ".q_proj.": metadata[f"{arch}.attention.head_count"],
        ".k_proj.": metadata[f"{arch}.attention.head_count_kv"],
    }
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no Hugging Face name")
        values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weight = torch.from_numpy(values.reshape(tuple(reversed(tensor.shape.tolist()))))
        for part, num_heads in heads.items():
            if arch == "llama" and part in name:
                weight = unpermute_rotary_rows(weight, num_heads).contiguous()
        out[name] = weight
    return out


#: Byte offsets of the f16 scale fields in a block of each K type (d, and dmin for Q4_K/Q5_K).
_K_SCALE_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Raw blocks uint8 ``[n, row_bytes]`` of a valid random weight: random floats through
    ``gguf.quants.quantize`` where gguf quantizes the type; for the K-types (which it does not)
    random bytes with every f16 scale field replaced by a finite value in (-0.01, 0.01)."""
    import gguf
    import gguf.quants

    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[name]
    if name not in K_TYPES:
        values = rng.standard_normal((n, k)).astype(np.float32)
        return gguf.quants.quantize(values, qtype).view(np.uint8)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, k // block_elems, block_bytes), dtype=np.uint8)
    for offset in _K_SCALE_FIELDS[name]:
        scale = rng.uniform(-0.01, 0.01, (n, k // block_elems, 1)).astype(np.float16)
        blocks[..., offset : offset + 2] = scale.view(np.uint8)
    return blocks.reshape(n, -1)


def kernels_or_skip(cache, isa: str, activations: str = "fp32"):
    """pagedkv's kernels built into ``cache`` with the products' body ``isa`` and
    ``activations`` ("fp32" or "q8"), or ``pytest.skip`` naming why they do not run here
    (no such ISA, no compiler, no F16C for the GGUF products)."""
    import pytest

    from pagedkv.model.kernels.cpu_quant import load_cpu_quant_kernels
    from pagedkv.ops.c_build import KernelUnavailableError

    try:
        kernels = load_cpu_quant_kernels(cache, isa=isa, activations=activations)
    except KernelUnavailableError as e:
        pytest.skip(f"pagedkv's {isa} kernels do not run here: {e}")
    if not kernels.gguf_types:
        pytest.skip("no F16C: the GGUF kernels are not offered")
    return kernels


def mapping_of(address: int) -> str:
    """The path of the file mapped at ``address`` in this process, resolved as the kernel
    resolves it (compare with ``os.path.realpath``); "" for anonymous memory (Linux's
    /proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(a, 16) for a in fields[0].split("-"))
        if start <= address < end:
            return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is not mapped")
