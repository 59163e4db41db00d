"""The torch backend's two paths, the fast one (``impl="cpu"``) and the plain reference, against
dense attention and against each other, through the backend interface; and the fast path's
internals (decode chunks and parts of any size, the value bags, the fp8 gather plan).

test_backends.py runs the shared matrix for both paths ("torch" and "torch-reference": block
sizes 1-128, GQA groups 1 / 3 / 8, head 64, decode / prefix-hit / mixed steps, windows, NaN in
unowned slots, a reused table buffer, one metadata for two layers, fp8); this file adds what is
particular to them.
"""

import pytest
import torch
from backend_cases import make_backend_case
from paged_attention_cases import dense_attention

from pagedkv.errors import OpsInputError
from pagedkv.ops.backends import TorchBackend
from pagedkv.ops.backends._torch.gather_plan import get_gather_plan

IMPLS = ["reference", "cpu"]

# bf16 / fp16 tolerance. Dense is computed in fp64 from the same rounded q/K/V, so only the paths'
# own rounding shows: scores rounded to the dtype before the fp32 softmax (relative 2^-9 for bf16,
# |score| <~ 4 here -> ~0.01 abs in a logit -> ~1% in a probability), probabilities rounded to the
# dtype (2^-9 relative) and the output rounded (2^-9 of |out| <~ 1, i.e. 2e-3). Outputs are
# weighted means of unit-normal values, so errors near 1-2% of one value are the expected scale:
# bf16 atol/rtol 3e-2 (observed max ~1e-2); fp16 has 3 more mantissa bits: 4e-3 (observed
# ~1.2e-3).
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def scenarios(bs: int) -> dict[str, list[tuple[int, int]]]:
    """(seq_len, q_len) per request, lengths at, just below and just above block boundaries."""
    return {
        "decode": [(bs, 1), (bs + 1, 1), (max(bs - 1, 1), 1), (3 * bs + 1, 1), (2 * bs, 1)],
        "prefill_with_prefix": [(2 * bs + 1, bs + 1), (bs + 1, bs + 1), (3 * bs - 1, 2 * bs)],
        "mixed": [(bs + 1, 1), (2 * bs, 2 * bs), (3 * bs + 1, 2), (bs, 1), (2 * bs - 1, bs)],
    }


def check(case, sliding_window=None, **kwargs):
    out = case.forward(**kwargs)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    tol = TOL[case.query.dtype]
    expected = dense_attention(case, case.spec.scale, sliding_window)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("scenario", ["decode", "prefill_with_prefix", "mixed"])
def test_fast_path_head_128_matches_dense(block_size, group, scenario):
    # (head 64 for both paths: test_backends.py; the reference path has no head-size-specific
    # code, so head 128 runs the fast path only, as it always did)
    case = make_backend_case(
        TorchBackend("cpu"),
        scenarios(block_size)[scenario],
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_size=128,
        seed=block_size * 7 + group,
    )
    check(case)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_low_precision_head_128_matches_dense(impl, dtype, scenario):
    case = make_backend_case(
        TorchBackend("cpu", impl=impl),
        scenarios(16)[scenario],
        block_size=16,
        num_kv_heads=3,
        group=3,
        head_size=128,
        dtype=dtype,
    )
    check(case)


# (dtype, kv_cache_dtype, sliding_window, block_size): the fast path against the reference on the
# same cache and step.
PATH_CASES = {
    "fp32": (torch.float32, None, None, 16),
    "fp32-window": (torch.float32, None, 7, 8),
    "bf16": (torch.bfloat16, None, None, 16),
    "fp16-window": (torch.float16, None, 16, 16),
    "bf16-fp8-e4m3": (torch.bfloat16, torch.float8_e4m3fn, None, 8),
    "fp32-fp8-e5m2-window": (torch.float32, torch.float8_e5m2, 5, 16),
}


@pytest.mark.parametrize("name", list(PATH_CASES))
def test_fast_path_equals_reference(name):
    dtype, kv_cache_dtype, window, block_size = PATH_CASES[name]
    scales = {"k_scale": 0.05, "v_scale": 0.02} if kv_cache_dtype is not None else {}
    case = make_backend_case(
        TorchBackend("cpu", impl="reference"),
        [(40, 1), (17, 1), (50, 12), (33, 33), (3, 1), (20, 2), (100, 1)],
        block_size=block_size,
        num_kv_heads=2,
        group=3,
        head_size=64,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        sliding_window=window,
        **scales,
    )
    reference = case.forward(**scales)
    fast_backend = TorchBackend("cpu")
    md = fast_backend.build_metadata(case.common, case.spec)
    fast = fast_backend.forward(case.query, case.kv_cache, md, validate=True, **scales)
    # fp32: both exact to rounding; lower precisions: the fast path rounds scores and
    # probabilities to the query dtype, the reference computes in fp32 and rounds once.
    tol = TOL[dtype]
    torch.testing.assert_close(fast.double(), reference.double(), atol=tol, rtol=tol)


