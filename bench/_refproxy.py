"""The floor for the overhead benchmark: the least a Python proxy can do per request.

A bare ASGI app under the same uvicorn settings as the gateway (uvloop, httptools, one worker)
that forwards each POST to the upstream with one shared `aiohttp.ClientSession` and relays the
answer (streams chunk by chunk). No routing, validation, statistics or headers of its own.

    python bench/_refproxy.py PORT UPSTREAM_BASE_URL
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp
import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def make_app(upstream: str) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    base = upstream.rstrip("/")
    sessions: list[aiohttp.ClientSession] = []

    async def lifespan(receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                connector = aiohttp.TCPConnector(limit=1000)
                sessions.append(aiohttp.ClientSession(connector=connector, auto_decompress=False))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for session in sessions:
                    await session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"].removeprefix("/v1")
        headers = {"content-type": "application/json"}
        async with sessions[0].post(base + path, data=body, headers=headers) as upstream_response:
            kind = upstream_response.headers.get("content-type", "application/json").encode()
            start = {"type": "http.response.start", "status": upstream_response.status}
            if kind.startswith(b"text/event-stream"):
                await send({**start, "headers": [(b"content-type", kind)]})
                async for data in upstream_response.content.iter_any():
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                return
            data = await upstream_response.read()
            length = str(len(data)).encode()
            await send({**start, "headers": [(b"content-type", kind), (b"content-length", length)]})
            await send({"type": "http.response.body", "body": data})

    return app


def main() -> None:
    port, upstream = int(sys.argv[1]), sys.argv[2]
    uvicorn.run(
        make_app(upstream),
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
