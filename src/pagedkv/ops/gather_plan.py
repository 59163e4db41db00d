"""The fast path's gather plan: what each layer copies out of the paged cache, in what chunks.

Decode requests (sorted by blocks read, most first) are gathered in chunks of about
``decode_chunk_bytes`` of K+V, so that the gathered data stays in the CPU cache between the
gather, the transpose to KV-head-major layout and the two matmuls; each chunk pads only to its own
longest request. A request bigger than the budget on its own is read in parts along its context
(split-K, as in flash-decoding, but in two passes: K parts for the scores, then V parts).
Whole blocks are gathered (one ``index_select`` row = one block, a contiguous
``block_size x num_kv_heads x head_size`` run): on this CPU that ran at memcpy speed, 1.5-2x
faster than gathering one row per token and head (docs/ops.md).

Prefill requests gather *rows*, one per token and KV head::

    kv_cache[i].view(-1, head_size)[row],   row = slot * num_kv_heads + kv_head

which lands exactly their attended keys ``[num_kv_heads, kv_len, head_size]``, contiguous, ready
for SDPA (prefill is compute-bound; the gather is a small part of it).

The plan depends on the cache's head layout, so it is built on a step's first layer and cached in
the metadata for the other layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.ops.attention_metadata import PagedAttentionMetadata


@dataclass(slots=True)
class DecodeChunk:
    """Decode requests ``[start, end)`` of the sorted decode group, attended together."""

    token_ids: torch.Tensor  # [num_reqs] int64 query rows
    num_reqs: int
    num_blocks: int  # blocks read per request (padded to the chunk's longest)
    block_ids: torch.Tensor  # [num_reqs * num_blocks] int64
    key_mask: torch.Tensor | None  # [num_reqs, 1, 1, num_blocks * block_size] bool, True = masked
    # Rows of the KV-head-major V ([num_reqs * num_kv_heads * kv_len, head_size]) outside the
    # requests' keys, to zero after the gather (int64; None = none). Only the last block's tail,
    # a sliding window's first block head and padding blocks: a few rows per request.
    value_zero_rows: torch.Tensor | None
    # A request alone bigger than the chunk budget is read in parts of part_blocks blocks: all K
    # parts (scores), softmax over the whole row, then all V parts. None = one part.
    part_blocks: int | None = None
    # With parts: per V part, its rows to zero ([num_kv_heads * part_len, head_size]) or None.
    part_value_zero_rows: list[torch.Tensor | None] | None = None


@dataclass(slots=True)
class GatherPlan:
    """Everything one layer needs to read K/V for a step, for one cache head layout."""

    decode_chunks: list[DecodeChunk]
    prefill_rows: list[torch.Tensor]  # per prefill request: [num_kv_heads * kv_len] int64
    max_decode_blocks: int  # blocks of the largest decode chunk
    max_prefill_rows: int
    buffers: dict = field(default_factory=dict)  # (dtype, shape) -> reused tensor

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A reused scratch tensor (allocated on first use, shared by the step's layers)."""
        key = (name, shape, dtype)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.empty(shape, dtype=dtype)
        return buf


def get_gather_plan(
    metadata: PagedAttentionMetadata, num_kv_heads: int, bytes_per_token: int
) -> GatherPlan:
    """The metadata's gather plan for a cache layout, built on first use and then reused.

    Args:
        metadata: the step's metadata.
        num_kv_heads: KV heads of the cache.
        bytes_per_token: gathered K+V bytes per token (2 x num_kv_heads x head_size x itemsize).
    """
    key = (num_kv_heads, bytes_per_token)
    plan = metadata.gather_plans.get(key)
    if plan is None:
        plan = _build(metadata, num_kv_heads, bytes_per_token)
        metadata.gather_plans[key] = plan
    return plan


def _build(md: PagedAttentionMetadata, num_kv_heads: int, bytes_per_token: int) -> GatherPlan:
    chunks = []
    max_decode_blocks = 0
    counts = md.decode_num_blocks
    bs = md.block_size
    start = 0
    while start < len(counts):
        num_blocks = counts[start]  # sorted descending: the chunk's longest
        n = max(1, md.decode_chunk_bytes // (num_blocks * bs * bytes_per_token))
        end = min(len(counts), start + n)
        part_blocks = max(1, md.decode_chunk_bytes // (bs * bytes_per_token))
        if part_blocks >= num_blocks:
            part_blocks = None
        kv_len = num_blocks * bs
        valid = md.decode_valid[start:end, :kv_len]
        key_mask = zero_rows = part_zero_rows = None
        if not bool(valid.all()):
            key_mask = ~valid[:, None, None, :]
            req, pos = (~valid).nonzero(as_tuple=True)
            heads = torch.arange(num_kv_heads)
            if part_blocks is None:
                zero_rows = _value_rows(req, pos, heads, kv_len)
            else:  # one request (alone over budget): rows per part of part_len tokens
                part_zero_rows = []
                for t0 in range(0, kv_len, part_blocks * bs):
                    part_len = min(part_blocks * bs, kv_len - t0)
                    in_part = (pos >= t0) & (pos < t0 + part_len)
                    rows = _value_rows(req[in_part], pos[in_part] - t0, heads, part_len)
                    part_zero_rows.append(rows if rows.numel() else None)
        chunks.append(
            DecodeChunk(
                token_ids=md.decode_token_ids[start:end],
                num_reqs=end - start,
                num_blocks=num_blocks,
                block_ids=md.decode_block_ids[start:end, :num_blocks].reshape(-1),
                key_mask=key_mask,
                value_zero_rows=zero_rows,
                part_blocks=part_blocks,
                part_value_zero_rows=part_zero_rows,
            )
        )
        max_decode_blocks = max(max_decode_blocks, part_blocks or (end - start) * num_blocks)
        start = end
    heads = torch.arange(num_kv_heads).view(num_kv_heads, 1)
    prefill_rows = [(p.kv_slots[None, :] * num_kv_heads + heads).reshape(-1) for p in md.prefills]
    return GatherPlan(
        decode_chunks=chunks,
        prefill_rows=prefill_rows,
        max_decode_blocks=max_decode_blocks,
        max_prefill_rows=max([0] + [r.numel() for r in prefill_rows]),
    )


def _value_rows(
    req: torch.Tensor, pos: torch.Tensor, heads: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """Rows of a ``[n, num_kv_heads, kv_len, head]`` tensor viewed ``[-1, head]`` for the given
    (request, position) pairs, every head: ``(req * num_kv_heads + head) * kv_len + pos``."""
    rows = (req[:, None] * heads.numel() + heads[None, :]) * kv_len + pos[:, None]
    return rows.reshape(-1).contiguous()
