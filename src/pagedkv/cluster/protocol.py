"""What travels between the cluster's front end, its router and its engine replicas (pickled by
Ray; plain objects in the in-process cluster), and :class:`Dispatcher`, the interface through
which the front end sends them (the in-process cluster and Ray Serve's handle implement it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class ClusterRequest:
    """One engine request, tokenized by the front end so that the router can hash its prompt.

    Attributes:
        request_id: unique among the cluster's unfinished requests.
        prompt_token_ids: the prompt after the chat template, as the engine will see it.
        sampling_params: a :class:`pagedkv.sampling_params.SamplingParams`.
        cache_salt: the engine's ``cache_salt`` (part of the first block's hash).
        priority: the engine's ``priority``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    cache_salt: str | None = None
    priority: int = 0


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
        accepted it (or raises its error), then the request's RequestOutputs. Closing the
        stream early aborts the request on the replica."""
        ...

    async def broadcast(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(engine)`` on every live replica; their results."""
        ...

    @property
    def is_alive(self) -> bool:
        """True while at least one replica serves."""
        ...
