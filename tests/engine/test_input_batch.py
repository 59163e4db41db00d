"""The worker's persistent batch against a batch rebuilt from scratch, after every step.

A hypothesis state machine sends random plain scheduler outputs (new requests, decode and chunked
prefill steps, requests left unscheduled, preempted and resumed with a new block table, finished
and aborted ones) to an :class:`InputBatch`, and after each step compares its rows and the step's
flattened inputs (token ids, positions, slot mapping per KV cache group, which rows sample) with
what the request states alone give, computed the plain way.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv.ops.backends import AttentionLayerSpec, TorchBackend
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.input_batch import InputBatch
from pagedkv.worker.scheduler_output import NewRequestData, SchedulerOutput

BLOCK_SIZE = 4
MAX_MODEL_LEN = 40
MAX_NUM_SEQS = 4
NUM_GROUPS = 2
NUM_BLOCKS = 400


class InputBatchMachine(RuleBasedStateMachine):
    """Model: per request, its tokens, block ids per group and num_computed_tokens."""

    @initialize()
    def setup(self) -> None:
        spec = AttentionLayerSpec(
            num_heads=1, num_kv_heads=1, head_size=16, block_size=BLOCK_SIZE, dtype=torch.float32
        )
        self.batch = InputBatch(
            block_size=BLOCK_SIZE,
            num_blocks=NUM_BLOCKS,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_SEQS * MAX_MODEL_LEN,
            max_model_len=MAX_MODEL_LEN,
            device=torch.device("cpu"),
            backend=TorchBackend("cpu"),
            attention_groups=[(g, spec) for g in range(NUM_GROUPS)],
            layer_attention_groups=list(range(NUM_GROUPS)),
        )
        self.tokens: dict[str, list[int]] = {}  # what the scheduler knows
        self.sent: dict[str, int] = {}  # tokens the worker was sent
        self.blocks: dict[str, list[list[int]]] = {}
        self.computed: dict[str, int] = {}
        self.preempted: set[str] = set()
        self.next_id = 0
        self.next_block = 1
        self.finished: set[str] = set()
        self.last: tuple[SchedulerOutput, object] | None = None

    def _new_blocks(self, count: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + count))
        self.next_block = (self.next_block + count) % (NUM_BLOCKS - 50) + 1
        return ids

    def _grow(self, req_id: str, num_tokens: int) -> list[list[int]]:
        """Give ``req_id`` blocks for ``num_tokens`` tokens; the new ids per group."""
        need = -(-num_tokens // BLOCK_SIZE) - len(self.blocks[req_id][0])
        new = [self._new_blocks(max(need, 0)) for _ in range(NUM_GROUPS)]
        for g in range(NUM_GROUPS):
            self.blocks[req_id][g] += new[g]
        return new

    @rule(
        prompt_len=st.integers(1, 20),
        seed=st.integers(0, 2**16),
        data=st.data(),
    )
    def step(self, prompt_len: int, seed: int, data) -> None:
        rng = np.random.default_rng(seed)
        out = SchedulerOutput(finished_req_ids=set(self.finished))
        self.finished = set()
        held = [r for r in self.tokens if r not in out.finished_req_ids]
        if len(held) < MAX_NUM_SEQS and data.draw(st.booleans(), "add a request"):
            req_id = f"r{self.next_id}"
            self.next_id += 1
            self.tokens[req_id] = rng.integers(0, 1000, prompt_len).tolist()
            self.blocks[req_id] = [[] for _ in range(NUM_GROUPS)]
            self.computed[req_id] = 0
            held.append(req_id)
        cached = out.scheduled_cached_reqs
        budget = MAX_NUM_SEQS * MAX_MODEL_LEN
        for req_id in held:
            tokens = self.tokens[req_id]
            if not data.draw(st.booleans(), f"schedule {req_id}"):
                if req_id in self.sent and data.draw(st.booleans(), f"preempt {req_id}"):
                    self.preempted.add(req_id)
                    out.preempted_req_ids.add(req_id)
                    self.computed[req_id] = 0
                    self.blocks[req_id] = [[] for _ in range(NUM_GROUPS)]
                continue
            left = len(tokens) - self.computed[req_id]
            if left == 0:
                continue
            n = data.draw(st.integers(1, left), f"tokens of {req_id}")
            c = self.computed[req_id]
            new_blocks = self._grow(req_id, c + n)
            if req_id not in self.sent:
                out.scheduled_new_reqs.append(
                    NewRequestData(
                        req_id,
                        list(tokens),
                        SamplingParams(),
                        tuple(list(b) for b in self.blocks[req_id]),
                        c,
                    )
                )
            else:
                resumed = req_id in self.preempted
                cached.req_ids.append(req_id)
                cached.resumed_from_preemption.append(resumed)
                cached.new_token_ids.append(tokens[self.sent[req_id] :])
                if resumed:
                    cached.new_block_ids.append(tuple(list(b) for b in self.blocks[req_id]))
                else:
                    cached.new_block_ids.append(tuple(new_blocks) if any(new_blocks) else None)
                cached.num_computed_tokens.append(c)
                self.preempted.discard(req_id)
            self.sent[req_id] = len(tokens)
            out.num_scheduled_tokens[req_id] = n
            out.total_num_scheduled_tokens += n
            budget -= n
        for req_id in out.finished_req_ids:
            for table in (self.tokens, self.sent, self.blocks, self.computed):
                table.pop(req_id, None)
            self.preempted.discard(req_id)
        self.batch.update(out)
        inputs = self.batch.prepare(out) if out.total_num_scheduled_tokens else None
        self.last = (out, inputs)
        # After the step: advance, sample (a token) or finish.
        for req_id, n in out.num_scheduled_tokens.items():
            self.computed[req_id] += n
            tokens = self.tokens[req_id]
            if self.computed[req_id] == len(tokens):
                if len(tokens) >= MAX_MODEL_LEN - 1 or data.draw(st.booleans(), f"end {req_id}"):
                    self.finished.add(req_id)
                else:
                    tokens.append(int(rng.integers(0, 1000)))

    @rule(data=st.data())
    def abort(self, data) -> None:
        alive = sorted(set(self.tokens) - self.finished)
        if alive:
            self.finished.add(data.draw(st.sampled_from(alive)))

    @invariant()
    def rows_and_inputs_match_the_requests(self) -> None:
        if self.last is None:
            return
        out, inputs = self.last
        batch = self.batch
        rows = batch.req_ids[: batch.num_reqs]
        assert sorted(rows) == sorted(out.num_scheduled_tokens)
        assert batch.req_ids[batch.num_reqs :] == [None] * (MAX_NUM_SEQS - batch.num_reqs)
        assert {r: i for i, r in enumerate(rows)} == batch.req_id_to_index
        assert set(batch.requests) == set(self.sent)
        for i, req_id in enumerate(rows):
            known = self.tokens[req_id][: self.sent[req_id]]
            assert batch.num_tokens[i] == len(known)
            assert batch.token_ids_cpu[i, : len(known)].tolist() == known
            for g in range(NUM_GROUPS):
                n = batch.num_blocks_per_row[g, i]
                assert batch.block_tables[g, i, :n].tolist() == self.blocks[req_id][g]
        if inputs is None:
            return
        ids, positions, slots = [], [], [[] for _ in range(NUM_GROUPS)]
        sample = []
        for req_id in rows:
            n = out.num_scheduled_tokens[req_id]
            c = self.computed[req_id] - n  # before the step
            known = self.tokens[req_id][: self.sent[req_id]]
            ids += known[c : c + n]
            positions += list(range(c, c + n))
            for g in range(NUM_GROUPS):
                table = self.blocks[req_id][g]
                slots[g] += [
                    table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c, c + n)
                ]
            sample.append(c + n >= len(known))
        assert inputs.input_ids.tolist() == ids
        assert inputs.positions.tolist() == positions
        assert inputs.sample.tolist() == sample
        for g in range(NUM_GROUPS):
            assert inputs.attn_metadata[g].metadata.slot_mapping.tolist() == slots[g]


TestInputBatch = InputBatchMachine.TestCase
