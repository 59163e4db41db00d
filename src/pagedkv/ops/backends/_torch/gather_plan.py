"""The torch backend's gather plan: what each layer reads out of the paged cache, in what chunks.

The cache is ``[2, num_blocks, num_kv_heads, block_size, head_size]``: each (block, KV head) is
one contiguous ``block_size x head_size`` run, a *row* of the view
``kv_cache[i].view(num_blocks * num_kv_heads, block_size, head_size)``, with
``row = block_id * num_kv_heads + kv_head``; and each (block, KV head, offset) is a *token row*
of ``kv_cache[i].view(-1, head_size)``::

    token_row = (block_id * num_kv_heads + kv_head) * block_size + offset

Decode requests (sorted by blocks read, most first) are attended in chunks of about
``decode_chunk_bytes`` of gathered data, so that it stays in the CPU cache between the gather and
the matmul that reads it; each chunk pads only to its own longest request.

* Keys: rows are gathered in ``(request, kv_head, block)`` order, so one ``index_select`` lands a
  chunk's keys as ``[num_reqs, num_kv_heads, kv_len, head_size]``, contiguous, for the scores
  matmul. A request bigger than the budget on its own is read in parts along its context
  (split-K, as in flash-decoding).
* Values (bf16 / fp16 / fp32 caches): not gathered. ``value_tokens`` holds, per (request, query
  head), the token rows of its ``kv_len`` keys, and one ``embedding_bag(mode="sum")`` with the
  probabilities as per-sample weights reads each value once, straight from the cache, and sums
  it into the output: the gather-and-reduce of the second matmul in one pass with no copy. A
  position the request does not attend (padding, the last block's tail, a sliding window's
  first-block head) points at the request's current token, always written and finite, and has
  probability 0, so whatever the unowned slots hold (NaN included) never reaches the output.
* Values of fp8 caches (no fp8 ``embedding_bag``): gathered like the keys, then dequantised;
  unowned slots are zeroed (``value_zero``) since a probability of 0 times NaN is NaN.

Prefill requests gather per-token rows of the view in ``(kv_head, position)`` order, which lands
exactly their attended keys ``[num_kv_heads, kv_len, head_size]``, ready for SDPA (prefill is
compute-bound; the gather is a small part of it).

The plan depends on the cache's head count, element size and the layer's GQA group, so it is
built on a step's first layer and cached in the metadata for the other layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.ops.backends._torch.metadata import PagedAttentionMetadata


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
    # Value bags: [num_reqs * num_heads, num_blocks * block_size] int32/int64 token rows, (request,
    # query head) major; None when values are gathered (fp8).
    value_tokens: torch.Tensor | None
    # Gathered values only: V slots outside the requests' keys, zeroed in the gathered rows (None
    # = none): the last block's tail, a sliding window's first-block head and padding blocks.
    value_zero: ZeroSlots | None
    # A request alone bigger than the chunk budget is read in parts of part_blocks blocks: all K
    # parts (scores), softmax over the whole row, then all V parts. None = one part.
    part_blocks: int | None = None
    # With parts: per part, its rows ([num_kv_heads * blocks in the part], head-major) and, for
    # gathered values, the value slots to zero in that part's gathered rows (or None).
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
    metadata: PagedAttentionMetadata,
    num_kv_heads: int,
    head_size: int,
    itemsize: int,
    group: int | None,
) -> GatherPlan:
    """The metadata's gather plan for a cache layout, built on first use and then reused.

    Args:
        metadata: the step's metadata.
        num_kv_heads: KV heads of the cache.
        head_size: elements per head.
        itemsize: bytes per cache element.
        group: query heads per KV head, for value bags read in place (bf16 / fp16 / fp32
            caches); None gathers the values like the keys (fp8 caches).
    """
    key = (num_kv_heads, head_size, itemsize, group)
    plan = metadata.gather_plans.get(key)
    if plan is None:
        plan = _build(metadata, num_kv_heads, head_size * itemsize, group)
        metadata.gather_plans[key] = plan
    return plan


def _build(
    md: PagedAttentionMetadata, num_kv_heads: int, head_bytes: int, group: int | None
) -> GatherPlan:
    chunks = []
    max_decode_rows = 0
    counts = md.decode_num_blocks
    bs = md.block_size
    device = md.decode_block_ids.device
    heads = torch.arange(num_kv_heads, device=device)
    # gathered bytes per token: keys only when the values are read in place
    bytes_per_token = num_kv_heads * head_bytes * (1 if group is not None else 2)
    # token rows fit int32 (embedding_bag's faster index type) unless the pool is that big
    max_token_row = (md.max_block_id + 1) * num_kv_heads * bs
    token_dtype = torch.int32 if max_token_row < 2**31 else torch.int64
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
        key_mask = value_zero = part_rows = part_value_zero = value_tokens = None
        invalid = None
        all_valid = bool(valid.all())
        if not all_valid:
            key_mask = ~valid[:, None, None, :]
        if group is not None:
            value_tokens = _value_tokens(block_ids, valid, all_valid, heads, bs, group, token_dtype)
        elif not all_valid:
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
                value_tokens=value_tokens,
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


def _value_tokens(
    block_ids: torch.Tensor,
    valid: torch.Tensor,
    all_valid: bool,
    heads: torch.Tensor,
    block_size: int,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Token rows of each (request, query head) bag, unattended positions at the current token.

    Args:
        block_ids: ``[n, num_blocks]`` int64 blocks read per request.
        valid: ``[n, num_blocks * block_size]`` bool, True = attended.
        heads: ``arange(num_kv_heads)``.
        dtype: int32 or int64, wide enough for the largest token row.

    Returns:
        ``[n * num_kv_heads * group, num_blocks * block_size]`` in ``dtype``: bag
        ``(r, h * group + g)`` (query head ``h * group + g`` reads KV head ``h``) lists request
        r's token rows.
    """
    n = block_ids.shape[0]
    num_kv_heads = heads.numel()
    offsets = torch.arange(block_size, device=block_ids.device, dtype=dtype)
    rows = block_ids.to(dtype)[:, None, :] * num_kv_heads + heads.to(dtype)[None, :, None]
    # [n, kv_heads, num_blocks, block_size] -> [n, kv_heads, kv_len]
    tokens = (rows[:, :, :, None] * block_size + offsets).view(n, num_kv_heads, -1)
    if not all_valid:
        # the current token: the last attended position (valid is one run per request)
        positions = torch.arange(valid.shape[1], device=valid.device)
        last = torch.where(valid, positions, 0).argmax(dim=1)
        current = tokens.gather(2, last.view(n, 1, 1).expand(n, num_kv_heads, 1))
        tokens = torch.where(valid[:, None, :], tokens, current)
    kv_len = tokens.shape[2]
    return tokens[:, :, None, :].expand(n, num_kv_heads, group, kv_len).reshape(-1, kv_len)


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
