"""Every sampling field has its exact effect (vLLM's semantics), on the sampler's transforms and
through the engine with the tiny model: penalties, min_p, min_tokens, logit_bias, stop_token_ids,
include_stop_str_in_output; logprobs and prompt logprobs (consistent with each other, across
chunked prefill, preemption and the prefix cache); vLLM's prompt forms in LLM.generate."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from _tiny_model import EOS, VOCAB_SIZE, tiny_loaded_model

from pagedkv.engine.llm import LLM
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import (
    FLOAT32_MAX,
    FLOAT32_MIN_NORMAL,
    GREEDY_EPSILON,
    SamplingParams,
)
from pagedkv.worker.sampler import (
    Sampler,
    _apply_min_p,
    _apply_min_tokens,
    _apply_penalties,
    apply_logit_bias,
    gather_logprobs,
)

PROMPT = "the quick brown fox jumps over the lazy dog. " * 2  # 90 tokens


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


def make_llm(tiny, **kwargs) -> LLM:
    options = {"num_blocks": 80, "max_model_len": 256, "block_size": 4} | kwargs
    return LLM(loaded_model=tiny, dtype="float32", num_threads=1, **options)


def greedy(max_tokens=12, **kwargs) -> SamplingParams:
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


# ---- the transforms, exact values ------------------------------------------------------------


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    _apply_penalties(logits, params, output_token_ids=[[1, 1, 2]], prompt_token_ids=[[0, 4]])
    # token 0 (prompt, > 0): 2 / 2; token 1 (output twice, < 0): -1 * 2 - 2 * 0.5 - 0.25;
    # token 2 (output once): 0.5 / 2 - 0.5 - 0.25; token 3 unseen; token 4 (prompt, < 0): * 2.
    assert logits.tolist() == [[1.0, -3.25, -0.5, 3.0, -1.0]]


def test_presence_and_frequency_ignore_the_prompt_repetition_does_not():
    logits = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    params = [SamplingParams(presence_penalty=1.0), SamplingParams(repetition_penalty=4.0)]
    _apply_penalties(logits, params, [[], []], [[0], [0]])
    assert logits.tolist() == [[1.0, 1.0], [0.25, 1.0]]


def test_penalty_rows_leave_other_rows_alone():
    logits = torch.ones(3, 4)
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams()]
    _apply_penalties(logits, params, [[0], [3, 3], [1]], None)
    assert logits.tolist() == [[1.0] * 4, [1.0, 1.0, 1.0, -1.0], [1.0] * 4]


def test_logit_bias_is_added_and_clamped():
    params = SamplingParams(logit_bias={3: 500, 1: -1.5, 2: -1e9})
    assert params.logit_bias == {3: 100.0, 1: -1.5, 2: -100.0}
    logits = torch.zeros(2, 5)
    apply_logit_bias(logits, [SamplingParams(), params])
    assert logits.tolist() == [[0.0] * 5, [0.0, -1.5, -100.0, 100.0, 0.0]]


def test_min_tokens_masks_stop_ids_until_reached():
    params = [SamplingParams(min_tokens=2), SamplingParams(min_tokens=2), SamplingParams()]
    logits = torch.zeros(3, 4)
    stops = [[1, 3], [1, 3], [1, 3]]
    _apply_min_tokens(logits, params, [[0], [0, 0], []], stops)
    inf = float("-inf")
    assert logits.tolist() == [[0.0, inf, 0.0, inf], [0.0] * 4, [0.0] * 4]


def test_min_p_drops_tokens_below_the_fraction_of_the_top():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    _apply_min_p(logits, [0.35])  # threshold 0.175: keeps 0.5 and 0.3
    assert torch.isinf(logits).tolist() == [[False, False, True, True]]
    out = Sampler(0)(probs.log().repeat(300, 1), [SamplingParams(min_p=0.35)] * 300, [None] * 300)
    assert set(out.tolist()) == {0, 1}


def test_gather_logprobs_ranks_and_top_k():
    logprobs = torch.tensor([[-0.5, -2.0, -1.0, -1.0]])
    ids, values, ranks = gather_logprobs(logprobs, torch.tensor([2]), 2)
    assert ids.tolist() == [[2, 0, 2]] or ids.tolist() == [[2, 0, 3]]
    assert values.tolist()[0][:2] == [-1.0, -0.5] and ranks.tolist() == [3]  # ties count


@pytest.mark.parametrize(
    "kwargs",
    [
        {"frequency_penalty": 5.0},
        {"presence_penalty": -2.5},
        {"repetition_penalty": 0},
        {"repetition_penalty": float("inf")},
        {"min_p": 1.5},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 4},
        {"logit_bias": {"3": 1.0}},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {3: float("nan")}},
        {"logit_bias": [1, 2]},
        {"logprobs": -1},
        {"prompt_logprobs": 1.5},
    ],
)
def test_sampling_params_refuses(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


#: Every float field of SamplingParams and its closed range (the module docstring of
#: pagedkv.sampling_params has the arithmetic that makes these keep the sampler finite).
FLOAT_RANGES = {
    "temperature": (0.0, FLOAT32_MAX),
    "top_p": (FLOAT32_MIN_NORMAL, 1.0),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.01, 100.0),
}


@pytest.mark.parametrize("name", FLOAT_RANGES)
def test_float_fields_take_their_bounds_and_refuse_the_next_float_outside(name):
    low, high = FLOAT_RANGES[name]
    for value in (low, high):
        assert getattr(SamplingParams(**{name: value}), name) == value
    for value in (math.nextafter(low, -math.inf), math.nextafter(high, math.inf)):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**{name: value})
        assert info.value.param == name
        # The message gives the range and the value got.
        assert f"[{low:g}, {high:g}]" in str(info.value) and repr(value) in str(info.value)
    for value in (math.nan, math.inf, -math.inf, True, "1"):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**{name: value})
        assert info.value.param == name


@pytest.mark.parametrize("penalty", [1e-40, 1e-300, 5e-324, 0.009999, 100.0001, 1e30])
def test_repetition_penalty_that_would_overflow_the_logits_is_refused(penalty):
    """The fault: 1e-40 was accepted, a positive logit divided by it became +inf in float32 and
    the sampler drew token 0 from NaN probabilities."""
    with pytest.raises(InvalidRequestError, match=r"repetition_penalty .*\[0\.01, 100\]") as info:
        SamplingParams(repetition_penalty=penalty)
    assert info.value.param == "repetition_penalty"


def test_greedy_cut_off_of_temperature():
    assert SamplingParams(temperature=math.nextafter(GREEDY_EPSILON, 0)).greedy
    assert not SamplingParams(temperature=GREEDY_EPSILON).greedy


@pytest.mark.parametrize("bias", [100.0, -100.0, 100.5, -1e300, FLOAT32_MAX * 2])
def test_logit_bias_takes_any_finite_bias_clamped_to_100(bias):
    params = SamplingParams(logit_bias={7: bias})
    assert params.logit_bias == {7: max(-100.0, min(100.0, bias))}


@pytest.mark.parametrize("bias", [math.inf, -math.inf, math.nan, True, "1"])
def test_logit_bias_refuses_a_bias_that_is_not_a_finite_number(bias):
    with pytest.raises(InvalidRequestError, match=r"logit_bias\[7\].*got") as info:
        SamplingParams(logit_bias={7: bias})
    assert info.value.param == "logit_bias"


def test_engine_refuses_ids_outside_the_vocabulary_and_too_many_logprobs(tiny):
    engine = make_llm(tiny).engine
    for params in (
        greedy(logit_bias={VOCAB_SIZE: 1.0}),
        greedy(stop_token_ids=[VOCAB_SIZE + 5]),
        greedy(logprobs=21),
        greedy(prompt_logprobs=21),
    ):
        with pytest.raises(InvalidRequestError):
            engine.add_request("bad", "hi", params)
    assert not engine.has_unfinished_requests()


# ---- through the engine: each transform's exact effect on greedy decoding ----------------------


def logits_spy(llm: LLM, monkeypatch) -> list[torch.Tensor]:
    """Record the raw logits the runner hands to the sampler (one row per sampling request)."""
    model = llm.engine.runner.model
    compute = model.compute_logits
    seen: list[torch.Tensor] = []

    def spy(hidden):
        logits = compute(hidden)
        seen.append(logits.clone())
        return logits

    monkeypatch.setattr(model, "compute_logits", spy)
    return seen


def reference_transform(row, prompt, generated, params):
    """The sampling transforms written out per token, independently of the sampler."""
    row = row.tolist()
    for token, bias in (params.logit_bias or {}).items():
        row[token] += bias
    for token in range(len(row)):
        count = generated.count(token)
        if token in prompt or count:
            r = params.repetition_penalty
            row[token] = row[token] / r if row[token] > 0 else row[token] * r
        row[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return row


@pytest.mark.parametrize(
    "field",
    [
        {"presence_penalty": 2.0},
        {"frequency_penalty": 1.5},
        {"repetition_penalty": 3.0},
        {"repetition_penalty": 0.5},
        {"logit_bias": {ord("e"): 2.5, ord("o"): 4.0, ord("q"): -3.0}},
    ],
)
def test_each_transform_changes_greedy_output_exactly_as_specified(tiny, monkeypatch, field):
    llm = make_llm(tiny)
    prompt = llm.get_tokenizer().encode(PROMPT)
    plain = llm.generate(PROMPT, greedy(24), use_tqdm=False)[0].token_ids
    seen = logits_spy(llm, monkeypatch)
    params = greedy(24, **field)
    tokens = llm.generate(PROMPT, params, use_tqdm=False)[0].token_ids
    assert tokens != plain  # the field has an effect
    assert len(seen) == len(tokens)
    for t, logits in enumerate(seen):
        row = reference_transform(logits[0], prompt, tokens[:t], params)
        assert tokens[t] == max(range(len(row)), key=row.__getitem__)


def test_logit_bias_forces_a_token(tiny):
    out = make_llm(tiny).generate(PROMPT, greedy(5, logit_bias={ord("Z"): 100}), use_tqdm=False)
    assert out[0].text == "ZZZZZ"


def test_min_tokens_suppresses_eos_and_stop_token_ids(tiny):
    llm = make_llm(tiny)
    force_eos = {EOS: 100.0}
    (early,) = llm.generate(PROMPT, greedy(10, ignore_eos=False, logit_bias=force_eos), False)
    assert early.token_ids == [EOS] and early.finish_reason == "stop"
    params = greedy(10, ignore_eos=False, logit_bias=force_eos, min_tokens=4)
    (late,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert len(late.token_ids) == 5 and EOS not in late.token_ids[:4]
    assert late.token_ids[4] == EOS and late.finish_reason == "stop"
    # A stop token id: masked until min_tokens too; its text is left out unless asked for.
    a = ord("A")
    for include in (False, True):
        params = greedy(
            10,
            stop_token_ids=[a],
            logit_bias={a: 100.0},
            min_tokens=3,
            include_stop_str_in_output=include,
        )
        (out,) = llm.generate(PROMPT, params, use_tqdm=False)
        assert len(out.token_ids) == 4 and out.token_ids[3] == a and a not in out.token_ids[:3]
        assert out.outputs[0].stop_reason == a and out.finish_reason == "stop"
        assert out.text == llm.get_tokenizer().decode(out.token_ids[: 4 if include else 3])


def test_stop_strings_are_not_looked_for_before_min_tokens(tiny):
    llm = make_llm(tiny)
    x = {ord("x"): 100.0}
    (plain,) = llm.generate(PROMPT, greedy(10, stop=["x"], logit_bias=x), use_tqdm=False)
    assert plain.token_ids == [ord("x")] and plain.text == ""
    (late,) = llm.generate(
        PROMPT, greedy(10, stop=["x"], logit_bias=x, min_tokens=3), use_tqdm=False
    )
    assert late.token_ids == [ord("x")] * 4 and late.text == "xxx"
    assert late.finish_reason == "stop" and late.outputs[0].stop_reason == "x"


# ---- logprobs ------------------------------------------------------------------------------------


def test_sample_logprobs_are_raw_and_consistent(tiny):
    llm = make_llm(tiny)
    params = SamplingParams(
        temperature=0.8,
        top_k=5,
        presence_penalty=1.0,
        seed=7,
        max_tokens=8,
        logprobs=3,
        ignore_eos=True,
    )
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    sample = out.outputs[0]
    assert len(sample.logprobs) == len(sample.token_ids) == 8
    total = 0.0
    for token, position in zip(sample.token_ids, sample.logprobs, strict=True):
        assert token in position and len(position) in (3, 4)
        top = sorted((lp for t, lp in position.items() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top][-3:] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in itertools.pairwise(top))
        assert position[token].decoded_token == chr(token)
        total += position[token].logprob
    assert sample.cumulative_logprob == pytest.approx(total)
    # Raw: the same tokens forced greedily (logit_bias) give the same logprobs.
    forced = llm.generate(
        {"prompt_token_ids": llm.get_tokenizer().encode(PROMPT)},
        greedy(1, logprobs=0, logit_bias={sample.token_ids[0]: 100.0}),
        use_tqdm=False,
    )[0].outputs[0]
    first = forced.logprobs[0][sample.token_ids[0]]
    # Another batch, another fp32 summation order (the kernels' blocking differs between CPU
    # classes: AVX2 and AVX-512 gave 4.5e-7 apart here): an absolute fp32 tolerance.
    expected = sample.logprobs[0][sample.token_ids[0]].logprob
    assert first.logprob == pytest.approx(expected, rel=1e-5, abs=1e-5)
    # Without logprobs: None.
    plain = llm.generate(PROMPT, greedy(2), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def prompt_logprob_values(output) -> list[float]:
    ids = output.prompt_token_ids
    assert output.prompt_logprobs[0] is None
    return [output.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]


def test_prompt_logprobs_equal_sample_logprobs_of_the_prefixes(tiny):
    llm = make_llm(tiny)
    ids = llm.get_tokenizer().encode(PROMPT)[:20]
    (out,) = llm.generate({"prompt_token_ids": ids}, greedy(1, prompt_logprobs=2), False)
    assert len(out.prompt_logprobs) == len(ids)
    for j in (1, 7, 19):
        position = out.prompt_logprobs[j]
        assert ids[j] in position and {lp.rank for t, lp in position.items() if t != ids[j]} <= {
            1,
            2,
        }
        forced = llm.generate(
            {"prompt_token_ids": ids[:j]},
            greedy(1, logprobs=2, logit_bias={ids[j]: 100.0}),
            use_tqdm=False,
        )[0].outputs[0]
        assert forced.token_ids == [ids[j]]
        for token, lp in position.items():
            assert forced.logprobs[0][token].logprob == pytest.approx(lp.logprob, abs=1e-5)
            assert forced.logprobs[0][token].rank == lp.rank


def test_prompt_logprobs_skip_reading_the_prefix_cache_but_fill_it(tiny):
    cold = make_llm(tiny).generate(PROMPT, greedy(2, prompt_logprobs=1), use_tqdm=False)[0]
    llm = make_llm(tiny)
    llm.generate(PROMPT, greedy(2), use_tqdm=False)  # warms the cache
    (warm,) = llm.generate(PROMPT, greedy(2, prompt_logprobs=1), use_tqdm=False)
    assert warm.num_cached_tokens == 0
    assert prompt_logprob_values(warm) == pytest.approx(prompt_logprob_values(cold), abs=1e-5)
    stats = llm.get_stats().scheduler
    assert stats.prefix_cache_queries == len(warm.prompt_token_ids)  # the first request only
    assert llm.reset_prefix_cache()
    (first,) = llm.generate(PROMPT, greedy(2, prompt_logprobs=1), use_tqdm=False)
    (after,) = llm.generate(PROMPT, greedy(2), use_tqdm=False)
    assert first.num_cached_tokens == 0 and after.num_cached_tokens == 88  # 22 blocks of 4


@pytest.mark.parametrize(
    "config",
    [
        {"max_num_batched_tokens": 16},
        {"num_blocks": 41, "max_num_batched_tokens": 16, "max_model_len": 160},
        {"enable_prefix_caching": False},
    ],
)
def test_prompt_and_sample_logprobs_under_chunking_and_preemption(tiny, config):
    prompts = [PROMPT, PROMPT[:50], "x" * 70, PROMPT[3:]]
    params = greedy(30, logprobs=2, prompt_logprobs=2)
    reference = [make_llm(tiny).generate(p, params, use_tqdm=False)[0] for p in prompts]
    llm = make_llm(tiny, **config)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if "num_blocks" in config:
        assert llm.get_stats().scheduler.num_preemptions > 0
    for out, ref in zip(outputs, reference, strict=True):
        assert out.token_ids == ref.token_ids
        assert prompt_logprob_values(out) == pytest.approx(prompt_logprob_values(ref), abs=1e-5)
        assert [sorted(p) for p in out.prompt_logprobs[1:]] == [
            sorted(p) for p in ref.prompt_logprobs[1:]
        ]
        got = [p[t].logprob for p, t in zip(out.outputs[0].logprobs, out.token_ids, strict=True)]
        want = [p[t].logprob for p, t in zip(ref.outputs[0].logprobs, ref.token_ids, strict=True)]
        assert got == pytest.approx(want, abs=1e-5)


def test_n_samples_share_one_prompt_logprobs(tiny):
    llm = make_llm(tiny)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=0)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(len(p) == 1 for p in out.prompt_logprobs[1:])  # k = 0: the prompt token only
    assert all(math.isfinite(v) and v <= 0 for v in prompt_logprob_values(out))
    # Samples 1 and 2 fork from sample 0's blocks (only sample 0 computes prompt logprobs).
    stats = llm.get_stats().scheduler
    assert stats.num_forks == 2 and stats.prefix_cache_hits == 0


# ---- prompt forms --------------------------------------------------------------------------------


def test_generate_takes_vllm_prompt_forms(tiny):
    llm = make_llm(tiny)
    ids = llm.get_tokenizer().encode("hello")
    forms = ["hello", {"prompt": "hello"}, {"prompt_token_ids": ids}, ids]
    outputs = llm.generate(forms, greedy(4), use_tqdm=False)
    assert len({tuple(o.token_ids) for o in outputs}) == 1
    assert [o.prompt for o in outputs] == ["hello", "hello", None, None]
    assert llm.generate({"prompt": "hello"}, greedy(4), use_tqdm=False)[0].prompt == "hello"
    single = llm.generate({"prompt_token_ids": ids}, greedy(4), use_tqdm=False)
    assert single[0].token_ids == outputs[0].token_ids
    for bad, match in (
        ({"role": "user", "content": "hi"}, "LLM.chat"),
        ({"prompt": 5}, "must be a str"),
        ({"prompt_token_ids": "abc"}, "token ids"),
        ({}, "a prompt must be"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate(bad, greedy(2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_chat_continue_final_message(tiny):
    llm = make_llm(tiny)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    (out,) = llm.chat(
        messages,
        greedy(2),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert out.prompt == "<user>hi\n<assistant>Sure"
    with pytest.raises(InvalidRequestError, match="cannot both"):
        llm.chat(messages, greedy(2), use_tqdm=False, continue_final_message=True)
