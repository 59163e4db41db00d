"""Scheduler unit tests with the real KVCacheManager and a fake token-level model."""

from __future__ import annotations

import pytest
from _engine_fakes import FakeModel, reference_output, run_until_done

from pagedkv.core.manager import KVCacheManager
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.scheduler import Scheduler
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.sampling_params import SamplingParams

BLOCK_SIZE = 4


def counts(out) -> list[int]:
    """Tokens scheduled per request, in scheduling order."""
    return list(out.num_scheduled_tokens.values())


def ids(out) -> list[str]:
    """The scheduled requests' ids, in scheduling order."""
    return list(out.num_scheduled_tokens)


def make_scheduler(
    num_blocks: int = 64,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    enable_caching: bool = True,
    enable_chunked_prefill: bool = True,
    policy: str = "fcfs",
    admission: str = "fcfs",
) -> tuple[Scheduler, FakeModel]:
    manager = KVCacheManager(num_blocks, block_size=BLOCK_SIZE, enable_caching=enable_caching)
    scheduler = Scheduler(
        manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=policy,
        admission=admission,
    )
    return scheduler, FakeModel(num_blocks, BLOCK_SIZE)


def make_request(
    scheduler: Scheduler,
    request_id: str,
    prompt: list[int],
    max_tokens: int = 8,
    *,
    priority: int = 0,
    eos: int | None = None,
    arrival_time: float | None = None,
) -> Request:
    extra = {} if arrival_time is None else {"arrival_time": arrival_time}
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        block_hasher=scheduler.kv_cache_manager.block_hasher,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        eos_token_ids=frozenset(() if eos is None else (eos,)),
        priority=priority,
        **extra,
    )
    scheduler.add_request(request)
    return request


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return [(seed * 101 + i * 7) % 500 + 1 for i in range(length)]


def test_single_request_matches_reference_and_frees_blocks():
    scheduler, model = make_scheduler()
    free_before = scheduler.kv_cache_manager.num_free_blocks
    request = make_request(scheduler, "a", prompt_of(10), max_tokens=6)
    steps = run_until_done(scheduler, model)
    assert request.output_token_ids == reference_output(prompt_of(10), 6)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.finish_reason == "length"
    assert len(steps) == 6  # one prefill step that samples, then 5 decode steps
    assert counts(steps[0]) == [10]
    assert scheduler.kv_cache_manager.num_free_blocks == free_before
    assert not scheduler.has_unfinished_requests()


def test_eos_and_stop_token_ids_finish_with_stop():
    scheduler, model = make_scheduler()
    expected = reference_output(prompt_of(9), 20)
    eos = expected[3]
    request = make_request(scheduler, "a", prompt_of(9), max_tokens=20, eos=eos)
    run_until_done(scheduler, model)
    assert request.output_token_ids == expected[: expected.index(eos) + 1]
    assert request.finish_reason == "stop" and request.stop_reason is None

    scheduler, model = make_scheduler()
    request = Request(
        request_id="b",
        prompt_token_ids=prompt_of(9),
        sampling_params=SamplingParams(max_tokens=20, stop_token_ids=[expected[2]]),
    )
    scheduler.add_request(request)
    run_until_done(scheduler, model)
    assert request.output_token_ids == expected[: expected.index(expected[2]) + 1]
    assert request.stop_reason == expected[2]


def test_chunked_prefill_respects_budget_and_mixes_decode():
    scheduler, model = make_scheduler(max_num_batched_tokens=16)
    short = make_request(scheduler, "short", prompt_of(5), max_tokens=10)
    long = make_request(scheduler, "long", prompt_of(40, seed=1), max_tokens=4)
    steps = run_until_done(scheduler, model)
    assert all(step.total_num_scheduled_tokens <= 16 for step in steps)
    # step 0: short's prompt (5) + a first chunk of long (11); step 1: short decodes (1) + 15.
    assert counts(steps[0]) == [5, 11]
    assert counts(steps[1]) == [1, 15]
    assert counts(steps[2]) == [1, 14]
    # step 0 sends both whole; step 1 only short's first sampled token (long sampled none)
    assert [new.req_id for new in steps[0].scheduled_new_reqs] == ["short", "long"]
    assert steps[1].scheduled_cached_reqs.new_token_ids == [short.output_token_ids[:1], []]
    assert steps[2].scheduled_cached_reqs.num_computed_tokens == [6, 26]
    assert short.output_token_ids == reference_output(prompt_of(5), 10)
    assert long.output_token_ids == reference_output(prompt_of(40, seed=1), 4)


