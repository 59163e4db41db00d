"""Speculative decoding of requests with a structured-output grammar: drafts checked against the
grammar, a bitmask per verification row, the matcher rolled back with the drafts.

The matcher's side is tested on its own (a 128-token character vocabulary, no model): the
longest valid prefix of the drafts is kept, the rows are the masks after each draft, and the
matcher is where it was afterwards. Through the engine (the tiny model of the other spec-decode
tests, its character vocabulary compiled by xgrammar), greedy output under a JSON schema, a regex
and a choice equals the engine's without speculation token for token, at batch 1 and with several
requests, whether the scripted drafts are all valid or break the grammar partway, and with a
draft model (the target drafting for itself); after every step each constrained request's
matcher has exactly its output accepted.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json

import numpy as np
import pytest
from _tiny_model import EOS, VOCAB_SIZE, tiny_loaded_model
from test_spec_decode import ScriptedProposer, make_engine

from pagedkv import SamplingParams, StructuredOutputsParams
from pagedkv.core.invariants import check_invariants
from pagedkv.engine.request import Request
from pagedkv.engine.structured_output import StructuredOutputManager, StructuredOutputRequest
from pagedkv.worker.scheduler_output import SchedulerOutput

xgr = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,6}, [0-9]{4}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
}
PROMPTS = ["hello there", "a much longer prompt about paged attention " * 2, "abc"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def _tokenizer_info():
    """The tiny model's vocabulary for xgrammar: token id = character, EOS the stop token."""
    return xgr.TokenizerInfo(
        [chr(i) for i in range(VOCAB_SIZE - 1)] + ["</s>"], stop_token_ids=[EOS]
    )


@functools.cache
def _compiler():
    return xgr.GrammarCompiler(_tokenizer_info(), max_threads=1)  # it caches what it compiles


def _compiled(constraint: StructuredOutputsParams):
    from pagedkv.engine.structured_output import parse_constraint

    return _compiler().compile_grammar(parse_constraint(constraint))


def _state(constraint: StructuredOutputsParams) -> StructuredOutputRequest:
    future = concurrent.futures.Future()
    future.set_result(_compiled(constraint))
    return StructuredOutputRequest(future)


