"""Batch invariance (issue 50): under ``batch_invariant=True`` a request's greedy tokens, every
returned logprob and its cumulative logprob are bit-identical to the same prompt decoded alone
(one request at a time, no prefix cache), whatever else runs beside it and however the engine
schedules it.

The model is a tiny random Llama written as a Q4_K_M-like GGUF file (Q4_K / Q6_K blocks on
pagedkv's C kernels, the native attention backend), built once per session; every engine loads
it from the file as a user's would (tens of milliseconds). Hypothesis draws schedules: which
prompts go together and in what order, staggered arrivals (requests added between steps),
shared prefixes (prefix-cache hits), repeated prompts, chunked prefill (a budget of 8..64
tokens), block sizes 8 / 16 / 32, bf16 and fp32, a pool small enough to preempt (recompute, or
swap to a host-RAM KV tier), n = 2 forks, and speculative decoding (n-gram, a one-layer draft
model, the model drafting for itself). Explicit tests pin what a schedule may not reach for
sure: preemption of both kinds, KV-tier hits, a disk tier across a restart, full acceptance
of the model drafting for itself, and the real default model (SmolLM2, slow).

The reference shares the schedule's dtype, block size and thread count (one thread): the claim
is alone versus batched on the same configuration. Floats are compared as ``float.hex``.

Without the switch (``PAGEDKV_BATCH_INVARIANT_TESTS=without-flag``, see
``_batch_invariance.py``) these tests fail: batching changes the products' summation, so the
logprobs differ in their last bits and sometimes a greedy token flips.
"""

from __future__ import annotations

import pytest
from _batch_invariance import (
    LOGPROBS,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPTS,
    Arrival,
    alone,
    assert_equal_alone,
    batch_invariant_options,
    engine_options,
    expected_for,
    greedy,
    has_switch,
    min_num_blocks,
    record_draft_steps,
    run_schedule,
    samples_of,
    without_flag,
    write_tiny_ggufs,
    write_tiny_hf_folder,
)
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from pagedkv.engine.llm import LLM
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sampling_params import SamplingParams

#: Compute dtypes the switch covers (the GGUF products on fp32 or bf16 activations).
DTYPES = ("bfloat16", "float32")
BLOCK_SIZES = (8, 16, 32)
#: max_num_batched_tokens: chunked prefill (odd 13 too) and one budget that takes any prompt.
BUDGETS = (8, 13, 32, 64, 2048)
#: A host-RAM KV tier (bytes): room for every block of every prompt.
TIER_BYTES = 1 << 20

#: Hypothesis settings of the schedule tests: few examples (each builds an engine, about 0.5 s
#: on a busy 2-core machine); no shrinking: a schedule that fails usually fails with many
#: others, and each shrink step would build another engine (minutes). A failure prints the
#: drawn example: pin it with @example.
SCHEDULE_SETTINGS = settings(
    derandomize=True,
    max_examples=12,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.generate),
)


@pytest.fixture(scope="session")
def ggufs(tmp_path_factory):
    """(target, draft) GGUF paths: the tiny Llama and its one-layer draft."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return write_tiny_ggufs(tmp_path_factory.mktemp("batch-invariant"))


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """The target as a dense Hugging Face folder (fp32 safetensors)."""
    pytest.importorskip("transformers")
    return write_tiny_hf_folder(tmp_path_factory.mktemp("batch-invariant-hf"))


@pytest.fixture(scope="session")
def references(ggufs):
    """``references(dtype, block_size)``: :func:`alone` of every prompt in that dtype, computed
    once each, with blocks of :data:`REFERENCE_BLOCK_SIZE` tokens whatever ``block_size`` the
    run under test has: the block size is part of how the KV blocks were made, which the
    switch makes invisible."""
    cache = {}

    def get(dtype: str, block_size: int):
        del block_size  # the run's; the reference keeps its own
        if dtype not in cache:
            cache[dtype] = alone(
                ggufs[0], dtype=dtype, quantization="gguf", block_size=REFERENCE_BLOCK_SIZE
            )
        return cache[dtype]

    return get


@pytest.fixture(scope="module", autouse=True)
def switch():
    """The switch's options (skips the module where the engine has none yet)."""
    return batch_invariant_options()


