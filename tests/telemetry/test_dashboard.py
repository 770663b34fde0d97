"""The dashboard (`GET /dashboard`) in a real headless Chromium, against a real gateway and a real
simulated upstream: it lists the configured models before any traffic, follows live traffic, shows
what fallback models served beside attainment, loads nothing from any other origin, logs no
console errors, and keeps working across a gateway restart.

Uses the Debian `chromium` binary (`.ci/run` installs it), never a browser Playwright downloads.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.async_api import (
    Browser,
    ConsoleMessage,
    Error,
    Page,
    Request,
    async_playwright,
    expect,
)

from gateway.config import Settings
from tests.conftest import Upstream, gateway_settings, run_gateway

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK),
    reason=f"{CHROMIUM} is missing or not executable: install the Debian `chromium` package "
    "(`apt-get install -y chromium`; .ci/run does this before the suite)",
)

# Long enough for a poll (every 2 s) to land after the snapshot refresh (every 1 s) that follows
# the traffic, short enough to keep a failure quick.
WAIT_MS = 8_000
# A deployment whose upstream model name is markup: it must show up as text, never as elements.
HOSTILE = '<img src=x onerror="document.title=1">'


def two_models(upstream: Upstream) -> Settings:
    """`chat` (with a budget, hedging on a TTFT miss, falling back to `backup`) and `backup`."""
    return gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [
            {
                "name": "chat",
                "deployments": [{"provider": "up", "model": "fast@prefill_base_ms=3"}],
                "budget": {"ttft_ms": 750, "total_ms": 4000},
                "fallbacks": ["backup"],
                "on_ttft_miss": "hedge",
            },
            {
                "name": "backup",
                "deployments": [
                    {"provider": "up", "model": "slow"},
                    {"provider": "up", "model": HOSTILE},
                ],
            },
        ],
    )


async def stream_chat(client: httpx.AsyncClient, url: str, model: str, n: int) -> None:
    """`n` streamed chat requests, one after another, each read to its `[DONE]`."""
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    for _ in range(n):
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            text = "".join([chunk async for chunk in response.aiter_text()])
        assert text.rstrip().endswith("data: [DONE]")


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        # Playwright passes --no-sandbox itself (chromium_sandbox defaults to False), which
        # Chromium needs when it runs as root, as it does in CI containers.
        browser = await playwright.chromium.launch(executable_path=str(CHROMIUM))
        try:
            yield browser
        finally:
            await browser.close()


class Watched:
    """Every request the page makes and every console error it logs."""

    def __init__(self, page: Page) -> None:
        self.requests: list[str] = []
        self.errors: list[str] = []
        page.on("request", self._request)
        page.on("console", self._console)
        page.on("pageerror", self._page_error)

    def _request(self, request: Request) -> None:
        self.requests.append(request.url)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def _page_error(self, error: Error) -> None:
        self.errors.append(f"uncaught: {error}")

    def foreign(self, origin: str) -> list[str]:
        """Requests to anywhere but `origin` (data: URLs are no request to anyone)."""
        return [
            url
            for url in self.requests
            if urlsplit(url).scheme != "data" and not url.startswith(origin + "/")
        ]


RPS = '[data-model="{model}"] [data-field="rps"]'
DEPLOYMENT_REQUESTS = '[data-deployment="{id}"] [data-field="requests"]'
# The raw figure behind a formatted one is in its `data-value`.
ABOVE_ZERO = """
    (selector) => {
        const node = document.querySelector(selector);
        return node !== null && Number(node.dataset.value || "0") > 0;
    }
"""


def save_screenshot(png: bytes, base: Path) -> list[Path]:
    """Write the screenshot under pytest's base temp dir and, if set, `$TAILGUARD_ARTIFACTS`."""
    targets = [base / "dashboard.png"]
    artifacts = os.environ.get("TAILGUARD_ARTIFACTS")
    if artifacts:
        targets.append(Path(artifacts) / "dashboard.png")
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png)
        print(f"dashboard screenshot: {path}")
    return targets


