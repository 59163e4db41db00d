"""Beam search in the engine: beams fork their KV blocks (copy-on-write), never recompute them,
and choose exactly what Hugging Face transformers' beam search chooses.

Fast tests use tiny random models: a Gemma 3 that exists in both pagedkv and transformers on the
same weights (so the token-for-token comparison with ``generate(num_beams=...)`` runs in
seconds, with sliding-window layers, and with an end-of-sequence token made likely so that
finished hypotheses and the early-stop rule are exercised), and a Llama for the scheduler's
bookkeeping. The slow test compares the real default model with transformers on chat prompts.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from _tiny_model import tiny_gemma3_hf_model, tiny_gemma3_loaded_model, tiny_loaded_model

from pagedkv.core.invariants import check_invariants
from pagedkv.engine import beam_search as bs
from pagedkv.engine.beam_search import (
    BeamSearchGroup,
    BeamSearchOutput,
    beam_search_output,
    f32,
    length_penalty_divisor,
    penalised_score,
)
from pagedkv.engine.llm import LLM
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import Logprob
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import BeamSearchParams, SamplingParams

# ------------------------------------------------------------------------------- helpers


def hf_beam_search(
    model, prompt_ids, width, max_tokens, length_penalty, *, ignore_eos=False, eos=None
):
    """transformers' beam search (one prompt, no padding): the ``width`` sequences best first,
    each cut after its end-of-sequence token, and their scores."""
    config = copy.deepcopy(model.generation_config)
    if ignore_eos:
        config.eos_token_id = None
    eos = config.eos_token_id if eos is None else eos
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    sequences = []
    for row in out.sequences:
        generated = row[len(prompt_ids) :].tolist()
        if not ignore_eos and eos in generated:
            generated = generated[: generated.index(eos) + 1]
        sequences.append(generated)
    return sequences, out.sequences_scores.tolist()


class StepChecks:
    """Wraps an engine so that every step checks the KV cache's invariants (every holder's
    blocks, no two writers) and records the scheduled tokens and the live beams of each step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.scheduled: list[int] = []
        schedule = engine.scheduler.schedule
        step = engine.step

        def counting_schedule():
            out = schedule()
            self.scheduled.append(out.total_num_scheduled_tokens)
            return out

        def checked_step():
            outputs = step()
            scheduler = engine.scheduler
            check_invariants(engine.kv_cache_manager, [r for r, _ in scheduler.request_states()])
            return outputs

        engine.scheduler.schedule = counting_schedule
        engine.step = checked_step


def tiny_llm(loaded, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 256)
    kwargs.setdefault("max_model_len", 128)
    kwargs.setdefault("block_size", 4)
    return LLM(loaded_model=loaded, dtype="float32", num_threads=1, **kwargs)


def run(engine: LLMEngine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id not in final, "reported after it finished"
            if output.finished:
                final[output.request_id] = output
    return final


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


@pytest.fixture(scope="module")
def tiny_gemma3_pair():
    """transformers' tiny Gemma 3 and ours on the same weights, with the end-of-sequence token's
    embedding (tied to its output row) scaled up so that it often ranks among the candidates."""
    hf = tiny_gemma3_hf_model()
    with torch.no_grad():
        hf.model.embed_tokens.weight[hf.generation_config.eos_token_id] *= 3.0
    return hf, tiny_gemma3_loaded_model(hf)


# ------------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2.0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": True, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": "4"}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "ignore_eos": 1}, "ignore_eos"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": -0.5}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": math.nan}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": math.inf}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": math.nan}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": "1"}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "include_stop_str_in_output": None}, None),
    ],
)
def test_beam_search_params_name_the_bad_field(kwargs, param):
    param = param or "include_stop_str_in_output"
    with pytest.raises(InvalidRequestError, match=param) as info:
        BeamSearchParams(**kwargs)
    assert info.value.param == param


def test_beam_search_params_are_vllms():
    params = BeamSearchParams(4, 16)
    assert (params.beam_width, params.max_tokens, params.ignore_eos, params.temperature) == (
        4,
        16,
        False,
        0.0,
    )
    assert (params.length_penalty, params.include_stop_str_in_output) == (1.0, False)


