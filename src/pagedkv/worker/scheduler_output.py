"""SchedulerOutput: what one scheduler step hands to the model runner (torch-free).

The worker defines what it consumes and the scheduler (one layer up) imports it, so the imports
run one way (vLLM V1 keeps it in ``vllm/v1/core/sched/output.py``, below its workers). Requests are
typed by the :class:`ScheduledRequest` protocol, the few attributes the runner reads, so this
module does not import the engine's ``Request``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class ScheduledRequest(Protocol):
    """What the runner reads from a scheduled request (``pagedkv.engine.request.Request``)."""

    request_id: str
    sampling_params: Any  # pagedkv.sampling_params.SamplingParams
    prompt_token_ids: Sequence[int]

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt and output token ids."""
        ...

    @property
    def output_token_ids(self) -> Sequence[int]:
        """Output token ids so far (read for presence / frequency penalties)."""
        ...

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length (prompt logprobs, repetition penalty)."""
        ...

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end-of-sequence ids (masked until ``min_tokens``)."""
        ...


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: parallel lists, one entry per scheduled request, in batch order.

    Attributes:
        requests: the scheduled requests.
        num_scheduled_tokens: tokens computed for each request this step (>= 1).
        num_computed_tokens: each request's num_computed_tokens BEFORE this step (the position
            of its first scheduled token); its tokens this step are
            ``all_token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens]``.
        block_ids: each request's block ids, one list per KV cache group (its block table).
        sample: whether a token is sampled for the request after this step (its prompt and
            every earlier token are then computed); False for a partial prefill chunk.
        total_num_scheduled_tokens: sum of num_scheduled_tokens.
        preempted_requests: requests preempted while scheduling this step.
        finished_requests: requests finished while scheduling (rejected: can never fit).
    """

    requests: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_requests: list[ScheduledRequest] = field(default_factory=list)
    finished_requests: list[ScheduledRequest] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        """Number of scheduled requests."""
        return len(self.requests)

    @property
    def num_sampled(self) -> int:
        """Number of requests that sample a token after this step."""
        return sum(self.sample)
