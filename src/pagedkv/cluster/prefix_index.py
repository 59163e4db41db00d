"""Which replica holds which prefix: an index over several engines' prefix caches, for routing.

A router that sends a request where its prefix is already cached (llm-d's KV-cache-aware
scorer, NVIDIA Dynamo's KV router, SGLang's cache-aware router) keeps, per replica, the set of
block hashes that replica has in its prefix cache. It learns them from the replicas' KV-cache
events (:mod:`pagedkv.core.events`, on the wire :mod:`pagedkv.cluster.kv_events`): BlockStored
adds hashes, BlockRemoved drops them, AllBlocksCleared empties the replica. To score a request it
computes the prompt's chained block hashes with the replicas' block_size, algorithm and seed
(:class:`pagedkv.core.hashing.BlockHasher`) and asks, per replica, how many leading blocks are
cached (:meth:`PrefixIndex.match`): hashes are chained, so block i's hash stands for the whole
prefix up to block i, and the walk stops at the first miss.

Events arrive after the blocks are computed, so a burst of requests with a new prefix would all
miss the index and spread out. :meth:`PrefixIndex.note_routed` therefore also records the hashes
of a request at the moment it is routed, for ``ttl`` seconds (Dynamo's "predicted" blocks, the
insert-on-route of SGLang's router): followers of the burst go where the first one went.

:func:`rank_replicas` turns the matches into an order: the longest cached prefix first, equal
prefixes by queue length, and replicas whose queue is much longer than the shortest one last (so
one popular prefix does not pile every request on one replica).

Pure Python, no I/O: the same index serves the Ray router, the in-process cluster and the
multi-replica simulator. Hashes are any hashable (digest bytes, or ints as on some wires);
replica keys are any hashable (strings in practice).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.errors import ConfigError

K = TypeVar("K", bound=Hashable)


class PrefixIndex:
    """Block hashes cached by each replica (from its events) or just routed to it.

    Cost: ``apply`` is O(blocks in the events); ``match`` is O(prompt blocks x replicas) in the
    worst case and stops at the first block no replica holds.
    """

    __slots__ = ("_holders", "_routed", "_stored")

    def __init__(self) -> None:
        # hash -> {replica: number of KV cache groups holding it}
        self._holders: dict[Hashable, dict[Hashable, int]] = {}
        # replica -> {hash: number of groups}; a replica is known once it is a key here
        self._stored: dict[Hashable, dict[Hashable, int]] = {}
        # hash -> {replica: expiry time}
        self._routed: dict[Hashable, dict[Hashable, float]] = {}

    # ---- replicas -------------------------------------------------------------------------

    @property
    def replicas(self) -> list[Hashable]:
        """Known replicas, in the order they were added."""
        return list(self._stored)

    def add_replica(self, key: Hashable) -> None:
        """Start tracking ``key`` with nothing cached (no-op if known)."""
        self._stored.setdefault(key, {})

    def remove_replica(self, key: Hashable) -> int:
        """Forget ``key``: its stored and routed entries go. Returns the stored hashes dropped
        (0 for an unknown replica)."""
        dropped = self.clear_replica(key)
        self._stored.pop(key, None)
        for hash_ in [h for h, replicas in self._routed.items() if key in replicas]:
            replicas = self._routed[hash_]
            del replicas[key]
            if not replicas:
                del self._routed[hash_]
        return dropped

    def clear_replica(self, key: Hashable) -> int:
        """Drop what ``key`` has stored (AllBlocksCleared, or events were lost); it stays known.
        Returns the number of hashes dropped."""
        stored = self._stored.get(key)
        if not stored:
            return 0
        holders = self._holders
        for hash_ in stored:
            replicas = holders[hash_]
            del replicas[key]
            if not replicas:
                del holders[hash_]
        dropped = len(stored)
        self._stored[key] = {}
        return dropped

    def num_cached_blocks(self, key: Hashable) -> int:
        """Distinct hashes ``key`` has stored (0 for an unknown replica)."""
        return len(self._stored.get(key, ()))

    # ---- events -----------------------------------------------------------------------------

    def apply(self, key: Hashable, events: Iterable[KVCacheEvent]) -> None:
        """Apply ``key``'s events in order (an unknown replica is added first). A removal of a
        hash the index never saw stored (stored before the index subscribed) is ignored.

        Raises:
            ConfigError: an object that is not a KV-cache event (events before it are applied).
        """
        stored = self._stored.setdefault(key, {})
        holders = self._holders
        for event in events:
            if isinstance(event, BlockStored):
                for hash_ in event.block_hashes:
                    count = stored.get(hash_, 0)
                    stored[hash_] = count + 1
                    if not count:
                        holders.setdefault(hash_, {})[key] = 1
            elif isinstance(event, BlockRemoved):
                for hash_ in event.block_hashes:
                    count = stored.get(hash_, 0)
                    if count > 1:
                        stored[hash_] = count - 1
                    elif count == 1:
                        del stored[hash_]
                        replicas = holders[hash_]
                        del replicas[key]
                        if not replicas:
                            del holders[hash_]
            elif isinstance(event, AllBlocksCleared):
                self.clear_replica(key)
                stored = self._stored[key]
            else:
                raise ConfigError(f"not a KV-cache event: {event!r}")

    def note_routed(
        self, key: Hashable, block_hashes: Iterable[Hashable], expires_at: float
    ) -> None:
        """Record that a request with ``block_hashes`` was just sent to ``key``: until
        ``expires_at`` (the caller's clock) they count as held by ``key``."""
        self._stored.setdefault(key, {})
        routed = self._routed
        for hash_ in block_hashes:
            replicas = routed.get(hash_)
            if replicas is None:
                routed[hash_] = {key: expires_at}
            elif replicas.get(key, -1.0) < expires_at:
                replicas[key] = expires_at

    def expire(self, now: float) -> int:
        """Drop routed entries that expired at or before ``now``; returns how many."""
        dropped = 0
        for hash_ in list(self._routed):
            replicas = self._routed[hash_]
            for key in [k for k, t in replicas.items() if t <= now]:
                del replicas[key]
                dropped += 1
            if not replicas:
                del self._routed[hash_]
        return dropped

    # ---- queries ----------------------------------------------------------------------------

    def match(
        self,
        block_hashes: Sequence[Hashable],
        keys: Iterable[Hashable] | None = None,
        now: float | None = None,
    ) -> dict[Hashable, int]:
        """Leading blocks of ``block_hashes`` that each replica holds.

        Args:
            block_hashes: the prompt's chained block hashes, in order.
            keys: the replicas to score (default: every known one); unknown ones score 0.
            now: the clock of :meth:`note_routed`; routed entries count while ``now`` is before
                their expiry. None: routed entries are not counted.

        Returns:
            {replica: number of leading blocks it holds}, one entry per replica asked about.
        """
        keys = list(self._stored if keys is None else keys)
        result = dict.fromkeys(keys, 0)
        alive = set(keys)
        holders, routed = self._holders, self._routed
        for depth, hash_ in enumerate(block_hashes):
            held = holders.get(hash_, {})
            pending = routed.get(hash_) if now is not None else None
            still = set()
            for key in alive:
                if key in held or (pending is not None and pending.get(key, now) > now):
                    still.add(key)
                else:
                    result[key] = depth
            alive = still
            if not alive:
                return result
        for key in alive:
            result[key] = len(block_hashes)
        return result


def rank_replicas(
    candidates: Sequence[K],
    matched_blocks: Mapping[K, int],
    queue_lens: Mapping[K, int],
    *,
    num_prompt_blocks: int,
    max_imbalance: int = 8,
    min_match_fraction: float = 0.1,
    last_routed: Mapping[K, int] | None = None,
) -> list[list[K]]:
    """Order replicas for a request: best first, as ranks of equally good ones.

    Rules, in order:

    1. Hot spots last: a replica whose queue is more than ``max_imbalance`` requests longer than
       the shortest queue goes to the last rank, whatever it caches.
    2. Longest cached prefix first: one rank per distinct number of matched blocks, descending.
       A match below ``min_match_fraction`` of the prompt's blocks counts as none (every chat
       prompt shares the template's first block; that alone must not attract traffic).
    3. Within a rank, shorter queue first; equal queues least recently routed to first
       (``last_routed``), so unrelated requests spread over idle replicas in turn.

    Args:
        candidates: the replicas that may take the request (at least one).
        matched_blocks: leading blocks of the prompt each replica holds (missing = 0).
        queue_lens: requests each replica has in flight (missing = 0).
        num_prompt_blocks: full blocks of the prompt (for ``min_match_fraction``).
        max_imbalance: queue-length excess that makes a replica a hot spot (>= 0).
        min_match_fraction: 0..1.
        last_routed: when each replica was last routed to (any increasing counter; missing
            = never, first); ties left are in ``candidates`` order.

    Returns:
        Non-empty ranks covering every candidate once; ``ranks[0][0]`` is the pick.

    Raises:
        ConfigError: no candidates, or an argument out of range.
    """
    n = len(candidates)
    if n == 0:
        raise ConfigError("rank_replicas needs at least one candidate replica")
    if not isinstance(max_imbalance, int) or max_imbalance < 0:
        raise ConfigError(f"max_imbalance must be an int >= 0, got {max_imbalance!r}")
    if not 0.0 <= min_match_fraction <= 1.0:
        raise ConfigError(f"min_match_fraction must be in [0, 1], got {min_match_fraction!r}")
    queue = {k: queue_lens.get(k, 0) for k in candidates}
    shortest = min(queue.values())
    threshold = min_match_fraction * num_prompt_blocks
    last = last_routed or {}
    order = {k: (last.get(k, -1), i) for i, k in enumerate(candidates)}
    cool: dict[int, list[K]] = {}
    hot: list[K] = []
    for key in candidates:
        if queue[key] - shortest > max_imbalance:
            hot.append(key)
            continue
        matched = matched_blocks.get(key, 0)
        if matched < threshold or matched <= 0:
            matched = 0
        cool.setdefault(matched, []).append(key)
    ranks = [
        sorted(cool[m], key=lambda k: (queue[k], order[k])) for m in sorted(cool, reverse=True)
    ]
    if hot:
        ranks.append(sorted(hot, key=lambda k: (queue[k], order[k])))
    return ranks
