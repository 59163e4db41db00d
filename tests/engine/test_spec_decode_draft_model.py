"""Speculative decoding with a draft model: its KV in the same block pool, lookahead slots for
its drafts, and the same tokens as without speculation.

The model drafting for itself must accept every greedy draft (the test of the mechanics: the
draft's KV at every position, the lookahead slots, the positions of its decode steps); a
different, one-layer draft model is accepted only in part, and the output must still be the
engine's without speculation, token for token, under every configuration the n-gram tests
cover. The KV cache's invariants are checked after every step.
"""

from __future__ import annotations

import pytest
from _tiny_model import (
    CharTokenizer,
    tiny_gemma3_hf_model,
    tiny_gemma3_loaded_model,
    tiny_loaded_model,
)
from test_spec_decode import (
    CONFIGS,
    PROMPTS,
    greedy,
    make_engine,
    reference,
    run,
    stop_conditions,
)

from pagedkv.config import SpeculativeConfig
from pagedkv.errors import ConfigError
from pagedkv.model.loader import LoadedModel
from pagedkv.sampling_params import SamplingParams

DRAFT = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


@pytest.fixture(scope="module")
def small_draft():
    """One layer: the first layer of ``tiny`` (same seed), so it agrees with it in part."""
    return tiny_loaded_model(num_layers=1)


def drafting(model, draft, adaptive=False, **kwargs):
    engine = make_engine(model, speculative_config=DRAFT, draft_model=draft, **kwargs)
    engine.scheduler.drafts.adaptive = adaptive
    return engine


def test_config_without_method_is_a_draft_model():
    config = SpeculativeConfig.from_dict({"model": "x.gguf", "num_speculative_tokens": 3})
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model",
        "x.gguf",
        3,
    )


@pytest.mark.parametrize("batch", [1, 16])
def test_the_model_drafting_for_itself_accepts_every_draft(tiny, batch):
    prompts = (PROMPTS * 4)[:batch]
    expected, num_steps = reference(tiny, prompts, greedy(), num_blocks=400)
    engine = drafting(tiny, tiny, num_blocks=400)
    got, num_spec_steps = run(engine, prompts, greedy())
    assert got == expected
    stats = engine.scheduler.get_stats()
    spec = stats.spec_decoding
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    # 24 tokens: 1 from the prefill step, then 5 a step (4 drafts + the bonus).
    assert num_steps == 24 and num_spec_steps == 1 + 5
    assert stats.num_used_blocks == 0


def test_kv_cache_holds_both_models_in_one_pool(tiny, small_draft):
    engine = drafting(tiny, small_draft)
    config = engine.kv_cache_config
    assert config.num_layers == 3  # the model's 2 layers, then the draft's 1
    assert len(config.kv_cache_groups) == 1  # equal specs: one block table for both
    assert len(engine.runner.kv_caches) == 3


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_smaller_draft_model_gives_the_same_tokens(tiny, small_draft, config):
    prompts = [*PROMPTS, PROMPTS[1], PROMPTS[1][:48]]  # repeats hit the prefix cache
    expected, _ = reference(tiny, prompts, greedy(30), **config)
    engine = drafting(tiny, small_draft, **config)
    got, _ = run(engine, prompts, greedy(30))
    assert got == expected
    stats = engine.scheduler.get_stats()
    spec = stats.spec_decoding
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    if config.get("num_blocks") == 41:
        assert stats.num_preemptions > 0
    assert stats.num_used_blocks == 0


def test_adaptive_draft_length_and_stop_conditions(tiny, small_draft):
    prompts = PROMPTS[:2]
    long, _ = reference(tiny, prompts, greedy(30))
    for params in stop_conditions(long):
        expected, _ = reference(tiny, prompts, params)
        for draft in (tiny, small_draft):
            got, _ = run(drafting(tiny, draft, adaptive=True), prompts, params)
            assert got == expected, params


def test_requests_that_cannot_be_verified_get_no_lookahead(tiny):
    engine = drafting(tiny, tiny)
    got, _ = run(engine, PROMPTS[:2], greedy(12, repetition_penalty=1.3))
    assert got == reference(tiny, PROMPTS[:2], greedy(12, repetition_penalty=1.3))[0]
    assert engine.scheduler.get_stats().spec_decoding.num_draft_tokens == 0


def test_seeded_sampling_is_reproducible(tiny, small_draft):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=7, ignore_eos=True)
    runs = [run(drafting(tiny, small_draft), PROMPTS[:1], params)[0][0] for _ in range(2)]
    assert runs[0] == runs[1]


def test_sliding_window_groups():
    """Gemma 3 drafting for itself: the group size stays 2 layers, so the draft's window-8 and
    full layers form two KV cache groups of their own beside the model's two; blocks that left
    the window are freed by verified tokens only."""
    import numpy as np

    gemma = tiny_gemma3_loaded_model(tiny_gemma3_hf_model())
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 96, n).tolist() for n in (5, 23, 37)]
    expected, _ = reference(gemma, prompts, greedy(20), max_model_len=64)
    engine = drafting(gemma, gemma, max_model_len=64)
    assert len(engine.kv_cache_config.kv_cache_groups) == 4
    got, _ = run(engine, prompts, greedy(20))
    assert got == expected
    spec = engine.scheduler.get_stats().spec_decoding
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0


def test_each_attention_backend(tiny, small_draft, attention_backend):
    expected, _ = reference(tiny, PROMPTS, greedy(), attention_backend=attention_backend)
    for draft in (tiny, small_draft):
        engine = drafting(tiny, draft, attention_backend=attention_backend)
        got, _ = run(engine, PROMPTS, greedy())
        assert got == expected


class OtherTokenizer(CharTokenizer):
    def decode_tokens(self, token_ids):
        return [chr(t + 1) for t in token_ids]


def test_refusals(tiny):
    other = LoadedModel(tiny.model, tiny.config, OtherTokenizer(), "other")
    with pytest.raises(ConfigError, match="does not share the tokenizer"):
        make_engine(tiny, speculative_config=DRAFT, draft_model=other)
    wide = tiny_loaded_model(head_dim=32, num_heads=2)  # pages of another size
    with pytest.raises(ConfigError, match="cannot share the model's block pool"):
        make_engine(tiny, speculative_config=DRAFT, draft_model=wide)
    with pytest.raises(ConfigError, match="tensor_parallel_size 1 only"):
        make_engine(tiny, speculative_config=DRAFT, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="draft_model is for a speculative_config"):
        make_engine(tiny, draft_model=tiny)


def test_a_missing_draft_model_is_named(tiny):
    from pagedkv.errors import ModelLoadError

    config = {**DRAFT, "model": "/nonexistent/draft.gguf"}
    with pytest.raises(ModelLoadError, match="speculative_config: the draft model"):
        make_engine(tiny, speculative_config=config)
