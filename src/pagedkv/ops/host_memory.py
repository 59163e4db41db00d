"""Large host buffers from anonymous private mappings: zeroed by the kernel, faulted in lazily,
on transparent huge pages where the platform has them.

Two users: the GGUF loader's weight arena (:class:`pagedkv.model.gguf_loader.WeightArena`)
and the CPU KV cache (:func:`pagedkv.ops.backends.hnd_layout.allocate_kv_cache`). Both are read
in long sweeps every decode step, where 2 MiB pages save most TLB misses (dearer in a virtual
machine: on a 2-core AMD EPYC Zen 4 VM a Llama-3.2-1B Q4_K_M decode step took 30.0-31.6 ms with
its weights on 4 KiB pages and 24.3-25.8 ms on huge pages). A mapping's pages are zero until
written (POSIX guarantees it for anonymous mappings) and take memory only once touched, so a
KV cache of many blocks costs no time to zero at start-up and no resident memory until its
blocks are used, where ``torch.zeros`` writes every byte up front.

And read-only file mappings (:func:`map_file_read_only`, the GGUF loader's): where the page
cache holds the file in 2 MiB folios the kernel maps them with 2 MiB entries, as fast to read
as anonymous huge pages and with no copy (:func:`huge_mapped_bytes` says how much).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.errors import HostMemoryError, OpsInputError
from pagedkv.units import format_bytes
from pagedkv.validation import check_int

#: The alignment of every buffer: one transparent huge page on x86-64 (bytes).
HUGE_PAGE = 2 << 20
#: madvise(2)'s MADV_POPULATE_READ (Linux 5.14+; the same number on every architecture), which
#: Python's mmap module does not name: fault a range in, reading what the page cache lacks.
_MADV_POPULATE_READ = 22
_SMAPS_HEADER = re.compile(r"^([0-9a-f]+)-[0-9a-f]+ ")


def anonymous_zeros(num_bytes: int, huge_pages: bool = True) -> torch.Tensor:
    """A zeroed uint8 tensor ``[num_bytes]`` on an anonymous private mapping of its own.

    The buffer starts on a :data:`HUGE_PAGE` boundary and, with ``huge_pages``, is advised
    ``MADV_HUGEPAGE`` where the platform has it (Linux; the kernel's transparent huge page
    setting decides: ``madvise`` or ``always`` take it, ``never`` keeps 4 KiB pages). It is
    unmapped when the last tensor viewing it is freed. View it as another dtype with
    ``.view(dtype)`` (its start is aligned for any).

    Args:
        num_bytes: the size (>= 0).
        huge_pages: advise huge pages.

    Raises:
        OpsInputError: ``num_bytes`` not a non-negative int.
        HostMemoryError: the system would not map that much (strict overcommit, a ``ulimit -v``
            limit). Under Linux's default overcommit, or a cgroup's memory limit, the mapping
            succeeds and memory is taken page by page as it is written (past a cgroup's limit
            the process is then killed: callers check sizes first).
    """
    check_int("num_bytes", num_bytes, 0, error=OpsInputError)
    if num_bytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    # private: shared anonymous memory is shmem's, whose huge pages follow another setting
    flags = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}
    try:
        mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE, **flags)
    except (OSError, OverflowError) as e:
        raise HostMemoryError(f"cannot map {format_bytes(num_bytes)} of host memory: {e}") from e
    whole = np.frombuffer(mapping, dtype=np.uint8)
    first = -whole.ctypes.data % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if huge_pages and advice is not None:
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(advice, first, num_bytes)
    return torch.from_numpy(whole[first : first + num_bytes])


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled contiguous CPU tensor of ``shape`` and ``dtype`` on memory of its own from
    :func:`anonymous_zeros` (huge pages where the platform has them): what ``torch.zeros``
    gives, without writing it up front. The all-zero bit pattern is 0 in every dtype torch
    has (+0.0 for the float and fp8 formats).

    Raises:
        OpsInputError: a negative size.
        HostMemoryError: see :func:`anonymous_zeros`.
    """
    count = 1
    for size in shape:
        check_int("size", size, 0, error=OpsInputError)
        count *= size
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return anonymous_zeros(count * itemsize).view(dtype).view(shape)


