"""A tiny random Llama and a one-character-per-token tokenizer, for fast engine tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.model.config import ModelConfig
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.loader import LoadedModel

VOCAB_SIZE = 128
EOS = 127


class CharTokenizer:
    """Token id = code point (ASCII); the chat template wraps messages in role tags."""

    eos_token_ids = (EOS,)
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB_SIZE for c in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids if not (skip_special_tokens and t == EOS))

    def decode_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [chr(t) for t in token_ids]

    def apply_chat_template(
        self, messages, add_generation_prompt=True, tokenize=True, continue_final_message=False
    ):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if continue_final_message:
            text = text.removesuffix("\n")
        elif add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text

    def incremental_detokenizer(self, prompt_token_ids=(), skip_special_tokens=True):
        return _CharDetokenizer(self, skip_special_tokens)


class _CharDetokenizer:
    def __init__(self, tokenizer: CharTokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""

    def step(self, token_ids: int | Sequence[int]) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        delta = self.tokenizer.decode(token_ids, self.skip)
        self.text += delta
        return delta

    def flush(self) -> str:
        return ""  # one character per token: nothing is ever held back


def tiny_loaded_model(num_layers: int = 2, seed: int = 0) -> LoadedModel:
    """A random 2-layer Llama (hidden 64, 4 query / 2 KV heads, fp32) with CharTokenizer."""
    config = ModelConfig(
        architecture="llama",
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=None,
        eos_token_id=EOS,
    )
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.5

    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    weights = {"model.embed_tokens.weight": rand(VOCAB_SIZE, h), "model.norm.weight": torch.ones(h)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(config.intermediate_size, h),
            p + "mlp.up_proj.weight": rand(config.intermediate_size, h),
            p + "mlp.down_proj.weight": rand(h, config.intermediate_size),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    model = LlamaForCausalLM(config, weights, dtype=torch.float32)
    return LoadedModel(model=model, config=config, tokenizer=CharTokenizer(), source="tiny")
