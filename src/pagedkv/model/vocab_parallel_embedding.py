"""The embedding table and the LM head split by vocabulary rows (vLLM's ``VocabParallelEmbedding``
and ``ParallelLMHead``, written for pagedkv), each running its own collective.

Over ``tp`` ranks each keeps ``shard_size = ceil(vocab_size / tp)`` consecutive rows, rank r the
rows from ``r * shard_size`` (the last rank's shard padded with zero rows)::

    VocabParallelEmbedding   h = sum_r lookup_r(ids)    a rank looks up the ids among its rows,
                                                        zeros for the others; one all-reduce
    ParallelLMHead           logits = cat_r h E_r^T     a rank computes its rows' logits; one
                                                        all-gather to rank 0, padding dropped

With ``parallel`` None (or one rank) neither cuts, copies nor communicates: the embedding is
``F.embedding`` on the whole table, the head one :class:`PackedLinear` over it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.errors import ConfigError
from pagedkv.model.gguf_weight import GGUFWeight
from pagedkv.model.packed_linear import PackedLinear
from pagedkv.model.parallel import TensorParallelGroup, multi_rank
from pagedkv.model.quantization import QuantizedWeight


def _vocab_rows(weight: torch.Tensor, parallel: TensorParallelGroup) -> torch.Tensor:
    """This rank's ``ceil(vocab_size / tp)`` rows of ``weight`` ``[vocab_size, hidden]``, zero
    rows past the vocabulary's end; a copy (a view would keep the whole table alive)."""
    shard_size = -(-weight.shape[0] // parallel.world_size)
    start = parallel.rank * shard_size
    part = weight[start : start + shard_size]
    pad = part.new_zeros((shard_size - part.shape[0], *part.shape[1:]))
    return torch.cat([part, pad])


class VocabParallelEmbedding:
    """Token embedding whose table is split by vocabulary rows.

    Args:
        weight: ``[vocab_size, hidden]`` the whole table, in the compute dtype; or a GGUF
            weight as the file stores it (one rank only: each lookup dequantizes its rows).
        parallel: this rank's group (its ``group`` set before the first call); None (or one
            rank) = the whole table, no collective.

    Raises:
        ConfigError: a GGUF weight with several ranks.
    """

    __slots__ = ("parallel", "shard_size", "vocab_size", "vocab_start", "weight")

    def __init__(
        self, weight: torch.Tensor | GGUFWeight, parallel: TensorParallelGroup | None = None
    ):
        parallel = multi_rank(parallel)
        if isinstance(weight, GGUFWeight) and parallel is not None:
            raise ConfigError("GGUF weights kept as stored run with tensor_parallel_size 1 only")
        #: rows of the whole vocabulary.
        self.vocab_size = weight.shape[0]
        if parallel is not None:
            weight = _vocab_rows(weight, parallel)
        #: this rank's rows ``[shard_size, hidden]`` (the whole table on one rank).
        self.weight = weight
        self.shard_size = weight.shape[0]
        #: the vocabulary id of this rank's first row.
        self.vocab_start = 0 if parallel is None else parallel.rank * self.shard_size
        self.parallel = parallel

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[num_tokens, hidden]`` (compute dtype, the same on every rank) of
        ``input_ids`` ``[num_tokens]`` int64 (ids in ``[0, vocab_size)``)."""
        if isinstance(self.weight, GGUFWeight):
            return self.weight.lookup(input_ids).to(self.weight.dtype)
        if self.parallel is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(h.masked_fill_(outside.unsqueeze(1), 0))


class ParallelLMHead:
    """The LM head ``logits = h E^T`` with E split by vocabulary rows (each rank computes its
    rows' logits; rank 0 gathers them).

    Args:
        weight: ``[vocab_size, hidden]`` the whole head (the embedding table when tied), in the
            compute dtype; or a GGUF weight as the file stores it (one rank only).
        mode: a :data:`~pagedkv.model.packed_linear.LINEAR_MODES` entry.
        parallel: this rank's group (its ``group`` set before the first call); None (or one
            rank) = the whole head, no collective.
        quant: the head quantized (one rank only; :class:`PackedLinear` runs it for a few
            rows).

    Raises:
        ConfigError: an unknown mode, or a quantized head with several ranks.
    """

    __slots__ = ("linear", "parallel", "vocab_size")

    def __init__(
        self,
        weight: torch.Tensor | GGUFWeight,
        mode: str,
        parallel: TensorParallelGroup | None = None,
        quant: QuantizedWeight | None = None,
    ):
        parallel = multi_rank(parallel)
        if (quant is not None or isinstance(weight, GGUFWeight)) and parallel is not None:
            raise ConfigError("quantized weights run with tensor_parallel_size 1 only")
        #: rows of the whole vocabulary (the gathered logits' width).
        self.vocab_size = weight.shape[0]
        if parallel is not None:
            weight = _vocab_rows(weight, parallel)
        #: this rank's rows, packed ``[ceil(vocab_size / tp), hidden]``.
        self.linear = PackedLinear(weight, None, mode, quant)
        self.parallel = parallel

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[num_rows, vocab_size]`` in the compute dtype of hidden states
        ``[num_rows, hidden]``; None on ranks other than 0. Every rank must call it with the
        same number of rows (the all-gather)."""
        if self.parallel is None:
            return self.linear(hidden_states)
        logits = self.parallel.gather_to_first(self.linear(hidden_states))
        return None if logits is None else logits[:, : self.vocab_size]
