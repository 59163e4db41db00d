"""KV-cache sizing and max_model_len from the model's shape, without loading weights; errors
that name the limit hit and the options (flags) that change it; checked before the weight load."""

from __future__ import annotations

import dataclasses

import pytest
from _tiny_model import tiny_loaded_model

from pagedkv.engine.config import DEFAULT_MAX_KV_CACHE_MEMORY, EngineConfig
from pagedkv.engine.kv_sizing import resolve_max_model_len, size_kv_cache
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.errors import CacheSizingError, ConfigError
from pagedkv.model.config import ModelConfig
from pagedkv.sampling_params import SamplingParams
from pagedkv.units import GiB, MiB

#: SmolLM2-135M's shape: 30 layers x 3 KV heads x head 64 = 23,040 B a token in bf16.
SMOLLM2 = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    rope_scaling=None,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    attention_bias=False,
    bos_token_id=1,
    eos_token_id=2,
)
BYTES_PER_BLOCK = 16 * 23040


def sized(**options) -> EngineConfig:
    """An EngineConfig at block size 16 in bf16 (the engine resolves a None block size from its
    attention backend and dtype "auto" from the CPU before sizing; the figures here are for 16
    and bf16)."""
    return EngineConfig(**{"block_size": 16, "dtype": "bfloat16", **options})


def test_auto_dtype_sizes_as_this_cpus_dtype():
    from pagedkv.cpu_caps import probe_cpu, resolve_dtype

    auto = size_kv_cache(SMOLLM2, sized(dtype="auto", kv_cache_memory="512MiB"))
    resolved = resolve_dtype("auto", probe_cpu())
    assert auto == size_kv_cache(SMOLLM2, sized(dtype=resolved, kv_cache_memory="512MiB"))


def test_sizing_needs_a_resolved_block_size():
    with pytest.raises(ConfigError, match="block_size is None"):
        size_kv_cache(SMOLLM2, EngineConfig())


def test_default_budget_is_capped_and_max_model_len_capped_at_4096():
    kv = size_kv_cache(SMOLLM2, sized())
    assert kv.max_model_len == 4096 == resolve_max_model_len(SMOLLM2, sized())
    assert kv.bytes_per_block == BYTES_PER_BLOCK
    assert kv.num_blocks == DEFAULT_MAX_KV_CACHE_MEMORY // BYTES_PER_BLOCK == 2912
    # Small enough to need less than the cap: max_num_seqs requests of max_model_len tokens,
    # and the null block.
    kv = size_kv_cache(SMOLLM2, sized(max_num_seqs=2, max_model_len=1024))
    assert kv.num_blocks == 2 * 1024 // 16 + 1 and kv.max_concurrency() == 2


#: Gemma 3 270M's shape: 15 sliding-window layers (window 512) and 3 full, 1 KV head x 256.
GEMMA3_270M = dataclasses.replace(
    SMOLLM2,
    architecture="gemma3",
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    max_position_embeddings=32768,
    layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 3,
    sliding_window=512,
)


def test_sliding_window_groups_size_the_default_pool_by_their_window():
    """Six groups of three layers (a block id spans 3 pages of 1 x 16 x 256 x 2 x 2 bytes); a
    request of 4096 tokens holds 256 blocks in the full group but, with 256-token steps, only
    cdiv(511 + 256, 16) + 1 = 49 in each sliding group: the default pool is sized for that."""
    options = {"max_num_seqs": 4, "max_model_len": 4096, "max_num_batched_tokens": 256}
    kv = size_kv_cache(GEMMA3_270M, sized(**options))
    assert [len(g.layer_ids) for g in kv.kv_cache_groups] == [3] * 6
    assert kv.bytes_per_block == 3 * 16 * 256 * 2 * 2
    per_request = 256 + 5 * 49
    assert kv.max_num_blocks_per_request() == per_request
    assert kv.num_blocks == 4 * per_request + 1 and kv.max_concurrency() == 4
    full = size_kv_cache(GEMMA3_270M, sized(**options, disable_hybrid_kv_cache_manager=True))
    assert len(full.kv_cache_groups) == 1 and full.group_size == 18
    assert full.num_blocks == 4 * 256 + 1  # blocks 6x as large: 6 x 256 pages a request
    same_pool = size_kv_cache(GEMMA3_270M, sized(**options, kv_cache_memory=64 * MiB))
    assert same_pool.max_concurrency() == 64 * MiB // (3 * 16 * 1024) // per_request == 2


