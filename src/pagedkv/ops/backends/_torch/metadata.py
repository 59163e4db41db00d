"""The torch backend's per-step metadata: the index work of one step, done once and reused by
every layer.

A forward runs the torch backend's ``forward`` once per layer (30 layers for SmolLM2) with the
same block tables, seq_lens and query_start_loc. Everything that depends only on those is computed
here once per step: which requests are decodes, the blocks and slots each reads, masks, and (on
the first layer, once the cache's head layout is known) the fast path's gather plan
(``gather_plan.py``).

Requests split into two groups:

* decode group: requests with exactly one query token, attended together, vectorised. They are
  sorted by blocks read so that each gather chunk pads only to its own longest request.
* prefill group: requests with more than one query token (a prompt, a chunk of one, or a prompt
  after a prefix cache hit), attended one request at a time (each is big enough that the Python
  loop costs little next to its matmuls).

Positions: request ``i`` has ``seq_lens[i]`` tokens in the cache (including this step's); its
``q_len`` query tokens are the last ``q_len`` positions. Query at position ``p`` sees key ``k``
iff ``k <= p`` and, with a sliding window ``W``, ``k > p - W`` (the last ``W`` tokens including
itself; vLLM's and Mistral's convention). Keys of request ``i`` live at slot
``block_tables[i, k // block_size] * block_size + k % block_size``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: Gathered bytes per decode chunk and per torch thread when the cache sizes are unknown: small
#: enough to stay in cache between the gather and the matmul that reads it, big enough that the
#: matmuls split well over the threads (twice a 1 MiB L2).
DEFAULT_DECODE_CHUNK_BYTES = 2 << 20

#: Cap of a decode chunk held in the last-level cache (bytes). On the 2-core Xeon of docs/perf.md
#: (2 MiB L2 per core, 300 MiB L3) the torch path's decode attention ran fastest with 8-32 MiB
#: key chunks at 1 and 2 threads; 64 MiB was slower again.
MAX_DECODE_CHUNK_BYTES = 16 << 20


def _cache_size(level: int) -> int | None:
    """Bytes of CPU 0's unified/data cache of ``level`` (Linux sysfs), or None if unknown."""
    try:
        for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if (index / "level").read_text().strip() != str(level):
                continue
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip()  # e.g. "2048K"
            units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    except (OSError, ValueError):
        pass
    return None


@functools.cache
def decode_chunk_bytes_per_thread() -> int:
    """Twice the L2 cache of CPU 0 (Linux sysfs), else :data:`DEFAULT_DECODE_CHUNK_BYTES`."""
    l2 = _cache_size(2)
    return DEFAULT_DECODE_CHUNK_BYTES if l2 is None else 2 * l2


