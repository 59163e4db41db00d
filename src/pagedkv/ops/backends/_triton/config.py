"""Tile sizes of the triton backend's kernels (no ``triton`` import: the backend and its callers
read it where triton is not installed)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import ConfigError


@dataclass(slots=True, frozen=True)
class TritonAttentionConfig:
    """Tile sizes of the Triton attention kernels (tiles: powers of two, ``tl.dot`` needs >= 16).

    Untuned guesses until a GPU run (docs/gpu.md); ``benchmarks/bench_triton_decode.py
    --partition-size`` sweeps the decode split.

    Attributes:
        partition_size: decode context positions per program (a multiple of ``decode_tile_n``);
            the context of one request is split into ``cdiv(max_seq_len, partition_size)``
            partitions, reduced by a second kernel when there is more than one.
        decode_tile_n: positions per K/V tile in the decode kernel.
        prefill_block_m: rows (query tokens x query heads of one KV head) per prefill program.
        prefill_tile_n: positions per K/V tile in the prefill kernel.
        num_warps: warps per program (ignored by the interpreter).

    Raises:
        ConfigError: a tile that is not a power of two >= 16, a partition that is not a
            multiple of the decode tile, or ``num_warps < 1``.
    """

    partition_size: int = 512
    decode_tile_n: int = 64
    prefill_block_m: int = 64
    prefill_tile_n: int = 64
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("decode_tile_n", "prefill_block_m", "prefill_tile_n"):
            value = getattr(self, name)
            if not _is_int(value) or value < 16 or value & (value - 1):
                raise ConfigError(f"{name} must be a power of two >= 16, got {value!r}")
        if not _is_int(self.num_warps) or self.num_warps < 1:
            raise ConfigError(f"num_warps must be an int >= 1, got {self.num_warps!r}")
        size = self.partition_size
        if not _is_int(size) or size < 1 or size % self.decode_tile_n:
            raise ConfigError(
                f"partition_size must be a multiple of decode_tile_n {self.decode_tile_n}, "
                f"got {size!r}"
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: The kernels' default tiles: 512-position decode partitions, 64-wide tiles, 4 warps.
DEFAULT_CONFIG = TritonAttentionConfig()
