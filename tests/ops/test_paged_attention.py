"""paged_attention (reference and fast CPU paths) against dense causal attention."""

from dataclasses import replace

import pytest
import torch
from paged_attention_cases import dense_attention, make_case

from pagedkv.ops import PagedAttentionMetadata, allocate_kv_cache, paged_attention, write_kv
from pagedkv.ops.gather_plan import get_gather_plan

IMPLS = ["reference", "cpu"]


def scenarios(bs: int) -> dict[str, list[tuple[int, int]]]:
    """(seq_len, q_len) per request, lengths at, just below and just above block boundaries."""
    return {
        "decode": [(bs, 1), (bs + 1, 1), (max(bs - 1, 1), 1), (3 * bs + 1, 1), (2 * bs, 1)],
        "prefill_with_prefix": [(2 * bs + 1, bs + 1), (bs + 1, bs + 1), (3 * bs - 1, 2 * bs)],
        "mixed": [(bs + 1, 1), (2 * bs, 2 * bs), (3 * bs + 1, 2), (bs, 1), (2 * bs - 1, bs)],
    }


def run(case, impl, scale, **kwargs):
    return paged_attention(
        case.query,
        case.kv_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        scale,
        impl=impl,
        **kwargs,
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("scenario", ["decode", "prefill_with_prefix", "mixed"])
def test_fp32_matches_dense(impl, block_size, head_size, group, scenario):
    if impl == "reference" and head_size == 128:
        pytest.skip("the reference path has no head-size-specific code; keeps the suite short")
    seq_q_lens = scenarios(block_size)[scenario]
    case = make_case(
        seq_q_lens,
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_size=head_size,
        seed=block_size * 7 + group,
    )
    scale = head_size**-0.5
    out = run(case, impl, scale)
    assert out.shape == case.query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dense_attention(case, scale), atol=1e-5, rtol=1e-5)


# bf16 / fp16 tolerance. Dense is computed in fp64 from the same rounded q/K/V, so only the paths'
# own rounding shows: scores rounded to the dtype before the fp32 softmax (relative 2^-9 for bf16,
# |score| <~ 4 here -> ~0.01 abs in a logit -> ~1% in a probability), probabilities rounded to the
# dtype (2^-9 relative) and the output rounded (2^-9 of |out| <~ 1, i.e. 2e-3). Outputs are
# weighted means of unit-normal values, so errors near 1-2% of one value are the expected scale:
# bf16 atol/rtol 3e-2 (observed max ~1e-2); fp16 has 3 more mantissa bits: 4e-3 (observed
# ~1.2e-3).
LOW_PRECISION_TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_low_precision_matches_dense(impl, dtype, head_size, scenario):
    case = make_case(
        scenarios(16)[scenario],
        block_size=16,
        num_kv_heads=3,
        group=3,
        head_size=head_size,
        dtype=dtype,
    )
    scale = head_size**-0.5
    out = run(case, impl, scale)
    assert out.dtype == dtype
    tol = LOW_PRECISION_TOL[dtype]
    torch.testing.assert_close(out.double(), dense_attention(case, scale), atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 35])
def test_sliding_window_matches_dense_masked(impl, block_size, window):
    seq_q_lens = [(40, 1), (17, 1), (50, 12), (33, 33), (3, 1), (20, 2)]
    case = make_case(seq_q_lens, block_size=block_size, num_kv_heads=2, group=3, head_size=64)
    out = run(case, impl, 0.125, sliding_window=window)
    expected = dense_attention(case, 0.125, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 7])