@functools.cache
def _llc_chunk_bytes() -> int:
    l3 = _cache_size(3)
    return 0 if l3 is None else min(MAX_DECODE_CHUNK_BYTES, l3 // 4)


def default_decode_chunk_bytes(num_threads: int) -> int:
    """Gathered bytes per decode chunk of the torch path for ``num_threads`` torch threads.

    The larger of twice the L2 per thread and a quarter of the last-level cache (capped at
    :data:`MAX_DECODE_CHUNK_BYTES`): a chunk gathered into L3 is still read back faster than
    memory, and bigger chunks mean fewer, larger ops per layer (docs/ops.md, "Why the values go
    through embedding_bag").
    """
    return max(decode_chunk_bytes_per_thread() * num_threads, _llc_chunk_bytes())


@dataclass(slots=True)
class PrefillRequest:
    """One prefill-group request: query rows ``[token_start, token_end)`` attend to keys at
    positions ``[kv_start, seq_len)``, whose slots are ``kv_slots``."""

    req_id: int
    token_start: int
    token_end: int
    kv_start: int
    kv_slots: torch.Tensor  # [seq_len - kv_start] int64
    attn_mask: torch.Tensor | None  # [q_len, kv_len] bool, True = attend; None = square causal


@dataclass(slots=True)
class PagedAttentionMetadata:
    """Index tensors of the torch backend's two paths, built once per step by :meth:`build`.

    Holds the step's inputs and what the paths derive from them. Treat as read-only after build
    and share it across the step's layers (the fast path caches its gather plan in it).
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
    # decode group (q_len == 1), sorted by blocks read (descending)
    decode_token_ids: torch.Tensor  # [num_decodes] int64, query rows
    decode_num_blocks: list[int]  # blocks read per decode request
    decode_block_ids: torch.Tensor  # [num_decodes, max blocks read] int64, padded with 0
    decode_valid: torch.Tensor  # [num_decodes, max blocks read * block_size] bool, True = attend
    # prefill group (q_len > 1)
    prefills: list[PrefillRequest]
    decode_chunk_bytes: int = DEFAULT_DECODE_CHUNK_BYTES
    gather_plans: dict = field(default_factory=dict)  # cache layout -> GatherPlan (gather_plan.py)

    @property
    def num_decodes(self) -> int:
        """Requests with exactly one query token this step."""
        return len(self.decode_num_blocks)

    @property
    def decode_only(self) -> bool:
        """Every request of the step is a decode (one query token each)."""
        return not self.prefills

    @classmethod
    def build(
        cls,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
        *,
        sliding_window: int | None = None,
        decode_chunk_bytes: int | None = None,
    ) -> PagedAttentionMetadata:
        """Precompute the step's attention indices.

        Args:
            block_tables: ``[num_reqs, max_num_blocks]`` int32/int64 physical block ids. Entries
                past a request's blocks are never read, whatever they hold: the model runner
                reuses one buffer and leaves stale block ids in each row's tail.
            seq_lens: ``[num_reqs]`` int32/int64, tokens per request in the cache after this
                step's write (>= q_len).
            query_start_loc: ``[num_reqs + 1]`` int32/int64, cumulative query lengths from 0
                (request i owns query rows ``[qsl[i], qsl[i+1])``, q_len >= 1).
            block_size: tokens per block of the KV cache.
            sliding_window: attend only to the last ``sliding_window`` positions (None = all).
            decode_chunk_bytes: gathered bytes per decode chunk of the fast path, >= 1 (None =
                :func:`default_decode_chunk_bytes` for ``torch.get_num_threads()``).

        Returns:
            The metadata every layer of the step with this block size and window reads.

        The inputs are not checked here: the torch backend validates the step
        (:meth:`~pagedkv.ops.backends.CommonAttentionMetadata.validate`) and its
        ``decode_chunk_bytes`` first.
        """
        if decode_chunk_bytes is None:
            decode_chunk_bytes = default_decode_chunk_bytes(torch.get_num_threads())
        num_reqs = block_tables.shape[0]
        seq_lens_list = seq_lens.tolist()
        qsl = query_start_loc.tolist()
        q_lens = [qsl[i + 1] - qsl[i] for i in range(num_reqs)]
        window = sliding_window

        def kv_start_of(seq_len: int, q_len: int) -> int:
            return 0 if window is None else max(0, seq_len - q_len - window + 1)

        # Index tensors live where block_tables lives (the cache's device); the Python lists above
        # are host copies (one sync per step).
        device = block_tables.device
        table = block_tables.long()
        max_block_id = 0
        # Decode group, vectorised over requests. Request i reads whole blocks from the one holding
        # its first attended key (kv_start) to its last; decode_valid marks the attended slots.
        decode_reqs = [i for i in range(num_reqs) if q_lens[i] == 1]

        def blocks_read(i: int) -> int:
            seq_len = seq_lens_list[i]
            return -(-seq_len // block_size) - kv_start_of(seq_len, 1) // block_size

        decode_reqs.sort(key=lambda i: -blocks_read(i))
        decode_num_blocks = [blocks_read(i) for i in decode_reqs]
        if decode_reqs:
            dec = torch.tensor(decode_reqs, dtype=torch.long, device=device)
            dec_seq = torch.tensor(
                [seq_lens_list[i] for i in decode_reqs], dtype=torch.long, device=device
            )
            kv_start = torch.tensor(
                [kv_start_of(seq_lens_list[i], 1) for i in decode_reqs], device=device
            )
            first_block = kv_start // block_size
            num_read = torch.tensor(decode_num_blocks, device=device)
            j = torch.arange(decode_num_blocks[0], device=device)
            used = j[None, :] < num_read[:, None]
            col = torch.where(used, first_block[:, None] + j[None, :], 0)
            decode_block_ids = torch.where(used, table.index_select(0, dec).gather(1, col), 0)
            max_block_id = int(decode_block_ids.max())
            pos = (first_block * block_size)[:, None] + torch.arange(
                j.numel() * block_size, device=device
            )
            decode_valid = (pos >= kv_start[:, None]) & (pos < dec_seq[:, None])
            decode_token_ids = torch.tensor(
                [qsl[i] for i in decode_reqs], dtype=torch.long, device=device
            )
        else:
            decode_block_ids = torch.zeros(0, 0, dtype=torch.long, device=device)
            decode_valid = torch.zeros(0, 0, dtype=torch.bool, device=device)
            decode_token_ids = torch.zeros(0, dtype=torch.long, device=device)

        # Prefill group, one entry per request.
        prefills = []
        for i in range(num_reqs):
            if q_lens[i] == 1:
                continue
            seq_len, q_len = seq_lens_list[i], q_lens[i]
            kv_start = kv_start_of(seq_len, q_len)
            k_pos = torch.arange(kv_start, seq_len, device=device)
            blocks = table[i].index_select(0, k_pos // block_size)
            max_block_id = max(max_block_id, int(blocks.max()))
            attn_mask = None
            if kv_start > 0 or q_len < seq_len or (window is not None and window < seq_len):
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
                attn_mask = k_pos[None, :] <= q_pos
                if window is not None:
                    attn_mask &= k_pos[None, :] > q_pos - window
            prefills.append(
                PrefillRequest(
                    req_id=i,
                    token_start=qsl[i],
                    token_end=qsl[i + 1],
                    kv_start=kv_start,
                    kv_slots=blocks * block_size + k_pos % block_size,
                    attn_mask=attn_mask,
                )
            )
        return cls(
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            block_size=block_size,
            sliding_window=sliding_window,
            num_reqs=num_reqs,
            num_tokens=qsl[-1],
            max_block_id=max_block_id,
            seq_lens_list=seq_lens_list,
            query_start_loc_list=qsl,
            decode_token_ids=decode_token_ids,
            decode_num_blocks=decode_num_blocks,
            decode_block_ids=decode_block_ids,
            decode_valid=decode_valid,
            prefills=prefills,
            decode_chunk_bytes=decode_chunk_bytes,
        )
