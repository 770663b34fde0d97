"""The bulk admission gate's AIMD steering, driven by hand (a fake clock, no network)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.batching import BulkGate
from gateway.config import BulkSpec
from gateway.errors import OverloadedError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gate(clock: Clock, **spec: object) -> BulkGate:
    settings = {"initial_concurrency": 4, "max_concurrency": 16, "max_queue": 2, **spec}
    return BulkGate(BulkSpec.model_validate(settings), clock=clock)


def test_slow_interactive_first_tokens_halve_the_limit_once_per_episode() -> None:
    """An interactive TTFT above 80% of its budget halves the bulk limit; a burst of such
    samples within the cooldown counts once; the limit never drops below the minimum."""
    clock = Clock()
    g = gate(clock)
    g.observe("d", 0.9, 1.0)
    assert g.limits() == {"d": 2}
    g.observe("d", 0.95, 1.0)  # same episode
    assert g.limits() == {"d": 2}
    for _ in range(5):
        clock.now += 1
        g.observe("d", 0.9, 1.0)
    assert g.limits() == {"d": 1}


async def test_headroom_grows_the_limit_only_while_bulk_waits() -> None:
    """Fast interactive first tokens add one slot at a time, and only when bulk requests are
    waiting for one (an unused limit does not grow without bound)."""
    clock = Clock()
    g = gate(clock, initial_concurrency=1)
    g.observe("d", 0.1, 1.0)
    assert g.limits() == {"d": 1}  # nobody waiting
    await g.acquire("d")
    waiting = asyncio.create_task(g.acquire("d"))
    await asyncio.sleep(0)
    assert g.waiting() == {"d": 1}
    clock.now += 1
    g.observe("d", 0.1, 1.0)
    await asyncio.wait_for(waiting, 1)  # the new slot went to the waiting request
    assert g.limits() == {"d": 2}


async def test_the_waiting_line_is_bounded_and_slots_pass_on() -> None:
    """Beyond max_queue waiting bulk requests the gate answers 503; a released slot goes to
    the first in line; a waiter that gives up leaves the line."""
    clock = Clock()
    g = gate(clock, initial_concurrency=1)
    g.observe("d", 0.5, 1.0)  # interactive traffic present: no idle growth
    await g.acquire("d")
    first = asyncio.create_task(g.acquire("d"))
    second = asyncio.create_task(g.acquire("d"))
    await asyncio.sleep(0)
    with pytest.raises(OverloadedError):
        await g.acquire("d")
    assert g.rejected == 1
    second.cancel()
    g.release("d")
    await asyncio.wait_for(first, 1)
    assert g.waiting() == {"d": 0}


async def test_no_interactive_traffic_lets_bulk_use_the_capacity() -> None:
    """With no interactive first token for a second, waiting bulk requests grow the limit."""
    clock = Clock()
    g = gate(clock, initial_concurrency=1)
    await g.acquire("d")
    waiting = asyncio.create_task(g.acquire("d"))
    await asyncio.sleep(0)
    clock.now += 2
    third = asyncio.create_task(g.acquire("d"))
    await asyncio.wait_for(waiting, 1)
    assert g.limits()["d"] >= 2
    third.cancel()
