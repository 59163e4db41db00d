"""Fixtures of the model tests: a runner that feeds one or more sequences through a fresh paged
KV cache, and Hugging Face's tokenizer (the models themselves come from tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model.llama import LlamaForCausalLM
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
        return [logits[qsl[i] : qsl[i + 1]] for i in range(len(chunks))]


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    """Hugging Face's AutoTokenizer built from the same GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture
def paged_runner():
    """Factory: ``paged_runner(model, num_blocks=256, block_size=16)`` -> PagedSequenceRunner."""
    return PagedSequenceRunner
