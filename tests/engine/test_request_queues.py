"""RequestQueues: the one owner of the scheduler's requests (queues, loading set, finished ids)."""

from __future__ import annotations

from collections import Counter

import pytest

from pagedkv.core.manager import KVCacheManager
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.request_queues import RequestQueues
from pagedkv.engine.stats import SchedulerStats
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 16


class CountingKVCache:
    """A real KV cache manager that counts what the queues ask of it per request id."""

    def __init__(self) -> None:
        self.manager = KVCacheManager(NUM_BLOCKS, block_size=BLOCK_SIZE)
        self.frees: Counter[str] = Counter()
        self.swaps: Counter[str] = Counter()
        self.loads_finished: Counter[str] = Counter()

    def __getattr__(self, name):
        return getattr(self.manager, name)

    def free(self, request) -> None:
        self.frees[request.request_id] += 1
        self.manager.free(request)

    def swap_out(self, request) -> int:
        self.swaps[request.request_id] += 1
        return self.manager.swap_out(request)

    def finish_tier_loads(self, request_id: str) -> None:
        self.loads_finished[request_id] += 1
        self.manager.finish_tier_loads(request_id)


class Grammar:
    """A structured-output constraint that counts its frees."""

    def __init__(self) -> None:
        self.num_frees = 0

    def free(self) -> None:
        self.num_frees += 1


def make_queues(policy: str = "fcfs", swap: bool = False):
    kv_cache = CountingKVCache()
    stats = SchedulerStats()
    queues = RequestQueues(kv_cache, stats, policy, swap=swap)
    released: list[str] = []
    queues.set_release_hook(lambda request: released.append(request.request_id))
    return queues, kv_cache, stats, released


def make_request(request_id: str, num_tokens: int = 6, arrival_time: float = 0.0) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, num_tokens + 1)),
        sampling_params=SamplingParams(max_tokens=4),
        arrival_time=arrival_time,
    )


