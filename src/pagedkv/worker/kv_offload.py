"""The KV tier's data, on the worker: host-RAM slots or files, and the step's stores and loads.

The scheduler's :class:`~pagedkv.core.offload.KVTierOps` say what to do; per step, before the
step's copy-on-write copies and forward::

    stores:  backend.read_block(group caches, block_id)   copy the block out (in the step)
             tier.write(key, slot, bytes)                  host RAM: a copy; disk: a queued
                                                           write, done by a writer thread
                                                           (queue full: dropped, reported in
                                                           ModelRunnerOutput.dropped_kv_stores)
    drops:   tier.drop(key, slot)                          disk: the file is deleted (queued)
    loads:   tier.submit_loads(req_id, ...)                host RAM: read at once; disk: a
                                                           loader thread reads (checked: size,
                                                           key and CRC-32), or a write still
                                                           queued; the step goes on
    then, every step with loads in flight:
             tier.poll_loads() -> ended requests           their bytes written into the pool
             backend.write_block(group caches, block_id)   (the step's thread), reported in
                                                           finished_kv_loads / failed_kv_loads

Disk layout (``--kv-offloading-dir``): ``pagedkv-tier.json`` (what the entries were made
with: model, dtype, layout, block size, hash algorithm and seed; :func:`open_disk_tier`) and
one file per entry, ``<key>.kv``: a header (magic, key, payload length, CRC-32 of the payload),
the key, then the payload (the block's pages, every layer of its KV cache group, in the
attention backend's layout). Files are written to a temporary name and renamed, so a crash
never leaves a half-written entry under its name; a truncated or corrupt file fails its check.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedkv.core.offload import KVTierOps, TierDrop, TierLoad, TierStore
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.ops.backends import AttentionBackend

logger = logging.getLogger(__name__)

METADATA_FILE = "pagedkv-tier.json"
ENTRY_SUFFIX = ".kv"
_HEADER = struct.Struct("<8sHQI")  # magic, key length, payload bytes, CRC-32 of the payload
_MAGIC = b"PKVTIER1"
#: default bound of the disk tier's write queue (bytes copied out, not yet on disk)
DEFAULT_MAX_QUEUED_BYTES = 256 * 2**20


@dataclass(slots=True)
class KVTierIOStats:
    """What the worker moved (since start).

    Attributes:
        bytes_stored: bytes copied out of the pool into the tier.
        bytes_loaded: bytes loaded from the tier into the pool.
        load_seconds: wall time of the loads (the reads, on the loader thread for disk, and
            the copies into the pool).
        num_failed_loads: loads that found a missing, truncated or corrupt entry.
        num_dropped_stores: stores dropped because the disk writer's queue was full (the
            step does not wait for the disk; the scheduler forgets those entries).
    """

    bytes_stored: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    num_failed_loads: int = 0
    num_dropped_stores: int = 0


class KVTier(ABC):
    """Where the tier's blocks live. ``block_nbytes``: the most bytes of one entry.

    Loads: :meth:`submit_loads` takes one request's loads; :meth:`poll_loads` gives back the
    requests whose reads have all ended. A tier with ``async_loads`` reads on a loader thread
    (the step goes on meanwhile); otherwise ``submit_loads`` reads at once.

    Attributes:
        before_read: test hook, called with the key before each read (on the loader thread
            for an ``async_loads`` tier), e.g. to hold a load back; None in normal runs.
    """

    medium: str
    #: read on a loader thread (True: disk) or in the step (False: host RAM, a memory copy).
    async_loads: bool = False

    def __init__(self, num_blocks: int, block_nbytes: int) -> None:
        self.num_blocks = num_blocks
        self.block_nbytes = block_nbytes
        self.stats = KVTierIOStats()
        self.before_read: Callable[[str], None] | None = None
        self._load_cv = threading.Condition()
        self._load_jobs: list[_LoadJob | None] = []  # submitted, not yet read (loader thread)
        self._loads_done: list[_LoadJob] = []  # read, not yet polled
        self._num_loads_in_flight = 0  # requests submitted and not yet polled
        self._loader: threading.Thread | None = None

    @property
    def num_loads_in_flight(self) -> int:
        """Requests whose loads were submitted and not yet given back by :meth:`poll_loads`."""
        return self._num_loads_in_flight

    def submit_loads(self, req_id: str, loads: Sequence[tuple[TierLoad, tuple[int, int]]]) -> None:
        """Start reading one request's loads (each with its uint8 ``[layers, page bytes]``
        shape)."""
        job = _LoadJob(req_id, list(loads))
        self._num_loads_in_flight += 1
        if not self.async_loads:
            self._read_job(job)
            self._loads_done.append(job)
            return
        if self._loader is None:
            self._loader = threading.Thread(
                target=self._load_loop, name="pagedkv-kv-tier-loader", daemon=True
            )
            self._loader.start()
        with self._load_cv:
            self._load_jobs.append(job)
            self._load_cv.notify_all()

    def poll_loads(self, wait_s: float = 0.0) -> list[_LoadJob]:
        """The requests whose reads have all ended since the last call (each with the bytes
        read, ``None`` for a failed read), in the order they ended. With none ended and loads
        in flight, waits up to ``wait_s`` seconds for one."""
        cv = self._load_cv
        with cv:
            if not self._loads_done and wait_s > 0 and self._num_loads_in_flight:
                cv.wait_for(lambda: bool(self._loads_done), timeout=wait_s)
            done, self._loads_done = self._loads_done, []
        self._num_loads_in_flight -= len(done)
        return done

    def _read_job(self, job: _LoadJob) -> None:
        start = time.perf_counter()
        hook = self.before_read
        for load, shape in job.loads:
            if hook is not None:
                hook(load.key)
            try:
                data = self.read(load.key, load.slot, shape)
            except Exception:  # any read fault: that load fails, the request recomputes
                logger.exception("KV tier: reading %s failed", load.key)
                data = None
            job.data.append(data)
        job.seconds = time.perf_counter() - start

    def _load_loop(self) -> None:
        cv = self._load_cv
        while True:
            with cv:
                cv.wait_for(lambda: bool(self._load_jobs))
                job = self._load_jobs.pop(0)
            if job is None:
                return
            self._read_job(job)
            with cv:
                self._loads_done.append(job)
                cv.notify_all()

    def _stop_loader(self) -> None:
        if self._loader is not None:
            with self._load_cv:
                self._load_jobs.append(None)
                self._load_cv.notify_all()
            self._loader.join()
            self._loader = None

    @abstractmethod
    def write(self, key: str, slot: int, data: torch.Tensor, wait: bool = False) -> bool:
        """Store ``data`` (a fresh uint8 tensor ``[layers, page bytes]``) under ``key``.

        Returns:
            False if the store was dropped (a full write queue, unless ``wait``: then it waits
            for room).
        """

    @abstractmethod
    def drop(self, key: str, slot: int) -> None:
        """Forget ``key``."""

    @abstractmethod
    def read(self, key: str, slot: int, shape: tuple[int, int]) -> torch.Tensor | None:
        """The entry's bytes as uint8 ``shape``, or ``None`` if missing, truncated or corrupt."""

    def flush(self) -> None:  # noqa: B027  (nothing queued in memory)
        """Wait until every queued write is done."""

    def close(self) -> None:
        """Finish queued writes and stop background work (reads in flight end first);
        idempotent."""
        self._stop_loader()


