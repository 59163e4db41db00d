"""A GGUF file's tokenizer written straight as a ``tokenizers`` JSON (``tokenizer.json``).

A GGUF file stores its tokenizer as metadata (llama.cpp's ``tokenizer.ggml.*``: the tokens, their
types, the merges or the scores); transformers' ``convert_gguf_tokenizer`` turns that into a
``tokenizers.Tokenizer`` through its tokenizer classes (``GPT2Tokenizer``, ``GemmaTokenizer``).
On a 128k-token vocabulary that costs about 0.9 s of Python (a class built, its vocabulary read
back, the whole tokenizer deep-copied into ``PreTrainedTokenizerFast``), and on Gemma's 262k
SentencePiece vocabulary, whose merges the file does not hold and must be derived, about 6.5 s
(4.6 s converting, 2.1 s the deep copy): most of a file's first start (later starts read the
converted tokenizer from pagedkv's cache). ``benchmarks/bench_tokenizer_json.py`` measures it.

:func:`tokenizer_json` writes the same tokenizer as one JSON text, which ``tokenizers`` parses
in Rust: for the two kinds that make up the large vocabularies people run,

- **byte-level BPE** (``tokenizer.ggml.model`` ``gpt2``: Llama 3, Qwen2/2.5/3, SmolLM2, Mistral
  Nemo): the vocabulary respelled into the byte alphabet where a token is not already, the
  file's merges, the pre-tokenizer's split for the file's ``tokenizer.ggml.pre`` (transformers'
  own table, so both follow one list);
- **Gemma's SentencePiece BPE** (``llama`` vocabulary of a ``gemma``/``gemma2``/``gemma3`` file):
  runs of spaces respelled as ``▁``, the merges derived from the vocabulary with the file's order
  as the merge priority;

and the added tokens as transformers adds them (its class's default special tokens, the file's
control tokens as special, its user-defined ones as plain added tokens). Anything else (another
kind of vocabulary, a file whose tokens the fast path would have to number past the vocabulary,
duplicate tokens, a default special token the file marks user-defined, a merge that is not a
pair) returns None and transformers converts it. Tests parse both JSON texts and
compare them whole on SmolLM2's and Gemma 3's files and on written vocabularies of each case.

Imports transformers lazily, and its byte alphabet and split table only once per transformers
version (:func:`transformers_gguf_tables`); torch-free.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

#: ``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``).
_CONTROL, _USER_DEFINED = 3, 4
#: Architectures whose SentencePiece vocabulary transformers builds with ``GemmaTokenizer``.
_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})
#: The special tokens ``GPT2Tokenizer`` and ``GemmaTokenizer`` set by default (unk, bos, eos,
#: then pad and mask): each becomes a special added token, appended to the vocabulary where the
#: file lacks it.
_GPT2_DEFAULT_SPECIALS = ("<|endoftext|>",)
_GEMMA_DEFAULT_SPECIALS = ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>")
#: The post-processor transformers' tokenizer classes start from (no BOS/EOS added; the
#: ``PreTrainedTokenizerFast`` built on the result sets its own from ``add_bos_token``).
_PLAIN_POST_PROCESSOR = {
    "type": "TemplateProcessing",
    "single": [{"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {},
}


def tokenizer_json(architecture: str, fields: dict[str, Any]) -> str | None:
    """The ``tokenizer.json`` text of a GGUF file's tokenizer, or None where transformers must
    convert it.

    Args:
        architecture: the file's ``general.architecture`` (``"llama"``, ``"gemma3"``...).
        fields: the tokenizer fields under transformers' names (``tokenizer_type``,
            ``pre_tokenizer_type``, ``tokens``, ``token_type``, ``merges``...), as
            :func:`~pagedkv.model.tokenizer.gguf_tokenizer_fields` returns them.

    Returns:
        JSON that ``tokenizers`` reads as the tokenizer ``convert_gguf_tokenizer(architecture,
        fields)[0]`` is (its merges as ``"left right"`` strings where no token holds a space,
        the form ``tokenizers`` reads fastest); None for a vocabulary outside the two kinds
        above, a case the fast path does not reproduce, or a transformers without the
        tables it reads (its GPT-2 byte alphabet, its ``GGUF_PRE_TOKENIZER_SPLITS``). Raises
        nothing of its own: fields it cannot take give None.
    """
    kind = fields.get("tokenizer_type")
    tokens = fields.get("tokens")
    pre_tokenizer_type = fields.get("pre_tokenizer_type")
    if (
        not isinstance(tokens, list)
        or not tokens
        or not all(isinstance(t, str) for t in tokens)
        or len(set(tokens)) != len(tokens)
        or not isinstance(pre_tokenizer_type, str | None)
        or not isinstance(fields.get("token_type") or [], list)
    ):
        return None
    tables = transformers_gguf_tables()  # its byte alphabet and split table
    if tables is None:
        return None
    split = tables["pre_tokenizer_splits"].get(pre_tokenizer_type)
    if kind == "gpt2":
        return _byte_level(fields, dict(enumerate(tables["byte_alphabet"])), split)
    if kind == "llama" and architecture in _GEMMA_ARCHITECTURES and split is None:
        return _gemma(fields)
    return None


#: Bumped when the tables' file changes form (part of its name).
_TABLES_VERSION = 1
#: What the tables' field mapping must hold, per group (GGUF key -> field name): the fields
#: the fast path and the reading of the special tokens take by these names.
_REQUIRED_MAPPING = {
    "tokenizer": {
        ("ggml.model", "tokenizer_type"),
        ("ggml.pre", "pre_tokenizer_type"),
        ("ggml.tokens", "tokens"),
        ("ggml.token_type", "token_type"),
        ("ggml.merges", "merges"),
    },
    "tokenizer_config": {("chat_template", "chat_template")},
}


def transformers_gguf_tables() -> dict[str, Any] | None:
    """The three tables of the installed transformers that reading and converting a GGUF
    tokenizer take, or None where this transformers lacks them:

    - ``tokenizer_mapping``: ``GGUF_TOKENIZER_MAPPING`` (GGUF key -> transformers' field name,
      per group: ``{"tokenizer": {"ggml.tokens": "tokens", ...}, "tokenizer_config": ...}``);
    - ``pre_tokenizer_splits``: ``GGUF_PRE_TOKENIZER_SPLITS`` (``tokenizer.ggml.pre`` -> the
      regex its text is split by before byte-level BPE);
    - ``byte_alphabet``: GPT-2's byte alphabet (``bytes_to_unicode``), 256 one-character
      strings, entry b the spelling of byte b.

    Importing them costs more than all of a file's conversion: the module that holds the first
    two imports transformers' model packages, whose ``__init__`` scans every model folder's
    files again (0.75 s of a 1B file's first start, holding the GIL that the start's other
    thread needs). They are facts of the installed transformers, not of a file, so they are
    read once per transformers version, as the compiled kernels are built once per machine,
    and kept in pagedkv's cache (``tokenizers/transformers-gguf-tables-<version>-v<n>.json``,
    written whole under a temporary name and renamed); a file there that is not such tables is
    logged and read again from transformers. A cache that cannot be written only costs the
    import on every first start."""
    import transformers

    from pagedkv.config import cache_dir

    path = (
        cache_dir()
        / "tokenizers"
        / f"transformers-gguf-tables-{transformers.__version__}-v{_TABLES_VERSION}.json"
    )
    try:
        tables = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        tables = None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        logger.warning("transformers' GGUF tables %s unreadable (%s): read again", path, e)
        tables = None
    if tables is not None and not _tables_valid(tables):
        logger.warning("transformers' GGUF tables %s malformed: read again", path)
        tables = None
    if tables is not None:
        return tables
    tables = _import_transformers_gguf_tables()
    if tables is not None:
        staging = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            staging.write_text(json.dumps(tables, ensure_ascii=False), encoding="utf-8")
            os.replace(staging, path)
        except OSError as e:
            logger.info("transformers' GGUF tables not cached in %s: %s", path, e)
            with contextlib.suppress(OSError):
                staging.unlink(missing_ok=True)
    return tables


def _import_transformers_gguf_tables() -> dict[str, Any] | None:
    """:func:`transformers_gguf_tables` read from transformers itself (None where it lacks
    them)."""
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
            GGUF_TOKENIZER_MAPPING,
        )
    except ImportError:
        return None
    alphabet = bytes_to_unicode()
    tables = {
        "tokenizer_mapping": {g: dict(m) for g, m in GGUF_TOKENIZER_MAPPING.items()},
        "pre_tokenizer_splits": dict(GGUF_PRE_TOKENIZER_SPLITS),
        "byte_alphabet": [alphabet.get(b) for b in range(256)],
    }
    return tables if _tables_valid(tables) else None


def _tables_valid(tables: Any) -> bool:
    """Whether ``tables`` has :func:`transformers_gguf_tables`' form."""

    def str_map(m: Any) -> bool:
        return isinstance(m, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in m.items()
        )

    if not isinstance(tables, dict):
        return False
    mapping = tables.get("tokenizer_mapping")
    alphabet = tables.get("byte_alphabet")
    return (
        isinstance(mapping, dict)
        and all(isinstance(g, str) and str_map(m) for g, m in mapping.items())
        # the groups and the fields the reading needs (a mapping without them would read no
        # vocabulary: every new file's first start would fail until the file was removed)
        and all(
            isinstance(mapping.get(group), dict) and keys <= mapping[group].items()
            for group, keys in _REQUIRED_MAPPING.items()
        )
        and str_map(tables.get("pre_tokenizer_splits"))
        and isinstance(alphabet, list)
        and len(alphabet) == 256
        and all(isinstance(c, str) and len(c) == 1 for c in alphabet)
        and len(set(alphabet)) == 256
    )


