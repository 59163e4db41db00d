"""The input processor: every prompt rule in one place, and the character bound that refuses a
prompt too long to fit before the tokenizer sees it."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pagedkv.engine.input_processor import InputProcessor, ProcessedPrompt
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(loaded_fp32):
    return loaded_fp32.tokenizer


@pytest.fixture(scope="module")
def processor(tokenizer):
    return InputProcessor(tokenizer, vocab_size=49152, max_model_len=64, max_logprobs=5)


# Text that packs many characters into each token: runs of what the vocabulary has long tokens
# for (spaces, '#', '=' and newlines), plus anything else.
_dense_text = st.lists(
    st.sampled_from([" " * 16, "#" * 16, "=" * 16, "\n" * 8, "    " * 8, "-" * 32])
    | st.text(max_size=20),
    max_size=40,
).map("".join)


@given(text=_dense_text | st.text(max_size=300))
@example(text="#" * 80 + " " * 81)  # the vocabulary's longest entries
def test_no_token_covers_more_characters_than_the_bound(tokenizer, processor, text):
    """The bound is sound: a text of n characters has at least n / max_token_chars tokens, so
    refusing text above max_model_len * max_token_chars refuses only what cannot fit."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) * processor.max_token_chars >= len(text)


def test_the_bound_is_the_longest_vocabulary_entry(tokenizer, processor):
    longest = max(map(len, tokenizer.hf_tokenizer.get_vocab()))
    assert processor.max_token_chars == longest
    assert processor.max_prompt_chars == 64 * longest


def test_text_beyond_the_bound_is_refused_without_tokenizing(processor):
    class NoTokenizer:
        def encode(self, text, add_special_tokens=True):
            if text:  # (the processor learns once, at construction, what "" tokenizes to)
                raise AssertionError("the tokenizer was called")
            return []

    refusing = InputProcessor(
        NoTokenizer(), vocab_size=100, max_model_len=8, max_logprobs=0, max_token_chars=4
    )
    with pytest.raises(InvalidRequestError) as excinfo:
        refusing.process("x" * 33)
    assert excinfo.value.param == "prompt" and "max_model_len=8" in str(excinfo.value)
    with pytest.raises(InvalidRequestError) as excinfo:
        refusing.process_chat([{"role": "user", "content": "x" * 33}])
    assert excinfo.value.param == "messages"


def test_every_prompt_form(processor, tokenizer):
    ids = tokenizer.encode("hello world")
    assert processor.process("hello world") == ProcessedPrompt(ids, "hello world")
    assert processor.process(ids) == ProcessedPrompt(ids, None)
    assert processor.process(ids, with_text=True).text == tokenizer.decode(
        ids, skip_special_tokens=False
    )
    assert processor.process({"prompt": "hello world"}).token_ids == ids
    assert processor.process({"prompt_token_ids": ids, "prompt": "shown"}) == ProcessedPrompt(
        ids, "shown"
    )
    messages = [{"role": "user", "content": "hi"}]
    chat = processor.process(messages)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert chat == ProcessedPrompt(tokenizer.encode(rendered, add_special_tokens=False), rendered)


@pytest.mark.parametrize(
    "prompt, param, message",
    [
        ("", "prompt", "empty"),
        ([], "prompt", "empty"),
        ([1, 49152], "prompt", "[0, 49152)"),
        ([-1], "prompt", "[0, 49152)"),
        (list(range(65)), "prompt", "max_model_len=64"),
        ("\ud800", "prompt", "not valid Unicode"),
        ({"prompt": "a", "role": "user"}, "prompt", "unknown prompt key"),
        ({"prompt_token_ids": "abc"}, "prompt", "list of token ids"),
        ({"prompt": 3}, "prompt", "must be a str"),
        ([1.5, 2], "prompt", "a prompt must be"),
        ([{"role": "user", "content": "\ud800"}], "messages", "not valid Unicode"),
    ],
)
def test_refused_prompts_name_the_field(processor, prompt, param, message):
    with pytest.raises(InvalidRequestError) as excinfo:
        processor.process(prompt)
    assert excinfo.value.param == param
    assert message in str(excinfo.value)


@pytest.mark.parametrize(
    "params, priority, param",
    [
        (SamplingParams(top_k=49153), 0, "top_k"),
        (SamplingParams(stop_token_ids=[49152]), 0, "stop_token_ids"),
        (SamplingParams(logit_bias={49152: 1.0}), 0, "logit_bias"),
        (SamplingParams(logprobs=6), 0, "logprobs"),
        (SamplingParams(prompt_logprobs=6), 0, "prompt_logprobs"),
        (SamplingParams(), 1, "priority"),  # fcfs: a priority would be ignored, so refused
        (SamplingParams(), 2**63, "priority"),
    ],
)
def test_parameters_are_checked_against_the_model_and_the_limits(
    processor, params, priority, param
):
    with pytest.raises(InvalidRequestError) as excinfo:
        processor.check_params(params, priority)
    assert excinfo.value.param == param


def test_the_limits_are_the_engines_not_constants(tokenizer):
    generous = InputProcessor(tokenizer, vocab_size=49152, max_model_len=64, max_logprobs=50)
    generous.check_params(SamplingParams(logprobs=50, prompt_logprobs=21))
    by_priority = InputProcessor(
        tokenizer, vocab_size=49152, max_model_len=64, max_logprobs=0, policy="priority"
    )
    by_priority.check_params(SamplingParams(), priority=-3)


def test_a_copy_has_its_own_tokenizer(processor):
    copy = processor.copy()
    assert copy.tokenizer is not processor.tokenizer
    assert copy.process("hello") == processor.process("hello")
    assert (copy.max_model_len, copy.max_token_chars) == (64, processor.max_token_chars)
