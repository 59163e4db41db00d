"""Tokenizer from the GGUF metadata against transformers' tokenizer from the same file."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing spaces  ",
    "Multi-byte: naïve café — Ελληνικά, русский, 日本語の文章, 你好，世界 🎉🚀👩‍👩‍👧",
    "Code:\n\tdef f(x):\n\t\treturn x ** 2  # square\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "numbers 1234567890 3.14159 -42",
]
MESSAGES = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Bonjour, ça va ?"},
        {"role": "assistant", "content": "Oui, merci !"},
        {"role": "user", "content": "Et toi ? 😊"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(loaded_fp32):
    return loaded_fp32.tokenizer


def test_encode_decode_equal_transformers(tokenizer, hf_tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    assert tokenizer.decode(tokenizer.encode(TEXTS[2])) == TEXTS[2]


def test_chat_template_equal_transformers(tokenizer, hf_tokenizer):
    for messages in MESSAGES:
        for add_generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            assert text == expected
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt
            )
            assert ids == hf_tokenizer.encode(expected, add_special_tokens=False)
    text = tokenizer.apply_chat_template(MESSAGES[0], tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n")


def test_special_ids(tokenizer, hf_tokenizer):
    assert tokenizer.eos_token_ids == (hf_tokenizer.eos_token_id,) == (2,)
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id


def test_incremental_detokenizer_equals_full_decode(tokenizer):
    prompt = tokenizer.apply_chat_template(MESSAGES[0])
    for text in TEXTS:
        ids = tokenizer.encode(text)
        for skip_special_tokens in (True, False):
            detokenizer = tokenizer.incremental_detokenizer(prompt, skip_special_tokens)
            deltas = [detokenizer.step(token_id) for token_id in ids]
            expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            assert "".join(deltas) == detokenizer.text == expected
            # Never a broken character in between: every delta is valid text.
            assert all("\ufffd" not in delta for delta in deltas)


def test_incremental_detokenizer_holds_back_partial_characters(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # byte-level BPE splits the 4-byte emoji
    detokenizer = tokenizer.incremental_detokenizer()
    assert [detokenizer.step(token_id) for token_id in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.step(ids[-1]) == "🚀"


def test_incremental_detokenizer_with_random_step_sizes(tokenizer):
    rng = random.Random(0)
    ids = tokenizer.encode(" ".join(TEXTS))
    detokenizer = tokenizer.incremental_detokenizer()
    start = 0
    while start < len(ids):
        size = rng.randint(1, 5)
        detokenizer.step(ids[start : start + size])
        start += size
    assert detokenizer.text == tokenizer.decode(ids)


def test_converted_tokenizer_is_cached_and_equal(gguf_path, tmp_path, monkeypatch):
    """The tokenizer converted from a GGUF file is saved under the cache directory, and a
    later start reads it from there: the same ids, texts, chat prompt and special tokens; the
    entry is the file's tokenizer's, so a copy elsewhere with another modification time reads
    it too."""
    import os
    import shutil

    from pagedkv.model.tokenizer import Tokenizer, _tokenizer_cache_folder

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / gguf_path.name
    shutil.copyfile(gguf_path, model)
    fresh = Tokenizer.from_gguf(model)
    folder = _tokenizer_cache_folder(model)
    assert (folder / "tokenizer.json").is_file()
    cached = Tokenizer.from_gguf(model)
    for text in TEXTS:
        ids = fresh.encode(text)
        assert cached.encode(text) == ids
        assert cached.decode(ids) == fresh.decode(ids)
    for messages in MESSAGES:
        prompt = fresh.apply_chat_template(messages, add_generation_prompt=True)
        assert cached.apply_chat_template(messages, add_generation_prompt=True) == prompt
    assert cached.hf_tokenizer.all_special_ids == fresh.hf_tokenizer.all_special_ids
    assert cached.hf_tokenizer.bos_token_id == fresh.hf_tokenizer.bos_token_id
    copy = tmp_path / "elsewhere" / "copy.gguf"
    copy.parent.mkdir()
    shutil.copyfile(model, copy)
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert _tokenizer_cache_folder(copy) == folder
    assert _tokenizer_cache_folder(tmp_path / "missing.gguf") is None


def test_an_unreadable_cache_entry_is_converted_again(gguf_path, tmp_path, monkeypatch, caplog):
    """A cache entry whose tokenizer.json was cut short (a disk filled mid-write by hand, a
    copy interrupted) is logged, replaced by a new conversion and the start goes on: the same
    tokenizer as a clean start, and the next start reads the new entry."""
    import shutil

    from pagedkv.model.tokenizer import Tokenizer, _tokenizer_cache_folder

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / gguf_path.name
    shutil.copyfile(gguf_path, model)
    fresh = Tokenizer.from_gguf(model)
    entry = _tokenizer_cache_folder(model) / "tokenizer.json"
    entry.write_text(entry.read_text(encoding="utf-8")[:1000], encoding="utf-8")
    with caplog.at_level("WARNING", logger="pagedkv.model.tokenizer"):
        again = Tokenizer.from_gguf(model)
    assert "unreadable" in caplog.text
    assert len(entry.read_text(encoding="utf-8")) > 1000
    later = Tokenizer.from_gguf(model)
    for text in TEXTS:
        assert again.encode(text) == fresh.encode(text) == later.encode(text)


def test_an_unreadable_entry_that_cannot_be_removed_still_starts(gguf_path, tmp_path, monkeypatch):
    """An unreadable entry that cannot be removed (a read-only or another user's cache): the
    start converts again and builds the tokenizer from its own new entry, which is dropped;
    the old one stays as it was."""
    import shutil

    from pagedkv.model.tokenizer import Tokenizer, _tokenizer_cache_folder

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / gguf_path.name
    shutil.copyfile(gguf_path, model)
    fresh = Tokenizer.from_gguf(model)
    entry = _tokenizer_cache_folder(model) / "tokenizer.json"
    entry.write_text("{cut short", encoding="utf-8")
    monkeypatch.setattr(shutil, "rmtree", lambda *args, **kwargs: None)
    again = Tokenizer.from_gguf(model)
    assert entry.read_text(encoding="utf-8") == "{cut short"
    for text in TEXTS:
        assert again.encode(text) == fresh.encode(text)


def test_an_unwritable_cache_builds_the_tokenizer_in_memory(gguf_path, tmp_path, monkeypatch):
    """A cache folder that cannot be made (its parent is a file): the tokenizer is built in
    memory, the same as a cached one, and nothing is written."""
    import shutil

    from pagedkv.model.tokenizer import Tokenizer

    (tmp_path / "not-a-folder").write_text("", encoding="utf-8")
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "not-a-folder" / "cache"))
    model = tmp_path / gguf_path.name
    shutil.copyfile(gguf_path, model)
    tokenizer = Tokenizer.from_gguf(model)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    cached = Tokenizer.from_gguf(model)
    for text in TEXTS:
        assert tokenizer.encode(text) == cached.encode(text)
        assert tokenizer.decode(cached.encode(text)) == cached.decode(cached.encode(text))


def test_a_tokenizer_that_cannot_be_built_is_refused_and_not_cached(tmp_path, monkeypatch):
    """A vocabulary large enough to be cached whose merges name a token it lacks: a
    ModelLoadError naming the file, and no cache entry (a later start would read it and fail
    again)."""
    import gguf

    from pagedkv.errors import ModelLoadError
    from pagedkv.model.tokenizer import _tokenizer_cache_folder, read_gguf_tokenizer

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "bad-merges.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    tokens = ["a", "b"] + [f"t{i}" for i in range(20000)]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["a b", "a z"])  # "z" and "ab" are not tokens
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"bad-merges\.gguf"):
        read_gguf_tokenizer(path)
    folder = _tokenizer_cache_folder(path)
    assert not folder.exists()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".staging-")]


def test_a_new_entry_never_replaces_one_already_there(gguf_path, tmp_path):
    """Two first starts of one file: the second's entry finds the first's in place and is
    dropped (the first's untouched, the second's tokenizer still built)."""
    from pagedkv.model.tokenizer import (
        _built_and_cached,
        gguf_tokenizer_fields,
        gguf_tokenizer_json,
    )

    text, kwargs = gguf_tokenizer_json(*gguf_tokenizer_fields(gguf_path))
    folder = tmp_path / "entry"
    first = _built_and_cached(folder, text, kwargs)
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    second = _built_and_cached(folder, text, kwargs)
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp
    assert second.encode(TEXTS[2]) == first.encode(TEXTS[2])
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_a_partial_entry_is_repaired_and_stale_staging_removed(gguf_path, tmp_path, monkeypatch):
    """An entry folder without its keyword arguments (a removal cut short) is replaced by the
    next start, so the start after reads it instead of converting again; a ``.staging-*``
    folder left by a killed start, older than ten minutes, is removed (a fresh one is not)."""
    import os
    import shutil
    import time

    import pagedkv.model.tokenizer as tokenizer_module
    from pagedkv.model.tokenizer import Tokenizer, _tokenizer_cache_folder

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / gguf_path.name
    shutil.copyfile(gguf_path, model)
    folder = _tokenizer_cache_folder(model)
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text("{}", encoding="utf-8")
    stale, fresh = folder.parent / ".staging-stale", folder.parent / ".staging-fresh"
    stale.mkdir()
    fresh.mkdir()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    first = Tokenizer.from_gguf(model)
    assert (folder / "pagedkv_tokenizer.json").is_file()
    assert not stale.exists() and fresh.exists()
    converted = []
    real = tokenizer_module.gguf_tokenizer_json
    monkeypatch.setattr(
        tokenizer_module,
        "gguf_tokenizer_json",
        lambda *a, **k: converted.append(1) or real(*a, **k),
    )
    later = Tokenizer.from_gguf(model)
    assert converted == []
    assert later.encode(TEXTS[2]) == first.encode(TEXTS[2])


def test_the_tokenizer_digest_covers_the_tokenizer_only(tmp_path):
    """Two GGUF files that differ in their tensors and other metadata share a tokenizer digest;
    a different token, merge, special id, chat template or architecture changes it."""
    import gguf
    import numpy as np

    from pagedkv.model.gguf_metadata import tokenizer_digest

    def write(name, arch="llama", tokens=("a", "b", "ab"), merges=("a b",), eos=1,
              template="{{ x }}", file_type=2, tensor=0.0):  # fmt: skip
        path = tmp_path / f"{name}.gguf"
        writer = gguf.GGUFWriter(path, arch)
        writer.add_file_type(file_type)
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(list(tokens))
        writer.add_token_merges(list(merges))
        writer.add_eos_token_id(eos)
        writer.add_chat_template(template)
        writer.add_tensor("output_norm.weight", np.full(4, tensor, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return tokenizer_digest(path)

    base = write("base")
    assert write("other_tensors", file_type=15, tensor=1.0) == base
    # a vocabulary longer than the header reader keeps (skipped, still hashed)
    long = tuple(f"t{i}" for i in range(5000))
    assert write("long", tokens=long) != write("long_changed", tokens=(*long[:-1], "u"))
    for changed in (
        {"tokens": ("a", "c", "ac")},
        {"merges": ("a c",)},
        {"eos": 2},
        {"template": "{{ y }}"},
        {"arch": "qwen2"},
    ):
        assert write("changed", **changed) != base, changed


def _get_gguf_tokenizer():
    try:
        from transformers.integrations.gguf import get_gguf_tokenizer
    except ImportError:
        pytest.skip("this transformers has no get_gguf_tokenizer")
    return get_gguf_tokenizer


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_tokenizer_fields_equal_transformers(model, request):
    """The fields the tokenizer is converted from, read by pagedkv's one-pass reader, are
    transformers' ``get_gguf_tokenizer``'s: a byte-level BPE vocabulary with merges (SmolLM2)
    and a SentencePiece one with scores (Gemma 3)."""
    from pagedkv.model.tokenizer import gguf_tokenizer_fields

    get_gguf_tokenizer = _get_gguf_tokenizer()
    path = request.getfixturevalue("gguf_path" if model == "smollm2" else "gemma3_gguf_path")
    assert gguf_tokenizer_fields(path) == get_gguf_tokenizer(str(path))


def _write_vocabulary(path, model="llama", special=None, add_bos=None, extra=None):
    """A GGUF file holding a 6-token vocabulary; ``extra(writer)`` adds metadata of its own."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(["<unk>", "<s>", "</s>", "\u2581a", "b", "\u2581ab"])
    writer.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -0.5])
    writer.add_token_types([2, 3, 3, 1, 1, 1])
    for key, token_id in (special or {}).items():
        writer.add_uint32(f"tokenizer.ggml.{key}", token_id)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{{ messages }}")
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("model", "special", "add_bos"),
    [
        ("llama", {"bos_token_id": 1, "eos_token_id": 2}, None),  # SentencePiece: BOS by default
        ("llama", {"unknown_token_id": 0, "padding_token_id": 2}, False),
        ("gpt2", {"bos_token_id": 5}, None),
        ("gemma4", {"bos_token_id": 1}, True),  # its template writes BOS
    ],
)
def test_tokenizer_fields_of_written_files_equal_transformers(tmp_path, model, special, add_bos):
    """The BOS default and special tokens follow transformers' reading for each kind of
    vocabulary, flag set or not."""
    from pagedkv.model.tokenizer import gguf_tokenizer_fields

    get_gguf_tokenizer = _get_gguf_tokenizer()
    path = tmp_path / "vocab.gguf"
    _write_vocabulary(path, model, special, add_bos)
    assert gguf_tokenizer_fields(path) == get_gguf_tokenizer(str(path))


