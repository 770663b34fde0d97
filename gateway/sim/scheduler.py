"""The simulator's batch slots: one pool per simulated deployment, and the engine's counters.

A sequence holds one slot from its prefill to its last token; when every slot is taken, requests
queue: first come, first served (`Pool`), or by (priority, arrival) (`PriorityPool`, vLLM's
`--scheduling-policy priority`), preempting as vLLM V1 does (only for KV-cache room) or also for
a slot (`preempt_for_slots`). A released slot passes straight to the
next waiter, so a slot is never free while someone waits for one. A `PriorityPool` may also limit
the tokens its sequences hold in the KV cache (`kv_cache_tokens`): then a waiter needs room there
as well, and a sequence that grows into a full cache preempts one, as vLLM does.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.sim.metrics import ModelMetrics

__all__ = ["Pool", "PriorityPool", "SimStats", "Ticket"]


@dataclass(slots=True)
class SimStats:
    """Live counters of one engine. `wait_for` lets a test await a state instead of sleeping.

    `requests` counts inference requests that parsed (chat, completions, embeddings); each ends
    as exactly one of `completed`, `cancelled` (the client left first) or `faults` (a simulated
    429, 500, reset, cut or in-band error). `running` holds batch slots, `waiting` queues for one
    (a preempted sequence waits again); `preemptions` counts sequences preempted.
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
    preemptions: int = 0
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


IDLE, QUEUED, SEATED = 0, 1, 2  # a ticket's state


class Ticket:
    """One sequence's claim on a pool's slots, on the step-by-step path (`gateway.sim.decode`).

    `need` is what it holds in the simulated KV cache once seated (its prompt, and after a
    preemption the tokens it had generated as well), `ahead` the tokens that must fit besides (1
    for the token its prefill makes); `held` is what it holds now. `wake` is set while it sleeps,
    so a preemption can end the sleep at once; `preempted` tells it that it lost its slot.
    """

    __slots__ = (
        "ahead",
        "future",
        "held",
        "need",
        "order",
        "preempted",
        "priority",
        "state",
        "wake",
    )

    def __init__(self, priority: int, order: int, need: int, ahead: int) -> None:
        self.priority = priority
        self.order = order
        self.need = need
        self.ahead = ahead
        self.state = IDLE
        self.held = 0
        self.preempted = False
        self.future: asyncio.Future[None] | None = None
        self.wake: asyncio.Future[None] | None = None


class Pool:
    """The batch slots of one simulated deployment, handed out first come, first served.

    Besides the engine-wide `stats`, it counts its own waiters and the tokens its running
    sequences hold in the (simulated) KV cache, for `/metrics` (it joins `metrics.pools`).
    """

    preemptive = False  # whether a sequence can lose its slot (only on tickets)

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

    # The step-by-step path takes tickets; a first-come pool never preempts one.

    def ticket(self, priority: int, need: int, ahead: int = 0) -> Ticket:
        """A sequence's ticket: it holds `need` KV tokens once seated (`ahead` more must fit)."""
        return Ticket(priority, 0, need, ahead)

    async def admit(self, ticket: Ticket) -> None:
        await self.acquire()
        ticket.state = SEATED
        self.hold(ticket, ticket.need)

    async def wait(self, ticket: Ticket) -> None:
        """Until a queued ticket (a preempted sequence) has a slot again."""
        if ticket.state == QUEUED and ticket.future is not None:
            await ticket.future

    def hold(self, ticket: Ticket, tokens: int) -> None:
        """The seated ticket's sequence made `tokens` more: they take room in the KV cache."""
        ticket.held += tokens
        self.kv_tokens += tokens

    def drop(self, ticket: Ticket) -> None:
        """The ticket's sequence is over (done or abandoned): free whatever it holds."""
        if ticket.state == SEATED:
            ticket.state = IDLE
            self.kv_tokens -= ticket.held
            ticket.held = 0
            self.release()

    def step_s(self, base_step_s: float, slowdown: float) -> float:
        """One decode step with the batch as full as it is now (continuous batching)."""
        if not slowdown:
            return base_step_s
        return base_step_s * (1 + slowdown * (self.running - 1) / max(1, self.capacity - 1))


