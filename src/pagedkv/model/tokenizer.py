"""Tokenizer and chat template of a model, from a GGUF file or a Hugging Face folder.

A thin layer over Hugging Face's fast tokenizer (transformers builds one from the vocabulary,
merges and chat template that a GGUF file's metadata holds), plus an incremental detokenizer for
streaming built on ``tokenizers.decoders.DecodeStream``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pagedkv.errors import ModelLoadError


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
        path = Path(path)
        try:
            hf_tokenizer = _fast_tokenizer_from_gguf(path)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot build the tokenizer from {path}: {e}") from e
        return cls(hf_tokenizer, eos_token_ids)

    @classmethod
    def from_hf_folder(cls, folder: str | Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Build from a Hugging Face model folder (tokenizer.json, tokenizer_config.json).

        Raises:
            ModelLoadError: the folder holds no readable tokenizer.
        """
        from transformers import AutoTokenizer

        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot load the tokenizer of {folder}: {e}") from e
        return cls(hf_tokenizer, eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the BOS token when the model's tokenizer adds one)."""
        return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; special tokens (``<|im_end|>``...) are left out by default."""
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
    ) -> list[int] | str:
        """Render a conversation with the model's chat template.

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``.
            add_generation_prompt: end with the header of the assistant's turn.
            tokenize: return token ids (True) or the rendered string (False).

        Raises:
            InvalidRequestError: the model has no chat template (a base model: send a
                completion prompt instead) or the messages do not fit it.
        """
        from pagedkv.errors import InvalidRequestError

        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template (a base model such as Gemma 3 270M); send a "
                "plain completion prompt instead of chat messages"
            )
        try:
            return self.hf_tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                return_dict=False,
            )
        except (ValueError, TypeError, KeyError) as e:
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from e

    def incremental_detokenizer(
        self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` for one output stream."""
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas for streaming, one step at a time.

    Text is emitted only once it is stable: a token that ends inside a multi-byte UTF-8 character
    (byte-level BPE splits "你" into several tokens) yields nothing until the character is
    complete, so the concatenation of all deltas equals the full decode. The prompt's ids, when
    given, seed the decoder so that the first output token gets its context (leading spaces of
    SentencePiece tokenizers).

    Args:
        tokenizer: the model's :class:`Tokenizer`.
        prompt_token_ids: the prompt, used as context only (its text is not emitted).
        skip_special_tokens: leave special tokens out of the text.
    """

    __slots__ = ("_backend", "_stream", "text")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.hf_tokenizer.backend_tokenizer
        # Only the tail of the prompt matters as context; keep the seed short.
        ids = list(prompt_token_ids[-8:]) if prompt_token_ids else None
        self._stream = DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens)
        #: all text emitted so far.
        self.text = ""

    def step(self, token_ids: int | Sequence[int]) -> str:
        """Add newly generated token ids; return the text they complete ("" if none yet)."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        pieces = []
        for token_id in token_ids:
            piece = self._stream.step(self._backend, token_id)
            if piece:
                pieces.append(piece)
        delta = "".join(pieces)
        self.text += delta
        return delta


def _fast_tokenizer_from_gguf(path: Path) -> Any:
    """transformers' fast tokenizer for a GGUF file.

    ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` also builds the model config, which
    parses the whole file with ``gguf.GGUFReader`` (seconds for a 49k-token vocabulary). Newer
    transformers expose the two steps that matter (read the tokenizer fields, convert them);
    use them when present. The result is the same tokenizer (tests compare the two).
    """
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    architecture, tokenizer_fields, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra_kwargs = convert_gguf_tokenizer(architecture, tokenizer_fields)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra_kwargs)
