"""Random workloads through the scheduler: whatever the pool, budget, policy, prefix sharing and
aborts, every request that is not aborted gives exactly its reference output, and at the end
every block is free again and the pool's invariants hold."""

from __future__ import annotations

from _engine_fakes import FakeModel, reference_output
from hypothesis import example, given
from hypothesis import strategies as st

from pagedkv.core.invariants import check_invariants
from pagedkv.core.manager import KVCacheManager
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.scheduler import Scheduler
from pagedkv.sampling_params import SamplingParams

BLOCK_SIZE = 4
MAX_MODEL_LEN = 48


@st.composite
def workloads(draw):
    prefixes = [draw(st.lists(st.integers(1, 50), min_size=1, max_size=20)) for _ in range(3)]
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(prefixes))
        tail = draw(st.lists(st.integers(1, 50), max_size=12))
        prompt = (prefix + tail)[: MAX_MODEL_LEN - 8]
        max_tokens = draw(st.integers(1, MAX_MODEL_LEN - len(prompt)))
        arrival_step = draw(st.integers(0, 6))
        abort_step = draw(st.one_of(st.none(), st.integers(0, 30)))
        priority = draw(st.integers(0, 3))
        requests.append((prompt, max_tokens, arrival_step, abort_step, priority))
    config = {
        "num_blocks": draw(st.integers(MAX_MODEL_LEN // BLOCK_SIZE + 1, 40)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "max_num_batched_tokens": draw(st.integers(1, 64)),
        "enable_caching": draw(st.booleans()),
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
    }
    return config, requests


#: Found by this test on a fresh clone (issue 17): under policy "priority" a low-priority request
#: ahead of two priority-0 ones in the running list preempted itself at step 17, and the step used
#: to schedule nothing although both of them had slots for their next token.
PRIORITY_SELF_PREEMPTION = (
    {
        "num_blocks": 13,
        "max_num_seqs": 3,
        "max_num_batched_tokens": 3,
        "enable_caching": False,
        "policy": "priority",
    },
    [([1], 17, 0, None, 1)]
    + [([1], 1, 0, None, 0)] * 3
    + [([1], 14, 4, None, 0)] * 2
    + [([1], 1, 0, None, 0)] * 2,
)


@given(workloads())  # examples, seed and deadline: the profile in tests/conftest.py
@example(PRIORITY_SELF_PREEMPTION)
def test_random_workloads_give_reference_outputs(workload):
    config, specs = workload
    manager = KVCacheManager(
        config["num_blocks"], block_size=BLOCK_SIZE, enable_caching=config["enable_caching"]
    )
    budget = config["max_num_batched_tokens"]
    scheduler = Scheduler(
        manager,
        max_num_seqs=config["max_num_seqs"],
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        policy=config["policy"],
    )
    model = FakeModel(config["num_blocks"], BLOCK_SIZE)
    requests: list[Request | None] = [None] * len(specs)
    step = 0
    while step < 5000:
        for i, (prompt, max_tokens, arrival, abort, priority) in enumerate(specs):
            if arrival == step:
                requests[i] = Request(
                    request_id=str(i),
                    prompt_token_ids=prompt,
                    block_hasher=manager.block_hasher,
                    sampling_params=SamplingParams(max_tokens=max_tokens),
                    priority=priority,
                    arrival_time=float(step),
                )
                scheduler.add_request(requests[i])
            if abort == step and requests[i] is not None:
                scheduler.finish_requests(str(i), RequestStatus.FINISHED_ABORTED)
        if step > 6 and not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= budget
        assert out.num_reqs <= config["max_num_seqs"]
        if scheduler.get_running_requests():  # every step makes progress
            assert out.total_num_scheduled_tokens > 0
        scheduler.update_from_output(out, model.execute(out))
        check_invariants(manager)
        step += 1
    assert not scheduler.has_unfinished_requests()
    for request, (prompt, max_tokens, *_) in zip(requests, specs, strict=True):
        if request.status == RequestStatus.FINISHED_ABORTED:
            expected = reference_output(prompt, max_tokens)
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
            assert request.output_token_ids == reference_output(prompt, max_tokens)
    assert manager.num_free_blocks == config["num_blocks"] - 1