def running_request(
    queues: RequestQueues, kv_cache: CountingKVCache, request_id: str, arrival_time: float = 0.0
) -> Request:
    """A request added, admitted and holding blocks for its prompt."""
    request = make_request(request_id, arrival_time=arrival_time)
    queues.add(request)
    assert queues.pop_waiting() is request
    assert kv_cache.manager.allocate_slots(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    queues.run(request)
    return request


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def state(queues: RequestQueues, kv_cache: CountingKVCache):
    """Everything a call may change, as plain values."""
    return (
        ids(queues.running),
        ids(queues.waiting),
        sorted(queues.loading),
        sorted(queues.requests),
        sorted(queues.finished_ids),
        kv_cache.manager.num_free_blocks,
        {r.request_id: r.status for r in queues.requests.values()},
    )


def test_add_run_and_the_id_map() -> None:
    queues, _, _, _ = make_queues()
    a, b = make_request("a"), make_request("b")
    queues.add(a)
    queues.add(b)
    assert ids(queues.waiting) == ["a", "b"] and len(queues) == 2 and queues.num_waiting == 2
    assert a.status == RequestStatus.WAITING and queues.get("a") is a and queues.get("x") is None
    assert queues.peek_waiting() is a and queues.pop_waiting() is a
    queues.run(a)
    assert ids(queues.running) == ["a"] and a.status == RequestStatus.RUNNING
    child = make_request("a#1")
    queues.add_running(child, 0)
    assert ids(queues.running) == ["a#1", "a"] and child.status == RequestStatus.RUNNING
    front = make_request("a#2")
    queues.add(front, front=True)
    assert ids(queues.waiting) == ["a#2", "b"] and len(queues) == 4


def test_a_used_id_is_refused_and_nothing_changes() -> None:
    queues, kv_cache, _, _ = make_queues()
    running_request(queues, kv_cache, "a")
    queues.add(make_request("b"))
    before = state(queues, kv_cache)
    for call in (
        lambda: queues.add(make_request("a")),
        lambda: queues.add(make_request("b"), front=True),
        lambda: queues.add_running(make_request("b"), 0),
    ):
        with pytest.raises(InvalidRequestError, match="already in use"):
            call()
        assert state(queues, kv_cache) == before


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preempt_puts_it_at_the_front_with_its_blocks_freed(policy: str) -> None:
    queues, kv_cache, stats, released = make_queues(policy)
    a = running_request(queues, kv_cache, "a", arrival_time=1.0)
    b = running_request(queues, kv_cache, "b", arrival_time=2.0)
    queues.add(make_request("new", arrival_time=3.0))
    free_before = kv_cache.manager.num_free_blocks
    b.spec_token_ids = [7, 8]
    queues.preempt(b)
    assert ids(queues.running) == ["a"] and sorted(ids(queues.waiting)) == ["b", "new"]
    assert queues.peek_waiting() is b  # taken next, before the newer arrival
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.spec_token_ids == [] and b.num_preemptions == 1 and stats.num_preemptions == 1
    assert kv_cache.frees["b"] == 1 and kv_cache.manager.num_free_blocks > free_before
    assert not kv_cache.swaps and not released and "b" not in queues.finished_ids
    assert queues.get("b") is b and a.status == RequestStatus.RUNNING


def test_preempt_under_swap_pages_out_first() -> None:
    queues, kv_cache, _, _ = make_queues(swap=True)
    b = running_request(queues, kv_cache, "b")
    queues.preempt(b)
    assert kv_cache.swaps["b"] == 1 and kv_cache.frees["b"] == 1


def test_preempting_a_request_not_running_changes_nothing() -> None:
    queues, kv_cache, stats, _ = make_queues()
    running_request(queues, kv_cache, "a")
    waiting = make_request("w")
    queues.add(waiting)
    before = state(queues, kv_cache)
    with pytest.raises(InvalidRequestError, match="not running"):
        queues.preempt(waiting)
    assert state(queues, kv_cache) == before
    assert stats.num_preemptions == 0 and waiting.num_preemptions == 0


def test_requeue_moves_a_waiting_request_to_the_front() -> None:
    queues, _, _, _ = make_queues()
    for request_id in "abc":
        queues.add(make_request(request_id))
    queues.requeue(queues.get("c"))
    assert ids(queues.waiting) == ["c", "a", "b"]
    skipped = queues.pop_waiting()  # taken out (admission skipped it), then put back
    queues.requeue(skipped)
    assert ids(queues.waiting) == ["c", "a", "b"]


def test_remove_running_takes_a_batch_out_in_order() -> None:
    queues, kv_cache, _, _ = make_queues()
    requests = [running_request(queues, kv_cache, str(i)) for i in range(5)]
    queues.remove_running([requests[1], requests[3]])
    assert ids(queues.running) == ["0", "2", "4"]
    running = queues.running
    queues.remove_running([])
    assert queues.running is running  # one list for the queues' life (drafts hold it)


@pytest.mark.parametrize("where", ["running", "waiting", "preempted", "finished"])
def test_release_frees_blocks_grammar_drafts_exactly_once(where: str) -> None:
    queues, kv_cache, _, released = make_queues()
    other = running_request(queues, kv_cache, "other")
    (other_blocks,) = kv_cache.get_block_ids("other")
    request = running_request(queues, kv_cache, "r")
    grammar = request.structured_output = Grammar()
    if where == "waiting":
        queues.remove_running([request])  # (back to waiting with its blocks, for the test)
        request.status = RequestStatus.WAITING
        queues.requeue(request)
    elif where == "preempted":
        queues.preempt(request)
    elif where == "finished":  # the step's finished requests: out of the running list first
        request.status = RequestStatus.FINISHED_STOPPED
        queues.remove_running([request])
    frees_before = kv_cache.frees["r"]
    queues.release(request, RequestStatus.FINISHED_ABORTED, now=12.5)
    assert request.status == RequestStatus.FINISHED_ABORTED and request.finished_time == 12.5
    assert request not in queues.running and request not in list(queues.waiting)
    assert queues.get("r") is None and len(queues) == 1
    assert kv_cache.frees["r"] == frees_before + 1 and not any(kv_cache.get_block_ids("r"))
    assert kv_cache.manager.num_free_blocks == NUM_BLOCKS - 1 - len(other_blocks)
    assert grammar.num_frees == 1 and released == ["r"]
    assert queues.take_finished_ids() == {"r"} and queues.take_finished_ids() == set()
    assert ids(queues.running) == ["other"] and other.status == RequestStatus.RUNNING
    # A second release is refused and changes nothing.
    before = state(queues, kv_cache)
    with pytest.raises(InvalidRequestError, match="not queued"):
        queues.release(request, RequestStatus.FINISHED_ABORTED)
    assert state(queues, kv_cache) == before
    assert kv_cache.frees["r"] == frees_before + 1 and grammar.num_frees == 1
    assert released == ["r"]


def test_release_needs_a_finished_status_and_changes_nothing_without_one() -> None:
    queues, kv_cache, _, released = make_queues()
    request = running_request(queues, kv_cache, "r")
    before = state(queues, kv_cache)
    with pytest.raises(InvalidRequestError, match="finished status"):
        queues.release(request, RequestStatus.WAITING)
    assert state(queues, kv_cache) == before and not kv_cache.frees and not released
    stranger = make_request("stranger")
    with pytest.raises(InvalidRequestError, match="not queued"):
        queues.release(stranger, RequestStatus.FINISHED_ABORTED)
    assert state(queues, kv_cache) == before and stranger.status == RequestStatus.WAITING


def test_release_while_loading_frees_the_blocks_when_the_loads_end() -> None:
    queues, kv_cache, _, released = make_queues()
    request = make_request("r")
    request.structured_output = grammar = Grammar()
    queues.add(request)
    queues.pop_waiting()
    assert kv_cache.manager.allocate_slots(request, request.num_tokens) is not None
    queues.wait_for_loads(request)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert queues.loading == {"r": request} and queues.num_waiting == 1
    free_before = kv_cache.manager.num_free_blocks
    queues.release(request, RequestStatus.FINISHED_ABORTED, now=3.0)
    # Its grammar and drafts go now; its blocks stay while the workers write them.
    assert grammar.num_frees == 1 and released == ["r"] and request.finished_time == 3.0
    assert queues.get("r") is None and "r" in queues.loading
    assert not kv_cache.frees and kv_cache.manager.num_free_blocks == free_before
    assert queues.take_finished_ids() == set()
    assert queues.loads_ended("r") is None
    assert kv_cache.frees["r"] == 1 and kv_cache.loads_finished["r"] == 1
    assert kv_cache.manager.num_free_blocks > free_before and not queues.loading
    assert queues.take_finished_ids() == {"r"}
    assert queues.loads_ended("r") is None  # a second report changes nothing
    assert kv_cache.frees["r"] == 1 and kv_cache.loads_finished["r"] == 1
    assert grammar.num_frees == 1 and released == ["r"]


def test_loads_ended_hands_back_a_live_request_to_run() -> None:
    queues, kv_cache, _, _ = make_queues()
    request = make_request("r")
    queues.add(request)
    queues.pop_waiting()
    queues.wait_for_loads(request)
    assert queues.loads_ended("r") is request
    assert not queues.loading and kv_cache.loads_finished["r"] == 1 and not kv_cache.frees
    queues.run(request)
    assert ids(queues.running) == ["r"] and queues.num_waiting == 0


def test_note_finished_adds_ids_for_the_next_step() -> None:
    queues, _, _, _ = make_queues()
    queues.note_finished({"probe"})
    queues.note_finished(("x", "y"))
    assert queues.finished_ids == frozenset({"probe", "x", "y"})
    assert queues.take_finished_ids() == {"probe", "x", "y"} and not queues.finished_ids


@pytest.mark.parametrize("step_first", [False, True])
def test_the_scheduler_releases_through_the_queues_and_tells_the_drafts(
    step_first: bool, monkeypatch
) -> None:
    """An abort (waiting or running) frees the request's blocks and tells the drafts once."""
    from pagedkv.engine.scheduler import Scheduler
    from pagedkv.engine.spec_decode.drafts import SpecDecodeDrafts

    forgotten: list[str] = []
    finished = SpecDecodeDrafts.finished

    def record(self, request):
        forgotten.append(request.request_id)
        finished(self, request)

    monkeypatch.setattr(SpecDecodeDrafts, "finished", record)
    manager = KVCacheManager(NUM_BLOCKS, block_size=BLOCK_SIZE)
    scheduler = Scheduler(
        manager,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=32,
        num_speculative_tokens=2,
    )
    assert scheduler.spec_decode_enabled
    request = make_request("r")
    scheduler.add_request(request)
    if step_first:
        scheduler.schedule()
        assert [r for r, where in scheduler.request_states()] == [request]
        assert manager.num_free_blocks < NUM_BLOCKS - 1
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)  # twice: a no-op
    assert forgotten == ["r"] and request.status == RequestStatus.FINISHED_ABORTED
    assert manager.num_free_blocks == NUM_BLOCKS - 1 and not scheduler.has_unfinished_requests()
    assert scheduler.get_request("r") is None and scheduler.request_states() == []
    assert scheduler.schedule().finished_req_ids == {"r"}


