"""KV-cache sizing: block counts from memory budgets, hybrid grouping, capacity and errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.core.config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    MemoryBudget,
    group_layers,
)
from pagedkv.core.manager import KVCacheManager
from pagedkv.core.spec import FullAttentionSpec, SlidingWindowSpec, max_num_blocks_per_request
from pagedkv.errors import CacheSizingError, ConfigError
from pagedkv.units import GiB, MiB

LLAMA_8B_LAYER = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")


def gemma2_specs(num_layers: int = 42, block_size: int = 16) -> list:
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=256)
    sliding = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=8, head_size=256, sliding_window=4096
    )
    return [sliding if i % 2 == 0 else full for i in range(num_layers)]


def test_issue_example_27545_blocks():
    # 80 GiB x 0.9 - 15 - 2 - 0.5 - 0.7 GiB = 53.8 GiB; 2 MiB a block -> 27,545 blocks.
    budget = MemoryBudget(
        device_memory=80 * GiB,
        gpu_memory_utilization=0.9,
        weight_bytes=15 * GiB,
        activation_bytes=2 * GiB,
        overhead_bytes=int(0.5 * GiB) + int(0.7 * GiB),
    )
    assert budget.kv_cache_memory == pytest.approx(53.8 * GiB, abs=1)
    config = KVCacheConfig.from_memory_budget([LLAMA_8B_LAYER] * 32, budget)
    assert config.bytes_per_block == 2 * MiB
    assert config.num_blocks == 27_545
    assert config.kv_cache_specs == (LLAMA_8B_LAYER,)
    assert config.group_size == 32
    assert config.tensor_ids == tuple(range(32))
    assert config.bytes_per_token == 128 * 1024
    assert config.num_kv_tokens == 27_544 * 16
    assert config.kv_cache_memory == 27_545 * 2 * MiB


def test_explicit_num_blocks_wins():
    budget = MemoryBudget(device_memory=80 * GiB, weight_bytes=15 * GiB)
    config = KVCacheConfig.from_memory_budget([LLAMA_8B_LAYER] * 32, budget, num_blocks=1000)
    assert config.num_blocks == 1000
    assert KVCacheConfig.from_num_blocks([LLAMA_8B_LAYER] * 32, 1000).num_blocks == 1000


def test_from_kv_cache_memory_floors():
    config = KVCacheConfig.from_kv_cache_memory([LLAMA_8B_LAYER] * 32, 10 * MiB - 1)
    assert config.num_blocks == 4


def test_fp8_halves_page_and_doubles_blocks():
    fp8 = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="fp8")
    bf16_config = KVCacheConfig.from_kv_cache_memory([LLAMA_8B_LAYER] * 32, 64 * GiB)
    fp8_config = KVCacheConfig.from_kv_cache_memory([fp8] * 32, 64 * GiB)
    assert fp8_config.bytes_per_block * 2 == bf16_config.bytes_per_block == 2 * MiB
    assert fp8_config.num_blocks == 2 * bf16_config.num_blocks == 65_536


def test_max_concurrency_full_attention():
    config = KVCacheConfig.from_num_blocks([LLAMA_8B_LAYER] * 32, 1001, max_model_len=4096)
    # 1000 usable blocks, 256 blocks per 4096-token request.
    assert config.max_num_blocks_per_request() == 256
    assert config.max_concurrency() == 3
    assert config.max_concurrency(1024) == 15
    assert config.largest_max_model_len() == 16_000


def test_gemma2_hybrid_grouping():
    specs = gemma2_specs()
    groups, group_size = group_layers(specs)
    assert group_size == 21
    assert [type(g.kv_cache_spec).__name__ for g in groups] == [
        "SlidingWindowSpec",
        "FullAttentionSpec",
    ]
    assert groups[0].layer_ids == tuple(range(0, 42, 2))
    assert groups[1].layer_ids == tuple(range(1, 42, 2))

    config = KVCacheConfig.from_kv_cache_memory(
        specs, 40 * GiB, max_model_len=8192, max_num_batched_tokens=2048
    )
    # page = 2 x 16 x 8 x 256 x 2 = 128 KiB; a block id covers 21 pages = 2.625 MiB.
    assert config.page_size_bytes == 128 * 1024
    assert config.bytes_per_block == 21 * 128 * 1024
    assert config.num_blocks == 40 * GiB // (21 * 128 * 1024) == 15_603
    assert config.num_padding_layers == 0
    # Layer 2i and 2i+1 share tensor i.
    assert config.tensor_ids[:6] == (0, 0, 1, 1, 2, 2)
    # Per request: full group 8192/16 = 512 blocks; sliding group
    # cdiv(4095 + 2048, 16) + 1 = 385 blocks.
    assert config.max_num_blocks_per_request() == 512 + 385
    assert config.max_concurrency() == 15_602 // 897 == 17
    # Without the window every layer would keep 512 blocks: 15 requests.
    assert 15_602 // 1024 == 15
    assert config.num_kv_tokens == 15_602 // 2 * 16


def test_grouping_pads_close_counts_and_cuts_far_ones():
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)
    sliding = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, sliding_window=128)
    # 12 sliding + 13 full: pad to groups of 13 (vLLM's gpt-oss example).
    groups, group_size = group_layers([sliding] * 12 + [full] * 13)
    assert group_size == 13 and len(groups) == 2
    config = KVCacheConfig.from_num_blocks([sliding] * 12 + [full] * 13, 10)
    assert config.num_padding_layers == 1
    # 10 full + 20 sliding: three groups of 10 (one full, two sliding).
    groups, group_size = group_layers([full] * 10 + [sliding] * 20)
    assert group_size == 10
    assert [len(g.layer_ids) for g in groups] == [10, 10, 10]
    assert [g.kv_cache_spec for g in groups] == [full, sliding, sliding]


def test_hybrid_pages_must_match():
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)
    sliding = SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=128, sliding_window=128)
    with pytest.raises(ConfigError, match="one page size"):
        group_layers([full, sliding])
    with pytest.raises(ConfigError, match="at least one attention layer"):
        group_layers([])


def test_zero_blocks_is_an_error_with_the_budget():
    budget = MemoryBudget(device_memory=16 * GiB, weight_bytes=16 * GiB)
    with pytest.raises(CacheSizingError, match="needs at least 2") as info:
        KVCacheConfig.from_memory_budget([LLAMA_8B_LAYER] * 32, budget)
    assert "16.00 GiB" in str(info.value)
    with pytest.raises(CacheSizingError):
        KVCacheConfig.from_num_blocks([LLAMA_8B_LAYER] * 32, 1)


def test_max_model_len_too_long_says_largest_that_fits():
    with pytest.raises(CacheSizingError, match="largest max_model_len that fits is 1600 tokens"):
        KVCacheConfig.from_num_blocks([LLAMA_8B_LAYER] * 32, 101, max_model_len=4096)
    # 1600 fits exactly.
    config = KVCacheConfig.from_num_blocks([LLAMA_8B_LAYER] * 32, 101, max_model_len=1600)
    assert config.max_concurrency() == 1


def test_sliding_window_only_model_fits_long_requests():
    sliding = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, sliding_window=4096)
    config = KVCacheConfig.from_num_blocks(
        [sliding] * 32, 400, max_model_len=32768, max_num_batched_tokens=2048
    )
    # cdiv(4095 + 2048, 16) + 1 = 385 blocks whatever the length.
    assert config.max_num_blocks_per_request() == 385
    assert config.max_concurrency() == 1


def test_blocks_per_request_is_one_count_for_config_and_manager():
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8)
    sliding = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, sliding_window=8)
    config = KVCacheConfig.from_num_blocks(
        [full, sliding], 100, max_model_len=64, max_num_batched_tokens=16
    )
    manager = KVCacheManager(100, config.kv_cache_specs)
    # full: 64 / 4 = 16 blocks; sliding: cdiv(8 - 1 + 16, 4) + 1 = 7 blocks.
    assert max_num_blocks_per_request(config.kv_cache_specs, 64, 16) == 16 + 7
    assert config.max_num_blocks_per_request() == 23
    assert manager.max_num_blocks_per_request(64, 16) == 23
    # All tokens in one step (the default): the window cannot save anything below 64 tokens.
    assert manager.max_num_blocks_per_request(64) == 16 + 16


def test_bad_values_raise_config_error():
    with pytest.raises(ConfigError):
        MemoryBudget(device_memory=80 * GiB, gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError):
        MemoryBudget(device_memory=80 * GiB, weight_bytes=-1)
    with pytest.raises(ConfigError):
        KVCacheConfig.from_num_blocks([LLAMA_8B_LAYER], 10, max_model_len=0)
    with pytest.raises(ConfigError):
        KVCacheConfig.from_kv_cache_memory([LLAMA_8B_LAYER], 1.5 * GiB)


def test_group_spec_is_a_plain_value():
    group = KVCacheGroupSpec((0, 1), LLAMA_8B_LAYER)
    assert group == KVCacheGroupSpec((0, 1), LLAMA_8B_LAYER)


def test_core_config_imports_no_torch_or_numpy():
    code = (
        "import sys, pagedkv.core.config; print(any(m in sys.modules for m in ('torch', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
