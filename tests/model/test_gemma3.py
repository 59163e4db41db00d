"""Gemma 3 over a paged KV cache against transformers' Gemma3ForCausalLM on the same weights (fp32).

Fast tests run a tiny random Gemma 3 (sliding window 8, GQA, query scale and rope scaling of its
own, random norm weights); slow ones the real Gemma 3 270M GGUF (skipped without the ``gemma``
extra) on prompts shorter than and well past its 512-token window.

The sequences run through :class:`WindowedRunner`: one block table per sequence, as the engine's
full-attention group has it, and for the sliding-window layers the same table with the null block
in place of every block that lies wholly before the window of the step's first query (what the
engine's sliding-window groups hold once those blocks went back to the pool). The null block of
every cache holds NaN, so a layer that read it would poison the output.
"""

from __future__ import annotations

import pytest
import torch
from _tiny_model import tiny_gemma3_hf_model

from pagedkv.core.config import KVCacheConfig
from pagedkv.core.invariants import check_invariants
from pagedkv.core.spec import FullAttentionSpec, SlidingWindowSpec
from pagedkv.errors import InvalidRequestError, ModelLoadError, OpsInputError
from pagedkv.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    kv_cache_layer_specs,
)
from pagedkv.model.gemma3 import Gemma3ForCausalLM
from pagedkv.modelinfo.shape import pattern_windows
from pagedkv.ops.backends import CommonAttentionMetadata, TorchBackend, bind_metadata

transformers = pytest.importorskip("transformers")

#: Tiny random model vs transformers, max |logit difference| (measured about 2e-6).
TINY_TOLERANCE = 1e-4
#: Gemma 3 270M vs transformers, max |logit difference| over the checked rows (logits reach
#: about 65). Measured 1.4e-4 on a 40-token prompt and 8.2e-4 at 1,500 tokens (docs/model.md).
TOLERANCE = 2e-3


class WindowedRunner:
    """Runs sequences through a Gemma3ForCausalLM with a fresh paged KV cache, one forward per
    :meth:`step` over a flattened batch of (sequence, new tokens) chunks (see the module doc).

    Blocks are handed out in a scrambled order so that a sequence's blocks are not contiguous.
    """

    def __init__(self, model: Gemma3ForCausalLM, num_blocks: int = 128, block_size: int = 16):
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = TorchBackend(model.device)
        self.specs = model.attention_layer_specs(block_size)
        self.kv_caches = []
        for spec in self.specs:
            cache = self.backend.allocate_kv_cache(num_blocks, spec)
            cache[:, 0] = float("nan")  # the null block (torch layout): never to be read
            self.kv_caches.append(cache)
        generator = torch.Generator().manual_seed(0)
        self._free_blocks = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
        self.block_ids: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}
        #: blocks replaced by the null block in the sliding-window tables of the last step.
        self.num_skipped_blocks = 0

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One forward over ``chunks`` = [(seq_id, new token ids), ...]; returns per chunk the
        final hidden states ``[len(new token ids), hidden]`` (see :meth:`logits`)."""
        bs = self.block_size
        input_ids, positions, slots, seq_lens, qsl = [], [], [], [], [0]
        for seq_id, token_ids in chunks:
            start = self.num_computed.get(seq_id, 0)
            end = start + len(token_ids)
            blocks = self.block_ids.setdefault(seq_id, [])
            while len(blocks) * bs < end:
                blocks.append(self._free_blocks.pop())
            input_ids += token_ids
            positions += range(start, end)
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            seq_lens.append(end)
            qsl.append(qsl[-1] + len(token_ids))
            self.num_computed[seq_id] = end
        max_blocks = max(len(self.block_ids[seq_id]) for seq_id, _ in chunks)
        table = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for row, (seq_id, _) in enumerate(chunks):
            blocks = self.block_ids[seq_id]
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        slot_mapping = torch.tensor(slots, dtype=torch.int64)

        metadata = {}
        self.num_skipped_blocks = 0
        for window in set(self.model.layer_sliding_windows):
            window_table = table
            if window is not None:
                window_table = table.clone()
                for row, (seq_id, token_ids) in enumerate(chunks):
                    first_query = self.num_computed[seq_id] - len(token_ids)
                    skipped = max(0, first_query - window + 1) // bs
                    window_table[row, :skipped] = 0
                    self.num_skipped_blocks += skipped
            common = CommonAttentionMetadata(
                window_table, seq_lens_t, qsl_t, slot_mapping, num_blocks=self.num_blocks
            )
            specs = [s for s in self.specs if s.sliding_window == window]
            metadata[window] = bind_metadata(self.backend, common, specs[:1])[0]
        per_layer = [metadata[w] for w in self.model.layer_sliding_windows]
        hidden = self.model.forward(
            torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, per_layer
        )
        return [hidden[qsl[i] : qsl[i + 1]] for i in range(len(chunks))]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden-state rows."""
        return self.model.compute_logits(hidden)


