"""The cluster's front end: the OpenAI server's engine loop, over replicas instead of one engine.

:class:`ClusterEngineLoop` offers what :class:`pagedkv.entrypoints.openai.app.OpenAIServing`
uses of :class:`~pagedkv.engine.engine_loop.EngineLoop` (add requests and get their
output stream, abort, call a function on the engine, health), so the same routes, streaming,
validation and abort-on-disconnect serve a cluster. It tokenizes each prompt as the engine would
(so the router can hash it), hands a :class:`ClusterRequest` to a dispatcher (Ray Serve's handle
or the in-process cluster), and pumps the replica's outputs into the request's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any

from pagedkv.cluster.protocol import ClusterRequest, Dispatcher
from pagedkv.engine.engine_loop import EngineDeadError, EngineRequest, OutputStream
from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)


def tokenize(tokenizer: Any, prompt: Any) -> list[int]:
    """The prompt's token ids as :meth:`LLMEngine.add_request` makes them: text encoded, chat
    messages through the chat template (assistant turn opened), token ids as given, and vLLM's
    ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}`` forms.

    Raises:
        InvalidRequestError: a prompt of another type.
    """
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, dict):  # vLLM's prompt forms: {"prompt_token_ids": [...]} first
        if "prompt_token_ids" in prompt:
            return tokenize(tokenizer, list(prompt["prompt_token_ids"]))
        if "prompt" in prompt:
            return tokenize(tokenizer, prompt["prompt"])
    items = list(prompt)
    if items and all(isinstance(m, dict) for m in items):
        return list(tokenizer.apply_chat_template(items))
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        raise InvalidRequestError(
            "a prompt must be a str, a list of token ids, or a list of chat messages "
            "({'role': ..., 'content': ...})"
        )
    return items


def merge_results(results: Sequence[Any]) -> Any:
    """One answer from the replicas' answers to a broadcast call: bools -> all of them; stats
    dataclasses (EngineStats, SchedulerStats) -> counters summed, ``kv_cache_usage`` averaged
    (replicas have equal pools), ``peak_kv_cache_usage`` the max; anything else -> the list.

    Raises:
        EngineDeadError: no replica answered.
    """
    if not results:
        raise EngineDeadError("no replica answered")
    if all(isinstance(r, bool) for r in results):
        return all(results)
    first = results[0]
    if dataclasses.is_dataclass(first) and all(type(r) is type(first) for r in results):
        return _merge_dataclasses(results)
    return list(results)


def _merge_dataclasses(results: Sequence[Any]) -> Any:
    values = {}
    for f in dataclasses.fields(results[0]):
        items = [getattr(r, f.name) for r in results]
        if dataclasses.is_dataclass(items[0]):
            values[f.name] = _merge_dataclasses(items)
        elif f.name == "kv_cache_usage":
            values[f.name] = sum(items) / len(items)
        elif f.name.startswith("peak_"):
            values[f.name] = max(items)
        else:
            values[f.name] = sum(items)
    return type(results[0])(**values)


class ClusterEngineLoop:
    """:class:`EngineLoop`'s interface over a cluster (see the module docstring).

    Args:
        dispatcher: routes requests and calls to replicas.
        tokenizer: the replicas' tokenizer (``encode``, ``apply_chat_template``).
    """

    def __init__(self, dispatcher: Dispatcher, tokenizer: Any) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self._pumps: dict[str, asyncio.Task] = {}
        self._streams: dict[str, OutputStream] = {}  # request id -> its stream, while pumped
        self._running = False
        self.error: BaseException | None = None

    # ---- lifetime ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Accept requests (outputs are pumped by tasks on ``loop``)."""
        self._running = True

    def stop(self, timeout: float = 30.0) -> None:
        """Stop taking requests and abort the ones in flight."""
        self._running = False
        for task in list(self._pumps.values()):
            task.cancel()
        self._pumps.clear()

    @property
    def is_alive(self) -> bool:
        return self._running and self.dispatcher.is_alive

    @property
    def num_streams(self) -> int:
        """Requests whose outputs are still being pumped."""
        return len(self._pumps)

    # ---- the EngineLoop interface -------------------------------------------------------------

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` on every replica, answers merged (:func:`merge_results`)."""
        if not self.is_alive:
            raise EngineDeadError("the cluster is not serving")
        return merge_results(await self.dispatcher.broadcast(fn))

    async def add_requests(self, requests: list[EngineRequest]) -> OutputStream:
        """Tokenize, route and start every request, all or none; their shared stream.

        Raises:
            InvalidRequestError: a prompt that cannot be tokenized or a request an engine
                refuses; requests already started are aborted.
            EngineDeadError: the cluster is not serving.
        """
        if not self.is_alive:
            raise EngineDeadError("the cluster is not serving")
        cluster_requests = []
        # A prompt may be a function of the engine (the server's prompt builders read only its
        # tokenizer): the front end has the replicas' tokenizer, not an engine.
        tokenizer_only = SimpleNamespace(tokenizer=self.tokenizer)
        for r in requests:
            kwargs = dict(r.kwargs)
            prompt = r.prompt(tokenizer_only) if callable(r.prompt) else r.prompt
            cluster_requests.append(
                ClusterRequest(
                    r.request_id,
                    tokenize(self.tokenizer, prompt),
                    r.sampling_params,
                    cache_salt=kwargs.pop("cache_salt", None),
                    priority=kwargs.pop("priority", 0),
                )
            )
            if kwargs:
                raise InvalidRequestError(f"the cluster does not take {sorted(kwargs)}")
        stream = OutputStream([r.request_id for r in requests], time.monotonic())
        started: list[tuple[str, AsyncIterator[Any]]] = []
        try:
            for request in cluster_requests:
                outputs = self.dispatcher.submit(request)
                started.append((request.request_id, outputs))
                await anext(outputs)  # accepted (or the engine's error)
        except BaseException:
            for _, outputs in started:
                with contextlib.suppress(Exception):
                    await outputs.aclose()
            raise
        for request_id, outputs in started:
            self._pumps[request_id] = asyncio.ensure_future(self._pump(request_id, outputs, stream))
            self._streams[request_id] = stream
        return stream

    def fail_streams(self, exc: BaseException) -> None:
        """:meth:`EngineLoop.fail_streams` over the cluster: every open stream gets ``exc``
        and its requests are aborted on their replicas (their pumps are cancelled, which closes
        the replicas' streams). Call it on the event loop."""
        streams = {id(s): s for s in self._streams.values()}
        self.abort(list(self._pumps))
        self._streams.clear()
        for stream in streams.values():
            stream.queue.put_nowait(exc)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests still in flight (their replicas free the blocks); never blocks."""
        for request_id in request_ids:
            task = self._pumps.pop(request_id, None)
            if task is not None:
                task.cancel()

    async def _pump(
        self, request_id: str, outputs: AsyncIterator[Any], stream: OutputStream
    ) -> None:
        try:
            async for output in outputs:
                stream.queue.put_nowait((output, time.monotonic()))
                if output.finished:
                    break
            else:
                stream.queue.put_nowait(
                    EngineDeadError(f"request {request_id!r} ended without a final output")
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica failed or died: this request fails, others go on
            logger.warning("request %s failed on its replica: %r", request_id, exc)
            stream.queue.put_nowait(exc)
        finally:
            self._pumps.pop(request_id, None)
            self._streams.pop(request_id, None)
            with contextlib.suppress(Exception):
                await outputs.aclose()
