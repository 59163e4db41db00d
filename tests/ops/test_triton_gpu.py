"""The Triton kernels compiled for a real GPU, against the torch reference, at model-like shapes.

Skipped without CUDA (and under ``TRITON_INTERPRET=1``, where test_triton_interpreter.py covers
the kernels). Not yet run: the machine they were written on had no GPU (docs/gpu.md).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="kernels are interpreted in this run"
    ),
]

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    # The shared case builder sits beside this file (pytest's importlib mode does not put
    # test folders on sys.path).
    if os.path.dirname(__file__) not in sys.path:
        sys.path.insert(0, os.path.dirname(__file__))
    from paged_attention_cases import make_case, torch_reference

    from pagedkv.ops.backends import AttentionLayerSpec, CommonAttentionMetadata, select_backend
    from pagedkv.ops.backends._torch.write import write_kv_torch
    from pagedkv.ops.backends._triton.attention import paged_attention_triton
    from pagedkv.ops.backends._triton.cache import write_kv_triton
    from pagedkv.ops.backends.hnd_layout import allocate_kv_cache


def _to_cuda(case):
    for name in ("query", "kv_cache", "block_tables", "seq_lens", "query_start_loc"):
        setattr(case, name, getattr(case, name).cuda())
    return case


def _reference(case, sliding_window=None, **scales):
    """The torch backend's reference path on CPU copies (fp32 softmax), back on the GPU."""
    return torch_reference(case, None, sliding_window, **scales).cuda()


def _triton(case, sliding_window=None, **kwargs):
    head_size = case.query.shape[-1]
    return paged_attention_triton(
        case.query,
        case.kv_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        head_size**-0.5,
        sliding_window,
        **kwargs,
    )


# bf16 on the GPU: probabilities are rounded to bf16 before P @ V (as in flash attention), on top
# of the output's rounding; 2e-2 absolute on outputs of magnitude <= ~4.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "seq_q_lens",
    [
        [(1, 1), (16, 1), (17, 1), (511, 1), (513, 1), (2048, 1), (4000, 1), (33, 1)],  # decode
        [(300, 300), (1000, 37), (17, 1), (2048, 512)],  # prefill, prefix hit, mixed, chunk
    ],
)
@pytest.mark.parametrize("sliding_window", [None, 256])
def test_matches_reference(dtype, seq_q_lens, sliding_window):
    case = _to_cuda(
        make_case(seq_q_lens, block_size=16, num_kv_heads=8, group=4, head_size=128, dtype=dtype)
    )
    out = _triton(case, sliding_window)
    torch.testing.assert_close(
        out.float(), _reference(case, sliding_window).float(), atol=TOL[dtype], rtol=0
    )


