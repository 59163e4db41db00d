"""What a decode step costs on this machine, for each number of tokens it computes, learned
from the engine's own step times (the cost side of the adaptive draft length,
:mod:`pagedkv.engine.spec_decode.drafts`).

A draft token is a row of the forward pass whether or not it is accepted, and what a row costs
depends on the CPU, the model, the dtype and the kernels a step of that size takes: on a CPU
where a one-token step is fast and bound by reading the weights, a few more rows cost little; on
one where the step is compute-bound they cost nearly a step each; and a step past the fused
layers' size (the model's ``fused_max_tokens`` in :mod:`pagedkv.model.llama`: 24, or 64 for
a model of interleaved Q4_0 / Q4_1) jumps. A fixed table measured
on another machine drafts where it should not, so :class:`StepCosts` measures: after every
**decode-only step** (every scheduled request computing its one new token and its drafts: no
prompt rows, whose cost depends on the prompt) the engine reports the step's wall time and its
number of tokens ``T`` (:meth:`StepCosts.observe`). The estimate for ``T`` is the median of its
last :data:`WINDOW` steps (older ones drop out, so it follows a context that grows, each step's
attention reading more KV, and a machine whose load changes; a median, because another job
only ever adds time, and a few slow steps must not move it), and the fastest of them while
fewer than :data:`MIN_SAMPLES` were seen. Only the sizes the rule chooses are measured, so a
size not seen for :data:`STALE_STEPS` steps is forgotten (then estimated from its neighbours
and measured again when tried): one measured during a burst of load would otherwise look
costly for good.

**Sizes not measured yet** are estimated from the measured ones: on the line between the
nearest two; below the smallest in proportion to its size; past the largest at the cost per row
measured between the last two (with one, a prior :data:`PRIOR_ROW_COST` of a one-token step a
row). Up to a quarter past a measured size (:data:`NEAR_FRACTION`; at least one token) the
cheaper of the line and that size plus the row cost measured just below it. The prior and the
near sizes are optimistic (rows cost less than on any CPU measured; a step has a fixed part
that a smaller one pays too), so the rule tries the sizes next to those it knows while their
rows look cheap, which measures them; a size that turns out costly is then not chosen again,
and a jump in cost (a step that leaves the fused kernels) is not walked past.

Units: seconds once a step is measured; before that, one-token steps (a prior step costs ``1 +
PRIOR_ROW_COST * (T - 1)``). Only ratios of costs matter to the rule. Idea: SmartSpec's goodput
(accepted tokens per unit of the batch's execution time, with that time modeled per batch size;
Liu et al., 2024, the basis of vLLM's dynamic speculative decoding proposal) and Sequoia's
hardware-aware draft sizing, with the execution time measured on the running engine instead of
profiled beforehand.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from statistics import median

from pagedkv.errors import ConfigError

#: What a row more costs where no step of that size was measured, as a fraction of a one-token
#: step: optimistic (on the 2-core AVX-512 CPU of docs/engine.md a row cost SmolLM2-135M about
#: 0.35 of its one-token step), so the rule drafts and measures.
PRIOR_ROW_COST = 0.05

#: Steps of one size whose median is its estimate (a sliding window: older steps drop out).
WINDOW = 8

#: Steps of a size seen before its median is used; until then the fastest of them.
MIN_SAMPLES = 3

#: Decode-only steps after which a size not seen since is forgotten (checked every as many
#: steps, so within twice as many; measured again when the rule tries it): an estimate made
#: while the machine was busy would otherwise keep the rule from the size for good, since
#: only the sizes it chooses are measured.
STALE_STEPS = 128

#: Sizes up to ``1 / NEAR_FRACTION`` past a measured one (at least one token) are estimated
#: onward from it when that is cheaper than the line (optimistic, so explored).
NEAR_FRACTION = 4


class StepCosts:
    """The estimated wall time of a decode-only step for each number of tokens it computes.

    Args:
        max_num_tokens: the largest step measured (steps past it are not recorded; their cost
            is extrapolated); the engine's ``max_num_batched_tokens``.
        prior_row_cost: what a row costs where nothing was measured, in one-token steps.
        learn: False: :meth:`observe` records nothing and every cost is the prior (a fixed
            rule that does not depend on timing: seeded requests, tests, replays).

    Raises:
        ConfigError: ``max_num_tokens`` < 1 or ``prior_row_cost`` not in (0, 1].
    """

    __slots__ = (
        "_estimate",
        "_last_seen",
        "_measured",
        "_num_steps",
        "_samples",
        "learn",
        "max_num_tokens",
        "prior_row_cost",
    )

    def __init__(
        self, max_num_tokens: int, prior_row_cost: float = PRIOR_ROW_COST, learn: bool = True
    ) -> None:
        if isinstance(max_num_tokens, bool) or not isinstance(max_num_tokens, int):
            raise ConfigError(f"max_num_tokens must be an int, got {max_num_tokens!r}")
        if max_num_tokens < 1:
            raise ConfigError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        if not 0.0 < prior_row_cost <= 1.0:
            raise ConfigError(f"prior_row_cost must be in (0, 1], got {prior_row_cost}")
        self.max_num_tokens = max_num_tokens
        self.prior_row_cost = float(prior_row_cost)
        self.learn = learn
        #: tokens -> its last WINDOW step times (seconds), and its estimate from them.
        self._samples: dict[int, deque[float]] = {}
        self._estimate: dict[int, float] = {}
        #: the sizes observed, ascending; the step count when each was last observed.
        self._measured: list[int] = []
        self._last_seen: dict[int, int] = {}
        self._num_steps = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Record a decode-only step of ``num_tokens`` tokens that took ``seconds`` (wall);
        ignored when not learning, for a count that is not an int in [1, max_num_tokens], or
        for a time that is not positive and finite. Every :data:`STALE_STEPS` steps the sizes
        not seen in the last ones are forgotten."""
        if (
            not self.learn
            or isinstance(num_tokens, bool)
            or not isinstance(num_tokens, int)
            or not 1 <= num_tokens <= self.max_num_tokens
            or not 0.0 < seconds < math.inf
        ):
            return
        self._num_steps += 1
        self._last_seen[num_tokens] = self._num_steps
        if self._num_steps % STALE_STEPS == 0:
            self._forget_stale()
        samples = self._samples.get(num_tokens)
        if samples is None:
            samples = self._samples[num_tokens] = deque(maxlen=WINDOW)
            insort(self._measured, num_tokens)
        samples.append(seconds)
        if len(samples) < MIN_SAMPLES:
            self._estimate[num_tokens] = min(samples)
        else:
            self._estimate[num_tokens] = median(samples)

    def cost(self, num_tokens: int) -> float:
        """The estimated cost of a decode-only step of ``num_tokens`` (>= 1) tokens: seconds,
        or one-token steps before anything was measured (see the module's docstring)."""
        measured = self._measured
        if not measured:
            return 1.0 + self.prior_row_cost * (num_tokens - 1)
        estimate = self._estimate
        index = bisect_left(measured, num_tokens)
        if index < len(measured) and measured[index] == num_tokens:
            return estimate[num_tokens]
        if index == 0:  # in proportion: no less than a smaller step costs (optimistic too)
            first = measured[0]
            return estimate[first] * num_tokens / first
        below = measured[index - 1]
        if index >= 2:  # the cost per row measured just below, else the prior's
            lower = measured[index - 2]
            row = max((estimate[below] - estimate[lower]) / (below - lower), 0.0)
        else:
            row = self.prior_row_cost * self._unit()
        onward = estimate[below] + row * (num_tokens - below)
        if index == len(measured):  # past the largest
            return onward
        above = measured[index]
        share = (num_tokens - below) / (above - below)
        line = estimate[below] + share * (estimate[above] - estimate[below])
        if num_tokens - below <= max(1, below // NEAR_FRACTION):  # near: explore
            return min(onward, line)
        return line

    def _forget_stale(self) -> None:
        """Drop the sizes not observed in the last :data:`STALE_STEPS` steps."""
        oldest = self._num_steps - STALE_STEPS
        stale = [t for t in self._measured if self._last_seen[t] <= oldest]
        for size in stale:
            del self._samples[size], self._estimate[size], self._last_seen[size]
        if stale:
            self._measured = [t for t in self._measured if t in self._estimate]

    def _unit(self) -> float:
        """What a one-token step costs by the prior, from the smallest measured step: its
        estimate over ``1 + prior_row_cost * (T - 1)``."""
        smallest = self._measured[0]
        return self._estimate[smallest] / (1.0 + self.prior_row_cost * (smallest - 1))

    def snapshot(self) -> dict[int, tuple[float, int]]:
        """tokens -> (estimated seconds, steps observed), for the sizes measured (metrics,
        benchmarks and tests)."""
        return {t: (self._estimate[t], len(self._samples[t])) for t in self._measured}


__all__ = [
    "MIN_SAMPLES",
    "NEAR_FRACTION",
    "PRIOR_ROW_COST",
    "STALE_STEPS",
    "WINDOW",
    "StepCosts",
]
