"""Spill-over without over-spill or herding: the queue predictor's estimates between scrapes.

Unit tests drive `TTFTPredictor` with a clock the test moves. The end-to-end tests run simulated
vLLM servers on loopback (real `/metrics` pages) behind the in-process gateway, as in
tests/routing/test_vllm_routing.py, whose helpers they share; every wait is a condition with a
deadline.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.routing.predict import MIN_WEIGHT, STALE_S, STAND_IN_SLOTS, TTFTPredictor
from gateway.sim.engine import SimEngine
from gateway.sim.profile import SimProfile
from gateway.sim.scheduler import SimStats
from tests.conftest import gateway_settings, run_gateway, serve
from tests.latency.test_end_to_end import poll_latency
from tests.routing.test_vllm_routing import (
    HOSTED,
    LOCAL,
    WATCHDOG_S,
    Sim,
    ask,
    served_well,
    sims,
    vllm,
    warm_up,
)
from tests.timing import scaled


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def congested(clock: Clock) -> TTFTPredictor:
    """A predictor whose fit for `d` learned 800 ms at an empty queue (30 observations)."""
    p = TTFTPredictor(clock)
    for _ in range(30):
        p.observe("d", "short", 0.0, 0.8)
    return p


def at_empty_queue(p: TTFTPredictor, prior_s: float | None = 0.05) -> float | None:
    return p.predict("d", "short", waiting=0, running=0, ttft_p50_s=prior_s, total_p50_s=1.0)


# --- the predictor, on a clock the test moves --------------------------------------------------


def test_a_stale_congested_fit_fades_to_the_prior_while_the_queue_reads_empty() -> None:
    """Fresh, the fit stands (800 ms); once nothing has refreshed it for `STALE_S`, each half
    life takes it half the way back to the prior (50 ms), so an idle server comes back."""
    clock = Clock()
    p = congested(clock)
    assert at_empty_queue(p) == pytest.approx(0.8)
    clock.now += STALE_S
    assert at_empty_queue(p) == pytest.approx(0.8)
    clock.now += 1.0  # one half life
    assert at_empty_queue(p) == pytest.approx(0.05 + 0.75 / 2)
    clock.now += 5.0
    assert at_empty_queue(p) == pytest.approx(0.05 + 0.75 / 64)


def test_a_fit_does_not_fade_while_the_server_has_a_queue() -> None:
    """With requests waiting the fit is what the queue costs now: it is kept however old."""
    clock = Clock()
    p = TTFTPredictor(clock)
    for waiting in (0, 2, 4, 8, 0, 6) * 5:
        p.observe("d", "short", waiting, 0.1 + 0.05 * waiting)
    clock.now += 60.0
    queued = p.predict("d", "short", waiting=4, running=8, ttft_p50_s=0.01, total_p50_s=0.08)
    assert queued == pytest.approx(0.1 + 0.05 * 4, rel=1e-6)


def test_after_fading_new_observations_count_in_full() -> None:
    """The faded fit keeps its weight as pseudo-observations of the prior: a few fast first
    tokens pull it further down, not back up to what it learned under congestion."""
    clock = Clock()
    p = congested(clock)
    clock.now += STALE_S + 10.0
    faded = at_empty_queue(p)
    assert faded is not None and faded < 0.06
    for _ in range(5):
        p.observe("d", "short", 0.0, 0.04)
    after = at_empty_queue(p)
    assert after is not None and 0.04 < after < faded


def test_without_a_prior_a_stale_fit_is_forgotten() -> None:
    """No latency figures to fade toward: the fit loses weight until it is dropped, and the
    prediction is None (the planner then explores the server like an unknown one)."""
    clock = Clock()
    p = congested(clock)
    clock.now += STALE_S + 0.5
    assert at_empty_queue(p, prior_s=None) == pytest.approx(0.8)
    clock.now += 3.0
    assert at_empty_queue(p, prior_s=None) is None
    assert p.learned() == {}


def test_requests_sent_since_the_scrape_fill_the_free_slots_then_queue() -> None:
    """Four slots, a scrape that showed the server empty: the first four requests sent since
    find a slot (0), the next ones wait for one (1, 2, ...)."""
    p = TTFTPredictor(Clock())
    queued = [
        p.queued("d", running=0, waiting=0, scraped_at=1.0, slots=4, inflight=sent)
        for sent in range(7)
    ]
    assert queued == [0, 0, 0, 0, 1, 2, 3]


def test_this_replicas_finished_requests_come_off_the_scraped_load() -> None:
    """The scrape showed 4 running and 2 waiting, all this replica's (6 in flight when it was
    first read): once 3 of them have finished, a request sent now finds a slot."""
    p = TTFTPredictor(Clock())
    full = p.queued("d", running=4, waiting=2, scraped_at=1.0, slots=4, inflight=6)
    assert full == 3  # two ahead, then itself
    assert p.queued("d", running=4, waiting=2, scraped_at=1.0, slots=4, inflight=3) == 0
    # Another client's requests count as the scrape showed them: 2 of ours on top of 4 others.
    other = TTFTPredictor(Clock())
    assert other.queued("d", running=4, waiting=0, scraped_at=1.0, slots=6, inflight=0) == 0
    assert other.queued("d", running=4, waiting=0, scraped_at=1.0, slots=6, inflight=2) == 1


def test_unknown_slots_are_a_small_stand_in_raised_by_what_the_server_ran() -> None:
    """Never seen full: `STAND_IN_SLOTS` are assumed, or twice the most it was seen running."""
    p = TTFTPredictor(Clock())
    stand_in = int(STAND_IN_SLOTS)
    assert p.queued("d", running=0, waiting=0, scraped_at=1.0, slots=None, inflight=stand_in) == 1
    p.queued("d", running=10, waiting=0, scraped_at=2.0, slots=None, inflight=10)
    assert p.queued("d", running=10, waiting=0, scraped_at=2.0, slots=None, inflight=20) == 1
    assert p.queued("d", running=10, waiting=0, scraped_at=2.0, slots=None, inflight=19) == 0


# --- end to end: simulated vLLM servers behind the gateway -------------------------------------


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(timeout=WATCHDOG_S, limits=limits) as http:
        yield http


SLOTS = 2
# Requests that stay over a second in their slots: a burst is all in flight at once.
LONG = SimProfile(max_batch=SLOTS, prefill_base_ms=20, tokens_per_s=20, output_tokens=30)


async def learn_slots(client: httpx.AsyncClient, servers: list[Sim]) -> None:
    """Show the gateway each server full (its slots held, one more waiting), then idle again."""
    for sim in servers:
        await sim.hold(client, SLOTS + 1)
    for sim in servers:
        await sim.read_by_gateway()
    for sim in servers:
        await sim.release()
    for sim in servers:
        await sim.read_by_gateway()


async def holding(servers: list[Sim], n: int) -> list[tuple[int, int]]:
    """(running, waiting) of each server, once they hold `n` requests between them."""

    def load() -> list[tuple[int, int]]:
        return [(sim.stats.running, sim.stats.waiting) for sim in servers]

    def moved(was: tuple[int, int]) -> Callable[[SimStats], bool]:
        return lambda s: (s.running, s.waiting) != was

    async with asyncio.timeout(WATCHDOG_S):
        while sum(r + w for r, w in load()) < n:
            changes = [
                asyncio.ensure_future(sim.stats.wait_for(moved(was)))
                for sim, was in zip(servers, load(), strict=True)
            ]
            try:
                await asyncio.wait(changes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for change in changes:
                    change.cancel()
    return load()


async def test_a_burst_within_one_scrape_interval_spreads_over_idle_servers(
    client: httpx.AsyncClient,
) -> None:
    """Three idle servers of two slots each, all shown empty by their last scrape, and twelve
    requests at once: each server gets its two slots' worth before any gets a third, and the
    rest are spread over them, rather than all going to the one whose baseline is lowest."""
    async with sims(LONG, LONG, LONG) as servers:
        names = dict(zip("abc", servers, strict=True))
        providers = {name: vllm(sim) for name, sim in names.items()}
        models: list[dict[str, Any]] = [
            {"name": "m", "deployments": [{"provider": n, "model": "local"} for n in names]},
            *(
                {"name": f"only-{n}", "deployments": [{"provider": n, "model": "local"}]}
                for n in names
            ),
        ]
        # One prompt for every request: cache-aware routing would steer them by prefix.
        off = {"affinity": {"enabled": False}}
        async with run_gateway(gateway_settings(providers, models, routing=off)) as gw:
            for name in names:  # a baseline for each (short answers: quick)
                for _ in range(2):
                    assert served_well(await ask(client, gw.url, f"only-{name}", max_tokens=2))

            def ready(body: dict[str, Any]) -> bool:
                stats = body["models"]
                return all(
                    stats.get(f"only-{n}", {}).get("ttft_ms", {}).get("count") for n in names
                )

            await poll_latency(client, gw.url, ready)
            await learn_slots(client, servers)
            burst = [asyncio.create_task(ask(client, gw.url, max_tokens=30)) for _ in range(12)]
            held = await holding(servers, 12)
            answers = await asyncio.gather(*burst)
    # Every server got its two slots' worth before any got a third, and the rest did not all
    # queue at one. How evenly they queue beyond that depends on whether a scrape lands inside
    # the burst, which a busy machine decides.
    assert [running for running, _ in held] == [SLOTS] * 3, held
    assert max(waiting for _, waiting in held) < 12 - 3 * SLOTS, held
    assert all(served_well(x) for x in answers), answers


async def fit_weight(client: httpx.AsyncClient, gateway_url: str, fit: str) -> float:
    """The observations (decayed) behind the queue predictor's fit `deployment/band`."""
    learned = (await client.get(gateway_url + "/admin/latency")).json()["predictor"]
    return float(learned[fit]["observations"]) if fit in learned else 0.0


