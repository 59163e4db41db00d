"""The cluster's front end: the OpenAI server's engine client, over replicas instead of one engine.

:class:`ClusterEngineLoop` is an :class:`~pagedkv.engine.protocol.EngineClient`, as one engine's
:class:`~pagedkv.engine.engine_loop.EngineLoop` is, so the same routes, streaming, validation and
abort-on-disconnect serve a cluster. Prompts are tokenized by the replicas' input processor on
the front end's input thread (so the router can hash them); each request goes to a dispatcher
(Ray Serve's handle or the in-process cluster) as a :class:`ClusterRequest`, and the replica's
outputs are pumped into the request's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar

from pagedkv.cluster.protocol import (
    ClusterRequest,
    Dispatcher,
    ReplicaDiedError,
    ReplicaError,
    describe_failure,
)
from pagedkv.engine.engine_loop import EngineDeadError, OutputStream
from pagedkv.engine.input_processor import InputProcessor, InputThread
from pagedkv.engine.protocol import EngineRequest

T = TypeVar("T")

logger = logging.getLogger(__name__)


def merge_results(results: Sequence[Any]) -> Any:
    """One answer from the replicas' answers to a broadcast call: bools -> all of them; stats
    dataclasses (EngineStats, SchedulerStats) -> counters summed, ``kv_cache_usage`` averaged
    (replicas have equal pools), ``peak_kv_cache_usage`` the max, optional parts (None on some
    replicas) merged over those that have them, labels (str) the first's; anything else -> the
    list.

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
        if any(item is None for item in items):  # an optional part (the KV tier's stats)
            present = [item for item in items if item is not None]
            values[f.name] = _merge_dataclasses(present) if present else None
        elif isinstance(items[0], str):  # a label (the KV tier's medium)
            values[f.name] = items[0]
        elif dataclasses.is_dataclass(items[0]):
            values[f.name] = _merge_dataclasses(items)
        elif f.name == "kv_cache_usage":
            values[f.name] = sum(items) / len(items)
        elif f.name.startswith("peak_"):
            values[f.name] = max(items)
        else:
            values[f.name] = sum(items)
    return type(results[0])(**values)


class ClusterEngineLoop:
    """The :class:`~pagedkv.engine.protocol.EngineClient` of a cluster (see the module
    docstring).

    Args:
        dispatcher: routes requests and calls to replicas.
        input_processor: the replicas' input processor (their tokenizer and limits); the front
            end runs a copy of it on its own input thread.
    """

    def __init__(self, dispatcher: Dispatcher, input_processor: InputProcessor) -> None:
        self.dispatcher = dispatcher
        self._input = InputThread(input_processor.copy())
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
        self._input.close()
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

    @property
    def status_reason(self) -> str:
        """Why the cluster is not serving ("" while it is)."""
        if self.is_alive:
            return ""
        return "no replica is serving" if self._running else "it was stopped"

    # ---- the EngineClient interface -----------------------------------------------------------

    @property
    def input_processor(self) -> InputProcessor:
        """The front end's processor (the replicas' limits and tokenizer)."""
        return self._input.processor

    async def process(self, fn: Callable[[InputProcessor], T]) -> T:
        """``fn(input_processor)`` on the front end's input thread."""
        return await self._input.run(fn)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` on every replica, answers merged (:func:`merge_results`)."""
        if not self.is_alive:
            raise EngineDeadError("the cluster is not serving")
        return merge_results(await self.dispatcher.broadcast(fn))

    async def get_stats(self) -> Any:
        """The replicas' counters, summed (:func:`merge_results`)."""
        return await self.call(lambda engine: engine.get_stats())

    async def reset_prefix_cache(self) -> bool:
        """Every replica drops its cached blocks; False if one could not."""
        return bool(await self.call(lambda engine: engine.reset_prefix_cache()))

    async def add_requests(self, requests: list[EngineRequest]) -> OutputStream:
        """Route and start every request, all or none; their shared stream.

        Raises:
            InvalidRequestError: a request an engine refuses; requests already started are
                aborted.
            EngineDeadError: the cluster is not serving.
        """
        if not self.is_alive:
            raise EngineDeadError("the cluster is not serving")
        cluster_requests = [
            ClusterRequest(
                r.request_id,
                r.prompt.token_ids,
                r.sampling_params,
                cache_salt=r.cache_salt,
                priority=r.priority,
                prompt_cache_key=r.prompt_cache_key,
            )
            for r in requests
        ]
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
            self._streams[request_id] = stream
            self._pumps[request_id] = asyncio.ensure_future(self._pump(request_id, outputs, stream))
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
            self._streams.pop(request_id, None)
            if task is not None:
                task.cancel()

    async def _pump(
        self, request_id: str, outputs: AsyncIterator[Any], stream: OutputStream
    ) -> None:
        """Move one request's outputs from its replica into ``stream``. If the replica fails or
        dies first, the stream gets one :class:`ReplicaError` (:class:`ReplicaDiedError` when
        the replica stopped) whose message is fixed and client-safe; what the replica raised is
        logged here, one line (a dispatcher that already raised a ReplicaError logged it)."""
        try:
            async for output in outputs:
                stream.queue.put_nowait((output, time.monotonic()))
                if output.finished:
                    break
            else:
                logger.warning("request %s: its replica's stream ended unfinished", request_id)
                stream.queue.put_nowait(ReplicaDiedError())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica failed or died: this request fails, others go on
            stream.queue.put_nowait(_client_safe(request_id, exc))
        finally:
            self._pumps.pop(request_id, None)
            self._streams.pop(request_id, None)
            with contextlib.suppress(Exception):
                await outputs.aclose()


def _client_safe(request_id: str, exc: Exception) -> ReplicaError:
    """What a request's stream gets for ``exc``, raised by its replica mid-stream: ``exc`` if it
    already is a :class:`ReplicaError`, else a :class:`ReplicaDiedError` (an EngineDeadError: the
    replica stopped) or a :class:`ReplicaError`, after logging ``exc`` (one line)."""
    if isinstance(exc, ReplicaError):
        return exc
    logger.warning("request %s failed on its replica: %s", request_id, describe_failure(exc))
    return ReplicaDiedError() if isinstance(exc, EngineDeadError) else ReplicaError()
