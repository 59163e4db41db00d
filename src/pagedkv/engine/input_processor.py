"""Prompts -> validated token ids, with every rule of what the engine accepts in one place
(vLLM V1's ``Processor``).

One :class:`InputProcessor` serves :class:`~pagedkv.engine.llm_engine.LLMEngine` (``LLM``), the
OpenAI server and the cluster's front end. It takes every prompt form the engine takes:

- text (``"..."``), tokenized with the model's tokenizer;
- token ids (``[1, 2, 3]``), checked against the vocabulary;
- vLLM's ``{"prompt": text}`` and ``{"prompt_token_ids": ids}`` (with an optional
  ``"prompt"`` text, then only reported);
- chat messages (``[{"role": ..., "content": ...}, ...]``), rendered with the model's chat
  template.

The length rule runs as early as it can: a text prompt longer than :attr:`max_prompt_chars`
characters cannot fit in ``max_model_len`` tokens (no token of the vocabulary covers more than
the longest token's characters), so it is refused before the tokenizer sees it: a 10 MB prompt
costs a length comparison, not seconds of tokenizing. The exact check follows on the token ids.

Threads: the tokenizer is not shared between threads. The engine keeps one processor for its
own thread (``LLM``); a server gives its processor a copy of the tokenizer
(:meth:`InputProcessor.copy`) and runs it on one input thread of its own (:class:`InputThread`),
never on the engine's step thread, so tokenizing a long prompt delays only its own request
(the ``tokenizers`` library releases the GIL while it encodes).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedkv.engine.structured_output import parse_constraint
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import (
    BeamSearchParams,
    SamplingParams,
    check_text,
    resolve_max_tokens,
)
from pagedkv.validation import is_int

#: Every prompt form the engine takes (see the module docstring).
Prompt = str | Sequence[int] | dict[str, Any] | Sequence[dict[str, Any]]

PROMPT_FORMS = (
    "a prompt must be a str, a list of token ids, {'prompt': str}, {'prompt_token_ids': [int]} "
    "or a list of chat messages ({'role': ..., 'content': ...})"
)

T = TypeVar("T")
_P = TypeVar("_P", SamplingParams, BeamSearchParams)


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A prompt as the engine takes it.

    Attributes:
        token_ids: the prompt's token ids ``[num_prompt_tokens]``, each in the vocabulary.
        text: the prompt's text (after the chat template), or None for token ids whose text
            was not asked for.
    """

    token_ids: list[int]
    text: str | None = None


