"""pagedkv's ``tokenizer.json`` of a GGUF vocabulary against transformers' conversion of it.

:func:`pagedkv.model.gguf_tokenizer.tokenizer_json` writes the tokenizer transformers'
``convert_gguf_tokenizer`` builds, in a fraction of the time; these tests parse both JSON texts
and compare them whole (vocabulary, merges in order, added tokens, normalizer, pre-tokenizer,
decoder), on the two packaged models' files and on written vocabularies of every case the fast
path takes or declines, then the tokenizers built on them side by side.
"""

from __future__ import annotations

import json

import pytest

TEXTS = [
    "Hello, world!",
    "  leading spaces,   runs of spaces and trailing ones  ",
    "Multi-byte: naïve café — Ελληνικά, русский, 日本語の文章, 你好，世界 🎉🚀",
    "Code:\n\tdef f(x):\n\t\treturn x ** 2  # square\n\n\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|><start_of_turn>model\n<end_of_turn>",
    "numbers 1234567890 3.14159 -42, <think>reasoning</think> ab abab",
]


def _transformers_json(architecture, fields):
    convert = pytest.importorskip("transformers.integrations.gguf").convert_gguf_tokenizer
    return json.loads(convert(architecture, fields)[0].to_str())


def _parsed(text):
    """A tokenizer.json text as ``tokenizers`` reads it, written back and parsed (merges in one
    form, every default filled in)."""
    from tokenizers import Tokenizer

    return json.loads(Tokenizer.from_str(text).to_str())


def _fields(path):
    from pagedkv.model.tokenizer import gguf_tokenizer_fields

    return gguf_tokenizer_fields(path)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_the_packaged_models_tokenizers_equal_transformers(model, request):
    """SmolLM2 (byte-level BPE, 49k tokens and their merges) and Gemma 3 (SentencePiece, 262k
    tokens, merges derived from the vocabulary): the same tokenizer.json as transformers'."""
    from pagedkv.model.gguf_tokenizer import tokenizer_json

    path = request.getfixturevalue("gguf_path" if model == "smollm2" else "gemma3_gguf_path")
    architecture, fields, _ = _fields(path)
    ours = tokenizer_json(architecture, fields)
    assert ours is not None
    assert _parsed(ours) == _transformers_json(architecture, fields)


def _byte_level_fields(**changes):
    """A byte-level vocabulary: plain tokens, one that needs respelling (a space, a character
    outside the byte alphabet), control tokens (one with a space, which transformers leaves
    out), user-defined ones (one in the vocabulary as spelled, one not)."""
    tokens = [
        "a",
        "b",
        "ab",
        "\u0120",
        "\u0120a",
        "\u0120ab",
        "<|begin|>",
        "<|end|>",
        "x y",
        "<think>",
        "</think>",
        "\u20ac",
        "\u00e9t\u00e9",
        "<| bad |>",
        "q\u0120r",
    ]
    types = [1, 1, 1, 1, 1, 1, 3, 3, 4, 4, 4, 1, 1, 3, 4]  # fmt: skip
    fields = {
        "tokenizer_type": "gpt2", "pre_tokenizer_type": "llama-bpe", "tokens": tokens,
        "token_type": types, "merges": ["a b", "\u0120 a", "\u0120a b"], "bos_token_id": 6,
        "eos_token_id": 7,
    }  # fmt: skip
    fields.update(changes)
    return fields


