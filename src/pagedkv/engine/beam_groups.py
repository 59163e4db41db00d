"""The scheduler's beam searches: their seats, their steps, and unparking them.

Each beam is a running sequence of the scheduler; a search's beams share blocks by fork. The
search (:class:`~pagedkv.engine.beam_search.BeamSearchGroup`) decides which beams go on; this
module applies its decisions to the scheduler's queues
(:class:`~pagedkv.engine.request_queues.RequestQueues`) and the KV cache:

- seats: a search holds ``beam_width`` seats (of max_num_seqs) while any of its beams runs, so
  its forks and its preempted beams always find one (vLLM V0 counted a sequence group's most
  running sequences the same way); a search with no running beam holds none;
- a step: once every live beam has reported its candidates, beams not chosen are freed, a beam
  chosen more than once forks a child (the partially filled last block is copied on write), and
  each next beam gets its token;
- unparking: a beam that reported waits (parked) for its siblings; when a step would compute
  nothing because the siblings do not fit, every such search is preempted whole and queued
  together, so that one search at a time comes back whole.
"""

from __future__ import annotations

from pagedkv.core.interface import KVCacheInterface
from pagedkv.engine.beam_search import BeamSearchGroup
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.request_queues import RequestQueues
from pagedkv.engine.scheduled_step import ScheduledStep
from pagedkv.engine.stats import SchedulerStats
from pagedkv.errors import InvalidRequestError
from pagedkv.worker.outputs import LogprobsLists


class BeamSearchGroups:
    """The unfinished beam searches of a scheduler, by their root beam's id (what abort and
    the outputs name).

    Moves beams through the scheduler's queues, forks them in its KV cache and counts into its
    counters; owns the searches.

    Args:
        queues: the scheduler's requests.
        kv_cache: the KV cache (forks; its ``num_blocks`` bounds a search).
        stats: the scheduler's counters (``num_forks``, ``num_generation_tokens``).
        max_num_seqs: the scheduler's seats (a search needs ``beam_width`` of them).
    """

    def __init__(
        self,
        queues: RequestQueues,
        kv_cache: KVCacheInterface,
        stats: SchedulerStats,
        max_num_seqs: int,
    ) -> None:
        self._queues = queues
        self._kv_cache = kv_cache
        self._stats = stats
        self._max_num_seqs = max_num_seqs
        self.groups: dict[str, BeamSearchGroup] = {}

    def __bool__(self) -> bool:
        return bool(self.groups)

    def check(self, group: BeamSearchGroup, num_blocks_per_beam: int) -> None:
        """Refuse a beam search that could never run: more beams than seats, or more blocks
        than the pool when every beam holds its own (no sharing left: after preemptions each
        beam may recompute alone), so that a group alone in the engine always fits.

        Raises:
            InvalidRequestError: ``param="beam_width"``, one of the above.
        """
        width = group.beam_width
        max_num_seqs = self._max_num_seqs
        if width > max_num_seqs:
            raise InvalidRequestError(
                f"beam_width ({width}) must be <= max_num_seqs ({max_num_seqs}): "
                "every beam is a running sequence",
                param="beam_width",
            )
        num_usable_blocks = self._kv_cache.num_blocks - 1
        if width * num_blocks_per_beam > num_usable_blocks:
            raise InvalidRequestError(
                f"beam search with beam_width={width} needs up to {width} x "
                f"{num_blocks_per_beam} KV blocks but the whole pool has "
                f"{num_usable_blocks}; lower beam_width or max_tokens, or grow the KV cache",
                param="beam_width",
            )

    def add(self, request: Request) -> None:
        """Track ``request``'s search (its root beam was queued)."""
        self.groups[request.request_id] = request.beam_group

    def find(self, request_id: str, request: Request | None) -> BeamSearchGroup | None:
        """The search ``request_id`` names (its root's id) or ``request`` is a beam of."""
        group = self.groups.get(request_id)
        if group is None and request is not None:
            group = request.beam_group
        return group

    def seats(self) -> BeamSeats:
        """The seats the searches with a running beam hold for their beams not running, and how
        many of their beams wait for one (counted for one admission pass)."""
        reserved = waiting = 0
        for group in self.groups.values():
            beams = group.beams
            num_running = sum(1 for b in beams if b.status == RequestStatus.RUNNING)
            if num_running:
                reserved += group.beam_width - num_running
                waiting += len(beams) - num_running
        return BeamSeats(reserved, waiting)

    def reserved_seats(self) -> int:
        """Seats the searches with a running beam hold for their beams not running
        (:meth:`seats`' ``reserved``; 0 without a search)."""
        return self.seats().reserved if self.groups else 0

    @staticmethod
    def seats_needed(request: Request) -> int:
        """Seats ``request`` takes when admitted: 1; a beam's search takes beam_width when none
        of its beams runs, else none (one of its reserved seats)."""
        group = request.beam_group
        if group is None:
            return 1
        if any(b.status == RequestStatus.RUNNING for b in group.beams):
            return 0
        return group.beam_width

    def unpark(self, step: ScheduledStep) -> None:
        """Called when a step would compute nothing while requests wait: every running request
        is then a beam waiting for a sibling that does not fit (the parked beams hold the blocks
        it needs). Preempt every such search whole and queue its beams together at the front,
        oldest search first, so the next admissions bring one search in whole (each fits alone:
        ``check`` made sure) instead of parts of several."""
        queues = self._queues
        groups = []
        for request in queues.running:
            group = request.beam_group
            if group is not None and group not in groups:
                groups.append(group)
        for group in reversed(groups):
            for beam in reversed(group.beams):  # each to the front: in order at the end
                if beam.status == RequestStatus.RUNNING:
                    queues.preempt(beam)
                    step.preempted_req_ids.add(beam.request_id)
                else:
                    queues.requeue(beam)

    def check_rows(self, sampling: list[Request], logprobs: dict[str, LogprobsLists]) -> None:
        """Every beam that sampled has its candidates' logprobs row.

        Raises:
            InvalidRequestError: a beam without one (nothing changed).
        """
        if not self.groups:
            return
        no_row = [
            r.request_id
            for r in sampling
            if r.beam_group is not None
            and not r.is_finished
            and (
                r.request_id not in logprobs
                or len(logprobs[r.request_id].token_ids[0]) <= r.beam_group.num_candidates
            )
        ]
        if no_row:
            raise InvalidRequestError(
                f"beams {no_row} sampled without their candidates: a beam search needs the "
                "runner's logprobs rows (a ModelRunnerOutput, top-K of each beam)"
            )

    def step(self, group: BeamSearchGroup, changed: list[Request], now: float) -> None:
        """Apply a search's choice once every live beam has reported (between steps): free the
        beams not chosen, fork a child from a beam chosen more than once (it shares the
        parent's blocks), then give each next beam its token. A child that gets no free block
        (or whose parent is not running, preempted since it reported) is queued to recompute
        its KV instead (prefix-cache hits on the shared full blocks). When the search is over,
        its root is reported changed."""
        queues = self._queues
        stats = self._stats
        decision = group.step()
        for beam in decision.dropped:
            queues.release(beam, RequestStatus.FINISHED_STOPPED, now)
        for request, parent, _ in decision.continuations:
            if request is parent:
                continue
            request.num_computed_tokens = parent.num_computed_tokens
            if (
                parent.status == RequestStatus.RUNNING
                and parent.num_computed_tokens > 0
                and self._kv_cache.fork(parent, request)
            ):
                queues.add_running(request, queues.running.index(parent) + 1)
                stats.num_forks += 1
            else:
                request.num_computed_tokens = 0
                queues.add(request, front=True)
        for request, _, token_id in decision.continuations:
            request.append_output_token_ids(token_id)
            stats.num_generation_tokens += 1
        root = group.root
        if root.first_token_time is None:
            root.first_token_time = now
        if decision.done:
            del self.groups[root.request_id]
            changed.append(root)

    def end(self, group: BeamSearchGroup, status: RequestStatus) -> None:
        """End a search from outside the step loop (abort, a failed step): every live beam is
        freed with ``status``; the search has no result."""
        if group.done:
            return
        error = group.root.error if status == RequestStatus.FINISHED_ERROR else None
        queues = self._queues
        for beam in group.abort(error):
            if queues.get(beam.request_id) is beam:  # (a rejected beam was released already)
                queues.release(beam, status)
        group.root.status = status
        self.groups.pop(group.root.request_id, None)