def test_float32_steps_are_torchs():
    """The group ranks candidates in float32 the way transformers' tensors compute: a sum of
    two float32, and a float32 divided by a Python float (torch rounds the scalar to float32
    first: dividing by the exact double differs in about one case in five)."""
    rng = random.Random(0)
    for _ in range(2000):
        a, b = f32(-rng.random() * 60), f32(-rng.random() * 20)
        assert f32(a + b) == (torch.tensor([a]) + torch.tensor([b])).item()
        n, lp = rng.randint(1, 3000), rng.choice([0.0, 0.5, 1.0, 1.3, 2.0, -1.0])
        assert f32(a / length_penalty_divisor(n, lp)) == (torch.tensor([a]) / (n**lp)).item()
    assert f32(1e39) == math.inf and f32(-1e39) == -math.inf
    assert length_penalty_divisor(10**6, 1e6) == math.inf


def test_a_length_penalty_whose_divisor_underflows_ranks_like_torch(tiny):
    """A very negative length_penalty (a finite number, so accepted) makes L ** length_penalty
    underflow to 0 in float32 from L = 2 on: the score divides as torch's float32 does (-inf),
    and the search finishes instead of raising ZeroDivisionError in the step (which, behind the
    server, left the request hanging)."""
    assert length_penalty_divisor(2, -200.0) == 0.0
    assert penalised_score(f32(-1.5), 0.0) == -math.inf
    assert penalised_score(f32(-1.5), 0.0) == (torch.tensor([-1.5]) / 0.0).item()
    assert penalised_score(0.0, 0.0) == -math.inf  # torch: NaN; -inf keeps the order total
    llm = tiny_llm(tiny)
    for length_penalty in (-200.0, -1e308):
        (output,) = llm.beam_search(
            ["paged attention"], BeamSearchParams(2, 6, length_penalty=length_penalty)
        )
        assert len(output.sequences) == 2
        assert all(s.finish_reason in ("stop", "length") for s in output.sequences)


# ------------------------------------------------------------------------------- vs transformers


def test_equals_transformers_on_a_tiny_gemma3(tiny_gemma3_pair):
    """Token for token, all beam_width sequences in transformers' order, for widths 2 to 4 and
    four length penalties; the scores agree to float32 noise. The sequences end by EOS or by
    length, and some searches stop early (transformers' heuristic)."""
    hf, ours = tiny_gemma3_pair
    llm = tiny_llm(ours, max_model_len=100)
    prompts = [[ord(c) % 96 for c in text] for text in ("hello world", "abc", "paged attn!")]
    max_tokens = 12
    num_stopped = num_early = 0
    for width in (2, 3, 4):
        for length_penalty in (1.0, 0.0, 2.0, -1.0):
            params = BeamSearchParams(width, max_tokens, length_penalty=length_penalty)
            outputs = llm.beam_search(prompts, params)
            for prompt, output in zip(prompts, outputs, strict=True):
                expected, scores = hf_beam_search(hf, prompt, width, max_tokens, length_penalty)
                got = [s.tokens[len(prompt) :] for s in output.sequences]
                assert got == expected, (width, length_penalty, prompt)
                for sequence, score in zip(output.sequences, scores, strict=True):
                    length = len(sequence.tokens) - len(prompt)
                    assert sequence.cum_logprob / length**length_penalty == pytest.approx(
                        score, abs=1e-3
                    )
                num_stopped += sum(s.finish_reason == "stop" for s in output.sequences)
                num_early += max(len(s) for s in got) < max_tokens
    assert num_stopped > 20 and num_early > 0
    assert llm.get_stats().scheduler.num_used_blocks == 0


def test_ignore_eos_equals_transformers_without_eos(tiny_gemma3_pair):
    hf, ours = tiny_gemma3_pair
    llm = tiny_llm(ours, max_model_len=100)
    prompt = [ord(c) % 96 for c in "paged attn!"]
    params = BeamSearchParams(3, 10, ignore_eos=True)
    (output,) = llm.beam_search([prompt], params)
    expected, _ = hf_beam_search(hf, prompt, 3, 10, 1.0, ignore_eos=True)
    assert [s.tokens[len(prompt) :] for s in output.sequences] == expected
    assert all(s.finish_reason == "length" for s in output.sequences)