#: The block size of every reference run.
REFERENCE_BLOCK_SIZE = 16


def build(ggufs, dtype: str, block_size: int, **options) -> LLMEngine:
    return LLMEngine(
        model=str(ggufs[0]),
        **engine_options(dtype=dtype, quantization="gguf", block_size=block_size, **options),
    )


def arrivals_of(schedule, logprobs_flags=None) -> list[Arrival]:
    """Arrivals from drawn ``(prompt, step, n)`` tuples (ids ``r0``, ``r1``...); request i asks
    for logprobs unless ``logprobs_flags[i]`` is False."""
    return [
        Arrival(
            f"r{i}",
            prompt,
            step,
            greedy(
                prompt,
                n=n,
                logprobs=LOGPROBS if logprobs_flags is None or logprobs_flags[i] else None,
            ),
        )
        for i, (prompt, step, n) in enumerate(schedule)
    ]


def check(engine: LLMEngine, arrivals: list[Arrival], reference) -> None:
    outputs = run_schedule(engine, arrivals)
    assert_equal_alone(samples_of(outputs), expected_for(arrivals, reference))
    assert engine.get_stats().scheduler.num_used_blocks == 0


# ---------------------------------------------------------------------------------------------
# The fixtures themselves


def test_the_file_and_the_prompts_are_what_the_tests_assume(ggufs):
    from _gguf_files import tensor_types

    types = tensor_types(ggufs[0])
    assert set(types.values()) == {"F32", "Q4_K", "Q6_K"}
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.1.ffn_down.weight"] == "Q4_K"
    assert len(tensor_types(ggufs[1])) < len(types)  # the draft: one layer
    lengths = [len(p) for p in PROMPTS]
    assert lengths == [3, 49, 63, 61, 37, 63, 1]
    assert all(n + m <= MAX_MODEL_LEN for n, m in zip(lengths, MAX_TOKENS, strict=True))
    assert PROMPTS[1][:40] == PROMPTS[2][:40] and PROMPTS[4][:20] == PROMPTS[1][:20]


def test_the_reference_is_not_degenerate(references):
    """Logprobs that separate the tokens and outputs that are not one token repeated: a
    variance in the last bits can show (and flip a token) only where values are computed."""
    reference = references("bfloat16", 16)
    for sample in reference:
        assert len(set(sample.token_ids)) > 2
        assert len(sample.logprobs) == len(sample.token_ids)
        first = sample.logprobs[0]
        assert len(first) in (LOGPROBS, LOGPROBS + 1)
        assert -10.0 < float.fromhex(first[0][2]) < -0.1


# ---------------------------------------------------------------------------------------------
# Schedules

prompt_index = st.integers(0, len(PROMPTS) - 1)
#: (prompt, arrival step, n): up to 6 requests, repeats allowed (full prefix-cache hits).
schedules = st.lists(
    st.tuples(prompt_index, st.integers(0, 8), st.sampled_from((1, 1, 2))), min_size=1, max_size=6
)
#: The pool and what a preempted request does.
MEMORY = ("plenty", "tight", "tight-swap", "tight-tier")


def memory_options(memory: str, block_size: int) -> dict:
    if memory == "plenty":
        return {}
    options = {"num_blocks": min_num_blocks(block_size) + 2}
    if memory in ("tight-swap", "tight-tier"):
        options |= {"kv_offloading_size": TIER_BYTES, "kv_offloading_backend": "cpu"}
    if memory == "tight-swap":
        options["preemption_mode"] = "swap"
    return options


