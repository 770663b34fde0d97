"""Pipelined HTTP/1.1 requests: what one connection may make the gateway hold, and what the
request path leaves for the garbage collector.

The properties:
- However many requests a client pipelines, and however slowly it reads the answers, at most
  `MAX_PIPELINED` of them are parsed and waiting on its connection, and what was received
  beyond is held unparsed (one read at most) with reading paused: the rest stays in the
  kernel's socket buffers. Every answer still arrives, in order, once the client reads.
- The request path makes no reference cycles, for any kind of request, pipelined or not, and
  whatever the client does with its connection: `tune_gc` relies on it (a cycle that outlives
  a young collection waits for a full one, which the tuned thresholds make rare), so every
  object a request made is freed by reference counting when it ends.
"""

from __future__ import annotations

import asyncio
import gc
import re
import socket
from asyncio import selector_events
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final

import orjson
import pytest
import uvicorn

from gateway.admission.auth import hash_key
from gateway.config import Settings
from gateway.server.protocol import MAX_PIPELINED, GuardedHttpToolsProtocol
from tests.conftest import gateway_settings, run_gateway
from tests.faults.leaks import request_tasks, task_names
from tests.timing import eventually

KEY: Final = "tg-pipelining-key-for-tests"
LIMITED: Final = "tg-pipelining-limited-key"  # rpm 1: its second request is a 429
MAX_BODY: Final = 2000
SLOW: Final = "s@tokens_per_s=20,output_tokens=200"  # 10 s
PACED: Final = "s@tokens_per_s=20,output_tokens=30"  # 1.5 s
UPSTREAM_FAULTS: Final = {  # models whose upstream always fails so
    "fails-500": "error_500_rate=1",
    "fails-429": "error_429_rate=1",
    "fails-inband": "inband_error_rate=1",
    "fails-400": "max_input_tokens=1",
}
# asyncio's socket transport (the standard library's, so not in its typing stubs), and what one
# read of it returns at most: what may be held unparsed.
TRANSPORT: Final[Any] = selector_events._SelectorSocketTransport  # type: ignore[attr-defined]
READ_SIZE: Final[int] = TRANSPORT.max_size
SETTLE_S: Final = 60.0  # generous: a deadline for a busy machine, not a timing target


def settings() -> Settings:
    return gateway_settings(
        {"sim": {"type": "simulated", "seed": 1, "default_profile": {"output_tokens": 3}}},
        [
            {"name": "m", "deployments": [{"provider": "sim", "model": "m"}]},
            # Streams for seconds: a client can leave in the middle.
            {"name": "slow", "deployments": [{"provider": "sim", "model": SLOW}]},
            {"name": "paced", "deployments": [{"provider": "sim", "model": PACED}]},
            *(
                {"name": name, "deployments": [{"provider": "sim", "model": f"s@{fault}"}]}
                for name, fault in UPSTREAM_FAULTS.items()
            ),
            {  # the first deployment fails, the second answers
                "name": "fails-over",
                "deployments": [
                    {"provider": "sim", "model": "s@error_500_rate=1", "prior": {"ttft_ms": 1}},
                    {"provider": "sim", "model": "m", "prior": {"ttft_ms": 50}},
                ],
            },
        ],
        server={"access_log": False, "max_body_bytes": MAX_BODY},
        auth={
            "keys": [
                {"name": "team", "sha256": hash_key(KEY)},
                {"name": "one", "sha256": hash_key(LIMITED), "rpm": 1},
            ]
        },
    )


class Recording(GuardedHttpToolsProtocol):
    """The gateway's protocol, noting the most requests that ever waited on a connection, and
    the bytes it read while some did."""

    deepest = 0
    read_while_queued = 0

    def data_received(self, data: bytes) -> None:
        if self.pipeline:
            Recording.read_while_queued += len(data)
        super().data_received(data)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        Recording.deepest = max(Recording.deepest, len(self.pipeline))