def _gemma_fields(**changes):
    """A Gemma-style SentencePiece vocabulary: its default specials, byte tokens, runs of
    spaces stored as spaces, control and user-defined tokens, no merges."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]"]
    tokens += [f"<0x{i:02X}>" for i in range(256)]
    tokens += ["\u2581", "a", "b", "\u2581a", "ab", "\u2581ab", "  ", "   ", "abab", "b\u2581a"]
    tokens += ["<start_of_turn>", "<end_of_turn>", "\n", "\n\n", "x y"]
    types = [3, 3, 3, 2, 3, 4] + [6] * 256 + [1] * 10 + [3, 3, 1, 1, 4]
    fields = {
        "tokenizer_type": "llama", "pre_tokenizer_type": "default", "tokens": tokens,
        "token_type": types, "scores": [0.0] * len(tokens), "bos_token_id": 2,
        "eos_token_id": 1, "unk_token_id": 3, "pad_token_id": 0,
    }  # fmt: skip
    fields.update(changes)
    return fields


BYTE_LEVEL_CASES = {
    "split table (llama-bpe)": ("llama", _byte_level_fields()),
    "split table (qwen2)": ("qwen2", _byte_level_fields(pre_tokenizer_type="qwen2")),
    "no split (gpt-2's own regex)": ("llama", _byte_level_fields(pre_tokenizer_type="gpt2")),
    "no pre-tokenizer type": ("qwen3", _byte_level_fields(pre_tokenizer_type=None)),
    "no token types": ("llama", _byte_level_fields(token_type=None)),
    "<|endoftext|> in the vocabulary": (
        "llama",
        _byte_level_fields(
            tokens=[*_byte_level_fields()["tokens"][:-1], "<|endoftext|>"],
            token_type=[*_byte_level_fields()["token_type"][:-1], 3],
        ),
    ),
}
GEMMA_CASES = {
    "gemma3": ("gemma3", _gemma_fields()),
    "gemma2": ("gemma2", _gemma_fields()),
    "gemma, no token types": ("gemma", _gemma_fields(token_type=None)),
    "gemma3 without <pad> (appended)": (
        "gemma3",
        _gemma_fields(
            tokens=_gemma_fields()["tokens"][1:], token_type=_gemma_fields()["token_type"][1:]
        ),
    ),
}


@pytest.mark.parametrize("case", [*BYTE_LEVEL_CASES, *GEMMA_CASES])
def test_written_vocabularies_equal_transformers(case):
    """Each case the fast path takes gives transformers' tokenizer.json: respelled tokens,
    the split regex of the file's pre-tokenizer type, the class's default special token
    appended when the vocabulary lacks it (GPT-2's ``<|endoftext|>``), control and
    user-defined tokens, derived merges."""
    from pagedkv.model.gguf_tokenizer import tokenizer_json

    architecture, fields = {**BYTE_LEVEL_CASES, **GEMMA_CASES}[case]
    ours = tokenizer_json(architecture, fields)
    assert ours is not None
    assert _parsed(ours) == _transformers_json(architecture, fields)


@pytest.mark.parametrize(
    ("architecture", "fields"),
    [
        ("llama", _gemma_fields()),  # a SentencePiece vocabulary outside Gemma's builder
        ("phi3", _gemma_fields()),
        ("t5", {**_gemma_fields(), "tokenizer_type": "t5"}),
        (
            "gemma3",
            _gemma_fields(
                tokens=_gemma_fields()["tokens"][2:], token_type=_gemma_fields()["token_type"][2:]
            ),
        ),
        ("gemma3", _gemma_fields(merges=["a b"])),  # merges stored: not Gemma's kind
        ("llama", _byte_level_fields(merges=None)),  # byte-level without merges
        ("llama", _byte_level_fields(merges=["a b", "\u0120 a b"])),  # a merge of three
        ("llama", _byte_level_fields(tokens=["a", "a", "b"], token_type=[1, 1, 1])),
        ("llama", _byte_level_fields(tokens=["a b", "a\u0120b"], token_type=[1, 1])),
        ("gemma3", _gemma_fields(token_type=[3] * 268 + [3] + [1] * 10)),  # "  " control
    ],
)
def test_cases_outside_the_fast_path_are_declined(architecture, fields):
    """Another kind of vocabulary, a Gemma file lacking two of its class's specials,
    duplicate tokens (as stored or once respelled), a byte-level file without merges, a
    control token that is respelled, a merge that is not a pair: None, and transformers
    converts it."""
    from pagedkv.model.gguf_tokenizer import tokenizer_json

    assert tokenizer_json(architecture, fields) is None


@pytest.mark.parametrize(
    ("architecture", "fields"),
    [
        ("llama", _byte_level_fields(tokens=["<|endoftext|>", "a"], token_type=[4, 1], merges=[])),
        ("gemma3", _gemma_fields(token_type=[3, 3, 3, 2, 4, 4] + [6] * 256 + [1] * 10 + [1] * 5)),
    ],
)
def test_a_user_defined_default_special_is_declined(architecture, fields):
    """A file marking one of the class's default specials (GPT-2's ``<|endoftext|>``, Gemma's
    ``<mask>``) user-defined: declined (transformers' treatment of a token made special and
    then added plain is not reproduced)."""
    from pagedkv.model.gguf_tokenizer import tokenizer_json

    assert tokenizer_json(architecture, fields) is None


@pytest.mark.parametrize("case", ["split table (llama-bpe)", "gemma3"])
def test_converted_tokenizers_behave_the_same(case, tmp_path):
    """The ``PreTrainedTokenizerFast`` pagedkv builds (its tokenizer.json and keyword arguments
    written to a folder, read back as the cache reads them) and the one built on transformers'
    converted object: the same ids, texts, tokens, specials and length."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer

    from pagedkv.model.tokenizer import (
        _tokenizer_from_files,
        _write_entry_files,
        gguf_tokenizer_json,
    )

    architecture, fields = {**BYTE_LEVEL_CASES, **GEMMA_CASES}[case]
    config = {"bos_token": fields["tokens"][fields["bos_token_id"]],
              "eos_token": fields["tokens"][fields["eos_token_id"]], "add_bos_token": True,
              "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}  # fmt: skip
    _write_entry_files(tmp_path, *gguf_tokenizer_json(architecture, fields, dict(config)))
    ours = _tokenizer_from_files(tmp_path)
    backend, extra = convert_gguf_tokenizer(architecture, fields)
    theirs = PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(
        theirs.backend_tokenizer.to_str()
    )
    assert len(ours) == len(theirs)
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.bos_token_id == theirs.bos_token_id and ours.eos_token_id == theirs.eos_token_id
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    messages = [{"role": "user", "content": TEXTS[2]}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)


def test_the_transformers_path_gives_its_own_tokenizer_json():
    """With ``fast=False`` (or where the fast path declines) the text is transformers'
    converted tokenizer serialized, and the keyword arguments carry the file's config."""
    from transformers.integrations.gguf import convert_gguf_tokenizer

    from pagedkv.model.tokenizer import gguf_tokenizer_json

    architecture, fields = GEMMA_CASES["gemma3"]
    text, kwargs = gguf_tokenizer_json(architecture, fields, {"eos_token": "<eos>"}, fast=False)
    assert json.loads(text) == json.loads(convert_gguf_tokenizer(architecture, fields)[0].to_str())
    assert kwargs == {"eos_token": "<eos>"}


# ---- transformers' tables, kept once per transformers version ---------------------------------


@pytest.fixture
def tables_module(tmp_path, monkeypatch):
    """``(transformers_gguf_tables, calls)``: the function with a fresh cache folder, and the
    list its reads of transformers' own tables are appended to."""
    from pagedkv.model import gguf_tokenizer

    pytest.importorskip("transformers.integrations.gguf")
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    real = gguf_tokenizer._import_transformers_gguf_tables
    calls = []

    def counted():
        calls.append(1)
        return real()

    monkeypatch.setattr(gguf_tokenizer, "_import_transformers_gguf_tables", counted)
    return gguf_tokenizer.transformers_gguf_tables, calls


def _tables_files(tmp_path):
    return sorted(p.name for p in (tmp_path / "cache" / "tokenizers").iterdir())


def test_transformers_tables_read_once_then_from_the_cache(tables_module, tmp_path):
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_PRE_TOKENIZER_SPLITS,
        GGUF_TOKENIZER_MAPPING,
    )

    read, calls = tables_module
    first = read()
    second = read()
    assert calls == [1]  # transformers imported once, then the kept file read
    assert first == second
    assert second["tokenizer_mapping"] == GGUF_TOKENIZER_MAPPING
    assert second["pre_tokenizer_splits"] == GGUF_PRE_TOKENIZER_SPLITS
    assert dict(enumerate(second["byte_alphabet"])) == bytes_to_unicode()
    (name,) = _tables_files(tmp_path)  # one file, no staging file left
    assert name.startswith("transformers-gguf-tables-") and name.endswith(".json")


