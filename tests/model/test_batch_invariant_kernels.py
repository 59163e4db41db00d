"""Batch invariance of the CPU kernels (``--batch-invariant``): a row's result depends only on
the row, never on how many rows share the call, how they are grouped or how many threads run.

- ``CpuQuantKernels.gguf_gemm_invariant`` (gguf_blocks.c ``pagedkv_gguf_gemm_invariant``):
  every GGUF type, each body the CPU runs (AVX2 / AVX-512 products; AVX2 / VNNI int8 bodies),
  int8 and fp32 activations: the rows of M = 1 .. 65 bit for bit the M = 1 ``gguf_gemm``
  row (the decode step's product), under 1 and 2 threads; ``gguf_gemm_large`` on each int8
  body bit for bit that body's small product.
- The fused layers with ``batch_invariant`` (decode_layer.c): a 24-token prompt in one
  ``llama_forward`` call over the native attention backend gives each row the bits that the
  same prompt fed one token a step gives it (keys written by other steps, other thread
  counts); any M is taken, int4 parts are refused.
- ``CpuQuantKernels.rms_norm``: torch's RMSNorm up to rounding, each row on its own.
- Held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``) once, in a subprocess.
"""

from __future__ import annotations

import pytest
import torch
from _gguf_files import kernels_or_skip
from _gguf_files import random_blocks as gguf_weight
from _held_to_avx2 import run_pytest_held_to_avx2

from pagedkv.cpu_caps import cpu_flags
from pagedkv.model.kernels.cpu_quant import (
    GGML_TYPES,
    MAX_ROWS,
    Q8_TYPES,
    VNNI_FLAGS,
    CpuQuantKernels,
    GGUFPart,
    KernelUnavailableError,
    LlamaLayerWeights,
    pack_int4,
)

ROW_COUNTS = (1, 2, 7, 8, 9, 17, 40, 65)
N = 150  # output rows: partial blocks of 16 and 64 rows


@pytest.fixture(scope="module", params=["avx2", "avx512"])
def kernels(request, kernel_cache) -> CpuQuantKernels:
    """The session's build with each products' body (skipped where the CPU lacks it or a
    hold caps it)."""
    return kernels_or_skip(kernel_cache, request.param, "q8")


def q8_bodies(isa: str) -> list[str]:
    """The int8 bodies to try with products' body ``isa``: AVX2 always, VNNI where it runs."""
    vnni = isa == "avx512" and all(f in cpu_flags() for f in VNNI_FLAGS)
    return ["avx2", "avx512_vnni"] if vnni else ["avx2"]


def raw_weight(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """A weight's raw blocks uint8 ``[n, row_bytes]`` (the float types: random values)."""
    if GGML_TYPES[name].block_elems == 1:
        values = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
        if name == "F32":
            return values.view(torch.uint8).contiguous()
        half = values.half() if name == "F16" else values.bfloat16()
        return half.view(torch.uint8).contiguous()
    return torch.from_numpy(gguf_weight(name, n, k, seed))


@pytest.mark.parametrize("activations", ["q8", "fp32"])
@pytest.mark.parametrize("name", sorted(GGML_TYPES))
def test_every_row_is_its_decode_product(kernels, name, activations):
    """Row i of ``gguf_gemm_invariant`` over M rows equals ``gguf_gemm`` of row i alone, bit
    for bit, at every M of :data:`ROW_COUNTS`, under 1 and 2 threads, for each int8 body (the
    fp32 product ignores it); K = 512 and, for the 32-element and float types, K = 288 (a
    partial pair of groups, the float types' tail)."""
    t = GGML_TYPES[name]
    gen = torch.Generator().manual_seed(t.type_id)
    for k in (512, 288):
        if k % max(t.block_elems, 32):
            continue
        raw = raw_weight(name, N, k, seed=k + t.type_id)
        x = torch.randn(max(ROW_COUNTS), k, generator=gen)
        for q8_isa in q8_bodies(kernels.isa):
            kk = CpuQuantKernels(
                kernels.path, isa=kernels.isa, activations=activations, q8_isa=q8_isa
            )
            alone = torch.cat([kk.gguf_gemm(t.type_id, x[i : i + 1], raw) for i in range(len(x))])
            assert bool(alone.isfinite().all())
            for rows in ROW_COUNTS:
                for threads in (1, 2):
                    got = kk.gguf_gemm_invariant(
                        t.type_id, x[:rows].contiguous(), raw, num_threads=threads
                    )
                    assert torch.equal(got, alone[:rows]), (k, q8_isa, rows, threads)


@pytest.mark.parametrize("name", sorted(n for n, t in GGML_TYPES.items() if t.type_id in Q8_TYPES))
def test_large_steps_on_each_body_are_its_small_products(kernels, name):
    """``gguf_gemm_large`` with ``q8_isa`` each body gives every row the bits of that body's
    one-row product (``gguf_gemm`` at M = 1), for row counts past one group of 8."""
    t = GGML_TYPES[name]
    raw = raw_weight(name, N, 512, seed=3)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(4))
    for q8_isa in q8_bodies(kernels.isa):
        kk = CpuQuantKernels(kernels.path, isa=kernels.isa, activations="q8", q8_isa=q8_isa)
        alone = torch.cat([kk.gguf_gemm(t.type_id, x[i : i + 1], raw) for i in range(len(x))])
        for rows in (9, 17, 40):
            got = kernels.gguf_gemm_large(t.type_id, x[:rows].contiguous(), raw, q8_isa=q8_isa)
            assert torch.equal(got, alone[:rows]), (q8_isa, rows)
    with pytest.raises(KernelUnavailableError, match="q8_isa"):
        kernels.gguf_gemm_large(t.type_id, x, raw, q8_isa="avx512")