def _mask_after(constraint, token_ids) -> np.ndarray:
    """The bitmask row of a fresh matcher fed ``token_ids`` (all -1 once terminated)."""
    matcher = xgr.GrammarMatcher(_compiled(constraint))
    assert all(matcher.accept_token(t) for t in token_ids)
    row = np.full((1, -(-VOCAB_SIZE // 32)), -1, dtype=np.int32)
    if not matcher.is_terminated():
        matcher.fill_next_token_bitmask(row, 0)
    return row[0]


# ---------------------------------------------------------------- the matcher (no model)


def test_validate_tokens_keeps_the_longest_valid_prefix_and_leaves_the_matcher():
    choice = CONSTRAINTS["choice"]
    state = _state(choice)
    output = [ord("m")]  # "maybe" is the only choice left
    drafts = [ord(c) for c in "aybz"]  # "z" breaks it, and nothing after it counts
    assert state.validate_tokens(output, [*drafts, ord("e")]) == [ord(c) for c in "ayb"]
    assert state.validate_tokens(output, [ord("x"), ord("a")]) == []
    assert state.validate_tokens(output, []) == []
    # The end token completes the choice; nothing is allowed after it.
    tail = [ord(c) for c in "aybe"] + [EOS]
    assert state.validate_tokens(output, [*tail, ord("a")]) == tail
    # The matcher is still after the output: it takes the same tokens as a fresh one.
    assert state.matcher.accept_token(ord("a")) and not state.matcher.accept_token(ord("z"))


def test_fill_bitmask_gives_k_plus_one_rows_in_order_and_rolls_back():
    regex, choice = CONSTRAINTS["regex"], CONSTRAINTS["choice"]
    manager = StructuredOutputManager(None, vocab_size=VOCAB_SIZE, eos_token_ids=[EOS])
    requests = []
    for req_id, constraint, output in (
        ("r", regex, [ord("A"), ord("b")]),
        ("free", None, [ord("x")]),
        ("c", choice, [ord("m")]),
        ("c2", choice, []),
    ):
        request = Request(
            request_id=req_id,
            prompt_token_ids=[1, 2, 3],
            sampling_params=SamplingParams(max_tokens=16),
            structured_output=None if constraint is None else _state(constraint),
        )
        for t in output:
            request.append_output_token_ids(t)
        request.num_computed_tokens = request.num_tokens
        requests.append(request)
    drafts = {
        "r": [ord(c) for c in "c, 1"],
        "free": [ord("y")],
        "c": [ord(c) for c in "aybe"] + [EOS],  # ends with the end token: the last row is open
    }
    out = SchedulerOutput(scheduled_spec_decode_tokens=drafts)
    manager.fill_bitmask(out, requests)
    assert out.structured_output_request_ids == ["r"] * 5 + ["c"] * 6 + ["c2"]
    expected = [_mask_after(regex, [ord("A"), ord("b"), *drafts["r"][:i]]) for i in range(5)]
    expected += [_mask_after(choice, [ord("m"), *drafts["c"][:i]]) for i in range(6)]
    expected += [_mask_after(choice, [])]
    assert out.grammar_bitmask.tolist() == np.array(expected).tolist()
    assert (out.grammar_bitmask[10] == -1).all()  # after the end token
    # Each matcher is back after its verified output: the sampled tokens are accepted as usual.
    for request in requests:
        if request.structured_output is not None:
            mask = _mask_after(
                regex if request.request_id == "r" else choice, request.output_token_ids
            )
            row = np.empty((1, len(mask)), dtype=np.int32)
            request.structured_output.matcher.fill_next_token_bitmask(row, 0)
            assert row[0].tolist() == mask.tolist()


def test_fill_bitmask_refuses_a_draft_the_grammar_does_not_allow():
    choice = CONSTRAINTS["choice"]
    manager = StructuredOutputManager(None, vocab_size=VOCAB_SIZE, eos_token_ids=[EOS])
    request = Request(
        request_id="c",
        prompt_token_ids=[1],
        sampling_params=SamplingParams(max_tokens=8),
        structured_output=_state(choice),
    )
    request.num_computed_tokens = 1
    out = SchedulerOutput(scheduled_spec_decode_tokens={"c": [ord("y"), ord("z")]})
    with pytest.raises(RuntimeError, match="validated"):
        manager.fill_bitmask(out, [request])
    assert out.grammar_bitmask is None and out.structured_output_request_ids == []
    yes = [ord(c) for c in "yes"]  # rolled back: the matcher is at the start again
    assert request.structured_output.validate_tokens([], yes) == yes


# ---------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


def engine_for(model, **kwargs):
    """An engine whose structured outputs compile against the tiny model's characters (the
    manager would read a Hugging Face tokenizer, which the tiny model has not)."""
    engine = make_engine(model, **kwargs)
    # NOTE: the compile thread uses this compiler from the first constrained request on.
    engine.structured_output_manager._compiler = xgr.GrammarCompiler(
        _tokenizer_info(), max_threads=1
    )
    return engine


class GrammarBreakingProposer(ScriptedProposer):
    """Drafts each request's continuation, with the draft at ``break_at`` replaced by a token
    its grammar refuses there (``grammars``: request id -> its constraint)."""

    def __init__(self, prompt_lens, continuations, grammars, break_at=None):
        super().__init__(prompt_lens, continuations)
        self.grammars, self.break_at = grammars, break_at

    def propose(self, req_id, token_ids, max_num_tokens):
        drafts = super().propose(req_id, token_ids, max_num_tokens)
        at = self.break_at
        if at is not None and len(drafts) > at and self.grammars.get(req_id) is not None:
            before = [*token_ids[self.prompt_lens[req_id] :], *drafts[:at]]
            allowed = _mask_after(self.grammars[req_id], before)
            drafts[at] = next(t for t in range(VOCAB_SIZE) if not allowed[t // 32] >> t % 32 & 1)
        return drafts


def params_for(constraint, **kwargs) -> SamplingParams:
    kwargs = {"temperature": 0, "max_tokens": 60, **kwargs}
    return SamplingParams(structured_outputs=constraint, **kwargs)


def run(engine, prompts, params, proposer=None):
    """Generate ``prompts`` (ids "0", "1", ...; one SamplingParams each), checking the KV cache
    and every constrained request's matcher after each step (it has accepted exactly the
    request's output: the same mask as a fresh matcher fed that output). Returns each
    request's final output and the drafts scheduled per step for the constrained requests."""
    if proposer is not None:
        engine.runner.drafter = proposer
        engine.scheduler.drafts.adaptive = False
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    execute = engine.executor.execute_model
    drafted = []

    def recording(out):
        constrained = set(out.structured_output_request_ids)
        drafted.append(
            {r: list(d) for r, d in out.scheduled_spec_decode_tokens.items() if r in constrained}
        )
        return execute(out)

    engine.executor.execute_model = recording
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output.outputs[0]
        check_invariants(engine.kv_cache_manager)
        for request in engine.scheduler.get_running_requests():
            state = request.structured_output
            if state is None:
                continue
            row = np.empty((1, engine.structured_output_manager.bitmask_width), dtype=np.int32)
            state.matcher.fill_next_token_bitmask(row, 0)
            constraint = request.sampling_params.structured_outputs
            assert row[0].tolist() == _mask_after(constraint, request.output_token_ids).tolist()
    return [final[str(i)] for i in range(len(prompts))], drafted


def reference(model, prompts, params):
    outputs, _ = run(engine_for(model), prompts, params)
    return outputs


def proposer_for(engine, prompts, outputs, params, break_at=None):
    encode = engine.input_processor.process
    prompt_lens = {str(i): len(encode(p).token_ids) for i, p in enumerate(prompts)}
    continuations = {str(i): list(o.token_ids) for i, o in enumerate(outputs)}
    grammars = {str(i): p.structured_outputs for i, p in enumerate(params)}
    return GrammarBreakingProposer(prompt_lens, continuations, grammars, break_at)


def _check_json(output):
    if output.finish_reason == "stop":
        value = json.loads(output.text, strict=False)  # control characters
        assert set(value) == {"name", "age"} and 0 <= value["age"] <= 99


@pytest.mark.parametrize("kind", CONSTRAINTS)
@pytest.mark.parametrize("break_at", [None, 0, 1, 2], ids=["valid", "at 0", "at 1", "at 2"])
def test_greedy_output_equals_no_speculation_at_batch_1(tiny, kind, break_at):
    """Drafts of the target's own output, all valid (every one accepted) or with a token the
    grammar refuses at ``break_at`` (the drafts are cut there before they are scheduled)."""
    prompts, params = PROMPTS[:1], [params_for(CONSTRAINTS[kind])]
    expected = reference(tiny, prompts, params)
    engine = engine_for(tiny, speculative_config=NGRAM)
    proposer = proposer_for(engine, prompts, expected, params, break_at)
    got, drafted = run(engine, prompts, params, proposer)
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in expected]
    assert got[0].finish_reason == expected[0].finish_reason == "stop"
    if kind == "json":
        _check_json(got[0])
    counts = [len(d["0"]) for d in drafted if "0" in d]
    stats = engine.scheduler.get_stats().spec_decoding
    assert stats.num_accepted_tokens == stats.num_draft_tokens == sum(counts)
    # The refused draft and those after it are never scheduled; a short output leaves fewer
    # drafts to propose.
    most = min(4 if break_at is None else break_at, len(expected[0].token_ids) - 1)
    assert max(counts, default=0) == most


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_drafts_the_grammar_allows_but_the_target_does_not_take(tiny, kind):
    """The second draft of each proposal shifted by one token (``ScriptedProposer``'s wrong
    draft): where the grammar allows it (the next letter or digit) it is scheduled and the
    masked target rejects it; where it does not, the drafts are cut before it."""
    prompts, params = PROMPTS[:1], [params_for(CONSTRAINTS[kind])]
    expected = reference(tiny, prompts, params)
    engine = engine_for(tiny, speculative_config=NGRAM)
    proposer = proposer_for(engine, prompts, expected, params)
    proposer.wrong_at, proposer.vocab_size = 1, VOCAB_SIZE  # ScriptedProposer's own: token + 1
    got, drafted = run(engine, prompts, params, proposer)
    assert list(got[0].token_ids) == list(expected[0].token_ids)
    stats = engine.scheduler.get_stats().spec_decoding
    assert stats.num_accepted_tokens_per_pos[1:] == [0, 0, 0]
    counts = [len(d["0"]) for d in drafted if "0" in d]
    assert max(counts) == 4  # a shifted draft the grammar allows was verified, and rejected
    assert min(counts) == 1  # one it refuses ended the drafts


@pytest.mark.parametrize("break_at", [None, 1], ids=["valid", "at 1"])
def test_greedy_output_equals_no_speculation_with_several_requests(tiny, break_at):
    """Each kind of constraint and a free request in one batch, twice over (nine requests): the
    bitmask rows of each request land on its own verification rows."""
    prompts = [p for p in PROMPTS for _ in range(3)]
    kinds = [*CONSTRAINTS.values(), None] * 3
    params = [params_for(c, max_tokens=40) for c in kinds[: len(prompts)]]
    expected = reference(tiny, prompts, params)
    engine = engine_for(tiny, speculative_config=NGRAM)
    proposer = proposer_for(engine, prompts, expected, params, break_at)
    got, drafted = run(engine, prompts, params, proposer)
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    for output, p in zip(got, params, strict=True):
        if p.structured_outputs is CONSTRAINTS["json"]:
            _check_json(output)
    constrained_drafts = [len(d) for step in drafted for d in step.values()]
    assert max(constrained_drafts) == (4 if break_at is None else break_at)
    assert sum(len(step) > 1 for step in drafted) > 0  # several constrained requests drafted


def test_seeded_sampling_under_a_grammar_with_drafts(tiny):
    """Random sampling verifies drafts against masked distributions: every output is one the
    grammar allows (the row after a draft end token allows every token; its token is dropped)
    and the run repeats itself."""
    prompts = PROMPTS
    greedy_params = [params_for(c) for c in CONSTRAINTS.values()]
    drafts = reference(tiny, prompts, greedy_params)
    runs = []
    for _ in range(2):
        params = [params_for(c, temperature=0.8, seed=5) for c in CONSTRAINTS.values()]
        engine = engine_for(tiny, speculative_config=NGRAM)
        got, _ = run(engine, prompts, params, proposer_for(engine, prompts, drafts, params))
        assert engine.scheduler.get_stats().spec_decoding.num_draft_tokens > 0
        for output, constraint in zip(got, CONSTRAINTS.values(), strict=True):
            matcher = xgr.GrammarMatcher(_compiled(constraint))
            assert all(matcher.accept_token(t) for t in output.token_ids)
            assert output.finish_reason == "length" or matcher.is_terminated()
        runs.append([list(o.token_ids) for o in got])
    assert runs[0] == runs[1]


def test_a_draft_models_drafts_are_cut_by_the_grammar(tiny):
    """The target drafting for itself as a draft model (speculative_config "draft_model"): its
    drafts are its unmasked greedy tokens, cut at the first the grammar refuses; each one kept
    is also the masked argmax, so every scheduled draft is accepted, and the output is the one
    without speculation."""
    prompts, params = PROMPTS, [params_for(c) for c in CONSTRAINTS.values()]
    expected = reference(tiny, prompts, params)
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": "tiny"}
    engine = engine_for(tiny, speculative_config=spec, draft_model=tiny)
    engine.scheduler.drafts.adaptive = False
    got, _ = run(engine, prompts, params)
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in expected]
    stats = engine.scheduler.get_stats().spec_decoding
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
