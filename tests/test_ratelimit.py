"""Per-key requests and tokens per minute: the buckets, OpenAI's headers, and the limits shared
by replicas through a real Redis, including when that Redis is down or never answers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.auth import Principal, new_key
from gateway.config import RateLimitSpec
from gateway.ratelimit import LocalBuckets, RateLimiter, duration, estimate_tokens
from tests.conftest import RedisServer, Upstream, gateway_settings, run_gateway
from tests.test_metrics import scrape_when

REQUESTS = "tailguard_requests_total"

KEY, KEY_HASH = new_key()
CHAT: Any = [{"role": "user", "content": "hi"}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings(base_url: str, *, rate_limits: dict[str, Any] | None = None, **key: Any) -> Any:
    return gateway_settings(
        {"up": {"type": "vllm", "base_url": base_url}},
        [{"name": "m", "deployments": [{"provider": "up", "model": "m"}]}],
        auth={
            "keys": [{"name": "team", "sha256": KEY_HASH, **key}],
            "rate_limits": rate_limits or {},
        },
    )


def bearer() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


async def chat(http: httpx.AsyncClient, base_url: str, **extra: Any) -> httpx.Response:
    return await http.post(
        base_url + "/chat/completions",
        json={"model": "m", "messages": CHAT, **extra},
        headers=bearer(),
    )


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


# --- the arithmetic -------------------------------------------------------------------------------


def test_durations_as_openai_spells_them() -> None:
    assert duration(0.12) == "120ms"
    assert duration(1.0) == "1s"
    assert duration(1.42) == "1.5s"
    assert duration(360) == "6m0s"
    assert duration(61.2) == "1m2s"


def test_a_bucket_bursts_to_its_limit_then_refills_at_its_rate() -> None:
    clock = Clock()
    buckets = LocalBuckets(clock)
    limits = (3, 0)
    allowed = [buckets.take("k", limits, (1, 0), check=True)[0] for _ in range(4)]
    assert allowed == [1, 1, 1, 0]
    refused = buckets.take("k", limits, (1, 0), check=True)
    assert refused[3] == pytest.approx(20_000)  # a request's worth refills in 60 s / 3
    clock.now += 20
    assert buckets.take("k", limits, (1, 0), check=True)[0] == 1
    clock.now += 600  # never more than the limit, however long the key was idle
    assert [buckets.take("k", limits, (1, 0), check=True)[0] for _ in range(4)] == [1, 1, 1, 0]


def test_settling_returns_unused_tokens() -> None:
    clock = Clock()
    buckets = LocalBuckets(clock)
    limits = (0, 100)
    assert buckets.take("k", limits, (0, 90), check=True)[0] == 1
    assert buckets.take("k", limits, (0, 20), check=True)[0] == 0
    buckets.take("k", limits, (0, -80), check=False)  # it used 10 of the 90 charged
    assert buckets.take("k", limits, (0, 20), check=True)[0] == 1


def test_estimate_counts_the_prompt_and_every_output_token_asked() -> None:
    prompt, total = estimate_tokens(b"x" * 400, max_tokens=50, n=2)
    assert (prompt, total) == (100, 200)
    assert estimate_tokens(b"", None, 1) == (1, 1)


# --- through the gateway, one replica ----------------------------------------------------------


async def test_requests_per_minute_with_openai_headers(
    upstream: Upstream, http: httpx.AsyncClient
) -> None:
    """Every answer to a limited key carries x-ratelimit-*; over the limit it is a 429 with
    retry-after that the SDK raises as RateLimitError, and nothing goes upstream."""
    async with run_gateway(settings(upstream.base_url, rpm=3)) as gw:
        answers = [await chat(http, gw.base_url) for _ in range(3)]
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0) as sdk:
            with pytest.raises(openai.RateLimitError) as refused:
                await sdk.chat.completions.create(model="m", messages=CHAT)
        metrics = await scrape_when(http, gw.url, lambda s: s.value(REQUESTS) >= 4)
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0"]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    assert answers[2].headers["x-ratelimit-reset-requests"] == "1m0s"
    response = refused.value.response
    assert refused.value.code == "rate_limit_exceeded"
    assert refused.value.type == "requests"
    assert response.headers["retry-after"] == "20"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert upstream.stats.requests == 3
    assert metrics.value("tailguard_rate_limited_total", key="team", limit="requests") == 1
    assert metrics.value("tailguard_requests_total", status="429") == 1


async def test_tokens_per_minute_are_charged_then_settled(
    upstream: Upstream, http: httpx.AsyncClient
) -> None:
    """A request is charged its prompt estimate plus max_tokens, then what it really used; one
    that could never fit is refused for good (x-should-retry: false)."""
    async with run_gateway(settings(upstream.base_url, tpm=1000)) as gw:
        first = await chat(http, gw.base_url, max_tokens=500)
        # The first used ~6 tokens, so its 500+ charge was mostly returned: this one fits.
        second = await chat(http, gw.base_url, max_tokens=900)
        too_big = await chat(http, gw.base_url, max_tokens=5000)
    assert first.status_code == 200 and second.status_code == 200
    remaining = int(first.headers["x-ratelimit-remaining-tokens"])
    assert 1000 - 500 - 60 < remaining < 500  # the estimate, before settling
    assert too_big.status_code == 429
    assert too_big.headers["x-should-retry"] == "false"
    assert too_big.json()["error"]["type"] == "tokens"


# --- shared by replicas through Redis -----------------------------------------------------------


def redis_limits(server: RedisServer, **extra: Any) -> dict[str, Any]:
    return {"store": "redis", "redis_url": server.url, **extra}


async def test_replicas_share_one_limit(
    upstream: Upstream, redis_server: RedisServer, http: httpx.AsyncClient
) -> None:
    """Two gateways on one Redis: a burst of 20 concurrent requests spread over both is allowed
    exactly the key's 8 per minute, atomically."""
    # A generous timeout: this is about atomicity, not about a slow machine tripping the breaker.
    limits = redis_limits(redis_server, timeout_ms=3000)
    config = settings(upstream.base_url, rpm=8, rate_limits=limits)
    async with run_gateway(config) as one, run_gateway(config) as two:
        answers = await asyncio.gather(*(chat(http, (one, two)[i % 2].base_url) for i in range(20)))
        ready = [(await http.get(g.url + "/readyz")).json()["rate_limits"] for g in (one, two)]
    assert [r["store_errors"] for r in ready] == [0, 0]
    codes = sorted(a.status_code for a in answers)
    assert codes.count(200) == 8 and codes.count(429) == 12
    assert upstream.stats.requests == 8


