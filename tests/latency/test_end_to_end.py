"""Latency statistics end to end: real gateways (in-process and as processes), real upstreams,
`GET /admin/latency`, `tailguard stats`, sharing through Redis and surviving its loss."""

from __future__ import annotations

import asyncio
import math
import re
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import orjson
import pytest
import yaml
from redis.asyncio import Redis

from gateway.latency import BYTES_PER_TOKEN
from gateway.sim.text import TOKENS as SIM_TOKENS
from tests.conftest import (
    RedisServer,
    Upstream,
    free_port,
    gateway_settings,
    one_model,
    run_gateway,
)
from tests.timing import eventually, scaled

CHAT = {"messages": [{"role": "user", "content": "Say something."}], "stream": True}
METRIC_KEYS = ("ttft_ms", "tpot_ms", "total_ms")
# A few ms of prefill with a heavy tail and a fast decode: percentiles that differ, quickly.
SPREAD_PROFILE = {
    "prefill_base_ms": 5,
    "ttft_tail": "lognormal",
    "ttft_sigma": 0.5,
    "tokens_per_s": 2000,
    "output_tokens": 5,
}
SPREAD = "tiny@" + ",".join(f"{k}={v}" for k, v in SPREAD_PROFILE.items())
Body = dict[str, Any]


def chat(model: str) -> dict[str, Any]:
    return {"model": model, **CHAT}


async def stream_chat(
    client: httpx.AsyncClient, url: str, model: str, n: int
) -> list[httpx.Response]:
    """Send `n` streamed chat requests one after another; each must end with `[DONE]`."""
    responses = []
    for _ in range(n):
        async with client.stream("POST", url + "/v1/chat/completions", json=chat(model)) as resp:
            text = (await resp.aread()).decode()
        assert resp.status_code == 200, text
        assert text.rstrip().endswith("data: [DONE]")
        responses.append(resp)
    return responses


async def poll_latency(
    client: httpx.AsyncClient, url: str, ready: Callable[[Body], bool], *, within_s: float = 5.0
) -> Body:
    """`GET /admin/latency` until `ready(body)` holds (the snapshot refreshes about every second),
    or fail with the last body once `within_s` (scaled) has passed."""
    last: list[Body] = []

    async def fetched() -> Body | None:
        resp = await client.get(url + "/admin/latency")
        assert resp.status_code == 200
        body: Body = resp.json()
        last[:] = [body]
        return body if ready(body) else None

    return await eventually(fetched, within_s=within_s, what=lambda: f"/admin/latency: {last}")


def count(
    kind: str, name: str, metric: str = "ttft_ms", n: int | None = None
) -> Callable[..., bool]:
    """A `ready` test: the deployment (or model) has `n` samples of `metric` (any, if None)."""

    def ready(body: Body) -> bool:
        target = body[kind].get(name)
        if target is None:
            return False
        found = int(target[metric]["count"])
        return found > 0 if n is None else found == n

    return ready


def ordered(metric: dict[str, Any]) -> bool:
    return bool(metric["p50"] <= metric["p90"] <= metric["p99"])


# --- one in-process gateway --------------------------------------------------------------------