def test_num_blocks_wins_then_kv_cache_memory_then_dtype():
    assert size_kv_cache(SMOLLM2, sized(num_blocks=300, kv_cache_memory=GiB)).num_blocks == 300
    kv = size_kv_cache(SMOLLM2, sized(kv_cache_memory="512MiB", max_model_len=2048))
    assert kv.num_blocks == 512 * MiB // BYTES_PER_BLOCK
    fp32 = size_kv_cache(SMOLLM2, sized(dtype="float32", kv_cache_memory="512MiB"))
    assert fp32.num_blocks == 512 * MiB // (2 * BYTES_PER_BLOCK)


def test_max_model_len_beyond_the_context_is_refused_unless_allowed():
    with pytest.raises(ConfigError, match=r"context of 8192 tokens \(max_position_embeddings") as e:
        size_kv_cache(SMOLLM2, sized(max_model_len=10000, kv_cache_memory=GiB))
    assert "--max-model-len 8192" in str(e.value)
    assert "--allow-long-max-model-len" in str(e.value)
    config = sized(max_model_len=10000, allow_long_max_model_len=True, kv_cache_memory=GiB)
    assert size_kv_cache(SMOLLM2, config).max_model_len == 10000


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"num_blocks": 5},
            "the largest max_model_len that fits is 64 tokens. Lower max_model_len",
        ),
        ({"kv_cache_memory": "1MiB"}, "the largest max_model_len that fits is 16 tokens"),
        ({"kv_cache_memory": 1000}, "needs at least 2"),
    ],
)
def test_sizing_errors_name_the_engine_flags(options, message):
    with pytest.raises(CacheSizingError, match=message) as e:
        size_kv_cache(SMOLLM2, sized(**options))
    text = str(e.value)
    assert "--kv-cache-memory" in text and "--num-blocks" in text
    assert "gpu_memory_utilization" not in text
    assert ("--max-model-len" in text) == ("largest max_model_len" in text)


def test_the_engine_fails_before_loading_weights(gguf_path, monkeypatch):
    """LLM(num_blocks=5) with the default model: refused from the GGUF header, no weight load."""
    import pagedkv.model.loader

    def no_load(*args, **kwargs):
        raise AssertionError("weights loaded before the options were checked")

    monkeypatch.setattr(pagedkv.model.loader, "load_model", no_load)
    with pytest.raises(CacheSizingError, match="--num-blocks"):
        LLMEngine(model=str(gguf_path), num_blocks=5)
    with pytest.raises(ConfigError, match="--allow-long-max-model-len"):
        LLMEngine(model=str(gguf_path), max_model_len=100_000)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        LLMEngine(model=str(gguf_path), enable_chunked_prefill=False, max_model_len=4096)


def test_allow_long_max_model_len_runs_past_the_context():
    tiny = tiny_loaded_model()  # its own copy: the rotary tables get extended
    assert tiny.config.max_position_embeddings == 1024
    options = {"dtype": "float32", "num_threads": 1, "max_model_len": 1536}
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLMEngine(loaded_model=tiny, **options)
    engine = LLMEngine(loaded_model=tiny, allow_long_max_model_len=True, **options)
    assert engine.max_model_len == 1536 and tiny.model.max_positions == 1536
    engine.add_request("long", [i % 100 for i in range(1200)], SamplingParams(max_tokens=4))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs[-1].token_ids) == 4
