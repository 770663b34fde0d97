"""Load-aware routing to vLLM, end to end: simulated vLLM servers with real `/metrics` pages.

Every server is its own simulator on loopback (`GET /metrics` driven by its real queue), every
provider is of type `vllm` scraped every 0.1 s, and the gateway runs in-process. A test makes a
server busy by sending it requests directly (they sit in a ten-minute prefill: the first
`max_batch` hold the slots, the rest queue), then waits until the gateway has read a page written
after that (two more scrapes counted at the server) before it sends anything through the gateway.
Nothing sleeps for a fixed time: every wait is a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from gateway.latency.vllm import parse_metrics
from gateway.sim.engine import SimEngine
from gateway.sim.profile import SimProfile
from gateway.sim.scheduler import SimStats
from gateway.sim.server import create_sim_app
from tests.conftest import free_port, gateway_settings, run_gateway, serve
from tests.latency.test_end_to_end import poll_latency

WATCHDOG_S = 15.0  # only reached when a test is broken
SCRAPE_S = 0.1  # the providers' metrics_interval_s
MAX_BATCH = 2
HELD = "local@prefill_base_ms=600000"  # the same batch slots as `local`, ten minutes of prefill
TTFT_BUDGET_MS = 300
# ~20 ms to the first token, ~160 ms in all: a queued request waits about 160 / 2 = 80 ms per
# request ahead of it, so six queued put a new one ~500 ms away from its first token.
LOCAL = SimProfile(max_batch=MAX_BATCH, prefill_base_ms=20, tokens_per_s=50, output_tokens=8)
HOSTED = SimProfile(prefill_base_ms=50, tokens_per_s=200, output_tokens=8)

Scope = MutableMapping[str, Any]
ASGI = Callable[[Scope, Any, Any], Awaitable[None]]


@dataclass
class Sim:
    """A simulated server on loopback that counts how often its `/metrics` was asked for."""

    engine: SimEngine
    url: str = ""
    scrapes: int = 0
    _scraped: asyncio.Event = field(default_factory=asyncio.Event)
    _held: list[asyncio.Task[Any]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def stats(self) -> SimStats:
        return self.engine.stats

    def app(self) -> ASGI:
        inner = create_sim_app(self.engine)

        async def app(scope: Scope, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] == "/metrics":
                self.scrapes += 1
                self._scraped.set()
            await inner(scope, receive, send)

        return app

    async def read_by_gateway(self, pages: int = 2) -> None:
        """Return once the gateway has asked for `pages` more pages: the last but one was
        written after this call began, and the gateway has finished with it."""
        target = self.scrapes + pages
        async with asyncio.timeout(WATCHDOG_S):
            while self.scrapes < target:
                self._scraped.clear()
                await self._scraped.wait()

    async def wait(self, predicate: Callable[[SimStats], bool]) -> None:
        async with asyncio.timeout(WATCHDOG_S):
            await self.engine.stats.wait_for(predicate)

    async def hold(self, client: httpx.AsyncClient, n: int) -> None:
        """Send `n` requests straight to this server that stay in prefill: `max_batch` of them
        run, the rest wait in its queue. Cancelled by `release`."""
        running, waiting = self.stats.running, self.stats.waiting
        body = {"model": HELD, "messages": [{"role": "user", "content": "hold"}]}
        for _ in range(n):
            self._held.append(
                asyncio.create_task(client.post(self.base_url + "/chat/completions", json=body))
            )
        slots = min(n, MAX_BATCH - running)
        await self.wait(lambda s: (s.running, s.waiting) == (running + slots, waiting + n - slots))

    async def release(self) -> None:
        for task in self._held:
            task.cancel()
        await asyncio.gather(*self._held, return_exceptions=True)
        self._held.clear()
        await self.wait(lambda s: s.running == 0 and s.waiting == 0)

    async def page(self, client: httpx.AsyncClient) -> str:
        response = await client.get(self.url + "/metrics")
        assert response.status_code == 200
        return response.text


@asynccontextmanager
async def sims(*profiles: SimProfile) -> AsyncIterator[list[Sim]]:
    async with AsyncExitStack() as stack:
        started = []
        for index, profile in enumerate(profiles):
            sim = Sim(SimEngine({}, profile, seed=index + 1))
            sim.url = await stack.enter_async_context(serve(sim.app()))
            started.append(sim)
        try:
            yield started
        finally:
            for sim in started:
                await sim.release()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(timeout=WATCHDOG_S, limits=limits) as http:
        yield http


def vllm(sim: Sim, **extra: Any) -> dict[str, Any]:
    return {"type": "vllm", "base_url": sim.base_url, "metrics_interval_s": SCRAPE_S, **extra}


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    ttft_s: float | None
    done: bool
    errors: list[Any]

    @property
    def deployment(self) -> str | None:
        value: str | None = self.headers.get("x-tailguard-deployment")
        return value

    @property
    def route(self) -> str | None:
        value: str | None = self.headers.get("x-tailguard-route")
        return value


async def ask(
    client: httpx.AsyncClient, gateway_url: str, model: str = "m", max_tokens: int | None = None
) -> Answer:
    """One streamed chat request through the gateway, read to its end."""
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "messages": [{"role": "user", "content": "Say something."}],
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    started = time.perf_counter()
    ttft = None
    done = False
    errors: list[Any] = []
    async with client.stream("POST", gateway_url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            elif ttft is None and any(
                (c.get("delta") or {}).get("content") for c in event.get("choices") or ()
            ):
                ttft = time.perf_counter() - started
        if resp.status_code != 200:
            errors.append(await resp.aread())
    return Answer(resp.status_code, resp.headers, ttft, done, errors)


def served_well(answer: Answer) -> bool:
    return answer.status == 200 and answer.done and not answer.errors and answer.ttft_s is not None


async def warm_up(client: httpx.AsyncClient, gateway_url: str, models: dict[str, int]) -> None:
    """Send each model its number of requests (one at a time, so nothing queues), then wait
    until the latency snapshot shows them: the predictions start from these p50s."""
    for model, n in models.items():
        for _ in range(n):
            assert served_well(await ask(client, gateway_url, model))

    def ready(body: dict[str, Any]) -> bool:
        stats = body["models"]
        return all(
            model in stats and stats[model]["total_ms"]["count"] >= n for model, n in models.items()
        )

    await poll_latency(client, gateway_url, ready)


def two_local(a: Sim, b: Sim, hosted: Sim | None = None, **model: Any) -> Any:
    """Model `m` on two vLLM servers of `local` (by equal weight), `only-a` / `only-b` on one of
    them each (to warm each up on purpose), and `hosted` (type openai) as `m`'s fallback."""
    providers: dict[str, Any] = {"a": vllm(a), "b": vllm(b)}
    models: list[dict[str, Any]] = [
        {
            "name": "m",
            "deployments": [
                {"provider": "a", "model": "local"},
                {"provider": "b", "model": "local"},
            ],
            **model,
        },
        {"name": "only-a", "deployments": [{"provider": "a", "model": "local"}]},
        {"name": "only-b", "deployments": [{"provider": "b", "model": "local"}]},
    ]
    if hosted is not None:
        providers["hosted"] = {"type": "openai", "base_url": hosted.base_url}
        models[0]["fallbacks"] = ["hosted"]
        models.append(
            {
                "name": "hosted",
                "deployments": [
                    {"provider": "hosted", "model": "remote", "prior": {"ttft_ms": 100}}
                ],
            }
        )
    return gateway_settings(providers, models)


