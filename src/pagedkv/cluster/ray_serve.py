"""The cluster on Ray Serve: N engine replicas (one Ray actor each) behind one ingress, routed
by a custom Ray Serve request router that reads the replicas' KV-cache events.

::

    HTTP --> Serve proxy --> PagedKVIngress (1 replica: the caller's ingress; pagedkv serve's
                                  |          is the OpenAI app, which tokenizes)
                                  | handle.generate(ClusterRequest)
                                  v
                      PrefixAwareRequestRouter (in the ingress's process)
                         subscribes to each replica's ZMQ PUB socket; ranks replicas
                                  |
                  +---------------+---------------+
                  v               v               v
            PagedKVEngine   PagedKVEngine   PagedKVEngine   (EngineReplica each)

Each engine replica binds its KV-event publisher on ``tcp://<node ip>:*`` and reports the
resolved address (and its rank) through Ray Serve's routing stats (``record_routing_stats``);
the router subscribes when it sees it, and unsubscribes (dropping the replica's index entries)
when Ray reports the replica gone or dead. The decision itself is
:class:`~pagedkv.cluster.router.ClusterRouter`; this module only adapts it to Ray
Serve's request-router API (``RequestRouter.choose_replicas`` returns ranks of replicas; Ray
takes the least loaded of the first rank that has room).

The ingress, what serves HTTP, is the caller's (``ingress=`` of :func:`build_app` and
:func:`start_cluster`; ``pagedkv serve``'s is
:class:`pagedkv.entrypoints.cluster.ray_ingress.OpenAIIngress`): this module deploys the engines
and routes to them, hands the ingress the engines' handle (:class:`RayDispatcher` sends work
through it), and knows nothing of HTTP beyond the address Serve's proxy listens on.

Requires ``pip install 'pagedkv[cluster]'`` (ray[serve], pyzmq, msgspec).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayTaskError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedkv.cluster.protocol import ClusterRequest, ReplicaCall, ReplicaInfo
from pagedkv.cluster.replica import EngineReplica
from pagedkv.cluster.router import ClusterRouter
from pagedkv.errors import ConfigError, PagedKVError

logger = logging.getLogger(__name__)

APP_NAME = "pagedkv"
ENGINE_DEPLOYMENT = "PagedKVEngine"
INGRESS_DEPLOYMENT = "PagedKVIngress"


# ---- the request router (runs where the handle is: in the ingress replica) ---------------------


class PrefixAwareRequestRouter(RequestRouter):
    """Ray Serve request router over :class:`ClusterRouter`.

    ``request_router_kwargs`` are ClusterRouter's arguments (block_size, hash_algo, hash_seed,
    hash_format, policy, max_imbalance, min_match_fraction, routed_ttl_s). A
    :class:`ReplicaCall` goes to the replica of its rank only; a :class:`ClusterRequest` is
    ranked by cached prefix and queue length; anything else by queue length.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self.cluster_router = ClusterRouter(**kwargs)
        self._routed: dict[str, Hashable] = {}  # internal request id -> replica key

    @staticmethod
    def _key(replica_id: ReplicaID) -> str:
        return replica_id.unique_id

    def _sync_subscriptions(self) -> None:
        """Subscribe to replicas whose endpoint is known, drop the ones that left."""
        router = self.cluster_router
        endpoints = {
            self._key(r.replica_id): r.routing_stats.get("kv_events_endpoint")
            for r in self._replicas.values()
        }
        for key in router.replicas:
            if key not in endpoints:
                router.remove_replica(key)
        for key, endpoint in endpoints.items():
            if endpoint and router.endpoint_of(key) != endpoint:
                try:
                    router.add_replica(key, endpoint)
                except ConfigError:
                    logger.exception("cannot subscribe to %s's KV events at %s", key, endpoint)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._sync_subscriptions()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.cluster_router.remove_replica(self._key(replica_id))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Every candidate is in the ranks below: if none takes the request (all full, or
            # the target of a ReplicaCall not reported yet), Ray should back off, not spin.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        request = pending_request.args[0] if pending_request and pending_request.args else None
        if isinstance(request, ReplicaCall):
            target = [r for r in candidate_replicas if r.routing_stats.get("rank") == request.rank]
            return [target] if target else []  # not reported yet: Ray retries with backoff
        by_key = {self._key(r.replica_id): r for r in candidate_replicas}
        ranks = self.cluster_router.rank(
            list(by_key), request if isinstance(request, ClusterRequest) else None
        )
        # One replica per rank: the order is already by prefix, then queue length, then least
        # recently used; Ray only moves down when a replica is full.
        return [[by_key[k]] for rank in ranks for k in rank]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request = pending_request.args[0] if pending_request.args else None
        if isinstance(request, ClusterRequest):
            key = self._key(replica_id)
            self._routed[pending_request.metadata.internal_request_id] = key
            self.cluster_router.on_routed(key, request)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = self._routed.pop(internal_request_id, None)
        if key is not None:
            self.cluster_router.on_completed(key)


# ---- the engine replicas ------------------------------------------------------------------------


class EngineDeployment:
    """One engine replica as a Ray Serve deployment (see :class:`EngineReplica`).

    Args:
        engine_factory: builds the LLMEngine in the replica's process.
        kv_events_host: address to publish KV events on (default: this node's IP).
        hash_format: ``"bytes"`` or ``"int"``.
    """

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        *,
        kv_events_host: str | None = None,
        hash_format: str = "bytes",
    ) -> None:
        rank = serve.get_replica_context().rank
        rank = getattr(rank, "rank", rank)
        host = kv_events_host or ray.util.get_node_ip_address()
        shown = f"[{host}]" if ":" in host else host
        self.replica = EngineReplica(
            engine_factory,
            rank=rank,
            kv_events_endpoint=f"tcp://{shown}:*",
            hash_format=hash_format,
        )

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router needs to know of this replica (Ray polls it)."""
        return {
            "rank": self.replica.rank,
            "kv_events_endpoint": self.replica.info.kv_events_endpoint,
        }

    async def generate(self, request: ClusterRequest) -> AsyncIterator[Any]:
        """Stream a request's outputs (``None`` first, once accepted)."""
        async for item in self.replica.generate(request):
            yield item

    async def engine_call(self, call: ReplicaCall) -> Any:
        """``call.fn(engine)`` in the engine thread."""
        return await self.replica.call(call.fn)

    def describe(self) -> ReplicaInfo:
        return self.replica.info

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.replica.shutdown()


