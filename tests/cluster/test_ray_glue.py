"""The Ray Serve glue without starting Ray: where an engine replica publishes its KV events
(loopback by default), the refusal of loopback events in a cluster of several nodes, and the
client-safe errors :class:`RayDispatcher` raises for Ray's exceptions."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray", reason="needs pip install 'pagedkv[cluster]'")
pytest.importorskip("ray.serve")
pytest.importorskip("zmq", reason="needs pip install 'pagedkv[cluster]'")

from _cluster_helpers import make_tiny_engine, tiny_engine_config  # noqa: E402
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError  # noqa: E402

from pagedkv.cluster import ray_serve  # noqa: E402
from pagedkv.cluster.kv_events import KVEventSubscriber  # noqa: E402
from pagedkv.cluster.protocol import (  # noqa: E402
    ClusterRequest,
    ReplicaDiedError,
    ReplicaError,
)
from pagedkv.engine.engine_loop import EngineDeadError  # noqa: E402
from pagedkv.errors import ConfigError, InvalidRequestError  # noqa: E402
from pagedkv.sampling_params import SamplingParams  # noqa: E402

# What Ray's exceptions say about a dead replica: none of it may reach a client.
SECRETS = ("ffd1c2e3a4b5c6d7e8f90a1b01000000", "pid=48213", "10.20.30.40")
RAY_DEATH_TEXT = (
    "The actor died unexpectedly before finishing this task. class_name: ServeReplica, "
    f"actor_id: {SECRETS[0]}, {SECRETS[1]}, ip={SECRETS[2]}, the actor was killed by ray.kill"
)


@pytest.fixture
def deployment_of(monkeypatch):
    """Builds an EngineDeployment (a tiny engine) as Serve would, outside Serve."""
    monkeypatch.setattr(
        ray_serve.serve, "get_replica_context", lambda: SimpleNamespace(rank=0), raising=True
    )
    built = []

    def build(**kwargs):
        deployment = ray_serve.EngineDeployment(make_tiny_engine, **kwargs)
        built.append(deployment)
        return deployment

    yield build
    for deployment in built:
        deployment.replica.shutdown()


def host_of(endpoint: str) -> str:
    return endpoint.partition("://")[2].rpartition(":")[0]


def test_a_replica_publishes_its_kv_events_on_loopback_by_default(deployment_of):
    deployment = deployment_of()
    bound = deployment.replica.publisher.endpoint  # what ZMQ bound
    advertised = deployment.record_routing_stats()["kv_events_endpoint"]
    assert bound.startswith("tcp://127.0.0.1:") and not bound.endswith(":*")
    assert advertised == bound == deployment.describe().kv_events_endpoint
    assert ray_serve.is_loopback(host_of(advertised))


def test_a_wildcard_host_binds_every_interface_and_advertises_the_node_ip(
    deployment_of, monkeypatch
):
    monkeypatch.setattr(ray_serve.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    deployment = deployment_of(kv_events_host="0.0.0.0")
    bound = deployment.replica.publisher.endpoint
    port = bound.rpartition(":")[2]
    assert bound == f"tcp://0.0.0.0:{port}"
    advertised = deployment.record_routing_stats()["kv_events_endpoint"]
    assert advertised == f"tcp://127.0.0.1:{port}"
    # The router reads the events at the advertised address.
    publisher = deployment.replica.publisher
    with KVEventSubscriber(advertised) as subscriber:
        deadline = time.monotonic() + 10
        received = []
        while not received:
            assert time.monotonic() < deadline, "no event reached the advertised address"
            publisher.publish((), allow_empty=True)
            received = subscriber.poll(20)
    assert received[0].batch.data_parallel_rank == 0


def test_endpoint_helpers():
    assert ray_serve.kv_events_bind_endpoint(None) == "tcp://127.0.0.1:*"
    assert ray_serve.kv_events_bind_endpoint("10.0.0.5") == "tcp://10.0.0.5:*"
    assert ray_serve.kv_events_bind_endpoint("*") == "tcp://0.0.0.0:*"
    assert ray_serve.advertised_endpoint("tcp://0.0.0.0:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert ray_serve.advertised_endpoint("tcp://127.0.0.1:5557", "10.0.0.5") == (
        "tcp://127.0.0.1:5557"
    )
    assert [ray_serve.is_loopback(h) for h in ("127.0.0.1", "[::1]", "localhost", "10.0.0.5")] == [
        True,
        True,
        True,
        False,
    ]
    # A loopback endpoint is unreachable from another node only.
    assert ray_serve.unreachable_loopback("tcp://127.0.0.1:5557", "node-b", "node-a")
    assert not ray_serve.unreachable_loopback("tcp://127.0.0.1:5557", "node-a", "node-a")
    assert not ray_serve.unreachable_loopback("tcp://10.0.0.5:5557", "node-b", "node-a")


class _Deployed(Exception):
    """Raised by the fake serve.start: start_cluster got past its checks."""


@pytest.mark.parametrize(
    "kv_events_host, policy, refused",
    [(None, "prefix", True), ("0.0.0.0", "prefix", False), (None, "round_robin", False)],
)
def test_loopback_events_in_a_cluster_of_several_nodes_are_refused(
    monkeypatch, kv_events_host, policy, refused
):
    monkeypatch.setattr(ray_serve.ray, "is_initialized", lambda: True)  # a joined cluster
    monkeypatch.setattr(ray_serve.ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}])

    def deployed(**_):
        raise _Deployed

    monkeypatch.setattr(ray_serve.serve, "start", deployed)
    call = lambda: ray_serve.start_cluster(  # noqa: E731
        tiny_engine_config(),
        ingress=object,
        num_replicas=2,
        port=8000,
        policy=policy,
        kv_events_host=kv_events_host,
        engine_factory=make_tiny_engine,
    )
    if refused:
        with pytest.raises(ConfigError, match=r"--kv-events-host 0\.0\.0\.0") as info:
            call()
        assert "2 nodes" in str(info.value) and "trusted network" in str(info.value)
    else:
        with pytest.raises(_Deployed):
            call()


# ---- client-safe errors ----------------------------------------------------------------------


class _FailingStream:
    """A streaming handle call: yields ``items``, then raises ``error``."""

    def __init__(self, items, error):
        self.items = list(items)
        self.error = error
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        raise self.error

    def cancel(self):
        self.cancelled = True


class _Handle:
    def __init__(self, stream):
        self.stream = stream
        self.generate = SimpleNamespace(remote=lambda request: stream)

    def options(self, stream=False):
        return self


def _task_error(cause: Exception) -> RayTaskError:
    traceback = f'Traceback (most recent call last):\n  File "replica.py", line 1\n{cause!r}'
    return RayTaskError(
        "generate", traceback, cause, proctitle="ray::ServeReplica", pid=48213, ip=SECRETS[2]
    ).as_instanceof_cause()


def _submit(error, items=(None,)):
    """What RayDispatcher.submit raises when the replica's stream raises ``error``."""
    stream = _FailingStream(items, error)
    dispatcher = ray_serve.RayDispatcher(_Handle(stream), num_replicas=2)
    request = ClusterRequest("cmpl-1-0", [1, 2, 3], SamplingParams(max_tokens=4))

    async def main():
        async for _ in dispatcher.submit(request):
            pass

    with pytest.raises(Exception) as info:
        asyncio.run(main())
    assert stream.cancelled
    return info.value


