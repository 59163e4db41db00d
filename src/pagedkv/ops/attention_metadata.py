"""Per-step attention metadata: the index work of one step, done once and reused by every layer.

A forward runs ``paged_attention`` once per layer (30 layers for SmolLM2) with the same block
tables, seq_lens and query_start_loc. Everything that depends only on those (which requests are
decodes, their gather indices and masks, each prefill request's blocks and causal mask) is built
here once per step. Requests split into two groups:

* decode group: requests with exactly one query token. Attended together, vectorised: their K/V
  blocks are gathered into ``[num_decodes, num_kv_heads, decode_num_blocks * block_size,
  head_size]`` (padded), and slots outside each request's key range are masked.
* prefill group: requests with more than one query token (a prompt, a chunk of one, or a prompt
  after a prefix cache hit). Attended one request at a time (each one is big enough that the Python
  loop costs little next to its matmuls).

Positions: request ``i`` has ``seq_lens[i]`` tokens in the cache (including this step's); its
``q_len`` query tokens are the last ``q_len`` positions. Query at position ``p`` sees key ``k``
iff ``k <= p`` and, with a sliding window ``W``, ``k > p - W`` (the last ``W`` tokens including
itself; vLLM's and Mistral's convention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.errors import OpsInputError


@dataclass(slots=True)
class PrefillRequest:
    """One prefill-group request's precomputed view of the cache.

    Keys attended: positions ``[kv_start, seq_len)``; gathered as whole blocks ``block_ids``
    starting at position ``first_block * block_size``, then sliced from ``kv_offset``.
    """

    req_id: int
    token_start: int  # first row of this request in query / output
    token_end: int
    seq_len: int
    kv_offset: int  # kv_start - first_block * block_size
    kv_len: int  # seq_len - kv_start
    block_ids: torch.Tensor  # [num_used_blocks] int64
    attn_mask: torch.Tensor | None  # [q_len, kv_len] bool, True = attend; None = plain causal


@dataclass(slots=True)
class PagedAttentionMetadata:
    """Index tensors for :func:`pagedkv.ops.paged_attention`, built once per step by :meth:`build`.

    Holds the step's inputs (``block_tables``, ``seq_lens``, ``query_start_loc``) and what the fast
    path derives from them. Read-only after build; share it across layers.
    """

    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    block_size: int
    sliding_window: int | None
    num_reqs: int
    num_tokens: int
    max_block_id: int  # largest block id any request reads (validation against the pool)
    seq_lens_list: list[int]
    query_start_loc_list: list[int]
    # decode group (requests with q_len == 1)
    num_decodes: int
    decode_only: bool  # every request is a decode: query rows == decode rows, in order
    decode_token_ids: torch.Tensor  # [num_decodes] int64, rows of query
    decode_num_blocks: int  # blocks gathered per decode request (max over the group)
    decode_block_ids: torch.Tensor  # [num_decodes * decode_num_blocks] int64 (padding -> 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, decode_num_blocks * block_size] bool,
    #                                   True = masked out; None = nothing to mask
    # prefill group (q_len > 1)
    prefills: list[PrefillRequest] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
        *,
        sliding_window: int | None = None,
        num_blocks: int | None = None,
        validate: bool = True,
    ) -> PagedAttentionMetadata:
        """Precompute the step's attention indices.

        Args:
            block_tables: ``[num_reqs, max_num_blocks]`` int32/int64 physical block ids, padded
                with the null block 0 (entries past a request's blocks are ignored, whatever they
                hold, so a reused buffer with stale rows is fine).
            seq_lens: ``[num_reqs]`` int32/int64, tokens in the cache per request after this
                step's write (>= q_len).
            query_start_loc: ``[num_reqs + 1]`` int32/int64, cumulative query lengths from 0
                (request i owns query rows ``[qsl[i], qsl[i+1])``, q_len >= 1).
            block_size: tokens per block of the KV cache.
            sliding_window: attend only to the last ``sliding_window`` positions (None = all).
            num_blocks: pool size; with ``validate`` the used block ids are checked against it.
            validate: check shapes, dtypes and ranges (off only for a trusted runner).

        Returns:
            The metadata to pass as ``paged_attention(..., metadata=...)`` to every layer.

        Raises:
            OpsInputError: (validate=True) inconsistent or out-of-range inputs.
        """
        if validate:
            _check_step_inputs(block_tables, seq_lens, query_start_loc, block_size, sliding_window)
        num_reqs = block_tables.shape[0]
        seq_lens_list = seq_lens.tolist()
        qsl_list = query_start_loc.tolist()
        q_lens = [qsl_list[i + 1] - qsl_list[i] for i in range(num_reqs)]
        if validate:
            for i in range(num_reqs):
                if not 1 <= q_lens[i] <= seq_lens_list[i]:
                    raise OpsInputError(
                        f"request {i}: q_len {q_lens[i]} must be in [1, seq_len="
                        f"{seq_lens_list[i]}] (query_start_loc must increase)"
                    )
            max_len = block_tables.shape[1] * block_size
            if max(seq_lens_list, default=0) > max_len:
                raise OpsInputError(
                    f"a seq_len {max(seq_lens_list)} exceeds the block table's capacity "
                    f"{block_tables.shape[1]} blocks x {block_size} = {max_len} tokens"
                )
        decode_reqs = [i for i in range(num_reqs) if q_lens[i] == 1]
        prefill_reqs = [i for i in range(num_reqs) if q_lens[i] != 1]
        num_decodes = len(decode_reqs)
        max_block_id = 0

        # Decode group, vectorised over requests.
        if num_decodes:
            dec = torch.tensor(decode_reqs, dtype=torch.long)
            dec_seq = seq_lens.long().index_select(0, dec)
            if sliding_window is not None:
                kv_start = (dec_seq - sliding_window).clamp_(min=0)
            else:
                kv_start = torch.zeros_like(dec_seq)
            first_block = kv_start // block_size
            num_used = (dec_seq + block_size - 1) // block_size - first_block
            decode_num_blocks = int(num_used.max())
            j = torch.arange(decode_num_blocks)
            used = j[None, :] < num_used[:, None]
            col = torch.where(used, first_block[:, None] + j[None, :], 0)
            ids = block_tables.index_select(0, dec).long().gather(1, col)
            ids = torch.where(used, ids, 0)
            max_block_id = max(max_block_id, int(ids.max()))
            if validate and int(ids.min()) < 0:
                raise OpsInputError("block_tables holds a negative block id")
            pos = (first_block * block_size)[:, None] + torch.arange(
                decode_num_blocks * block_size
            )[None, :]
            mask = (pos < kv_start[:, None]) | (pos >= dec_seq[:, None])
            decode_mask = mask[:, None, None, :] if bool(mask.any()) else None
            decode_block_ids = ids.reshape(-1)
            decode_token_ids = torch.tensor([qsl_list[i] for i in decode_reqs], dtype=torch.long)
        else:
            decode_num_blocks = 0
            decode_block_ids = torch.zeros(0, dtype=torch.long)
            decode_token_ids = torch.zeros(0, dtype=torch.long)
            decode_mask = None

        # Prefill group, one entry per request.
        prefills = []
        table_rows = block_tables.long()
        for i in prefill_reqs:
            seq_len, q_len = seq_lens_list[i], q_lens[i]
            ctx_len = seq_len - q_len
            kv_start = 0 if sliding_window is None else max(0, ctx_len - sliding_window + 1)
            first_block = kv_start // block_size
            last_block = (seq_len + block_size - 1) // block_size
            block_ids = table_rows[i, first_block:last_block]
            if validate and int(block_ids.min()) < 0:
                raise OpsInputError(f"request {i}: block_tables holds a negative block id")
            max_block_id = max(max_block_id, int(block_ids.max()))
            kv_len = seq_len - kv_start
            q_pos = torch.arange(ctx_len, seq_len)[:, None]
            k_pos = torch.arange(kv_start, seq_len)[None, :]
            if kv_start == 0 and ctx_len == 0:
                attn_mask = None  # square causal: SDPA's is_causal
                if sliding_window is not None and sliding_window < seq_len:
                    attn_mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
            else:
                attn_mask = k_pos <= q_pos
                if sliding_window is not None:
                    attn_mask &= k_pos > q_pos - sliding_window
            prefills.append(
                PrefillRequest(
                    req_id=i,
                    token_start=qsl_list[i],
                    token_end=qsl_list[i + 1],
                    seq_len=seq_len,
                    kv_offset=kv_start - first_block * block_size,
                    kv_len=kv_len,
                    block_ids=block_ids.contiguous(),
                    attn_mask=attn_mask,
                )
            )
        if validate and num_blocks is not None and max_block_id >= num_blocks:
            raise OpsInputError(
                f"block_tables refers to block {max_block_id}, beyond the pool's {num_blocks}"
            )
        return cls(
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            block_size=block_size,
            sliding_window=sliding_window,
            num_reqs=num_reqs,
            num_tokens=qsl_list[-1],
            max_block_id=max_block_id,
            seq_lens_list=seq_lens_list,
            query_start_loc_list=qsl_list,
            num_decodes=num_decodes,
            decode_only=num_decodes == num_reqs and qsl_list[-1] == num_reqs,
            decode_token_ids=decode_token_ids,
            decode_num_blocks=decode_num_blocks,
            decode_block_ids=decode_block_ids,
            decode_mask=decode_mask,
            prefills=prefills,
        )


def _check_step_inputs(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> None:
    """Shape/dtype checks of the step tensors (value checks happen while building)."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise OpsInputError(f"block_size must be an int >= 1, got {block_size!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int)
        or isinstance(sliding_window, bool)
        or sliding_window < 1
    ):
        raise OpsInputError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    int_dtypes = (torch.int32, torch.int64)
    for name, tensor, dim in (
        ("block_tables", block_tables, 2),
        ("seq_lens", seq_lens, 1),
        ("query_start_loc", query_start_loc, 1),
    ):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != dim:
            raise OpsInputError(f"{name} must be a {dim}-D tensor")
        if tensor.dtype not in int_dtypes:
            raise OpsInputError(f"{name} must be int32 or int64, got {tensor.dtype}")
    num_reqs = block_tables.shape[0]
    if num_reqs < 1:
        raise OpsInputError("a step needs at least one request")
    if seq_lens.shape[0] != num_reqs or query_start_loc.shape[0] != num_reqs + 1:
        raise OpsInputError(
            f"num_reqs mismatch: block_tables has {num_reqs} rows, seq_lens "
            f"{seq_lens.shape[0]} (want {num_reqs}), query_start_loc {query_start_loc.shape[0]} "
            f"(want {num_reqs + 1})"
        )
    if int(query_start_loc[0]) != 0:
        raise OpsInputError("query_start_loc must start at 0")
