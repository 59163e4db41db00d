"""What a step's sampled tokens do to their requests (the body of ``update_from_output``).

A request samples when the step computed every token it has. Its token is appended and its stop
conditions checked (end-of-sequence, stop token ids, max_tokens: ``Request.check_stop``; a
structured-output constraint first accepts the token, and ends the request once complete); a
beam samples no token itself: its top candidates go to its beam search, which chooses once every
live beam has reported. Finished requests are freed by the scheduler afterwards.
"""

from __future__ import annotations

from pagedkv.engine.beam_search import BeamSearchGroup
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.stats import SchedulerStats
from pagedkv.errors import InvalidRequestError
from pagedkv.worker.outputs import LogprobsLists, ModelRunnerOutput
from pagedkv.worker.scheduler_output import SchedulerOutput


def match_sampled_tokens(
    scheduled: list[Request], scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
) -> tuple[list[Request], list[int], list[tuple[Request, object]]]:
    """The sampling requests of the last step (``scheduled``, in scheduling order) and their
    tokens from ``runner_output``, and the pooling requests whose prompt the step completed
    with their pooled vectors (a pooling request samples nothing).

    Raises:
        InvalidRequestError: ``scheduler_output`` is not the last step's, or the sampled tokens
            do not match the sampling requests (their number, or a request id that did not
            sample), or the pooled vectors the pooling requests (:func:`match_pooled`).
    """
    if len(scheduled) != scheduler_output.num_reqs:
        raise InvalidRequestError("update_from_output needs the output of the last schedule()")
    sampling, pooling = [], []
    for r in scheduled:
        if r.num_computed_tokens >= r.num_tokens:
            (sampling if r.pooling_params is None else pooling).append(r)
    by_id = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True))
    missing = [r.request_id for r in sampling if r.request_id not in by_id]
    if missing or len(by_id) != len(sampling):
        raise InvalidRequestError(
            f"the sampled tokens are for requests {sorted(by_id)}, the sampling requests "
            f"are {sorted(r.request_id for r in sampling)}"
        )
    accepted = runner_output.num_accepted_draft_tokens
    if accepted or scheduler_output.scheduled_spec_decode_tokens:
        drafted = {r.request_id: len(r.spec_token_ids) for r in sampling if r.spec_token_ids}
        if set(accepted) != set(drafted) or any(
            not 0 <= accepted[i] <= k for i, k in drafted.items()
        ):
            raise InvalidRequestError(
                f"accepted draft counts {accepted} do not match the drafts {drafted}"
            )
    pooled = match_pooled(pooling, runner_output) if pooling or runner_output.pooler_output else []
    return sampling, [by_id[r.request_id] for r in sampling], pooled


def match_pooled(
    done: list[Request], runner_output: ModelRunnerOutput
) -> list[tuple[Request, object]]:
    """The pooling requests whose prompt the last step completed (``done``, in scheduling
    order), each with its pooled vector from ``runner_output.pooler_output``.

    Raises:
        InvalidRequestError: the pooled vectors do not match those requests (one missing, or
            one for a request whose prompt is not complete); nothing is changed then.
    """
    pooler_output = runner_output.pooler_output
    if len(done) != len(pooler_output) or any(r.request_id not in pooler_output for r in done):
        raise InvalidRequestError(
            f"the pooled outputs are for requests {sorted(pooler_output)}, the pooling "
            f"requests whose prompt is complete are {sorted(r.request_id for r in done)}"
        )
    return [(r, pooler_output[r.request_id]) for r in done]


def finish_pooled(
    pooled: list[tuple[Request, object]], changed: list[Request], now: float
) -> list[Request]:
    """Finish each pooling request (FINISHED_STOPPED) with its pooled vector, appended to
    ``changed`` in order; returns the requests finished (not those aborted meanwhile)."""
    finished = []
    for request, vector in pooled:
        if request.is_finished:  # aborted between schedule() and now
            continue
        request.pooled_output = vector
        request.status = RequestStatus.FINISHED_STOPPED
        if request.first_token_time is None:
            request.first_token_time = now  # its output is ready: the end of its prefill
        changed.append(request)
        finished.append(request)
    return finished


def append_sampled_tokens(
    sampling: list[Request],
    tokens: list[int],
    logprobs: dict[str, LogprobsLists],
    changed: list[Request],
    stats: SchedulerStats,
    now: float,
    accepted_drafts: dict[str, list[int]] | None = None,
) -> tuple[list[Request], list[BeamSearchGroup]]:
    """Give each sampling request its token (appended to ``changed`` in order), or its beam
    search its candidates (``logprobs`` rows). Returns ``(finished, ready)``: the requests
    the token finished, and the beam searches whose every live beam has now reported.

    ``accepted_drafts``: request id -> its accepted draft tokens (speculative decoding), which
    come before its sampled token; each new token is checked for a stop in order, and the
    tokens after one that stops the request are dropped."""
    finished: list[Request] = []
    ready: list[BeamSearchGroup] = []
    num_generated = 0
    for request, token_id in zip(sampling, tokens, strict=True):
        if request.is_finished:  # aborted between schedule() and now
            continue
        group = request.beam_group
        if group is not None:  # a beam: its candidates go to its group, no token yet
            row = logprobs[request.request_id]
            if group.report(request, row.token_ids[0][1:], row.logprobs[0][1:]):
                ready.append(group)
            continue
        if request.first_token_time is None:
            request.first_token_time = now
        changed.append(request)
        drafts = accepted_drafts.get(request.request_id) if accepted_drafts else None
        for token in (token_id,) if not drafts else (*drafts, token_id):
            request.append_output_token_ids(token)
            num_generated += 1
            if (
                request.check_stop(token)
                if request.structured_output is None
                else constrained_stop(request, token)
            ):
                finished.append(request)
                break
    stats.num_generation_tokens += num_generated
    return finished, ready


def constrained_stop(request: Request, token_id: int) -> bool:
    """The stop check of a request with a structured-output constraint (its token just
    appended): True when the token finished it (a stop condition, the constraint complete, or a
    token the constraint refuses)."""
    constraint = request.structured_output
    if not constraint.accept(token_id):
        # Only when every token was masked (min_tokens hid the end the constraint needed): the
        # output cannot go on under the constraint.
        request.status = RequestStatus.FINISHED_ERROR
        request.error = (
            f"request {request.request_id!r}: token {token_id} breaks its structured_outputs "
            "constraint (no allowed token was left: min_tokens or stop settings may exclude the "
            "constraint's end)"
        )
        return True
    if request.check_stop(token_id):
        return True
    if constraint.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED  # the constraint is complete
        return True
    return False


__all__ = [
    "append_sampled_tokens",
    "constrained_stop",
    "finish_pooled",
    "match_pooled",
    "match_sampled_tokens",
]