async def test_redis_down_fails_open_to_per_replica_limits(
    upstream: Upstream, redis_server: RedisServer, http: httpx.AsyncClient
) -> None:
    """With Redis gone, the default policy keeps serving and still enforces the limit, per
    replica; /readyz says the limiter is degraded."""
    config = settings(upstream.base_url, rpm=3, rate_limits=redis_limits(redis_server))
    async with run_gateway(config) as gw:
        assert (await chat(http, gw.base_url)).status_code == 200
        redis_server.kill()
        codes = [(await chat(http, gw.base_url)).status_code for _ in range(4)]
        ready = (await http.get(gw.url + "/readyz")).json()
    assert codes == [200, 200, 200, 429]  # a fresh local bucket: 3 more, then the limit
    assert ready["rate_limits"]["degraded"] is True
    assert ready["rate_limits"]["store_errors"] >= 1


async def test_redis_down_fails_closed_when_configured(
    upstream: Upstream, redis_server: RedisServer, http: httpx.AsyncClient
) -> None:
    config = settings(
        upstream.base_url,
        rpm=100,
        rate_limits=redis_limits(redis_server, on_store_error="closed"),
    )
    async with run_gateway(config) as gw:
        redis_server.kill()
        refused = await chat(http, gw.base_url)
    assert refused.status_code == 503
    assert refused.headers["retry-after"]
    assert upstream.stats.requests == 0


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A Redis URL whose server accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


