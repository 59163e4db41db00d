"""Speculative decoding through the engine: the same tokens as without it, whatever is accepted.

The mechanics are tested with a scripted proposer that drafts the target's own greedy
continuation (the model drafting for itself: every draft must be accepted), optionally with a
wrong token at one draft position (the drafts after it are rejected, the target's token replaces
it): greedy output must equal the engine's without speculation, token for token, at batch 1 and
16, with chunked steps, without the prefix cache, under preemption, on sliding-window groups and
every attention backend that runs here; max_tokens and stop tokens that fall inside the accepted
drafts end the request exactly where they would without drafts. The KV cache's invariants are
checked after every step, and the prefix cache is checked to hold verified tokens only.
"""

from __future__ import annotations

import numpy as np
import pytest
from _batch_invariance import record_draft_steps
from _tiny_model import tiny_gemma3_hf_model, tiny_gemma3_loaded_model, tiny_loaded_model

from pagedkv.core.invariants import check_invariants
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.spec_decode import drafts as drafts_module
from pagedkv.engine.spec_decode.drafts import IDLE_STEPS_BEFORE_PAUSE, PROPOSE_EVERY
from pagedkv.engine.spec_decode.step_costs import StepCosts
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.sampling_params import BeamSearchParams, SamplingParams
from pagedkv.worker.spec_decode.ngram import find_ngram_drafts
from pagedkv.worker.spec_decode.proposer import TokenProposer

PROMPTS = ["hello", "a much longer prompt about paged attention " * 3, "abc", "x" * 70]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


@pytest.fixture(scope="module")
def tiny_gemma():
    return tiny_gemma3_loaded_model(tiny_gemma3_hf_model())


def make_engine(model, **kwargs) -> LLMEngine:
    kwargs = {"num_blocks": 80, "max_model_len": 256, "block_size": 4, **kwargs}
    return LLMEngine(loaded_model=model, dtype="float32", num_threads=1, **kwargs)


