"""The fault suite's own loop-stall watchdog can fail: it catches a blocked loop and names the
blocking code, and it does not mistake an idle or stopped loop for a blocked one.

Each scenario runs its own event loop in a worker thread, watched by its own detector, so the
test's loop (and its autouse watchdog) stays idle while the scenario blocks.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

from tests.faults.stall import Stall, StallDetector
from tests.timing import scaled

ROOT = Path(__file__).resolve().parents[2]


async def blocking_call() -> None:
    time.sleep(0.1)  # noqa: ASYNC251 - the blocking call the watchdog must catch


async def blocked_loop() -> list[Stall]:
    async with StallDetector() as detector:
        await asyncio.sleep(0.05)
        await blocking_call()
        await asyncio.sleep(0.05)
    return detector.stalls


async def idle_loop() -> list[Stall]:
    async with StallDetector() as detector:
        await asyncio.sleep(0.2)  # waiting in the selector is not blocking
    return detector.stalls


def stopped_loop() -> list[Stall]:
    """A loop that is not running for 100 ms (between two `run_until_complete`) is not blocked."""
    loop = asyncio.new_event_loop()
    detector = StallDetector()
    try:
        loop.run_until_complete(detector.__aenter__())
        time.sleep(0.1)  # outside the loop: nothing it should be doing is held up
        loop.run_until_complete(detector.__aexit__(None, None, None))
    finally:
        loop.close()
    return detector.stalls


async def collected_elsewhere() -> tuple[list[Stall], float]:
    """A turn of the loop held up while another thread collects a large heap (a collection
    holds the GIL); the collection's length."""
    heap = [[i] for i in range(2_000_000)]  # tracked objects: a long full collection
    go, done = threading.Event(), threading.Event()
    took = [0.0]

    def collect() -> None:
        go.wait()
        started = time.perf_counter()
        gc.collect()
        took[0] = time.perf_counter() - started
        done.set()

    worker = threading.Thread(target=collect)
    worker.start()
    async with StallDetector() as detector:
        await asyncio.sleep(0)
        go.set()
        while not done.is_set():  # one turn of Python work, the GIL taken from it meanwhile
            time.sleep(0)  # noqa: ASYNC251 - yields the GIL, never the loop
    worker.join()
    del heap
    return detector.stalls, took[0]


async def test_another_threads_collection_is_not_a_stall() -> None:
    """A garbage collection in another thread holds the GIL, so the loop waits it out: like the
    loop's own collections, it is the interpreter's cost, not the code's."""
    stalls, took = await asyncio.to_thread(asyncio.run, collected_elsewhere())
    assert took > 0.05, f"the collection took {took * 1000:.0f} ms: not long enough to judge"
    assert stalls == [], [str(s) for s in stalls]


async def test_a_blocked_loop_is_caught_with_its_stack() -> None:
    """A coroutine that calls `time.sleep(0.1)` is reported once, with its line in the stack."""
    stalls = await asyncio.to_thread(asyncio.run, blocked_loop())
    assert len(stalls) == 1
    (stall,) = stalls
    assert 0.05 < stall.blocked_s < 1.0
    assert "in blocking_call" in stall.stack
    assert "time.sleep(0.1)" in stall.stack
    assert "event loop blocked for" in str(stall)


async def test_idle_and_stopped_loops_are_not_stalls() -> None:
    """Sleeping in the selector, or not running at all, is never counted as blocking."""
    assert await asyncio.to_thread(asyncio.run, idle_loop()) == []
    assert await asyncio.to_thread(stopped_loop) == []


# 0.3 s: over the fixture's limit even where it is stretched for a slow CPU (at most 200 ms).
TEST_FILE = textwrap.dedent(
    """
    import asyncio
    import time


    async def blocking_call():
        time.sleep(0.3)


    async def test_blocks():
        await blocking_call()


    async def test_waits():
        await asyncio.sleep(0.1)
    """
)


async def test_the_fixture_fails_a_test_that_blocks_its_loop(tmp_path: Path) -> None:
    """Under the watchdog fixture, a test that blocks its loop fails, showing the blocking line;
    a test that only waits passes."""
    (tmp_path / "conftest.py").write_text(
        "from tests.faults.stall import loop_watchdog, pytest_runtest_call  # noqa: F401\n"
    )
    (tmp_path / "test_blocking.py").write_text(TEST_FILE)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "pytest", "-p", "pytest_asyncio.plugin", "-p", "no:cacheprovider"),
        *("-q", "-rf", str(tmp_path)),
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(scaled(30)):
        out, _ = await process.communicate()
    text = out.decode()
    assert process.returncode == 1, text
    assert "1 failed, 1 passed" in text, text
    assert "FAILED test_blocking.py::test_blocks" in text, text
    assert "event loop blocked for" in text and "time.sleep(0.3)" in text, text


# A loop that only waits, then one held by `time.sleep(0.2)`, in a process pinned to one CPU
# beside two CPU hogs and niced below them: its threads wait for the CPU for tens of ms, again
# and again. The threshold is 20 ms so that those waits, were they counted, would show.
STARVED = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    from tests.faults.stall import StallDetector

    async def ticking():
        for _ in range(50):
            await asyncio.sleep(0.01)

    async def waiting():
        async with StallDetector(threshold_s=0.02) as detector:
            await asyncio.gather(*(ticking() for _ in range(20)))
        return detector.stalls

    def hold():
        time.sleep(0.2)

    async def held():
        async with StallDetector(threshold_s=0.02) as detector:
            await asyncio.sleep(0.05)
            hold()
            await asyncio.sleep(0.05)
        return detector.stalls

    os.sched_setaffinity(0, {int(sys.argv[1])})
    os.nice(15)
    idle, busy = asyncio.run(waiting()), asyncio.run(held())
    held = [[stall.blocked_s, stall.stack] for stall in busy]
    print(json.dumps({"idle": [str(stall) for stall in idle], "held": held}))
    sys.stdout.flush()
    os._exit(0)  # an interpreter's teardown takes seconds at this priority
    """
)
HOG = "import os, sys, time\nos.sched_setaffinity(0, {int(sys.argv[1])})\n" + (
    "end = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass\n"
)


async def test_a_descheduled_loop_is_late_but_not_blocked(tmp_path: Path) -> None:
    """Starved of CPU by two hogs on its CPU, an idle loop is never reported blocked (however
    late the OS runs it: the wait in the run queue is not the loop's), while a loop held by
    `time.sleep(0.2)` still is, for the whole 200 ms, with its stack."""
    cpu = str(min(os.sched_getaffinity(0)))
    (script := tmp_path / "starved.py").write_text(STARVED)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    hogs = [await asyncio.create_subprocess_exec(sys.executable, "-c", HOG, cpu) for _ in range(2)]
    try:
        child = await asyncio.create_subprocess_exec(
            *(sys.executable, str(script), cpu), env=env, stdout=asyncio.subprocess.PIPE
        )
        async with asyncio.timeout(scaled(50)):
            out, _ = await child.communicate()
    finally:
        for hog in hogs:
            hog.kill()
            await hog.wait()
    assert child.returncode == 0
    found = json.loads(out)
    assert found["idle"] == []
    ((blocked_s, stack),) = found["held"]
    assert 0.18 < blocked_s < 1.0
    assert "in hold" in stack and "time.sleep(0.2)" in stack
