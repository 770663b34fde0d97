"""One micro-batch queue: compatible requests to one deployment, sent together.

A batch leaves as soon as it holds `max_batch_size` inputs, or when its oldest item has waited
`max_wait_ms`, whichever comes first, never later; up to `max_inflight` batches run at once and
the rest wait their turn. The queue is bounded: beyond `max_queue` waiting inputs a submit is
refused at once. A caller that gives up before its batch leaves is taken out of it; one that
gives up after only stops waiting (the others still get their answers).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gateway.config import BatchingSpec
from gateway.errors import OverloadedError

T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True, eq=False)
class Item(Generic[T, R]):
    """One caller's part of a batch: its payload, how many inputs it adds, and its answer."""

    payload: T
    size: int  # inputs it contributes (a request may carry several)
    future: asyncio.Future[R]
    queued: float = field(default_factory=time.perf_counter)
    sent: float | None = None  # when its batch left


Send = Callable[[list[Item[T, R]]], Awaitable[None]]
"""Sends one batch upstream and settles every item's future (result or exception)."""


class BatchQueue(Generic[T, R]):
    def __init__(
        self,
        spec: BatchingSpec,
        send: Send[T, R],
        *,
        on_sent: Callable[[list[Item[T, R]]], None] | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self._spec = spec
        self._send = send
        self._on_sent = on_sent
        self._on_idle = on_idle
        self._items: deque[Item[T, R]] = deque()
        self.waiting = 0  # inputs queued, not yet sent
        self.inflight = 0  # batches being sent
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, payload: T, size: int = 1) -> R:
        """Queue `payload` and wait for its answer. Raises OverloadedError when the queue is
        full, or whatever its batch raised."""
        spec = self._spec
        if self.waiting + size > spec.max_queue and self.waiting > 0:
            # About how long the queue needs to drain, at a batch per max_wait per slot.
            batches = self.waiting / spec.max_batch_size
            drain_s = batches / spec.max_inflight * max(spec.max_wait_ms / 1000, 0.05)
            raise OverloadedError(
                f"The batch queue is full ({self.waiting} inputs waiting); retry later.",
                retry_after_s=max(1.0, drain_s),
            )
        item: Item[T, R] = Item(payload, size, asyncio.get_running_loop().create_future())
        self._items.append(item)
        self.waiting += size
        self._pump()
        try:
            return await item.future
        except asyncio.CancelledError:
            if item.sent is None and item in self._items:
                # Gone before its batch left: it is not sent at all.
                self._items.remove(item)
                self.waiting -= item.size
                self._pump()
            raise

    def _pump(self) -> None:
        """Send every batch that is due and has a slot; arm the timer for the next one."""
        spec = self._spec
        max_wait_s = spec.max_wait_ms / 1000
        while self._items and self.inflight < spec.max_inflight:
            oldest = self._items[0]
            full = self.waiting >= spec.max_batch_size
            if not full and time.perf_counter() - oldest.queued < max_wait_s:
                break
            self._launch(self._take())
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._items and self.inflight < spec.max_inflight:
            due = self._items[0].queued + max_wait_s - time.perf_counter()
            self._timer = asyncio.get_running_loop().call_later(max(0.0, due), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._pump()

    def _take(self) -> list[Item[T, R]]:
        batch: list[Item[T, R]] = []
        inputs = 0
        now = time.perf_counter()
        while self._items:
            item = self._items[0]
            if batch and inputs + item.size > self._spec.max_batch_size:
                break
            self._items.popleft()
            self.waiting -= item.size
            if item.future.done():  # its caller already left
                continue
            item.sent = now
            batch.append(item)
            inputs += item.size
        return batch

    def _launch(self, batch: list[Item[T, R]]) -> None:
        if not batch:
            return
        self.inflight += 1
        if self._on_sent is not None:
            self._on_sent(batch)
        task = asyncio.create_task(self._run(batch), name="batch")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[Item[T, R]]) -> None:
        try:
            await self._send(batch)
        except BaseException as exc:
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc if isinstance(exc, Exception) else _gone())
            if not isinstance(exc, Exception):
                raise
        finally:
            self.inflight -= 1
            self._pump()
            if not self._items and self.inflight == 0 and self._on_idle is not None:
                self._on_idle()

    async def aclose(self) -> None:
        """Cancel the batches in flight (their callers get an error)."""
        if self._timer is not None:
            self._timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _gone() -> Exception:
    return OverloadedError("The gateway is shutting down.", retry_after_s=1.0)


def settle(item: Item[Any, R], result: R | BaseException) -> None:
    """Give an item its answer, unless its caller already left."""
    if item.future.done():
        return
    if isinstance(result, BaseException):
        item.future.set_exception(result)
    else:
        item.future.set_result(result)
