"""InputBatch: one scheduler step's flattened model inputs, built in buffers allocated once.

From the :class:`~pagedkv.worker.scheduler_output.SchedulerOutput` (requests in batch order, each
with ``num_computed_tokens`` c and ``num_scheduled_tokens`` n)::

    input_ids        [T]   the tokens all_token_ids[c : c + n] of each request, concatenated
    positions        [T]   c, c+1, ..., c+n-1 for each request
    query_start_loc  [R+1] 0, n_0, n_0+n_1, ...   (request i owns rows qsl[i] .. qsl[i+1]-1)
    seq_lens         [R]   c + n                  (tokens in the cache after this step)

and per KV cache group g (one for the Llama family; Gemma 3 has six)::

    block_tables[g]  [R, max_blocks] int32        (row i starts with request i's block ids in
                                                   group g, ``out.block_ids[i][g]``; a sliding-
                                                   window group holds the null block 0 where
                                                   blocks left the window; the tail of each row
                                                   is never read and holds stale ids of earlier
                                                   steps: the buffer is reused, not cleared)
    slot_mapping[g]  [T]   block_tables[g][i, pos // block_size] * block_size + pos % block_size

The group's tensors form one :class:`~pagedkv.ops.backends.CommonAttentionMetadata`; the
attention backend builds its metadata from it once per distinct (group, layer spec) pair (a spec
carries the layer's sliding window and scale), bound to the backend
(:class:`~pagedkv.ops.backends.BoundAttentionMetadata`); layers that share a group and a spec
share one object. ``ModelInputs.attn_metadata`` is the per-layer list.

All of it is built with numpy over whole arrays (no Python object per token), then viewed as torch
tensors without copies on CPU (copied to the model's device otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.ops.backends import (
    AttentionBackend,
    AttentionLayerSpec,
    BoundAttentionMetadata,
    CommonAttentionMetadata,
)
from pagedkv.worker.scheduler_output import SchedulerOutput


@dataclass(slots=True)
class ModelInputs:
    """One step's inputs to ``model.forward`` and where to compute logits.

    Attributes:
        input_ids: ``[num_tokens]`` int64.
        positions: ``[num_tokens]`` int64.
        attn_metadata: per layer, the backend's metadata of its KV cache group and spec, bound
            to the backend (layers of one group and spec share one object).
        logits_rows: ``[num_sampled]`` int numpy array: the rows of the sampling requests' last
            scheduled tokens, in batch order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[BoundAttentionMetadata]
    logits_rows: np.ndarray


