"""A minimal OTLP/HTTP trace collector for the benchmarks: it accepts, counts and discards.

`POST /v1/traces` (protobuf, optionally gzip) is decoded only to count its spans and answered
with an empty `ExportTraceServiceResponse`, as a collector does; `GET /stats` returns
`{"exports", "spans", "bytes"}` so a run can check that traces really left the gateway. It runs
in a process of its own, so the gateway pays for exporting and nothing for collecting.

    python bench/_otlp_sink.py PORT
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_EMPTY_RESPONSE = ExportTraceServiceResponse().SerializeToString()


def make_app() -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    stats = {"exports": 0, "spans": 0, "bytes": 0, "refused": 0}

    async def answer(send: Send, status: int, body: bytes, kind: bytes) -> None:
        headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] == "GET":
            body = json.dumps(stats).encode() if scope["path"] == "/stats" else b"ok"
            await answer(send, 200, body, b"application/json")
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        data = b"".join(chunks)
        headers = dict(scope["headers"])
        try:
            if headers.get(b"content-encoding") == b"gzip":
                data = gzip.decompress(data)
            request = ExportTraceServiceRequest.FromString(data)
        except Exception:  # anything undecodable is a refused export, counted
            stats["refused"] += 1
            await answer(send, 400, b"", b"text/plain")
            return
        stats["exports"] += 1
        stats["bytes"] += len(data)
        stats["spans"] += sum(
            len(scope_spans.spans)
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
        )
        await answer(send, 200, _EMPTY_RESPONSE, b"application/x-protobuf")

    return app


def main() -> None:
    uvicorn.run(
        make_app(),
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
