"""A tiny random Llama, a tiny random Gemma 3 (ours and transformers' on the same weights) and a
one-character-per-token tokenizer, for fast engine and model tests."""

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
        self,
        messages,
        add_generation_prompt=True,
        tokenize=True,
        continue_final_message=False,
        tools=None,
        chat_template=None,
        template_kwargs=None,
    ):
        if chat_template is not None:
            raise NotImplementedError("the tiny tokenizer renders its own template only")
        text = f"<tools>{[t['function']['name'] for t in tools]}\n" if tools else ""
        text += "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
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


def tiny_loaded_model(
    num_layers: int = 2,
    seed: int = 0,
    parallel=None,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
) -> LoadedModel:
    """A random 2-layer Llama (hidden 64, 4 query / 2 KV heads, fp32) with CharTokenizer;
    ``parallel``: this rank's shard only (a tensor-parallel model loader, see
    :class:`pagedkv.worker.tp_executor.TensorParallelExecutor`); the hidden size is
    ``num_heads * head_dim``."""
    config = ModelConfig(
        architecture="llama",
        vocab_size=VOCAB_SIZE,
        hidden_size=num_heads * head_dim,
        intermediate_size=2 * num_heads * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
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
    model = LlamaForCausalLM(config, weights, dtype=torch.float32, parallel=parallel)
    return LoadedModel(model=model, config=config, tokenizer=CharTokenizer(), source="tiny")


def tiny_gemma3_hf_model():
    """A random 4-layer transformers Gemma 3 (window 8, 4 query / 2 KV heads of 32, query scale
    24**-0.5, linear rope scaling on the full-attention layer 1) with random norm weights, fp32
    (transformers is imported here: only the tests that compare with it need it)."""
    import transformers

    full, sliding = "full_attention", "sliding_attention"
    config = transformers.Gemma3TextConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=8,
        layer_types=[sliding, full, sliding, sliding],
        query_pre_attn_scalar=24,
        max_position_embeddings=128,
        rope_parameters={
            full: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            sliding: {"rope_type": "default", "rope_theta": 1e4},
        },
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # zeros at init: make the (1 + weight) form matter
                param.normal_(0.0, 0.3)
    return model


def tiny_gemma3_loaded_model(hf_model, parallel=None) -> LoadedModel:
    """Our Gemma3ForCausalLM on ``hf_model``'s weights (fp32), with CharTokenizer; ``parallel``:
    this rank's shard only."""
    from pagedkv.model.gemma3 import Gemma3ForCausalLM

    config = ModelConfig.from_hf_config(hf_model.config.to_dict(), has_lm_head=False)
    model = Gemma3ForCausalLM(config, hf_model.state_dict(), parallel=parallel)
    return LoadedModel(model=model, config=config, tokenizer=CharTokenizer(), source="tiny-gemma3")


def tiny_gemma3_model_loader(parallel=None) -> LoadedModel:
    """The tiny random Gemma 3 of :func:`tiny_gemma3_hf_model` (the same weights in every
    process: its seed is fixed), this rank's shard when ``parallel`` is given: a picklable
    tensor-parallel model loader."""
    return tiny_gemma3_loaded_model(tiny_gemma3_hf_model(), parallel=parallel)
