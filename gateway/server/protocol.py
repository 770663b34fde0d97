"""uvicorn's httptools protocol with the limits it lacks on what a client may hold open.

uvicorn buffers a request's headers without bound and waits for them forever on a new
connection, so one client trickling bytes (slow-loris) or sending megabytes of headers holds a
connection and its memory. Here a request whose headers exceed `server.max_header_bytes` gets a
431, and one whose headers are not complete within `server.read_timeout_s` of its first byte
(or of the connection, for the first request) gets a 408; both close the connection. The body's
deadline is the app's (see `read_body` in gateway/api/admit.py).

Two more holes are closed:
- An answer sent before its request's body was all received (a 401, 413 or 408, or any route
  that ignores a body) says `connection: close` and closes: the rest of that body would
  otherwise be read and dropped for as long as the client cares to send it. The close is
  staged, as after every refusal here: the answer is followed by a FIN, what the client still
  sends is dropped until it closes, goes `server.keepalive_timeout_s` without sending, or
  `server.read_timeout_s` has passed. (Closing with bytes unread sends a reset, which can
  destroy the answer before the client has read it.)
- An idle keep-alive connection is closed `server.keepalive_timeout_s` after its last response.
  uvicorn restarts that wait on every byte received; here only the start of a request stops it,
  and that request's headers then have the header deadline.
Malformed requests get uvicorn's 400, in the OpenAI shape like every other error; behind
pipelined requests, after their answers.

Pipelining is bounded: uvicorn parsed every byte it read and queued each pipelined request
(about 2.5 KB of objects for a 37-byte `GET`), resuming reads whenever an answer completed, so
one connection could queue without bound. Here at most `MAX_PIPELINED` requests wait; the rest
of what was read stays unparsed with reading paused until they are answered.

Serve with `uvicorn.Config(..., http="gateway.server.protocol:GuardedHttpToolsProtocol")`; the
limits come from the running gateway's config (the lifespan state), with the defaults otherwise.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Final

import httptools
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.config import ServerSpec
from gateway.errors import (
    GatewayError,
    HeadersTooLargeError,
    InvalidRequestError,
    RequestTimeoutError,
    answer_headers,
    render,
)

_DEFAULTS = ServerSpec()
# Pipelined requests parsed and waiting on one connection, at most: beyond, the rest of what was
# received is held unparsed (at most one read of the transport's) and reading pauses, so a flood
# fills the kernel's socket buffers, not the process's memory. Pipelining clients gain nothing
# from a deeper queue: the next requests are parsed as soon as one is answered.
MAX_PIPELINED: Final = 16
_WHOLE: Final = 8192  # a read this short with too few line feeds to fill the queue is fed whole
_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
}


def _nothing() -> None:
    pass


class _HeldFlow(FlowControl):
    """uvicorn's flow control, except that reading stays paused while pipelined requests wait
    or bytes are held unparsed: uvicorn resumes it whenever an answer completes or the request
    in flight asks for more of its body, which let a pipelining client queue without bound."""

    def __init__(self, transport: asyncio.Transport, protocol: BoundedPipelineProtocol) -> None:
        super().__init__(transport)
        self._protocol = weakref.ref(protocol)  # weakly: the protocol holds this

    def resume_reading(self) -> None:
        protocol = self._protocol()
        if protocol is None or not protocol.reading_held():
            super().resume_reading()


class _RefusedError(Exception):
    """Raised from a parser callback to stop parsing a request already answered."""


class _StagedClose(asyncio.Transport):
    """The transport as a request whose body is still arriving sees it: when uvicorn closes
    the connection after that request's answer, the close is the protocol's staged one."""

    def __init__(self, protocol: GuardedHttpToolsProtocol) -> None:
        super().__init__()
        # Weakly: the protocol holds this, and a strong link back would be a reference cycle.
        self._protocol = weakref.ref(protocol)
        self._transport = protocol.transport

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._transport.write(data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        protocol = self._protocol()
        if protocol is not None:
            protocol.close_after_answer()
        else:
            self._transport.close()


class BoundedPipelineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with at most `MAX_PIPELINED` requests parsed and waiting
    on a connection, and no reference cycle left when the connection ends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Received, not parsed from `_held_from` on: `MAX_PIPELINED` requests were waiting.
        self._held = b""
        self._held_from = 0
        self._release_handle: asyncio.Handle | None = None
        self._running: RequestResponseCycle | None = None  # the request last started

    def _stopped(self) -> bool:
        """Whether nothing more is to be parsed on this connection (it is being refused)."""
        return False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _HeldFlow(transport, self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._release_handle is not None:
            self._release_handle.cancel()
        super().connection_lost(exc)
        # Requests still queued never run: each holds the protocol (its `on_response`), which
        # holds the queue, a reference cycle that only a full collection would free.
        for cycle, _ in self.pipeline:
            cycle.on_response = _nothing
        self.pipeline.clear()
        self._drop_held()
        running, self._running = self._running, None
        if running is not None and not running.response_complete:
            # uvicorn tells only the request it parsed last, which may be a queued one.
            running.disconnected = True
            running.message_event.set()

    def _parse(self, data: bytes, start: int = 0) -> None:
        """Parse `data` in pieces so that at most `MAX_PIPELINED` requests ever wait; what is
        left once they do is held, unparsed, with reading paused, until they have been answered.

        The parser cannot be stopped within what it is given, so a piece holds at most
        2 * room - 1 line feeds: every request has at least two before its headers are complete
        (llhttp requires CRLF), so no more than `room` requests can be queued by one piece (one
        more completed by the request already under way).
        """
        end = len(data)
        try:
            if (  # the common case, as one piece would be: one request, fed as it came
                not start
                and not self.pipeline
                and end <= _WHOLE
                and data.count(b"\n") < 2 * MAX_PIPELINED
            ):
                self.parser.feed_data(data)
                return
            view = memoryview(data)
            while start < end:
                room = MAX_PIPELINED - len(self.pipeline)
                if room <= 0:
                    self._held, self._held_from = data, start
                    self.flow.pause_reading()
                    return
                stop = start
                for _ in range(2 * room - 1):
                    stop = data.find(b"\n", stop) + 1
                    if not stop:
                        stop = end
                        break
                self.parser.feed_data(view[start:stop])
                if self._stopped() or self.parser is None:
                    return
                start = stop
        except httptools.HttpParserError as exc:
            if self._stopped():
                return
            self.logger.warning("Invalid HTTP request received: %s.", exc)
            self.send_400_response(f"The request is not valid HTTP/1.1: {exc}.")
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def _release(self) -> None:
        """Parse what was held back, now that a queued request has started; read again once
        nothing is queued or held."""
        self._release_handle = None
        if self._stopped() or self.parser is None or self.transport.is_closing():
            return
        held, start = self._held, self._held_from
        self._held, self._held_from = b"", 0
        if held:
            self._parse(held, start)
        if not self.pipeline and not self._held:
            self.flow.resume_reading()

    def _drop_held(self) -> None:
        self._held, self._held_from = b"", 0

    @property
    def held_bytes(self) -> int:
        """Bytes received and held unparsed while `MAX_PIPELINED` requests wait."""
        return len(self._held) - self._held_from

    def reading_held(self) -> bool:
        """Whether reading must stay paused: requests wait, or bytes are held unparsed."""
        return bool(self.pipeline or self._held)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def _owed(self) -> bool:
        """Whether earlier requests are still to be answered (in flight or queued)."""
        running = self._running
        return bool(self.pipeline) or (
            running is not None and not running.response_complete and not running.disconnected
        )

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing() or self._stopped():
            return
        if self._held:
            # The next queued request has started: once half the queue is free, parse what was
            # held back (soon, not within the answer's `send`), several requests at a time.
            if self._release_handle is None and len(self.pipeline) <= MAX_PIPELINED // 2:
                self._release_handle = self.loop.call_soon(self._release)
        elif not self.pipeline:
            self.flow.resume_reading()  # uvicorn's came while the queue was not yet empty


class GuardedHttpToolsProtocol(BoundedPipelineProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        spec = _DEFAULTS
        runtime = self.app_state.get("runtime")
        if runtime is not None:
            spec = runtime.services.settings.server
        self._max_header_bytes = spec.max_header_bytes
        self._read_timeout_s = spec.read_timeout_s
        self.timeout_keep_alive = spec.keepalive_timeout_s  # type: ignore[assignment]
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False  # answered and closing: what arrives is dropped
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_until = 0.0
        self._in_headers = False  # a request has begun and its headers are not complete
        # The request whose body is still arriving, its keep-alive held back until it is in.
        self._body_pending: RequestResponseCycle | None = None
        self._keep_alive = False  # what that request's keep-alive will be once its body is in
        self._staged: _StagedClose = None  # type: ignore[assignment]  # set with the transport
        self._deferred: GatewayError | None = None  # a refusal waiting for earlier answers

    def _stopped(self) -> bool:
        return self._refused or self._deferred is not None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._staged = _StagedClose(self)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        self._deferred = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's own, except that what arrives after an answer that closes is dropped (and a
        # refusal is not also a 400), that the keep-alive timer is left alone (bytes that begin
        # no request must not keep an idle connection open), and that parsing stops once
        # `MAX_PIPELINED` requests wait (see `_parse`).
        if self._refused:
            self._linger()
            return
        if self._deferred is None:
            self._parse(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._unset_keepalive_if_required()  # no longer idle: the header deadline applies
        self._in_headers = True
        self._header_bytes = len(self.url)
        self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_headers = False
        previous = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not previous:
            # Whether the connection is kept depends on the body being all in before the
            # answer starts: until then an answer says `connection: close`, and its close is
            # staged. The app has not run yet (its task is only scheduled), and a request
            # without a body completes in this same parse.
            self._keep_alive = cycle.keep_alive
            cycle.keep_alive = False
            cycle.transport = self._staged
            self._body_pending = cycle

    def on_message_complete(self) -> None:
        super().on_message_complete()
        cycle = self._body_pending
        if cycle is not None:
            self._body_pending = None
            if not cycle.response_started:
                cycle.keep_alive = self._keep_alive
                cycle.transport = self.transport

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._deferred is not None and not self._owed() and not self.transport.is_closing():
            error, self._deferred = self._deferred, None
            self._refuse(error)
        if self._refused:
            self._unset_keepalive_if_required()  # the staged close has its own deadline
        elif self._in_headers and not self.transport.is_closing():
            # The next request began while this one was answered: not idle, and its header
            # deadline (suspended while a response was being sent) runs from now.
            self._unset_keepalive_if_required()
            self._arm()

    def shutdown(self) -> None:
        self._body_pending = None  # shutting down: no connection is kept any more
        super().shutdown()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request the parser rejected, in the OpenAI shape."""
        cycle = self._body_pending
        if cycle is not None and not cycle.response_complete:
            # Its body was malformed: the app must not answer as well, and an answer it has
            # begun cannot be followed by another. Queued, it never starts: the 400 is its answer.
            self._body_pending = None
            cycle.disconnected = True
            cycle.message_event.set()
            if self.pipeline and self.pipeline[0][0] is cycle:
                self.pipeline.popleft()
                cycle.on_response = _nothing
            elif cycle.response_started:
                self.transport.close()
                return
        self._refuse(InvalidRequestError(msg, code="invalid_http_request"))

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self._max_header_bytes:
            self._refuse(
                HeadersTooLargeError(
                    f"The request's headers exceed the limit of {self._max_header_bytes} bytes."
                )
            )
            raise _RefusedError

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self._read_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served: its own deadlines apply
        self._refuse(
            RequestTimeoutError(
                f"The request's headers did not arrive within {self._read_timeout_s:g} s."
            )
        )

    def reading_held(self) -> bool:
        return not self._refused and (super().reading_held() or self._deferred is not None)

    def _refuse(self, error: GatewayError) -> None:
        if self._refused or self.transport.is_closing():
            return
        if self._owed():
            # Answers to earlier pipelined requests come first: this one waits its turn, and
            # nothing more is read or parsed meanwhile.
            if self._deferred is None:
                self._deferred = error
            self._drop_held()
            self.flow.pause_reading()
            return
        body = render(error, "openai")
        hints = b"".join(
            b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in answer_headers(error).items()
        )
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"%sconnection: close\r\n\r\n%s"
            % (error.status, _REASONS[error.status], len(body), hints, body)
        )
        self.close_after_answer()

    def close_after_answer(self) -> None:
        """Close the connection without risking the answer just written: end our side, then
        drop what the client still sends until it closes, goes quiet for the keep-alive
        timeout, or the read timeout has passed (see the module's docstring)."""
        transport = self.transport
        if self._refused or transport.is_closing():
            return
        self._refused = True
        self._disarm()
        self._unset_keepalive_if_required()
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._drop_held()
        self.flow.resume_reading()
        self._linger_until = self.loop.time() + self._read_timeout_s
        self._linger()

    def _linger(self) -> None:
        """(Re)start the wait for the client's next byte, within the staged close's deadline."""
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        left = min(float(self.timeout_keep_alive), self._linger_until - self.loop.time())
        self._linger_timer = self.loop.call_later(max(left, 0.0), self.transport.close)
