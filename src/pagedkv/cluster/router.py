"""The cluster's routing decision, without Ray: subscribe to each replica's KV-cache events, keep
the :class:`~pagedkv.cluster.prefix_index.PrefixIndex`, hash each prompt as the engines do, and rank
the replicas (:func:`~pagedkv.cluster.prefix_index.rank_replicas`).

The Ray request router (:mod:`pagedkv.cluster.ray_serve`) and the in-process cluster
(:mod:`pagedkv.cluster.local`) are thin shells around :class:`ClusterRouter`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.cluster.kv_events import HASH_FORMATS, KVEventSubscriber, to_wire_block_hash
from pagedkv.cluster.prefix_index import PrefixIndex, rank_replicas
from pagedkv.cluster.protocol import ClusterRequest
from pagedkv.core.hashing import BlockHasher
from pagedkv.core.request import KVCacheRequest
from pagedkv.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)

ROUTING_POLICIES = ("prefix", "round_robin")


@dataclass(slots=True)
class ReplicaRoutingStats:
    """What the router knows of one replica.

    Attributes:
        endpoint: the replica's KV-event address.
        num_cached_blocks: distinct block hashes the index holds for it.
        num_in_flight: requests routed to it and not finished.
        num_routed: requests routed to it since it joined.
        num_batches: event batches received from it.
        num_missed_batches: event batches it published that the router never received (a gap
            makes the router forget the replica's blocks: they are learned again).
    """

    endpoint: str
    num_cached_blocks: int = 0
    num_in_flight: int = 0
    num_routed: int = 0
    num_batches: int = 0
    num_missed_batches: int = 0


class ClusterRouter:
    """Chooses the replica of each request.

    Args:
        block_size / hash_algo / hash_seed: the replicas' (``EngineConfig``): the router
            recomputes prompt hashes with them.
        hash_format: how the replicas publish hashes (``"bytes"`` or ``"int"``).
        policy: ``"prefix"`` (longest cached prefix, then queue length) or ``"round_robin"``.
        max_imbalance / min_match_fraction: see :func:`rank_replicas`.
        routed_ttl_s: how long a routed request's hashes count as held by its replica before
            the replica's events confirm them (bursts with a new prefix stick together).
        max_prompt_cache_keys: most ``prompt_cache_key`` values remembered (least recently
            used forgotten first); each maps to the replica its requests go to.
        clock: seconds, monotonic (injectable for tests).
        subscriber_factory: ``endpoint -> subscriber`` (default :class:`KVEventSubscriber`).

    Not thread-safe: use it from one thread (an event loop).

    Raises:
        ConfigError: an unknown policy or hash format, a bad hash setting, or no hash_seed.
    """

    def __init__(
        self,
        *,
        block_size: int,
        hash_algo: str = "sha256",
        hash_seed: int | str | bytes,
        hash_format: str = "bytes",
        policy: str = "prefix",
        max_imbalance: int = 8,
        min_match_fraction: float = 0.1,
        routed_ttl_s: float = 10.0,
        max_prompt_cache_keys: int = 65536,
        clock: Callable[[], float] = time.monotonic,
        subscriber_factory: Callable[[str], Any] = KVEventSubscriber,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ConfigError(f"policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        if hash_format not in HASH_FORMATS:
            raise ConfigError(f"hash_format must be one of {HASH_FORMATS}, got {hash_format!r}")
        if hash_seed is None:
            raise ConfigError("the router needs the replicas' hash_seed to predict their hashes")
        if not routed_ttl_s >= 0:
            raise ConfigError(f"routed_ttl_s must be >= 0 seconds, got {routed_ttl_s!r}")
        if not isinstance(max_prompt_cache_keys, int) or max_prompt_cache_keys < 0:
            raise ConfigError(
                f"max_prompt_cache_keys must be an int >= 0, got {max_prompt_cache_keys!r}"
            )
        self.hasher = BlockHasher(block_size, hash_algo, hash_seed)
        self.hash_format = hash_format
        self.policy = policy
        self.max_imbalance = max_imbalance
        self.min_match_fraction = min_match_fraction
        self.routed_ttl_s = routed_ttl_s
        self.clock = clock
        self.index = PrefixIndex()
        self._subscriber_factory = subscriber_factory
        self._subscribers: dict[Hashable, Any] = {}
        self._stats: dict[Hashable, ReplicaRoutingStats] = {}
        self._counter = 0  # rank() calls (round robin)
        self._num_routed = 0
        self._last_routed: dict[Hashable, int] = {}  # replica -> _num_routed when last chosen
        self._last_expiry = clock()
        self.max_prompt_cache_keys = max_prompt_cache_keys
        # prompt_cache_key -> the replica its requests go to, least recently used first
        self._key_owner: OrderedDict[str, Hashable] = OrderedDict()

    # ---- replicas -------------------------------------------------------------------------

    @property
    def replicas(self) -> list[Hashable]:
        """Replicas the router subscribes to, in the order they were added."""
        return list(self._subscribers)

    def endpoint_of(self, key: Hashable) -> str | None:
        stats = self._stats.get(key)
        return None if stats is None else stats.endpoint

    def add_replica(self, key: Hashable, endpoint: str) -> None:
        """Subscribe to ``key``'s events at ``endpoint`` (a new endpoint replaces the old one,
        and what the index knew of ``key`` is dropped).

        Raises:
            ConfigError: the subscriber cannot connect (nothing changes then).
        """
        if key in self._subscribers:
            if self._stats[key].endpoint == endpoint:
                return
            self.remove_replica(key)
        subscriber = self._subscriber_factory(endpoint)
        self._subscribers[key] = subscriber
        self._stats[key] = ReplicaRoutingStats(endpoint)
        self.index.add_replica(key)

    def remove_replica(self, key: Hashable) -> None:
        """Forget ``key`` (it died or left): unsubscribe and drop its index entries."""
        subscriber = self._subscribers.pop(key, None)
        if subscriber is not None:
            subscriber.close()
        self._stats.pop(key, None)
        self._last_routed.pop(key, None)
        for cache_key in [k for k, owner in self._key_owner.items() if owner == key]:
            del self._key_owner[cache_key]
        dropped = self.index.remove_replica(key)
        if subscriber is not None:
            logger.info("replica %s left the router (%d cached blocks forgotten)", key, dropped)

    def close(self) -> None:
        """Unsubscribe from every replica."""
        for key in list(self._subscribers):
            self.remove_replica(key)

    # ---- events -----------------------------------------------------------------------------

    def drain(self, timeout_ms: int = 0) -> int:
        """Apply every event batch received so far; returns the number of batches. A gap in a
        replica's sequence numbers (lost batches) clears what the index knew of that replica."""
        num_batches = 0
        for key, subscriber in self._subscribers.items():
            received = subscriber.poll(timeout_ms)
            if not received:
                continue
            stats = self._stats[key]
            for item in received:
                if item.num_missed:  # lost removals would leave stale entries: start over
                    self.index.clear_replica(key)
                stats.num_missed_batches += item.num_missed
                stats.num_batches += 1
                self.index.apply(key, item.batch.events)
                num_batches += 1
            stats.num_cached_blocks = self.index.num_cached_blocks(key)
        return num_batches

    # ---- routing ----------------------------------------------------------------------------

    def prompt_hashes(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> list:
        """The chained hashes of the prompt's full blocks, as the replicas publish them.

        Raises:
            InvalidRequestError: an empty prompt or token ids the hash cannot encode.
        """
        request = KVCacheRequest(
            "route", list(prompt_token_ids), block_hasher=self.hasher, cache_salt=cache_salt
        )
        if self.hash_format == "bytes":
            return list(request.block_hashes)
        return [to_wire_block_hash(h, "int") for h in request.block_hashes]

    def rank(
        self, candidates: Sequence[Hashable], request: ClusterRequest | None = None
    ) -> list[list[Hashable]]:
        """Rank ``candidates`` for ``request`` (best first, ranks of equals; see
        :func:`rank_replicas`). Without a request (a call that is not a generation) or with the
        round-robin policy, by queue length and the rotating order only. Under the prefix
        policy a request with a ``prompt_cache_key`` seen before goes first to the replica the
        key's earlier requests went to (OpenAI's meaning of the key: requests that share a
        prefix), unless that replica is a hot spot (``max_imbalance``).

        Raises:
            ConfigError: no candidates.
        """
        if not candidates:
            raise ConfigError("no replica to route to")
        self._counter += 1
        queue = {k: self._stats[k].num_in_flight if k in self._stats else 0 for k in candidates}
        if self.policy == "round_robin":
            start = self._counter % len(candidates)
            return [[k] for k in [*candidates[start:], *candidates[:start]]]
        matched: dict[Hashable, int] = {}
        num_blocks = 0
        if request is not None:
            self.drain()
            hashes = self._hashes_of(request)
            num_blocks = len(hashes)
            if hashes:
                now = self.clock()
                self._maybe_expire(now)
                matched = self.index.match(hashes, candidates, now=now)
        ranks = rank_replicas(
            candidates,
            matched,
            queue,
            num_prompt_blocks=num_blocks,
            max_imbalance=self.max_imbalance,
            min_match_fraction=self.min_match_fraction,
            last_routed=self._last_routed,
        )
        owner = self._key_owner.get(request.prompt_cache_key) if request is not None else None
        shortest = min(queue.values())
        if owner in queue and queue[owner] - shortest <= self.max_imbalance:
            rest = [[k for k in rank if k != owner] for rank in ranks]
            ranks = [[owner], *(rank for rank in rest if rank)]
        return ranks

    def on_routed(self, key: Hashable, request: ClusterRequest | None) -> None:
        """``request`` was sent to ``key``: count it in flight and remember its prompt."""
        stats = self._stats.get(key)
        if stats is not None:
            stats.num_in_flight += 1
            stats.num_routed += 1
        self._num_routed += 1
        self._last_routed[key] = self._num_routed
        cache_key = None if request is None else request.prompt_cache_key
        if cache_key is not None and self.policy == "prefix" and self.max_prompt_cache_keys:
            self._key_owner[cache_key] = key
            self._key_owner.move_to_end(cache_key)
            while len(self._key_owner) > self.max_prompt_cache_keys:
                self._key_owner.popitem(last=False)
        if request is not None and self.policy == "prefix" and self.routed_ttl_s > 0:
            hashes = self._hashes_of(request)
            if hashes:
                self.index.note_routed(key, hashes, self.clock() + self.routed_ttl_s)

    def on_completed(self, key: Hashable) -> None:
        """A request routed to ``key`` finished (or failed, or was aborted)."""
        stats = self._stats.get(key)
        if stats is not None and stats.num_in_flight > 0:
            stats.num_in_flight -= 1

    def stats(self) -> dict[Hashable, ReplicaRoutingStats]:
        """A snapshot per replica."""
        return {
            k: ReplicaRoutingStats(
                s.endpoint,
                self.index.num_cached_blocks(k),
                s.num_in_flight,
                s.num_routed,
                s.num_batches,
                s.num_missed_batches,
            )
            for k, s in self._stats.items()
        }

    def _hashes_of(self, request: ClusterRequest) -> list:
        try:
            return self.prompt_hashes(request.prompt_token_ids, request.cache_salt)
        except InvalidRequestError:
            return []  # the engine will refuse it with the real message

    def _maybe_expire(self, now: float) -> None:
        if now - self._last_expiry >= self.routed_ttl_s:
            self.index.expire(now)
            self._last_expiry = now