def _byte_level(fields: dict[str, Any], spelling: dict[int, str], split: str | None) -> str | None:
    """Byte-level BPE (transformers' ``byte_level_tokenizer`` + ``add_gguf_special_tokens`` +
    ``set_split_regex``): ``spelling`` GPT-2's byte -> character map, ``split`` the regex of
    the file's pre-tokenizer type (None: ByteLevel's own)."""
    merges = fields.get("merges")
    if not isinstance(merges, list) or not all(
        isinstance(m, str) and m.count(" ") == 1 for m in merges
    ):
        return None  # no merges, or one transformers would split into other than a pair
    tokens: list[str] = fields["tokens"]
    alphabet = frozenset(spelling.values())
    # a token already spelled in the byte alphabet stays; another is spelled byte by byte
    vocab_tokens = [
        t if alphabet.issuperset(t) else "".join(spelling[b] for b in t.encode("utf-8"))
        for t in tokens
    ]
    vocab = dict(zip(vocab_tokens, range(len(vocab_tokens)), strict=True))
    if len(vocab) != len(tokens):  # respelling made two tokens one
        return None
    added = _added_tokens(fields, vocab, _GPT2_DEFAULT_SPECIALS, lambda t: alphabet.issuperset(t))
    if added is None:
        return None
    pre_tokenizer: dict[str, Any] = {
        "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True,
    }  # fmt: skip
    if split is not None:
        pre_tokenizer = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                 "use_regex": False},
            ],
        }  # fmt: skip
    model = {
        "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
        "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
        "ignore_merges": False, "vocab": vocab, "merges": list(merges),
    }  # fmt: skip
    decoder = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
               "use_regex": True}  # fmt: skip
    return _document(added, None, pre_tokenizer, decoder, model)


