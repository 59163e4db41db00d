"""The draft-length rule on scripted step costs, without a model: what it gains or loses.

    python benchmarks/sim_draft_length.py [--steps 300] [--seeds 5] [--spikes 0.05]

Runs the engine's own rule (:func:`~pagedkv.engine.spec_decode.drafts.best_num_drafts` on a
:class:`~pagedkv.engine.spec_decode.step_costs.StepCosts` that learns from the steps as they
run) for ``n`` decoding requests whose drafts are each accepted with chance ``a`` (until the
first miss), on two cost shapes, in milliseconds a step of T tokens:

- ``smol``: 5.9 + 2.0 (T - 1) up to 24 tokens (the fused layers), as the engine learned them for
  SmolLM2-135M on a 2-core AMD EPYC Zen 4 in bf16 (``bench_spec_decode.py``, 2026-12-06: rows
  cost a third of a one-token step, so drafts pay alone and hardly in a batch), then an assumed
  jump of 8 ms and 1.5 ms a row;
- ``1b``: an assumed step bound by reading the weights (a 1B-parameter 4-bit model: 30 + 0.8
  (T - 1) up to 24 tokens, then a jump of 20 ms and 1.6 ms a row): rows are cheap.

Each step's time is the shape's times ``1 + 0.05 u`` (u uniform in [0, 1)), and with chance
``--spikes`` three times that (another job took the cores). Prints, per shape, batch size and
acceptance, the tokens per second with the rule over those without speculation (the same seeds,
so the same spikes fall on both), the mean and the worst of ``--seeds`` runs. The acceptance
estimate per request is the engine's (decayed counts from 1 in 2, the first unscheduled draft
checked). Results: docs/engine.md ("Adaptive draft length").
"""

from __future__ import annotations

import argparse
import random

from pagedkv.engine.spec_decode.drafts import ACCEPTANCE_DECAY, best_num_drafts, expected_tokens
from pagedkv.engine.spec_decode.step_costs import StepCosts

SHAPES = {
    "smol": (5.9, 2.0, 8.0, 1.5),
    "1b": (30.0, 0.8, 20.0, 1.6),
}
FUSED_MAX_TOKENS = 24


def step_ms(shape: str, num_tokens: int) -> float:
    """The scripted cost of a step of ``num_tokens`` tokens (milliseconds)."""
    base, row, jump, row_after = SHAPES[shape]
    if num_tokens <= FUSED_MAX_TOKENS:
        return base + row * (num_tokens - 1)
    return base + row * (FUSED_MAX_TOKENS - 1) + jump + row_after * (num_tokens - FUSED_MAX_TOKENS)


def simulate(
    shape: str,
    num_requests: int,
    acceptance: float,
    steps: int,
    seed: int,
    spikes: float,
    speculate: bool,
    max_num_drafts: int = 7,
) -> float:
    """Tokens per millisecond over ``steps`` steps of ``num_requests`` decoding requests."""
    rng = random.Random(seed)
    costs = StepCosts(4096)
    counts = [[1.0, 2.0] for _ in range(num_requests)]
    tokens, elapsed = 0, 0.0
    for _ in range(steps):
        step_tokens, step_expected = num_requests, float(num_requests)
        chosen = []
        for accepted, tried in counts:
            k = 0
            if speculate:
                a = accepted / tried
                k = best_num_drafts(a, max_num_drafts, costs, step_tokens, step_expected)
                if k:
                    step_tokens += k
                    step_expected += expected_tokens(a, k) - 1.0
            chosen.append(k)
        ms = step_ms(shape, step_tokens) * (1 + 0.05 * rng.random())
        if rng.random() < spikes:
            ms *= 3.0
        costs.observe(step_tokens, ms / 1000)
        elapsed += ms
        for state, k in zip(counts, chosen, strict=True):
            num_accepted = 0
            while num_accepted < k and rng.random() < acceptance:
                num_accepted += 1
            tokens += num_accepted + 1
            if k:  # tried: the accepted drafts and the first miss
                state[0] = ACCEPTANCE_DECAY * state[0] + num_accepted
                state[1] = ACCEPTANCE_DECAY * state[1] + num_accepted + (num_accepted < k)
            else:  # the first unscheduled draft, checked against the sampled token
                state[0] = ACCEPTANCE_DECAY * state[0] + (rng.random() < acceptance)
                state[1] = ACCEPTANCE_DECAY * state[1] + 1
    return tokens / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--spikes", type=float, default=0.05, help="chance a step is 3x slower")
    args = parser.parse_args()
    print(f"{args.steps} steps, {args.seeds} seeds, {args.spikes:.0%} of steps 3x slower")
    for shape in SHAPES:
        for num_requests in (1, 4, 16):
            cells = []
            for acceptance in (0.3, 0.6, 0.85):
                ratios = [
                    simulate(shape, num_requests, acceptance, args.steps, s, args.spikes, True)
                    / simulate(shape, num_requests, acceptance, args.steps, s, args.spikes, False)
                    for s in range(args.seeds)
                ]
                mean = sum(ratios) / len(ratios)
                cells.append(f"a={acceptance}: {mean:.2f}x (worst {min(ratios):.2f}x)")
            print(f"{shape:<5} batch {num_requests:>2}  " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
