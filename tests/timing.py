"""How slow this machine is right now, for the few deadlines a test cannot do without.

Tests wait for events, not for time. Where a deadline is unavoidable (another process starting,
a state polled in another process, the bound on a wait that should end at once), it is a generous
base figure for a quiet machine, times `slowdown()`: how much slower than a quiet reference
machine this one runs Python. That is the larger of a calibrated loop's wall time at the start of
the session against the reference's (it counts both a slower CPU and a CPU shared with other
work), and the load average per CPU now (work that arrived since); never under 1, at most 20.
`TAILGUARD_TEST_SLOWDOWN` sets it outright. pytest-timeout's limit scales the same way.

`cpu_slowdown()` is narrower: how much more CPU time than on the reference the same work takes
right now (a CPU shared with a hog runs slower, through its caches and its host, even while this
thread has it); it stretches the loop-stall detector's 50 ms, a budget of the loop's own time.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar, overload

import pytest

T = TypeVar("T")

__all__ = [
    "SLOWDOWN_AT_START",
    "cpu_slowdown",
    "eventually",
    "eventually_sync",
    "scaled",
    "slowdown",
]

REFERENCE_S: Final = 0.02  # `_spin()` on a quiet 2-core development machine (best of 10)
MOST: Final = 20.0
REFERENCE_CPU_S: Final = 0.0025  # `_cpu_spin()`'s CPU time on that machine (best of 40)
MOST_CPU: Final = 4.0  # a stall of 200 ms is always caught


def _spin() -> float:
    """Seconds of wall time for a fixed piece of pure-Python work."""
    started, total = time.perf_counter(), 0
    for i in range(200_000):
        total += i * i
    return time.perf_counter() - started


def _cpu_spin() -> float:
    """Seconds of this thread's CPU time for a fixed piece of pure-Python work."""
    started, total = time.thread_time(), 0
    for i in range(50_000):
        total += i * i
    return time.thread_time() - started


def _load_per_cpu() -> float:
    try:
        return os.getloadavg()[0] / max(1, len(os.sched_getaffinity(0)))
    except OSError:  # no load average here
        return 1.0


def _measure() -> float:
    if forced := os.environ.get("TAILGUARD_TEST_SLOWDOWN"):
        return float(forced)
    return statistics.median(_spin() for _ in range(3)) / REFERENCE_S


SLOWDOWN_AT_START: Final = _measure()


def slowdown() -> float:
    """The factor every unavoidable deadline is multiplied by (see the module doc)."""
    if os.environ.get("TAILGUARD_TEST_SLOWDOWN"):
        return SLOWDOWN_AT_START
    return min(MOST, max(1.0, SLOWDOWN_AT_START, _load_per_cpu()))


def scaled(seconds: float) -> float:
    """`seconds`, a deadline generous on a quiet machine, stretched for this one."""
    return seconds * slowdown()


@overload
async def eventually(
    check: Callable[[], Awaitable[T | None]],
    *,
    within_s: float = ...,
    what: str | Callable[[], str] = ...,
    every_s: float = ...,
) -> T: ...
@overload
async def eventually(
    check: Callable[[], T | None],
    *,
    within_s: float = ...,
    what: str | Callable[[], str] = ...,
    every_s: float = ...,
) -> T: ...
async def eventually(
    check: Callable[[], Any],
    *,
    within_s: float = 10.0,
    what: str | Callable[[], str] = "the condition",
    every_s: float = 0.02,
) -> Any:
    """The suite's one poll: call `check` (plain or async) until it returns something truthy,
    and return that; fail naming `what` once `within_s` (scaled to the machine) has passed. For
    state another process or task changes without an event to wait on; an event is awaited."""
    deadline = time.monotonic() + scaled(within_s)
    while True:
        found = check()
        if inspect.isawaitable(found):
            found = await found
        if found:
            return found
        _fail_if_past(deadline, within_s, what)
        await asyncio.sleep(every_s)


def eventually_sync(
    check: Callable[[], T | None],
    *,
    within_s: float = 10.0,
    what: str | Callable[[], str] = "the condition",
    every_s: float = 0.02,
) -> T:
    """`eventually` for code that cannot await: a synchronous fixture (a module-scoped one
    outlives the tests' event loops) waiting on another process."""
    deadline = time.monotonic() + scaled(within_s)
    while True:
        if found := check():
            return found
        _fail_if_past(deadline, within_s, what)
        time.sleep(every_s)


def _fail_if_past(deadline: float, within_s: float, what: str | Callable[[], str]) -> None:
    if time.monotonic() > deadline:
        pytest.fail(
            f"not reached within {scaled(within_s):.1f} s: "
            f"{what if isinstance(what, str) else what()}"
        )


def cpu_slowdown() -> float:
    """How much more CPU time than on the reference the same work takes now (1 to 4); measured
    afresh on each call (about 10 ms)."""
    if forced := os.environ.get("TAILGUARD_TEST_SLOWDOWN"):
        return min(MOST_CPU, max(1.0, float(forced)))
    measured = statistics.median(_cpu_spin() for _ in range(3)) / REFERENCE_CPU_S
    return min(MOST_CPU, max(1.0, measured))