class InputProcessor:
    """Turns prompts into validated token ids, and checks sampling parameters against the
    model and the engine's limits (see the module docstring).

    Args:
        tokenizer: the model's tokenizer (:class:`pagedkv.model.tokenizer.Tokenizer` or an
            object with its ``encode`` / ``decode`` / ``decode_tokens`` /
            ``apply_chat_template`` / ``has_chat_template``).
        vocab_size: the model's vocabulary size (token ids are in ``[0, vocab_size)``).
        max_model_len: most tokens (prompt + output) of one request.
        max_logprobs: most ``logprobs`` / ``prompt_logprobs`` one request may ask for
            (``--max-logprobs``).
        policy: the scheduling policy, ``"fcfs"`` or ``"priority"``; a non-zero ``priority``
            needs ``"priority"``.
        max_token_chars: most characters one token covers; default: the longest entry of the
            tokenizer's vocabulary (``get_vocab()``), else no character bound.
        structured_outputs: the engine's
            :class:`~pagedkv.engine.structured_output.StructuredOutputManager` (its parse
            cache is shared with the engine); None: constraints are parsed without a cache.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        max_model_len: int,
        max_logprobs: int,
        policy: str = "fcfs",
        max_token_chars: int | None = None,
        structured_outputs: Any = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.structured_outputs = structured_outputs
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.policy = policy
        if max_token_chars is None:
            max_token_chars = _longest_token_chars(tokenizer)
        self.max_token_chars = max_token_chars
        #: Longest text (characters) that can still fit in max_model_len tokens; longer text is
        #: refused before tokenizing. None: no bound known.
        self.max_prompt_chars: int | None = (
            None if max_token_chars is None else max_model_len * max_token_chars
        )
        #: True when "" tokenizes to no token (no BOS): an empty text prompt is then refused.
        self.empty_text_is_empty = not tokenizer.encode("", add_special_tokens=True)

    def copy(self) -> InputProcessor:
        """The same processor with its own copy of the tokenizer, for another thread (the copy
        is not used in the calling thread)."""
        twin = copy.copy(self)
        twin.tokenizer = copy.deepcopy(self.tokenizer)
        twin.structured_outputs = self.structured_outputs  # shared: its parse cache locks
        return twin

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to a cluster's front end) without the engine's structured-output manager,
        which holds a lock and a compile thread: the copy parses constraints itself."""
        state = dict(self.__dict__)
        state["structured_outputs"] = None
        return state

    @property
    def has_chat_template(self) -> bool:
        """False for a base model (no chat template): chat requests are refused."""
        return bool(getattr(self.tokenizer, "has_chat_template", True))

    # ---- prompts ------------------------------------------------------------------------------

    def process(
        self, prompt: Prompt, *, add_special_tokens: bool = True, with_text: bool = False
    ) -> ProcessedPrompt:
        """Any :data:`Prompt` form -> its token ids (and text).

        Args:
            prompt: see the module docstring.
            add_special_tokens: text is tokenized with the tokenizer's special tokens (BOS).
            with_text: decode token-id prompts to text too (echo); text prompts always keep it.

        Raises:
            InvalidRequestError: a prompt of no known form, unknown keys of a prompt dict, text
                that is not valid Unicode, text or token ids that cannot fit in max_model_len
                tokens, token ids outside the vocabulary, or an empty prompt. ``param`` is
                ``"prompt"`` (``"messages"`` for chat messages).
        """
        if isinstance(prompt, str):
            return self.process_text(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, dict):
            return self._process_dict(prompt, add_special_tokens, with_text)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            return self.process_chat(items)
        if not all(is_int(t) for t in items):
            raise InvalidRequestError(PROMPT_FORMS, param="prompt")
        return self.process_token_ids(items, with_text=with_text)

    def process_text(
        self,
        text: str,
        *,
        add_special_tokens: bool = True,
        param: str = "prompt",
        allow_empty: bool = False,
    ) -> ProcessedPrompt:
        """Text -> token ids; refused before tokenizing when it is too long to ever fit.
        ``allow_empty``: no tokens is an answer, not an error (``/tokenize`` of "").

        Raises:
            InvalidRequestError: see :meth:`process`.
        """
        self.check_text(text, param)
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if ids or not allow_empty:
            self.check_token_ids(ids, param)
        return ProcessedPrompt(ids, text)

    def process_token_ids(
        self, token_ids: Sequence[int], *, with_text: bool = False, param: str = "prompt"
    ) -> ProcessedPrompt:
        """Token ids, checked; decoded to text (special tokens kept) when ``with_text``.

        Raises:
            InvalidRequestError: see :meth:`process`.
        """
        ids = list(token_ids)
        self.check_token_ids(ids, param)
        text = self.tokenizer.decode(ids, skip_special_tokens=False) if with_text else None
        return ProcessedPrompt(ids, text)

    def process_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ProcessedPrompt:
        """Chat messages -> the model's chat template -> token ids.

        Args:
            messages: ``[{"role": ..., "content": str}, ...]`` (with ``tool_calls`` /
                ``tool_call_id`` where the conversation has them).
            add_generation_prompt: open the assistant's turn.
            continue_final_message: leave the last message open for the model to go on.
            add_special_tokens: add the tokenizer's special tokens to the rendered text (the
                template usually writes them itself, hence False, as vLLM).
            tools: OpenAI-style tools, the template's ``tools`` variable.
            chat_template: a Jinja template used instead of the model's.
            template_kwargs: extra variables of the render.

        Raises:
            InvalidRequestError: no chat template (a base model), text that is not valid
                Unicode, messages too long to ever fit, messages the template refuses, both
                options true; ``param`` is ``"messages"``.
        """
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true: either "
                "a new assistant turn opens or the last message goes on",
                param="continue_final_message",
            )
        total = 0
        for message in messages:
            for value in message.values():
                if isinstance(value, str):
                    check_text(value, "messages")
                    total += len(value)
        self._check_num_chars(total, "messages")
        # Only what is set is passed: a tokenizer without these options keeps working.
        extra: dict[str, Any] = {}
        if tools is not None:
            extra["tools"] = tools
        if chat_template is not None:
            extra["chat_template"] = chat_template
        if template_kwargs:
            extra["template_kwargs"] = template_kwargs
        text = self.tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **extra,
        )
        return self.process_text(text, add_special_tokens=add_special_tokens, param="messages")

    # ---- checks ---------------------------------------------------------------------------------

    def check_text(self, text: str, param: str = "prompt") -> None:
        """Valid Unicode, and not so long that it cannot fit (a comparison, no tokenizing).

        Raises:
            InvalidRequestError: naming ``param``.
        """
        self._check_num_chars(len(text), param)
        check_text(text, param)

    def _check_num_chars(self, num_chars: int, param: str) -> None:
        limit = self.max_prompt_chars
        if limit is not None and num_chars > limit:
            raise InvalidRequestError(
                f"{param}: {num_chars} characters cannot fit in max_model_len="
                f"{self.max_model_len} tokens (no token covers more than {self.max_token_chars} "
                f"characters, so at most {limit} characters could)",
                param=param,
            )

    def check_token_ids(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        """Non-empty, at most max_model_len tokens, every id in the vocabulary.

        Raises:
            InvalidRequestError: naming ``param``.
        """
        if not token_ids:
            raise InvalidRequestError(f"{param}: the prompt is empty", param=param)
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"{param}: the prompt has {len(token_ids)} tokens, more than "
                f"max_model_len={self.max_model_len}",
                param=param,
            )
        if not 0 <= min(token_ids) <= max(token_ids) < self.vocab_size:
            raise InvalidRequestError(
                f"{param}: prompt token ids must be in [0, {self.vocab_size}) (the vocabulary)",
                param=param,
            )

    def check_params(self, params: SamplingParams | BeamSearchParams, priority: int = 0) -> None:
        """The checks of a request against this model and engine (SamplingParams checks what
        needs neither): top_k, stop_token_ids and logit_bias against the vocabulary, logprobs
        and prompt_logprobs against max_logprobs, priority against the policy. Of a
        :class:`BeamSearchParams`, the priority here; the engine checks beam_width against
        max_num_seqs and the vocabulary when it adds the search.

        Raises:
            InvalidRequestError: naming the field.
        """
        if isinstance(params, BeamSearchParams):
            self._check_priority(priority)
            return
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                "sampling_params must be a SamplingParams or a BeamSearchParams, got "
                f"{type(params).__name__}"
            )
        vocab_size = self.vocab_size
        if params.top_k > vocab_size:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (off) or in [1, {vocab_size}] (the vocabulary size), "
                f"got {params.top_k}",
                param="top_k",
            )
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or ()),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name}: token id {bad[0]} is out of the vocabulary [0, {vocab_size})",
                    param=name,
                )
        limit = self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise InvalidRequestError(
                    f"{name}: requested {value}, which is more than the most allowed, {limit} "
                    "(the engine's max_logprobs)",
                    param=name,
                )
        self._check_priority(priority)

    def resolve_max_tokens(self, params: _P, num_prompt_tokens: int) -> _P:
        """``params`` with ``max_tokens`` resolved for a prompt of ``num_prompt_tokens`` tokens
        (None: the room left in max_model_len; :func:`~pagedkv.sampling_params.resolve_max_tokens`),
        once, before the request is queued. The one place for every request kind: sampling
        (n >= 1) and beam search (``LLMEngine.add_request`` calls it for both; the HTTP layer
        and ``LLM`` pass the client's value through, None when absent).

        Raises:
            InvalidRequestError: ``param="prompt"``, max_tokens None and a prompt that leaves no
                room to generate.
        """
        if params.max_tokens is not None:
            return params
        max_tokens = resolve_max_tokens(None, num_prompt_tokens, self.max_model_len)
        if max_tokens < 1:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens, which leaves no room to generate "
                f"within max_model_len={self.max_model_len}",
                param="prompt",
            )
        return dataclasses.replace(params, max_tokens=max_tokens)

    def _check_priority(self, priority: int) -> None:
        if not is_int(priority) or priority.bit_length() > 63:
            raise InvalidRequestError(
                f"priority must be an int64, got {priority!r}", param="priority"
            )
        if priority and self.policy != "priority":
            raise InvalidRequestError(
                "priority needs the engine to schedule by priority (--policy priority)",
                param="priority",
            )

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Parse the request's ``structured_outputs`` constraint, if any (xgrammar, no
        tokenizer; cached, so the engine does not parse it again): a schema, regex or grammar
        that cannot compile is refused here. Run it off the engine's thread (the server's
        input thread).

        Raises:
            InvalidRequestError: naming ``structured_outputs`` and xgrammar's reason.
        """
        constraint = params.structured_outputs
        if constraint is None:
            return
        if self.structured_outputs is not None:
            self.structured_outputs.parse(constraint)
        else:
            parse_constraint(constraint)

    # ---- tokenizer routes -----------------------------------------------------------------------

    def decode(self, token_ids: Sequence[int], param: str = "tokens") -> str:
        """Token ids -> text, special tokens kept.

        Raises:
            InvalidRequestError: an id outside the vocabulary (naming ``param``).
        """
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise InvalidRequestError(
                f"{param} must be in [0, {self.vocab_size}) (the vocabulary)", param=param
            )
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def decode_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text (echo with logprobs, /tokenize's ``token_strs``)."""
        return self.tokenizer.decode_tokens(list(token_ids))

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: class, limits, special tokens and chat template."""
        hf = getattr(self.tokenizer, "hf_tokenizer", None)
        info: dict[str, Any] = {
            "tokenizer_class": type(hf or self.tokenizer).__name__,
            "model_max_length": self.max_model_len,
            "vocab_size": self.vocab_size,
        }
        for name in ("eos_token", "bos_token", "pad_token", "unk_token", "chat_template"):
            value = getattr(hf, name, None)
            info[name] = value if isinstance(value, str) or value is None else str(value)
        return info

    def _process_dict(
        self, prompt: dict[str, Any], add_special_tokens: bool, with_text: bool
    ) -> ProcessedPrompt:
        """vLLM's ``{"prompt": text}`` and ``{"prompt_token_ids": ids}`` prompt forms."""
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unknown:
            hint = " (chat messages go to LLM.chat)" if "role" in prompt else ""
            raise InvalidRequestError(
                f"unknown prompt key(s) {unknown}{hint}; {PROMPT_FORMS}", param="prompt"
            )
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise InvalidRequestError(
                f"prompt['prompt'] must be a str, got {text!r}", param="prompt"
            )
        if "prompt_token_ids" not in prompt:
            if text is None:
                raise InvalidRequestError(PROMPT_FORMS, param="prompt")
            return self.process_text(text, add_special_tokens=add_special_tokens)
        if text is not None:
            check_text(text, "prompt")
        token_ids = prompt["prompt_token_ids"]
        if not isinstance(token_ids, list | tuple) or not all(is_int(t) for t in token_ids):
            raise InvalidRequestError(
                "prompt['prompt_token_ids'] must be a list of token ids", param="prompt"
            )
        if text is not None:
            self.check_token_ids(list(token_ids))
            return ProcessedPrompt(list(token_ids), text)
        return self.process_token_ids(token_ids, with_text=with_text)


def _longest_token_chars(tokenizer: Any) -> int | None:
    """Characters of the vocabulary's longest entry: for byte-level BPE each character of an
    entry stands for one byte of text (so for at least one character of it), for SentencePiece
    for one character; either way no token covers more characters of text than its entry has."""
    hf = getattr(tokenizer, "hf_tokenizer", None)
    get_vocab = getattr(hf, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab()
    return max(map(len, vocab), default=None) if vocab else None


class InputThread:
    """One thread that runs an :class:`InputProcessor` for an event loop: prompts are
    tokenized there, never on the engine's step thread, one at a time (the processor's
    tokenizer is used by this thread only).

    Args:
        processor: the processor this thread owns (give it its own tokenizer:
            :meth:`InputProcessor.copy`).
    """

    def __init__(self, processor: InputProcessor) -> None:
        self.processor = processor
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-input")

    async def run(self, fn: Callable[[InputProcessor], T]) -> T:
        """``fn(processor)`` on the input thread; its result, or its exception."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, self.processor)

    def close(self) -> None:
        """Stop the thread (work already queued still runs)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