def hf_logits(hf_model, token_ids: list[int], rows: list[int] | None = None) -> torch.Tensor:
    """transformers' logits of ``token_ids`` at ``rows`` (None = every row), fp32."""
    with torch.inference_mode():
        hidden = hf_model.model(torch.tensor([token_ids])).last_hidden_state[0]
        if rows is not None:
            hidden = hidden[rows]
        return hf_model.lm_head(hidden).float()


# ---------------------------------------------------------------- tiny random model (fast)


@pytest.fixture(scope="module")
def tiny_pair():
    hf = tiny_gemma3_hf_model()
    config = ModelConfig.from_hf_config(hf.config.to_dict(), has_lm_head=False)
    return Gemma3ForCausalLM(config, hf.state_dict()), hf


def test_tiny_config_from_transformers(tiny_pair):
    ours, _ = tiny_pair
    config = ours.config
    assert config.architecture == "gemma3"
    assert ours.layer_sliding_windows == (8, None, 8, 8)
    assert config.rope_theta == 1e6 and config.rope_local_theta == 1e4
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.query_pre_attn_scalar == 24 and config.tie_word_embeddings


def test_tiny_prefill_past_window_matches_transformers(tiny_pair):
    ours, hf = tiny_pair
    tokens = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = WindowedRunner(ours, num_blocks=32, block_size=4)
    (hidden,) = runner.step([(0, tokens)])
    error = (runner.logits(hidden) - hf_logits(hf, tokens)).abs().max().item()
    assert error < TINY_TOLERANCE


def test_tiny_chunked_prefill_and_decode_free_out_of_window_blocks(tiny_pair):
    ours, hf = tiny_pair
    tokens = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    runner = WindowedRunner(ours, num_blocks=32, block_size=4)
    logits = []
    for chunk in (tokens[:5], tokens[5:19], tokens[19:]):
        (hidden,) = runner.step([(0, chunk)])
        logits.append(runner.logits(hidden))
    assert runner.num_skipped_blocks > 0  # the last chunk's window starts past block 0
    sequence = list(tokens)
    for _ in range(6):
        sequence.append(int(logits[-1][-1].argmax()))
        (hidden,) = runner.step([(0, sequence[-1:])])
        logits.append(runner.logits(hidden))
        assert runner.num_skipped_blocks > 0
    ours_logits = torch.cat(logits)
    reference = hf_logits(hf, sequence)
    assert (ours_logits - reference).abs().max().item() < TINY_TOLERANCE


def test_tiny_mixed_batch_equals_one_at_a_time(tiny_pair):
    """A decode, a first prefill chunk and a later chunk in one forward give each sequence the
    logits it gets alone."""
    ours, _ = tiny_pair
    generator = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, 96, (n,), generator=generator).tolist() for n in (21, 17, 26))
    alone = []
    for tokens, split in ((a, 20), (b, 17), (c, 11)):
        runner = WindowedRunner(ours, num_blocks=32, block_size=4)
        if split < len(tokens):
            runner.step([(0, tokens[:split])])
        (hidden,) = runner.step([(0, tokens[split:] if split < len(tokens) else tokens)])
        alone.append(runner.logits(hidden))
    runner = WindowedRunner(ours, num_blocks=32, block_size=4)
    runner.step([(0, a[:20]), (2, c[:11])])
    together = runner.step([(0, a[20:]), (1, b), (2, c[11:])])
    for mine, reference in zip(together, alone, strict=True):
        assert (runner.logits(mine) - reference).abs().max().item() < TINY_TOLERANCE