# ---- the front end ------------------------------------------------------------------------------


class RayDispatcher:
    """The front end's :class:`~pagedkv.cluster.protocol.Dispatcher` over the engine
    deployment's handle.

    Args:
        handle: DeploymentHandle of the engine deployment.
        num_replicas: replicas (ranks 0..N-1) that broadcasts go to.
        call_timeout_s: how long a broadcast waits for each replica.
    """

    def __init__(self, handle: Any, num_replicas: int, call_timeout_s: float = 30.0) -> None:
        self.handle = handle
        self.num_replicas = num_replicas
        self.call_timeout_s = call_timeout_s

    @property
    def is_alive(self) -> bool:
        return True  # Ray Serve restarts replicas; requests fail one by one, never all at once

    def _remote(self, method: str, *args: Any, stream: bool = False) -> Any:
        # NOTE: a handle call made while serving a request inherits that request's internal id
        # (a context variable), so the calls one HTTP request fans out (n prompts, a broadcast)
        # would share it, and Ray's router, which hands each chosen replica to the pending
        # request of that id, would give one call's replica to another and leave the rest
        # unrouted. Each call therefore starts from an empty context: a fresh id.
        handle = self.handle.options(stream=stream) if stream else self.handle
        return contextvars.Context().run(lambda: getattr(handle, method).remote(*args))

    async def submit(self, request: ClusterRequest) -> AsyncIterator[Any]:
        outputs = self._remote("generate", request, stream=True)
        try:
            async for item in outputs:
                yield item
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, PagedKVError):  # the engine refused it: a 400, not a 500
                raise cause from None
            raise
        finally:
            outputs.cancel()

    async def broadcast(self, fn: Callable[[Any], Any]) -> list[Any]:
        async def one(rank: int) -> Any:
            return await self._remote("engine_call", ReplicaCall(rank, fn))

        results = await asyncio.gather(
            *(
                asyncio.wait_for(one(rank), self.call_timeout_s)
                for rank in range(self.num_replicas)
            ),
            return_exceptions=True,
        )
        answers = []
        for rank, result in enumerate(results):
            if isinstance(result, BaseException):
                logger.warning("replica rank %d did not answer: %r", rank, result)
            else:
                answers.append(result)
        return answers


