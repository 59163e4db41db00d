"""``paged_attention``: the one entry point, dispatching to the reference or the fast CPU path."""

from __future__ import annotations

import importlib.util

import torch

from pagedkv.errors import OpsInputError
from pagedkv.ops.attention_metadata import PagedAttentionMetadata
from pagedkv.ops.cpu_attention import cpu_paged_attention
from pagedkv.ops.kv_cache import FP8_DTYPES, cache_dims, check_kv_cache
from pagedkv.ops.reference import reference_paged_attention

IMPLS = ("auto", "reference", "cpu", "triton")
_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    scale: float | None = None,
    sliding_window: int | None = None,
    *,
    impl: str = "auto",
    validate: bool = True,
    metadata: PagedAttentionMetadata | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a mixed batch over a paged KV cache (PagedAttention, Kwon et al. 2023).

    Request ``i`` owns query rows ``[query_start_loc[i], query_start_loc[i+1])`` (varlen layout, as
    in flash-attention); they are the last ``q_len`` positions of its ``seq_lens[i]``-token
    sequence, whose K/V were already written (``write_kv``) into the blocks of
    ``block_tables[i]``. Decode (q_len 1), prefill, prefill after a prefix cache hit and chunked
    prefill may be mixed in one call. Paging does not change the result: it equals dense causal
    attention over the same keys.

    Args:
        query: ``[num_tokens, num_heads, head_size]`` float32 / bfloat16 / float16.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]``, query's dtype or fp8
            (``torch.float8_e4m3fn`` / ``float8_e5m2`` with ``k_scale`` / ``v_scale``).
            ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA / MQA).
        block_tables: ``[num_reqs, max_num_blocks]`` int32, padded with the null block 0.
            May be None when ``metadata`` is given.
        seq_lens: ``[num_reqs]`` int32, tokens per request in the cache (including this step's).
        query_start_loc: ``[num_reqs + 1]`` int32, cumulative query lengths starting at 0.
        scale: softmax scale; None = ``head_size ** -0.5``.
        sliding_window: attend to the last ``sliding_window`` positions only (None = all); must
            equal the window ``metadata`` was built with.
        impl: "auto" ("triton" for CUDA tensors when Triton is installed, else "cpu"), "cpu"
            (fast path), "reference" (plain, for tests) or "triton" (pagedkv.ops.triton; the
            interpreter runs it on CPU tensors).
        validate: check shapes, dtypes and block ids; off for the trusted hot path.
        metadata: the step's precomputed :class:`PagedAttentionMetadata` (built from the same
            block_tables / seq_lens / query_start_loc); None = build it now (costs per call).
        k_scale, v_scale: fp8 per-tensor scales (ignored for other cache dtypes).

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype``.

    Raises:
        OpsInputError: (validate=True) bad shapes, dtypes, block ids or lengths, an unknown impl,
            or a sliding_window that differs from the metadata's.
    """
    if impl not in IMPLS:
        raise OpsInputError(f"impl must be one of {IMPLS}, got {impl!r}")
    if metadata is None:
        if block_tables is None or seq_lens is None or query_start_loc is None:
            raise OpsInputError(
                "pass block_tables, seq_lens and query_start_loc, or a prebuilt metadata"
            )
        if validate:
            check_kv_cache(kv_cache)
        num_blocks, block_size, _, _ = cache_dims(kv_cache)
        metadata = PagedAttentionMetadata.build(
            block_tables,
            seq_lens,
            query_start_loc,
            block_size,
            sliding_window=sliding_window,
            num_blocks=num_blocks,
            validate=validate,
        )
    elif validate and (
        (block_tables is not None and block_tables is not metadata.block_tables)
        or (seq_lens is not None and seq_lens is not metadata.seq_lens)
        or (query_start_loc is not None and query_start_loc is not metadata.query_start_loc)
    ):
        raise OpsInputError(
            "metadata was built from other block_tables / seq_lens / query_start_loc tensors; "
            "pass the same tensors or None"
        )
    if sliding_window != metadata.sliding_window:
        raise OpsInputError(
            f"sliding_window {sliding_window} differs from the metadata's "
            f"{metadata.sliding_window}; build one metadata per window size"
        )
    if validate:
        _check_query(query, kv_cache, metadata)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if impl == "triton" or (
        impl == "auto" and query.is_cuda and importlib.util.find_spec("triton") is not None
    ):
        from pagedkv.ops.triton import paged_attention_triton

        return paged_attention_triton(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            metadata.sliding_window,
            decode_only=metadata.decode_only,
            max_seq_len=max(metadata.seq_lens_list),
            k_scale=k_scale,
            v_scale=v_scale,
        )
    if impl == "reference":
        return reference_paged_attention(
            query, kv_cache, metadata, scale, k_scale=k_scale, v_scale=v_scale
        )
    return cpu_paged_attention(query, kv_cache, metadata, scale, k_scale=k_scale, v_scale=v_scale)


def _check_query(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: PagedAttentionMetadata
) -> None:
    check_kv_cache(kv_cache)
    num_blocks, block_size, num_kv_heads, head_size = cache_dims(kv_cache)
    if query.dim() != 3:
        raise OpsInputError(
            f"query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}"
        )
    num_tokens, num_heads, q_head_size = query.shape
    if query.dtype not in _QUERY_DTYPES:
        raise OpsInputError(f"query dtype must be float32, bfloat16 or float16, got {query.dtype}")
    if kv_cache.dtype not in FP8_DTYPES and kv_cache.dtype != query.dtype:
        raise OpsInputError(f"kv_cache dtype {kv_cache.dtype} differs from query's {query.dtype}")
    if q_head_size != head_size:
        raise OpsInputError(f"query head_size {q_head_size} != kv_cache head_size {head_size}")
    if num_heads % num_kv_heads:
        raise OpsInputError(
            f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    if num_tokens != metadata.num_tokens:
        raise OpsInputError(
            f"query has {num_tokens} tokens but query_start_loc ends at {metadata.num_tokens}"
        )
    if block_size != metadata.block_size:
        raise OpsInputError(
            f"kv_cache block_size {block_size} != metadata block_size {metadata.block_size}"
        )
    if metadata.max_block_id >= num_blocks:
        raise OpsInputError(
            f"block_tables refers to block {metadata.max_block_id}, beyond the pool's {num_blocks}"
        )
