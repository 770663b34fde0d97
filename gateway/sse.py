"""Incremental server-sent-events framing.

Upstream bytes arrive in arbitrary network chunks; `SSEParser` cuts them into complete events and
keeps each event's exact bytes so the relay can forward them untouched.
"""

from __future__ import annotations

from gateway.models import SSEEvent

MAX_EVENT_BYTES = 8 * 1024 * 1024  # one event larger than this is a broken upstream, not a stream


class SSEFramingError(ValueError):
    """The upstream sent something that cannot be a server-sent event stream."""


class SSEParser:
    """Feed bytes, get complete events. CRLF and CR line endings are normalised to LF."""

    __slots__ = ("_after_cr", "_buffer")

    def __init__(self) -> None:
        self._buffer = b""
        self._after_cr = False  # the last byte fed was a CR

    def feed(self, data: bytes) -> list[SSEEvent]:
        if self._after_cr and data:
            self._after_cr = False
            if data.startswith(b"\n"):
                # The LF of a CRLF split across network chunks: its CR already ended the line.
                # (Holding the CR back instead would leave a stream's last event unfinished when
                # its lines end in a lone CR.)
                data = data[1:]
        if b"\r" in data:  # the buffer is already normalised
            self._after_cr = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buffer = self._buffer + data if self._buffer else data
        events: list[SSEEvent] = []
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            frame = buffer[start : end + 2]
            start = end + 2
            event = parse_frame(frame)
            if event is not None:
                events.append(event)
        self._buffer = buffer[start:]
        if len(self._buffer) > MAX_EVENT_BYTES:
            raise SSEFramingError(f"an event exceeded {MAX_EVENT_BYTES} bytes without ending")
        return events

    @property
    def pending(self) -> bytes:
        """Bytes received that do not yet form a complete event."""
        return self._buffer


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
