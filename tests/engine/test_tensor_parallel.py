"""Tensor parallelism (``tensor_parallel_size``): the tiny Llama (4 query / 2 KV heads) split over
2 processes (gloo, loopback) gives the same greedy tokens and logprobs as one process in fp32,
through prefix-cache hits and preemption; so does the tiny Gemma 3 (sliding-window KV cache
groups) and, slow, SmolLM2 at tp=3 and Gemma 3 270M at tp=2; sizes that do not divide the heads
are refused before any process starts; a killed rank fails the engine with a clear error; no
process outlives its engine (shutdown, a dead rank, a dead parent)."""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch
from _tiny_model import tiny_gemma3_model_loader, tiny_loaded_model

from pagedkv.engine.llm import LLM
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.spec_decode.step_costs import StepCosts
from pagedkv.errors import ConfigError, WorkerError
from pagedkv.model.parallel import check_tensor_parallel
from pagedkv.sampling_params import SamplingParams

PROMPTS = [
    "a much longer prompt about paged attention " * 3,
    "hello",
    "a much longer prompt about paged attention " * 2 + "and tensor parallel",
    "x" * 70,
]
#: Few blocks of 4 tokens: the four requests cannot all run at once (preemption).
OPTIONS = {
    "dtype": "float32",
    "num_threads": 1,
    "block_size": 4,
    "num_blocks": 60,
    "max_model_len": 200,
    "max_num_batched_tokens": 32,
}


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kwargs)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split()[2] != "Z"


def wait_gone(pids, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def outputs(llm: LLM):
    params = [greedy(), greedy(prompt_logprobs=1), greedy(), greedy(logprobs=2)]
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    again = llm.generate(PROMPTS[:1], greedy(), use_tqdm=False)  # all cached but the last block
    return first + again


def test_tp2_gives_the_same_tokens_and_logprobs_as_one_process():
    one = LLM(loaded_model=tiny_loaded_model(), **OPTIONS)
    expected = outputs(one)
    two = LLM(model_loader=functools.partial(tiny_loaded_model), tensor_parallel_size=2, **OPTIONS)
    try:
        pids = two.engine.executor.worker_pids
        assert len(pids) == 1 and all(alive(p) for p in pids)
        got = outputs(two)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        for a, b in zip(got, expected, strict=True):
            if b.outputs[0].logprobs:
                for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                    assert x.keys() == y.keys()
                    assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
            if b.prompt_logprobs:
                assert [p and list(p) for p in a.prompt_logprobs] == [
                    p and list(p) for p in b.prompt_logprobs
                ]
        stats = two.get_stats().scheduler
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert stats.num_preemptions == one.get_stats().scheduler.num_preemptions
        # Each rank holds 1 of the 2 KV heads, the same number of blocks.
        assert two.engine.runner.kv_caches[0].shape[2] == 1
        assert one.engine.runner.kv_caches[0].shape[2] == 2
    finally:
        two.engine.shutdown()
    assert wait_gone(pids, 10) and not multiprocessing.active_children()


def test_tp2_with_ngram_drafts_gives_the_drafts_and_tokens_of_one_process():
    """Speculative decoding under tensor parallelism: only rank 0 samples, so only it proposes;
    on the same step costs, the drafts, their acceptance and the tokens are one process's (and
    no speculation's)."""
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    prompts, params = PROMPTS[:3], greedy()
    expected = LLM(loaded_model=tiny_loaded_model(), **OPTIONS).generate(
        prompts, params, use_tqdm=False
    )
    one = LLM(loaded_model=tiny_loaded_model(), speculative_config=config, **OPTIONS)
    two = LLM(
        model_loader=functools.partial(tiny_loaded_model),
        tensor_parallel_size=2,
        speculative_config=config,
        **OPTIONS,
    )
    # The draft lengths follow the step costs each engine measures (two processes step at
    # another speed than one): fixed costs here, so both schedule the same drafts.
    for llm in (one, two):
        llm.engine.scheduler.drafts.step_costs = StepCosts(1024, learn=False)
    try:
        pids = two.engine.executor.worker_pids
        got_one = one.generate(prompts, params, use_tqdm=False)
        got_two = two.generate(prompts, params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in expected]
        assert [o.outputs[0].token_ids for o in got_one] == tokens
        assert [o.outputs[0].token_ids for o in got_two] == tokens
        spec_one = one.get_stats().scheduler.spec_decoding
        spec_two = two.get_stats().scheduler.spec_decoding
        assert spec_two == spec_one and spec_two.num_accepted_tokens > 0
        assert two.engine.runner.drafter is not None  # rank 0's
    finally:
        two.engine.shutdown()
    assert wait_gone(pids, 10) and not multiprocessing.active_children()


def test_tiny_gemma3_tp2_gives_the_same_tokens_as_one_process():
    # 4 query / 2 KV heads, window 8, four KV cache groups (three sliding-window, one full):
    # every rank writes its KV head into every group's blocks; chunked prefill, a prefix hit.
    pytest.importorskip("transformers")
    options = {
        "dtype": "float32",
        "num_threads": 1,
        "block_size": 4,
        "num_blocks": 120,
        "max_model_len": 64,
        "max_num_batched_tokens": 16,
    }
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 96, (n,), generator=generator).tolist() for n in (5, 23, 37)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(llm):
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[2:], params, use_tqdm=False)  # a prefix-cache hit
        return [list(o.token_ids) for o in first + again]

    one = LLM(loaded_model=tiny_gemma3_model_loader(), **options)
    expected = run(one)
    two = LLM(model_loader=tiny_gemma3_model_loader, tensor_parallel_size=2, **options)
    try:
        pids = two.engine.executor.worker_pids
        assert len(two.engine.kv_cache_config.kv_cache_groups) == 4
        assert run(two) == expected
        assert two.get_stats().scheduler.prefix_cache_hits > 0
        assert two.engine.runner.kv_caches[0].shape[2] == 1  # 1 of the 2 KV heads
    finally:
        two.engine.shutdown()
    assert wait_gone(pids, 10) and not multiprocessing.active_children()


