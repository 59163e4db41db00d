"""Tensor-parallel linear layers that run their own collective (vLLM's ``ColumnParallelLinear``,
``QKVParallelLinear`` and ``RowParallelLinear``, written for pagedkv's prepacked linears).

Megatron-LM's split of ``y = x W^T + b`` (W ``[out_features, in_features]``) over ``tp`` ranks::

    ColumnParallelLinear  W split on out: rank r holds W[rows_r] and b[rows_r], and computes
                          y_r = x W_r^T + b_r, its slice of y's features. No communication: the
                          next op (attention over its heads, an elementwise epilogue, a
                          row-parallel linear) takes the slice as it is.
    QKVParallelLinear     the column split of the fused q/k/v weight by whole heads; when there
                          are fewer KV heads than ranks each KV head is replicated on
                          tp / num_kv_heads ranks, so a rank's query heads find theirs locally.
    RowParallelLinear     W split on in: rank r holds W[:, cols_r] and takes the matching slice
                          x_r of its input (a column-parallel output); y = sum_r x_r W_r^T + b,
                          one all-reduce. Rank 0 alone adds the bias (and the residual of
                          :meth:`RowParallelLinear.add`), so that the sum counts it once.

Each layer is given the whole checkpoint weight and cuts its rank's part itself; the part is a
smaller :class:`~pagedkv.model.packed_linear.PackedLinear` (oneDNN-prepacked, fused epilogues, the
same three modes). With ``parallel`` None, or a group of one rank, nothing is cut, copied or
communicated: a column-parallel layer *is* a PackedLinear of the whole weight (a subclass that
adds nothing to its calls) and a row-parallel one calls its PackedLinear and returns its result.
A decoder written with these layers therefore runs unchanged on one rank and on N.
"""

from __future__ import annotations

import torch

from pagedkv.errors import ConfigError
from pagedkv.model.gguf_weight import GGUFWeight
from pagedkv.model.packed_linear import PackedLinear
from pagedkv.model.parallel import TensorParallelGroup, multi_rank
from pagedkv.model.quantization import QuantizedWeight


def _whole_only(quant, parallel: TensorParallelGroup | None) -> None:
    """Quantized weights (and GGUF weights kept as stored) run on one rank only (their
    groups are not cut for shards).

    Raises:
        ConfigError: a quantized weight given with a group of several ranks.
    """
    if quant is not None and parallel is not None:
        raise ConfigError("quantized weights run with tensor_parallel_size 1 only")


def _rank_slice(size: int, parallel: TensorParallelGroup, what: str) -> slice:
    """This rank's ``[start, stop)`` of ``size`` elements split evenly.

    Raises:
        ConfigError: ``size`` is not a multiple of the group's size (the message names both).
    """
    tp = parallel.world_size
    if size % tp:
        raise ConfigError(f"tensor_parallel_size {tp} does not divide {what} ({size})")
    per_rank = size // tp
    return slice(parallel.rank * per_rank, (parallel.rank + 1) * per_rank)


class ColumnParallelLinear(PackedLinear):
    """A linear layer whose output features are split over the ranks (no communication).

    Args:
        weight: ``[out_features, in_features]`` the whole layer's weight, in the compute dtype.
        bias: ``[out_features]`` or None.
        mode: a :data:`~pagedkv.model.packed_linear.LINEAR_MODES` entry.
        parallel: this rank's group; None (or one rank) = the whole layer, the same object as
            ``PackedLinear(weight, bias, mode, quant)``.
        quant: the weight quantized (one rank only), see :class:`PackedLinear`.

    Calls are :class:`PackedLinear`'s (``__call__``, ``silu``, ``gelu_tanh``, ``mul``, ``add``)
    and return this rank's ``out_features / tp`` output columns, ``[num_tokens, out_features /
    tp]`` in the compute dtype; an epilogue's ``other`` is the matching slice (the product of
    another column-parallel layer split the same way).

    Raises:
        ConfigError: ``out_features`` not divisible by the group's size, or an unknown mode.
    """

    __slots__ = ()

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        mode: str = "packed",
        parallel: TensorParallelGroup | None = None,
        quant: QuantizedWeight | None = None,
    ):
        parallel = multi_rank(parallel)
        _whole_only(quant, parallel)
        _whole_only(weight if isinstance(weight, GGUFWeight) else None, parallel)
        if parallel is not None:
            rows = _rank_slice(weight.shape[0], parallel, "the output features")
            # A copy, not a view: a view would keep the whole weight alive (mode "plain").
            weight = weight[rows].clone()
            bias = None if bias is None else bias[rows].clone()
        super().__init__(weight, bias, mode, quant)


