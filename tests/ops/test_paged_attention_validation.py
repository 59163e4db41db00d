"""Bad input to paged_attention / PagedAttentionMetadata.build raises OpsInputError, changes
nothing, and says what was wrong."""

import pytest
import torch
from paged_attention_cases import make_case

from pagedkv.errors import OpsInputError
from pagedkv.ops import PagedAttentionMetadata, paged_attention


@pytest.fixture
def case():
    return make_case(
        [(20, 1), (9, 4), (16, 1)], block_size=8, num_kv_heads=2, group=3, head_size=64
    )


def call(case, **overrides):
    args = {
        "query": case.query,
        "kv_cache": case.kv_cache,
        "block_tables": case.block_tables,
        "seq_lens": case.seq_lens,
        "query_start_loc": case.query_start_loc,
        "scale": 0.125,
    }
    args.update(overrides)
    return paged_attention(**args)


def with_value(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


BAD_INPUTS = {
    "block id beyond the pool": (
        lambda c: {"block_tables": with_value(c.block_tables, (0, 0), c.kv_cache.shape[1])},
        "beyond the pool",
    ),
    "negative block id": (
        lambda c: {"block_tables": with_value(c.block_tables, (1, 1), -3)},
        "negative block id",
    ),
    "seq_len beyond the table": (
        lambda c: {"seq_lens": with_value(c.seq_lens, 0, c.block_tables.shape[1] * 8 + 1)},
        "capacity",
    ),
    "q_len above seq_len": (
        lambda c: {"seq_lens": with_value(c.seq_lens, 1, 3)},
        "q_len",
    ),
    "query_start_loc not from 0": (
        lambda c: {"query_start_loc": c.query_start_loc + 1},
        "start at 0",
    ),
    "query_start_loc decreasing": (
        lambda c: {"query_start_loc": with_value(c.query_start_loc, 2, 0)},
        "q_len",
    ),
    "num_tokens mismatch": (lambda c: {"query": c.query[:-1]}, "tokens"),
    "num_reqs mismatch": (lambda c: {"seq_lens": c.seq_lens[:2]}, "num_reqs"),
    "float block table": (lambda c: {"block_tables": c.block_tables.float()}, "int32 or int64"),
    "query dtype differs from cache": (
        lambda c: {"query": c.query.to(torch.bfloat16)},
        "differs from query",
    ),
    "integer query": (lambda c: {"query": c.query.long()}, "query dtype"),
    "head size mismatch": (lambda c: {"query": c.query[..., :32]}, "head_size"),
    "heads not a multiple of kv heads": (lambda c: {"query": c.query[:, :5]}, "multiple"),
    "query not 3-D": (lambda c: {"query": c.query[0]}, "query must be"),
    "cache not 5-D": (lambda c: {"kv_cache": c.kv_cache[0]}, "kv_cache must be"),
    "cache not contiguous": (
        lambda c: {"kv_cache": c.kv_cache.transpose(3, 4)},
        "contiguous",
    ),
    "bad sliding window": (lambda c: {"sliding_window": 0}, "sliding_window"),
    "unknown impl": (lambda c: {"impl": "cuda"}, "impl"),
    "missing tensors": (lambda c: {"seq_lens": None}, "metadata"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_and_changes_nothing(case, name):
    make_overrides, match = BAD_INPUTS[name]
    overrides = make_overrides(case)
    before = {k: v.clone() for k, v in vars(case).items() if isinstance(v, torch.Tensor)}
    with pytest.raises(OpsInputError, match=match):
        call(case, **overrides)
    for k, v in before.items():
        assert torch.equal(getattr(case, k), v), k  # garbage is finite here


def test_metadata_mismatches_are_caught(case):
    md = PagedAttentionMetadata.build(
        case.block_tables, case.seq_lens, case.query_start_loc, block_size=8
    )
    with pytest.raises(OpsInputError, match="sliding_window"):
        paged_attention(case.query, case.kv_cache, metadata=md, sliding_window=4)
    with pytest.raises(OpsInputError, match="other block_tables"):
        call(case, block_tables=case.block_tables.clone(), metadata=md)
    other_cache = torch.zeros(2, case.kv_cache.shape[1], 2, 4, 64)  # block_size 4
    with pytest.raises(OpsInputError, match="block_size"):
        paged_attention(case.query, other_cache, metadata=md)
    small_pool = torch.zeros(2, 2, 2, 8, 64)
    with pytest.raises(OpsInputError, match="beyond the pool"):
        paged_attention(case.query, small_pool, metadata=md)


def test_build_checks_the_pool_size(case):
    with pytest.raises(OpsInputError, match="beyond the pool"):
        PagedAttentionMetadata.build(
            case.block_tables, case.seq_lens, case.query_start_loc, block_size=8, num_blocks=2
        )
    with pytest.raises(OpsInputError, match="block_size"):
        PagedAttentionMetadata.build(
            case.block_tables, case.seq_lens, case.query_start_loc, block_size=0
        )


@pytest.mark.parametrize("chunk_bytes", [0, -5, 1.5, True])
def test_decode_chunk_bytes_must_be_a_positive_int(chunk_bytes):
    from pagedkv.ops.backends import TorchBackend

    tables = torch.tensor([[1]], dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(OpsInputError, match="decode_chunk_bytes must be an int >= 1"):
        PagedAttentionMetadata.build(tables, lens, qsl, 16, decode_chunk_bytes=chunk_bytes)
    with pytest.raises(OpsInputError, match="decode_chunk_bytes must be an int >= 1"):
        TorchBackend("cpu", decode_chunk_bytes=chunk_bytes)
