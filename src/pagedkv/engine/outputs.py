"""What the engine hands back: per-step, per-request outputs usable for streaming and as results.

A prompt with ``n`` samples gives one :class:`RequestOutput` holding ``n`` :class:`CompletionOutput`
(index 0..n-1). Each step's output carries both the cumulative state (``text``, ``token_ids``)
and what is new since the previous step's output of that request (``new_text``,
``new_token_ids``), so a streaming server sends the deltas and an offline caller keeps the last.

Log-probabilities, when asked for, have vLLM's shapes: one ``dict[token id, Logprob]`` per
position, holding the chosen token (sampled, or the prompt's) and the top-k; the values are the
model's raw distribution (``log_softmax`` in float32 of the logits before any sampling transform:
vLLM's ``logprobs_mode="raw_logprobs"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``).

    Attributes:
        logprob: natural log of the probability, float32 precision.
        rank: 1 = the most likely token at that position.
        decoded_token: the token's text on its own (special tokens included).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One position's logprobs: token id -> Logprob (the chosen token first, then the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: sample index in 0..n-1.
        text: generated text so far (a matched stop string is cut off).
        token_ids: generated token ids so far.
        new_text: text added since the previous output of this request.
        new_token_ids: token ids added since the previous output of this request.
        finish_reason: None while running, else "stop", "length", "abort" or "error".
        stop_reason: the stop string or stop token id that ended it (None for EOS / length).
        error: why it failed (finish_reason "error").
        logprobs: with ``SamplingParams.logprobs``: one entry per token of ``token_ids`` (the
            sampled token and the top-k); None otherwise.
        cumulative_logprob: with ``logprobs``: the sum of the sampled tokens' logprobs.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        """True once this sample is done."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps of one request, ``time.monotonic()`` seconds.

    Attributes:
        arrival_time: when the request was added.
        first_scheduled_time: when it was first scheduled (None before).
        first_token_time: when its first output token was sampled (None before).
        finished_time: when its last sample finished (None before).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first output token (None before it)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """One request's state after a step.

    Attributes:
        request_id: the id given to ``add_request``.
        prompt: the prompt text (None when given as token ids; the rendered chat template for
            chat messages).
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: one entry per prompt token,
            the first None (nothing predicts it), then the prompt token's logprob and the top-k
            at each position; None otherwise (or until the whole prompt is computed).
        outputs: one :class:`CompletionOutput` per sample (n).
        finished: True when every sample is finished.
        num_cached_tokens: prompt tokens served from the prefix cache (first sample's, at its
            first admission).
        metrics: timestamps (time to first token ...).
        embedding: a pooling request's pooled vector once finished (a float32 numpy array
            ``[hidden_size]``, L2-normalized unless its ``PoolingParams.normalize`` is False;
            see :mod:`pagedkv.pooling_params`); None for a generation request, and for a
            pooling request aborted or failed. Its ``outputs`` hold one empty sample with the
            finish reason ("stop" when pooled).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    embedding: Any = None

    # Shortcuts to the first sample: what n = 1 callers use.
    @property
    def text(self) -> str:
        """Generated text of sample 0."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """Generated token ids of sample 0."""
        return self.outputs[0].token_ids

    @property
    def new_text(self) -> str:
        """Text of sample 0 added in this step."""
        return self.outputs[0].new_text

    @property
    def new_token_ids(self) -> list[int]:
        """Token ids of sample 0 added in this step."""
        return self.outputs[0].new_token_ids

    @property
    def finish_reason(self) -> str | None:
        """finish_reason of sample 0."""
        return self.outputs[0].finish_reason

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first output token of any sample."""
        return None if self.metrics is None else self.metrics.time_to_first_token
