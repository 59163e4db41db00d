"""Byte units: the constants, a parser for sizes such as ``"2GiB"`` and a formatter.

Torch-free and imports nothing from pagedkv but the errors, so every layer (the core's sizing,
the engine's options, the planner and the CLIs) uses the same parser and the same spelling.
"""

from __future__ import annotations

import re

from pagedkv.errors import ConfigError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

#: Unit suffixes (upper-cased) -> bytes. Bare K/M/G/T are binary, as in ``--kv-cache-memory 1G``
#: and vLLM's ``--kv-cache-memory``; KB/MB/GB/TB are decimal.
_UNITS = {
    "": 1,
    "B": 1,
    "K": KiB,
    "KIB": KiB,
    "KB": 10**3,
    "M": MiB,
    "MIB": MiB,
    "MB": 10**6,
    "G": GiB,
    "GIB": GiB,
    "GB": 10**9,
    "T": TiB,
    "TIB": TiB,
    "TB": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_memory_size(text: str) -> int:
    """Bytes from ``"24GiB"``, ``"80 GB"``, ``"1.5G"`` (bare K/M/G/T are binary) or ``"1024"``.

    Raises:
        ConfigError: not a size.
    """
    match = _SIZE.match(str(text))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"not a memory size: {text!r}; write a number with a unit such as 24GiB, 80GB, 512MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` as a short human string in binary units (``"53.80 GiB"``)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{int(num_bytes)} B"
