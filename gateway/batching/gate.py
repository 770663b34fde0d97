"""Admission of bulk chat traffic: bulk fills a deployment's idle capacity and yields under
pressure.

Each deployment has a concurrency limit for bulk requests, steered by the first-token times of
its *interactive* requests relative to their budgets (AIMD, as TCP does with its window): when
one comes in above `backoff_at` of its budget, the limit halves (at most once per `cooldown_s`,
so one congestion episode counts once); while they stay below `grow_below` of their budgets, or
there is no interactive traffic at all, and bulk requests are waiting, it grows by one at a time.
Bulk requests beyond the limit wait in a bounded queue; beyond it they get a 503.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.config import BulkSpec
from gateway.errors import OverloadedError

GROW_EVERY_S = 1.0  # additive increase: at most one step per this long
SETTLE_S = 2.0  # and none this soon after a cut: the queue it left must drain first
QUIET_S = 1.0  # no interactive first token for this long: the deployment is idle


@dataclass(slots=True)
class _Lane:
    limit: float
    running: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)
    last_cut: float = -1e9
    last_grow: float = -1e9
    last_interactive: float = -1e9


class BulkGate:
    def __init__(self, spec: BulkSpec, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._spec = spec
        self._clock = clock
        self._lanes: dict[str, _Lane] = {}
        self.rejected = 0

    def _lane(self, deployment: str) -> _Lane:
        lane = self._lanes.get(deployment)
        if lane is None:
            lane = self._lanes[deployment] = _Lane(float(self._spec.initial_concurrency))
        return lane

    def limits(self) -> dict[str, int]:
        """The current bulk concurrency limit per deployment (for metrics)."""
        return {d: int(lane.limit) for d, lane in self._lanes.items()}

    def waiting(self) -> dict[str, int]:
        return {d: len(lane.waiters) for d, lane in self._lanes.items()}

    def observe(self, deployment: str, ttft_s: float, budget_s: float) -> None:
        """An interactive request's first token on `deployment`, against its TTFT budget."""
        lane = self._lane(deployment)
        now = self._clock()
        lane.last_interactive = now
        ratio = ttft_s / budget_s
        spec = self._spec
        if ratio > spec.backoff_at:
            if now - lane.last_cut >= spec.cooldown_s:
                lane.limit = max(float(spec.min_concurrency), lane.limit / 2)
                lane.last_cut = now
        elif ratio < spec.grow_below:
            self._grow(lane, now)

    def _grow(self, lane: _Lane, now: float) -> None:
        if (
            lane.waiters
            and now - lane.last_grow >= GROW_EVERY_S
            and now - lane.last_cut >= SETTLE_S
        ):
            lane.limit = min(float(self._spec.max_concurrency), lane.limit + 1)
            lane.last_grow = now
            self._wake(lane)

    async def acquire(self, deployment: str) -> None:
        """Take a bulk slot on `deployment`, waiting for one; raises OverloadedError when too
        many bulk requests are already waiting. Give it back with `release`."""
        lane = self._lane(deployment)
        now = self._clock()
        if now - lane.last_interactive >= QUIET_S:
            self._grow(lane, now)  # nobody interactive to protect: use the idle capacity
        if lane.running < int(lane.limit) and not lane.waiters:
            lane.running += 1
            return
        if len(lane.waiters) >= self._spec.max_queue:
            self.rejected += 1
            raise OverloadedError(
                "Too many bulk requests are waiting for this deployment; retry later.",
                retry_after_s=1.0,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lane.waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter in lane.waiters:
                lane.waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled():
                self.release(deployment)  # a slot was handed over as we left: pass it on
            raise

    def release(self, deployment: str) -> None:
        lane = self._lane(deployment)
        lane.running -= 1
        self._wake(lane)

    def _wake(self, lane: _Lane) -> None:
        while lane.waiters and lane.running < int(lane.limit):
            waiter = lane.waiters.popleft()
            if not waiter.done():
                lane.running += 1  # handed over: the waiter owns this slot now
                waiter.set_result(None)
