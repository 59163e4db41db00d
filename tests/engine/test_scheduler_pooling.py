"""Pooling requests in the scheduler (torch-free, with the fake token-level model of
_engine_fakes.py, whose "pooled vector" is the prompt read back from its KV cache): they sample
nothing, finish in the step that completes their prompt, fill the prefix cache, read it only
under last pooling, recompute after preemption, and share steps with generation requests."""

from __future__ import annotations

import pytest
from _engine_fakes import FakeModel, reference_output, run_until_done

from pagedkv.core.manager import KVCacheManager
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.scheduler import Scheduler
from pagedkv.errors import InvalidRequestError
from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.outputs import ModelRunnerOutput

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int = 64, **kwargs) -> tuple[Scheduler, FakeModel]:
    manager = KVCacheManager(num_blocks, block_size=BLOCK_SIZE, enable_caching=True)
    options = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64, **kwargs}
    return Scheduler(manager, **options), FakeModel(num_blocks, BLOCK_SIZE)


def add(scheduler, request_id, prompt, pooling=None, max_tokens=8) -> Request:
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        block_hasher=scheduler.kv_cache_manager.block_hasher,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None if pooling is None else PoolingParams(pooling_type=pooling),
    )
    scheduler.add_request(request)
    return request


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return [(seed * 101 + i * 7) % 500 + 1 for i in range(length)]


def test_a_pooling_request_finishes_with_its_prompt_and_samples_nothing():
    scheduler, model = make_scheduler(max_num_batched_tokens=8)
    prompt = prompt_of(21)
    request = add(scheduler, "pool", prompt, "mean")
    outputs = run_until_done(scheduler, model)
    assert len(outputs) == 3  # 8 + 8 + 5 tokens, chunked
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.pooled_output == tuple(prompt)  # the fake's vector: the KV read back
    assert request.output_token_ids == []
    assert scheduler.kv_cache_manager.num_free_blocks == 64 - 1


def test_pooling_and_generation_share_steps():
    scheduler, model = make_scheduler(max_num_batched_tokens=16)
    generation = add(scheduler, "gen", prompt_of(10, 1), max_tokens=6)
    pooled = [add(scheduler, f"pool-{k}", prompt_of(9, k + 2), "last") for k in range(3)]
    outputs = run_until_done(scheduler, model)
    assert any({"gen", "pool-0"} <= set(out.num_scheduled_tokens) for out in outputs)
    assert generation.output_token_ids == reference_output(prompt_of(10, 1), 6)
    for k, request in enumerate(pooled):
        assert request.pooled_output == tuple(prompt_of(9, k + 2))


def test_the_prompt_fills_the_prefix_cache_and_only_last_pooling_reads_it():
    scheduler, model = make_scheduler()
    prompt = prompt_of(18)
    add(scheduler, "first", prompt, "cls")
    run_until_done(scheduler, model)
    hit = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    for pooling, expected in (("last", hit), ("mean", 0), ("cls", 0)):
        request = add(scheduler, pooling, prompt, pooling)
        run_until_done(scheduler, model)
        assert request.num_cached_tokens == expected, pooling
        assert request.pooled_output == tuple(prompt)
    generation = add(scheduler, "gen", prompt, max_tokens=2)
    run_until_done(scheduler, model)
    assert generation.num_cached_tokens == hit


def test_a_preempted_pooling_request_recomputes_from_the_start():
    # 10 usable blocks of 4; two generations of 8 + 12 tokens (5 blocks each at the end) and a
    # pooling request of 16 tokens (4 blocks) prefilled 2 tokens a step: it is the newest, so
    # the victim when the generations grow.
    scheduler, model = make_scheduler(num_blocks=11, max_num_batched_tokens=4, max_model_len=24)
    add(scheduler, "gen-0", prompt_of(8, 1), max_tokens=12)
    add(scheduler, "gen-1", prompt_of(8, 2), max_tokens=12)
    for _ in range(3):
        scheduler.update_from_output(out := scheduler.schedule(), model.execute(out))
    pooled = add(scheduler, "pool", prompt_of(16, 3), "mean")
    run_until_done(scheduler, model)
    assert pooled.num_preemptions >= 1
    assert pooled.pooled_output == tuple(prompt_of(16, 3))


def test_a_pooling_prompt_may_fill_max_model_len():
    scheduler, model = make_scheduler(max_model_len=16)
    request = add(scheduler, "full", prompt_of(16), "last")
    run_until_done(scheduler, model)
    assert request.pooled_output == tuple(prompt_of(16))
    with pytest.raises(InvalidRequestError) as info:
        add(scheduler, "over", prompt_of(17), "last")
    assert info.value.param == "prompt"


def test_a_missing_pooled_output_is_refused_and_changes_nothing():
    scheduler, model = make_scheduler()
    request = add(scheduler, "pool", prompt_of(6), "last")
    out = scheduler.schedule()
    model.execute(out)
    with pytest.raises(InvalidRequestError, match="pooled outputs"):
        scheduler.update_from_output(out, ModelRunnerOutput())
    assert request.status == RequestStatus.RUNNING and request.pooled_output is None
    with pytest.raises(InvalidRequestError, match="pooled outputs"):
        stray = ModelRunnerOutput(pooler_output={"other": (1,)})
        scheduler.update_from_output(out, stray)
    assert request.status == RequestStatus.RUNNING