class PriorityPool(Pool):
    """Batch slots handed out by (priority, arrival), a lower priority value first, as vLLM's
    `--scheduling-policy priority` does.

    vLLM V1 preempts only while it schedules its running sequences and one lacks KV-cache blocks;
    a waiting request never preempts, whatever its priority (vllm-project/vllm issue #40004).
    With `preempt_for_slots` (what vLLM's open pull requests propose) a waiting one may:
    a ticket that finds every slot taken preempts the seated ticket of the lowest priority (the
    latest arrival among equals) if its priority is strictly lower: that one loses its slot and
    its KV at once, and waits again at its original place. Only tickets use it
    (`gateway.sim.decode`).

    With `kv_limit` (tokens) the KV cache is a limit too. The head of the queue is seated once a
    slot is free and its `need` plus `ahead` fits in the free KV; nobody behind it is seated
    first (vLLM's scheduler stops at a head that does not fit). A ticket that would be the head
    preempts seated tickets of strictly lower priority, the lowest first, when that makes room
    for it (and none when it would not). A seated ticket whose new tokens do not fit preempts
    the seated ticket of the lowest priority, the latest arrival among equals, itself included,
    until they fit: under fcfs every priority is 0, so that is the latest arrival. A ticket alone
    in the pool is seated, and grows, whatever it needs: it could not wait for anyone.
    """

    preemptive = True

    __slots__ = ("_heap", "_order", "_seated", "kv_limit", "preempt_for_slots")

    def __init__(
        self,
        capacity: int,
        stats: SimStats,
        metrics: ModelMetrics,
        kv_tokens_per_seq: int,
        kv_limit: int | None = None,
        *,
        preempt_for_slots: bool = False,
    ) -> None:
        super().__init__(capacity, stats, metrics, kv_tokens_per_seq)
        self.kv_limit = kv_limit
        self.preempt_for_slots = preempt_for_slots
        if kv_limit is not None:
            self.kv_capacity = kv_limit
        self._heap: list[tuple[int, int, Ticket]] = []
        self._order = itertools.count()
        self._seated: set[Ticket] = set()

    def ticket(self, priority: int, need: int, ahead: int = 0) -> Ticket:
        return Ticket(priority, next(self._order), need, ahead)

    async def acquire(self) -> None:
        raise TypeError("a priority pool hands out slots to tickets only")

    async def admit(self, ticket: Ticket) -> None:
        head = self._head()
        if head is None or _rank(ticket) < _rank(head):  # it would be the head of the queue
            if self.running < self.capacity and self._fits(ticket):
                self._seat(ticket)
                self.stats.changed()
                return
            if (victims := self._room(ticket)) is not None:
                for victim in victims:
                    self._preempt(victim)
                self._seat(ticket)
                if self.kv_limit is not None:
                    self._fill()  # the victims may have freed more than it needs
                self.stats.changed()
                return
        self._queue(ticket)
        self.stats.changed()
        await self.wait(ticket)  # cancelled: the caller's `drop` takes it out of the queue

    def hold(self, ticket: Ticket, tokens: int) -> None:
        limit = self.kv_limit
        if limit is not None and self.kv_tokens + tokens > limit:
            while self.kv_tokens + tokens > limit and len(self._seated) > 1:
                victim = max(self._seated, key=_rank)
                self._preempt(victim)
                if victim is ticket:  # the step that made these tokens is lost with it
                    self._fill()
                    self.stats.changed()
                    return
            ticket.held += tokens
            self.kv_tokens += tokens
            self._fill()
            self.stats.changed()
            return
        ticket.held += tokens
        self.kv_tokens += tokens

    def drop(self, ticket: Ticket) -> None:
        if ticket.state == SEATED:
            self._leave(ticket)
        elif ticket.state == QUEUED:
            ticket.state = IDLE
            self.waiting -= 1
            self.stats.waiting -= 1
            if ticket.future is not None and not ticket.future.done():
                ticket.future.cancel()
            if self.kv_limit is not None:
                self._fill()  # it may have been a head that did not fit
        else:
            return
        self.stats.changed()

    def _head(self) -> Ticket | None:
        """The first live waiter, dropping the entries of those that left."""
        heap = self._heap
        while heap:
            waiter = heap[0][2]
            assert waiter.future is not None
            if waiter.state == QUEUED and not waiter.future.done():
                return waiter
            heapq.heappop(heap)  # dropped, or being cancelled (its `drop` counts it out)
        return None

    def _fits(self, ticket: Ticket) -> bool:
        limit = self.kv_limit
        return (
            limit is None
            or not self._seated
            or self.kv_tokens + ticket.need + ticket.ahead <= limit
        )

    def _room(self, ticket: Ticket) -> list[Ticket] | None:
        """The seated tickets of strictly lower priority to preempt, the lowest first, for
        `ticket` to have a slot and its KV; None if even all of them would not do, or if
        waiting requests never preempt (vLLM V1)."""
        if not self.preempt_for_slots:
            return None
        lower = [t for t in self._seated if t.priority > ticket.priority]
        if not lower:
            return None
        lower.sort(key=_rank, reverse=True)
        limit = self.kv_limit
        slots = self.capacity - self.running
        free = 0 if limit is None else limit - self.kv_tokens
        want = ticket.need + ticket.ahead
        everyone = len(self._seated)
        victims: list[Ticket] = []
        for victim in lower:
            if slots > 0 and (limit is None or free >= want or len(victims) == everyone):
                return victims
            victims.append(victim)
            slots += 1
            free += victim.held
        if slots > 0 and (limit is None or free >= want or len(victims) == everyone):
            return victims
        return None

    def _seat(self, ticket: Ticket) -> None:
        ticket.state = SEATED
        self._seated.add(ticket)
        self.running += 1
        self.stats.running += 1
        ticket.held = ticket.need
        self.kv_tokens += ticket.need

    def _unseat(self, ticket: Ticket) -> None:
        self._seated.discard(ticket)
        self.kv_tokens -= ticket.held
        ticket.need = ticket.held  # recomputed when it is seated again
        ticket.held = 0
        self.running -= 1
        self.stats.running -= 1

    def _queue(self, ticket: Ticket) -> None:
        ticket.state = QUEUED
        ticket.future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (ticket.priority, ticket.order, ticket))
        self.waiting += 1
        self.stats.waiting += 1

    def _preempt(self, victim: Ticket) -> None:
        self._unseat(victim)
        victim.preempted = True
        self._queue(victim)
        self.stats.preemptions += 1
        self.metrics.preemptions += 1
        if victim.wake is not None and not victim.wake.done():
            victim.wake.set_result(None)  # it is sleeping: it learns it at once

    def _leave(self, ticket: Ticket) -> None:
        self._unseat(ticket)
        ticket.state = IDLE
        self._fill()

    def _fill(self) -> None:
        """Seat the head of the queue while it has a slot and its KV (making room for it with
        a KV limit); stop at the first head that cannot be seated."""
        while (head := self._head()) is not None:
            victims: list[Ticket] = []
            if self.running >= self.capacity or not self._fits(head):
                room = None if self.kv_limit is None else self._room(head)
                if not room:
                    return
                victims = room
            heapq.heappop(self._heap)
            for victim in victims:  # each ranks after the head, which stays first
                self._preempt(victim)
            self.waiting -= 1
            self.stats.waiting -= 1
            self._seat(head)
            assert head.future is not None
            head.future.set_result(None)


def _rank(ticket: Ticket) -> tuple[int, int]:
    return ticket.priority, ticket.order
