"""GGUF loading: names, the Q/K rotary permutation, and equality with transformers' loader."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model.gguf_loader import hf_name, load_gguf, unpermute_rotary_rows


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows (HF rotate-half -> interleaved pairs)."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


@pytest.mark.parametrize(("num_heads", "head_dim"), [(9, 64), (3, 64), (4, 8), (1, 2)])
def test_unpermute_inverts_llama_cpp_permutation(num_heads, head_dim):
    weight = torch.randn(num_heads * head_dim, 5)
    permuted = llama_cpp_permute(weight, num_heads)
    assert not torch.equal(permuted, weight) or head_dim == 2
    assert torch.equal(unpermute_rotary_rows(permuted, num_heads), weight)
    bias = torch.randn(num_heads * head_dim)
    assert torch.equal(unpermute_rotary_rows(llama_cpp_permute(bias, num_heads), num_heads), bias)


def test_unpermute_pairs_rows_as_rotate_half():
    # One head of 4 rows in GGUF order [x0, y0, x1, y1] -> HF order [x0, x1, y0, y1].
    gguf_rows = torch.tensor([[0.0], [10.0], [1.0], [11.0]])
    assert unpermute_rotary_rows(gguf_rows, 1).flatten().tolist() == [0.0, 1.0, 10.0, 11.0]


def test_tensor_names_map_to_hf():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    assert hf_name("blk.0.unknown.weight") is None


@pytest.mark.slow
def test_default_gguf_config(gguf_path):
    config = load_gguf(gguf_path).config
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.intermediate_size) == (49152, 1536)
    assert config.rope_theta == 100000.0
    assert config.tie_word_embeddings
    assert not config.attention_bias
    assert config.eos_token_ids == (2,)


@pytest.mark.slow
def test_weights_equal_transformers_gguf_loader(gguf_path, hf_model):
    state_dict = load_gguf(gguf_path).state_dict
    reference = hf_model.state_dict()
    # Tied embeddings: no lm_head in the file; transformers ties it to the embedding.
    assert set(reference) - set(state_dict) == {"lm_head.weight"}
    assert torch.equal(reference["lm_head.weight"], state_dict["model.embed_tokens.weight"])
    for name, weight in state_dict.items():
        assert weight.dtype == torch.float32
        assert torch.equal(weight, reference[name]), name