async def test_a_redis_that_never_answers_costs_at_most_the_timeout(
    upstream: Upstream, black_hole: str, http: httpx.AsyncClient
) -> None:
    """One request waits out the 50 ms cap; then the breaker skips Redis and none waits."""
    config = settings(
        upstream.base_url, rpm=100, rate_limits={"store": "redis", "redis_url": black_hole}
    )
    async with run_gateway(config) as gw:
        answers = [await chat(http, gw.base_url) for _ in range(5)]
        ready = (await http.get(gw.url + "/readyz")).json()
    assert [a.status_code for a in answers] == [200] * 5
    assert ready["rate_limits"]["store_errors"] == 1  # only the first asked Redis


async def test_limiter_unit_with_real_redis(redis_server: RedisServer) -> None:
    """The Lua script on a real server: charges, refusals and the reset arithmetic."""
    from gateway.latency import connect_redis

    client = connect_redis(redis_server.url, wait_for_connection=True, max_connections=8)
    limiter = RateLimiter(RateLimitSpec(), client)
    principal = Principal(name="p", rpm=2, tpm=100)
    try:
        first = await limiter.take(principal, 40)
        assert first.source == "redis"
        assert first.requests is not None and first.requests.remaining == 1
        assert first.tokens is not None and first.tokens.remaining == 60
        with pytest.raises(Exception, match="tokens per min") as over:
            await limiter.take(principal, 70)
        assert over.value.headers["retry-after"] in ("6", "7")  # type: ignore[attr-defined]
        limiter.settle(principal, -40)
        async with asyncio.timeout(2):
            while True:  # settling is not awaited by the request: poll its effect
                state = await client.hget("tg:rl:{p}:tokens", "l")
                if state is not None and float(state) > 95:
                    break
                await asyncio.sleep(0.01)
    finally:
        await limiter.aclose()


async def test_a_request_refused_after_its_charge_gets_its_tokens_back(
    upstream: Upstream, http: httpx.AsyncClient
) -> None:
    async with run_gateway(settings(upstream.base_url, tpm=1000)) as gw:
        unknown = await http.post(
            gw.base_url + "/chat/completions",
            json={"model": "nope", "messages": CHAT, "max_tokens": 900},
            headers=bearer(),
        )
        fits = await chat(http, gw.base_url, max_tokens=900)
    assert unknown.status_code == 404
    assert fits.status_code == 200


async def test_anthropic_clients_get_anthropic_headers() -> None:
    """On /v1/messages the limits are spelled as Anthropic's API does, and a refusal is the
    Anthropic SDK's RateLimitError."""
    import anthropic

    from tests.conftest import serve
    from tests.fakes.anthropic_upstream import AnthropicFake

    async with serve(AnthropicFake()) as url:
        config = gateway_settings(
            {"claude": {"type": "anthropic", "base_url": url, "api_key": "sk-ant-x"}},
            [{"name": "m", "deployments": [{"provider": "claude", "model": "claude-x"}]}],
            auth={"keys": [{"name": "team", "sha256": KEY_HASH, "rpm": 1}]},
        )
        async with (
            run_gateway(config) as gw,
            anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0) as client,
        ):
            first = await client.messages.with_raw_response.create(
                model="m", max_tokens=8, messages=CHAT
            )
            with pytest.raises(anthropic.RateLimitError) as refused:
                await client.messages.create(model="m", max_tokens=8, messages=CHAT)
    assert first.headers["anthropic-ratelimit-requests-limit"] == "1"
    assert first.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert first.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    assert "x-ratelimit-limit-requests" not in first.headers
    assert refused.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(refused.value.response.headers["retry-after"]) > 0