def greedy(max_tokens=24, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


class ScriptedProposer(TokenProposer):
    """Drafts each request's continuation from ``continuations`` (request id -> the tokens
    after its prompt), with the draft at position ``wrong_at`` of every proposal changed."""

    def __init__(
        self,
        prompt_lens: dict[str, int],
        continuations: dict[str, list[int]],
        wrong_at: int | None = None,
        vocab_size: int = 96,
    ) -> None:
        self.prompt_lens = prompt_lens
        self.continuations = continuations
        self.wrong_at = wrong_at
        self.vocab_size = vocab_size
        self.finished_ids: list[str] = []

    def propose(self, req_id: str, token_ids: np.ndarray, max_num_tokens: int) -> np.ndarray:
        done = len(token_ids) - self.prompt_lens[req_id]
        drafts = np.array(self.continuations[req_id][done : done + max_num_tokens], np.int32)
        if self.wrong_at is not None and len(drafts) > self.wrong_at:
            drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % self.vocab_size
        return drafts

    def finished(self, req_id: str, prompt_len: int, token_ids) -> None:
        self.finished_ids.append(req_id)


def run(
    engine: LLMEngine, prompts, params, proposer=None, adaptive=False
) -> tuple[list[list[int]], int]:
    """Generate ``prompts`` (ids "0", "1", ...), checking the KV cache after every step;
    returns each request's token ids and the number of steps. A scripted ``proposer`` has every
    draft scheduled unless ``adaptive`` (the mechanics are under test, not the draft length)."""
    if proposer is not None:  # the runner asks it after each step
        engine.runner.drafter = proposer
        engine.scheduler.drafts.adaptive = adaptive
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    final, num_steps = {}, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_steps += 1
        check_invariants(engine.kv_cache_manager)
        for output in outputs:
            if output.finished:
                final[output.request_id] = output
    return [list(final[str(i)].outputs[0].token_ids) for i in range(len(prompts))], num_steps


def reference(model, prompts, params, **kwargs):
    return run(make_engine(model, **kwargs), prompts, params)


def scripted(engine, prompts, tokens, wrong_at=None):
    encode = engine.input_processor.process
    prompt_lens = {str(i): len(encode(p).token_ids) for i, p in enumerate(prompts)}
    continuations = {str(i): t for i, t in enumerate(tokens)}
    return ScriptedProposer(prompt_lens, continuations, wrong_at)


def test_steps_with_drafts_stay_within_the_models_row_exact_size(tiny):
    """A model whose rows get their decode steps' bits up to a step size
    (``max_row_exact_tokens``) has the drafts cut to keep a step within it: 4 requests x (4
    drafts + 1) rows would be 20; with a size of 10 the 6 spare rows go 2, 2, 1, 1. Seeded
    requests draft nothing then (their draft count must not depend on the batch). The dense
    tiny model has no such size."""
    prompts = PROMPTS[:4]
    expected, _ = reference(tiny, prompts, greedy(), num_blocks=400)
    engine = make_engine(tiny, speculative_config=NGRAM, num_blocks=400)
    assert engine.scheduler.drafts.max_step_tokens is None
    engine.scheduler.drafts.set_max_step_tokens(10)
    sizes = record_draft_steps(engine)
    shares = []
    schedule = engine.scheduler.schedule

    def first_shares():
        out = schedule()
        if not shares and any(out.scheduled_spec_decode_tokens.values()):
            shares.extend(len(out.scheduled_spec_decode_tokens.get(str(i), ())) for i in range(4))
        return out

    engine.scheduler.schedule = first_shares
    got, _ = run(engine, prompts, greedy(), scripted(engine, prompts, expected))
    assert got == expected
    assert max(sizes) == 10 and sizes[0] == 10
    assert shares == [2, 2, 1, 1]

    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    engine = make_engine(tiny, speculative_config=NGRAM, num_blocks=400)
    engine.scheduler.drafts.set_max_step_tokens(10)
    sizes = record_draft_steps(engine)
    run(engine, prompts, seeded, scripted(engine, prompts, expected), adaptive=True)
    assert sizes == [] and engine.scheduler.get_stats().spec_decoding.num_draft_tokens == 0


def run_arrivals(engine: LLMEngine, prompts, arrive_at: list[int], steps: int) -> list[list[int]]:
    """Add prompt i (id ``str(i)``) before step ``arrive_at[i]``, run ``steps`` steps checking
    the KV cache after each, and return each request's token ids."""
    final = {}
    for step in range(steps):
        for i, at in enumerate(arrive_at):
            if at == step:
                engine.add_request(str(i), prompts[i], greedy())
        for output in engine.step():
            if output.finished:
                final[output.request_id] = list(output.outputs[0].token_ids)
        check_invariants(engine.kv_cache_manager)
    return [final[str(i)] for i in range(len(prompts))]


def test_no_drafts_in_a_step_that_admits_a_prompt_under_a_row_exact_size(tiny):
    """A waiting request joins the step after the running ones' drafts are chosen, and its
    prompt rows would take the step past the row-exact size: such a step carries none. Requests
    arriving while others decode (the recorder checks every step with drafts holds no prompt
    rows); the same tokens as without speculation."""
    prompts = PROMPTS[:4]
    expected, _ = reference(tiny, prompts, greedy(), num_blocks=400)
    engine = make_engine(tiny, speculative_config=NGRAM, num_blocks=400)
    engine.scheduler.drafts.set_max_step_tokens(12)
    engine.runner.drafter = scripted(engine, prompts, expected)
    engine.scheduler.drafts.adaptive = False
    sizes = record_draft_steps(engine)
    assert run_arrivals(engine, prompts, [0, 3, 6, 9], 60) == expected
    assert sizes and max(sizes) <= 12


def test_a_running_prompt_chunk_counts_toward_the_row_exact_size(tiny):
    """A long prompt chunked over several steps runs behind the decoding requests (it joined
    later): its chunk's rows (what is left of it, at most the token budget) count toward the
    size from the start of the step, so the drafts ahead of it are cut to fit. A size of 12
    under a budget of 32: counted only when reached, the chunk took such steps to 32 rows."""
    prompts = [*PROMPTS[:3], "a long prompt chunked over steps " * 4]
    budget = {"num_blocks": 400, "max_num_batched_tokens": 32}
    expected, _ = reference(tiny, prompts, greedy(), **budget)
    engine = make_engine(tiny, speculative_config=NGRAM, **budget)
    engine.scheduler.drafts.set_max_step_tokens(12)
    engine.runner.drafter = scripted(engine, prompts, expected)
    engine.scheduler.drafts.adaptive = False
    sizes = record_draft_steps(engine, prompt_rows=True)
    assert run_arrivals(engine, prompts, [0, 1, 2, 4], 80) == expected
    assert sizes and max(sizes) <= 12


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "8"])
def test_a_bad_max_step_tokens_is_refused(tiny, value):
    engine = make_engine(tiny, speculative_config=NGRAM)
    with pytest.raises(ConfigError):
        engine.scheduler.drafts.set_max_step_tokens(value)
    assert engine.scheduler.drafts.max_step_tokens is None