def _greedy_run(model, prompt: list[int], steps: int, tokens: list[int] | None = None):
    """Prefill ``prompt`` then ``steps`` decode steps; the fed tokens are the greedy ones, or
    ``tokens`` when given (ranks other than 0 have no logits to choose from). Returns the KV
    heads of a cache, the fed tokens and the logits row of each step (None off rank 0)."""
    runner = WindowedRunner(model, num_blocks=32, block_size=4)
    (hidden,) = runner.step([(0, prompt)])
    fed, rows = [], []
    for i in range(steps):
        row = runner.logits(hidden[-1:])
        rows.append(row)
        fed.append(int(row[0].argmax()) if tokens is None else tokens[i])
        (hidden,) = runner.step([(0, fed[-1:])])
    return runner.kv_caches[0].shape[2], fed, rows


@pytest.mark.parametrize("tp", [2, 4])
def test_tiny_tensor_parallel_equals_one_rank_and_transformers(
    tiny_pair, tensor_parallel_ranks, tp
):
    """Split 2 ways (2 query heads and 1 KV head per rank) or 4 (1 query head, each KV head on
    two ranks) through the same parallel layers as Llama: a prefill past the window, then decode
    steps fed the one-rank model's greedy tokens; rank 0's logits are the one-rank model's (so
    are its greedy tokens) and transformers'; the other ranks get None."""
    ours, hf = tiny_pair
    prompt = torch.randint(0, 96, (22,), generator=torch.Generator().manual_seed(4)).tolist()
    _, greedy, expected = _greedy_run(ours, prompt, 6)

    def rank(parallel):
        model = Gemma3ForCausalLM(ours.config, hf.state_dict(), parallel=parallel)
        return _greedy_run(model, prompt, 6, greedy)

    results = tensor_parallel_ranks(tp, rank)
    for r, (kv_heads, _, rows) in enumerate(results):
        assert kv_heads == 1
        if r:
            assert rows == [None] * len(expected)
    rows = results[0][2]
    assert [int(row[0].argmax()) for row in rows] == greedy
    for mine, reference in zip(rows, expected, strict=True):
        assert (mine - reference).abs().max().item() < TINY_TOLERANCE
    reference = hf_logits(hf, prompt + greedy, rows=list(range(len(prompt) - 1, len(prompt) + 5)))
    assert (torch.cat(rows) - reference).abs().max().item() < TINY_TOLERANCE


def test_forward_needs_one_metadata_per_layer_with_its_window(tiny_pair):
    ours, _ = tiny_pair
    runner = WindowedRunner(ours, num_blocks=8, block_size=4)
    before = [cache.clone() for cache in runner.kv_caches]
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    seq_lens, qsl = torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    common = CommonAttentionMetadata(table, seq_lens, qsl, torch.tensor([4, 5, 6]), num_blocks=8)
    global_spec = next(s for s in runner.specs if s.sliding_window is None)
    (full,) = bind_metadata(runner.backend, common, [global_spec])
    ids, positions = torch.tensor([1, 2, 3]), torch.arange(3)
    with pytest.raises(OpsInputError, match="one attention metadata per layer"):
        ours.forward(ids, positions, runner.kv_caches, full)
    with pytest.raises(OpsInputError, match="layer 0 has sliding_window 8"):
        ours.forward(ids, positions, runner.kv_caches, [full] * 4)
    for cache, old in zip(runner.kv_caches, before, strict=True):  # nothing was written
        assert torch.equal(cache.nan_to_num(), old.nan_to_num())


