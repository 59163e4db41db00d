"""Building pagedkv's own C kernels at first use: one compile into the cache, reused after.

Two libraries are built this way: the paged attention of the ``native`` backend
(:mod:`pagedkv.ops.backends.native`) and the quantized products and fused decoder layers of
:mod:`pagedkv.model.kernels.cpu_quant`. Each is compiled with the system C compiler (``$CC``
or ``cc``) into ``$PAGEDKV_CACHE_DIR/kernels/`` under a name keyed by a hash of its sources,
headers, flags and the compiler's path and version; the build goes to a temporary file renamed
into place, so two processes building at once both end with a whole library.

Threads: ``-fopenmp`` links ``libgomp.so.1``; torch's wheel carries its own ``libgomp.so.1``
(the same soname), loaded first, so the dynamic loader resolves these libraries to torch's
OpenMP runtime: their parallel regions run on torch's thread pool, with
``torch.get_num_threads()`` threads passed on every call.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pagedkv.config import cache_dir
from pagedkv.cpu_caps import CpuCapabilities, cpu_flags, probe_cpu
from pagedkv.errors import PagedKVError

logger = logging.getLogger(__name__)

#: Flags of every build: AVX2 + FMA code, OpenMP, a shared library.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
#: CPU flags (``/proc/cpuinfo``) of the AVX-512 code paths (F, BW, VL, DQ).
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
#: :data:`CFLAGS` plus AVX-512 F/BW/VL/DQ: a source's 16-lane paths (``__AVX512F__``).
AVX512_CFLAGS = (*CFLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")


class KernelUnavailableError(PagedKVError, RuntimeError):
    """pagedkv's C kernels cannot run here (no AVX2/FMA, no compiler, a failed build or
    self-check, a library that does not load)."""


def kernel_cache() -> Path:
    """Where the libraries are built: ``$PAGEDKV_CACHE_DIR/kernels``."""
    return cache_dir() / "kernels"


def compiler() -> str:
    """The C compiler: ``$CC``, else ``cc``."""
    return os.environ.get("CC") or "cc"


def check_avx2_fma(caps: CpuCapabilities | None = None) -> None:
    """Raises KernelUnavailableError unless the CPU has AVX2 and FMA (with ``caps`` applied:
    an AVX2 hold through ``ATEN_CPU_CAPABILITY`` counts; None = :func:`probe_cpu`)."""
    caps = probe_cpu() if caps is None else caps
    if not (caps.avx2 and "fma" in cpu_flags()):
        raise KernelUnavailableError(f"{caps.summary()}: the kernels need AVX2 and FMA")


def avx512_available(caps: CpuCapabilities | None = None) -> bool:
    """The CPU runs AVX-512 F/BW/VL/DQ and no hold caps it (``caps`` applied: an AVX2 hold
    through ``ATEN_CPU_CAPABILITY`` or ``ONEDNN_MAX_CPU_ISA`` makes this False; None =
    :func:`probe_cpu`)."""
    caps = probe_cpu() if caps is None else caps
    flags = cpu_flags()
    return caps.avx512 and all(f in flags for f in AVX512_FLAGS)


def build_library(
    compiler: str,
    cache: Path,
    sources: Path | Sequence[Path],
    *,
    name: str,
    headers: Sequence[Path] = (),
    flags: Sequence[str] = CFLAGS,
) -> Path:
    """Compile ``sources`` (one C file or several, linked into one library) into ``cache`` as
    ``{name}-{hash}.so`` unless an identical build is there.

    Raises:
        KernelUnavailableError: the compiler is missing or the build failed.
    """
    path = shutil.which(compiler)
    if path is None:
        raise KernelUnavailableError(f"no C compiler {compiler!r}")
    try:
        version = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailableError(f"C compiler {compiler!r} does not run: {e}") from None
    sources = [sources] if isinstance(sources, Path) else list(sources)
    text = b"".join(p.read_bytes() for p in (*sources, *headers))
    key = hashlib.sha256(text + " ".join(flags).encode() + path.encode() + version.encode())
    target = cache / f"{name}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    names = " + ".join(p.name for p in sources)
    # once per machine and source version; minutes for the quantized products on 2 cores,
    # which would otherwise read as a hang between two start-up lines
    logger.info("compiling %s into %s (once: up to minutes)", names, target.name)
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [path, *flags, *map(str, sources), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode:
            raise KernelUnavailableError(f"building {names} failed: {done.stderr[-2000:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailableError(f"building {names} failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