@dataclass(slots=True)
class _LoadJob:
    """One request's loads: what to read, then (read) the bytes of each, ``None`` = failed."""

    req_id: str
    loads: list[tuple[TierLoad, tuple[int, int]]]
    data: list[torch.Tensor | None] = field(default_factory=list)
    seconds: float = 0.0


class CpuKVTier(KVTier):
    """Host RAM: one uint8 tensor ``[num_blocks, block_nbytes]`` (pages touched on first write).
    With the pool on a GPU this is the natural tier; on a CPU it is a test double (the pool is
    already RAM)."""

    medium = "CPU"

    def __init__(self, num_blocks: int, block_nbytes: int) -> None:
        super().__init__(num_blocks, block_nbytes)
        self._slots = torch.empty((num_blocks, block_nbytes), dtype=torch.uint8)
        self._keys: list[str | None] = [None] * num_blocks

    def write(self, key: str, slot: int, data: torch.Tensor, wait: bool = False) -> bool:
        flat = data.reshape(-1)
        self._slots[slot, : flat.numel()].copy_(flat)
        self._keys[slot] = key
        return True

    def drop(self, key: str, slot: int) -> None:
        if self._keys[slot] == key:
            self._keys[slot] = None

    def read(self, key: str, slot: int, shape: tuple[int, int]) -> torch.Tensor | None:
        if not 0 <= slot < self.num_blocks or self._keys[slot] != key:
            return None
        return self._slots[slot, : shape[0] * shape[1]].view(shape)