def build_app(
    engine_factory: Callable[[], Any],
    *,
    ingress: type,
    num_replicas: int,
    block_size: int,
    hash_algo: str,
    hash_seed: int | str | bytes,
    policy: str = "prefix",
    hash_format: str = "bytes",
    kv_events_host: str | None = None,
    max_ongoing_requests: int = 256,
    num_cpus_per_replica: float = 1.0,
    router_options: dict[str, Any] | None = None,
    model_name: str | None = None,
    ingress_options: dict[str, Any] | None = None,
) -> Any:
    """The Serve application: ``num_replicas`` engines behind ``ingress``.

    Args:
        engine_factory: builds each replica's engine (events on, ``hash_seed`` set).
        ingress: the ingress deployment's class, wrapped here by ``serve.ingress()`` (so it
            serves HTTP through ``__serve_build_asgi_app__``); built in its replica as
            ``ingress(engine_handle, num_replicas=..., model_name=...)``, where
            ``engine_handle`` is the engines' DeploymentHandle (wrap it in a
            :class:`RayDispatcher`). ``pagedkv serve``'s is
            :class:`pagedkv.entrypoints.cluster.ray_ingress.OpenAIIngress`.
        num_replicas: engine replicas (>= 1).
        block_size / hash_algo / hash_seed: the engines' (the router hashes prompts alike).
        policy: ``"prefix"`` or ``"round_robin"``.
        hash_format: block hashes on the wire.
        kv_events_host: address replicas publish on (default: each node's IP).
        max_ongoing_requests: requests Ray sends one replica at once (beyond: queued in Ray).
        num_cpus_per_replica: Ray CPUs reserved per engine replica.
        router_options: more ClusterRouter arguments (max_imbalance, min_match_fraction,
            routed_ttl_s).
        model_name: the name clients use, passed to ``ingress`` (None: the ingress picks, the
            OpenAI one the engines' :attr:`ReplicaInfo.model_name`).
        ingress_options: more keyword arguments for ``ingress`` (the OpenAI one takes
            ``server_options``, the HTTP layer's security and limits).

    Raises:
        ConfigError: num_replicas < 1.
    """
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ConfigError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    router_config = RequestRouterConfig(
        request_router_class=PrefixAwareRequestRouter,
        request_router_kwargs={
            "block_size": block_size,
            "hash_algo": hash_algo,
            "hash_seed": hash_seed,
            "hash_format": hash_format,
            "policy": policy,
            **(router_options or {}),
        },
        request_routing_stats_period_s=1.0,
        request_routing_stats_timeout_s=10.0,
    )
    engine = serve.deployment(EngineDeployment, name=ENGINE_DEPLOYMENT).options(
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus_per_replica},
        request_router_config=router_config,
    )
    ingress = serve.deployment(serve.ingress()(ingress), name=INGRESS_DEPLOYMENT).options(
        num_replicas=1,
        max_ongoing_requests=max(1000, max_ongoing_requests * num_replicas),
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(
        engine.bind(engine_factory, kv_events_host=kv_events_host, hash_format=hash_format),
        num_replicas=num_replicas,
        model_name=model_name,
        **(ingress_options or {}),
    )


def free_port(host: str) -> int:
    """A port that was free a moment ago on ``host`` (Serve's proxy needs a number)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_cluster(
    engine_config: Any,
    *,
    ingress: type,
    num_replicas: int,
    host: str = "127.0.0.1",
    port: int = 0,
    policy: str = "prefix",
    ray_address: str | None = None,
    num_cpus_per_replica: float = 1.0,
    kv_events_host: str | None = None,
    hash_format: str = "bytes",
    engine_factory: Callable[[], Any] | None = None,
    startup_timeout_s: float = 600.0,
    router_options: dict[str, Any] | None = None,
    model_name: str | None = None,
    ingress_options: dict[str, Any] | None = None,
) -> str:
    """Start (or join, with ``ray_address``) Ray, deploy the cluster, wait until it serves.

    Args:
        engine_config: the replicas' EngineConfig; events are switched on, a random
            hash_seed shared by every replica and the router is drawn if it has none, and
            num_threads defaults to num_cpus_per_replica.
        ingress: the ingress deployment's class (see :func:`build_app`).
        num_replicas: engine replicas.
        host / port: where Serve's HTTP proxy listens (port 0: a free one). Serve keeps the
            address of its first start in a Ray cluster: a second deployment must pass it.
        policy: ``"prefix"`` or ``"round_robin"``.
        ray_address: an existing Ray cluster (``"auto"``, ``ray://...``); None: a local one.
        num_cpus_per_replica: CPUs Ray reserves per replica (the engine uses
            ``engine_config.num_threads`` threads).
        kv_events_host / hash_format / router_options / model_name / ingress_options: see
            :func:`build_app`.
        engine_factory: builds the engine instead of ``LLMEngine(engine_config)`` (tests).
        startup_timeout_s: how long to wait for every replica to load.

    Returns:
        The base URL (``http://host:port``).

    Raises:
        ConfigError: a bad option; TimeoutError: the replicas did not come up in time.
    """
    import dataclasses

    from pagedkv.engine.llm_engine import LLMEngine

    seed = engine_config.hash_seed
    if seed is None:
        seed = secrets.token_hex(16)
    if engine_config.block_size is None:  # the router hashes with the replicas' block size
        from pagedkv.cpu_caps import probe_cpu, resolve_dtype
        from pagedkv.engine.attention_backend import choose_attention_backend
        from pagedkv.model.loader import load_model_config

        shape = load_model_config(engine_config.model)
        dtype = resolve_dtype(engine_config.dtype, probe_cpu())
        engine_config, _ = choose_attention_backend(engine_config, shape.head_dim, dtype)
    # One replica per num_cpus_per_replica CPUs: its torch threads should not take them all.
    num_threads = engine_config.num_threads or max(1, int(num_cpus_per_replica))
    config = dataclasses.replace(
        engine_config, hash_seed=seed, enable_kv_cache_events=True, num_threads=num_threads
    )
    if engine_factory is None:
        engine_factory = functools.partial(LLMEngine, config)
    if not ray.is_initialized():
        ray.init(
            address=ray_address,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    port = port or free_port(host)
    serve.start(http_options={"host": host, "port": port})
    app = build_app(
        engine_factory,
        ingress=ingress,
        num_replicas=num_replicas,
        block_size=config.block_size,
        hash_algo=config.hash_algo,
        hash_seed=seed,
        policy=policy,
        hash_format=hash_format,
        kv_events_host=kv_events_host,
        num_cpus_per_replica=num_cpus_per_replica,
        router_options=router_options,
        model_name=model_name,
        ingress_options=ingress_options,
    )
    serve.run(app, name=APP_NAME, route_prefix="/")
    _wait_running(startup_timeout_s)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _wait_running(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(APP_NAME)
        state = getattr(status, "status", None)
        if state == "RUNNING":
            return
        if state == "DEPLOY_FAILED":
            raise ConfigError(f"the cluster failed to deploy: {status.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster did not start within {timeout_s} s ({state})")
        time.sleep(0.2)


def stop_cluster() -> None:
    """Tear the Serve app down and stop the local Ray (a joined cluster keeps running)."""
    with contextlib.suppress(Exception):
        serve.shutdown()
    with contextlib.suppress(Exception):
        ray.shutdown()
