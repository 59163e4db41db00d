"""A torch-free stand-in for LLMEngine, for fast server tests.

It keeps the engine's contract (add_request / step -> incremental RequestOutputs with n
CompletionOutputs / abort_request / has_unfinished_requests / get_stats / reset_prefix_cache),
uses the engine's real SamplingParams and output classes, and counts KV blocks like a paged cache,
so the server's streaming, abort and leak handling are tested without a model. Tokens are
characters; the "model" spells out a fixed sentence from an offset: the prompt's token sum for
temperature 0, else the seed (+ sample index, as the engine does for n > 1). Log-probabilities
are made up but have the engine's shapes: the chosen token ranks first (logprob -0.5), then the
top-k alternatives (code points from U+0100, logprob -1 - rank); prompt logprobs likewise, the
first position None.

Tests never depend on the machine's speed: instead of sleeping, a test that needs a request to
still run at some point (a client leaving mid-stream, a reset while blocks are in use) holds
requests with :meth:`FakeEngine.hold` and lets them go with :meth:`FakeEngine.release` once it
has seen what it waits for.

Faults, as LLMEngine has them: a prompt containing FAIL_MARKER makes the step that runs it raise
after finishing that request with finish_reason "error" (a request's fault: the server must go on);
``fail_after_steps`` breaks the fake for good (every step and ``check_health`` raise: an engine
fault); ``fail_with`` makes the next step raise that exception (e.g. MemoryError).
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np

from pagedkv.engine.input_processor import InputProcessor
from pagedkv.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedkv.engine.stats import SchedulerStats
from pagedkv.errors import InvalidRequestError
from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import BeamSearchParams, SamplingParams

SENTENCE = "the quick brown fox jumps over the lazy dog. "
#: A prompt containing this fails the engine step that runs it (and only that request).
FAIL_MARKER = "<fail-step>"


def token_text(token_id: int) -> str:
    """A token's text: its code point, U+FFFD for a surrogate (no text has one alone; a real
    tokenizer decodes bytes that are not UTF-8 to U+FFFD likewise)."""
    return "\ufffd" if 0xD800 <= token_id < 0xE000 else chr(token_id)


class FakeTokenizer:
    """One token per character; the chat template wraps each message in role tags."""

    eos_token_ids = (0,)
    vocab_size = 0x110000  # one token per Unicode code point

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(token_text, token_ids))

    def decode_tokens(self, token_ids: list[int]) -> list[str]:
        return [token_text(t) for t in token_ids]

    def apply_chat_template(
        self,
        messages,
        add_generation_prompt=True,
        tokenize=True,
        continue_final_message=False,
        tools=None,
        chat_template=None,
        template_kwargs=None,
    ):
        """Role tags; tools as ``<tools>[names]``; an assistant's tool calls as JSON after its
        content; a tool message's id in its tag. ``chat_template``: rendered by Jinja's sandbox
        with ``messages``, ``tools``, ``add_generation_prompt`` and ``template_kwargs``."""
        if chat_template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            text = (
                ImmutableSandboxedEnvironment()
                .from_string(chat_template)
                .render(
                    messages=messages,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    **(template_kwargs or {}),
                )
            )
            return self.encode(text) if tokenize else text
        text = ""
        if tools:
            text += f"<tools>{[t['function']['name'] for t in tools]}\n"
        for m in messages:
            tag = m["role"] + (f" {m['tool_call_id']}" if "tool_call_id" in m else "")
            calls = json.dumps(m["tool_calls"]) if m.get("tool_calls") else ""
            text += f"<{tag}>{m['content']}{calls}\n"
        if continue_final_message:
            text = text.removesuffix("\n")
        elif add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text


#: The fake's alternatives at a position are code points from here on (none is in SENTENCE).
FIRST_ALTERNATIVE = 0x100


def fake_position(token_id: int, k: int) -> dict[int, Logprob]:
    """A made-up position: ``token_id`` first (rank 1, logprob -0.5), then k - 1 alternatives
    (ranks 2..k, logprob -1 - rank), as the engine's ``{token id: Logprob}``."""
    position = {token_id: Logprob(-0.5, rank=1, decoded_token=token_text(token_id))}
    alternatives = (t for t in itertools.count(FIRST_ALTERNATIVE) if t != token_id)
    for rank, alternative in zip(range(2, k + 1), alternatives, strict=False):
        position[alternative] = Logprob(
            -1.0 - rank, rank=rank, decoded_token=token_text(alternative)
        )
    return position


