"""GET /metrics after real traffic: the request counter, the GenAI histograms with their advised
buckets, failover, hedge and breaker counters, and bounded label values.

A request is counted when its handler finishes, just after the last byte went out, so a test
polls the exposition (with a deadline) until the traffic it sent is all counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.telemetry import semconv as sc
from tests.conftest import Upstream, one_model, run_gateway
from tests.telemetry.test_tracing import Sim, two
from tests.timing import eventually

CHAT = {"messages": [{"role": "user", "content": "Say something."}]}
OPS = {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "vllm", "gen_ai_request_model": "m"}


class Scrape:
    """One parsed exposition."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: list[Sample] = [s for f in self.families.values() for s in f.samples]

    def matching(self, name: str, **labels: str) -> list[Sample]:
        """Samples called `name` whose labels include `labels`."""
        return [
            s
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples `matching` (0 when there are none)."""
        return sum(s.value for s in self.matching(name, **labels))

    def buckets(self, name: str, **labels: str) -> list[float]:
        """The `le` boundaries of histogram `name`'s buckets for one label set."""
        found = self.matching(name + "_bucket", **labels)
        return sorted(float(s.labels["le"]) for s in found)


async def scrape(client: httpx.AsyncClient, url: str) -> Scrape:
    resp = await client.get(url + "/metrics")
    assert resp.status_code == 200
    return Scrape(resp.text)


async def scrape_when(
    client: httpx.AsyncClient, url: str, ready: Callable[[Scrape], bool]
) -> Scrape:
    """Scrape until `ready` holds (the requests sent are all counted), within 3 s."""

    async def scraped() -> Scrape | None:
        found = await scrape(client, url)
        return found if ready(found) else None

    return await eventually(scraped, within_s=3, what="the scrape to be ready", every_s=0.005)


def requests_counted(n: int) -> Callable[[Scrape], bool]:
    return lambda s: s.value(sc.REQUESTS + "_total") >= n


async def stream_chat(
    client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None
) -> httpx.Response:
    body = {"model": "m", "stream": True, **CHAT}
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=body, headers=headers
    ) as resp:
        await resp.aread()
    return resp


async def chat(client: httpx.AsyncClient, url: str, **body: Any) -> httpx.Response:
    return await client.post(url + "/v1/chat/completions", json={"model": "m", **CHAT, **body})


# --- served requests -----------------------------------------------------------------------------


