"""The bytes of a committed answer, written to the client as routing hands them over.

`Committed` (gateway/routing/committed.py) does every per-event job; this writes what it gives
and notes what went out, so that a failure of the gateway itself knows whether it may still
answer with a status or must end the stream with an error event.
"""

from __future__ import annotations

from contextlib import aclosing

from starlette.types import Send

from gateway.routing.committed import Committed


class Sent:
    """What went out to the client so far."""

    __slots__ = ("responded", "started")

    def __init__(self) -> None:
        self.started = False  # the status line went out: errors must now be in-band
        self.responded = False  # the last byte went out: a disconnect now is just the end


async def send_whole(
    send: Send, headers: list[tuple[bytes, bytes]], body: bytes, sent: Sent
) -> None:
    """A whole answer: the head with its length, then the body."""
    headers.append((b"content-length", str(len(body)).encode()))
    sent.started = True
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    sent.responded = True


async def send_stream(
    send: Send, headers: list[tuple[bytes, bytes]], committed: Committed, sent: Sent
) -> None:
    """A stream: the head, then each block as the committed attempt yields it, the last one
    (an error event when the stream was cut) closing the response."""
    headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
    sent.started = True
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    async with aclosing(committed.events()) as blocks:
        async for data, more in blocks:
            await send({"type": "http.response.body", "body": data, "more_body": more})
            if not more:
                sent.responded = True
