"""The draft-length rule on measured step costs (engine/spec_decode/step_costs.py, drafts.py).

The estimate converges on the costs of a scripted engine (a real engine on the tiny model whose
clock advances by a known cost per step size), the rule never drafts where the estimate says a
draft cannot pay, a seeded request's draft count does not depend on timing, and greedy tokens
are those of no speculation whatever the costs. No test reads a real clock.
"""

from __future__ import annotations

import random

import pytest
from _tiny_model import tiny_loaded_model
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.spec_decode.drafts import MIN_GAIN, best_num_drafts, expected_tokens
from pagedkv.engine.spec_decode.step_costs import (
    MIN_SAMPLES,
    PRIOR_ROW_COST,
    STALE_STEPS,
    WINDOW,
    StepCosts,
)
from pagedkv.errors import ConfigError
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.spec_decode.proposer import TokenProposer

PROMPTS = ["hello", "a much longer prompt about paged attention " * 3, "abc", "x" * 70]
SPEC = {"method": "ngram", "num_speculative_tokens": 7}


class TableCosts:
    """Known step costs (seconds by number of tokens) in :class:`StepCosts`' interface."""

    def __init__(self, cost):
        self.cost = cost


def true_best(acceptance, max_num_drafts, cost, step_tokens=1, step_expected=1.0):
    """By brute force: the k with the most expected tokens per cost, a larger k taken only
    where it beats the best smaller one by MIN_GAIN."""
    best, best_value = 0, step_expected / cost(step_tokens)
    for k in range(1, max_num_drafts + 1):
        value = (step_expected - 1 + expected_tokens(acceptance, k)) / cost(step_tokens + k)
        if value > best_value * MIN_GAIN:
            best, best_value = k, value
    return best


# ---------------------------------------------------------------- the estimate


def test_prior_before_any_step_is_measured():
    costs = StepCosts(64)
    assert costs.cost(1) == 1.0
    assert costs.cost(5) == pytest.approx(1 + 4 * PRIOR_ROW_COST)
    assert costs.snapshot() == {}


def test_a_constant_step_time_is_learned_exactly_and_interpolated_between_sizes():
    costs = StepCosts(64)
    for _ in range(MIN_SAMPLES):
        costs.observe(1, 0.010)
        costs.observe(9, 0.030)
    assert costs.cost(1) == pytest.approx(0.010)
    assert costs.cost(9) == pytest.approx(0.030)
    assert costs.cost(5) == pytest.approx(0.020)  # halfway
    assert costs.cost(2) == pytest.approx(0.010 * (1 + PRIOR_ROW_COST))  # next to one: the prior
    # Past the largest measured size: the cost per row measured between the last two.
    assert costs.cost(11) == pytest.approx(0.030 + 2 * 0.0025)
    assert costs.cost(11) == pytest.approx(0.035)
    # Below the smallest: in proportion.
    small = StepCosts(64)
    small.observe(4, 0.040)
    assert small.cost(2) == pytest.approx(0.020)
    assert StepCosts(64).cost(3) == pytest.approx(1 + 2 * PRIOR_ROW_COST)  # nothing measured
    assert costs.snapshot() == {1: (pytest.approx(0.010), 3), 9: (pytest.approx(0.030), 3)}


def test_slow_steps_do_not_move_the_estimate():
    """The fastest of the first steps, then the median of the last WINDOW: one slow first step
    (another process woke up) and a few slow ones later change nothing."""
    costs = StepCosts(64)
    costs.observe(4, 0.100)
    costs.observe(4, 0.012)
    assert costs.cost(4) == pytest.approx(0.012)
    for _ in range(WINDOW):
        costs.observe(4, 0.012)
    for _ in range(WINDOW // 2 - 1):
        costs.observe(4, 0.050)
    assert costs.cost(4) == pytest.approx(0.012)
    for _ in range(WINDOW):  # the machine got slower for good: the estimate follows
        costs.observe(4, 0.020)
    assert costs.cost(4) == pytest.approx(0.020)


def test_noisy_times_converge_near_the_true_cost():
    """Other jobs only add time: the estimate settles within the noise above the true cost."""
    rng = random.Random(0)
    costs = StepCosts(64)
    for _ in range(200):
        for size, seconds in ((1, 0.010), (4, 0.012), (8, 0.020)):
            spike = 3.0 if rng.random() < 0.05 else 1.0
            costs.observe(size, seconds * (1 + 0.2 * rng.random()) * spike)
    for size, seconds in ((1, 0.010), (4, 0.012), (8, 0.020)):
        assert seconds <= costs.cost(size) <= seconds * 1.2


def test_observations_outside_the_table_or_not_learning_are_ignored():
    costs = StepCosts(8)
    costs.observe(9, 1.0)
    costs.observe(0, 1.0)
    costs.observe(2, 0.0)
    assert costs.snapshot() == {}
    fixed = StepCosts(8, prior_row_cost=0.15, learn=False)
    fixed.observe(1, 1.0)
    assert fixed.snapshot() == {} and fixed.cost(3) == pytest.approx(1.3)


@pytest.mark.parametrize(
    "kwargs", [{"max_num_tokens": 0}, {"max_num_tokens": 2.0}, {"prior_row_cost": 0.0}]
)
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ConfigError):
        StepCosts(**{"max_num_tokens": 8, **kwargs})


