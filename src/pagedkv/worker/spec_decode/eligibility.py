"""Which requests may draft: the one rule the scheduler (its draft slots) and the model runner
(its proposals) share. Torch- and numpy-free."""

from __future__ import annotations

from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import GREEDY_EPSILON, SamplingParams


def may_draft(
    params: SamplingParams,
    num_output_tokens: int,
    pooling_params: PoolingParams | None = None,
    *,
    shared_drafts: bool = False,
) -> bool:
    """Whether a request's drafts can be verified exactly, so that it samples what it would
    without them.

    The rejection sampler does not apply penalties or the ``min_tokens`` mask, and returns no
    logprobs, so a request with penalties, with ``min_tokens`` still pending or with
    ``logprobs`` drafts nothing (it decodes exactly as without speculation); so does a beam
    search's beam (its sampling params ask for logprobs) and a pooling request (it samples
    nothing).

    Args:
        params: the request's sampling params.
        num_output_tokens: tokens it has generated (after the step that proposes, for the
            runner; before the step that schedules, for the scheduler).
        pooling_params: a pooling request's params, else None.
        shared_drafts: the method's drafts come from what other requests generated (suffix
            decoding's tree): a seeded sample (temperature above 0 with a seed) then drafts
            nothing. Its draws follow its drafts (how many, which), so drafts learned from
            whatever the engine served before would make the same seeded request sample other
            tokens on another run; n-gram and draft-model drafts come from its own tokens.
    """
    return (
        pooling_params is None
        and params.logprobs is None
        and not params.has_penalties
        and num_output_tokens >= params.min_tokens
        and not (shared_drafts and params.seed is not None and params.temperature >= GREEDY_EPSILON)
    )
