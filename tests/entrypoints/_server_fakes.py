"""A torch-free stand-in for LLMEngine, for fast server tests.

It keeps the engine's contract (add_request / step -> incremental outputs / abort_request /
has_unfinished_requests / get_stats / reset_prefix_cache) and counts KV blocks like a paged
cache, so the server's streaming, abort and leak handling are tested without a model. Tokens are
characters; the "model" spells out a fixed sentence, from an offset that depends on the prompt
(temperature 0) or on the seed.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from pagedkv.errors import InvalidRequestError

SENTENCE = "the quick brown fox jumps over the lazy dog. "


@dataclass(slots=True)
class FakeSamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(slots=True)
class FakeOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str  # new text since the last output
    token_ids: list[int]  # new token ids since the last output
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0


class FakeTokenizer:
    """One token per character; the chat template wraps each message in role tags."""

    eos_token_ids = (0,)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text


@dataclass(slots=True)
class _FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: FakeSamplingParams
    offset: int
    text: str = ""
    num_emitted_chars: int = 0
    num_tokens_out: int = 0
    first_output: bool = True


@dataclass(slots=True)
class FakeStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_blocks: int


class FakeEngine:
    """Each step gives every running request one character; requests wait while their blocks
    (block_size characters each, prompt plus output) do not fit in num_blocks."""

    def __init__(
        self,
        *,
        num_blocks: int = 256,
        block_size: int = 4,
        max_model_len: int = 256,
        max_num_seqs: int = 64,
        step_delay: float = 0.002,
    ) -> None:
        self.tokenizer = FakeTokenizer()
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.waiting: list[_FakeRequest] = []
        self.running: list[_FakeRequest] = []
        self.num_used_blocks = 0
        self.num_prefix_queries = 0
        self.added: list[tuple[str, object, FakeSamplingParams, str | None]] = []

    # ---- engine API ---------------------------------------------------------------------------

    def add_request(self, request_id, prompt, sampling_params, priority=0, cache_salt=None):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = sampling_params.max_tokens
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) is longer than "
                f"max_model_len ({self.max_model_len})"
            )
        if sampling_params.temperature == 0:
            offset = sum(ids)
        elif sampling_params.seed is not None:
            offset = sampling_params.seed
        else:
            offset = random.randrange(len(SENTENCE))
        self.added.append((request_id, prompt, sampling_params, cache_salt))
        self.waiting.append(_FakeRequest(request_id, ids, sampling_params, offset))

    def abort_request(self, request_ids):
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        for queue in (self.waiting, self.running):
            for req in [r for r in queue if r.request_id in ids]:
                queue.remove(req)
                if queue is self.running:
                    self.num_used_blocks -= self._num_blocks(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_stats(self) -> FakeStats:
        return FakeStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.num_used_blocks / self.num_blocks,
            prefix_cache_queries=self.num_prefix_queries,
            prefix_cache_hits=0,
            num_preemptions=0,
            num_free_blocks=self.num_blocks - self.num_used_blocks,
            num_blocks=self.num_blocks,
        )

    def reset_prefix_cache(self) -> bool:
        return self.num_used_blocks == 0

    def step(self) -> list[FakeOutput]:
        time.sleep(self.step_delay)
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = self._blocks_for(len(req.prompt_token_ids) + 1)
            if self.num_used_blocks + need > self.num_blocks:
                break
            self.waiting.pop(0)
            self.running.append(req)
            self.num_used_blocks += need
            self.num_prefix_queries += len(req.prompt_token_ids)
        outputs = []
        for req in list(self.running):
            before = self._num_blocks(req)
            char = SENTENCE[(req.offset + req.num_tokens_out) % len(SENTENCE)]
            req.num_tokens_out += 1
            req.text += char
            self.num_used_blocks += self._num_blocks(req) - before
            finish_reason = None
            for stop in req.params.stop:
                if stop in req.text:
                    req.text = req.text[: req.text.index(stop)]
                    finish_reason = "stop"
                    break
            if finish_reason is None and req.num_tokens_out >= req.params.max_tokens:
                finish_reason = "length"
            emit_upto = len(req.text)
            if finish_reason is None:  # hold back a possible start of a stop string
                for stop in req.params.stop:
                    for k in range(min(len(stop) - 1, len(req.text)), 0, -1):
                        if req.text.endswith(stop[:k]):
                            emit_upto = min(emit_upto, len(req.text) - k)
                            break
            new_text = req.text[req.num_emitted_chars : emit_upto]
            req.num_emitted_chars = max(req.num_emitted_chars, emit_upto)
            outputs.append(
                FakeOutput(
                    req.request_id,
                    req.prompt_token_ids,
                    new_text,
                    [ord(char)],
                    finish_reason is not None,
                    finish_reason,
                )
            )
            if finish_reason is not None:
                self.running.remove(req)
                self.num_used_blocks -= self._num_blocks(req)
        return outputs

    # ---- helpers ------------------------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _num_blocks(self, req: _FakeRequest) -> int:
        return self._blocks_for(len(req.prompt_token_ids) + max(req.num_tokens_out, 1))
