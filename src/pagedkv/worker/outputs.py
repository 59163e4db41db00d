"""ModelRunnerOutput: what one step of the model runner hands back (vLLM V1: ``v1/outputs.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class LogprobsLists:
    """Log-probabilities of consecutive positions (rows) of one request (vLLM V1's
    ``LogprobsLists``: column 0 is the chosen token, then the top-k).

    Attributes:
        token_ids: ``[num_rows][1 + k]`` int: the chosen token (the sampled one, or for a
            prompt position the prompt's token there), then the k most likely tokens, most
            likely first.
        logprobs: ``[num_rows][1 + k]`` float: their log-probabilities (natural log, the raw
            model distribution: see :mod:`pagedkv.worker.sampler`).
        ranks: ``[num_rows]`` int: the chosen token's rank, 1 = most likely (tokens with an
            equal logprob share the worse rank, as vLLM counts).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass(slots=True)
class ModelRunnerOutput:
    """The step's sampled tokens, one entry per request that sampled, in batch order, and the
    log-probabilities the requests asked for.

    Requests whose prompt is still incomplete after the step (a partial prefill chunk) sample
    nothing and do not appear in ``req_ids``; they may appear in ``prompt_logprobs``.

    Attributes:
        req_ids: the ids of the requests that sampled (those whose step computed every token
            they have), in the worker's batch order.
        sampled_token_ids: the token sampled for each of them (after its accepted drafts,
            if it had any: the bonus token, or the one that replaced the first rejected draft).
        logprobs: request id -> one row (the sampled token, then the top ``logprobs``), for
            the sampling requests whose params ask for ``logprobs``.
        prompt_logprobs: request id -> ``(first, rows)`` for requests asking for
            ``prompt_logprobs`` whose step computed prompt positions: row j holds the
            logprobs of prompt token ``first + j`` (given the tokens before it), then the top
            ``prompt_logprobs``. ``first >= 1``: the first prompt token has none.
        finished_kv_loads: requests whose KV tier loads (``kv_tier_ops.loads`` of this or
            an earlier step) are all in their pool blocks, checked: they may run now.
        dropped_kv_stores: tier keys whose store this step the workers dropped (the disk
            writer's queue was full): the scheduler forgets them.
        failed_kv_loads: request id -> tier keys whose load failed (missing, truncated or
            corrupt), reported once the request's loads have all ended: its KV is not what it
            should be, and the scheduler recomputes it.
        num_accepted_draft_tokens: request id -> how many of its draft tokens
            (``SchedulerOutput.scheduled_spec_decode_tokens``) were accepted, ``0 <= j <= k``,
            for every sampling request that had drafts: its new tokens this step are its first
            ``j`` drafts, then its ``sampled_token_ids`` entry.
        draft_token_ids: request id -> the proposer's drafts for its next step (speculative
            decoding, every method; vLLM's ``DraftTokenIds``): they follow the request's tokens
            after this step, for the requests that sampled and may draft, at most
            ``num_speculative_tokens`` each (a draft model: at most the request's
            ``SchedulerOutput.num_lookahead_tokens``); a request without drafts is left out.
        pooler_output: request id -> the pooled vector (a float32 numpy array
            ``[hidden_size]``, L2-normalized when its ``PoolingParams.normalize``) of each
            pooling request whose prompt this step completed (vLLM's name); empty otherwise.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] = field(default_factory=dict)
    finished_kv_loads: list[str] = field(default_factory=list)
    dropped_kv_stores: list[str] = field(default_factory=list)
    failed_kv_loads: dict[str, list[str]] = field(default_factory=dict)
    num_accepted_draft_tokens: dict[str, int] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    pooler_output: dict[str, Any] = field(default_factory=dict)
