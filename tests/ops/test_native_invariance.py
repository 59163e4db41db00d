"""Batch invariance of the native backend's attention (paged_attention.c): a query row's output
is bit for bit the same whatever the step around it: its q_len and chunk (a decode row alone
or row 250 of a 300-row prefill), the other requests in the step, the cache's block size
(1, 8, 16, 32, 48) and physical block ids, the number of threads and the head grouping of the
work units (one head a unit for little work, every head of a KV head for a prefill), and
whether a unit's keys were split into segments across the threads (a decode row or a short
chunk alone on 2 threads) or walked by one thread; with and
without a sliding window, fp32 and bf16 models (and caches). Held to AVX2 (the 8-lane build)
once in a subprocess."""

from __future__ import annotations

import pytest
import torch
from _held_to_avx2 import run_pytest_held_to_avx2

from pagedkv.ops.backends import AttentionLayerSpec, CommonAttentionMetadata

NUM_KV_HEADS, GROUP, HEAD_SIZE = 2, 4, 64
SEQ_LEN = 300  # positions 0..299 of one sequence
#: positions checked: both sides of piece (64), segment (256) and block boundaries, the
#: window's edge
POSITIONS = (0, 5, 7, 8, 63, 64, 65, 99, 100, 127, 130, 191, 250, 255, 256, 257, 299)


def sequence(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's keys and values ``[SEQ_LEN, KV, D]`` and queries ``[SEQ_LEN, H, D]``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(SEQ_LEN, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    v = torch.randn(SEQ_LEN, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    q = torch.randn(SEQ_LEN, NUM_KV_HEADS * GROUP, HEAD_SIZE, generator=gen)
    return k, v, q


def run_step(
    backend,
    seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    requests: list[tuple[int, int, int]],
    *,
    block_size: int,
    window: int | None,
    dtype: torch.dtype,
    threads: int,
    seed: int,
) -> list[torch.Tensor]:
    """Every sequence's keys and values written into a fresh cache (blocks in a shuffled
    order from ``seed``), then one attention step of ``requests`` = [(sequence, first query
    position, end position)]: the request attends with the queries of positions
    [first, end) over the sequence's keys [0, end). Returns each request's output rows
    ``[end - first, H, D]``."""
    spec = AttentionLayerSpec(
        num_heads=NUM_KV_HEADS * GROUP,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        block_size=block_size,
        dtype=dtype,
        sliding_window=window,
    )
    per_seq = -(-SEQ_LEN // block_size)
    num_blocks = 1 + per_seq * len(seqs)
    gen = torch.Generator().manual_seed(seed)
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
    tables = physical.view(len(seqs), per_seq)
    cache = backend.allocate_kv_cache(num_blocks, spec)
    cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype) * 50)
    pos = torch.arange(SEQ_LEN)
    slots = [
        tables[s].long()[pos // block_size] * block_size + pos % block_size
        for s in range(len(seqs))
    ]
    write = CommonAttentionMetadata(
        block_tables=tables,
        seq_lens=torch.full((len(seqs),), SEQ_LEN, dtype=torch.int32),
        query_start_loc=torch.arange(len(seqs) + 1, dtype=torch.int32) * SEQ_LEN,
        slot_mapping=torch.cat(slots),
        num_blocks=num_blocks,
    )
    md = backend.build_metadata(write, spec)
    key, value = (torch.cat([s[i] for s in seqs]).to(dtype) for i in (0, 1))
    backend.write_kv(key, value, cache, md)
    q_lens = [end - first for _, first, end in requests]
    qsl = torch.zeros(len(requests) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    step = CommonAttentionMetadata(
        block_tables=torch.stack([tables[s] for s, _, _ in requests]),
        seq_lens=torch.tensor([end for _, _, end in requests], dtype=torch.int32),
        query_start_loc=qsl,
        slot_mapping=torch.cat([slots[s][first:end] for s, first, end in requests]),
        num_blocks=num_blocks,
    )
    query = torch.cat([seqs[s][2][first:end] for s, first, end in requests]).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = backend.forward(query, cache, backend.build_metadata(step, spec), validate=True)
    finally:
        torch.set_num_threads(before)
    return list(out.split(q_lens))


def rows_of(outs, requests, seq: int, positions) -> dict[int, torch.Tensor]:
    """The output row of each of ``positions`` of sequence ``seq`` in a step's outputs."""
    found = {}
    for out, (s, first, end) in zip(outs, requests, strict=True):
        if s == seq:
            for p in positions:
                if first <= p < end:
                    found[p] = out[p - first]
    return found


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_in_any_step(native, window, dtype):
    """Each checked position of sequence 0 as a decode row alone (one thread, one request),
    as rows of a whole 300-row prefill, inside a 200-row chunk beside two other requests'
    prefill and decode rows, as many single-row requests in one step, under block sizes
    1, 8, 16, 32, 48, shuffled blocks and 1 or 2 threads: the same bits everywhere."""
    seqs = [sequence(0), sequence(1)]
    steps = [
        [(0, 0, SEQ_LEN)],  # a whole prompt
        [(1, 0, 77), (0, 100, SEQ_LEN), (1, 150, 151)],  # a chunk beside others
        [(1, 299, 300)] + [(0, p, p + 1) for p in POSITIONS],  # decode rows
        [(0, 0, 100), (0, 100, 240), (0, 240, SEQ_LEN)],  # the prompt in three chunks
        # alone, little work: on 2 threads each unit's keys split into segments
        [(0, 250, 260)],
        [(0, 256, 257)],
        [(0, 299, 300)],
    ]
    reference = None
    for block_size in (16, 1, 8, 32, 48):
        for threads in (1, 2):
            for i, requests in enumerate(steps):
                outs = run_step(
                    native,
                    seqs,
                    requests,
                    block_size=block_size,
                    window=window,
                    dtype=dtype,
                    threads=threads,
                    seed=block_size + 7 * i + threads,
                )
                rows = rows_of(outs, requests, 0, POSITIONS)
                if reference is None:  # a decode row alone, the first configuration
                    reference = {
                        p: run_step(
                            native,
                            seqs,
                            [(0, p, p + 1)],
                            block_size=16,
                            window=window,
                            dtype=dtype,
                            threads=1,
                            seed=99,
                        )[0][0]
                        for p in POSITIONS
                    }
                for p, row in rows.items():
                    assert torch.equal(row, reference[p]), (block_size, threads, i, p)


@pytest.mark.slow
def test_held_to_avx2_a_row_is_the_same_in_any_step(tmp_path):
    """The invariance test above on the 8-lane build (``ATEN_CPU_CAPABILITY=avx2``,
    ``ONEDNN_MAX_CPU_ISA=AVX2``), in a subprocess so that its library is the AVX2 one."""
    from pagedkv.ops import c_build

    try:
        c_build.check_avx2_fma()
    except c_build.KernelUnavailableError as e:
        pytest.skip(str(e))
    out = run_pytest_held_to_avx2(
        "tests/ops/test_native_invariance.py::test_a_row_is_the_same_in_any_step", timeout=600
    )
    assert "4 passed" in out