@pytest.mark.parametrize("bad", [6, 2**32 - 1, "1", 1.0])
def test_a_special_token_outside_the_vocabulary_is_left_out(tmp_path, caplog, bad):
    """A special id that is not one of the vocabulary's (past its end, llama.cpp's -1 as a
    uint32, a string, a float) is logged and left out, as llama.cpp does; the others stay."""
    from pagedkv.model.tokenizer import gguf_tokenizer_fields

    def eos(writer):
        key = "tokenizer.ggml.eos_token_id"
        if isinstance(bad, int):
            writer.add_uint32(key, bad)
        elif isinstance(bad, str):
            writer.add_string(key, bad)
        else:
            writer.add_float32(key, bad)

    path = tmp_path / "vocab.gguf"
    _write_vocabulary(path, special={"bos_token_id": 1}, extra=eos)
    with caplog.at_level("WARNING", logger="pagedkv.model.tokenizer"):
        _, _, config = gguf_tokenizer_fields(path)
    assert config["eos_token"] is None and config["bos_token"] == "<s>"
    assert "tokenizer.ggml.eos_token_id" in caplog.text


def test_the_fields_reader_runs_on_the_versions_it_was_checked_against():
    from pagedkv.model.tokenizer import _fields_tested

    assert _fields_tested("5.25.0") and _fields_tested("5.26.0.dev0")
    assert not _fields_tested("5.24.1") and not _fields_tested("6.0.0")
    assert not _fields_tested("4.57.0") and not _fields_tested("main")


def test_a_vocabulary_count_past_the_end_is_refused_before_it_is_allocated(tmp_path):
    """A corrupt array count (2^61 strings in a 200-byte file) is a ModelLoadError, not a
    MemoryError or a multi-GiB list."""
    from pagedkv.errors import ModelLoadError
    from pagedkv.model.tokenizer import read_gguf_tokenizer

    path = tmp_path / "vocab.gguf"
    _write_vocabulary(path)
    data = bytearray(path.read_bytes())
    key = b"tokenizer.ggml.tokens"
    at = data.index(key) + len(key) + 4 + 4  # the value type, then the items' type
    data[at : at + 8] = (2**61).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="runs past the end of the file"):
        read_gguf_tokenizer(path)
