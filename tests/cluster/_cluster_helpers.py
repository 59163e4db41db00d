"""Helpers of the cluster tests: tiny real engines (a random 2-layer Llama, one character per
token) that publish their KV-cache events, so routing is tested on real hashes and real blocks."""

from __future__ import annotations

from _tiny_model import tiny_loaded_model

HASH_SEED = "cluster-tests"
BLOCK_SIZE = 4


def tiny_engine_config(**overrides):
    """EngineConfig of a tiny cluster replica: fp32, block_size 4, events on, shared seed."""
    from pagedkv.engine.config import EngineConfig

    options = {
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "num_blocks": 96,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 256,
        "hash_seed": HASH_SEED,
        "enable_kv_cache_events": True,
        "num_threads": 1,
    }
    return EngineConfig(**{**options, **overrides})


def make_tiny_engine(**overrides):
    """A tiny LLMEngine (random weights, fixed seed: every replica has the same model)."""
    from pagedkv.engine.llm_engine import LLMEngine

    return LLMEngine(tiny_engine_config(**overrides), loaded_model=tiny_loaded_model())
