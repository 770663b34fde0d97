"""Every route a request can take, driven end to end through a real gateway and simulated
upstreams, against every counter that speaks of routes: `tailguard_requests_total`,
`tailguard_fallbacks_total`, `tailguard_fallback_served_total`, `tailguard_hedges_total`, the
`/admin/latency` counters and the dashboard's cards (in a real headless Chromium).

The ledger the counters are checked against is built from what each response says
(`x-tailguard-route`, `x-tailguard-deployment`) and what the test configured (each model's first
deployment): a fallback is an answer from any candidate but the first one planned, so a model's
only deployment serving over its budget (`budget_unattainable`) is none.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, get_args

import httpx
import pytest
from playwright.async_api import Page, expect

from gateway.routing.plan import Route
from gateway.telemetry import semconv as sc
from tests.conftest import Upstream, gateway_settings, run_gateway
from tests.latency.test_end_to_end import poll_latency
from tests.telemetry.test_dashboard import CHROMIUM, WAIT_MS, Watched, chromium
from tests.telemetry.test_metrics import scrape_when

# Upstream model names script the simulated server: how slow, how it fails.
SOLO = "solo@prefill_base_ms=300"  # slower than its model's budget, and its only deployment
SLOW = "slow@prefill_base_ms=300"  # slower than the budget, with a fast fallback model
SLOWER = "slower@prefill_base_ms=450"  # slower than the budget, as is its fallback model...
SLOW2 = "slow2@prefill_base_ms=250"  # ...but less so: it serves, over budget
OK = "ok"
BAD = "bad@error_500_rate=1"
BAD2 = "bad2@error_500_rate=1"
GOOD = "good"
STALL = "stall@stall_rate=1"
LATE = "late@prefill_base_ms=2000"
DEAD = "dead@error_500_rate=1"


def every_route(upstream: Upstream) -> Any:
    """One model per way a request can be served (see `TRAFFIC`), all on one simulated server,
    with `b` the fast fallback model most of them fall back to."""
    fast_fallback = {"fallbacks": ["b"]}
    over_budget = {"budget": {"ttft_ms": 200}, "on_ttft_miss": "none"}
    return gateway_settings(
        # A plain OpenAI-compatible provider: routing goes by the latency window alone.
        {"up": {"type": "openai", "base_url": upstream.base_url}},
        [
            {"name": "solo", "deployments": [{"provider": "up", "model": SOLO}], **over_budget},
            {
                "name": "moved",
                "deployments": [{"provider": "up", "model": SLOW}],
                **fast_fallback,
                **over_budget,
            },
            {
                "name": "unattainable",
                "deployments": [{"provider": "up", "model": SLOWER}],
                "fallbacks": ["s2"],
                **over_budget,
            },
            {"name": "s2", "deployments": [{"provider": "up", "model": SLOW2}]},
            {"name": "flaky", "deployments": [{"provider": "up", "model": BAD}], **fast_fallback},
            {
                # Two deployments, no fallback model: the bad one is (all but surely) planned
                # first, and the other deployment of the same model answers.
                "name": "pair",
                "deployments": [
                    {"provider": "up", "model": BAD2, "weight": 1e6},
                    {"provider": "up", "model": GOOD, "weight": 1e-6},
                ],
            },
            {
                "name": "stalled",
                "deployments": [{"provider": "up", "model": STALL}],
                "budget": {"ttft_ms": 400},
                "on_ttft_miss": "failover",
                **fast_fallback,
            },
            {
                "name": "hedged",
                "deployments": [{"provider": "up", "model": LATE}],
                "budget": {"ttft_ms": 400},
                "on_ttft_miss": "hedge",
                "hedge_max_fraction": 1.0,
                **fast_fallback,
            },
            {"name": "dead", "deployments": [{"provider": "up", "model": DEAD}]},
            {
                "name": "b",
                "deployments": [{"provider": "up", "model": OK, "prior": {"ttft_ms": 50}}],
            },
        ],
        latency={"min_samples": 3},
    )


# Each model's first deployment: the candidate its plans are made from first.
FIRST = {
    "solo": SOLO,
    "moved": SLOW,
    "unattainable": SLOWER,
    "s2": SLOW2,
    "flaky": BAD,
    "pair": BAD2,
    "stalled": STALL,
    "hedged": LATE,
    "dead": DEAD,
    "b": OK,
}
OWN = {**FIRST, "pair": f"{BAD2} {GOOD}"}  # each model's own deployments
WARM_UP = {"solo": 3, "moved": 3, "unattainable": 3, "s2": 3}  # until the window trusts them
TRAFFIC = {
    "solo": 2,  # budget_unattainable, on its only deployment: no fallback
    "moved": 1,  # budget: moved to the fallback model b
    "unattainable": 1,  # budget_unattainable, on the fallback model s2 (less over budget)
    "flaky": 1,  # error_fallback to b
    "pair": 2,  # error_fallback to the model's other deployment
    "stalled": 1,  # ttft_failover to b
    "hedged": 1,  # hedge: b's hedge answers first
    "dead": 1,  # nothing answers: an error
}


@dataclass(frozen=True, slots=True)
class Answer:
    model: str
    status: int
    route: str  # "" when nothing answered
    deployment: str  # "" when nothing answered


async def ask(client: httpx.AsyncClient, url: str, model: str) -> Answer:
    """One streamed chat request, read to its end."""
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        await response.aread()
    ok = response.status_code < 400
    return Answer(
        model,
        response.status_code,
        response.headers.get("x-tailguard-route", "") if ok else "",
        response.headers.get("x-tailguard-deployment", "") if ok else "",
    )


async def each_in_turn(client: httpx.AsyncClient, url: str, model: str, n: int) -> list[Answer]:
    return [await ask(client, url, model) for _ in range(n)]


async def drive(client: httpx.AsyncClient, url: str, plan: dict[str, int]) -> list[Answer]:
    """Each model's requests one after another, the models side by side."""
    found = await asyncio.gather(*(each_in_turn(client, url, m, n) for m, n in plan.items()))
    return [answer for answers in found for answer in answers]


