"""EngineConfig: every field has a CLI flag (shared by generate, serve and bench)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.errors import ConfigError


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


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"attention_backend": "torch"}, "native"),
        ({"quantization": "int4"}, "int4"),
        ({"quantization": "int8"}, "int8"),
        ({"kv_cache_dtype": "fp8"}, "fp8"),
        ({"batch_invariant": 1}, "bool"),
    ],
)
def test_batch_invariant_refuses_what_it_cannot_run_before_loading(options, named):
    settings = {"batch_invariant": True, **options}
    with pytest.raises(ConfigError, match=named):
        EngineConfig(**settings)


def test_batch_invariant_refuses_gemma_from_its_header(gemma3_gguf_path):
    from pagedkv.engine.config_resolution import resolve_engine_config

    with pytest.raises(ConfigError, match="Llama-family"):
        resolve_engine_config(EngineConfig(model=str(gemma3_gguf_path), batch_invariant=True))


def test_batch_invariant_is_resolved_into_the_model_config():
    from pagedkv.engine.config_resolution import resolve_engine_config

    resolved = resolve_engine_config(
        EngineConfig(batch_invariant=True, num_blocks=64, max_model_len=256)
    )
    assert resolved.config.model_config.batch_invariant
    assert resolved.attention.backend.name == "native"


def test_a_model_without_the_batch_invariant_path_says_why(loaded_bf16):
    """A loaded model either has the batch-invariant path (a GGUF file kept as stored) or names
    what it lacks; asking for it never leaves the model half switched."""
    model = loaded_bf16.model
    reason = model.batch_invariant_reason()
    if reason is None:
        model.set_batch_invariant(True)
        assert model.batch_invariant
        model.set_batch_invariant(False)
        assert not model.batch_invariant
    else:
        with pytest.raises(ConfigError, match="batch_invariant"):
            model.set_batch_invariant(True)
        assert not model.batch_invariant


def test_a_dense_model_loaded_without_the_switch_is_refused_with_the_reason(loaded_fp32):
    """SmolLM2 read as dense fp32 (``--dtype float32`` picks quantization none): its products
    run on torch's GEMM, so an engine asking for batch invariance on it is refused, naming
    why, and the model is left as it was."""
    from pagedkv.engine.llm_engine import LLMEngine

    model = loaded_fp32.model
    assert "pagedkv's C kernels" in model.batch_invariant_reason()
    with pytest.raises(ConfigError, match="batch_invariant"):
        LLMEngine(loaded_model=loaded_fp32, batch_invariant=True, num_blocks=64, max_model_len=256)
    assert not model.batch_invariant
