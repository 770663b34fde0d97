"""Preemption of bulk work on a first-come-first-served vLLM server, from the gateway.

Such a server serves an interactive arrival only after the sequences it already queued, and
nothing in front of it can reorder its queue; but the gateway can give back a slot it holds
itself. When an interactive request is about to queue there, the gate aborts the youngest bulk
work in flight on the deployment (the one that has done the least): cancelling it closes its
upstream connection, vLLM aborts the sequence and frees its slot. The work goes back to the head
of the gate's bulk queue and runs again on the same deployment once bulk is admitted again, as
vLLM's own priority scheduler would recompute a preempted sequence.

Only work that has sent nothing to its clients can be preempted (a bulk chat before its answer,
a micro-batch before its upstream call returns), so nothing is lost and nobody sees an error;
after `max_preemptions` a piece of work is left to finish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from gateway.batching.gate import BulkGate

T = TypeVar("T")
Preempted = Callable[[], bool]
"""Asked by the work as it unwinds from a cancellation: is this a preemption?"""


def _never() -> bool:
    return False


@dataclass(slots=True, eq=False)
class Hold:
    """Bulk work in flight that the gate may preempt: its slot-equivalents, when it started and
    how often it was preempted before. `abort` cancels it unless it is too late (it already has
    its answer); once preempted, `waiter` is its place at the head of the gate's queue."""

    deployment: str
    weight: float
    started: float
    preemptions: int
    abort: Callable[[], bool] = _never
    preempted: bool = False
    waiter: asyncio.Future[None] | None = None

    def is_preempted(self) -> bool:
        return self.preempted


def victims(holds: Iterable[Hold], need: float, limit: int) -> list[Hold]:
    """The bulk work to preempt to free `need` slot-equivalents: the youngest first, none
    preempted `limit` times already (their candidates, in order; the caller stops once enough
    were actually aborted)."""
    if need <= 0:
        return []
    eligible = [h for h in holds if h.preemptions < limit and not h.preempted]
    return sorted(eligible, key=lambda h: h.started, reverse=True)


class BulkWork:
    """Bulk work's slot-equivalents on one deployment, from `acquire` to `release`, preemptible
    by the gate while `run`'s work has sent nothing."""

    __slots__ = ("_gate", "deployment", "held", "preemptions", "queued_s", "weight")

    def __init__(self, gate: BulkGate, deployment: str, weight: float) -> None:
        self._gate = gate
        self.deployment = deployment
        self.weight = weight
        self.held = False  # the gate counts our slot-equivalents as in flight
        self.preemptions = 0
        self.queued_s = 0.0  # waiting at the gate, re-queued waits included

    async def acquire(self) -> None:
        """Wait for the slot-equivalents (OverloadedError when too many bulk requests wait)."""
        queued = time.perf_counter()
        await self._gate.acquire(self.deployment, self.weight)
        self.held = True
        self.queued_s += time.perf_counter() - queued

    def release(self) -> None:
        """Give the slot-equivalents back, if they are held (a re-queued piece of work whose
        caller left holds none)."""
        if self.held:
            self.held = False
            self._gate.release(self.deployment, self.weight)

    async def run(
        self,
        work: Callable[[Preempted], Awaitable[T]],
        *,
        committed: Callable[[], bool] = _never,
    ) -> T:
        """Run `work` holding the slot-equivalents. If the gate preempts it, it is cancelled
        (`work` is told, through the predicate it gets, that this cancellation is a preemption),
        waits at the head of the gate's queue and runs again. `committed`: the work has its
        answer already, too late to preempt."""
        current = asyncio.current_task()
        while True:
            hold = self._gate.hold(self.deployment, self.weight, self.preemptions)
            task = asyncio.ensure_future(work(hold.is_preempted))
            hold.abort = _aborter(task, committed)
            rejoining = False
            try:
                return await task
            except asyncio.CancelledError:
                if not hold.preempted or (current is not None and current.cancelling()):
                    raise
                rejoining = True
            finally:
                self._gate.unhold(hold, rejoining=rejoining)
            self.held = False
            self.preemptions += 1
            queued = time.perf_counter()
            await self._gate.rejoin(hold)
            self.held = True
            self.queued_s += time.perf_counter() - queued


def _aborter(task: asyncio.Future[T], committed: Callable[[], bool]) -> Callable[[], bool]:
    def abort() -> bool:
        if task.done() or committed():
            return False
        task.cancel()
        return True

    return abort
