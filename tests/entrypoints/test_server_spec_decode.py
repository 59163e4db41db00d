"""``pagedkv serve --speculative-config`` on the real default model (fp32; n-gram drafts, and the
model drafting for itself), with the openai client:
completions and streaming chat give the tokens of an engine without speculation, the
spec-decode counters move in /metrics, and a beam search is a 400 naming use_beam_search."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from _serve_process import serve_process

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
MAX_TOKENS = 48
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
    # the default model drafting for itself (the weights loaded once, the KV in one pool)
    "draft_model": {"model": "smollm2", "num_speculative_tokens": 4},
}
TEXT = (
    "The block pool hands out fixed-size blocks of KV cache. A request's block table maps its "
    "token positions to blocks, so its KV need not be contiguous."
)
PROMPT = f"Repeat this text exactly: {TEXT}\nRepeated: {TEXT[:40]}"
CHAT = [{"role": "user", "content": f"Copy this text exactly:\n\n{TEXT}"}]


@pytest.fixture(scope="module")
def offline():
    """Greedy outputs of an engine without speculation on the same weights."""
    torch = pytest.importorskip("torch")
    from pagedkv.engine.llm import LLM
    from pagedkv.errors import ModelLoadError
    from pagedkv.model.loader import load_model
    from pagedkv.sampling_params import SamplingParams

    try:
        loaded = load_model(dtype=torch.float32)
    except ModelLoadError as exc:
        pytest.skip(f"default model not installed: {exc}")
    llm = LLM(
        dtype="float32", max_model_len=MAX_MODEL_LEN, loaded_model=loaded, attention_backend="torch"
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return (
        llm.generate([PROMPT], params, use_tqdm=False)[0].text,
        llm.chat([CHAT], params, use_tqdm=False)[0].text,
    )


@pytest.fixture(scope="module", params=SPECS.values(), ids=SPECS.keys())
def server(request):
    args = [
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--attention-backend", "torch",
        "--speculative-config", json.dumps(request.param),
    ]  # fmt: skip
    with serve_process(args) as (url, output):
        yield url, output


def test_openai_client_gets_the_tokens_of_no_speculation(server, offline):
    url, _ = server
    completion_text, chat_text = offline
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        result = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        assert result.choices[0].text == completion_text
        stream = client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat_text
        with pytest.raises(openai.BadRequestError, match="use_beam_search"):
            client.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=4,
                extra_body={"use_beam_search": True, "n": 2},
            )
    metrics = {
        line.split("{")[0]: float(line.split()[-1])
        for line in httpx.get(url + "/metrics").text.splitlines()
        if line.startswith("pagedkv:spec_decode_num")
    }
    assert metrics["pagedkv:spec_decode_num_drafts_total"] > 0
    assert (
        0
        < metrics["pagedkv:spec_decode_num_accepted_tokens_total"]
        <= (metrics["pagedkv:spec_decode_num_draft_tokens_total"])
    )


def test_a_bad_speculative_config_is_refused_at_start():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pagedkv.entrypoints.cli", "serve", "--port", "0",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    assert "num_speculative_tokens" in done.stdout + done.stderr