# ------------------------------------------------------------------------------- the engine side


def _record_decisions(monkeypatch) -> list[tuple[int, list[tuple[str, str]], bool]]:
    """Records each BeamSearchGroup.step: (the parents' token count at the fork, the
    continuations as (request id, parent id), done)."""
    decisions = []
    step = BeamSearchGroup.step

    def recording(self):
        num_tokens = {b.request_id: b.num_tokens for b in self.beams}
        result = step(self)
        continuations = [(r.request_id, p.request_id) for r, p, _ in result.continuations]
        parents = {p for _, p in continuations}
        decisions.append(([num_tokens[p] for p in parents], continuations, result.done))
        return result

    monkeypatch.setattr(BeamSearchGroup, "step", recording)
    return decisions


@pytest.mark.parametrize("prompt", ["hello wo", "hello wor"])  # 8 and 9 tokens
def test_beams_fork_share_blocks_and_never_recompute(tiny, monkeypatch, prompt):
    """Every step computes one token per live beam (no KV recomputed): the scheduled tokens
    are the prompt plus one per beam per step. A beam chosen k times forks k - 1 children
    (``num_forks``); when the parent's tokens end inside a block, the 1 + (k - 1) holders of
    that block all write into it next step: all but the last copy it (``num_cow_copies``), so
    one copy per child; none on a block boundary (4-token blocks). Unchosen beams are freed;
    at the end every block is."""
    decisions = _record_decisions(monkeypatch)
    llm = tiny_llm(tiny)
    engine = llm.engine
    checks = StepChecks(engine)
    width, max_tokens = 4, 10
    (output,) = llm.beam_search([prompt], BeamSearchParams(width, max_tokens, ignore_eos=True))
    stats = llm.get_stats().scheduler
    assert len(output.sequences) == width
    assert sum(checks.scheduled) == len(prompt) + stats.num_generation_tokens
    # After the prompt: one token per live beam per step, width beams from the first choice.
    assert checks.scheduled == [len(prompt)] + [width] * (max_tokens - 1)
    forks = copies = 0
    for parent_tokens, continuations, done in decisions:
        if done:
            continue
        assert len(set(parent_tokens)) == 1  # the beams of a step have one length
        num_children = len(continuations) - len(parent_tokens)
        forks += num_children
        copies += num_children if parent_tokens[0] % 4 else 0
    assert stats.num_forks == forks >= width - 1
    assert stats.num_cow_copies == copies > 0
    assert stats.num_used_blocks == 0 and stats.num_preemptions == 0
    assert engine.scheduler.get_num_unfinished_requests() == 0


def test_output_shape_text_and_logprobs(tiny):
    llm = tiny_llm(tiny)
    prompt = "paged attention"
    params = BeamSearchParams(3, 8)
    (output,) = llm.beam_search([prompt], params)
    assert isinstance(output, BeamSearchOutput) and len(output.sequences) == 3
    prompt_ids = llm.tokenizer.encode(prompt)
    scores = []
    for sequence in output.sequences:
        assert sequence.tokens[: len(prompt_ids)] == prompt_ids
        generated = sequence.tokens[len(prompt_ids) :]
        assert len(sequence.logprobs) == len(generated)
        total = 0.0
        for token_id, position in zip(generated, sequence.logprobs, strict=True):
            chosen = next(iter(position.items()))
            assert chosen[0] == token_id and isinstance(chosen[1], Logprob)
            assert len(position) >= 2 * params.beam_width  # the chosen token and the K candidates
            total = f32(total + chosen[1].logprob)
        assert sequence.cum_logprob == total
        text_ids = generated[:-1] if sequence.finish_reason == "stop" else generated
        assert sequence.text == llm.tokenizer.decode(text_ids, skip_special_tokens=False)
        assert sequence.finish_reason in ("stop", "length")
        scores.append(sequence.cum_logprob / len(generated) ** params.length_penalty)
    assert scores == sorted(scores, reverse=True)