@pytest.mark.parametrize("block_size", [1, 8, 32])
@pytest.mark.parametrize("num_kv_heads, group, head_size", [(3, 3, 64), (1, 8, 128), (4, 1, 64)])
def test_shapes(block_size, num_kv_heads, group, head_size):
    case = _to_cuda(
        make_case(
            [(700, 1), (40, 40), (129, 5)],
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            group=group,
            head_size=head_size,
            dtype=torch.bfloat16,
        )
    )
    torch.testing.assert_close(
        _triton(case).float(), _reference(case).float(), atol=TOL[torch.bfloat16], rtol=0
    )


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="fp8 e4m3 needs compute capability 8.9+",
)
@pytest.mark.parametrize("seq_q_lens", [[(1000, 1), (70, 1)], [(1000, 100), (70, 1)]])
def test_fp8_cache(seq_q_lens):
    case = make_case(seq_q_lens, block_size=16, num_kv_heads=2, group=4, head_size=128)
    k_scale, v_scale = 0.75, 2.0  # garbage up to ~250 stays below fp8 e4m3's max 448
    fp8 = torch.empty_like(case.kv_cache, dtype=torch.float8_e4m3fn)
    fp8[0] = (case.kv_cache[0] / k_scale).to(fp8.dtype)
    fp8[1] = (case.kv_cache[1] / v_scale).to(fp8.dtype)
    case.kv_cache = fp8
    case.query = case.query.to(torch.bfloat16)
    case = _to_cuda(case)
    out = _triton(case, k_scale=k_scale, v_scale=v_scale)
    expected = _reference(case, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_write_kv_matches_torch(dtype):
    if dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 e4m3 needs compute capability 8.9+")
    gen = torch.Generator().manual_seed(0)
    cache = allocate_kv_cache(64, 16, 8, 128, dtype)
    slots = torch.randperm(64 * 16, generator=gen)[:300]
    slots[::7] = -1
    qkv = torch.randn(300, 48, 128, generator=gen, dtype=torch.bfloat16)
    key, value = qkv[:, 32:40], qkv[:, 40:]
    write_kv_torch(key, value, cache, slots, k_scale=0.5, v_scale=0.25)  # torch backend's, CPU
    gpu_cache = allocate_kv_cache(64, 16, 8, 128, dtype, device="cuda")
    write_kv_triton(key.cuda(), value.cuda(), gpu_cache, slots.cuda(), k_scale=0.5, v_scale=0.25)
    assert torch.equal(gpu_cache.cpu().view(torch.uint8), cache.view(torch.uint8))


def test_auto_is_triton_on_cuda_and_its_write_and_forward_match_the_reference():
    """select_backend("auto") on CUDA is the triton backend; a step written and attended through
    its interface (CUDA tensors) gives the torch reference's output on the same K/V."""
    case = make_case(
        [(100, 1), (64, 9)],
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_size=64,
        dtype=torch.bfloat16,
    )
    choice = select_backend("auto", "cuda", torch.bfloat16, 64, block_size=16)
    backend = choice.backend
    assert backend.name == "triton" and choice.block_size == 16
    spec = AttentionLayerSpec(
        num_heads=6, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.bfloat16
    )
    num_blocks = case.kv_cache.shape[1]
    cache = backend.allocate_kv_cache(num_blocks, spec)
    seq_lens = case.seq_lens.tolist()
    table = case.block_tables.long()
    slots = [
        table[i][torch.arange(n) // 16] * 16 + torch.arange(n) % 16 for i, n in enumerate(seq_lens)
    ]
    write_qsl = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    write_step = CommonAttentionMetadata(
        block_tables=case.block_tables.cuda(),
        seq_lens=case.seq_lens.cuda(),
        query_start_loc=write_qsl.cuda(),
        slot_mapping=torch.cat(slots).cuda(),
        num_blocks=num_blocks,
    )
    md = backend.build_metadata(write_step, spec)
    key, value = torch.cat(case.keys).cuda(), torch.cat(case.values).cuda()
    backend.write_kv(key, value, cache, md, validate=True)
    q_lens = (case.query_start_loc[1:] - case.query_start_loc[:-1]).tolist()
    step = CommonAttentionMetadata(
        block_tables=case.block_tables.cuda(),
        seq_lens=case.seq_lens.cuda(),
        query_start_loc=case.query_start_loc.cuda(),
        slot_mapping=torch.cat([s[-q:] for s, q in zip(slots, q_lens, strict=True)]).cuda(),
        num_blocks=num_blocks,
    )
    out = backend.forward(
        case.query.cuda(), cache, backend.build_metadata(step, spec), validate=True
    )
    torch.testing.assert_close(
        out.float(), _reference(case).float(), atol=TOL[torch.bfloat16], rtol=0
    )


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn], ids=str
)
@pytest.mark.parametrize("mapping_on", ["cpu", "cuda"])
def test_copy_blocks_on_cuda_matches_the_dense_reference(dtype, mapping_on):
    """The triton backend's block copies on CUDA caches (30 layers of SmolLM2's shape, 8 pairs):
    every destination its source, every other block unchanged, bit for bit."""
    from pagedkv.ops.backends import TritonBackend

    backend = TritonBackend("cuda")
    fp8 = dtype.itemsize == 1
    spec = AttentionLayerSpec(
        num_heads=9, num_kv_heads=3, head_size=64, block_size=16,
        dtype=torch.bfloat16 if fp8 else dtype, kv_cache_dtype=dtype,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(30):
        cache = backend.allocate_kv_cache(256, spec)
        noise = torch.randint(0, 256, (*cache.shape, cache.element_size()), generator=gen)
        cache.view(torch.uint8).view(noise.shape).copy_(noise.to(torch.uint8).cuda())
        caches.append(cache)
    ids = (torch.randperm(255, generator=gen) + 1).tolist()
    pairs = list(zip(ids[:8], ids[8:16], strict=True))
    expected = []
    for cache in caches:
        want = cache.view(torch.uint8).clone()
        for src, dst in pairs:
            want[:, dst] = cache.view(torch.uint8)[:, src]
        expected.append(want)
    backend.copy_blocks(caches, torch.tensor(pairs, device=mapping_on))
    torch.cuda.synchronize()
    for cache, want in zip(caches, expected, strict=True):
        assert cache.is_cuda and torch.equal(cache.view(torch.uint8), want)
