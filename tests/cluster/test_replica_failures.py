"""What the front end's stream of a request gets when the request's replica fails or dies
mid-stream: one :class:`ReplicaError` / :class:`ReplicaDiedError`, whose message is fixed and
client-safe, whatever the replica raised (its text is logged, one line)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pagedkv.cluster.protocol import ReplicaDiedError, ReplicaError, describe_failure
from pagedkv.engine.engine_loop import EngineDeadError, EngineRequest
from pagedkv.engine.input_processor import InputProcessor, ProcessedPrompt
from pagedkv.entrypoints.cluster import frontend
from pagedkv.entrypoints.cluster.frontend import ClusterEngineLoop
from pagedkv.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0)
# What a Ray exception says of a dead replica (an actor id, a pid, a node address, a traceback).
DETAILS = (
    "ActorDiedError: The actor died unexpectedly before finishing this task.\n"
    "  actor_id: ffd1c2e3a4b5c6d7e8f90a1b01000000, pid=48213, ip=10.20.30.40\n"
    'Traceback (most recent call last):\n  File "replica.py", line 1'
)


class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 128 for c in text]


def _processor() -> InputProcessor:
    return InputProcessor(_Tokenizer(), vocab_size=128, max_model_len=256, max_logprobs=0)


def _prompt(text: str) -> ProcessedPrompt:
    return ProcessedPrompt(_Tokenizer().encode(text), text)


class _FailingDispatcher:
    """Accepts every request, then raises ``error`` in place of its first output."""

    is_alive = True

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def submit(self, request):
        yield None
        raise self.error

    async def broadcast(self, fn):
        return []


def _stream_error(error: Exception) -> BaseException:
    """The exception the request's stream raises when its replica raised ``error``."""

    async def main():
        loop = ClusterEngineLoop(_FailingDispatcher(error), _processor())
        loop.start(asyncio.get_running_loop())
        stream = await loop.add_requests([EngineRequest("r-0", _prompt("hello"), GREEDY)])
        with pytest.raises(Exception) as info:
            await asyncio.wait_for(stream.get(), 30)
        assert loop.num_streams == 0
        return info.value

    return asyncio.run(main())


@pytest.mark.parametrize(
    "error, expected",
    [
        (EngineDeadError("replica 1 stopped"), ReplicaDiedError),
        (RuntimeError(DETAILS), ReplicaError),
        (ConnectionResetError(DETAILS), ReplicaError),
    ],
)
def test_the_stream_gets_a_client_safe_replica_error(error, expected, caplog):
    with caplog.at_level(logging.WARNING, logger=frontend.__name__):
        raised = _stream_error(error)
    assert type(raised) is expected
    assert str(raised) == expected.client_message
    assert isinstance(raised, EngineDeadError) == (expected is ReplicaDiedError)
    # The server's log has the details, on one line naming the request.
    (record,) = [r for r in caplog.records if r.name == frontend.__name__]
    assert record.getMessage() == f"request r-0 failed on its replica: {describe_failure(error)}"


def test_a_replica_error_from_the_dispatcher_is_passed_as_it_is(caplog):
    error = ReplicaDiedError()
    with caplog.at_level(logging.WARNING, logger=frontend.__name__):
        assert _stream_error(error) is error
    assert not [r for r in caplog.records if r.name == frontend.__name__]  # logged by it


def test_describe_failure_is_one_bounded_line():
    assert describe_failure(RuntimeError(DETAILS)) == "RuntimeError: " + " ".join(DETAILS.split())
    assert describe_failure(KeyError()) == "KeyError"
    long = describe_failure(ValueError("x" * 5000))
    assert len(long) == 1000 and long.endswith("...")


def test_a_killed_replica_of_a_local_cluster_fails_its_stream_with_replica_died_error(tmp_path):
    pytest.importorskip("zmq", reason="needs pip install 'pagedkv[cluster]'")
    pytest.importorskip("msgspec", reason="needs pip install 'pagedkv[cluster]'")
    from _cluster_helpers import BLOCK_SIZE, HASH_SEED, make_tiny_engine

    from pagedkv.cluster.local import LocalCluster
    from pagedkv.cluster.replica import EngineReplica
    from pagedkv.cluster.router import ClusterRouter

    replicas = {
        f"r{i}": EngineReplica(
            make_tiny_engine, rank=i, kv_events_endpoint=f"ipc://{tmp_path}/r{i}"
        )
        for i in range(2)
    }
    cluster = LocalCluster(replicas, ClusterRouter(block_size=BLOCK_SIZE, hash_seed=HASH_SEED))

    async def main():
        processor = replicas["r0"].info.input_processor
        loop = ClusterEngineLoop(cluster, processor)

        def prompt(text: str) -> ProcessedPrompt:
            return processor.process_text(text)

        loop.start(asyncio.get_running_loop())
        long = SamplingParams(max_tokens=150, ignore_eos=True)
        stream = await loop.add_requests(
            [EngineRequest("slow", prompt("Tell me a long story."), long)]
        )
        cluster.kill(cluster.placements["slow"])
        with pytest.raises(ReplicaDiedError) as info:
            while True:
                output, _ = await asyncio.wait_for(stream.get(), 30)
                assert not output.finished
        assert str(info.value) == ReplicaDiedError.client_message
        # The other replica serves the next request.
        stream = await loop.add_requests([EngineRequest("next", prompt("hello"), GREEDY)])
        output, _ = await asyncio.wait_for(stream.get(), 30)
        while not output.finished:
            output, _ = await asyncio.wait_for(stream.get(), 30)
        assert len(output.outputs[0].token_ids) == 3
        loop.stop()

    try:
        asyncio.run(main())
    finally:
        cluster.shutdown()
