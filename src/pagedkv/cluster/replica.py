"""One engine replica of a cluster: the engine stepping in its own thread, its KV-cache events
published on a ZMQ PUB socket after every engine call, requests in as :class:`ClusterRequest`,
outputs out as an async stream.

The Ray deployment (:mod:`pagedkv.cluster.ray_serve`) and the in-process cluster
(:mod:`pagedkv.cluster.local`) both wrap this class.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedkv.cluster.kv_events import KVEventPublisher
from pagedkv.cluster.protocol import ClusterRequest, ReplicaInfo
from pagedkv.engine.engine_loop import EngineDeadError, EngineLoop
from pagedkv.engine.input_processor import ProcessedPrompt
from pagedkv.engine.protocol import EngineRequest
from pagedkv.errors import ConfigError
from pagedkv.modelinfo.naming import served_model_name


class EventPublishingEngine:
    """The engine as :class:`EngineLoop` drives it, publishing the engine's KV-cache events
    after every call that can change its cache (add, step, abort, reset). Every call runs in the
    engine thread, so the publisher's socket is used from that thread only.

    Args:
        engine: an :class:`pagedkv.engine.llm_engine.LLMEngine` with KV-cache events enabled.
        publisher: where the events go.
    """

    def __init__(self, engine: Any, publisher: KVEventPublisher) -> None:
        self.engine = engine
        self.publisher = publisher

    def flush(self) -> None:
        """Publish the events the engine recorded since the last flush."""
        events = self.engine.take_kv_cache_events()
        if events:
            self.publisher.publish(events)

    def add_request(self, *args: Any, **kwargs: Any) -> None:
        try:
            self.engine.add_request(*args, **kwargs)
        finally:
            self.flush()

    def step(self) -> list[Any]:
        try:
            return self.engine.step()
        finally:
            self.flush()

    def abort_request(self, request_ids: Any) -> None:
        try:
            self.engine.abort_request(request_ids)
        finally:
            self.flush()

    def reset_prefix_cache(self) -> bool:
        try:
            return self.engine.reset_prefix_cache()
        finally:
            self.flush()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    @property
    def input_processor(self) -> Any:
        return self.engine.input_processor

    def get_stats(self) -> Any:
        return self.engine.get_stats()

    def heartbeat(self) -> None:
        """Publish an empty batch (subscribers use it to know they are connected)."""
        self.publisher.publish((), allow_empty=True)


class EngineReplica:
    """An engine that serves :class:`ClusterRequest` streams and publishes its KV-cache events.

    Args:
        engine_factory: builds the engine (called once, here); it must have
            ``enable_kv_cache_events`` on and a ``hash_seed`` shared with the router.
        rank: the replica's rank, sent with its events as data_parallel_rank.
        kv_events_endpoint: ZMQ address to bind the publisher to (``tcp://HOST:*`` takes a
            free port; :attr:`info` has the resolved address).
        hash_format: block hashes on the wire, ``"bytes"`` or ``"int"``.

    Raises:
        ConfigError: an engine without events or without a hash seed, or a bad endpoint.
    """

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        *,
        rank: int,
        kv_events_endpoint: str,
        hash_format: str = "bytes",
    ) -> None:
        engine = engine_factory()
        config = engine.config.cache_config
        if not config.enable_kv_cache_events or not config.enable_prefix_caching:
            raise ConfigError(
                "a cluster replica needs prefix caching and enable_kv_cache_events=True"
            )
        if config.hash_seed is None:
            raise ConfigError("a cluster replica needs a hash_seed shared with its router")
        self.publisher = KVEventPublisher(
            kv_events_endpoint, data_parallel_rank=rank, hash_format=hash_format
        )
        self.engine = EventPublishingEngine(engine, self.publisher)
        self.loop = EngineLoop(self.engine)
        self.rank = rank
        self.info = ReplicaInfo(
            rank=rank,
            kv_events_endpoint=self.publisher.endpoint,
            model_name=served_model_name(engine.loaded_model.source),
            max_model_len=engine.max_model_len,
            block_size=config.block_size,
            hash_algo=config.prefix_caching_hash_algo,
            hash_seed=config.hash_seed,
            input_processor=engine.input_processor,
        )
        self._started = False
        self._stopped = False
        self._streams: dict[str, Any] = {}  # request id -> OutputStream

    def _ensure_started(self) -> None:
        if not self._started:
            self._started = True
            self.loop.start(asyncio.get_running_loop())

    async def generate(self, request: ClusterRequest) -> AsyncIterator[Any]:
        """Add ``request`` to the engine and stream its outputs.

        Yields ``None`` once the engine has accepted the request, then its
        :class:`pagedkv.engine.outputs.RequestOutput` objects up to the finished one. Closing
        the stream early (the client left) aborts the request, which frees its blocks.

        Raises:
            InvalidRequestError: a request the engine refuses (before anything is yielded).
            EngineDeadError: the engine thread is not running.
        """
        self._ensure_started()
        engine_request = EngineRequest(
            request.request_id,
            ProcessedPrompt(list(request.prompt_token_ids)),
            request.sampling_params,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        stream = await self.loop.add_requests([engine_request])
        self._streams[request.request_id] = stream
        finished = False
        try:
            yield None
            while not stream.finished:
                output, _ = await stream.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.loop.abort([request.request_id])

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` in the engine thread between two steps (the LLMEngine itself); the
        events it caused (a reset of the prefix cache) are published right after."""
        self._ensure_started()

        def run(wrapped: EventPublishingEngine) -> Any:
            try:
                return fn(wrapped.engine)
            finally:
                wrapped.flush()

        return await self.loop.call(run)

    async def heartbeat(self) -> None:
        """Publish an empty event batch from the engine thread."""
        self._ensure_started()
        await self.loop.call(lambda wrapped: wrapped.heartbeat())

    def shutdown(self) -> None:
        """Stop the engine thread, fail the streams still open (their requests never finish),
        then close the publisher. Idempotent; call it from the event loop's thread."""
        if self._stopped:
            return
        self._stopped = True
        if self._started:
            self.loop.stop()
        error = EngineDeadError(f"replica {self.rank} stopped")
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._streams.clear()
        self.publisher.close()