@pytest.mark.parametrize(
    "error",
    [
        RayActorError(error_msg=RAY_DEATH_TEXT),
        ActorDiedError(),
        _task_error(EngineDeadError("replica 1 stopped")),
    ],
    ids=["RayActorError", "ActorDiedError", "engine stopped"],
)
def test_a_replica_that_dies_mid_stream_raises_replica_died_error(error, caplog):
    with caplog.at_level(logging.WARNING, logger=ray_serve.__name__):
        raised = _submit(error)
    assert type(raised) is ReplicaDiedError and isinstance(raised, EngineDeadError)
    assert str(raised) == ReplicaDiedError.client_message
    assert raised.__cause__ is None and raised.__suppress_context__
    # The details are in the server's log, one line that names the request.
    (record,) = [r for r in caplog.records if r.name == ray_serve.__name__]
    message = record.getMessage()
    assert "cmpl-1-0" in message and "\n" not in message
    if isinstance(error, RayActorError) and error.error_msg == RAY_DEATH_TEXT:
        assert all(secret in message for secret in SECRETS)


def test_an_unexpected_replica_exception_is_a_replica_error_without_its_text():
    raised = _submit(_task_error(KeyError(f"actor {SECRETS[0]} on {SECRETS[2]}")))
    assert type(raised) is ReplicaError and str(raised) == ReplicaError.client_message
    assert not any(secret in str(raised) for secret in SECRETS)


def test_an_engine_refusal_is_still_the_engines_error():
    raised = _submit(_task_error(InvalidRequestError("prompt too long", param="prompt")), items=())
    assert type(raised) is InvalidRequestError
    assert str(raised) == "prompt too long" and raised.param == "prompt"
