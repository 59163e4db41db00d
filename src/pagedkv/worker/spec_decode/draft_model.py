"""The worker's draft model (speculative decoding with ``method: "draft_model"``).

A second, smaller model with the target's tokenizer drafts each decoding request's next tokens
greedily; the target verifies them in its next step like any other drafts. Its KV lives in the
same block pool: its layers follow the target's in the KV cache config (layer
``num_target_layers + i`` is its layer ``i``), so a layer with the target's spec shares the
target's block table (one block id holds a token's KV in both models) and the manager sizes,
shares, preempts and frees both models' blocks together. Per step (vLLM V1's draft-model
proposer, in our own code)::

    target step:   [ t  d1 d2 d3 ]      the scheduled tokens, positions p .. p+3
    draft forward: [ t  d1 d2 d3 ]      the same tokens through the draft model: its KV of every
                                        computed position (prompt chunks too)
    verification:  j = 1 accepted, x sampled at position p+2
    draft decode:  x -> y1 -> y2 -> y3  one token per request and decode step, the draft's
                                        KV written at p+2, p+3, p+4 (p+4: a lookahead slot the
                                        scheduler allocated), its argmax drafted
    next step:     [ x  y1 y2 y3 ]

The draft model's KV at rejected positions is written again by the next step's draft forward
(it covers the same positions), as the target's is. The draft decode writes only slots the
request holds: at most ``num_lookahead_tokens`` past its scheduled tokens, and never past
``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedkv.ops.backends import BoundAttentionMetadata
from pagedkv.worker.input_batch import InputBatch, ModelInputs
from pagedkv.worker.spec_decode.proposer import DraftRequests


class DraftModelProposer:
    """The :class:`~pagedkv.worker.spec_decode.proposer.DraftProposer` of a draft model: its
    forward over each step's tokens, then its greedy drafts.

    Args:
        model: the draft model (``forward``, ``compute_logits``), on the target's device.
        first_layer: index of its first layer in the runner's layers (the target's count).
        kv_caches: its layers' KV cache tensors (the runner's, from ``first_layer`` on).
        input_batch: the runner's persistent batch (block tables, positions).
        max_model_len: most tokens of a request: no draft KV is written past it.
    """

    __slots__ = ("first_layer", "input_batch", "kv_caches", "max_model_len", "model")

    def __init__(
        self,
        model,
        first_layer: int,
        kv_caches: Sequence[torch.Tensor],
        input_batch: InputBatch,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.first_layer = first_layer
        self.kv_caches = list(kv_caches)
        self.input_batch = input_batch
        self.max_model_len = max_model_len

    def forward(self, inputs: ModelInputs) -> None:
        """Run the draft model over the step's tokens (``inputs``: the target's), writing its KV
        of every scheduled position; its hidden states are not needed."""
        self.model.forward(
            inputs.input_ids,
            inputs.positions,
            self.kv_caches,
            inputs.attn_metadata[self.first_layer :],
        )

    def propose_drafts(self, requests: DraftRequests) -> list[list[int]]:
        """Greedy drafts of each request with lookahead slots (``requests.num_lookahead_tokens``
        > 0: the scheduler allocated KV slots for them), at most ``min(max_num_drafts,
        num_lookahead_tokens)`` each; [] for the others. Each request's newest token (the last
        of its ``token_ids``) is at position ``len(token_ids) - 1``."""
        num_drafts = np.minimum(requests.max_num_drafts, requests.num_lookahead_tokens)
        picks = np.flatnonzero(num_drafts > 0)
        drafts: list[list[int]] = [[] for _ in requests.req_ids]
        if not len(picks):
            return drafts
        token_ids = [requests.token_ids[i] for i in picks.tolist()]
        positions = np.array([len(t) - 1 for t in token_ids], dtype=np.int64)
        last_token_ids = np.array([t[-1] for t in token_ids], dtype=np.int64)
        picked = self.propose(
            requests.rows[picks],
            positions,
            self.input_batch.to_device(last_token_ids),
            num_drafts[picks],
        )
        for i, draft in zip(picks.tolist(), picked, strict=True):
            drafts[i] = draft
        return drafts

    def finished(self, req_id: str, prompt_len: int, token_ids: np.ndarray) -> None:
        """Nothing: the draft model keeps nothing per request (its KV is in the block pool)."""

    def propose(
        self,
        rows: np.ndarray,
        positions: np.ndarray,
        last_token_ids: torch.Tensor,
        num_drafts: np.ndarray,
    ) -> list[list[int]]:
        """Greedy drafts: request ``i`` (persistent-batch row ``rows[i]``) has its newest token
        ``last_token_ids[i]`` at ``positions[i]`` (its KV not yet in the draft's cache); each
        decode step feeds one token per request, writes the draft model's KV at its position
        and drafts its argmax, ``num_drafts[i]`` steps for request ``i``.

        Args:
            rows: ``[n]`` int64 persistent-batch rows.
            positions: ``[n]`` int64 positions of the newest tokens.
            last_token_ids: ``[n]`` int64 (on the model's device).
            num_drafts: ``[n]`` int64 drafts wanted (>= 0); cut so that no KV is written past
                the request's blocks or ``max_model_len``.

        Returns:
            Per request its draft token ids (``num_drafts[i]`` of them, or fewer where cut).
        """
        batch = self.input_batch
        bs = batch.block_size
        capacity = batch.num_blocks_per_row[:, rows].min(axis=0) * bs
        room = np.minimum(capacity, self.max_model_len) - positions
        num_drafts = np.clip(np.minimum(num_drafts, room), 0, None)
        num_steps = int(num_drafts.max(initial=0))
        drafts = np.zeros((len(rows), max(num_steps, 1)), dtype=np.int64)
        index = np.arange(len(rows))
        tokens = last_token_ids
        for step in range(num_steps):
            keep = num_drafts[index] > step
            if not keep.all():
                tokens = tokens[batch.to_device(np.flatnonzero(keep))]
                index = index[keep]
            step_positions = positions[index] + step
            metadata = batch.decode_metadata(rows[index], step_positions)
            tokens = self._decode(tokens, batch.to_device(step_positions), metadata)
            drafts[index, step] = tokens.cpu().numpy()
        return [drafts[i, :n].tolist() for i, n in enumerate(num_drafts.tolist())]

    def _decode(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: list[BoundAttentionMetadata],
    ) -> torch.Tensor:
        """One decode step of the draft model: ``[n]`` tokens in, their ``[n]`` argmax out."""
        hidden = self.model.forward(
            token_ids, positions, self.kv_caches, metadata[self.first_layer :]
        )
        return self.model.compute_logits(hidden).argmax(dim=-1)
