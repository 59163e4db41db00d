"""Tokenizer and chat template of a model, from a GGUF file or a Hugging Face folder.

A thin layer over Hugging Face's fast tokenizer (transformers builds one from the vocabulary,
merges and chat template that a GGUF file's metadata holds), plus an incremental detokenizer for
streaming (the ``tokenizers`` library's ``DecodeStream``, as vLLM V1, with a clean prompt context,
byte-fallback runs held whole and a flush at finish).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from pagedkv.errors import InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)


class Tokenizer:
    """Text <-> token ids, chat template and end-of-sequence ids of one model.

    Args:
        hf_tokenizer: a transformers fast tokenizer.
        eos_token_ids: extra end-of-sequence ids (from the model config / generation config);
            merged with the tokenizer's own eos id.
    """

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self.hf_tokenizer = hf_tokenizer
        ids = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.insert(0, hf_tokenizer.eos_token_id)
        #: ids that end a generation (deduplicated, tokenizer's eos first).
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        #: size of the vocabulary including added tokens.
        self.vocab_size: int = len(hf_tokenizer)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self._byte_token_ids: frozenset[int] | None = None
        #: ids that ``skip_special_tokens`` leaves out of the text.
        self.special_token_ids: frozenset[int] = frozenset(
            [
                i
                for i, token in getattr(hf_tokenizer, "added_tokens_decoder", {}).items()
                if getattr(token, "special", False)
            ]
            + list(getattr(hf_tokenizer, "all_special_ids", []))
        )

    @property
    def byte_token_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte-fallback tokens (``<0xE2>``...); empty for byte-level BPE.

        Their decoder turns a run of them into text as a whole (U+FFFD for each byte if the run
        is not valid UTF-8), so the incremental detokenizer holds text back while the last id is
        one of them (special tokens that ``skip_special_tokens`` leaves out do not end a run).
        """
        if self._byte_token_ids is None:
            model = getattr(self.hf_tokenizer, "backend_tokenizer", None)
            model = getattr(model, "model", None)
            ids: frozenset[int] = frozenset()
            if getattr(model, "byte_fallback", False):
                ids = frozenset(
                    i
                    for token, i in self.hf_tokenizer.get_vocab().items()
                    if len(token) == 6 and token.startswith("<0x") and token.endswith(">")
                )
            self._byte_token_ids = ids
        return self._byte_token_ids

    @property
    def has_chat_template(self) -> bool:
        """Whether the model has a chat template (base models such as Gemma 3 270M have none)."""
        return bool(getattr(self.hf_tokenizer, "chat_template", None))

    @classmethod
    def from_gguf(cls, path: str | Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Build from a GGUF file's metadata (vocabulary, merges, special ids, chat template).

        Raises:
            ModelLoadError: the file holds no tokenizer transformers can build.
        """
        return cls(read_gguf_tokenizer(path), eos_token_ids)

    @classmethod
    def from_hf_folder(cls, folder: str | Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Build from a Hugging Face model folder (tokenizer.json, tokenizer_config.json).

        Raises:
            ModelLoadError: the folder holds no readable tokenizer.
        """
        return cls(read_hf_folder_tokenizer(folder), eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the BOS token when the model's tokenizer adds one)."""
        return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; special tokens (``<|im_end|>``...) are left out by default."""
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's text on its own, special tokens included (the ``decoded_token`` of a
        logprob, as vLLM: ``convert_tokens_to_string`` of the one token; a token holding part
        of a multi-byte character gives U+FFFD)."""
        hf = self.hf_tokenizer
        return [hf.convert_tokens_to_string([t]) for t in hf.convert_ids_to_tokens(list(token_ids))]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        continue_final_message: bool = False,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int] | str:
        """Render a conversation with the model's chat template (or ``chat_template``).

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``; an assistant's may hold
                ``tool_calls`` (``[{"id", "type", "function": {"name", "arguments": dict}}]``),
                a ``tool`` message ``tool_call_id``.
            add_generation_prompt: end with the header of the assistant's turn.
            tokenize: return token ids (True) or the rendered string (False).
            continue_final_message: leave the last message open (no end-of-turn marker), so
                the model continues it (a partly written assistant reply); not with
                add_generation_prompt.
            tools: OpenAI-style tools (``[{"type": "function", "function": {"name",
                "description", "parameters"}}]``), the template's ``tools`` variable; a
                template that does not read it ignores it.
            chat_template: a Jinja template used instead of the model's.
            template_kwargs: extra variables of the render (``enable_thinking``...).

        Raises:
            InvalidRequestError: no template (a base model: send a completion prompt instead,
                or give one), a template that does not compile or fails on these messages, or
                both add_generation_prompt and continue_final_message.
        """
        from jinja2 import TemplateError

        if chat_template is None and not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template (a base model such as Gemma 3 270M); send a "
                "plain completion prompt instead of chat messages"
            )
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true: "
                "either a new assistant turn opens or the last message goes on"
            )
        try:
            return self.hf_tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=tokenize,
                return_dict=False,
                **(template_kwargs or {}),
            )
        except (TemplateError, ValueError, TypeError, LookupError, AttributeError) as e:
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from e

    def incremental_detokenizer(
        self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` for one output stream."""
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas for streaming, one step at a time.

    The contract (property-tested with random token sequences, byte tokens that split multi-byte
    characters, random prompt tails and random finish points)::

        "".join(step(...) for each step) + flush()  ==  text
            ==  decode(context + output_ids)[len(decode(context)):]

    where ``context`` is the clean prompt tail described below and ``decode`` uses
    ``skip_special_tokens``. For byte-level BPE tokenizers (SmolLM2, GPT-2 style), whose decoder
    does not depend on context, this is exactly ``decode(output_ids)``: special tokens are left out
    when ``skip_special_tokens`` (the default), rendered as their text otherwise. For
    SentencePiece tokenizers, whose decoder strips the leading space of the first token decoded,
    the first output token keeps the space it has after the prompt (as vLLM does).

    Text is emitted only once it is stable: a token that ends inside a multi-byte UTF-8 character
    yields nothing until the character completes (and, for SentencePiece byte-fallback tokens,
    whose run decodes as a whole, until a token that is not a byte token follows). :meth:`flush`
    (call it when the sequence finishes, for any reason) returns what is still held back, as
    ``decode`` shows it (U+FFFD for the bytes of an unfinished character), so the final text
    always equals the decode of the output ids.

    The streaming decode is the ``tokenizers`` library's ``DecodeStream`` (what vLLM V1 uses for
    fast tokenizers: a window of ids decoded in Rust, the text past the previous window's emitted
    once it does not end in U+FFFD). Used alone it breaks three of the contract's cases, so three
    small pieces stay here (``tests/model/test_detokenizer.py`` fails without each, checked by
    removing it, tokenizers 0.23.3):

    - Context: ``DecodeStream(ids=prompt)`` emits the prompt's own text when the prompt ends
      inside a character (the issue prompt in the tests). It is given the clean context: up to
      the last 6 prompt ids, leaving out the trailing ids that hold an unfinished character (or
      a byte-fallback run); the output's continuation bytes then decode as U+FFFD on their own,
      exactly as ``decode(output_ids)`` shows them.
    - Byte-fallback runs: ``DecodeStream`` emits "é" for ``<0xC3><0xA9>``, and a following
      ``<0xFF>`` turns the run into three U+FFFD, so the next step raises "Invalid prefix
      encountered". Ids are held here while the text ends in a run of byte tokens (skipped
      special tokens do not end a run) and handed over with the token that closes it.
    - Flush: ``DecodeStream`` has none; the held-back end is decoded here from a window of the
      last emitted ids plus the ids since (two decodes of a few ids, once per sequence).

    Cost (``benchmarks/bench_detokenizer.py --repeats 200``: 512 output ids of mixed scripts and
    emojis after a short prompt, one id per step, then flush; median of 200 runs, two runs each,
    side by side; "Intel(R) Xeon(R) Processor" (lscpu), 2 shared cores, tokenizers 0.23.3): SmolLM2
    1.6 us/token (1.8 for the two-Python-decodes algorithm this replaced), Gemma 3 270M 2.6-2.7
    (2.7-2.8): the same within noise, and nothing next to a decode step of milliseconds.

    Args:
        tokenizer: the model's :class:`Tokenizer`.
        prompt_token_ids: the prompt, used as context only (its text is never emitted).
        skip_special_tokens: leave special tokens out of the text.
    """

    __slots__ = (
        "_backend",
        "_byte_ids",
        "_held",
        "_in_byte_run",
        "_num_emitted",
        "_skip",
        "_special_ids",
        "_stream",
        "_window",
        "text",
    )

    #: Prompt ids kept as context (and emitted ids kept for flush), and the most trailing prompt
    #: ids left out to find a clean end.
    CONTEXT_TOKENS = 6
    MAX_PARTIAL_TOKENS = 4

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._backend = tokenizer.hf_tokenizer.backend_tokenizer
        self._skip = skip_special_tokens
        self._byte_ids = tokenizer.byte_token_ids
        # Skipped special tokens vanish before decoding: they neither end a byte run nor count.
        self._special_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        #: all text emitted so far.
        self.text = ""
        self._restart(list(prompt_token_ids[-self.CONTEXT_TOKENS - self.MAX_PARTIAL_TOKENS :]))

    def _restart(self, tail: list[int]) -> None:
        """A fresh stream whose context is the clean part of ``tail``."""
        context = self._clean_context(tail)
        self._stream = DecodeStream(ids=context, skip_special_tokens=self._skip)
        self._held: list[int] = []  # ids of an open byte-fallback run, not yet streamed
        self._in_byte_run = False
        # The last emitted ids (at most CONTEXT_TOKENS) and every id since: flush decodes it.
        self._window: list[int] = context
        self._num_emitted = len(context)

    def _clean_context(self, tail: list[int]) -> list[int]:
        """The longest of ``tail[:k]`` (k = len, len - 1, ...) whose decode does not end inside
        a character (nor with a byte-fallback token), cut to its last CONTEXT_TOKENS ids; ``[]``
        if none."""
        for drop in range(min(self.MAX_PARTIAL_TOKENS, len(tail)) + 1):
            context = tail[: len(tail) - drop][-self.CONTEXT_TOKENS :]
            if not context:
                return []
            if self._track_byte_run(context, False):
                continue
            if not self._decode(context).endswith("\ufffd"):
                return context
        return []

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip)

    def step(self, token_ids: int | Sequence[int]) -> str:
        """Add newly generated token ids; return the text they complete ("" if none yet)."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        elif not isinstance(token_ids, list):
            token_ids = list(token_ids)
        if not token_ids:
            return ""
        self._window.extend(token_ids)
        if self._byte_ids:
            self._in_byte_run = self._track_byte_run(token_ids, self._in_byte_run)
            if self._in_byte_run:  # the run may still turn into U+FFFD: hold it
                self._held.extend(token_ids)
                return ""
            if self._held:
                token_ids = self._held + token_ids
                self._held = []
        delta = self._stream.step(self._backend, token_ids)
        if delta is None:
            return ""  # nothing new yet, or it may end inside a character: wait for more ids
        self._mark_emitted(delta)
        return delta

    def _mark_emitted(self, delta: str) -> None:
        """Everything given so far is text now: keep the window's last ids only."""
        self.text += delta
        window = self._window
        if len(window) > self.CONTEXT_TOKENS:
            del window[: -self.CONTEXT_TOKENS]
        self._num_emitted = len(window)

    def _track_byte_run(self, token_ids: Sequence[int], in_run: bool) -> bool:
        """Whether the text ends in a run of byte-fallback tokens after ``token_ids``."""
        byte_ids, special_ids = self._byte_ids, self._special_ids
        for token_id in token_ids:
            if token_id in byte_ids:
                in_run = True
            elif token_id not in special_ids:
                in_run = False
        return in_run

    def flush(self) -> str:
        """The text still held back (the bytes of an unfinished character, as U+FFFD; "" if
        none). Call it once the sequence has finished; later steps start after it."""
        window = self._window
        if self._num_emitted == len(window):
            return ""
        emitted = self._decode(window[: self._num_emitted])
        delta = self._decode(window)[len(emitted) :]
        self.text += delta
        self._restart(window[-self.CONTEXT_TOKENS - self.MAX_PARTIAL_TOKENS :])
        return delta


def read_hf_folder_tokenizer(folder: str | Path) -> Any:
    """transformers' tokenizer of a Hugging Face model folder (:meth:`Tokenizer.from_hf_folder`
    wraps it).

    Raises:
        ModelLoadError: the folder holds no readable tokenizer.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {folder}: {e}") from e


def read_gguf_tokenizer(path: str | Path) -> Any:
    """transformers' fast tokenizer of a GGUF file (:meth:`Tokenizer.from_gguf` wraps it).

    Raises:
        ModelLoadError: the file holds no tokenizer transformers can build (a field it cannot
            read, merges naming tokens outside the vocabulary: ``tokenizers`` raises a bare
            ``Exception`` for those, turned into this).
    """
    path = Path(path)
    try:
        return _fast_tokenizer_from_gguf(path)
    except (ModelLoadError, MemoryError):
        raise
    except Exception as e:  # OSError, ValueError, KeyError...; tokenizers' bare Exception
        raise ModelLoadError(f"cannot build the tokenizer from {path}: {e}") from e


def _fast_tokenizer_from_gguf(path: Path) -> Any:
    """transformers' fast tokenizer for a GGUF file, converted once and then read from
    pagedkv's cache (:func:`_tokenizer_cache_folder`).

    ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` also builds the model config, which
    parses the whole file with ``gguf.GGUFReader`` (seconds for a 49k-token vocabulary). Newer
    transformers expose the two steps that matter (read the tokenizer fields, convert them);
    pagedkv reads the fields itself (:func:`gguf_tokenizer_fields`) and writes the converted
    tokenizer as ``tokenizer.json`` (:func:`gguf_tokenizer_json`), which the cache keeps with
    the keyword arguments the tokenizer is built with: the first start builds it from the
    entry it is about to keep, ``PreTrainedTokenizerFast(tokenizer_file=..., **kwargs)``
    (:func:`_tokenizer_from_files`; so a tokenizer that cannot be built is never kept), and
    every later start the same way from the kept entry, so later starts of the same file (or of
    any file with the same tokenizer: a copy, another quantization of the model) skip the
    reading and the conversion and give the same tokenizer. An unreadable entry is logged and
    converted again. Vocabularies under ``_MIN_CACHED_VOCAB`` tokens (milliseconds to convert)
    and starts whose cache folder is not writable build the tokenizer in memory.
    """
    cached = _tokenizer_cache_folder(path)
    if cached is not None:
        try:
            if (cached / _CACHE_KWARGS_FILE).is_file():
                return _tokenizer_from_files(cached)
            if os.path.lexists(cached):  # a removal cut short, a hand-made folder
                raise OSError(f"no {_CACHE_KWARGS_FILE} in it")
        except MemoryError:
            raise
        except Exception as e:  # OSError, JSON, arguments; tokenizers raises a bare Exception
            logger.warning("tokenizer cache %s unreadable (%s): converting again", cached, e)
            shutil.rmtree(cached, ignore_errors=True)  # where it cannot, the new one is not kept
    from pagedkv.model.gguf_tokenizer import transformers_gguf_tables

    if transformers_gguf_tables() is None:  # (kept: importing them costs 0.75 s)
        try:
            from transformers.integrations.gguf import convert_gguf_tokenizer  # noqa: F401
        except ImportError:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    architecture, fields, config = gguf_tokenizer_fields(path)
    text, kwargs = gguf_tokenizer_json(architecture, fields, config)
    if cached is not None and len(fields.get("tokens") or ()) >= _MIN_CACHED_VOCAB:
        tokenizer = _built_and_cached(cached, text, kwargs)
        if tokenizer is not None:
            return tokenizer
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast

    # in memory (no file to read from): the object is deep-copied, cheap at these sizes
    return PreTrainedTokenizerFast(tokenizer_object=Backend.from_str(text), **kwargs)


def gguf_tokenizer_json(
    architecture: str,
    fields: dict[str, Any],
    config: dict[str, Any],
    *,
    fast: bool = True,
) -> tuple[str, dict[str, Any]]:
    """``(tokenizer.json text, keyword arguments of PreTrainedTokenizerFast)`` of a GGUF
    file's tokenizer.

    Args:
        architecture, fields, config: what :func:`gguf_tokenizer_fields` returns (the file's
            architecture, its tokenizer fields under transformers' names, the tokenizer
            config: special tokens, chat template, ``add_bos_token``).
        fast: let pagedkv write the JSON where it can (False: always transformers).

    With ``fast`` (and a transformers version :func:`gguf_tokenizer_fields` was checked
    against), a byte-level BPE or Gemma vocabulary is written by
    :func:`~pagedkv.model.gguf_tokenizer.tokenizer_json`: the tokenizer transformers'
    ``convert_gguf_tokenizer`` builds (tests compare the two whole), without its classes and
    its deep copy (docs/model.md: a 1B file's first engine start 2.6-3.0 -> 2.2-2.4 s, Gemma
    3's 8.4-10.2 -> 5.8-6.2 s). Otherwise, or where the fast path declines, transformers
    converts and its tokenizer is serialized.

    Raises:
        ValueError: transformers has no converter for this kind of vocabulary. The
            ``tokenizers`` library's Exception, TypeError, KeyError: transformers cannot
            convert these fields (:func:`read_gguf_tokenizer` turns each into a
            ``ModelLoadError``).
    """
    import transformers

    text = None
    extra: dict[str, Any] = {}
    if fast and _fields_tested(transformers.__version__):
        from pagedkv.model.gguf_tokenizer import tokenizer_json

        text = tokenizer_json(architecture, fields)
    if text is None:
        from transformers.integrations.gguf import convert_gguf_tokenizer

        backend, extra = convert_gguf_tokenizer(architecture, fields)
        text = backend.to_str()
    return text, {**config, **extra}


#: A cache entry's keyword arguments of ``PreTrainedTokenizerFast`` (beside its tokenizer.json).
_CACHE_KWARGS_FILE = "pagedkv_tokenizer.json"


def _tokenizer_from_files(folder: Path) -> Any:
    """``PreTrainedTokenizerFast`` from ``folder``'s ``tokenizer.json`` and the keyword
    arguments in its :data:`_CACHE_KWARGS_FILE` (the tokenizer is read from the file, never
    deep-copied from an object; transformers' ``from_pretrained`` would also parse the whole
    tokenizer.json again in Python, about 1 s for Gemma's).

    Raises:
        OSError, ValueError (a JSON error), TypeError (arguments not a mapping), or the
        ``tokenizers`` library's Exception for an unreadable tokenizer.json.
    """
    from transformers import PreTrainedTokenizerFast

    kwargs = json.loads((folder / _CACHE_KWARGS_FILE).read_text(encoding="utf-8"))
    if not isinstance(kwargs, dict):
        raise TypeError(f"{_CACHE_KWARGS_FILE} holds {type(kwargs).__name__}, not an object")
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **kwargs)


def _write_entry_files(folder: Path, text: str, kwargs: dict[str, Any]) -> None:
    """``tokenizer.json`` (``text``) and :data:`_CACHE_KWARGS_FILE` (``kwargs``) in ``folder``.

    Raises:
        OSError: not writable. TypeError: ``kwargs`` not JSON (transformers' extra arguments
        of a kind this was not written for).
    """
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    (folder / _CACHE_KWARGS_FILE).write_text(json.dumps(kwargs), encoding="utf-8")


#: A ``.staging-*`` folder older than this (s) is a start's that was killed: removed.
_STALE_STAGING_S = 600.0


def _remove_stale_staging(parent: Path) -> None:
    """Remove the ``.staging-*`` folders in ``parent`` older than :data:`_STALE_STAGING_S`
    (a start killed while writing or building its entry leaves one); errors are ignored."""
    now = time.time()
    try:
        for staging in parent.glob(".staging-*"):
            try:
                if now - staging.stat().st_mtime > _STALE_STAGING_S:
                    shutil.rmtree(staging, ignore_errors=True)
            except OSError:
                continue
    except OSError:
        return


def _built_and_cached(folder: Path, text: str, kwargs: dict[str, Any]) -> Any | None:
    """The tokenizer built from a new cache entry (``text``, ``kwargs``) written into a
    temporary folder beside ``folder``, which is then renamed to ``folder`` (kept): a
    tokenizer that cannot be built raises and is never kept. Where ``folder`` exists by then
    (another start's entry, or an unreadable one that could not be removed) the rename fails
    and the new entry is dropped; the tokenizer built from it is returned all the same (it was
    read whole at its construction). None where the temporary folder cannot be written (a
    cache on a read-only file system): the caller builds the tokenizer in memory.

    Raises:
        The ``tokenizers`` library's Exception (or OSError, TypeError) where the tokenizer
        cannot be built from the entry.
    """
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_staging(folder.parent)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))
        staging.chmod(0o755)  # mkdtemp's 0700 would keep the entry from other users
    except OSError as e:
        logger.info("tokenizer not cached in %s: %s", folder, e)
        return None
    try:
        try:
            _write_entry_files(staging, text, kwargs)
        except (OSError, TypeError) as e:
            logger.info("tokenizer not cached in %s: %s", folder, e)
            return None
        tokenizer = _tokenizer_from_files(staging)
        try:
            staging.rename(folder)
        except OSError as e:  # a folder there already: that entry stays
            logger.info("tokenizer entry %s not replaced: %s", folder, e)
        return tokenizer
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def gguf_tokenizer_fields(path: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(architecture, tokenizer_fields, tokenizer_config)`` of a GGUF file, what
    transformers' ``get_gguf_tokenizer`` returns and its ``convert_gguf_tokenizer`` and
    ``PreTrainedTokenizerFast`` take, read by :func:`~pagedkv.model.gguf_metadata.
    read_tokenizer_metadata` in about a sixth of the time (the vocabulary and merges in one
    pass over their bytes instead of a numpy slice per string): transformers' key mapping
    (``GGUF_TOKENIZER_MAPPING``) renames the fields, and the special tokens and BOS default
    follow transformers' reading of the file (a ``llama`` (SentencePiece) vocabulary adds BOS
    unless the file says otherwise, as llama.cpp does; a ``gemma4`` file's chat template
    writes BOS itself, so none is added). Tests compare the result with
    ``get_gguf_tokenizer``'s on SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece). A
    special token whose id is not one of the vocabulary's (llama.cpp's -1, a wrong type) is
    logged and left out, as llama.cpp leaves it (transformers would take ``tokens[-1]`` or
    fail). Outside the transformers versions this was checked
    against (``_fields_tested``), or where transformers has no such mapping, its own
    ``get_gguf_tokenizer`` reads the file.

    Raises:
        ModelLoadError: the file cannot be read. KeyError: it names no architecture.
    """
    import transformers

    from pagedkv.model.gguf_tokenizer import transformers_gguf_tables

    mapping = None
    if _fields_tested(transformers.__version__):
        tables = transformers_gguf_tables()  # kept once per transformers version
        mapping = None if tables is None else tables["tokenizer_mapping"]
    if mapping is None:
        from transformers.integrations.gguf import get_gguf_tokenizer

        return get_gguf_tokenizer(str(path))
    from pagedkv.model.gguf_metadata import read_tokenizer_metadata

    metadata = read_tokenizer_metadata(path)
    architecture = metadata["general.architecture"]

    def renamed(group: str) -> dict[str, Any]:
        renames = mapping[group].items()
        return {name: metadata[f"tokenizer.{key}"] for key, name in renames
                if f"tokenizer.{key}" in metadata}  # fmt: skip

    fields, config = renamed("tokenizer"), renamed("tokenizer_config")
    if fields.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)
    elif fields.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False
    tokens = fields.get("tokens", [])
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not (
            isinstance(token_id, int) and not isinstance(token_id, bool)
            and 0 <= token_id < len(tokens)
        ):  # fmt: skip
            # llama.cpp's reading: a bad special id is no such token (-1 is its "none")
            logger.warning(
                "%s: tokenizer.ggml.%s %r is not among its %d tokens: no %s",
                path, key, token_id, len(tokens), name,
            )  # fmt: skip
            token_id = None
        config[name] = tokens[token_id] if token_id is not None else None
    return architecture, fields, config


#: transformers versions (major, minor) whose ``get_gguf_tokenizer`` gives what
#: :func:`gguf_tokenizer_fields` gives (its tests compare the two on the installed version):
#: from the first one checked to the next major version; others read with it.
_FIELDS_TESTED_SINCE = (5, 25)
_FIELDS_TESTED_BEFORE = (6, 0)


def _fields_tested(version: str) -> bool:
    """Whether transformers ``version`` (``"5.25.0"``, ``"5.26.0.dev0"``) is in the range
    :func:`gguf_tokenizer_fields` was checked against."""
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return _FIELDS_TESTED_SINCE <= major_minor < _FIELDS_TESTED_BEFORE


#: The special tokens a GGUF file names by id: tokenizer attribute -> ``tokenizer.ggml.*`` key.
_GGUF_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


#: Bumped when what the cache holds changes meaning (part of its key).
_TOKENIZER_CACHE_VERSION = 3
#: Vocabularies smaller than this convert in milliseconds and are not cached (a test's tiny
#: GGUF files would fill the cache).
_MIN_CACHED_VOCAB = 16384


def _tokenizer_cache_folder(path: Path) -> Path | None:
    """Where the converted tokenizer of the GGUF file at ``path`` is kept:
    ``$PAGEDKV_CACHE_DIR/tokenizers/gguf-<key>``, the key a hash of the file's tokenizer as
    stored (:func:`~pagedkv.model.gguf_metadata.tokenizer_digest`: its ``tokenizer.*``
    metadata and architecture) and of the transformers and tokenizers versions: a copy of the
    file, or the same model in another quantization, reads the same entry; another vocabulary
    or library converts again. None when the file's header cannot be read."""
    import hashlib

    import tokenizers
    import transformers

    from pagedkv.config import cache_dir
    from pagedkv.model.gguf_metadata import tokenizer_digest

    try:
        stored = tokenizer_digest(path)
    except ModelLoadError:
        return None
    key = "|".join(
        str(part)
        for part in (
            stored,
            transformers.__version__,
            tokenizers.__version__,
            _TOKENIZER_CACHE_VERSION,
        )
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_dir() / "tokenizers" / f"gguf-{digest}"
