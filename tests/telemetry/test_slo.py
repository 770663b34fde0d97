"""SLO attainment end to end: real gateways and simulated upstreams on loopback. Each client
request is judged against the budgets it carried (TTFT, total, TPOT), and the verdicts show on
`GET /admin/latency`, `/metrics`, the request's span, the access log, `tailguard stats` and the
dashboard; `x-slo-ttft-ms` / `x-slo-tpot-ms` act as budgets.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
from playwright.async_api import expect

from gateway.api.openapi import build_openapi
from gateway.latency import BYTES_PER_TOKEN
from gateway.telemetry import semconv as sc
from tests.conftest import Upstream, gateway_settings, run_gateway
from tests.latency.test_end_to_end import poll_latency, tailguard
from tests.routing.test_end_to_end import routed
from tests.telemetry.test_access_log import lines
from tests.telemetry.test_dashboard import CHROMIUM, WAIT_MS, Watched, chromium
from tests.telemetry.test_metrics import scrape, scrape_when
from tests.telemetry.test_tracing import Collector, collector
from tests.timing import scaled

__all__ = ["collector"]  # a fixture, used by name

CHAT = {"messages": [{"role": "user", "content": "Say something."}]}
SLO_REQUESTS = sc.SLO_REQUESTS + "_total"
# TTFT ~100 ms, well inside the model's budgets and well outside a 20 ms one.
PACED = "paced@prefill_base_ms=100"
DEPLOYMENT = f"up/{PACED}"
BEYOND_MS = re.compile(r"^> [0-9,]+ ms$")  # a quantile known only to exceed its latest cut
Body = dict[str, Any]
BODY = orjson.dumps({"model": "m", "stream": True, **CHAT})


def paced(upstream: Upstream, model: str = PACED, **spec: Any) -> Any:
    """Model `m` on one deployment, with budgets it meets (TTFT 2 s, total 5 s) unless a
    request's header asks for less."""
    return gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [
            {
                "name": "m",
                "deployments": [{"provider": "up", "model": model}],
                "budget": {"ttft_ms": 2000, "total_ms": 5000},
                **spec,
            }
        ],
    )


async def stream(
    client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None, model: str = "m"
) -> httpx.Response:
    """One streamed chat request (its body exactly `BODY` for model `m`), read to its end."""
    body = orjson.dumps({"model": model, "stream": True, **CHAT})
    headers = {"content-type": "application/json", **(headers or {})}
    async with client.stream(
        "POST", url + "/v1/chat/completions", content=body, headers=headers
    ) as resp:
        await resp.aread()
    return resp


# Four requests with the model's budgets (met), four asking for a 20 ms first token, two of them
# in the Gateway API Inference Extension's spelling (missed), and one sending both headers, where
# the gateway's own wins (met): 5 of 9 meet their TTFT budget, all 9 their total budget.
MIXED: list[dict[str, str]] = [
    *[{}] * 4,
    *[{"x-tailguard-ttft-budget-ms": "20"}] * 2,
    *[{"x-slo-ttft-ms": "20"}] * 2,
    {"x-slo-ttft-ms": "20", "x-tailguard-ttft-budget-ms": "3000"},
]


def judged(kind: str, name: str, slo: str, n: int) -> Callable[[Body], bool]:
    """A `poll_latency` test: `n` requests judged on `slo` for the model or deployment."""

    def ready(body: Body) -> bool:
        target = body[kind].get(name)
        return target is not None and target["slo"][slo]["judged"] == n

    return ready