class DiskKVTier(KVTier):
    """A directory of entry files, written by a writer thread (the step only queues the bytes it
    copied out). A load of an entry whose write is still queued reads the queued bytes.

    Args:
        max_queued_bytes: the most bytes queued for the writer (at least one entry's): a
            store that would go beyond is dropped and counted (``num_dropped_stores``), so
            a slow disk never makes the step wait nor the queue grow without bound.
            Default: :data:`DEFAULT_MAX_QUEUED_BYTES`.
    """

    medium = "DISK"
    async_loads = True

    def __init__(
        self,
        directory: str | os.PathLike,
        num_blocks: int,
        block_nbytes: int,
        max_queued_bytes: int | None = None,
    ) -> None:
        super().__init__(num_blocks, block_nbytes)
        limit = DEFAULT_MAX_QUEUED_BYTES if max_queued_bytes is None else max_queued_bytes
        self.max_queued_bytes = max(limit, block_nbytes)
        self._queued_bytes = 0  # bytes of the queued writes (under self._lock)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}  # key -> bytes whose write is queued
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._write_errors = 0
        self._thread = threading.Thread(target=self._writer, name="pagedkv-kv-tier", daemon=True)
        self._thread.start()
        self._closed = False

    def path_of(self, key: str) -> Path:
        """The file of ``key``."""
        return self.directory / (key + ENTRY_SUFFIX)

    def write(self, key: str, slot: int, data: torch.Tensor, wait: bool = False) -> bool:
        nbytes = data.numel()
        with self._lock:
            full = self._queued_bytes + nbytes > self.max_queued_bytes
        if full and wait:
            self.flush()
        elif full:
            self.stats.num_dropped_stores += 1
            return False
        with self._lock:
            self._pending[key] = data
            self._queued_bytes += nbytes
        self._queue.put(("write", key, data))
        return True

    def drop(self, key: str, slot: int) -> None:
        with self._lock:
            self._pending.pop(key, None)
        self._queue.put(("drop", key, None))

    def read(self, key: str, slot: int, shape: tuple[int, int]) -> torch.Tensor | None:
        with self._lock:
            data = self._pending.get(key)
        if data is not None:
            return data.view(shape) if tuple(data.shape) == shape else None
        try:
            raw = self.path_of(key).read_bytes()
        except OSError:
            return None
        return _decode(raw, key, shape)

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                op, key, data = item
                path = self.path_of(key)
                if op == "drop":
                    path.unlink(missing_ok=True)
                    continue
                try:
                    self._write_file(path, key, data)
                finally:
                    with self._lock:  # its bytes stay queued until written (or skipped)
                        self._queued_bytes -= data.numel()
                        if self._pending.get(key) is data:
                            del self._pending[key]
            finally:
                self._queue.task_done()

    def _write_file(self, path: Path, key: str, data: torch.Tensor) -> None:
        with self._lock:
            if self._pending.get(key) is not data:
                return  # dropped (or stored anew) since it was queued
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(_encode(key, data))
            os.replace(tmp, path)
        except OSError as e:  # a full disk: the entry is missing; its load fails
            self._write_errors += 1
            if self._write_errors == 1:
                logger.warning("KV tier: cannot write %s: %s", path, e)

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_loader()
        self._queue.put(None)
        self._thread.join()


