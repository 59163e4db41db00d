"""The int8-activation products of GGUF weights (gguf_blocks.c's ``pagedkv_gguf_gemm_q8``,
``CpuQuantKernels(activations="q8")``): each quantized type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K) at every row count 1..8
against the float64 product of ``gguf.quants.dequantize``'s weights with the activations
rounded the same way in numpy (blocks of 32; the K-types' small and batch-invariant products
blocks of 256; equal up to fp32 summation), and against the plain float64 product within the
activations' rounding; the fused layer on int8 activations against torch ops; the refusals
and the fp32 fall-back of the other types."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from _gguf_files import kernels_or_skip
from _gguf_files import random_blocks as gguf_weight
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from pagedkv.model.kernels.cpu_quant import (
    GGML_TYPES,
    MAX_ROWS,
    Q8_ISA_CODES,
    Q8_TYPES,
    CpuQuantKernels,
    GGUFPart,
    KernelUnavailableError,
    LlamaLayerWeights,
    load_cpu_quant_kernels,
)

EPS32 = 2.0**-24  # half an fp32 ulp of 1
K_NAMES = ("Q4_K", "Q5_K", "Q6_K")  # their small products round activations in blocks of 256
Q8_NAMES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
N = 37  # output rows: not a multiple of the kernels' 16-row blocks


@pytest.fixture(scope="module", params=["avx2", "avx512"])
def kernels(request, kernel_cache) -> CpuQuantKernels:
    """The kernels with int8 activations, each ISA: "avx2" runs the AVX2 body of the q8
    products, "avx512" the AVX-512 VNNI one where the CPU has it (else the AVX2 one again;
    skipped where the CPU lacks AVX-512 or a hold caps it). The session's one build."""
    return kernels_or_skip(kernel_cache, request.param, "q8")


def dense(name: str, raw: np.ndarray) -> torch.Tensor:
    """``gguf.quants.dequantize``'s weights as float64 ``[n, K]``."""
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[name])).double()


def min_terms(name: str, raw: np.ndarray) -> torch.Tensor:
    """The offset of each weight's group that the product takes through the activation
    blocks' sums, ``|m|`` (Q4_1, Q5_1) or ``|dmin * m_j|`` (Q4_K, Q5_K), float64 ``[n, K]``;
    empty for the types without one."""
    n = raw.shape[0]
    if name in ("Q4_1", "Q5_1"):
        blocks = raw.reshape(-1, 20 if name == "Q4_1" else 24)
        m = np.abs(blocks[:, 2:4].copy().view(np.float16).astype(np.float64))
        return torch.from_numpy(np.repeat(m, 32, 1).reshape(n, -1))
    if name not in ("Q4_K", "Q5_K"):
        return torch.zeros(0)
    blocks = raw.reshape(-1, 144 if name == "Q4_K" else 176)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
    _, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return torch.from_numpy(np.repeat(np.abs(dmin * m.astype(np.float64)), 32, 1).reshape(n, -1))


def act_block(name: str) -> int:
    """The activation block of a type's small (and batch-invariant) int8 product: 256 for the
    K-types (Q8_K-style, one per weight super-block), else 32."""
    return 256 if name in K_NAMES else 32


