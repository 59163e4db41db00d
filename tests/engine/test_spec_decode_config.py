"""SpeculativeConfig: vLLM's --speculative-config keys, defaults and refusals."""

from __future__ import annotations

import pytest

from pagedkv.config import SpeculativeConfig
from pagedkv.errors import ConfigError


def test_ngram_defaults_and_one_bound_sets_the_other():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (config.method, config.num_speculative_tokens) == ("ngram", 4)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    only_max = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    config = SpeculativeConfig.from_dict(only_max)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    only_min = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    config = SpeculativeConfig.from_dict(only_min)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)
    both = {"method": "[ngram]", "num_speculative_tokens": 2}
    assert SpeculativeConfig.from_dict(both | {"prompt_lookup_min": 1, "prompt_lookup_max": 4}) == (
        SpeculativeConfig(
            method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=4
        )
    )


def test_suffix_defaults_are_vllms():
    config = SpeculativeConfig.from_json('{"method": "suffix"}')
    assert config.num_speculative_tokens == 24  # = suffix_decoding_max_tree_depth, as vLLM
    assert config.suffix_decoding_max_tree_depth == 24
    assert config.suffix_decoding_max_cached_requests == 10000
    assert config.suffix_decoding_max_spec_factor == 1.0
    assert config.suffix_decoding_min_token_prob == 0.1
    config = SpeculativeConfig.from_dict(
        {
            "method": "suffix",
            "suffix_decoding_max_tree_depth": 8,
            "suffix_decoding_max_cached_requests": 0,
            "suffix_decoding_max_spec_factor": 2,
            "suffix_decoding_min_token_prob": 0.5,
        }
    )
    assert config.num_speculative_tokens == 8
    assert config.suffix_decoding_max_cached_requests == 0
    assert config.suffix_decoding_max_spec_factor == 2


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "unknown key(s) ['foo']"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min must be an int >= 1",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_max must be an int >= 4",
        ),
        (
            {"method": "draft_model", "model": "x.gguf"},
            "num_speculative_tokens is required for method 'draft_model'",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "model is required"),
        ({"model": "x.gguf"}, "num_speculative_tokens is required"),
        ({"model": "", "num_speculative_tokens": 3}, "model must be a model name or path"),
        (
            {"model": "x.gguf", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
            "prompt_lookup_min is for method 'ngram'",
        ),
        ({"method": "eagle", "num_speculative_tokens": 3}, "eagle heads is not built"),
        ({"method": "lookahead", "num_speculative_tokens": 3}, "method must be one of"),
        ({"num_speculative_tokens": 3}, "method is required"),
        ({"method": 3}, "method must be a string"),
        ({"method": "suffix", "model": "x.gguf"}, "model is for method 'draft_model'"),
        ({"method": "suffix", "prompt_lookup_min": 2}, "prompt_lookup_min is for method 'ngram'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 3},
            "are for method 'suffix'",
        ),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "max_tree_depth must be"),
        (
            {"method": "suffix", "suffix_decoding_max_cached_requests": -1},
            "suffix_decoding_max_cached_requests must be an int >= 0",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_spec_factor": -0.5},
            "suffix_decoding_max_spec_factor must be",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_spec_factor": float("inf")},
            "suffix_decoding_max_spec_factor must be a finite number",
        ),
        (
            {"method": "suffix", "suffix_decoding_min_token_prob": 1.5},
            "suffix_decoding_min_token_prob must be a number in [0, 1]",
        ),
        (
            {"method": "suffix", "suffix_decoding_min_token_prob": "0.1"},
            "suffix_decoding_min_token_prob must be",
        ),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_refusals_name_the_key(config, words):
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.from_dict(config)
    assert words in str(info.value)


def test_bad_json_is_a_config_error():
    with pytest.raises(ConfigError, match="not valid JSON"):
        SpeculativeConfig.from_json("{method: ngram}")


def test_direct_construction_is_checked_too():
    with pytest.raises(ConfigError, match="method must be one of"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="model is required for method 'draft_model'"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="model is required for method 'draft_model'"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, model="x.gguf")
    with pytest.raises(ConfigError, match="prompt_lookup_max"):
        SpeculativeConfig(
            method="ngram", num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2
        )


def test_the_start_up_log_says_speculative_decoding_is_on(caplog):
    import logging

    from _tiny_model import tiny_loaded_model

    from pagedkv.engine.llm_engine import LLMEngine

    caplog.set_level(logging.INFO, logger="pagedkv.engine.llm_engine")
    LLMEngine(
        loaded_model=tiny_loaded_model(),
        dtype="float32",
        num_blocks=64,
        max_model_len=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    lines = [r.getMessage() for r in caplog.records if "speculative decoding" in r.getMessage()]
    assert lines == [
        "speculative decoding: ngram, up to 3 draft tokens per request per step "
        "(n-grams of 5-5 tokens)"
    ]
    suffix = SpeculativeConfig.from_dict({"method": "suffix"})
    assert suffix.summary().startswith("speculative decoding: suffix, up to 24 draft tokens")