def _gemma(fields: dict[str, Any]) -> str | None:
    """Gemma's SentencePiece BPE (transformers' ``gemma_tokenizer`` + ``add_gguf_special_tokens``):
    a token of two or more spaces (and nothing else) is spelled with ``▁``, and the merges are
    derived from the vocabulary (:func:`_derived_merges`)."""
    if "merges" in fields:  # transformers would read them (None included: it fails)
        return None
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in fields["tokens"]]
    vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    if len(vocab) != len(tokens):  # respelling made two tokens one
        return None
    added = _added_tokens(fields, vocab, _GEMMA_DEFAULT_SPECIALS, None)
    if added is None:
        return None
    model = {
        "type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
        "ignore_merges": False, "vocab": vocab,
        "merges": _derived_merges(vocab, as_pairs=any(" " in t for t in tokens)),
    }  # fmt: skip
    normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    pre_tokenizer = {"type": "Split", "pattern": {"String": " "},
                     "behavior": "MergedWithPrevious", "invert": False}  # fmt: skip
    decoder = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ],
    }
    return _document(added, normalizer, pre_tokenizer, decoder, model)


def _derived_merges(vocab: dict[str, int], *, as_pairs: bool) -> list[Any]:
    """The merges a vocabulary implies, in transformers' ``generate_merges`` order with each
    token's score its negated position (what ``gemma_tokenizer`` passes): every split of a token
    into two tokens of the vocabulary, ordered by score (the earlier token first), then by the
    left part's length and the right part's (longer first). The scores are distinct, and one
    token's splits differ in the left part's length, so no two merges tie: this order is the
    whole of it. ``vocab``: token -> id, with distinct tokens. Each merge is ``"left right"``
    (``tokenizers`` reads that form faster than a pair) unless ``as_pairs`` (a token
    holds a space)."""
    merges: list[Any] = []
    append = merges.append
    for piece in vocab:  # ids ascending: the dict was built in the file's order
        for cut in range(len(piece) - 1, 0, -1):
            left = piece[:cut]
            if left in vocab:
                right = piece[cut:]
                if right in vocab:
                    append([left, right] if as_pairs else f"{left} {right}")
    return merges


