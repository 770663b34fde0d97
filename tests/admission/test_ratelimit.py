"""Per-key requests and tokens per minute: the buckets, OpenAI's headers, and the limits shared
by replicas through a real Redis, including when that Redis is down or never answers."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.admission.auth import Principal, new_key
from gateway.admission.ratelimit import (
    LocalBuckets,
    RateLimiter,
    duration,
    estimate_tokens,
    open_rate_limiter,
)
from gateway.admission.validate import parse_call
from gateway.config import RateLimitSpec
from gateway.errors import KeyRateLimitedError
from gateway.latency import MemoryLatencyStore, Sample
from gateway.models import Call, Endpoint
from gateway.redis import connect_redis
from tests.conftest import RedisServer, Upstream, gateway_settings, run_gateway
from tests.faults.wire import RedisProxy
from tests.telemetry.test_metrics import scrape_when
from tests.timing import eventually, scaled

REQUESTS = "tailguard_requests_total"

KEY, KEY_HASH = new_key()
ADMIN, ADMIN_HASH = new_key()  # /readyz's detail is for admins
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
            "admin_keys": [{"name": "ops", "sha256": ADMIN_HASH}],
            "rate_limits": rate_limits or {},
        },
    )


async def readiness(http: httpx.AsyncClient, url: str) -> Any:
    return (await http.get(url + "/readyz", headers={"authorization": f"Bearer {ADMIN}"})).json()


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


def seconds(spelled: str) -> float:
    """A duration as OpenAI's reset headers spell it (`120ms`, `1.5s`, `6m0s`), in seconds."""
    if spelled.endswith("ms"):
        return float(spelled[:-2]) / 1000
    minutes, _, rest = spelled[:-1].rpartition("m")
    return 60 * int(minutes or 0) + float(rest)


def test_durations_as_openai_spells_them() -> None:
    assert duration(0.12) == "120ms"
    assert duration(1.0) == "1s"
    assert duration(1.42) == "1.5s"
    assert duration(360) == "6m0s"
    assert duration(61.2) == "1m2s"
    assert [seconds(duration(s)) for s in (0.12, 1.5, 59.5, 360)] == [0.12, 1.5, 59.5, 360]


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
    prompt, total = estimate_tokens(400, max_tokens=50, n=2, expected_output=7)
    assert (prompt, total) == (100, 200)
    # Without max_tokens: what the model is expected to write, for every choice; never nothing.
    assert estimate_tokens(0, None, 2, expected_output=300) == (1, 601)
    assert estimate_tokens(0, None, 1, expected_output=0) == (1, 2)
    assert estimate_tokens(40, 0, 1, expected_output=300) == (10, 10)  # asked for none


