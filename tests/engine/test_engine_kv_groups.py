"""The engine with several KV cache groups, fast: a tiny random Gemma 3 (layers sliding, full,
sliding, sliding; window 8; blocks of 4 tokens) against transformers' Gemma3ForCausalLM on the
same weights, greedy, token for token. Its groups: three sliding-window groups of one layer and
one full-attention group, each with its own block table and slot mapping every step.

The real Gemma 3 270M runs the same checks in test_gemma3_engine.py (slow).
"""

from __future__ import annotations

import pytest
import torch
from _tiny_model import tiny_gemma3_hf_model, tiny_gemma3_loaded_model

from pagedkv.config import SchedulerConfig
from pagedkv.core.config import KVCacheConfig
from pagedkv.core.spec import FullAttentionSpec
from pagedkv.engine.llm import LLM
from pagedkv.errors import ConfigError
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.model_runner import ModelRunner

pytest.importorskip("transformers")

WINDOW = 8
BLOCK_SIZE = 4
MAX_TOKENS = 12
PROMPT_LENGTHS = (5, 23, 37)


@pytest.fixture(scope="module")
def hf():
    return tiny_gemma3_hf_model()


@pytest.fixture(scope="module")
def loaded(hf):
    return tiny_gemma3_loaded_model(hf)


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(2, 96, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(hf, prompts):
    """transformers' greedy tokens (a full forward per token: the model is tiny)."""
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            sequence = list(ids)
            for _ in range(MAX_TOKENS):
                logits = hf(torch.tensor([sequence])).logits[0, -1]
                sequence.append(int(logits.argmax()))
            outputs.append(sequence[len(ids) :])
    return outputs


def make_llm(loaded, **options) -> LLM:
    options = {
        "num_blocks": 200,
        "block_size": BLOCK_SIZE,
        "max_model_len": 64,
        "max_num_batched_tokens": 64,
        **options,
    }
    return LLM(dtype="float32", num_threads=1, loaded_model=loaded, **options)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

CONFIGS = {
    "batched": {},
    "chunked-prefill-8": {"max_num_batched_tokens": 8},
    "one-at-a-time": {"max_num_seqs": 1},
    "no-prefix-caching": {"enable_prefix_caching": False},
    # Every layer held as full attention: one group, the windows still applied per layer.
    "hybrid-disabled": {"disable_hybrid_kv_cache_manager": True},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_transformers(name, loaded, prompts, reference):
    llm = make_llm(loaded, **CONFIGS[name])
    groups = llm.engine.kv_cache_config.kv_cache_groups
    assert len(groups) == (1 if name == "hybrid-disabled" else 4)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in outputs] == reference
    assert llm.engine.kv_cache_manager.usage == 0.0


def windows(engine) -> tuple[tuple[int, int | None], ...]:
    """(KV cache group, window) of each distinct (group, layer spec) the runner builds for."""
    groups = engine.runner.input_batch.attention_groups
    return tuple((g, spec.sliding_window) for g, spec in groups)


def test_groups_and_their_windows(loaded):
    engine = make_llm(loaded).engine
    groups = engine.kv_cache_config.kv_cache_groups
    assert [g.layer_ids for g in groups] == [(0,), (2,), (3,), (1,)]
    assert windows(engine) == ((0, 8), (1, 8), (2, 8), (3, None))
    assert engine.runner.input_batch.layer_attention_groups == (0, 3, 1, 2)
    # every layer's spec carries Gemma's scale (query_pre_attn_scalar), not head_dim ** -0.5
    config = loaded.config
    scalar = config.query_pre_attn_scalar or config.head_dim
    assert {spec.scale for spec in engine.runner.layer_specs} == {float(scalar) ** -0.5}
    unified = make_llm(loaded, disable_hybrid_kv_cache_manager=True).engine
    assert windows(unified) == ((0, 8), (0, None))
    assert unified.runner.input_batch.layer_attention_groups == (0, 1, 0, 0)


def test_out_of_window_blocks_are_freed_while_decoding(loaded, prompts, reference):
    """The 37-token prompt: while it decodes, each sliding-window table holds the null block
    for every block wholly before the window and the blocks in use drop below the prefill's."""
    engine = make_llm(loaded).engine
    engine.add_request("r", prompts[2], GREEDY)
    manager = engine.kv_cache_manager
    in_use, tables = [], []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        in_use.append(engine.kv_cache_config.num_usable_blocks - manager.num_free_blocks)
        if not outputs[0].finished:
            tables.append(manager.get_block_ids("r"))
    assert list(outputs[0].token_ids) == reference[2]
    # The last step that did not finish computed the 11th output token, at position p = 46
    # (step 0 computes the prompt, step j position 36 + j); its window is p - 7 .. p.
    position = PROMPT_LENGTHS[2] + MAX_TOKENS - 3
    num_blocks = position // BLOCK_SIZE + 1
    first_live = (position - WINDOW + 1) // BLOCK_SIZE
    *sliding, full = tables[-1]
    assert full == [b for b in full if b != 0] and len(full) == num_blocks
    for table in sliding:
        assert table[:first_live] == [0] * first_live and 0 not in table[first_live:]
    assert in_use[0] == 4 * -(-PROMPT_LENGTHS[2] // BLOCK_SIZE)  # the prompt, every group
    assert in_use[-2] == num_blocks + 3 * (num_blocks - first_live) < in_use[0]
    assert in_use[-1] == 0


def test_prefix_cache_hit_agreed_by_every_group(loaded, prompts, reference):
    llm = make_llm(loaded)
    first = llm.generate([prompts[2]], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prompts[2]], GREEDY, use_tqdm=False)[0]
    hit = (PROMPT_LENGTHS[2] - 1) // BLOCK_SIZE * BLOCK_SIZE  # 36: the last token is computed
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, hit)
    assert list(first.token_ids) == list(second.token_ids) == reference[2]


