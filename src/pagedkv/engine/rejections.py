"""The scheduler's rejections: requests that can never be served, found while scheduling.

A request whose blocks cannot be had while no other request holds any (the whole pool was free)
can never fit, and one whose grammar failed to compile can never run (one whose grammar is still
compiling waits): each is finished with
FINISHED_ERROR and its reason, with its fork children or its whole beam search, and reported by
the next ``update_from_output`` (a fault of one request fails that request only; the step goes
on with the others).
"""

from __future__ import annotations

from pagedkv.engine.beam_groups import BeamSearchGroups
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.request_queues import RequestQueues
from pagedkv.engine.sample_forks import SampleForks
from pagedkv.engine.scheduled_step import ScheduledStep
from pagedkv.engine.stats import SchedulerStats


class Rejections:
    """Requests finished with an error while scheduling, until the next report.

    Releases them from the scheduler's queues and counts them; owns the unreported list.

    Args:
        queues: the scheduler's requests.
        stats: the scheduler's counters (``num_rejected``).
        beams: the scheduler's beam searches (a rejected beam ends its search).
        num_usable_blocks: the KV cache's blocks a request may hold (for the message).
    """

    __slots__ = ("_beams", "_num_usable_blocks", "_queues", "_stats", "_unreported")

    def __init__(
        self,
        queues: RequestQueues,
        stats: SchedulerStats,
        beams: BeamSearchGroups,
        num_usable_blocks: int,
    ) -> None:
        self._queues = queues
        self._stats = stats
        self._beams = beams
        self._num_usable_blocks = num_usable_blocks
        self._unreported: list[Request] = []

    def take(self) -> list[Request]:
        """The requests rejected since the last call (beam searches by their root), in order."""
        unreported, self._unreported = self._unreported, []
        return unreported

    def grammar_not_ready(self, request: Request, skipped: list[Request]) -> bool:
        """Whether ``request`` (at the front of the waiting queue, with a structured-output
        constraint) cannot be admitted for its grammar: still compiling (vLLM's
        WAITING_FOR_FSM: it goes to ``skipped`` and waits, not the requests behind it, whatever
        the admission policy), or failed to compile (rejected)."""
        constraint = request.structured_output
        if not constraint.ready():
            skipped.append(self._queues.pop_waiting())
            return True
        if constraint.error is not None:
            self.reject(request, f"request {request.request_id!r}: {constraint.error}")
            return True
        return False

    def reject_if_never_fits(self, request: Request, step: ScheduledStep) -> bool:
        """Finish ``request`` (still queued) with an error if allocation failed while no other
        request holds blocks: the whole pool was free, so it can never fit. Returns True when
        rejected."""
        queues = self._queues
        if queues.running or step.requests or queues.loading:
            return False
        self.reject(
            request,
            f"request {request.request_id!r} needs more KV blocks for {request.num_tokens} "
            f"tokens than the whole pool ({self._num_usable_blocks} blocks) can give",
        )
        return True

    def reject(self, request: Request, error: str) -> None:
        """Finish waiting ``request`` with FINISHED_ERROR and ``error``, with its fork children
        or its whole beam search."""
        request.error = error
        self._stats.num_rejected += 1
        self._queues.release(request, RequestStatus.FINISHED_ERROR)
        group = request.beam_group
        if group is not None:  # its beam search ends with it (reported through its root)
            group.root.error = error
            self._beams.end(group, RequestStatus.FINISHED_ERROR)
            self._unreported.append(group.root)
            return
        self._unreported.append(request)
        self._unreported.extend(SampleForks.reject(request))


__all__ = ["Rejections"]
