"""The tensor-parallel layers (pagedkv.model.linear, pagedkv.model.vocab_parallel_embedding) and
the decoders built from them, with the ranks as threads over one in-process gloo group: each
layer's ranks together equal the unsplit layer (bias and residual counted once), one rank cuts,
copies and communicates nothing, and the tiny Llama split 2 and 4 ways (KV heads split, then
replicated) computes the logits of the whole model."""

from __future__ import annotations

import pytest
import torch
from _tiny_model import tiny_loaded_model

from pagedkv.errors import ConfigError
from pagedkv.model.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedkv.model.packed_linear import PackedLinear, linear_mode
from pagedkv.model.parallel import TensorParallelGroup
from pagedkv.model.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

MODES = ["plain", linear_mode("cpu", torch.float32)]  # "packed" where oneDNN runs


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tp", [2, 4])
def test_column_then_row_parallel_equal_the_whole_mlp(tensor_parallel_ranks, mode, tp):
    # gate/up column parallel, down row parallel with a bias and a fused residual: each rank's
    # slice flows from one to the other, one all-reduce gives every rank the whole output.
    hidden, inter, tokens = 16, 24, 5
    x, residual = rand(tokens, hidden, seed=1), rand(tokens, hidden, seed=2)
    w_gate, w_up, w_down = (
        rand(inter, hidden, seed=3),
        rand(inter, hidden, seed=4),
        rand(hidden, inter, seed=5),
    )
    b_up, b_down = rand(inter, seed=6), rand(hidden, seed=7)
    gate = PackedLinear(w_gate, None, mode)
    up, down = PackedLinear(w_up, b_up, mode), PackedLinear(w_down, b_down, mode)
    act = up.mul(x, gate.silu(x))
    expected_add, expected = down.add(act, residual), down(act)

    def rank(parallel):
        g = ColumnParallelLinear(w_gate, None, mode, parallel)
        u = ColumnParallelLinear(w_up, b_up, mode, parallel)
        d = RowParallelLinear(w_down, b_down, mode, parallel)
        local = u.mul(x, g.silu(x))
        assert local.shape == (tokens, inter // tp) and g.out_features == inter // tp
        return local, d.add(local, residual), d(local)

    results = tensor_parallel_ranks(tp, rank)
    torch.testing.assert_close(torch.cat([r[0] for r in results], dim=1), act)
    for _, with_residual, plain in results:  # the same on every rank; bias and residual once
        torch.testing.assert_close(with_residual, expected_add, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(plain, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("tp", "heads_per_rank", "kv_heads"), [(2, 2, [[0], [1]]), (4, 1, [[0], [0], [1], [1]])]
)
def test_qkv_parallel_keeps_whole_heads_and_replicates_kv_heads(
    tensor_parallel_ranks, tp, heads_per_rank, kv_heads
):
    # 4 query / 2 KV heads of 3: at tp=2 one KV head each, at tp=4 each KV head on 2 ranks.
    d, hidden = 3, 8
    q, k, v = rand(4 * d, hidden, seed=1), rand(2 * d, hidden, seed=2), rand(2 * d, hidden, seed=3)
    biases = (rand(4 * d, seed=4), rand(2 * d, seed=5), rand(2 * d, seed=6))
    x = rand(2, hidden, seed=7)
    whole = QKVParallelLinear(q, k, v, d, biases, "plain")
    assert (whole.num_heads, whole.num_kv_heads) == (4, 2)
    full = whole(x)
    fq, fk, fv = full[:, : 4 * d], full[:, 4 * d : 6 * d], full[:, 6 * d :]

    def rank(parallel):
        layer = QKVParallelLinear(q, k, v, d, biases, "plain", parallel)
        return layer.num_heads, layer.num_kv_heads, layer(x)

    for r, (num_heads, num_kv_heads, out) in enumerate(tensor_parallel_ranks(tp, rank)):
        assert (num_heads, num_kv_heads) == (heads_per_rank, 1)
        heads = slice(r * heads_per_rank * d, (r + 1) * heads_per_rank * d)
        kv = slice(kv_heads[r][0] * d, (kv_heads[r][0] + 1) * d)
        torch.testing.assert_close(out[:, : heads_per_rank * d], fq[:, heads])
        torch.testing.assert_close(out[:, heads_per_rank * d : (heads_per_rank + 1) * d], fk[:, kv])
        torch.testing.assert_close(out[:, (heads_per_rank + 1) * d :], fv[:, kv])


def test_vocab_parallel_embedding_and_lm_head_pad_an_uneven_vocabulary(tensor_parallel_ranks):
    # 10 rows over 3 ranks: 4 + 4 + 2 (and 2 zero rows) each.
    table = rand(10, 6, seed=1)
    ids = torch.tensor([0, 3, 4, 9, 7, 8])
    hidden = rand(3, 6, seed=2)
    mode = MODES[-1]

    def rank(parallel):
        embedding = VocabParallelEmbedding(table, parallel)
        head = ParallelLMHead(table, mode, parallel)
        return embedding.shard_size, embedding(ids), head(hidden)

    results = tensor_parallel_ranks(3, rank)
    for r, (shard_size, embedded, logits) in enumerate(results):
        assert shard_size == 4
        torch.testing.assert_close(embedded, table[ids])
        if r == 0:
            torch.testing.assert_close(logits, PackedLinear(table, None, mode)(hidden))
        else:
            assert logits is None


def test_one_rank_cuts_copies_and_communicates_nothing():
    # A group of one rank has no process group: any collective would fail on it.
    one = TensorParallelGroup(0, 1)
    w, b, x = rand(6, 4, seed=1), rand(6, seed=2), rand(3, 4, seed=3)
    column = ColumnParallelLinear(w, b, "plain", one)
    assert type(column).__call__ is PackedLinear.__call__  # nothing added to its calls
    assert type(column).add is PackedLinear.add and type(column).mul is PackedLinear.mul
    assert column.weight is w and column.bias is b  # no copy
    row = RowParallelLinear(w, b, "plain", one)
    assert row.parallel is None and row.linear.weight is w and row.linear.bias is b
    torch.testing.assert_close(
        row.add(x, x.new_ones(3, 6)), torch.nn.functional.linear(x, w, b) + 1
    )
    table = rand(10, 4, seed=4)
    embedding = VocabParallelEmbedding(table, one)
    assert embedding.weight is table and embedding.parallel is None
    assert ParallelLMHead(table, "plain", one).linear.weight is table
    model = tiny_loaded_model(parallel=one).model
    assert model.parallel is None and model.num_kv_heads == 2


def test_a_layer_that_does_not_split_says_why():
    two = TensorParallelGroup(0, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size 2 does not divide the output"):
        ColumnParallelLinear(rand(5, 4), None, "plain", two)
    with pytest.raises(ConfigError, match="does not divide the input features"):
        RowParallelLinear(rand(4, 5), None, "plain", two)
    with pytest.raises(ConfigError, match="does not divide the query heads"):
        QKVParallelLinear(rand(3, 4), rand(1, 4), rand(1, 4), 1, None, "plain", two)
    with pytest.raises(ConfigError, match="neither divides the 3 KV heads"):
        QKVParallelLinear(rand(6, 4), rand(3, 4), rand(3, 4), 1, None, "plain", two)


@pytest.mark.parametrize("tp", [2, 4])
def test_tiny_llama_split_gives_the_whole_models_logits(tensor_parallel_ranks, paged_runner, tp):
    # tp=2: one of the 2 KV heads per rank; tp=4: each KV head replicated on 2 ranks. A prefill
    # of two sequences, then a mixed step (a decode and a new chunk) through the paged cache.
    prompts = [list(range(3, 40)), list(range(50, 61))]

    def steps(model):
        runner = paged_runner(model, num_blocks=32, block_size=4)
        first = runner.step([(0, prompts[0][:30]), (1, prompts[1])])
        second = runner.step([(0, prompts[0][30:]), (1, [7])])
        return runner.kv_caches[0].shape[2], first, second

    _, *expected = steps(tiny_loaded_model().model)
    results = tensor_parallel_ranks(tp, lambda p: steps(tiny_loaded_model(parallel=p).model))
    for r, (kv_heads, *got) in enumerate(results):
        assert kv_heads == 1
        if r:
            assert got == [None, None]  # only rank 0 gets the logits
            continue
        for mine_step, reference_step in zip(got, expected, strict=True):
            for mine, reference in zip(mine_step, reference_step, strict=True):
                torch.testing.assert_close(mine, reference, atol=1e-4, rtol=1e-4)
