"""The simulator's batch slots: one FIFO pool per simulated deployment, and the engine's counters.

A sequence holds one slot from its prefill to its last token; when every slot is taken, requests
queue first come, first served. A released slot passes straight to the oldest waiter, so a slot
is never free while someone waits for one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.sim.metrics import ModelMetrics

__all__ = ["Pool", "SimStats"]


@dataclass(slots=True)
class SimStats:
    """Live counters of one engine. `wait_for` lets a test await a state instead of sleeping.

    `requests` counts inference requests that parsed (chat, completions, embeddings); each ends
    as exactly one of `completed`, `cancelled` (the client left first) or `faults` (a simulated
    429, 500, reset, cut or in-band error). `running` holds batch slots, `waiting` queues for one.
    """

    requests: int = 0
    running: int = 0
    waiting: int = 0
    completed: int = 0
    cancelled: int = 0
    faults: int = 0
    open_streams: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    _waiters: list[tuple[Callable[[SimStats], bool], asyncio.Future[None]]] = field(
        default_factory=list, repr=False, compare=False
    )

    def changed(self) -> None:
        """Wake the waiters whose predicate now holds. Called after every change."""
        if not self._waiters:  # the common case costs one check
            return
        for predicate, future in self._waiters:
            if not future.done() and predicate(self):
                future.set_result(None)

    async def wait_for(self, predicate: Callable[[SimStats], bool]) -> None:
        """Return once `predicate(stats)` holds (at once if it already does)."""
        if predicate(self):
            return
        entry = (predicate, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        finally:
            self._waiters.remove(entry)


class Pool:
    """The batch slots of one simulated deployment, handed out first come, first served.

    Besides the engine-wide `stats`, it counts its own waiters and the tokens its running
    sequences hold in the (simulated) KV cache, for `/metrics` (it joins `metrics.pools`).
    """

    __slots__ = (
        "capacity",
        "kv_capacity",
        "kv_tokens",
        "metrics",
        "running",
        "stats",
        "waiters",
        "waiting",
    )

    def __init__(
        self, capacity: int, stats: SimStats, metrics: ModelMetrics, kv_tokens_per_seq: int
    ) -> None:
        self.capacity = capacity
        self.running = 0
        self.waiting = 0
        self.kv_tokens = 0
        self.kv_capacity = capacity * kv_tokens_per_seq
        self.stats = stats
        self.metrics = metrics
        self.metrics.pools.append(self)
        self.waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        stats = self.stats
        if self.running < self.capacity and not self.waiters:
            self.running += 1
            stats.running += 1
            stats.changed()
            return
        future = asyncio.get_running_loop().create_future()
        self.waiters.append(future)
        self.waiting += 1
        stats.waiting += 1
        stats.changed()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # a slot was handed over just as we were cancelled: pass it on
            elif future in self.waiters:  # `release` may have dropped it already (it was done)
                self.waiters.remove(future)
            raise
        finally:
            self.waiting -= 1
            stats.waiting -= 1
            stats.changed()

    def release(self) -> None:
        while self.waiters:
            future = self.waiters.popleft()
            if not future.done():
                future.set_result(None)  # the slot passes on; `running` is unchanged
                return
        self.running -= 1
        self.stats.running -= 1
        self.stats.changed()

    def step_s(self, base_step_s: float, slowdown: float) -> float:
        """One decode step with the batch as full as it is now (continuous batching)."""
        if not slowdown:
            return base_step_s
        return base_step_s * (1 + slowdown * (self.running - 1) / max(1, self.capacity - 1))