@pytest.mark.parametrize("name", sorted(n for n, t in GGML_TYPES.items() if t.type_id in Q8_TYPES))
def test_large_vnni_steps_over_long_rows_are_the_small_products(kernels, name):
    """The VNNI body's large-step kernel runs K in chunks of 16 pairs of groups (its lanes'
    sums kept between chunks) and the activation rows in spans sized to L2: K = 2304 (three
    chunks, the last partial; for the 32-element types 72 blocks: four of the one-row
    kernel's groups of 16 and a last group of 8) and, for the 32-element types, K = 1056 (a
    lone last block in the second chunk: a last group of one pair, one block) and K = 576
    (SmolLM2's width, 18 blocks: a last group of one pair of two blocks); 70 rows (two spans at
    K = 2304) and 40 weight rows (a partial tile of 16), under 1 and 2 threads: every row the
    bits of the one-row product."""
    if "avx512_vnni" not in q8_bodies(kernels.isa):
        pytest.skip("no AVX-512 VNNI here")
    t = GGML_TYPES[name]
    kk = CpuQuantKernels(kernels.path, isa=kernels.isa, activations="q8", q8_isa="avx512_vnni")
    for k in (2304, 1056, 576):
        if k % t.block_elems:
            continue
        raw = raw_weight(name, 40, k, seed=k)
        x = torch.randn(70, k, generator=torch.Generator().manual_seed(k + 1))
        alone = torch.cat([kk.gguf_gemm(t.type_id, x[i : i + 1], raw) for i in range(len(x))])
        assert bool(alone.isfinite().all())
        assert float(alone.abs().max()) > 0.0
        for threads in (1, 2):
            got = kk.gguf_gemm_invariant(t.type_id, x, raw, num_threads=threads)
            assert torch.equal(got, alone), (k, threads)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q5_0"])