async def test_attainment_counts_the_requests_that_missed_their_ttft_budget(
    upstream: Upstream,
    client: httpx.AsyncClient,
    collector: Collector,
    access: pytest.LogCaptureFixture,
) -> None:
    """5 of 9 streams meet their TTFT budget (the alias header counts, the gateway's header wins
    over it): /admin/latency's attainment per model and deployment, the /metrics counters, each
    request's span and its access line all say so; every one met the total budget."""
    async with run_gateway(paced(upstream), environ=collector.env) as gw:
        for headers in MIXED:
            resp = await stream(client, gw.url, headers)
            assert resp.status_code == 200
        body = await poll_latency(client, gw.url, judged("models", "m", "ttft", len(MIXED)))
        metrics = await scrape(client, gw.url)
    for target in (body["models"]["m"], body["deployments"][DEPLOYMENT]):
        slo = target["slo"]
        assert slo["ttft"] == {"met": 5, "judged": 9, "attainment": round(5 / 9, 4)}
        assert slo["total"] == {"met": 9, "judged": 9, "attainment": 1.0}
        assert slo["tpot"]["judged"] == 0
    labels = {"model": "m", "deployment": DEPLOYMENT}
    assert metrics.value(SLO_REQUESTS, **labels, slo="ttft", result="met") == 5
    assert metrics.value(SLO_REQUESTS, **labels, slo="ttft", result="missed") == 4
    assert metrics.value(SLO_REQUESTS, **labels, slo="total", result="met") == 9
    assert metrics.value(SLO_REQUESTS, **labels, slo="total", result="missed") == 0
    assert metrics.matching(SLO_REQUESTS, slo="tpot") == []

    # The app's lifespan is over: every span was exported.
    servers = collector.receiver.of_kind("SERVER")
    assert len(servers) == len(MIXED)
    ttft_met = sorted(s.attributes[sc.TG_SLO_TTFT_MET] for s in servers)
    assert ttft_met == [False] * 4 + [True] * 5
    assert all(s.attributes[sc.TG_SLO_TOTAL_MET] is True for s in servers)
    assert all(sc.TG_SLO_TPOT_MET not in s.attributes for s in servers)
    logged = lines(access)
    assert len(logged) == len(MIXED)
    assert sorted(line["ttft_met"] for line in logged) == [False] * 4 + [True] * 5
    assert {line["total_met"] for line in logged} == {True}
    assert {line["tpot_met"] for line in logged} == {None}


