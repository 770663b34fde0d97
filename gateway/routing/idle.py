"""The stream idle timeout after commit: a stream with no content progress for `idle_s` ends.

The relay reads the upstream once per network read. A timer per read would cost the relay more
than the rest of its bookkeeping for that read, so one timer runs per idle period instead, and
rearms itself for as long as content keeps coming.
"""

from __future__ import annotations

import asyncio

__all__ = ["IdleWatch"]


class IdleWatch:
    """Cancels the current task's upstream read once the reads since the last content token
    have waited `idle_s` in all.

    Call `reading()` before each read and `read()` right after it returns (before anything else
    is awaited), `progressed()` once a read brought content, and `close()` at the end. A read
    that raises CancelledError was ended by this watch when `expired()` says so. Only time spent
    waiting on the upstream counts: a client slow to take what was sent holds the relay in its
    send, which says nothing about the upstream.
    """

    __slots__ = (
        "_cancelling",
        "_fired",
        "_handle",
        "_idle_s",
        "_loop",
        "_since",
        "_task",
        "_waited",
    )

    def __init__(self, idle_s: float) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()  # cancellations asked for before: not ours
        self._loop = asyncio.get_running_loop()
        self._idle_s = idle_s
        self._waited = 0.0  # seconds spent in reads since the last content, the current one aside
        self._since: float | None = None  # when the read under way began
        self._handle: asyncio.TimerHandle | None = None
        self._fired = False

    def reading(self) -> None:
        now = self._loop.time()
        self._since = now
        if self._handle is None:
            self._handle = self._loop.call_at(now + self._idle_s - self._waited, self._check)

    def read(self) -> None:
        since, self._since = self._since, None
        if since is not None:
            self._waited += self._loop.time() - since

    def progressed(self) -> None:
        self._waited = 0.0

    def expired(self) -> bool:
        """Whether this watch ended the read that raised CancelledError (and nobody else asked
        for a cancellation too); if so, the cancellation is consumed."""
        if not self._fired:
            return False
        self._fired = False
        return self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        self._handle = None
        since = self._since
        if since is None:
            return  # between reads: the next read rearms the timer
        now = self._loop.time()
        left = self._idle_s - self._waited - (now - since)
        if left > 0:
            self._handle = self._loop.call_at(now + left, self._check)
            return
        self._fired = True
        self._task.cancel()  # only ever during a read: the CancelledError surfaces from it
