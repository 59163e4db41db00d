"""A torch-free fake model that drives the scheduler through a real paged "KV cache".

Its cache stores token ids instead of K/V: each step writes the scheduled tokens through the slot
mapping, then every sampling request reads its whole sequence back through its block table and
the next token is a hash of what it read. A wrong block table, slot mapping, prefix-cache hit or
resumption therefore changes the output, while a correct engine gives the same tokens whatever
the batching, chunking, caching or preemption.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.engine.scheduler import Scheduler
from pagedkv.worker.scheduler_output import SchedulerOutput

VOCAB_SIZE = 997


def next_token(token_ids: Sequence[int]) -> int:
    """The fake model's deterministic next token after ``token_ids``."""
    acc = 17
    for i, token_id in enumerate(token_ids):
        acc = (acc * 31 + (i + 1) * (token_id + 3)) % 1_000_003
    return acc % VOCAB_SIZE


def reference_output(prompt: Sequence[int], max_tokens: int, eos: int | None = None) -> list[int]:
    """What generation alone, without any cache, gives."""
    seq = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        token_id = next_token(seq)
        seq.append(token_id)
        out.append(token_id)
        if token_id == eos:
            break
    return out


class FakeModel:
    """Token-id "KV cache" of ``num_blocks`` x ``block_size`` slots (-1 = never written)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.cache = [[-1] * block_size for _ in range(num_blocks)]

    def execute(self, out: SchedulerOutput) -> list[int]:
        """Write this step's tokens, then sample one token per sampling request."""
        bs = self.block_size
        for request, start, num, block_ids in zip(
            out.requests,
            out.num_computed_tokens,
            out.num_scheduled_tokens,
            out.block_ids,
            strict=True,
        ):
            table = block_ids[0]
            for pos in range(start, start + num):
                block_id = table[pos // bs]
                assert block_id != 0, "wrote into the null block"
                self.cache[block_id][pos % bs] = request.all_token_ids[pos]
        sampled = []
        for start, num, block_ids, sample in zip(
            out.num_computed_tokens,
            out.num_scheduled_tokens,
            out.block_ids,
            out.sample,
            strict=True,
        ):
            if sample:
                table = block_ids[0]
                seq = [self.cache[table[p // bs]][p % bs] for p in range(start + num)]
                sampled.append(next_token(seq))
        return sampled


def run_until_done(scheduler: Scheduler, model: FakeModel, max_steps: int = 10_000):
    """Step until nothing is left; returns the list of SchedulerOutputs (one per step)."""
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        out = scheduler.schedule()
        scheduler.update_from_output(out, model.execute(out))
        outputs.append(out)
    raise AssertionError("the scheduler made no progress")
