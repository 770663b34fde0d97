"""One chat request's place at bulk admission, for as long as it runs.

A bulk request takes its slot-equivalents on its first candidate before the race (waiting if
the gate says so), may be preempted and sent again until it commits, and gives them back when
it ends; an interactive request is counted while it runs, so bulk leaves it room, and its first
token teaches the gate how interactive traffic fares. The edge uses it in one `async with`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TypeVar

from gateway.batching.gate import BulkGate
from gateway.batching.preempt import BulkWork, Preempted

T = TypeVar("T")


class Admission:
    """Admission for one request on `lane` (its first candidate's deployment): bulk when
    `weight` (its slot-equivalents) is given, interactive otherwise; nothing without a gate."""

    __slots__ = ("_entered", "_gate", "_lane", "_work")

    def __init__(self, gate: BulkGate | None, lane: str | None, weight: float | None = None):
        self._gate = gate if lane is not None else None
        self._lane = lane
        self._work = BulkWork(gate, lane, weight) if gate and lane and weight else None
        self._entered = False

    @property
    def queued_s(self) -> float | None:
        """How long bulk work waited at the gate, re-queued waits included (None: not bulk)."""
        return self._work.queued_s if self._work is not None else None

    async def open(
        self, race: Callable[[Preempted | None], Awaitable[T]], committed: Callable[[], bool]
    ) -> T:
        """Run `race` once admitted. Bulk work may be preempted until `committed()`: the race is
        then cancelled (told so by the predicate it gets) and run again once readmitted."""
        gate, lane, work = self._gate, self._lane, self._work
        if gate is None or lane is None:
            return await race(None)
        self._entered = True
        if work is None:
            gate.enter(lane)
            return await race(None)
        await work.acquire()
        return await work.run(race, committed=committed)

    def first_token(
        self, deployment: str, ttft_s: float, budget_s: float | None, band: str
    ) -> None:
        """An interactive request's first token on `deployment`, against its budget: bulk
        admission there follows how interactive traffic fares."""
        if self._gate is not None and self._work is None:
            self._gate.observe(deployment, ttft_s, budget_s, band)

    def close(self) -> None:
        """Give back what the request holds at the gate; once."""
        if not self._entered or self._gate is None or self._lane is None:
            return
        self._entered = False
        if self._work is not None:
            self._work.release()
        else:
            self._gate.leave(self._lane)

    async def __aenter__(self) -> Admission:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
