"""The engine process's output wire (pagedkv.engine.engine_process.OutputDeltas /
OutputAssembler): outputs sent as deltas and assembled again equal the engine's own, step by
step, for stop strings, n > 1, best_of, logprobs, prompt logprobs and an abort; nothing is kept
for a request once it finished (fast, the tiny random model)."""

from __future__ import annotations

import pickle

import pytest
from _tiny_model import tiny_loaded_model

from pagedkv.engine.engine_process import OutputAssembler, OutputDeltas
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


def snapshot(output) -> tuple:
    """What a consumer reads of an output at the time it gets it (lists copied: both sides
    hand on lists that keep growing)."""
    completions = tuple(
        (
            c.index, c.text, tuple(c.token_ids), c.new_text, tuple(c.new_token_ids),
            c.finish_reason, c.stop_reason, c.error,
            None if c.logprobs is None else repr(c.logprobs), c.cumulative_logprob,
        )
        for c in output.outputs
    )  # fmt: skip
    return (
        output.request_id, output.prompt, tuple(output.prompt_token_ids), output.finished,
        repr(output.prompt_logprobs), output.num_cached_tokens, repr(output.metrics),
        completions,
    )  # fmt: skip


def test_deltas_assemble_into_the_engines_outputs(tiny):
    engine = LLMEngine(
        loaded_model=tiny, dtype="float32", num_threads=1, num_blocks=120, max_model_len=256,
        block_size=4,
    )  # fmt: skip
    requests = {
        "stop": SamplingParams(temperature=0, max_tokens=20, stop=["q", "zz"]),
        "n2": SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12, logprobs=2),
        "prompt_lp": SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, logprobs=0),
        "best_of": SamplingParams(temperature=1.0, seed=3, n=1, best_of=3, max_tokens=8),
        "aborted": SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
    }
    for i, (rid, params) in enumerate(requests.items()):
        engine.add_request(rid, {"prompt": f"prompt number {i} about paging"}, params)
    deltas, assembler = OutputDeltas(), OutputAssembler()
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        wire = pickle.loads(pickle.dumps(deltas.encode(outputs)))
        assembled = assembler.decode(wire)
        assert [snapshot(o) for o in assembled] == [snapshot(o) for o in outputs]
        steps += 1
        if steps == 3:
            engine.abort_request(["aborted"])
    assert steps > 3
    assert assembler._requests == {} and deltas._started == set()  # nothing kept after finish
    assert deltas._prompt_logprobs_sent == set()
