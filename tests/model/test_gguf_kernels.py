"""pagedkv's kernels on GGUF blocks as the file stores them (gguf_blocks.c through
pagedkv.model.kernels.cpu_quant): for every type, the product in each body the CPU runs (AVX2,
and AVX-512 where the CPU has it) against the float64 product of ``gguf.quants.dequantize``'s
weights, dequantization and row lookup bit for bit against it, and the refusals."""

from __future__ import annotations

import ctypes
import warnings

import numpy as np
import pytest
import torch
from _gguf_files import kernels_or_skip
from _gguf_files import random_blocks as gguf_weight
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from pagedkv.model.kernels.cpu_quant import (
    GGML_TYPES,
    MAX_ROWS,
    CpuQuantKernels,
    KernelUnavailableError,
    load_cpu_quant_kernels,
    row_bytes,
)

EPS32 = 2.0**-24  # half an fp32 ulp of 1: one rounding's relative error
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
N = 37  # output rows: not a multiple of the kernels' 16-row blocks


@pytest.fixture(scope="module", params=["avx2", "avx512"])
def kernels(request, kernel_cache) -> CpuQuantKernels:
    """The kernels with each body of the products (AVX-512 skipped where the CPU lacks it;
    "avx2" holds an AVX-512 CPU to the AVX2 body). One build for both (tests/model/conftest.py)."""
    return kernels_or_skip(kernel_cache, request.param, "fp32")


def reference(name: str, raw: np.ndarray) -> torch.Tensor:
    """``gguf.quants.dequantize``'s fp32 weights ``[n, K]``."""
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[name]))


def min_terms(name: str, raw: np.ndarray) -> torch.Tensor:
    """Q4_K / Q5_K: ``dmin * m`` of each weight's group (``[n, K]``, fp64), the term the
    product subtracts separately (through x's group sums); zeros for the other types."""
    n = raw.shape[0]
    if name not in ("Q4_K", "Q5_K"):
        return torch.zeros(0)
    size = GGML_QUANT_SIZES[GGMLQuantizationType[name]][1]
    blocks = raw.reshape(-1, size)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
    _, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    terms = np.repeat(dmin * m.astype(np.float64), 32, axis=1)  # [blocks, 256]
    return torch.from_numpy(terms.reshape(n, -1))


def test_types_match_gguf_sizes():
    for name, t in GGML_TYPES.items():
        qtype = GGMLQuantizationType[name]
        assert t.type_id == int(qtype)
        assert (t.block_elems, t.block_bytes) == GGML_QUANT_SIZES[qtype]
        assert row_bytes(t.type_id, 2048) == 2048 // t.block_elems * t.block_bytes
    with pytest.raises(KernelUnavailableError):
        row_bytes(GGML_TYPES["Q4_K"].type_id, 896)
    with pytest.raises(KernelUnavailableError):
        row_bytes(int(GGMLQuantizationType.Q2_K), 256)


def in_features(name: str) -> list[int]:
    """256 and 2048 for every type; 896 (Qwen2.5-0.5B's width, not a multiple of 256) for
    the 32-element and float types; 100 (not a multiple of 32) for the float types."""
    sizes = [256, 2048]
    if name not in K_TYPES:
        sizes.append(896)
    if name in FLOAT_TYPES:
        sizes.append(100)
    return sizes


CASES = [(name, k) for name in GGML_TYPES for k in in_features(name)]


@pytest.mark.parametrize(("name", "k"), CASES)
def test_gemm_against_the_dequantized_product(kernels, name, k):
    """Every row count 1..8. Bound: each output within ``(K/8 + 16)`` roundings of
    ``sum |x| (|w| + 2 |dmin m|)`` (fp32 sums over at most K/8 terms per lane, the rounding
    of a group's q . x, its scaling and the lanes' sum; Q4_K / Q5_K form ``d sc q`` and
    ``dmin m`` apart, each at most ``|w| + |dmin m|``), and on average within one rounding."""
    t = GGML_TYPES[name]
    raw = gguf_weight(name, N, k, seed=k)
    dense = reference(name, raw).double()
    terms = dense.abs()
    mins = min_terms(name, raw)
    if mins.numel():
        terms = terms + 2 * mins.abs()
    w = torch.from_numpy(raw)
    gen = torch.Generator().manual_seed(k + 1)
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=gen)
        y = kernels.gguf_gemm(t.type_id, x, w, N)
        assert y.dtype == torch.float32 and y.shape == (rows, N)
        error = (y.double() - x.double() @ dense.T).abs()
        magnitude = x.double().abs() @ terms.T
        assert bool((error <= (k / 8 + 16) * EPS32 * magnitude).all()), (rows, error.max())
        assert float((error / magnitude).mean()) <= EPS32