class BeamSeats:
    """Seats held for beams during one admission pass: a running search keeps ``beam_width``
    seats, so its queued beams get in even when the batch is full, and newcomers do not take
    the seats its beams will need.

    Attributes:
        reserved: seats held by searches with a running beam for their beams not running.
        waiting: how many of those beams are queued.
    """

    __slots__ = ("reserved", "waiting")

    def __init__(self, reserved: int, waiting: int) -> None:
        self.reserved = reserved
        self.waiting = waiting

    def room(self, num_busy: int, max_num_seqs: int) -> bool:
        """Whether a queued request may be tried: a free seat, or a queued beam with a seat."""
        return num_busy + self.reserved < max_num_seqs or self.waiting > 0

    def fits(self, num_busy: int, seats: int, max_num_seqs: int) -> bool:
        """Whether ``seats`` more seats fit next to ``num_busy`` running or loading requests."""
        return num_busy + self.reserved + seats <= max_num_seqs

    def admitted(self, request: Request, seats: int) -> None:
        """Count ``request`` in, which took ``seats`` (:meth:`BeamSearchGroups.seats_needed`):
        a search's first running beam reserves the seats of the others (all queued); a later
        beam takes one of its reserved seats."""
        group = request.beam_group
        if group is None:
            return
        if seats:
            self.reserved += seats - 1
            self.waiting += len(group.beams) - 1
        else:
            self.reserved -= 1
            self.waiting -= 1


__all__ = ["BeamSearchGroups", "BeamSeats"]