def test_an_infinite_block_scale_gives_the_same_row_either_way(kernels, name):
    """A block whose f16 scale is infinite (a damaged file) in a row's last group of one or two
    blocks (K 544 and 576: the one-row kernel's pair layout, whose other lanes hold zero
    scales) and in a full group (K 512): the large steps' rows are still the one-row product's
    bits, infinities included (an infinite scale times a zero lane would be NaN on one side
    only)."""
    if "avx512_vnni" not in q8_bodies(kernels.isa):
        pytest.skip("no AVX-512 VNNI here")
    t = GGML_TYPES[name]
    kk = CpuQuantKernels(kernels.path, isa=kernels.isa, activations="q8", q8_isa="avx512_vnni")
    for k in (544, 576, 512):
        raw = raw_weight(name, 5, k, seed=k).clone()
        blocks = raw.view(5, k // 32, -1)
        inf = torch.tensor([float("inf")], dtype=torch.float16).view(torch.uint8)
        blocks[:, -1, 0:2] = inf  # every row's last block: d = +inf
        x = torch.randn(12, k, generator=torch.Generator().manual_seed(k))
        alone = torch.cat([kk.gguf_gemm(t.type_id, x[i : i + 1], raw) for i in range(len(x))])
        assert not bool(alone.isnan().any())
        got = kk.gguf_gemm_invariant(t.type_id, x, raw)
        assert torch.equal(got, alone), k


def test_refusals(kernels):
    """No rows, a weight of another width, an unknown type: refused before anything runs."""
    raw = raw_weight("Q4_K", N, 256, seed=1)
    q4k = GGML_TYPES["Q4_K"].type_id
    with pytest.raises(KernelUnavailableError):
        kernels.gguf_gemm_invariant(q4k, torch.zeros(0, 256), raw)
    with pytest.raises(KernelUnavailableError):
        kernels.gguf_gemm_invariant(q4k, torch.zeros(3, 512), raw)
    with pytest.raises(KernelUnavailableError):
        kernels.gguf_gemm_invariant(10, torch.zeros(3, 256), raw)  # Q2_K


def test_rms_norm_row_by_row(kernels):
    """``rms_norm`` is torch's RMSNorm up to fp32 rounding, and a row's bits are those it gets
    alone."""
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(13, 200, generator=gen) * 3
    w = torch.rand(200, generator=gen) + 0.5
    out = kernels.rms_norm(h, w, 1e-5)
    expected = torch.nn.functional.rms_norm(h.double(), (200,), w.double(), 1e-5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    for i in (0, 6, 12):
        assert torch.equal(kernels.rms_norm(h[i : i + 1], w, 1e-5), out[i : i + 1])
    with pytest.raises(KernelUnavailableError):
        kernels.rms_norm(h, w[:100], 1e-5)


HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, EPS = 256, 512, 4, 2, 64, 1e-5
#: each layer's part types: q, k, v; o; gate, up; down (a float part takes fp32 activations
#: even with int8 ones on)
LAYER_MIXES = {
    "q4_k_m": ("Q4_K", "Q4_K", "Q6_K", "Q8_0", "Q4_K", "F16", "Q6_K"),
    "mixed": ("Q5_K", "Q5_0", "Q5_1", "Q4_1", "BF16", "Q4_0", "F32"),
}


def make_layer(kernels, mix: str, seed: int, activations: str, **kwargs) -> LlamaLayerWeights:
    tq, tk, tv, to, tg, tu, td = LAYER_MIXES[mix]

    def part(name, n, k, s):
        return GGUFPart(GGML_TYPES[name].type_id, raw_weight(name, n, k, seed + s))

    gen = torch.Generator().manual_seed(seed)
    return LlamaLayerWeights(
        [
            part(tq, HEADS * HEAD_DIM, HIDDEN, 1),
            part(tk, KV_HEADS * HEAD_DIM, HIDDEN, 2),
            part(tv, KV_HEADS * HEAD_DIM, HIDDEN, 3),
        ],
        part(to, HIDDEN, HEADS * HEAD_DIM, 4),
        [part(tg, INTER, HIDDEN, 5), part(tu, INTER, HIDDEN, 6)],
        part(td, HIDDEN, INTER, 7),
        torch.rand(HIDDEN, generator=gen) + 0.5,
        torch.rand(HIDDEN, generator=gen) + 0.5,
        torch.randn((HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen) * 0.1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        eps=EPS,
        isa=kernels.isa,
        activations=activations,
        **kwargs,
    )


class NativeSteps:
    """A fresh native-backend cache per layer for one sequence, and the C attention entries of
    each step (the steps' metadata kept alive here)."""

    def __init__(self, num_layers: int, block_size: int = 16, num_blocks: int = 8):
        from pagedkv.ops.backends import AttentionLayerSpec, NativeBackend

        reason = NativeBackend.unavailable_reason("cpu")
        if reason is not None:
            pytest.skip(f"native backend: {reason}")
        self.backend = NativeBackend("cpu")
        self.spec = AttentionLayerSpec(
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_size=HEAD_DIM,
            block_size=block_size,
            dtype=torch.float32,
        )
        self.caches = [
            self.backend.allocate_kv_cache(num_blocks, self.spec) for _ in range(num_layers)
        ]
        for cache in self.caches:
            cache.fill_(float("nan"))  # a slot read before it is written poisons the result
        self.block_size = block_size
        self.blocks = torch.tensor([5, 2, 7, 1, 3, 6, 4], dtype=torch.int32)  # shuffled
        self._keep = []

    def entries(self, start: int, end: int):
        """The attention entries of a step that writes and attends positions [start, end)."""
        from pagedkv.ops.backends import CommonAttentionMetadata

        pos = torch.arange(start, end)
        slots = self.blocks.long()[pos // self.block_size] * self.block_size + pos % self.block_size
        common = CommonAttentionMetadata(
            block_tables=self.blocks[None],
            seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            slot_mapping=slots,
            num_blocks=self.caches[0].shape[1],
        )
        md = self.backend.build_metadata(common, self.spec)
        self._keep.append((common, md))
        return [tuple(self.backend.c_attention(md, cache)) for cache in self.caches]


@pytest.mark.parametrize("activations", ["q8", "fp32"])
@pytest.mark.parametrize("mix", sorted(LAYER_MIXES))
def test_fused_layers_give_a_prompt_row_its_decode_bits(kernels, mix, activations):
    """Two batch-invariant layers over the native backend: a 24-token prompt in one
    ``llama_forward`` call (2 threads) and the same tokens one a step (1 thread, each step
    attending over keys the earlier steps wrote) give every row the same bits; the layers
    without ``batch_invariant`` refuse 24 rows and leave h as it was."""
    layers = [make_layer(kernels, mix, 10 * i, activations, batch_invariant=True) for i in range(2)]
    array = kernels.layer_array(layers)
    gen = torch.Generator().manual_seed(1)
    M = 24
    h0 = torch.randn(M, HIDDEN, generator=gen)
    angles = torch.rand(M, HEAD_DIM // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)

    prompt = NativeSteps(len(layers))
    h_prompt = h0.clone()
    kernels.llama_forward(
        array, kernels.attention_array(prompt.entries(0, M)), h_prompt, cos, sin, 2
    )
    assert bool(h_prompt.isfinite().all())

    steps = NativeSteps(len(layers))
    for i in range(M):
        h = h0[i : i + 1].clone()
        entries = kernels.attention_array(steps.entries(i, i + 1))
        kernels.llama_forward(array, entries, h, cos[i : i + 1], sin[i : i + 1], 1)
        assert torch.equal(h[0], h_prompt[i]), i

    plain = [make_layer(kernels, mix, 10 * i, activations) for i in range(2)]
    h = h0.clone()
    with pytest.raises(KernelUnavailableError):
        kernels.llama_forward(
            kernels.layer_array(plain),
            kernels.attention_array(NativeSteps(2).entries(0, M)),
            h,
            cos,
            sin,
            1,
        )
    assert torch.equal(h, h0)


def test_attn_in_and_out_take_any_rows(kernels):
    """``llama_attn_in`` / ``llama_attn_out`` of a batch-invariant layer take 40 rows and give
    each row its one-row bits; a layer without the flag refuses more than 8 rows."""
    layer = make_layer(kernels, "q4_k_m", 3, kernels.activations, batch_invariant=True)
    plain = make_layer(kernels, "q4_k_m", 3, kernels.activations)
    assert layer.batch_invariant and not plain.batch_invariant
    gen = torch.Generator().manual_seed(6)
    M, width = 40, (HEADS + 2 * KV_HEADS) * HEAD_DIM
    h = torch.randn(M, HIDDEN, generator=gen)
    cos, sin = torch.rand(M, HEAD_DIM, generator=gen), torch.rand(M, HEAD_DIM, generator=gen)
    attn = torch.randn(M, HEADS * HEAD_DIM, generator=gen)
    qkv = torch.empty(M, width)
    kernels.llama_attn_in(layer, h, cos, sin, qkv, 2)
    out = h.clone()
    kernels.llama_attn_out(layer, out, attn, 2)
    for i in (0, 17, 39):
        one = torch.empty(1, width)
        kernels.llama_attn_in(layer, h[i : i + 1], cos[i : i + 1], sin[i : i + 1], one, 1)
        assert torch.equal(one[0], qkv[i])
        row = h[i : i + 1].clone()
        kernels.llama_attn_out(layer, row, attn[i : i + 1], 1)
        assert torch.equal(row[0], out[i])
        if i < MAX_ROWS:  # the plain layer's one-row step is the same product
            plain_row = h[i : i + 1].clone()
            kernels.llama_attn_out(plain, plain_row, attn[i : i + 1], 1)
            assert torch.equal(plain_row, row)
    with pytest.raises(KernelUnavailableError):
        kernels.llama_attn_in(plain, h, cos, sin, qkv, 1)
    with pytest.raises(KernelUnavailableError):
        kernels.llama_attn_out(plain, h.clone(), attn, 1)


def test_int4_parts_have_no_invariant_product(kernels):
    """A layer with an int4 part cannot be batch-invariant."""
    gen = torch.Generator().manual_seed(0)
    q4 = torch.randint(0, 16, (HIDDEN, HEADS * HEAD_DIM), generator=gen)
    scale = torch.rand(HIDDEN, HEADS * HEAD_DIM // 32, generator=gen)
    good = make_layer(kernels, "q4_k_m", 1, "q8")
    with pytest.raises(KernelUnavailableError, match="int4"):
        LlamaLayerWeights(
            good._keep[0],
            pack_int4(q4, scale, None),
            *good._keep[2:6],
            None,
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            eps=EPS,
            batch_invariant=True,
        )


@pytest.mark.slow
def test_held_to_avx2(tmp_path):
    """This file's layer and product tests in a fresh interpreter held to AVX2
    (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``): the 8-lane native attention build
    under the fused layers, the kernels' "avx2" bodies only."""
    run_pytest_held_to_avx2(
        "tests/model/test_batch_invariant_kernels.py",
        "-k",
        "not held and (fused or attn_in or Q4_K or Q6_K or F16)",
    )
