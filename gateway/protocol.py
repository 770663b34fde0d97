"""uvicorn's httptools protocol with the two limits it lacks: header size and header deadline.

uvicorn buffers a request's headers without bound and waits for them forever on a new
connection, so one client trickling bytes (slow-loris) or sending megabytes of headers holds a
connection and its memory. Here a request whose headers exceed `server.max_header_bytes` gets a
431, and one whose headers are not complete within `server.read_timeout_s` of its first byte
(or of the connection, for the first request) gets a 408; both close the connection. The body's
deadline is the app's (see `read_body` in gateway/api.py). Idle keep-alive connections are
closed by uvicorn itself after `timeout_keep_alive`.

Serve with `uvicorn.Config(..., http="gateway.protocol:GuardedHttpToolsProtocol")`; the limits
come from the running gateway's config (the lifespan state), with the defaults otherwise.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import ServerSpec
from gateway.errors import GatewayError, HeadersTooLargeError, RequestTimeoutError, render

_DEFAULTS = ServerSpec()
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _RefusedError(Exception):
    """Raised from a parser callback to stop parsing a request already answered."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        spec = _DEFAULTS
        runtime = self.app_state.get("runtime")
        if runtime is not None:
            spec = runtime.services.settings.server
        self._max_header_bytes = spec.max_header_bytes
        self._read_timeout_s = spec.read_timeout_s
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's own, except that a refusal (already answered) is not also a 400.
        if self._refused:
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._refused:
                return
            message = "Invalid HTTP request received."
            self.logger.warning(message)
            self.send_400_response(message)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def on_message_begin(self) -> None:
        super().on_message_begin()
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
        super().on_headers_complete()

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

    def _refuse(self, error: GatewayError) -> None:
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self._disarm()
        body = render(error, "openai")
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (error.status, _REASONS[error.status], len(body), body)
        )
        self.transport.close()