def test_engine_request_kind_reports_once_and_aborts_whole(tiny):
    """Through LLMEngine.add_request / step / abort_request (what the server drives): a beam
    search streams nothing and reports once, finished; an abort frees every beam."""
    engine = LLMEngine(loaded_model=tiny, dtype="float32", num_threads=1, block_size=4)
    engine.add_request("b", "hello world", BeamSearchParams(4, 6, ignore_eos=True))
    engine.add_request("g", "hello world", SamplingParams(temperature=0, max_tokens=6))
    reports = []
    while engine.has_unfinished_requests():
        reports += [o for o in engine.step() if o.request_id == "b"]
    (final,) = reports
    assert final.finished and len(final.outputs) == 4
    sequences = beam_search_output(final).sequences
    assert [s.tokens[len(final.prompt_token_ids) :] for s in sequences] == [
        o.token_ids for o in final.outputs
    ]
    # abort after the beams forked
    engine.add_request("c", "hello world", BeamSearchParams(4, 20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.get_num_unfinished_requests() == 4 and engine.kv_cache_manager.usage > 0
    engine.abort_request("c")
    assert engine.kv_cache_manager.usage == 0.0 and not engine.scheduler.has_unfinished_requests()
    (aborted,) = engine.step()
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="abort"):
        beam_search_output(aborted)
    engine.abort_request("c")  # twice: nothing


def test_a_failing_step_ends_the_search_with_an_error(tiny, monkeypatch):
    engine = LLMEngine(loaded_model=tiny, dtype="float32", num_threads=1, block_size=4)
    engine.add_request("b", "hello world", BeamSearchParams(3, 8))
    engine.step()
    engine.step()

    def broken(scheduler_output):
        raise RuntimeError("model blew up")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "execute_model", broken)
        with pytest.raises(RuntimeError, match="blew up"):
            engine.step()
    final = run(engine)["b"]
    assert final.outputs[0].finish_reason == "error" and "blew up" in final.outputs[0].error
    assert engine.kv_cache_manager.usage == 0.0


def test_requests_that_can_never_run_are_refused_and_queue_nothing(tiny):
    llm = tiny_llm(tiny, num_blocks=41, max_model_len=64, max_num_seqs=8)
    engine = llm.engine
    cases = [
        (BeamSearchParams(9, 4), "beam_width", "max_num_seqs"),
        # 8 beams x cdiv(20 + 20, 4) = 80 blocks > 40
        (BeamSearchParams(8, 20), "beam_width", "whole pool"),
        (BeamSearchParams(2, 60), "max_tokens", "max_model_len"),
        (BeamSearchParams(65, 4), "beam_width", "vocabulary"),
    ]
    for params, param, message in cases:
        with pytest.raises(InvalidRequestError, match=message) as info:
            engine.add_request("x", "a" * 20, params)
        assert info.value.param == param
        assert not engine.has_unfinished_requests()
        assert not engine.scheduler.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="BeamSearchParams"):
        llm.beam_search(["a"], SamplingParams())
    assert llm.beam_search([], BeamSearchParams(2, 4)) == []


def test_preempted_beams_recompute_and_the_result_does_not_change(tiny):
    """A pool too small for every beam of three searches and a plain request at once: beams
    are preempted (their KV freed, recomputed when they return; a beam waiting for a preempted
    sibling holds its place), and a search whose beams all wait for room is taken out whole
    and brought back whole. The result is the one with room to spare; every block is freed."""
    prompts = ["paged attention is", "hello world", "block tables!!"]
    params = BeamSearchParams(4, 12, ignore_eos=True)
    roomy = tiny_llm(tiny).beam_search(prompts, params)
    llm = tiny_llm(tiny, num_blocks=33, max_num_batched_tokens=16)
    engine = llm.engine
    StepChecks(engine)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    engine.add_request("plain", "x" * 30, SamplingParams(temperature=0, max_tokens=12))
    final = run(engine)
    stats = llm.get_stats().scheduler
    assert stats.num_preemptions > 0
    for i, expected in enumerate(roomy):
        got = beam_search_output(final[str(i)])
        assert [s.tokens for s in got.sequences] == [s.tokens for s in expected.sequences]
    assert stats.num_used_blocks == 0 and not engine.scheduler.has_unfinished_requests()


