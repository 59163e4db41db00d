"""KV-cache events on the wire, in vLLM's format: a ZMQ PUB socket sending msgpack event batches.

An engine that records events (``EngineConfig.enable_kv_cache_events``) hands each step's
:mod:`pagedkv.core.events` to :class:`KVEventPublisher`; a router subscribes with
:class:`KVEventSubscriber` and learns which block hashes the engine holds. The bytes are the ones
vLLM V1 publishes (``vllm/distributed/kv_events.py``: ``ZmqEventPublisher``, ``KVEventBatch``,
msgspec structs with ``array_like=True, tag=True``): the structs below have vLLM's fields, in
vLLM's order, with vLLM's struct options, and msgspec encodes them, so consumers of vLLM's events
(llm-d's KV-cache indexer, NVIDIA Dynamo's KV router, the ``kv_events_subscriber.py`` example)
read ours.

One ZMQ message is three frames::

    [topic (utf-8, default b""), seq (8 bytes, big-endian, 0, 1, 2, ... per publisher), payload]

The payload is one msgpack array (msgspec's array-like encoding of :class:`WireKVEventBatch`)::

    [ts, events, data_parallel_rank]          ts: float64 Unix seconds; rank: the engine's rank

and each event is an array whose first item is its tag (the class name in vLLM)::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
     lora_name, extra_keys, group_idx]
    ["BlockRemoved", block_hashes, medium, group_idx]
    ["AllBlocksCleared"]

``token_ids`` is the stored blocks' token ids, ``len(block_hashes) * block_size`` of them;
``parent_block_hash`` is nil at the start of a chain; ``lora_id`` nil without LoRA; ``medium`` is
``"GPU"``, vLLM's name for the engine's own KV pool (the one prefix hits come from), whatever the
device; ``lora_name`` and ``extra_keys`` are always nil (pagedkv names adapters by id);
``group_idx`` is the KV cache group, nil for group 0. msgspec writes every field of an array-like
struct, defaults included (``omit_defaults`` does not apply to arrays), as vLLM's encoder does.
Decoders of older vLLM versions (5 fields, no medium, no rank) read the same bytes: msgspec
ignores trailing fields; and this module reads their bytes too (a missing ``medium`` or
``lora_name`` is nil).

Block hashes on the wire (vLLM's ``ExternalBlockHash = bytes | int``): pagedkv's hash is the
digest of its chain (:mod:`pagedkv.core.hashing`: 32 bytes for sha256, 16 for xxh3_128).

- ``hash_format="bytes"`` (default, as vLLM by default): the digest itself, a msgpack bin.
- ``hash_format="int"`` (as vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the digest read
  as a big-endian unsigned int, low 64 bits kept (``int.from_bytes(digest, "big") & (2**64-1)``),
  for consumers that key on u64. Two chains can then collide (1 in 2**64 per pair): a router
  using them may misroute, never compute wrong KV (the engine checks its own full hash).

A consumer that recomputes the hashes of a prompt (to score replicas) needs the engines'
block_size, hash algorithm and hash seed (``EngineConfig.hash_seed``, the same on every replica)
and applies the same mapping (:func:`to_wire_block_hash`).

Delivery is ZMQ PUB/SUB: at most once, in order. A subscriber sees a gap in ``seq`` when it
missed batches (joined late, or its queue overflowed ``hwm``); :class:`KVEventSubscriber` reports
the gap and the consumer decides (the router forgets that replica's blocks and learns them anew).
vLLM's optional replay socket is not offered.

Speed, measured with ``PYTHONPATH=src python benchmarks/bench_kv_events.py --against 750adb8``
(encode + decode of one batch of 1,000 BlockStored events, one 16-token block each, sha256
hashes; best of 7 x 20 calls; 2 shared vCPUs, load 3-4; the median of three runs): these msgspec
structs 730 + 2,286 = 3,016 us per batch, the msgpack lists packed and checked by hand before
them (commit 750adb8) 1,558 + 4,542 = 6,099 us; over the three runs 2.9-3.1 ms against 5.0-6.3
ms. msgspec encodes and type-checks in C; most of what is left is building pagedkv's event
objects from the decoded structs (msgspec's decode alone: about 0.7 ms). The payload is 1.4%
larger (141,597 bytes against 139,597: the two nil fields per BlockStored that vLLM sends too).

Needs the ``cluster`` extra (``pip install 'pagedkv[cluster]'``): msgspec to import this module,
pyzmq for the publisher and the subscriber.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.errors import ConfigError, PagedKVError

#: vLLM's ``MEDIUM_GPU``: the engine's own KV pool.
MEDIUM_GPU = "GPU"
HASH_FORMATS = ("bytes", "int")
_U64_MASK = (1 << 64) - 1
EXTRA_INSTALL = "pip install 'pagedkv[cluster]'"

#: A block hash as it travels: the digest (bytes) or its low 64 bits (int).
WireBlockHash = bytes | int


class KVEventFormatError(PagedKVError, ValueError):
    """A payload or frame that is not a KV event batch in vLLM's format."""


