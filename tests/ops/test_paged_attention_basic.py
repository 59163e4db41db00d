import pytest
import torch
from paged_attention_cases import dense_attention, make_case

from pagedkv.ops import PagedAttentionMetadata, paged_attention


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize(
    "seq_q_lens",
    [
        [(17, 1), (16, 1), (15, 1), (1, 1)],  # decode
        [(40, 40), (33, 9)],  # prefill, prefill after prefix hit
        [(17, 1), (40, 7), (5, 1), (32, 32)],  # mixed
    ],
)
def test_matches_dense_fp32(impl, seq_q_lens):
    case = make_case(seq_q_lens, block_size=16, num_kv_heads=3, group=3, head_size=64)
    out = paged_attention(
        case.query,
        case.kv_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        0.125,
        impl=impl,
    )
    torch.testing.assert_close(out.double(), dense_attention(case, 0.125), atol=1e-5, rtol=1e-5)


def test_metadata_reused_across_layers():
    case = make_case([(30, 1), (20, 5)], block_size=8, num_kv_heads=2, group=4, head_size=64)
    md = PagedAttentionMetadata.build(
        case.block_tables, case.seq_lens, case.query_start_loc, block_size=8
    )
    for _ in range(2):
        out = paged_attention(case.query, case.kv_cache, metadata=md, scale=0.125)
        torch.testing.assert_close(out.double(), dense_attention(case, 0.125), atol=1e-5, rtol=1e-5)
