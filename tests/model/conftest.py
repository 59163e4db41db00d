"""Fixtures of the model tests: a runner that feeds one or more sequences through a fresh paged
KV cache, tensor-parallel ranks as threads of this process, and Hugging Face's tokenizer (the
models themselves come from tests/conftest.py)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch

from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.parallel import TensorParallelGroup
from pagedkv.ops.backends import CommonAttentionMetadata, TorchBackend, bind_metadata


class PagedSequenceRunner:
    """Runs sequences through a model with a fresh paged KV cache, the way the engine's runner
    does: each call is one forward over a flattened batch of (sequence, new tokens) chunks.

    Blocks are handed out in a scrambled order so that a sequence's blocks are not contiguous.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int = 256,
        block_size: int = 16,
        backend=None,
    ):
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = backend or TorchBackend(model.device)
        self.specs = model.attention_layer_specs(block_size)
        self.kv_caches = [self.backend.allocate_kv_cache(num_blocks, spec) for spec in self.specs]
        generator = torch.Generator().manual_seed(0)
        self._free_blocks = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
        self.block_ids: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One forward over ``chunks`` = [(seq_id, new token ids), ...]; returns per chunk the
        fp32 logits ``[len(new token ids), vocab]``."""
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
        block_tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for row, (seq_id, _) in enumerate(chunks):
            blocks = self.block_ids[seq_id]
            block_tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        common = CommonAttentionMetadata(
            block_tables,
            torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.int64),
            num_blocks=self.num_blocks,
        )
        attn_metadata = bind_metadata(self.backend, common, self.specs)
        hidden = self.model.forward(
            torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, attn_metadata
        )
        logits = self.model.compute_logits(hidden)
        if logits is None:  # a tensor-parallel rank other than 0
            return None
        return [logits[qsl[i] : qsl[i + 1]] for i in range(len(chunks))]


def run_ranks(world_size: int, fn, timeout: float = 120.0) -> list:
    """``[fn(parallel) for each rank]``, the ranks run at once as threads of this process, each
    with a :class:`TensorParallelGroup` over one gloo group (an in-memory store, loopback): the
    model's collectives without spawning processes. The first rank's exception is re-raised.

    Gloo's ranks connect over loopback TCP on ports the OS hands out; beside the other test
    worker's servers and groups a connection was once closed by its peer while the mesh was
    built ("Gloo connectFullMesh failed"). That failure, and only it, is retried once with a
    fresh group: it says nothing of the model's code."""
    try:
        return _run_ranks(world_size, fn, timeout)
    except RuntimeError as e:
        if "connectFullMesh" not in str(e):
            raise
        return _run_ranks(world_size, fn, timeout)


def _run_ranks(world_size: int, fn, timeout: float) -> list:
    store = torch.distributed.HashStore()
    results: list = [None] * world_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            options = torch.distributed.ProcessGroupGloo._Options()
            options._timeout = datetime.timedelta(seconds=timeout / 2)
            device = torch.distributed.ProcessGroupGloo.create_device(hostname="127.0.0.1")
            options._devices = [device]
            prefixed = torch.distributed.PrefixStore("tp", store)
            group = torch.distributed.ProcessGroupGloo(prefixed, rank, world_size, options)
            results[rank] = fn(TensorParallelGroup(rank, world_size, group))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), "a rank did not finish"
    return results


@pytest.fixture
def tensor_parallel_ranks():
    """``tensor_parallel_ranks(world_size, fn)`` -> ``[fn(parallel) for each rank]``, the ranks
    as threads over one in-process gloo group (:func:`run_ranks`)."""
    return run_ranks


@pytest.fixture(scope="session")
def kernel_cache():
    """The build folder of pagedkv's CPU kernels that the engine uses
    (``pagedkv.ops.c_build.kernel_cache()``: ``$PAGEDKV_CACHE_DIR/kernels``, by default in
    ``~/.cache/pagedkv``), for ``load_cpu_quant_kernels(kernel_cache, isa=..., activations=...)``.
    One library holds every body and both activations, named by the hash of its sources, flags
    and compiler, so the kernel tests share the engine's build: a build takes tens of seconds on
    a 2-core machine and was made once per module and parameter. The build itself, from an
    empty folder, is tested in test_cpu_quant_kernels.py (test_a_second_build_reuses_the_library)
    and held to AVX2 in a subprocess (test_kernels_held_to_avx2)."""
    from pagedkv.ops.c_build import kernel_cache as engine_kernel_cache

    return engine_kernel_cache()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    """Hugging Face's AutoTokenizer built from the same GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture
def paged_runner():
    """Factory: ``paged_runner(model, num_blocks=256, block_size=16)`` -> PagedSequenceRunner."""
    return PagedSequenceRunner
