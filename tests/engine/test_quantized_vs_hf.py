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
    """The GGUF's blocks as stored, on fp32 activations (``PAGEDKV_GGUF_ACTIVATIONS=fp32``,
    not the int8 default: this holds the weights' path to the float32 reference;
    tests/model/test_gguf_q8_default.py holds the default to this path)."""
    from pagedkv.model.kernels.cpu_quant import ACTIVATIONS_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ACTIVATIONS_ENV, "fp32")
        loaded = load_model(gguf_path, dtype=torch.float32, quantization="gguf")
    assert loaded.quantization == "gguf"
    return loaded


def test_gguf_weights_follow_the_float32_reference(
    attention_backend, loaded_gguf, chat_prompt_ids, hf_outputs
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
    assert [t[0] for t in tokens] == [t[0] for t in hf_outputs]
    num_equal = sum(t == r for t, r in zip(tokens, hf_outputs, strict=True))
    assert num_equal >= MIN_EQUAL_PROMPTS, (num_equal, tokens, hf_outputs)


def test_mid_size_steps_follow_the_float32_reference(
    attention_backend, loaded_gguf, chat_prompt_ids, hf_outputs
):
    """Every prompt twice, 16 at a time: the decode steps have 16 rows, which run the fused
    layers on the batch-invariant products (``FUSED_MAX_TOKENS``), not the small steps'."""
    from pagedkv.model.llama import FUSED_MAX_TOKENS

    assert QUANT_MAX_TOKENS < 2 * len(chat_prompt_ids) <= FUSED_MAX_TOKENS
    llm = LLM(
        loaded_model=loaded_gguf,
        attention_backend=attention_backend,
        num_blocks=512 if attention_backend == "torch" else 128,
        max_model_len=512,
        max_num_seqs=2 * len(chat_prompt_ids),
        enable_prefix_caching=False,
    )
    outputs = llm.generate(chat_prompt_ids * 2, GREEDY, use_tqdm=False)
    tokens = [o.token_ids for o in outputs]
    expected = hf_outputs * 2
    assert [t[0] for t in tokens] == [t[0] for t in expected]
    num_equal = sum(t == r for t, r in zip(tokens, expected, strict=True))
    assert num_equal >= 2 * MIN_EQUAL_PROMPTS, (num_equal, tokens, expected)
