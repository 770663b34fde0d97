"""A real OTLP/HTTP trace receiver, as a bare ASGI app, and a header-recording upstream wrapper.

`OTLPReceiver` accepts `POST /v1/traces` with `content-type: application/x-protobuf` (optionally
`content-encoding: gzip`), decodes it as an `ExportTraceServiceRequest` and answers an empty
`ExportTraceServiceResponse`, as a collector does. Anything else is refused (404 for another path,
405 for another method, 415 for another content type) and counted in `refused`.

Every accepted export is kept in `exports` (its lower-cased headers and raw body, decompressed);
every span in `spans`, flattened to plain values: ids in lower-case hex, the kind and status code
without their enum prefixes (`SERVER`, `ERROR`), attributes and resource attributes as dicts.
The receiver is the ASGI app: serve it as it is.
`await receiver.wait_for(predicate)` returns once a predicate over the receiver holds;
`hold()` keeps exports waiting for their answer (a stuck collector) until `release()`.

`RecordingApp` wraps any ASGI app and keeps the lower-cased headers of each HTTP request it passes
on, so a test can see exactly what a gateway sent upstream.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.fakes.asgi import lifespan

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True, slots=True)
class ExportedSpan:
    name: str
    kind: str  # SERVER, CLIENT, INTERNAL, PRODUCER, CONSUMER, UNSPECIFIED
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # 16 hex digits, "" for a root span
    attributes: dict[str, Any]
    status: str  # UNSET, OK, ERROR
    status_message: str
    events: list[tuple[str, dict[str, Any]]]
    resource: dict[str, Any]  # the resource attributes of the batch it came in
    scope: str  # the instrumentation scope's name
    start_ns: int
    end_ns: int


@dataclass(frozen=True, slots=True)
class Export:
    headers: dict[str, str]  # lower-cased names
    body: bytes  # the protobuf, decompressed


def value(any_value: AnyValue) -> Any:
    """An OTLP AnyValue as a plain Python value."""
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return attributes(any_value.kvlist_value.values)
    return getattr(any_value, kind)


def attributes(pairs: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    pair: KeyValue
    for pair in pairs:
        found[pair.key] = value(pair.value)
    return found


def _flatten(request: ExportTraceServiceRequest) -> list[ExportedSpan]:
    spans: list[ExportedSpan] = []
    for resource_spans in request.resource_spans:
        resource = attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ExportedSpan(
                        name=span.name,
                        kind=Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        attributes=attributes(span.attributes),
                        status=Status.StatusCode.Name(span.status.code).removeprefix(
                            "STATUS_CODE_"
                        ),
                        status_message=span.status.message,
                        events=[(e.name, attributes(e.attributes)) for e in span.events],
                        resource=resource,
                        scope=scope_spans.scope.name,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                    )
                )
    return spans


@dataclass(eq=False)
class OTLPReceiver:
    """An OTLP/HTTP collector that keeps what it receives; an ASGI app itself."""

    exports: list[Export] = field(default_factory=list)
    spans: list[ExportedSpan] = field(default_factory=list)
    refused: list[tuple[str, str, int]] = field(default_factory=list)  # method, path, status
    held: int = 0  # exports waiting in `hold`
    _waiters: list[tuple[Callable[[OTLPReceiver], bool], asyncio.Future[None]]] = field(
        default_factory=list, repr=False
    )
    _gate: asyncio.Event | None = field(default=None, repr=False)

    def hold(self) -> None:
        """Keep every export waiting for its answer until `release()` (a stuck collector)."""
        self._gate = asyncio.Event()

    def release(self) -> None:
        if self._gate is not None:
            self._gate.set()
            self._gate = None

    def named(self, name: str) -> list[ExportedSpan]:
        return [span for span in self.spans if span.name == name]

    def of_kind(self, kind: str) -> list[ExportedSpan]:
        return [span for span in self.spans if span.kind == kind]

    async def wait_for(self, predicate: Callable[[OTLPReceiver], bool]) -> None:
        """Return once `predicate(receiver)` holds (at once if it already does)."""
        if predicate(self):
            return
        entry = (predicate, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        finally:
            self._waiters.remove(entry)

    def _changed(self) -> None:
        for predicate, future in self._waiters:
            if not future.done() and predicate(self):
                future.set_result(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in scope["headers"]
        }
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        status = 200
        if scope["path"] != "/v1/traces":
            status = 404
        elif scope["method"] != "POST":
            status = 405
        elif headers.get("content-type", "").split(";")[0].strip() != PROTOBUF:
            status = 415
        if status != 200:
            self.refused.append((scope["method"], scope["path"], status))
            await _reply(send, status, b"", "text/plain")
            self._changed()
            return
        gate = self._gate
        if gate is not None:
            self.held += 1
            self._changed()
            await gate.wait()
            self.held -= 1
        raw = bytes(body)
        if headers.get("content-encoding") == "gzip":
            raw = gzip.decompress(raw)
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(raw)
        except Exception:  # a body that is not the protobuf it claims to be
            self.refused.append((scope["method"], scope["path"], 400))
            await _reply(send, 400, b"", "text/plain")
            self._changed()
            return
        self.exports.append(Export(headers, raw))
        self.spans.extend(_flatten(request))
        await _reply(send, 200, ExportTraceServiceResponse().SerializeToString(), PROTOBUF)
        self._changed()


async def _reply(send: Send, status: int, body: bytes, content_type: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type.encode()),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RecordingApp:
    """Passes every request on to `app`, keeping each POST's path and headers (not the
    gateway's reads of a vLLM provider's /metrics)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self.requests: list[tuple[str, dict[str, str]]] = []  # path, lower-cased headers

    @property
    def headers(self) -> list[dict[str, str]]:
        return [headers for _, headers in self.requests]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = {
                name.decode("latin-1").lower(): value.decode("latin-1")
                for name, value in scope["headers"]
            }
            self.requests.append((scope["path"], headers))
        await self._app(scope, receive, send)