async def test_served_requests_fill_the_counters_and_histograms(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Three streamed and two whole answers: the request counter has exactly five under their
    model, deployment, route and status; the attempt duration and token histograms have five
    observations each on exactly the GenAI-advised buckets; time to first chunk and time per
    output chunk only the three streams; the overhead histogram one per request."""
    async with run_gateway(one_model(upstream.base_url)) as gw:
        for _ in range(3):
            assert (await stream_chat(client, gw.url)).status_code == 200
        for _ in range(2):
            assert (await chat(client, gw.url)).status_code == 200
        found = await scrape_when(client, gw.url, requests_counted(5))

    requests = found.matching(sc.REQUESTS + "_total")
    assert [(s.labels, s.value) for s in requests] == [
        ({"model": "m", "deployment": "up/m", "route": "primary", "status": "200"}, 5.0)
    ]
    assert found.families[sc.REQUESTS].type == "counter"
    assert found.value(sc.ATTEMPTS + "_total", deployment="up/m", outcome="won") == 5

    duration = sc.CLIENT_OPERATION_DURATION
    assert found.families[duration].type == "histogram"
    ((labels),) = {tuple(sorted(s.labels.items())) for s in found.matching(duration + "_count")}
    assert dict(labels) == {**OPS, "error_type": ""}
    assert found.buckets(duration, **OPS) == [*sc.DURATION_BUCKETS, float("inf")]
    assert found.value(duration + "_count", **OPS) == 5
    assert found.value(duration + "_bucket", le="+Inf", **OPS) == 5

    tokens = sc.CLIENT_TOKEN_USAGE
    assert found.families[tokens].type == "histogram"
    types = {s.labels["gen_ai_token_type"] for s in found.matching(tokens + "_count")}
    assert types == {"input", "output"}
    for kind in ("input", "output"):
        assert found.buckets(tokens, gen_ai_token_type=kind, **OPS) == [
            *map(float, sc.TOKEN_BUCKETS),
            float("inf"),
        ]
        assert found.value(tokens + "_count", gen_ai_token_type=kind, **OPS) == 5
    assert found.value(tokens + "_sum", gen_ai_token_type="output", **OPS) == 25  # 5 x 5 tokens
    assert found.value(tokens + "_sum", gen_ai_token_type="input", **OPS) > 0

    for streamed_only in (sc.CLIENT_TIME_TO_FIRST_CHUNK, sc.CLIENT_TIME_PER_OUTPUT_CHUNK):
        assert found.buckets(streamed_only, **OPS) == [*sc.DURATION_BUCKETS, float("inf")]
        assert found.value(streamed_only + "_count", **OPS) == 3, streamed_only

    assert found.value(sc.OVERHEAD + "_count", model="m") == 5
    assert found.buckets(sc.OVERHEAD, model="m") == [*sc.OVERHEAD_BUCKETS, float("inf")]
    server = sc.SERVER_REQUEST_DURATION
    assert found.value(server + "_count", gen_ai_request_model="m", error_type="") == 5
    assert found.value(sc.FALLBACKS + "_total") == 0


# --- routing decisions ---------------------------------------------------------------------------


async def test_failover_is_counted(primary: Sim, fallback: Sim, client: httpx.AsyncClient) -> None:
    """A stalled primary cut at its deadline counts a `ttft_failover` fallback and a
    `ttft_deadline` attempt; the cut attempt has no operation duration of its own."""
    settings = two(primary, fallback, "slow@stall_rate=1", budget={"ttft_ms": 300})
    async with run_gateway(settings) as gw:
        resp = await stream_chat(client, gw.url)
        assert resp.headers["x-tailguard-route"] == "ttft_failover"
        found = await scrape_when(client, gw.url, requests_counted(1))
    assert found.value(sc.FALLBACKS + "_total", model="m", reason="ttft_failover") == 1
    assert found.value(sc.FALLBACKS + "_total") == 1
    cut = "p/slow@stall_rate=1"
    assert found.value(sc.ATTEMPTS + "_total", deployment=cut, outcome="ttft_deadline") == 1
    assert found.value(sc.ATTEMPTS + "_total", deployment="f/ok", outcome="won") == 1
    assert (
        found.value(
            sc.REQUESTS + "_total",
            model="m",
            deployment="f/ok",
            route="ttft_failover",
            status="200",
        )
        == 1
    )
    duration = sc.CLIENT_OPERATION_DURATION + "_count"
    assert found.matching(duration, gen_ai_request_model="slow@stall_rate=1") == []
    assert found.value(duration, gen_ai_request_model="ok") == 1


async def test_hedge_is_counted(primary: Sim, fallback: Sim, client: httpx.AsyncClient) -> None:
    """A hedge that wins counts `started` and `won`; the beaten primary is a `hedge_lost`
    attempt, and a hedge is not a fallback."""
    settings = two(
        primary,
        fallback,
        "slow@prefill_base_ms=2000",
        budget={"ttft_ms": 400},
        on_ttft_miss="hedge",
        hedge_max_fraction=1.0,
    )
    async with run_gateway(settings) as gw:
        resp = await stream_chat(client, gw.url)
        assert resp.headers["x-tailguard-route"] == "hedge"
        found = await scrape_when(client, gw.url, requests_counted(1))
    assert found.families[sc.HEDGES].type == "counter"
    assert found.value(sc.HEDGES + "_total", model="m", result="started") == 1
    assert found.value(sc.HEDGES + "_total", model="m", result="won") == 1
    assert found.value(sc.HEDGES + "_total", result="denied") == 0
    lost = "p/slow@prefill_base_ms=2000"
    assert found.value(sc.ATTEMPTS + "_total", deployment=lost, outcome="hedge_lost") == 1
    assert found.value(sc.REQUESTS + "_total", route="hedge", status="200") == 1
    assert found.value(sc.FALLBACKS + "_total") == 0


async def test_breaker_opening_is_counted(
    primary: Sim, fallback: Sim, client: httpx.AsyncClient
) -> None:
    """Three 500s in a row open the primary's breaker once (every configured deployment has its
    series from the start, so `increase()` sees a first opening); each failed attempt is an
    `error` attempt with an operation duration labelled by its error type, and each request an
    `error_fallback`."""
    settings = two(primary, fallback, "bad@error_500_rate=1")
    async with run_gateway(settings) as gw:
        for _ in range(4):
            assert (await stream_chat(client, gw.url)).status_code == 200
        found = await scrape_when(client, gw.url, requests_counted(4))
    bad = "p/bad@error_500_rate=1"
    assert found.families[sc.COOLDOWNS].type == "counter"
    assert {s.labels["deployment"]: s.value for s in found.matching(sc.COOLDOWNS + "_total")} == {
        bad: 1.0,
        "f/ok": 0.0,
    }
    assert found.value(sc.ATTEMPTS + "_total", deployment=bad, outcome="error") == 3
    assert found.value(sc.FALLBACKS + "_total", model="m", reason="error_fallback") == 4
    failed = found.matching(
        sc.CLIENT_OPERATION_DURATION + "_count", gen_ai_request_model="bad@error_500_rate=1"
    )
    assert [s.value for s in failed] == [3.0]
    assert failed[0].labels["error_type"] not in ("", None)


# --- errors and cardinality ----------------------------------------------------------------------


async def test_refused_requests_are_counted_without_unbounded_labels(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A 400 (bad JSON) and a 404 (unknown model) are counted under their status with an empty
    model: a name a client made up never becomes a label value, nor does a request id. Neither is
    an observation of the overhead histogram, and no `_created` series are exposed."""
    async with run_gateway(one_model(upstream.base_url)) as gw:
        ok = await chat(client, gw.url, stream=False)
        bad = await client.post(
            gw.url + "/v1/chat/completions",
            content=b'{"model": "m", "messages": [',
            headers={"content-type": "application/json", "x-request-id": "req-UNIQUE-123"},
        )
        unknown = await client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "gpt-UNKNOWN-zzz", **CHAT},
            headers={"x-request-id": "req-UNIQUE-123"},
        )
        await stream_chat(client, gw.url, headers={"x-request-id": "req-UNIQUE-123"})
        found = await scrape_when(client, gw.url, requests_counted(4))
    assert (ok.status_code, bad.status_code, unknown.status_code) == (200, 400, 404)
    assert bad.headers["x-request-id"] == "req-UNIQUE-123"
    requests = sc.REQUESTS + "_total"
    empty = {"model": "", "deployment": "", "route": ""}
    assert found.value(requests, status="400", **empty) == 1
    assert found.value(requests, status="404", **empty) == 1
    assert found.value(requests, model="m", status="200") == 2
    assert found.value(sc.OVERHEAD + "_count") == 2
    server = sc.SERVER_REQUEST_DURATION + "_count"
    assert found.value(server, gen_ai_request_model="", error_type="model_not_found") == 1
    assert found.value(server, gen_ai_request_model="", error_type="invalid_json") == 1

    assert "gpt-UNKNOWN-zzz" not in found.text
    assert "req-UNIQUE-123" not in found.text
    values = {value for s in found.samples for value in s.labels.values()}
    assert not {v for v in values if "UNKNOWN" in v or "UNIQUE" in v}
    assert not [s.name for s in found.samples if s.name.endswith("_created")]
    assert "_created" not in found.text