def test_load_model_from_hf_folder(tiny_pair, tmp_path):
    """A gemma3_text folder (config.json + safetensors + tokenizer) loads as Gemma3ForCausalLM."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from pagedkv.model.loader import load_model

    _, hf = tiny_pair
    hf.save_pretrained(tmp_path)
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2} | {f"w{i}": i for i in range(3, 96)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    ).save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert isinstance(loaded.model, Gemma3ForCausalLM)
    tokens = [2, 5, 9, 40, 41, 7, 3, 3, 8, 60, 61, 62, 1]
    (hidden,) = WindowedRunner(loaded.model, num_blocks=16, block_size=4).step([(0, tokens)])
    error = (loaded.model.compute_logits(hidden) - hf_logits(hf, tokens)).abs().max().item()
    assert error < TINY_TOLERANCE
    # No chat template in this folder: chat is refused with a clear error.
    assert not loaded.tokenizer.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        loaded.tokenizer.apply_chat_template([{"role": "user", "content": "w3"}])


# ---------------------------------------------------------------- config and KV-cache specs


def gguf_metadata(**extra):
    metadata = {
        "general.architecture": "gemma3",
        "gemma3.context_length": 32768,
        "gemma3.embedding_length": 640,
        "gemma3.block_count": 18,
        "gemma3.feed_forward_length": 2048,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.sliding_window": 512,
        "gemma3.vocab_size": 262144,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
    }
    return ModelConfig.from_gguf_metadata(metadata | extra, {"token_embd.weight"})


def test_gguf_metadata_defaults_are_gemma3s():
    config = gguf_metadata()
    windows = config.layer_sliding_windows
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17]
    assert set(windows) == {512, None}
    assert config.rope_theta == 1e6 and config.rope_local_theta == 10000.0
    assert config.query_pre_attn_scalar == 256
    assert config.tie_word_embeddings and config.final_logit_softcapping is None


def test_gguf_metadata_pattern_and_local_base_when_stored():
    by_period = gguf_metadata(**{"gemma3.attention.sliding_window_pattern": 3})
    assert by_period.layer_sliding_windows == pattern_windows(18, 512, 3)
    flags = [i % 2 == 0 for i in range(18)]
    by_flags = gguf_metadata(
        **{"gemma3.attention.sliding_window_pattern": flags, "gemma3.rope.freq_base_swa": 2e4}
    )
    assert by_flags.layer_sliding_windows == tuple(512 if f else None for f in flags)
    assert by_flags.rope_local_theta == 2e4
    with pytest.raises(ModelLoadError, match="17 entries for 18 layers"):
        gguf_metadata(**{"gemma3.attention.sliding_window_pattern": flags[:17]})


def test_gemma3_27b_query_scale_is_hidden_over_heads():
    config = gguf_metadata(
        **{
            "gemma3.block_count": 62,
            "gemma3.embedding_length": 5376,
            "gemma3.attention.head_count": 32,
            "gemma3.attention.head_count_kv": 16,
            "gemma3.attention.key_length": 128,
        }
    )
    assert config.query_pre_attn_scalar == 168


def test_hf_config_older_form():
    """Configs from before transformers 5: rope_theta, rope_local_base_freq, rope_scaling (for the
    global layers) and sliding_window_pattern, read as transformers reads them."""
    old = {
        "model_type": "gemma3_text",
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": 16,
        "sliding_window_pattern": 3,
        "rope_theta": 5e5,
        "rope_local_base_freq": 2e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    config = ModelConfig.from_hf_config(old)
    reference = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k != "model_type"})
    assert list(config.layer_types) == reference.layer_types
    assert config.rope_theta == reference.rope_parameters[FULL_ATTENTION]["rope_theta"]
    assert config.rope_local_theta == reference.rope_parameters[SLIDING_ATTENTION]["rope_theta"]
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.query_pre_attn_scalar == 32  # head_dim when the config names none


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("hidden_activation", "relu", "hidden_activation"),
        ("model_type", "gemma3", "multimodal"),
    ],
)
def test_hf_config_refuses_what_we_do_not_run(tiny_pair, key, value, message):
    config = tiny_pair[1].config.to_dict() | {key: value}
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_config(config)


def test_kv_cache_specs_group_into_five_sliding_groups_and_one_full():
    """15 sliding-window layers and 3 full ones: groups of 3 (the smaller type's count), so 5
    sliding-window groups and 1 full-attention group share one pool, each block id covering 3
    layers' pages (vLLM groups Gemma 3 the same way)."""
    specs = kv_cache_layer_specs(gguf_metadata(), block_size=16, dtype="bfloat16")
    sliding = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=256, dtype="bfloat16", sliding_window=512
    )
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=256, dtype="bfloat16")
    assert specs == [full if i in (5, 11, 17) else sliding for i in range(18)]
    config = KVCacheConfig.from_num_blocks(
        specs, 1000, max_model_len=8192, max_num_batched_tokens=256
    )
    assert config.group_size == 3 and config.num_padding_layers == 0
    assert [g.layer_ids for g in config.kv_cache_groups] == [
        (0, 1, 2),
        (3, 4, 6),
        (7, 8, 9),
        (10, 12, 13),
        (14, 15, 16),
        (5, 11, 17),
    ]
    assert config.kv_cache_specs == (sliding,) * 5 + (full,)
    assert config.tensor_ids == (0, 1, 2, 0, 1, 0, 2, 0, 1, 2, 0, 1, 1, 2, 0, 1, 2, 2)
    assert config.bytes_per_block == 3 * 2 * 16 * 256 * 2
    # A request of 8192 tokens holds 512 blocks in the full group and, with steps of 256
    # tokens, cdiv(511 + 256, 16) + 1 = 49 per sliding group: (512 + 5 x 49) x 3 pages instead
    # of 512 x 18 (a step as long as the request would keep all 512 in every group).
    assert config.max_num_blocks_per_request() == 512 + 5 * 49
    assert config.max_num_blocks_per_request(8192, 8192) == 6 * 512