async def test_an_error_misses_every_budget_and_a_client_that_left_early_is_not_judged(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """A 502 misses both budgets it had. A client that leaves a stalled stream long before its
    budgets run out is not judged at all; a whole answer in time meets its total budget (a
    non-streaming request has no TTFT budget)."""
    settings = gateway_settings(
        {
            "up": {"type": "vllm", "base_url": primary.base_url},
            "stuck": {"type": "vllm", "base_url": fallback.base_url},
        },
        [
            {
                "name": "m",
                "deployments": [{"provider": "up", "model": "broken@error_500_rate=1"}],
                "budget": {"ttft_ms": 2000, "total_ms": 5000},
            },
            {
                "name": "s",
                "deployments": [{"provider": "stuck", "model": "stuck@stall_rate=1"}],
                "budget": {"ttft_ms": 5000, "total_ms": 9000},
            },
            {
                "name": "w",
                "deployments": [{"provider": "up", "model": "whole"}],
                "budget": {"ttft_ms": 2000, "total_ms": 5000},
            },
        ],
    )
    async with run_gateway(settings) as gw:
        failed = await stream(client, gw.url)
        assert failed.status_code == 502
        whole = await client.post(gw.url + "/v1/chat/completions", json={"model": "w", **CHAT})
        assert whole.status_code == 200

        async def leave_early() -> None:
            await stream(client, gw.url, model="s")

        left = asyncio.create_task(leave_early())
        async with asyncio.timeout(scaled(5)):
            await fallback.stats.wait_for(lambda s: s.requests == 1)  # stalled upstream
        left.cancel()  # the client goes away
        with pytest.raises(asyncio.CancelledError):
            await left
        found = await scrape_when(
            client, gw.url, lambda s: s.value(sc.REQUESTS + "_total", model="s") == 1
        )
        body = await poll_latency(client, gw.url, judged("models", "w", "total", 1))
    assert found.value(sc.REQUESTS + "_total", model="s", status="499") == 1
    # Judged in the same step as it is counted: the counters below are complete.
    broken = {"model": "m", "deployment": "up/broken@error_500_rate=1"}
    for slo in ("ttft", "total"):
        assert found.value(SLO_REQUESTS, **broken, slo=slo, result="missed") == 0
        assert found.value(SLO_REQUESTS, model="m", deployment="", slo=slo, result="missed") == 1
        assert found.value(SLO_REQUESTS, model="m", slo=slo, result="met") == 0
    assert found.matching(SLO_REQUESTS, model="s") == []
    assert found.value(SLO_REQUESTS, model="w", slo="total", result="met") == 1
    assert found.matching(SLO_REQUESTS, model="w", slo="ttft") == []
    models = body["models"]
    assert models["m"]["slo"]["ttft"] == {"met": 0, "judged": 1, "attainment": 0.0}
    assert models["m"]["slo"]["total"] == {"met": 0, "judged": 1, "attainment": 0.0}
    assert "s" not in models or models["s"]["slo"]["ttft"]["judged"] == 0
    assert models["w"]["slo"]["total"] == {"met": 1, "judged": 1, "attainment": 1.0}
    assert models["w"]["slo"]["ttft"]["judged"] == 0


# --- the x-slo headers ---------------------------------------------------------------------------


async def test_x_slo_ttft_ms_gets_a_stalled_primary_rescued(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """With no budget configured, `x-slo-ttft-ms: 400` is the TTFT budget: the stalled primary is
    cut at its deadline and the fallback serves in time. The cut attempt is wasted work, counted
    with its prompt tokens; the rescue is the model's extra load (1 of 1 client request)."""
    settings = routed(primary, fallback, "slow@stall_rate=1", prior_ms=100)
    async with run_gateway(settings) as gw:
        async with asyncio.timeout(scaled(5)):
            resp = await stream(client, gw.url, {"x-slo-ttft-ms": "400"})
        assert resp.status_code == 200
        assert resp.headers["x-tailguard-route"] == "ttft_failover"
        assert resp.headers["x-tailguard-deployment"] == "f/ok"
        view = await poll_latency(client, gw.url, judged("models", "m", "ttft", 1))
        metrics = await scrape_when(client, gw.url, lambda s: s.value(sc.EXTRA_LOAD, model="m") > 0)
    model = view["models"]["m"]
    assert model["slo"]["ttft"] == {"met": 1, "judged": 1, "attainment": 1.0}
    assert model["extra_load"] == 1.0
    cut = {"model": "m", "deployment": "p/slow@stall_rate=1"}
    assert metrics.value(sc.WASTED_ATTEMPTS + "_total", **cut) == 1
    tokens = len(BODY) // BYTES_PER_TOKEN
    assert metrics.value(sc.WASTED_PROMPT_TOKENS + "_total", **cut) == tokens
    assert metrics.value(SLO_REQUESTS, model="m", deployment="f/ok", slo="ttft", result="met") == 1
    assert metrics.value(sc.EXTRA_LOAD, model="m") == 1.0


async def test_x_slo_tpot_ms_is_a_per_token_budget_that_is_judged(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A stream decoding at 20 ms a token misses `x-slo-tpot-ms: 5` and meets
    `x-slo-tpot-ms: 500`; a request without the header is not judged on TPOT."""
    settings = paced(upstream, "decode@tokens_per_s=50,output_tokens=5")
    async with run_gateway(settings) as gw:
        for headers in ({"x-slo-tpot-ms": "5"}, {"x-slo-tpot-ms": "500"}, {}):
            resp = await stream(client, gw.url, headers)
            assert resp.status_code == 200
        body = await poll_latency(client, gw.url, judged("models", "m", "ttft", 3))
        metrics = await scrape(client, gw.url)
    assert body["models"]["m"]["slo"]["tpot"] == {"met": 1, "judged": 2, "attainment": 0.5}
    deployment = "up/decode@tokens_per_s=50,output_tokens=5"
    for result in ("met", "missed"):
        assert metrics.value(SLO_REQUESTS, deployment=deployment, slo="tpot", result=result) == 1


async def test_x_slo_tpot_ms_steers_a_stream_away_from_a_slow_decoder(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """A primary expected to take 50 ms a token does not fit `x-slo-tpot-ms: 10`: the stream
    starts on the fallback. Without the header, or for a whole answer (no per-token target),
    the primary serves."""
    settings = gateway_settings(
        {
            "p": {"type": "vllm", "base_url": primary.base_url},
            "f": {"type": "vllm", "base_url": fallback.base_url},
        },
        [
            {
                "name": "m",
                "deployments": [{"provider": "p", "model": "ok", "prior": {"tpot_ms": 50}}],
                "fallbacks": ["b"],
            },
            {"name": "b", "deployments": [{"provider": "f", "model": "ok"}]},
        ],
    )
    async with run_gateway(settings) as gw:
        steered = await stream(client, gw.url, {"x-slo-tpot-ms": "10"})
        plain = await stream(client, gw.url)
        whole = await client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", **CHAT},
            headers={"x-slo-tpot-ms": "10"},
        )
    assert (steered.headers["x-tailguard-deployment"], steered.headers["x-tailguard-route"]) == (
        "f/ok",
        "budget",
    )
    assert plain.headers["x-tailguard-deployment"] == "p/ok"
    assert whole.status_code == 200
    assert whole.headers["x-tailguard-deployment"] == "p/ok"


def test_the_slo_headers_are_in_the_openapi_document() -> None:
    document = build_openapi(lambda: {"openapi": "3.1.0", "info": {}, "paths": {}})
    parameters = document["components"]["parameters"]
    names = {p["name"]: p for p in parameters.values()}
    assert {"x-slo-ttft-ms", "x-slo-tpot-ms"} <= set(names)
    for name in ("x-slo-ttft-ms", "x-slo-tpot-ms"):
        assert names[name]["schema"] == {"type": "integer", "minimum": 1, "maximum": 3600000}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        refs = {p["$ref"].rsplit("/", 1)[1] for p in document["paths"][path]["post"]["parameters"]}
        assert {"SLOTTFT", "SLOTPOT"} <= refs


@pytest.mark.parametrize("header", ["x-slo-ttft-ms", "x-slo-tpot-ms"])
@pytest.mark.parametrize("value", ["0", "-5", "1.5", "fast", "3600001"])
async def test_an_invalid_slo_header_is_a_400_naming_it(
    upstream: Upstream, client: httpx.AsyncClient, header: str, value: str
) -> None:
    async with run_gateway(paced(upstream)) as gw:
        resp = await client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "stream": True, **CHAT},
            headers={header: value},
        )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == header
    assert header in error["message"]
    assert error["code"] == "invalid_header"


async def test_an_slo_ttft_above_the_total_budget_is_refused_by_its_name(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    async with run_gateway(paced(upstream)) as gw:
        resp = await client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "stream": True, **CHAT},
            headers={"x-slo-ttft-ms": "900", "x-tailguard-total-budget-ms": "800"},
        )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "x-slo-ttft-ms"


# --- tailguard stats and the dashboard -----------------------------------------------------------


async def test_stats_shows_attainment_first(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """`tailguard stats` opens with attainment per model (TTFT and total against the budget,
    p99 against the budget, extra load, wasted prompt tokens), before the percentile tables; a
    quantile beyond every cut shows as "> N"."""
    settings = routed(
        primary,
        fallback,
        "slow@stall_rate=1",
        prior_ms=100,
        budget={"ttft_ms": 400},
        hedge_max_fraction=1.0,  # both requests may be rescued
    )
    async with run_gateway(settings) as gw:
        for headers in ({}, {"x-slo-tpot-ms": "1000"}):
            async with asyncio.timeout(scaled(5)):
                resp = await stream(client, gw.url, headers)
            assert resp.headers["x-tailguard-route"] == "ttft_failover"
        view = await poll_latency(client, gw.url, judged("models", "m", "ttft", 2))
        table = await asyncio.to_thread(tailguard, "stats", "--url", gw.url)
    stalled = view["deployments"]["p/slow@stall_rate=1"]["ttft_ms"]
    assert stalled["p99"] is None and stalled["beyond_ms"] > 0
    assert table.returncode == 0, table.stderr
    out = table.stdout
    assert out.index("SLO attainment") < out.index("Deployments") < out.index("Models")
    attainment = out[out.index("SLO attainment") : out.index("Deployments")]
    row = next(line for line in attainment.splitlines() if line.lstrip().startswith("m "))
    assert "100.0% (2/2)" in row  # TTFT
    assert f"> {round(view['models']['m']['ttft_ms']['beyond_ms'])} / 400" in row  # p99 / budget
    # TPOT: the one request with a target met it; extra load: a rescue per request; the prompt
    # tokens of the two attempts cut at their deadline; then both requests served by the
    # fallback model, each after a first-token deadline failover.
    wasted = 2 * (len(BODY) // BYTES_PER_TOKEN)
    served = r"100\.0% \(2/2\)\s+ttft_failover 2"
    assert re.search(rf"100\.0% \(1/1\)\s+100\.0%\s+{wasted}\s+{served}$", row.rstrip()), row
    beyond = round(stalled["beyond_ms"])
    deployments = out[out.index("Deployments") : out.index("Models")]
    stalled_row = next(line for line in deployments.splitlines() if "p/slow" in line)
    assert f"> {beyond}" in stalled_row


@pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason=f"{CHROMIUM} is missing")
async def test_dashboard_shows_attainment_first(
    primary: Upstream, fallback: Upstream, client: httpx.AsyncClient
) -> None:
    """Each model's card opens with its TTFT and total attainment and its extra load; a TTFT
    known only to exceed its cut shows as "> N ms"."""
    settings = gateway_settings(
        {
            "up": {"type": "vllm", "base_url": primary.base_url},
            "f": {"type": "vllm", "base_url": fallback.base_url},
        },
        [
            {
                "name": "m",
                "deployments": [{"provider": "up", "model": PACED}],
                "budget": {"ttft_ms": 2000, "total_ms": 5000},
            },
            {
                "name": "s",
                "deployments": [{"provider": "up", "model": "slow@stall_rate=1"}],
                "fallbacks": ["b"],
                "budget": {"ttft_ms": 400},
            },
            {
                "name": "b",
                "deployments": [{"provider": "f", "model": "ok", "prior": {"ttft_ms": 100}}],
            },
        ],
    )
    async with run_gateway(settings) as gw, chromium() as browser:
        for headers in ({}, {}, {}, {"x-slo-ttft-ms": "20"}):
            assert (await stream(client, gw.url, headers)).status_code == 200
        async with asyncio.timeout(scaled(5)):
            rescued = await stream(client, gw.url, model="s")
        assert rescued.headers["x-tailguard-route"] == "ttft_failover"
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        watched = Watched(page)
        await page.goto(gw.url + "/dashboard")
        m = page.locator('[data-model="m"]')
        s = page.locator('[data-model="s"]')
        await expect(m.locator('[data-field="slo-ttft"]')).to_have_text("75%", timeout=WAIT_MS)
        await expect(m.locator('[data-field="slo-total"]')).to_have_text("100%")
        await expect(m.locator('[data-field="extra-load"]')).to_have_text("0%")
        await expect(s.locator('[data-field="slo-ttft"]')).to_have_text("100%")
        await expect(s.locator('[data-field="slo-total"]')).to_have_text("—")  # no budget
        await expect(s.locator('[data-field="extra-load"]')).to_have_text("100%")
        # Attainment comes before everything else in the card.
        first = await m.evaluate(
            "(card) => card.querySelector('[data-field]').closest('.slo') !== null"
        )
        assert first
        row = page.locator('[data-deployment="up/slow@stall_rate=1"]')
        await expect(row.locator('[data-field="ttft-p99"]')).to_have_text(
            BEYOND_MS, timeout=WAIT_MS
        )
        assert watched.errors == []
