"""Incremental server-sent-events framing.

Upstream bytes arrive in arbitrary network chunks; `SSEParser` cuts them into complete events and
keeps each event's exact bytes so the relay can forward them untouched. The stream must be UTF-8
(as the SSE format says): the relay forwards bytes it did not parse, so it is checked here.
"""

from __future__ import annotations

import re
from codecs import utf_8_decode

from gateway.models import SSEEvent

MAX_EVENT_BYTES = 8 * 1024 * 1024  # one event larger than this is a broken upstream, not a stream


class SSEFramingError(ValueError):
    """The upstream sent something that cannot be a server-sent event stream."""


class SSEParser:
    """Feed bytes, get complete events. CRLF and CR line endings are normalised to LF.

    Raises SSEFramingError for bytes that are not UTF-8 and for an event that grows past
    MAX_EVENT_BYTES. Work and memory are linear in what is fed: bytes that end no event are
    kept as a list of pieces, not copied into one growing buffer.
    """

    __slots__ = ("_after_cr", "_parts", "_size", "_utf8_tail")

    def __init__(self) -> None:
        self._parts: list[bytes] = []  # bytes received that end no event yet (normalised)
        self._size = 0  # their total length
        self._after_cr = False  # the last byte fed was a CR
        self._utf8_tail = b""  # a multi-byte character cut by the end of the last piece

    def feed(self, data: bytes) -> list[SSEEvent]:
        if self._after_cr and data:
            self._after_cr = False
            if data.startswith(b"\n"):
                # The LF of a CRLF split across network chunks: its CR already ended the line.
                # (Holding the CR back instead would leave a stream's last event unfinished when
                # its lines end in a lone CR.)
                data = data[1:]
        if not data:
            return []
        if self._utf8_tail or not data.isascii():
            self._check_utf8(data)
        if b"\r" in data:  # what is kept is already normalised
            self._after_cr = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        parts = self._parts
        if parts:
            if b"\n\n" not in data and not (data[:1] == b"\n" and parts[-1][-1:] == b"\n"):
                parts.append(data)  # still inside the same event: no copy, no search
                self._size += len(data)
                self._check_size()
                return []
            parts.append(data)
            buffer = b"".join(parts)
            parts.clear()
        else:
            buffer = data
        events: list[SSEEvent] = []
        start = 0
        while True:
            if buffer.startswith(b"\n\n", start):  # blank lines, which end nothing: skip them
                found = _NOT_NEWLINE.search(buffer, start)
                start = found.start() if found is not None else len(buffer)
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            frame = buffer[start : end + 2]
            start = end + 2
            event = parse_frame(frame)
            if event is not None:
                events.append(event)
        if start < len(buffer):
            rest = buffer[start:] if start else buffer
            parts.append(rest)
            self._size = len(rest)
            self._check_size()
        else:
            self._size = 0
        return events

    def _check_utf8(self, data: bytes) -> None:
        if self._utf8_tail:
            data = self._utf8_tail + data
        try:
            _, used = utf_8_decode(data, "strict", False)
        except UnicodeDecodeError as exc:
            raise SSEFramingError(f"the stream is not valid UTF-8 ({exc.reason})") from None
        self._utf8_tail = data[used:] if used < len(data) else b""

    def _check_size(self) -> None:
        if self._size > MAX_EVENT_BYTES:
            raise SSEFramingError(f"an event exceeded {MAX_EVENT_BYTES} bytes without ending")

    @property
    def pending(self) -> bytes:
        """Bytes received that do not yet form a complete event."""
        return b"".join(self._parts)


_NOT_NEWLINE = re.compile(rb"[^\n]")


def parse_frame(frame: bytes) -> SSEEvent | None:
    """Parse one frame (ending in a blank line); None for a frame of blank lines only."""
    body = frame.strip(b"\n")
    if not body:
        return None
    if body.startswith(b"data: ") and b"\n" not in body:  # the common case, kept cheap
        return SSEEvent(raw=frame, data=body[6:])
    data_lines: list[bytes] = []
    event_name: str | None = None
    for line in body.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data_lines.append(value)
        elif name == b"event":
            event_name = value.decode("utf-8", "replace")
    return SSEEvent(raw=frame, data=b"\n".join(data_lines), event=event_name)


def frame(data: bytes, event: str | None = None) -> bytes:
    """Encode one event. `data` must not contain newlines (JSON from orjson never does)."""
    if event is None:
        return b"data: " + data + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
