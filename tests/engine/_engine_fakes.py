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
from pagedkv.worker.outputs import ModelRunnerOutput
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
    """Token-id "KV cache" of ``num_blocks`` x ``block_size`` slots (-1 = never written).

    It is a worker: it knows requests only through the plain data of the scheduler outputs (the
    new requests whole, then new token ids and block ids), as the model runner does.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.cache = [[-1] * block_size for _ in range(num_blocks)]
        self.tokens: dict[str, list[int]] = {}  # request id -> token ids
        self.tables: dict[str, list[int]] = {}  # request id -> block ids of group 0
        self.computed: dict[str, int] = {}
        self.pooling: set[str] = set()  # pooling requests: their tokens read back, not sampled

    def _update(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.tables.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.tables[new.req_id] = list(new.block_ids[0])
            self.computed[new.req_id] = new.num_computed_tokens
            if new.pooling_params is not None:
                self.pooling.add(new.req_id)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self.tokens[req_id] += cached.new_token_ids[i]
            blocks = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                self.tables[req_id] = list(blocks[0])
            elif blocks is not None:
                self.tables[req_id] += blocks[0]
            self.computed[req_id] = cached.num_computed_tokens[i]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Copy the step's blocks (group 0's ``blocks_to_copy``, as the runner does, before any
        write), write this step's tokens, then sample one token per sampling request (in
        scheduling order); a pooling request whose prompt is complete gets its tokens read
        back from the cache as its pooled output."""
        self._update(out)
        if out.blocks_to_copy:
            sources = [list(self.cache[src]) for src, _ in out.blocks_to_copy[0]]
            for (_, dst), tokens in zip(out.blocks_to_copy[0], sources, strict=True):
                self.cache[dst] = tokens
        bs = self.block_size
        sampled = ModelRunnerOutput()
        for req_id, num in out.num_scheduled_tokens.items():
            table, tokens, start = self.tables[req_id], self.tokens[req_id], self.computed[req_id]
            for pos in range(start, start + num):
                block_id = table[pos // bs]
                assert block_id != 0, "wrote into the null block"
                self.cache[block_id][pos % bs] = tokens[pos]
            if start + num >= len(tokens):
                seq = [self.cache[table[p // bs]][p % bs] for p in range(start + num)]
                if req_id in self.pooling:  # its "vector": the prompt read back from the cache
                    sampled.pooler_output[req_id] = tuple(seq)
                    continue
                sampled.req_ids.append(req_id)
                sampled.sampled_token_ids.append(next_token(seq))
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


def sampling_req_ids(scheduler: Scheduler, out: SchedulerOutput) -> list[str]:
    """The ids of the requests of ``out`` that sample a token after the step (the step computes
    every token they have), in scheduling order: what a scripted runner answers for."""
    done = [scheduler.get_request(req_id) for req_id in out.num_scheduled_tokens]
    return [r.request_id for r in done if r is not None and r.num_computed_tokens >= r.num_tokens]
