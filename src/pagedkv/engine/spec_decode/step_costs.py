"""What a decode step costs on this machine, for each number of tokens it computes, learned
from the engine's own step times (the cost side of the adaptive draft length,
:mod:`pagedkv.engine.spec_decode.drafts`).

A draft token is a row of the forward pass whether or not it is accepted, and what a row costs
depends on the CPU, the model, the dtype and the kernels a step of that size takes: on a CPU
where a one-token step is fast and bound by reading the weights, a few more rows cost little; on
one where the step is compute-bound they cost nearly a step each; and a step past the fused
layers' size (``FUSED_MAX_TOKENS`` in :mod:`pagedkv.model.llama`) jumps. A fixed table measured
on another machine drafts where it should not, so :class:`StepCosts` measures: after every
**decode-only step** (every scheduled request computing its one new token and its drafts: no
prompt rows, whose cost depends on the prompt) the engine reports the step's wall time and its
number of tokens ``T`` (:meth:`StepCosts.observe`), and the estimate for ``T`` follows them,
decayed so that it tracks a context that grows (each step's attention reads more KV) and a
machine that gets busier.

**Sizes not measured yet** are estimated from the measured ones: from the nearest smaller one at
a prior cost per row, :data:`PRIOR_ROW_COST` of the smallest measured step (or on the line to
the nearest larger one where that is cheaper), and below the smallest in proportion to its
size. Both are optimistic (rows cost less than
they do on any CPU measured, and a step has a fixed part that a smaller one pays too), so the
rule tries the sizes it does not know, which measures them; a size that turns out costly is
then not chosen again. A size measured fewer than :data:`MIN_SAMPLES` times costs the
smaller of its own estimate and that interpolation, and its estimate is the fastest of its
first :data:`MIN_SAMPLES` steps, so one slow step (another process woke up) does not rule a
size out for good. After those, a time above the estimate moves it by ``1 - DECAY_UP``, one
below by ``1 - DECAY_DOWN`` (another job's load only ever adds time).

Units: seconds once a step is measured; before that, one-token steps (a prior step costs
``1 + PRIOR_ROW_COST * (T - 1)``). Only ratios of costs matter to the rule. The idea of
measuring the verification cost per draft length on the running system is that of
SpecInfer's and Sequoia's hardware-aware tree sizing, and of vLLM's dynamic speculation
proposals, reduced to one table per engine.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from pagedkv.errors import ConfigError

#: What a row more costs where no step of that size was measured, as a fraction of a one-token
#: step: optimistic (a 1B model's decode step on a 2-core AVX-512 CPU pays about 0.03 a row for
#: its first rows; SmolLM2-135M's about 0.15), so the rule drafts and measures.
PRIOR_ROW_COST = 0.05

#: Observations of a size before its own estimate is used alone (see the module's docstring).
MIN_SAMPLES = 3

#: Sizes up to ``1 / NEAR_FRACTION`` past a measured one (at least one token) are estimated
#: onward from it (optimistic, so explored); farther ones between two measured sizes on the line
#: between them.
NEAR_FRACTION = 4

#: Weight of the estimate when a step took longer than it (slow to rise: a busy moment).
DECAY_UP = 0.8

#: Weight of the estimate when a step took less than it (quick to fall).
DECAY_DOWN = 0.5


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
        "_count",
        "_estimate",
        "_measured",
        "_trusted",
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
        #: tokens -> estimated seconds, and how many steps of that size were observed.
        self._estimate: dict[int, float] = {}
        self._count: dict[int, int] = {}
        #: the sizes observed at least once / at least MIN_SAMPLES times, ascending.
        self._measured: list[int] = []
        self._trusted: list[int] = []

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Record a decode-only step of ``num_tokens`` tokens that took ``seconds`` (wall);
        ignored when not learning, past ``max_num_tokens``, or for a non-positive time."""
        if not self.learn or not 1 <= num_tokens <= self.max_num_tokens or not seconds > 0.0:
            return
        estimate = self._estimate.get(num_tokens)
        if estimate is None:
            self._estimate[num_tokens] = seconds
            self._count[num_tokens] = 1
            insort(self._measured, num_tokens)
            return
        count = self._count[num_tokens] + 1
        self._count[num_tokens] = count
        if count <= MIN_SAMPLES:  # the fastest of the first few: one slow step is not its cost
            self._estimate[num_tokens] = min(estimate, seconds)
            if count == MIN_SAMPLES:
                insort(self._trusted, num_tokens)
            return
        decay = DECAY_UP if seconds > estimate else DECAY_DOWN
        self._estimate[num_tokens] = decay * estimate + (1.0 - decay) * seconds

    def cost(self, num_tokens: int) -> float:
        """The estimated cost of a decode-only step of ``num_tokens`` (>= 1) tokens: seconds,
        or one-token steps before anything was measured (see the module's docstring)."""
        interpolated = self._interpolate(num_tokens)
        count = self._count.get(num_tokens, 0)
        if count >= MIN_SAMPLES:
            return self._estimate[num_tokens]
        if count:
            return min(self._estimate[num_tokens], interpolated)
        return interpolated

    def _interpolate(self, num_tokens: int) -> float:
        """From the trusted sizes (those measured MIN_SAMPLES times); see the module's
        docstring. With none, the prior alone."""
        trusted = self._trusted
        if not trusted:
            return self._unit() * (1.0 + self.prior_row_cost * (num_tokens - 1))
        estimate = self._estimate
        index = bisect_left(trusted, num_tokens)
        if index < len(trusted) and trusted[index] == num_tokens:
            return estimate[num_tokens]
        if index == 0:  # in proportion: no less than a smaller step costs (optimistic too)
            first = trusted[0]
            return estimate[first] * num_tokens / first
        below = trusted[index - 1]
        if index >= 2:  # the cost per row measured just below, else the prior's
            lower = trusted[index - 2]
            row = max((estimate[below] - estimate[lower]) / (below - lower), 0.0)
        else:
            row = self.prior_row_cost * self._unit()
        onward = estimate[below] + row * (num_tokens - below)
        if index == len(trusted):  # past the largest
            return onward
        above = trusted[index]
        share = (num_tokens - below) / (above - below)
        line = estimate[below] + share * (estimate[above] - estimate[below])
        if num_tokens - below <= max(1, below // NEAR_FRACTION):  # near: explore
            return min(onward, line)
        return line

    def _unit(self) -> float:
        """What a one-token step costs by the prior, from the smallest measured step: its
        estimate over ``1 + prior_row_cost * (T - 1)``; 1.0 before any step was measured."""
        if not self._measured:
            return 1.0
        smallest = self._measured[0]
        return self._estimate[smallest] / (1.0 + self.prior_row_cost * (smallest - 1))

    def snapshot(self) -> dict[int, tuple[float, int]]:
        """tokens -> (estimated seconds, steps observed), for the sizes measured (metrics,
        benchmarks and tests)."""
        return {t: (self._estimate[t], self._count[t]) for t in self._measured}


__all__ = [
    "DECAY_DOWN",
    "DECAY_UP",
    "MIN_SAMPLES",
    "NEAR_FRACTION",
    "PRIOR_ROW_COST",
    "StepCosts",
]
