"""The access log: one JSON line per LLM request on the `tailguard.access` logger, no bodies.

A serving process writes the lines to stdout, or to a file (`serve --access-log FILE`); on a
terminal, `serve` shows one short line per request for a person instead (`human_line`), and the
JSON goes to the file when one is given."""

from __future__ import annotations

import atexit
import logging
import queue
import sys
import threading
import time
from logging.handlers import QueueHandler
from typing import IO, Any

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
        self,
        records: queue.SimpleQueue[logging.LogRecord | str],
        other: logging.Handler,
        *,
        json_to: IO[str] | None,
        human: bool,
    ) -> None:
        super().__init__(name="tailguard-log-writer", daemon=True)
        self._records = records
        self._other = other
        self._json_to = json_to  # None: the JSON lines are not written (a terminal, no file)
        self._human = human
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
        if not lines:
            return
        if self._json_to is not None:
            _write(self._json_to, lines)
        if self._human:
            _write(sys.stdout, [human_line(orjson.loads(line)) for line in lines])


def _write(to: IO[str], lines: list[str]) -> None:
    try:
        to.write("\n".join(lines) + "\n")
        to.flush()
    except (OSError, ValueError):  # closed: nothing useful left to do
        pass


def human_line(fields: dict[str, Any]) -> str:
    """An access line for a person at a terminal: time, status, model, route, TTFT, total.

    `12:03:04 200 chat-large primary  ttft 288 ms  total 1,204 ms  sim/large`
    """
    when = time.strftime("%H:%M:%S", time.localtime(fields.get("time") or time.time()))
    model = fields.get("model") or fields.get("requested_model") or "-"
    parts = [when, str(fields.get("status", "-")), model, fields.get("route") or "-"]
    ttft = fields.get("ttft_ms")
    parts.append(" ttft " + ("-" if ttft is None else _ms(ttft)))
    parts.append(" total " + _ms(fields.get("total_ms") or 0.0))
    if fields.get("deployment"):
        parts.append(" " + fields["deployment"])
    if fields.get("error"):
        parts.append(" " + fields["error"])
    path = fields.get("path")
    if path and path != "/v1/chat/completions":
        parts.append(" " + path)
    return " ".join(parts)


def _ms(value: float) -> str:
    return f"{value:,.0f} ms" if value >= 10 else f"{value:.1f} ms"


_writer: _Writer | None = None
_direct: queue.SimpleQueue[logging.LogRecord | str] | None = None  # the writer's queue, once set up


def configure_logging(
    level: str = "info", *, access_file: str | None = None, human: bool = False
) -> None:
    """Logging for a serving process: access lines as bare JSON on stdout, or appended to
    `access_file`; the gateway's other messages at `level` on stderr. With `human` (stdout is a
    terminal), stdout gets one short line per request instead of the JSON, which goes to
    `access_file` if given and nowhere else. Records go through a queue to a writer thread, so
    a slow or blocked stdout never stalls the event loop. Call once, before the app starts."""
    global _writer, _direct
    if _writer is not None:
        _writer.stop()
    records: queue.SimpleQueue[logging.LogRecord | str] = queue.SimpleQueue()
    other = logging.StreamHandler(sys.stderr)
    other.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    json_to: IO[str] | None = None if human else sys.stdout
    if access_file is not None and access_file != "-":
        # Line-buffered: each line is one append, whole even when several workers share the file.
        json_to = open(access_file, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
    elif access_file == "-":
        json_to = sys.stdout
    _writer = _Writer(records, other, json_to=json_to, human=human and json_to is not sys.stdout)
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
