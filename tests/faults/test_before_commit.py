"""Upstream failures before the first token: error statuses, refused and reset connections.

Before the first token the gateway may still choose: a retryable failure moves on to the next
candidate, and with none left the client gets one OpenAI-shaped error whose status sums up the
attempts. Nothing is left open either way.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import httpx
import openai
import orjson
import pytest

from tests.conftest import Upstream, free_port, run_gateway
from tests.faults.conftest import MESSAGES, routed, sdk, settled
from tests.faults.scripts import answer, reset_before_headers
from tests.faults.wire import RawUpstream, Script
from tests.timing import scaled

OPENAI_500 = orjson.dumps({"error": {"message": "boom", "type": "server_error", "code": None}})
RATE_LIMITED = orjson.dumps({"error": {"message": "slow down", "type": "rate_limit_error"}})
OVERLOADED = orjson.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "x"}})

FAULTS: dict[str, tuple[Script, int, str]] = {
    # name: (what the upstream does, the status the client gets, its error code)
    "500": (answer(500, OPENAI_500), 502, "all_candidates_failed"),
    "429": (
        answer(429, RATE_LIMITED, headers={"retry-after": "1"}),
        429,
        "rate_limit_exceeded",
    ),
    "529": (answer(529, OVERLOADED), 503, "upstream_overloaded"),
}


async def complete(client: openai.AsyncOpenAI, *, stream: bool) -> str:
    """One chat completion through the SDK; the text it carried."""
    if not stream:
        completion = await client.chat.completions.create(model="m", messages=MESSAGES)
        return completion.choices[0].message.content or ""
    chunks = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
@pytest.mark.parametrize("fault", list(FAULTS))
async def test_error_status_without_fallback_is_one_clean_error(fault: str, stream: bool) -> None:
    """With nothing to fall back on, an upstream 5xx / 429 / 529 reaches the SDK as the matching
    exception, naming the deployment, after exactly one upstream request."""
    script, status, code = FAULTS[fault]
    async with RawUpstream(script) as up, run_gateway(routed(up.base_url, "bad")) as gw:
        async with sdk(gw) as client, asyncio.timeout(scaled(5)):
            with pytest.raises(openai.APIStatusError) as caught:
                await complete(client, stream=stream)
        await settled(up.url)
    error = caught.value
    assert error.status_code == status
    assert error.code == code
    assert "p/bad" in error.message
    assert up.requests == 1
    if fault == "429":
        assert error.response.headers["retry-after"] == "1"


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_error_status_with_fallback_is_served_by_the_fallback(
    fault: str, upstream: Upstream
) -> None:
    """With a fallback, the same failures are invisible to the client: the fallback answers and
    the headers say so (and tell the SDK not to retry on top)."""
    script = FAULTS[fault][0]
    async with RawUpstream(script) as up:
        settings = routed(up.base_url, "bad", upstream.base_url)
        async with run_gateway(settings) as gw, sdk(gw) as client, asyncio.timeout(scaled(5)):
            raw = await client.chat.completions.with_raw_response.create(
                model="m", messages=MESSAGES, stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in raw.parse()])
            await settled(up.url)
            await settled(upstream.url, at_most=1)
    assert text
    assert raw.headers["x-tailguard-route"] == "error_fallback"
    assert raw.headers["x-tailguard-deployment"] == "f/ok"
    assert raw.headers["x-should-retry"] == "false"
    assert up.requests == 1 and upstream.stats.completed == 1


HUGE_429 = answer(429, RATE_LIMITED, headers={"retry-after": "99999"})


async def test_huge_retry_after_is_capped_for_the_client() -> None:
    """An absurd `retry-after` from the upstream is not passed on: the client is told to wait at
    most as long as the deployment cools down (capped at `routing.cooldown.max_s`)."""
    async with (
        RawUpstream(HUGE_429) as up,
        run_gateway(routed(up.base_url, "bad")) as gw,
        sdk(gw) as client,
        asyncio.timeout(scaled(5)),
    ):
        with pytest.raises(openai.RateLimitError) as caught:
            await complete(client, stream=True)
    assert caught.value.response.headers["retry-after"] == "60"


async def test_huge_retry_after_cooldown_is_capped(client: httpx.AsyncClient) -> None:
    """An absurd `retry-after` cools the deployment down for at most `max_s` (60 s); with
    nowhere else to go the next request is still sent (as the probe), and the client is told a
    bounded `retry-after` again."""
    async with RawUpstream(HUGE_429) as up, run_gateway(routed(up.base_url, "bad")) as gw:
        async with sdk(gw) as openai_client, asyncio.timeout(scaled(5)):
            with pytest.raises(openai.RateLimitError):
                await complete(openai_client, stream=True)
            latency = (await client.get(gw.url + "/admin/latency")).json()
            with pytest.raises(openai.RateLimitError) as again:
                await complete(openai_client, stream=True)
        await settled(up.url)
    assert again.value.response.headers["retry-after"] == "60"
    until = latency["deployments"]["p/bad"]["cooldown_until"]
    assert 50 < until - time.time() <= 60 * 1.1  # capped (and jittered at most 10%)
    assert up.requests == 2


@pytest.mark.parametrize("fallback", [False, True], ids=["alone", "fallback"])
async def test_connect_refused(upstream: Upstream, fallback: bool) -> None:
    """A deployment whose port refuses connections fails fast: a 502 naming it, or the fallback."""
    dead = f"http://127.0.0.1:{free_port()}/v1"
    settings = routed(dead, "gone", upstream.base_url if fallback else None)
    async with run_gateway(settings) as gw, sdk(gw) as client, asyncio.timeout(scaled(5)):
        started = time.perf_counter()
        if fallback:
            assert await complete(client, stream=True)
        else:
            with pytest.raises(openai.InternalServerError) as caught:
                await complete(client, stream=True)
            assert caught.value.status_code == 502
            assert "p/gone" in caught.value.message
        elapsed = time.perf_counter() - started
        await settled(dead, upstream.url, at_most=1)
    assert elapsed < scaled(1.0)


@pytest.mark.parametrize("read_first", [False, True], ids=["on-accept", "after-request"])
@pytest.mark.parametrize("how", ["reset", "close"])
async def test_reset_before_headers_falls_back(
    upstream: Upstream, how: Literal["reset", "close"], read_first: bool
) -> None:
    """An upstream that drops the connection before any header (an RST or a FIN, before or after
    reading the request) is a connection error: the fallback serves, nothing stays open."""
    script = reset_before_headers(how=how, read_first=read_first)
    async with RawUpstream(script) as up:
        settings = routed(up.base_url, "rude", upstream.base_url)
        async with run_gateway(settings) as gw, sdk(gw) as client, asyncio.timeout(scaled(5)):
            for stream in (True, False):
                assert await complete(client, stream=stream)
            await settled(up.url)
    assert up.accepted == 2 and up.open == 0


async def test_reset_before_headers_without_fallback_is_502() -> None:
    """With nothing to fall back on, a reset before headers is a 502 naming the deployment."""
    script = reset_before_headers(how="reset", read_first=True)
    async with RawUpstream(script) as up, run_gateway(routed(up.base_url, "rude")) as gw:
        async with sdk(gw) as client, asyncio.timeout(scaled(5)):
            with pytest.raises(openai.InternalServerError) as caught:
                await complete(client, stream=True)
        await settled(up.url)
    assert caught.value.status_code == 502
    assert caught.value.code == "all_candidates_failed"
    assert "p/rude" in caught.value.message
