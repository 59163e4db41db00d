"""The scheduler's options and limits, and what one request may ask of them
(``Scheduler.add_request``).

A request that can never be served is refused when it is queued, not after it waited: an empty
prompt, an unresolved ``max_tokens``, prompt + max_tokens beyond max_model_len, or more KV blocks
than the whole pool holds at once (summed over KV cache groups, for a request whose prompt is
prefilled ``max_num_batched_tokens`` at a time:
:func:`~pagedkv.core.spec.max_num_blocks_per_request`).
The simulator refuses trace requests through the same rules (it queues them in a scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.core.spec import KVCacheSpec, max_num_blocks_per_request
from pagedkv.engine.request import Request
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.validation import check_int

POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
ADMISSION_POLICIES = ("fcfs", "skip")


def check_scheduler_options(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    enable_chunked_prefill: bool,
    policy: str,
    admission: str,
    preemption_mode: str,
) -> None:
    """Check a scheduler's limits and policies (see :class:`~pagedkv.engine.scheduler.Scheduler`).

    Raises:
        ConfigError: a value < 1, an unknown policy, admission or preemption mode, or chunked
            prefill off with a token budget below max_model_len (a prompt, or a preempted
            request, of max_model_len tokens must fit in one step).
    """
    for name, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_model_len", max_model_len),
    ):
        check_int(name, value, 1)
    if policy not in POLICIES:
        raise ConfigError(f"unknown scheduling policy {policy!r}; choose one of {POLICIES}")
    if admission not in ADMISSION_POLICIES:
        raise ConfigError(f"unknown admission {admission!r}; choose one of {ADMISSION_POLICIES}")
    if preemption_mode not in PREEMPTION_MODES:
        raise ConfigError(
            f"unknown preemption_mode {preemption_mode!r}; choose one of {PREEMPTION_MODES}"
        )
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) "
            f"must be >= max_model_len ({max_model_len}): a prompt (or a preempted request) "
            "of max_model_len tokens must fit in one step; enable chunked prefill or raise "
            "the budget"
        )


class RequestLimits:
    """The limits one request must fit in.

    Args:
        max_model_len: most tokens (prompt + output) of one request.
        max_num_batched_tokens: tokens per step (a prompt's prefill chunk).
        kv_cache_specs: the KV cache groups' specs.
        num_usable_blocks: blocks of the pool a request can hold (the null block left out).
    """

    def __init__(
        self,
        max_model_len: int,
        max_num_batched_tokens: int,
        kv_cache_specs: Sequence[KVCacheSpec],
        num_usable_blocks: int,
    ) -> None:
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache_specs = tuple(kv_cache_specs)
        self.num_usable_blocks = num_usable_blocks

    def check(self, request: Request) -> int:
        """Refuse ``request`` if it can never be served; returns the most KV blocks it holds
        at once.

        Raises:
            InvalidRequestError: an empty prompt (``param="prompt"``), max_tokens None (resolve
                it first: :func:`~pagedkv.sampling_params.resolve_max_tokens`), prompt +
                max_tokens beyond max_model_len, or more blocks than the whole pool
                (``param="max_tokens"``).
        """
        request_id = request.request_id
        num_prompt_tokens = request.num_prompt_tokens
        if num_prompt_tokens == 0:
            raise InvalidRequestError(
                f"request {request_id!r}: the prompt is empty", param="prompt"
            )
        # A pooling request generates nothing: its prompt may fill max_model_len.
        max_tokens = 0 if request.pooling_params is not None else request.sampling_params.max_tokens
        if max_tokens is None:
            raise InvalidRequestError(
                f"request {request_id!r}: max_tokens is None; resolve it before queueing "
                "(pagedkv.sampling_params.resolve_max_tokens)",
                param="max_tokens",
            )
        num_tokens = num_prompt_tokens + max_tokens
        param = "prompt" if request.pooling_params is not None else "max_tokens"
        if num_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"request {request_id!r}: prompt ({num_prompt_tokens} tokens) + max_tokens "
                f"({max_tokens}) = {num_tokens} tokens exceeds max_model_len="
                f"{self.max_model_len}; shorten the prompt or lower max_tokens",
                param=param,
            )
        num_blocks = max_num_blocks_per_request(
            self.kv_cache_specs, num_tokens, self.max_num_batched_tokens
        )
        if num_blocks > self.num_usable_blocks:
            raise InvalidRequestError(
                f"request {request_id!r}: prompt + max_tokens = {num_tokens} tokens needs "
                f"{num_blocks} KV blocks but the whole pool has {self.num_usable_blocks}; lower "
                "max_tokens or grow the KV cache",
                param=param,
            )
        return num_blocks


__all__ = [
    "ADMISSION_POLICIES",
    "POLICIES",
    "PREEMPTION_MODES",
    "RequestLimits",
    "check_scheduler_options",
]
