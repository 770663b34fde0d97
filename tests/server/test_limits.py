"""Limits against abusive clients, on the wire: oversized headers, headers or a body sent too
slowly (slow-loris). Raw sockets, because well-behaved clients cannot misbehave on purpose."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import orjson
import pytest

from tests.conftest import Gateway, Upstream, gateway_settings, run_gateway
from tests.timing import scaled

READ_TIMEOUT_S = 0.3


@pytest.fixture
async def gw(upstream: Upstream) -> AsyncIterator[Gateway]:
    config = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [{"name": "m", "deployments": [{"provider": "up", "model": "m"}]}],
        server={"read_timeout_s": READ_TIMEOUT_S, "max_header_bytes": 4096},
    )
    async with run_gateway(config) as gateway:
        yield gateway


async def connect(gw: Gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = gw.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of the one response before the server closes."""
    async with asyncio.timeout(scaled(5)):
        data = await reader.read()  # to EOF: every refusal closes the connection
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


async def test_headers_over_the_limit_get_431_and_a_close(gw: Gateway) -> None:
    reader, writer = await connect(gw)
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
    for i in range(100):  # 100 x ~60 bytes, over 4096
        writer.write(f"x-filler-{i}: {'a' * 48}\r\n".encode())
    writer.write(b"\r\n")
    status, headers, body = await answer(reader)
    writer.close()
    assert status == 431
    assert headers["connection"] == "close"
    error = orjson.loads(body)["error"]
    assert error["code"] == "headers_too_large" and "4096" in error["message"]


async def test_headers_within_the_limit_are_served(gw: Gateway) -> None:
    reader, writer = await connect(gw)
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-filler: " + b"a" * 3000 + b"\r\n\r\n")
    async with asyncio.timeout(scaled(5)):
        line = await reader.readline()
    writer.close()
    assert line.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"])
async def test_headers_too_slow_get_408(gw: Gateway, sent: bytes) -> None:
    """A connection that sends nothing, or stops in the middle of its headers, is answered with
    408 and closed after the read timeout, not held open forever."""
    reader, writer = await connect(gw)
    started = time.monotonic()
    writer.write(sent)
    status, _, body = await answer(reader)
    waited = time.monotonic() - started
    writer.close()
    assert status == 408
    assert orjson.loads(body)["error"]["code"] == "request_timeout"
    assert waited >= READ_TIMEOUT_S * 0.9


async def test_a_body_too_slow_gets_408(gw: Gateway, upstream: Upstream) -> None:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    reader, writer = await connect(gw)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body[:10])  # and then nothing more
    )
    async with asyncio.timeout(scaled(5)):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        payload = await reader.readexactly(length)
    writer.close()
    assert head.startswith(b"HTTP/1.1 408")
    assert orjson.loads(payload)["error"]["code"] == "request_timeout"
    assert upstream.stats.requests == 0


async def test_keep_alive_requests_each_get_their_own_deadline(gw: Gateway) -> None:
    """The header deadline restarts with each request on a kept-alive connection: two requests
    spread over more than one read timeout are both served."""
    reader, writer = await connect(gw)
    for _ in range(2):
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        async with asyncio.timeout(scaled(5)):
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1][:2]))
        assert head.startswith(b"HTTP/1.1 200")
        await asyncio.sleep(READ_TIMEOUT_S * 0.7)  # idle between requests, as a client may be
    writer.close()