# ---- the structs on the wire (vLLM's fields, order and options) --------------------------------
# msgspec resolves these annotations (strings, under ``from __future__ import annotations``) in
# this module's namespace the first time it encodes or decodes: every name in them is a global.


class WireKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events as they travel (vLLM's ``KVCacheEvent``): an array, tag first."""


class WireBlockStored(WireKVCacheEvent, tag="BlockStored"):
    """vLLM's ``BlockStored``. ``medium`` and ``lora_name`` default to nil only so that the
    first layout (5 fields) decodes; the encoder writes every field."""

    block_hashes: list[WireBlockHash]
    parent_block_hash: WireBlockHash | None
    token_ids: list[int]
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class WireBlockRemoved(WireKVCacheEvent, tag="BlockRemoved"):
    """vLLM's ``BlockRemoved`` (``medium`` nil when absent: the first layout)."""

    block_hashes: list[WireBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class WireAllBlocksCleared(WireKVCacheEvent, tag="AllBlocksCleared"):
    """vLLM's ``AllBlocksCleared``."""


class WireKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: one step's events."""

    ts: float
    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One decoded batch: what an engine published after one step.

    Attributes:
        ts: Unix time (seconds) when the batch was published.
        events: the events in order; their block hashes are as on the wire (bytes or int).
        data_parallel_rank: the publishing engine's rank (None if the publisher gave none).
    """

    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """A batch as a subscriber received it.

    Attributes:
        seq: the publisher's sequence number of the batch.
        batch: the decoded batch.
        num_missed: batches lost just before this one (``seq`` minus the expected one); for the
            first batch a subscriber sees, the batches published before it joined.
    """

    seq: int
    batch: KVEventBatch
    num_missed: int


def _import(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(f"KV-cache events on the wire need {name}: {EXTRA_INSTALL}") from None


def to_wire_block_hash(block_hash: bytes, hash_format: str = "bytes") -> WireBlockHash:
    """``block_hash`` as published: the digest (``"bytes"``) or its low 64 bits as an unsigned
    big-endian int (``"int"``, vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    if hash_format == "bytes":
        return bytes(block_hash)
    return int.from_bytes(block_hash, "big") & _U64_MASK


def _check_hash_format(hash_format: str) -> None:
    if hash_format not in HASH_FORMATS:
        raise ConfigError(f"hash_format must be one of {HASH_FORMATS}, got {hash_format!r}")


def _wire_hashes(hashes: Sequence[bytes], hash_format: str) -> list[WireBlockHash]:
    if hash_format == "bytes":  # pagedkv's block hashes are bytes: they travel as they are
        return list(hashes)
    return [int.from_bytes(h, "big") & _U64_MASK for h in hashes]


def event_to_wire(
    event: KVCacheEvent, hash_format: str = "bytes", medium: str | None = MEDIUM_GPU
) -> WireKVCacheEvent:
    """One event as the struct vLLM sends (see the module docstring). ``medium`` is the
    block pool's (``"GPU"``, or None for the first layout); an event of the KV tier keeps its
    own (``"CPU"`` / ``"DISK"``).

    Raises:
        ConfigError: an unknown hash_format or an object that is not a KV-cache event.
    """
    _check_hash_format(hash_format)
    if isinstance(event, BlockStored | BlockRemoved) and event.medium != MEDIUM_GPU:
        medium = event.medium
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return WireBlockStored(
            _wire_hashes(event.block_hashes, hash_format),
            None if parent is None else to_wire_block_hash(parent, hash_format),
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            medium,
            None,  # lora_name
            None,  # extra_keys
            event.kv_cache_group_id or None,
        )
    if isinstance(event, BlockRemoved):
        return WireBlockRemoved(
            _wire_hashes(event.block_hashes, hash_format), medium, event.kv_cache_group_id or None
        )
    if isinstance(event, AllBlocksCleared):
        return WireAllBlocksCleared()
    raise ConfigError(f"not a KV-cache event: {event!r}")


def encode_batch(
    events: Iterable[KVCacheEvent],
    *,
    ts: float | None = None,
    data_parallel_rank: int | None = 0,
    hash_format: str = "bytes",
    medium: str | None = MEDIUM_GPU,
) -> bytes:
    """The msgpack payload of one batch: ``[ts, [event...], data_parallel_rank]`` (a rank of
    None travels as nil, as from vLLM).

    Args:
        events: the batch's events, in order.
        ts: Unix seconds (default: now).
        data_parallel_rank: the engine's rank.
        hash_format: ``"bytes"`` or ``"int"`` (see the module docstring).
        medium: the ``medium`` field of BlockStored / BlockRemoved.

    Raises:
        ConfigError: an unknown hash_format, or a non-event.
    """
    _check_hash_format(hash_format)
    batch = WireKVEventBatch(
        time.time() if ts is None else float(ts),
        [event_to_wire(e, hash_format, medium) for e in events],
        data_parallel_rank,
    )
    return msgspec.msgpack.encode(batch)


def event_from_wire(wire: WireKVCacheEvent) -> KVCacheEvent:
    """A decoded wire struct as a :mod:`pagedkv.core.events` object whose block hashes stay as
    on the wire; fields pagedkv does not use (lora_name, extra_keys) are dropped; a nil
    ``medium`` reads as ``"GPU"``."""
    if type(wire) is WireBlockStored:
        return BlockStored(
            block_hashes=tuple(wire.block_hashes),  # type: ignore[arg-type]
            parent_block_hash=wire.parent_block_hash,  # type: ignore[arg-type]
            token_ids=tuple(wire.token_ids),
            block_size=wire.block_size,
            lora_id=wire.lora_id,
            kv_cache_group_id=wire.group_idx or 0,
            medium=wire.medium or MEDIUM_GPU,
        )
    if type(wire) is WireBlockRemoved:
        return BlockRemoved(
            block_hashes=tuple(wire.block_hashes),  # type: ignore[arg-type]
            kv_cache_group_id=wire.group_idx or 0,
            medium=wire.medium or MEDIUM_GPU,
        )
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload (``[ts, events]`` or ``[ts, events, data_parallel_rank]``; fields after
    the ones vLLM defines are ignored).

    Raises:
        KVEventFormatError: bytes that are not a KV event batch (not msgpack, an unknown tag, a
            missing field, a field of the wrong type, a block_size < 1); the message says where.
    """
    try:
        batch = msgspec.msgpack.decode(payload, type=WireKVEventBatch)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise KVEventFormatError(f"not a KV event batch: {e}") from None
    return KVEventBatch(
        batch.ts, tuple(event_from_wire(e) for e in batch.events), batch.data_parallel_rank
    )


def _bind_or_connect(socket: Any, endpoint: str, bind: bool) -> str:
    if bind:
        socket.bind(endpoint)
        return socket.getsockopt_string(_import("zmq").LAST_ENDPOINT)
    socket.connect(endpoint)
    return endpoint


class KVEventPublisher:
    """Publishes an engine's KV-cache events on a ZMQ PUB socket, one batch per call.

    Args:
        endpoint: ZMQ address. Binding (default) takes ``tcp://HOST:PORT``, ``tcp://HOST:*`` (a
            free port; :attr:`endpoint` tells which), ``ipc://PATH`` or ``inproc://NAME``;
            with ``bind=False`` it connects to a subscriber that binds.
        data_parallel_rank: the engine's rank, sent in every batch.
        topic: first frame of every message (subscribers filter on its prefix).
        hash_format: ``"bytes"`` or ``"int"`` (module docstring).
        medium: ``medium`` of BlockStored / BlockRemoved.
        hwm: most messages queued per subscriber before ZMQ drops (the subscriber sees a gap).
        bind: bind (default) or connect.
        context: a ``zmq.Context`` (default: the process's shared one).

    Not thread-safe (ZMQ sockets are not): publish and close from one thread, the engine's.

    Raises:
        ConfigError: pyzmq missing, a bad hash_format or rank, or an endpoint ZMQ refuses (the
            message names it).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        data_parallel_rank: int = 0,
        topic: str = "",
        hash_format: str = "bytes",
        medium: str | None = MEDIUM_GPU,
        hwm: int = 100_000,
        bind: bool = True,
        context: Any = None,
    ) -> None:
        zmq = self._zmq = _import("zmq")
        _check_hash_format(hash_format)
        if (
            not isinstance(data_parallel_rank, int)
            or isinstance(data_parallel_rank, bool)
            or data_parallel_rank < 0
        ):
            raise ConfigError(f"data_parallel_rank must be an int >= 0, got {data_parallel_rank!r}")
        self.data_parallel_rank = data_parallel_rank
        self.hash_format = hash_format
        self.medium = medium
        self.topic = topic.encode()
        self.next_seq = 0
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self.endpoint = _bind_or_connect(self._socket, endpoint, bind)
        except zmq.ZMQError as e:
            self._socket.close()
            raise ConfigError(f"cannot {'bind' if bind else 'connect'} {endpoint!r}: {e}") from None

    def publish(
        self, events: Sequence[KVCacheEvent], ts: float | None = None, *, allow_empty: bool = False
    ) -> int | None:
        """Send ``events`` as one batch; returns its sequence number, or None (nothing sent) when
        ``events`` is empty, unless ``allow_empty`` (an empty batch is a heartbeat that tells a
        subscriber it is connected). Never blocks: beyond ``hwm`` ZMQ drops the message."""
        if not events and not allow_empty:
            return None
        payload = encode_batch(
            events,
            ts=ts,
            data_parallel_rank=self.data_parallel_rank,
            hash_format=self.hash_format,
            medium=self.medium,
        )
        seq = self.next_seq
        self.next_seq += 1
        zmq = self._zmq
        # zmq.Again: every subscriber's queue is full; the batch is lost and seq moves on.
        with contextlib.suppress(zmq.Again):
            self._socket.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        return seq

    def close(self) -> None:
        """Close the socket (pending messages are dropped). Idempotent."""
        self._socket.close(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class KVEventSubscriber:
    """Receives one publisher's batches (a ZMQ SUB socket) and decodes them.

    Args:
        endpoint: the publisher's address (connect, default) or an address to bind when the
            publishers connect (``bind=True``).
        topic: subscribe to messages whose topic starts with this.
        bind: bind instead of connect.
        context: a ``zmq.Context`` (default: the process's shared one).

    Not thread-safe: poll and close from one thread.

    Raises:
        ConfigError: pyzmq missing, or an endpoint ZMQ refuses.
    """

    def __init__(
        self, endpoint: str, *, topic: str = "", bind: bool = False, context: Any = None
    ) -> None:
        zmq = _import("zmq")
        self._zmq = zmq
        self._socket = (context or zmq.Context.instance()).socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, 100_000)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        try:
            self.endpoint = _bind_or_connect(self._socket, endpoint, bind)
        except zmq.ZMQError as e:
            self._socket.close()
            raise ConfigError(f"cannot {'bind' if bind else 'connect'} {endpoint!r}: {e}") from None
        #: sequence number expected next (None before the first batch).
        self.next_seq: int | None = None
        self.num_missed = 0
        self.num_malformed = 0

    def poll(self, timeout_ms: int = 0, max_batches: int | None = None) -> list[ReceivedBatch]:
        """Batches received so far, in order, waiting up to ``timeout_ms`` for the first one
        (0: never wait). A malformed message is skipped (counted in ``num_malformed``), so the
        next batch reports it as missed."""
        zmq = self._zmq
        received: list[ReceivedBatch] = []
        wait = timeout_ms
        while max_batches is None or len(received) < max_batches:
            if wait and not self._socket.poll(wait):
                break
            wait = 0
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                if len(frames) != 3 or len(frames[1]) != 8:
                    raise KVEventFormatError(f"expected 3 frames, got {len(frames)}")
                seq = int.from_bytes(frames[1], "big")
                batch = decode_batch(frames[2])
            except KVEventFormatError:
                # Skipped; the next good batch shows the gap (its seq is one beyond).
                self.num_malformed += 1
                continue
            missed = seq if self.next_seq is None else max(0, seq - self.next_seq)
            self.num_missed += missed
            self.next_seq = seq + 1
            received.append(ReceivedBatch(seq, batch, missed))
        return received

    def close(self) -> None:
        """Close the socket. Idempotent."""
        self._socket.close(linger=0)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