def test_metadata_shared_by_layers_and_paths():
    # Two "layers" (two caches with different data, same block tables) share one metadata, which
    # either path reads; the fast path's gather plan is built on the first layer and reused.
    seq_q_lens = [(30, 1), (20, 5), (64, 1), (1, 1), (45, 45)]
    kwargs = dict(block_size=16, num_kv_heads=2, group=4, head_size=64)
    fast, reference = TorchBackend("cpu"), TorchBackend("cpu", impl="reference")
    layer0 = make_backend_case(fast, seq_q_lens, **kwargs)
    layer1 = make_backend_case(
        fast, seq_q_lens, seed=5, block_tables=layer0.common.block_tables, **kwargs
    )
    md = fast.build_metadata(layer0.common, layer0.spec)
    for case in (layer0, layer1):
        for backend in (fast, reference):
            out = backend.forward(case.query, case.kv_cache, md, validate=True)
            expected = dense_attention(case, case.spec.scale)
            torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert len(md.paged.gather_plans) == 1


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [1, 40_000, 100_000, 1 << 30])
def test_decode_chunks_and_parts_of_any_size(chunk_bytes, dtype, window):
    # Small budgets split single requests into parts along the context (K pass, then V pass).
    lengths = [37, 5, 64, 63, 65, 1, 17, 100, 16, 33, 130]
    case = make_backend_case(
        TorchBackend("cpu", decode_chunk_bytes=chunk_bytes),
        [(n, 1) for n in lengths] + [(50, 10)],
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_size=64,
        dtype=dtype,
        sliding_window=window,
        garbage="nan",
    )
    check(case, sliding_window=window)


def test_decode_value_bags_point_unattended_positions_at_the_current_token():
    # One chunk, lengths 40 / 17 / 5 at block 8, NaN in every unowned slot: the values are read
    # in place by embedding_bag, and every position a request does not attend (its last block's
    # tail, its padding) reads its current token instead (finite, probability 0).
    backend = TorchBackend("cpu")
    case = make_backend_case(
        backend,
        [(40, 1), (17, 1), (5, 1)],
        block_size=8,
        num_kv_heads=2,
        group=4,
        head_size=64,
        garbage="nan",
    )
    md = backend.build_metadata(case.common, case.spec)
    out = backend.forward(case.query, case.kv_cache, md, validate=True)
    torch.testing.assert_close(out.double(), dense_attention(case, 0.125), atol=1e-5, rtol=1e-5)
    (plan,) = md.paged.gather_plans.values()
    (chunk,) = plan.decode_chunks
    assert chunk.value_zero is None  # nothing gathered, nothing to zero
    table = case.common.block_tables.long()
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
    backend = TorchBackend("cpu")
    case = make_backend_case(
        backend, [(40, 1), (17, 1), (5, 1)], block_size=8, num_kv_heads=2, group=4, head_size=64
    )
    md = backend.build_metadata(case.common, case.spec).paged
    (chunk,) = get_gather_plan(md, 2, 64, 1, None).decode_chunks
    assert chunk.value_tokens is None
    table = case.common.block_tables.long()
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
    backend = TorchBackend("cpu")
    case = make_backend_case(
        backend, scenarios(16)["mixed"], block_size=16, num_kv_heads=3, group=3, head_size=64
    )
    md = backend.build_metadata(case.common, case.spec, validate=False)
    on = backend.forward(case.query, case.kv_cache, md, validate=True)
    off = backend.forward(case.query, case.kv_cache, md, validate=False)
    assert torch.equal(on, off)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_read_in_parts_matches_dense(fp8_dtype, dtype):
    # A 1-byte decode chunk budget: every decode request read in parts (K parts, V parts) of
    # an fp8 cache. (Whole requests, both paths: test_backends.py.)
    case = make_backend_case(
        TorchBackend("cpu", decode_chunk_bytes=1),
        [(20, 1), (9, 1), (30, 7)],
        block_size=8,
        num_kv_heads=2,
        group=3,
        head_size=64,
        dtype=dtype,
        kv_cache_dtype=fp8_dtype,
        k_scale=0.05,
        v_scale=0.02,
    )
    check(case, k_scale=0.05, v_scale=0.02)


@pytest.mark.parametrize("chunk_bytes", [0, -5, 1.5, True])
def test_decode_chunk_bytes_must_be_a_positive_int(chunk_bytes):
    with pytest.raises(OpsInputError, match="decode_chunk_bytes must be an int >= 1"):
        TorchBackend("cpu", decode_chunk_bytes=chunk_bytes)


def test_unknown_impl_is_refused():
    with pytest.raises(OpsInputError, match="impl"):
        TorchBackend("cpu", impl="cuda")
