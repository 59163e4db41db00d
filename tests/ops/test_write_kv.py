"""The torch backend's write and cache allocation (the layout shared with the triton backend:
``[2, num_blocks, num_kv_heads, block_size, head_size]``), through the backend interface."""

import pytest
import torch

from pagedkv.errors import OpsInputError
from pagedkv.ops.backends import AttentionLayerSpec, CommonAttentionMetadata, TorchBackend


def spec_of(block_size, dtype=torch.float32, num_kv_heads=2, head_size=64, **kwargs):
    return AttentionLayerSpec(
        num_heads=num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        **kwargs,
    )


def write_step(slot_mapping, num_tokens, num_blocks):
    """A valid step of ``num_tokens`` one-token requests in block 1, writing ``slot_mapping``."""
    return CommonAttentionMetadata(
        block_tables=torch.ones(num_tokens, 1, dtype=torch.int32),
        seq_lens=torch.ones(num_tokens, dtype=torch.int32),
        query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32),
        slot_mapping=slot_mapping,
        num_blocks=num_blocks,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_writes_exactly_its_slots(dtype, block_size, slot_dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_size = 9, 2, 64
    backend, spec = TorchBackend("cpu"), spec_of(block_size, dtype)
    kv_cache = backend.allocate_kv_cache(num_blocks, spec)
    kv_cache.copy_(torch.randn(kv_cache.shape, generator=gen))
    before = kv_cache.clone()
    num_slots = num_blocks * block_size
    num_tokens = min(11, num_slots - 1)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1  # padding token: skipped
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)

    md = backend.build_metadata(write_step(slots.to(slot_dtype), num_tokens, num_blocks), spec)
    backend.write_kv(key, value, kv_cache, md, validate=True)

    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:  # layout [2, num_blocks, num_kv_heads, block_size, head_size]
            expected[0, slot // block_size, :, slot % block_size] = key[t]
            expected[1, slot // block_size, :, slot % block_size] = value[t]
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda k, v, s: (k, v, torch.tensor([0, 1, 99])), "slot_mapping values"),
        (lambda k, v, s: (k, v, torch.tensor([0, 1, -2])), "slot_mapping values"),
        (lambda k, v, s: (k, v, torch.tensor([3, 3, 4])), "same slot twice"),
        (lambda k, v, s: (k, v, s[:2]), "slot_mapping has 2 entries"),
        (lambda k, v, s: (k, v, s.float()), "int32 or int64"),
        (lambda k, v, s: (k.double(), v.double(), s), "key must be"),
        (lambda k, v, s: (k[:, :1], v[:, :1], s), "key must be"),
        (lambda k, v, s: (k, v[:2], s), "value must be"),
    ],
)
def test_write_kv_rejects_bad_input_and_changes_nothing(mutate, match):
    # Bad slots are the step's (build_metadata), bad tensors the layer's (write_kv).
    backend, spec = TorchBackend("cpu"), spec_of(4, head_size=8)
    kv_cache = backend.allocate_kv_cache(4, spec)
    kv_cache.copy_(torch.randn(kv_cache.shape))
    before = kv_cache.clone()
    key, value, slots = mutate(torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.tensor([0, 1, 2]))
    with pytest.raises(OpsInputError, match=match):
        md = backend.build_metadata(write_step(slots, 3, 4), spec)
        backend.write_kv(key, value, kv_cache, md, validate=True)
    assert torch.equal(kv_cache, before)


def test_allocate_kv_cache_layout_and_errors():
    backend = TorchBackend("cpu")
    spec = spec_of(16, torch.bfloat16, num_kv_heads=3, kv_cache_dtype="bfloat16")
    cache = backend.allocate_kv_cache(5, spec)
    assert cache.shape == (2, 5, 3, 16, 64) and cache.dtype == torch.bfloat16
    assert backend.kv_cache_shape(5, 16, 3, 64) == (2, 5, 3, 16, 64)
    assert not cache.any()
    fp8 = backend.allocate_kv_cache(2, spec_of(16, kv_cache_dtype="fp8_e5m2"))
    assert fp8.dtype == torch.float8_e5m2 and not fp8.view(torch.uint8).any()
    with pytest.raises(OpsInputError):
        backend.allocate_kv_cache(0, spec)
    with pytest.raises(OpsInputError):
        spec_of(16, kv_cache_dtype=torch.int8)