@dataclass(slots=True)
class _FakeSample:
    offset: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    num_emitted_chars: int = 0
    finish_reason: str | None = None
    error: str | None = None


@dataclass(slots=True)
class _FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    samples: list[_FakeSample] = field(default_factory=list)
    poisoned: bool = False
    prompt_logprobs_sent: bool = False
    pooling: PoolingParams | None = None  # a pooling request: one step, then its embedding

    @property
    def num_blocks_tokens(self) -> int:
        """Tokens held in the KV cache: the prompt once per sample plus its output."""
        return sum(len(self.prompt_token_ids) + max(s.num_tokens, 1) for s in self.samples)


@dataclass(slots=True)
class FakeStats:
    scheduler: SchedulerStats


class FakeEngine:
    """Each step gives every sample of every running request one character; requests wait
    while their blocks (block_size characters each) do not fit in num_blocks; held requests
    (:meth:`hold`) stop after a given number of characters until :meth:`release`."""

    #: Token ids are code points.
    vocab_size = 0x110000

    def __init__(
        self,
        *,
        num_blocks: int = 256,
        block_size: int = 4,
        max_model_len: int = 256,
        max_num_seqs: int = 64,
        policy: str = "fcfs",
        max_logprobs: int = 20,
    ) -> None:
        self.tokenizer = FakeTokenizer()
        # One token per character: no token covers more than one character.
        self.input_processor = InputProcessor(
            self.tokenizer,
            vocab_size=self.vocab_size,
            max_model_len=max_model_len,
            max_logprobs=max_logprobs,
            policy=policy,
            max_token_chars=1,
        )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.waiting: list[_FakeRequest] = []
        self.running: list[_FakeRequest] = []
        self.aborted: list[_FakeRequest] = []
        self.num_used_blocks = 0
        self.num_prefix_queries = 0
        self.num_aborted = 0
        self.fail_after_steps: int | None = None  # break the fake for good (engine fault)
        self.broken = False
        self.fail_with: BaseException | None = None  # the next step raises it
        self.num_failed_steps = 0
        self.added: list[tuple[str, object, SamplingParams, str | None]] = []
        # The gate (set by the test thread, read by the engine thread).
        self._hold_after: int | None = None
        self._hold_ids: frozenset[str] | None = None
        self._released = threading.Event()

    # ---- the gate -------------------------------------------------------------------------------

    def hold(self, after_tokens: int = 0, request_ids: Collection[str] | None = None) -> None:
        """From now on, each sample of the requests ``request_ids`` (default: all) stops after
        ``after_tokens`` characters and stays unfinished, holding its blocks, until
        :meth:`release`. Aborts still go through."""
        self._released.clear()
        self._hold_ids = None if request_ids is None else frozenset(request_ids)
        self._hold_after = after_tokens

    def release(self) -> None:
        """Let held requests run on."""
        self._hold_after = None
        self._released.set()

    def _is_held(self, req: _FakeRequest) -> bool:
        after = self._hold_after
        if after is None or (self._hold_ids is not None and req.request_id not in self._hold_ids):
            return False
        return all(s.num_tokens >= after or s.finish_reason is not None for s in req.samples)

    # ---- engine API ---------------------------------------------------------------------------

    def add_request(self, request_id, prompt, sampling_params, priority=0, cache_salt=None):
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict):  # {"prompt_token_ids": [...]} (the server's form)
            ids = list(prompt["prompt_token_ids"])
        elif prompt and isinstance(prompt[0], dict):
            ids = self.tokenizer.apply_chat_template(prompt)
        else:
            ids = list(prompt)
        params = sampling_params
        if isinstance(params, PoolingParams):
            self._add_pooling(request_id, prompt, ids, params)
            return
        if isinstance(params, BeamSearchParams):  # the fake's beams: n greedy samples
            params = SamplingParams(
                n=params.beam_width, max_tokens=params.max_tokens, temperature=0.0
            )
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if not 0 <= min(ids) <= max(ids) < self.vocab_size:  # as LLMEngine checks them
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size})", param="prompt"
            )
        if params.top_k > self.vocab_size:
            raise InvalidRequestError(f"top_k must be <= {self.vocab_size}", param="top_k")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(ids)
            if max_tokens < 1:
                raise InvalidRequestError(
                    f"the prompt has {len(ids)} tokens, which leaves no room to generate "
                    f"within max_model_len={self.max_model_len}",
                    param="prompt",
                )
        elif len(ids) + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}",
                param="max_tokens",
            )
        need = params.n * -(-(len(ids) + max_tokens) // self.block_size)
        if need > self.num_blocks:  # the fake admits a request's samples together
            raise InvalidRequestError(
                f"n={params.n} samples of prompt + max_tokens = {len(ids) + max_tokens} tokens "
                f"need {need} KV blocks but the whole pool has {self.num_blocks}",
                param="max_tokens",
            )
        request = _FakeRequest(request_id, ids, params, max_tokens)
        request.poisoned = FAIL_MARKER in self.tokenizer.decode(ids)
        for i in range(params.n):
            if params.temperature == 0:
                offset = sum(ids)
            elif params.seed is not None:
                offset = params.seed + i
            else:
                offset = random.randrange(len(SENTENCE))
            request.samples.append(_FakeSample(offset))
        self.added.append((request_id, prompt, params, cache_salt))
        self.waiting.append(request)

    def _add_pooling(self, request_id, prompt, ids, params: PoolingParams) -> None:
        """A pooling request: refused as the engine refuses one (empty, out of the vocabulary,
        beyond max_model_len); finished with :func:`fake_embedding` by the step that runs it."""
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size})", param="prompt"
            )
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, more than max_model_len", param="prompt"
            )
        request = _FakeRequest(
            request_id, ids, SamplingParams(temperature=0.0, max_tokens=1), 0, pooling=params
        )
        request.samples.append(_FakeSample(0))
        self.added.append((request_id, prompt, params, None))
        self.waiting.append(request)

    def abort_request(self, request_ids):
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        for queue in (self.waiting, self.running):
            for req in [r for r in queue if r.request_id in ids]:
                queue.remove(req)
                if queue is self.running:
                    self.num_used_blocks -= self._num_blocks(req)
                for sample in req.samples:
                    sample.finish_reason = sample.finish_reason or "abort"
                self.aborted.append(req)  # reported by the next step, as the engine does
                self.num_aborted += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.aborted)

    def get_stats(self) -> FakeStats:
        return FakeStats(
            SchedulerStats(
                num_running=len(self.running),
                num_waiting=len(self.waiting),
                kv_cache_usage=self.num_used_blocks / self.num_blocks,
                num_used_blocks=self.num_used_blocks,
                prefix_cache_queries=self.num_prefix_queries,
            )
        )

    def reset_prefix_cache(self) -> bool:
        return self.num_used_blocks == 0

    def check_health(self) -> None:
        if self.broken:
            raise RuntimeError("the fake model is broken")

    def step(self) -> list[RequestOutput]:
        if self.fail_with is not None:
            exc, self.fail_with = self.fail_with, None
            raise exc
        if self.fail_after_steps is not None:
            if self.fail_after_steps == 0:
                self.broken = True
                raise RuntimeError("the fake engine broke")
            self.fail_after_steps -= 1
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = self._num_blocks(req)
            if self.num_used_blocks + need > self.num_blocks:
                break
            self.waiting.pop(0)
            self.running.append(req)
            self.num_used_blocks += need
            self.num_prefix_queries += len(req.prompt_token_ids)
        poisoned = [req for req in self.running if req.poisoned]
        if poisoned:  # as LLMEngine: finish the failing requests, report them next step, raise
            for req in poisoned:
                self.running.remove(req)
                self.num_used_blocks -= self._num_blocks(req)
                for sample in req.samples:
                    sample.finish_reason = "error"
                    sample.error = f"RuntimeError: fake step failure in {req.request_id}"
                self.aborted.append(req)
            self.num_failed_steps += 1
            raise RuntimeError("fake step failure")
        outputs = [self._output(req) for req in self.aborted]  # reported once, next step
        self.aborted.clear()
        for req in list(self.running):
            if self._is_held(req):
                continue
            if req.pooling is not None:  # its prompt in one step, then its vector
                req.samples[0].finish_reason = "stop"
                outputs.append(self._output(req, [[]]))
                outputs[-1].embedding = fake_embedding(req.prompt_token_ids, req.pooling)
                self.running.remove(req)
                self.num_used_blocks -= self._num_blocks(req)
                continue
            before = self._num_blocks(req)
            new_token_ids = [self._advance(req, s) for s in req.samples]
            self.num_used_blocks += self._num_blocks(req) - before
            outputs.append(self._output(req, new_token_ids))
            if outputs[-1].finished:
                self.running.remove(req)
                self.num_used_blocks -= self._num_blocks(req)
        if not outputs and self._hold_after is not None:
            # Everything is held: return to the engine loop (which runs aborts between steps)
            # without spinning; release() ends the wait at once.
            self._released.wait(0.01)
        return outputs

    # ---- helpers ------------------------------------------------------------------------------

    def _advance(self, req: _FakeRequest, sample: _FakeSample) -> list[int]:
        if sample.finish_reason is not None:
            return []
        char = SENTENCE[(sample.offset + sample.num_tokens) % len(SENTENCE)]
        sample.num_tokens += 1
        if req.params.logprobs is not None:
            sample.logprobs.append(fake_position(ord(char), req.params.logprobs))
        sample.text += char
        for stop in req.params.stop:
            if stop in sample.text:
                sample.text = sample.text[: sample.text.index(stop)]
                sample.finish_reason = "stop"
                break
        if sample.finish_reason is None and sample.num_tokens >= req.max_tokens:
            sample.finish_reason = "length"
        return [ord(char)]

    def _output(self, req: _FakeRequest, new_token_ids=None) -> RequestOutput:
        completions = []
        for index, sample in enumerate(req.samples):
            visible = len(sample.text)
            if sample.finish_reason is None:  # hold back a possible start of a stop string
                for stop in req.params.stop:
                    for k in range(min(len(stop) - 1, len(sample.text)), 0, -1):
                        if sample.text.endswith(stop[:k]):
                            visible = min(visible, len(sample.text) - k)
                            break
            visible = max(visible, sample.num_emitted_chars)
            completions.append(
                CompletionOutput(
                    index=index,
                    text=sample.text[:visible],
                    new_text=sample.text[sample.num_emitted_chars : visible],
                    new_token_ids=new_token_ids[index] if new_token_ids else [],
                    finish_reason=sample.finish_reason,
                    error=sample.error,
                    logprobs=list(sample.logprobs) if req.params.logprobs is not None else None,
                )
            )
            sample.num_emitted_chars = visible
        prompt_logprobs = None
        k = req.params.prompt_logprobs
        if k is not None and not req.prompt_logprobs_sent:  # with the first output, as vLLM
            req.prompt_logprobs_sent = True
            prompt_logprobs = [None] + [fake_position(t, k) for t in req.prompt_token_ids[1:]]
        return RequestOutput(
            request_id=req.request_id,
            prompt=None,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=all(s.finish_reason is not None for s in req.samples),
            prompt_logprobs=prompt_logprobs,
        )

    def _num_blocks(self, req: _FakeRequest) -> int:
        return sum(
            -(-(len(req.prompt_token_ids) + max(s.num_tokens, 1)) // self.block_size)
            for s in req.samples
        )


#: The fake's embeddings have this many components.
FAKE_EMBEDDING_SIZE = 8


def fake_embedding(token_ids: list[int], params: PoolingParams) -> np.ndarray:
    """A made-up float32 embedding of a prompt: component i sums the ids at positions i mod 8
    (plus 1), L2-normalized unless ``params.normalize`` is False."""
    vector = np.ones(FAKE_EMBEDDING_SIZE, dtype=np.float32)
    for position, token_id in enumerate(token_ids):
        vector[position % FAKE_EMBEDDING_SIZE] += token_id
    if params.normalize:
        vector /= np.linalg.norm(vector)
    return vector


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Block until ``condition()`` holds (checked every 10 ms); fail after ``timeout`` seconds,
    a bound for a hung server, not a speed assumption."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class ScriptedEngine(FakeEngine):
    """The fake engine, but every request's reply is ``self.reply`` (one character a step),
    finished with "stop" (or "length" at max_tokens)."""

    reply = "ok"

    def add_request(self, request_id, prompt, sampling_params, priority=0, cache_salt=None):
        super().add_request(request_id, prompt, sampling_params, priority, cache_salt)
        self.replies = getattr(self, "replies", {})
        self.replies[request_id] = self.reply

    def _advance(self, req, sample):
        if sample.finish_reason is not None:
            return []
        reply = self.replies[req.request_id]
        char = reply[sample.num_tokens]
        sample.num_tokens += 1
        sample.text += char
        if sample.num_tokens >= len(reply):
            sample.finish_reason = "stop"
        elif sample.num_tokens >= req.max_tokens:
            sample.finish_reason = "length"
        return [ord(char)]
