"""The scheduler -> worker boundary is plain data (issue 23).

Every SchedulerOutput of a running engine (chunked prefill, prefix hits, preemption, aborts,
seeded sampling, penalties, prompt logprobs, a beam search's forked beams) is pickled and
unpickled by an unpickler that refuses any class but the boundary's own plain types, then applied
to a second, independent model runner on the same weights that sees nothing else: its persistent
batch, its inputs and its sampled tokens must equal the engine's own runner's, step by step."""

from __future__ import annotations

import io
import pickle

import pytest
from _tiny_model import tiny_loaded_model

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sampling_params import BeamSearchParams, SamplingParams
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.scheduler_output import SchedulerOutput

#: What may cross the boundary: the boundary's dataclasses, SamplingParams, builtins.
ALLOWED = {
    ("pagedkv.worker.scheduler_output", "SchedulerOutput"),
    ("pagedkv.worker.scheduler_output", "NewRequestData"),
    ("pagedkv.worker.scheduler_output", "CachedRequestData"),
    ("pagedkv.sampling_params", "SamplingParams"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
}


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} crossed the scheduler/worker boundary")
        return super().find_class(module, name)


def wire(out: SchedulerOutput) -> SchedulerOutput:
    data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
    return _PlainDataUnpickler(io.BytesIO(data)).load()


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


def make_engine(tiny, **overrides) -> LLMEngine:
    """The tiny model in float32, one thread, 4-token blocks (64 blocks, 64 tokens unless
    overridden)."""
    options = {"num_blocks": 64, "max_model_len": 64, **overrides}
    return LLMEngine(loaded_model=tiny, dtype="float32", num_threads=1, block_size=4, **options)


def test_a_worker_rebuilt_from_pickled_scheduler_outputs_alone_matches_the_engine(tiny):
    # 30 usable blocks of 4 tokens, a budget of 24 tokens a step: prompts are chunked, the
    # repeated prompt hits the prefix cache, and the pool runs out (preemption).
    # both on the torch backend: logprobs are compared exactly, and auto may pick another one
    engine = make_engine(
        tiny,
        num_blocks=31,
        max_model_len=96,
        max_num_batched_tokens=24,
        seed=3,
        attention_backend="torch",
    )
    shadow = ModelRunner(
        tiny_loaded_model().model,
        engine.kv_cache_config,
        engine.pagedkv_config.scheduler_config,
        seed=3,
        attention_backend="torch",
    )
    runner = engine.runner
    steps = []

    def execute_model(out: SchedulerOutput):
        copy = wire(out)
        result = type(runner).execute_model(runner, out)
        shadow_result = shadow.execute_model(copy)
        steps.append((out, result, shadow_result))
        return result

    runner.execute_model = execute_model
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3, min_tokens=4
        ),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    ]
    prompts = [
        "paged attention " * 3,
        "hello",
        "block tables!" * 2,
        "abc" * 9,
        "paged attention " * 3,
    ]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    # A beam search: its forked beams reach the workers with their parent's output tokens.
    engine.add_request("beams", "tables", BeamSearchParams(3, 10, ignore_eos=True))
    finished = {}
    step = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        step += 1
        if step == 6:
            engine.abort_request("2")
    assert set(finished) == {str(i) for i in range(len(prompts))} | {"beams"}
    assert len(finished["beams"].outputs) == 3
    assert finished["2"].finish_reason == "abort"
    assert engine.get_stats().scheduler.num_preemptions > 0
    assert any(out.scheduled_cached_reqs.resumed_from_preemption for out, _, _ in steps)
    assert finished["4"].num_cached_tokens > 0

    for _, result, shadow_result in steps:
        assert shadow_result.req_ids == result.req_ids
        assert shadow_result.sampled_token_ids == result.sampled_token_ids
        assert shadow_result.logprobs == result.logprobs
        assert shadow_result.prompt_logprobs == result.prompt_logprobs
    # The shadow's persistent rows hold what the engine's runner holds.
    a, b = runner.input_batch, shadow.input_batch
    assert a.req_ids[: a.num_reqs] == b.req_ids[: b.num_reqs]
    assert set(a.requests) == set(b.requests)
    # A decode step sends O(1) data per request: one new token, at most one new block.
    decode_steps = [
        out
        for out, _, _ in steps
        if out.num_reqs
        and set(out.num_scheduled_tokens.values()) == {1}
        and not out.scheduled_new_reqs
    ]
    assert decode_steps
    for out in decode_steps:
        cached = out.scheduled_cached_reqs
        for tokens, blocks, resumed in zip(
            cached.new_token_ids,
            cached.new_block_ids,
            cached.resumed_from_preemption,
            strict=True,
        ):
            if not resumed:
                assert len(tokens) == 1
                assert blocks is None or sum(map(len, blocks)) <= 1


def test_the_worker_forgets_finished_requests(tiny):
    engine = make_engine(tiny)
    for i in range(3):
        engine.add_request(str(i), "abc" * (i + 1), SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    batch = engine.runner.input_batch
    # Finished ids reach the worker with the next step that runs the model.
    engine.step()
    assert set(batch.requests) == {"0", "1", "2"}  # an idle step does not call the workers
    engine.add_request("3", "xyz", SamplingParams(temperature=0, max_tokens=1))
    engine.step()
    assert set(batch.requests) == {"3"}
    engine.step()
    engine.add_request("4", "xyz", SamplingParams(temperature=0, max_tokens=1))
    engine.step()
    assert set(batch.requests) == {"4"} and batch.num_reqs == 1


def test_an_interrupted_step_still_tells_the_worker_what_finished(tiny):
    """A KeyboardInterrupt inside the step (before the worker applied the output) puts the
    output's finished ids back: the next step that runs the model drops their state."""
    engine = make_engine(tiny)
    engine.add_request("short", "abc", SamplingParams(temperature=0, max_tokens=2))
    engine.add_request("long", "abcd", SamplingParams(temperature=0, max_tokens=8))
    while "short" not in engine.scheduler.queues.finished_ids:
        engine.step()
    batch = engine.runner.input_batch
    update = batch.update

    def interrupted(out):
        batch.update = update
        raise KeyboardInterrupt

    batch.update = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert "short" in engine.scheduler.queues.finished_ids
    engine.abort_request("long")  # what LLM.generate does after an interrupt
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("next", "xyz", SamplingParams(temperature=0, max_tokens=1))
    engine.step()
    assert set(batch.requests) == {"next"}


def test_blocks_to_copy_cross_as_plain_data(tiny):
    """Copy-on-write copies are tuples of lists of int pairs: nothing else crosses, and the
    worker copies what arrives (tests/engine/test_block_copy.py has the semantics)."""
    out = SchedulerOutput(blocks_to_copy=([(1, 2), (3, 4)],))
    copy = wire(out)
    assert copy.blocks_to_copy == out.blocks_to_copy == ([(1, 2), (3, 4)],)
    assert SchedulerOutput().blocks_to_copy == ()  # the default: nothing to copy
    engine = make_engine(tiny)
    cache = engine.runner.kv_caches[0]
    cache[:, 1].fill_(1.5)
    cache[:, 3].fill_(-2.0)
    engine.runner.execute_model(copy)
    assert bool((cache[:, 2] == 1.5).all()) and bool((cache[:, 4] == -2.0).all())
