"""What every fake upstream does the same way: answer the lifespan protocol, read a request,
and let a test wait on what it saw."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Self

import orjson


async def lifespan(receive: Any, send: Any) -> None:
    """Complete start-up, then shutdown when the server asks."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def read_body(receive: Any) -> bytes:
    """The whole request body, however many messages it came in."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def request_of(scope: Any, receive: Any) -> tuple[bytes, dict[str, str]] | None:
    """The request's whole body and its headers (names lower-cased); None when the client left
    before sending it all."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    return b"".join(parts), headers


async def incoming(scope: Any, receive: Any, send: Any) -> tuple[bytes, dict[str, str]] | None:
    """An HTTP request's whole body and headers, as `request_of` reads them; None once the
    lifespan protocol is answered here, for any other scope, or when the client left early."""
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return None
    if scope["type"] != "http":
        return None
    return await request_of(scope, receive)


def json_or_none(raw: bytes) -> Any:
    """A request body as JSON, or None when it is not JSON (a fake records what it was sent)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


class Watched:
    """A fake whose state a test waits on: it calls `notify()` after each change, and
    `wait_for(predicate)` returns once the predicate holds (at once if it already does)."""

    def _condition(self) -> asyncio.Condition:
        # Made on first use, inside the loop the test runs (a fake may be built outside it).
        found: asyncio.Condition | None = self.__dict__.get("_watched")
        if found is None:
            found = self.__dict__["_watched"] = asyncio.Condition()
        return found

    async def wait_for(self, predicate: Callable[[Self], bool]) -> None:
        condition = self._condition()
        async with condition:
            await condition.wait_for(lambda: predicate(self))

    async def notify(self) -> None:
        condition = self._condition()
        async with condition:
            condition.notify_all()