# ---------------------------------------------------------------- the rule


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    acceptance=st.floats(0.0, 1.0),
    max_num_drafts=st.integers(0, 10),
    increments=st.lists(st.floats(0.0, 2.0), min_size=20, max_size=20),
    step_tokens=st.integers(1, 8),
    others=st.floats(0.0, 20.0),
)
@example(acceptance=0.3, max_num_drafts=7, increments=[1.0] * 20, step_tokens=1, others=0.0)
def test_the_rule_drafts_only_what_pays_by_the_estimate(
    acceptance, max_num_drafts, increments, step_tokens, others
):
    """For any non-decreasing step cost, the rule's k is the brute-force argmax; k > 0 only
    where it beats the step without drafts by the estimate."""
    table = [1.0]
    for increment in increments:
        table.append(table[-1] + increment)

    def cost(num_tokens):
        return table[num_tokens - 1]

    step_expected = 1.0 + others
    k = best_num_drafts(acceptance, max_num_drafts, TableCosts(cost), step_tokens, step_expected)
    assert k == true_best(acceptance, max_num_drafts, cost, step_tokens, step_expected)
    if k:
        gain = (step_expected - 1 + expected_tokens(acceptance, k)) / cost(step_tokens + k)
        assert gain > MIN_GAIN * step_expected / cost(step_tokens)


def test_a_row_that_costs_a_step_never_pays():
    """Each row as dear as a one-token step: even drafts that are always accepted only tie."""

    def cost(num_tokens):
        return float(num_tokens)

    for acceptance in (0.0, 0.5, 0.99, 1.0):
        assert best_num_drafts(acceptance, 7, TableCosts(cost)) == 0


# ---------------------------------------------------------------- a scripted engine


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


def greedy(max_tokens=200, **kwargs):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


class ContinuationProposer(TokenProposer):
    """Drafts each request's known greedy continuation (every draft is accepted)."""

    def __init__(self, prompt_lens, continuations):
        self.prompt_lens = prompt_lens
        self.continuations = continuations

    def propose(self, req_id, token_ids, max_num_tokens):
        import numpy as np

        done = len(token_ids) - self.prompt_lens[req_id]
        return np.array(self.continuations[req_id][done : done + max_num_tokens], np.int32)

    def finished(self, req_id, prompt_len, token_ids):
        pass


class ScriptedClock:
    """The engine's step clock: advances by ``cost(T)`` seconds in each step of T tokens."""

    def __init__(self, cost):
        self.cost = cost
        self.now = 0.0

    def __call__(self):
        return self.now


def make_engine(model, cost=None, **kwargs):
    kwargs = {"num_blocks": 600, "max_model_len": 512, "block_size": 8, **kwargs}
    engine = LLMEngine(loaded_model=model, dtype="float32", num_threads=1, **kwargs)
    if cost is not None:
        clock = ScriptedClock(cost)
        engine.step_clock = clock
        execute = engine.executor.execute_model

        def timed(scheduler_output):
            clock.now += cost(scheduler_output.total_num_scheduled_tokens)
            return execute(scheduler_output)

        engine.executor.execute_model = timed
    return engine


