"""Q4_0 / Q4_1 weights interleaved by 8 rows (gguf_blocks.c ``pagedkv_gguf_interleave``, the AVX2
body's decode layout; ``CpuQuantKernels.interleave``): the file's values bit for bit through
dequantization and lookup; products equal to the file layout's up to fp32 summation order; a
row's bits the same at every row count, on the small, large, fast and batch-invariant products
(a verification step's rows are a decode step's); the refusals, leaving the weight unchanged;
the loader's default and ``PAGEDKV_GGUF_REPACK=0``."""

from __future__ import annotations

import os

import pytest
import torch
from _gguf_files import kernels_or_skip, mapping_of, random_blocks

from pagedkv.errors import ConfigError
from pagedkv.model.gguf_weight import GGUFMatmul, GGUFWeight
from pagedkv.model.kernels.cpu_quant import (
    GGML_TYPES,
    INTERLEAVED_TYPES,
    Q8_TYPES,
    CpuQuantKernels,
    KernelUnavailableError,
)

NAMES = ("Q4_0", "Q4_1")
SHAPES = ((24, 64), (40, 576))  # (rows, K): three and five bands


@pytest.fixture(scope="module")
def kernels(kernel_cache) -> CpuQuantKernels:
    """The session's build with int8 activations on the AVX2 body (where the interleaved
    layout runs, whatever the CPU's default body)."""
    built = kernels_or_skip(kernel_cache, "avx2", "q8")
    return CpuQuantKernels(built.path, isa="avx2", activations="q8", q8_isa="avx2")