def _without_groups(tables):
    return json.dumps({**tables, "tokenizer_mapping": {}})


def _without_tokens_field(tables):
    mapping = {g: dict(m) for g, m in tables["tokenizer_mapping"].items()}
    del mapping["tokenizer"]["ggml.tokens"]
    return json.dumps({**tables, "tokenizer_mapping": mapping})


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"tokenizer_mapping": {}}',
        "[]",
        "[" * 200_000,  # nested past the parser's recursion limit
        _without_groups,  # the right types, no groups: would read no vocabulary
        _without_tokens_field,
    ],
)
def test_malformed_tables_file_read_again_and_replaced(tables_module, tmp_path, content, caplog):
    read, calls = tables_module
    tables = read()
    (name,) = _tables_files(tmp_path)
    path = tmp_path / "cache" / "tokenizers" / name
    path.write_text(content(tables) if callable(content) else content)
    assert read() == tables
    assert calls == [1, 1]
    assert "read again" in caplog.text
    assert json.loads(path.read_text()) == tables  # replaced by good tables
    assert read() == tables
    assert calls == [1, 1]


def test_unwritable_cache_still_gives_the_tables(tables_module, tmp_path):
    read, calls = tables_module
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    tables = read()
    assert tables is not None and len(tables["byte_alphabet"]) == 256
    assert read() == tables
    assert calls == [1, 1]  # nothing kept: read from transformers each time


@pytest.mark.slow
def test_a_first_start_with_kept_tables_skips_transformers_gguf_module(gguf_path, tmp_path):
    """The point of keeping them: a file's first start (no converted tokenizer in the cache)
    with the tables kept converts the tokenizer without importing transformers' GGUF tables
    module (and the model packages it imports), and gives the same tokenizer."""
    import os
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from pagedkv.model.tokenizer import read_gguf_tokenizer\n"
        f"tok = read_gguf_tokenizer({str(gguf_path)!r})\n"
        "print('gguf_tokenizer_mapping' in ' '.join(sys.modules))\n"
        "print(tok.encode('Hello, world! naïve café 日本語'))\n"
    )

    def first_start(cache):
        env = {**os.environ, "PAGEDKV_CACHE_DIR": str(cache)}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        ).stdout.splitlines()
        return out[0] == "True", out[1]

    imported, tokens = first_start(tmp_path / "a")  # nothing kept: transformers' module read
    assert imported
    kept = tmp_path / "b" / "tokenizers"
    kept.mkdir(parents=True)
    for path in (tmp_path / "a" / "tokenizers").glob("transformers-gguf-tables-*.json"):
        (kept / path.name).write_bytes(path.read_bytes())  # the tables only, no tokenizer
    imported, tokens_again = first_start(tmp_path / "b")
    assert not imported
    assert tokens_again == tokens
    assert any(p.name.startswith("gguf-") for p in kept.iterdir())  # converted and kept
