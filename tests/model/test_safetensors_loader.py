"""Hugging Face folders (config.json + safetensors): tiny random models against transformers."""

from __future__ import annotations

import json

import pytest
import torch
from _hf_hub_model import TINY_SHAPE, VOCAB_SIZE, save_tiny_tokenizer

from pagedkv.errors import ModelLoadError
from pagedkv.model.loader import load_model

transformers = pytest.importorskip("transformers")


def tiny_config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(**TINY_SHAPE, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "llama3_tied":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(
            **TINY_SHAPE, rope_parameters=rope, tie_word_embeddings=True
        )
    return transformers.Qwen2Config(**TINY_SHAPE, rope_theta=1000000.0, tie_word_embeddings=False)


@pytest.fixture(params=["llama", "llama3_tied", "qwen2"])
def tiny_folder(request, tmp_path):
    torch.manual_seed(0)
    config = tiny_config(request.param)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if request.param == "qwen2":  # random biases, not the zeros of a fresh init
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    return tmp_path, model


def test_hf_folder_logits_equal_transformers(tiny_folder, paged_runner):
    folder, hf_model = tiny_folder
    loaded = load_model(folder, dtype=torch.float32)
    assert loaded.config.architecture == hf_model.config.model_type
    assert loaded.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert loaded.config.attention_bias == (hf_model.config.model_type == "qwen2")
    assert loaded.tokenizer.eos_token_ids == (2,)
    torch.manual_seed(1)
    token_ids = torch.randint(3, VOCAB_SIZE, (150,)).tolist()
    with torch.inference_mode():
        reference = hf_model(torch.tensor([token_ids])).logits[0]
    # Prefill in chunks (positions continue across calls), then one decode step.
    runner = paged_runner(loaded.model, num_blocks=32, block_size=8)
    logits = torch.cat(
        [runner.step([(0, token_ids[a:b])])[0] for a, b in ((0, 13), (13, 100), (100, 149))]
        + runner.step([(0, token_ids[149:])])
    )
    assert (logits - reference).abs().max().item() < 1e-4


def test_hf_folder_tokenizer_and_generation_config_eos_ids(tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    model.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tokenizer = load_model(tmp_path).tokenizer
    assert tokenizer.eos_token_ids == (2, 7)
    assert tokenizer.encode("w5 w7 w95") == [5, 7, 95]
    assert tokenizer.decode([5, 7]) == "w5 w7"


def test_folder_without_weights_is_a_load_error(tmp_path):
    transformers.LlamaConfig(**{"vocab_size": 8}).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path)


def test_unsupported_architecture_is_a_load_error(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "vocab_size": 8, "hidden_size": 8,
                    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1})
    )  # fmt: skip
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="not supported"):
        load_model(tmp_path)