def test_sizes_that_do_not_divide_the_heads_are_refused_before_any_process_starts():
    config = tiny_loaded_model().config  # 4 query heads, 2 KV heads
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 does not divide the model's 4"):
        check_tensor_parallel(config, 3)
    assert check_tensor_parallel(config, 4).num_kv_heads == 1  # KV heads replicated
    gemma = dataclasses.replace(config, architecture="gemma3")  # split by the same rules
    assert check_tensor_parallel(gemma, 2).num_kv_heads == 1
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        check_tensor_parallel(gemma, 3)
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        LLMEngine(
            model_loader=functools.partial(tiny_loaded_model), tensor_parallel_size=3, **OPTIONS
        )
    assert not multiprocessing.active_children()
    with pytest.raises(ConfigError, match="loaded_model cannot be split"):
        LLMEngine(loaded_model=tiny_loaded_model(), tensor_parallel_size=2, **OPTIONS)


@pytest.mark.slow
def test_default_model_header_refuses_tp2():
    # SmolLM2-135M: 9 attention heads, 3 KV heads; refused from the GGUF header alone.
    with pytest.raises(ConfigError, match="does not divide the model's 9 attention heads"):
        LLMEngine(tensor_parallel_size=2, dtype="float32")
    assert not multiprocessing.active_children()


def test_a_killed_rank_fails_the_engine_with_a_clear_error():
    engine = LLMEngine(
        model_loader=functools.partial(tiny_loaded_model), tensor_parallel_size=2, **OPTIONS
    )
    try:
        (pid,) = engine.executor.worker_pids
        engine.add_request("a", PROMPTS[0], greedy())
        engine.step()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match=rf"rank 1 \(pid {pid}\) exited with code -9"):
            while engine.has_unfinished_requests():
                engine.step()
        outs = engine.step()  # the failed request is reported, with the error
        assert outs and outs[0].finished and outs[0].outputs[0].finish_reason == "error"
        engine.add_request("b", "hello", greedy())
        with pytest.raises(WorkerError):  # the engine stays dead, it does not hang
            engine.step()
    finally:
        engine.shutdown()
    assert not multiprocessing.active_children()