def test_beams_synchronise_when_the_token_budget_splits_them(tiny):
    """A budget of 3 tokens a step for 4 beams: some beams compute a step later and the ones
    that reported wait for them; the result is unchanged."""
    params = BeamSearchParams(4, 8, ignore_eos=True)
    expected = tiny_llm(tiny).beam_search(["hello world"], params)
    llm = tiny_llm(tiny, max_num_batched_tokens=3)
    StepChecks(llm.engine)
    got = llm.beam_search(["hello world"], params)
    assert [s.tokens for s in got[0].sequences] == [s.tokens for s in expected[0].sequences]


def test_hypotheses_rank_by_length_penalised_score():
    """The group alone, fed by hand (K = 4 candidates for 2 beams, EOS = 9): an EOS candidate
    among the first beam_width becomes a hypothesis scored cum / L ** length_penalty; one
    ranked lower is dropped; a full set of hypotheses that the best beam cannot beat ends the
    search (transformers' early_stopping=False heuristic)."""
    from pagedkv.engine.request import Request

    def make_root(request_id, params):
        return Request(request_id=request_id, prompt_token_ids=[1, 2], sampling_params=params)

    group = BeamSearchGroup("r", BeamSearchParams(2, 10), frozenset({9}), make_root)
    assert group.num_candidates == 4
    root = group.root
    # step 1: EOS is the best candidate -> a hypothesis of 1 token; beams: tokens 5, 6
    assert group.report(root, [9, 5, 6, 7], [-0.1, -0.5, -1.0, -2.0])
    first = group.step()
    assert [t for _, _, t in first.continuations] == [5, 6]
    child = first.continuations[1][0]
    assert child is not root and child.request_id == "r#beam1"
    assert group.num_generated == 1 and not first.done
    # step 2: beam 5's candidates beat beam 6's; EOS ranked 5th overall: dropped.
    group.report(root, [3, 4, 7, 8], [-0.1, -0.2, -0.3, -0.4])
    assert group.report(child, [9, 1, 2, 3], [-5.0, -6.0, -6.1, -6.2])
    second = group.step()
    assert [t for _, _, t in second.continuations] == [3, 4]
    assert second.dropped == [child]
    # step 3: a second hypothesis (EOS first): 2 kept; the best beam's score at length 3 is
    # below both, so the search ends.
    beams = [r for r, _, _ in second.continuations]
    group.report(beams[0], [9, 1, 2, 3], [-0.05, -9.0, -9.1, -9.2])
    group.report(beams[1], [1, 2, 3, 4], [-9.0, -9.1, -9.2, -9.3])
    third = group.step()
    assert third.done and set(third.dropped) == set(beams)
    hyps = group.hypotheses
    assert [h.token_ids for h in hyps] == [[9], [5, 3, 9]]
    assert hyps[0].score == f32(-0.1) and hyps[0].finish_reason == "stop"
    assert hyps[1].cum_logprob == f32(f32(f32(-0.5) + f32(-0.1)) + f32(-0.05))
    assert hyps[1].score == f32(hyps[1].cum_logprob / 3.0)
    with pytest.raises(InvalidRequestError):
        group.step()
    assert bs.num_beam_candidates(4, 0) == 8 and bs.num_beam_candidates(4, 2) == 12


# ------------------------------------------------------------------------------- the real model

MAX_NEW_TOKENS = 16


