"""Client connections on the wire: how long the gateway holds them, and what it answers at the
protocol level. Raw sockets, because well-behaved clients cannot linger, trickle or half-close
on purpose.

The property: whatever a client does after an answer (trickle a body nobody reads, trickle
bytes that begin no request, begin a request and never finish it, half-close, or just stay
silent), the gateway closes the connection within its read or keep-alive deadline, and every
descriptor it held is released.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.admission.auth import hash_key
from gateway.api import LLM_ROUTES
from gateway.config import Settings
from tests.conftest import Gateway, free_port, gateway_settings, run_gateway
from tests.faults.conftest import http_client, settled
from tests.faults.leaks import fd_count, links, port_of
from tests.runtime.test_operations import TAILGUARD, config, gateway_from, write
from tests.timing import eventually, scaled, slowdown

# server.read_timeout_s: on a busy machine 50 clients' heads may wait longer than 0.4 s for the
# gateway's loop, and a head read late is answered 408 rather than with the status under test.
READ_S = round(0.4 * slowdown(), 2)
IDLE_S = 0.4  # server.keepalive_timeout_s
MAX_BODY = 1000
# A close is due within the read deadline plus the keep-alive deadline; the rest is slack for a
# loaded machine (the property is "closed by the deadlines", not "held until told to go").
CLOSED_WITHIN_S = READ_S + IDLE_S + 1.5
CLIENTS = 50
EVERY_S = 0.05  # a trickling client's pace
KEY = "tg-client-key-for-tests"
ADMIN_KEY = "tg-admin-key-for-tests"
KEYS = {
    "keys": [{"name": "team", "sha256": hash_key(KEY)}],
    "admin_keys": [{"name": "ops", "sha256": hash_key(ADMIN_KEY)}],
}
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "Say something."}]})


def settings(*, auth: bool = True, **server: Any) -> Settings:
    return gateway_settings(
        {"sim": {"type": "simulated", "seed": 1, "default_profile": {"output_tokens": 3}}},
        [{"name": "m", "deployments": [{"provider": "sim", "model": "m"}]}],
        server={
            "access_log": False,
            "read_timeout_s": READ_S,
            "keepalive_timeout_s": IDLE_S,
            "max_body_bytes": MAX_BODY,
            **server,
        },
        **({"auth": KEYS} if auth else {}),
    )


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async with run_gateway(settings()) as gateway:
        yield gateway


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with http_client(timeout=scaled(10)) as client:
        yield client


def bearer(key: str = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def head(
    method: str, path: str, *, length: int | None = None, key: str | None = None, v: str = "1.1"
) -> bytes:
    lines = [f"{method} {path} HTTP/{v}", "host: gateway", "content-type: application/json"]
    if length is not None:
        lines.append(f"content-length: {length}")
    if key is not None:
        lines.append(f"authorization: Bearer {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass(slots=True, eq=False)
class Client:
    """One raw client: every byte the gateway sent it, and when the gateway ended its side."""

    received: bytearray = field(default_factory=bytearray)
    ended_after_s: float | None = None  # since the client connected; None: not ended yet

    def responses(self) -> list[tuple[int, dict[str, str], bytes]]:
        """The complete responses in what was received, in order (bodies by content-length)."""
        found = []
        rest = bytes(self.received)
        while b"\r\n\r\n" in rest:
            top, _, rest = rest.partition(b"\r\n\r\n")
            lines = top.decode("latin-1").split("\r\n")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            found.append((int(lines[0].split()[1]), headers, rest[:length]))
            rest = rest[length:]
        return found


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _client(
    url: str, client: Client, first: bytes, then: bytes, half_close: bool, stop: asyncio.Event
) -> None:
    reader, writer = await connect(url)
    started = time.monotonic()

    async def read() -> None:
        try:
            while chunk := await reader.read(65536):
                client.received.extend(chunk)
        except ConnectionError:  # reset: the gateway closed with bytes of ours unread
            pass
        client.ended_after_s = time.monotonic() - started

    reading = asyncio.create_task(read())
    writer.write(first)
    if half_close:
        writer.write_eof()
    sent = 0
    try:
        # Until the connection is gone altogether: an ended answer does not stop a trickler.
        while not stop.is_set() and not writer.transport.is_closing():
            if then and not half_close:
                writer.write(then[sent % len(then) :][:1])
                sent += 1
            # Pacing, not synchronisation: a trickling client sends at its own rate.
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), EVERY_S)
    finally:
        reading.cancel()
        with suppress(asyncio.CancelledError):
            await reading
        writer.close()
        with suppress(ConnectionError):
            await writer.wait_closed()


@asynccontextmanager
async def crowd(
    url: str, first: bytes = b"", *, then: bytes = b"", half_close: bool = False, n: int = CLIENTS
) -> AsyncIterator[list[Client]]:
    """`n` raw clients at once, each sending `first`, then one byte of `then` (cycled) every
    `EVERY_S`, or half-closing, or nothing more, for as long as its connection lasts, even
    after the gateway ended its side. They stop and close when the block exits."""
    stop = asyncio.Event()
    clients = [Client() for _ in range(n)]
    tasks = [asyncio.create_task(_client(url, c, first, then, half_close, stop)) for c in clients]
    try:
        yield clients
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def let_go(url: str, clients: list[Client]) -> None:
    """The gateway ends its side of every client's connection within the deadlines, and then
    holds none of them at all (its staged close is bounded too), whatever the clients do."""
    await eventually(
        lambda: all(c.ended_after_s is not None for c in clients),
        within_s=CLOSED_WITHIN_S,
        what=lambda: f"{sum(c.ended_after_s is None for c in clients)} of {len(clients)} open",
    )
    port = port_of(url)

    async def none_held() -> bool:
        return not any(k.local_port == port and k.state != "LISTEN" for k in await links())

    await eventually(none_held, within_s=READ_S + 1.5, what="the gateway holds client connections")


# --- an answer that leaves the request's body unread closes the connection ----------------------

EARLY = {
    # A big body still coming, no key: refused before the body is read.
    "401-chat": head("POST", "/v1/chat/completions", length=100_000),
    "401-messages": head("POST", "/v1/messages", length=100_000),
    "401-admin": head("GET", "/admin/latency", length=100_000),
    "401-http/1.0": head("POST", "/v1/chat/completions", length=100_000, v="1.0"),
    "413": head("POST", "/v1/embeddings", length=MAX_BODY * 5, key=KEY),
    # The body trickles slower than the read deadline allows.
    "408": head("POST", "/v1/chat/completions", length=MAX_BODY - 1, key=KEY) + b"{",
    "405": head("PUT", "/v1/completions", length=100_000, key=KEY),
    "healthz": head("GET", "/healthz", length=100_000),
}
EARLY_STATUS = {
    "401-chat": 401,
    "401-messages": 401,
    "401-admin": 401,
    "401-http/1.0": 401,
    "413": 413,
    "408": 408,
    "405": 405,
    "healthz": 200,
}


@pytest.mark.parametrize("case", list(EARLY))
async def test_an_answer_before_the_body_closes_the_connection(gw: Gateway, case: str) -> None:
    """50 clients each trickle, one byte at a time, the rest of a body the gateway answered
    without reading (a 401, 413, 408, 405, or a quick /healthz): each answer says
    `connection: close` and the connection is closed, the trickle does not keep it open."""
    before = fd_count()
    async with crowd(gw.url, EARLY[case], then=b"a") as seen:
        await let_go(gw.url, seen)
    for one in seen:
        [(status, headers, body)] = one.responses()
        assert status == EARLY_STATUS[case]
        assert headers["connection"] == "close"
        assert orjson.loads(body)
    await settled(gateway=gw.url)
    await eventually(
        lambda: fd_count() <= before, what=lambda: f"{fd_count()} fds, {before} before"
    )


@pytest.mark.parametrize(("key", "status"), [(None, 401), (KEY, 413)], ids=["401", "413"])
async def test_a_client_still_uploading_reads_its_answer_not_a_reset(
    gw: Gateway, http: httpx.AsyncClient, key: str | None, status: int
) -> None:
    """The close after an early answer is staged: a client still writing a large body (8 MB
    here) when it is refused gets the refusal, not a connection reset that destroys it."""
    headers = {"content-type": "application/json", **(bearer(key) if key else {})}
    for _ in range(3):
        resp = await http.post(
            gw.url + "/v1/chat/completions", content=b" " * 8_000_000, headers=headers
        )
        assert resp.status_code == status
        assert resp.headers["connection"] == "close"


async def test_an_answer_after_the_whole_body_keeps_the_connection(gw: Gateway) -> None:
    """The other side of it: a request whose body was read before the answer (served, or
    refused after reading it) keeps its connection alive for the next request."""
    reader, writer = await connect(gw.url)
    exchanges = [
        (head("POST", "/v1/chat/completions", length=len(BODY), key=KEY) + BODY, 200),
        (head("POST", "/v1/chat/completions", length=2, key=KEY) + b"{]", 400),
        (head("GET", "/healthz"), 200),
    ]
    try:
        for request, status in exchanges:
            writer.write(request)
            async with asyncio.timeout(scaled(5)):
                top = await reader.readuntil(b"\r\n\r\n")
                length = int(top.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
            assert top.startswith(b"HTTP/1.1 %d" % status)
            assert b"connection: close" not in top.lower()
    finally:
        writer.close()
        await writer.wait_closed()


# --- keep-alive is measured from the last response, not the last byte ---------------------------

HEALTHZ = head("GET", "/healthz")


# What a client sends after its answer, and the statuses it gets, per case.
TRICKLES: dict[str, tuple[bytes, bytes, list[int]]] = {
    # Blank lines between requests begin no request: they must not hold the connection.
    "blank-lines": (HEALTHZ, b"\r\n", [200]),
    # A next request begun and never finished: 408 by the header deadline.
    "slow-headers": (HEALTHZ, b"GET /healthz HTTP/1.1\r\nx-slow: " + b"a" * 10_000, [200, 408]),
    # Two pipelined requests, the second with a body nobody reads.
    "pipelined": (HEALTHZ + head("GET", "/healthz", length=100_000), b"a", [200, 200]),
    # Pipelined, the second refused without its body (no key).
    "pipelined-401": (
        HEALTHZ + head("POST", "/v1/chat/completions", length=9_999),
        b"a",
        [200, 401],
    ),
}


@pytest.mark.parametrize("case", list(TRICKLES))
async def test_trickling_after_an_answer_does_not_hold_the_connection(
    gw: Gateway, case: str
) -> None:
    """50 clients per case trickle a byte every 50 ms after their answers: each connection is
    closed by the keep-alive or header deadline, whichever applies, and nothing is left."""
    first, then, expected = TRICKLES[case]
    before = fd_count()
    async with crowd(gw.url, first, then=then) as seen:
        await let_go(gw.url, seen)
    statuses = [[r[0] for r in one.responses()] for one in seen]
    assert statuses == [expected] * CLIENTS
    await settled(gateway=gw.url)
    await eventually(
        lambda: fd_count() <= before, what=lambda: f"{fd_count()} fds, {before} before"
    )


async def test_a_kept_alive_connection_is_closed_when_idle(gw: Gateway) -> None:
    """An idle connection after a complete exchange is closed after the keep-alive timeout
    (and not before it: a client may pause between requests)."""
    async with crowd(gw.url, HEALTHZ, n=1) as [seen]:
        await let_go(gw.url, [seen])
    assert seen.ended_after_s is not None and seen.ended_after_s >= IDLE_S * 0.9
    assert [r[0] for r in seen.responses()] == [200]


# --- lingering and half-closed clients -----------------------------------------------------------

LINGERING: dict[str, dict[str, Any]] = {
    "silent": {"first": b""},
    "partial-headers": {"first": b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"},
    "half-closed-headers": {"first": b"GET /healthz HTTP/1.1\r\nhost: x\r\n", "half_close": True},
    "half-closed-body": {
        "first": head("POST", "/v1/chat/completions", length=len(BODY), key=KEY) + BODY[:9],
        "half_close": True,
    },
    "half-closed-after-answer": {"first": HEALTHZ, "half_close": True},
}


@pytest.mark.parametrize("kind", list(LINGERING))
async def test_descriptors_return_to_baseline_after_lingering_clients(
    gw: Gateway, kind: str
) -> None:
    """50 clients at once that stay silent, stop mid-headers, or half-close before, during or
    after a request: every connection is closed by a deadline or by the client's end, and the
    gateway's descriptors are back where they were."""
    before = fd_count()
    async with crowd(gw.url, **LINGERING[kind]) as seen:
        await let_go(gw.url, seen)
    await settled(gateway=gw.url)
    await eventually(
        lambda: fd_count() <= before, what=lambda: f"{fd_count()} fds, {before} before"
    )