@pytest.mark.parametrize("batch", [1, 16])
def test_self_drafting_accepts_every_draft_and_saves_steps(tiny, batch):
    prompts = (PROMPTS * 4)[:batch]
    expected, num_steps = reference(tiny, prompts, greedy(), num_blocks=400)
    engine = make_engine(tiny, speculative_config=NGRAM, num_blocks=400)
    got, num_spec_steps = run(engine, prompts, greedy(), scripted(engine, prompts, expected))
    assert got == expected
    stats = engine.scheduler.get_stats().spec_decoding
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.acceptance_rate == 1.0
    # 24 tokens: 1 from the prefill step, then 5 a step (4 drafts + the bonus).
    assert num_steps == 24 and num_spec_steps == 1 + 5
    per_pos = stats.num_accepted_tokens_per_pos
    assert per_pos[0] == stats.num_drafts and per_pos == sorted(per_pos, reverse=True)
    assert sum(per_pos) == stats.num_accepted_tokens
    # Verification steps by draft length: the scripted proposer always has 4 (the last step
    # of each request fewer: max_tokens leaves no room); at batch 1 they are every decode step.
    per_len = stats.num_drafts_per_len
    assert sum(per_len) == stats.num_drafts
    assert sum((k + 1) * n for k, n in enumerate(per_len)) == stats.num_draft_tokens
    if batch == 1:
        assert per_len == [0, 1, 0, 4]  # 4 x (4 + 1) tokens, then 2 drafts + 1: 1 + 20 + 3


