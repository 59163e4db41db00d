"""Reference paged attention: gather each request's keys and values token by token into dense
tensors, then textbook attention in fp32. Slow and plain on purpose; the fast paths are tested
against it and against dense attention."""

from __future__ import annotations

import torch

from pagedkv.ops.backends._torch.metadata import PagedAttentionMetadata
from pagedkv.ops.backends.base import FP8_DTYPES


def reference_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Paged attention by per-request gathering and explicit fp32 softmax.

    Args:
        query: ``[num_tokens, num_heads, head_size]``.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]``.
        metadata: the step's :class:`PagedAttentionMetadata` (only its plain inputs are used).
        scale: softmax scale (usually ``head_size ** -0.5``).
        k_scale, v_scale: fp8 dequantisation scales (ignored for other dtypes).
        soft_cap: scores become ``soft_cap * tanh(s / soft_cap)`` before the softmax; None =
            no cap.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype``.
    """
    num_heads = query.shape[1]
    _, _, num_kv_heads, block_size, head_size = kv_cache.shape
    group = num_heads // num_kv_heads
    if kv_cache.dtype not in FP8_DTYPES:
        k_scale = v_scale = 1.0
    # [num_slots, num_kv_heads, head_size]: slot-major copies of the cache (slow on purpose)
    key_slots = kv_cache[0].transpose(1, 2).reshape(-1, num_kv_heads, head_size)
    value_slots = kv_cache[1].transpose(1, 2).reshape(-1, num_kv_heads, head_size)
    window = metadata.sliding_window
    out = torch.empty_like(query)
    qsl = metadata.query_start_loc_list
    for i in range(metadata.num_reqs):
        seq_len = metadata.seq_lens_list[i]
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        positions = torch.arange(seq_len, device=key_slots.device)
        blocks = metadata.block_tables[i].long()[positions // block_size]
        slots = blocks * block_size + positions % block_size
        k = key_slots[slots].float() * k_scale  # [seq_len, kv_heads, head]
        v = value_slots[slots].float() * v_scale
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq_len, head]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[start:end].float().transpose(0, 1)  # [heads, q_len, head]
        scores = (q @ k.transpose(1, 2)) * scale  # [heads, q_len, seq_len]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=key_slots.device)[:, None]
        visible = positions[None, :] <= q_pos
        if window is not None:
            visible &= positions[None, :] > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = (probs @ v).transpose(0, 1).to(query.dtype)
    return out
