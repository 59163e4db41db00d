"""SchedulerOutput: what one scheduler step hands to the workers, as plain picklable data.

The boundary has vLLM V1's shape (``vllm/v1/core/sched/output.py``), in our own code: the
scheduler sends a request to the workers once, whole (:class:`NewRequestData`), and afterwards
only what changed (:class:`CachedRequestData`: the token ids and block ids the workers do not have
yet, the new ``num_computed_tokens``), plus the ids of requests that finished since the last step
and the block copies of copy-on-write (``blocks_to_copy``), applied before the step's KV writes.
Every worker keeps its own copy of each request's state (``pagedkv.worker.input_batch``), so a
decode step sends O(1) data per request, whatever its context length, and tensor parallelism
pickles this object as it is to every rank.

Only ids, ints, lists of ints (and of int pairs: ``blocks_to_copy``),
:class:`~pagedkv.sampling_params.SamplingParams` and
:class:`~pagedkv.pooling_params.PoolingParams` (dataclasses of plain values) and the
structured-output bitmask (an int32 numpy array) cross the boundary: no live object of the
engine.

The worker defines what it consumes and the scheduler (one layer up) imports it, so the imports
run one way (vLLM V1 keeps it below its workers too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.offload import KVTierOps
from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import SamplingParams

#: Block ids of one request, one list per KV cache group (``0`` = the null block).
BlockIds = tuple[list[int], ...]

#: A step's block copies, one list of ``(src_block_id, dst_block_id)`` pairs per KV cache group.
BlocksToCopy = tuple[list[tuple[int, int]], ...]


@dataclass(slots=True)
class NewRequestData:
    """A request the workers have not seen: sent once, at its first scheduling.

    Attributes:
        req_id: the request's id (unique among unfinished requests).
        prompt_token_ids: the prompt, ``[num_prompt_tokens]`` token ids.
        sampling_params: its sampling options.
        block_ids: its block table, one list of block ids per KV cache group.
        num_computed_tokens: tokens whose KV is in the cache before this step (its prefix-cache
            hit); its tokens this step start there.
        eos_token_ids: the model's end-of-sequence ids (masked until ``min_tokens``).
        output_token_ids: tokens it generated before the workers first see it: empty, except
            for a beam forked from another (it starts with its parent's output tokens and
            the one it was chosen for).
        pooling_params: a pooling (embedding) request's parameters, else None: the worker
            samples nothing for it and returns its pooled hidden state once its prompt is
            computed (``ModelRunnerOutput.pooler_output``).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: BlockIds
    num_computed_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None


@dataclass(slots=True)
class CachedRequestData:
    """The scheduled requests the workers already hold, as parallel lists (one entry each).

    Attributes:
        req_ids: their ids.
        resumed_from_preemption: True for a request that was preempted (its blocks freed) and
            is scheduled again: ``new_block_ids`` then REPLACES its block table; otherwise
            they are appended to it.
        new_token_ids: token ids appended to the request since the workers last got its tokens
            (the tokens sampled since: one per decode step), ``[k]`` each.
        new_block_ids: blocks allocated to it since (one list per KV cache group), or None.
        num_computed_tokens: tokens whose KV is in the cache before this step.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[BlockIds | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        """Number of cached requests scheduled."""
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes, and what changed since the last step.

    Attributes:
        scheduled_new_reqs: requests scheduled for the first time.
        scheduled_cached_reqs: requests the workers already hold, scheduled again.
        num_scheduled_tokens: request id -> tokens computed for it this step (>= 1), for every
            scheduled request, in scheduling order (new requests are not first: the order is
            the scheduler's). A request's tokens this step are its token ids
            ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)``.
        total_num_scheduled_tokens: sum of ``num_scheduled_tokens``.
        finished_req_ids: requests that finished (or were aborted) since the last step: the
            workers drop their state.
        preempted_req_ids: requests preempted while scheduling this step (their blocks are
            freed; the workers keep their tokens for when they resume).
        blocks_to_copy: copy-on-write copies, one list of ``(src_block_id, dst_block_id)``
            pairs per KV cache group (``()``, or empty lists: nothing to copy). When a forked
            request writes into a partially filled block it shares, the KV-cache manager gives it
            a fresh block and asks for the shared one's contents to be copied there; each worker
            copies every pair, keys and values, in every layer of the group (on its own shard of
            the KV heads), before this step's KV writes, whether or not the step schedules any
            token. A group's pairs follow
            :func:`pagedkv.ops.backends.check_block_mapping` (ids in ``[1, num_blocks)``, no copy
            onto itself, no ``dst`` twice, no block both a source and a destination), and so do
            all groups' pairs together (the groups share the cache tensors). Idea from vLLM's
            ``blocks_to_copy`` of its V0 scheduler outputs (beam search, parallel sampling).
        structured_output_request_ids: the constrained requests that sample this step, one per
            row of ``grammar_bitmask`` (empty: no constraint this step); a request with ``k``
            drafts in ``scheduled_spec_decode_tokens`` has ``k + 1`` consecutive rows, the mask
            after its verified tokens, then after each draft (its verification rows, in order).
        grammar_bitmask: None, or an int32 numpy array ``[len(structured_output_request_ids),
            ceil(vocab_size / 32)]``: bit ``t % 32`` of word ``t // 32`` of a row is 1 when the
            request may sample token ``t`` (xgrammar's layout). The engine fills it
            (:mod:`pagedkv.engine.structured_output`); the worker sets the other tokens' logits
            to -inf before logprobs and sampling (vLLM's ``GrammarOutput``).
        kv_tier_ops: the KV tier's stores, drops and loads (:class:`pagedkv.core.offload.
            KVTierOps`), or ``None``: each worker copies the stored blocks out of the pool first,
            then loads (before ``blocks_to_copy`` and the forward).
        scheduled_spec_decode_tokens: request id -> its draft token ids this step (speculative
            decoding; vLLM's name), for decoding requests with drafts only. They are the last
            ``k`` of the request's ``num_scheduled_tokens`` (after its last verified token):
            computed and verified in this step's forward, never part of the request's token
            ids until accepted.
        num_lookahead_tokens: request id -> KV slots allocated past its scheduled tokens
            (speculative decoding with a draft model): after sampling, the worker's draft model
            drafts up to that many tokens for the request's next step, writing the draft
            model's KV of each into those slots (vLLM's ``num_lookahead_tokens``). Only for
            requests that sample this step and may draft.
        finished_token_ids: request id -> the token ids a request in ``finished_req_ids`` got
            since the workers last got its tokens (its last step's, as the engine kept them:
            cut at a stop), so that the workers know its final tokens (speculative decoding's
            proposers learn from finished outputs: SuffixDecoding); only with speculative
            decoding, only for requests the workers hold.
        draft_paused_req_ids: requests of this step the workers propose no drafts for after
            it (speculative decoding's adaptive rule declined their drafts for several steps
            in a row: :data:`~pagedkv.engine.spec_decode.drafts.IDLE_STEPS_BEFORE_PAUSE`); only
            with a proposer of token ids (n-gram, suffix).
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    blocks_to_copy: BlocksToCopy = ()
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    kv_tier_ops: KVTierOps | None = None
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)
    finished_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_paused_req_ids: set[str] = field(default_factory=set)

    @property
    def num_reqs(self) -> int:
        """Number of scheduled requests."""
        return len(self.num_scheduled_tokens)

    @property
    def req_ids(self) -> list[str]:
        """The scheduled requests' ids, in scheduling order."""
        return list(self.num_scheduled_tokens)