def quantize_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' rounding of fp32 ``x [M, K]`` in numpy: per block of ``block`` elements
    (32, or the K-types' 256), ``d = max|x| / 127`` (fp32), ``q = rint(x * (1 / d))`` (fp32,
    nearest even; 0 where d is 0). Returns ``(q, d)``: float64 ``[M, K]`` integers in
    [-127, 127] and float64 ``[M, K / block]``."""
    blocks = x.numpy().reshape(x.shape[0], -1, block)
    d = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.zeros_like(d)
    inv[d != 0] = np.float32(1) / d[d != 0]
    q = np.rint(blocks * inv[..., None])
    assert q.dtype == np.float32 and np.abs(q).max() <= 127
    return torch.from_numpy(q.reshape(x.shape)).double(), torch.from_numpy(d).double()


def check_rounded_product(y, x, w, terms, k, block=32) -> tuple[torch.Tensor, torch.Tensor]:
    """Assert the product ``y`` of x's int8 rounding (blocks of ``block``) and the dequantized
    ``w`` is within fp32 summation error of the float64 one (``terms``: each weight's
    magnitude); returns each activation's scale ``[M, K]`` (its block's) and the slack allowed
    per output."""
    q, d = quantize_activations(x, block)
    d = d.repeat_interleave(block, 1)
    x_hat = q * d
    error = (y.double() - x_hat @ w.T).abs()
    magnitude = x_hat.abs() @ terms.T
    slack = (k / 8 + 16) * EPS32 * magnitude
    assert bool((error <= slack).all()), (x.shape[0], float(error.max()))
    assert float((error / magnitude).mean()) <= EPS32, x.shape[0]
    return d, slack


@pytest.mark.parametrize("k", [256, 2048, 288])
@pytest.mark.parametrize("name", Q8_NAMES)
def test_q8_product_against_the_rounded_activations(kernels, name, k):
    """Every row count 1..8 (K 288: an odd number of 32-element blocks, the VNNI body's lone
    last block), with a zero block and a block of one large value among the
    activations. (1) Against x rounded the same way in numpy times the dequantized weights in
    float64: within ``K/8 + 16`` fp32 roundings of ``sum |x_hat| (|w| + 2 |dmin m|)`` (as the
    fp32 product's bound) and on average within one. (2) Against the exact product with x:
    within ``sum_k |w_k| * d_block / 2`` (each activation off by at most half its block's
    step: blocks of 32, the K-types' of 256) plus that fp32 slack."""
    t = GGML_TYPES[name]
    if k % t.block_elems:
        pytest.skip(f"{name} rows are whole blocks of {t.block_elems}")
    raw = gguf_weight(name, N, k, seed=k + len(name))
    w = dense(name, raw)
    terms = w.abs()
    mins = min_terms(name, raw)
    if mins.numel():
        terms = terms + 2 * mins
    gen = torch.Generator().manual_seed(k)
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=gen)
        x[0, 32:64] = 0.0  # a block of zeros: scale 0
        x[-1, 64] = 50.0  # one value dominating its block
        y = kernels.gguf_gemm(t.type_id, x, torch.from_numpy(raw), N)
        assert y.dtype == torch.float32 and y.shape == (rows, N)
        d, slack = check_rounded_product(y, x, w, terms, k, act_block(name))

        exact_error = (y.double() - x.double() @ w.T).abs()
        rounding = (d / 2) @ w.abs().T
        assert bool((exact_error <= rounding * (1 + 1e-5) + slack).all()), rows


@pytest.mark.parametrize("name", K_NAMES)
def test_k_types_at_the_integer_extremes(kernels, name):
    """The K-types' super-block sums in int32 (blocks of 256) at their bounds: every code its
    largest (Q4_K 15, Q5_K 31, Q6_K 63, and Q6_K's 0, the -32 of the offset), every scale and
    min its largest (63; Q6_K's -128 and 127), activations of +-127 (scale 1, rounded exactly),
    one row of each sign and one alternating: no 16-bit pair sum saturates and the result is
    the float64 product up to the fp32 conversion of the super-block's integer (2^-24
    relative), at every row count."""
    t = GGML_TYPES[name]
    n, k = 5, 512
    blocks = np.zeros((n, k // 256, t.block_bytes), dtype=np.uint8)
    eighth = np.array([0.125], dtype=np.float16).view(np.uint8)
    if name == "Q6_K":
        blocks[..., :192] = 0xFF  # ql, qh: q = 63
        blocks[1::2, :, :192] = 0x00  # q = 0: w = -32 d scale
        blocks[..., 192:208] = np.array([0x80, 0x7F] * 8, dtype=np.uint8)  # scales -128, 127
        blocks[..., 208:210] = eighth
    else:
        blocks[..., 0:2] = eighth
        blocks[..., 2:4] = eighth
        blocks[..., 4:] = 0xFF  # scales and mins 63, qh all set, nibbles 15
    raw = blocks.reshape(n, -1)
    w = dense(name, raw)
    x = torch.full((MAX_ROWS, k), 127.0)
    x[1] = -127.0
    x[2, ::2] = -127.0
    for rows in range(1, MAX_ROWS + 1):
        y = kernels.gguf_gemm(t.type_id, x[:rows].contiguous(), torch.from_numpy(raw), n)
        want = x[:rows].double() @ w.T
        magnitude = x[:rows].abs().double() @ w.abs().T
        assert bool(((y.double() - want).abs() <= 4 * EPS32 * magnitude).all()), rows


def test_the_ld_entry_writes_strided_rows_and_the_bodies_agree(kernels):
    """``pagedkv_gguf_gemm_q8_ld`` writes rows ``ldo`` apart and nothing between them; the
    result equals the unstrided call bit for bit; the AVX-512 code runs the AVX2 body
    (identical results) and the VNNI body, where the CPU has it, agrees with it up to fp32
    summation."""
    lib = ctypes.CDLL(str(kernels.path))
    entry = lib.pagedkv_gguf_gemm_q8_ld
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    entry.argtypes = [ctypes.c_int, p, p, p, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    t = GGML_TYPES["Q6_K"]
    raw = torch.from_numpy(gguf_weight("Q6_K", N, 512, seed=1))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))

    def call(out, isa):
        return entry(
            t.type_id, x.data_ptr(), raw.data_ptr(), out.data_ptr(), 3, N, 512, N + 5, 1, isa
        )

    out = torch.full((3, N + 5), 7.0)
    assert call(out, Q8_ISA_CODES[kernels.q8_isa]) == 0
    assert torch.equal(out[:, :N], kernels.gguf_gemm(t.type_id, x, raw))
    assert bool((out[:, N:] == 7.0).all())
    avx2 = torch.full((3, N + 5), 7.0)
    assert call(avx2, 0) == 0
    other = torch.full((3, N + 5), 7.0)
    assert call(other, 1) == 0
    assert torch.equal(other, avx2)
    if kernels.q8_isa == "avx512_vnni":
        assert torch.allclose(out, avx2, rtol=1e-5, atol=1e-5 * float(avx2.abs().max()))


@pytest.mark.parametrize("name", Q8_NAMES)
def test_large_steps_are_the_small_steps_products_row_by_row(kernels, name):
    """``gguf_gemm_large`` (more than 8 rows, rounded to int8 once, groups of 8 rows over
    blocks of 64 weight rows) gives each row bit for bit what the 8-row AVX2 product gives it,
    for row counts that do and do not fill the last group; and a GGUFMatmul of that many rows
    takes it where ``q8_large_max_rows`` allows and ``gguf_gemm_fast`` does not (Q8_0 on the
    AVX2 body)."""
    from pagedkv.model.gguf_weight import GGUFMatmul, GGUFWeight

    avx2 = CpuQuantKernels(kernels.path, isa="avx2", activations="q8", q8_isa="avx2")
    t = GGML_TYPES[name]
    k = 512
    n = 150  # more than two blocks of 64 weight rows, the last one partial
    raw = torch.from_numpy(gguf_weight(name, n, k, seed=11 + len(name)))
    gen = torch.Generator().manual_seed(5)
    for rows in (9, 20, 64):
        x = torch.randn(rows, k, generator=gen)
        big = kernels.gguf_gemm_large(t.type_id, x, raw)
        small = torch.cat(
            [
                avx2.gguf_gemm(t.type_id, x[i : i + MAX_ROWS].contiguous(), raw)
                for i in range(0, rows, MAX_ROWS)
            ]
        )
        assert torch.equal(big, small), (name, rows)
    matmul = GGUFMatmul([GGUFWeight(name, raw, (n, k), kernels)])
    x = torch.randn(20, k, generator=gen)
    assert kernels.q8_large_max_rows >= 20
    if kernels.takes_fast_large(t.type_id, 20, torch.float32):
        assert torch.equal(matmul(x), kernels.gguf_gemm_fast(t.type_id, x, raw))
    else:
        assert name == "Q8_0" and kernels.q8_isa == "avx2"  # maddubs' int16 would overflow
        assert torch.equal(matmul(x), kernels.gguf_gemm_large(t.type_id, x, raw))
    with pytest.raises(KernelUnavailableError):
        kernels.gguf_gemm_large(GGML_TYPES["F16"].type_id, x, raw)


def test_float_types_keep_the_fp32_product(kernels):
    """F16, BF16 and F32 (not among :data:`Q8_TYPES`) give in q8 mode what the fp32 mode
    gives."""
    fp32 = CpuQuantKernels(kernels.path, isa=kernels.isa, activations="fp32")
    assert fp32.activations == "fp32" and kernels.activations == "q8"
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    values = torch.randn(N, 256, generator=torch.Generator().manual_seed(4))
    for name, raw in (
        ("F16", values.half().view(torch.uint8)),
        ("BF16", values.bfloat16().view(torch.uint8)),
        ("F32", values.view(torch.uint8)),
    ):
        type_id = GGML_TYPES[name].type_id
        assert type_id not in Q8_TYPES
        raw = raw.contiguous()
        assert torch.equal(kernels.gguf_gemm(type_id, x, raw), fp32.gguf_gemm(type_id, x, raw))


def test_refusals(kernels, tmp_path):
    """The C entry's -1 (and nothing written) for a type outside :data:`Q8_TYPES`, M outside 1..8, K
    not a multiple of the block, ldo < N, an unknown ISA; unknown ``activations`` names."""
    lib = ctypes.CDLL(str(kernels.path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    gemm = lib.pagedkv_gguf_gemm_q8
    gemm.argtypes = [ctypes.c_int, p, p, p, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    ld = lib.pagedkv_gguf_gemm_q8_ld
    ld.argtypes = [ctypes.c_int, p, p, p, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    takes = lib.pagedkv_gguf_q8_takes
    takes.argtypes = [ctypes.c_int]
    # and Q2_K, Q3_K; and the interleaved Q4_0_X8, Q4_1_X8
    ids = [t.type_id for t in GGML_TYPES.values()] + [10, 11, 0x102, 0x103]
    assert {i for i in ids if takes(i)} == set(Q8_TYPES)
    q4k = GGML_TYPES["Q4_K"].type_id
    raw = torch.from_numpy(gguf_weight("Q4_K", N, 256, seed=4))
    x = torch.randn(MAX_ROWS + 1, 256)
    out = torch.full((MAX_ROWS + 1, N), 7.0)
    for rows, k, type_id, isa in (
        (0, 256, q4k, 0),
        (MAX_ROWS + 1, 256, q4k, 0),
        (1, 128, q4k, 0),
        (1, 256, GGML_TYPES["F16"].type_id, 0),
        (1, 256, GGML_TYPES["F32"].type_id, 0),
        (1, 256, 10, 0),  # Q2_K
        (1, 256, q4k, 3),
    ):
        args = (type_id, x.data_ptr(), raw.data_ptr(), out.data_ptr(), rows, N, k, 1, isa)
        assert gemm(*args) == -1
    assert ld(q4k, x.data_ptr(), raw.data_ptr(), out.data_ptr(), 1, N, 256, N - 1, 1, 0) == -1
    assert bool((out == 7.0).all())
    with pytest.raises(KernelUnavailableError):
        kernels.gguf_gemm(q4k, x, raw)  # 9 rows
    with pytest.raises(KernelUnavailableError, match="activations"):
        CpuQuantKernels(kernels.path, activations="int4")
    with pytest.raises(KernelUnavailableError, match="activations"):
        load_cpu_quant_kernels(tmp_path, activations="fp16")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with sign-folded sin over the last dimension (heads in between)."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([x[..., half:], x[..., :half]], -1) * sin[:, None]


def fused_layer(weights, norms, shape, isa, activations) -> LlamaLayerWeights:
    """A fused layer without bias: ``weights`` (qkv parts, o, gate_up parts, down), ``norms``
    (input, post-attention), ``shape`` (heads, kv heads, head dim, eps)."""
    (qkv, o, gate_up, down), (heads, kv, dim, eps) = weights, shape
    return LlamaLayerWeights(
        qkv, o, gate_up, down, *norms, None, num_heads=heads, num_kv_heads=kv, head_dim=dim,
        eps=eps, isa=isa, activations=activations,
    )  # fmt: skip


#: Each product's part types of a layer: Q4_K_M-like, and the other quantized types.
LAYER_MIXES = {
    "q4_k_m": ("Q4_K", "Q4_K", "Q6_K", "Q8_0", "Q4_K", "Q4_0", "Q6_K"),
    "q5_q4_1": ("Q5_K", "Q5_0", "Q5_1", "Q4_1", "Q5_K", "Q5_1", "Q4_1"),
    "k_types": ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_K", "Q6_K", "Q5_K"),
}


@pytest.mark.parametrize("mix", sorted(LAYER_MIXES))
def test_fused_layer_on_int8_activations(kernels, mix):
    """A layer of mixed types (:data:`LAYER_MIXES`: q, k, v; o; gate, up; down), e.g.
    Q4_K_M-like (q, k Q4_K; v Q6_K; o Q8_0; gate Q4_K, up Q4_0; down Q6_K), with
    ``activations="q8"`` through the fused calls against torch ops on the dequantized weights
    (fp32 activations): within a few per cent of the output's scale (the activations' int8
    rounding), at 1 and 5 rows; and the same layer with ``activations="fp32"`` differs from
    it (the flag reaches the C side)."""
    hidden, inter, heads, kv, dim, eps = 256, 256, 4, 2, 32, 1e-5
    gen = torch.Generator().manual_seed(10)

    def gguf(name, n, k, seed):
        raw = gguf_weight(name, n, k, seed)
        return GGUFPart(GGML_TYPES[name].type_id, torch.from_numpy(raw)), dense(name, raw).float()

    tq, tk, tv, to, tg, tu, td = LAYER_MIXES[mix]
    q, q_dense = gguf(tq, heads * dim, hidden, 11)
    k, k_dense = gguf(tk, kv * dim, hidden, 12)
    v, v_dense = gguf(tv, kv * dim, hidden, 13)
    o, o_dense = gguf(to, hidden, heads * dim, 14)
    gate, gate_dense = gguf(tg, inter, hidden, 15)
    up, up_dense = gguf(tu, inter, hidden, 16)
    down, down_dense = gguf(td, hidden, inter, 17)
    input_norm = torch.rand(hidden, generator=gen) + 0.5
    post_norm = torch.rand(hidden, generator=gen) + 0.5

    def layer(activations):
        return fused_layer(
            ([q, k, v], o, [gate, up], down), (input_norm, post_norm), (heads, kv, dim, eps),
            kernels.isa, activations,
        )  # fmt: skip

    q8_layer, fp32_layer = layer("q8"), layer("fp32")
    qkv_dense = torch.cat([q_dense, k_dense, v_dense])
    gate_up_dense = torch.cat([gate_dense, up_dense])

    def close(got, want):
        assert float((got - want).abs().max()) <= 0.03 * float(want.abs().max())

    for rows in (1, 5):
        h = torch.randn(rows, hidden, generator=gen)
        angle = torch.rand(rows, dim // 2, generator=gen) * 6
        cos = torch.cat([angle.cos(), angle.cos()], -1)
        sin = torch.cat([-angle.sin(), angle.sin()], -1)
        qkv = torch.empty(rows, (heads + 2 * kv) * dim)
        kernels.llama_attn_in(q8_layer, h, cos, sin, qkv, 1)
        ref = rms_norm(h, input_norm, eps) @ qkv_dense.T
        ref_q = ref[:, : heads * dim].reshape(rows, heads, dim)
        ref_k = ref[:, heads * dim : (heads + kv) * dim].reshape(rows, kv, dim)
        close(qkv[:, : heads * dim], rotate(ref_q, cos, sin).reshape(rows, -1))
        close(qkv[:, heads * dim : (heads + kv) * dim], rotate(ref_k, cos, sin).reshape(rows, -1))
        close(qkv[:, (heads + kv) * dim :], ref[:, (heads + kv) * dim :])
        exact = torch.empty_like(qkv)
        kernels.llama_attn_in(fp32_layer, h, cos, sin, exact, 1)
        assert not torch.equal(exact, qkv)

        attn = torch.randn(rows, heads * dim, generator=gen)
        want = h + attn @ o_dense.T
        gate_out, up_out = (rms_norm(want, post_norm, eps) @ gate_up_dense.T).split(inter, -1)
        mlp = (torch.nn.functional.silu(gate_out) * up_out) @ down_dense.T
        got = h.clone()
        kernels.llama_attn_out(q8_layer, got, attn, 1)
        close(got - h, want - h + mlp)


@pytest.mark.parametrize("inter", [256, 260])
def test_fused_swiglu_against_torchs_silu(kernels, inter):
    """The fused layer's SwiGLU (decode_layer.c ``swiglu``: 8 lanes at a time on its own exp,
    a tail on libm's ``expf``) value by value against torch's ``silu(gate) * up`` on the
    layer's own gate and up products, gate values past -100 and 100 (where e^-gate leaves the
    float range both ways: silu is -0 below about -88.7), at an intermediate size with a tail
    of 4 (260). The MLP weights are F32 (exact fp32 products, any size) and down is the
    identity, so the residual stream takes each value as it is; the residual is zero at the
    even positions (the norm sees the odd ones), where the layer's output is then the SwiGLU
    value itself, tiny ones and zeros included: within 8 ulp of torch's (denormals: 1e-44)."""
    hidden, heads, kv, dim, eps = inter, 4, 2, 32, 0.0
    gen = torch.Generator().manual_seed(12)

    def f32(w):
        return GGUFPart(GGML_TYPES["F32"].type_id, w.contiguous().view(torch.uint8))

    def rand(n, k):
        return f32(torch.randn(n, k, generator=gen) / k**0.5)

    h = torch.randn(4, hidden, generator=gen)
    h[:, ::2] = 0.0
    gate_w = torch.randn(inter, hidden, generator=gen)
    up_w = torch.randn(inter, hidden, generator=gen)
    x = kernels.rms_norm(h, torch.ones(hidden), eps)
    g = x @ gate_w.T
    gate_w *= 100.0 / min(-float(g.min()), float(g.max()))  # gate values past +-100
    gate, up = f32(gate_w), f32(up_w)
    qkv = [rand(heads * dim, hidden), rand(kv * dim, hidden), rand(kv * dim, hidden)]
    layer = fused_layer(
        (qkv, rand(hidden, heads * dim), [gate, up], f32(torch.eye(hidden))),
        (torch.ones(hidden), torch.ones(hidden)), (heads, kv, dim, eps), kernels.isa, "fp32",
    )  # fmt: skip
    gate_out = kernels.gguf_gemm(gate.type_id, x, gate.data)
    up_out = kernels.gguf_gemm(up.type_id, x, up.data)
    assert float(gate_out.min()) < -89 and float(gate_out.max()) > 89
    want = (torch.nn.functional.silu(gate_out) * up_out)[:, ::2].double()
    got = h.clone()
    kernels.llama_attn_out(layer, got, torch.zeros(4, heads * dim), 1)
    err = (got[:, ::2].double() - want).abs()
    assert bool((err <= 8 * 2.0**-24 * want.abs() + 1e-44).all()), float(err.max())
    assert int((want == 0).sum()) > 0  # some gates past where silu is -0


@pytest.mark.parametrize("k", [256, 2048, 288])
@pytest.mark.parametrize("name", Q8_NAMES)
def test_fast_large_product_against_the_rounded_activations(kernels, name, k):
    """``gguf_gemm_fast`` (the default engine's large steps, each body: each weight group's
    integer dot summed whole) against x rounded the same way in numpy times the dequantized
    weights in float64, within the bound of the small products' test, for row counts that do
    and do not fill its groups of rows (1, 9, 20, 64), N not a multiple of its tiles and K
    with a lone last block (288); and within a few fp32 roundings of ``gguf_gemm_large`` on
    the same body (the K-types: within the two roundings of the activations, ``gguf_gemm_fast``
    keeping blocks of 32 where ``gguf_gemm_large`` takes the decode step's 256). Q8_0 on the
    AVX2 body is refused (KernelUnavailableError), as F16 is."""
    t = GGML_TYPES[name]
    if k % t.block_elems:
        pytest.skip(f"{name} rows are whole blocks of {t.block_elems}")
    raw = gguf_weight(name, N, k, seed=k + 3 * len(name))
    x0 = torch.randn(2, k)
    if t.type_id not in kernels.fast_large_rows:
        assert name == "Q8_0" and kernels.q8_isa == "avx2"
        with pytest.raises(KernelUnavailableError):
            kernels.gguf_gemm_fast(t.type_id, x0, torch.from_numpy(raw))
        return
    w = dense(name, raw)
    terms = w.abs()
    mins = min_terms(name, raw)
    if mins.numel():
        terms = terms + 2 * mins
    gen = torch.Generator().manual_seed(k + 1)
    for rows in (1, 9, 20, 64):
        x = torch.randn(rows, k, generator=gen)
        x[0, 32:64] = 0.0  # a block of zeros: scale 0
        x[-1, 64] = 50.0  # one value dominating its block
        y = kernels.gguf_gemm_fast(t.type_id, x, torch.from_numpy(raw))
        assert y.dtype == torch.float32 and y.shape == (rows, N)
        d32, slack = check_rounded_product(y, x, w, terms, k)
        large = kernels.gguf_gemm_large(t.type_id, x, torch.from_numpy(raw), kernels.q8_isa)
        if name in K_NAMES:  # the large product's blocks of 256: both within their rounding
            d256, slack256 = check_rounded_product(large, x, w, terms, k, 256)
            apart = ((d32 + d256) / 2) @ w.abs().T * (1 + 1e-5) + slack + slack256
        else:
            apart = 2 * slack
        assert bool(((y - large).double().abs() <= apart).all()), rows
    with pytest.raises(KernelUnavailableError):
        kernels.gguf_gemm_fast(GGML_TYPES["F16"].type_id, x0, torch.from_numpy(raw))


def test_large_steps_pick_the_fast_product_per_part(kernels):
    """A GGUFMatmul of stacked parts (a Q4_K and a Q6_K weight, as a Q4_K_M file's q/k/v)
    runs each part of a large step on ``gguf_gemm_fast`` up to its type's
    ``fast_large_rows`` and on the tiles beyond, and stacks their columns in order: at 100
    rows (past Q6_K's limit, within Q4_K's) the Q4_K columns are the fast product's bits and
    the Q6_K ones the tiles', and the whole stays within the activations' rounding of the
    float64 product."""
    from pagedkv.model.gguf_weight import GGUFMatmul, GGUFWeight

    if kernels.q8_isa != "avx512_vnni":
        pytest.skip("no VNNI body here: its per-type row limits do not apply")
    k = 512
    q4 = GGUFWeight("Q4_K", torch.from_numpy(gguf_weight("Q4_K", 40, k, seed=3)), (40, k), kernels)
    q6 = GGUFWeight("Q6_K", torch.from_numpy(gguf_weight("Q6_K", 24, k, seed=4)), (24, k), kernels)
    rows = 100
    assert kernels.fast_large_rows[q6.type_id] < rows <= kernels.fast_large_rows[q4.type_id]
    matmul = GGUFMatmul([q4, q6])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(6))
    got = matmul(x)
    assert got.shape == (rows, 64) and got.dtype == torch.float32
    assert torch.equal(got[:, :40], kernels.gguf_gemm_fast(q4.type_id, x, q4.data))
    assert torch.equal(got[:, 40:], matmul._tiled(x, (q6,)))
    w = torch.cat([dense("Q4_K", q4.data.numpy()), dense("Q6_K", q6.data.numpy())])
    _, d = quantize_activations(x)
    rounding = (d.repeat_interleave(32, 1) / 2) @ w.abs().T  # the fast product's blocks of 32
    error = (got.double() - x.double() @ w.T).abs()
    assert bool((error <= rounding * 1.01 + 1e-4 * float(error.new_tensor(1.0))).all())


@pytest.mark.parametrize(
    "types",
    [
        ("Q4_K", "Q5_K", "Q6_K"),
        ("Q6_K", "Q4_K", "Q4_K"),
        ("Q4_K", "Q5_0", "Q6_K"),
        ("Q4_1", "Q4_1", "Q4_1"),
        ("Q8_0", "Q5_0", "Q5_1"),
        ("Q4_0", "Q4_1", "Q6_K"),
    ],
)
@pytest.mark.parametrize("hidden", [512, 576])
def test_stacked_parts_are_each_parts_product(kernels, types, hidden):
    """The fused layer's q, k, v (three stacked parts) on int8 activations are, bit for bit,
    each part's own product of the layer's normed input: parts all of the K-types share one
    rounding and one parallel region (gguf_blocks.c ``pagedkv_gguf_gemm_q8k_parts``), and so
    do parts all of the 32-element types (``pagedkv_gguf_gemm_q8v_parts``, either body;
    SmolLM2's Q4_1 q, k, v, at its width 576 too), a mix runs part by part. 1, 3 and 8
    tokens, 1 and 2 threads; the rotation is the identity (cos 1, sin 0) so the products are
    read as they are."""
    if hidden % 256 and any(t in K_NAMES for t in types):
        pytest.skip("K-type rows are whole blocks of 256")
    heads, kv, dim, eps = 16, 11, 2, 1e-5
    gen = torch.Generator().manual_seed(21)
    sizes = (heads * dim, kv * dim, kv * dim)
    parts = [
        GGUFPart(GGML_TYPES[t].type_id, torch.from_numpy(gguf_weight(t, n, hidden, 30 + i)))
        for i, (t, n) in enumerate(zip(types, sizes, strict=True))
    ]

    def square(n, k, seed):
        return GGUFPart(
            GGML_TYPES["Q8_0"].type_id, torch.from_numpy(gguf_weight("Q8_0", n, k, seed))
        )

    input_norm = torch.rand(hidden, generator=gen) + 0.5
    weights = (
        parts,
        square(hidden, heads * dim, 40),
        [square(512, hidden, 41)],
        square(hidden, 256, 42),
    )
    layer = fused_layer(weights, (input_norm, input_norm), (heads, kv, dim, eps), kernels.isa, "q8")
    for rows in (1, 3, 8):
        h = torch.randn(rows, hidden, generator=gen)
        x = kernels.rms_norm(h, input_norm, eps)
        want = torch.cat([kernels.gguf_gemm(p.type_id, x, p.data) for p in parts], dim=1)
        for threads in (1, 2):
            qkv = torch.full((rows, sum(sizes)), float("nan"))
            kernels.llama_attn_in(
                layer, h, torch.ones(rows, dim), torch.zeros(rows, dim), qkv, threads
            )
            assert torch.equal(qkv, want), (rows, threads)


def test_decode_rows_in_pairs_are_each_rows_product(kernels):
    """A decode step's Q4_K product (one token) takes its weight rows two at a time on the VNNI
    body: each row's result is bit for bit the row's product alone, an odd count's last row
    included, and the same at every row count (the batch-invariant property). The AVX2 body,
    one row at a time, is held to the same."""
    w = torch.from_numpy(gguf_weight("Q4_K", 37, 2048, 50))
    x = torch.randn(8, 2048, generator=torch.Generator().manual_seed(51))
    type_id = GGML_TYPES["Q4_K"].type_id
    whole = kernels.gguf_gemm(type_id, x[:1].contiguous(), w)
    alone = torch.cat(
        [kernels.gguf_gemm(type_id, x[:1].contiguous(), w[n : n + 1]) for n in range(37)], 1
    )
    assert torch.equal(whole, alone)
    assert torch.equal(kernels.gguf_gemm(type_id, x, w)[:1], whole)


#: Each stacked-parts entry's part types, the K it is tried at and a type it refuses.
PARTS_ENTRIES = {
    "pagedkv_gguf_gemm_q8k_parts": (("Q6_K", "Q4_K", "Q5_K", "Q4_K"), 512, "Q8_0"),
    "pagedkv_gguf_gemm_q8v_parts": (("Q4_1", "Q8_0", "Q5_0", "Q5_1"), 576, "Q4_K"),
}


@pytest.mark.parametrize("name", sorted(PARTS_ENTRIES))
def test_the_stacked_parts_entry_directly(kernels, name):
    """``pagedkv_gguf_gemm_q8k_parts`` (the K-types) and ``pagedkv_gguf_gemm_q8v_parts`` (the
    32-element types, on the VNNI body or the AVX2 one) themselves: parts of odd and zero row
    counts written side by side into rows ``ldo`` apart (the columns past them untouched), bit
    for bit each part's own product, on the fixture's body at 1 and 5 tokens; a part of another
    type returns 1 and a bad size or an unknown body -1, each writing nothing."""
    lib = ctypes.CDLL(str(kernels.path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    entry = getattr(lib, name)
    entry.argtypes = [ctypes.c_int, p, p, p, p, p, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    code = Q8_ISA_CODES[kernels.q8_isa]
    names, k, refused = PARTS_ENTRIES[name]
    ldo, sizes = 60, (17, 0, 3, 37)
    raws = [
        gguf_weight(t, max(n, 1), k, 60 + i)[:n]
        for i, (t, n) in enumerate(zip(names, sizes, strict=True))
    ]

    def call(types, rows, x, out, isa=code):
        arrays = [np.ascontiguousarray(r) for r in raws]
        return entry(
            len(types), (ctypes.c_int * len(types))(*types),
            (ctypes.c_void_p * len(types))(*[a.ctypes.data for a in arrays]),
            (ctypes.c_int64 * len(types))(*rows), x.data_ptr(), out.data_ptr(),
            x.shape[0], k, ldo, 2, isa,
        )  # fmt: skip

    types = [GGML_TYPES[t].type_id for t in names]
    for rows in (1, 5):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        out = torch.full((rows, ldo), 7.0)
        assert call(types, sizes, x, out) == 0
        want = [
            kernels.gguf_gemm(t, x, torch.from_numpy(np.ascontiguousarray(r)))
            for t, r, n in zip(types, raws, sizes, strict=True)
            if n
        ]
        assert torch.equal(out[:, : sum(sizes)], torch.cat(want, 1))
        assert torch.equal(out[:, sum(sizes) :], torch.full((rows, ldo - sum(sizes)), 7.0))
        before = out.clone()
        assert call([*types[:3], GGML_TYPES[refused].type_id], sizes, x, out) == 1
        assert call(types, [*sizes[:3], -1], x, out) == -1
        assert call(types, sizes, x, out, isa=99) == -1
        assert torch.equal(out, before)
    x = torch.randn(9, k)  # more than the small products' 8 rows
    out = torch.full((9, ldo), 7.0)
    assert call(types, sizes, x, out) == -1
    assert torch.equal(out, torch.full((9, ldo), 7.0))
