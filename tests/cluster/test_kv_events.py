"""KV-cache events on the wire: the bytes vLLM's structs encode to, byte for byte, decoders of
vLLM's structs (and ours of theirs), ZMQ framing and sequence numbers over loopback, and an
engine's events against the hashes a router predicts."""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq", reason="needs pip install 'pagedkv[cluster]'")
msgspec = pytest.importorskip("msgspec", reason="needs pip install 'pagedkv[cluster]'")

import _vllm_structs as v  # noqa: E402
from _cluster_helpers import BLOCK_SIZE, HASH_SEED, make_tiny_engine  # noqa: E402

from pagedkv.cluster.kv_events import (  # noqa: E402
    KVEventFormatError,
    KVEventPublisher,
    KVEventSubscriber,
    decode_batch,
    encode_batch,
    to_wire_block_hash,
)
from pagedkv.cluster.router import ClusterRouter  # noqa: E402
from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from pagedkv.errors import ConfigError  # noqa: E402
from pagedkv.sampling_params import SamplingParams  # noqa: E402

H1, H2, H3 = (bytes([i]) * 32 for i in (1, 2, 3))
STORED = BlockStored(
    block_hashes=(H2, H3), parent_block_hash=H1, token_ids=tuple(range(8)), block_size=4
)
EVENTS = (STORED, BlockRemoved((H1,)), AllBlocksCleared())


def pack(obj) -> bytes:
    """Any object as msgpack (to build malformed payloads)."""
    return msgspec.msgpack.encode(obj)


def test_batch_is_vllms_msgpack_array():
    payload = encode_batch(EVENTS, ts=12.5, data_parallel_rank=3)
    assert msgspec.msgpack.decode(payload) == [
        12.5,
        [
            # lora_id, medium, lora_name, extra_keys, group_idx (nil: group 0)
            ["BlockStored", [H2, H3], H1, list(range(8)), 4, None, "GPU", None, None, None],
            ["BlockRemoved", [H1], "GPU", None],
            ["AllBlocksCleared"],
        ],
        3,
    ]
    # Byte for byte what vLLM's encoder writes for the same batch.
    vllm_batch = v.KVEventBatch(
        12.5,
        [
            v.BlockStored([H2, H3], H1, list(range(8)), 4, None, "GPU", None),
            v.BlockRemoved([H1], "GPU"),
            v.AllBlocksCleared(),
        ],
        3,
    )
    assert payload == msgspec.msgpack.encode(vllm_batch)
    # Digests travel as msgpack bin (0xc4: bin 8 of 32 bytes), ts as float64 (0xcb).
    assert b"\xc4\x20" + H2 in payload
    assert payload[1] == 0xCB
    # A group other than 0 travels as group_idx; no rank as nil.
    grouped = BlockRemoved((H1,), kv_cache_group_id=2)
    raw = msgspec.msgpack.decode(encode_batch([grouped], ts=0.0, data_parallel_rank=None))
    assert raw == [0.0, [["BlockRemoved", [H1], "GPU", 2]], None]


def test_int_hashes_are_the_low_64_bits_big_endian():
    digest = bytes(range(32))
    assert to_wire_block_hash(digest, "int") == int.from_bytes(digest[-8:], "big")
    wire = msgspec.msgpack.decode(encode_batch([STORED], ts=0.0, hash_format="int"))
    assert wire[1][0][1] == [int.from_bytes(H2[-8:], "big"), int.from_bytes(H3[-8:], "big")]
    assert wire[1][0][2] == int.from_bytes(H1[-8:], "big")


def test_round_trip_keeps_every_field():
    stored = BlockStored(
        block_hashes=(H1,),
        parent_block_hash=None,
        token_ids=(5, 6, 7, 8),
        block_size=4,
        lora_id=7,
        kv_cache_group_id=2,
    )
    events = (stored, BlockRemoved((H2, H3), kv_cache_group_id=2), AllBlocksCleared())
    batch = decode_batch(encode_batch(events, ts=1.0, data_parallel_rank=0))
    assert batch.events == events
    assert (batch.ts, batch.data_parallel_rank) == (1.0, 0)
    assert (
        decode_batch(encode_batch([], ts=2.0, data_parallel_rank=None)).data_parallel_rank is None
    )


