"""The torch backend's gather plan: what each layer copies out of the paged cache, in what chunks.

The cache is ``[2, num_blocks, num_kv_heads, block_size, head_size]``: each (block, KV head) is
one contiguous ``block_size x head_size`` run, a *row* of the view
``kv_cache[i].view(num_blocks * num_kv_heads, block_size, head_size)``, with
``row = block_id * num_kv_heads + kv_head``.

Decode requests (sorted by blocks read, most first) are gathered in chunks of about
``decode_chunk_bytes`` of K+V, so that the gathered data stays in the CPU cache between the
gather and the two matmuls; each chunk pads only to its own longest request. Rows are gathered in
``(request, kv_head, block)`` order, so one ``index_select`` lands a chunk's keys as
``[num_reqs, num_kv_heads, kv_len, head_size]``, contiguous: no transpose copy (the previous
token-major layout needed one, docs/ops.md). A request bigger than the budget on its own is read
in parts along its context (split-K, as in flash-decoding, but in two passes: K parts for the
scores, then V parts).

Prefill requests gather per-token rows of the view ``kv_cache[i].view(-1, head_size)``::

    row = (block_id * num_kv_heads + kv_head) * block_size + offset

in ``(kv_head, position)`` order, which lands exactly their attended keys ``[num_kv_heads, kv_len,
head_size]``, ready for SDPA (prefill is compute-bound; the gather is a small part of it).

The plan depends on the cache's head count and element size, so it is built on a step's first
layer and cached in the metadata for the other layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.ops.attention_metadata import PagedAttentionMetadata


@dataclass(slots=True)
class ZeroSlots:
    """Gathered value slots to zero, at two granularities (each int64 or None for none).

    ``blocks``: rows of the gathered ``[num_rows, block_size, head_size]`` holding no attended key
    (padding). ``slots``: rows of the same buffer viewed per token ``[num_rows * block_size,
    head_size]``, unattended slots of partly attended blocks.
    """

    blocks: torch.Tensor | None
    slots: torch.Tensor | None

    @classmethod
    def of(cls, invalid: torch.Tensor, block_size: int) -> ZeroSlots | None:
        """From a ``[num_rows * block_size]`` bool mask (True = zero)."""
        per_block = invalid.view(-1, block_size)
        full = per_block.all(dim=1)
        partial = per_block & ~full[:, None]
        blocks = full.nonzero().flatten()
        slots = partial.view(-1).nonzero().flatten()
        if blocks.numel() == 0 and slots.numel() == 0:
            return None
        return cls(blocks if blocks.numel() else None, slots if slots.numel() else None)

    def apply(self, gathered: torch.Tensor) -> None:
        """Zero the slots in ``gathered`` ``[num_rows, block_size, head_size]`` in place."""
        if gathered.dtype.itemsize == 1:  # fp8: no fill kernel; 0x00 is +0.0 in both formats
            gathered = gathered.view(torch.uint8)
        if self.blocks is not None:
            gathered.index_fill_(0, self.blocks, 0)
        if self.slots is not None:
            gathered.view(gathered.shape[0] * gathered.shape[1], -1).index_fill_(0, self.slots, 0)


@dataclass(slots=True)
class DecodeChunk:
    """Decode requests ``[start, end)`` of the sorted decode group, attended together."""

    token_ids: torch.Tensor  # [num_reqs] int64 query rows
    num_reqs: int
    num_blocks: int  # blocks read per request (padded to the chunk's longest)
    rows: torch.Tensor  # [num_reqs * num_kv_heads * num_blocks] int64 (request, head, block) rows
    key_mask: torch.Tensor | None  # [num_reqs, 1, 1, num_blocks * block_size] bool, True = masked
    # V slots outside the requests' keys, zeroed in the gathered rows (None = none): only the
    # last block's tail, a sliding window's first-block head and padding blocks.
    value_zero: ZeroSlots | None
    # A request alone bigger than the chunk budget is read in parts of part_blocks blocks: all K
    # parts (scores), softmax over the whole row, then all V parts. None = one part.
    part_blocks: int | None = None
    # With parts: per part, its rows ([num_kv_heads * blocks in the part], head-major) and the
    # value slots to zero in that part's gathered rows (or None).
    part_rows: list[torch.Tensor] | None = None
    part_value_zero: list[ZeroSlots | None] | None = None


@dataclass(slots=True)
class GatherPlan:
    """Everything one layer needs to read K/V for a step, for one cache head layout."""

    decode_chunks: list[DecodeChunk]
    prefill_rows: list[torch.Tensor]  # per prefill request: [num_kv_heads * kv_len] int64
    max_decode_rows: int  # gathered (block, head) rows of the largest decode chunk or part
    max_prefill_rows: int
    buffers: dict = field(default_factory=dict)  # (name, shape, dtype) -> reused tensor

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A reused scratch tensor (allocated on first use, shared by the step's layers)."""
        key = (name, shape, dtype)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.empty(shape, dtype=dtype, device=device)
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
    max_decode_rows = 0
    counts = md.decode_num_blocks
    bs = md.block_size
    device = md.decode_block_ids.device
    heads = torch.arange(num_kv_heads, device=device)
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
        block_ids = md.decode_block_ids[start:end, :num_blocks]
        key_mask = value_zero = part_rows = part_value_zero = None
        invalid = None
        if not bool(valid.all()):
            key_mask = ~valid[:, None, None, :]
            block_ids, valid = _read_padding_from_own_block(block_ids, valid, bs)
            # per (request, head, position): the same mask for every head
            invalid = (~valid)[:, None, :].expand(-1, num_kv_heads, -1)
        # [n, num_kv_heads, num_blocks] rows of the (block, head) view
        rows = block_ids[:, None, :] * num_kv_heads + heads[None, :, None]
        if part_blocks is None:
            if invalid is not None:
                value_zero = ZeroSlots.of(invalid.reshape(-1), bs)
            max_decode_rows = max(max_decode_rows, rows.numel())
        else:  # one request (alone over budget), read in parts of part_blocks blocks
            part_rows, part_value_zero = [], []
            for b0 in range(0, num_blocks, part_blocks):
                b1 = min(num_blocks, b0 + part_blocks)
                part_rows.append(rows[0, :, b0:b1].reshape(-1))
                part_invalid = None if invalid is None else invalid[0, :, b0 * bs : b1 * bs]
                part_value_zero.append(
                    None if part_invalid is None else ZeroSlots.of(part_invalid.reshape(-1), bs)
                )
                max_decode_rows = max(max_decode_rows, part_rows[-1].numel())
        chunks.append(
            DecodeChunk(
                token_ids=md.decode_token_ids[start:end],
                num_reqs=end - start,
                num_blocks=num_blocks,
                rows=rows.reshape(-1),
                key_mask=key_mask,
                value_zero=value_zero,
                part_blocks=part_blocks,
                part_rows=part_rows,
                part_value_zero=part_value_zero,
            )
        )
        start = end
    prefill_rows = []
    for p in md.prefills:
        token_rows = (p.kv_slots // bs) * (num_kv_heads * bs) + p.kv_slots % bs  # head 0
        prefill_rows.append((token_rows[None, :] + (heads * bs)[:, None]).reshape(-1))
    return GatherPlan(
        decode_chunks=chunks,
        prefill_rows=prefill_rows,
        max_decode_rows=max_decode_rows,
        max_prefill_rows=max([0] + [r.numel() for r in prefill_rows]),
    )


def _read_padding_from_own_block(
    block_ids: torch.Tensor, valid: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Point a request's padding blocks at one of its own fully attended blocks.

    A padding block (no attended slot) of a request that has a fully attended block gathers that
    block again instead of the null block: its values are the request's own finite K/V, so a
    masked probability of 0 times them is 0 and nothing needs zeroing. Only the rest (partly
    attended blocks, and padding of requests with no full block) is left for zeroing.

    Args:
        block_ids: ``[n, num_blocks]`` int64 blocks read per request.
        valid: ``[n, num_blocks * block_size]`` bool, True = attended.

    Returns:
        New block ids and a "needs no zeroing" mask (``valid`` plus the redirected blocks).
    """
    per_block = valid.view(valid.shape[0], -1, block_size)
    full = per_block.all(dim=2)  # [n, num_blocks]
    empty = ~per_block.any(dim=2)
    has_full = full.any(dim=1, keepdim=True)
    donor = block_ids.gather(1, full.to(torch.uint8).argmax(dim=1, keepdim=True))
    redirect = empty & has_full
    block_ids = torch.where(redirect, donor, block_ids)
    safe = (per_block | redirect[:, :, None]).view(valid.shape)
    return block_ids, safe