def test_chunked_prefill_off_waits_for_whole_prompt_budget():
    with pytest.raises(ConfigError, match="chunked prefill"):
        make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    scheduler, model = make_scheduler(
        max_num_batched_tokens=48, max_model_len=48, enable_chunked_prefill=False
    )
    a = make_request(scheduler, "a", prompt_of(30), max_tokens=4)
    b = make_request(scheduler, "b", prompt_of(30, seed=2), max_tokens=4)
    steps = run_until_done(scheduler, model)
    assert counts(steps[0]) == [30]  # b does not fit in the remaining 18
    assert counts(steps[1]) == [1, 30]
    assert a.output_token_ids == reference_output(prompt_of(30), 4)
    assert b.output_token_ids == reference_output(prompt_of(30, seed=2), 4)


def test_max_num_seqs_caps_running_requests():
    scheduler, model = make_scheduler(max_num_seqs=2)
    requests = [make_request(scheduler, str(i), prompt_of(6, seed=i), 5) for i in range(5)]
    steps = run_until_done(scheduler, model)
    assert max(step.num_reqs for step in steps) == 2
    for i, request in enumerate(requests):
        assert request.output_token_ids == reference_output(prompt_of(6, seed=i), 5)


def test_requests_that_do_not_fit_together_both_finish_as_alone():
    # 9 usable blocks of 4 tokens; each request needs 6 blocks (12 prompt + 12 output tokens).
    scheduler, model = make_scheduler(num_blocks=10, max_model_len=32, enable_caching=False)
    a = make_request(scheduler, "a", prompt_of(12), max_tokens=12)
    b = make_request(scheduler, "b", prompt_of(12, seed=3), max_tokens=12)
    run_until_done(scheduler, model)
    assert scheduler.get_stats().num_preemptions >= 1
    assert b.num_preemptions >= 1 and a.num_preemptions == 0  # the newest is the victim
    assert a.output_token_ids == reference_output(prompt_of(12), 12)
    assert b.output_token_ids == reference_output(prompt_of(12, seed=3), 12)
    assert scheduler.kv_cache_manager.num_free_blocks == 9


@pytest.mark.parametrize(
    ("admission", "first_step"), [("fcfs", ["hog"]), ("skip", ["hog", "small"])]
)
def test_admission_fcfs_stops_at_the_first_misfit_and_skip_tries_the_next(admission, first_step):
    # 9 usable blocks: "hog" takes 6, "big" needs 4 of the 3 left, "small" needs 1.
    scheduler, model = make_scheduler(
        num_blocks=10, max_model_len=32, enable_caching=False, admission=admission
    )
    prompts = {"hog": prompt_of(24), "big": prompt_of(16, 1), "small": prompt_of(4, 2)}
    requests = {name: make_request(scheduler, name, p, 4) for name, p in prompts.items()}
    out = scheduler.schedule()
    assert ids(out) == first_step
    assert scheduler.queues.peek_waiting() is requests["big"]  # a skipped request keeps its place
    scheduler.update_from_output(out, model.execute(out))
    run_until_done(scheduler, model)
    for name, request in requests.items():
        assert request.output_token_ids == reference_output(prompts[name], 4)
    assert scheduler.kv_cache_manager.num_free_blocks == 9


def test_unknown_admission_is_a_config_error():
    with pytest.raises(ConfigError, match="admission"):
        make_scheduler(admission="lifo")


@pytest.mark.parametrize("enable_caching", [True, False])
def test_preemption_storm_gives_reference_outputs(enable_caching):
    scheduler, model = make_scheduler(
        num_blocks=14, max_model_len=40, max_num_batched_tokens=10, enable_caching=enable_caching
    )
    requests = [
        make_request(scheduler, str(i), prompt_of(5 + 3 * i, seed=i % 3), 10 + i) for i in range(6)
    ]
    run_until_done(scheduler, model)
    assert scheduler.get_stats().num_preemptions > 0
    for i, request in enumerate(requests):
        assert request.output_token_ids == reference_output(prompt_of(5 + 3 * i, i % 3), 10 + i)
    assert scheduler.kv_cache_manager.num_free_blocks == 13