def test_kv_cache_manager_runs_the_six_groups():
    """The core's manager takes the six groups and frees the sliding-window groups' blocks that
    leave the window while a request grows (null block 0 in their tables)."""
    from pagedkv.core import KVCacheManager, KVCacheRequest

    specs = kv_cache_layer_specs(gguf_metadata(), block_size=16, dtype="float32")
    config = KVCacheConfig.from_num_blocks(specs, 600)
    manager = KVCacheManager(config.num_blocks, list(config.kv_cache_specs))
    request = KVCacheRequest("r", list(range(1500)), block_hasher=manager.block_hasher)
    blocks, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, 1500, num_hit, blocks) is not None
    request.num_computed_tokens = 1500
    for token in range(40):  # decode: the next allocation drops out-of-window blocks
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    tables = manager.get_block_ids("r")
    assert len(tables) == 6
    assert 0 not in tables[5] and len(tables[5]) == -(-1540 // 16)
    for table in tables[:5]:
        assert len(table) == len(tables[5])
        live = [b for b in table if b != 0]
        assert 0 < len(live) <= -(-512 // 16) + 1
        assert all(b == 0 for b in table[: len(table) - len(live)])
    check_invariants(manager)


# ---------------------------------------------------------------- the real Gemma 3 270M (slow)


def long_text(num_sentences: int) -> str:
    nouns = ["lamp", "river", "ledger", "violin", "harbor", "orchard", "engine", "quilt", "comet"]
    verbs = ["moved", "painted", "measured", "borrowed", "repaired", "counted", "described"]
    return " ".join(
        f"On day {i}, Mara {verbs[i % 7]} the {nouns[i * 5 % 9]} near shelf {i * 37 % 101}."
        for i in range(num_sentences)
    )


def test_gguf_config(gemma3_gguf_path):
    """The packaged file's shape, as its header and llama.cpp's Gemma 3 defaults give it."""
    from pagedkv.model.loader import load_model_config

    config = load_model_config(gemma3_gguf_path)
    assert config.layer_types == gguf_metadata().layer_types  # 5 sliding, 1 full, x 3
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (18, 640, 256)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 1)
    assert config.sliding_window == 512 and config.tie_word_embeddings
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    assert config.query_pre_attn_scalar == 256 and config.vocab_size == 262144


@pytest.mark.slow
def test_gguf_weights_equal_transformers(gemma3_gguf_path, gemma3_hf):
    """Dequantized weights equal transformers' exactly: the norms' stored +1 is taken back off
    and q/k rows are not permuted (NeoX-style rotary in llama.cpp's Gemma)."""
    from pagedkv.model.gguf_loader import load_gguf

    state_dict = load_gguf(gemma3_gguf_path).state_dict
    reference = gemma3_hf.state_dict()
    assert set(reference) - set(state_dict) == {"lm_head.weight"}  # tied
    for name, weight in state_dict.items():
        assert torch.equal(weight, reference[name]), name
    norm = state_dict["model.layers.0.self_attn.q_norm.weight"]
    assert norm.abs().mean() < 2  # HF form (about -0.5 .. 1), not 1 + weight


@pytest.mark.slow
def test_tokenizer_adds_bos_and_has_no_chat_template(gemma3_fp32):
    tokenizer = gemma3_fp32.tokenizer
    ids = tokenizer.encode("The capital of France is")
    assert ids == [2, 818, 5279, 529, 7001, 563]  # <bos> first, as transformers' tokenizer
    assert tokenizer.decode(ids) == "The capital of France is"
    assert tokenizer.eos_token_ids == (1,)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])


