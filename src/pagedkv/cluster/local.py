"""A cluster in one process: several :class:`EngineReplica` (each its own engine thread and event
publisher) behind a :class:`ClusterRouter` that reads their events over ZMQ, as under Ray.

It is the Ray deployment without Ray: the tests check routing, replica death and block freeing
with it in a second, and the HTTP front end
(:class:`pagedkv.entrypoints.cluster.frontend.ClusterEngineLoop`) serves it the same way, as a
:class:`~pagedkv.cluster.protocol.Dispatcher`. Serving for real uses Ray Serve (one process per
replica, several hosts): ``pagedkv serve --data-parallel-size N``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

from pagedkv.cluster.protocol import ClusterRequest
from pagedkv.cluster.replica import EngineReplica
from pagedkv.cluster.router import ClusterRouter
from pagedkv.engine.engine_loop import EngineDeadError
from pagedkv.errors import ConfigError


class LocalCluster:
    """Replicas in this process, routed by ``router`` (a
    :class:`~pagedkv.cluster.protocol.Dispatcher`).

    Args:
        replicas: ``{key: replica}``; the router subscribes to each one's events.
        router: decides where each request goes.
    """

    def __init__(self, replicas: dict[Hashable, EngineReplica], router: ClusterRouter) -> None:
        if not replicas:
            raise ConfigError("a cluster needs at least one replica")
        self.replicas = dict(replicas)
        self.router = router
        #: request id -> key of the replica that served it (for tests and benchmarks).
        self.placements: dict[str, Hashable] = {}
        self._started = False

    async def start(self, timeout: float = 10.0) -> None:
        """Subscribe the router to every replica and wait until each subscription delivers
        (ZMQ drops what a subscriber misses while it connects). Runs once; :meth:`submit` and
        :meth:`broadcast` call it, so the replicas' engine threads report to the event loop
        that uses the cluster.

        Raises:
            EngineDeadError: a replica's events did not arrive within ``timeout`` seconds.
        """
        if self._started:
            return
        self._started = True
        for key, replica in self.replicas.items():
            self.router.add_replica(key, replica.info.kv_events_endpoint)
        for key, replica in self.replicas.items():
            await self._wait_subscribed(key, replica, timeout)

    async def _wait_subscribed(self, key: Hashable, replica: EngineReplica, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # Heartbeats (empty batches) until one arrives: then every later batch will.
        while True:
            self.router.drain()
            if self.router.stats()[key].num_batches:
                return
            if time.monotonic() > deadline:
                raise EngineDeadError(f"replica {key!r}: no KV events within {timeout} s")
            await replica.heartbeat()
            await asyncio.sleep(0.005)

    @property
    def is_alive(self) -> bool:
        return bool(self.replicas)

    async def submit(self, request: ClusterRequest) -> AsyncIterator[Any]:
        """Route ``request`` to the best replica and stream from it (see
        :class:`~pagedkv.cluster.protocol.Dispatcher`)."""
        await self.start()
        if not self.replicas:
            raise EngineDeadError("no replica is serving")
        ranks = self.router.rank(list(self.replicas), request)
        key = ranks[0][0]
        self.router.on_routed(key, request)
        self.placements[request.request_id] = key
        try:
            async for item in self.replicas[key].generate(request):
                yield item
        finally:
            self.router.on_completed(key)

    async def broadcast(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(engine)`` on every replica."""
        await self.start()
        return [await replica.call(fn) for replica in self.replicas.values()]

    def kill(self, key: Hashable) -> None:
        """Stop replica ``key`` as if its process died: its engine stops (its requests never
        finish), the router forgets it, and new requests go to the others."""
        replica = self.replicas.pop(key)
        replica.shutdown()
        self.router.remove_replica(key)

    def shutdown(self) -> None:
        """Stop every replica and the router's subscriptions."""
        for replica in self.replicas.values():
            replica.shutdown()
        self.replicas.clear()
        self.router.close()
