"""The shared latency store's Redis going down, slow, hung or flapping: requests never notice.

Redis is never on the request path: samples are recorded in memory and owned background tasks
flush and refresh them. So whatever Redis does, every request is served, and as fast as with a
healthy Redis (up to the noise of a shared machine); the store says it is degraded, and comes
back once Redis does. Latency is compared with the same gateway's own requests while Redis was
healthy; a request that waited on Redis would take at least the injected delay.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

from gateway.config import Settings
from tests.conftest import Gateway, RedisServer, Upstream, run_gateway
from tests.faults.conftest import chat, routed
from tests.faults.wire import RedisProxy
from tests.timing import eventually, scaled

NOISE_S = 0.025  # how much slower a median request may be on a quiet machine (then scaled)


def with_redis(upstream: Upstream, url: str) -> Settings:
    return routed(upstream.base_url, "m", top={"latency": {"store": "redis", "redis_url": url}})


async def timed(client: httpx.AsyncClient, gw: Gateway, n: int) -> list[float]:
    """`n` streamed requests one after another; each must succeed. Their durations."""
    durations = []
    for _ in range(n):
        started = time.perf_counter()
        resp = await client.post(gw.base_url + "/chat/completions", json=chat(stream=True))
        durations.append(time.perf_counter() - started)
        assert resp.status_code == 200
        assert resp.text.rstrip().endswith("data: [DONE]")
    return durations


async def store(client: httpx.AsyncClient, gw: Gateway) -> dict[str, object]:
    body = (await client.get(gw.url + "/readyz")).json()
    assert body["status"] == "ready"  # the gateway stays ready whatever the store does
    latency: dict[str, object] = body["latency_store"]
    return latency


async def state_is(client: httpx.AsyncClient, gw: Gateway, state: str) -> bool:
    return (await store(client, gw))["state"] == state


def no_slower(healthy: list[float], faulty: list[float], *, limit_s: float) -> None:
    """The faulty run's median is within the noise of the healthy one's, and no more than one
    request (a scheduler hiccup) took as long as `limit_s`."""
    base, now = statistics.median(healthy), statistics.median(faulty)
    assert now <= base + scaled(NOISE_S), (base, now, faulty)
    assert sum(d >= limit_s for d in faulty) <= 1, faulty


async def test_redis_down_costs_requests_nothing(
    redis_server: RedisServer, upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Redis killed mid-run: requests go on at the same speed, the store reports `degraded`
    (the gateway stays ready), and it is `ok` again soon after Redis is back."""
    async with run_gateway(with_redis(upstream, redis_server.url)) as gw:
        await eventually(lambda: state_is(client, gw, "ok"))
        healthy = await timed(client, gw, 10)
        await asyncio.to_thread(redis_server.kill)
        down = await timed(client, gw, 10)
        await eventually(lambda: state_is(client, gw, "degraded"))
        down += await timed(client, gw, 10)
        await asyncio.to_thread(redis_server.start)

        async def shared_again() -> bool:  # the first refresh after reconnecting has landed
            back = await store(client, gw)
            return back["state"] == "ok" and back["snapshot_source"] == "redis"

        await eventually(shared_again, within_s=15)
    no_slower(healthy, down, limit_s=scaled(0.25))


async def test_redis_down_at_start_up(
    redis_server: RedisServer, upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A gateway started while its Redis is down starts anyway, serves, and reports `degraded`."""
    await asyncio.to_thread(redis_server.kill)
    async with run_gateway(with_redis(upstream, redis_server.url)) as gw:
        assert await state_is(client, gw, "degraded")
        await timed(client, gw, 5)


@pytest.mark.parametrize("delay_s", [0.12, 5.0], ids=["slow", "hung"])
async def test_slow_redis_does_not_slow_requests(
    redis_server: RedisServer, upstream: Upstream, client: httpx.AsyncClient, delay_s: float
) -> None:
    """Redis answering every command 120 ms late (the store keeps working), or not at all within
    its timeouts (the store gives up and backs off): requests sent while the store waits on
    Redis are as fast as before. The delay grows with the noise allowed on a busy machine, so a
    request that waited on Redis still shows (the slow one stays within the store's 0.5 s)."""
    delay_s = scaled(delay_s) if delay_s > 1 else min(scaled(delay_s), 0.4)
    async with (
        RedisProxy(redis_server.port) as proxy,
        run_gateway(with_redis(upstream, proxy.url)) as gw,
    ):
        await eventually(lambda: state_is(client, gw, "ok"))
        healthy = await timed(client, gw, 10)
        proxy.delay_s = delay_s
        slow: list[float] = []
        while len(slow) < 8:  # requests sent while the store waits on a reply the proxy holds
            await proxy.wait_for(lambda p: p.holding > 0 and p.delayed > 0)
            slow += await timed(client, gw, 1)
        if delay_s > 1:  # its calls time out: the store notices, the gateway stays ready
            await eventually(lambda: state_is(client, gw, "degraded"))
        proxy.delay_s = 0.0  # the store's final flush on shut-down needs no waiting
    no_slower(healthy, slow, limit_s=min(delay_s, scaled(0.25)))


async def test_flapping_redis_costs_requests_nothing_and_opens_few_connections(
    redis_server: RedisServer, upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Redis connections that keep dropping (every other one reset at once, the rest cut after
    200 ms): requests are served as fast as before, and the store's connections stay bounded
    by its pool (no storm of reconnects)."""
    async with (
        RedisProxy(redis_server.port) as proxy,
        run_gateway(with_redis(upstream, proxy.url)) as gw,
    ):
        await eventually(lambda: state_is(client, gw, "ok"))
        healthy = await timed(client, gw, 10)
        proxy.start_flapping()
        flapping: list[float] = []
        for _ in range(2):  # two rounds of reconnecting, with requests in between
            seen = proxy.accepted
            await proxy.wait_for(lambda p: p.accepted > seen)  # noqa: B023 - awaited at once
            flapping += await timed(client, gw, 10)
        proxy.flap = False
    no_slower(healthy, flapping, limit_s=scaled(0.25))
    assert proxy.dropped >= 2
    assert proxy.max_open <= 4  # connect_redis's pool
    assert proxy.accepted <= 30