async def test_streamed_requests_show_up_per_deployment_and_model(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """After N streamed requests the deployment and the model each show N samples of every
    metric, ordered percentiles, no errors and nothing in flight."""
    n = 25
    async with run_gateway(one_model(upstream.base_url, SPREAD)) as gw:
        await stream_chat(client, gw.url, "m", n)
        body = await poll_latency(client, gw.url, count("deployments", f"up/{SPREAD}", n=n))
    assert body["source"] == "memory"
    assert body["window_s"] == 60
    for target in (body["deployments"][f"up/{SPREAD}"], body["models"]["m"]):
        for key in METRIC_KEYS:
            assert target[key]["count"] == n, key
            assert ordered(target[key]), (key, target[key])
        assert target["ttft_ms"]["p50"] < target["ttft_ms"]["p99"]  # real spread, not one bucket
        assert target["ttft_ms"]["p99"] <= target["total_ms"]["p99"] * 1.05  # sketch error
        assert (target["requests"], target["errors"], target["inflight"]) == (n, 0, 0)
        assert target["trusted"] is True  # 25 >= min_samples (20)
    assert set(body["deployments"]) == {f"up/{SPREAD}"}
    assert set(body["models"]) == {"m"}


async def test_failed_attempts_are_errors_not_latencies(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A deployment answering 500 counts each attempt as an error of its own and adds no latency;
    the fallback that served gets the samples."""
    n = 5
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [
            {
                "name": "m",
                "deployments": [{"provider": "up", "model": "m@error_500_rate=1"}],
                "fallbacks": ["backup"],
            },
            {"name": "backup", "deployments": [{"provider": "up", "model": "ok"}]},
        ],
        routing={"cooldown": {"failures": n + 1}},  # every request tries the bad one
    )
    async with run_gateway(settings) as gw:
        responses = await stream_chat(client, gw.url, "m", n)
        body = await poll_latency(client, gw.url, count("deployments", "up/ok", n=n))
    assert {r.headers["x-tailguard-route"] for r in responses} == {"error_fallback"}
    bad = body["deployments"]["up/m@error_500_rate=1"]
    assert (bad["requests"], bad["errors"], bad["inflight"]) == (n, n, 0)
    for key in METRIC_KEYS:
        empty = {"p50": None, "p90": None, "p95": None, "p99": None, "count": 0}
        assert bad[key] == {**empty, "censored": 0, "beyond_ms": None}, key
    assert bad["trusted"] is False
    assert (body["models"]["m"]["errors"], body["models"]["m"]["ttft_ms"]["count"]) == (n, 0)
    for good in (body["deployments"]["up/ok"], body["models"]["backup"]):
        assert (good["requests"], good["errors"], good["ttft_ms"]["count"]) == (n, 0, n)


def attempt_ms(resp: httpx.Response, index: int = 1) -> float:
    """How long attempt `index` lasted, from the `server-timing` header."""
    found = re.search(rf"attempt{index};dur=([0-9.]+)", resp.headers["server-timing"])
    assert found is not None, resp.headers["server-timing"]
    return float(found.group(1))


async def test_a_stall_cut_by_the_ttft_budget_looks_slow(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A stalled primary cut at its TTFT deadline is an error whose TTFT is known only to exceed
    the cut-off (a censored sample): its TTFT tail is beyond every cut, never at or under it."""
    n = 3
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [
            {
                "name": "m",
                "deployments": [
                    {"provider": "up", "model": "slow@stall_rate=1", "weight": 1e9},
                    # A measured successor (its prior) is failed over to, not explored by a hedge.
                    {"provider": "up", "model": "ok", "weight": 1e-9, "prior": {"ttft_ms": 50}},
                ],
                "budget": {"ttft_ms": 300},
                "on_ttft_miss": "failover",
                "hedge_max_fraction": 1.0,  # rescue every request
            }
        ],
    )
    async with run_gateway(settings) as gw:
        responses = await stream_chat(client, gw.url, "m", n)
        body = await poll_latency(client, gw.url, count("deployments", "up/ok", n=n))
        body = await poll_latency(client, gw.url, count("deployments", "up/slow@stall_rate=1", n=n))
    assert {r.headers["x-tailguard-route"] for r in responses} == {"ttft_failover"}
    cut_off_ms = max(attempt_ms(r) for r in responses)
    assert cut_off_ms >= 100  # the deadline is a share of the 300 ms budget, not zero
    slow = body["deployments"]["up/slow@stall_rate=1"]
    assert (slow["requests"], slow["errors"], slow["inflight"]) == (n, n, 0)
    assert slow["total_ms"]["count"] == 0  # a cut attempt has no total time
    assert (slow["ttft_ms"]["count"], slow["ttft_ms"]["censored"]) == (n, n)
    assert slow["ttft_ms"]["p50"] is None  # every observation is "more than the cut-off"
    assert slow["ttft_ms"]["beyond_ms"] >= cut_off_ms * 0.97  # the sketch is good to ~2%
    model = body["models"]["m"]
    assert (model["requests"], model["errors"], model["ttft_ms"]["count"]) == (2 * n, n, 2 * n)
    assert model["ttft_ms"]["p99"] is None  # the slower half was all cut: its tail is unknown


# --- tailguard stats -----------------------------------------------------------------------------


def tailguard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_stats_command_reads_a_live_gateway(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """`tailguard stats` prints a table naming the deployment and the model, `--json` prints
    the raw snapshot, and an unreachable gateway is a one-line error with exit code 1."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [{"name": "assistant-e2e", "deployments": [{"provider": "up", "model": "tiny-e2e"}]}],
    )
    closed = f"http://127.0.0.1:{free_port()}"
    async with run_gateway(settings) as gw:
        await stream_chat(client, gw.url, "assistant-e2e", 3)
        await poll_latency(client, gw.url, count("deployments", "up/tiny-e2e", n=3))
        # The gateway serves from this event loop: the commands run in threads meanwhile.
        table, raw, down = await asyncio.gather(
            asyncio.to_thread(tailguard, "stats", "--url", gw.url),
            asyncio.to_thread(tailguard, "stats", "--url", gw.url + "/", "--json"),
            asyncio.to_thread(tailguard, "stats", "--url", closed),
        )
    assert table.returncode == 0, table.stderr
    assert "up/tiny-e2e" in table.stdout
    assert "assistant-e2e" in table.stdout
    assert "source memory" in table.stdout
    assert "TTFT" in table.stdout
    # Next to attainment, the share a fallback model served: none of the three.
    row = next(line for line in table.stdout.splitlines() if "assistant-e2e" in line)
    assert "0.0% (0/3)" in row, table.stdout
    assert raw.returncode == 0, raw.stderr
    snapshot = orjson.loads(raw.stdout)
    assert snapshot["counters"]["fallback"]["assistant-e2e"]["share"] == 0.0
    assert snapshot["deployments"]["up/tiny-e2e"]["ttft_ms"]["count"] == 3
    assert snapshot["models"]["assistant-e2e"]["requests"] == 3
    assert down.returncode == 1
    assert down.stdout == ""
    assert len(down.stderr.strip().splitlines()) == 1
    assert closed in down.stderr


# --- gateway processes sharing Redis -------------------------------------------------------------


def redis_config(redis_url: str, model: str = "shared") -> dict[str, Any]:
    """A gateway on the shared Redis store, with one model on the in-process simulator."""
    return {
        "server": {"host": "127.0.0.1"},
        "latency": {"store": "redis", "redis_url": redis_url},
        "providers": {"sim": {"type": "simulated", "default_profile": SPREAD_PROFILE}},
        "models": [{"name": model, "deployments": [{"provider": "sim", "model": "tiny"}]}],
    }


@contextmanager
def spawn_gateway(config: dict[str, Any], workdir: Path, name: str) -> Iterator[GatewayProcess]:
    """`tailguard serve` as a child process on a free port, always terminated and reaped."""
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    with (workdir / f"{name}.log").open("w+b") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield GatewayProcess(name, f"http://127.0.0.1:{port}", process, log)
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


@dataclass
class GatewayProcess:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: IO[bytes]

    async def healthy(self, within_s: float = 30.0) -> str:
        """Wait until /healthz answers (bounded); return the URL."""
        async with httpx.AsyncClient(timeout=2) as http:

            async def answered() -> bool:
                if self.process.poll() is not None:
                    pytest.fail(f"gateway {self.name} exited during start-up:\n{self.output()}")
                try:
                    return (await http.get(self.url + "/healthz")).status_code == 200
                except httpx.TransportError:
                    return False

            await eventually(
                answered,
                within_s=within_s,
                what=lambda: f"gateway {self.name} to start:\n{self.output()}",
                every_s=0.05,
            )
        return self.url

    def output(self) -> str:
        """What the process has logged so far."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


@asynccontextmanager
async def gateway_process(config: dict[str, Any], workdir: Path, name: str) -> AsyncIterator[str]:
    """A gateway process that answers /healthz; yields its URL."""
    with spawn_gateway(config, workdir, name) as gateway:
        yield await gateway.healthy()


def shared_numbers(target: dict[str, Any]) -> dict[str, Any]:
    """What replicas must agree on (in-flight is per process)."""
    return {key: target[key] for key in (*METRIC_KEYS, "requests", "errors", "trusted")}


async def test_two_gateway_processes_share_percentiles_through_redis(
    redis_server: RedisServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """Traffic sent only to gateway A shows up in gateway B's /admin/latency within 2 s, with the
    same counts and percentiles."""
    n = 30
    config = redis_config(redis_server.url)
    with spawn_gateway(config, tmp_path, "a") as ga, spawn_gateway(config, tmp_path, "b") as gb:
        a, b = await asyncio.gather(ga.healthy(), gb.healthy())
        await stream_chat(client, a, "shared", n)
        sent_at = time.monotonic()
        done = count("deployments", "sim/tiny", n=n)
        mine = await poll_latency(client, a, lambda body: body["source"] == "redis" and done(body))
        theirs = await poll_latency(client, b, done)
        seen_after_s = time.monotonic() - sent_at
    assert seen_after_s < scaled(2.0), seen_after_s
    assert (mine["source"], theirs["source"]) == ("redis", "redis")
    for kind, name in (("deployments", "sim/tiny"), ("models", "shared")):
        assert shared_numbers(theirs[kind][name]) == shared_numbers(mine[kind][name]), name
        assert theirs[kind][name]["inflight"] == 0
        assert theirs[kind][name]["requests"] == n
        assert theirs[kind][name]["ttft_ms"]["p50"] < theirs[kind][name]["ttft_ms"]["p99"]


@dataclass
class Load:
    """Clients sending streamed requests back to back; every outcome kept with its start time."""

    url: str
    model: str
    clients: int = 20
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (start, seconds)
    failures: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.clients)
        async with httpx.AsyncClient(timeout=10, limits=limits) as http:
            await asyncio.gather(*(self._client(http) for _ in range(self.clients)))

    async def _client(self, http: httpx.AsyncClient) -> None:
        url = self.url + "/v1/chat/completions"
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                async with http.stream("POST", url, json=chat(self.model)) as resp:
                    text = (await resp.aread()).decode()
                if resp.status_code != 200 or not text.rstrip().endswith("data: [DONE]"):
                    self.failures.append(f"{resp.status_code}: {text[-300:]}")
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
            self.latencies.append((started, time.monotonic() - started))
            await asyncio.sleep(0.02)  # pacing, so the load stays steady on a small machine

    def served_between(self, start: float, end: float) -> list[float]:
        return sorted(s for t, s in self.latencies if start <= t < end)


def p99(values: list[float]) -> float:
    return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]


async def poll_ready(
    client: httpx.AsyncClient, url: str, state: str, source: str, *, within_s: float
) -> tuple[Body, Body]:
    """Poll /readyz and /admin/latency until the store's state and the snapshot's source match
    (within `within_s`, scaled to the machine)."""
    last: list[Body] = []

    async def fetched() -> tuple[Body, Body] | None:
        ready = await client.get(url + "/readyz")
        assert ready.status_code == 200  # ready whatever the store's state
        health: Body = ready.json()
        latency: Body = (await client.get(url + "/admin/latency")).json()
        last[:] = [health, latency]
        if health["latency_store"]["state"] == state and latency["source"] == source:
            return health, latency
        return None

    return await eventually(
        fetched, within_s=within_s, what=lambda: f"store at {state}/{source}: {last}"
    )


async def test_redis_outage_under_load_fails_no_request_and_recovers(
    redis_server: RedisServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """Killing Redis under steady load fails no request and keeps latency sane; /readyz says
    degraded and statistics come from the local window; once Redis is back on the same port the
    gateway reconnects by itself."""
    async with gateway_process(redis_config(redis_server.url), tmp_path, "gw") as url:
        load = Load(url, "shared")
        running = asyncio.create_task(load.run())
        try:
            await poll_latency(
                client, url, lambda b: b["source"] == "redis" and count("models", "shared")(b)
            )
            killed_at = time.monotonic()
            redis_server.kill()
            health, latency = await poll_ready(
                client, url, "degraded", "local-fallback", within_s=5
            )
            await poll_latency(  # the local window keeps counting during the outage
                client,
                url,
                lambda b: (
                    b["models"]["shared"]["requests"] > latency["models"]["shared"]["requests"]
                ),
            )
            restarted_at = time.monotonic()
            redis_server.start()
            recovered, back = await poll_ready(client, url, "ok", "redis", within_s=15)
        finally:
            load.stop.set()
            await running
    assert load.failures == []
    assert health["status"] == "ready"
    assert health["latency_store"]["last_error"] is not None
    assert latency["deployments"]["sim/tiny"]["errors"] == 0
    during = load.served_between(killed_at, restarted_at)
    before = load.served_between(0.0, killed_at)
    assert len(during) >= 20 and len(before) >= 20, (len(during), len(before))
    # A request that waited on the dead Redis would pay at least its 250 ms timeout: the median
    # would move by that much. The tail is left to the machine (a shared CI box stalls at times);
    # only a hang would fail it.
    assert statistics.median(during) < statistics.median(before) + 0.2, (during, before)
    assert p99(during) < 5.0, during[-5:]
    assert recovered["latency_store"]["last_ok_at"] is not None
    assert back["models"]["shared"]["requests"] > 0


async def test_keys_written_after_redis_returns_still_expire(
    redis_server: RedisServer, upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """After Redis restarts empty, every key the gateway writes again carries a TTL and its
    deployment is listed in the index, so other replicas find it and nothing outlives the window."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [{"name": "m", "deployments": [{"provider": "up", "model": "tiny"}]}],
        # One 10-minute slice: what is written before and after the outage lands in the same hash.
        latency={"store": "redis", "redis_url": redis_server.url, "window_s": 600, "slice_s": 600},
    )
    redis = Redis.from_url(redis_server.url, decode_responses=True)
    try:
        async with run_gateway(settings) as gw:
            first_slice = time.time() // 600
            await stream_chat(client, gw.url, "m", 3)
            done = count("deployments", "up/tiny", n=3)
            await poll_latency(client, gw.url, lambda b: b["source"] == "redis" and done(b))
            redis_server.kill()
            await stream_chat(client, gw.url, "m", 3)  # the same slice, during the outage
            if time.time() // 600 != first_slice:  # about one run in 500
                pytest.skip("a slice boundary passed mid-test: the case needs a single slice")
            await poll_ready(client, gw.url, "degraded", "local-fallback", within_s=5)
            redis_server.start()
            await poll_ready(client, gw.url, "ok", "redis", within_s=15)

            async def written() -> bool:  # the flush after the restart
                return bool(await redis.keys("*{up/tiny}*"))

            await eventually(written, within_s=5, what="a write after the restart", every_s=0.05)
            ttls = {str(key): await redis.ttl(key) for key in await redis.keys("*")}
            listed = {str(tag) for tag in await redis.zrange("tg:lat:index", 0, -1)}
    finally:
        await redis.aclose()
    assert ttls
    assert all(ttl > 0 for ttl in ttls.values()), ttls
    assert "up/tiny" in listed


async def test_a_stream_cut_by_the_total_budget_teaches_the_router(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A slow decoder whose streams all run past the total budget is still measured: each cut
    stream keeps its TTFT and the pace of its tokens (its total is censored, and the cut is no
    error), so once that is trusted the plan sees it cannot finish in time and the requests go
    to the fast fallback, which meets the budget. (Before, a cut stream taught nothing: every
    request was cut, for as long as the gateway ran.)"""
    settings = gateway_settings(
        {"up": {"type": "openai", "base_url": upstream.base_url}},
        [
            {
                "name": "capable",
                "deployments": [
                    {"provider": "up", "model": "slow@tokens_per_s=25,output_tokens=400"}
                ],
                "budget": {"total_ms": 1000},
                "on_total_miss": "cut",
                "fallbacks": ["fast"],
            },
            {
                "name": "fast",
                "deployments": [
                    {"provider": "up", "model": "fast@tokens_per_s=400,output_tokens=400"}
                ],
            },
        ],
        latency={"min_samples": 3},
    )
    body = {**chat("capable"), "max_tokens": 40}  # 40 tokens: 1.6 s on the slow decoder
    served: list[str] = []
    async with run_gateway(settings) as gw, asyncio.timeout(scaled(30)):
        while not served or served[-1] != "up/fast@tokens_per_s=400,output_tokens=400":
            async with client.stream("POST", gw.url + "/v1/chat/completions", json=body) as resp:
                text = (await resp.aread()).decode()
            assert resp.status_code == 200, text
            served.append(resp.headers["x-tailguard-deployment"])
        latency = (await client.get(gw.url + "/admin/latency")).json()
    assert text.rstrip().endswith("data: [DONE]"), served  # the fallback met the budget
    slow = latency["deployments"]["up/slow@tokens_per_s=25,output_tokens=400"]
    assert slow["tpot_ms"]["count"] >= 3 and slow["ttft_ms"]["count"] >= 3, (served, slow)
    # A cut stream reports no usage: its tokens are estimated from its text (4 bytes a token),
    # and the simulator's tokens are whole words, so its 40 ms a word reads per estimated token.
    word_bytes = statistics.mean(len(word) for word in SIM_TOKENS)
    assert slow["tpot_ms"]["p50"] == pytest.approx(40 * BYTES_PER_TOKEN / word_bytes, rel=0.25)
    assert slow["total_ms"]["censored"] >= 3
    assert slow["errors"] == 0  # cut by the gateway's own budget: slow, not broken
    assert len(served) <= 8  # min_samples cut streams, a snapshot refresh, then the fallback
