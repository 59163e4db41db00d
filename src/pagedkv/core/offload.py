"""A second KV tier below the block pool, keyed by block hash (KV offloading).

The block pool is physical memory; a cached full block that the free queue hands to someone
else is paged out here instead of being forgotten, and a later prefix hit pages it back in::

    pool evicts block 7 (group 0, hash h)   ->  tier: store "0-<h>" into tier slot 3
                                                worker: copy block 7 out (in the step), write
                                                slot 3 (off the step's path)
    get_computed_blocks(r): pool hit 4 blocks, tier holds blocks 4..5
                            -> hit of 6 blocks;  allocate_slots gives blocks 12, 9 for 4..5
                                                worker: load slot of block 4 -> 12, 5 -> 9
                                                (before the step's forward reads them)

This module is the tier's bookkeeping (torch-free): which block hashes it holds, in which tier
slot, in LRU order, within its own capacity (``num_blocks`` tier blocks, each one pool block's
bytes: ``KVCacheConfig.bytes_per_block``), and the plain-data instructions for the workers
(:class:`KVTierOps`), drained once per step like the copy-on-write copies. The data itself lives
with the worker (:mod:`pagedkv.worker.kv_offload`: host RAM or files).

A tier key names one block of one KV cache group: ``f"{group}-{block_hash.hex()}"``. The block
hash is the chained hash, so an entry is valid for exactly the prefixes that produced it (extra
keys and cache_salt included). Each key is stored once: storing a key the tier holds only
refreshes its LRU position.

Idea from vLLM's KV offloading (``vllm/v1/kv_offload``: an ``OffloadingManager`` with LRU over
block hashes) and vLLM V0's swap space.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedkv.core.hashing import BlockHash
from pagedkv.errors import CacheStateError, ConfigError
from pagedkv.validation import check_int

#: Tier media, as vLLM's KV events name them.
MEDIA = ("CPU", "DISK")


def tier_key(kv_cache_group_id: int, block_hash: BlockHash) -> str:
    """The tier key of one block: ``"<group>-<hash hex>"`` (also a file name)."""
    return f"{kv_cache_group_id}-{block_hash.hex()}"


class TierStore(NamedTuple):
    """Write pool block ``block_id`` (every layer of KV cache group ``group``) to tier slot
    ``slot`` under ``key``. The worker copies the block out before the step's KV writes."""

    group: int
    key: str
    slot: int
    block_id: int


class TierDrop(NamedTuple):
    """The tier forgot ``key`` (LRU eviction, a failed load, a reset): its slot is free."""

    key: str
    slot: int


class TierLoad(NamedTuple):
    """Read tier slot ``slot`` (``key``) into pool block ``block_id`` of KV cache group ``group``
    for request ``req_id`` (which waits, not scheduled, until its loads are reported done)."""

    req_id: str
    group: int
    key: str
    slot: int
    block_id: int


@dataclass(slots=True)
class KVTierOps:
    """One step's tier instructions for the workers (plain, picklable data).

    Attributes:
        writes: stores and drops in the order they happened (a slot freed by a drop may be
            written again by a later store of the same step). Apply the copy-outs of the stores
            before any load or KV write of the step.
        loads: blocks to read into the pool, for requests the scheduler holds back (waiting
            for their KV) until the workers report every load of the request done, in a later
            (or this) step's ``ModelRunnerOutput.finished_kv_loads``, or failed (a missing,
            truncated or corrupt entry) in ``failed_kv_loads``: then the request recomputes.
        wait_for_writes: the workers wait for the tier's writes and deletions: stores wait
            for room in a full disk write queue instead of being dropped, and every queued
            write and drop is done before the step returns (a shutdown's page-out, a prefix
            cache reset); a normal step's never wait.
    """

    writes: list[TierStore | TierDrop] = field(default_factory=list)
    loads: list[TierLoad] = field(default_factory=list)
    wait_for_writes: bool = False

    def __bool__(self) -> bool:
        return bool(self.writes or self.loads)


