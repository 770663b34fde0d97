"""Leak accounting for the fault suite: asyncio tasks, file descriptors and TCP connections.

Every server of a test runs in the test's own process, so `/proc/self/fd` and `/proc/net/tcp`
show both ends of every loopback connection: a connection *from* this process *to* port P is a
socket whose remote port is P. Counts are compared after a bounded settle loop (a close is
asynchronous), never after a fixed sleep.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

import pytest

from tests.faults.stall import StallDetector
from tests.timing import eventually

__all__ = [
    "SERVER_OWNED",
    "Link",
    "fd_count",
    "links",
    "no_leaks",
    "port_of",
    "request_tasks",
    "task_names",
]

_FD_DIR: Final = Path("/proc/self/fd")
_TCP_TABLES: Final = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_STATES: Final = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


def fd_count() -> int:
    return len(os.listdir(_FD_DIR))


@dataclass(frozen=True, slots=True)
class Link:
    """One TCP socket held by this process."""

    local_port: int
    remote_port: int
    state: str


def _read_links() -> list[Link]:
    owned = {t[8:-1] for t in _fd_targets() if t.startswith("socket:[")}
    found = []
    for table in _TCP_TABLES:
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[9] not in owned:
                continue
            local, remote = fields[1].rsplit(":", 1)[1], fields[2].rsplit(":", 1)[1]
            found.append(Link(int(local, 16), int(remote, 16), _STATES.get(fields[3], fields[3])))
    return found


async def links() -> list[Link]:
    """Every TCP socket this process holds (read off the loop: the tables can be long)."""
    return await asyncio.to_thread(_read_links)


# What servers and stores own for as long as they run (by coroutine): anything else, such as a
# request's handler, an attempt or a disconnect watcher, ends with its request.
SERVER_OWNED: Final = frozenset(
    {
        "LifespanOn.main",  # uvicorn
        "Server.serve",
        "Runtime._watch_file",  # the gateway: config watcher, latency store loops
        "_every",
        "StallDetector._beat",  # the fault suite's own servers
        "RawUpstream._handle",
        "Exchange.until_closed",
        "RedisProxy._accept",
        "RedisProxy._delayed_pump",
        "RedisProxy._delayed_pump.<locals>.deliver",
        "_pump",
    }
)


def request_tasks() -> set[asyncio.Task[object]]:
    """Running tasks that no server owns: each belongs to some request still in flight."""
    current = asyncio.current_task()
    return {
        task
        for task in asyncio.all_tasks()
        if task is not current and getattr(task.get_coro(), "__qualname__", "") not in SERVER_OWNED
    }


def task_names(tasks: set[asyncio.Task[object]]) -> str:
    return ", ".join(sorted(f"{t.get_name()} ({t.get_coro()!r})" for t in tasks))


@dataclass(slots=True)
class _Baseline:
    tasks: set[asyncio.Task[object]]
    fds: int

    def new_tasks(self) -> set[asyncio.Task[object]]:
        current = asyncio.current_task()
        return {t for t in asyncio.all_tasks() if t not in self.tasks and t is not current}


@pytest.fixture(autouse=True)
async def no_leaks(loop_watchdog: StallDetector) -> AsyncIterator[None]:
    """After the test and every other fixture are done, tasks and file descriptors are back
    where they were before it (servers, clients and upstream connections all closed)."""
    baseline = _Baseline(set(asyncio.all_tasks()), fd_count())
    yield

    def described() -> str:
        extra = baseline.new_tasks()
        return (
            f"{len(extra)} task(s) left: {task_names(extra)}; "
            f"{fd_count()} fds open, {baseline.fds} before: {sorted(_fd_targets())}"
        )

    await eventually(
        lambda: not baseline.new_tasks() and fd_count() <= baseline.fds, what=described
    )


def _fd_targets() -> list[str]:
    targets = []
    for name in os.listdir(_FD_DIR):
        try:
            targets.append(os.readlink(_FD_DIR / name))
        except OSError:  # closed while we looked
            continue
    return targets