def count(body: dict[str, Any], model: str) -> int:
    """First tokens of `model` in the latency window."""
    stats = body["models"].get(model)
    return int(stats["ttft_ms"]["count"]) if stats else 0


@dataclass
class SlowSim(Sim):
    """A simulated server that answers completions `delay_s` late, its page none the wiser."""

    delay_s: float = 0.0

    def app(self) -> Any:
        inner = super().app()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if self.delay_s and scope["type"] == "http" and scope["path"].endswith("completions"):
                await asyncio.sleep(self.delay_s)  # the server's own latency
            await inner(scope, receive, send)

        return app


@pytest.mark.slow
async def test_a_congested_fit_recovers_once_the_queue_reads_empty(
    client: httpx.AsyncClient,
) -> None:
    """The local server was slow while its page showed no queue (a base of ~400 ms learned),
    then is fast again. The fit keeps the traffic on the hosted fallback at first; once the
    window has forgotten those requests and the fit has faded on an empty queue, local
    traffic returns.

    A busy machine changes how fast this runs, not what it shows: the window stretches with
    the machine (the slow requests are still in it when the spill is judged), and the fit is
    taught until it is in use (a request routed while the page's scrape was late has no
    prediction, so teaches nothing)."""
    window_s = math.ceil(scaled(5))
    async with AsyncExitStack() as stack:
        roomy = LOCAL.model_copy(update={"max_batch": 16})
        a = SlowSim(SimEngine({}, roomy, seed=1), delay_s=0.4)
        a.url = await stack.enter_async_context(serve(a.app()))
        (hosted,) = await stack.enter_async_context(sims(HOSTED))
        settings = gateway_settings(
            {"a": vllm(a), "hosted": {"type": "openai", "base_url": hosted.base_url}},
            [
                {
                    "name": "m",
                    "deployments": [{"provider": "a", "model": "local"}],
                    "budget": {"ttft_ms": 300},
                    "fallbacks": ["hosted"],
                },
                {"name": "only-a", "deployments": [{"provider": "a", "model": "local"}]},
                {
                    "name": "hosted",
                    "deployments": [
                        {"provider": "hosted", "model": "remote", "prior": {"ttft_ms": 100}}
                    ],
                },
            ],
            latency={"window_s": window_s, "slice_s": 1},
        )
        async with run_gateway(settings) as gw:
            # Two to give it a baseline (the fit learns only where there is a prediction),
            # then twelve at once (the fit's minimum weight) until the fit is in use.
            await warm_up(client, gw.url, {"only-a": 2})
            async with asyncio.timeout(scaled(WATCHDOG_S)):
                while await fit_weight(client, gw.url, "a/local/short") < MIN_WEIGHT:
                    warm = [ask(client, gw.url, "only-a") for _ in range(12)]
                    assert all(served_well(x) for x in await asyncio.gather(*warm))
            await poll_latency(client, gw.url, lambda body: count(body, "only-a") >= 14)
            a.delay_s = 0.0
            spilled = await ask(client, gw.url)

            def forgotten(body: dict[str, Any]) -> bool:
                return "a/local" not in body["deployments"] or (
                    body["deployments"]["a/local"]["ttft_ms"]["count"] == 0
                )

            await poll_latency(client, gw.url, forgotten, within_s=window_s + WATCHDOG_S)
            async with asyncio.timeout(scaled(WATCHDOG_S)):
                while (back := await ask(client, gw.url)).deployment != "a/local":
                    assert served_well(back)
    assert (spilled.deployment, spilled.route) == ("hosted/remote", "budget")
    assert served_well(back) and back.route == "primary"


async def test_an_idle_server_without_history_ranks_by_its_queue(
    client: httpx.AsyncClient,
) -> None:
    """`a` has latency history and a queue; `b` was never used (no statistics, no TTFT on its
    page) and reads empty. `b` is predicted from `a`'s baseline and so leads, instead of
    sorting after the busy server that has a prediction."""
    async with sims(LOCAL, LOCAL) as (a, b):
        providers = {"a": vllm(a), "b": vllm(b)}
        models = [
            {
                "name": "m",
                "deployments": [
                    {"provider": "a", "model": "local", "weight": 1000},
                    {"provider": "b", "model": "local", "weight": 1},
                ],
            },
            {"name": "only-a", "deployments": [{"provider": "a", "model": "local"}]},
        ]
        async with run_gateway(gateway_settings(providers, models)) as gw:
            await warm_up(client, gw.url, {"only-a": 6})
            await a.hold(client, LOCAL.max_batch + 4)
            await a.read_by_gateway()
            await b.read_by_gateway()
            answer = await ask(client, gw.url)
    assert served_well(answer)
    assert (answer.deployment, answer.route) == ("b/local", "primary")