def test_preemption_with_a_small_pool(loaded, prompts, reference):
    """39 usable blocks; a request of 64 tokens holds at most 16 full-attention blocks + 3 x 5
    sliding-window ones (8-token steps), so one always fits but the three prompts together do
    not: requests are preempted, recomputed, and still give transformers' tokens."""
    llm = make_llm(loaded, num_blocks=40, max_num_batched_tokens=8)
    assert llm.engine.kv_cache_config.max_num_blocks_per_request() == 16 + 3 * 5
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.get_stats().scheduler.num_preemptions > 0
    assert [list(o.token_ids) for o in outputs] == reference
    assert llm.engine.kv_cache_manager.usage == 0.0


SCHED = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)


def test_runner_refuses_a_group_whose_window_is_not_its_layers(loaded):
    """A sliding-window group would free blocks that a full-attention layer still reads."""
    specs = [FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=32, dtype="float32")] * 4
    wrong = KVCacheConfig.from_num_blocks(specs, 16)
    # Every layer full attention in the cache is fine (the unified form) ...
    ModelRunner(loaded.model, wrong, SCHED)
    # ... a window on a full-attention layer is not; nor a config of another layer count.
    from pagedkv.core.spec import SlidingWindowSpec

    sliding = SlidingWindowSpec(
        block_size=4, num_kv_heads=2, head_size=32, dtype="float32", sliding_window=8
    )
    with pytest.raises(ConfigError, match="layer 1 attends to every token"):
        ModelRunner(
            loaded.model,
            KVCacheConfig.from_num_blocks([sliding] * 4, 16),
            SCHED,
        )
    with pytest.raises(ConfigError, match="3 layers, the model 4"):
        ModelRunner(
            loaded.model,
            KVCacheConfig.from_num_blocks(specs[:3], 16),
            SCHED,
        )


def test_an_eos_id_beyond_the_vocabulary_is_never_masked(loaded, prompts):
    """The tiny Gemma's tokenizer says EOS 127, its vocabulary has 96 ids: the engine keeps only
    the EOS ids the model can sample, so min_tokens masks nothing out of range."""
    engine = make_llm(loaded).engine
    assert all(t < loaded.config.vocab_size for t in engine.eos_token_ids)
    engine.add_request("r", prompts[0], SamplingParams(temperature=0, max_tokens=4, min_tokens=3))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finish_reason == "length" and len(outputs[-1].token_ids) == 4