# --- a queue on one server ----------------------------------------------------------------------


@pytest.mark.parametrize("names", ["current", "legacy"])
async def test_requests_go_to_the_server_without_a_queue(
    client: httpx.AsyncClient, names: str
) -> None:
    """Server `a` has two requests running and six queued; `b` is idle. Every new request goes
    to `b`: its predicted TTFT (~20 ms) is far below `a`'s (~20 ms + 6 x 80 ms). With the
    deprecated metric names (`gpu_cache_usage_perc`, `time_per_output_token_seconds`) the page
    is read all the same."""
    profile = LOCAL.model_copy(update={"metrics_names": names})
    async with sims(profile, profile) as (a, b), run_gateway(two_local(a, b)) as gw:
        await warm_up(client, gw.url, {"only-a": 6, "only-b": 6})
        await a.hold(client, MAX_BATCH + 6)
        await a.read_by_gateway()
        answers = [await ask(client, gw.url) for _ in range(8)]
        assert all(served_well(x) for x in answers), answers
        assert [x.deployment for x in answers] == ["b/local"] * 8
        assert {x.route for x in answers} == {"primary"}
        # `a` saw none of them: its queue is just what the test put there.
        assert (a.stats.running, a.stats.waiting) == (MAX_BATCH, 6)
        page = await a.page(client)
    if names == "legacy":
        assert "vllm:gpu_cache_usage_perc{" in page and "vllm:kv_cache_usage_perc{" not in page
    load = parse_metrics(page)
    assert (load.running, load.waiting) == (MAX_BATCH, 6)
    assert load.kv_usage is not None and load.kv_usage > 0  # the held prompts sit in the cache