@SCHEDULE_SETTINGS
@given(
    dtype=st.sampled_from(DTYPES),
    block_size=st.sampled_from(BLOCK_SIZES),
    budget=st.sampled_from(BUDGETS),
    prefix_caching=st.booleans(),
    memory=st.sampled_from(MEMORY),
    max_num_seqs=st.sampled_from((2, 64)),
    threads=st.sampled_from((1, 2)),
    schedule=schedules,
)
@example(  # everything at once, one chunk each: the plainest batch
    dtype="bfloat16",
    block_size=16,
    budget=2048,
    prefix_caching=False,
    memory="plenty",
    max_num_seqs=64,
    threads=1,
    schedule=[(i, 0, 1) for i in range(len(PROMPTS))],
)
@example(  # staggered, chunked, shared prefixes hit, forks, preempted by swap, two threads
    dtype="float32",
    block_size=8,
    budget=13,
    prefix_caching=True,
    memory="tight-swap",
    max_num_seqs=64,
    threads=2,
    schedule=[(1, 0, 1), (2, 1, 2), (4, 3, 1), (2, 5, 1), (3, 5, 1)],
)
def test_schedules_give_the_alone_outputs(
    ggufs,
    references,
    dtype,
    block_size,
    budget,
    prefix_caching,
    memory,
    max_num_seqs,
    threads,
    schedule,
):
    mem = memory_options(memory, block_size)
    engine = build(
        ggufs,
        dtype,
        block_size,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix_caching or "kv_offloading_size" in mem,
        max_num_seqs=max_num_seqs,
        num_threads=threads,
        **mem,
    )
    check(engine, arrivals_of(schedule), references(dtype, block_size))
    engine.shutdown()


#: Speculative decoding: n-gram, the one-layer draft, the model drafting for itself.
SPEC_METHODS = ("ngram", "draft", "self")


def speculative_config(method: str, ggufs) -> dict:
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
    model = ggufs[1] if method == "draft" else ggufs[0]
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}


