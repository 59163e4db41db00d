"""Random paged-attention cases for the kernel tests: a cache in the torch / triton backends'
layout ``[2, num_blocks, num_kv_heads, block_size, head_size]`` full of garbage, requests written
into shuffled physical blocks by plain indexing (an oracle of the layout, independent of any
backend's write), and the same keys/values kept contiguous for dense attention.

Tests of a backend build their cases through the backend instead (backend_cases.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.ops.backends import AttentionLayerSpec, CommonAttentionMetadata, TorchBackend


@dataclass
class PagedCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_size], dense copy
    values: list[torch.Tensor]


def make_case(
    seq_q_lens: list[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_size: int,
    dtype: torch.dtype = torch.float32,
    extra_blocks: int = 3,
    table_pad: int = 2,
    seed: int = 0,
    kv_cache: torch.Tensor | None = None,
    block_tables_buffer: torch.Tensor | None = None,
    garbage: str = "large",
) -> PagedCase:
    """Build a case: request i has (seq_len, q_len) = seq_q_lens[i].

    Every slot of the cache first holds garbage ("large": randn x 50; "nan": NaN), then each
    request's K/V goes into its own shuffled physical blocks (slot = block * block_size + offset;
    the key of head h at ``kv_cache[0, slot // block_size, h, slot % block_size]``). Table entries
    past a request's blocks hold other requests' block ids (stale-buffer garbage).
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks_per_req = [-(-s // block_size) for s, _ in seq_q_lens]
    num_blocks = 1 + sum(num_blocks_per_req) + extra_blocks
    if kv_cache is None:
        kv_cache = torch.zeros(2, num_blocks, num_kv_heads, block_size, head_size, dtype=dtype)
        if garbage == "nan":
            kv_cache.copy_(torch.full(kv_cache.shape, float("nan")))
        else:
            kv_cache.copy_(torch.randn(kv_cache.shape, generator=gen) * 50)
    else:
        num_blocks = kv_cache.shape[1]
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(num_blocks_per_req) + table_pad
    num_reqs = len(seq_q_lens)
    if block_tables_buffer is None:
        block_tables = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    else:
        block_tables = block_tables_buffer[:num_reqs]
    keys, values, q_lens = [], [], []
    for i, (seq_len, q_len) in enumerate(seq_q_lens):
        ids = physical[: num_blocks_per_req[i]]
        physical = physical[num_blocks_per_req[i] :]
        stale = torch.randint(1, num_blocks, (block_tables.shape[1],), generator=gen)
        block_tables[i] = stale.to(torch.int32)
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        blocks = block_tables[i].long()[pos // block_size]
        kv_cache[0, blocks, :, pos % block_size] = k
        kv_cache[1, blocks, :, pos % block_size] = v
        keys.append(k)
        values.append(v)
        q_lens.append(q_len)
    num_heads = num_kv_heads * group
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    seq_lens = torch.tensor([s for s, _ in seq_q_lens], dtype=torch.int32)
    return PagedCase(query, kv_cache, block_tables, seq_lens, qsl, keys, values)


def dense_attention(
    case: PagedCase,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
):
    """Dense causal attention in float64 over each request's contiguous K/V (explicit softmax;
    scores capped to ``cap * tanh(s / cap)`` when ``logits_soft_cap`` is given)."""
    outs = []
    qsl = case.query_start_loc.tolist()
    num_heads = case.query.shape[1]
    for i, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        q = case.query[qsl[i] : qsl[i + 1]].double().transpose(0, 1)  # [H, q_len, D]
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, 1).transpose(0, 1)
        v = v.double().repeat_interleave(group, 1).transpose(0, 1)
        seq_len, q_len = k.shape[1], q.shape[1]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = q @ k.transpose(1, 2) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append((torch.softmax(scores, -1) @ v).transpose(0, 1))
    return torch.cat(outs)


def torch_reference(
    case: PagedCase,
    scale: float | None = None,
    sliding_window: int | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The torch backend's reference path on the case's tensors (CPU), through the backend
    interface with validation: the plain per-request gather and fp32 softmax others are compared
    with (fp8 caches included, which dense_attention does not read)."""
    query, kv_cache = case.query.cpu(), case.kv_cache.cpu()
    _, num_blocks, num_kv_heads, block_size, head_size = kv_cache.shape
    spec = AttentionLayerSpec(
        num_heads=query.shape[1],
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=query.dtype,
        kv_cache_dtype=kv_cache.dtype,
        sliding_window=sliding_window,
        scale=scale,
    )
    common = CommonAttentionMetadata(
        block_tables=case.block_tables.cpu(),
        seq_lens=case.seq_lens.cpu(),
        query_start_loc=case.query_start_loc.cpu(),
        slot_mapping=torch.full((query.shape[0],), -1, dtype=torch.int64),  # nothing to write
        num_blocks=num_blocks,
    )
    backend = TorchBackend("cpu", impl="reference")
    md = backend.build_metadata(common, spec)
    return backend.forward(query, kv_cache, md, k_scale=k_scale, v_scale=v_scale, validate=True)
