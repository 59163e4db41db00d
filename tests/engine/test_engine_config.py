"""EngineConfig: every field has a CLI flag (shared by generate, serve and bench)."""

from __future__ import annotations

import argparse
import dataclasses

from pagedkv.engine.config import EngineConfig


def test_every_field_has_a_flag():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args([])
    # Set by `pagedkv serve --data-parallel-size N` for its replicas (its own --hash-seed flag;
    # the replicas drain the events they turn on), not by a single engine's flags.
    cluster_only = {"hash_seed", "enable_kv_cache_events"}
    names = {f.name for f in dataclasses.fields(EngineConfig)} - cluster_only
    assert names <= set(vars(args))
    assert EngineConfig.from_cli_args(args) == EngineConfig()
    args = parser.parse_args(
        [
            "--prefix-caching-hash-algo",
            "xxh3_128",
            "--allow-long-max-model-len",
            "--max-model-len",
            "9000",
            "--kv-cache-memory",
            "1G",
        ]
    )
    config = EngineConfig.from_cli_args(args)
    assert config.hash_algo == "xxh3_128" and config.allow_long_max_model_len
    assert config.max_model_len == 9000 and config.kv_cache_memory == 1 << 30


def test_the_resolved_config_is_frozen_and_holds_the_one_block_size():
    """The engine resolves its options once (pagedkv.engine.config_resolution) into a frozen
    PagedKVConfig; the block size decided there (the backend's default: none given) is the
    one every part reads: the KV cache config's specs, the manager, the runner's batch (its
    attention metadata), its layers' specs and its cache tensors."""
    import pytest
    from _tiny_model import tiny_loaded_model

    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        loaded_model=tiny_loaded_model(),
        dtype="float32",
        attention_backend="torch",
        max_model_len=64,
        num_blocks=40,
        num_threads=1,
    )
    config = engine.config
    assert engine.pagedkv_config is config
    assert engine.options.block_size is None  # as typed; the decision is the config's
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache_config = config.cache_config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache_config.block_size = 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model_config.max_model_len = 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.scheduler_config.max_num_seqs = 1
    block_size = config.cache_config.block_size
    assert block_size == engine.attention_backend.default_block_size(16, "float32") == 16
    assert engine.kv_cache_config.block_size == block_size
    assert {spec.block_size for spec in engine.kv_cache_config.kv_cache_specs} == {block_size}
    assert engine.kv_cache_manager.block_size == block_size
    assert {m.block_size for m in engine.kv_cache_manager.coordinator.single_type_managers} == {
        block_size
    }
    runner = engine.runner
    assert runner.block_size == runner.input_batch.block_size == block_size
    assert {spec.block_size for spec in runner.layer_specs} == {block_size}
    assert runner.input_batch.max_num_blocks_per_req == 64 // block_size
    # What typed options the engine changed: none (resolution builds new values).
    assert engine.options.dtype == "float32" and engine.options.max_model_len == 64


def test_a_given_block_size_is_the_resolved_one():
    from _tiny_model import tiny_loaded_model

    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        loaded_model=tiny_loaded_model(),
        dtype="float32",
        attention_backend="torch",
        block_size=8,
        max_model_len=64,
        num_blocks=40,
        num_threads=1,
    )
    assert engine.config.cache_config.block_size == 8 == engine.options.block_size
    assert engine.kv_cache_manager.block_size == engine.runner.input_batch.block_size == 8


def test_the_options_are_a_copy_of_what_was_passed():
    """Issue 48's review: ``engine.options`` keeps what was typed even when the caller changes
    its own EngineConfig afterwards."""
    from _tiny_model import tiny_loaded_model

    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine

    options = EngineConfig(dtype="float32", num_threads=1, num_blocks=80)
    engine = LLMEngine(options, loaded_model=tiny_loaded_model())
    options.num_blocks = 9999
    assert engine.options is not options and engine.options.num_blocks == 80
    assert engine.config.cache_config.num_gpu_blocks == 80