@SCHEDULE_SETTINGS
@given(
    method=st.sampled_from(SPEC_METHODS),
    dtype=st.sampled_from(DTYPES),
    block_size=st.sampled_from(BLOCK_SIZES),
    budget=st.sampled_from(BUDGETS),
    tight=st.booleans(),
    schedule=schedules,
    data=st.data(),
)
@example(
    method="draft",
    dtype="bfloat16",
    block_size=16,
    budget=32,
    tight=False,
    schedule=[(5, 0, 1), (1, 0, 1), (3, 2, 1), (0, 2, 2)],
    data=None,
)
def test_speculative_schedules_give_the_alone_outputs(
    ggufs, references, method, dtype, block_size, budget, tight, schedule, data
):
    """Requests without logprobs draft (the engine drafts nothing for a request that asks for
    logprobs: those decode beside the verifications, a mixed batch); tokens are compared for
    the first, tokens and logprobs for the others."""
    if data is None:  # an @example: the first half without logprobs
        flags = [i >= len(schedule) // 2 for i in range(len(schedule))]
    else:
        flags = data.draw(st.lists(st.booleans(), min_size=len(schedule), max_size=len(schedule)))
    engine = build(
        ggufs,
        dtype,
        block_size,
        max_num_batched_tokens=budget,
        speculative_config=speculative_config(method, ggufs),
        **({"num_blocks": min_num_blocks(block_size) + 4} if tight else {}),
    )
    check(engine, arrivals_of(schedule, flags), references(dtype, block_size))
    engine.shutdown()


# ---------------------------------------------------------------------------------------------
# What a schedule may not reach for sure


def everything_at_once(n: int = 1) -> list[Arrival]:
    return [Arrival(f"r{i}", i, 0, greedy(i, n=n)) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_give_the_alone_outputs(ggufs, references, mode):
    tier = {"kv_offloading_size": TIER_BYTES} if mode == "swap" else {}
    engine = build(
        ggufs,
        "bfloat16",
        8,
        num_blocks=min_num_blocks(8) + 2,
        max_num_batched_tokens=16,
        preemption_mode=mode,
        **tier,
    )
    check(engine, everything_at_once(), references("bfloat16", 8))
    stats = engine.get_stats()
    assert stats.scheduler.num_preemptions > 0
    if mode == "swap":
        assert stats.kv_tier.num_stored_blocks > 0 and stats.kv_tier.num_hit_blocks > 0
    engine.shutdown()


def test_forked_samples_each_give_the_alone_outputs(ggufs, references):
    engine = build(ggufs, "bfloat16", 16, max_num_batched_tokens=32)
    check(engine, everything_at_once(n=2), references("bfloat16", 16))
    # every prompt but the one-token one (nothing to prefill before its fork) forks its second
    assert engine.get_stats().scheduler.num_forks == len(PROMPTS) - 1
    engine.shutdown()


def test_kv_tier_hits_give_the_alone_outputs(ggufs, references):
    """A pool that holds one request: the first round's blocks page out to the host-RAM tier
    and the second round (all at once, the same prompts) loads them back."""
    engine = build(
        ggufs,
        "bfloat16",
        8,
        num_blocks=min_num_blocks(8) + 2,
        kv_offloading_size=TIER_BYTES,
    )
    reference = references("bfloat16", 8)
    for i in range(len(PROMPTS)):
        check(engine, [Arrival(f"first-{i}", i, 0, greedy(i))], reference)
    check(engine, everything_at_once(), reference)
    assert engine.get_stats().kv_tier.num_hit_blocks > 0
    engine.shutdown()


def test_disk_tier_across_a_restart_gives_the_alone_outputs(ggufs, references, tmp_path):
    options = {
        "num_blocks": 64,
        "kv_offloading_size": TIER_BYTES,
        "kv_offloading_backend": "disk",
        "kv_offloading_dir": str(tmp_path),
    }
    reference = references("bfloat16", 8)
    first = build(ggufs, "bfloat16", 8, **options)
    check(first, everything_at_once(), reference)
    first.shutdown()  # pages the cached blocks out to the directory
    assert list(tmp_path.glob("*.kv"))
    second = build(ggufs, "bfloat16", 8, **options)
    check(second, everything_at_once(), reference)
    stats = second.get_stats()
    assert stats.kv_tier.num_hit_blocks > 0 and stats.kv_tier.num_failed_loads == 0
    second.shutdown()


def test_speculation_drafts_and_gives_the_alone_outputs(ggufs, references):
    """Both proposers do draft here (the schedule tests cannot be sure), and some drafts are
    accepted and some rejected by the one-layer draft."""
    reference = references("bfloat16", 16)
    arrivals = [Arrival(f"r{i}", i, i % 3, greedy(i, logprobs=None)) for i in range(len(PROMPTS))]
    arrivals.append(Arrival("with-logprobs", 2, 1, greedy(2)))
    for method in ("ngram", "draft"):
        engine = build(
            ggufs,
            "bfloat16",
            16,
            max_num_batched_tokens=32,
            speculative_config=speculative_config(method, ggufs),
        )
        check(engine, arrivals, reference)
        spec = engine.get_stats().scheduler.spec_decoding
        assert spec.num_draft_tokens > 0, method
        if method == "draft":
            assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
        engine.shutdown()


@pytest.mark.parametrize("batch", [1, 4])
def test_the_model_drafting_for_itself_accepts_every_draft(ggufs, references, batch):
    """The draft's one-token decode steps and the target's verification of several tokens
    are the same products on the same rows: every greedy draft is accepted."""
    llm = LLM(
        str(ggufs[0]),
        **engine_options(
            dtype="bfloat16",
            quantization="gguf",
            block_size=16,
            speculative_config=speculative_config("self", ggufs),
        ),
    )
    prompts = [1, 3, 5, 0][:batch]
    params = [greedy(i, logprobs=None) for i in prompts]
    outputs = llm.generate(
        [{"prompt_token_ids": list(PROMPTS[i])} for i in prompts], params, use_tqdm=False
    )
    reference = references("bfloat16", 16)
    assert [tuple(o.outputs[0].token_ids) for o in outputs] == [
        reference[i].token_ids for i in prompts
    ]
    spec = llm.get_stats().scheduler.spec_decoding
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens
    assert spec.acceptance_rate == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_dense_hugging_face_folder_gives_the_alone_outputs(hf_folder, dtype):
    """The same model as a dense fp32 safetensors folder (its products wrapped as F32 / BF16
    parts under the switch): everything at once, chunked, in a pool that preempts."""
    folder = hf_folder
    reference = alone(folder, dtype=dtype, block_size=16)
    engine = LLMEngine(
        model=str(folder),
        **engine_options(
            dtype=dtype,
            block_size=16,
            max_num_batched_tokens=16,
            num_blocks=min_num_blocks(16) + 2,
        ),
    )
    check(engine, everything_at_once(), reference)
    assert engine.get_stats().scheduler.num_preemptions > 0
    engine.shutdown()


# ---------------------------------------------------------------------------------------------
# The real default model


@pytest.mark.slow
def test_smollm2_schedules_give_the_alone_outputs(gguf_path):
    """SmolLM2-135M (the packaged GGUF, dtype auto: its products on pagedkv's kernels): four
    chat prompts (two sharing a prefix) alone, then all at once with chunked prefill, then
    staggered in a pool that preempts."""
    texts = [
        "Hi!",
        "What is the capital of France?",
        "Explain in simple words how a hash table handles collisions.",
        "Explain in simple words how a hash table grows when it is full.",
    ]
    options = engine_options(max_model_len=128, block_size=16)
    engine = LLMEngine(model=str(gguf_path), enable_prefix_caching=False, **options)
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in texts
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=LOGPROBS, ignore_eos=True)
    reference = {}
    for i in range(len(prompts)):
        outputs = run_schedule(engine, [Arrival(f"alone-{i}", i, 0, params)], prompts)
        reference[i] = samples_of(outputs)[f"alone-{i}"][0]
    engine.shutdown()
    schedules = {
        "together, chunked": ({"max_num_batched_tokens": 24}, [0, 0, 0, 0]),
        # 9 blocks hold one request of 128 tokens; the four need about 16
        "staggered, preempted": ({"num_blocks": 11, "max_num_batched_tokens": 40}, [0, 1, 1, 3]),
    }
    for name, (extra, steps) in schedules.items():
        engine = LLMEngine(model=str(gguf_path), **options, **extra)
        arrivals = [Arrival(f"r{i}", i, step, params) for i, step in enumerate(steps)]
        outputs = run_schedule(engine, arrivals, prompts)
        assert_equal_alone(
            samples_of(outputs), {a.request_id: reference[a.prompt] for a in arrivals}
        )
        if "num_blocks" in extra:
            assert engine.get_stats().scheduler.num_preemptions > 0, name
        engine.shutdown()


# ---------------------------------------------------------------------------------------------
# The switch's own contract


def test_the_switch_refuses_tensor_parallel():
    if without_flag() or not has_switch():
        pytest.skip("the switch is not there to refuse")
    from pagedkv.engine.config import EngineConfig
    from pagedkv.errors import ConfigError

    with pytest.raises(ConfigError, match=r"batch_invariant|tensor_parallel"):
        LLMEngine(EngineConfig(batch_invariant=True, tensor_parallel_size=2))


def test_an_engine_repeats_its_alone_outputs(ggufs, references):
    """The harness's control (it passes without the switch too): a second engine decoding each
    prompt alone gives the reference bit for bit, so a difference elsewhere is the batch's."""
    for dtype in DTYPES:
        again = alone(ggufs[0], dtype=dtype, quantization="gguf", block_size=16)
        assert again == references(dtype, 16)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_vectors_do_not_depend_on_the_batch(ggufs, pooling):
    """An embedding request's vector (the final norm's rows pooled, L2-normalized) is the same
    bits embedded alone, with every other prompt in one batch, in another order, chunked."""
    import numpy as np

    def llm(**options) -> LLM:
        return LLM(
            str(ggufs[0]), **engine_options(dtype="bfloat16", quantization="gguf", **options)
        )

    prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS]
    single = llm(enable_prefix_caching=False)
    alone = [single.embed([p], pooling)[0] for p in prompts]
    for options in ({}, {"max_num_batched_tokens": 8}):
        batched = llm(**options)
        for order in (list(range(len(prompts))), list(range(len(prompts)))[::-1]):
            got = batched.embed([prompts[i] for i in order], pooling)
            for i, vector in zip(order, got, strict=True):
                assert np.array_equal(vector, alone[i]), (options, pooling, i)