def model_of(deployment: str) -> str:
    """The model whose own deployment `deployment` (`up/...`) is."""
    name = deployment.removeprefix("up/")
    return next(model for model, own in OWN.items() if name in own.split(" "))


class Ledger:
    """What the counters must say, from the answers alone."""

    def __init__(self, answers: list[Answer]) -> None:
        self.requests = Counter((a.model, a.deployment, a.route, str(a.status)) for a in answers)
        self.answered = Counter(a.model for a in answers if a.status < 400)
        self.errors = Counter(a.model for a in answers if a.status >= 400)
        self.routes = Counter((a.model, a.route) for a in answers if a.status < 400)
        # Served by a candidate other than the first planned, hedges aside (counted as won).
        self.fallbacks = Counter(
            (a.model, a.route)
            for a in answers
            if a.status < 400 and a.deployment != f"up/{FIRST[a.model]}" and a.route != "hedge"
        )
        self.served = Counter(
            (a.model, model_of(a.deployment), a.route)
            for a in answers
            if a.status < 400 and model_of(a.deployment) != a.model
        )
        self.hedges_won = Counter(a.model for a in answers if a.route == "hedge")


def answers_text(ledger: Ledger, model: str) -> str:
    """What the dashboard's "Fallback answers" must read for `model`."""
    reasons = {r: n for (m, r), n in ledger.fallbacks.items() if m == model}
    answered = ledger.answered[model]
    total = sum(reasons.values())
    if not total:
        return f"none of {answered}" if answered else "none"
    shown = (
        next(iter(reasons))
        if len(reasons) == 1
        else ", ".join(f"{r} {n}" for r, n in reasons.items())
    )
    return f"{total} of {answered} ({shown})"


def js_number(value: float) -> str:
    """`value` as JavaScript's String() writes it."""
    return str(int(value)) if value == int(value) else repr(value)


# Records every fallback-rate figure each model's card shows from now on, in `window.rates`.
RECORD_RATES = """
    () => {
        window.rates = {};
        for (const node of document.querySelectorAll('[data-field="fallback-rate"]')) {
            const model = node.closest("[data-model]").dataset.model;
            window.rates[model] = [];
            new MutationObserver(() => window.rates[model].push(node.dataset.value)).observe(
                node, { attributes: true, attributeFilter: ["data-value"] });
        }
    }
"""


async def drive_every_route(client: httpx.AsyncClient, url: str) -> tuple[Ledger, list[Answer]]:
    """The warm-up, until the window trusts the slow deployments, then `TRAFFIC`; the ledger of
    every answer, and the answers of `TRAFFIC`. Every route value is taken, each where it is
    meant to be."""
    answers = await drive(client, url, WARM_UP)
    trusted = [f"up/{FIRST[m]}" for m in WARM_UP]
    await poll_latency(
        client,
        url,
        lambda body: all(
            body["deployments"].get(d, {}).get("ttft_ms", {}).get("count") == 3 for d in trusted
        ),
    )
    traffic = await drive(client, url, TRAFFIC)
    answers += traffic
    assert {a.route for a in answers} - {""} == set(get_args(Route))
    taken = {(a.model, a.route, a.deployment) for a in traffic}
    assert ("solo", "budget_unattainable", f"up/{SOLO}") in taken
    assert ("moved", "budget", f"up/{OK}") in taken
    assert ("unattainable", "budget_unattainable", f"up/{SLOW2}") in taken
    assert ("flaky", "error_fallback", f"up/{OK}") in taken
    assert ("pair", "error_fallback", f"up/{GOOD}") in taken
    assert ("stalled", "ttft_failover", f"up/{OK}") in taken
    assert ("hedged", "hedge", f"up/{OK}") in taken
    ledger = Ledger(answers)
    assert ledger.errors == {"dead": 1}
    # A request is counted once its stream has ended, maybe after the client read it.
    await scrape_when(client, url, lambda s: s.value(sc.REQUESTS + "_total") >= len(answers))
    return ledger, traffic


