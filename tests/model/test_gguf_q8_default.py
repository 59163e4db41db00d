"""int8 activations are the default of the GGUF products (as llama.cpp's): the default model
(SmolLM2-135M, Q4_1 linears and a Q8_0 embedding / LM head) on them against the same model
with ``PAGEDKV_GGUF_ACTIVATIONS=fp32`` (the exact opt-out), greedy, a few prompts."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model.kernels.cpu_quant import ACTIVATIONS_ENV, default_cpu_quant_kernels

PROMPTS = (
    "The capital of France is",
    "def fib(n):",
    "Once upon a time",
    "Paging in operating systems",
    "List three primary colors:",
)
#: greedy tokens generated per prompt
STEPS = 16


def test_q8_is_the_default_and_fp32_the_opt_out(monkeypatch):
    monkeypatch.delenv(ACTIVATIONS_ENV, raising=False)
    kernels = default_cpu_quant_kernels()
    if kernels is None:
        pytest.skip("pagedkv's CPU kernels do not run here")
    assert kernels.activations == "q8"
    monkeypatch.setenv(ACTIVATIONS_ENV, "fp32")
    assert default_cpu_quant_kernels().activations == "fp32"


@pytest.fixture(scope="module")
def models(gguf_path):
    """The default model loaded twice as the engine loads it (the file's blocks as stored):
    with int8 activations (the default) and fp32 ones."""
    from pagedkv.model.loader import load_model

    loaded = {}
    for activations in ("q8", "fp32"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(ACTIVATIONS_ENV, activations)
            if default_cpu_quant_kernels() is None:
                pytest.skip("pagedkv's CPU kernels do not run here")
            # quantization None: the engine's default for a GGUF file, its blocks as stored
            loaded[activations] = load_model(gguf_path, dtype=torch.float32, quantization=None)
            if loaded[activations].quantization != "gguf":
                pytest.skip(f"the GGUF runs {loaded[activations].quantization!r} here")
    return loaded


def test_q8_default_against_fp32_greedy(models, paged_runner):
    """Each prompt, then 16 greedy decode steps fed the fp32 run's tokens (so both see the
    same inputs; prompts of at most 8 tokens, so the prefill runs the int8 products too):
    logits within 5 % of the fp32 logits' range at every step (measured: at most 3.4 %;
    int8 activations round each block of 32 to a step of ``max |x| / 127``), and the same
    greedy token at 95 % of the steps at least (measured: 79 of 80), each other one a near
    tie in the fp32 logits (the q8 pick within twice the step's logit error of the top)."""
    tokenizer = models["fp32"].tokenizer
    worst, same, steps = 0.0, 0, 0
    for prompt in PROMPTS:
        runners = {
            k: paged_runner(m.model, num_blocks=16, block_size=16) for k, m in models.items()
        }
        chunk = tokenizer.encode(prompt)
        assert len(chunk) <= 8
        for _ in range(STEPS):
            logits = {k: r.step([(0, chunk)])[0][-1] for k, r in runners.items()}
            want, got = logits["fp32"], logits["q8"]
            diff = float((got - want).abs().max())
            error = diff / float(want.max() - want.min())
            worst = max(worst, error)
            assert error <= 0.05, (prompt, error)
            token, pick = int(want.argmax()), int(got.argmax())
            steps += 1
            same += pick == token
            assert float(want[token] - want[pick]) <= 2 * diff, (prompt, token, pick)
            chunk = [token]
    assert same >= 0.95 * steps, (same, steps)
    assert worst > 0.0  # the two runs differ: the default reached the int8 products
