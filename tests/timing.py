"""How slow this machine is right now, for the few deadlines a test cannot do without.

Tests wait for events, not for time. Where a deadline is unavoidable (another process starting,
a state polled in another process, the bound on a wait that should end at once), it is a generous
base figure for a quiet machine, times `slowdown()`: how much slower than a quiet reference
machine this one runs Python. That is the larger of a calibrated loop's wall time at the start of
the session against the reference's (it counts both a slower CPU and a CPU shared with other
work), and the load average per CPU now (work that arrived since); never under 1, at most 20.
`TAILGUARD_TEST_SLOWDOWN` sets it outright. pytest-timeout's limit scales the same way.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Final

__all__ = ["SLOWDOWN_AT_START", "scaled", "slowdown"]

REFERENCE_S: Final = 0.02  # `_spin()` on a quiet 2-core development machine (best of 10)
MOST: Final = 20.0


def _spin() -> float:
    """Seconds of wall time for a fixed piece of pure-Python work."""
    started, total = time.perf_counter(), 0
    for i in range(200_000):
        total += i * i
    return time.perf_counter() - started


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
