"""LLMEngine and LLM with a tiny random model: streaming, stop strings, n, abort, errors, and
the same tokens whatever the batching, caching, chunking or preemption (fast, no real model)."""

from __future__ import annotations

import json

import pytest
from _engine_fakes import sampling_req_ids
from _tiny_model import EOS, tiny_loaded_model

from pagedkv.core.invariants import check_invariants
from pagedkv.engine.llm import LLM
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.output_processor import _partial_stop_len
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.outputs import ModelRunnerOutput

PROMPTS = ["hello", "a much longer prompt about paged attention " * 3, "abc", "x" * 70]


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


def make_engine(tiny, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_blocks", 80)
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("block_size", 4)
    return LLMEngine(loaded_model=tiny, dtype="float32", num_threads=1, **kwargs)


def greedy(max_tokens=12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run(engine: LLMEngine) -> dict[str, list]:
    """Step until done; returns every RequestOutput per request id, in step order."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.setdefault(output.request_id, []).append(output)
    return seen


def test_streaming_deltas_add_up_and_finish_once(tiny):
    engine = make_engine(tiny)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(10))
    seen = run(engine)
    for i in range(len(PROMPTS)):
        outputs = seen[str(i)]
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        final = outputs[-1]
        assert "".join(o.new_text for o in outputs) == final.text
        assert [t for o in outputs for t in o.new_token_ids] == final.token_ids
        assert len(final.token_ids) == 10 and final.finish_reason == "length"
        assert final.time_to_first_token > 0
    stats = engine.get_stats()
    assert stats.num_requests == stats.num_finished_requests == len(PROMPTS)
    assert stats.scheduler.kv_cache_usage == 0.0


CONFIGS = [
    {},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 16},
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 256},
    {"max_num_seqs": 1},
    {"num_blocks": 41, "max_num_batched_tokens": 16, "max_model_len": 160},
]


def test_same_tokens_in_every_configuration(tiny):
    prompts = [*PROMPTS, PROMPTS[1], PROMPTS[1][:48]]  # repeats hit the prefix cache
    reference = []
    for prompt in prompts:  # each alone in a fresh engine
        engine = make_engine(tiny)
        engine.add_request("r", prompt, greedy(30))
        reference.append(run(engine)["r"][-1].token_ids)
    preempted = 0
    for config in CONFIGS:
        llm = LLM(
            loaded_model=tiny,
            dtype="float32",
            num_threads=1,
            block_size=4,
            **({"num_blocks": 80, "max_model_len": 256} | config),
        )
        outputs = llm.generate(prompts, greedy(30), use_tqdm=False)
        assert [o.token_ids for o in outputs] == reference, config
        preempted += llm.get_stats().scheduler.num_preemptions
    assert preempted > 0


def test_stop_strings_cut_the_text_and_never_leak_in_deltas(tiny):
    engine = make_engine(tiny)
    engine.add_request("plain", PROMPTS[0], greedy(40))
    full = run(engine)["plain"][-1].text
    stop = full[20:23]
    first = full.index(stop)
    for include in (False, True):
        engine.add_request(
            "stop",
            PROMPTS[0],
            greedy(40, stop=[stop, "\x00never"], include_stop_str_in_output=include),
        )
        outputs = run(engine)["stop"]
        final = outputs[-1]
        assert final.finish_reason == "stop" and final.outputs[0].stop_reason == stop
        assert final.text == full[: first + (len(stop) if include else 0)]
        assert "".join(o.new_text for o in outputs) == final.text
        assert all(stop not in o.text for o in outputs[:-1])


def test_partial_stop_len():
    assert _partial_stop_len("hello wor", ["world"]) == 3
    assert _partial_stop_len("hello", ["xyz", "lo!"]) == 2
    assert _partial_stop_len("hello", ["abc"]) == 0


def test_stop_token_ids_and_eos(tiny):
    engine = make_engine(tiny)
    engine.add_request("a", PROMPTS[1], greedy(20))
    tokens = run(engine)["a"][-1].token_ids
    engine.add_request("b", PROMPTS[1], greedy(20, stop_token_ids=[tokens[5]]))
    final = run(engine)["b"][-1]
    assert final.token_ids == tokens[: tokens.index(tokens[5]) + 1]
    assert final.outputs[0].stop_reason == tokens[5]
    # EOS ends a request unless ignore_eos; a forced EOS via stop_token_ids shows both paths.
    assert EOS in engine.eos_token_ids


def _count_scheduled_tokens(engine: LLMEngine) -> list[int]:
    """Wraps the scheduler so that the returned list holds each step's scheduled tokens."""
    counts: list[int] = []
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        counts.append(out.total_num_scheduled_tokens)
        return out

    engine.scheduler.schedule = counting
    return counts


@pytest.mark.parametrize("prompt", [PROMPTS[1], PROMPTS[3][:64], PROMPTS[3][:65]])
def test_n_samples_prefill_once_then_fork(tiny, prompt):
    """n > 1: the prompt is computed once (all but its last token), then the n samples fork,
    sharing its blocks; each computes the last prompt token and samples from there. Prompt
    lengths on and off a block boundary (block_size 4: 129, 64 and 65 tokens)."""
    engine = make_engine(tiny)
    counts = _count_scheduled_tokens(engine)
    n, max_tokens = 3, 12
    params = SamplingParams(
        n=n, temperature=1.0, top_k=20, top_p=0.9, seed=3, max_tokens=max_tokens, ignore_eos=True
    )
    engine.add_request("s", prompt, params)
    first = run(engine)["s"][-1]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3
    num_prompt = len(first.prompt_token_ids)
    # (P - 1) prompt tokens once, then per sample its last prompt token and max_tokens - 1
    # decode tokens: not n * P.
    assert sum(counts) == (num_prompt - 1) + n * max_tokens
    stats = engine.get_stats().scheduler
    assert stats.num_forks == n - 1
    # On a block boundary the last prompt token starts a new block: nothing is copied.
    expected_copies = 0 if (num_prompt - 1) % 4 == 0 else n - 1
    assert stats.num_cow_copies == expected_copies
    assert engine.kv_cache_manager.usage == 0.0
    check_invariants(engine.kv_cache_manager)
    # Reproducible: the same seeded request gives the same samples.
    engine.add_request("t", prompt, params)
    again = run(engine)["t"][-1]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]


def test_forked_samples_equal_independent_requests_seeded_alike(tiny):
    """The fork changes where the samples' KV comes from, not what they sample: sample i equals
    a request of its own seeded with seed + i (the path before the fork)."""
    prompt = PROMPTS[3][:65]
    params = SamplingParams(n=4, temperature=0.8, seed=11, max_tokens=10, ignore_eos=True)
    forked = make_engine(tiny)
    forked.add_request("s", prompt, params)
    samples = [o.token_ids for o in run(forked)["s"][-1].outputs]
    alone = make_engine(tiny, enable_prefix_caching=False)
    for i in range(4):
        alone.add_request(f"a{i}", prompt, params.for_sample(i))
    outputs = run(alone)
    assert samples == [outputs[f"a{i}"][-1].token_ids for i in range(4)]
    greedy_forked = make_engine(tiny)
    greedy_forked.add_request("g", prompt, greedy(10, n=2))
    same = [o.token_ids for o in run(greedy_forked)["g"][-1].outputs]
    assert same[0] == same[1]


def test_aborting_an_n_request_before_its_fork_ends_every_sample(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=16)  # the prompt takes several steps
    engine.add_request("s", PROMPTS[1], SamplingParams(n=3, max_tokens=5))
    engine.step()
    engine.abort_request("s")
    outputs = engine.step()
    (aborted,) = [o for o in outputs if o.request_id == "s"]
    assert aborted.finished and [o.finish_reason for o in aborted.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.usage == 0.0


def test_abort_reports_once_frees_blocks_and_twice_is_noop(tiny):
    engine = make_engine(tiny)
    engine.add_request("a", PROMPTS[1], greedy(50))
    engine.add_request("b", PROMPTS[0], greedy(50))
    engine.step()
    engine.abort_request(["a", "unknown"])
    engine.abort_request("a")
    outputs = engine.step()
    aborted = [o for o in outputs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    rest = run(engine)
    assert "a" not in rest and rest["b"][-1].finish_reason == "length"
    assert engine.kv_cache_manager.usage == 0.0
    assert engine.reset_prefix_cache()


def test_add_request_errors_queue_nothing(tiny):
    engine = make_engine(tiny, num_blocks=20, max_model_len=64)
    engine.add_request("ok", PROMPTS[0], greedy(4))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("ok", PROMPTS[0], greedy(4))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("long", "y" * 60, greedy(10))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("vocab", [1, 2, 500], greedy(4))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", "", greedy(4))
    with pytest.raises(InvalidRequestError, match="a prompt must be"):
        engine.add_request("type", [1.5, 2], greedy(4))
    with pytest.raises(InvalidRequestError, match="n must"):
        engine.add_request("n", PROMPTS[0], SamplingParams(n=0))
    assert engine.get_num_unfinished_requests() == 1
    run(engine)
    assert engine.kv_cache_manager.usage == 0.0
    with pytest.raises(ConfigError):
        make_engine(tiny, max_num_seqs=0)


def test_kv_cache_memory_takes_a_size_like_the_cli(tiny):
    # 2 layers x 2 KV heads x head 16 x fp32 x K and V = 512 B a token, 2 KiB a block of 4.
    by_text = make_engine(tiny, num_blocks=None, kv_cache_memory="64KiB", max_model_len=64)
    by_int = make_engine(tiny, num_blocks=None, kv_cache_memory=64 << 10, max_model_len=64)
    assert by_text.options.kv_cache_memory == 64 << 10
    assert by_text.kv_cache_config.num_blocks == by_int.kv_cache_config.num_blocks == 32
    llm = LLM(
        loaded_model=tiny,
        dtype="float32",
        block_size=4,
        kv_cache_memory="64KiB",
        max_model_len=64,
        num_threads=1,
    )
    assert llm.engine.kv_cache_config.num_blocks == 32
    with pytest.raises(ConfigError, match="not a memory size"):
        make_engine(tiny, num_blocks=None, kv_cache_memory="lots")


def test_llm_generate_keeps_input_order_and_per_prompt_params(tiny):
    llm = LLM(
        loaded_model=tiny,
        dtype="float32",
        num_threads=1,
        num_blocks=80,
        block_size=4,
        max_model_len=256,
    )
    params = [greedy(3 + i) for i in range(len(PROMPTS))]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [3, 4, 5, 6]
    assert [o.prompt for o in outputs] == PROMPTS
    chat = llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False)
    assert chat[0].prompt == "<user>hi\n<assistant>" and len(chat[0].token_ids) == 2
    with pytest.raises(InvalidRequestError, match="sampling params"):
        llm.generate(PROMPTS, params[:2], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        llm.generate(["hi"], {"max_tokens": 2}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        llm.engine.add_request("dict", "hi", {"max_tokens": 2})
    assert llm.generate([], use_tqdm=False) == []
    assert llm.chat([], use_tqdm=False) == []


def test_a_failing_step_errors_its_requests_and_the_engine_goes_on(tiny, monkeypatch):
    engine = make_engine(tiny)
    engine.add_request("a", PROMPTS[0], greedy(5))
    engine.add_request("b", PROMPTS[2], greedy(5, n=2))

    def broken(scheduler_output):
        raise RuntimeError("model blew up")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "execute_model", broken)
        with pytest.raises(RuntimeError, match="blew up"):
            engine.step()
    outputs = run(engine)
    assert {rid: outs[-1].finish_reason for rid, outs in outputs.items()} == {
        "a": "error",
        "b": "error",
    }
    assert [o.finish_reason for o in outputs["b"][-1].outputs] == ["error", "error"]
    assert engine.kv_cache_manager.usage == 0.0
    engine.add_request("c", PROMPTS[0], greedy(3))
    assert run(engine)["c"][-1].finish_reason == "length"


@pytest.mark.parametrize("where", ["update_from_output", "_process_outputs"])
def test_a_fault_after_the_model_ran_errors_the_steps_requests(tiny, monkeypatch, where):
    # A fault in the step's output processing used to be logged and leave the requests
    # waiting forever (a client hung until it left).
    engine = make_engine(tiny)
    engine.add_request("a", PROMPTS[0], greedy(5))
    engine.add_request("b", PROMPTS[2], greedy(5, n=2))

    def broken(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    owner = engine.scheduler if where == "update_from_output" else engine
    with monkeypatch.context() as patch:
        patch.setattr(owner, where, broken)
        with pytest.raises(ZeroDivisionError):
            engine.step()
    outputs = run(engine)
    assert {rid: outs[-1].finish_reason for rid, outs in outputs.items()} == {
        "a": "error",
        "b": "error",
    }
    assert "ZeroDivisionError" in outputs["a"][-1].outputs[0].error
    assert engine.kv_cache_manager.usage == 0.0
    engine.add_request("c", PROMPTS[0], greedy(3))
    assert run(engine)["c"][-1].finish_reason == "length"


def test_llm_generate_after_a_failing_step_still_works(tiny, monkeypatch):
    llm = LLM(
        loaded_model=tiny,
        dtype="float32",
        num_threads=1,
        num_blocks=80,
        block_size=4,
        max_model_len=256,
    )
    with monkeypatch.context() as patch:
        patch.setattr(llm.engine.runner, "execute_model", lambda _: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            llm.generate(PROMPTS, greedy(3), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    outputs = llm.generate(PROMPTS[:2], greedy(3), use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [3, 3]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -2},
        {"max_tokens": 0},
        {"stop": [""]},
        {"presence_penalty": 3},
        {"seed": 1.5},
        {"seed": 2**64},
        {"seed": 2**64 - 1, "n": 2},
        {"seed": -(2**63) - 1},
        {"stop": 5},
        {"stop_token_ids": 5},
        {"temperature": float("inf")},
        {"ignore_eos": "no"},
        {"skip_special_tokens": 1},
        # Beyond what torch and the block hash take (issue 12): a 400 before queueing.
        {"top_k": 2**63},
        {"n": 2**63},
        {"max_tokens": 2**63},
        {"stop_token_ids": [2**63]},
        {"stop_token_ids": [-1]},
        {"top_p": 1e-45},
        {"temperature": 1e39},
        {"temperature": float("nan")},
        {"stop": ["\ud800"]},
    ],
)
def test_sampling_params_validation(kwargs):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == next(iter(kwargs))


def test_values_at_the_bounds_are_accepted():
    SamplingParams(top_k=2**63 - 1, max_tokens=2**63 - 1, stop_token_ids=[2**63 - 1])
    SamplingParams(top_p=1.2e-38, temperature=3e38, seed=2**64 - 2, n=2, stop=["é😀"])


def test_engine_refuses_what_the_model_cannot_take(tiny):
    engine = make_engine(tiny)
    vocab = engine.model_config.vocab_size
    cases = [
        ("prompt", "\ud800 lone surrogate", SamplingParams()),
        ("messages", [{"role": "user", "content": "\udfff"}], SamplingParams()),
        ("top_k", "hi", SamplingParams(top_k=vocab + 1)),
        ("prompt", [vocab], SamplingParams()),
        ("max_tokens", "hi", SamplingParams(max_tokens=10**6)),
    ]
    for param, prompt, params in cases:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("r", prompt, params)
        assert info.value.param == param
    with pytest.raises(InvalidRequestError, match="cache_salt") as info:
        engine.add_request("r", "hi", SamplingParams(), cache_salt="\ud800")
    with pytest.raises(InvalidRequestError, match="priority"):
        engine.add_request("r", "hi", SamplingParams(), priority=2**63)
    assert not engine.has_unfinished_requests()
    engine.add_request("r", "hi", SamplingParams(top_k=vocab, max_tokens=2))
    assert run(engine)["r"][-1].finished


def test_failed_step_outputs_say_why_and_check_health_probes_the_model(tiny, monkeypatch):
    engine = make_engine(tiny)
    engine.check_health()  # a healthy model: the probe runs and gives its block back
    assert engine.kv_cache_manager.usage == 0.0
    engine.add_request("a", PROMPTS[0], greedy(5))
    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "execute_model", lambda _: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            engine.step()
        with pytest.raises(ZeroDivisionError):
            engine.check_health()
    final = run(engine)["a"][-1].outputs[0]
    assert final.finish_reason == "error" and final.error.startswith("ZeroDivisionError")
    assert engine.kv_cache_manager.usage == 0.0


# ---- text equals tokens at finish, for any reason ---------------------------------------------


def _byte(value: int) -> int:
    return 3 + value  # the byte-fallback tokenizer's <0xBB> token (tests/conftest.py)


def _scripted(engine: LLMEngine, patch, tokens: list[int], fail_at: int | None = None) -> None:
    """The runner returns ``tokens`` one per step (every sampling request gets the same one);
    with ``fail_at``, that step raises instead."""
    script = iter(range(len(tokens)))

    def execute_model(scheduler_output):
        i = next(script)
        if i == fail_at:
            raise RuntimeError("scripted failure")
        sampling = sampling_req_ids(engine.scheduler, scheduler_output)
        return ModelRunnerOutput(
            req_ids=sampling,
            sampled_token_ids=[tokens[i]] * len(sampling),
        )

    patch.setattr(engine.runner, "execute_model", execute_model)


@pytest.mark.parametrize("finish", ["length", "stop", "abort", "error"])
def test_held_back_bytes_are_flushed_at_finish(tiny, byte_fallback_tokenizer, monkeypatch, finish):
    engine = make_engine(tiny)
    engine.tokenizer = engine.output_processor.tokenizer = byte_fallback_tokenizer
    # "▁hello", then the first two bytes of a 4-byte emoji (held back), then a stop token.
    tokens = [260, _byte(0xF0), _byte(0x9F), 2]
    max_tokens = 3 if finish == "length" else 10
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[2])
    outputs = []
    with monkeypatch.context() as patch:
        _scripted(engine, patch, tokens, fail_at=3 if finish == "error" else None)
        engine.add_request("r", [5, 6, 7], params)
        for _ in range(3):
            outputs += engine.step()
        held = "".join(o.outputs[0].new_text for o in outputs)
        assert held == ("hello\ufffd\ufffd" if finish == "length" else "hello")
        if finish == "abort":
            engine.abort_request("r")
        if finish == "error":
            with pytest.raises(RuntimeError, match="scripted"):
                engine.step()
        outputs += run(engine).get("r", [])
    final = outputs[-1].outputs[0]
    assert final.finish_reason == finish
    assert "".join(o.outputs[0].new_text for o in outputs) == final.text
    assert final.text == byte_fallback_tokenizer.decode(final.token_ids) == "hello\ufffd\ufffd"
    assert engine.kv_cache_manager.usage == 0.0


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(tiny):
    """best_of=4, n=2: four samples (forked from one prefill, seeded seed + i), the two with the
    highest cumulative logprob come back, best first, reported once at the end; logprobs only
    when asked."""
    prompt = PROMPTS[3][:65]
    base = {"temperature": 1.0, "seed": 5, "max_tokens": 8, "ignore_eos": True}
    engine = make_engine(tiny)
    engine.add_request("all", prompt, SamplingParams(n=4, logprobs=0, **base))
    every = run(engine)["all"][-1].outputs
    best = sorted(every, key=lambda o: -o.cumulative_logprob)[:2]
    assert engine.reset_prefix_cache()  # (else the samples would hit the cache, not fork)
    engine.add_request("best", prompt, SamplingParams(n=2, best_of=4, **base))
    outputs = run(engine)["best"]
    assert len(outputs) == 1 and outputs[0].finished  # nothing before the end
    chosen = outputs[0].outputs
    assert [o.index for o in chosen] == [0, 1]
    assert [o.token_ids for o in chosen] == [o.token_ids for o in best]
    assert all(o.logprobs is None and o.cumulative_logprob is None for o in chosen)
    assert engine.get_stats().scheduler.num_forks == 3 + 3
    assert engine.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize(
    "kwargs, param", [({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 1.5}, "best_of")]
)
def test_best_of_below_n_is_refused(kwargs, param):
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(**kwargs)
    assert excinfo.value.param == param


@pytest.mark.parametrize("n, best_of", [(1, 3), (2, 3)])
def test_best_of_text_is_the_decode_of_its_tokens(tiny, n, best_of):
    """best_of reports nothing until the end, yet every step's new tokens are detokenized once:
    the final text is the decode of the output ids (before, each step re-decoded every token
    since the start, so the text was the concatenation of every prefix)."""
    engine = make_engine(tiny)
    params = SamplingParams(
        n=n, best_of=best_of, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True
    )
    engine.add_request("r", PROMPTS[0], params)
    (final,) = run(engine)["r"]
    assert len(final.outputs) == n
    for output in final.outputs:
        assert len(output.token_ids) == 6
        assert output.text == engine.tokenizer.decode(output.token_ids)
        assert output.new_text == output.text and output.new_token_ids == output.token_ids


def test_kv_snapshot_shows_waiting_running_the_batch_and_forks(tiny):
    engine = make_engine(tiny)
    engine.add_request("a", "abcdefghij", greedy(max_tokens=3, n=2))
    engine.add_request("b", "0123456789", greedy(max_tokens=3))
    snap = engine.kv_snapshot()
    assert [(r["status"], r["num_computed_tokens"]) for r in snap["requests"]] == [
        ("waiting", 0),
        ("waiting", 0),
    ]
    assert snap["num_used_blocks"] == 0
    engine.step()  # a's parent prefills up to its fork point (its last prompt token), b all
    snap = engine.kv_snapshot()
    running = [r for r in snap["requests"] if r["status"] == "running"]
    assert [r["num_scheduled_tokens"] for r in running] == [9, 10]
    assert snap["num_used_blocks"] == 6  # 3 blocks of 4 tokens each
    assert snap["num_used_slots"] == 9 + 10  # the last blocks are partly filled
    text = json.dumps(snap)
    assert "abcdefghij" not in text and "0123456789" not in text
    while engine.has_unfinished_requests():
        engine.step()
    snap = engine.kv_snapshot()
    assert snap["requests"] == [] and snap["num_used_blocks"] == 0
    assert snap["stats"]["num_forks"] == 1
    assert snap["num_cached_free_blocks"] > 0  # the prompts' full blocks stay hit-able