CONFIGS = {
    "default": {},
    "no prefix cache": {"enable_prefix_caching": False},
    "small budget": {"max_num_batched_tokens": 7},
    "one seat": {"max_num_seqs": 1},
    "preemption": {"num_blocks": 41, "max_num_batched_tokens": 16, "max_model_len": 160},
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("wrong_at", [0, 2])
def test_rejected_drafts_roll_back_to_the_same_tokens(tiny, config, wrong_at):
    prompts = [*PROMPTS, PROMPTS[1], PROMPTS[1][:48]]  # repeats hit the prefix cache
    expected, _ = reference(tiny, prompts, greedy(30), **config)
    engine = make_engine(tiny, speculative_config=NGRAM, **config)
    got, _ = run(engine, prompts, greedy(30), scripted(engine, prompts, expected, wrong_at))
    assert got == expected
    stats = engine.scheduler.get_stats()
    spec = stats.spec_decoding
    assert spec.num_draft_tokens > 0
    per_pos = spec.num_accepted_tokens_per_pos
    assert per_pos[wrong_at:] == [0] * (4 - wrong_at)  # every proposal is cut at wrong_at
    assert 0 < spec.num_accepted_tokens <= spec.num_drafts * wrong_at or wrong_at == 0
    if config.get("num_blocks") == 41:
        assert stats.num_preemptions > 0
    assert stats.num_used_blocks == 0


def test_prefix_cache_holds_verified_tokens_only(tiny):
    """Drafts rejected at position 1 wrote KV for wrong tokens into the slots after the last
    verified one; a later request whose prompt is an earlier request's prompt + output hits the
    prefix cache and must still decode the tokens of an engine that never drafted."""
    prompts = PROMPTS[:3]
    first, _ = reference(tiny, prompts, greedy(30))
    engine = make_engine(tiny, speculative_config=NGRAM)
    got, _ = run(engine, prompts, greedy(30), scripted(engine, prompts, first, wrong_at=1))
    assert got == first
    follow = [p + "".join(chr(t) for t in out) for p, out in zip(prompts, first, strict=True)]
    expected, _ = reference(tiny, follow, greedy(12))
    hits_before = engine.scheduler.get_stats().prefix_cache_hits
    got, _ = run(engine, follow, greedy(12), scripted(engine, follow, expected, wrong_at=1))
    assert got == expected
    assert engine.scheduler.get_stats().prefix_cache_hits > hits_before


def stop_conditions(long: list[list[int]]) -> tuple[SamplingParams, ...]:
    """Stops that fall inside accepted drafts of two requests whose 30 greedy tokens are
    ``long``: max_tokens 7 (= the prefill's token + 4 drafts + 1 bonus + 1: the last step may
    draft none), a stop token of the first, a stop string of the second."""
    return (
        greedy(7),
        greedy(30, stop_token_ids=[long[0][9]]),
        SamplingParams(temperature=0, max_tokens=30, stop=[chr(long[1][12])]),
    )


def test_max_tokens_and_stop_tokens_inside_the_accepted_drafts(tiny):
    prompts = PROMPTS[:2]
    long, _ = reference(tiny, prompts, greedy(30))
    for params in stop_conditions(long):
        expected, _ = reference(tiny, prompts, params)
        engine = make_engine(tiny, speculative_config=NGRAM)
        got, _ = run(engine, prompts, params, scripted(engine, prompts, long))
        assert got == expected, params


def test_requests_that_cannot_be_verified_draft_nothing(tiny):
    """Penalties, pending min_tokens and logprobs need the sampler's full path: those requests
    decode without drafts (and exactly as without speculation)."""
    prompts = PROMPTS[:2]
    for params in (
        greedy(12, repetition_penalty=1.3),
        greedy(12, min_tokens=12),
        greedy(12, logprobs=2),
    ):
        expected, _ = reference(tiny, prompts, params)
        engine = make_engine(tiny, speculative_config=NGRAM)
        long, _ = reference(tiny, prompts, params)
        got, _ = run(engine, prompts, params, scripted(engine, prompts, long))
        assert got == expected
        assert engine.scheduler.get_stats().spec_decoding.num_draft_tokens == 0
    # min_tokens reached: from there on the request drafts (no mask is left to apply).
    params = greedy(16, min_tokens=4)
    expected, _ = reference(tiny, prompts, params)
    engine = make_engine(tiny, speculative_config=NGRAM)
    got, _ = run(engine, prompts, params, scripted(engine, prompts, expected))
    assert got == expected
    assert engine.scheduler.get_stats().spec_decoding.num_draft_tokens > 0


def test_seeded_sampling_is_reproducible(tiny):
    """A seeded request samples the same tokens run after run, alone or beside 15 others (its
    draft count, which its random draws follow, does not depend on the batch)."""
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=7, ignore_eos=True)
    scripted_tokens, _ = reference(tiny, PROMPTS, greedy(24))
    runs = []
    for prompts in (PROMPTS[:1], PROMPTS[:1], PROMPTS * 4):
        engine = make_engine(tiny, speculative_config=NGRAM, num_blocks=400)
        proposer = scripted(engine, prompts, (scripted_tokens * 4)[: len(prompts)])
        runs.append(run(engine, prompts, params, proposer, adaptive=True)[0][0])
        assert engine.scheduler.get_stats().spec_decoding.num_draft_tokens > 0
    assert runs[0] == runs[1] == runs[2]


