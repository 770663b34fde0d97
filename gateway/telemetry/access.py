"""The access log: one JSON line per LLM request on the `tailguard.access` logger, no bodies."""

from __future__ import annotations

import atexit
import logging
import queue
import sys
import threading
from logging.handlers import QueueHandler
from typing import Any

import orjson

_log = logging.getLogger("tailguard.access")


class AccessLog:
    """Writes when the `tailguard.access` logger is enabled for INFO (see `server.access_log`)."""

    def __init__(self, enabled: bool = True) -> None:
        self._on = enabled

    @property
    def enabled(self) -> bool:
        return self._on and _log.isEnabledFor(logging.INFO)

    def write(self, fields: dict[str, Any]) -> None:
        line = orjson.dumps(fields).decode()
        direct = _direct
        if direct is not None and not _log.propagate:
            # A serving process (configure_logging ran): the line goes straight to the writer
            # thread, skipping a log record's construction (about 30 us a request).
            direct.put(line)
        else:
            _log.info(line)


class _Writer(threading.Thread):
    """Writes queued log records from its own thread, in batches: it drains the queue every
    50 ms and writes the access lines in one call, so a busy gateway pays neither a blocking
    write nor a thread switch per line."""

    def __init__(
        self, records: queue.SimpleQueue[logging.LogRecord | str], other: logging.Handler
    ) -> None:
        super().__init__(name="tailguard-log-writer", daemon=True)
        self._records = records
        self._other = other
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.05):
            self._drain()
        self._drain()

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)

    def _drain(self) -> None:
        lines: list[str] = []
        while True:
            try:
                record = self._records.get_nowait()
            except queue.Empty:
                break
            if isinstance(record, str):  # an access line queued directly
                lines.append(record)
            elif record.name == _log.name:
                lines.append(record.getMessage())
            else:
                self._other.handle(record)
        if lines:
            try:
                sys.stdout.write("\n".join(lines) + "\n")
                sys.stdout.flush()
            except (OSError, ValueError):  # stdout closed: nothing useful left to do
                pass


_writer: _Writer | None = None
_direct: queue.SimpleQueue[logging.LogRecord | str] | None = None  # the writer's queue, once set up


def configure_logging(level: str = "info") -> None:
    """Logging for a serving process: access lines as bare JSON on stdout; the gateway's other
    messages at `level` on stderr. Records go through a queue to a writer thread, so a slow or
    blocked stdout never stalls the event loop. Call once, before the app starts."""
    global _writer, _direct
    if _writer is not None:
        _writer.stop()
    records: queue.SimpleQueue[logging.LogRecord | str] = queue.SimpleQueue()
    other = logging.StreamHandler(sys.stderr)
    other.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _writer = _Writer(records, other)
    _writer.start()
    atexit.register(_writer.stop)  # writes out what is queued
    enqueue = QueueHandler(records)
    _direct = records
    _log.handlers[:] = [enqueue]
    _log.setLevel(logging.INFO)
    _log.propagate = False
    for name in ("tailguard", "gateway"):  # the app's logger and the modules' (`gateway.latency`)
        logger = logging.getLogger(name)
        logger.handlers[:] = [enqueue]
        logger.setLevel(level.upper())
        logger.propagate = False