@dataclass(slots=True)
class TierStats:
    """Counters of the tier since start (blocks are tier blocks: one pool block each).

    Attributes:
        num_stored_blocks: blocks written to the tier.
        num_loaded_blocks: blocks read back into the pool (tier hits, counted at allocation).
        num_evicted_blocks: entries dropped by LRU to make room.
        num_failed_loads: loads the workers reported failed (the request recomputed).
        num_skipped_stores: stores dropped because every entry was in use this step.
    """

    num_stored_blocks: int = 0
    num_loaded_blocks: int = 0
    num_evicted_blocks: int = 0
    num_failed_loads: int = 0
    num_skipped_stores: int = 0


class OffloadingManager:
    """The tier's index: block keys -> tier slots, in LRU order, with its own capacity.

    Args:
        num_blocks: tier capacity in blocks (>= 1): ``kv_offloading_size //
            KVCacheConfig.bytes_per_block``.
        medium: ``"CPU"`` or ``"DISK"`` (for KV events).
        record_events: keep the keys stored and dropped for :meth:`take_event_keys` (KV
            events); off, nothing is kept.

    Raises:
        ConfigError: ``num_blocks`` < 1 or an unknown medium.
    """

    def __init__(self, num_blocks: int, medium: str = "CPU", record_events: bool = False) -> None:
        check_int("num_blocks", num_blocks, 1, why="the tier must hold a block")
        if medium not in MEDIA:
            raise ConfigError(f"medium must be one of {MEDIA}, got {medium!r}")
        self.num_blocks = num_blocks
        self.medium = medium
        self._entries: OrderedDict[str, int] = OrderedDict()  # key -> slot, LRU first
        self._free_slots = list(range(num_blocks - 1, -1, -1))  # pop() gives slot 0 first
        self._pinned: set[str] = set()  # keys in this step's instructions: never evicted
        #: keys of loads still in flight, by request (never evicted until the load ends)
        self._loading: dict[str, list[str]] = {}
        self._load_pins: dict[str, int] = {}  # key -> loads in flight reading it
        self._ops = KVTierOps()
        self.stats = TierStats()
        self.record_events = record_events
        #: keys stored / dropped since the last ``take_events`` (for KV events).
        self.stored_keys: list[str] = []
        self.dropped_keys: list[str] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def slot_of(self, key: str) -> int | None:
        """The slot holding ``key``, or ``None``."""
        return self._entries.get(key)

    def lru_keys(self) -> list[str]:
        """Held keys, least recently used first."""
        return list(self._entries)

    def store(self, group: int, key: str, block_id: int) -> bool:
        """Page block ``block_id`` out under ``key`` (the pool is evicting it).

        A held key is only refreshed (each key is stored once). With the tier full, the least
        recently used entry not in this step's instructions makes room; if every entry is, the
        store is skipped.

        Returns:
            True if a store was recorded.
        """
        entries = self._entries
        if key in entries:
            entries.move_to_end(key)
            return False
        if not self._free_slots and not self._evict_one():
            self.stats.num_skipped_stores += 1
            return False
        slot = self._free_slots.pop()
        entries[key] = slot
        self._pinned.add(key)
        self._ops.writes.append(TierStore(group, key, slot, block_id))
        self.stats.num_stored_blocks += 1
        if self.record_events:
            self.stored_keys.append(key)
        return True

    def _evict_one(self) -> bool:
        pinned, load_pins = self._pinned, self._load_pins
        for key in self._entries:
            if key not in pinned and key not in load_pins:
                self._drop(key)
                self.stats.num_evicted_blocks += 1
                return True
        return False

    def _drop(self, key: str) -> None:
        slot = self._entries.pop(key)
        self._free_slots.append(slot)
        self._ops.writes.append(TierDrop(key, slot))
        if self.record_events:
            self.dropped_keys.append(key)

    def load(self, req_id: str, group: int, key: str, block_id: int) -> None:
        """Record a load of held ``key`` into pool block ``block_id`` (a tier hit being
        allocated); the entry stays (it may hit again) and becomes most recently used. It is
        kept from LRU eviction until :meth:`finish_loads` of ``req_id`` (the workers may read
        it over several steps).

        Raises:
            CacheStateError: ``key`` is not held (check with ``in`` first).
        """
        slot = self._entries.get(key)
        if slot is None:
            raise CacheStateError(f"tier key {key} is not held; look the hit up again")
        self._entries.move_to_end(key)
        self._pinned.add(key)
        self._ops.loads.append(TierLoad(req_id, group, key, slot, block_id))
        self._loading.setdefault(req_id, []).append(key)
        self._load_pins[key] = self._load_pins.get(key, 0) + 1
        self.stats.num_loaded_blocks += 1

    def finish_loads(self, req_id: str) -> None:
        """The workers reported ``req_id``'s loads done (good or failed): its entries may be
        evicted again. Unknown ids are ignored."""
        load_pins = self._load_pins
        for key in self._loading.pop(req_id, ()):
            count = load_pins[key] - 1
            if count:
                load_pins[key] = count
            else:
                del load_pins[key]

    @property
    def num_loading_requests(self) -> int:
        """Requests whose loads are in flight."""
        return len(self._loading)

    def pin(self, keys: Iterable[str]) -> None:
        """Keep ``keys`` from LRU eviction until the next :meth:`take_ops` (hits about to be
        loaded while the same allocation evicts pool blocks into the tier)."""
        self._pinned.update(keys)

    def discard(self, keys: Iterable[str], failed_load: bool = True) -> None:
        """Forget entries the workers found bad (a failed load) or never wrote (a dropped
        store: ``failed_load=False``); unknown keys are ignored."""
        for key in keys:
            if key in self._entries:
                self._drop(key)
                if failed_load:
                    self.stats.num_failed_loads += 1

    def clear(self) -> None:
        """Forget every entry (a prefix-cache reset: new weights make the tier's KV stale)."""
        for key in list(self._entries):
            self._drop(key)

    def restore(self, keys: Iterable[str]) -> list[str]:
        """Adopt entries a persistent tier already holds (at start, least recently used
        first); beyond capacity the oldest are left out.

        Returns:
            The keys left out (the caller may delete them).

        Raises:
            CacheStateError: the tier already holds entries.
        """
        if self._entries:
            raise CacheStateError("restore is for an empty tier, at start")
        keys = list(dict.fromkeys(keys))
        left_out = keys[: max(0, len(keys) - self.num_blocks)]
        for key in keys[len(left_out) :]:
            self._entries[key] = self._free_slots.pop()
        return left_out

    def take_ops(self) -> KVTierOps | None:
        """The instructions recorded since the last call (drains them; unpins), or ``None``."""
        self._pinned.clear()
        if not self._ops:
            return None
        ops, self._ops = self._ops, KVTierOps()
        return ops

    def take_event_keys(self) -> tuple[list[str], list[str]]:
        """``(stored, dropped)`` keys since the last call."""
        stored, dropped = self.stored_keys, self.dropped_keys
        self.stored_keys, self.dropped_keys = [], []
        return stored, dropped

    def check_invariants(self) -> None:
        """Raise CacheStateError if the slots and entries disagree (O(num_blocks); tests)."""
        slots = list(self._entries.values())
        if len(set(slots)) != len(slots):
            raise CacheStateError("two tier entries share a slot")
        if set(slots) & set(self._free_slots) or len(set(self._free_slots)) != len(
            self._free_slots
        ):
            raise CacheStateError("a tier slot is both free and held, or free twice")
        if len(slots) + len(self._free_slots) != self.num_blocks:
            raise CacheStateError(
                f"held {len(slots)} + free {len(self._free_slots)} != {self.num_blocks}"
            )
        if any(not 0 <= s < self.num_blocks for s in slots):
            raise CacheStateError("a tier slot is out of range")


__all__ = [
    "MEDIA",
    "KVTierOps",
    "OffloadingManager",
    "TierDrop",
    "TierLoad",
    "TierStats",
    "TierStore",
    "tier_key",
]
