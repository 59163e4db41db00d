"""GGUF quantized blocks as :class:`~pagedkv.model.quantization.QuantizedWeight` (no rounding).

llama.cpp's block layouts (``ggml-common.h``), each block covering consecutive elements of one
row::

    Q4_0  32 weights, 18 bytes: f16 d | 16 bytes of nibbles       w = d * (q - 8)
    Q4_1  32 weights, 20 bytes: f16 d | f16 m | 16 bytes          w = d * q + m
    Q4_K  256 weights, 144 bytes: f16 d | f16 dmin | 12 bytes of 6-bit (sc, m) for 8 groups
          of 32 | 128 bytes of nibbles                            w = d * sc * q - dmin * m
    Q8_0  32 weights, 34 bytes: f16 d | 32 int8                   w = d * q

In Q4_0 / Q4_1 byte j holds weight j (low nibble) and weight j + 16 (high nibble); in Q4_K each
32 bytes hold two groups: the low nibbles the first, the high nibbles the second. Every 4-bit
format becomes ``q * scale + min`` per group of 32, computed in float32 exactly as ``gguf``'s
dequantizer does (a test checks the two are equal, bit for bit).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedkv.model.quantization import QuantizedWeight

#: GGUF tensor types (``gguf.GGMLQuantizationType`` names) kept quantized, and their bits.
GGUF_QUANTIZED_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8}


def _nibbles_q4_01(qs: np.ndarray) -> np.ndarray:
    """``[num_blocks, 16]`` bytes -> ``[num_blocks, 32]`` uint8: low nibbles, then high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def unpack_gguf_tensor(data: np.ndarray, type_name: str, shape: tuple[int, int]):
    """The integers and scales of a quantized GGUF tensor.

    Args:
        data: the tensor's raw bytes as ``GGUFReader`` gives them (uint8, one row of blocks per
            output row).
        type_name: its GGUF type (a key of :data:`GGUF_QUANTIZED_BITS`).
        shape: ``(out_features, in_features)``.

    Returns:
        A :class:`QuantizedWeight`: 4-bit formats with ``min`` (Q4_0: ``-8 d``) and group size
        32; Q8_0 as int8 with group size 32 and no ``min``.

    Raises:
        KeyError: a type not in :data:`GGUF_QUANTIZED_BITS`.
    """
    rows, cols = shape
    bits = GGUF_QUANTIZED_BITS[type_name]
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    if type_name == "Q4_K":
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        scale = d * sc.astype(np.float32)  # [num_blocks, 8]
        minimum = -(dmin * m.astype(np.float32))
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(rows, cols)
    elif type_name == "Q8_0":
        blocks = raw.reshape(-1, 34)
        scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        minimum = None
        q = blocks[:, 2:].copy().view(np.int8).reshape(rows, cols)
    else:
        size = 18 if type_name == "Q4_0" else 20
        blocks = raw.reshape(-1, size)
        scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        if type_name == "Q4_0":
            minimum = -8 * scale
        else:
            minimum = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        q = _nibbles_q4_01(blocks[:, size - 16 :]).reshape(rows, cols)
    groups = cols // 32
    return QuantizedWeight(
        bits,
        torch.from_numpy(np.ascontiguousarray(q)),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, groups))),
        None if minimum is None else torch.from_numpy(minimum.reshape(rows, groups).copy()),
        32,
    )