@pytest.mark.parametrize(("name", "k"), CASES)
def test_dequant_is_bit_identical_to_gguf(kernels, name, k):
    t = GGML_TYPES[name]
    raw = gguf_weight(name, N, k, seed=k + 2)
    expected = reference(name, raw)
    w = torch.from_numpy(raw)
    out = kernels.gguf_dequant(t.type_id, w, torch.empty(N, k))
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    # a range of rows (not starting at 0), and bf16 rounded to nearest even
    part = kernels.gguf_dequant(t.type_id, w, torch.empty(20, k, dtype=torch.bfloat16), 11)
    assert torch.equal(part.view(torch.int16), expected[11:31].bfloat16().view(torch.int16))


@pytest.mark.parametrize("name", list(GGML_TYPES))
def test_get_rows_is_bit_identical_to_gguf(kernels, name):
    t = GGML_TYPES[name]
    raw = gguf_weight(name, N, 512, seed=3)
    expected = reference(name, raw)
    ids = torch.tensor([3, 0, N - 1, 3], dtype=torch.int64)
    out = kernels.gguf_get_rows(t.type_id, torch.from_numpy(raw), ids, torch.empty(4, 512))
    assert torch.equal(out.view(torch.int32), expected[ids].view(torch.int32))


def test_refusals_raise_and_leave_out_untouched(kernels):
    q4k = GGML_TYPES["Q4_K"].type_id
    w = torch.from_numpy(gguf_weight("Q4_K", N, 256, seed=4))
    x = torch.randn(MAX_ROWS + 1, 256)
    for bad_x in (x, x[:0], x[:1, :128].contiguous(), x[:2].double(), x[:2, ::2]):
        with pytest.raises(KernelUnavailableError):
            kernels.gguf_gemm(q4k, bad_x, w)
    with pytest.raises(KernelUnavailableError):
        kernels.gguf_gemm(q4k, x[:1], w, N + 1)  # N that is not the weight's
    with pytest.raises(KernelUnavailableError):
        kernels.gguf_gemm(int(GGMLQuantizationType.Q2_K), x[:1], w)  # a type not offered

    sentinel = torch.full((4, 256), 7.0)
    ids = torch.tensor([0, 1, N, 2])  # N is out of range
    out = sentinel.clone()
    with pytest.raises(KernelUnavailableError, match="ids"):
        kernels.gguf_get_rows(q4k, w, ids, out)
    assert torch.equal(out, sentinel)
    with pytest.raises(KernelUnavailableError):
        kernels.gguf_get_rows(q4k, w, torch.tensor([-1, 0, 0, 0]), out)
    assert torch.equal(out, sentinel)
    for bad_out, start in (
        (torch.full((4, 128), 7.0), 0),  # K not a multiple of 256
        (torch.full((4, 256), 7.0), N - 3),  # rows past the end
        (torch.full((4, 256), 7.0), -1),
        (torch.full((4, 256), 7.0, dtype=torch.float16), 0),
    ):
        before = bad_out.clone()
        with pytest.raises(KernelUnavailableError):
            kernels.gguf_dequant(q4k, w, bad_out, start)
        assert torch.equal(bad_out, before)


