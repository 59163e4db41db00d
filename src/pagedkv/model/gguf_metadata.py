"""Read a GGUF file's header (metadata, tensor names and places) without touching its tensors.

The engine sizes its KV cache and checks its options from the model's shape before it loads
weights, so a bad option fails in well under a second instead of after the load. The ``gguf``
package's ``GGUFReader`` (no header-only mode in gguf 0.19.0) builds numpy views of every field
and tensor up front, most of the time in the vocabulary and merges; this reader walks the header
with ``struct`` and skips long arrays. Measured (issue 23: a library is kept unless a measurement
says why not) with ``PYTHONPATH=src python benchmarks/bench_gguf_header.py`` (median of 5, both
give the same metadata and tensor names; two runs; "Intel(R) Xeon(R) Processor" per lscpu, 2
cores, load average 5-6; gguf 0.19.0):

    SmolLM2-135M Q4_1 (94 MiB)     ours 0.018 s   GGUFReader + read_metadata 4.6-4.9 s  (~260x)
    Gemma 3 270M Q4_K_M (241 MiB)  ours 0.056 s   GGUFReader + read_metadata 20.5-21.5 s (~380x)

plus 0.25-0.3 s to import gguf (numpy) once. Both are far above the ~2x / 0.3 s bound under
which the library would do, so this reader stays.

GGUF layout (versions 2 and 3, little- or big-endian; llama.cpp's ``docs/gguf.md``)::

    "GGUF"  u32 version  u64 tensor_count  u64 kv_count
    kv_count x  (string key, u32 value_type, value)      string = u64 length + UTF-8 bytes
                                                         array = u32 item_type, u64 count, items
    tensor_count x  (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment (default 32), then the tensor data; each offset counts from
    the data's start

Torch-free (only the standard library).
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.errors import ModelLoadError

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
#: GGUF value type -> struct format of one scalar.
_SCALARS = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
#: Arrays with more items than this (the vocabulary, merges) are skipped, their length kept;
#: the same bound as ``gguf_loader.read_metadata`` (which reads ``gguf.GGUFReader``'s fields).
MAX_ARRAY_LEN = 4096
#: Alignment of the tensor data when the file does not set ``general.alignment`` (the GGUF spec's).
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """Where one tensor's bytes lie in a GGUF file.

    Attributes:
        name: the tensor's GGUF name (``blk.0.attn_q.weight``).
        dims: its dimensions in ggml's order: ``dims[0]`` is the innermost (elements per row,
            the input features of a linear weight), ``dims[1]`` the rows (output features).
        ggml_type: its ``ggml_type`` code (``gguf.GGMLQuantizationType``: 0 F32, 1 F16, 2 Q4_0,
            12 Q4_K, 14 Q6_K, ...).
        offset: bytes from the start of the file to the tensor's first byte.
    """

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(slots=True)
class GGUFHeader:
    """What a GGUF header says.

    Attributes:
        metadata: key -> Python value (str, int, float, bool or list), as
            ``GGUFReader.fields[key].contents()`` gives it, including ``GGUF.version``,
            ``GGUF.tensor_count`` and ``GGUF.kv_count``; arrays longer than MAX_ARRAY_LEN are
            left out.
        array_lengths: key -> item count of every array field (also the skipped ones).
        tensor_names: the names of the file's tensors.
        tensors: every tensor's place in the file, in the header's order.
    """

    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensor_names: set[str]
    tensors: list[GGUFTensorInfo] = field(default_factory=list)


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Read the metadata and tensor names of a GGUF file.

    Raises:
        ModelLoadError: the file cannot be read or is not a GGUF file of version 2 or 3.
    """
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _parse(m)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def tokenizer_digest(path: str | Path) -> str:
    """The SHA-256 (hex) of a GGUF file's tokenizer as stored: the bytes (key, type and value)
    of its ``tokenizer.*`` metadata entries and of ``general.architecture``, which is all a
    tokenizer converted from the file is built from (transformers' ``get_gguf_tokenizer``
    reads those). Copies of a file, and the files of one model in other quantizations, have
    the same; 20-30 ms for a 128k vocabulary.

    Raises:
        ModelLoadError: as :func:`read_gguf_header`.
    """
    extents: list[tuple[int, int]] = []
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            _parse(m, extents)
            digest = hashlib.sha256()
            for start, end in extents:
                digest.update(m[start:end])
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    return digest.hexdigest()


