"""The engine with the GGUF file's quantized weights against Hugging Face transformers on the
dequantized weights (fp32, greedy).

Decode steps of at most 8 tokens run the file's int4 blocks with bfloat16 activations
(docs/model.md "Quantized weights"), so the outputs are not bit-equal to the float32 reference:
they follow it closely. The bound this test holds (measured: docs/perf.md "Batch 1"): every
first token equal (the prefill runs the dense weights and the LM head's top logits are
recomputed exactly), and most prompts' 16 greedy tokens equal.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.llm import LLM
from pagedkv.model.loader import load_model
from pagedkv.model.quantization import (
    QUANT_MAX_TOKENS,
    int4_kernel_available,
    int8_kernel_available,
)
from pagedkv.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (int4_kernel_available() and int8_kernel_available()),
        reason="torch's CPU weight-only kernels do not run here",
    ),
]

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
#: prompts (of 8) whose 16 greedy tokens must equal the float32 reference's
MIN_EQUAL_PROMPTS = 6


@pytest.fixture(scope="module")
def loaded_gguf(gguf_path):
    loaded = load_model(gguf_path, dtype=torch.float32, quantization="gguf")
    assert loaded.quantization == "gguf"
    return loaded


@pytest.fixture(scope="module")
def hf_greedy(hf_model, chat_prompt_ids, loaded_fp32):
    """HF's greedy continuations, one prompt at a time, cut after the first EOS."""
    eos = set(loaded_fp32.config.eos_token_ids) | set(loaded_fp32.tokenizer.eos_token_ids)
    outputs = []
    with torch.inference_mode():
        for ids in chat_prompt_ids:
            input_ids = torch.tensor([ids])
            generated = hf_model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
            cut = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
            outputs.append(generated[:cut])
    return outputs


def test_gguf_weights_follow_the_float32_reference(
    attention_backend, loaded_gguf, chat_prompt_ids, hf_greedy
):
    llm = LLM(
        loaded_model=loaded_gguf,
        attention_backend=attention_backend,
        num_blocks=512 if attention_backend == "torch" else 64,
        max_model_len=512,
        max_num_seqs=QUANT_MAX_TOKENS,  # every decode step runs the quantized weights
    )
    outputs = llm.generate(chat_prompt_ids, GREEDY, use_tqdm=False)
    tokens = [o.token_ids for o in outputs]
    assert [t[0] for t in tokens] == [t[0] for t in hf_greedy]
    num_equal = sum(t == r for t, r in zip(tokens, hf_greedy, strict=True))
    assert num_equal >= MIN_EQUAL_PROMPTS, (num_equal, tokens, hf_greedy)
