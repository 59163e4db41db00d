"""A weight kept as the GGUF file stores it, and the product that computes on its blocks.

llama.cpp multiplies by a GGUF file's blocks as they are stored: its memory is the file plus
the KV cache. pagedkv does the same. A :class:`GGUFWeight` holds the file's bytes (unchanged,
but for Q4_0 / Q4_1 blocks moved into bands of 8 rows for the AVX2 body, below; a
view of the mapped file where the page cache maps it with 2 MiB pages, else read into anonymous
huge pages by the loader, :class:`~pagedkv.model.gguf_loader.WeightArena`, where a decode step
reads them faster than from 4 KiB pages; a lookup-only embedding table stays a view of the
file's memory map), and :class:`GGUFMatmul` computes
``x W^T`` on them with pagedkv's kernels (:mod:`pagedkv.model.kernels.cpu_quant`,
``gguf_blocks.c``)::

    steps of at most MAX_ROWS tokens   gguf_gemm: every block read once from memory and unpacked
                                       in registers for all rows; int8 activations in blocks of
                                       32 for the quantized types (the default), fp32 ones with
                                       PAGEDKV_GGUF_ACTIVATIONS=fp32 (the dequantized weights'
                                       numbers)
    larger steps, int8 activations,    gguf_gemm_fast: the step's rows rounded to int8 once,
    up to fast_large_rows (VNNI: any   tiles of weight rows unpacked once (one row per lane)
    model, per type; AVX2 body: a      and met by a few activation rows at a time, each
    float32 model, as gguf_gemm_large) weight group's integer dot summed whole (as llama.cpp)
    larger steps of a float32 model,   gguf_gemm_large: the step's rows rounded to int8 once,
    int8 activations, up to            then the small steps' products over groups of 8 rows
    q8_large_max_rows rows (all held   while a block of 64 weight rows stays in L2 (Q8_0
    to AVX2, 64 with AVX-512's GEMM)   on the AVX2 body, which gguf_gemm_fast does not take)
    larger steps otherwise             a tile of rows at a time dequantized into a small scratch
                                       (``gguf_dequant``, fp32 or bf16), then torch's GEMM on
                                       the tile: the weight is read once per step, and the
                                       scratch stays in the caches

so no dense copy of the model is ever held (``--quantization none`` asks for one). On the
AVX2 body's int8 products a Q4_0 / Q4_1 weight's rows are laid out at load in bands of 8
(:meth:`~pagedkv.model.kernels.cpu_quant.CpuQuantKernels.interleave`, ``interleaved``): the
same bytes, moved, so that one activation broadcast meets 8 weight rows at once. The
embedding table is looked up row by row (``gguf_get_rows``). Every GGML type the kernels
take runs this way (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.errors import ConfigError
from pagedkv.model.kernels.cpu_quant import (
    INTERLEAVED_TYPES,
    MAX_ROWS,
    Q8_TYPES,
    CpuQuantKernels,
)

#: Elements of the dequantized scratch a large step fills per tile (16 MiB in fp32): the
#: tile then stays in the L2/L3 caches while the GEMM reads it.
TILE_ELEMENTS = 4 << 20


def ggml_type_sizes(type_name: str) -> tuple[int, int]:
    """``(block_elems, block_bytes)`` of a GGML type (``"Q4_K"`` -> ``(256, 144)``).

    Raises:
        ConfigError: a type the ``gguf`` package does not know.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    except KeyError:
        raise ConfigError(f"unknown GGML tensor type {type_name!r}") from None


def ggml_type_name(type_id: int) -> str:
    """The GGML type's name of a ``ggml_type`` code (2 -> ``"Q4_0"``).

    Raises:
        ConfigError: an unknown code.
    """
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        raise ConfigError(f"unknown GGML tensor type code {type_id}") from None