def test_never_fitting_requests_are_rejected_at_add_time_and_change_nothing():
    scheduler, _ = make_scheduler(num_blocks=6, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        make_request(scheduler, "long", prompt_of(60), max_tokens=8)
    with pytest.raises(InvalidRequestError, match="whole pool has 5"):
        make_request(scheduler, "big", prompt_of(20), max_tokens=8)  # 7 blocks > 5
    assert not scheduler.has_unfinished_requests()
    make_request(scheduler, "ok", prompt_of(10), max_tokens=8)
    with pytest.raises(InvalidRequestError, match="already in use"):
        make_request(scheduler, "ok", prompt_of(10), max_tokens=8)
    assert scheduler.get_num_unfinished_requests() == 1


class _RefusingManager(KVCacheManager):
    """A manager that never finds room for requests whose id starts with 'x'."""

    def allocate_slots(self, request, *args, **kwargs):
        if request.request_id.startswith("x"):
            return None
        return KVCacheManager.allocate_slots(self, request, *args, **kwargs)


def test_request_failing_with_the_whole_pool_free_is_rejected_without_blocking():
    manager = _RefusingManager(32, block_size=BLOCK_SIZE)
    scheduler = Scheduler(manager, 4, 64, 64)
    model = FakeModel(32, BLOCK_SIZE)
    bad = make_request(scheduler, "x", prompt_of(8), 4)
    good = make_request(scheduler, "good", prompt_of(8), 4)
    out = scheduler.schedule()
    assert bad.status == RequestStatus.FINISHED_ERROR and "whole pool" in bad.error
    assert ids(out) == ["good"]
    changed = scheduler.update_from_output(out, model.execute(out))
    assert changed == [bad, good]
    run_until_done(scheduler, model)
    assert good.output_token_ids == reference_output(prompt_of(8), 4)


def test_abort_waiting_and_running_frees_blocks_and_twice_is_noop():
    scheduler, model = make_scheduler(num_blocks=32, max_num_seqs=1)
    running = make_request(scheduler, "run", prompt_of(10), 8)
    waiting = make_request(scheduler, "wait", prompt_of(10, seed=1), 8)
    out = scheduler.schedule()
    scheduler.update_from_output(out, model.execute(out))
    assert running.status == RequestStatus.RUNNING and waiting.status == RequestStatus.WAITING
    for _ in range(2):
        scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
        assert running.finish_reason == "abort" and waiting.finish_reason == "abort"
        assert scheduler.kv_cache_manager.num_free_blocks == 31
        assert not scheduler.has_unfinished_requests()
        assert scheduler.schedule().num_reqs == 0
    with pytest.raises(InvalidRequestError):
        scheduler.finish_requests("run", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_drops_the_token():
    scheduler, model = make_scheduler()
    request = make_request(scheduler, "a", prompt_of(6), 4)
    out = scheduler.schedule()
    sampled = model.execute(out)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(out, sampled) == []
    assert request.num_output_tokens == 0


def test_priority_policy_admits_and_preempts_by_priority():
    scheduler, model = make_scheduler(
        num_blocks=10, max_num_seqs=1, max_model_len=32, policy="priority"
    )
    low = make_request(scheduler, "low", prompt_of(6), 4, priority=5, arrival_time=1.0)
    make_request(scheduler, "high", prompt_of(6, 1), 4, priority=0, arrival_time=2.0)
    out = scheduler.schedule()
    assert ids(out) == ["high"]
    scheduler.update_from_output(out, model.execute(out))
    steps = [out, *run_until_done(scheduler, model)]
    order = [r for step in steps for r in step.num_scheduled_tokens]  # (not clock readings)
    assert order == ["high"] * 4 + ["low"] * 4
    assert low.output_token_ids == reference_output(prompt_of(6), 4)

    scheduler, model = make_scheduler(
        num_blocks=10, max_model_len=32, enable_caching=False, policy="priority"
    )
    # "old" is admitted first but has the lowest priority, so it is the victim, not "new".
    old = make_request(scheduler, "old", prompt_of(12), 12, priority=9, arrival_time=1.0)
    out = scheduler.schedule()
    scheduler.update_from_output(out, model.execute(out))
    new = make_request(scheduler, "new", prompt_of(12, 4), 12, priority=1, arrival_time=2.0)
    run_until_done(scheduler, model)
    assert old.num_preemptions >= 1 and new.num_preemptions == 0
    assert old.output_token_ids == reference_output(prompt_of(12), 12)
    assert new.output_token_ids == reference_output(prompt_of(12, 4), 12)


def test_priority_self_preemption_still_serves_the_running_requests_after_it():
    # Issue 17: under policy="priority" the running list is in admission order, not priority
    # order. "low" (admitted first) needs a new block when the pool is empty, so it preempts
    # itself; "high" after it still has a free slot in its block and must run in that step.
    scheduler, model = make_scheduler(
        num_blocks=4, max_model_len=32, enable_caching=False, policy="priority"
    )
    low = make_request(scheduler, "low", prompt_of(7), 5, priority=1, arrival_time=1.0)
    out = scheduler.schedule()  # low's prompt: 7 tokens in 2 blocks
    scheduler.update_from_output(out, model.execute(out))
    high = make_request(scheduler, "high", prompt_of(2, 1), 4, priority=0, arrival_time=2.0)
    out = scheduler.schedule()  # low's token 7; high's prompt in the last free block
    assert ids(out) == ["low", "high"]
    scheduler.update_from_output(out, model.execute(out))
    assert scheduler.kv_cache_manager.num_free_blocks == 0

    out = scheduler.schedule()  # low's token 8 needs a third block: none is free
    assert out.preempted_req_ids == {"low"}
    assert ids(out) == ["high"] and counts(out) == [1]
    scheduler.update_from_output(out, model.execute(out))
    run_until_done(scheduler, model)
    assert low.output_token_ids == reference_output(prompt_of(7), 5)
    assert high.output_token_ids == reference_output(prompt_of(2, 1), 4)


@pytest.mark.parametrize("length", [8, 11, 12])
def test_prompt_submitted_twice_hits_the_cache_and_gives_the_same_output(length):
    scheduler, model = make_scheduler()
    first = make_request(scheduler, "first", prompt_of(length), 6)
    run_until_done(scheduler, model)
    second = make_request(scheduler, "second", prompt_of(length), 6)
    steps = run_until_done(scheduler, model)
    assert first.num_cached_tokens == 0
    # The hit is capped at num_tokens - 1, then rounded down to whole blocks.
    assert second.num_cached_tokens == (length - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert counts(steps[0]) == [length - second.num_cached_tokens]
    assert first.output_token_ids == second.output_token_ids
    assert first.output_token_ids == reference_output(prompt_of(length), 6)
    stats = scheduler.get_stats()
    assert stats.prefix_cache_queries == 2 * length
    assert stats.prefix_cache_hits == second.num_cached_tokens


@pytest.mark.parametrize("enable_caching", [True, False])
def test_prefix_counters_count_each_request_once_at_first_admission(enable_caching):
    # 9 usable blocks: "first" takes 6 for its prompt, "second" needs 4 and waits (its lookup
    # is retried every step) until "first" finishes; neither retries nor resumptions count.
    scheduler, model = make_scheduler(
        num_blocks=10, max_model_len=32, enable_caching=enable_caching
    )
    make_request(scheduler, "first", prompt_of(24), 4)
    make_request(scheduler, "second", prompt_of(16, 1), 4)
    steps = run_until_done(scheduler, model)
    assert "second" not in ids(steps[0]) and "second" in ids(steps[-1])
    stats = scheduler.get_stats()
    assert stats.num_prompt_tokens == 24 + 16
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (
        (24 + 16, 0) if enable_caching else (0, 0)
    )


def test_same_prompt_in_one_step_shares_blocks():
    scheduler, model = make_scheduler()
    a = make_request(scheduler, "a", prompt_of(17), 5)
    b = make_request(scheduler, "b", prompt_of(17), 5)
    out = scheduler.schedule()
    # b hits the blocks a is computing in this very step (each layer writes before it reads).
    assert counts(out) == [17, 1]
    a_new, b_new = out.scheduled_new_reqs
    assert a_new.block_ids[0][:4] == b_new.block_ids[0][:4]
    scheduler.update_from_output(out, model.execute(out))
    run_until_done(scheduler, model)
    assert a.output_token_ids == b.output_token_ids == reference_output(prompt_of(17), 5)


def test_stats_track_peak_usage():
    scheduler, model = make_scheduler(num_blocks=17)
    make_request(scheduler, "a", prompt_of(16), 16)
    run_until_done(scheduler, model)
    stats = scheduler.get_stats()
    assert stats.peak_kv_cache_usage == pytest.approx(8 / 16)
    assert stats.kv_cache_usage == 0.0
    assert stats.num_generation_tokens == 16
