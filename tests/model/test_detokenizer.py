"""The incremental detokenizer: text equals tokens, whatever the ids, the prompt and the finish.

Property (hypothesis, derandomized): for random output token sequences (including tokens that hold
only some bytes of a multi-byte character), random prompt tails (also ending inside a character),
random step sizes and a random finish point, the concatenated deltas plus the final flush equal
the detokenizer's text and the one-shot decode of the output ids; nothing of the prompt appears.
Run on the default model's byte-level BPE tokenizer (SmolLM2) and on a small SentencePiece-style
tokenizer with byte-fallback tokens (built here, no model file).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedkv.model.tokenizer import Tokenizer

PROPERTY = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def stream(tokenizer: Tokenizer, prompt, output, sizes, skip_special_tokens=True):
    """Feed ``output`` in steps of ``sizes`` (cycled), then flush; return (deltas, detokenizer)."""
    detokenizer = tokenizer.incremental_detokenizer(prompt, skip_special_tokens)
    deltas, pos, k = [], 0, 0
    while pos < len(output):
        size = sizes[k % len(sizes)]
        deltas.append(detokenizer.step(output[pos : pos + size]))
        pos += size
        k += 1
    deltas.append(detokenizer.flush())
    assert detokenizer.flush() == ""  # a second flush has nothing left
    return deltas, detokenizer


# ---- SentencePiece with byte fallback (Llama 2 / TinyLlama style), built in the test ----------

SP_PIECES = ["▁", "▁hello", "▁world", "a", "b", "é", "▁é", "😀", "▁😀", ",", "▁x"]  # ids 259..


@pytest.fixture(scope="module")
def sp_tokenizer(byte_fallback_tokenizer) -> Tokenizer:
    return byte_fallback_tokenizer


def sp_byte(value: int) -> int:
    return 3 + value


# Byte tokens that build (and break) multi-byte characters: é = C3 A9, 😀 = F0 9F 98 80.
_SP_IDS = st.one_of(
    st.sampled_from([sp_byte(b) for b in (0xC3, 0xA9, 0xF0, 0x9F, 0x98, 0x80, 0x41, 0xFF)]),
    st.integers(259, 259 + len(SP_PIECES) - 1),  # the pieces
    st.sampled_from([0, 1, 2]),  # special tokens
    st.integers(3, 258),  # any byte
)


@PROPERTY
@given(
    prompt=st.lists(_SP_IDS, max_size=10),
    output=st.lists(_SP_IDS, max_size=16),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    skip=st.booleans(),
)
@example(
    prompt=[259 + 1, sp_byte(0xF0), sp_byte(0x9F)], output=[sp_byte(0x98)], sizes=[1], skip=True
)
# A skipped special token (<s>) inside a byte run: 02 <s> 18 FF is one run, all U+FFFD.
@example(
    prompt=[], output=[260, sp_byte(2), 1, sp_byte(0x18), sp_byte(0xFF), 262], sizes=[1], skip=True
)
def test_sentencepiece_byte_fallback_text_equals_tokens(sp_tokenizer, prompt, output, sizes, skip):
    deltas, detokenizer = stream(sp_tokenizer, prompt, output, sizes, skip)
    text = "".join(deltas)
    assert text == detokenizer.text
    # SentencePiece drops the first token's leading space when decoding from the start; after a
    # prompt the space stays (as vLLM does). Either way the text is the output's own.
    alone = sp_tokenizer.decode(output, skip_special_tokens=skip)
    anchor = [259 + 3]  # "a": a clean context
    in_context = sp_tokenizer.decode(anchor + output, skip_special_tokens=skip)[1:]
    assert text in (alone, in_context)


def test_sentencepiece_byte_run_is_held_until_it_ends(sp_tokenizer):
    detokenizer = sp_tokenizer.incremental_detokenizer([259 + 1])  # "▁hello"
    # C3 A9 is "é", but a following byte can still turn the run into U+FFFD: held back.
    assert detokenizer.step([sp_byte(0xC3), sp_byte(0xA9)]) == ""
    assert detokenizer.step(259 + 3) == "éa"
    assert detokenizer.step([sp_byte(0xF0), sp_byte(0x9F)]) == ""
    assert detokenizer.flush() == "\ufffd\ufffd"
    assert detokenizer.text == "éa\ufffd\ufffd"


# ---- the default model's tokenizer (byte-level BPE) -------------------------------------------

#: The issue's input: a prompt whose last token (40303, " " + 3 bytes of an emoji) ends inside a
#: character, and the output token 218 that completes it. The output's text is its own byte.
ISSUE_PROMPT = [19556, 905, 28, 1535, 314, 253, 2715, 42, 40303]
ISSUE_OUTPUT = [218]


@pytest.fixture(scope="module")
def smol_tokenizer(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.mark.slow
def test_issue_prompt_text_never_leaks_into_the_output(smol_tokenizer):
    assert smol_tokenizer.decode(ISSUE_PROMPT).endswith("face: \ufffd")
    detokenizer = smol_tokenizer.incremental_detokenizer(ISSUE_PROMPT)
    assert detokenizer.step(ISSUE_OUTPUT) == ""  # one continuation byte: held back
    assert detokenizer.flush() == "\ufffd" == smol_tokenizer.decode(ISSUE_OUTPUT)
    # Whatever follows stays the output's own text.
    detokenizer = smol_tokenizer.incremental_detokenizer(ISSUE_PROMPT)
    more = smol_tokenizer.encode(" and more", add_special_tokens=False)
    text = "".join(detokenizer.step(t) for t in ISSUE_OUTPUT + more) + detokenizer.flush()
    assert text == smol_tokenizer.decode(ISSUE_OUTPUT + more) == "\ufffd and more"


def _smol_ids():
    # Tokens of multi-byte text (byte-level BPE splits these into byte pieces), the issue's
    # partial-character tokens, special tokens, and anything else in the vocabulary.
    pieces = [218, 40303, 0, 1, 2, 28, 905, 216, 9160]
    return st.one_of(st.sampled_from(pieces), st.integers(0, 49151))


@pytest.mark.slow
@PROPERTY
@given(
    prompt=st.lists(_smol_ids(), max_size=10),
    output=st.lists(_smol_ids(), max_size=16),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    skip=st.booleans(),
)
@example(prompt=ISSUE_PROMPT, output=ISSUE_OUTPUT, sizes=[1], skip=True)
@example(prompt=ISSUE_PROMPT, output=[218, 218, 28], sizes=[1], skip=True)
def test_byte_level_text_equals_decode_of_output_ids(smol_tokenizer, prompt, output, sizes, skip):
    deltas, detokenizer = stream(smol_tokenizer, prompt, output, sizes, skip)
    assert "".join(deltas) == detokenizer.text == smol_tokenizer.decode(output, skip)


@pytest.mark.slow
def test_multibyte_text_streams_whole_characters(smol_tokenizer):
    text = "Multi-byte: naïve café — Ελληνικά, 日本語の文章, 你好 🎉🚀👩‍👩‍👧"
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    prompt = smol_tokenizer.encode("Say:", add_special_tokens=False)
    deltas, _ = stream(smol_tokenizer, prompt, ids, [1])
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