def read_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's metadata with its ``tokenizer.*`` arrays read in full (the vocabulary,
    merges, token types and scores, however long), as :func:`read_gguf_header`'s ``metadata``
    gives the rest: what a tokenizer is built from. Each string array is one pass over its
    bytes (about 0.08 s for a 128k vocabulary and its merges; transformers' GGUF reader, which
    slices a numpy memory map once per string, about 0.5 s: benchmarks/bench_gguf_header.py).

    Raises:
        ModelLoadError: as :func:`read_gguf_header`.
    """
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _parse(m, whole_arrays="tokenizer.").metadata
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def _parse(
    buf: mmap.mmap,
    tokenizer_extents: list[tuple[int, int]] | None = None,
    whole_arrays: str | None = None,
) -> GGUFHeader:
    """The header of the GGUF bytes ``buf``; with ``tokenizer_extents``, the ``(start, end)``
    byte offsets of the tokenizer's metadata entries are appended to it
    (:func:`tokenizer_digest`); arrays whose key starts with ``whole_arrays`` are read whatever
    their length."""
    if buf[:4] != _MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    order = "<"
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:  # written for the other byte order
        order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    tensor_count, kv_count = struct.unpack_from(order + "QQ", buf, 8)
    reader = _Reader(buf, order, 24)
    metadata: dict[str, Any] = {
        "GGUF.version": version,
        "GGUF.tensor_count": tensor_count,
        "GGUF.kv_count": kv_count,
    }
    array_lengths: dict[str, int] = {}
    for _ in range(kv_count):
        start = reader.offset
        key = reader.string()
        value_type = reader.scalar("I")
        if value_type == _ARRAY:
            item_type = reader.scalar("I")
            count = reader.scalar("Q")
            array_lengths[key] = count
            if whole_arrays is not None and key.startswith(whole_arrays):
                metadata[key] = reader.array(item_type, count)
            elif count > MAX_ARRAY_LEN:
                reader.skip_array(item_type, count)
            else:
                metadata[key] = [reader.value(item_type) for _ in range(count)]
        else:
            metadata[key] = reader.value(value_type)
        if tokenizer_extents is not None and (
            key.startswith("tokenizer.") or key == "general.architecture"
        ):
            tokenizer_extents.append((start, reader.offset))
    tensor_names = set()
    relative = []
    for _ in range(tensor_count):
        name = reader.string()
        tensor_names.add(name)
        n_dims = reader.scalar("I")
        dims = struct.unpack_from(f"{order}{n_dims}Q", buf, reader.offset)
        reader.offset += 8 * n_dims
        ggml_type = reader.scalar("I")
        relative.append((name, tuple(dims), ggml_type, reader.scalar("Q")))
    # the tensor data starts at the next multiple of general.alignment after the header
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"general.alignment {alignment!r} is not a positive integer")
    data_start = -(-reader.offset // alignment) * alignment
    tensors = [GGUFTensorInfo(n, d, t, data_start + off) for n, d, t, off in relative]
    return GGUFHeader(metadata, array_lengths, tensor_names, tensors)


class _Reader:
    """A cursor over the header bytes."""

    __slots__ = ("buf", "offset", "order")

    def __init__(self, buf: mmap.mmap, order: str, offset: int) -> None:
        self.buf = buf
        self.order = order
        self.offset = offset

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        start = self.offset
        self.offset += length
        if self.offset > len(self.buf):
            raise ValueError("truncated string")
        return self.buf[start : self.offset].decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type = self.scalar("I")
            count = self.scalar("Q")
            return [self.value(item_type) for _ in range(count)]
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {value_type}")
        return self.scalar(fmt)

    def array(self, item_type: int, count: int) -> list[Any]:
        """The ``count`` items of an array of ``item_type``, read in one pass; a count the
        rest of the file cannot hold is refused (``ValueError``) before anything is
        allocated."""
        fmt = _SCALARS.get(item_type)
        least = struct.calcsize(fmt) if fmt is not None else 8 if item_type == _STRING else 1
        if count > (len(self.buf) - self.offset) // least:
            raise ValueError(f"an array of {count} items runs past the end of the file")
        if fmt is not None:
            values = list(struct.unpack_from(f"{self.order}{count}{fmt}", self.buf, self.offset))
            self.offset += struct.calcsize(fmt) * count
            return values
        if item_type != _STRING:
            return [self.value(item_type) for _ in range(count)]
        unpack_from, buf, order = struct.unpack_from, self.buf, self.order + "Q"
        offset, end = self.offset, len(buf)
        values = [""] * count
        for i in range(count):
            start = offset + 8
            offset = start + unpack_from(order, buf, offset)[0]
            if offset > end:
                raise ValueError("truncated string")
            values[i] = buf[start:offset].decode("utf-8")
        self.offset = offset
        return values

    def skip_array(self, item_type: int, count: int) -> None:
        fmt = _SCALARS.get(item_type)
        if fmt is not None:
            self.offset += struct.calcsize(fmt) * count
        elif item_type == _STRING:  # each string has its own length
            unpack_from, buf, order = struct.unpack_from, self.buf, self.order + "Q"
            offset = self.offset
            for _ in range(count):
                offset += 8 + unpack_from(order, buf, offset)[0]
            self.offset = offset
        else:
            for _ in range(count):
                self.value(item_type)
