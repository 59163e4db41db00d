"""Process-wide CPU settings that the engine's speed depends on (measurements: docs/perf.md).

- glibc malloc: by default a freed tensor above 128 KiB-32 MiB goes back to the OS and the next
  step's tensor of the same size comes back as fresh pages (page faults on every step). Raising
  the mmap threshold to its maximum (32 MiB) and never trimming the heap keeps that memory in the
  process: batch-64 bf16 decode went from 150 ms to 92 ms (docs/perf.md).
- torch threads: one per CPU this process may use (:func:`pagedkv.cpu_env.available_cpu_count`:
  its affinity mask, capped by its cgroup's CPU quota). OpenMP's spin-wait is bounded before
  torch loads (:mod:`pagedkv.cpu_env`, ``GOMP_SPINCOUNT=1000``): with libgomp's default spin, a
  4-chat run beside a CPU burner on a busy 2-core machine did not finish in 120 s; with the
  bound the default took 14.2 s without and 23.5 s with the burner (1.65x; ``--num-threads 1``
  5.0 / 6.7 s), benchmarks/bench_threads_load.py, docs/perf.md.

- one OpenMP thread pool: libgomp gives each thread that starts parallel regions a pool of its
  own, and once its threads outnumber the CPUs (the model loaded on the main thread, the steps
  run on the server's engine thread: 3 on 2 CPUs) every barrier spins only a hundredth as long
  before it sleeps (``gomp_throttled_spin_count_var``), so each of a step's ~150 parallel regions
  pays a futex wake-up. An int4 product took 74-94 us from the engine thread against 27-43 us
  from the main thread, and a served chat decoded at about half the offline speed.
  :func:`release_openmp_threads` (``omp_pause_resource_all``) frees the calling thread's pool;
  the server's engine loop calls it on the thread that starts the engine thread.

Applied once at engine start-up by :func:`tune_cpu_runtime`; both settings are idempotent.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from pagedkv.cpu_env import available_cpu_count

# glibc mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's cap on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_TRIM_THRESHOLD_NEVER = 2**31 - 1


def tune_malloc() -> bool:
    """Keep freed large blocks in the process (glibc only). Returns True when applied."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    return mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_NEVER) == 1 and ok


#: ``omp_pause_hard`` (OpenMP 5.0's ``omp_pause_resource_t``): free the threads.
_OMP_PAUSE_HARD = 2


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP thread pool (``omp_pause_resource_all(omp_pause_hard)``
    of the libgomp torch loaded), so that another thread's pool is the only one (see the module
    docs). The next parallel region this thread starts builds a new pool. Call it outside any
    parallel region. Returns True when the runtime did it; False where there is no libgomp
    with OpenMP 5.0's pause (another OpenMP runtime, an old libgomp): nothing changes then.
    """
    try:
        gomp = ctypes.CDLL("libgomp.so.1")  # torch's: the soname is loaded already
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes = (ctypes.c_int,)
    pause.restype = ctypes.c_int
    return pause(_OMP_PAUSE_HARD) == 0


def tune_cpu_runtime(num_threads: int | None = None) -> int:
    """Apply the malloc settings and set torch's intra-op thread count.

    Args:
        num_threads: torch threads; None = :func:`pagedkv.cpu_env.available_cpu_count`.

    Returns:
        The thread count set.
    """
    tune_malloc()
    threads = num_threads if num_threads is not None else available_cpu_count()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
