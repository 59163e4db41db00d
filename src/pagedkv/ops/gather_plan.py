"""The fast path's gather plan: which rows of the KV cache each layer copies, and in what chunks.

The fast path reads K/V as *rows*: one row = one head of one token, ``head_size`` elements::

    kv_cache[i].view(-1, head_size)[row],   row = slot * num_kv_heads + kv_head

so a single ``index_select`` lands a request's keys directly in the KV-head-major layout the
matmuls want (``[num_kv_heads, kv_len, head_size]``, contiguous) — no transpose copy after the
gather. Gathering whole blocks and transposing costs a second full copy (docs/ops.md).

Decode requests (sorted by kv_len, longest first) are gathered in chunks of about
``decode_chunk_bytes`` so that the gathered K/V stays in cache between the gather and the two
matmuls; each chunk pads only to its own longest request. The plan depends on the cache's
``num_kv_heads``, so it is built on the first layer of a step and cached in the metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.ops.attention_metadata import PagedAttentionMetadata


@dataclass(slots=True)
class DecodeChunk:
    """Decode requests attended together by one gather + grouped matmul-softmax-matmul."""

    token_ids: torch.Tensor  # [num_reqs] int64 query rows
    num_reqs: int
    kv_len: int  # keys per request, padded to the chunk's longest
    rows: torch.Tensor  # [num_reqs * num_kv_heads * kv_len] int64 cache rows
    mask: torch.Tensor | None  # [num_reqs, 1, 1, kv_len] bool, True = padding (masked out)


@dataclass(slots=True)
class GatherPlan:
    """Everything one layer needs to read K/V for a step, for one cache head layout."""

    decode_chunks: list[DecodeChunk]
    prefill_rows: list[torch.Tensor]  # per prefill request: [num_kv_heads * kv_len] int64
    max_rows: int  # rows of the largest single gather (sizes the reused buffers)
    buffers: dict = field(default_factory=dict)  # dtype -> (key rows, value rows) buffers

    def gather_buffers(self, dtype: torch.dtype, head_size: int):
        """Return the plan's reused K and V gather buffers ``[max_rows, head_size]`` of dtype."""
        bufs = self.buffers.get(dtype)
        if bufs is None:
            bufs = (
                torch.empty(self.max_rows, head_size, dtype=dtype),
                torch.empty(self.max_rows, head_size, dtype=dtype),
            )
            self.buffers[dtype] = bufs
        return bufs


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


def _rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Cache rows for ``slots`` ``[..., kv_len]``, KV-head-major: ``[..., num_kv_heads, kv_len]``
    flattened."""
    heads = torch.arange(num_kv_heads).view(num_kv_heads, 1)
    return (slots.unsqueeze(-2) * num_kv_heads + heads).reshape(-1)


def _build(md: PagedAttentionMetadata, num_kv_heads: int, bytes_per_token: int) -> GatherPlan:
    chunks = []
    max_rows = 0
    lens = md.decode_kv_lens
    start = 0
    while start < len(lens):
        kv_len = lens[start]  # sorted descending: the chunk's longest
        n = max(1, md.decode_chunk_bytes // (kv_len * bytes_per_token))
        end = min(len(lens), start + n)
        rows = _rows(md.decode_kv_slots[start:end, :kv_len], num_kv_heads)
        mask = None
        if lens[end - 1] != kv_len:
            chunk_lens = torch.tensor(lens[start:end])
            mask = (torch.arange(kv_len)[None, :] >= chunk_lens[:, None])[:, None, None, :]
        chunks.append(
            DecodeChunk(
                token_ids=md.decode_token_ids[start:end],
                num_reqs=end - start,
                kv_len=kv_len,
                rows=rows,
                mask=mask,
            )
        )
        max_rows = max(max_rows, rows.numel())
        start = end
    prefill_rows = [_rows(p.kv_slots, num_kv_heads) for p in md.prefills]
    max_rows = max([max_rows] + [r.numel() for r in prefill_rows])
    return GatherPlan(decode_chunks=chunks, prefill_rows=prefill_rows, max_rows=max_rows)