def _encode(key: str, data: torch.Tensor) -> bytes:
    payload = data.contiguous().numpy().tobytes()
    encoded = key.encode()
    return _HEADER.pack(_MAGIC, len(encoded), len(payload), zlib.crc32(payload)) + encoded + payload


def _decode(raw: bytes, key: str, shape: tuple[int, int]) -> torch.Tensor | None:
    """The payload of an entry file, or ``None`` if it is not a whole, intact entry of ``key``
    with ``shape`` bytes."""
    if len(raw) < _HEADER.size:
        return None
    magic, key_len, nbytes, crc = _HEADER.unpack_from(raw)
    start = _HEADER.size + key_len
    if (
        magic != _MAGIC
        or raw[_HEADER.size : start] != key.encode()
        or nbytes != shape[0] * shape[1]
        or len(raw) != start + nbytes
    ):
        return None
    payload = memoryview(raw)[start:]
    if zlib.crc32(payload) != crc:
        return None
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(shape)


def check_tier_ops(
    tier: KVTier, ops: KVTierOps, group_kv_caches: Sequence[Sequence[torch.Tensor]]
) -> None:
    """Check one step's tier instructions against this worker (changes nothing).

    Raises:
        InvalidRequestError: an instruction naming a KV cache group, block or tier slot this
            worker lacks.
    """
    num_groups = len(group_kv_caches)
    num_blocks = group_kv_caches[0][0].shape[1]
    for op in (*ops.writes, *ops.loads):
        # A drop names only a tier slot; stores and loads also a pool block of a group.
        group, block_id = (0, 1) if isinstance(op, TierDrop) else (op.group, op.block_id)
        if not 0 <= group < num_groups or not 1 <= block_id < num_blocks:
            raise InvalidRequestError(f"KV tier instruction out of range: {op}")
        if not 0 <= op.slot < tier.num_blocks:
            raise InvalidRequestError(f"KV tier slot out of range: {op}")


def apply_tier_ops(
    tier: KVTier,
    ops: KVTierOps,
    backend: AttentionBackend,
    group_kv_caches: Sequence[Sequence[torch.Tensor]],
) -> list[str]:
    """Do one step's tier instructions (checked first with :func:`check_tier_ops`): copy the
    stored blocks out and hand them to the tier, drop, then start the loads (each request's
    together; :func:`collect_tier_loads` finishes them).

    Returns:
        Keys whose store the tier dropped (a full write queue; with ``ops.wait_for_writes``
        it waits instead, and every queued write and drop is done on return): the scheduler
        should forget them.
    """
    stats = tier.stats
    dropped: list[str] = []
    for op in ops.writes:
        if isinstance(op, TierStore):
            data = backend.read_block(group_kv_caches[op.group], op.block_id)
            if tier.write(op.key, op.slot, data, ops.wait_for_writes):
                stats.bytes_stored += data.numel()
            else:
                dropped.append(op.key)
        else:
            tier.drop(op.key, op.slot)
    if ops.loads:
        by_request: dict[str, list[tuple[TierLoad, tuple[int, int]]]] = {}
        for op in ops.loads:
            caches = group_kv_caches[op.group]
            shape = (len(caches), caches[0][:, 0].numel() * caches[0].element_size())
            by_request.setdefault(op.req_id, []).append((op, shape))
        for req_id, loads in by_request.items():
            tier.submit_loads(req_id, loads)
    if ops.wait_for_writes:
        tier.flush()
    return dropped


def collect_tier_loads(
    tier: KVTier,
    backend: AttentionBackend,
    group_kv_caches: Sequence[Sequence[torch.Tensor]],
    wait_s: float = 0.0,
) -> tuple[list[str], dict[str, list[str]]]:
    """Write the requests' loads whose reads have ended into their pool blocks (on the
    calling thread: the step's), waiting up to ``wait_s`` seconds for one when none has.

    Returns:
        ``(finished, failed)``: requests whose every load is in; request id -> keys whose
        read failed (missing, truncated or corrupt; those pool blocks are left as they were).
    """
    finished: list[str] = []
    failed: dict[str, list[str]] = {}
    stats = tier.stats
    for job in tier.poll_loads(wait_s):
        start = time.perf_counter()
        pairs = list(zip(job.loads, job.data, strict=True))
        bad = [load.key for (load, _), data in pairs if data is None]
        if bad:
            failed[job.req_id] = bad
            stats.num_failed_loads += len(bad)
        else:
            for (load, _), data in pairs:
                backend.write_block(group_kv_caches[load.group], load.block_id, data)
                stats.bytes_loaded += data.numel()
            finished.append(job.req_id)
        stats.load_seconds += job.seconds + time.perf_counter() - start
    return finished, failed