def test_the_c_entry_points_refuse_what_they_do_not_take(kernels):
    """The C side's own checks (under the Python ones): -1 and nothing written."""
    lib = ctypes.CDLL(str(kernels.path))
    q4k = GGML_TYPES["Q4_K"].type_id
    w = torch.from_numpy(gguf_weight("Q4_K", N, 256, seed=5))
    x = torch.randn(MAX_ROWS + 1, 256)
    out = torch.full((MAX_ROWS + 1, N), 7.0)
    p = ctypes.c_void_p
    i64 = ctypes.c_int64
    gemm = lib.pagedkv_gguf_gemm
    gemm.argtypes = [ctypes.c_int, p, p, p, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    for rows, k, type_id, isa in (
        (0, 256, q4k, 0),
        (MAX_ROWS + 1, 256, q4k, 0),
        (1, 128, q4k, 0),
        (1, 256, 10, 0),  # Q2_K
        (1, 256, q4k, 2),
    ):
        args = (type_id, x.data_ptr(), w.data_ptr(), out.data_ptr(), rows, N, k, 1, isa)
        assert gemm(*args) == -1
    assert bool((out == 7.0).all())
    rows = lib.pagedkv_gguf_get_rows
    rows.argtypes = [ctypes.c_int, p, p, i64, i64, i64, p]
    ids = torch.tensor([0, N])
    assert rows(q4k, w.data_ptr(), ids.data_ptr(), 2, N, 256, out.data_ptr()) == -1
    assert bool((out == 7.0).all())


def test_a_read_only_memory_map_is_read_in_place(kernels, tmp_path):
    """The weight may be the file itself, mapped read-only: the kernels never write it."""
    t = GGML_TYPES["Q6_K"]
    raw = gguf_weight("Q6_K", N, 512, seed=6)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "the array is not writable"
        w = torch.from_numpy(mapped)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(7))
    copy = torch.from_numpy(raw.copy())
    assert torch.equal(kernels.gguf_gemm(t.type_id, x, w), kernels.gguf_gemm(t.type_id, x, copy))
    out = kernels.gguf_dequant(t.type_id, w, torch.empty(N, 512))
    assert torch.equal(out, reference("Q6_K", raw))