def laid_out(
    kernels, name: str, n: int, k: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the file's blocks, an interleaved copy, the interleaved type id)"""
    raw = torch.from_numpy(random_blocks(name, n, k, seed).copy())
    x8 = raw.clone()
    type_id = kernels.interleave(GGML_TYPES[name].type_id, x8)
    return raw, x8, type_id


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_values_are_the_files(kernels, name, n, k):
    raw, x8, type_id = laid_out(kernels, name, n, k)
    file_id = GGML_TYPES[name].type_id
    assert type_id == INTERLEAVED_TYPES[file_id].type_id and type_id in Q8_TYPES
    assert not torch.equal(raw, x8)  # the bytes moved
    assert torch.equal(torch.sort(raw.flatten())[0], torch.sort(x8.flatten())[0])  # not changed
    expected = kernels.gguf_dequant(file_id, raw, torch.empty(n, k))
    assert torch.equal(kernels.gguf_dequant(type_id, x8, torch.empty(n, k)), expected)
    tile = kernels.gguf_dequant(type_id, x8, torch.empty(5, k), 11)  # rows 11..15, mid-band
    assert torch.equal(tile, expected[11:16])
    ids = torch.tensor([0, 7, 8, 23, 3, 23])
    assert torch.equal(kernels.gguf_get_rows(type_id, x8, ids, torch.empty(6, k)), expected[ids])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_products_rows_independent_of_the_step(kernels, name, n, k):
    raw, x8, type_id = laid_out(kernels, name, n, k, seed=1)
    file_id = GGML_TYPES[name].type_id
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([kernels.gguf_gemm(type_id, x[i : i + 1], x8) for i in range(40)])
    # the file layout's product: the same int8 blocks, another fp32 summation order
    torch.testing.assert_close(
        alone, kernels.gguf_gemm_large(file_id, x, raw), rtol=1e-5, atol=1e-5
    )
    for rows in range(1, 9):  # a decode step's and a verification step's sizes
        assert torch.equal(kernels.gguf_gemm(type_id, x[:rows], x8), alone[:rows])
    for rows in (9, 13, 24, 40):  # mid-size and large steps
        assert torch.equal(kernels.gguf_gemm_large(type_id, x[:rows], x8), alone[:rows])
        assert torch.equal(kernels.gguf_gemm_fast(type_id, x[:rows], x8), alone[:rows])
        assert torch.equal(kernels.gguf_gemm_invariant(type_id, x[:rows], x8), alone[:rows])


def test_stacked_parts_in_a_gguf_matmul(kernels):
    """q, k, v of mixed layouts in one GGUFMatmul: each part's columns are its own product."""
    k = 64
    parts, expected_parts = [], []
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    for name, n, seed in (("Q4_1", 32, 4), ("Q4_0", 16, 5), ("Q5_0", 16, 6)):
        raw = torch.from_numpy(random_blocks(name, n, k, seed).copy())
        file_id = GGML_TYPES[name].type_id
        expected_parts.append(kernels.gguf_gemm(file_id, x, raw))
        interleave = kernels.interleaved_type(file_id, n) is not None
        if interleave:
            kernels.interleave(file_id, raw)
        parts.append(GGUFWeight(name, raw, (n, k), kernels, interleaved=interleave))
    assert [p.type_id for p in parts] == [0x103, 0x102, 6]
    y = GGUFMatmul(parts)(x)
    torch.testing.assert_close(y, torch.cat(expected_parts, dim=1), rtol=1e-5, atol=1e-5)
    assert torch.equal(y[:, 48:], expected_parts[2])  # the file's layout untouched


def test_refusals_leave_the_weight_unchanged(kernel_cache, kernels):
    raw = torch.from_numpy(random_blocks("Q4_1", 20, 64, 7).copy())  # 20 rows: not whole bands
    before = raw.clone()
    with pytest.raises(KernelUnavailableError, match="no interleaved layout"):
        kernels.interleave(GGML_TYPES["Q4_1"].type_id, raw)
    q5 = torch.from_numpy(random_blocks("Q5_0", 24, 64, 8).copy())
    with pytest.raises(KernelUnavailableError, match="no interleaved layout"):
        kernels.interleave(GGML_TYPES["Q5_0"].type_id, q5)
    assert torch.equal(raw, before)
    assert kernels.interleaved_type(GGML_TYPES["Q4_1"].type_id, 20) is None
    # fp32 activations (and the VNNI body) read the file's layout: no interleaved types
    fp32 = CpuQuantKernels(kernels.path, isa="avx2", activations="fp32")
    assert not fp32.interleaves and 0x103 not in fp32.gguf_types
    assert fp32.interleaved_type(GGML_TYPES["Q4_1"].type_id, 24) is None
    x8 = torch.from_numpy(random_blocks("Q4_1", 24, 64, 9).copy())
    kernels.interleave(GGML_TYPES["Q4_1"].type_id, x8)
    with pytest.raises(KernelUnavailableError):
        fp32.gguf_gemm(0x103, torch.randn(1, 64), x8)


def test_weight_rows_in_whole_bands(kernels):
    raw = torch.from_numpy(random_blocks("Q4_1", 24, 64, 10).copy())
    with pytest.raises(ConfigError, match="no interleaved layout"):
        GGUFWeight("Q4_1", raw[:20], (20, 64), kernels, interleaved=True)
    with pytest.raises(ConfigError, match="no interleaved layout"):
        GGUFWeight(
            "Q5_0",
            torch.from_numpy(random_blocks("Q5_0", 8, 64, 1).copy()),
            (8, 64),
            kernels,
            interleaved=True,
        )
    expected = kernels.gguf_dequant(3, raw, torch.empty(24, 64))
    kernels.interleave(3, raw)
    w = GGUFWeight("Q4_1", raw, (24, 64), kernels, interleaved=True)
    band = w.rows(slice(8, 16))
    assert band.interleaved and band.type_id == 0x103
    assert torch.equal(band.dequantize(), expected[8:16])
    for index in (slice(4, 12), slice(0, 16, 2), torch.arange(8)):
        with pytest.raises(ConfigError, match="bands of 8"):
            w.rows(index)


def test_loader_interleaves_by_default(monkeypatch, tmp_path, kernels):
    """A GGUF file of Q4_1 layers loads interleaved (values the file's), and with
    PAGEDKV_GGUF_REPACK=0 in the file's layout; a bad value is refused before reading."""
    gguf = pytest.importorskip("gguf")
    from pagedkv.model.gguf_loader import MMAP_ENV, REPACK_ENV, load_gguf

    path = tmp_path / "q4_1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(32)
    blocks = {
        "blk.0.ffn_gate.weight": (128, 64),
        "blk.0.ffn_up.weight": (128, 64),
        "blk.0.ffn_down.weight": (64, 128),
        "blk.0.attn_output.weight": (64, 64),
    }
    raws = {}
    for i, (name, (n, k)) in enumerate(blocks.items()):
        raws[name] = random_blocks("Q4_1", n, k, 20 + i)
        writer.add_tensor(name, raws[name], raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("token_embd.weight", torch.randn(32, 64).numpy())
    writer.add_tensor("output.weight", torch.randn(32, 64).numpy())
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        writer.add_tensor(name, torch.ones(64).numpy())
    for name, n in (
        ("blk.0.attn_q.weight", 64),
        ("blk.0.attn_k.weight", 64),
        ("blk.0.attn_v.weight", 64),
    ):
        writer.add_tensor(name, torch.randn(n, 64).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def weights():
        state = load_gguf(path, quantized=True, kernels=kernels).state_dict
        return state["model.layers.0.mlp.down_proj.weight"], state[
            "model.layers.0.self_attn.o_proj.weight"
        ]

    monkeypatch.delenv(REPACK_ENV, raising=False)
    monkeypatch.delenv(MMAP_ENV, raising=False)
    down, o = weights()
    assert down.interleaved and down.type_id == 0x103 and o.interleaved
    # laid out in this process's memory, not on the read-only mapped file
    assert mapping_of(down.data.data_ptr()) != os.path.realpath(path)
    expected = kernels.gguf_dequant(
        3, torch.from_numpy(raws["blk.0.ffn_down.weight"].copy()), torch.empty(64, 128)
    )
    assert torch.equal(down.dequantize(), expected)
    monkeypatch.setenv(REPACK_ENV, "0")
    down, _ = weights()
    assert not down.interleaved and down.type_id == 3
    assert torch.equal(down.data, torch.from_numpy(raws["blk.0.ffn_down.weight"].copy()))
    monkeypatch.delenv(REPACK_ENV)
    monkeypatch.setenv(MMAP_ENV, "1")  # the mapped file itself: its layout
    down, _ = weights()
    assert not down.interleaved
    assert mapping_of(down.data.data_ptr()) == os.path.realpath(path)
    monkeypatch.setenv(REPACK_ENV, "yes")
    with pytest.raises(ConfigError, match=REPACK_ENV):
        load_gguf(path, quantized=True, kernels=kernels)


def test_stacked_parts_in_one_c_call(kernels):
    """decode_layer.c's stacked product (``pagedkv_gguf_gemm_q8v_parts``: q, k, v or gate, up
    in one region) with interleaved and file-layout parts: each part's columns bit for bit its
    own product, at 1 and 2 threads; the VNNI body refuses an interleaved part, writing
    nothing."""
    import ctypes

    from pagedkv.model.kernels.cpu_quant import q8_isa_code

    lib = ctypes.CDLL(str(kernels.path))
    parts_fn = lib.pagedkv_gguf_gemm_q8v_parts
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    parts_fn.argtypes = [ctypes.c_int, p, p, p, p, p, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    k = 96

    def run(spec, rows, threads, isa):
        parts = []
        for name, n, seed, x8 in spec:
            raw = torch.from_numpy(random_blocks(name, n, k, seed).copy())
            type_id = GGML_TYPES[name].type_id
            parts.append((kernels.interleave(type_id, raw) if x8 else type_id, raw))
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        total = sum(w.shape[0] for _, w in parts)
        out = torch.full((rows, total), float("nan"))
        types = (ctypes.c_int * len(parts))(*[t for t, _ in parts])
        ws = (ctypes.c_void_p * len(parts))(*[w.data_ptr() for _, w in parts])
        counts = (ctypes.c_int64 * len(parts))(*[w.shape[0] for _, w in parts])
        args = (len(parts), ctypes.addressof(types), ctypes.addressof(ws))
        rc = parts_fn(*args, ctypes.addressof(counts), x.data_ptr(), out.data_ptr(), rows, k,
                      total, threads, q8_isa_code(isa))  # fmt: skip
        expected = torch.cat([kernels.gguf_gemm(t, x, w) for t, w in parts], dim=1)
        return rc, out, expected

    spec = [("Q4_1", 32, 1, True), ("Q5_0", 12, 2, False), ("Q4_0", 24, 3, True)]
    for rows in (1, 3, 8):
        for threads in (1, 2):
            rc, out, expected = run(spec, rows, threads, "avx2")
            assert rc == 0 and torch.equal(out, expected)
    rc, out, _ = run([("Q4_1", 32, 1, True), ("Q4_1", 16, 5, False)], 2, 1, "avx512_vnni")
    assert rc == -1 and bool(out.isnan().all())