@asynccontextmanager
async def gateway(*, sndbuf: int | None = None) -> AsyncIterator[tuple[int, uvicorn.Server]]:
    """A gateway served as `tailguard serve` serves it (through `Recording`); yields its port
    and the server, whose `server_state.connections` are the live protocols. With `sndbuf`,
    accepted connections have that send buffer (inherited from the listening socket), so a
    client that does not read blocks the gateway's writes early."""
    async with run_gateway(settings(), http=Recording, sndbuf=sndbuf) as gw:
        yield gw.port, gw.server


def protocols(server: uvicorn.Server) -> list[GuardedHttpToolsProtocol]:
    """The gateway's live client connections."""
    found = [p for p in server.server_state.connections if isinstance(p, GuardedHttpToolsProtocol)]
    assert len(found) == len(server.server_state.connections)
    return found


def request(
    method: str, path: str, body: Any = None, *, key: str | None = KEY, extra: str = ""
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: gateway"]
    if key is not None:
        lines.append(f"authorization: Bearer {key}")
    data = b""
    if body is not None:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        lines += ["content-type: application/json", f"content-length: {len(data)}"]
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode() + data


async def connect(port: int, *, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def read_until(sock: socket.socket, end: bytes | None = None) -> bytes:
    """What the gateway sends on `sock` until what it sent ends with `end`, or until it closes."""
    loop = asyncio.get_running_loop()
    received = bytearray()
    while chunk := await loop.sock_recv(sock, 65536):
        received += chunk
        if end is not None and received.endswith(end):
            break
    return bytes(received)


# --- a flood of pipelined requests -------------------------------------------------------------

FLOOD: Final = 5000  # requests per connection: several reads' worth
CONNECTIONS: Final = 3


def numbered(n: int) -> bytes:
    return b"".join(b"GET /healthz HTTP/1.1\r\nx-request-id: req-%d\r\n\r\n" % i for i in range(n))


async def test_a_pipelining_flood_queues_a_bounded_number_of_requests() -> None:
    """3 connections each pipeline 5,000 `GET /healthz` and read nothing: once the gateway's
    writes are blocked on every one, at most `MAX_PIPELINED` requests wait on each (uvicorn
    queued all it had read, thousands) and at most one read is held unparsed; no more than
    that ever waited. Then the clients read: every answer arrives, in order."""
    Recording.deepest = 0
    loop = asyncio.get_running_loop()
    async with gateway(sndbuf=8192) as (port, server):
        socks = [await connect(port, rcvbuf=4096) for _ in range(CONNECTIONS)]
        try:
            flood = numbered(FLOOD)
            sending = [asyncio.create_task(loop.sock_sendall(s, flood)) for s in socks]

            def blocked() -> bool:
                found = protocols(server)
                return len(found) == CONNECTIONS and all(p.flow.write_paused for p in found)

            await eventually(blocked, within_s=SETTLE_S, what="the gateway's writes blocked")
            for protocol in protocols(server):
                assert len(protocol.pipeline) <= MAX_PIPELINED
                assert protocol.held_bytes <= READ_SIZE
            assert Recording.deepest <= MAX_PIPELINED

            ends = b'x-request-id: req-%d\r\n\r\n{"status":"ok"}' % (FLOOD - 1)
            answers = await asyncio.gather(*(read_until(s, ends) for s in socks))
            await asyncio.gather(*sending)
        finally:
            for sock in socks:
                sock.close()
        expected = [b"req-%d" % i for i in range(FLOOD)]
        for answer in answers:
            assert re.findall(rb"x-request-id: (req-\d+)", answer) == expected
            assert answer.count(b"HTTP/1.1 200 OK\r\n") == FLOOD
        assert Recording.deepest <= MAX_PIPELINED
        await eventually(lambda: not server.server_state.connections, within_s=SETTLE_S)


def statuses(answer: bytes) -> list[int]:
    """The status of every answer in `answer`, in order (an answer may follow a body directly)."""
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)]


