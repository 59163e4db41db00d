"""The scheduler's waiting queue, first-come-first-served or by priority.

Both queues remove a request from anywhere in O(1) or lazily (abort), so an abort never walks the
queue, and both put a preempted request back where it will be taken next among its peers.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator

from pagedkv.engine.request import Request


class FCFSQueue:
    """Requests in arrival order; a preempted request goes back to the front."""

    __slots__ = ("_requests",)

    def __init__(self) -> None:
        self._requests: OrderedDict[str, Request] = OrderedDict()

    def add(self, request: Request) -> None:
        """Append a new request at the back."""
        self._requests[request.request_id] = request

    def add_front(self, request: Request) -> None:
        """Put a preempted request at the front (it is resumed before newer arrivals)."""
        self._requests[request.request_id] = request
        self._requests.move_to_end(request.request_id, last=False)

    def peek(self) -> Request:
        """The request to admit next (the queue must not be empty)."""
        return next(iter(self._requests.values()))

    def pop(self) -> Request:
        """Remove and return the request :meth:`peek` gives."""
        return self._requests.popitem(last=False)[1]

    def remove(self, request: Request) -> None:
        """Remove ``request`` if it is queued (O(1))."""
        self._requests.pop(request.request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests.values())


class PriorityQueue:
    """Requests by (priority, arrival_time): lower priority value first, then older first.

    A binary heap with lazy deletion: :meth:`remove` only forgets the request; its heap entry is
    dropped when it reaches the top.
    """

    __slots__ = ("_counter", "_heap", "_requests")

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._requests: dict[str, Request] = {}
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        """Queue ``request`` by its priority and arrival time."""
        self._requests[request.request_id] = request
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    # A preempted request keeps its (priority, arrival_time), which puts it ahead of newer peers.
    add_front = add

    def _drop_removed(self) -> None:
        heap = self._heap
        while heap and self._requests.get(heap[0][3].request_id) is not heap[0][3]:
            heapq.heappop(heap)

    def peek(self) -> Request:
        """The request to admit next (the queue must not be empty)."""
        self._drop_removed()
        return self._heap[0][3]

    def pop(self) -> Request:
        """Remove and return the request :meth:`peek` gives."""
        self._drop_removed()
        request = heapq.heappop(self._heap)[3]
        del self._requests[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        """Forget ``request`` if it is queued (its heap entry is dropped later)."""
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests.values())