def test_workers_exit_when_the_engine_process_dies(tmp_path):
    # An engine process killed with SIGKILL (no shutdown, no atexit) leaves no worker behind.
    script = textwrap.dedent(
        f"""
        import functools, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from _tiny_model import tiny_gemma3_model_loader, tiny_loaded_model
        from pagedkv.engine.llm_engine import LLMEngine
        engine = LLMEngine(model_loader=functools.partial(tiny_loaded_model),
                           tensor_parallel_size=2, dtype="float32", num_threads=1, num_blocks=20,
                           max_model_len=64)
        print(*engine.executor.worker_pids, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and all(alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(pids, 30)


@pytest.mark.slow
def test_default_model_tp3_gives_the_same_tokens_as_one_process():
    # SmolLM2-135M: 9 query / 3 KV heads, vocabulary 49152: 3 query heads, 1 KV head and 16384
    # vocabulary rows per rank.
    options = {"dtype": "float32", "num_threads": 1, "num_blocks": 32, "max_model_len": 128}
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = LLM(**options).chat([prompt], params, use_tqdm=False)[0].token_ids
    three = LLM(tensor_parallel_size=3, **options)
    try:
        pids = three.engine.executor.worker_pids
        assert three.engine.runner.kv_caches[0].shape[2] == 1
        assert three.chat([prompt], params, use_tqdm=False)[0].token_ids == expected
    finally:
        three.engine.shutdown()
    assert wait_gone(pids, 10)


@pytest.mark.slow
def test_gemma3_270m_tp2_gives_the_same_tokens_as_one_process(gemma3_fp32):
    # 4 query heads and 1 KV head (replicated: each rank holds it, with 2 query heads),
    # 131,072 vocabulary rows per rank; a 700-token prompt reaches past the 512-token window,
    # so the sliding-window groups drop blocks while the ranks decode.
    options = {"dtype": "float32", "num_threads": 1, "num_blocks": 400, "max_model_len": 1024}
    tokenizer = gemma3_fp32.tokenizer
    words = " ".join(f"item {i} costs {i * 7 % 90} coins;" for i in range(200))
    long = tokenizer.encode(words)[:700]
    assert len(long) == 700
    prompts = [tokenizer.encode("The capital of France is"), long]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(loaded_model=gemma3_fp32, **options)
    expected = [o.token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    del one
    two = LLM(model=gemma3_fp32.source, tensor_parallel_size=2, **options)
    try:
        pids = two.engine.executor.worker_pids
        assert two.engine.runner.kv_caches[0].shape[2] == 1
        got = [o.token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        assert got == expected
    finally:
        two.engine.shutdown()
    assert wait_gone(pids, 10)


@pytest.mark.slow  # rank processes, then a step held until the interrupt
def test_an_interrupt_mid_step_stops_the_engine_instead_of_waiting_for_the_ranks():
    # Ctrl-C between two collectives of rank 0 leaves the workers inside that step's
    # collectives: the engine's cleanup step (and any later one) must not wait for them. Rank 0
    # stops them, the caller gets its KeyboardInterrupt, every later call a WorkerError.
    llm = LLM(
        model_loader=functools.partial(tiny_loaded_model),
        tensor_parallel_size=2,
        dtype="float32",
        num_threads=1,
        num_blocks=40,
        max_model_len=128,
    )
    executor = llm.engine.executor
    pids = executor.worker_pids
    real = executor.runner.execute_model
    calls = []

    def interrupted(out):
        calls.append(out)
        if len(calls) == 3:  # after the step's broadcast: the workers are in its forward
            raise KeyboardInterrupt
        return real(out)

    executor.runner.execute_model = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["hello"] * 2, greedy(), use_tqdm=False)
        assert wait_gone(pids, 30)
        with pytest.raises(WorkerError, match="interrupted"):
            llm.generate(["hello"], greedy(), use_tqdm=False)
    finally:
        executor.shutdown()


def test_ctrl_c_stops_every_rank():
    # Ctrl-C sends SIGINT to the whole foreground process group: the workers ignore it, the
    # engine process gets KeyboardInterrupt and its exit stops them.
    script = textwrap.dedent(
        f"""
        import functools, signal, sys
        # Ctrl-C as a terminal gives it, whatever this test's process left to its children: an
        # ignored SIGINT disposition and a blocked signal mask are both inherited through exec
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from _tiny_model import tiny_gemma3_model_loader, tiny_loaded_model
        from pagedkv.engine.llm import LLM
        from pagedkv.sampling_params import SamplingParams
        llm = LLM(model_loader=functools.partial(tiny_loaded_model), tensor_parallel_size=2,
                  dtype="float32", num_threads=1, num_blocks=40, max_model_len=128)
        print(*llm.engine.executor.worker_pids, flush=True)
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        while True:
            llm.generate(["hello"] * 4, params, use_tqdm=False)
        """
    )
    # stderr goes to a file, not a pipe nobody reads while the engine runs: a full pipe would
    # block the process in a write (then it could not even print its KeyboardInterrupt).
    with tempfile.TemporaryFile(mode="w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        try:
            pids = [int(p) for p in proc.stdout.readline().split()]
            assert pids and all(alive(p) for p in pids)
            os.killpg(proc.pid, signal.SIGINT)
            try:
                code = proc.wait(timeout=150)  # generous: a loaded 2-core machine
            except subprocess.TimeoutExpired:
                code = None
            stderr.seek(0)
            text = stderr.read()
            assert code not in (None, 0), f"exit code {code}; stderr:\n{text[-3000:]}"
            assert "KeyboardInterrupt" in text
        finally:
            proc.kill()
            proc.wait()
    assert wait_gone(pids, 10)


def test_kv_sizing_counts_one_ranks_kv_heads():
    # The same per-rank budget holds tp / (KV heads per rank) times the blocks: SmolLM2's 3 KV
    # heads are 1 per rank at tp=3 (header only, nothing loads).
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.kv_sizing import size_kv_cache
    from pagedkv.model.loader import load_model_config

    shape = load_model_config()
    budget = {
        "kv_cache_memory": "64MiB",
        "max_model_len": 256,
        "dtype": "float32",
        "block_size": 16,
    }
    one = size_kv_cache(shape, EngineConfig(**budget))
    three = size_kv_cache(shape, EngineConfig(tensor_parallel_size=3, **budget))
    assert three.num_blocks == 3 * one.num_blocks
    assert three.kv_cache_specs[0].num_kv_heads == 1


def test_an_unguarded_script_gets_the_main_guard_hint(tmp_path):
    # spawn re-imports the main script in each rank: unguarded, the rank dies at start-up; the
    # error says what to change (vLLM's users meet the same rule).
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import functools, sys
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            from _tiny_model import tiny_gemma3_model_loader, tiny_loaded_model
            from pagedkv.engine.llm_engine import LLMEngine
            LLMEngine(model_loader=functools.partial(tiny_loaded_model), tensor_parallel_size=2,
                      dtype="float32", num_threads=1, num_blocks=20, max_model_len=64)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "WorkerError" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr.splitlines()[-1]