def test_sliding_window_groups(tiny_gemma):
    """Gemma 3's window-8 layers free blocks by verified tokens only: rejected drafts never
    cost a block a later step needs."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 96, n).tolist() for n in (5, 23, 37)]
    expected, _ = reference(tiny_gemma, prompts, greedy(20), max_model_len=64)
    for wrong_at in (None, 1):
        engine = make_engine(tiny_gemma, speculative_config=NGRAM, max_model_len=64)
        got, _ = run(engine, prompts, greedy(20), scripted(engine, prompts, expected, wrong_at))
        assert got == expected


def test_each_attention_backend(tiny, attention_backend):
    prompts = PROMPTS
    expected, _ = reference(tiny, prompts, greedy(), attention_backend=attention_backend)
    engine = make_engine(tiny, speculative_config=NGRAM, attention_backend=attention_backend)
    got, _ = run(engine, prompts, greedy(), scripted(engine, prompts, expected, wrong_at=2))
    assert got == expected


@pytest.mark.parametrize(
    "config",
    [
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
        {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0},
    ],
    ids=["ngram", "suffix"],
)
def test_real_proposers_end_to_end(tiny, config):
    """The n-gram and suffix proposers on prompts that repeat themselves, twice over (the second
    round's suffix drafts can come from the first round's outputs): same tokens, some drafts."""
    prompts = ["abcdefgh" * 6, "the cat sat on the mat, the cat sat on the " * 2]
    expected, _ = reference(tiny, prompts, greedy(32))
    engine = make_engine(tiny, speculative_config=config)
    for _ in range(2):
        got, _ = run(engine, prompts, greedy(32))
        assert got == expected
    assert engine.scheduler.get_stats().spec_decoding.num_drafts > 0


def _wrong_then_right(tiny, switch_at: int):
    """One prompt's engine (60 greedy tokens) whose proposer is wrong until ``switch_at``
    tokens were generated and right after, with fixed step costs (a row 0.16 of a step), so
    that what it drafts does not depend on timing (the learned costs are tested in
    test_step_costs.py). Returns (prompts, expected tokens, engine, proposer)."""
    prompts = PROMPTS[:1]
    expected, _ = reference(tiny, prompts, greedy(60))
    engine = make_engine(tiny, speculative_config=NGRAM)
    proposer = scripted(engine, prompts, expected)
    right = proposer.propose

    def wrong_then_right(req_id, token_ids, max_num_tokens):
        drafts = right(req_id, token_ids, max_num_tokens)
        if len(token_ids) - proposer.prompt_lens[req_id] < switch_at:
            drafts = (drafts + 1) % 96
        return drafts

    proposer.propose = wrong_then_right
    engine.scheduler.drafts.step_costs = StepCosts(256, prior_row_cost=0.16, learn=False)
    return prompts, expected, engine, proposer


def test_drafts_that_miss_stop_being_scheduled_and_resume_when_they_hit(tiny):
    """A proposer wrong for the first 20 tokens and right after: drafts shrink to none (the
    steps cost no more than plain decoding), then the unscheduled drafts checked against the
    sampled tokens raise the estimate and drafting resumes."""
    prompts, expected, engine, proposer = _wrong_then_right(tiny, 20)
    scheduled = []
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def counting():
        out = schedule()
        scheduled.append(sum(len(d) for d in out.scheduled_spec_decode_tokens.values()))
        return out

    scheduler.schedule = counting
    got, _ = run(engine, prompts, greedy(60), proposer, adaptive=True)
    assert got == expected
    # From 1 in 2: 2 drafts, then 1 while a >= 0.16 (a row costs 0.16 of a step), then none.
    assert scheduled[:5] == [0, 2, 1, 1, 0]
    assert scheduled[4:12] == [0] * 8  # missing drafts are no longer scheduled
    assert max(scheduled[-10:]) >= 3  # and come back once they would be accepted
    stats = scheduler.get_stats().spec_decoding
    assert stats.num_accepted_tokens > 20


def test_declined_drafts_are_proposed_one_step_in_propose_every(tiny):
    """Drafts whose first token always misses: once the rule has scheduled none for
    IDLE_STEPS_BEFORE_PAUSE decode steps in a row, the workers propose for the request only one
    step in PROPOSE_EVERY (the proposal is work that brings nothing), each proposal's first
    draft still checked against the token sampled; the tokens stay those of no speculation."""
    prompts = PROMPTS[:1]
    expected, _ = reference(tiny, prompts, greedy(60))
    engine = make_engine(tiny, speculative_config=NGRAM)
    proposer = scripted(engine, prompts, expected, wrong_at=0)
    proposed_at = []  # the request's token count at each proposal
    propose = proposer.propose

    def counting(req_id, token_ids, max_num_tokens):
        proposed_at.append(len(token_ids))
        return propose(req_id, token_ids, max_num_tokens)

    proposer.propose = counting
    engine.scheduler.drafts.step_costs = StepCosts(256, prior_row_cost=0.16, learn=False)
    got, _ = run(engine, prompts, greedy(60), proposer, adaptive=True)
    assert got == expected
    gaps = np.diff(proposed_at).tolist()
    assert gaps[:IDLE_STEPS_BEFORE_PAUSE] == [1] * IDLE_STEPS_BEFORE_PAUSE  # every step at first
    assert set(gaps[-8:]) == {PROPOSE_EVERY}  # then one step in PROPOSE_EVERY
    assert len(proposed_at) < 60 / PROPOSE_EVERY + 2 * IDLE_STEPS_BEFORE_PAUSE


def _first_drafts_after(tiny, switch_at: int) -> int:
    """Tokens generated when drafts are first scheduled after ``switch_at``
    (:func:`_wrong_then_right`)."""
    prompts, expected, engine, proposer = _wrong_then_right(tiny, switch_at)
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    first = []

    def watching():
        out = schedule()
        request = scheduler.get_request("0")
        drafting = request is not None and bool(out.scheduled_spec_decode_tokens)
        if drafting and not first and request.num_output_tokens >= switch_at:
            first.append(request.num_output_tokens)
        return out

    scheduler.schedule = watching
    got, _ = run(engine, prompts, greedy(60), proposer, adaptive=True)
    assert got == expected
    return first[0]


def test_a_paused_request_drafts_again_soon_after_its_text_starts_to_repeat(tiny, monkeypatch):
    """A first draft that would have been accepted ends the pause, so drafting resumes at most
    PROPOSE_EVERY - 1 tokens later than if the request had never been paused."""
    paused = _first_drafts_after(tiny, 30)
    monkeypatch.setattr(drafts_module, "IDLE_STEPS_BEFORE_PAUSE", 10**9)
    never_paused = _first_drafts_after(tiny, 30)
    assert never_paused <= paused <= never_paused + PROPOSE_EVERY - 1


def test_every_draft_scheduled_is_never_paused(tiny):
    """With the adaptive rule off (every proposed draft scheduled) the workers propose after
    every step, however the drafts fare."""
    prompts = PROMPTS[:1]
    expected, _ = reference(tiny, prompts, greedy(30))
    engine = make_engine(tiny, speculative_config=NGRAM)
    proposer = scripted(engine, prompts, expected, wrong_at=0)
    proposed_at = []
    propose = proposer.propose

    def counting(req_id, token_ids, max_num_tokens):
        proposed_at.append(len(token_ids))
        return propose(req_id, token_ids, max_num_tokens)

    proposer.propose = counting
    got, _ = run(engine, prompts, greedy(30), proposer, adaptive=False)
    assert got == expected
    assert set(np.diff(proposed_at).tolist()) == {1}  # a miss each step: one token a step


def test_abort_while_drafts_are_verified(tiny):
    """A request aborted between schedule() and update_from_output (the engine thread's order
    when a client goes away mid-step) with drafts in flight: it is reported once as aborted, its
    blocks come back, and the request beside it goes on to the tokens of no speculation."""
    prompts = PROMPTS[:2]
    expected, _ = reference(tiny, prompts, greedy(30))
    engine = make_engine(tiny, speculative_config=NGRAM)
    engine.runner.drafter = scripted(engine, prompts, expected)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(30))
    execute = engine.executor.execute_model
    aborted = []

    def abort_during(scheduler_output):
        output = execute(scheduler_output)
        if not aborted and scheduler_output.scheduled_spec_decode_tokens.get("0"):
            engine.abort_request("0")
            aborted.append(True)
        return output

    engine.executor.execute_model = abort_during
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id not in final
            if output.finished:
                final[output.request_id] = output
        check_invariants(engine.kv_cache_manager)
    assert aborted and final["0"].outputs[0].finish_reason == "abort"
    assert list(final["1"].outputs[0].token_ids) == expected[1]
    assert engine.scheduler.get_stats().num_used_blocks == 0


def test_beam_search_is_refused(tiny):
    engine = make_engine(tiny, speculative_config=NGRAM)
    with pytest.raises(InvalidRequestError, match="speculative") as info:
        engine.add_request("b", "hello", BeamSearchParams(beam_width=2, max_tokens=4))
    assert info.value.param == "use_beam_search"
    assert not engine.has_unfinished_requests()


def test_the_runner_returns_the_proposers_drafts_for_the_tokens_after_its_step(tiny):
    """After each step the model runner proposes for every request that sampled, may draft and
    is not paused (``draft_paused_req_ids``):
    its drafts are n-gram's over the request's tokens after the step (the step's accepted drafts
    and sampled token included), capped by num_speculative_tokens and the room max_tokens
    leaves; a request with logprobs (it may not draft) gets none."""
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = make_engine(tiny, speculative_config=config)
    execute = engine.executor.execute_model
    outputs = []

    paused = []

    def recording(out):
        paused.append(out.draft_paused_req_ids)
        outputs.append(execute(out))
        return outputs[-1]

    engine.executor.execute_model = recording
    params = [greedy(20), greedy(20, logprobs=1), greedy(9)]
    for i, (prompt, p) in enumerate(zip(PROMPTS[:3], params, strict=True)):
        engine.add_request(str(i), prompt, p)
    checked = drafted = 0
    while engine.has_unfinished_requests():
        engine.step()
        result = outputs[-1]
        for req_id in result.req_ids:
            request = engine.scheduler.get_request(req_id)
            if request is None:  # finished in this step
                continue
            p = request.sampling_params
            limit = min(3, p.max_tokens - request.num_output_tokens - 1)
            expected = []
            if req_id != "1" and limit > 0 and req_id not in paused[-1]:
                tokens = np.array(request.all_token_ids, dtype=np.int32)
                expected = find_ngram_drafts(tokens, 1, 5, limit).tolist()
            assert result.draft_token_ids.get(req_id, []) == expected
            checked += 1
            drafted += bool(expected)
    assert "1" not in {r for out in outputs for r in out.draft_token_ids}
    assert checked > 20 and drafted > 0


def test_a_finished_requests_final_tokens_reach_the_proposer(tiny):
    """A finished request's tokens (prompt + output, cut where a stop token inside its accepted
    drafts ended it) reach the proposer with the next step that runs the model: what suffix's
    global tree learns from."""
    prompts = PROMPTS[:2]
    long, _ = reference(tiny, prompts, greedy(30))
    params = greedy(30, stop_token_ids=[long[0][9]])
    expected, _ = reference(tiny, prompts, params)
    engine = make_engine(tiny, speculative_config=NGRAM)
    proposer = scripted(engine, prompts, long)
    learned = {}

    def finished(req_id, prompt_len, token_ids):
        learned[req_id] = (prompt_len, token_ids.tolist())

    proposer.finished = finished
    got, _ = run(engine, prompts, params, proposer)
    assert got == expected and len(got[0]) == 10  # its stop token was a draft
    engine.add_request("next", "abc", greedy(1))
    engine.step()
    encode = engine.input_processor.process
    for i, prompt in enumerate(prompts):
        prompt_ids = list(encode(prompt).token_ids)
        assert learned[str(i)] == (len(prompt_ids), prompt_ids + expected[i])