def test_the_two_bodies_agree_up_to_rounding(kernel_cache):
    cache = kernel_cache
    try:
        wide = load_cpu_quant_kernels(cache, isa="avx512")
    except KernelUnavailableError as e:
        pytest.skip(f"no AVX-512 body here: {e}")
    narrow = load_cpu_quant_kernels(cache, isa="avx2")
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(8))
    for name, t in GGML_TYPES.items():
        w = torch.from_numpy(gguf_weight(name, N, 2048, seed=9))
        a, b = wide.gguf_gemm(t.type_id, x, w), narrow.gguf_gemm(t.type_id, x, w)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max())), name


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with sign-folded sin over the last dimension (heads in between)."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([x[..., half:], x[..., :half]], -1) * sin[:, None]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_layer_of_mixed_gguf_types(kernels, qk_norm):
    """A Q4_K_M-like layer (q, k Q4_K; v Q6_K; o Q8_0; gate Q4_K, up in pagedkv's int4
    layout; down Q6_K) through the fused calls against torch ops on the dequantized weights,
    with and without Qwen3's per-head q/k norm, at 1 and 5 rows (5: every stacked part writes
    its columns of each row)."""
    from pagedkv.model.kernels.cpu_quant import GGUFPart, LlamaLayerWeights, pack_int4

    hidden, inter, heads, kv, dim, eps = 256, 256, 4, 2, 32, 1e-5
    gen = torch.Generator().manual_seed(10)

    def gguf(name, n, k, seed):
        raw = gguf_weight(name, n, k, seed)
        w = GGUFPart(GGML_TYPES[name].type_id, torch.from_numpy(raw))
        return w, reference(name, raw)

    q, q_dense = gguf("Q4_K", heads * dim, hidden, 11)
    k, k_dense = gguf("Q4_K", kv * dim, hidden, 12)
    v, v_dense = gguf("Q6_K", kv * dim, hidden, 13)
    o, o_dense = gguf("Q8_0", hidden, heads * dim, 14)
    gate, gate_dense = gguf("Q4_K", inter, hidden, 15)
    down, down_dense = gguf("Q6_K", hidden, inter, 16)
    up_q = torch.randint(0, 16, (inter, hidden), generator=gen)
    up_scale = torch.rand(inter, hidden // 32, generator=gen) * 0.01
    up_min = torch.rand(inter, hidden // 32, generator=gen) * -0.08
    up = pack_int4(up_q, up_scale, up_min)
    up_dense = up_q.float() * up_scale.repeat_interleave(32, 1) + up_min.repeat_interleave(32, 1)

    input_norm = torch.rand(hidden, generator=gen) + 0.5
    post_norm = torch.rand(hidden, generator=gen) + 0.5
    bias = torch.randn((heads + 2 * kv) * dim, generator=gen) * 0.1
    q_norm = torch.rand(dim, generator=gen) + 0.5 if qk_norm else None
    k_norm = torch.rand(dim, generator=gen) + 0.5 if qk_norm else None
    layer = LlamaLayerWeights(
        [q, k, v],
        o,
        [gate, up],
        down,
        input_norm,
        post_norm,
        bias,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=dim,
        eps=eps,
        isa=kernels.isa,
        q_norm=q_norm,
        k_norm=k_norm,
    )
    qkv_dense = torch.cat([q_dense, k_dense, v_dense])
    gate_up_dense = torch.cat([gate_dense, up_dense])

    def close(got, want):
        assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())

    for rows in (1, 5):
        h = torch.randn(rows, hidden, generator=gen)
        angle = torch.rand(rows, dim // 2, generator=gen) * 6
        cos = torch.cat([angle.cos(), angle.cos()], -1)
        sin = torch.cat([-angle.sin(), angle.sin()], -1)
        qkv = torch.empty(rows, (heads + 2 * kv) * dim)
        kernels.llama_attn_in(layer, h, cos, sin, qkv, 1)

        ref = rms_norm(h, input_norm, eps) @ qkv_dense.T + bias
        ref_q = ref[:, : heads * dim].reshape(rows, heads, dim)
        ref_k = ref[:, heads * dim : (heads + kv) * dim].reshape(rows, kv, dim)
        if qk_norm:
            ref_q, ref_k = rms_norm(ref_q, q_norm, eps), rms_norm(ref_k, k_norm, eps)
        close(qkv[:, : heads * dim], rotate(ref_q, cos, sin).reshape(rows, -1))
        close(qkv[:, heads * dim : (heads + kv) * dim], rotate(ref_k, cos, sin).reshape(rows, -1))
        close(qkv[:, (heads + kv) * dim :], ref[:, (heads + kv) * dim :])

        attn = torch.randn(rows, heads * dim, generator=gen)
        want = h + attn @ o_dense.T
        gate_out, up_out = (rms_norm(want, post_norm, eps) @ gate_up_dense.T).split(inter, -1)
        want = want + (torch.nn.functional.silu(gate_out) * up_out) @ down_dense.T
        got = h.clone()
        kernels.llama_attn_out(layer, got, attn, 1)
        close(got, want)


def test_fused_layer_refuses_parts_that_do_not_fit(kernels):
    from pagedkv.model.kernels.cpu_quant import GGUFPart, LlamaLayerWeights

    hidden, heads, kv, dim = 256, 4, 2, 32

    def gguf(name, n, k):
        return GGUFPart(GGML_TYPES[name].type_id, torch.from_numpy(gguf_weight(name, n, k, 0)))

    def layer(qkv, o=None):
        return LlamaLayerWeights(
            qkv,
            o or gguf("Q8_0", hidden, heads * dim),
            gguf("Q4_K", 512, hidden),
            gguf("Q4_K", hidden, 256),
            torch.ones(hidden),
            torch.ones(hidden),
            None,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=dim,
            eps=1e-5,
        )

    layer([gguf("Q4_K", 128, hidden), gguf("Q4_K", 64, hidden), gguf("Q6_K", 64, hidden)])
    with pytest.raises(KernelUnavailableError, match="qkv: parts of 192 rows"):
        layer([gguf("Q4_K", 128, hidden), gguf("Q4_K", 64, hidden)])
    with pytest.raises(KernelUnavailableError, match="qkv: 4 parts"):
        layer([gguf("Q4_K", 64, hidden)] * 4)
    with pytest.raises(KernelUnavailableError, match="o:"):
        layer(gguf("Q4_K", 256, hidden), gguf("Q8_0", hidden, 96))  # 128 inputs, not 96
    with pytest.raises(KernelUnavailableError):
        layer(gguf("Q4_K", 256, hidden), gguf("Q4_K", hidden, 256))  # K 128 is no Q4_K row
