"""Speculative decoding, modelled: a draft proposes `k` tokens, the target verifies them in one
step and keeps the longest agreeing run, plus one token of its own.

Each draft token is right with probability `alpha` (independently, as in the usual analysis), and
the first wrong one ends the run: a step yields `1 + accepted` tokens, `accepted` in `0..k`. A
step costs one plain decode step, plus `verify_cost` of one per draft token verified (a forward
pass over k + 1 positions costs little more than over one) plus `draft_cost` of one per token the
draft generates. The speedup is tokens per step over what a step costs: a draft that is rarely
right adds cost and yields about one token per step, so it slows decoding down.

Pure functions and one draw, shared by the simulator's decode loop (`gateway.sim.timeline`) and
`tailguard simulate speculative`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Speculation", "accepted_at", "tokens_per_step"]


def tokens_per_step(k: int, alpha: float) -> float:
    """Expected tokens one target step yields: `sum(alpha**i for i in 0..k)`."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def accepted_at(k: int, alpha: float) -> list[float]:
    """The chance that draft position `i` (0-based) is accepted: every position before it, and
    it, agreed. vLLM's per-position acceptance counters estimate these."""
    return [alpha ** (i + 1) for i in range(max(0, k))]


@dataclass(frozen=True, slots=True)
class Speculation:
    """A draft of `k` tokens per step, each right with probability `alpha`."""

    k: int
    alpha: float
    verify_cost: float = 0.0  # one step's cost per draft token verified
    draft_cost: float = 0.0  # one step's cost per token drafted

    @property
    def step_cost(self) -> float:
        """One speculative step, in plain decode steps."""
        return 1.0 + self.k * (self.verify_cost + self.draft_cost)

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step(self.k, self.alpha)

    @property
    def speedup(self) -> float:
        """Decode speed over plain decoding (below 1: speculation slows decoding)."""
        return self.tokens_per_step / self.step_cost

    def draw(self, rng: random.Random) -> int:
        """The draft tokens one step accepts (0..k)."""
        accepted = 0
        while accepted < self.k and rng.random() < self.alpha:
            accepted += 1
        return accepted
