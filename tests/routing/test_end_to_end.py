"""Latency-budget routing end to end: deadlines, failover, hedging, cooldowns and the retry budget.

Each deployment is its own simulated server on loopback, so a test can tell which upstream saw a
request and which saw its stream closed.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx
import orjson

from gateway.telemetry import semconv as sc
from tests.conftest import Upstream, gateway_settings, run_gateway
from tests.latency.test_end_to_end import count, poll_latency, tailguard
from tests.telemetry.test_metrics import scrape_when
from tests.timing import scaled, slowdown

CHAT = {"messages": [{"role": "user", "content": "Say something."}]}


def routed(
    primary: Upstream,
    fallback: Upstream,
    first: str,
    second: str = "ok",
    *,
    prior_ms: float | None = 50.0,
    **model: Any,
) -> Any:
    """Model `m` on `first` (at the primary upstream) with fallback model `b` on `second` (at the
    fallback upstream), whose expected TTFT is `prior_ms` until it has statistics."""
    prior = {"prior": {"ttft_ms": prior_ms}} if prior_ms is not None else {}
    top = {key: model.pop(key) for key in ("routing", "latency") if key in model}
    return gateway_settings(
        {
            "p": {"type": "vllm", "base_url": primary.base_url},
            "f": {"type": "vllm", "base_url": fallback.base_url},
        },
        [
            {
                "name": "m",
                "deployments": [{"provider": "p", "model": first}],
                "fallbacks": ["b"],
                **model,
            },
            {"name": "b", "deployments": [{"provider": "f", "model": second, **prior}]},
        ],
        **top,
    )


async def stream(
    client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None
) -> tuple[httpx.Response, list[str], float]:
    """One streamed chat request: the response, its non-empty lines, and the client's TTFT."""
    started = time.perf_counter()
    ttft = -1.0
    lines: list[str] = []
    body = {"model": "m", "stream": True, **CHAT}
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=body, headers=headers
    ) as resp:
        async for line in resp.aiter_lines():
            if line:
                if ttft < 0 and '"content"' in line:
                    ttft = time.perf_counter() - started
                lines.append(line)
    return resp, lines, ttft


def events(lines: list[str]) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in lines if line.startswith("data: {")]


def attempt_ms(resp: httpx.Response, index: int) -> tuple[float, str]:
    """Duration and description of attempt `index` (1-based) from `server-timing`."""
    found = re.search(
        rf'attempt{index};dur=([0-9.]+);desc="([^"]*)"', resp.headers["server-timing"]
    )
    assert found is not None, resp.headers["server-timing"]
    return float(found.group(1)), found.group(2)


# --- TTFT deadlines ------------------------------------------------------------------------------