def test_a_seeded_sample_draws_the_same_tokens_under_suffix_decoding(ggufs):
    """Suffix decoding's drafts come from what the engine generated before (one tree for all
    requests), and a seeded sample's draws follow its drafts: such a request drafts nothing,
    so it samples the same tokens on a fresh engine, again after other traffic, and batched;
    greedy requests beside it still draft."""
    suffix = {"method": "suffix", "num_speculative_tokens": 3}
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)

    def seeded_run(engine, step: int, others: int) -> list[int]:
        arrivals = [Arrival("seeded", 1, step, seeded)]
        arrivals += [
            Arrival(f"g{i}", i % len(PROMPTS), 0, greedy(i % len(PROMPTS), logprobs=None))
            for i in range(others)
        ]
        return samples_of(run_schedule(engine, arrivals))["seeded"][0].token_ids

    first = build(ggufs, "float32", 16, speculative_config=suffix)
    for i in range(2):  # the tree learns prompt 1's greedy output; its second run drafts it
        run_schedule(first, [Arrival(f"learn{i}", 1, 0, greedy(1, logprobs=None))])
    assert first.scheduler.get_stats().spec_decoding.num_draft_tokens > 0
    alone_tokens = seeded_run(first, 0, 0)
    assert seeded_run(first, 0, 0) == alone_tokens  # after the tree learned the first run
    assert seeded_run(first, 2, 5) == alone_tokens  # batched with greedy traffic
    first.shutdown()
    fresh = build(ggufs, "float32", 16, speculative_config=suffix)
    assert seeded_run(fresh, 0, 0) == alone_tokens  # an engine whose tree learned nothing
    fresh.shutdown()


