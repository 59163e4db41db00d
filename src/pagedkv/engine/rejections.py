"""The scheduler's rejections: requests that can never be served, found while scheduling.

A request whose blocks cannot be had while no other request holds any (the whole pool was free)
can never fit, and one whose grammar failed to compile can never run (one whose grammar is still
compiling waits): each is finished with
FINISHED_ERROR and its reason, with its fork children or its whole beam search, and reported by
the next ``update_from_output`` (a fault of one request fails that request only; the step goes
on with the others).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.scheduled_step import ScheduledStep

if TYPE_CHECKING:
    from pagedkv.engine.scheduler import Scheduler


class Rejections:
    """Requests finished with an error while scheduling, until the next report.

    Shares the scheduler's queues and counters (``num_rejected``); owns the unreported list.

    Args:
        scheduler: the scheduler it serves.
    """

    __slots__ = ("_scheduler", "_unreported")

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
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
        waiting = self._scheduler.waiting
        if not constraint.ready():
            skipped.append(waiting.pop())
            return True
        if constraint.error is not None:
            waiting.pop()
            self.reject(request, f"request {request.request_id!r}: {constraint.error}")
            return True
        return False

    def reject_if_never_fits(self, request: Request, step: ScheduledStep) -> bool:
        """Finish ``request`` (still queued) with an error if allocation failed while no other
        request holds blocks: the whole pool was free, so it can never fit. Returns True when
        rejected."""
        scheduler = self._scheduler
        if scheduler.running or step.requests or scheduler.tier_loads:
            return False
        scheduler.waiting.remove(request)
        self.reject(
            request,
            f"request {request.request_id!r} needs more KV blocks for {request.num_tokens} "
            f"tokens than the whole pool ({scheduler.limits.num_usable_blocks} blocks) can give",
        )
        return True

    def reject(self, request: Request, error: str) -> None:
        """Finish ``request`` (out of the waiting queue already) with FINISHED_ERROR and
        ``error``, with its fork children or its whole beam search."""
        scheduler = self._scheduler
        request.status = RequestStatus.FINISHED_ERROR
        request.error = error
        scheduler.stats.num_rejected += 1
        scheduler.free_request(request)
        group = request.beam_group
        if group is not None:  # its beam search ends with it (reported through its root)
            group.root.error = request.error
            scheduler.beams.end(group, RequestStatus.FINISHED_ERROR)
            self._unreported.append(group.root)
            return
        self._unreported.append(request)
        self._unreported.extend(scheduler.forks.reject(request))


__all__ = ["Rejections"]
