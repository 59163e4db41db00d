"""Tensor parallelism's plumbing: this rank's place, its collectives, and which sizes split.

Megatron-LM's split, as vLLM does it (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``)::

    column parallel   W [out, in] split on out:   y_r = x W_r^T          (no communication)
    row parallel      W [out, in] split on in:    y = sum_r x_r W_r^T    (one all-reduce)
    vocab parallel    embedding rows split:       h = sum_r masked lookup_r (one all-reduce)
                      LM head rows split:         logits = cat_r x E_r^T  (one gather to rank 0)

The layers that cut their weights and run these collectives are
:mod:`pagedkv.model.linear` (``ColumnParallelLinear``, ``QKVParallelLinear``,
``RowParallelLinear``) and :mod:`pagedkv.model.vocab_parallel_embedding`
(``VocabParallelEmbedding``, ``ParallelLMHead``); the decoders (Llama, Gemma 3) are built from
them and have one forward for one rank and for N. In a decoder layer q/k/v and gate/up are
column parallel (each rank owns whole heads and a slice of the intermediate size); o_proj and
down_proj are row parallel: two all-reduces per layer. When there are fewer KV heads than ranks,
each KV head is replicated on ``tp / num_kv_heads`` ranks (vLLM's ``QKVParallelLinear``), so
every rank's query heads find their KV head locally.

A model built with ``parallel=None`` (or a group of one rank) takes the single-process path: its
layers cut nothing and run no collective. :class:`TensorParallelGroup` wraps a
``torch.distributed`` process group (set up by the worker layer,
:mod:`pagedkv.worker.tp_executor`); :func:`check_tensor_parallel` needs no process group and runs
before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ShardSizes:
    """What one rank holds of a model split ``tensor_parallel_size`` ways.

    Attributes:
        num_heads: query heads per rank.
        num_kv_heads: KV heads per rank (1 when KV heads are replicated).
        intermediate_size: MLP intermediate size per rank.
        vocab_shard: embedding / LM-head rows per rank (the vocabulary padded up to a multiple
            of the ranks; the padding rows are zero and their logits dropped).
    """

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_shard: int


def check_tensor_parallel(config, tensor_parallel_size: int) -> ShardSizes:
    """Check that ``config`` (a :class:`~pagedkv.model.config.ModelConfig`) splits
    ``tensor_parallel_size`` ways and return each rank's share.

    Raises:
        ConfigError: a size below 1; query heads, KV heads (when tp <= num_kv_heads; otherwise
            tp must be a multiple of them) or the intermediate size not divisible by the size.
            The message names the numbers and the sizes that do split the model.
    """
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    inter = config.intermediate_size
    valid = [
        n
        for n in range(1, heads + 1)
        if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0) and inter % n == 0
    ]
    sizes = f"; sizes that split this model: {', '.join(map(str, valid))}"
    if heads % tp:
        raise ConfigError(
            f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads "
            f"(num_attention_heads){sizes}"
        )
    if tp <= kv_heads and kv_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size {tp} does not divide the model's {kv_heads} KV heads "
            f"(num_key_value_heads){sizes}"
        )
    if tp > kv_heads and tp % kv_heads:
        raise ConfigError(
            f"tensor_parallel_size {tp} is above the model's {kv_heads} KV heads "
            "(num_key_value_heads) but not a multiple of them: KV heads cannot be replicated "
            f"evenly{sizes}"
        )
    if inter % tp:
        raise ConfigError(
            f"tensor_parallel_size {tp} does not divide the model's intermediate_size "
            f"{inter}{sizes}"
        )
    return ShardSizes(
        num_heads=heads // tp,
        num_kv_heads=max(1, kv_heads // tp),
        intermediate_size=config.intermediate_size // tp,
        vocab_shard=-(-config.vocab_size // tp),
    )


def multi_rank(parallel: TensorParallelGroup | None) -> TensorParallelGroup | None:
    """``parallel`` when it spans more than one rank, else None: a group of one rank takes the
    single-process path (nothing cut, no collective)."""
    return parallel if parallel is not None and parallel.world_size > 1 else None


class TensorParallelGroup:
    """This process's rank in a tensor-parallel group and the collectives the model runs.

    Args:
        rank: this process's rank, 0 .. world_size - 1 (rank 0 samples).
        world_size: the tensor-parallel size.
        group: the ``torch.distributed`` ProcessGroup object of the compute collectives
            (``ProcessGroupGloo`` / ``ProcessGroupNCCL``; the worker layer creates it, and sets
            it after the model is built: building needs only the rank). Its own methods are
            called, not torch.distributed's default group, so that several engines (tests) can
            live in one process.
    """

    __slots__ = ("group", "rank", "world_size")

    def __init__(self, rank: int, world_size: int, group=None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        self.group.allreduce([x]).wait()
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` ``[rows, cols]`` along the last dimension on rank 0
        (``[rows, world_size x cols]``); None on the other ranks. Same shape on every rank.
        (An all-gather: gloo's gather is no cheaper on one host, and it keeps one code path.)"""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """The KV heads ``[first, last)`` this rank holds: a slice of them, or the one head its
        query heads share when KV heads are replicated (tp > num_kv_heads).

        Raises:
            ConfigError: ``num_kv_heads`` neither divisible by the group's size nor dividing it.
        """
        tp = self.world_size
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ConfigError(
                f"tensor_parallel_size {tp} neither divides the {num_kv_heads} KV heads nor is a "
                "multiple of them"
            )
        if self.world_size <= num_kv_heads:
            per_rank = num_kv_heads // self.world_size
            return self.rank * per_rank, (self.rank + 1) * per_rank
        head = self.rank // (self.world_size // num_kv_heads)
        return head, head + 1