@pytest.mark.slow
def test_equals_transformers_on_the_default_model(loaded_fp32, hf_model, chat_prompt_ids):
    """The default model in fp32 against transformers' ``generate(num_beams=w, do_sample=False,
    length_penalty=..., early_stopping=False)`` on the same weights: every sequence token for
    token and in the same order, for 2 chat prompts, widths 2 and 4, length penalties 1.0 and
    0.5; with the invariants checked every step, each step computing one token per live beam,
    and every block freed at the end."""
    prompts = chat_prompt_ids[:2]
    llm = LLM(
        dtype="float32",
        loaded_model=loaded_fp32,
        attention_backend="torch",
        num_blocks=512,
        max_model_len=512,
    )
    engine = llm.engine
    checks = StepChecks(engine)
    for width in (2, 4):
        for length_penalty in (1.0, 0.5):
            params = BeamSearchParams(width, MAX_NEW_TOKENS, length_penalty=length_penalty)
            before = llm.get_stats().scheduler
            scheduled_before = sum(checks.scheduled)
            outputs = llm.beam_search(prompts, params)
            stats = llm.get_stats().scheduler
            for prompt, output in zip(prompts, outputs, strict=True):
                expected, scores = hf_beam_search(
                    hf_model, prompt, width, MAX_NEW_TOKENS, length_penalty
                )
                got = [s.tokens[len(prompt) :] for s in output.sequences]
                assert got == expected, (width, length_penalty)
                for sequence, score in zip(output.sequences, scores, strict=True):
                    length = len(sequence.tokens) - len(prompt)
                    assert sequence.cum_logprob / length**length_penalty == pytest.approx(
                        score, abs=1e-3
                    )
            # No KV recomputed: the prompts (less their prefix-cache hits) and one token per
            # live beam per step, nothing else.
            hits = stats.prefix_cache_hits - before.prefix_cache_hits
            tokens = stats.num_generation_tokens - before.num_generation_tokens
            assert (
                sum(checks.scheduled) - scheduled_before == sum(map(len, prompts)) - hits + tokens
            )
            assert stats.num_forks > before.num_forks
            assert stats.num_preemptions == 0 and stats.num_used_blocks == 0


# ------------------------------------------------------------------------------- the rare paths


def _eat_free_blocks(engine: LLMEngine) -> list:
    """Requests outside the scheduler that take every free block (free them with
    ``_release``): the pool looks full to the scheduler."""
    from pagedkv.engine.request import Request

    manager = engine.kv_cache_manager
    eaters = []
    while manager.num_free_blocks:
        num_tokens = min(manager.num_free_blocks * manager.block_size, engine.max_model_len)
        eater = Request(request_id=f"eater{len(eaters)}", prompt_token_ids=[0] * num_tokens)
        assert manager.allocate_slots(eater, num_tokens) is not None
        eaters.append(eater)
    return eaters


def _release(engine: LLMEngine, eaters: list) -> None:
    for eater in eaters:
        engine.kv_cache_manager.free(eater)


def test_a_child_without_a_free_block_recomputes_and_the_result_does_not_change(tiny):
    """A beam chosen again forks a child, but no block is free at that moment (the child's
    first write needs one): the child is queued instead and computes its KV itself (prefix-cache
    hits on the full blocks), and the search gives what it gives with room."""
    params = BeamSearchParams(3, 8, ignore_eos=True)
    expected = tiny_llm(tiny).beam_search(["hello world"], params)
    engine = tiny_llm(tiny).engine
    scheduler = engine.scheduler
    update = scheduler.update_from_output
    queued = []

    def starved_update(scheduler_output, runner_output):
        eater = _eat_free_blocks(engine)
        waiting = scheduler.num_waiting
        try:
            return update(scheduler_output, runner_output)
        finally:
            queued.append(scheduler.num_waiting - waiting)
            _release(engine, eater)

    scheduler.update_from_output = starved_update
    engine.add_request("b", "hello world", params)
    final = run(engine)["b"]
    # The first choice forks the root twice with nothing to free: both children queue. Later
    # choices free the beams not chosen first, which gives the forks their blocks.
    assert queued[0] == 2
    got = beam_search_output(final)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in expected[0].sequences]
    assert engine.kv_cache_manager.usage == 0.0