def test_a_parents_unforked_samples_hold_their_ids() -> None:
    """Issue 48's review: a new request may not take the id of an n > 1 sample its parent has
    not forked yet (it used to be accepted and then clash inside schedule()); the id is free
    again once the sample is queued under it and finished, or its parent finishes first."""
    queues, _, _, _ = make_queues()
    parent, sample = make_request("a"), make_request("a#1")
    parent.fork_children = [sample]
    queues.add(parent)
    assert queues.id_in_use("a#1")
    before = state(queues, queues._kv_cache)
    with pytest.raises(InvalidRequestError, match="'a#1' is already in use"):
        queues.add(make_request("a#1"))
    assert state(queues, queues._kv_cache) == before
    parent.fork_children = []
    queues.add(sample, front=True)  # the sample itself takes its held id
    assert queues.get("a#1") is sample
    queues.release(sample, RequestStatus.FINISHED_ABORTED)
    assert not queues.id_in_use("a#1")

    other, pending = make_request("b"), make_request("b#1")
    other.fork_children = [pending]
    queues.add(other)
    queues.release(other, RequestStatus.FINISHED_ABORTED)  # never forked: its ids are free
    assert not queues.id_in_use("b#1")
    queues.add(make_request("b#1"))


def test_the_engine_refuses_a_request_id_of_an_unforked_sample() -> None:
    """Through the scheduler: the clash is a clear refusal of the new request at add time, and
    the n = 2 request still runs both samples."""
    from _engine_fakes import FakeModel, run_until_done

    from pagedkv.engine.scheduler import Scheduler

    scheduler = Scheduler(KVCacheManager(NUM_BLOCKS, block_size=BLOCK_SIZE), 4, 64, 64)
    params = SamplingParams(max_tokens=2, n=2)

    def sample(request_id: str) -> Request:
        return Request(
            request_id=request_id, prompt_token_ids=list(range(1, 9)), sampling_params=params
        )

    parent = sample("a#0")
    parent.fork_children = [sample("a#1")]
    parent.fork_at = 7
    scheduler.add_request(parent)
    with pytest.raises(InvalidRequestError, match="'a#1' is already in use"):
        scheduler.add_request(
            Request(request_id="a#1", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams())
        )
    outputs = run_until_done(scheduler, FakeModel(NUM_BLOCKS, BLOCK_SIZE))
    assert {i for out in outputs for i in out.num_scheduled_tokens} == {"a#0", "a#1"}
    assert not scheduler.has_unfinished_requests() and not scheduler.queues.id_in_use("a#1")


def test_a_sample_id_stays_taken_until_its_abort_is_reported():
    """Issue 48's review: after an abort the scheduler frees a sample's id at once, the output
    processor only when it reports the abort; a new request under that id (or whose samples
    take it) is refused until then, and the engine keeps stepping (it used to wedge on a
    KeyError forever)."""
    from _tiny_model import tiny_loaded_model

    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine(loaded_model=tiny_loaded_model(), dtype="float32", num_threads=1)
    prompt = [5, 6, 7, 8]
    engine.add_request("a", prompt, SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=0))
    engine.step()
    engine.abort_request("a")
    for request_id, n in (("a#1", 1), ("a", 1)):
        with pytest.raises(InvalidRequestError, match="already in use"):
            engine.add_request(request_id, prompt, SamplingParams(max_tokens=2, n=n))
    engine.add_request("b#0", prompt, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="'b#0' is already in use"):
        engine.add_request("b", prompt, SamplingParams(max_tokens=2, n=2))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].finish_reason
    assert finished == {"a": "abort", "b#0": "length"}
    engine.add_request("a#1", prompt, SamplingParams(max_tokens=2))  # reported: free again
    while engine.has_unfinished_requests():
        engine.step()