def run(engine, prompts, params):
    """Token ids per prompt, and the draft tokens scheduled in each step."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    final, drafts = {}, []
    scheduler = engine.scheduler
    while engine.has_unfinished_requests():
        outputs = engine.step()
        scheduled = getattr(scheduler, "_last_drafts", None)
        drafts.append(scheduled)
        for output in outputs:
            if output.finished:
                final[output.request_id] = output
    return [list(final[str(i)].outputs[0].token_ids) for i in range(len(prompts))], drafts


def count_drafts(engine):
    """Wrap schedule() to record each step's scheduled draft tokens (scheduler._last_drafts)."""
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def counting():
        out = schedule()
        scheduler._last_drafts = sum(len(d) for d in out.scheduled_spec_decode_tokens.values())
        return out

    scheduler.schedule = counting


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy outputs without speculation, batch of 4, and a proposer factory."""
    engine = make_engine(tiny)
    tokens, _ = run(engine, PROMPTS, greedy())
    return tokens


def drafting_engine(tiny, reference, cost, prompts):
    engine = make_engine(tiny, cost, speculative_config=SPEC)
    encode = engine.input_processor.process
    engine.runner.drafter = ContinuationProposer(
        {str(i): len(encode(p).token_ids) for i, p in enumerate(prompts)},
        {str(i): reference[PROMPTS.index(p)] for i, p in enumerate(prompts)},
    )
    count_drafts(engine)
    return engine


COSTS = {
    # rows cheap (a step bound by reading the weights): draft all 7
    "cheap rows": (lambda t: 0.010 * (1 + 0.02 * (t - 1)), 7),
    # every row as dear as a step (compute-bound): drafting never pays
    "dear rows": (lambda t: 0.010 * t, 0),
    # cheap up to 4 tokens, then the step leaves the fast kernels: 3 drafts
    "a jump past 4 tokens": (lambda t: 0.010 * (1 + 0.05 * (t - 1)) if t <= 4 else 0.030, 3),
}


@pytest.mark.parametrize("name", COSTS)
def test_batch_1_converges_on_the_scripted_costs(tiny, reference, name):
    cost, settled_k = COSTS[name]
    engine = drafting_engine(tiny, reference, cost, PROMPTS[:1])
    tokens, drafts = run(engine, PROMPTS[:1], greedy())
    assert tokens == reference[:1]  # speculation never changes greedy tokens
    costs = engine.scheduler.drafts.step_costs
    for size, (seconds, _) in costs.snapshot().items():
        assert seconds == pytest.approx(cost(size))  # a constant time is learned exactly
    # Settled: every step of the last third schedules the draft count that is best by the
    # true costs (every draft here is accepted), where the request has room for it.
    tail = [d for d in drafts[len(drafts) // 2 : -2] if d is not None]
    assert tail and all(d == settled_k for d in tail), drafts
    assert settled_k == true_best(1.0, 7, cost)


def test_dear_rows_are_tried_only_until_measured(tiny, reference):
    """With rows as dear as steps, the rule drafts only while sizes are unmeasured (its
    optimistic prior) and never once every size it would try is measured."""
    cost, _ = COSTS["dear rows"]
    engine = drafting_engine(tiny, reference, cost, PROMPTS[:1])
    _, drafts = run(engine, PROMPTS[:1], greedy())
    decode = [d for d in drafts[1:] if d is not None]
    drafting = [i for i, d in enumerate(decode) if d]
    # A few sizes, each measured MIN_SAMPLES times, early in some 190 decode steps; never after.
    assert len(drafting) <= 3 * MIN_SAMPLES and max(drafting) < 20, decode


def test_a_batch_keeps_its_steps_under_the_jump(tiny, reference):
    """Four requests, steps cheap up to 8 tokens and three times dearer past them: once
    measured, the batch's steps stay at 8 tokens or fewer (drafts shared between requests)."""

    def cost(num_tokens):
        if num_tokens <= 8:
            return 0.010 * (1 + 0.05 * (num_tokens - 1))
        return 0.040 + 0.010 * (num_tokens - 8)  # then each row as dear as a step

    engine = drafting_engine(tiny, reference, cost, PROMPTS)
    sizes = []
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def sizing():
        out = schedule()
        sizes.append(out.total_num_scheduled_tokens)
        return out

    scheduler.schedule = sizing
    tokens, _ = run(engine, PROMPTS, greedy())
    assert tokens == reference
    decode_sizes = sizes[len(sizes) // 2 : -2]
    assert decode_sizes and max(decode_sizes) <= 8, sizes
    assert max(decode_sizes) > 4  # and they draft: 4 requests' tokens alone are 4


def test_a_seeded_requests_tokens_do_not_depend_on_the_step_costs(tiny, reference):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=11, ignore_eos=True)
    runs = []
    for cost in (COSTS["cheap rows"][0], COSTS["dear rows"][0], COSTS["a jump past 4 tokens"][0]):
        engine = drafting_engine(tiny, reference, cost, PROMPTS)
        runs.append(run(engine, PROMPTS, params)[0])
        assert engine.scheduler.get_stats().spec_decoding.num_draft_tokens > 0
    assert runs[0] == runs[1] == runs[2]


def test_a_size_not_seen_for_long_is_forgotten_and_measured_again():
    """Only the sizes the rule chooses are measured: one measured during a burst of load is
    forgotten within 2 x STALE_STEPS steps without it (the check runs every STALE_STEPS), and
    estimated from its neighbours again."""
    costs = StepCosts(64)
    for _ in range(MIN_SAMPLES):
        costs.observe(1, 0.010)
        costs.observe(2, 0.090)  # measured while another job took the cores
    assert costs.cost(2) == pytest.approx(0.090)
    for _ in range(2 * STALE_STEPS):
        costs.observe(1, 0.010)
    assert 2 not in costs.snapshot()
    assert costs.cost(2) == pytest.approx(0.010 * (1 + PRIOR_ROW_COST))


@pytest.mark.parametrize("seconds", [float("inf"), float("nan"), 0.0, -1.0])
def test_times_that_are_not_positive_and_finite_are_ignored(seconds):
    costs = StepCosts(8)
    costs.observe(1, seconds)
    costs.observe(2.5, 0.01)
    costs.observe(True, 0.01)
    assert costs.snapshot() == {}