async def test_stalled_primary_is_cut_at_its_deadline(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """The deadline is the budget minus the fallback's padded expected TTFT (400 - 1.1 x 100 =
    290 ms): a primary that never sends a byte is cut then, not later, and the fallback serves."""
    settings = routed(primary, fallback, "slow@stall_rate=1", prior_ms=100, budget={"ttft_ms": 400})
    async with run_gateway(settings) as gw:
        resp, lines, ttft = await stream(client, gw.url)
        async with asyncio.timeout(scaled(5)):
            await primary.stats.wait_for(lambda s: s.cancelled == 1)  # the upstream saw the close
        # Beside attainment: served by the fallback model, rescued at the deadline.
        assert await fallback_routes(client, gw.url, 1) == {"ttft_failover": 1}
    assert resp.status_code == 200
    assert lines[-1] == "data: [DONE]"
    assert resp.headers["x-tailguard-route"] == "ttft_failover"
    assert resp.headers["x-tailguard-deployment"] == "f/ok"
    assert resp.headers["x-should-retry"] == "false"
    cut_ms, desc = attempt_ms(resp, 1)
    assert desc == "p/slow@stall_rate=1 ttft_deadline"
    assert 270 <= cut_ms <= 310  # 290 ms after arrival, less the few ms before the attempt
    assert ttft < 0.4
    assert fallback.stats.requests == 1


async def test_last_candidate_is_not_cut_by_the_ttft_budget(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """With nothing left to rescue it, a slow attempt is waited for: better late than an error."""
    settings = routed(
        primary,
        fallback,
        "slow@stall_rate=1",
        "late@prefill_base_ms=400",
        budget={"ttft_ms": 200},
    )
    async with run_gateway(settings) as gw:
        resp, lines, ttft = await stream(client, gw.url)
    assert resp.status_code == 200
    assert lines[-1] == "data: [DONE]"
    assert resp.headers["x-tailguard-deployment"] == "f/late@prefill_base_ms=400"
    assert ttft > 0.4


# --- hedging -------------------------------------------------------------------------------------


async def fallback_routes(client: httpx.AsyncClient, url: str, served: int) -> dict[str, int]:
    """Model `m`'s fallback-served counts by route in `/admin/latency`, once `served` are in
    (a request's outcome is recorded as its stream ends, maybe after the client read it)."""
    body = await poll_latency(
        client, url, lambda b: b["counters"]["fallback"]["m"]["served"] >= served
    )
    routes: dict[str, int] = body["counters"]["fallback"]["m"]["routes"]
    return routes


def hedged(primary: Upstream, fallback: Upstream, first: str, second: str = "ok") -> Any:
    return routed(
        primary,
        fallback,
        first,
        second,
        budget={"ttft_ms": 400},
        on_ttft_miss="hedge",
        hedge_max_fraction=1.0,
    )


async def test_hedge_wins_and_the_primary_is_closed(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """At the deadline a hedge starts without cancelling the primary; the hedge's first token
    wins, the primary's stream is closed at once, and the client gets one clean stream."""
    settings = hedged(primary, fallback, "slow@prefill_base_ms=2000")
    async with run_gateway(settings) as gw:
        resp, lines, _ = await stream(client, gw.url)
        async with asyncio.timeout(scaled(1)):
            await primary.stats.wait_for(lambda s: s.cancelled == 1)
        assert await fallback_routes(client, gw.url, 1) == {"hedge": 1}
    assert resp.status_code == 200
    assert resp.headers["x-tailguard-route"] == "hedge"
    assert resp.headers["x-tailguard-deployment"] == "f/ok"
    assert resp.headers["x-tailguard-attempts"] == "2"
    assert attempt_ms(resp, 1)[1] == "p/slow@prefill_base_ms=2000 hedge_lost"
    assert primary.stats.requests == 1 and fallback.stats.requests == 1
    # One stream: one id, one role delta, the fallback's five tokens, one finish, one [DONE].
    chunks = events(lines)
    assert len({c["id"] for c in chunks}) == 1
    assert sum(1 for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]) == 1
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finishes if f] == ["length"] or [f for f in finishes if f] == ["stop"]
    assert lines.count("data: [DONE]") == 1 and lines[-1] == "data: [DONE]"
    assert fallback.stats.completed == 1


async def test_primary_answering_first_beats_its_hedge(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """A primary that answers after the hedge started but before the hedge's first token wins,
    and the hedge is the one closed."""
    settings = hedged(primary, fallback, "late@prefill_base_ms=450", "slower@prefill_base_ms=2000")
    async with run_gateway(settings) as gw:
        resp, lines, _ = await stream(client, gw.url)
        async with asyncio.timeout(scaled(1)):
            await fallback.stats.wait_for(lambda s: s.cancelled == 1)
    assert resp.status_code == 200
    assert resp.headers["x-tailguard-deployment"] == "p/late@prefill_base_ms=450"
    assert resp.headers["x-tailguard-route"] == "primary"
    assert resp.headers["x-tailguard-attempts"] == "2"
    assert attempt_ms(resp, 2)[1] == "f/slower@prefill_base_ms=2000 cancelled"
    assert lines[-1] == "data: [DONE]"
    assert primary.stats.completed == 1


async def test_a_client_retry_is_not_hedged(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """A request the SDK marks as its own retry fails over instead of adding a hedge."""
    settings = hedged(primary, fallback, "slow@prefill_base_ms=2000")
    async with run_gateway(settings) as gw:
        resp, _, _ = await stream(client, gw.url, headers={"x-stainless-retry-count": "1"})
    assert resp.headers["x-tailguard-route"] == "ttft_failover"
    assert attempt_ms(resp, 1)[1].endswith("ttft_deadline")


async def test_hedges_are_capped(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """Over its cap, a slow attempt is not rescued at all, neither hedged nor failed over (that
    would be extra upstream load by another name): it is waited for."""
    settings = routed(
        primary,
        fallback,
        "slow@prefill_base_ms=2000",
        budget={"ttft_ms": 300},
        on_ttft_miss="hedge",
        hedge_max_fraction=0.05,  # an empty window allows one hedge (as if it held 20 requests)
    )
    async with run_gateway(settings) as gw:
        routes = [(await stream(client, gw.url))[0].headers["x-tailguard-route"] for _ in range(3)]
    assert routes == ["hedge", "primary", "primary"]


# --- errors before commit, cooldowns -------------------------------------------------------------


async def test_rate_limited_primary_fails_over_and_cools_down(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """A 429 moves on to the fallback and puts the deployment in cooldown for its retry-after:
    the next request does not try it at all."""
    settings = routed(primary, fallback, "busy@error_429_rate=1,retry_after_s=30")
    async with run_gateway(settings) as gw:
        first, _, _ = await stream(client, gw.url)
        second, _, _ = await stream(client, gw.url)
        assert await fallback_routes(client, gw.url, 2) == {"error_fallback": 2}
        latency = (await client.get(gw.url + "/admin/latency")).json()
    assert first.headers["x-tailguard-route"] == "error_fallback"
    assert first.headers["x-tailguard-attempts"] == "2"
    assert second.headers["x-tailguard-deployment"] == "f/ok"
    assert second.headers["x-tailguard-attempts"] == "1"
    assert second.headers["x-tailguard-route"] == "error_fallback"
    assert primary.stats.requests == 1
    until = latency["deployments"]["p/busy@error_429_rate=1,retry_after_s=30"]["cooldown_until"]
    assert 25 < until - time.time() <= 30


async def test_all_cooling_still_sends_the_request_as_a_probe(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """When every candidate is cooling down there is nowhere to route around to: the request is
    not refused but sent, one probe per deployment, and the upstreams' own answer (a 429 with
    its retry-after) reaches the client, as it would through a plain proxy."""
    settings = routed(
        primary,
        fallback,
        "busy@error_429_rate=1,retry_after_s=20",
        "busier@error_429_rate=1,retry_after_s=40",
    )
    async with run_gateway(settings) as gw:
        first, _, _ = await stream(client, gw.url)
        second = await client.post(
            gw.base_url + "/chat/completions", json={"model": "m", "stream": True, **CHAT}
        )
    assert first.status_code == 429
    assert second.status_code == 429
    assert second.json()["error"]["code"] != "deployments_cooling_down"
    assert 15 < int(second.headers["retry-after"]) <= 40
    assert primary.stats.requests == 2 and fallback.stats.requests == 2


async def test_repeated_failures_open_the_breaker(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """Three consecutive 500s open the breaker: later requests go straight to the fallback."""
    settings = routed(primary, fallback, "bad@error_500_rate=1")
    async with run_gateway(settings) as gw:
        attempts = [
            (await stream(client, gw.url))[0].headers["x-tailguard-attempts"] for _ in range(5)
        ]
    assert attempts == ["2", "2", "2", "1", "1"]
    assert primary.stats.requests == 3


async def test_a_first_failover_is_never_refused_by_the_retry_budget(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """With no retry budget at all, a request's first failover still goes to the fallback (it
    adds no load to the failing deployment): a healthy fallback serves, and a failing one is
    answered as it is, after exactly one failover."""
    budget: dict[str, Any] = {"routing": {"retry_budget": {"percent": 0, "min_concurrent": 0}}}
    healthy = routed(primary, fallback, "bad@error_500_rate=1", **budget)
    async with run_gateway(healthy) as gw:
        served = await client.post(gw.base_url + "/chat/completions", json={"model": "m", **CHAT})
    assert (served.status_code, served.headers["x-tailguard-route"]) == (200, "error_fallback")
    both = routed(primary, fallback, "bad@error_500_rate=1", "worse@error_500_rate=1", **budget)
    async with run_gateway(both) as gw:
        failed = await client.post(gw.base_url + "/chat/completions", json={"model": "m", **CHAT})
    assert failed.status_code == 502
    assert fallback.stats.requests == 2  # one per request: never a second failover


# --- after commit --------------------------------------------------------------------------------


async def test_no_failover_after_commit(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """Once tokens were sent, an upstream failure ends the stream with an error event: the
    fallback is not tried and no [DONE] follows."""
    settings = routed(primary, fallback, "cut@cut_rate=1,output_tokens=10")
    async with run_gateway(settings) as gw:
        resp, lines, _ = await stream(client, gw.url)
    assert resp.status_code == 200
    assert "data: [DONE]" not in lines
    assert orjson.loads(lines[-1][6:])["error"]["code"] == "upstream_stream_error"
    assert fallback.stats.requests == 0


async def test_total_budget_cuts_a_committed_stream_with_an_error_event(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """With `on_total_miss: cut`, a stream still running when the total budget ends is cut with
    an error event; no chunk claims it finished."""
    settings = routed(
        primary,
        fallback,
        "long@tokens_per_s=20,output_tokens=100",
        budget={"total_ms": 400},
        on_total_miss="cut",
    )
    async with run_gateway(settings) as gw:
        resp, lines, _ = await stream(client, gw.url)
        async with asyncio.timeout(scaled(1)):
            await primary.stats.wait_for(lambda s: s.cancelled == 1)
    assert resp.status_code == 200
    assert "data: [DONE]" not in lines
    assert orjson.loads(lines[-1][6:])["error"]["code"] == "upstream_timeout"
    finishes = [c["choices"][0].get("finish_reason") for c in events(lines) if c.get("choices")]
    assert not any(finishes)


async def test_a_committed_stream_past_the_total_budget_is_finished_and_counted_a_miss(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """By default (`on_total_miss: finish`) a stream still running when the total budget ends is
    delivered whole, as a plain proxy would deliver it, and counted as a missed total budget.
    (Before, it was cut into an error: the answer was lost for being a little late.)"""
    settings = routed(
        primary, fallback, "long@tokens_per_s=20,output_tokens=20", budget={"total_ms": 400}
    )
    judged = sc.SLO_REQUESTS + "_total"
    async with run_gateway(settings) as gw:
        resp, lines, _ = await stream(client, gw.url)
        found = await scrape_when(client, gw.url, lambda s: s.value(judged) >= 1)
    assert resp.status_code == 200
    assert lines[-1] == "data: [DONE]"
    finishes = [c["choices"][0].get("finish_reason") for c in events(lines) if c.get("choices")]
    assert finishes[-1] == "stop"
    assert primary.stats.cancelled == 0
    assert found.value(judged, model="m", slo="total", result="missed") == 1
    assert found.value(judged, slo="total", result="met") == 0


# --- the plan ------------------------------------------------------------------------------------

SLOW = "p/slow@prefill_base_ms=300"


def slow_primary(primary: Upstream, fallback: Upstream, **extra: Any) -> Any:
    """Model `m` on a primary slower than its 200 ms TTFT budget (no deadline rescue), trusted
    after 3 samples, with the fallback model beside it."""
    return routed(
        primary,
        fallback,
        SLOW.removeprefix("p/"),
        prior_ms=None,
        budget={"ttft_ms": 200},
        on_ttft_miss="none",
        latency={"min_samples": 3},
        **extra,
    )


async def test_plan_routes_around_a_deployment_slower_than_the_budget(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """Once the window trusts the primary's p99 TTFT and it misses the budget, requests start on
    the fallback (route `budget`) without trying the primary first."""
    settings = slow_primary(primary, fallback)
    async with run_gateway(settings) as gw:
        for _ in range(3):
            assert (await stream(client, gw.url))[0].headers["x-tailguard-route"] == "primary"
        await poll_latency(client, gw.url, count("deployments", SLOW, n=3))
        resp, _, _ = await stream(client, gw.url)
    assert resp.headers["x-tailguard-route"] == "budget"
    assert resp.headers["x-tailguard-deployment"] == "f/ok"
    assert resp.headers["x-tailguard-attempts"] == "1"
    assert primary.stats.requests == 3


async def test_what_a_fallback_model_serves_is_counted_by_route(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """A request routed to the fallback model for latency is counted in
    `tailguard_fallback_served` by the model asked for, the fallback and the route, and the
    same count is a headline figure next to attainment: in `/admin/latency` (what the
    dashboard draws), `tailguard stats` and `tailguard report`."""
    settings = slow_primary(primary, fallback)
    served = sc.FALLBACK_SERVED + "_total"
    async with run_gateway(settings) as gw:
        for _ in range(3):
            await stream(client, gw.url)
        await poll_latency(client, gw.url, count("deployments", SLOW, n=3))
        resp, _, _ = await stream(client, gw.url)
        found = await scrape_when(client, gw.url, lambda s: s.value(served) >= 1)
        latency = (await client.get(gw.url + "/admin/latency")).json()
        shown, report = await asyncio.gather(
            asyncio.to_thread(tailguard, "stats", "--url", gw.url),
            asyncio.to_thread(tailguard, "report", "--url", gw.url, "--format", "json"),
        )
    assert resp.headers["x-tailguard-route"] == "budget"
    assert found.value(served, model="m", fallback="b", route="budget") == 1
    assert found.value(served) == 1
    # Three requests on the primary, one moved to the fallback model for latency.
    headline = {
        "requests": 4,
        "served": 1,
        "share": 0.25,
        "routes": {"budget": 1},
        "fallbacks": {"b": 1},
    }
    assert latency["counters"]["fallback"]["m"] == headline
    # A configured model not asked for yet is there too, with nothing to share.
    assert latency["counters"]["fallback"]["b"] == {
        "requests": 0,
        "served": 0,
        "share": None,
        "routes": {},
        "fallbacks": {},
    }
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if line.split()[:1] == ["m"])
    assert "25.0% (1/4)" in row and "budget 1" in row, shown.stdout
    assert report.returncode == 0, report.stderr
    assert orjson.loads(report.stdout)["models"]["m"]["fallback_served"] == headline


async def test_max_fallback_share_keeps_the_requested_model_leading(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """With `max_fallback_share: 0`, a requested model the window says misses the budget still
    serves its requests while it is available (route budget_unattainable): no share of its
    traffic is moved to the fallback model for latency."""
    settings = slow_primary(primary, fallback, max_fallback_share=0)
    async with run_gateway(settings) as gw:
        for _ in range(3):
            await stream(client, gw.url)
        await poll_latency(client, gw.url, count("deployments", SLOW, n=3))
        resp, _, _ = await stream(client, gw.url)
    assert resp.headers["x-tailguard-route"] == "budget_unattainable"
    assert resp.headers["x-tailguard-deployment"] == SLOW
    assert fallback.stats.requests == 0


async def test_anthropic_ingress_uses_the_same_attempt_loop(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """`/v1/messages` gets the same deadline and failover, answered in Anthropic's stream format."""
    settings = routed(primary, fallback, "slow@stall_rate=1", budget={"ttft_ms": 300})
    body = {"model": "m", "max_tokens": 16, "stream": True, **CHAT}
    async with (
        run_gateway(settings) as gw,
        client.stream("POST", gw.url + "/v1/messages", json=body) as resp,
    ):
        text = (await resp.aread()).decode()
    assert resp.status_code == 200
    assert resp.headers["x-tailguard-route"] == "ttft_failover"
    assert resp.headers["x-tailguard-deployment"] == "f/ok"
    assert text.startswith("event: message_start")
    assert text.rstrip().endswith('data: {"type":"message_stop"}')


async def test_short_and_long_prompts_are_judged_by_their_own_size(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """A primary that prefills slowly serves short prompts well within the budget and long ones
    not at all; the fallback prefills fast. Once each size has been measured, short prompts stay
    on the primary and long ones go to the fallback: a few long samples no longer make the
    primary look slow for every prompt (before, its p99 over all sizes sent everything away).

    The samples are taught through `p-only`, a model on the primary alone: taught through `m`,
    a snapshot refreshed between two long prompts (every second, whenever a busy machine lets
    it) would rightly send the next one away before the primary had three of them. The budget
    and the simulated prefill times stretch by one factor, so a short prompt's scheduling delay
    on a busy machine stays as far inside the budget as on a quiet one."""
    k = slowdown()
    slow_prefill = f"p@prefill_base_ms={20 * k:.4g},prefill_ms_per_token={0.1 * k:.4g}"
    fast_prefill = f"f@prefill_base_ms={40 * k:.4g},prefill_ms_per_token={0.01 * k:.4g}"
    settings = gateway_settings(
        {
            "p": {"type": "openai", "base_url": primary.base_url},
            "f": {"type": "openai", "base_url": fallback.base_url},
        },
        [
            {
                "name": "m",
                "deployments": [{"provider": "p", "model": slow_prefill}],
                "fallbacks": ["b"],
                "budget": {"ttft_ms": round(300 * k)},
                "on_ttft_miss": "none",
            },
            {"name": "b", "deployments": [{"provider": "f", "model": fast_prefill}]},
            {"name": "p-only", "deployments": [{"provider": "p", "model": slow_prefill}]},
        ],
        latency={"min_samples": 3},
    )
    short = {"model": "m", "stream": True, **CHAT}
    long_ = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "w " * 8000}]}
    on_primary, on_fallback = "p/" + slow_prefill, "f/" + fast_prefill

    async def served(body: dict[str, Any]) -> str:
        async with client.stream("POST", gw.url + "/v1/chat/completions", json=body) as resp:
            await resp.aread()
        assert resp.status_code == 200
        return resp.headers["x-tailguard-deployment"]

    async with run_gateway(settings) as gw:
        for body in (short, long_):  # three of each size teach the primary both bands
            for _ in range(3):
                assert await served({**body, "model": "p-only"}) == on_primary
        await poll_latency(client, gw.url, count("deployments", on_primary, n=6))
        routes = [await served(short), await served(long_), await served(short)]
        fitted = (await client.get(gw.url + "/admin/latency")).json()["deployments"]
        stats = await asyncio.to_thread(tailguard, "stats", "--url", gw.url)
    # The fitted model: about 0.1·k ms a token, so ~25·k ms per KiB of "w " (2 chars a token).
    slope = fitted[on_primary]["ttft_model"]["p50"]["ms_per_kib"]
    assert 10 * k < slope < 60 * k, fitted[on_primary]["ttft_model"]
    assert "TTFT by prompt size (fitted)" in stats.stdout and "ms/KiB" in stats.stdout
    assert routes == [on_primary, on_fallback, on_primary]
