"""What travels between the cluster's front end, its router and its engine replicas (pickled by
Ray; plain objects in the in-process cluster), :class:`Dispatcher`, the interface through
which the front end sends them (the in-process cluster and Ray Serve's handle implement it), and
:class:`ReplicaError` / :class:`ReplicaDiedError`, what a request's stream raises when its
replica fails or dies."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedkv.engine.engine_loop import EngineDeadError
from pagedkv.errors import PagedKVError

#: Longest failure description :func:`describe_failure` writes (characters).
MAX_FAILURE_DESCRIPTION = 1000


class ReplicaError(PagedKVError, RuntimeError):
    """A request failed on its replica for a reason that is not the request's (the replica's
    process raised something unexpected). The request's stream raises it in place of the
    replica's own exception, whose text (Ray actor ids, pids, node addresses, a remote traceback)
    stays in the server's log: the message, which the server may show the client, is fixed
    (:attr:`client_message` unless one is given). The serving layer counts the request as
    finished with ``finish_reason="error"``.

    Args:
        message: a client-safe message (default :attr:`client_message`).
    """

    client_message = "the replica serving this request failed"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.client_message)


class ReplicaDiedError(ReplicaError, EngineDeadError):
    """The replica serving a request died or stopped while the request was in flight (its Ray
    actor was killed or lost its node, or its engine thread stopped): the request will never
    finish there. Also an :class:`~pagedkv.engine.engine_loop.EngineDeadError`, so the server
    answers 503 (retry); the other replicas keep serving, and the router forgets the dead one.
    Like every :class:`ReplicaError`, its message is fixed and safe to show a client.
    (vLLM's front end raises its ``EngineDeadError`` in the same place.)
    """

    client_message = "the replica serving this request stopped; retry the request"


def describe_failure(exc: BaseException) -> str:
    """``exc`` as one line for the server's log: its class and its text with every run of
    whitespace (a remote traceback's newlines) made one space, cut at
    :data:`MAX_FAILURE_DESCRIPTION` characters. Never for a client: it keeps Ray's actor ids,
    pids and addresses."""
    text = " ".join(str(exc).split())
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if len(line) > MAX_FAILURE_DESCRIPTION:
        line = line[: MAX_FAILURE_DESCRIPTION - 3] + "..."
    return line


@dataclass(slots=True)
class ClusterRequest:
    """One engine request, tokenized by the front end so that the router can hash its prompt.

    Attributes:
        request_id: unique among the cluster's unfinished requests.
        prompt_token_ids: the prompt after the chat template, as the engine will see it.
        sampling_params: a :class:`pagedkv.sampling_params.SamplingParams`.
        cache_salt: the engine's ``cache_salt`` (part of the first block's hash).
        priority: the engine's ``priority``.
        prompt_cache_key: OpenAI's key of requests that share a prefix: the router keeps one
            key's requests on one replica (:class:`~pagedkv.cluster.router.ClusterRouter`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    cache_salt: str | None = None
    priority: int = 0
    prompt_cache_key: str | None = None


@dataclass(slots=True)
class ReplicaCall:
    """Run ``fn(engine)`` on the replica of rank ``rank``, in its engine thread, between two
    steps (stats, reset of the prefix cache); the router sends it to that replica only."""

    rank: int
    fn: Callable[[Any], Any]


@dataclass(slots=True)
class ReplicaInfo:
    """What a replica tells the front end and the router about itself.

    Attributes:
        rank: the replica's rank (its events carry it as data_parallel_rank).
        kv_events_endpoint: where its KV-cache events are published (ZMQ PUB).
        model_name: name of the served model.
        max_model_len: most tokens per request.
        block_size / hash_algo / hash_seed: what its block hashes depend on.
        input_processor: the engine's :class:`~pagedkv.engine.input_processor.InputProcessor`
            (its tokenizer and limits; the front end processes prompts with a copy).
    """

    rank: int
    kv_events_endpoint: str
    model_name: str
    max_model_len: int
    block_size: int
    hash_algo: str
    hash_seed: Any
    input_processor: Any = field(repr=False, default=None)


class Dispatcher(Protocol):
    """Where the front end sends work: :class:`pagedkv.cluster.local.LocalCluster` in one
    process, :class:`pagedkv.cluster.ray_serve.RayDispatcher` on Ray Serve."""

    def submit(self, request: ClusterRequest) -> AsyncIterator[Any]:
        """Route ``request`` to one replica; the stream yields ``None`` once the replica's engine
        accepted it (or raises its error: an ``InvalidRequestError`` for a request the engine
        refuses), then the request's RequestOutputs. A replica that fails or dies makes the
        stream raise (Ray's dispatcher raises a :class:`ReplicaError` or
        :class:`ReplicaDiedError`; the front end turns any other exception into one of them
        before a client sees it). Closing the stream early aborts the request on the
        replica."""
        ...

    async def broadcast(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(engine)`` on every live replica; their results."""
        ...

    @property
    def is_alive(self) -> bool:
        """True while at least one replica serves."""
        ...
