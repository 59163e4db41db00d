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

Each engine replica binds its KV-event publisher on ``tcp://127.0.0.1:*`` (loopback: the events
are unauthenticated and carry the token ids of every cached prompt; ``kv_events_host`` opens
them to a network, see :func:`kv_events_bind_endpoint`) and reports the resolved address, its
rank and its Ray node through Ray Serve's routing stats (``record_routing_stats``); the router
subscribes when it sees it (not to a loopback address on another node: it cannot be reached),
and unsubscribes (dropping the replica's index entries) when Ray reports the replica gone or
dead. The decision itself is
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
import dataclasses
import functools
import ipaddress
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import ray
from ray import serve
from ray.exceptions import (
    LocalRayletDiedError,
    NodeDiedError,
    RayActorError,
    RayTaskError,
    WorkerCrashedError,
)
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedkv.cluster.protocol import (
    ClusterRequest,
    ReplicaCall,
    ReplicaDiedError,
    ReplicaError,
    ReplicaInfo,
    describe_failure,
)
from pagedkv.cluster.replica import EngineReplica
from pagedkv.cluster.router import ClusterRouter
from pagedkv.cpu_caps import probe_cpu, resolve_dtype
from pagedkv.engine.engine_loop import EngineDeadError
from pagedkv.errors import ConfigError, PagedKVError
from pagedkv.model.gguf_loader import MMAP_ENV, gguf_mmap_setting

logger = logging.getLogger(__name__)

APP_NAME = "pagedkv"
ENGINE_DEPLOYMENT = "PagedKVEngine"
INGRESS_DEPLOYMENT = "PagedKVIngress"

#: Where replicas publish their KV-cache events unless told otherwise: this machine only.
DEFAULT_KV_EVENTS_HOST = "127.0.0.1"
#: Hosts that bind every interface; the replica then advertises its node's IP to the router.
WILDCARD_HOSTS = ("0.0.0.0", "::", "*")

#: Ray's exceptions that mean the replica's process is gone (killed, crashed, its node lost).
_REPLICA_GONE = (
    RayActorError,
    WorkerCrashedError,
    NodeDiedError,
    LocalRayletDiedError,
    ReplicaUnavailableError,
    DeploymentUnavailableError,
)


# ---- where the KV events are published ----------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) reaches this machine only."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def kv_events_bind_endpoint(kv_events_host: str | None) -> str:
    """The ZMQ address a replica binds its KV-event publisher to (a free port).

    ``None`` is :data:`DEFAULT_KV_EVENTS_HOST` (127.0.0.1). The events are not authenticated and
    their BlockStored events carry the token ids of every prompt the replica caches: bind them
    on another address only on a trusted network. A wildcard (``0.0.0.0``, ``::``) binds every
    interface of the replica's node, which a replica on another node than the router needs
    (:func:`advertised_endpoint` then names the node's IP).
    """
    host = kv_events_host or DEFAULT_KV_EVENTS_HOST
    if host == "*":
        host = "0.0.0.0"
    shown = f"[{host}]" if ":" in host else host
    return f"tcp://{shown}:*"


def advertised_endpoint(bound: str, node_ip: str) -> str:
    """The address the router connects to for a publisher bound at ``bound`` (ZMQ's resolved
    ``tcp://HOST:PORT``): the same, except that a wildcard host becomes ``node_ip``."""
    scheme, _, rest = bound.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or host.strip("[]") not in WILDCARD_HOSTS:
        return bound
    shown = f"[{node_ip}]" if ":" in node_ip else node_ip
    return f"tcp://{shown}:{port}"


def unreachable_loopback(endpoint: str, replica_node: str | None, router_node: str | None) -> bool:
    """Whether ``endpoint`` is a loopback address on another Ray node than the router's (the
    router would connect to its own machine, not to the replica)."""
    host = endpoint.partition("://")[2].rpartition(":")[0]
    return (
        is_loopback(host)
        and replica_node is not None
        and router_node is not None
        and replica_node != router_node
    )


def _node_id() -> str | None:
    """This process's Ray node id (None outside Ray: never starts Ray)."""
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


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
        self._node = _node_id()
        self._unreachable: set[str] = set()  # replicas whose loopback endpoint is elsewhere

    @staticmethod
    def _key(replica_id: ReplicaID) -> str:
        return replica_id.unique_id

    def _sync_subscriptions(self) -> None:
        """Subscribe to replicas whose endpoint is known, drop the ones that left."""
        router = self.cluster_router
        stats = {self._key(r.replica_id): r.routing_stats for r in self._replicas.values()}
        endpoints = {key: s.get("kv_events_endpoint") for key, s in stats.items()}
        for key in router.replicas:
            if key not in endpoints:
                router.remove_replica(key)
        self._unreachable &= set(endpoints)
        for key, endpoint in endpoints.items():
            if endpoint and unreachable_loopback(endpoint, stats[key].get("node_id"), self._node):
                if key not in self._unreachable and router.policy == "prefix":
                    logger.error(
                        "replica %s publishes its KV events on %s, a loopback address on "
                        "another node: it is routed by queue length only. Start the cluster "
                        "with --kv-events-host 0.0.0.0 (unauthenticated, carries prompt token "
                        "ids: trusted networks only; docs/cluster.md)",
                        key,
                        endpoint,
                    )
                self._unreachable.add(key)
                continue
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
        kv_events_host: address to publish KV events on (default 127.0.0.1; a wildcard binds
            every interface and advertises this node's IP; see :func:`kv_events_bind_endpoint`).
        hash_format: ``"bytes"`` or ``"int"``.

    Raises:
        ConfigError: an address this node cannot bind (Serve then reports the deployment
            failed), or an engine without events (see :class:`EngineReplica`).
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
        self.replica = EngineReplica(
            engine_factory,
            rank=rank,
            kv_events_endpoint=kv_events_bind_endpoint(kv_events_host),
            hash_format=hash_format,
        )
        info = self.replica.info
        endpoint = advertised_endpoint(info.kv_events_endpoint, ray.util.get_node_ip_address())
        self.info = dataclasses.replace(info, kv_events_endpoint=endpoint)
        self.node_id = _node_id()

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router needs to know of this replica (Ray polls it): its rank, where its
        KV events can be read, and its Ray node (a loopback endpoint is reachable from that
        node only)."""
        return {
            "rank": self.replica.rank,
            "kv_events_endpoint": self.info.kv_events_endpoint,
            "node_id": self.node_id,
        }

    async def generate(self, request: ClusterRequest) -> AsyncIterator[Any]:
        """Stream a request's outputs (``None`` first, once accepted)."""
        async for item in self.replica.generate(request):
            yield item

    async def engine_call(self, call: ReplicaCall) -> Any:
        """``call.fn(engine)`` in the engine thread."""
        return await self.replica.call(call.fn)

    def describe(self) -> ReplicaInfo:
        return self.info

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
        """See :meth:`~pagedkv.cluster.protocol.Dispatcher.submit`.

        Raises:
            InvalidRequestError (or another PagedKVError the engine raised, as it was): the
                engine refused the request.
            ReplicaDiedError: the replica's actor died, its node or worker was lost, Serve has
                no replica, or its engine stopped.
            ReplicaError: the replica raised anything else.

        Ray's exception (actor id, pid, node address, the remote traceback) is logged here,
        one line; the two Replica errors carry a fixed message, safe for a client.
        """
        outputs = self._remote("generate", request, stream=True)
        try:
            async for item in outputs:
                yield item
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = _replica_failure(exc)
            if error is None:  # the engine refused it: a 400, not a 500
                refusal = exc.cause if isinstance(exc, RayTaskError) else exc
                raise refusal from None
            logger.warning(
                "request %s failed on its replica: %s", request.request_id, describe_failure(exc)
            )
            raise error from None
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
                logger.warning("replica rank %d did not answer: %s", rank, describe_failure(result))
            else:
                answers.append(result)
        return answers


def _replica_failure(exc: Exception) -> ReplicaError | None:
    """The client-safe error for ``exc``, raised by a replica's stream; None when it is the
    engine's refusal of the request (a PagedKVError other than EngineDeadError, or one
    wrapped in a RayTaskError), which the caller raises as it is."""
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    if isinstance(cause, ReplicaError):
        return cause
    if isinstance(exc, _REPLICA_GONE) or isinstance(cause, (EngineDeadError, *_REPLICA_GONE)):
        return ReplicaDiedError()
    if isinstance(cause, PagedKVError):
        return None
    return ReplicaError()


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
    model_name: str | list[str] | None = None,
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
        kv_events_host: address replicas publish their KV events on (default 127.0.0.1:
            unauthenticated events that carry prompt token ids stay on the machine; a wildcard
            such as ``0.0.0.0`` binds every interface of each replica's node and advertises
            the node's IP, which replicas on other nodes than the ingress need; see
            :func:`kv_events_bind_endpoint`).
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
    model_name: str | list[str] | None = None,
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
        ConfigError: a bad option, or KV events on loopback (the default) with the prefix
            policy in a Ray cluster of more than one node (replicas on the other nodes could
            not be read: pass ``kv_events_host``, see :func:`kv_events_bind_endpoint`);
            Ray is then left as it was. TimeoutError: the replicas did not come up in time.
    """
    # Lazy: the engine (torch, the model) loads on Ray's driver only when a cluster starts.
    from pagedkv.engine.llm_engine import LLMEngine

    seed = engine_config.hash_seed
    if seed is None:
        seed = secrets.token_hex(16)
    if engine_config.block_size is None:  # the router hashes with the replicas' block size
        from pagedkv.engine.attention_backend import choose_attention_backend
        from pagedkv.model.loader import load_model_config

        shape = load_model_config(engine_config.model)
        dtype = resolve_dtype(engine_config.dtype, probe_cpu())
        choice, _ = choose_attention_backend(
            engine_config, shape.head_dim, dtype, logits_soft_cap=shape.attn_logit_softcapping
        )
        # Pinned as given: every replica runs the block size the router hashes with.
        engine_config = dataclasses.replace(engine_config, block_size=choice.block_size)
    # One replica per num_cpus_per_replica CPUs: its torch threads should not take them all.
    num_threads = engine_config.num_threads or max(1, int(num_cpus_per_replica))
    config = dataclasses.replace(
        engine_config, hash_seed=seed, enable_kv_cache_events=True, num_threads=num_threads
    )
    if engine_factory is None:
        engine_factory = functools.partial(LLMEngine, config)
    started_ray = init_ray(ray_address)
    try:
        _check_events_reachable(kv_events_host, policy)
    except ConfigError:
        if started_ray:
            ray.shutdown()
        raise
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


def init_ray(ray_address: str | None = None) -> bool:
    """Start a local Ray (``ray_address`` None) or join one, unless Ray is already up in this
    process; returns whether this call did it. No dashboard, Ray's warnings only, and no worker
    logs forwarded to this process's stdout.

    A local Ray's own servers listen on this machine's network address unless Ray was imported
    with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment (then on 127.0.0.1):
    ``pagedkv serve`` sets it (:mod:`pagedkv.entrypoints.cluster.ray_process`).

    Raises:
        ConfigError: ``PAGEDKV_GGUF_MMAP`` other than unset, empty, 0 or 1 (its value, "1"
            where unset or empty, is passed to the replicas).
    """
    if ray.is_initialized():
        return False
    ray.init(
        address=ray_address,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                _PROXY_READY_VAR: os.environ.get(_PROXY_READY_VAR, "60"),
                # replicas on one machine share the GGUF file's pages (the page cache) instead of
                # each reading the weights into memory of its own (docs/cluster.md); a bad
                # value is refused here, before Ray starts
                MMAP_ENV: gguf_mmap_setting() or "1",
            }
        },
    )
    return True


#: Serve's setting of how long its HTTP proxy may take to report ready: Ray's default is 5 s,
#: three tries, then it kills the proxy; on a busy 2-core machine a proxy took about 17 s to
#: start, so a local Ray gets 60 s unless the user set it.
_PROXY_READY_VAR = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"


def _check_events_reachable(kv_events_host: str | None, policy: str) -> None:
    """Refuse loopback KV events (the default) for prefix routing in a Ray cluster of several
    nodes: a replica on another node than the router could not be read."""
    host = kv_events_host or DEFAULT_KV_EVENTS_HOST
    if policy != "prefix" or not is_loopback(host):
        return
    num_nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    if num_nodes > 1:
        raise ConfigError(
            f"the Ray cluster has {num_nodes} nodes, and replicas publish their KV-cache events "
            f"on {host}, which the router cannot read from another node: pass "
            "--kv-events-host 0.0.0.0 (the events are unauthenticated and carry the token ids "
            "of cached prompts: only on a trusted network), or --router round_robin "
            "(docs/cluster.md)"
        )


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
    """Tear the Serve app down and stop the local Ray (a joined cluster keeps running): the
    replicas' processes, Ray's own (GCS, raylet, its dashboard and runtime-env agents) and
    their sockets end. Errors are ignored: it is called on the way out."""
    with contextlib.suppress(Exception):
        serve.shutdown()
    with contextlib.suppress(Exception):
        ray.shutdown()