def test_vllm_shaped_msgspec_structs_decode_our_bytes():
    """The structs vLLM decodes with (array_like, tagged), in the current layout and in the
    first one (no medium, no rank): both read pagedkv's payloads, and pagedkv reads theirs."""
    payload = encode_batch(EVENTS, ts=3.0, data_parallel_rank=1)
    batch = msgspec.msgpack.decode(payload, type=v.KVEventBatch)
    assert batch.data_parallel_rank == 1
    stored, removed, cleared = batch.events
    assert (stored.block_hashes, stored.parent_block_hash) == ([H2, H3], H1)
    assert (stored.token_ids, stored.block_size, stored.medium) == (list(range(8)), 4, "GPU")
    assert (removed.block_hashes, removed.medium) == ([H1], "GPU")
    assert isinstance(cleared, v.AllBlocksCleared)
    old = msgspec.msgpack.decode(payload, type=v.FirstKVEventBatch)
    assert old.events[0].block_hashes == [H2, H3] and old.events[1].block_hashes == [H1]
    # And what pagedkv decodes, vLLM's encoder can have written.
    vllm_payload = msgspec.msgpack.encode(v.KVEventBatch(4.0, [v.BlockRemoved([7, 8], "GPU")], 2))
    assert decode_batch(vllm_payload).events == (BlockRemoved((7, 8)),)
    first = v.FirstKVEventBatch(
        5.0, [v.FirstBlockStored([H2], H1, [1, 2, 3, 4], 4, 9), v.FirstBlockRemoved([H2])]
    )
    decoded = decode_batch(msgspec.msgpack.encode(first))
    assert decoded.data_parallel_rank is None
    assert decoded.events == (
        BlockStored((H2,), H1, (1, 2, 3, 4), 4, lora_id=9),
        BlockRemoved((H2,)),
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # reserved msgpack byte
        b"\x92\xcb",  # cut short
        pack({"ts": 1.0}),
        pack([1.0]),
        pack(["x", []]),
        pack([1.0, [["BlockEvicted", [b"x"]]]]),
        pack([1.0, [["BlockStored", ["not-a-hash"], None, [1], 1, None]]]),
        pack([1.0, [["BlockStored", [True], None, [1], 1, None]]]),
        pack([1.0, [["BlockStored", [b"h"], None, [1], 0, None]]]),
        pack([1.0, [["BlockStored", [b"h"], None, [1.5], 1, None]]]),
        pack([1.0, [["BlockStored", [b"h"], None, [1], 1, None, "GPU", None, None, "g"]]]),
        pack([1.0, [["BlockRemoved"]]]),
        pack([1.0, [], "rank"]),
    ],
)
def test_malformed_payloads_are_refused(payload):
    """Each one is refused with KVEventFormatError, a PagedKVError (never msgspec's own error)."""
    with pytest.raises(KVEventFormatError):
        decode_batch(payload)


def test_bad_options_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="hash_format"):
        encode_batch([STORED], hash_format="hex")
    with pytest.raises(ConfigError, match="data_parallel_rank"):
        KVEventPublisher(f"ipc://{tmp_path}/x", data_parallel_rank=-1)
    with pytest.raises(ConfigError, match="cannot bind"):
        KVEventPublisher("tcp://no-such-host.invalid:*")


def test_missing_extra_names_the_install_command(monkeypatch):
    import importlib

    real = importlib.import_module

    def no_zmq(name, *args):
        if name == "zmq":
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_zmq)
    with pytest.raises(ConfigError, match=r"pip install 'pagedkv\[cluster\]'"):
        KVEventPublisher("inproc://nowhere")


