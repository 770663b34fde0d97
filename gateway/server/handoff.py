"""A worker process of `tailguard serve --workers N`: uvicorn fed with connections by the
supervisor (`gateway/server/workers.py`) instead of a listening socket of its own.

The worker gets one end of a Unix socketpair. Each connection the supervisor accepted arrives on
it as an SCM_RIGHTS message (one HANDOFF byte carrying the socket), and is served with uvicorn's
protocol exactly as if this process had accepted it: the same protocol factory, the same
connection set, so uvicorn's graceful shutdown closes and drains these connections as its own.
The worker writes READY once its app has started, and one CLOSED byte for every connection of
its that closes, which is what the supervisor's per-worker counts are kept from. If the
supervisor goes away (its end of the socketpair closes) the worker shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any, Final

import uvicorn
from uvicorn.config import STARTUP_FAILURE

__all__ = ["CLOSED", "HANDOFF", "READY", "STARTUP_FAILURE", "HandoffServer", "run_worker"]

log = logging.getLogger(__name__)

APP: Final = "gateway.api:create_app_from_env"
HANDOFF: Final = b"f"
READY: Final = b"r"
CLOSED: Final = b"c"
BATCH: Final = 64  # messages read per wake-up, so that a burst does not starve the loop
REPORT_RETRY_S: Final = 0.05  # the socketpair was full: report the closes a little later


def run_worker(channel: socket.socket, options: Mapping[str, Any]) -> None:
    """A worker process's entry point: serve the app (`$TAILGUARD_CONFIG`) on the connections
    that arrive on `channel`. `options` are `uvicorn.Config` keywords."""
    # A SIGHUP forwarded before the app installs its reload handler must not end the process.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    config = uvicorn.Config(APP, factory=True, **options)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C reaches the whole process group
        HandoffServer(config, channel).run()


class _Reported(set[Any]):
    """uvicorn's set of open connections, which also reports each one that leaves it."""

    __slots__ = ("_on_leave",)

    def __init__(self, on_leave: Callable[[], None]) -> None:
        super().__init__()
        self._on_leave = on_leave

    def discard(self, item: Any) -> None:
        if item in self:
            super().discard(item)
            self._on_leave()


class HandoffServer(uvicorn.Server):
    """uvicorn's server on the connections that arrive on `channel`; its connection tracking
    and graceful shutdown are uvicorn's own."""

    def __init__(self, config: uvicorn.Config, channel: socket.socket) -> None:
        super().__init__(config)
        self._channel = channel
        self._closes = 0  # not reported yet
        self._report_due = False
        self._dropping = False  # logged that connections are dropped, until one arrives
        self._opening: set[asyncio.Task[None]] = set()
        self.server_state.connections = _Reported(self._closed)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        config, state = self.config, self.server_state

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=state, app_state=self.lifespan.state, _loop=_loop
            )

        self._create_protocol = create_protocol
        self._loop = asyncio.get_running_loop()
        self.servers = []  # uvicorn's shutdown closes these; nothing listens here
        self._channel.sendall(READY)
        self._channel.setblocking(False)
        self._loop.add_reader(self._channel.fileno(), self._receive)
        self.started = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop.remove_reader(self._channel.fileno())
        await super().shutdown(sockets)

    def _receive(self) -> None:
        for _ in range(BATCH):
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._channel, BATCH, BATCH)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            if not data and not fds:
                # The supervisor is gone: nobody would hand this worker connections or stop it.
                self._loop.remove_reader(self._channel.fileno())
                self.should_exit = True
                return
            for fd in fds:
                task = self._loop.create_task(self._open(socket.socket(fileno=fd)))
                self._opening.add(task)
                task.add_done_callback(self._opening.discard)
            # A hand-off whose socket did not arrive (no descriptor free here: EMFILE) is a
            # connection the kernel has closed; it must not stay counted as open.
            lost = data.count(HANDOFF) - len(fds)
            if lost > 0 and not self._dropping:
                log.warning("no file descriptor free: handed-over connections are dropped")
            self._dropping = lost > 0
            for _ in range(lost):
                self._closed()

    async def _open(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            await self._loop.connect_accepted_socket(self._create_protocol, sock)
        except OSError:  # the client left before it was served
            sock.close()
            self._closed()

    def _closed(self) -> None:
        self._closes += 1
        if not self._report_due:
            self._report_due = True
            self._loop.call_soon(self._report)  # the closes of one loop pass in one write

    def _report(self) -> None:
        self._report_due = False
        try:
            sent = self._channel.send(CLOSED * self._closes)
        except BlockingIOError:
            sent = 0
        except OSError:  # the supervisor is gone: nobody to tell
            sent = self._closes
        self._closes -= sent
        if self._closes:
            self._report_due = True
            self._loop.call_later(REPORT_RETRY_S, self._report)
