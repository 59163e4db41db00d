"""The scheduler's forks of ``n > 1`` samples: one prefill, then each sample shares its blocks.

The first sample (the parent) carries the others in ``fork_children`` and stops at ``fork_at``
(all its prompt but the last token). Between steps, once it got there, each child maps the
parent's blocks (:meth:`KVCacheManager.fork <pagedkv.core.manager.KVCacheManager.fork>`: the
shared partially filled block is copied on the first write) and runs from there::

    parent:  [ prompt[:fork_at] computed ] --fork--> parent  computes prompt[-1], samples
                                                     child 1 computes prompt[-1], samples
                                                     ...

A child that has no seat (max_num_seqs) or no room for its first block queues as a plain request
instead (prefix-cache hits on the parent's full blocks, the rest recomputed); so does every child
when the prefix cache already holds the parent's whole prompt at admission.

:func:`sample_ids` names the samples of one prompt and :func:`fork_samples` sets them up so (the
engine's ``add_request`` and the simulator call both); :class:`SampleForks` forks them in the
scheduler.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedkv.core.interface import KVCacheInterface
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.request_queues import RequestQueues
from pagedkv.engine.stats import SchedulerStats
from pagedkv.errors import InvalidRequestError


def sample_ids(request_id: str, num_samples: int) -> list[str]:
    """The sequence ids of a prompt's ``num_samples`` samples: ``[request_id]`` alone, or
    ``request_id#0`` .. ``request_id#{n-1}`` (the engine's and the simulator's naming)."""
    if num_samples == 1:
        return [request_id]
    return [f"{request_id}#{index}" for index in range(num_samples)]


def fork_samples(samples: list[Request]) -> list[Request]:
    """Set up the ``n`` samples of one prompt to share its prefill: with ``n > 1`` and a prompt
    of 2 or more tokens, the first sample carries the others in ``fork_children`` and forks
    them at ``fork_at = len(prompt) - 1`` (each sample computes the last prompt token itself and
    samples from it). Returns the requests to add to the scheduler, in order: that first one
    alone, or every sample (one, or a one-token prompt: nothing to share)."""
    if len(samples) < 2 or samples[0].num_prompt_tokens < 2:
        return samples
    parent = samples[0]
    parent.fork_children = samples[1:]
    parent.fork_at = parent.num_prompt_tokens - 1
    return [parent]


class SampleForks:
    """Parents waiting to fork their samples, and the forks themselves.

    Moves the samples through the scheduler's queues, forks them in its KV cache and counts
    into its counters; owns the parents that reached their fork point.

    Args:
        queues: the scheduler's requests.
        kv_cache: the KV cache (forks).
        stats: the scheduler's counters (``num_forks``).
        max_num_seqs: the scheduler's seats.
        reserved_seats: the seats beam searches hold now
            (:meth:`~pagedkv.engine.beam_groups.BeamSearchGroups.reserved_seats`): a child
            forks only into a seat left over.
    """

    def __init__(
        self,
        queues: RequestQueues,
        kv_cache: KVCacheInterface,
        stats: SchedulerStats,
        max_num_seqs: int,
        reserved_seats: Callable[[], int],
    ) -> None:
        self._queues = queues
        self._kv_cache = kv_cache
        self._stats = stats
        self._max_num_seqs = max_num_seqs
        self._reserved_seats = reserved_seats
        self._pending: list[Request] = []  # parents that reached fork_at last step

    def check(self, request: Request) -> None:
        """Refuse a parent whose children cannot be forked from it (add time).

        Raises:
            InvalidRequestError: a child id in use, a child with another prompt, or a fork
                point outside ``[1, num_prompt_tokens)``.
        """
        queues = self._queues
        child_ids = set()
        for child in request.fork_children:
            child_id = child.request_id
            if (
                queues.id_in_use(child_id)
                or child_id == request.request_id
                or child_id in child_ids
            ):
                raise InvalidRequestError(f"request id {child_id!r} is already in use")
            child_ids.add(child_id)
            if child.prompt_token_ids != request.prompt_token_ids:
                raise InvalidRequestError("fork children must have their parent's prompt")
        if request.fork_children and not 1 <= request.fork_at < request.num_prompt_tokens:
            raise InvalidRequestError(
                f"fork_at must be in [1, {request.num_prompt_tokens}), got {request.fork_at}"
            )

    @staticmethod
    def admit(
        request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> tuple[int, list[Request]]:
        """A parent being admitted stops at its fork point: ``(num_new_tokens, [])``; unless
        the prefix cache has it all: then its children are released as plain requests (each
        hits the cache too) and returned (give them back with :meth:`keep` if it is not
        admitted, queue them with :meth:`queue_released` if it is)."""
        if num_computed_tokens < request.fork_at:
            return request.fork_at - num_computed_tokens, []
        released, request.fork_children = request.fork_children, []
        return num_new_tokens, released

    @staticmethod
    def keep(request: Request, released: list[Request]) -> None:
        """``request`` was not admitted: its released children are its own again."""
        if released:
            request.fork_children = released

    def queue_released(self, released: list[Request]) -> None:
        """Queue released children as plain requests, right behind their parent."""
        queues = self._queues
        for child in reversed(released):
            queues.add(child, front=True)

    def note_fork_points(self, requests: list[Request]) -> None:
        """After the step: parents whose step reaches their fork point fork before the next."""
        for request in requests:
            if request.fork_children and request.num_computed_tokens == request.fork_at:
                self._pending.append(request)

    def fork_pending(self) -> None:
        """Fork the children of the parents that reached their fork point (between steps).
        A parent preempted since forks when it gets there again."""
        if not self._pending:
            return
        queues = self._queues
        kv_cache = self._kv_cache
        running = queues.running
        for parent in self._pending:
            children, parent.fork_children = parent.fork_children, []
            if not children:
                continue
            if not (
                parent.status == RequestStatus.RUNNING
                and parent.num_computed_tokens == parent.fork_at
            ):
                parent.fork_children = children
                continue
            at = running.index(parent) + 1
            max_running = self._max_num_seqs - self._reserved_seats()
            for child in children:
                child.num_computed_tokens = parent.fork_at
                if len(running) < max_running and kv_cache.fork(parent, child):
                    child.num_cached_tokens = parent.num_cached_tokens
                    queues.add_running(child, at)
                    at += 1
                    self._stats.num_forks += 1
                else:
                    child.num_computed_tokens = 0
                    queues.add(child)
        self._pending = []

    @staticmethod
    def reject(request: Request) -> list[Request]:
        """``request`` failed: its children fail with it (returned, to report)."""
        children, request.fork_children = request.fork_children, []
        for child in children:
            child.status = RequestStatus.FINISHED_ERROR
            child.error = request.error
        return children


__all__ = ["SampleForks", "fork_samples", "sample_ids"]
