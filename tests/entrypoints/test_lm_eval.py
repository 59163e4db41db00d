"""Acceptance: EleutherAI's lm-eval harness against a running ``pagedkv serve``.

``pagedkv serve`` (the real CLI, fp32, a free loopback port) and ``lm_eval --model
local-completions`` (a second process, offline) run the two tasks the project ships in
tests/data/lm_eval_tasks: a loglikelihood multiple-choice task (scored through /v1/completions
with ``echo``, ``logprobs`` and ``max_tokens: 1``: the prompt tokens' logprobs) and a
generate-until task. The harness tokenizes through the server's /tokenizer_info, /tokenize and
/detokenize (its ``remote`` tokenizer backend: no model hub, no local tokenizer files). Every
per-item log-likelihood must equal transformers' on the same GGUF in fp32 within 1e-3.

The command and its runtime are in docs/server.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _serve_process import serve_process

pytestmark = pytest.mark.slow

TASKS = Path(__file__).parents[1] / "data" / "lm_eval_tasks"
MODEL = "smollm2"
LIMIT = 4
TOL = 1e-3


@pytest.fixture(scope="module")
def server_url(gguf_path):
    pytest.importorskip("lm_eval")
    args = ["--model", str(gguf_path), "--dtype", "float32", "--max-model-len", "512"]
    args += ["--served-model-name", MODEL, "--log-level", "warning", "--disable-log-stats"]
    with serve_process(args) as (url, _):
        yield url


def run_lm_eval(url: str, out: Path) -> dict[str, list[dict]]:
    """Run the harness on both tasks; returns each task's logged samples."""
    model_args = ",".join(
        [
            f"base_url={url}/v1/completions",
            f"model={MODEL}",
            "tokenizer_backend=remote",
            "num_concurrent=1",
            "max_retries=1",
            "timeout=300",
        ]
    )
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--include_path",
        str(TASKS),
        "--tasks",
        "pagedkv_mc,pagedkv_gen",
        "--limit",
        str(LIMIT),
        "--log_samples",
        "--output_path",
        str(out),
    ]
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(out / "hf"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    samples = {}
    for task in ("pagedkv_mc", "pagedkv_gen"):
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines() if line]
    (results,) = out.rglob("results_*.json")
    summary = json.loads(results.read_text())["results"]
    assert "acc,none" in summary["pagedkv_mc"]
    assert "exact_match,none" in summary["pagedkv_gen"]
    return samples


def hf_loglikelihood(hf_model, tokenizer, context: str, continuation: str) -> float:
    """log P(continuation | context) with transformers, tokenized as lm-eval does (trailing
    spaces of the context move to the continuation; the whole text is encoded, then split at
    the context's length; no special tokens)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    num_context = len(tokenizer.encode(context, add_special_tokens=False))
    with torch.inference_mode():
        logits = hf_model(torch.tensor([whole])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(logprobs[j - 1, whole[j]].item() for j in range(num_context, len(whole)))


def test_lm_eval_against_pagedkv_serve(server_url, loaded_fp32, hf_model, tmp_path):
    samples = run_lm_eval(server_url, tmp_path)
    mc, gen = samples["pagedkv_mc"], samples["pagedkv_gen"]
    assert len(mc) == LIMIT and len(gen) == LIMIT
    tokenizer = loaded_fp32.tokenizer
    checked = 0
    for doc in mc:
        for i, response in enumerate(doc["resps"]):
            args = doc["arguments"][f"gen_args_{i}"]
            got = float(response[0][0])
            want = hf_loglikelihood(hf_model, tokenizer, args["arg_0"], args["arg_1"])
            assert abs(got - want) <= TOL, (args, got, want)
            checked += 1
    assert checked == LIMIT * 4
    # generate_until ran to completion: one greedy answer per item, cut at the newline.
    for doc in gen:
        (answer,) = doc["resps"][0]
        assert isinstance(answer, str) and "\n" not in answer