def _wait_connected(publisher, subscriber, timeout=5.0):
    """Heartbeats until the subscriber gets one (ZMQ drops messages while SUB connects)."""
    deadline = time.monotonic() + timeout
    while True:
        publisher.publish((), allow_empty=True)
        received = subscriber.poll(20)
        if received:
            return received
        assert time.monotonic() < deadline, "subscriber never connected"


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_publisher_to_subscriber_in_order_with_sequence_numbers(tmp_path, transport):
    endpoint = f"ipc://{tmp_path}/events" if transport == "ipc" else "tcp://127.0.0.1:*"
    with KVEventPublisher(endpoint, data_parallel_rank=2, topic="kv") as publisher:
        if transport == "tcp":
            assert publisher.endpoint.startswith("tcp://127.0.0.1:")
            assert not publisher.endpoint.endswith(":*")
        with KVEventSubscriber(publisher.endpoint, topic="kv") as subscriber:
            first = _wait_connected(publisher, subscriber)
            # Heartbeats sent before the subscription took effect count as missed.
            assert first[0].num_missed == first[0].seq
            seqs = [publisher.publish([STORED]), publisher.publish([BlockRemoved((H2,))])]
            assert publisher.publish([]) is None  # nothing to send
            received = []
            deadline = time.monotonic() + 5
            while len(received) < 2 and time.monotonic() < deadline:
                received += subscriber.poll(20)
    assert [r.seq for r in received] == seqs == [first[-1].seq + 1, first[-1].seq + 2]
    assert [r.num_missed for r in received] == [0, 0]
    assert received[0].batch.events == (STORED,)
    assert received[1].batch.data_parallel_rank == 2


def test_subscriber_reports_gaps_and_skips_malformed_frames(tmp_path):
    endpoint = f"ipc://{tmp_path}/raw"
    context = zmq.Context.instance()
    pub = context.socket(zmq.PUB)
    pub.bind(endpoint)
    try:
        with KVEventSubscriber(endpoint) as subscriber:
            payload = encode_batch([], ts=0.0)
            deadline = time.monotonic() + 5
            while not subscriber.poll(20):  # seq 0, repeated until connected
                pub.send_multipart([b"", (0).to_bytes(8, "big"), payload])
                assert time.monotonic() < deadline
            pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1"])  # malformed
            pub.send_multipart([b"", (4).to_bytes(8, "big"), payload])
            received = []
            while not received and time.monotonic() < deadline:
                received = subscriber.poll(20)
    finally:
        pub.close(linger=0)
    assert [(r.seq, r.num_missed) for r in received] == [(4, 3)]
    assert subscriber.num_malformed == 1 and subscriber.num_missed >= 3


def test_engine_events_carry_the_hashes_a_router_predicts():
    """A real engine's BlockStored hashes are the prompt hashes the router computes with the
    same block_size, algorithm and seed; another seed gives other hashes."""
    engine = make_tiny_engine()
    prompt = [ord(c) for c in "The same system prompt, then a question?"]  # 40 tokens
    engine.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    stored = [e for e in engine.take_kv_cache_events() if isinstance(e, BlockStored)]
    published = [h for e in stored for h in e.block_hashes]
    router = ClusterRouter(block_size=BLOCK_SIZE, hash_seed=HASH_SEED, subscriber_factory=None)
    predicted = router.prompt_hashes(prompt)
    assert len(predicted) == len(prompt) // BLOCK_SIZE == 10
    assert published[: len(predicted)] == predicted
    assert stored[0].parent_block_hash is None and stored[0].token_ids[:4] == tuple(prompt[:4])
    other = ClusterRouter(block_size=BLOCK_SIZE, hash_seed="other", subscriber_factory=None)
    assert not set(other.prompt_hashes(prompt)) & set(published)
    assert router.prompt_hashes(prompt, cache_salt="tenant") != predicted