# --- protocol-level refusals are JSON ------------------------------------------------------------

MALFORMED = {
    "unknown-method": b"BREW /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n",
    "bad-header": b"GET /healthz HTTP/1.1\r\nhost: x\r\nno colon here\r\n\r\n",
    "bad-content-length": b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: ten\r\n\r\n",
    "not-http": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32,
    "bad-chunk": b"POST /healthz HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_an_unparseable_request_gets_an_openai_shaped_400(gw: Gateway, case: str) -> None:
    async with crowd(gw.url, MALFORMED[case], n=1) as [seen]:
        await let_go(gw.url, [seen])
    [(status, headers, body)] = seen.responses()
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    error = orjson.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_http_request"
    assert set(error) == {"message", "type", "param", "code"}


# --- the LLM routes answer only POST ------------------------------------------------------------


@pytest.mark.parametrize("path", list(LLM_ROUTES))
@pytest.mark.parametrize("method", ["HEAD", "OPTIONS", "GET", "PUT", "PATCH", "DELETE", "TRACE"])
async def test_other_methods_on_llm_routes_get_405_allow_post(
    gw: Gateway, http: httpx.AsyncClient, path: str, method: str
) -> None:
    resp = await http.request(method, gw.url + path, headers=bearer())
    assert resp.status_code == 405
    assert resp.headers["allow"] == "POST"
    if method != "HEAD":
        body = resp.json()
        if path == "/v1/messages":
            assert body["type"] == "error" and body["error"]["message"]
        else:
            assert body["error"]["code"] == "method_not_allowed"


# --- /readyz: open status, detail for those allowed to see it -----------------------------------

DETAIL = {"providers", "models", "latency_store", "rate_limits", "config", "responses_store"}


@pytest.mark.parametrize(
    ("detail", "auth", "shown"),
    [
        # (server.readiness_detail, keys configured, who sees the detail)
        ("admin", True, {"admin"}),
        ("admin", False, {"none", "client", "admin", "wrong"}),  # no keys: like /admin/*
        ("public", True, {"none", "client", "admin", "wrong"}),
        ("none", True, set()),
    ],
    ids=["admin", "admin-without-keys", "public", "none"],
)
async def test_readiness_detail_is_shown_only_to_whom_it_is_configured_for(
    http: httpx.AsyncClient, detail: str, auth: bool, shown: set[str]
) -> None:
    callers = {
        "none": {},
        "client": bearer(KEY),
        "admin": bearer(ADMIN_KEY),
        "wrong": bearer("tg-not-a-key"),
    }
    async with run_gateway(settings(auth=auth, readiness_detail=detail)) as gw:
        for caller, headers in callers.items():
            ready = await http.get(gw.url + "/readyz", headers=headers)
            assert ready.status_code == 200, caller
            body = ready.json()
            assert body["status"] == "ready"
            assert set(body) == ({"status"} | DETAIL if caller in shown else {"status"}), caller
            health = await http.get(gw.url + "/healthz", headers=headers)
            assert health.status_code == 200 and health.json() == {"status": "ok"}


# --- a reload may not turn authentication off on an exposed gateway ------------------------------


@asynccontextmanager
async def from_file(path: Path, doc: dict[str, Any]) -> AsyncIterator[str]:
    await asyncio.to_thread(write, path, doc)
    async with gateway_from(path) as url:
        yield url


@pytest.mark.parametrize(
    ("server", "refused"),
    [
        ({"host": "0.0.0.0"}, True),
        ({"host": "::"}, True),
        ({"host": "0.0.0.0", "allow_unauthenticated": True}, False),
        ({"host": "127.0.0.1"}, False),
    ],
    ids=["any-ipv4", "any-ipv6", "allowed", "loopback"],
)
async def test_a_reload_without_keys_is_refused_beyond_loopback(
    tmp_path: Path,
    http: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
    server: dict[str, Any],
    refused: bool,
) -> None:
    """A valid file without `auth` reloaded into a gateway that listens beyond loopback (and
    was not started with `allow_unauthenticated`) is refused, as it would be at start-up: the
    old config keeps serving and keys are still required. On loopback, or when
    unauthenticated serving was allowed, the same reload is applied."""
    caplog.set_level(logging.WARNING, logger="tailguard")
    path = tmp_path / "gateway.yaml"
    keyed = {**config("a", access_log=False, **server), "auth": KEYS}
    async with from_file(path, keyed) as url, asyncio.timeout(scaled(20)):
        assert (await http.get(url + "/v1/models")).status_code == 401
        await asyncio.to_thread(write, path, config("a", "b", access_log=False, **server))

        async def decided() -> bool:
            # Applied or refused, the admin key sees the detail: without keys it is open.
            state = (await http.get(url + "/readyz", headers=bearer(ADMIN_KEY))).json()
            return bool(state["config"]["reloads"] or state["config"]["reload_failures"])

        await eventually(decided, within_s=10)
        anonymous = await http.get(url + "/v1/models")
        if refused:
            assert anonymous.status_code == 401
            keyed_models = (await http.get(url + "/v1/models", headers=bearer())).json()
            assert [m["id"] for m in keyed_models["data"]] == ["a"]
            state = (await http.get(url + "/readyz", headers=bearer(ADMIN_KEY))).json()
            assert state["config"]["reload_failures"] == 1 and state["config"]["reloads"] == 0
            assert "authentication" in state["config"]["last_failure"]
        else:
            assert anonymous.status_code == 200
            assert [m["id"] for m in anonymous.json()["data"]] == ["a", "b"]
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("reload" in m and "authentication" in m for m in messages), messages


@asynccontextmanager
async def served_by_cli(path: Path, *flags: str) -> AsyncIterator[str]:
    """`tailguard serve --config path *flags` in its own process, once it answers."""
    port = free_port()
    command = [str(TAILGUARD), "serve", "--config", str(path), "--port", str(port), *flags]
    process = await asyncio.to_thread(
        subprocess.Popen, command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with http_client(timeout=1) as probe:

            async def up() -> bool:
                assert process.poll() is None, "the gateway exited"
                with suppress(httpx.TransportError):
                    return (await probe.get(url + "/healthz")).status_code == 200
                return False

            await eventually(up, within_s=20, what="the gateway did not start")
        yield url
    finally:
        process.kill()
        await asyncio.to_thread(process.wait, 10)
        assert process.stderr is not None
        process.stderr.close()


async def test_the_cli_host_is_what_a_reload_is_judged_by(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """`serve --host 0.0.0.0` with a file that says 127.0.0.1: the bind address, not the
    file's, decides, so the reload without keys is refused there too."""
    path = tmp_path / "gateway.yaml"
    await asyncio.to_thread(write, path, {**config("a"), "auth": KEYS})
    async with served_by_cli(path, "--host", "0.0.0.0") as url, asyncio.timeout(scaled(30)):
        await asyncio.to_thread(write, path, config("a", "b"))

        async def refused() -> bool:
            state = (await http.get(url + "/readyz", headers=bearer(ADMIN_KEY))).json()
            return bool(state["config"]["reload_failures"])

        await eventually(refused, within_s=15)
        assert (await http.get(url + "/v1/models")).status_code == 401
        assert (await http.get(url + "/v1/models", headers=bearer())).status_code == 200
