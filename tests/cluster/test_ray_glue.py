"""The Ray Serve glue without starting Ray: the client-safe errors :class:`RayDispatcher` raises
for Ray's exceptions."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray", reason="needs pip install 'pagedkv[cluster]'")
pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError, RayActorError, RayTaskError  # noqa: E402

from pagedkv.cluster import ray_serve  # noqa: E402
from pagedkv.cluster.protocol import (  # noqa: E402
    ClusterRequest,
    ReplicaDiedError,
    ReplicaError,
)
from pagedkv.engine.engine_loop import EngineDeadError  # noqa: E402
from pagedkv.errors import InvalidRequestError  # noqa: E402
from pagedkv.sampling_params import SamplingParams  # noqa: E402

# What Ray's exceptions say about a dead replica: none of it may reach a client.
SECRETS = ("ffd1c2e3a4b5c6d7e8f90a1b01000000", "pid=48213", "10.20.30.40")
RAY_DEATH_TEXT = (
    "The actor died unexpectedly before finishing this task. class_name: ServeReplica, "
    f"actor_id: {SECRETS[0]}, {SECRETS[1]}, ip={SECRETS[2]}, the actor was killed by ray.kill"
)


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
