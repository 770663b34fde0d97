"""Scripts for `RawUpstream`: what a broken upstream does with one request."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Literal

from tests.faults.wire import DONE, Exchange, Script

__all__ = ["answer", "cut_body", "reset_before_headers", "silent", "stream"]

StreamEnd = Literal["done", "clean", "cut", "reset", "stall"]


def answer(
    status: int,
    body: bytes,
    *,
    content_type: str = "application/json",
    headers: Mapping[str, str] | None = None,
) -> Script:
    """Answer every request with one complete response."""

    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        await exchange.respond(status, body, content_type=content_type, headers=headers)

    return script


def reset_before_headers(*, how: Literal["reset", "close"], read_first: bool) -> Script:
    """Drop the connection before any response byte: an RST or a plain FIN, on accepting it or
    once the request was read."""

    async def script(exchange: Exchange) -> None:
        if read_first:
            await exchange.read_request()
        if how == "reset":
            exchange.reset()
        # "close": return, and the server closes the connection

    return script


def silent(*, head: Literal["none", "partial", "full"]) -> Script:
    """Read the request, send no response head, half of one, or a whole 200 SSE head, then say
    nothing until the gateway leaves."""

    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        if head == "partial":
            await exchange.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        elif head == "full":
            await exchange.start_stream()
        await exchange.until_closed()

    return script


def cut_body(status: int, body: bytes, *, declared: int) -> Script:
    """A response that declares `declared` bytes of body, sends `body`, and closes."""

    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        head = (
            f"HTTP/1.1 {status} OK\r\ncontent-type: application/json\r\n"
            f"content-length: {declared}\r\nconnection: close\r\n\r\n"
        )
        await exchange.send(head.encode() + body)

    return script


def stream(
    *events: bytes, end: StreamEnd, chunked: bool = True, hold: asyncio.Event | None = None
) -> Script:
    """A 200 SSE response carrying `events` (each sent as it is), then ending as `end` says:
    `done` sends `[DONE]` and ends properly, `clean` ends the body properly without `[DONE]`,
    `cut` closes the connection mid-body, `reset` drops it with an RST, `stall` goes silent
    until the gateway closes it. With `hold`, the events after the first wait until it is set
    (so that they cannot arrive in the same network read as the first)."""

    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        await exchange.start_stream(chunked=chunked)
        send = exchange.chunk if chunked else exchange.send
        for index, event in enumerate(events):
            if index == 1 and hold is not None:
                await hold.wait()
            await send(event)
        if end == "done":
            await send(DONE)
        if end in ("done", "clean") and chunked:
            await exchange.end_chunks()
        elif end == "reset":
            exchange.reset()
        elif end == "stall":
            await exchange.until_closed()

    return script
