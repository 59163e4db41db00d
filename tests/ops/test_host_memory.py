"""Host buffers on anonymous mappings: zeroed, aligned, any dtype and shape, freed with their
last view; the CPU KV caches are such buffers."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.errors import CacheSizingError, HostMemoryError, OpsInputError
from pagedkv.ops.backends.hnd_layout import allocate_kv_cache
from pagedkv.ops.host_memory import (
    HUGE_PAGE,
    anonymous_zeros,
    drop_cached_pages,
    huge_mapped_bytes,
    map_file_read_only,
    populate_mapped_pages,
    release_mapped_pages,
    trim_heap,
    zeroed_host_tensor,
)


@pytest.mark.parametrize("num_bytes", [1, 4095, 4096, HUGE_PAGE + 3, 3 * HUGE_PAGE])
def test_anonymous_zeros_are_zero_aligned_and_writable(num_bytes):
    buffer = anonymous_zeros(num_bytes)
    assert buffer.dtype == torch.uint8 and buffer.shape == (num_bytes,)
    assert buffer.data_ptr() % HUGE_PAGE == 0
    assert int(buffer.count_nonzero()) == 0
    buffer[-1] = 7
    buffer[0] += 9
    assert int(buffer.sum()) == 16  # one element when num_bytes is 1: 7 + 9
    assert int(anonymous_zeros(num_bytes, huge_pages=False).count_nonzero()) == 0


def test_anonymous_zeros_of_nothing_and_bad_sizes():
    assert anonymous_zeros(0).shape == (0,)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(OpsInputError):
            anonymous_zeros(bad)
    with pytest.raises(OpsInputError):
        zeroed_host_tensor((2, -1), torch.float32)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64]
)
def test_zeroed_host_tensor_equals_torch_zeros(dtype):
    shape = (2, 3, 4, 16, 8)
    got = zeroed_host_tensor(shape, dtype)
    assert got.shape == shape and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), torch.zeros(shape, dtype=dtype).view(torch.uint8))
    got[1, 2, 3] = 1
    assert got.float().sum().item() == 16 * 8


def test_the_mapping_lives_as_long_as_a_view():
    buffer = anonymous_zeros(HUGE_PAGE)
    tail = buffer[-16:]
    del buffer
    gc.collect()
    tail.fill_(3)  # still mapped: the view keeps it
    assert int(tail.sum()) == 48


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "fp8_e4m3"])
def test_cpu_kv_cache_is_a_zeroed_host_buffer(dtype):
    cache = allocate_kv_cache(5, 16, 2, 64, dtype)
    assert cache.shape == (2, 5, 2, 16, 64) and cache.data_ptr() % HUGE_PAGE == 0
    assert int(cache.view(torch.uint8).count_nonzero()) == 0


def test_memory_the_system_refuses_is_a_host_memory_error(monkeypatch):
    import mmap

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(HostMemoryError, match=r"cannot map 3\.00 MiB"):
        anonymous_zeros(3 << 20)
    with pytest.raises(HostMemoryError):
        allocate_kv_cache(5, 16, 2, 64, "bfloat16")


def test_a_cpu_kv_cache_beyond_the_available_memory_is_refused(monkeypatch):
    """A CPU cache takes its memory as blocks are first written: one larger than what the
    process may still take is refused when it is laid out, not when it fills."""
    from pagedkv.core.config import KVCacheConfig
    from pagedkv.core.spec import FullAttentionSpec
    from pagedkv.ops.backends import AttentionLayerSpec, get_attn_backend
    from pagedkv.worker import kv_cache_layout

    backend = get_attn_backend("torch")
    spec = AttentionLayerSpec(
        num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.bfloat16
    )
    kv = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    config = KVCacheConfig.from_num_blocks([kv, kv], 100)
    per_tensor = 2 * 100 * 2 * 16 * 64 * 2  # K and V, blocks, heads, slots, head size, bf16
    monkeypatch.setattr(kv_cache_layout, "available_memory", lambda: 2 * per_tensor - 1)
    with pytest.raises(CacheSizingError, match="needs"):
        kv_cache_layout.allocate_kv_caches(backend, config, [spec, spec])
    monkeypatch.setattr(kv_cache_layout, "available_memory", lambda: 2 * per_tensor)
    caches = kv_cache_layout.allocate_kv_caches(backend, config, [spec, spec])
    assert len(caches) == 2 and caches[0].numel() * 2 == per_tensor


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's /proc/self/status")
def test_available_memory_counts_the_address_space_limit(monkeypatch):
    """Under ``ulimit -v`` a mapping fails past the limit: the memory the process may still
    take is at most the limit less what it has mapped."""
    import resource

    from pagedkv.model.loader import available_memory

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1 << 62, resource.RLIM_INFINITY))
    vm_size = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmSize:")
    )
    got = available_memory()
    assert got is not None and got <= (1 << 62) - vm_size
    monkeypatch.setattr(resource, "getrlimit", lambda which: (vm_size, resource.RLIM_INFINITY))
    assert available_memory() == 0  # nothing left below the limit


def test_a_read_only_file_mapping_holds_the_file(tmp_path):
    """The whole file, read-only; faulted in on demand (a window, then all), its pages leave
    the resident set on release and read back the same; the share in 2 MiB pages is whole
    pages within the file (None where no mapping starts at the array)."""
    path = tmp_path / "weights.bin"
    payload = np.random.default_rng(0).integers(0, 256, 5 << 20, dtype=np.uint8)
    path.write_bytes(payload.tobytes())
    mapped = map_file_read_only(path)
    smaps = Path("/proc/self/smaps").exists()
    if smaps:
        assert _resident_kib(mapped.ctypes.data) == 0  # nothing read yet
    populate_mapped_pages(mapped, [(1 << 20, 8192)])
    if smaps:
        assert 8 <= _resident_kib(mapped.ctypes.data) < payload.nbytes // 1024
    populate_mapped_pages(mapped)
    if smaps:
        assert _resident_kib(mapped.ctypes.data) == payload.nbytes // 1024
    assert np.array_equal(mapped, payload) and not mapped.flags.writeable
    with pytest.raises(ValueError):
        mapped[0] = 1
    huge = huge_mapped_bytes(mapped)
    if smaps:
        assert huge is not None and huge % HUGE_PAGE == 0 and 0 <= huge <= payload.nbytes
        assert huge_mapped_bytes(mapped[4096:]) is None
    release_mapped_pages(mapped)
    if smaps:
        assert _resident_kib(mapped.ctypes.data) == 0
    assert np.array_equal(mapped, payload)


def test_dropped_pages_read_back_the_same(tmp_path, monkeypatch):
    """Dropping a file's cached pages (a range, or all) loses nothing: the mapping reads the
    same bytes from the disk; what this process maps stays resident; a missing file, or a
    platform without posix_fadvise, is a no-op."""
    path = tmp_path / "weights.bin"
    payload = np.random.default_rng(1).integers(0, 256, 3 * HUGE_PAGE, dtype=np.uint8)
    path.write_bytes(payload.tobytes())
    os.sync()  # clean pages: dirty ones would stay
    mapped = map_file_read_only(path)
    populate_mapped_pages(mapped, [(0, HUGE_PAGE)])
    resident = _resident_kib(mapped.ctypes.data) if Path("/proc/self/smaps").exists() else 0
    drop_cached_pages(path, [(HUGE_PAGE, HUGE_PAGE)])
    drop_cached_pages(path)
    if resident:
        assert _resident_kib(mapped.ctypes.data) == resident
    populate_mapped_pages(mapped)
    assert np.array_equal(mapped, payload)
    drop_cached_pages(tmp_path / "missing.bin")
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    drop_cached_pages(path)
    assert np.array_equal(mapped, payload)


def _resident_kib(address: int) -> int:
    """The ``Rss`` (KiB) of the mapping that starts at ``address`` (/proc/self/smaps)."""
    found = False
    for line in Path("/proc/self/smaps").read_text(errors="surrogateescape").splitlines():
        if line[:1].isalnum() and "-" in line.split()[0]:
            found = int(line.split("-")[0], 16) == address
        elif found and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping starts at {address:#x}")


def test_a_file_that_cannot_be_mapped_is_a_host_memory_error(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    for path in (tmp_path / "missing.bin", tmp_path / "empty.bin", tmp_path):
        with pytest.raises(HostMemoryError, match="cannot map"):
            map_file_read_only(path)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise")
def test_a_file_read_cold_through_the_mapping_is_mapped_with_huge_pages(tmp_path):
    """Where the kernel and filesystem cache large folios (Linux 6.x: ext4 from 6.16, XFS), a
    file read for the first time through the mapping (advised MADV_HUGEPAGE) is mapped with
    2 MiB pages, which is what lets the GGUF loader compute on it in place."""
    path = tmp_path / "cold.bin"
    path.write_bytes(np.arange(16 << 20, dtype=np.uint8).tobytes())
    with open(path, "rb") as file:  # written and synced: clean pages the cache can drop
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    mapped = map_file_read_only(path)
    populate_mapped_pages(mapped)
    huge = huge_mapped_bytes(mapped)
    if not huge:
        pytest.skip("this kernel or filesystem caches the file in small folios")
    assert huge % HUGE_PAGE == 0 and huge <= 16 << 20


def test_trim_heap_keeps_live_memory(monkeypatch):
    """Trimming returns only free memory: what is alive reads the same; without glibc's
    malloc_trim it is a no-op."""
    alive = [bytes([i]) * 100_000 for i in range(64)]
    garbage = [bytearray(100_000) for _ in range(64)]
    del garbage
    trim_heap()
    assert all(block == bytes([i]) * 100_000 for i, block in enumerate(alive))

    def no_libc(*args, **kwargs):
        raise OSError("no libc")

    monkeypatch.setattr("pagedkv.ops.host_memory.ctypes.CDLL", no_libc)
    trim_heap()


@pytest.mark.parametrize("gil_free_bytes", [1 << 62, 4096])
def test_populating_checks_its_ranges_first(tmp_path, monkeypatch, gil_free_bytes):
    """Ranges are faulted in holding the GIL or through libc (long ones) alike; a range
    outside the mapping or off a page is refused before anything is faulted in."""
    path = tmp_path / "weights.bin"
    payload = np.random.default_rng(2).integers(0, 256, 3 << 20, dtype=np.uint8)
    path.write_bytes(payload.tobytes())
    monkeypatch.setattr("pagedkv.ops.host_memory.GIL_FREE_BYTES", gil_free_bytes)
    mapped = map_file_read_only(path)
    smaps = Path("/proc/self/smaps").exists()
    for bad in ([(0, 4096), (3 << 20, 4096)], [(-4096, 4096)], [(100, 4096)], [(0, -1)]):
        with pytest.raises(OpsInputError, match="mapping"):
            populate_mapped_pages(mapped, bad)
        if smaps:
            assert _resident_kib(mapped.ctypes.data) == 0
    populate_mapped_pages(mapped, [(1 << 20, 1 << 20)])
    if smaps:
        assert _resident_kib(mapped.ctypes.data) >= 1024
    populate_mapped_pages(mapped)
    if smaps:
        assert _resident_kib(mapped.ctypes.data) == payload.nbytes // 1024
    assert np.array_equal(mapped, payload)
