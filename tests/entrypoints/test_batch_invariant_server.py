"""``pagedkv serve --batch-invariant`` (issue 50): concurrent completions, streamed and not, with
logprobs, give each prompt's alone tokens and logprobs bit for bit.

A real server of the tiny Q4_K_M-like Llama (``tests/engine/_batch_invariance.py``): the
reference is the same file decoded alone in this process (no prefix cache) on the server's
configuration; the server's answers to one request at a time (a plain and a streamed request
of each prompt: prefix-cache hits) must equal it, then the same fourteen requests sent at once
must too. JSON carries
a float as its shortest round-trip text, so ``==`` on the parsed floats is bitwise.

Without the switch (``PAGEDKV_BATCH_INVARIANT_TESTS=without-flag``) the concurrent part fails.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from _batch_invariance import (
    LOGPROBS,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPTS,
    Arrival,
    batch_invariant_options,
    engine_options,
    greedy,
    has_switch,
    run_schedule,
    without_flag,
    write_tiny_ggufs,
)

#: The server's configuration, as flags and as the in-process reference's options.
BLOCK_SIZE = 16
DTYPE = "bfloat16"


@pytest.fixture(scope="module")
def switch():
    """The switch's options (skips where the engine has none yet)."""
    return batch_invariant_options()


@pytest.fixture(scope="module")
def model(tmp_path_factory, switch):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    target, _ = write_tiny_ggufs(tmp_path_factory.mktemp("batch-invariant-server"))
    return target


def as_openai(output) -> dict:
    """A finished engine output as a completions choice's comparable part: text, tokens,
    token_logprobs, top_logprobs (the server's own conversion)."""
    from pagedkv.entrypoints.openai.logprobs import completion_logprobs

    sample = output.outputs[0]
    logprobs, _ = completion_logprobs(sample.token_ids, sample.logprobs, LOGPROBS, 0)
    return {
        "text": sample.text,
        "tokens": logprobs.tokens,
        "token_logprobs": logprobs.token_logprobs,
        "top_logprobs": logprobs.top_logprobs,
    }


@pytest.fixture(scope="module")
def reference(model, switch):
    """Each prompt decoded alone in this process, on the server's configuration."""
    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        model=str(model),
        **engine_options(
            dtype=DTYPE, quantization="gguf", block_size=BLOCK_SIZE, enable_prefix_caching=False
        ),
    )
    result = []
    for i in range(len(PROMPTS)):
        outputs = run_schedule(engine, [Arrival(f"alone-{i}", i, 0, greedy(i))])
        result.append(as_openai(outputs[f"alone-{i}"]))
    engine.shutdown()
    return result


@pytest.fixture(scope="module")
def server(model, switch):
    from _serve_process import serve_process

    options = engine_options()  # the harness's: native, one thread, max_model_len, switch
    args = [
        str(model),
        "--dtype", DTYPE,
        "--quantization", "gguf",
        "--block-size", str(BLOCK_SIZE),
        "--attention-backend", options["attention_backend"],
        "--num-threads", str(options["num_threads"]),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--disable-log-stats",
    ]  # fmt: skip
    if options.get("batch_invariant"):
        args.append("--batch-invariant")
    with serve_process(args) as (url, _):
        yield url


def complete(url: str, prompt: int, stream: bool) -> dict:
    """One completion of prompt #``prompt`` (greedy, its max_tokens, EOS ignored, top-3
    logprobs), streamed or not, as :func:`as_openai`'s dict (a stream's chunks joined)."""
    import httpx

    body = {
        "prompt": list(PROMPTS[prompt]),
        "max_tokens": MAX_TOKENS[prompt],
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": LOGPROBS,
        "stream": stream,
    }
    joined = {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": []}
    with httpx.Client(base_url=url, timeout=300) as client:
        if not stream:
            response = client.post("/v1/completions", json=body)
            response.raise_for_status()
            choices = [response.json()["choices"][0]]
        else:
            choices = []
            with client.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    choices += chunk["choices"]
    for choice in choices:
        joined["text"] += choice["text"]
        if choice.get("logprobs"):
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                joined[key] += choice["logprobs"][key]
    return joined


@pytest.mark.slow
def test_concurrent_requests_give_the_alone_outputs(server, reference):
    """One request at a time first (the later ones of a prompt, and those sharing a prefix,
    hit the prefix cache), then every request at once."""
    jobs = [(i, stream) for i in range(len(PROMPTS)) for stream in (False, True)]
    one_at_a_time = [complete(server, i, stream) for i, stream in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        concurrent = list(pool.map(lambda job: complete(server, *job), jobs))
    differ = [
        f"{phase}: prompt {i} {'streamed' if stream else 'plain'}"
        for phase, results in (("one at a time", one_at_a_time), ("concurrent", concurrent))
        for (i, stream), got in zip(jobs, results, strict=True)
        if got != reference[i]
    ]
    assert not differ, "differ from alone:\n" + "\n".join(differ)


def test_the_cli_takes_the_switch():
    """``--batch-invariant`` on ``serve`` and ``generate`` sets EngineConfig.batch_invariant."""
    if without_flag() or not has_switch():
        pytest.skip("EngineConfig has no batch_invariant yet (issue 50)")
    from pagedkv.engine.config import EngineConfig
    from pagedkv.entrypoints.cli import build_parser

    parser = build_parser()
    for argv in (["serve", "m.gguf"], ["generate"]):
        assert EngineConfig.from_cli_args(parser.parse_args(argv)).batch_invariant is False
        args = parser.parse_args([*argv, "--batch-invariant"])
        assert EngineConfig.from_cli_args(args).batch_invariant is True