@dataclass(frozen=True, slots=True)
class GGUFWeight:
    """A 2-D weight ``[out_features, in_features]`` as the GGUF file stores it.

    Attributes:
        type_name: its GGML type (``"Q4_K"``, ``"Q6_K"``, ``"F16"``, ...).
        data: uint8 ``[out_features, row_bytes]``: each row's consecutive blocks, as in the
            file (a copy in the loader's weight arena, q / k rows reordered; or a view of
            the file's memory map).
        shape: ``(out_features, in_features)``.
        kernels: pagedkv's kernels that compute on it.
        dtype: the dtype its products return (the model's compute dtype).
        interleaved: the rows laid out in bands of 8 for the AVX2 body's int8 products
            (:meth:`~pagedkv.model.kernels.cpu_quant.CpuQuantKernels.interleave`: Q4_0 and
            Q4_1, the same bytes moved); :attr:`type_id` is then the interleaved type's.
    """

    type_name: str
    data: torch.Tensor
    shape: tuple[int, int]
    kernels: CpuQuantKernels | None = field(default=None, repr=False, compare=False)
    dtype: torch.dtype = torch.float32
    interleaved: bool = False
    #: the ``ggml_type`` code the kernels take (from ``type_name``, or its interleaved type's;
    #: looked up once, not per product).
    type_id: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from gguf.constants import GGMLQuantizationType

        block_elems, block_bytes = ggml_type_sizes(self.type_name)
        type_id = int(GGMLQuantizationType[self.type_name])
        if self.interleaved:
            if type_id not in INTERLEAVED_TYPES or self.shape[0] % 8:
                raise ConfigError(
                    f"a {self.type_name} weight of {self.shape[0]} rows has no interleaved layout"
                )
            type_id = INTERLEAVED_TYPES[type_id].type_id
        object.__setattr__(self, "type_id", type_id)
        rows, cols = self.shape
        if cols % block_elems:
            raise ConfigError(
                f"a {self.type_name} row of {cols} elements is not a whole number of "
                f"{block_elems}-element blocks"
            )
        expected = (rows, cols // block_elems * block_bytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ConfigError(
                f"{self.type_name} weight {self.shape}: data must be uint8 {expected}, got "
                f"{self.data.dtype} {tuple(self.data.shape)}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes of the stored blocks (what a product reads)."""
        return self.data.numel()

    def with_(self, **changes) -> GGUFWeight:
        """A copy with ``changes`` (``kernels=``, ``dtype=``); the data is shared."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dense(
        cls, weight: torch.Tensor, dtype: torch.dtype, kernels: CpuQuantKernels
    ) -> GGUFWeight:
        """A dense 2-D weight ``[out_features, in_features]`` as a GGML F32 (``dtype``
        float32) or BF16 (bfloat16) tensor, so pagedkv's kernels run it as they run a file's
        blocks (the batch-invariant path's products). Shares the memory of a float32 weight
        kept in float32; otherwise a copy in ``dtype``.

        Raises:
            ConfigError: a weight that is not 2-D, or a dtype other than float32 and bfloat16.
        """
        if weight.dim() != 2:
            raise ConfigError(f"a dense weight must be 2-D, got {tuple(weight.shape)}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"dense weights run as F32 or BF16 blocks, not {dtype}")
        rows, cols = weight.shape
        data = weight.to(dtype).contiguous().view(torch.uint8).reshape(rows, -1)
        name = "F32" if dtype == torch.float32 else "BF16"
        return cls(name, data, (rows, cols), kernels, dtype)

    def rows(self, index: torch.Tensor | slice) -> GGUFWeight:
        """The weight's output rows ``index`` (a copy of their blocks for an index tensor: the
        rows of a q / k weight reordered). An interleaved weight takes slices of whole bands
        only (start and stop multiples of 8, step 1).

        Raises:
            ConfigError: other rows of an interleaved weight.
        """
        if self.interleaved:
            start, stop, step = (
                index.indices(self.shape[0]) if isinstance(index, slice) else (1, 0, 0)
            )
            if step != 1 or start % 8 or stop % 8 or stop < start:
                raise ConfigError(
                    f"rows of an interleaved {self.type_name} weight are taken in bands of 8, "
                    f"not {index!r}"
                )
        data = self.data[index].contiguous()
        return dataclasses.replace(self, data=data, shape=(data.shape[0], self.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight ``[out_features, in_features]`` in ``dtype`` (float32: the
        values ``gguf``'s dequantizer gives, bit for bit)."""
        out = torch.empty(self.shape, dtype=torch.float32)
        self._kernels().gguf_dequant(self.type_id, self.data, out, 0)
        return out if dtype == torch.float32 else out.to(dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64, any shape ``S``) dequantized, float32 ``[*S, in_features]``
        (an embedding lookup, or the LM head rows :func:`~pagedkv.model.logits.
        refine_top_logits` recomputes)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.shape[0], self.shape[1], dtype=torch.float32)
        if flat.shape[0]:
            self._kernels().gguf_get_rows(self.type_id, self.data, flat, out)
        return out.view(*ids.shape, self.shape[1])

    __getitem__ = lookup

    def _kernels(self) -> CpuQuantKernels:
        if self.kernels is None:
            raise ConfigError(f"{self.type_name} weight {self.shape} has no kernels attached")
        return self.kernels