def tier_identity(
    *,
    model: str | None,
    dtype: str,
    kv_cache_dtype: str | None = None,
    attention_backend: str,
    block_size: int,
    hash_algo: str,
    kv_cache_groups: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """What a persistent tier's entries depend on besides their key (JSON-able): the model,
    the compute dtype and the KV cache's dtype, the backend (its layout), the block size, the
    hash algorithm, and each KV cache group's layers and page size. The hash seed is recorded
    next to it."""
    return {
        "format": 1,
        "model": model,
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype or dtype,
        "attention_backend": attention_backend,
        "block_size": block_size,
        "hash_algo": hash_algo,
        "kv_cache_groups": [dict(g) for g in kv_cache_groups],
    }


def open_disk_tier(
    directory: str | os.PathLike, identity: Mapping[str, Any], hash_seed: Any
) -> tuple[str | int, list[str]]:
    """Open a disk tier's directory at start: adopt its entries if it was made with the same
    ``identity`` (and the same hash seed, when one is given), else start it empty (its entry
    files deleted, one log line). Records the identity and the seed.

    Args:
        identity: :func:`tier_identity`.
        hash_seed: the engine's hash seed; ``None``: reuse the recorded one (so block hashes
            agree with the previous process), or make one.

    Returns:
        ``(hash seed to use, entry keys least recently used first)``.

    Raises:
        ConfigError: the directory cannot be created or written.
    """
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"kv_offloading_dir {str(path)!r}: {e}") from None
    meta_path = path / METADATA_FILE
    recorded = None
    try:
        recorded = json.loads(meta_path.read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        logger.warning("KV tier %s: unreadable %s (%s); starting empty", path, METADATA_FILE, e)
    entries = sorted(path.glob("*" + ENTRY_SUFFIX), key=lambda p: p.stat().st_mtime)
    same = (
        isinstance(recorded, dict)
        and recorded.get("identity") == json.loads(json.dumps(dict(identity)))
        and (hash_seed is None or recorded.get("hash_seed") == _seed_json(hash_seed))
    )
    if same:
        seed = recorded["hash_seed"] if hash_seed is None else hash_seed
        if isinstance(seed, dict):  # bytes were recorded as hex
            seed = bytes.fromhex(seed["bytes"])
        keys = [p.name[: -len(ENTRY_SUFFIX)] for p in entries]
    else:
        if recorded is not None or entries:
            logger.warning(
                "KV tier %s was made for another model, layout or hash seed; starting empty "
                "(%d entries deleted)",
                path,
                len(entries),
            )
        for p in entries:
            p.unlink(missing_ok=True)
        seed = hash_seed if hash_seed is not None else secrets.token_hex(16)
        keys = []
    try:
        meta_path.write_text(
            json.dumps({"identity": dict(identity), "hash_seed": _seed_json(seed)}, indent=1)
        )
    except OSError as e:
        raise ConfigError(f"kv_offloading_dir {str(path)!r}: {e}") from None
    for tmp in path.glob("*.tmp"):
        tmp.unlink(missing_ok=True)
    return seed, keys


def _seed_json(seed: Any) -> Any:
    return {"bytes": seed.hex()} if isinstance(seed, bytes) else seed


__all__ = [
    "DEFAULT_MAX_QUEUED_BYTES",
    "CpuKVTier",
    "DiskKVTier",
    "KVTier",
    "KVTierIOStats",
    "apply_tier_ops",
    "check_tier_ops",
    "collect_tier_loads",
    "open_disk_tier",
    "tier_identity",
]
