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


def write_gguf(path, hf_model, arch: str, rope_freqs=None) -> None:
    """Write a Hugging Face model as llama.cpp's converter would (names, q/k permutation, F32)."""
    import gguf
    from _gguf_files import add_shape_metadata

    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_shape_metadata(writer, config)
    writer.add_eos_token_id(2)
    gguf_names = {v: k for k, v in _gguf_name_table(config.num_hidden_layers).items()}
    for name, weight in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "llama" and ".q_proj." in name:
            weight = llama_cpp_permute(weight, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            weight = llama_cpp_permute(weight, config.num_key_value_heads)
        writer.add_tensor(gguf_names[name], weight.float().numpy().copy())
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_name_table(num_layers: int) -> dict[str, str]:
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    suffixes = [
        "attn_norm.weight",
        "ffn_norm.weight",
        "attn_output.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ] + [f"attn_{p}.{kind}" for p in "qkv" for kind in ("weight", "bias")]
    names += [f"blk.{i}.{s}" for i in range(num_layers) for s in suffixes]
    return {name: hf_name(name) for name in names}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_gguf_round_trip_equals_transformers(arch, tmp_path, paged_runner):
    """A tiny random model written the way llama.cpp converts (q/k permuted for llama, llama3
    rope as GGUF freq factors; qwen2 with q/k/v bias and untied output) loads back to the same
    weights and the same logits as transformers."""
    transformers = pytest.importorskip("transformers")
    from pagedkv.model.llama import LlamaForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    rope_freqs = None
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        config = transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True)
    else:
        config = transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=False)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if arch == "llama":
        default = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16)
        rope_freqs = default / hf_model.model.rotary_emb.inv_freq
        assert not torch.allclose(rope_freqs, torch.ones(8))
    else:
        for layer in hf_model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_model, arch, rope_freqs)

    checkpoint = load_gguf(path)
    assert checkpoint.config.tie_word_embeddings == (arch == "llama")
    assert checkpoint.config.attention_bias == (arch == "qwen2")
    reference = hf_model.state_dict()
    for name, weight in checkpoint.state_dict.items():
        assert torch.equal(weight, reference[name]), name

    model = LlamaForCausalLM(checkpoint.config, checkpoint.state_dict)
    token_ids = torch.randint(0, 64, (100,)).tolist()
    with torch.inference_mode():
        expected = hf_model(torch.tensor([token_ids])).logits[0]
    runner = paged_runner(model, num_blocks=16, block_size=8)
    logits = torch.cat(
        [runner.step([(0, token_ids[:60])])[0], runner.step([(0, token_ids[60:])])[0]]
    )
    assert (logits - expected).abs().max().item() < 1e-4
