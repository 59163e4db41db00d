"""InputBatch: the worker's persistent per-request rows, and one step's flattened model inputs.

The worker keeps its own copy of every unfinished request it has been sent
(:class:`CachedRequestState`: token ids, block ids per KV cache group, sampling params), built from
the plain data of :class:`~pagedkv.worker.scheduler_output.SchedulerOutput` (vLLM V1's
``InputBatch`` and ``CachedRequestState``, in our own code). The requests scheduled in a step
occupy rows ``0 .. num_reqs-1`` of buffers allocated once::

    token_ids_cpu    [max_num_seqs, max_model_len] int32   row i: request i's token ids
    num_tokens       [max_num_seqs] int64                  prompt + output tokens known
    num_computed     [max_num_seqs] int64                  KV in the cache before the step
    block_tables[g]  [max_num_seqs, max_blocks] int32      row i: its block ids in group g
                                                           (``num_blocks[g, i]`` of them)

A step (:meth:`InputBatch.update`) removes the rows of finished, preempted and unscheduled
requests, appends each scheduled request's new token ids and block ids to its row in place, adds
rows for new and returning requests, and moves the last rows into the holes; a decode step's
Python work is O(batch), independent of context length. A request that leaves the batch
without finishing (preempted, or not scheduled this step) keeps its state and gets its row back
when it is scheduled again; after a preemption its block table is replaced, not appended to.

From the rows and ``num_scheduled_tokens`` (n per request, c = num_computed)
:meth:`InputBatch.prepare` builds::

    input_ids        [T]   token_ids_cpu[i, c : c + n] of each request, concatenated
    positions        [T]   c, c+1, ..., c+n-1 for each request
    query_start_loc  [R+1] 0, n_0, n_0+n_1, ...   (request i owns rows qsl[i] .. qsl[i+1]-1)
    seq_lens         [R]   c + n                  (tokens in the cache after this step)
    slot_mapping[g]  [T]   block_tables[g][i, pos // block_size] * block_size + pos % block_size

A sliding-window group's row keeps the ids of blocks that have left the window (the scheduler
sends only new blocks, as vLLM V1 does); the attention never reads them (they are before the
window), so freeing and reusing them changes nothing here.

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
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedkv.errors import InvalidRequestError
from pagedkv.ops.backends import (
    AttentionBackend,
    AttentionLayerSpec,
    BoundAttentionMetadata,
    CommonAttentionMetadata,
)
from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.scheduler_output import BlockIds, SchedulerOutput


@dataclass(slots=True)
class CachedRequestState:
    """What a worker holds of one unfinished request (built from the scheduler's plain data).

    Attributes:
        req_id: the request's id.
        prompt_token_ids: ``[num_prompt_tokens]`` token ids.
        output_token_ids: the tokens sampled so far, as the scheduler sent them.
        sampling_params: its sampling options.
        eos_token_ids: the model's end-of-sequence ids (masked until ``min_tokens``).
        block_ids: its block ids, one list per KV cache group.
        num_computed_tokens: tokens whose KV is in the cache before the current step.
        generator: its own sampling generator (a seeded, non-greedy request), made on first
            use.
        pooling_params: a pooling request's parameters (it samples nothing), else None.
        pooled_sum: mean pooling: the float32 ``[hidden_size]`` sum of the states of its
            first ``pooled_count`` prompt positions (accumulated over prefill chunks).
        pooled_first: cls pooling: the first position's float32 ``[hidden_size]`` state.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: BlockIds
    num_computed_tokens: int
    generator: torch.Generator | None = field(default=None, repr=False)
    pooling_params: PoolingParams | None = None
    pooled_sum: torch.Tensor | None = field(default=None, repr=False)
    pooled_count: int = 0
    pooled_first: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass(slots=True)
class ModelInputs:
    """One step's inputs to ``model.forward`` and where to compute logits.

    Attributes:
        input_ids: ``[num_tokens]`` int64.
        positions: ``[num_tokens]`` int64.
        attn_metadata: per layer, the backend's metadata of its KV cache group and spec, bound
            to the backend (layers of one group and spec share one object).
        num_scheduled_tokens: ``[num_reqs]`` int64 numpy array, per row.
        query_start_loc: ``[num_reqs + 1]`` int32 numpy array.
        sample: ``[num_reqs]`` bool numpy array: the rows whose request samples a token after
            this step (the step completes its prompt and every earlier token; never a pooling
            request).
        logits_rows: ``[num_sampled + num_drafts]`` int numpy array: the rows of the sampling
            requests' last scheduled tokens, in batch order; a request with ``k`` draft tokens
            has its last ``k + 1`` rows there (the draft positions, then the bonus position).
        num_draft_tokens: ``[num_reqs]`` int64 numpy array, draft tokens per row, or None when
            the step has none (speculative decoding off, or nothing drafted).
        pooling: ``[num_reqs]`` bool numpy array, the rows of pooling requests, or None when
            the step has none.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[BoundAttentionMetadata]
    num_scheduled_tokens: np.ndarray
    query_start_loc: np.ndarray
    sample: np.ndarray
    logits_rows: np.ndarray
    num_draft_tokens: np.ndarray | None = None
    pooling: np.ndarray | None = None


class InputBatch:
    """The persistent rows of the requests a worker runs, and the step inputs built from them.

    Args:
        block_size: tokens per KV block.
        num_blocks: KV blocks in the pool (bounds the block ids, for the ops' bookkeeping).
        max_num_seqs: most requests per step (rows).
        max_num_batched_tokens: most tokens per step.
        max_model_len: most tokens per request (columns of the token rows; block-table columns
            are ``ceil(max_model_len / block_size)``).
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
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.device = device
        self.backend = backend
        num_kv_cache_groups = 1 + max(g for g, _ in attention_groups)
        self.num_kv_cache_groups = num_kv_cache_groups
        self.attention_groups = tuple(attention_groups)
        self.layer_attention_groups = tuple(layer_attention_groups)
        self.max_num_blocks_per_req = -(-max_model_len // block_size)

        #: every unfinished request this worker was sent, in the batch or not.
        self.requests: dict[str, CachedRequestState] = {}
        #: the request in each row (rows ``0 .. num_reqs-1`` are filled after :meth:`update`).
        self.req_ids: list[str | None] = [None] * max_num_seqs
        self.req_id_to_index: dict[str, int] = {}
        self.num_reqs = 0
        # Persistent rows (numpy buffers viewed by torch on CPU).
        self.token_ids_cpu = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        #: rows of pooling requests (they sample nothing).
        self.is_pooling = np.zeros(max_num_seqs, dtype=bool)
        #: pooling requests this worker holds (0: a step skips the pooling rows' work).
        self.num_pooling_requests = 0
        self.block_tables = np.zeros(
            (num_kv_cache_groups, max_num_seqs, self.max_num_blocks_per_req), dtype=np.int32
        )
        self.num_blocks_per_row = np.zeros((num_kv_cache_groups, max_num_seqs), dtype=np.int64)
        # Per-step scratch buffers.
        self._input_ids = np.zeros(max_num_batched_tokens, dtype=np.int64)
        self._arange = np.arange(max(max_num_batched_tokens, max_num_seqs) + 1, dtype=np.int64)
        self._query_start_loc = np.zeros(max_num_seqs + 1, dtype=np.int32)

    # ------------------------------------------------------------------ state updates

    def update(self, out: SchedulerOutput) -> None:
        """Apply one step's changes: drop finished requests, take unscheduled ones out of the
        batch, update and add the scheduled ones, and pack them into rows ``0 .. R-1``.

        Raises:
            InvalidRequestError: a cached request this worker does not hold, a request with
                more tokens than max_model_len or more blocks than its row, or more requests
                than max_num_seqs.
        """
        requests = self.requests
        for req_id in out.finished_req_ids:
            self._remove_row(req_id)
            self._forget(requests.pop(req_id, None))
        scheduled = out.num_scheduled_tokens
        for req_id in self.req_ids[: self.num_reqs]:
            if req_id is not None and req_id not in scheduled:
                self._remove_row(req_id)  # preempted or not scheduled: state kept
        for new in out.scheduled_new_reqs:
            state = CachedRequestState(
                new.req_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                new.sampling_params,
                tuple(new.eos_token_ids),
                tuple(list(ids) for ids in new.block_ids),
                new.num_computed_tokens,
                pooling_params=new.pooling_params,
            )
            self._remove_row(new.req_id)  # a re-sent id (after a failed step): start afresh
            self._forget(requests.get(new.req_id))
            requests[new.req_id] = state
            self.num_pooling_requests += state.pooling_params is not None
            self._add_row(state)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = requests.get(req_id)
            if state is None:
                raise InvalidRequestError(f"the worker holds no request {req_id!r}")
            new_token_ids = cached.new_token_ids[i]
            new_block_ids = cached.new_block_ids[i]
            resumed = cached.resumed_from_preemption[i]
            index = self.req_id_to_index.get(req_id)
            if new_token_ids:
                start = state.num_tokens
                end = start + len(new_token_ids)
                if end > self.max_model_len:
                    raise InvalidRequestError(
                        f"request {req_id!r} would hold {end} tokens, more than max_model_len="
                        f"{self.max_model_len}"
                    )
                state.output_token_ids.extend(new_token_ids)
                if index is not None:
                    self.token_ids_cpu[index, start:end] = new_token_ids
                    self.num_tokens[index] = end
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if resumed:
                state.block_ids = tuple(list(ids) for ids in new_block_ids)
                if index is not None:
                    self._write_block_ids(index, state.block_ids)
            elif new_block_ids is not None:
                for g, ids in enumerate(new_block_ids):
                    if not ids:
                        continue
                    row_blocks = state.block_ids[g]
                    start = len(row_blocks)
                    row_blocks.extend(ids)
                    if index is not None:
                        self._check_num_blocks(req_id, len(row_blocks))
                        self.block_tables[g, index, start : len(row_blocks)] = ids
                        self.num_blocks_per_row[g, index] = len(row_blocks)
            if index is None:
                self._add_row(state)
            else:
                self.num_computed_tokens[index] = state.num_computed_tokens
        self._condense()

    def _forget(self, state: CachedRequestState | None) -> None:
        """Count a dropped request out of the pooling requests held."""
        if state is not None and state.pooling_params is not None:
            self.num_pooling_requests -= 1

    def _add_row(self, state: CachedRequestState) -> None:
        """Give ``state`` a row (the first hole, else the next free row) and copy it in."""
        if len(self.req_id_to_index) >= self.max_num_seqs:
            raise InvalidRequestError(f"more than max_num_seqs={self.max_num_seqs} requests")
        num_tokens = state.num_tokens
        if num_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"request {state.req_id!r} has {num_tokens} tokens, more than max_model_len="
                f"{self.max_model_len}"
            )
        if len(self.req_id_to_index) < self.num_reqs:  # the first hole
            index = self.req_ids.index(None)
        else:
            index = self.num_reqs
            self.num_reqs += 1
        num_prompt = len(state.prompt_token_ids)
        row = self.token_ids_cpu[index]
        row[:num_prompt] = state.prompt_token_ids
        row[num_prompt:num_tokens] = state.output_token_ids
        self.num_tokens[index] = num_tokens
        self.num_computed_tokens[index] = state.num_computed_tokens
        self.is_pooling[index] = state.pooling_params is not None
        self._write_block_ids(index, state.block_ids)
        self.req_ids[index] = state.req_id
        self.req_id_to_index[state.req_id] = index

    def _write_block_ids(self, index: int, block_ids: BlockIds) -> None:
        for g, ids in enumerate(block_ids):
            self._check_num_blocks(self.req_ids[index] or "?", len(ids))
            self.block_tables[g, index, : len(ids)] = ids
            self.num_blocks_per_row[g, index] = len(ids)

    def _check_num_blocks(self, req_id: str, num_blocks: int) -> None:
        if num_blocks > self.max_num_blocks_per_req:
            raise InvalidRequestError(
                f"request {req_id!r} would hold {num_blocks} blocks, more than a row's "
                f"{self.max_num_blocks_per_req} (max_model_len / block_size)"
            )

    def _remove_row(self, req_id: str) -> None:
        """Free ``req_id``'s row (a hole until :meth:`_condense`); no-op if it has none."""
        index = self.req_id_to_index.pop(req_id, None)
        if index is not None:
            self.req_ids[index] = None

    def _condense(self) -> None:
        """Move the last filled rows into the holes so rows ``0 .. R-1`` are the batch."""
        req_ids = self.req_ids
        num_reqs = len(self.req_id_to_index)
        last = self.num_reqs - 1
        for hole in range(num_reqs):
            if req_ids[hole] is not None:
                continue
            while req_ids[last] is None:
                last -= 1
            self._move_row(last, hole)
            last -= 1
        self.num_reqs = num_reqs

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        num_tokens = int(self.num_tokens[src])
        self.token_ids_cpu[dst, :num_tokens] = self.token_ids_cpu[src, :num_tokens]
        self.num_tokens[dst] = num_tokens
        self.num_computed_tokens[dst] = self.num_computed_tokens[src]
        self.is_pooling[dst] = self.is_pooling[src]
        for g in range(self.num_kv_cache_groups):
            n = int(self.num_blocks_per_row[g, src])
            self.block_tables[g, dst, :n] = self.block_tables[g, src, :n]
            self.num_blocks_per_row[g, dst] = n
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = dst

    # ------------------------------------------------------------------ the step's inputs

    def prepare(self, out: SchedulerOutput) -> ModelInputs:
        """Build the step's flattened inputs from rows ``0 .. R-1`` (after :meth:`update`)."""
        num_reqs = self.num_reqs
        scheduled = out.num_scheduled_tokens
        num_scheduled = np.fromiter(
            (scheduled[r] for r in self.req_ids[:num_reqs]), dtype=np.int64, count=num_reqs
        )
        num_computed = self.num_computed_tokens[:num_reqs]
        num_draft_tokens = None
        if out.scheduled_spec_decode_tokens:
            num_draft_tokens = self._write_drafts(out, num_scheduled)
        qsl = self._query_start_loc[: num_reqs + 1]
        np.cumsum(num_scheduled, out=qsl[1:])
        num_tokens = int(qsl[-1])

        # Positions, vectorised over all tokens; token ids gathered from the rows.
        req_index = np.repeat(self._arange[:num_reqs], num_scheduled)
        positions = self._arange[:num_tokens] - np.repeat(qsl[:-1] - num_computed, num_scheduled)
        input_ids = self._input_ids[:num_tokens]
        input_ids[:] = self.token_ids_cpu.reshape(-1)[req_index * self.max_model_len + positions]
        seq_lens = (num_computed + num_scheduled).astype(np.int32)

        attn_rows, attn_seq_lens, attn_qsl = None, seq_lens, qsl
        if num_draft_tokens is not None:
            attn_rows, attn_seq_lens, attn_qsl = _one_query_per_draft(
                num_scheduled, num_draft_tokens, positions
            )
        layer_metadata = self._layer_metadata(
            num_reqs, req_index, positions, attn_rows, attn_seq_lens, attn_qsl
        )
        sample = seq_lens >= self.num_tokens[:num_reqs]
        pooling = None
        if self.num_pooling_requests:  # a pooling request samples nothing
            pooling = self.is_pooling[:num_reqs].copy()
            if pooling.any():
                sample &= ~pooling
            else:
                pooling = None
        if num_draft_tokens is None:
            logits_rows = qsl[1:][sample] - 1
        else:  # a request with k drafts: its last k + 1 rows (each draft's, then the bonus)
            num_rows = np.where(sample, num_draft_tokens + 1, 0)
            first_row = np.cumsum(num_rows) - num_rows
            logits_rows = (
                np.repeat(qsl[1:] - num_rows - first_row, num_rows)
                + self._arange[: int(num_rows.sum())]
            )
        to = self.to_device
        return ModelInputs(
            to(input_ids),
            to(positions),
            layer_metadata,
            num_scheduled,
            qsl,
            sample,
            logits_rows,
            num_draft_tokens,
            pooling,
        )

    def decode_metadata(
        self, rows: np.ndarray, positions: np.ndarray
    ) -> list[BoundAttentionMetadata]:
        """Per layer, the attention metadata of a step of one token per request, outside
        :meth:`prepare` (the draft model's decode steps, speculative decoding): row ``rows[i]``'s
        token sits at ``positions[i]`` (its KV is written to that slot of the row's block
        table, and it attends to positions ``0 .. positions[i]``).

        Args:
            rows: ``[n]`` int64 rows of the persistent batch (each once).
            positions: ``[n]`` int64, each inside its row's blocks (the caller's check).
        """
        n = len(rows)
        qsl = self._arange[: n + 1].astype(np.int32)
        seq_lens = (positions + 1).astype(np.int32)
        return self._layer_metadata(self.num_reqs, rows, positions, rows, seq_lens, qsl)

    def _layer_metadata(
        self,
        num_reqs: int,
        token_rows: np.ndarray,
        positions: np.ndarray,
        seq_rows: np.ndarray | None,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
    ) -> list[BoundAttentionMetadata]:
        """Per layer, the bound metadata of its (group, spec): token ``t`` is row
        ``token_rows[t]``'s at ``positions[t]`` (its slot); attention sequence ``s`` reads row
        ``seq_rows[s]``'s block table (None: sequence ``s`` is row ``s``, rows
        ``0 .. num_reqs-1``) up to ``seq_lens[s]`` tokens, its queries at ``query_start_loc``."""
        bs = self.block_size
        block_index = positions // bs
        offsets = positions % bs
        to = self.to_device
        seq_lens_t, qsl_t = to(seq_lens), to(query_start_loc)
        host = self.device.type != "cpu"  # host copies save the backend a device sync
        seq_lens_cpu = torch.from_numpy(seq_lens) if host else None
        qsl_cpu = torch.from_numpy(query_start_loc) if host else None
        commons = []  # per KV cache group
        for g in range(self.num_kv_cache_groups):
            max_num_blocks = int(self.num_blocks_per_row[g, :num_reqs].max())
            block_tables = self.block_tables[g, :num_reqs, :max_num_blocks]
            slot_mapping = block_tables[token_rows, block_index].astype(np.int64)
            slot_mapping *= bs
            slot_mapping += offsets
            if seq_rows is not None:
                block_tables = block_tables[seq_rows]
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
            return metadata * len(self.layer_attention_groups)
        return [metadata[k] for k in self.layer_attention_groups]

    def _write_drafts(self, out: SchedulerOutput, num_scheduled: np.ndarray) -> np.ndarray:
        """Write each request's draft tokens (``out.scheduled_spec_decode_tokens``) into its row
        after its verified tokens, without counting them in ``num_tokens`` (the next step's new
        token ids overwrite them). Returns ``[num_reqs]`` drafts per row.

        Raises:
            InvalidRequestError: drafts for a request not in the step, or whose scheduled tokens
                are not its unverified tokens plus exactly its drafts.
        """
        num_reqs = self.num_reqs
        num_draft_tokens = np.zeros(num_reqs, dtype=np.int64)
        for req_id, draft_token_ids in out.scheduled_spec_decode_tokens.items():
            index = self.req_id_to_index.get(req_id)
            k = len(draft_token_ids)
            if index is None or index >= num_reqs:
                raise InvalidRequestError(f"draft tokens for {req_id!r}, not scheduled this step")
            start = int(self.num_tokens[index])
            if self.num_computed_tokens[index] + num_scheduled[index] != start + k:
                raise InvalidRequestError(
                    f"request {req_id!r}: {num_scheduled[index]} scheduled tokens do not cover "
                    f"its unverified tokens and exactly its {k} drafts"
                )
            self.token_ids_cpu[index, start : start + k] = draft_token_ids
            num_draft_tokens[index] = k
        return num_draft_tokens

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A torch view of ``array`` (CPU), or a copy on the model's device."""
        tensor = torch.from_numpy(array)
        if self.device.type != "cpu":
            tensor = tensor.to(self.device, non_blocking=True)
        return tensor


def _one_query_per_draft(
    num_scheduled: np.ndarray, num_draft_tokens: np.ndarray, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The attention's view of a step with draft tokens: each token of a request with drafts
    (its last verified token and its drafts) is a sequence of its own, one query token long,
    reading the request's blocks up to its position; other requests are as they are. Every
    position of a verification is then attended by the backends' one-query (decode) path, as it
    would be one token at a time without speculation, so the drafts are verified with the same
    numbers as plain decoding (a multi-token query takes the prefill path, whose sums run in
    another order: greedy ties can break the other way). The tokens keep their order, so
    ``slot_mapping`` and the model's rows do not change.

    Returns:
        ``(rows, seq_lens, query_start_loc)``: per attention sequence its request's row
        (``[num_seqs]`` int64, for the block tables), its tokens in the cache after the step
        (``[num_seqs]`` int32) and the query offsets (``[num_seqs + 1]`` int32).
    """
    drafted = num_draft_tokens > 0
    num_seqs_per_row = np.where(drafted, num_scheduled, 1)
    rows = np.repeat(np.arange(len(num_scheduled)), num_seqs_per_row)
    query_lens = np.repeat(np.where(drafted, 1, num_scheduled), num_seqs_per_row)
    query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_lens = (positions[query_start_loc[1:] - 1] + 1).astype(np.int32)
    return rows, seq_lens, query_start_loc
