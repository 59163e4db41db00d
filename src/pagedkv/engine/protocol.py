"""What a server needs of an engine: :class:`EngineClient` (vLLM's ``EngineClient``).

Two implementations: :class:`pagedkv.engine.engine_loop.EngineLoop` (one engine stepping in its
own thread) and :class:`pagedkv.entrypoints.cluster.frontend.ClusterEngineLoop` (engine replicas
behind a router). The OpenAI serving classes take either and know nothing else of the engine:
what crosses is plain data (token ids, :class:`SamplingParams`, request ids) one way, and
:class:`~pagedkv.engine.outputs.RequestOutput` s the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pagedkv.engine.input_processor import InputProcessor, ProcessedPrompt
from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine.engine_loop import KVStateListener, OutputStream
    from pagedkv.engine.llm_engine import EngineStats

T = TypeVar("T")


@dataclass(slots=True)
class EngineRequest:
    """One engine request, its prompt already processed (off the engine's thread).

    Attributes:
        request_id: unique among unfinished requests.
        prompt: token ids (and text) from the client's :class:`InputProcessor`.
        sampling_params: the request's parameters (``n`` samples share the prompt), or a
            beam search's (reported once, at its end, with ``beam_width`` outputs), or a
            pooling request's (reported once, with its ``embedding``).
        priority: lower = sooner under the priority policy.
        cache_salt: separates this request's prefix-cache entries from others'.
        prompt_cache_key: OpenAI's key of requests that share a prefix; a cluster routes one
            key's requests to one replica (an engine alone has no use for it).
    """

    request_id: str
    prompt: ProcessedPrompt
    sampling_params: SamplingParams | BeamSearchParams | PoolingParams
    priority: int = 0
    cache_salt: str | None = None
    prompt_cache_key: str | None = None

    def engine_prompt(self) -> dict[str, object]:
        """The prompt in the engine's ``{"prompt_token_ids": ..., "prompt": ...}`` form."""
        prompt: dict[str, object] = {"prompt_token_ids": self.prompt.token_ids}
        if self.prompt.text is not None:
            prompt["prompt"] = self.prompt.text
        return prompt


class EngineClient(Protocol):
    """An engine (or a cluster of them) as the server drives it, from an asyncio event loop."""

    @property
    def input_processor(self) -> InputProcessor:
        """The limits and tokenizer rules; call its methods through :meth:`process` (they
        tokenize), read its attributes (max_model_len, vocab_size, max_logprobs) anywhere."""
        ...

    async def process(self, fn: Callable[[InputProcessor], T]) -> T:
        """``fn(input_processor)`` on the client's input thread (tokenizing, chat templates),
        never on the engine's step thread."""
        ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start serving; outputs are delivered on ``loop``."""
        ...

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving (``timeout`` seconds at most for the engine thread to end)."""
        ...

    @property
    def is_alive(self) -> bool:
        """True while requests can be served."""
        ...

    @property
    def status_reason(self) -> str:
        """Why the engine is not serving ("" while it is)."""
        ...

    @property
    def num_streams(self) -> int:
        """Engine requests with an open output stream."""
        ...

    async def add_requests(self, requests: list[EngineRequest]) -> OutputStream:
        """Add the requests, all or none; their shared output stream.

        Raises:
            InvalidRequestError: a request the engine refuses (none is left queued).
            EngineDeadError: the engine is not serving.
        """
        ...

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort unfinished requests (their blocks are freed); never blocks."""
        ...

    def fail_streams(self, exc: BaseException) -> None:
        """End every open stream with ``exc`` (raised by its next ``get``); a server's drain
        at shutdown uses it."""
        ...

    async def get_stats(self) -> EngineStats:
        """The engine's counters (summed over replicas)."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False (nothing changed) while blocks are in use."""
        ...


class KVStateSource(Protocol):
    """Snapshots of one engine's KV cache, for the server's /kv view (plain data from
    :func:`pagedkv.core.kv_view.snapshot_kv_cache`). :class:`~pagedkv.engine.engine_loop.EngineLoop`
    is one; a cluster of replicas is not (yet)."""

    async def get_kv_state(self) -> dict[str, Any]:
        """A snapshot taken between two steps.

        Raises:
            EngineDeadError: the engine is not serving.
        """
        ...

    def listen_kv_states(self) -> KVStateListener:
        """Start listening to snapshots as the engine runs, a few a second (the newest only);
        no snapshot is taken while no listener is open. Close it when done.

        Raises:
            EngineDeadError: the engine is not serving.
        """
        ...
