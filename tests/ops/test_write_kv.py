import pytest
import torch

from pagedkv.errors import OpsInputError
from pagedkv.ops import allocate_kv_cache, write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_writes_exactly_its_slots(dtype, block_size, slot_dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_size = 9, 2, 64
    kv_cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype)
    kv_cache.copy_(torch.randn(kv_cache.shape, generator=gen))
    before = kv_cache.clone()
    num_slots = num_blocks * block_size
    num_tokens = min(11, num_slots - 1)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1  # padding token: skipped
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)

    write_kv(key, value, kv_cache, slots.to(slot_dtype))

    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:  # layout [2, num_blocks, num_kv_heads, block_size, head_size]
            expected[0, slot // block_size, :, slot % block_size] = key[t]
            expected[1, slot // block_size, :, slot % block_size] = value[t]
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda k, v, c, s: (k, v, c, torch.tensor([0, 1, 99])), "slot_mapping values"),
        (lambda k, v, c, s: (k, v, c, torch.tensor([0, 1, -2])), "slot_mapping values"),
        (lambda k, v, c, s: (k, v, c, torch.tensor([3, 3, 4])), "same slot twice"),
        (lambda k, v, c, s: (k, v, c, s[:2]), r"slot_mapping must be \[num_tokens"),
        (lambda k, v, c, s: (k, v, c, s.float()), "int32 or int64"),
        (lambda k, v, c, s: (k.double(), v.double(), c, s), "dtype"),
        (lambda k, v, c, s: (k[:, :1], v[:, :1], c, s), "heads"),
        (lambda k, v, c, s: (k, v[:2], c, s), "key and value"),
    ],
)
def test_write_kv_rejects_bad_input_and_changes_nothing(mutate, match):
    kv_cache = allocate_kv_cache(4, 4, 2, 8, torch.float32)
    kv_cache.copy_(torch.randn(kv_cache.shape))
    before = kv_cache.clone()
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    args = mutate(key, value, kv_cache, torch.tensor([0, 1, 2]))
    with pytest.raises(OpsInputError, match=match):
        write_kv(*args)
    assert torch.equal(kv_cache, before)


def test_allocate_kv_cache_layout_and_errors():
    cache = allocate_kv_cache(5, 16, 3, 64, "bfloat16")
    assert cache.shape == (2, 5, 3, 16, 64) and cache.dtype == torch.bfloat16
    assert not cache.any()
    with pytest.raises(OpsInputError):
        allocate_kv_cache(0, 16, 3, 64)
    with pytest.raises(OpsInputError):
        allocate_kv_cache(4, 16, 3, 64, torch.int8)
