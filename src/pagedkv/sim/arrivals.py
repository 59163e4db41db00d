"""The simulators' arrival clock: when each trace request may be added, in steps.

One step is ``step_time`` seconds. A first turn arrives at its ``arrival_time``; a follow-up turn
becomes eligible once its parent finished (or was refused), plus its think time (at least one
step)::

    t (s)     0.0        0.1        ...   parent finishes at step k
    step      0          4          ...   child eligible at step k + max(1, think_time steps)

:func:`~pagedkv.sim.simulator.simulate` (one pool) and
:func:`~pagedkv.sim.cluster.simulate_cluster` (replicas) share it, and its stall check.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence

from pagedkv.errors import ConfigError
from pagedkv.sim.workloads import SimRequest


def to_steps(seconds: float, step_time: float) -> int:
    """Whole steps covering ``seconds`` (the first step at or after that time)."""
    # NOTE: the epsilon keeps 0.1 s / 0.025 s at 4 steps despite binary rounding.
    return max(0, math.ceil(seconds / step_time - 1e-9))


class ArrivalClock:
    """The trace's requests (by index) in the order they become eligible.

    Args:
        requests: the trace.
        step_time: seconds per step.
    """

    def __init__(self, requests: Sequence[SimRequest], step_time: float) -> None:
        self._requests = requests
        self._step_time = step_time
        self._children: dict[int, list[int]] = {}
        self._eligible: list[tuple[int, int]] = []  # heap of (step, index)
        for index, request in enumerate(requests):
            if request.parent_index is None:
                heapq.heappush(self._eligible, (to_steps(request.arrival_time, step_time), index))
            else:
                self._children.setdefault(request.parent_index, []).append(index)

    def __bool__(self) -> bool:
        """True while a request is still to arrive."""
        return bool(self._eligible)

    def skip_idle(self, step: int, busy: bool) -> int:
        """The step to run: ``step``, or when nothing runs or waits (not ``busy``) the next
        arrival's, if later (the clock jumps over idle time)."""
        if not busy and self._eligible and self._eligible[0][0] > step:
            return self._eligible[0][0]
        return step

    def due(self, step: int) -> Iterator[int]:
        """Pop the indices of the requests eligible at ``step`` (in order)."""
        eligible = self._eligible
        while eligible and eligible[0][0] <= step:
            yield heapq.heappop(eligible)[1]

    def finished(self, index: int, step: int) -> None:
        """Request ``index`` finished (or was refused) at ``step``: its follow-up turns become
        eligible after their think time."""
        for child in self._children.get(index, ()):
            delay = max(1, to_steps(self._requests[child].think_time, self._step_time))
            heapq.heappush(self._eligible, (step + delay, child))

    def check_stalled(self, num_scheduled: int, num_running: int, num_waiting: int) -> None:
        """Raise if a step ran nothing while requests wait, none runs and none will arrive.

        Raises:
            ConfigError: the waiting requests never fit (the pool or the budget is too small).
        """
        if not num_scheduled and not num_running and num_waiting and not self._eligible:
            raise ConfigError("the simulation stalled: waiting requests that never fit")


__all__ = ["ArrivalClock", "to_steps"]
