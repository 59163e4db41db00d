"""The scheduler's requests and where each one is: the one owner of the queues.

Every unfinished request is in exactly one place, which its status names::

    add() --> waiting --pop_waiting(), run()--> running --preempt()--> waiting (front)
                 |
                 +--pop_waiting(), wait_for_loads()--> loading (a KV tier hit)
                         loading --loads_ended(), run()--> running
                         loading --loads_ended(), requeue()--> waiting (front: a load failed)
    add_running(): a fork or beam child runs at once, behind its parent
    release(): out of any of them, its KV blocks, grammar, drafts and tier loads freed, its
               id recorded for the workers (take_finished_ids() at the next step)

The ids of a parent's n > 1 samples not forked yet are held from its add() until each sample is
added under its id or the parent is released (:meth:`RequestQueues.id_in_use`): no new request
can take one meanwhile.

The scheduler and its collaborators (beam searches, sample forks, KV tier loads, rejections) move
requests only through these methods; they read ``running``, ``waiting``, ``loading`` and
``requests`` freely. Torch-free; every method is O(1) but those that search the running list
(:meth:`preempt`, :meth:`release` of a running request: O(batch)) and
:meth:`remove_running` (one O(batch) pass for a step's finished requests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from pagedkv.core.interface import KVCacheInterface
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.request_queue import FCFSQueue, PriorityQueue
from pagedkv.engine.stats import SchedulerStats
from pagedkv.errors import InvalidRequestError

_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class RequestQueues:
    """The running list, the waiting queue, the loading set, the id map and the finished ids.

    Args:
        kv_cache: the KV cache the requests' blocks live in (freed by :meth:`preempt` and
            :meth:`release`).
        stats: the scheduler's counters (``num_preemptions``).
        policy: "fcfs" (the waiting queue in arrival order) or "priority" (by
            ``Request.priority``, then arrival): :mod:`~pagedkv.engine.request_queue`.
        swap: a preempted request's cached blocks are paged out to the KV tier first
            (``preemption_mode="swap"``).

    Attributes:
        running: the running requests in scheduling order (one list for the queues' life,
            changed in place: holders of it see every change).
        waiting: the waiting queue (new and preempted requests).
        loading: request id -> request holding blocks while the workers load its KV tier hit.
        requests: request id -> every unfinished request (in one of the three above).
    """

    __slots__ = (
        "_finished_ids",
        "_fork_children",
        "_kv_cache",
        "_release_hook",
        "_stats",
        "_swap",
        "loading",
        "requests",
        "running",
        "waiting",
    )

    def __init__(
        self,
        kv_cache: KVCacheInterface,
        stats: SchedulerStats,
        policy: str = "fcfs",
        swap: bool = False,
    ) -> None:
        self._kv_cache = kv_cache
        self._stats = stats
        self._swap = swap
        self.running: list[Request] = []
        self.waiting: FCFSQueue | PriorityQueue = (
            PriorityQueue() if policy == "priority" else FCFSQueue()
        )
        self.loading: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        #: ids held for the n > 1 samples their parent has not forked yet (id -> sample): no
        #: new request may take one before the sample is queued or its parent finishes.
        self._fork_children: dict[str, Request] = {}
        self._release_hook: Callable[[Request], None] | None = None

    def set_release_hook(self, hook: Callable[[Request], None] | None) -> None:
        """Call ``hook(request)`` from every :meth:`release` (speculative decoding's drafts
        forget the request there); None: none."""
        self._release_hook = hook

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        """Unfinished requests (running, waiting or loading)."""
        return len(self.requests)

    def get(self, request_id: str) -> Request | None:
        """The unfinished request ``request_id``, or None."""
        return self.requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued or loading (vLLM counts both as waiting)."""
        return len(self.waiting) + len(self.loading)

    @property
    def finished_ids(self) -> frozenset[str]:
        """Ids finished since the last :meth:`take_finished_ids` (a copy)."""
        return frozenset(self._finished_ids)

    # ------------------------------------------------------------------ in

    def id_in_use(self, request_id: str) -> bool:
        """True when an unfinished request, or a sample its parent has not forked yet, has
        ``request_id``."""
        return request_id in self.requests or request_id in self._fork_children

    def _check_new(self, request: Request) -> None:
        request_id = request.request_id
        if request_id in self.requests or (
            self._fork_children.get(request_id, request) is not request
        ):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")

    def _enter(self, request: Request) -> None:
        """Into the id map; a sample's held id is its own now, a parent's samples' are held."""
        request_id = request.request_id
        self.requests[request_id] = request
        self._fork_children.pop(request_id, None)
        for child in request.fork_children:
            self._fork_children[child.request_id] = child

    def add(self, request: Request, front: bool = False) -> None:
        """Queue a new request (status WAITING) at the back of the waiting queue, or at its
        front (a fork or beam child that recomputes instead of sharing its parent's blocks).

        Raises:
            InvalidRequestError: its id is in use (nothing changed).
        """
        self._check_new(request)
        request.status = RequestStatus.WAITING
        self._enter(request)
        if front:
            self.waiting.add_front(request)
        else:
            self.waiting.add(request)

    def add_running(self, request: Request, at: int) -> None:
        """A new request that runs at once at index ``at`` of the running list (a fork or beam
        child right behind its parent, sharing its blocks).

        Raises:
            InvalidRequestError: its id is in use (nothing changed).
        """
        self._check_new(request)
        request.status = RequestStatus.RUNNING
        self._enter(request)
        self.running.insert(at, request)

    # ------------------------------------------------------------------ moves

    def peek_waiting(self) -> Request:
        """The waiting request admission tries next (the waiting queue must not be empty)."""
        return self.waiting.peek()

    def pop_waiting(self) -> Request:
        """Take :meth:`peek_waiting`'s request out of the waiting queue (to :meth:`run`,
        :meth:`wait_for_loads`, :meth:`requeue` or :meth:`release` it)."""
        return self.waiting.pop()

    def run(self, request: Request) -> None:
        """``request`` (admitted, or its loads done) runs: status RUNNING, at the end of the
        running list."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def wait_for_loads(self, request: Request) -> None:
        """``request`` (admitted with a KV tier hit) waits for the workers' loads:
        WAITING_FOR_REMOTE_KVS, in the loading set."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = request

    def loads_ended(self, request_id: str) -> Request | None:
        """The workers reported ``request_id``'s loads over (done or failed): it leaves the
        loading set and the KV cache stops holding its loading blocks. Returns the request to
        :meth:`run` or :meth:`requeue`; None when unknown or released meanwhile (its blocks,
        which the workers were writing, are freed now and its finish recorded)."""
        request = self.loading.pop(request_id, None)
        if request is None:
            return None
        kv_cache = self._kv_cache
        kv_cache.finish_tier_loads(request_id)
        if request.is_finished:
            kv_cache.free(request)
            self._finished_ids.add(request_id)
            return None
        return request

    def preempt(self, request: Request) -> None:
        """Preempt running ``request``: out of the running list, its blocks freed (paged out
        first under swap; its cached blocks stay hit-able), its drafts dropped, status
        PREEMPTED with nothing computed, at the front of the waiting queue; counted.

        Raises:
            InvalidRequestError: ``request`` is not running (nothing changed).
        """
        if request.status != RequestStatus.RUNNING:
            raise InvalidRequestError(
                f"request {request.request_id!r} is not running ({request.status.name})"
            )
        self.running.remove(request)
        if self._swap:
            self._kv_cache.swap_out(request)
        self._kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self._stats.num_preemptions += 1
        self.waiting.add_front(request)

    def requeue(self, request: Request) -> None:
        """Put a waiting ``request`` (or one taken out of it) at the front of the waiting queue,
        so that it is taken next: a request admission skipped, a parked beam, a request whose
        loads failed. Its status is the caller's."""
        self.waiting.remove(request)
        self.waiting.add_front(request)

    def remove_running(self, requests: Collection[Request]) -> None:
        """Take ``requests`` out of the running list in one pass (a step's finished requests,
        released next)."""
        if requests:
            gone = {id(r) for r in requests}
            self.running[:] = [r for r in self.running if id(r) not in gone]

    # ------------------------------------------------------------------ out

    def release(self, request: Request, status: RequestStatus, now: float | None = None) -> None:
        """Finish ``request`` with ``status``: the one way out. It leaves the queue its status
        names (the running list, the waiting queue; a request whose status is already a
        finished one was taken out of the running list by :meth:`remove_running`); its KV
        blocks, its grammar's matcher and its drafts are freed; its finish time is stamped
        (``now``, :func:`time.monotonic` seconds; default now) and its id recorded for the
        workers (:meth:`take_finished_ids`). A request still loading keeps its blocks (the
        workers write them) until :meth:`loads_ended`, which frees them and records it.

        Raises:
            InvalidRequestError: ``status`` is not a finished one, or ``request`` is not an
                unfinished request of these queues (released twice). Nothing changed then.
        """
        if not status.is_finished:
            raise InvalidRequestError(f"release needs a finished status, got {status!r}")
        request_id = request.request_id
        if self.requests.get(request_id) is not request:
            raise InvalidRequestError(f"request {request_id!r} is not queued here")
        current = request.status
        if current == RequestStatus.RUNNING:
            self.running.remove(request)
        elif current in _QUEUED:
            self.waiting.remove(request)
        del self.requests[request_id]
        for child in request.fork_children:  # samples never forked: their ids are free again
            self._fork_children.pop(child.request_id, None)
        request.status = status
        if current == RequestStatus.WAITING_FOR_REMOTE_KVS and request_id in self.loading:
            pass  # blocks freed and finish recorded by loads_ended()
        else:
            self._kv_cache.free(request)
            self._finished_ids.add(request_id)
        if request.structured_output is not None:
            request.structured_output.free()
        if self._release_hook is not None:
            self._release_hook(request)
        request.finished_time = time.monotonic() if now is None else now

    def note_finished(self, request_ids: Collection[str]) -> None:
        """Tell the workers with the next step to forget ``request_ids`` too (requests run
        outside the queues, or a step whose finished ids the workers may not have applied)."""
        self._finished_ids.update(request_ids)

    def take_finished_ids(self) -> set[str]:
        """The ids finished since the last call (the next step's output tells the workers)."""
        finished, self._finished_ids = self._finished_ids, set()
        return finished


__all__ = ["RequestQueues"]
