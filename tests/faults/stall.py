"""An event-loop stall detector: notices when one turn of the loop runs for too long.

The loop marks, itself, when each turn's work begins (its selector returned) and ends (back to
the next `select`); a watchdog thread only watches the turn in progress, to take its stack. A
turn's length is the loop's own wall time, less what the OS and the interpreter cost it rather
than the code it runs:

- the loop thread's run-queue delay: runnable, waiting for a CPU (/proc/.../schedstat), read by
  the loop thread itself at both ends of the turn, so it is exact even though the kernel adds a
  wait only once the thread is back on a CPU;
- while the loop thread waits on a futex (for the GIL), the run-queue delay of the thread it
  may be waiting for (the largest among the process's others), as the watchdog samples it:
  since its last sample, in this turn or an earlier one, but never more than the part of that
  interval inside the turn;
- the time spent collecting garbage, by the loop thread or any other (a collection holds the
  GIL: the loop cannot run until it ends).

So a loop that is idle in its selector is never in a turn (however late the OS wakes it, the
turn begins only once it runs again), a turn descheduled on a busy machine is late but not
blocked, and a loop held by `time.sleep` or a blocking socket call is never excused. Past
`threshold_s` the turn is a stall, with the stack the watchdog took while it was held.

The stack is taken with `faulthandler` (it reads the interpreter's frames without building frame
objects): walking `f_back` of another thread's live frames can crash CPython 3.11.

`loop_watchdog` is the autouse fixture form; `pytest_runtest_call` fails the test that stalled.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import linecache
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryFile
from types import TracebackType
from typing import Any, Final

import pytest

from tests.timing import cpu_slowdown

__all__ = ["Stall", "StallDetector", "loop_watchdog", "pytest_runtest_call"]

THRESHOLD_S: Final = 0.05
_TASKS: Final = Path("/proc/self/task")
_FRAME: Final = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>.*)$')
_UNSEEN: Final = "  (over before the watchdog thread could take its stack)\n"


@dataclass(frozen=True, slots=True)
class Stall:
    """The loop was blocked for `blocked_s` (one turn, less what was excused) running `stack`."""

    blocked_s: float
    stack: str

    def __str__(self) -> str:
        return f"event loop blocked for {self.blocked_s * 1000:.0f} ms in:\n{self.stack}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # the thread ended
        return None


def _run_delay(text: str | bytes | None) -> float | None:
    """The run-queue delay (seconds) in a schedstat line; None where the kernel does not say."""
    fields = text.split() if text else []
    return int(fields[1]) / 1e9 if len(fields) >= 2 and fields[1].isdigit() else None


def _run_delays() -> dict[str, float]:
    """Per thread of this process (by native id), the seconds it has spent runnable but waiting
    for a CPU; empty where the kernel does not say."""
    delays = {}
    try:
        threads = [entry.name for entry in _TASKS.iterdir()]
    except OSError:
        return {}
    for tid in threads:
        if (delay := _run_delay(_read(_TASKS / tid / "schedstat"))) is not None:
            delays[tid] = delay
    return delays


def _loop_stack(thread_id: int) -> str:
    """The stack of the callback `thread_id`'s loop is running (frames inside `_run_once`),
    formatted as a traceback, innermost last."""
    with TemporaryFile("w+") as out:
        faulthandler.dump_traceback(out, all_threads=True)
        out.seek(0)
        dump = out.read()
    # faulthandler names threads by `threading.get_ident()`; the caller is "Current thread".
    block = re.search(
        rf"^Thread 0x{thread_id:016x} \(most recent call first\):\n((?:  .*\n?)*)", dump, re.M
    )
    lines: list[str] = []
    for line in (block.group(1) if block else "").splitlines():  # innermost first
        found = _FRAME.match(line)
        if found is None:
            continue
        file, number, name = found["file"], int(found["line"]), found["name"]
        if name == "_run_once" and file.endswith("base_events.py"):
            break
        if name == "_run" and file.endswith("events.py"):
            continue  # Handle._run: asyncio's own trampoline
        source = linecache.getline(file, number).strip()
        lines.append(
            f'  File "{file}", line {number}, in {name}\n' + (f"    {source}\n" if source else "")
        )
    if block is None:
        return dump  # the thread is not in the dump: show every thread
    return "".join(reversed(lines)) or "  (no Python frame: the loop thread was in C code)\n"


class StallDetector:
    """Watches the running (selector) event loop while the `async with` block runs; see the
    module doc. `stalls` lists every turn that ran longer than `threshold_s`, once each."""

    def __init__(self, *, threshold_s: float = THRESHOLD_S, poll_s: float = 0.005) -> None:
        self.threshold_s = threshold_s
        self.poll_s = poll_s
        self.stalls: list[Stall] = []
        self.reported = 0  # stalls already turned into a test failure
        self._loop: Any = None  # a BaseSelectorEventLoop: its `_run_once` and `_selector`
        self._thread_id = 0
        self._native_id = ""
        self._schedstat: int | None = None  # the loop thread's schedstat, open
        # The turn in progress, written by the loop thread only.
        self._turn = 0
        self._busy = False
        self._started = self._delay_at = self._gc_at = 0.0
        # Written by the watchdog thread for the turn it names.
        self._gil_excused = (0, 0.0)
        self._stack = (0, "")
        self._gc_s = 0.0  # time spent collecting garbage, by any thread of the process
        self._gc_started: float | None = None
        self._stopping = False  # a plain flag: the watchdog's idle poll holds the GIL briefly
        self._watchdog: threading.Thread | None = None

    async def __aenter__(self) -> StallDetector:
        loop: Any = asyncio.get_running_loop()
        if not hasattr(loop, "_selector"):
            raise TypeError("StallDetector watches a selector event loop")
        self._loop = loop
        self._thread_id = threading.get_ident()
        self._native_id = str(threading.get_native_id())
        try:
            self._schedstat = os.open(_TASKS / self._native_id / "schedstat", os.O_RDONLY)
        except OSError:
            self._schedstat = None  # where the kernel does not say: nothing is excused
        gc.callbacks.append(self._on_gc)
        self._watchdog = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._watchdog.start()
        # From the next turn on: the loop reports each turn's start and end.
        run_once, select = loop._run_once, loop._selector.select

        def watched_run_once() -> None:
            try:
                run_once()
            finally:
                if self._busy:
                    self._end_turn()

        def watched_select(timeout: float | None = None) -> Any:
            if self._busy:  # a turn that did not end in `_run_once` (not expected)
                self._end_turn()
            events = select(timeout)
            self._delay_at, self._gc_at = self._own_delay(), self._gc_total()
            self._started = time.monotonic()
            self._turn += 1
            self._busy = True
            return events

        loop._run_once, loop._selector.select = watched_run_once, watched_select
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        loop = self._loop
        del loop._run_once, loop._selector.select  # back to the class's own methods
        if self._busy:  # this turn so far
            self._end_turn()
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.join(1.0)  # it polls every few ms
        gc.callbacks.remove(self._on_gc)
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None

    def report(self) -> str | None:
        """The stalls not reported yet, as text (None if there are none); marks them reported."""
        fresh = self.stalls[self.reported :]
        self.reported += len(fresh)
        return "\n\n".join(str(stall) for stall in fresh) if fresh else None

    def _end_turn(self) -> None:
        """On the loop thread, as a turn ends: record it if it held the loop too long."""
        self._busy = False
        if self._stopping:
            return
        wall = time.monotonic() - self._started
        if wall <= self.threshold_s:
            return
        turn, (gil_turn, gil) = self._turn, self._gil_excused
        excused = self._own_delay() - self._delay_at + self._gc_total() - self._gc_at
        blocked = wall - excused - (gil if gil_turn == turn else 0.0)
        if blocked > self.threshold_s:
            stack_turn, stack = self._stack
            self.stalls.append(Stall(blocked, stack if stack_turn == turn else _UNSEEN))

    def _own_delay(self) -> float:
        """The loop thread's run-queue delay so far: one `pread` of its open schedstat."""
        if self._schedstat is None:
            return 0.0
        return _run_delay(os.pread(self._schedstat, 128, 0)) or 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # Any thread's collection: it holds the GIL, so the loop waits it out (the test's
        # own worker threads collect a heap that large cached documents make long).
        if phase == "start":
            self._gc_started = time.monotonic()
        elif self._gc_started is not None:
            self._gc_s += time.monotonic() - self._gc_started
            self._gc_started = None

    def _gc_total(self) -> float:
        started = self._gc_started
        return self._gc_s + (time.monotonic() - started if started is not None else 0.0)

    def _watch(self) -> None:
        """Poll until stopped: while one turn goes on, excuse the GIL holder's run-queue delay
        and take the turn's stack once it looks long (an upper bound: a run-queue wait in
        progress is not counted yet)."""
        own = _TASKS / self._native_id / "schedstat"
        seen, gil = 0, 0.0
        # The other threads' run-queue delays when last read, and when: kept from turn to turn,
        # so the first wait for the GIL in a turn is excused too (the holder, often this very
        # thread, descheduled mid-poll); what counts is clamped to the part inside the turn.
        others: dict[str, float] | None = None
        others_at = 0.0
        # time.sleep, not Event.wait: a few bytecodes with the GIL per poll rather than a hundred,
        # so the watchdog is rarely descheduled while the loop waits for the GIL it holds.
        while not self._stopping:
            time.sleep(self.poll_s)
            turn, started = self._turn, self._started
            if not self._busy:
                continue
            if turn != seen:  # a new turn: nothing excused or taken for it yet
                seen, gil = turn, 0.0
            if (_read(_TASKS / self._native_id / "wchan") or "").startswith("futex"):
                latest, now = _run_delays(), time.monotonic()
                latest.pop(self._native_id, None)
                if others is not None:
                    window = now - max(others_at, started)
                    waited = max((d - others.get(t, d) for t, d in latest.items()), default=0.0)
                    gil += max(0.0, min(waited, window))
                    self._gil_excused = (turn, gil)
                others, others_at = latest, now
            delay = (_run_delay(_read(own)) or self._delay_at) - self._delay_at
            held = time.monotonic() - started - delay - gil
            if held > self.threshold_s * 0.6 and self._stack[0] != turn and self._turn == turn:
                self._stack = (turn, _loop_stack(self._thread_id))


@pytest.fixture(autouse=True)
async def loop_watchdog() -> AsyncIterator[StallDetector]:
    """Fails a test whose event loop is blocked for more than 50 ms (of the reference machine's
    CPU time: longer where the same work takes more CPU now), showing the blocking stack."""
    async with StallDetector(threshold_s=THRESHOLD_S * cpu_slowdown()) as detector:
        yield detector
    if (report := detector.report()) is not None:  # a stall in some fixture's teardown
        pytest.fail(report, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Turn stalls seen while the test body ran into a failure of the test itself."""
    yield
    detector = getattr(item, "funcargs", {}).get("loop_watchdog")
    if isinstance(detector, StallDetector) and (report := detector.report()) is not None:
        pytest.fail(report, pytrace=False)