@pytest.mark.slow
def test_short_prompt_logits_match_transformers(gemma3_fp32, gemma3_hf):
    tokens = gemma3_fp32.tokenizer.encode("The three primary colors of light are red, green and")
    (hidden,) = WindowedRunner(gemma3_fp32.model).step([(0, tokens)])
    logits = gemma3_fp32.model.compute_logits(hidden)
    reference = hf_logits(gemma3_hf, tokens)
    assert (logits - reference).abs().max().item() < TOLERANCE
    assert gemma3_fp32.tokenizer.decode([int(logits[-1].argmax())]).strip() == "blue"


@pytest.mark.slow
def test_long_prompt_past_window_matches_transformers(gemma3_fp32, gemma3_hf):
    """1,500 tokens in one prefill: positions beyond 512 see only their window in 15 layers."""
    tokens = gemma3_fp32.tokenizer.encode(long_text(200))[:1500]
    assert len(tokens) == 1500
    (hidden,) = WindowedRunner(gemma3_fp32.model, num_blocks=100).step([(0, tokens)])
    rows = [*range(0, 1500, 97), 511, 512, 513, 1024, 1498, 1499]
    logits = gemma3_fp32.model.compute_logits(hidden[rows])
    reference = hf_logits(gemma3_hf, tokens, rows)
    assert (logits - reference).abs().max().item() < TOLERANCE


@pytest.mark.slow
def test_chunked_prefill_then_greedy_decode_past_window(gemma3_fp32, gemma3_hf):
    """A 700-token prompt in three chunks, then greedy decoding with the out-of-window blocks
    nulled in the sliding-window tables: logits within tolerance of transformers' full forward
    over the final sequence, and every greedy token the one transformers picks (its argmax at
    that row)."""
    model = gemma3_fp32.model
    prompt = gemma3_fp32.tokenizer.encode(long_text(100))[:700]
    runner = WindowedRunner(model, num_blocks=64)
    for chunk in (prompt[:200], prompt[200:533], prompt[533:]):
        (hidden,) = runner.step([(0, chunk)])
    assert runner.num_skipped_blocks == (533 - 511) // 16
    step_logits = [model.compute_logits(hidden[-1:])]
    sequence = list(prompt)
    for _ in range(8):
        sequence.append(int(step_logits[-1][0].argmax()))
        (hidden,) = runner.step([(0, sequence[-1:])])
        assert runner.num_skipped_blocks == (len(sequence) - 512) // 16
        step_logits.append(model.compute_logits(hidden))
    reference = hf_logits(gemma3_hf, sequence, list(range(len(prompt) - 1, len(sequence))))
    assert (torch.cat(step_logits) - reference).abs().max().item() < TOLERANCE
    assert reference[:-1].argmax(dim=-1).tolist() == sequence[len(prompt) :]