class QKVParallelLinear(PackedLinear):
    """The fused q/k/v projection split by whole heads: this rank's query heads, then its KV
    heads' keys, then their values, in one GEMM.

    Args:
        q_weight: ``[num_heads * head_size, hidden]``; ``k_weight``, ``v_weight``:
            ``[num_kv_heads * head_size, hidden]`` (the whole layer's), in the compute dtype.
        head_size: elements per head.
        biases: ``(q_bias, k_bias, v_bias)`` matching the weights' rows (Qwen2), or None.
        mode: a :data:`~pagedkv.model.packed_linear.LINEAR_MODES` entry.
        parallel: this rank's group; None (or one rank) = every head.
        quants: ``(q, k, v)`` quantized weights (one rank only), or None.

    Output of a call: ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]``, this rank's
    counts (:attr:`num_heads`, :attr:`num_kv_heads`).

    Raises:
        ConfigError: query heads not divisible by the group's size, KV heads neither divisible
            by it nor dividing it (:meth:`TensorParallelGroup.kv_head_range`), or an unknown
            mode.
    """

    __slots__ = ("head_size", "num_heads", "num_kv_heads")

    def __init__(
        self,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        v_weight: torch.Tensor,
        head_size: int,
        biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        mode: str = "packed",
        parallel: TensorParallelGroup | None = None,
        quants: tuple[QuantizedWeight, QuantizedWeight, QuantizedWeight] | None = None,
    ):
        num_heads = q_weight.shape[0] // head_size
        num_kv_heads = k_weight.shape[0] // head_size
        parallel = multi_rank(parallel)
        _whole_only(quants, parallel)
        _whole_only(q_weight if isinstance(q_weight, GGUFWeight) else None, parallel)
        parts = [(q_weight, k_weight, v_weight)] + ([] if biases is None else [biases])
        if parallel is not None:
            heads = _rank_slice(num_heads, parallel, "the query heads")
            first_kv, last_kv = parallel.kv_head_range(num_kv_heads)
            q_rows = slice(heads.start * head_size, heads.stop * head_size)
            kv_rows = slice(first_kv * head_size, last_kv * head_size)
            parts = [(q[q_rows], k[kv_rows], v[kv_rows]) for q, k, v in parts]
            num_heads, num_kv_heads = heads.stop - heads.start, last_kv - first_kv
        # kept as stored: three products, no copy; dense: a copy that holds this rank's rows
        stored = isinstance(q_weight, GGUFWeight)
        weight = list(parts[0]) if stored else torch.cat(parts[0])
        bias = torch.cat(parts[1]) if biases is not None else None
        quant = None if quants is None else QuantizedWeight.cat(list(quants))
        super().__init__(weight, bias, mode, quant)
        #: this rank's query heads, KV heads, and elements per head.
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size


class RowParallelLinear:
    """A linear layer whose input features are split over the ranks; its output is summed over
    them (one all-reduce per call, none on one rank).

    Args:
        weight: ``[out_features, in_features]`` the whole layer's weight, in the compute dtype.
        bias: ``[out_features]`` or None; only rank 0 keeps it.
        mode: a :data:`~pagedkv.model.packed_linear.LINEAR_MODES` entry.
        parallel: this rank's group (its ``group`` set before the first call); None (or one
            rank) = the whole layer, no collective.
        quant: the weight quantized (one rank only), see :class:`PackedLinear`.

    Raises:
        ConfigError: ``in_features`` not divisible by the group's size, or an unknown mode.
    """

    __slots__ = ("linear", "parallel")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        mode: str = "packed",
        parallel: TensorParallelGroup | None = None,
        quant: QuantizedWeight | None = None,
    ):
        parallel = multi_rank(parallel)
        _whole_only(quant, parallel)
        _whole_only(weight if isinstance(weight, GGUFWeight) else None, parallel)
        if parallel is not None:
            cols = _rank_slice(weight.shape[1], parallel, "the input features")
            weight = weight[:, cols].contiguous()  # a column slice: contiguous() copies it
            if parallel.rank != 0:
                bias = None
        #: this rank's shard, ``[out_features, in_features / tp]``.
        self.linear = PackedLinear(weight, bias, mode, quant)
        #: the group the output is summed over; None on one rank.
        self.parallel = parallel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` summed over the ranks, ``[num_tokens, out_features]`` (the same on
        every rank), for this rank's input slice x ``[num_tokens, in_features / tp]``."""
        y = self.linear(x)
        return y if self.parallel is None else self.parallel.all_reduce(y)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``x W^T + b + residual`` summed over the ranks, the add fused into rank 0's GEMM;
        residual ``[num_tokens, out_features]`` (the same on every rank; the residual stream)."""
        parallel = self.parallel
        if parallel is None:
            return self.linear.add(x, residual)
        y = self.linear.add(x, residual) if parallel.rank == 0 else self.linear(x)
        return parallel.all_reduce(y)