def _added_tokens(
    fields: dict[str, Any],
    vocab: dict[str, int],
    defaults: tuple[str, ...],
    control_ok: Callable[[str], bool] | None,
) -> list[dict[str, Any]] | None:
    """The ``added_tokens`` entries, by id: the class's ``defaults`` and the file's control
    tokens as special (a control token ``control_ok`` refuses is left out, transformers' rule for
    byte-level vocabularies), its user-defined tokens found in the vocabulary as plain added
    tokens. A default the vocabulary lacks is appended after it (``GPT2Tokenizer``'s
    ``<|endoftext|>`` in a Llama 3 vocabulary). None where transformers' result is not this
    (a default the file also marks user-defined, two defaults missing)."""
    special: dict[int, str] = {}
    plain: dict[int, str] = {}
    size = len(vocab)
    missing = [t for t in dict.fromkeys(defaults) if t not in vocab]
    if len(missing) > 1:
        return None
    types = fields.get("token_type") or ()
    tokens = fields["tokens"]
    for token in defaults:
        special[vocab.get(token, size)] = token
    # zip as transformers does: a short list of types leaves the last tokens plain
    for token, token_type in zip(tokens, types, strict=False):
        if token_type == _CONTROL and (control_ok is None or control_ok(token)):
            if token not in vocab:  # respelled: transformers would append it
                return None
            special[vocab[token]] = token
    for token, token_type in zip(tokens, types, strict=False):
        if token_type == _USER_DEFINED and token in vocab:
            token_id = vocab[token]
            if token_id in special:  # made special before: transformers' result not checked
                return None
            plain[token_id] = token
        elif token_type == _USER_DEFINED and token in missing:
            return None
    entries = [(i, t, True) for i, t in special.items()] + [(i, t, False) for i, t in plain.items()]
    return [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": is_special}
        for i, t, is_special in sorted(entries)
    ]  # fmt: skip


def _document(
    added: list[dict[str, Any]],
    normalizer: dict[str, Any] | None,
    pre_tokenizer: dict[str, Any],
    decoder: dict[str, Any],
    model: dict[str, Any],
) -> str:
    # msgspec: the 3 MB of a 128k vocabulary in 0.02 s (the standard library's json 0.2-0.3 s,
    # on a first start's critical path); the same JSON value, without the optional spaces
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": _PLAIN_POST_PROCESSOR,
        "decoder": decoder,
        "model": model,
    }
    return msgspec.json.encode(document).decode("utf-8")