async def test_the_queue_moves_traffic_back_once_it_drains(client: httpx.AsyncClient) -> None:
    """The preference follows the live queue: busy `a` is avoided, then used again once its
    queue is gone (here: `b` gets the queue instead)."""
    async with sims(LOCAL, LOCAL) as (a, b), run_gateway(two_local(a, b)) as gw:
        await warm_up(client, gw.url, {"only-a": 6, "only-b": 6})
        await a.hold(client, MAX_BATCH + 6)
        await a.read_by_gateway()
        first = await ask(client, gw.url)
        await a.release()
        await b.hold(client, MAX_BATCH + 6)
        await a.read_by_gateway()
        await b.read_by_gateway()
        second = await ask(client, gw.url)
    assert (first.deployment, second.deployment) == ("b/local", "a/local")
    assert served_well(first) and served_well(second)


# --- both saturated: spill to the hosted fallback -----------------------------------------------


async def test_both_saturated_spills_to_the_hosted_fallback(client: httpx.AsyncClient) -> None:
    """Both local servers have six queued: predicted TTFT ~500 ms misses the 300 ms budget on
    either, so the plan starts on the hosted fallback (route `budget`), at once (one attempt),
    and the local queues get nothing more."""
    async with sims(LOCAL, LOCAL, HOSTED) as (a, b, hosted):
        settings = two_local(a, b, hosted, budget={"ttft_ms": TTFT_BUDGET_MS})
        async with run_gateway(settings) as gw:
            await warm_up(client, gw.url, {"only-a": 6, "only-b": 6})
            before = (a.stats.requests, b.stats.requests)
            # With one server busy the other takes the traffic (and fits the budget).
            await a.hold(client, MAX_BATCH + 6)
            await a.read_by_gateway()
            one_busy = await ask(client, gw.url)
            await b.hold(client, MAX_BATCH + 6)
            await b.read_by_gateway()
            await a.read_by_gateway()
            answers = [await ask(client, gw.url) for _ in range(5)]
            local_after = (a.stats.requests, b.stats.requests)
    assert served_well(one_busy)
    assert (one_busy.deployment, one_busy.route) == ("b/local", "primary")
    assert all(served_well(x) for x in answers), answers
    assert [x.deployment for x in answers] == ["hosted/remote"] * 5
    assert [x.route for x in answers] == ["budget"] * 5
    assert [x.headers["x-tailguard-attempts"] for x in answers] == ["1"] * 5
    # The held requests, the one that went to `b`: nothing else reached the local servers.
    assert local_after == (before[0] + MAX_BATCH + 6, before[1] + 1 + MAX_BATCH + 6)
    assert hosted.stats.requests == 5


# --- metrics down -------------------------------------------------------------------------------


