"""ModelRunnerOutput: what one step of the model runner hands back (vLLM V1: ``v1/outputs.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelRunnerOutput:
    """The step's sampled tokens, one entry per request that sampled, in batch order.

    Requests whose prompt is still incomplete after the step (a partial prefill chunk) sample
    nothing and do not appear. Per-token logprobs (and prompt logprobs) belong here too, one entry
    per request alongside its token, when the engine offers them.

    Attributes:
        req_ids: the sampling requests' ids (``SchedulerOutput.requests[i].request_id`` for
            every i with ``sample[i]``).
        sampled_token_ids: the token sampled for each of them.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