STREAM: Final = request(
    "POST",
    "/v1/chat/completions",
    {"model": "paced", "messages": [{"role": "user", "content": "Hi."}], "stream": True},
)
REFUSED: Final = {
    "400": b"GET /healthz HTTP/1.1\r\nbad header\r\n\r\n",
    "431": b"GET /healthz HTTP/1.1\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("case", list(REFUSED))
async def test_a_refusal_behind_pipelined_requests_comes_after_their_answers(case: str) -> None:
    """A stream in flight and a request queued, then one the protocol refuses: the stream is
    answered whole, then the queued request, then the refusal, and the connection closes (the
    refusal used to come first, cutting the stream, and the queued answer failed after it)."""
    async with gateway() as (port, _):
        answer = await exchange(port, STREAM + request("GET", "/healthz") + REFUSED[case])
    assert statuses(answer) == [200, 200, int(case)]
    stream, _, rest = answer.partition(b"\r\n0\r\n\r\n")
    assert b"data: [DONE]" in stream
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n")


async def test_nothing_more_is_read_while_pipelined_requests_wait() -> None:
    """A stream in flight, a request queued behind it whose 100 kB body is still coming: the
    gateway reads none of that body until the queued request starts (uvicorn read on whenever
    the request in flight listened for a disconnect, filling the queued request's buffer)."""
    Recording.read_while_queued = 0
    body = b"x" * 100_000
    queued = request("POST", "/v1/embeddings", key=None).replace(
        b"\r\n\r\n", b"\r\ncontent-length: %d\r\n\r\n" % len(body), 1
    )
    loop = asyncio.get_running_loop()
    async with gateway() as (port, server):
        sock = await connect(port)
        try:
            await loop.sock_sendall(sock, STREAM + queued)
            await eventually(
                lambda: any(p.pipeline for p in protocols(server)),
                within_s=SETTLE_S,
                what="the second request queued",
            )
            await loop.sock_sendall(sock, body)
            answer = await read_until(sock)
        finally:
            sock.close()
    assert statuses(answer) == [200, 401]
    assert Recording.read_while_queued == 0


# --- no reference cycles on the request path ----------------------------------------------------

CHAT: Final = {"model": "m", "messages": [{"role": "user", "content": "Say something."}]}
KINDS: Final = {
    "healthz": request("GET", "/healthz"),
    "readyz": request("GET", "/readyz"),
    "metrics": request("GET", "/metrics"),
    "chat": request("POST", "/v1/chat/completions", CHAT),
    "chat-stream": request("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    "responses": request("POST", "/v1/responses", {"model": "m", "input": "Hi."}),
    "responses-stream": request(
        "POST", "/v1/responses", {"model": "m", "input": "Hi.", "stream": True}
    ),
    "messages": request("POST", "/v1/messages", {**CHAT, "max_tokens": 5}),
    "messages-stream": request("POST", "/v1/messages", {**CHAT, "max_tokens": 5, "stream": True}),
    "400-json": request("POST", "/v1/chat/completions", b'{"model": "m", "messages": ['),
    "400-field": request("POST", "/v1/chat/completions", {"model": "m"}),
    "401": request("POST", "/v1/chat/completions", CHAT, key=None),
    "401-admin": request("GET", "/admin/latency", key=KEY),
    "404-path": request("GET", "/nowhere"),
    "404-model": request("POST", "/v1/chat/completions", {**CHAT, "model": "nope"}),
    "405": request("GET", "/v1/chat/completions"),
    "413": request("POST", "/v1/chat/completions", {**CHAT, "user": "x" * MAX_BODY}),
    "429": request("POST", "/v1/chat/completions", CHAT, key=LIMITED),
    **{
        f"upstream-{name}{stream}": request(
            "POST", "/v1/chat/completions", {**CHAT, "model": name, "stream": bool(stream)}
        )
        for name in UPSTREAM_FAULTS
        for stream in ("", "-stream")
    },
    "upstream-failover": request("POST", "/v1/chat/completions", {**CHAT, "model": "fails-over"}),
    "upstream-messages": request(
        "POST", "/v1/messages", {**CHAT, "model": "fails-500", "max_tokens": 5}
    ),
    "upstream-responses": request(
        "POST", "/v1/responses", {"model": "fails-inband", "input": "Hi.", "stream": True}
    ),
}
# Ends a connection: an unparseable request gets a 400 and a close.
UNPARSEABLE: Final = b"GET /healthz HTTP/1.1\r\nbad header\r\n\r\n"
CLOSE: Final = request("GET", "/healthz", extra="connection: close\r\n")
CUT_SHORT: Final = request(
    "POST", "/v1/chat/completions", {**CHAT, "model": "slow", "stream": True}
)


def strongly_connected(objects: list[object]) -> list[list[object]]:
    """The reference cycles among `objects`: their strongly connected components of more than
    one object, or of one that refers to itself (Tarjan's algorithm, iteratively)."""
    ids = {id(o): o for o in objects}
    edges = {i: [id(r) for r in gc.get_referents(o) if id(r) in ids] for i, o in ids.items()}
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    found: list[list[object]] = []
    for root in ids:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, at = work.pop()
            if at == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            for position in range(at, len(edges[node])):
                nxt = edges[node][position]
                if nxt not in index:
                    work += [(node, position + 1), (nxt, 0)]
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in edges[node]:
                        found.append([ids[i] for i in component])
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return found


def asyncio_own(cycle: list[object]) -> bool:
    """The cycle every asyncio socket transport makes with its read callback (a bound method it
    keeps): the standard library's, one per connection, not the request path's (uvloop, which
    `tailguard serve` runs, has none)."""
    transports = [o for o in cycle if isinstance(o, TRANSPORT)]
    return len(transports) == 1 and all(
        o is transports[0] or getattr(o, "__self__", None) is transports[0] for o in cycle
    )


def described(cycle: list[object]) -> str:
    return " <-> ".join(
        getattr(o, "__qualname__", None) or type(o).__qualname__ for o in cycle[:12]
    )


@contextmanager
def cycles_made() -> Iterator[list[list[object]]]:
    """The reference cycles among the objects made within the block that nothing reaches any
    more at its end (the block's caller must let what it started finish first)."""
    gc.collect()
    gc.disable()
    gc.freeze()  # what exists now is out of scope
    found: list[list[object]] = []
    try:
        yield found
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found += [c for c in strongly_connected(gc.garbage) if not asyncio_own(c)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.unfreeze()
        gc.enable()


async def exchange(port: int, data: bytes, *, leave: bool = False) -> bytes:
    """Send `data` on a new connection and read until the gateway closes it; with `leave`, close
    it as soon as the first bytes of an answer arrive."""
    sock = await connect(port)
    try:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, data)
        if leave:
            return await loop.sock_recv(sock, 1)
        return await read_until(sock)
    finally:
        sock.close()


async def test_the_request_path_makes_no_reference_cycles() -> None:
    """Every kind of request (health, metrics, each LLM endpoint streamed or not, each error),
    one per connection and all pipelined on one, then pipelined requests left queued by a
    client that goes away, and a stream whose client leaves: with the collector off, nothing
    they made is left in a reference cycle (the only cycles are asyncio's own transports')."""
    async with gateway() as (port, server):
        for data in KINDS.values():  # warm: first-use caches and imports are not requests'
            await exchange(port, data + CLOSE)
        with cycles_made() as cycles:
            for name, data in KINDS.items():
                answer = await exchange(port, data + CLOSE)
                assert answer.count(b"HTTP/1.1 ") == 2, (name, answer[:300])
            answer = await exchange(port, b"".join(KINDS.values()) + UNPARSEABLE)
            assert answer.count(b"HTTP/1.1 ") == len(KINDS) + 1, answer[-300:]
            await exchange(port, b"".join(KINDS.values()) * 20, leave=True)
            await exchange(port, CUT_SHORT + b"".join(KINDS.values()), leave=True)
            await exchange(port, b"".join(KINDS.values()) + CUT_SHORT, leave=True)

            def done() -> bool:
                return not request_tasks() and not server.server_state.connections

            await eventually(
                done, within_s=SETTLE_S, what=lambda: task_names(request_tasks()) or "connections"
            )
        assert not cycles, "\n".join(described(c) for c in cycles)