@pytest.mark.parametrize("down", ["up", "error", "garbage", "closed_port"])
async def test_metrics_down_falls_back_to_the_latency_statistics(
    client: httpx.AsyncClient, down: str
) -> None:
    """One local server, fast in its latency statistics (trusted after 5 samples), then given a
    queue. With its metrics readable the queue is seen and the request spills to the hosted
    fallback straight away (`budget`). With them down (a 500, a page that is not Prometheus text,
    nothing listening) the load is unknown: the plan trusts the statistics, starts locally, and
    the first-token deadline rescues the request (`ttft_failover`). Served without error either
    way."""
    fault = down if down in ("error", "garbage") else "none"
    local = LOCAL.model_copy(update={"metrics_fault": fault})
    async with sims(local, HOSTED) as (a, hosted):
        extra = {"metrics_url": f"http://127.0.0.1:{free_port()}/metrics"}
        provider = vllm(a, **(extra if down == "closed_port" else {}))
        settings = gateway_settings(
            {"a": provider, "hosted": {"type": "openai", "base_url": hosted.base_url}},
            [
                {
                    "name": "m",
                    "deployments": [{"provider": "a", "model": "local"}],
                    "budget": {"ttft_ms": TTFT_BUDGET_MS},
                    "fallbacks": ["hosted"],
                },
                {
                    "name": "hosted",
                    "deployments": [
                        {"provider": "hosted", "model": "remote", "prior": {"ttft_ms": 100}}
                    ],
                },
            ],
            latency={"min_samples": 5},
        )
        async with run_gateway(settings) as gw:
            await warm_up(client, gw.url, {"m": 6})
            await a.hold(client, MAX_BATCH + 6)
            if down != "closed_port":
                await a.read_by_gateway()  # asked for (and failed, or read) after the queue formed
            answer = await ask(client, gw.url)
            if down != "up":
                await a.wait(lambda s: s.cancelled == 1)  # the local attempt was cut and closed
    assert served_well(answer), answer
    assert answer.deployment == "hosted/remote"
    if down == "up":
        assert (answer.route, answer.headers["x-tailguard-attempts"]) == ("budget", "1")
        assert a.stats.requests == 6 + MAX_BATCH + 6  # warm-up and held only
    else:
        assert (answer.route, answer.headers["x-tailguard-attempts"]) == ("ttft_failover", "2")
        assert a.stats.requests == 6 + MAX_BATCH + 6 + 1


async def test_metrics_failing_while_running_make_the_load_unknown(
    client: httpx.AsyncClient,
) -> None:
    """The page starts failing after the gateway has read it: the last good reading is not used
    any more (the route changes from `budget` to `ttft_failover`); when it comes back, it is."""
    async with sims(LOCAL, HOSTED) as (a, hosted):
        settings = gateway_settings(
            {"a": vllm(a), "hosted": {"type": "openai", "base_url": hosted.base_url}},
            [
                {
                    "name": "m",
                    "deployments": [{"provider": "a", "model": "local"}],
                    "budget": {"ttft_ms": TTFT_BUDGET_MS},
                    "fallbacks": ["hosted"],
                },
                {
                    "name": "hosted",
                    "deployments": [
                        {"provider": "hosted", "model": "remote", "prior": {"ttft_ms": 100}}
                    ],
                },
            ],
            latency={"min_samples": 5},
        )
        async with run_gateway(settings) as gw:
            await warm_up(client, gw.url, {"m": 6})
            await a.hold(client, MAX_BATCH + 6)
            await a.read_by_gateway()
            known = await ask(client, gw.url)
            a.engine.metrics_fault = "error"
            await a.read_by_gateway()
            unknown = await ask(client, gw.url)
            a.engine.metrics_fault = "none"
            await a.read_by_gateway()
            back = await ask(client, gw.url)
    assert all(served_well(x) for x in (known, unknown, back))
    assert [x.route for x in (known, unknown, back)] == ["budget", "ttft_failover", "budget"]


# --- the client leaves --------------------------------------------------------------------------


async def test_closing_the_client_stream_aborts_the_request_at_vllm(
    client: httpx.AsyncClient,
) -> None:
    """A client that reads the first token and closes: the gateway closes its upstream stream,
    the server cancels the request (frees the slot), and its metrics count an `abort`."""
    slow = SimProfile(max_batch=MAX_BATCH, tokens_per_s=20, output_tokens=10_000)
    async with sims(slow) as (a,):
        settings = gateway_settings(
            {"a": vllm(a)}, [{"name": "m", "deployments": [{"provider": "a", "model": "local"}]}]
        )
        async with run_gateway(settings) as gw:
            body = {
                "model": "m",
                "stream": True,
                "messages": [{"role": "user", "content": "Talk for a long time."}],
            }
            async with client.stream("POST", gw.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                assert resp.headers["x-tailguard-deployment"] == "a/local"
                async for line in resp.aiter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        break
            await a.wait(lambda s: s.cancelled == 1 and s.running == 0 and s.open_streams == 0)
            page = await a.page(client)
    assert a.stats.completed == 0
    aborted = 'vllm:request_success_total{model_name="local",engine="0",finished_reason="abort"}'
    assert f"{aborted} 1.0" in page
    assert parse_metrics(page).running == 0
