"""The Llama family honours its config's sliding windows: Mistral-7B-v0.1's form (every layer
slides) and Qwen2's (layers from ``max_window_layers`` on slide, so full and sliding layers mix in
one model), against transformers on the same random weights, through the engine: prompts and
generations past the window, prefix hits, and the out-of-window blocks freed as vLLM does."""

from __future__ import annotations

import pytest
import torch
from _tiny_model import EOS, VOCAB_SIZE, CharTokenizer

from pagedkv.engine.llm import LLM
from pagedkv.model.config import ModelConfig
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.loader import LoadedModel
from pagedkv.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

WINDOW = 8


def _hf_model(kind: str):
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        eos_token_id=EOS,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    if kind == "mistral":
        config = transformers.MistralConfig(**common)
        cls = transformers.MistralForCausalLM
    else:
        config = transformers.Qwen2Config(**common, use_sliding_window=True, max_window_layers=1)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:  # ones / zeros at init: make them matter
                param.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def pair(request):
    hf = _hf_model(request.param)
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    model = LlamaForCausalLM(config, hf.state_dict(), dtype=torch.float32)
    loaded = LoadedModel(model=model, config=config, tokenizer=CharTokenizer(), source="tiny")
    return request.param, loaded, hf


def test_config_windows(pair):
    kind, loaded, _ = pair
    expected = (WINDOW,) * 3 if kind == "mistral" else (None, WINDOW, WINDOW)
    assert loaded.config.layer_sliding_windows == expected
    specs = loaded.model.attention_layer_specs(4)
    assert tuple(spec.sliding_window for spec in specs) == expected


def test_engine_matches_transformers_past_the_window(pair):
    _, loaded, hf = pair
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 120, (n,), generator=generator).tolist() for n in (5, 23, 40)]
    prompts.append([*prompts[2][:16], 7, 8, 9])  # a prefix hit of 4 blocks on prompt 2
    llm = LLM(
        dtype="float32",
        loaded_model=loaded,
        attention_backend="torch",
        block_size=4,
        num_blocks=160,
        max_model_len=96,
        num_threads=1,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params)
    second = llm.generate([{"prompt_token_ids": prompts[3]}], params)
    assert second[0].num_cached_tokens > 0
    for prompt, output in zip(prompts, first + second, strict=True):
        sample = output.outputs[0]
        sequence = prompt + sample.token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([sequence])).logits[0].float()
        reference = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        assert sample.token_ids == reference.argmax(dim=-1).tolist()
        for position, token_id in enumerate(sample.token_ids):
            got = sample.logprobs[position][token_id].logprob
            assert got == pytest.approx(reference[position, token_id].item(), abs=1e-4)


def test_a_stray_sliding_window_in_a_llama_config_is_ignored_as_transformers_does():
    base = _hf_model("mistral").config.to_dict() | {"model_type": "llama"}
    assert ModelConfig.from_hf_config(base).layer_sliding_windows == (None,) * 3
    layer_types = ["full_attention", "sliding_attention", "full_attention"]
    named = ModelConfig.from_hf_config(base | {"layer_types": layer_types})
    assert named.layer_sliding_windows == (None, WINDOW, None)