def test_beams_waiting_for_siblings_that_do_not_fit_are_taken_out_whole(tiny):
    """Two searches whose running beams all wait for a preempted sibling that finds no room
    (the pool is full): rather than a step that computes nothing forever, every such search is
    preempted whole and its beams queued together, in order, at the front, oldest search
    first; both finish with the result they have with room."""
    params = BeamSearchParams(2, 8, ignore_eos=True)
    prompts = {"a": "hello world", "b": "paged attn"}
    expected = {
        k: out
        for k, out in zip(
            prompts, tiny_llm(tiny).beam_search(list(prompts.values()), params), strict=True
        )
    }
    engine = tiny_llm(tiny).engine
    scheduler = engine.scheduler
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    while len(scheduler.get_running_requests()) < 4:  # both searches have forked their second beam
        engine.step()
    groups = [scheduler.get_request(f"{k}#beam0").beam_group for k in ("a", "b")]
    # Preempt one beam of each search, then fill the pool: the other beams compute their token,
    # report, and wait for the preempted ones, which cannot come back.
    for group in groups:
        scheduler.queues.preempt(group.beams[1])
    eater = _eat_free_blocks(engine)
    engine.step()  # the running beams report
    parked = list(scheduler.get_running_requests())
    assert len(parked) == 2 and all(g.has_reported(b) for g, b in zip(groups, parked, strict=True))
    out = scheduler.schedule()
    # Nothing could run: both searches were taken out whole (their parked beams preempted),
    # which freed room for the oldest one to come back whole; the other waits, in order.
    assert out.preempted_req_ids == {b.request_id for b in parked}
    assert list(out.num_scheduled_tokens) == [b.request_id for b in groups[0].beams]
    waiting = [r.request_id for r, where in scheduler.request_states() if where == "waiting"]
    assert waiting == [b.request_id for b in groups[1].beams]
    engine._process_outputs(scheduler.update_from_output(out, engine.executor.execute_model(out)))
    _release(engine, eater)
    final = run(engine)
    for request_id, output in expected.items():
        got = beam_search_output(final[request_id])
        assert [s.tokens for s in got.sequences] == [s.tokens for s in output.sequences]
    assert engine.kv_cache_manager.usage == 0.0


def test_random_workloads_under_pressure_give_the_result_with_room(tiny):
    """Random mixes of beam searches (widths 3-4, some ignoring EOS) and plain requests, in
    pools barely larger than the widest search needs alone, with small token budgets, few seats
    and prefix caching on or off: every step keeps the KV invariants, nothing gets stuck, every
    block is freed, and each request gives what it gives with room to spare."""
    rng = random.Random(1234)
    roomy = tiny_llm(tiny, num_blocks=400, max_model_len=64).engine
    num_preemptions = 0
    for trial in range(15):
        requests = []
        for i in range(rng.randint(3, 7)):
            prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(3, 14)))
            max_tokens = rng.randint(4, 16)
            if rng.random() < 0.25:
                params = SamplingParams(temperature=0, max_tokens=max_tokens)
            else:
                params = BeamSearchParams(
                    rng.choice([3, 4, 4]), max_tokens, ignore_eos=rng.random() < 0.5
                )
            requests.append((f"r{i}", prompt, params))
        need = max(
            -(-(len(prompt) + params.max_tokens) // 4) * getattr(params, "beam_width", 1)
            for _, prompt, params in requests
        )
        engine = tiny_llm(
            tiny,
            num_blocks=max(need + 1 + rng.randint(0, 2), 17),
            max_model_len=64,
            max_num_batched_tokens=rng.choice([4, 8, 16, 64]),
            max_num_seqs=rng.choice([4, 6, 8, 16]),
            enable_prefix_caching=rng.random() < 0.7,
        ).engine
        StepChecks(engine)
        for request_id, prompt, params in requests:
            engine.add_request(request_id, prompt, params)
            roomy.add_request(f"{trial}-{request_id}", prompt, params)
        got, expected = run(engine), run(roomy)
        for request_id, _, _ in requests:
            assert [o.token_ids for o in got[request_id].outputs] == [
                o.token_ids for o in expected[f"{trial}-{request_id}"].outputs
            ], (trial, request_id)
        stats = engine.get_stats().scheduler
        assert stats.num_used_blocks == 0 and not engine.scheduler.has_unfinished_requests()
        num_preemptions += stats.num_preemptions
    assert num_preemptions > 10
