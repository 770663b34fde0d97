"""Misbehaving servers at the TCP level: a scripted raw HTTP upstream and a faulty Redis proxy.

`RawUpstream` runs a script per accepted connection; the script reads the request and writes
whatever bytes it likes (a reset, a truncated stream, an HTML page, silence), and can wait for
the gateway to close the connection, which the server records: that is how a test sees that
the upstream observed a disconnect. Every response says `connection: close`, so one connection
is one exchange.

`RedisProxy` forwards to a real redis-server, adding latency to every reply (a delay line: each
chunk is delivered `delay_s` after it arrived, in order) or dropping connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Final, Self

import orjson

from tests.timing import scaled

__all__ = [
    "DONE",
    "Exchange",
    "RawUpstream",
    "RedisProxy",
    "Script",
    "sse_finish",
    "sse_token",
]

_LINGER_RESET: Final = struct.pack("ii", 1, 0)  # close() then sends RST instead of FIN
DONE: Final = b"data: [DONE]\n\n"


def sse_token(text: str) -> bytes:
    """One OpenAI chat-completion chunk carrying `text`, as an SSE event."""
    chunk = {
        "id": "chatcmpl-raw",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "raw",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def sse_finish() -> bytes:
    chunk = {
        "id": "chatcmpl-raw",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "raw",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


class _Watchers:
    """Await a predicate over some counters instead of sleeping (as `SimStats.wait_for`)."""

    def __init__(self) -> None:
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []

    def changed(self) -> None:
        for predicate, future in self._waiters:
            if not future.done() and predicate():
                future.set_result(None)

    async def wait_for(self, predicate: Callable[[], bool], *, within_s: float = 5.0) -> None:
        if predicate():
            return
        entry = (predicate, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(scaled(within_s)):
                await entry[1]
        finally:
            self._waiters.remove(entry)


class Exchange:
    """One connection to a `RawUpstream`, as its script sees it."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: RawUpstream
    ) -> None:
        self.reader = reader
        self.writer = writer
        self._server = server
        self.head = b""
        self.body = b""

    async def read_request(self) -> bytes:
        """Read one request; return its body."""
        self.head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in self.head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        self.body = await self.reader.readexactly(length)
        self._server.requests += 1
        self._server.events.changed()
        return self.body

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def respond(
        self,
        status: int,
        body: bytes,
        *,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """A complete response with a content-length."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (
            f"HTTP/1.1 {status} {_reason(status)}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
        )
        await self.send(head.encode() + body)

    async def start_stream(self, *, chunked: bool = True) -> None:
        """The head of a 200 SSE response: chunked, or delimited by the connection's close."""
        framing = "transfer-encoding: chunked\r\n" if chunked else ""
        head = (
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            f"cache-control: no-cache\r\n{framing}connection: close\r\n\r\n"
        )
        await self.send(head.encode())

    async def chunk(self, data: bytes) -> None:
        """One piece of a chunked body."""
        await self.send(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    async def end_chunks(self) -> None:
        await self.send(b"0\r\n\r\n")

    async def until_closed(self) -> None:
        """Wait for the gateway to close its end (FIN or RST), and record that it did."""
        with contextlib.suppress(ConnectionError):
            while await self.reader.read(65536):
                pass
        self._server.peer_closes += 1
        self._server.events.changed()

    def reset(self) -> None:
        """Drop the connection with an RST (the gateway reads ECONNRESET)."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        self.writer.transport.abort()


Script = Callable[[Exchange], Awaitable[None]]


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Site Overloaded" if status == 529 else "Unknown"


class _LoopbackServer:
    """A TCP server on a free loopback port that tracks its connections, so that leaving the
    `async with` ends every handler, and a test can wait for a state of the server."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[object]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.events = _Watchers()
        self.accepted = 0  # connections accepted
        self.open = 0  # connections open now
        self.port = 0
        self.url = ""

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._connected, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = self._url(self.port)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        await _finish(self._handlers, self._writers)
        await self._server.wait_closed()

    async def wait_for(self, predicate: Callable[[Self], bool], within_s: float = 5) -> None:
        await self.events.wait_for(lambda: predicate(self), within_s=within_s)

    def stop_listening(self) -> None:
        """Close the port: new connections are refused (ECONNREFUSED) until `listen_again`."""
        assert self._server is not None
        self._server.close()

    async def listen_again(self) -> None:
        """Accept connections again, on the same port."""
        assert self._server is not None
        await self._server.wait_closed()
        self._server = await asyncio.start_server(self._connected, "127.0.0.1", self.port)

    def _url(self, port: int) -> str:
        raise NotImplementedError

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(writer)
        self.accepted += 1
        self.open += 1
        try:
            await self._serve(reader, writer)
        finally:
            self.open -= 1
            self._handlers.discard(task)
            self._writers.discard(writer)
            self.events.changed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class RawUpstream(_LoopbackServer):
    """A bare HTTP/1.1 server on loopback whose every connection runs `script`."""

    def __init__(self, script: Script) -> None:
        super().__init__()
        self._script = script
        self.requests = 0  # requests read
        self.peer_closes = 0  # closes by the gateway that a script waited for
        self.base_url = ""

    def _url(self, port: int) -> str:
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.events.changed()
        try:
            await self._script(Exchange(reader, writer, self))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the gateway went away mid-script: that is its right
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


class RedisProxy(_LoopbackServer):
    """A TCP proxy in front of a real redis-server, on loopback; both knobs can change any time.

    `delay_s` holds every reply chunk that long after it arrived (a delay line: replies stay in
    order and a burst is not slowed further). While flapping, connections alternate: every
    other one is reset as soon as it is accepted, and the others are cut after `flap_after_s`.
    """

    def __init__(
        self, target_port: int, *, delay_s: float = 0.0, flap_after_s: float = 0.2
    ) -> None:
        super().__init__()
        self._target = target_port
        self.delay_s = delay_s
        self.flap = False
        self.flap_after_s = flap_after_s
        self.max_open = 0
        self.dropped = 0  # connections the proxy reset or cut
        self.holding = 0  # reply chunks being delayed right now
        self.delayed = 0  # reply chunks delayed so far

    def _url(self, port: int) -> str:
        return f"redis://127.0.0.1:{port}/0"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.max_open = max(self.max_open, self.open)
        self.events.changed()
        upstream: asyncio.StreamWriter | None = None
        cut: asyncio.TimerHandle | None = None
        try:
            if self.flap and self.accepted % 2 == 0:
                self.dropped += 1
                _reset(writer)
                return
            up_reader, upstream = await asyncio.open_connection("127.0.0.1", self._target)
            self._writers.add(upstream)
            if self.flap:
                cut = asyncio.get_running_loop().call_later(self.flap_after_s, self._cut, writer)
            pumps = [
                asyncio.create_task(_pump(reader, upstream)),
                asyncio.create_task(self._delayed_pump(up_reader, writer)),
            ]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except OSError:  # ConnectionError included: either end went away
            pass
        finally:
            if cut is not None:
                cut.cancel()
            for end in (writer, upstream):
                if end is not None:
                    end.transport.abort()
                    self._writers.discard(end)

    def start_flapping(self) -> None:
        """Flap from now on, starting by dropping every connection open now."""
        self.flap = True
        for writer in list(self._writers):
            if writer.get_extra_info("peername")[1] != self._target:  # a client's, not Redis's
                self._cut(writer)

    def _cut(self, writer: asyncio.StreamWriter) -> None:
        self.dropped += 1
        _reset(writer)

    async def _delayed_pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Redis to client, each chunk `delay_s` (as it was when the chunk arrived) late."""
        loop = asyncio.get_running_loop()
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        held = 0  # chunks of this connection read and not yet delivered

        async def deliver() -> None:
            nonlocal held
            while True:
                due, data = await line.get()
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                held -= 1
                self.holding -= 1
                writer.write(data)
                await writer.drain()
                self.events.changed()

        delivery = asyncio.create_task(deliver())
        try:
            while data := await reader.read(65536):
                held += 1
                self.holding += 1
                self.delayed += 1 if self.delay_s else 0
                self.events.changed()
                line.put_nowait((loop.time() + self.delay_s, data))
        finally:
            delivery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await delivery
            self.holding -= held


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


async def _finish(handlers: set[asyncio.Task[object]], writers: set[asyncio.StreamWriter]) -> None:
    """End every connection's handler by dropping its connections (a cancelled handler task
    would make asyncio's stream machinery log an error), then wait for them."""
    for writer in list(writers):
        writer.transport.abort()
    if handlers:
        _, stuck = await asyncio.wait(set(handlers), timeout=scaled(2))
        for task in stuck:  # a script that ignores its closed connection
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    writer.transport.abort()