async def test_what_a_request_without_max_tokens_is_charged() -> None:
    """The mean output its model was seen to write (before any, the configured default), for
    each choice, capped so that the request alone fits the key's tpm; an embeddings request
    writes nothing, and a max_tokens asked for is charged as asked."""
    store = MemoryLatencyStore()
    limiter = RateLimiter(RateLimitSpec(default_output_tokens=700), None)
    key = Principal(name="k", tpm=10_000)

    def call(endpoint: Endpoint, **body: Any) -> Call:
        return parse_call(endpoint, orjson.dumps({"model": "m", **body}))

    def charged(principal: Principal, request: Call) -> int:
        prompt, total = limiter.estimate(principal, request, store)
        assert prompt == len(request.raw) // 4
        return total - prompt

    two = call("chat", messages=CHAT, n=2)
    completion = call("completions", prompt="hi")
    assert (charged(key, two), charged(key, completion)) == (1400, 700)
    for _ in range(3):
        store.record(Sample("up/m", "m", ok=True, total_s=0.1, output_tokens=300))
    await store.refresh()
    assert (charged(key, two), charged(key, completion)) == (600, 300)
    assert charged(key, call("embeddings", input="hi")) == 0
    assert charged(key, call("chat", messages=CHAT, max_tokens=20_000)) == 20_000
    small = Principal(name="s", tpm=400)
    assert charged(small, two) == 2 * ((400 - len(two.raw) // 4) // 2)  # it fits the 400


# --- through the gateway, one replica ----------------------------------------------------------


async def test_requests_per_minute_with_openai_headers(
    upstream: Upstream, http: httpx.AsyncClient
) -> None:
    """Every answer to a limited key carries x-ratelimit-*; over the limit it is a 429 with
    retry-after that the SDK raises as RateLimitError, and nothing goes upstream."""
    async with run_gateway(settings(upstream.base_url, rpm=3)) as gw:
        began = time.monotonic()
        answers = [await chat(http, gw.base_url) for _ in range(3)]
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0) as sdk:
            with pytest.raises(openai.RateLimitError) as refused:
                await sdk.chat.completions.create(model="m", messages=CHAT)
        took = time.monotonic() - began  # the bucket refilled for this long (a busy machine)
        metrics = await scrape_when(http, gw.url, lambda s: s.value(REQUESTS) >= 4)
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0"]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    # Full again 60 s after the first request (20 s a request), less what has passed since.
    assert 60 - took - 0.1 <= seconds(answers[2].headers["x-ratelimit-reset-requests"]) <= 60
    response = refused.value.response
    assert refused.value.code == "rate_limit_exceeded"
    assert refused.value.type == "requests"
    assert 20 - took <= int(response.headers["retry-after"]) <= 20
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


# A healthy Redis answers well within this even when the machine is busy (the default 50 ms is
# missed when redis-server waits for a CPU): for tests about what Redis stores, not its speed.
CHECK_MS = min(1000, round(scaled(250)))


def redis_limits(server: RedisServer, **extra: Any) -> dict[str, Any]:
    return {"store": "redis", "redis_url": server.url, "timeout_ms": CHECK_MS, **extra}


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
        ready = [(await readiness(http, g.url))["rate_limits"] for g in (one, two)]
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
        ready = await readiness(http, gw.url)
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
        ready = await readiness(http, gw.url)
    assert [a.status_code for a in answers] == [200] * 5
    assert ready["rate_limits"]["store_errors"] == 1  # only the first asked Redis


async def test_limiter_unit_with_real_redis(redis_server: RedisServer) -> None:
    """The Lua script on a real server: charges, refusals and the reset arithmetic."""
    client = connect_redis(redis_server.url, wait_for_connection=True, max_connections=8)
    limiter = RateLimiter(RateLimitSpec(timeout_ms=CHECK_MS), client)
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

        async def settled() -> bool:  # settling is not awaited by the request: poll its effect
            state = await client.hget("tg:rl:{p}:tokens", "l")
            return state is not None and float(state) > 95

        await eventually(settled, within_s=2, what="the settle to reach Redis", every_s=0.01)
    finally:
        await limiter.aclose()


async def evalsha_calls(client: Any) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_settles_of_a_key_are_summed_into_one_round_trip(redis_server: RedisServer) -> None:
    """Many requests' corrections of one key within the settle interval reach Redis as one
    script call carrying their sum; shutting down sends what is still owed."""
    client = connect_redis(redis_server.url, wait_for_connection=True, max_connections=8)
    limiter = RateLimiter(RateLimitSpec(timeout_ms=CHECK_MS), client)
    principal = Principal(name="s", tpm=10_000)
    try:
        await limiter.take(principal, 5_000)  # the bucket now holds 5,000
        before = await evalsha_calls(client)
        for _ in range(50):
            limiter.settle(principal, -20)  # 1,000 tokens back in all

        async def summed() -> bool:
            state = await client.hget("tg:rl:{s}:tokens", "l")
            return state is not None and float(state) >= 6_000

        await eventually(summed, within_s=2, what="the settles to reach Redis", every_s=0.01)
        assert await evalsha_calls(client) - before == 1
        limiter.settle(principal, -1_000)
        await limiter.aclose()  # flushes the correction instead of dropping it
        reader = connect_redis(redis_server.url, wait_for_connection=True, max_connections=1)
        state = await reader.hget("tg:rl:{s}:tokens", "l")
        await reader.aclose()
        assert state is not None and float(state) >= 7_000
    finally:
        await limiter.aclose()


async def test_checks_of_a_key_in_one_loop_turn_share_one_round_trip(
    redis_server: RedisServer,
) -> None:
    """Eight requests of one key arriving together are checked by one script call, in order: the
    first five of an rpm of 5 are let through with a falling remainder, the other three refused.
    Another key's checks go in their own call."""
    client = connect_redis(redis_server.url, wait_for_connection=True, max_connections=8)
    limiter = RateLimiter(RateLimitSpec(timeout_ms=CHECK_MS), client)
    burst, other = Principal(name="burst", rpm=5), Principal(name="other", rpm=5)
    try:
        await limiter.take(other, 0)  # the script is loaded: what follows is EVALSHA alone
        before = await evalsha_calls(client)
        results = await asyncio.gather(
            *(limiter.take(burst, 0) for _ in range(8)),
            limiter.take(other, 0),
            return_exceptions=True,
        )
        assert await evalsha_calls(client) - before == 2
        allowed = [r for r in results[:8] if not isinstance(r, BaseException)]
        refused = [r for r in results[:8] if isinstance(r, BaseException)]
        assert [v.requests.remaining for v in allowed if v.requests is not None] == [4, 3, 2, 1, 0]
        assert len(refused) == 3 and all("requests per min" in str(r) for r in refused)
        assert not isinstance(results[8], BaseException)
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


# --- tokens per minute when the request sets no max_tokens ---------------------------------------

WARM, WARM_HASH = new_key()
TPM = 12_000
WRITES = 3000  # what the simulated model writes when nothing caps it
EXPECTED = 2500  # what the gateway expects it to write, in every variant below


def burst_settings(upstream_url: str, expected: str, store: dict[str, Any]) -> Any:
    key: dict[str, Any] = {"name": "team", "sha256": KEY_HASH, "tpm": TPM}
    limits = dict(store)
    if expected == "configured":
        limits["default_output_tokens"] = EXPECTED
    elif expected == "key_cap":
        key["max_tokens"] = EXPECTED
    return gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream_url}},
        [{"name": "m", "deployments": [{"provider": "up", "model": f"m@output_tokens={WRITES}"}]}],
        auth={
            "keys": [key, {"name": "warm", "sha256": WARM_HASH}],
            "admin_keys": [{"name": "ops", "sha256": ADMIN_HASH}],
            "rate_limits": limits,
        },
    )


