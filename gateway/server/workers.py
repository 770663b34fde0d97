"""Several worker processes behind one listening socket, with the connections dealt out evenly.

`tailguard serve --workers N` runs this supervisor (the `tailguard serve` process) and N
workers, each a spawned process running `create_app_from_env` under uvicorn
(`gateway/server/handoff.py`). The supervisor alone listens and accepts. It hands each accepted
connection to the worker with the fewest open connections (ties in turn) as an SCM_RIGHTS
message on that worker's Unix socketpair and closes its own copy; the worker reports each of
its connections that closes, which keeps the counts true. Counts rather than plain turns:
keep-alive pools open and close connections unevenly, and a worker left holding the long-lived
ones would carry more of the load.

Why not every worker accepting from the shared socket (uvicorn's own supervisor): the one that
wakes first accepts a whole burst, and with keep-alive clients that skew lasts as long as their
pools do. Why not SO_REUSEPORT: the kernel hashes each connection to a listener, so a few dozen
long-lived connections split like coin flips.

Signals to the supervisor: SIGTERM or SIGINT closes the listening socket at once and sends
SIGTERM to every worker, which shuts down as a single process does (streams get
`server.shutdown_grace_s`); a worker still running after that and a margin is killed, and the
supervisor exits 0. SIGHUP is forwarded to every worker, and each reloads its config in place
(uvicorn's supervisor replaced its workers instead). A worker that dies is replaced; one that
cannot start (uvicorn's startup failure, or an error before it was ready) stops the supervisor
with exit status 3.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import selectors
import signal
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from multiprocessing.process import BaseProcess
from typing import Any, Final

from gateway.server.handoff import CLOSED, HANDOFF, READY, STARTUP_FAILURE, run_worker

__all__ = ["Supervisor", "listen", "serve_workers"]

log = logging.getLogger(__name__)

BACKLOG: Final = 2048  # uvicorn's default
STOP_MARGIN_S: Final = 5.0  # past shutdown_grace_s: a worker's lifespan shutdown (final flushes)
ACCEPT_PAUSE_S: Final = 0.5  # after an accept error such as EMFILE, before trying again
ACCEPT_BATCH: Final = 64  # connections accepted per wake-up, so that signals are not starved
CAUGHT: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def serve_workers(
    count: int,
    options: Mapping[str, Any],
    *,
    grace_s: float,
    listener: socket.socket | None = None,
) -> int:
    """Serve on `options["host"]:options["port"]` with `count` workers until SIGTERM or SIGINT;
    returns the exit status. `options` are `uvicorn.Config` keywords, given to every worker.
    `listener`: the socket, already bound with `listen` (else it is bound here)."""
    return Supervisor(count, options, grace_s=grace_s, listener=listener).run()


def listen(host: str, port: int) -> socket.socket:
    """A non-blocking listening TCP socket, bound as uvicorn binds one. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(slots=True, eq=False)
class _Worker:
    process: BaseProcess
    channel: socket.socket  # the supervisor's end of the socketpair
    ready: bool = False  # takes connections (false again once a send to it has failed)
    served: bool = False  # was ready once: its exit is a death, not a failed start
    open: int = 0  # connections handed over and not yet reported closed
    reload_due: bool = False  # a SIGHUP came before it was ready

    @property
    def pid(self) -> int:
        assert self.process.pid is not None  # started in `Supervisor._start_worker`
        return self.process.pid

    def signal(self, signum: int) -> None:
        if self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # exited: its sentinel reports it
                os.kill(self.pid, signum)


