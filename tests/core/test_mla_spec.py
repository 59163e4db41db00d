"""MLAAttentionSpec: one latent per token (no K and V per head), sized as vLLM's MLA spec, and
managed like full attention by the KV-cache manager."""

from __future__ import annotations

import pytest

from pagedkv.core.config import KVCacheConfig
from pagedkv.core.manager import KVCacheManager
from pagedkv.core.request import KVCacheRequest
from pagedkv.core.spec import FullAttentionSpec, MLAAttentionSpec
from pagedkv.errors import ConfigError


def test_page_holds_one_latent_per_token():
    spec = MLAAttentionSpec(block_size=16, head_size=512 + 64, dtype="bfloat16")
    assert spec.num_kv_heads == 1
    assert spec.page_size_bytes == 16 * 576 * 2 == 18_432  # no factor 2 for K and V
    assert spec.bytes_per_token == 1_152
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=576)
    assert full.page_size_bytes == 2 * spec.page_size_bytes
    assert spec != full  # distinct specs: never grouped as one type
    assert spec.max_num_blocks_per_request(100, 64) == 7  # every block kept, as full attention
    fp8 = MLAAttentionSpec(block_size=16, head_size=576, dtype="fp8")
    assert fp8.page_size_bytes == spec.page_size_bytes // 2


def test_bad_values_are_refused():
    with pytest.raises(ConfigError, match="num_kv_heads 1"):
        MLAAttentionSpec(block_size=16, head_size=576, num_kv_heads=8)
    with pytest.raises(ConfigError, match="head_size must be an int >= 1"):
        MLAAttentionSpec(block_size=16, head_size=0)


def test_sizing_and_manager_use_the_latent_page():
    specs = [MLAAttentionSpec(block_size=4, head_size=576)] * 27
    config = KVCacheConfig.from_kv_cache_memory(specs, 100 * 27 * 4 * 576 * 2, max_model_len=64)
    assert config.num_blocks == 100
    assert config.bytes_per_token == 27 * 576 * 2
    manager = KVCacheManager(config.num_blocks, config.kv_cache_specs)
    request = KVCacheRequest("r", list(range(10)))
    blocks = manager.allocate_slots(request, 10)
    assert blocks is not None
    assert len(manager.get_block_ids("r")[0]) == 3