@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("expected", ["observed", "configured", "key_cap"])
async def test_a_burst_without_max_tokens_stays_within_tpm_and_its_debt_is_owed(
    upstream: Upstream,
    redis_server: RedisServer,
    http: httpx.AsyncClient,
    store: str,
    expected: str,
) -> None:
    """20 concurrent requests without max_tokens on a key with a tpm: each is charged what its
    model is expected to write (the mean output it was seen to write, else the configured
    default, or the key's max_tokens cap), so the burst uses at most the tpm and one request
    more. What they used beyond their charge is owed: the next request waits for it too."""
    limits = redis_limits(redis_server, timeout_ms=3000) if store == "redis" else {}
    async with run_gateway(burst_settings(upstream.base_url, expected, limits)) as gw:
        if expected == "observed":  # another key's requests teach the gateway the model's length
            warm = {"authorization": f"Bearer {WARM}"}
            body = {"model": "m", "messages": CHAT, "max_tokens": EXPECTED}
            for _ in range(3):
                answer = await http.post(gw.base_url + "/chat/completions", json=body, headers=warm)
                assert answer.status_code == 200

            async def learnt() -> bool:
                admin = {"authorization": f"Bearer {ADMIN}"}
                seen = (await http.get(gw.url + "/admin/latency", headers=admin)).json()
                return bool(seen["models"].get("m", {}).get("output_tokens_mean") == EXPECTED)

            await eventually(learnt)
        started = time.monotonic()
        answers = await asyncio.gather(*(chat(http, gw.base_url) for _ in range(20)))
        used = [a.json()["usage"]["total_tokens"] for a in answers if a.status_code == 200]
        assert len(used) >= 2 and {a.status_code for a in answers} == {200, 429}
        assert sum(used) <= TPM + max(used), used
        owed = sum(used) - TPM

        async def refused_until_owed() -> bool:
            # Refused until the bucket holds the next charge (at least EXPECTED) on top of what
            # is owed, less what it refilled since the burst began.
            answer = await chat(http, gw.base_url)
            assert answer.status_code == 429, answer.text
            wait_s = int(answer.headers["retry-after-ms"]) / 1000
            return bool(wait_s >= (EXPECTED + owed) * 60 / TPM - (time.monotonic() - started))

        # Settling is not awaited by the request: poll its effect.
        await eventually(refused_until_owed, what=f"a wait for the {owed} tokens owed")


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_debt_beyond_a_whole_minute_is_carried(redis_server: RedisServer, store: str) -> None:
    """A request that used far more than it was charged leaves the bucket owing more than a
    minute's allowance: the key is refused until all of it has refilled (Redis keeps the bucket
    that long), none of it forgiven."""
    client = None
    if store == "redis":
        client = connect_redis(redis_server.url, wait_for_connection=True, max_connections=8)
    limiter = RateLimiter(RateLimitSpec(timeout_ms=3000), client)
    principal = Principal(name="p", tpm=100)
    try:
        await limiter.take(principal, 50)
        limiter.settle(principal, 350)  # it used 400 tokens: the bucket owes 300

        async def settled() -> bool:
            if client is None:
                return True
            level = await client.hget("tg:rl:{p}:tokens", "l")
            return level is not None and float(level) < -290

        await eventually(settled)
        with pytest.raises(KeyRateLimitedError) as refused:
            await limiter.take(principal, 10)
        if client is not None:
            assert await client.pttl("tg:rl:{p}:tokens") >= 185_000
    finally:
        await limiter.aclose()
    # (10 + 300) tokens at 100 a minute.
    assert 185 <= int(refused.value.headers["retry-after"]) <= 187