async def test_every_route_is_counted_as_what_it_is(upstream: Upstream) -> None:
    """Every route value, each served as the ledger says; every route counter in `/metrics` and
    `/admin/latency` agrees with the ledger. `solo`'s two requests served over budget by its
    only deployment (`budget_unattainable`) are no fallback; the other deployment of `pair`
    answering after an error is one, though `pair` has no fallback model."""
    async with run_gateway(every_route(upstream)) as gw, httpx.AsyncClient(timeout=10) as client:
        ledger, _ = await drive_every_route(client, gw.url)
        scraped = await scrape_when(client, gw.url, lambda s: True)
        body = (await client.get(gw.url + "/admin/latency")).json()

    requests = {
        (s.labels["model"], s.labels["deployment"], s.labels["route"], s.labels["status"]): n
        for s in scraped.matching(sc.REQUESTS + "_total")
        if (n := int(s.value))
    }
    assert requests == dict(ledger.requests)
    fallbacks = {
        (s.labels["model"], s.labels["reason"]): int(s.value)
        for s in scraped.matching(sc.FALLBACKS + "_total")
    }
    assert fallbacks == dict(ledger.fallbacks)
    assert ("solo", "budget_unattainable") not in fallbacks
    assert fallbacks[("pair", "error_fallback")] == 2
    served = {
        (s.labels["model"], s.labels["fallback"], s.labels["route"]): int(s.value)
        for s in scraped.matching(sc.FALLBACK_SERVED + "_total")
    }
    assert served == dict(ledger.served)
    won = {
        s.labels["model"]: int(s.value)
        for s in scraped.matching(sc.HEDGES + "_total", result="won")
        if s.value
    }
    assert won == dict(ledger.hedges_won)

    # /admin/latency: the same counts, as the dashboard, `stats` and `report` read them.
    counters = body["counters"]
    routes = {
        (model, route): n for model, by in counters["routes"].items() for route, n in by.items()
    }
    assert routes == {**ledger.routes, **{(m, "error"): n for m, n in ledger.errors.items()}}
    shown = {
        (model, reason): n
        for model, by in counters["fallbacks"].items()
        for reason, n in by.items()
    }
    assert shown == dict(ledger.fallbacks)
    for model in FIRST:
        expected = sum(n for (m, _, _), n in ledger.served.items() if m == model)
        assert counters["fallback"][model]["served"] == expected, model
    hedges = {m: h["won"] for m, h in counters["hedges"].items() if h.get("won")}
    assert hedges == dict(ledger.hedges_won)


@pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK),
    reason=f"{CHROMIUM} is missing or not executable: install the Debian `chromium` package "
    "(`apt-get install -y chromium`; .ci/run does this before the suite)",
)
async def test_the_dashboard_cards_agree_with_the_route_counters(
    upstream: Upstream, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each model's card, in a real headless Chromium: its fallback answers (count, share of
    the requests answered and why), the share a fallback model served, and a fallback rate that
    moves only for a model some other candidate answered for. No "Fallback rate 33%" on a card
    whose model has no fallback and was only ever served by its own deployment."""
    async with (
        run_gateway(every_route(upstream)) as gw,
        httpx.AsyncClient(timeout=10) as client,
        chromium() as browser,
    ):
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        watched = Watched(page)
        response = await page.goto(gw.url + "/dashboard")
        assert response is not None and response.ok
        await expect(page.locator('[data-model="b"]')).to_be_visible()
        await page.evaluate(RECORD_RATES)
        ledger, _ = await drive_every_route(client, gw.url)
        await check_cards(page, ledger)
        rates: dict[str, list[str]] = await page.evaluate("() => window.rates")
        png = await page.locator('[data-model="pair"]').screenshot()
        (tmp_path_factory.getbasetemp() / "dashboard-routes.png").write_bytes(png)
        assert watched.errors == []
    with_fallbacks = {m for m, _ in ledger.fallbacks}
    for model, shown in rates.items():
        peak = max((float(v) for v in shown if v), default=0.0)
        if model in with_fallbacks:
            assert peak > 0, (model, shown)
        else:
            assert peak == 0, (model, shown)


async def check_cards(page: Page, ledger: Ledger) -> None:
    """Every model's card shows the ledger's figures (once a poll has the final counts: that
    poll also showed the last interval's rates, so every fallback has been in a rate shown)."""
    for model in FIRST:
        card = page.locator(f'[data-model="{model}"]')
        await expect(card.locator('[data-field="fallback-answers"]')).to_have_text(
            answers_text(ledger, model), timeout=WAIT_MS
        )
        asked = ledger.answered[model] + ledger.errors[model]
        if asked:
            share = sum(n for (m, _, _), n in ledger.served.items() if m == model) / asked
            await expect(card.locator('[data-field="fallback-served"]')).to_have_attribute(
                "data-value", js_number(share)
            )
    solo = page.locator('[data-model="solo"]')
    await expect(solo.locator('[data-field="fallbacks"]')).to_have_text("none")
    await expect(solo.locator('[data-field="fallback-answers"]')).to_have_text("none of 5")
    pair = page.locator('[data-model="pair"]')
    await expect(pair.locator('[data-field="fallbacks"]')).to_have_text("none")
    await expect(pair.locator('[data-field="fallback-answers"]')).to_have_text(
        "2 of 2 (error_fallback)"
    )
