"""Speculative decoding, worked through: the course's exercise as a table.

A draft proposes `k` tokens, the target verifies them in one step and keeps the longest agreeing
run plus one token of its own (`gateway.sim.speculative`). For each acceptance rate `alpha` (the
chance that one draft token agrees with the target): the tokens one target step yields,
`sum(alpha**i for i in 0..k)`; what the step costs in plain decode steps,
`1 + k x (verify_cost + draft_cost)`; and the wall-clock speedup, their ratio. A draft that is
rarely right pays the cost and yields about one token per step: below 1, slower than no draft.

The measured columns draw that many steps from `Speculation.draw` with `random.Random(seed)` (a
fresh generator per rate, so a row does not depend on the others), and also give what vLLM's
counters would read: `accepted / draft tokens`, which is below `alpha` since the first wrong
token discards the rest of the draft.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from gateway.sim.speculative import Speculation

__all__ = [
    "DEFAULT_RATES",
    "SpeculativeExperiment",
    "SpeculativeRow",
    "break_even",
    "conclusion",
    "run_experiment",
]

DEFAULT_RATES: Final = (0.05, 0.2, 0.4, 0.6, 0.8, 0.9)


@dataclass(frozen=True, slots=True)
class SpeculativeRow:
    """One acceptance rate: the formula's figures and a Monte-Carlo run's."""

    speculation: Speculation
    steps: int
    accepted: int  # draft tokens accepted over the run's steps

    @property
    def measured_tokens_per_step(self) -> float:
        return (self.steps + self.accepted) / self.steps

    @property
    def measured_speedup(self) -> float:
        return self.measured_tokens_per_step / self.speculation.step_cost

    @property
    def measured_acceptance(self) -> float:
        """accepted / draft tokens, as vLLM's counters give it."""
        return self.accepted / (self.steps * self.speculation.k)

    def to_json(self) -> dict[str, float]:
        s = self.speculation
        return {
            "acceptance": s.alpha,
            "tokens_per_step": s.tokens_per_step,
            "step_cost": s.step_cost,
            "speedup": s.speedup,
            "measured_tokens_per_step": self.measured_tokens_per_step,
            "measured_speedup": self.measured_speedup,
            "measured_acceptance_rate": self.measured_acceptance,
        }


@dataclass(frozen=True, slots=True)
class SpeculativeExperiment:
    k: int
    verify_cost: float
    draft_cost: float
    steps: int
    seed: int
    rows: tuple[SpeculativeRow, ...]

    @property
    def step_cost(self) -> float:
        return Speculation(self.k, 0.0, self.verify_cost, self.draft_cost).step_cost

    def to_json(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "verify_cost": self.verify_cost,
            "draft_cost": self.draft_cost,
            "step_cost": self.step_cost,
            "steps": self.steps,
            "seed": self.seed,
            "break_even_acceptance": break_even(self.k, self.verify_cost, self.draft_cost),
            "rows": [row.to_json() for row in self.rows],
            "conclusion": conclusion(self),
        }


def run_experiment(
    k: int,
    rates: Sequence[float] = DEFAULT_RATES,
    *,
    verify_cost: float = 0.02,
    draft_cost: float = 0.05,
    steps: int = 5000,
    seed: int = 1,
) -> SpeculativeExperiment:
    """The table for a draft of `k` tokens at each acceptance rate in `rates`."""
    if k < 1 or steps < 1:
        raise ValueError("k and steps must be at least 1")
    if any(not 0.0 <= alpha <= 1.0 for alpha in rates):
        raise ValueError("acceptance rates lie in [0, 1]")
    rows = []
    for alpha in rates:
        speculation = Speculation(k, alpha, verify_cost, draft_cost)
        rng = random.Random(seed)
        accepted = sum(speculation.draw(rng) for _ in range(steps))
        rows.append(SpeculativeRow(speculation, steps, accepted))
    return SpeculativeExperiment(k, verify_cost, draft_cost, steps, seed, tuple(rows))


def break_even(k: int, verify_cost: float, draft_cost: float) -> float | None:
    """The acceptance rate at which speculation neither gains nor loses (tokens per step equal
    the step's cost); None when even a draft that is always right cannot pay for itself."""
    cost = Speculation(k, 0.0, verify_cost, draft_cost).step_cost
    if Speculation(k, 1.0, verify_cost, draft_cost).tokens_per_step < cost:
        return None
    low, high = 0.0, 1.0  # tokens per step grows with alpha: bisect
    for _ in range(60):
        mid = (low + high) / 2
        if Speculation(k, mid).tokens_per_step < cost:
            low = mid
        else:
            high = mid
    return high


def conclusion(experiment: SpeculativeExperiment) -> str:
    """One paragraph: where speculation pays off, how much it gains and loses, and whether the
    draws agree with the formula."""
    k, cost = experiment.k, experiment.step_cost
    even = break_even(k, experiment.verify_cost, experiment.draft_cost)
    rows = experiment.rows
    if not rows:
        return "No acceptance rate given: nothing to compare."
    worst = min(rows, key=lambda r: r.speculation.speedup)
    best = max(rows, key=lambda r: r.speculation.speedup)
    gap = max(abs(r.measured_speedup - r.speculation.speedup) for r in rows)
    if even is None:
        where = (
            f"a step costs {cost:.2f} plain steps but yields at most {k + 1} tokens: no draft, "
            "however good, pays for itself"
        )
    else:
        where = (
            f"a step costs {cost:.2f} plain steps, so speculation pays off only once each draft "
            f"token is right more than {even:.0%} of the time"
        )
    seen = f"At acceptance {worst.speculation.alpha:g} decoding is {_speed(worst)}"
    if best is not worst:
        seen += f"; at {best.speculation.alpha:g} it is {_speed(best)}"
    return (
        f"With {k} draft tokens per step, {where}. {seen}. "
        f"{experiment.steps} simulated steps per rate agree with the formula within "
        f"{gap:.3f}x. vLLM's acceptance counter (accepted / draft tokens) reads below the "
        f"per-token rate: the first wrong token throws the rest of the draft away."
    )


def _speed(row: SpeculativeRow) -> str:
    speedup = row.speculation.speedup
    if speedup < 1.0:
        return f"{1.0 - speedup:.0%} slower than without a draft ({speedup:.2f}x)"
    return f"{speedup:.2f}x as fast"