def huge_page_setting() -> str:
    """The kernel's transparent huge page mode for this process's buffers ("always",
    "madvise": both give :func:`anonymous_zeros` huge pages; "never": 4 KiB pages), from
    /sys/kernel/mm/transparent_hugepage/enabled; "unknown" where it cannot be read (not
    Linux)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unknown"


def map_file_read_only(path: str | Path) -> np.ndarray:
    """A read-only shared mapping of the whole file at ``path`` as a uint8 array ``[size]``,
    its pages faulted in as they are read (or ahead, :func:`populate_mapped_pages`). Shared:
    the pages are the page cache's, so a write to the file by another process shows through,
    and truncating it makes reads past its new end fault (SIGBUS).

    A range the page cache holds in 2 MiB folios is mapped with 2 MiB entries
    (:func:`huge_mapped_bytes`): the file's pages read with as few TLB misses as anonymous huge
    pages, shared with every process mapping the file; pages in smaller folios stay 4 KiB
    entries. The mapping is advised ``MADV_HUGEPAGE``, which decides the
    folio size of what the page cache reads for it from disk: 2 MiB where the kernel and
    filesystem can (large folios in the page cache: Linux 6.18's ext4 here, XFS). Advice the
    platform lacks is skipped. The mapping lives as long as the array (or a view of it).

    Raises:
        HostMemoryError: the file cannot be opened or mapped (missing, empty, a directory).
    """
    try:
        with open(path, "rb") as file:
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise HostMemoryError(f"cannot map {path}: {e}") from e
    if sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapping, dtype=np.uint8)


#: Ranges of at least this many bytes are faulted in through libc, the GIL released; shorter
#: ones hold it (:func:`populate_mapped_pages`).
GIL_FREE_BYTES = 64 << 20


def populate_mapped_pages(array: np.ndarray, ranges: list[tuple[int, int]] | None = None) -> None:
    """Fault in the pages of a mapping from :func:`map_file_read_only`, reading from the file
    what the page cache lacks (``MADV_POPULATE_READ``, Linux 5.14+, as ``MAP_POPULATE``):
    ``ranges`` of ``(start, length)`` bytes (page-aligned starts), or all of it. A no-op
    where the platform lacks it.

    A range of :data:`GIL_FREE_BYTES` or more is faulted in through libc (ctypes), which
    releases the GIL: reading a file of gigabytes from the disk takes seconds, which other
    threads (the tokenizer's, at load) get to use. A shorter one holds it (Python's
    ``mmap.madvise``) for the call: a thread that gives the GIL up waits at least the
    interpreter's switch interval (5 ms) to get it back from a busy thread, 5-10x a 2 MiB
    window's read.

    Raises:
        OpsInputError: a range outside the mapping or not starting on a page (nothing is
            faulted in).
    """
    mapping = _mapping_of(array)
    if mapping is None or not sys.platform.startswith("linux"):
        return
    size = len(mapping)
    ranges = [(0, size)] if ranges is None else ranges
    for start, length in ranges:
        if start < 0 or length < 0 or start + length > size or start % mmap.PAGESIZE:
            raise OpsInputError(
                f"range of {length} bytes at {start} is outside the {size}-byte mapping or "
                "does not start on a page"
            )
    madvise = _libc_madvise()
    base = np.frombuffer(mapping, dtype=np.uint8).ctypes.data  # the mapping's first byte
    for start, length in ranges:
        if madvise is not None and length >= GIL_FREE_BYTES:
            madvise(base + start, length, _MADV_POPULATE_READ)  # an error: not faulted in,
            continue  # read when used
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(_MADV_POPULATE_READ, start, length)


def trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim(0)``, every malloc
    arena; milliseconds). After a load: what a loading thread (the tokenizer's) allocated and
    freed stays in its own arena otherwise, resident (61 MiB for a 128k vocabulary's tokenizer;
    the loads' transient allocations, 16-80 MiB more, whichever thread made them). A no-op
    where libc has no ``malloc_trim`` (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


def _libc_madvise() -> Any:
    """libc's ``madvise(addr, length, advice)`` as a ctypes function (None where libc cannot
    be loaded)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def drop_cached_pages(path: str | Path, ranges: list[tuple[int, int]] | None = None) -> None:
    """Ask the kernel to drop the page cache's pages of the file at ``path`` in ``ranges`` of
    ``(start, length)`` bytes, or all of it (``POSIX_FADV_DONTNEED``): clean pages that no
    process maps leave the page cache, and the next read of them comes from the disk (through
    a :func:`map_file_read_only` mapping: in 2 MiB folios where the kernel and filesystem can).
    Pages some process maps, and dirty ones, stay. A no-op where the platform lacks it or the
    file cannot be opened."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        for start, length in [(0, 0)] if ranges is None else ranges:
            with contextlib.suppress(OSError):
                fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _mapping_of(array: np.ndarray) -> mmap.mmap | None:
    """The mmap behind an array from :func:`map_file_read_only` (None for another array)."""
    mapping = array.base.obj if isinstance(array.base, memoryview) else array.base
    return mapping if isinstance(mapping, mmap.mmap) else None


def release_mapped_pages(array: np.ndarray) -> None:
    """Drop the page-table entries of a read-only file mapping from
    :func:`map_file_read_only` (``MADV_DONTNEED``): its pages leave this process's resident
    set but stay in the page cache, and fault back in when read. A no-op where the platform
    lacks it."""
    mapping = _mapping_of(array)
    if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(mmap.MADV_DONTNEED)


def huge_mapped_bytes(array: np.ndarray) -> int | None:
    """How many bytes of the file mapping that ``array`` starts (:func:`map_file_read_only`)
    the kernel maps with 2 MiB page-table entries: its ``FilePmdMapped`` in /proc/self/smaps
    (bytes; a multiple of 2 MiB). None where that cannot be read (not Linux, no such field) or
    where no mapping starts at ``array``'s first byte (a view into one)."""
    address = array.ctypes.data
    try:  # any mapped path's bytes, whatever their encoding
        with open(f"/proc/{os.getpid()}/smaps", errors="surrogateescape") as smaps:
            found = False
            for line in smaps:
                header = _SMAPS_HEADER.match(line)
                if header:
                    if found:
                        return None
                    found = int(header.group(1), 16) == address
                elif found and line.startswith("FilePmdMapped:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None
