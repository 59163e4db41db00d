"""The native backend's own contract (tests/ops/test_backends.py runs it through the shared
matrix against dense attention): strided q/k/v views, its C entry points, refusals that leave
the cache as it was, the dtypes it passes over, and where it cannot be built."""

from __future__ import annotations

import pytest
import torch
from backend_cases import make_backend, make_backend_case

from pagedkv.errors import OpsInputError
from pagedkv.ops.backends import AttentionLayerSpec, NativeBackend, TorchBackend


@pytest.fixture(scope="module")
def native():
    made = make_backend("native")
    if isinstance(made, str):
        pytest.skip(made)
    return made


def test_views_of_one_qkv_buffer_equal_contiguous_tensors(native):
    """The fused model hands q, k and v as views of one [tokens, (H + 2 KV) D] buffer."""
    case = make_backend_case(
        native, [(40, 3), (17, 1)], block_size=16, num_kv_heads=2, group=3, head_size=64
    )
    md = native.build_metadata(case.common, case.spec)
    tokens, heads, kv_heads, dim = case.query.shape[0], 6, 2, 64
    buffer = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q, k, v = buffer.view(tokens, heads + 2 * kv_heads, dim).split((heads, kv_heads, kv_heads), 1)
    assert not q.is_contiguous()
    strided_cache, dense_cache = case.kv_cache.clone(), case.kv_cache.clone()
    native.write_kv(k, v, strided_cache, md, validate=True)
    native.write_kv(k.contiguous(), v.contiguous(), dense_cache, md, validate=True)
    assert torch.equal(strided_cache, dense_cache)
    out = native.forward(q, strided_cache, md, validate=True)
    assert torch.equal(out, native.forward(q.contiguous(), dense_cache, md, validate=True))


@pytest.mark.parametrize("block_size,window", [(16, None), (16, 100), (5, None), (64, 70)])
def test_long_prompts_in_one_step(native, block_size, window):
    """The kernel's prefill path: chunks of 32 query rows, pieces of 64 keys across blocks
    (8 keys at a time where they lie in one block, one at a time where they do not), windows
    that start inside a piece; beside decode rows in the same step."""
    from paged_attention_cases import dense_attention

    case = make_backend_case(
        native,
        [(700, 700), (451, 300), (90, 1), (333, 67)],
        block_size=block_size,
        num_kv_heads=3,
        group=3,
        head_size=64,
        sliding_window=window,
    )
    out = case.forward()
    expected = dense_attention(case, case.spec.scale, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


def test_c_entry_points(native):
    case = make_backend_case(native, [(9, 2)], block_size=4, num_kv_heads=1, group=2, head_size=8)
    md = native.build_metadata(case.common, case.spec)
    entry = native.c_attention(md, case.kv_cache)
    assert entry.k_cache == case.kv_cache[0].data_ptr()
    assert entry.v_cache == case.kv_cache[1].data_ptr()
    assert entry.step == md.step_address and entry.write_kv and entry.attention
    torch_backend = TorchBackend()
    torch_md = torch_backend.build_metadata(case.common, case.spec)
    assert torch_backend.c_attention(torch_md, case.kv_cache) is None


def test_a_refused_write_leaves_the_cache_as_it_was(native):
    case = make_backend_case(native, [(9, 2)], block_size=4, num_kv_heads=1, group=2, head_size=8)
    md = native.build_metadata(case.common, case.spec)
    before = case.kv_cache.clone()
    three = torch.randn(3, 1, 8)  # three tokens, two slots
    with pytest.raises(OpsInputError, match="one slot per token"):
        native.write_kv(three, three, case.kv_cache, md)
    with pytest.raises(OpsInputError):
        native.write_kv(three, three, case.kv_cache, md, validate=True)
    two = torch.randn(2, 1, 8, dtype=torch.float16)
    with pytest.raises(OpsInputError, match="float32 or bfloat16"):
        native.write_kv(two, two, case.kv_cache, md)
    with pytest.raises(OpsInputError, match="float32 or bfloat16 rows"):
        native.forward(case.query[:1], case.kv_cache, md)
    assert torch.equal(case.kv_cache, before)


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "head_size", "says"),
    [
        (torch.float16, None, 64, "runs float32 and bfloat16"),
        (torch.float32, torch.float8_e4m3fn, 64, "runs float32 and bfloat16"),
        (torch.float32, None, 12, "multiple of 8"),
        (torch.float32, None, 1024, "up to 512"),
    ],
)
def test_what_it_passes_over(native, dtype, kv_cache_dtype, head_size, says):
    spec = AttentionLayerSpec(
        num_heads=2,
        num_kv_heads=1,
        head_size=head_size,
        block_size=16,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    assert says in native.unsupported_reason(spec)


def test_unavailable_without_a_compiler(monkeypatch, tmp_path):
    from pagedkv.ops import c_build

    monkeypatch.setattr(c_build, "check_avx2_fma", lambda caps=None: None)  # any CPU
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert "no C compiler" in NativeBackend.unavailable_reason("cpu")
    assert NativeBackend.unavailable_reason("cuda") == "runs on the CPU, not cuda"