async def test_dashboard_shows_models_and_follows_live_traffic(
    upstream: Upstream, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Both models with their budgets before any traffic; then live traffic moves the model's
    requests per second above zero and the deployment's request count; no foreign request, no
    console error; a full-page screenshot is kept."""
    async with (
        run_gateway(two_models(upstream)) as gw,
        httpx.AsyncClient(timeout=10) as client,
        chromium() as browser,
    ):
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        watched = Watched(page)
        response = await page.goto(gw.url + "/dashboard")
        assert response is not None and response.ok

        # Both configured models, before any traffic, with their budgets and fallbacks.
        chat = page.locator('[data-model="chat"]')
        backup = page.locator('[data-model="backup"]')
        await expect(chat.locator("h3")).to_have_text("chat")
        await expect(backup.locator("h3")).to_have_text("backup")
        await expect(chat.locator('[data-field="budget-ttft"]')).to_have_text("≤ 750 ms")
        await expect(chat.locator('[data-field="budget-total"]')).to_have_text("≤ 4,000 ms")
        await expect(chat.locator('[data-field="fallbacks"]')).to_have_text("backup")
        await expect(chat.locator('[data-field="on-ttft-miss"]')).to_have_text("hedge")
        await expect(backup.locator('[data-field="budget-ttft"]')).to_have_text("none")
        await expect(page.locator('[data-field="connection"]')).to_have_text("Live")
        await expect(page.locator('[data-field="store-type"]')).to_have_text("memory")
        await expect(page.locator('[data-field="store-state"]')).to_have_text("ok")
        await expect(page.locator('[data-field="window"]')).to_have_text("last 60 s")

        # Every configured deployment has a row from the start; markup in a name stays text.
        deployment = "up/fast@prefill_base_ms=3"
        ids = await page.eval_on_selector_all(
            "tr[data-deployment]", "(rows) => rows.map((row) => row.dataset.deployment)"
        )
        assert ids == [deployment, "up/slow", f"up/{HOSTILE}"]
        hostile_row = page.locator("tr[data-deployment]").nth(2)
        await expect(hostile_row.locator("th")).to_have_text(f"up/{HOSTILE}")
        assert await page.locator("img").count() == 0
        assert await page.title() == "Tailguard dashboard"

        # Live traffic: the rate and the deployment's window count follow.
        await stream_chat(client, gw.url, "chat", 12)
        await page.wait_for_function(ABOVE_ZERO, arg=RPS.format(model="chat"), timeout=WAIT_MS)
        await page.wait_for_function(
            ABOVE_ZERO, arg=DEPLOYMENT_REQUESTS.format(id=deployment), timeout=WAIT_MS
        )
        row = page.locator(f'[data-deployment="{deployment}"]')
        await expect(row.locator('[data-field="requests"]')).to_have_text("12", timeout=WAIT_MS)
        await expect(row.locator('[data-field="errors"]')).to_have_text("0")
        await expect(row.locator('[data-field="ttft-p50"]')).to_contain_text("ms")
        await expect(row.locator('[data-field="state"]')).to_have_text("available")
        await expect(chat.locator('[data-field="ttft-now"]')).to_contain_text("p99")
        assert await chat.locator("svg.chart path.s-p99").count() >= 1
        assert await chat.locator("svg.chart line.budget").count() == 2  # TTFT and total

        png = await page.screenshot(full_page=True)
        save_screenshot(png, tmp_path_factory.getbasetemp())

        assert watched.foreign(gw.url) == []
        assert any(url == gw.url + "/admin/latency" for url in watched.requests)
        assert watched.errors == []


# --- what fallback models served ------------------------------------------------------------------

SLOW = "slow@prefill_base_ms=300"


def served_by_fallbacks(upstream: Upstream) -> Settings:
    """`m` on a primary slower than its 200 ms TTFT budget (no rescue; trusted after 3 samples,
    then moved to `b` for latency, within a cap of 30%), `flaky` on a primary that always fails
    (served by `b` after the error), and `b`."""
    return gateway_settings(
        # A plain OpenAI-compatible provider: routing goes by the window alone (a vLLM server's
        # own TTFT, of all its models, would predict for `m` and `b` alike, and sooner).
        {"up": {"type": "openai", "base_url": upstream.base_url}},
        [
            {
                "name": "m",
                "deployments": [{"provider": "up", "model": SLOW}],
                "fallbacks": ["b"],
                "budget": {"ttft_ms": 200},
                "on_ttft_miss": "none",
                "max_fallback_share": 0.3,
            },
            {
                "name": "flaky",
                "deployments": [{"provider": "up", "model": "bad@error_500_rate=1"}],
                "fallbacks": ["b"],
            },
            {"name": "b", "deployments": [{"provider": "up", "model": "ok"}]},
        ],
        latency={"min_samples": 3},
    )


async def test_dashboard_shows_what_fallback_models_served(
    upstream: Upstream, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Next to attainment, each model's share of requests a fallback model served, which one and
    why (the route), and its `max_fallback_share`: one of `m`'s four requests moved to `b` for
    latency, `flaky`'s one request served by `b` after an error; `b` was asked for nothing."""
    from tests.latency.test_end_to_end import count, poll_latency

    async with (
        run_gateway(served_by_fallbacks(upstream)) as gw,
        httpx.AsyncClient(timeout=10) as client,
        chromium() as browser,
    ):
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        watched = Watched(page)
        response = await page.goto(gw.url + "/dashboard")
        assert response is not None and response.ok
        served = '[data-model="{model}"] [data-field="fallback-served{part}"]'
        m, flaky, b = (
            (
                page.locator(served.format(model=name, part="")),
                page.locator(served.format(model=name, part="-detail")),
            )
            for name in ("m", "flaky", "b")
        )
        # Before any traffic: nothing to share, and the cap where there is one.
        await expect(m[0]).to_have_text("—")
        await expect(m[1]).to_have_text("no requests since start · cap 30%")
        await expect(flaky[1]).to_have_text("no requests since start · no cap")

        # Three requests on the slow primary; once the window trusts its p99, the fourth is
        # moved to the fallback model (route budget).
        await stream_chat(client, gw.url, "m", 3)
        await poll_latency(client, gw.url, count("deployments", f"up/{SLOW}", n=3))
        await stream_chat(client, gw.url, "m", 1)
        await stream_chat(client, gw.url, "flaky", 1)
        # A request's outcome is recorded as its stream ends, maybe after the client read it.
        body = await poll_latency(
            client,
            gw.url,
            lambda body: all(
                body["counters"]["fallback"][n]["served"] == 1 for n in ("m", "flaky")
            ),
        )
        assert body["counters"]["fallback"]["m"]["routes"] == {"budget": 1}

        await expect(m[0]).to_have_text("25.0%", timeout=WAIT_MS)
        await expect(m[0]).to_have_attribute("data-value", "0.25")
        await expect(m[1]).to_have_text("b (budget) · 1 of 4 since start · cap 30%")
        await expect(flaky[0]).to_have_text("100%", timeout=WAIT_MS)
        await expect(flaky[1]).to_have_text("b (error_fallback) · 1 of 1 since start · no cap")
        await expect(b[0]).to_have_text("—")
        await expect(b[1]).to_have_text("no requests since start · no cap")
        # The attainment beside it is unchanged: m's TTFT budget judged all four requests.
        await expect(
            page.locator('[data-model="m"] [data-field="slo-ttft-detail"]')
        ).to_contain_text("of 4 met")
        png = await page.locator('[data-model="m"]').screenshot()
        (tmp_path_factory.getbasetemp() / "dashboard-fallback.png").write_bytes(png)
        assert watched.errors == []
        assert watched.foreign(gw.url) == []


# --- a gateway restart ---------------------------------------------------------------------------


# Records every requests-per-second figure the page shows from now on, in `window.rpsShown`.
RECORD_RPS = """
    (selector) => {
        const node = document.querySelector(selector);
        window.rpsShown = [];
        new MutationObserver(() => window.rpsShown.push(node.dataset.value)).observe(
            node, { attributes: true, attributeFilter: ["data-value"] });
    }
"""


async def test_dashboard_survives_a_gateway_restart(upstream: Upstream) -> None:
    """Down: the page says so and keeps the last data; back (with every counter reset): it
    resumes, and its rates come back without a bogus negative or huge figure."""
    settings = two_models(upstream)
    deployment = "up/fast@prefill_base_ms=3"
    rps = RPS.format(model="chat")
    async with httpx.AsyncClient(timeout=10) as client, chromium() as browser:
        page = await browser.new_page()
        watched = Watched(page)
        connection = page.locator('[data-field="connection"]')
        requests = page.locator(f'[data-deployment="{deployment}"] [data-field="requests"]')

        async with run_gateway(settings) as gw:
            url, port = gw.url, gw.port
            await page.goto(url + "/dashboard")
            await expect(connection).to_have_text("Live")
            await stream_chat(client, url, "chat", 5)
            await expect(requests).to_have_text("5", timeout=WAIT_MS)

        await expect(connection).to_have_text("Gateway unreachable", timeout=WAIT_MS)
        await expect(page.locator('[data-field="last-update"]')).to_contain_text(
            "showing data from"
        )
        await expect(requests).to_have_text("5")  # the last data stays up, marked stale

        await page.evaluate(RECORD_RPS, rps)
        # Served again on the same port: back at the origin the page was loaded from.
        async with run_gateway(settings, port=port) as again:
            assert again.url == url
            await expect(connection).to_have_text("Live", timeout=WAIT_MS)
            await expect(requests).to_have_text("0")  # the new process's empty window
            await stream_chat(client, url, "chat", 3)
            await page.wait_for_function(ABOVE_ZERO, arg=rps, timeout=WAIT_MS)
            await expect(requests).to_have_text("3", timeout=WAIT_MS)

        # The counters went back to zero: that interval shows no figure, never a negative or a
        # huge one.
        shown = await page.evaluate("window.rpsShown")
        assert "" in shown
        assert all(value == "" or 0 <= float(value) < 1000 for value in shown), shown

    assert watched.foreign(url) == []
    # While the gateway was down the browser itself logs the failed fetches (refused, or reset by
    # the shutdown); nothing else.
    failed_fetch = "Failed to load resource: net::ERR_"
    assert [e for e in watched.errors if not e.startswith(failed_fetch)] == []


async def test_dashboard_behind_an_admin_key(upstream: Upstream) -> None:
    """With keys configured the browser is asked for the admin key (HTTP Basic: any user name,
    the key as password); once given, the page and its polls of /admin/latency work."""
    from gateway.admission.auth import new_key

    key, digest = new_key()
    base = two_models(upstream)
    settings = gateway_settings(
        {name: spec.model_dump() for name, spec in base.providers.items()},
        [m.model_dump() for m in base.models],
        auth={"admin_keys": [{"name": "ops", "sha256": digest}]},
    )
    async with run_gateway(settings) as gw, chromium() as browser:
        async with httpx.AsyncClient() as client:
            refused = await client.get(gw.url + "/dashboard")
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith(
            "Basic"
        )
        context = await browser.new_context(http_credentials={"username": "ops", "password": key})
        page = await context.new_page()
        watched = Watched(page)
        response = await page.goto(gw.url + "/dashboard")
        assert response is not None and response.ok
        await expect(page.locator('[data-model="chat"] h3')).to_have_text("chat")
        await expect(page.locator('[data-field="connection"]')).to_have_text("Live")
        assert any(url == gw.url + "/admin/latency" for url in watched.requests)
        assert watched.errors == []
        assert key not in await page.content()


# --- the vLLM servers ----------------------------------------------------------------------------


def _pct(value: float) -> str:
    """The page's percentage: whole percents, one decimal under 10%."""
    return f"{value * 100:.{0 if value >= 0.1 or value == 0 else 1}f}%"


async def test_dashboard_shows_the_vllm_servers_figures(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A speculating vLLM server with a prefix cache, and a plain one: the page's vLLM table
    shows the first's prefix-cache hits, measured TPOT, acceptance, tokens per step and
    acceptance by position, as `/admin/latency` gives them; the second's speculative figures
    are unknown (—), not zero."""
    from tests.latency.test_vllm_spec import PLAIN, SPEC, straight
    from tests.routing.test_vllm_routing import sims, vllm

    async with (
        sims(SPEC, PLAIN) as (spec, plain),
        httpx.AsyncClient(timeout=10) as client,
        chromium() as browser,
    ):
        await straight(client, spec, 3)
        settings = gateway_settings(
            {"gpu": vllm(spec), "cpu": vllm(plain)},
            [
                {"name": "m", "deployments": [{"provider": "gpu", "model": "m"}]},
                {"name": "n", "deployments": [{"provider": "cpu", "model": "m"}]},
            ],
        )
        async with run_gateway(settings) as gw:
            await spec.read_by_gateway()
            await plain.read_by_gateway()
            shown = (await client.get(gw.url + "/admin/latency")).json()["vllm"]
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            watched = Watched(page)
            response = await page.goto(gw.url + "/dashboard")
            assert response is not None and response.ok
            figures = shown["gpu"]["spec_decode"]
            gpu = page.locator('[data-provider="gpu"]')
            await expect(gpu.locator('[data-field="state"]')).to_have_text("ok")
            await expect(gpu.locator('[data-field="acceptance"]')).to_have_text(
                _pct(figures["acceptance_rate"])
            )
            await expect(gpu.locator('[data-field="tokens-per-step"]')).to_have_text(
                f"{figures['tokens_per_step']:.2f}"
            )
            await expect(gpu.locator('[data-field="positions"]')).to_have_text(
                " · ".join(_pct(share) for share in figures["per_position"])
            )
            await expect(gpu.locator('[data-field="prefix"]')).to_have_text(
                _pct(shown["gpu"]["prefix_cache_hit_rate"])
            )
            await expect(gpu.locator('[data-field="tpot"]')).to_contain_text(" ms")
            cpu = page.locator('[data-provider="cpu"]')
            await expect(cpu.locator('[data-field="state"]')).to_have_text("ok")
            for field in ("acceptance", "tokens-per-step", "positions", "prefix"):
                await expect(cpu.locator(f'[data-field="{field}"]')).to_have_text("—")
            await expect(cpu.locator('[data-field="running"]')).to_have_text("0")
            ids = await page.eval_on_selector_all(
                "tr[data-provider]", "(rows) => rows.map((row) => row.dataset.provider)"
            )
            assert ids == ["cpu", "gpu"]
            png = await page.locator("#vllm-section").screenshot()
            (tmp_path_factory.getbasetemp() / "dashboard-vllm.png").write_bytes(png)
            assert watched.errors == []
            assert watched.foreign(gw.url) == []