# --- the store's breaker --------------------------------------------------------------------------


def busy(seconds: float) -> None:
    """Hold the event loop with CPU-bound work, as a saturated gateway does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_a_busy_event_loop_does_not_trip_the_breaker(redis_server: RedisServer) -> None:
    """Redis answers a limit check at once, but the loop is busy past the timeout before it reads
    the answer: the time was the loop's, not Redis's, so the answer counts (the check is
    Redis's, the shared bucket charged) and the breaker stays closed."""
    timeout_s = CHECK_MS / 1000  # Redis's answer (through the proxy) comes well within it
    async with RedisProxy(redis_server.port, delay_s=0.0005) as proxy:
        limits = {"store": "redis", "redis_url": proxy.url, "timeout_ms": CHECK_MS}
        limiter = open_rate_limiter(settings("http://127.0.0.1:9", rpm=100, rate_limits=limits))
        principal = Principal(name="team", rpm=100)
        try:
            await limiter.take(principal, 1)  # connected, and the script loaded
            seen, lagged = proxy.delayed, limiter.loop_lag_waits
            check = asyncio.ensure_future(limiter.take(principal, 1))
            await proxy.wait_for(lambda p: p.delayed > seen)  # Redis has answered
            busy(timeout_s * 1.5)  # the timer fires far later than due
            verdict = await check
            health = limiter.health()
        finally:
            await limiter.aclose()
    assert verdict.source == "redis"
    assert verdict.requests is not None and verdict.requests.remaining == 98
    assert health["store_errors"] == 0 and health["degraded"] is False
    assert health["loop_lag_waits"] == lagged + 1  # the wait extended once, for the burst