@pytest.mark.parametrize(
    ("batch", "dtype"),
    [(1, "bfloat16"), (4, "bfloat16"), (4, "float32"), (7, "float32"), (14, "bfloat16")],
)
def test_without_the_switch_the_self_draft_accepts_every_draft_at_any_batch(ggufs, batch, dtype):
    """The default engine runs steps of up to FUSED_MAX_TOKENS tokens on the fused layers with
    each row's decode-step bits (the int8 products row by row, the final norm row by row in
    C, the LM head's rows one at a time), so a verification step of up to 4 requests x (3
    drafts + 1) rows computes what their decode steps would: the model drafting for itself
    accepts every draft, switch or not, and greedy tokens equal those without speculation.
    Past that size a step takes the large steps' products (other bits), so the scheduler
    keeps the steps that carry drafts within the model's row-exact size
    (``max_row_exact_tokens``): at 7 or 14 requests (28 or 56 rows with every draft) the
    drafts are cut to fit. A seeded request beside them drafts nothing."""
    from pagedkv.model.llama import FUSED_MAX_TOKENS

    prompts = [(1, 3, 5, 0, 2, 4, 6)[i % 7] for i in range(batch)]
    requests = [{"prompt_token_ids": list(PROMPTS[i])} for i in prompts]
    params = [greedy(i, logprobs=None) for i in prompts]
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    if batch > 1:
        requests.append({"prompt_token_ids": list(PROMPTS[5])})
        params.append(seeded)

    def generate(**options):
        llm = LLM(
            str(ggufs[0]),
            **engine_options(dtype=dtype, quantization="gguf", batch_invariant=False, **options),
        )
        sizes = record_draft_steps(llm.engine)
        outputs = llm.generate(requests, params, use_tqdm=False)
        return llm, sizes, [list(out.outputs[0].token_ids) for out in outputs]

    _, _, expected = generate()
    llm, step_sizes, got = generate(speculative_config=speculative_config("self", ggufs))
    assert llm.engine.scheduler.drafts.max_step_tokens == FUSED_MAX_TOKENS
    spec = llm.get_stats().scheduler.spec_decoding
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens
    assert max(step_sizes) <= FUSED_MAX_TOKENS
    assert got == expected  # the greedy requests, and the seeded one (no drafts)


