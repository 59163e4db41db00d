"""The native backend's own contract (tests/ops/test_backends.py runs it through the shared
matrix against dense attention): strided q/k/v views, its C entry points, refusals that leave
the cache as it was, the dtypes it passes over, and where it cannot be built."""

from __future__ import annotations

import pytest
import torch
from backend_cases import make_backend_case

from pagedkv.errors import OpsInputError
from pagedkv.ops.backends import AttentionLayerSpec, NativeBackend, TorchBackend


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


def within_one_rounding(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``out`` equals ``expected`` (fp64) up to fp32 arithmetic, then the output's rounding to
    ``dtype`` (bf16: half an ulp, up to 2^-8 relative)."""
    rel = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    error = (out.double() - expected).abs()
    assert bool((error <= rel * expected.abs() + 2e-5).all()), float(error.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8, 40])  # 40: more query heads than a unit's 32 rows
@pytest.mark.parametrize("threads", [1, 2])
def test_query_heads_of_a_kv_head_share_a_unit(native, dtype, group, threads):
    """With enough work for the threads, a unit takes every query head of a KV head (up to 32
    rows: tokens x heads, so keys and values are read once per group); with little (one
    decode row), its keys split into segments over the threads (one head a unit on one
    thread, or a single segment). All, with bf16 caches and models too, against fp64 dense
    attention over the same (bf16-valued) keys and values."""
    from paged_attention_cases import dense_attention

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # the last two: keys in several segments of 256, split across the threads
        for lens in (
            [(37, 1)],
            [(37, 1), (50, 1), (19, 1), (64, 1), (3, 1)] * 3,
            [(90, 45)],
            [(700, 1)],
            [(600, 7), (300, 1)],
        ):
            case = make_backend_case(
                native,
                lens,
                block_size=16,
                num_kv_heads=2,
                group=group,
                head_size=8 if group == 40 else 64,
                dtype=dtype,
                seed=group,
            )
            out = case.forward()
            assert out.dtype == dtype
            within_one_rounding(out, dense_attention(case, case.spec.scale), dtype)
    finally:
        torch.set_num_threads(before)


def test_a_bf16_cache_holds_keys_rounded_as_torch_rounds_them(native):
    """fp32 keys and values (what a bf16 model's fused layers hand the C entry points) into a
    bf16 cache: rounded to nearest even as ``.to(bfloat16)`` rounds them (ties, NaN and
    infinities included)."""
    case = make_backend_case(
        native, [(6, 6)], block_size=4, num_kv_heads=1, group=1, head_size=8, dtype=torch.bfloat16
    )
    md = native.build_metadata(case.common, case.spec)
    keys = torch.randn(6, 1, 8)
    keys[0, 0, :4] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, float("inf"), float("nan")])
    values = -keys
    cache = case.kv_cache.clone()
    native.write_kv(keys, values, cache, md)
    slots = case.common.slot_mapping.tolist()
    for t, slot in enumerate(slots):
        block, offset = divmod(slot, 4)
        for half, rows in ((0, keys), (1, values)):
            stored = cache[half, block, 0, offset]
            assert torch.equal(stored.isnan(), rows[t, 0].to(torch.bfloat16).isnan())
            finite = ~stored.isnan()
            assert torch.equal(stored[finite], rows[t, 0].to(torch.bfloat16)[finite])


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


def test_held_to_avx2_it_builds_the_avx2_kernels(tmp_path):
    """Held to AVX2 (``ATEN_CPU_CAPABILITY=avx2``), the library is the 8-lane build even on
    an AVX-512 CPU, and it still matches dense attention."""
    import os
    import subprocess
    import sys

    from pagedkv.ops import c_build

    try:
        c_build.check_avx2_fma()
    except c_build.KernelUnavailableError as e:
        pytest.skip(str(e))
    code = (
        "import sys; sys.path[:0] = ['tests/ops', 'tests/engine']\n"
        "from backend_cases import make_backend, make_backend_case\n"
        "from paged_attention_cases import dense_attention\n"
        "backend = make_backend('native')\n"
        "case = make_backend_case(backend, [(70, 1), (33, 20)], block_size=16,\n"
        "                         num_kv_heads=2, group=3, head_size=64)\n"
        "error = (case.forward().double() - dense_attention(case, case.spec.scale)).abs().max()\n"
        "print(backend.library.path.name.split('-')[0], float(error))\n"
    )
    env = {
        **os.environ,
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "PAGEDKV_CACHE_DIR": str(tmp_path),
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    name, error = done.stdout.split()
    assert name == "paged_attention" and float(error) < 2e-5
