"""A client that leaves: the upstream must see its connection closed soon after, on every path.

The upstream here is a raw TCP server that notes when the gateway closes its connection, so
"the upstream saw the close" is observed at the socket, not inferred from the gateway's state.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import run_gateway
from tests.faults.conftest import MESSAGES, chat, routed, sdk, settled
from tests.faults.wire import Exchange, RawUpstream, sse_token
from tests.timing import scaled

NOTICE_S = 1.0  # how soon the upstream must see the close after the client left


async def endless(exchange: Exchange) -> None:
    """Stream a token every 20 ms (up to 500) until the gateway closes the connection."""
    await exchange.read_request()
    await exchange.start_stream()
    closed = asyncio.create_task(exchange.until_closed())
    try:
        for i in range(500):
            await exchange.chunk(sse_token(f"t{i} "))
            # The upstream's own pace (not synchronisation), cut short by the close.
            await asyncio.wait([closed], timeout=0.02)
            if closed.done():
                return
    except ConnectionError:  # written after the close: the reader is about to see it
        await asyncio.wait([closed], timeout=1)
    finally:
        closed.cancel()


async def mute(exchange: Exchange) -> None:
    await exchange.read_request()
    await exchange.until_closed()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
async def test_disconnect_before_the_first_token_closes_the_upstream(
    client: httpx.AsyncClient, stream: bool
) -> None:
    """A client that gives up while the upstream is still silent (streaming or not) makes the
    gateway close the upstream connection at once."""
    async with RawUpstream(mute) as up, run_gateway(routed(up.base_url, "slow")) as gw:
        request = asyncio.create_task(
            client.post(gw.base_url + "/chat/completions", json=chat(stream=stream))
        )
        await up.wait_for(lambda u: u.requests == 1)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        left = time.perf_counter()
        await up.wait_for(lambda u: u.peer_closes == 1, within_s=NOTICE_S)
        noticed = time.perf_counter() - left
        await settled(up.url, gateway=gw.url)
    assert noticed < NOTICE_S


async def test_disconnect_during_a_hedge_closes_both_attempts(client: httpx.AsyncClient) -> None:
    """A client that leaves while a slow primary and its hedge are both still silent makes the
    gateway close both upstream connections."""
    async with RawUpstream(mute) as primary, RawUpstream(mute) as hedge:
        settings = routed(
            primary.base_url,
            "slow",
            hedge.base_url,
            budget={"ttft_ms": 300},
            on_ttft_miss="hedge",
            hedge_max_fraction=1.0,
        )
        async with run_gateway(settings) as gw:
            request = asyncio.create_task(
                client.post(gw.base_url + "/chat/completions", json=chat(stream=True))
            )
            await hedge.wait_for(lambda u: u.requests == 1)  # both attempts are running now
            assert primary.peer_closes == 0
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            await primary.wait_for(lambda u: u.peer_closes == 1, within_s=NOTICE_S)
            await hedge.wait_for(lambda u: u.peer_closes == 1, within_s=NOTICE_S)
            await settled(primary.url, hedge.url, gateway=gw.url)


async def test_disconnect_mid_stream_closes_the_upstream() -> None:
    """A client (the SDK) that closes a stream after two chunks makes the gateway close the
    upstream connection within about a chunk, rather than reading the rest."""
    async with RawUpstream(endless) as up, run_gateway(routed(up.base_url, "chatty")) as gw:
        async with sdk(gw) as client, asyncio.timeout(scaled(5)):
            chunks = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            got = [await anext(chunks), await anext(chunks)]
            await chunks.close()
            left = time.perf_counter()
            await up.wait_for(lambda u: u.peer_closes == 1, within_s=NOTICE_S)
            noticed = time.perf_counter() - left
        await settled(up.url, gateway=gw.url)
    assert [c.choices[0].delta.content for c in got] == ["t0 ", "t1 "]
    assert noticed < NOTICE_S


async def test_many_disconnects_leave_nothing_open(client: httpx.AsyncClient) -> None:
    """Twenty clients that leave mid-stream at once: every upstream connection is closed, and
    so is every client connection the gateway held."""
    async with RawUpstream(endless) as up, run_gateway(routed(up.base_url, "chatty")) as gw:
        url = gw.base_url + "/chat/completions"

        async def leave_after_a_token() -> None:
            async with client.stream("POST", url, json=chat(stream=True)) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        return

        async with asyncio.timeout(scaled(5)):
            await asyncio.gather(*(leave_after_a_token() for _ in range(20)))
            await up.wait_for(lambda u: u.peer_closes == 20)
            await settled(up.url, gateway=gw.url)
            assert up.open == 0
