"""The simulator as a standalone HTTP server: a bare ASGI application around `SimEngine`.

No framework: one request costs a dict lookup, the engine call and the `send`s. While a request
runs, a watcher listens for `http.disconnect`, so a client that leaves cancels its request (the
engine frees the batch slot and counts it as cancelled) even in the middle of a stall.

Dropped connections need the transport, which ASGI does not expose: under uvicorn `send` is a
method of the request cycle that holds it. A reset before headers then closes the socket with
SO_LINGER 0 (the client reads ECONNRESET); a cut stream closes it after the bytes already sent
(the client sees the chunked body end early). Under a server without that attribute the app
raises instead, which closes a started response but turns a reset before headers into a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Final

from pydantic import ValidationError

from gateway.sim.engine import SimEngine
from gateway.sim.profile import SimProfile
from gateway.sim.wire import SimConnectionReset, SimReply

__all__ = ["ASGIApp", "SimConfigError", "create_sim_app", "load_profiles", "run_sim"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_LINGER_RESET: Final = struct.pack("ii", 1, 0)  # close() then sends RST instead of FIN
_END: Final = {"type": "http.response.body", "body": b"", "more_body": False}
_GRACEFUL_SHUTDOWN_S: Final = 2  # a stalled stream must not hold a shutdown for an hour


class SimConfigError(ValueError):
    """A profile file that cannot be used; the message names the file and the key."""


def create_sim_app(engine: SimEngine) -> ASGIApp:
    """An ASGI 3 application serving `engine` (HTTP and lifespan; nothing else)."""
    handle = engine.handle

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await _http(handle, scope, receive, send)
        elif kind == "lifespan":
            await _lifespan(receive, send)
        # Anything else (websocket) is refused by returning without accepting it.

    return app


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _http(
    handle: Callable[[str, str, bytes], Awaitable[SimReply]],
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    method: str = scope["method"]
    if method != "POST":  # nothing else has a body or takes time
        await _send_whole(send, await handle(method, scope["path"], b""))
        return
    message = await receive()
    body: bytes = message.get("body", b"")
    if message.get("more_body"):
        parts = bytearray(body)
        while message.get("more_body"):
            message = await receive()
            parts += message.get("body", b"")
        body = bytes(parts)
    if message["type"] == "http.disconnect":
        return

    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        left = True
        task.cancel()  # the client is gone: stop whatever the request is waiting on

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        try:
            reply = await handle(method, scope["path"], body)
        except SimConnectionReset:
            watcher.cancel()
            await _drop(send, receive, reset=True)
            return
        stream = reply.stream
        if stream is None:
            watcher.cancel()
            await _send_whole(send, reply)
            return
        await send(
            {"type": "http.response.start", "status": reply.status, "headers": _raw(reply.headers)}
        )
        cut = False
        try:
            async for frame in stream:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        except SimConnectionReset:
            cut = True
        finally:
            await stream.aclose()  # frees the batch slot now, whatever ended the loop
        watcher.cancel()
        if cut:
            await _drop(send, receive, reset=False)
        else:
            await send(_END)
    except asyncio.CancelledError:
        watcher.cancel()
        if task.uncancel() > 0:  # cancelled more than once: let it through
            raise
        if not left:
            # The server cancelled us (its shutdown grace period is over): drop the connection
            # as a dying server would, instead of ending in an error log.
            await _drop(send, receive, reset=False)
    finally:
        watcher.cancel()


def _raw(headers: Mapping[str, str], length: int | None = None) -> list[tuple[bytes, bytes]]:
    raw = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
    if length is not None:
        raw.append((b"content-length", str(length).encode()))
    return raw


async def _send_whole(send: Send, reply: SimReply) -> None:
    body = reply.body or b""
    await send(
        {
            "type": "http.response.start",
            "status": reply.status,
            "headers": _raw(reply.headers, len(body)),
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _drop(send: Send, receive: Receive, *, reset: bool) -> None:
    """Close the connection without finishing the response: a reset, or a cut after data."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None or not hasattr(transport, "abort"):
        raise SimConnectionReset("simulated connection drop")  # the server closes it for us
    if reset:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        transport.abort()
    else:
        transport.close()  # sends what was already written, then FIN: the body stays incomplete
    # Wait until the server has seen the connection go, so it neither logs nor answers a 500.
    while (await receive())["type"] != "http.disconnect":
        pass


def run_sim(host: str, port: int, engine: SimEngine, *, log_level: str = "warning") -> None:
    """Serve `engine` on host:port until interrupted."""
    import uvicorn  # only the standalone server needs it

    uvicorn.run(
        create_sim_app(engine),
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level=log_level,
        server_header=False,
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
    )


def load_profiles(path: str) -> tuple[dict[str, SimProfile], SimProfile, int | None]:
    """Read `{seed: 7, default: {...}, profiles: {name: {...}}}`: (profiles, default, seed)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as file:
            data = yaml.safe_load(file)
    except (OSError, yaml.YAMLError) as exc:
        raise SimConfigError(f"{path}: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SimConfigError(f"{path}: the top level must be a mapping")
    for key in data:
        if key not in ("seed", "default", "profiles"):
            raise SimConfigError(f"{path}: unknown key {key!r} (expected seed, default, profiles)")
    seed = data.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise SimConfigError(f"{path}: seed: must be an integer")
    default = _profile(path, "default", data.get("default") or {})
    raw_profiles = data.get("profiles") or {}
    if not isinstance(raw_profiles, dict):
        raise SimConfigError(f"{path}: profiles: must be a mapping of name to profile")
    profiles = {
        str(name): _profile(path, f"profiles.{name}", raw or {})
        for name, raw in raw_profiles.items()
    }
    return profiles, default, seed


def _profile(path: str, where: str, raw: object) -> SimProfile:
    if not isinstance(raw, dict):
        raise SimConfigError(f"{path}: {where}: must be a mapping")
    try:
        return SimProfile.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{where}.{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"
            for error in exc.errors()
        )
        raise SimConfigError(f"{path}: {problems}") from None
