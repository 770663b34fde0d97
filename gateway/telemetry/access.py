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


_STOP = object()  # queued by `stop`: the writer drains what came before it and ends
_BATCH_S = 0.05  # how long the writer lets lines gather after the first one


class _Writer(threading.Thread):
    """Writes queued log records from its own thread, in batches: woken by a record, it lets
    more gather for 50 ms, then drains the queue and writes the access lines in one call. A busy
    gateway pays neither a blocking write nor a thread switch per line, and an idle one is never
    woken (no timer takes the interpreter while a request waits)."""

    def __init__(
        self, records: queue.SimpleQueue[logging.LogRecord | str], other: logging.Handler
    ) -> None:
        super().__init__(name="tailguard-log-writer", daemon=True)
        self._records = records
        self._other = other
        self._done = threading.Event()

    def run(self) -> None:
        while True:
            first = self._records.get()  # blocks, holding nothing, until there is work
            stopping = first is _STOP or self._done.wait(_BATCH_S)  # let more lines gather
            self._drain(first)
            if stopping:
                return

    def stop(self) -> None:
        self._done.set()
        self._records.put(_STOP)  # type: ignore[arg-type]
        self.join(timeout=5)

    def _drain(self, first: object) -> None:
        lines: list[str] = []
        record: object = first
        while True:
            if isinstance(record, str):  # an access line queued directly
                lines.append(record)
            elif isinstance(record, logging.LogRecord) and record.name == _log.name:
                lines.append(record.getMessage())
            elif isinstance(record, logging.LogRecord):
                self._other.handle(record)
            try:
                record = self._records.get_nowait()
            except queue.Empty:
                break
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
