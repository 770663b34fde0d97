"""An event-loop stall detector: a watchdog thread that notices when the loop stops turning.

The loop updates a heartbeat every `beat_s`. A watchdog thread polls every `poll_s`; whenever it
sees a fresh heartbeat, or the loop idle in its selector (the loop thread sleeps in
`epoll_wait`, as /proc/.../wchan says; where the kernel hides that, the innermost frame is the
selector's), or the loop not running at all, the loop is known to be alive at that moment. The
time since then is how long the loop has been held, less what the OS and the interpreter cost
it rather than the code it runs:

- the loop thread's own run-queue delay: runnable, waiting for a CPU (/proc/.../schedstat);
- while the loop thread waits on a futex (for the GIL, or for a thread it just started), the
  run-queue delay of the thread it may be waiting for (the largest among the process's others);
- the time the loop thread spent collecting garbage.

Past `threshold_s` the loop thread's stack is recorded: the code holding the loop. So a process
descheduled on a busy machine is late but not blocked, and an idle loop sits in the selector;
a loop held by `time.sleep` or a blocking socket call is never excused.

The stack is taken with `faulthandler` (it reads the interpreter's frames without building frame
objects): walking `f_back` of another thread's live frames can crash CPython 3.11.

`loop_watchdog` is the autouse fixture form; `pytest_runtest_call` fails the test that stalled.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import linecache
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryFile
from types import TracebackType
from typing import Any, Final

import pytest

__all__ = ["Stall", "StallDetector", "loop_watchdog", "pytest_runtest_call"]

THRESHOLD_S: Final = 0.05
_TASKS: Final = Path("/proc/self/task")
_FRAME: Final = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>.*)$')


@dataclass(frozen=True, slots=True)
class Stall:
    """The loop was blocked for `blocked_s` (the longest the watchdog saw) running `stack`."""

    blocked_s: float
    stack: str

    def __str__(self) -> str:
        return f"event loop blocked for {self.blocked_s * 1000:.0f} ms in:\n{self.stack}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # the thread ended
        return None


def _run_delays() -> dict[str, float]:
    """Per thread of this process (by native id), the seconds it has spent runnable but waiting
    for a CPU; empty where the kernel does not say."""
    delays = {}
    try:
        threads = [entry.name for entry in _TASKS.iterdir()]
    except OSError:
        return {}
    for tid in threads:
        text = _read(_TASKS / tid / "schedstat")
        fields = text.split() if text else []
        if len(fields) >= 2 and fields[1].isdigit():
            delays[tid] = int(fields[1]) / 1e9
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
    return "".join(reversed(lines)) or dump


class StallDetector:
    """Watches the running event loop while the `async with` block runs; see the module doc.

    `stalls` lists every blocking episode over `threshold_s`, one entry per episode.
    """

    def __init__(
        self, *, threshold_s: float = THRESHOLD_S, beat_s: float = 0.01, poll_s: float = 0.005
    ) -> None:
        self.threshold_s = threshold_s
        self.beat_s = beat_s
        self.poll_s = poll_s
        self.stalls: list[Stall] = []
        self.reported = 0  # stalls already turned into a test failure
        self._beats = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_id = 0
        self._native_id = ""
        self._wchan_works = False  # until the loop thread is seen sleeping in a named function
        self._gc_s = 0.0  # time the loop thread spent collecting garbage
        self._gc_started: float | None = None
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StallDetector:
        self._loop = asyncio.get_running_loop()
        self._thread_id = threading.get_ident()
        self._native_id = str(threading.get_native_id())
        gc.callbacks.append(self._on_gc)
        # Watching starts with the first heartbeat, after the watchdog thread's own start.
        self._watchdog = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._watchdog.start()
        self._heartbeat = asyncio.create_task(self._beat(), name="stall-detector-heartbeat")
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(1.0)  # it polls every few ms
        gc.callbacks.remove(self._on_gc)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            try:
                await self._heartbeat
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # our own caller is being cancelled, not just the heartbeat

    def report(self) -> str | None:
        """The stalls not reported yet, as text (None if there are none); marks them reported."""
        fresh = self.stalls[self.reported :]
        self.reported += len(fresh)
        return "\n\n".join(str(stall) for stall in fresh) if fresh else None

    async def _beat(self) -> None:
        while True:
            self._beats += 1
            await asyncio.sleep(self.beat_s)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if threading.get_ident() != self._thread_id:
            return
        if phase == "start":
            self._gc_started = time.monotonic()
        elif self._gc_started is not None:
            self._gc_s += time.monotonic() - self._gc_started
            self._gc_started = None

    def _gc_total(self) -> float:
        started = self._gc_started
        return self._gc_s + (time.monotonic() - started if started is not None else 0.0)

    def _waiting_in(self) -> str:
        """The kernel function the loop thread sleeps in ("0" while it runs or is runnable, and
        where the kernel does not say)."""
        return (_read(_TASKS / self._native_id / "wchan") or "0").strip()

    def _idle(self, kernel_wait: str) -> bool:
        """Whether the loop thread waits in its selector."""
        if kernel_wait != "0":
            self._wchan_works = True
            return "epoll" in kernel_wait or "ep_poll" in kernel_wait
        if self._wchan_works:
            return False  # running (or runnable): not waiting in anything
        # The kernel may hide wchan: look at the innermost frame (never at its f_back).
        frame = sys._current_frames().get(self._thread_id)
        code = frame.f_code if frame is not None else None
        return (
            code is not None
            and code.co_name == "select"
            and code.co_filename.endswith("selectors.py")
        )

    def _watch(self) -> None:
        """Poll until stopped. An episode starts when the watchdog first sees the loop held
        (at most a poll after it began); `excused` sums what the loop lost to others since."""
        beats = self._beats
        held_since: float | None = None
        delays: dict[str, float] = {}
        gc_at = excused = 0.0
        reported = False  # the current episode was recorded already
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            loop = self._loop
            kernel_wait = self._waiting_in()
            idle = self._idle(kernel_wait)
            running = loop is not None and loop.is_running()
            if self._beats == 0 or self._beats != beats or idle or not running:
                beats, held_since, reported = self._beats, None, False
                continue
            latest = _run_delays()
            if held_since is None:
                held_since, delays, gc_at, excused = now, latest, self._gc_total(), 0.0
                continue
            own = latest.get(self._native_id, 0.0) - delays.get(self._native_id, 0.0)
            others = max(
                (d - delays.get(tid, 0.0) for tid, d in latest.items() if tid != self._native_id),
                default=0.0,
            )
            excused += own + (others if kernel_wait.startswith("futex") else 0.0)
            excused += self._gc_total() - gc_at
            delays, gc_at = latest, self._gc_total()
            blocked = now - held_since - excused
            if reported:  # the same episode goes on: keep its first stack, note the longest
                last = self.stalls[-1]
                self.stalls[-1] = Stall(max(blocked, last.blocked_s), last.stack)
            elif blocked > self.threshold_s:
                reported = True
                self.stalls.append(Stall(blocked, _loop_stack(self._thread_id)))


@pytest.fixture(autouse=True)
async def loop_watchdog() -> AsyncIterator[StallDetector]:
    """Fails a test whose event loop is blocked for more than 50 ms, showing the blocking stack."""
    async with StallDetector() as detector:
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