@pytest.fixture(scope="session")
def q4_1_gguf(tmp_path_factory):
    """The tiny Llama of :func:`write_tiny_ggufs` with its layers' linears as Q4_1 blocks (the
    rest F32): every fused product of whole bands of 8 rows, interleaved where the kernels
    interleave."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from _batch_invariance import tiny_hf_llama
    from _gguf_files import write_mixed_gguf

    path = tmp_path_factory.mktemp("interleaved") / "tiny-q4_1.gguf"
    write_mixed_gguf(path, tiny_hf_llama(num_layers=2), "llama", q4_1_layers)
    return path


def q4_1_layers(name: str, shape: tuple[int, ...]) -> str:
    """The layers' linears Q4_1, the rest (embedding and tied head, norms) F32."""
    return "Q4_1" if name.startswith("blk.") and len(shape) == 2 else "F32"


def test_the_fused_size_is_64_only_where_nothing_loses_by_it(q4_1_gguf, tmp_path):
    """64 tokens (the row-exact size too) where every fused product is interleaved and the LM
    head's large product is its row-by-row one (F32 here); 24 where one layer's product is
    not interleaved (a Q4_K ffn_down), or where the head is a type whose large steps take a
    faster product (Q6_K)."""
    from _batch_invariance import tiny_hf_llama
    from _gguf_files import write_mixed_gguf

    from pagedkv.model.kernels.cpu_quant import default_cpu_quant_kernels
    from pagedkv.model.llama import FUSED_MAX_TOKENS, FUSED_MAX_TOKENS_INTERLEAVED

    kernels = default_cpu_quant_kernels()
    if kernels is None or not kernels.interleaves:
        pytest.skip("the kernels here do not interleave (no AVX2 int8 body)")

    def sizes(path) -> tuple[int, int | None]:
        engine = LLMEngine(
            model=str(path),
            **engine_options(dtype="float32", quantization="gguf", batch_invariant=False),
        )
        found = engine.loaded_model.model.fused_max_tokens, engine.runner.max_row_exact_tokens
        engine.shutdown()
        return found

    assert sizes(q4_1_gguf) == (FUSED_MAX_TOKENS_INTERLEAVED,) * 2
    variants = {
        "q4_k_down": lambda n, s: "Q4_K" if n == "blk.1.ffn_down.weight" else q4_1_layers(n, s),
        "q6_k_head": lambda n, s: "Q6_K" if n == "token_embd.weight" else q4_1_layers(n, s),
    }
    for name, types in variants.items():
        path = tmp_path / f"{name}.gguf"
        write_mixed_gguf(path, tiny_hf_llama(num_layers=2), "llama", types)
        assert sizes(path) == (FUSED_MAX_TOKENS,) * 2, name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interleaved_layers_keep_steps_of_64_rows_exact(q4_1_gguf, dtype):
    """A model whose fused products are all interleaved (Q4_1 in bands of 8 rows) runs steps of
    up to FUSED_MAX_TOKENS_INTERLEAVED tokens on the fused layers with every row's decode bits
    (their large product is their batch-invariant one), and that is its row-exact size: 14
    requests drafting 3 tokens each for themselves (steps of up to 56 rows, past 24) accept
    every draft, and the greedy tokens equal those without speculation, in fp32 and bf16."""
    from pagedkv.model.kernels.cpu_quant import default_cpu_quant_kernels
    from pagedkv.model.llama import FUSED_MAX_TOKENS, FUSED_MAX_TOKENS_INTERLEAVED

    kernels = default_cpu_quant_kernels()
    if kernels is None or not kernels.interleaves:
        pytest.skip("the kernels here do not interleave (no AVX2 int8 body)")
    prompts = [(1, 3, 5, 0, 2, 4, 6)[i % 7] for i in range(14)]
    requests = [{"prompt_token_ids": list(PROMPTS[i])} for i in prompts]
    # up to 40 tokens each (as long as max_model_len allows): long enough that the rule drafts
    # for most requests in some step
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=min(40, MAX_MODEL_LEN - len(PROMPTS[i])), ignore_eos=True
        )
        for i in prompts
    ]

    def generate(**options):
        llm = LLM(
            str(q4_1_gguf),
            **engine_options(dtype=dtype, quantization="gguf", batch_invariant=False, **options),
        )
        if llm.engine.scheduler.drafts is not None:
            # every proposed draft scheduled: the adaptive rule's choice follows the step times
            # it measures (on a busy machine it drafted for few requests at once, and the steps
            # stayed under 24 rows), this test's point is the rows past 24
            llm.engine.scheduler.drafts.adaptive = False
        sizes = record_draft_steps(llm.engine)
        outputs = llm.generate(requests, params, use_tqdm=False)
        return llm, sizes, [list(out.outputs[0].token_ids) for out in outputs]

    _, _, expected = generate()
    self_draft = {"method": "draft_model", "model": str(q4_1_gguf), "num_speculative_tokens": 3}
    llm, step_sizes, got = generate(speculative_config=self_draft)
    assert llm.engine.runner.max_row_exact_tokens == FUSED_MAX_TOKENS_INTERLEAVED
    assert llm.engine.scheduler.drafts.max_step_tokens == FUSED_MAX_TOKENS_INTERLEAVED
    spec = llm.get_stats().scheduler.spec_decoding
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens
    assert FUSED_MAX_TOKENS < max(step_sizes) <= FUSED_MAX_TOKENS_INTERLEAVED
    assert got == expected


def test_the_row_exact_size_only_where_every_row_is_exact(ggufs, monkeypatch):
    """24 tokens for the default GGUF engine on the native backend; None (no step size keeps
    rows exact, so drafts are not cut for it) with fp32 activations (the products of several
    rows sum otherwise than one's), with a backend without C entry points (its attention is
    called from Python) and with the batch-invariant switch (every step is exact)."""
    from pagedkv.model.kernels.cpu_quant import ACTIVATIONS_ENV
    from pagedkv.model.llama import FUSED_MAX_TOKENS

    def size(**options) -> int | None:
        engine = LLMEngine(
            model=str(ggufs[0]),
            **engine_options(
                dtype="float32",
                quantization="gguf",
                speculative_config=speculative_config("ngram", ggufs),
                **{"batch_invariant": False, **options},
            ),
        )
        value = engine.runner.max_row_exact_tokens
        assert engine.scheduler.drafts.max_step_tokens == value
        engine.shutdown()
        return value

    assert size() == FUSED_MAX_TOKENS
    assert size(attention_backend="torch") is None
    if has_switch():
        assert size(batch_invariant=True) is None
    monkeypatch.setenv(ACTIVATIONS_ENV, "fp32")
    assert size() is None