class Supervisor:
    """Owns the listening socket and the workers; see the module docstring."""

    def __init__(
        self,
        count: int,
        options: Mapping[str, Any],
        *,
        grace_s: float,
        listener: socket.socket | None = None,
    ) -> None:
        self.count = count
        self.options = dict(options)
        self.grace_s = grace_s
        self.workers: list[_Worker] = []
        self.status: int | None = None  # once set, the loop ends and the process exits with it
        self._selector = selectors.DefaultSelector()
        self._spawn = multiprocessing.get_context("spawn")
        self._listener: socket.socket | None = listener
        self._listening = False
        self._paused_until: float | None = None
        self._failing: set[str] = set()  # what was logged as failing, until it works again
        self._turn = 0
        self._announced = False

    @property
    def address(self) -> str:
        host, port = self.options["host"], self.options["port"]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def run(self) -> int:
        if self._listener is None:
            try:
                self._listener = listen(self.options["host"], self.options["port"])
            except OSError as exc:
                log.error("cannot listen on %s: %s", self.address, exc)
                return STARTUP_FAILURE
        # Signals arrive as bytes on the wake-up socket, read in the loop like everything else.
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        self._selector.register(wake_r, selectors.EVENT_READ, partial(self._on_signals, wake_r))
        signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        previous = {signum: signal.signal(signum, _noted) for signum in CAUGHT}
        try:
            for _ in range(self.count):
                self._start_worker()
            while self.status is None:
                self._step()
        finally:
            self._close_listener()
            self._stop_workers()
            signal.set_wakeup_fd(-1)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._selector.close()
            wake_r.close()
            wake_w.close()
        return self.status

    def _step(self) -> None:
        timeout = None
        if self._paused_until is not None:
            timeout = self._paused_until - time.monotonic()
            if timeout <= 0:
                self._paused_until, timeout = None, None
                self._sync_listening()
        events = self._selector.select(timeout)
        # Closes first, so that the connections accepted in this pass see fresh counts.
        events.sort(key=lambda event: event[0].fileobj is self._listener)
        for key, _ in events:
            if self.status is not None:
                return
            if self._selector.get_map().get(key.fd) is key:  # not dropped by an earlier callback
                key.data()

    def _start_worker(self) -> _Worker:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        process = self._spawn.Process(
            target=run_worker, args=(theirs, self.options), name="tailguard-worker"
        )
        try:
            process.start()  # `theirs` travels to the child by fd, as uvicorn's sockets do
        finally:
            theirs.close()
        mine.setblocking(False)
        worker = _Worker(process, mine)
        self.workers.append(worker)
        self._selector.register(mine, selectors.EVENT_READ, partial(self._on_message, worker))
        sentinel = process.sentinel
        self._selector.register(sentinel, selectors.EVENT_READ, partial(self._on_exit, worker))
        return worker

    def _sync_listening(self) -> None:
        """Accept only while some worker can take a connection; until then clients wait in the
        backlog."""
        listener = self._listener
        if listener is None:  # closed: `_close_listener` has unregistered it
            return
        want = self._paused_until is None and any(w.ready for w in self.workers)
        if want and not self._listening:
            self._selector.register(listener, selectors.EVENT_READ, self._accept)
        elif self._listening and not want:
            self._selector.unregister(listener)
        self._listening = want

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while queued
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: the rest stay queued meanwhile
                self._warn_once(
                    "accept", "accept failed (%s): retried every %.1f s", exc, ACCEPT_PAUSE_S
                )
                self._paused_until = time.monotonic() + ACCEPT_PAUSE_S
                self._sync_listening()
                return
            self._failing.discard("accept")
            self._hand_off(conn)

    def _hand_off(self, conn: socket.socket) -> None:
        with conn:  # the supervisor's copy is closed whether or not a worker took it
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for worker in self._by_load():
                try:
                    socket.send_fds(worker.channel, [HANDOFF], [conn.fileno()])
                except BlockingIOError:
                    continue  # it is not keeping up: its queue of connections is full
                except OSError:
                    worker.ready = False  # gone (EPIPE): its sentinel reports the exit
                    self._sync_listening()
                    continue
                worker.open += 1
                self._failing.discard("hand-off")
                return
            self._warn_once("hand-off", "no worker could take a connection: closed it")

    def _by_load(self) -> list[_Worker]:
        """The ready workers, fewest open connections first, ties in turn."""
        ready = [w for w in self.workers if w.ready]
        if not ready:
            return []
        self._turn = (self._turn + 1) % len(ready)
        turned = ready[self._turn :] + ready[: self._turn]
        return sorted(turned, key=lambda w: w.open)  # stable: the turn breaks ties

    def _on_message(self, worker: _Worker) -> None:
        try:
            data = worker.channel.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the worker is gone; its sentinel reports the exit
            self._selector.unregister(worker.channel)
            worker.ready = False
            self._sync_listening()
            return
        worker.open = max(0, worker.open - data.count(CLOSED))
        if READY in data and not worker.served:
            worker.ready = worker.served = True
            if worker.reload_due:
                worker.reload_due = False
                worker.signal(signal.SIGHUP)
            self._sync_listening()
            if not self._announced and all(w.served for w in self.workers):
                self._announced = True
                pids = ", ".join(str(w.pid) for w in self.workers)
                log.info("%d workers (pids %s) on %s", len(self.workers), pids, self.address)

    def _on_exit(self, worker: _Worker) -> None:
        worker.process.join()
        code = worker.process.exitcode
        for fileobj in (worker.channel, worker.process.sentinel):
            if fileobj in self._selector.get_map():  # the channel may be dropped already
                self._selector.unregister(fileobj)
        worker.channel.close()
        self.workers.remove(worker)
        self._sync_listening()
        # uvicorn's STARTUP_FAILURE, or an exception from the app factory: every replacement
        # would fail the same way. A signal (a kill, the OOM killer) is no such verdict.
        if code == STARTUP_FAILURE or (not worker.served and code is not None and code > 0):
            log.error(
                "worker %d exited (%s) before it was ready: the app cannot start, stopping",
                worker.pid,
                _describe(code),
            )
            self.status = STARTUP_FAILURE
            return
        replacement = self._start_worker()
        log.warning(
            "worker %d died (%s): its connections are lost; replaced by worker %d",
            worker.pid,
            _describe(code),
            replacement.pid,
        )

    def _on_signals(self, wake: socket.socket) -> None:
        try:
            data = wake.recv(64)
        except BlockingIOError:
            return
        for signum in data:
            if signum in (signal.SIGTERM, signal.SIGINT) and self.status is None:
                log.info("%s: stopping the workers", signal.Signals(signum).name)
                self._close_listener()  # refuse new connections now, not once workers are done
                self.status = 0
            elif signum == signal.SIGHUP:
                log.info("SIGHUP: every worker reloads its config")
                for worker in self.workers:
                    if worker.served:
                        worker.signal(signal.SIGHUP)
                    else:  # it may have read the file before the change
                        worker.reload_due = True

    def _close_listener(self) -> None:
        if self._listener is not None:
            if self._listening:
                self._selector.unregister(self._listener)
                self._listening = False
            self._listener.close()
            self._listener = None

    def _stop_workers(self) -> None:
        """SIGTERM to every worker, then wait for their graceful shutdown; kill the late."""
        for worker in self.workers:
            worker.signal(signal.SIGTERM)
        within_s = self.grace_s + STOP_MARGIN_S
        deadline = time.monotonic() + within_s
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        for worker in self.workers:
            if worker.process.exitcode is None:
                log.warning("worker %d still running after %.0f s: killed", worker.pid, within_s)
                worker.process.kill()
                worker.process.join()
            worker.channel.close()
        self.workers.clear()

    def _warn_once(self, what: str, message: str, *args: object) -> None:
        """Log a failure the first time only, until `what` works again: no log flood."""
        if what not in self._failing:
            self._failing.add(what)
            log.warning(message, *args)


def _noted(signum: int, frame: object) -> None:
    """The Python-level handler: the signal itself is read from the wake-up socket."""


def _describe(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