class InputBatch:
    """Builds :class:`ModelInputs` from scheduler outputs, reusing its buffers every step.

    Args:
        block_size: tokens per KV block.
        num_blocks: KV blocks in the pool (bounds the block ids, for the ops' bookkeeping).
        max_num_seqs: most requests per step (rows of the block-table buffer).
        max_num_batched_tokens: most tokens per step.
        max_model_len: most tokens per request (columns of the block-table buffer).
        device: where the model runs; tensors are torch views of the buffers on CPU.
        backend: the attention backend that builds the metadata.
        attention_groups: the distinct (KV cache group index, layer spec) pairs the layers
            read, one metadata built per pair each step (the Llama family: one pair); every KV
            cache group appears in one at least.
        layer_attention_groups: per layer, its index into ``attention_groups``.
    """

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        device: torch.device,
        backend: AttentionBackend,
        attention_groups: Sequence[tuple[int, AttentionLayerSpec]],
        layer_attention_groups: Sequence[int],
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.backend = backend
        num_kv_cache_groups = 1 + max(g for g, _ in attention_groups)
        self.num_kv_cache_groups = num_kv_cache_groups
        self.attention_groups = tuple(attention_groups)
        self.layer_attention_groups = tuple(layer_attention_groups)
        max_blocks = -(-max_model_len // block_size)
        # Buffers reused by every step (numpy views shared with torch tensors).
        self._block_tables = np.zeros(
            (num_kv_cache_groups, max_num_seqs, max_blocks), dtype=np.int32
        )
        self._input_ids = np.zeros(max_num_batched_tokens, dtype=np.int64)
        self._arange = np.arange(max(max_num_batched_tokens, max_num_seqs) + 1, dtype=np.int64)
        self._query_start_loc = np.zeros(max_num_seqs + 1, dtype=np.int32)

    def prepare(self, out: SchedulerOutput) -> ModelInputs:
        """Build the step's flattened inputs (see the module docstring)."""
        num_reqs = out.num_reqs
        bs = self.block_size
        num_scheduled = np.asarray(out.num_scheduled_tokens, dtype=np.int64)
        num_computed = np.asarray(out.num_computed_tokens, dtype=np.int64)
        qsl = self._query_start_loc[: num_reqs + 1]
        np.cumsum(num_scheduled, out=qsl[1:])
        num_tokens = int(qsl[-1])

        # Token ids: decode-only steps (the common case) take one id per request.
        input_ids = self._input_ids[:num_tokens]
        requests = out.requests
        if num_tokens == num_reqs:
            computed = out.num_computed_tokens
            input_ids[:] = [r.all_token_ids[c] for r, c in zip(requests, computed, strict=True)]
        else:
            starts = qsl.tolist()
            for i, request in enumerate(requests):
                c = out.num_computed_tokens[i]
                n = out.num_scheduled_tokens[i]
                input_ids[starts[i] : starts[i] + n] = request.all_token_ids[c : c + n]

        # Positions, vectorised over all tokens; the block index and offset of each token.
        req_index = np.repeat(self._arange[:num_reqs], num_scheduled)
        positions = self._arange[:num_tokens] - np.repeat(qsl[:-1] - num_computed, num_scheduled)
        block_index = positions // bs
        offsets = positions % bs
        seq_lens = (num_computed + num_scheduled).astype(np.int32)

        to = self.to_device
        seq_lens_t, qsl_t = to(seq_lens), to(qsl)
        host = self.device.type != "cpu"  # host copies save the backend a device sync
        seq_lens_cpu = torch.from_numpy(seq_lens) if host else None
        qsl_cpu = torch.from_numpy(qsl) if host else None
        commons = []  # per KV cache group
        for g in range(self.num_kv_cache_groups):
            # Block tables: copy each row's block ids of group g.
            block_ids = [ids[g] for ids in out.block_ids]
            max_num_blocks = max(map(len, block_ids))
            block_tables = self._block_tables[g, :num_reqs, :max_num_blocks]
            for i, row in enumerate(block_ids):
                block_tables[i, : len(row)] = row
            slot_mapping = block_tables[req_index, block_index].astype(np.int64)
            slot_mapping *= bs
            slot_mapping += offsets
            commons.append(
                CommonAttentionMetadata(
                    to(block_tables),
                    seq_lens_t,
                    qsl_t,
                    to(slot_mapping),
                    num_blocks=self.num_blocks,
                    seq_lens_cpu=seq_lens_cpu,
                    query_start_loc_cpu=qsl_cpu,
                )
            )

        backend = self.backend
        metadata = [
            BoundAttentionMetadata(
                backend, backend.build_metadata(commons[g], spec, validate=False), spec
            )
            for g, spec in self.attention_groups
        ]
        if len(metadata) == 1:
            layer_metadata = metadata * len(self.layer_attention_groups)
        else:
            layer_metadata = [metadata[k] for k in self.layer_attention_groups]
        logits_rows = qsl[1:][np.asarray(out.sample, dtype=bool)] - 1
        return ModelInputs(to(input_ids), to(positions), layer_metadata, logits_rows)

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A torch view of ``array`` (CPU), or a copy on the model's device."""
        tensor = torch.from_numpy(array)
        if self.device.type != "cpu":
            tensor = tensor.to(self.device, non_blocking=True)
        return tensor
