"""The access log: one JSON line per LLM request on the `tailguard.access` logger, no bodies."""

from __future__ import annotations

import atexit
import logging
import queue
import sys
from logging.handlers import QueueHandler, QueueListener
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
        _log.info(orjson.dumps(fields).decode())


_listener: QueueListener | None = None


def configure_logging(level: str = "info") -> None:
    """Logging for a serving process: access lines as bare JSON on stdout; the gateway's other
    messages at `level` on stderr. Records go through a queue to a writer thread, so a slow or
    blocked stdout never stalls the event loop. Call once, before the app starts."""
    global _listener
    if _listener is not None:
        _listener.stop()
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    access = logging.StreamHandler(sys.stdout)
    access.setFormatter(logging.Formatter("%(message)s"))
    access.addFilter(lambda record: record.name == _log.name)
    other = logging.StreamHandler(sys.stderr)
    other.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    other.addFilter(lambda record: record.name != _log.name)
    _listener = QueueListener(records, access, other)
    _listener.start()
    atexit.register(_listener.stop)  # writes out what is queued
    enqueue = QueueHandler(records)
    _log.handlers[:] = [enqueue]
    _log.setLevel(logging.INFO)
    _log.propagate = False
    for name in ("tailguard", "gateway"):  # the app's logger and the modules' (`gateway.latency`)
        logger = logging.getLogger(name)
        logger.handlers[:] = [enqueue]
        logger.setLevel(level.upper())
        logger.propagate = False