class GGUFMatmul:
    """``x W^T`` on weights as the file stores them: ``parts`` stacked along the output
    features (q, k and v of one layer, each in its own type; or one weight).

    Args:
        parts: :class:`GGUFWeight` of one ``in_features``, each with kernels attached; the
            output's columns are the parts' rows in order.

    Raises:
        ConfigError: no parts, parts of different widths or compute dtypes, or a part
            without kernels.
    """

    __slots__ = ("dtype", "in_features", "out_features", "parts")

    def __init__(self, parts: Sequence[GGUFWeight]):
        if not parts:
            raise ConfigError("GGUFMatmul needs at least one weight")
        first = parts[0]
        for part in parts:
            if part.shape[1] != first.shape[1] or part.dtype != first.dtype:
                raise ConfigError(
                    f"stacked GGUF weights must share in_features and dtype: {first.shape} "
                    f"{first.dtype} vs {part.shape} {part.dtype}"
                )
            part._kernels()
        self.parts = tuple(parts)
        #: ``in_features`` and the parts' rows summed.
        self.in_features = first.shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        #: the dtype a call returns (the model's compute dtype).
        self.dtype = first.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the stored blocks of every part."""
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` ``[num_tokens, out_features]`` in :attr:`dtype` for x ``[num_tokens,
        in_features]`` (any float dtype)."""
        num_tokens = x.shape[0]
        if num_tokens <= MAX_ROWS:
            xf = x.float().contiguous()
            outs = [
                p.kernels.gguf_gemm(p.type_id, xf, p.data, p.shape[0])
                if num_tokens
                else xf.new_empty(0, p.shape[0])
                for p in self.parts
            ]
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
            return y if y.dtype == self.dtype else y.to(self.dtype)
        fast = [p.kernels.takes_fast_large(p.type_id, num_tokens, self.dtype) for p in self.parts]
        if any(fast):
            # each part on the fast large product where it was measured faster, the others
            # as before (the int8 large product or tiles)
            xf = x.float().contiguous()
            outs = [
                p.kernels.gguf_gemm_fast(p.type_id, xf, p.data).to(self.dtype)
                if f
                else self._large(x, xf, (p,))
                for p, f in zip(self.parts, fast, strict=True)
            ]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return self._large(x, None, self.parts)

    def _large(
        self, x: torch.Tensor, xf: torch.Tensor | None, parts: Sequence[GGUFWeight]
    ) -> torch.Tensor:
        """``parts`` of a large step (their columns) on the int8 large products where a
        float32 model's kernels take them (:attr:`~pagedkv.model.kernels.cpu_quant.
        CpuQuantKernels.q8_large_max_rows`), else on tiles; ``xf``: x in fp32, or None."""
        num_tokens = x.shape[0]
        if self.dtype == torch.float32 and all(
            p.type_id in Q8_TYPES and num_tokens <= p.kernels.q8_large_max_rows for p in parts
        ):
            xf = x.float().contiguous() if xf is None else xf
            outs = [p.kernels.gguf_gemm_large(p.type_id, xf, p.data) for p in parts]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return self._tiled(x, parts)

    def invariant(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` float32 ``[num_tokens, out_features]`` for x ``[num_tokens, in_features]``
        (any float dtype) in one reduction order per row whatever ``num_tokens``
        (:meth:`~pagedkv.model.kernels.cpu_quant.CpuQuantKernels.gguf_gemm_invariant`): a
        row's bits are those it gets alone. The batch-invariant path's product (the LM head's;
        the layers' run in C). Not rounded to :attr:`dtype`.

        Raises:
            KernelUnavailableError: a part whose type or shape the kernels do not take.
        """
        xf = x.float().contiguous()
        if xf.shape[0] == 0:
            return xf.new_empty(0, self.out_features)
        outs = [p.kernels.gguf_gemm_invariant(p.type_id, xf, p.data) for p in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _tiled(self, x: torch.Tensor, parts: Sequence[GGUFWeight] | None = None) -> torch.Tensor:
        """A large step: each tile of rows dequantized into a scratch in the compute dtype
        (float32, or bfloat16 for a bf16 model), then torch's GEMM on it. ``parts``: those
        of :attr:`parts` to compute (their columns only); None = all."""
        parts = self.parts if parts is None else parts
        dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32
        xc = x.to(dtype).contiguous()
        k = self.in_features
        tile_rows = max(16, TILE_ELEMENTS // k)
        scratch = torch.empty(min(tile_rows, max(p.shape[0] for p in parts)), k, dtype=dtype)
        out = torch.empty(x.shape[0], sum(p.shape[0] for p in parts), dtype=dtype)
        column = 0
        for part in parts:
            for start in range(0, part.shape[0], tile_rows):
                rows = min(tile_rows, part.shape[0] - start)
                tile = scratch[:rows]
                part.kernels.gguf_dequant(part.type_id, part.data, tile, start)
                out[:, column : column + rows] = torch.mm(xc, tile.t())
                column += rows
        return out if out.dtype == self.dtype else out.to(self.dtype)
