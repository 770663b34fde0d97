"""The store's background work: periodic flush and refresh, owned by one context manager."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from gateway.latency.memory import LatencyStore

logger = logging.getLogger(__name__)


@asynccontextmanager
async def run_store(
    store: LatencyStore, *, flush_every_s: float = 0.25, refresh_every_s: float = 1.0
) -> AsyncIterator[LatencyStore]:
    """Own the store's periodic flush and refresh tasks while the block runs.

    The snapshot is refreshed once on entry. On exit both tasks are cancelled and awaited, then the
    store makes a final flush. An exception in one round is logged and the loop carries on.
    """
    await _attempt(store.refresh, "refresh")
    tasks = [
        asyncio.create_task(_every(flush_every_s, store.flush, "flush"), name="latency-flush"),
        asyncio.create_task(
            _every(refresh_every_s, store.refresh, "refresh"), name="latency-refresh"
        ),
    ]
    try:
        yield store
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _attempt(store.flush, "final flush")


async def _every(period_s: float, action: Callable[[], Awaitable[object]], what: str) -> None:
    while True:
        await asyncio.sleep(period_s)
        await _attempt(action, what)


async def _attempt(action: Callable[[], Awaitable[object]], what: str) -> None:
    try:
        await action()
    except Exception:  # a bad round must not end the loop; the next one may succeed
        logger.exception("latency store: %s failed", what)