def test_nan_in_unowned_slots_is_never_read(impl, window):
    # Every slot a request does not own (other blocks, the tail of its last block, the null block)
    # holds NaN: a single read of one would poison the output.
    seq_q_lens = [(17, 1), (5, 1), (40, 9), (31, 31), (16, 1)]
    case = make_case(seq_q_lens, block_size=8, num_kv_heads=2, group=4, head_size=64, garbage="nan")
    out = run(case, impl, 0.125, sliding_window=window)
    expected = dense_attention(case, 0.125, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_smaller_batch_reuses_table_buffer(impl):
    buffer = torch.zeros(8, 12, dtype=torch.int32)
    first = make_case(
        [(40, 1), (70, 1), (33, 20), (9, 1), (64, 1), (20, 20)],
        block_size=8,
        num_kv_heads=2,
        group=3,
        head_size=64,
        block_tables_buffer=buffer,
    )
    out = run(first, impl, 0.125)
    torch.testing.assert_close(out.double(), dense_attention(first, 0.125), atol=1e-5, rtol=1e-5)
    # Same cache, same buffer, fewer requests: rows 3.. of the buffer still hold the first batch.
    second = make_case(
        [(25, 1), (8, 8), (17, 1)],
        block_size=8,
        num_kv_heads=2,
        group=3,
        head_size=64,
        seed=1,
        kv_cache=first.kv_cache,
        block_tables_buffer=buffer,
    )
    assert second.block_tables.data_ptr() == buffer.data_ptr()
    out = run(second, impl, 0.125)
    torch.testing.assert_close(out.double(), dense_attention(second, 0.125), atol=1e-5, rtol=1e-5)


def test_metadata_shared_by_layers_and_paths():
    # Two "layers" (two caches with different data, same block tables) share one metadata.
    seq_q_lens = [(30, 1), (20, 5), (64, 1), (1, 1), (45, 45)]
    c0 = make_case(seq_q_lens, block_size=16, num_kv_heads=2, group=4, head_size=64)
    c1 = replace(c0, kv_cache=torch.randn(c0.kv_cache.shape), query=torch.randn(c0.query.shape))
    c1.keys, c1.values = [], []
    for i, (seq_len, _) in enumerate(seq_q_lens):
        k, v = torch.randn(2, seq_len, 2, 64)
        pos = torch.arange(seq_len)
        write_kv(k, v, c1.kv_cache, c0.block_tables[i].long()[pos // 16] * 16 + pos % 16)
        c1.keys.append(k)
        c1.values.append(v)
    md = PagedAttentionMetadata.build(
        c0.block_tables, c0.seq_lens, c0.query_start_loc, block_size=16, num_blocks=64
    )
    for case in (c0, c1):
        for impl in IMPLS:
            out = paged_attention(case.query, case.kv_cache, scale=0.125, metadata=md, impl=impl)
            expected = dense_attention(case, 0.125)
            torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert len(md.gather_plans) == 1  # built on the first layer, reused after


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [1, 40_000, 100_000, 1 << 30])
def test_decode_chunks_and_parts_of_any_size(chunk_bytes, dtype, window):
    # Small budgets split single requests into parts along the context (K pass, then V pass).
    lengths = [37, 5, 64, 63, 65, 1, 17, 100, 16, 33, 130]
    case = make_case(
        [(n, 1) for n in lengths] + [(50, 10)],
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_size=64,
        dtype=dtype,
        garbage="nan",
    )
    md = PagedAttentionMetadata.build(
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        16,
        sliding_window=window,
        decode_chunk_bytes=chunk_bytes,
    )
    out = paged_attention(
        case.query, case.kv_cache, scale=0.125, metadata=md, sliding_window=window
    )
    tol = 1e-5 if dtype == torch.float32 else LOW_PRECISION_TOL[dtype]
    expected = dense_attention(case, 0.125, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_decode_value_bags_point_unattended_positions_at_the_current_token():
    # One chunk, lengths 40 / 17 / 5 at block 8, NaN in every unowned slot: the values are read
    # in place by embedding_bag, and every position a request does not attend (its last block's
    # tail, its padding) reads its current token instead (finite, probability 0).
    case = make_case(
        [(40, 1), (17, 1), (5, 1)],
        block_size=8,
        num_kv_heads=2,
        group=4,
        head_size=64,
        garbage="nan",
    )
    md = PagedAttentionMetadata.build(case.block_tables, case.seq_lens, case.query_start_loc, 8)
    out = paged_attention(case.query, case.kv_cache, scale=0.125, metadata=md)
    torch.testing.assert_close(out.double(), dense_attention(case, 0.125), atol=1e-5, rtol=1e-5)
    (plan,) = md.gather_plans.values()
    (chunk,) = plan.decode_chunks
    assert chunk.value_zero is None  # nothing gathered, nothing to zero
    table = case.block_tables.long()
    tokens = chunk.value_tokens.long().view(3, 2, 4, 40)  # (request, kv head, group, position)
    assert chunk.value_tokens.dtype == torch.int32
    for r, seq_len in enumerate([40, 17, 5]):
        pos = torch.arange(40)
        p = pos.clamp(max=seq_len - 1)  # unattended -> the current token (position seq_len - 1)
        for h in range(2):
            want = (table[r, p // 8] * 2 + h) * 8 + p % 8
            for g in range(4):
                assert tokens[r, h, g].tolist() == want.tolist()


def test_fp8_plan_reads_padding_from_own_blocks_and_zeroes_only_partial_ones():
    # The same step planned for an fp8 cache (values gathered, no fp8 embedding_bag): the shorter
    # requests' padding blocks re-read one of their own full blocks (finite, masked) instead of
    # zeroing; only the last blocks' tails and the padding of the 5-token request (no full block of
    # its own) are zeroed.
    case = make_case(
        [(40, 1), (17, 1), (5, 1)], block_size=8, num_kv_heads=2, group=4, head_size=64
    )
    md = PagedAttentionMetadata.build(case.block_tables, case.seq_lens, case.query_start_loc, 8)
    (chunk,) = get_gather_plan(md, 2, 64, 1, None).decode_chunks
    assert chunk.value_tokens is None
    table = case.block_tables.long()
    rows = chunk.rows.view(3, 2, 5)  # (request, kv head, block): row = block * 2 + head
    assert torch.equal(rows % 2, torch.arange(2).view(1, 2, 1).expand(3, 2, 5))
    ids = rows[:, 0] // 2
    assert ids[0].tolist() == table[0, :5].tolist()
    assert ids[1, :3].tolist() == table[1, :3].tolist()
    assert set(ids[1, 3:].tolist()) <= set(table[1, :2].tolist())  # padding -> own full block
    assert ids[2, 0] == table[2, 0]
    # Zeroed, per gathered row (request r, head h, block j at r * 10 + h * 5 + j): request 2's
    # four padding blocks for both heads (rows 21..24, 26..29) and, per slot (row * 8 + offset),
    # the tails of request 1's third block (17..23 -> offsets 1..7 of rows 12 and 17) and of
    # request 2's block (offsets 5..7 of rows 20 and 25).
    assert chunk.value_zero.blocks.tolist() == [21, 22, 23, 24, 26, 27, 28, 29]
    tails = [
        row * 8 + o
        for row, offsets in (
            (12, range(1, 8)),
            (17, range(1, 8)),
            (20, range(5, 8)),
            (25, range(5, 8)),
        )
        for o in offsets
    ]
    assert chunk.value_zero.slots.tolist() == tails


def test_validate_off_gives_the_same_result():
    case = make_case(scenarios(16)["mixed"], block_size=16, num_kv_heads=3, group=3, head_size=64)
    on = run(case, "cpu", 0.125)
    off = run(case, "cpu", 0.125, validate=False)
    assert torch.equal(on, off)


def test_default_scale_is_inverse_sqrt_head_size():
    case = make_case([(20, 1), (9, 4)], block_size=8, num_kv_heads=1, group=2, head_size=64)
    out = paged_attention(
        case.query, case.kv_cache, case.block_tables, case.seq_lens, case.query_start_loc
    )
    torch.testing.assert_close(out.double(), dense_attention(case, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", [*IMPLS, "cpu_in_parts"])
def test_fp8_cache_matches_dense_on_dequantised_kv(fp8_dtype, query_dtype, impl):
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, head_size, group = 8, 2, 64, 3
    seq_q_lens = [(20, 1), (9, 1), (30, 7)]
    k_scale, v_scale = 0.05, 0.02
    kv_cache = allocate_kv_cache(16, block_size, num_kv_heads, head_size, fp8_dtype)
    physical = (torch.randperm(15, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(seq_q_lens), 6, dtype=torch.int32)
    keys, values = [], []
    for i, (seq_len, _) in enumerate(seq_q_lens):
        nb = -(-seq_len // block_size)
        block_tables[i, :nb] = torch.tensor(physical[:nb], dtype=torch.int32)
        physical = physical[nb:]
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(query_dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(query_dtype)
        pos = torch.arange(seq_len)
        slots = block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        write_kv(k, v, kv_cache, slots, k_scale=k_scale, v_scale=v_scale)
        # What the cache holds, dequantised: the dense attention's K/V.
        keys.append((k.float() / k_scale).to(fp8_dtype).float() * k_scale)
        values.append((v.float() / v_scale).to(fp8_dtype).float() * v_scale)
    q_lens = [q for _, q in seq_q_lens]
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_size, generator=gen)
    query = query.to(query_dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in seq_q_lens], dtype=torch.int32)
    md = PagedAttentionMetadata.build(
        block_tables, seq_lens, qsl, block_size, decode_chunk_bytes=1 if "parts" in impl else 2**21
    )
    out = paged_attention(
        query,
        kv_cache,
        scale=0.125,
        metadata=md,
        impl=impl.removesuffix("_in_parts"),
        k_scale=k_scale,
        v_scale=v_scale,
    )

    class Dense:  # the fields dense_attention reads
        pass

    dense = Dense()
    dense.query, dense.query_start_loc, dense.keys, dense.values = query, qsl, keys, values
    tol = 1e-5 if query_dtype == torch.float32 else LOW_PRECISION_TOL[torch.bfloat16]
    torch.testing.assert_close(out.double(), dense_attention(dense, 0.125), atol=tol, rtol=tol)
