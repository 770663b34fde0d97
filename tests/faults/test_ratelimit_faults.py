"""The rate-limit store's Redis stalling: one breaker opening per outage, shown while it lasts.

Limit checks are on the request path (unlike the latency store), capped by `timeout_ms`. When
Redis stops answering, the checks in flight all time out at once: that is one outage, and the
breaker opens once, for 1 s, however many checks failed together. After the cooldown one check
probes Redis while the rest are decided locally at once. Meanwhile `/readyz` and `/metrics` say
that limits are enforced per replica.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.admission.auth import Principal, new_key
from gateway.admission.ratelimit import open_rate_limiter
from gateway.errors import OverloadedError
from tests.conftest import RedisServer, Upstream, run_gateway
from tests.faults.conftest import chat, routed
from tests.faults.wire import RedisProxy
from tests.telemetry.test_metrics import scrape
from tests.timing import eventually, scaled

KEY, KEY_HASH = new_key()
ADMIN, ADMIN_HASH = new_key()
HUNG_S = 5.0  # a reply held this long never arrives within any check's timeout
# A healthy Redis answers well within this even when the machine is busy (the default 50 ms is
# missed when redis-server waits for a CPU); a hung one still times out long before HUNG_S.
CHECK_MS = min(1000, round(scaled(250)))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def auth(redis_url: str, **limits: Any) -> dict[str, Any]:
    return {
        "keys": [{"name": "team", "sha256": KEY_HASH, "rpm": 1000}],
        "admin_keys": [{"name": "ops", "sha256": ADMIN_HASH}],
        "rate_limits": {"store": "redis", "redis_url": redis_url, "timeout_ms": CHECK_MS, **limits},
    }


async def test_checks_that_time_out_together_open_the_breaker_once(
    redis_server: RedisServer,
) -> None:
    """Ten checks in flight when Redis hangs: one opening for 1 s (the 503's retry-after says
    so, not 2^9 s). After the cooldown a single check probes the still-hung Redis (the others
    are refused at once, not after the timeout), and its failure is the second opening, for 2 s.
    Once Redis answers again the probe closes the breaker."""
    clock = Clock()
    policy = {"on_store_error": "closed"}
    async with RedisProxy(redis_server.port) as proxy:
        config = routed("http://127.0.0.1:9", "m", top={"auth": auth(proxy.url, **policy)})
        limiter = open_rate_limiter(config, clock=clock)
        principal = Principal(name="team", rpm=1000)
        try:
            assert (await limiter.take(principal, 1)).source == "redis"
            proxy.delay_s = HUNG_S
            failed = await asyncio.gather(
                *(limiter.take(principal, 1) for _ in range(10)), return_exceptions=True
            )
            first = limiter.health()
            with pytest.raises(OverloadedError) as refused:
                await limiter.take(principal, 1)
            clock.now += 1.0  # the cooldown is over
            probed = await asyncio.gather(
                *(limiter.take(principal, 1) for _ in range(10)), return_exceptions=True
            )
            second = limiter.health()
            proxy.delay_s = 0.0
            clock.now += 2.0
            back = await limiter.take(principal, 1)
            closed = limiter.health()
        finally:
            await limiter.aclose()
    assert all(isinstance(f, OverloadedError) for f in failed + probed)
    assert refused.value.headers["retry-after"] == "1"
    assert first["outages"] == 1 and first["store_errors"] == 10
    assert 0.8 <= first["retry_in_s"] <= 1.0
    assert second["outages"] == 2 and second["store_errors"] == 11  # one probe asked Redis
    assert 1.6 <= second["retry_in_s"] <= 2.0
    assert back.source == "redis"
    assert closed["degraded"] is False and closed["retry_in_s"] is None


async def test_degraded_enforcement_shows_on_metrics_and_readyz(
    redis_server: RedisServer, upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Redis hangs under a burst: every request is still served (each replica enforces the
    limits alone), and /readyz and /metrics say so, with one outage counted, until a check
    finds Redis answering again."""
    admin = {"authorization": f"Bearer {ADMIN}"}
    bearer = {"authorization": f"Bearer {KEY}"}

    async def served() -> int:
        answer = await client.post(gw.base_url + "/chat/completions", json=chat(), headers=bearer)
        return answer.status_code

    async def limits() -> dict[str, Any]:
        found: dict[str, dict[str, Any]] = (
            await client.get(gw.url + "/readyz", headers=admin)
        ).json()
        return found["rate_limits"]

    async with RedisProxy(redis_server.port) as proxy:
        config = routed(upstream.base_url, "m", top={"auth": auth(proxy.url)})
        async with run_gateway(config) as gw:
            assert await served() == 200
            healthy = await limits()
            before = await scrape(client, gw.url)
            proxy.delay_s = HUNG_S
            codes = await asyncio.gather(*(served() for _ in range(10)))
            degraded = await limits()
            during = await scrape(client, gw.url)
            proxy.delay_s = 0.0

            async def recovered() -> bool:
                assert await served() == 200
                return (await limits())["degraded"] is False

            await eventually(recovered)  # the cooldown is ~1 s, then the next check probes Redis
            after = await scrape(client, gw.url)
    assert codes == [200] * 10
    assert healthy["degraded"] is False and healthy["outages"] == 0
    assert degraded["degraded"] is True and degraded["outages"] == 1
    assert before.value("tailguard_rate_limit_degraded") == 0
    assert during.value("tailguard_rate_limit_degraded") == 1
    assert during.value("tailguard_rate_limit_store_outages_total") == 1
    assert after.value("tailguard_rate_limit_degraded") == 0
    assert after.value("tailguard_rate_limit_store_outages_total") == 1
