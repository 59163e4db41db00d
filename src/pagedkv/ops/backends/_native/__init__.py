"""The ``native`` backend's C kernels (paged_attention.c) and their ctypes binding."""

from __future__ import annotations

import ctypes
from pathlib import Path

from pagedkv.cpu_caps import probe_cpu
from pagedkv.ops import c_build

#: The C source of the kernels.
SOURCE = Path(__file__).with_name("paged_attention.c")
#: Largest head size the kernels take (their accumulators live on the stack).
MAX_HEAD_SIZE = 512

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int


class AttentionStep(ctypes.Structure):
    """``pagedkv_attention_step`` of paged_attention.c: one step's metadata for one layer
    spec (pointers into the metadata's tensors, which must outlive it)."""

    _fields_ = [
        ("query_start_loc", _P),
        ("seq_lens", _P),
        ("block_tables", _P),
        ("slot_mapping", _P),
        ("block_table_stride", _I64),
        ("num_reqs", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_size", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("kv_bf16", ctypes.c_int32),
        ("softcap", ctypes.c_float),  # logit soft-cap; <= 0: none
    ]


class NativeAttentionLibrary:
    """The loaded library (paged_attention.c): :attr:`write_kv` and :attr:`attention` are its
    step entry points (``pagedkv_step_write_kv``, ``pagedkv_step_attention``), callable with
    raw pointers (the backend checks the tensors first); :attr:`write_kv_address` and
    :attr:`attention_address` are the same functions' addresses, for C callers.

    Args:
        path: the built library.

    Raises:
        OSError: the library does not load.
    """

    __slots__ = ("attention", "attention_address", "path", "write_kv", "write_kv_address")

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self.path = path
        self.write_kv = lib.pagedkv_step_write_kv
        self.write_kv.restype = _I32
        self.write_kv.argtypes = [_P, _P, _P, _P, _I64, _P, _I64, _I64]
        self.attention = lib.pagedkv_step_attention
        self.attention.restype = _I32
        self.attention.argtypes = [_P, _P, _P, _P, _I64, _P, _I32]
        self.write_kv_address = ctypes.cast(self.write_kv, _P).value
        self.attention_address = ctypes.cast(self.attention, _P).value


def load_library() -> NativeAttentionLibrary:
    """Build (once, into the cache) and load the kernels: with AVX-512 (16-lane inner loops)
    where :func:`pagedkv.ops.c_build.avx512_available` (holds applied), else AVX2 + FMA.

    Raises:
        KernelUnavailableError: no AVX2/FMA, no compiler, a failed build, or a library that does
            not load.
    """
    caps = probe_cpu()
    c_build.check_avx2_fma(caps)
    wide = c_build.avx512_available(caps)
    path = c_build.build_library(
        c_build.compiler(),
        c_build.kernel_cache(),
        SOURCE,
        name="paged_attention_avx512" if wide else "paged_attention",
        flags=c_build.AVX512_CFLAGS if wide else c_build.CFLAGS,
    )
    try:
        return NativeAttentionLibrary(path)
    except OSError as e:
        raise c_build.KernelUnavailableError(f"{path} does not load: {e}") from None
