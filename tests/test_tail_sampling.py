"""Tail-aware trace sampling: a real gateway exporting OTLP/HTTP to a real receiver on loopback.

Spans of a request are held until its SERVER span ends and then exported together or dropped.
The batch processor exports in the order spans reach it, so a dropped trace is shown by sending
a kept one after it and waiting for that one to arrive (a short `OTEL_BSP_SCHEDULE_DELAY` makes
it arrive while the gateway still runs, so `/metrics` can be read).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context
from prometheus_client.parser import text_string_to_metric_families

from gateway import semconv as sc
from gateway.config import Settings
from gateway.telemetry import tracing_from_env
from gateway.telemetry.tracing import TailProcessor
from tests.conftest import free_port, gateway_settings
from tests.test_tracing import (
    CHAT,
    Collector,
    Sim,
    client,
    collector,
    fallback,
    primary,
    stream_chat,
    traced_gateway,
    two,
)

__all__ = ["client", "collector", "fallback", "primary"]  # fixtures, used by name

FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "10"}


def settings_for(primary: Sim, fallback: Sim) -> Settings:
    """`plain` serves; `broken` always answers 500 with nothing to fall back to; `stalls` stalls
    and is failed over to `b` at its 300 ms first-token deadline."""
    return gateway_settings(
        {
            "p": {"type": "vllm", "base_url": primary.base_url},
            "f": {"type": "vllm", "base_url": fallback.base_url},
        },
        [
            {"name": "plain", "deployments": [{"provider": "p", "model": "ok"}]},
            {"name": "broken", "deployments": [{"provider": "p", "model": "m@error_500_rate=1"}]},
            {
                "name": "stalls",
                "deployments": [{"provider": "p", "model": "slow@stall_rate=1"}],
                "fallbacks": ["b"],
                "budget": {"ttft_ms": 300},
            },
            {
                "name": "b",
                "deployments": [{"provider": "f", "model": "ok", "prior": {"ttft_ms": 50}}],
            },
        ],
    )


async def chat(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    headers: Mapping[str, str] | None = None,
    *,
    stream: bool = False,
) -> httpx.Response:
    """One chat request, read to its end (a stream's first-token deadline can fail it over)."""
    body = {"model": model, "stream": stream, **CHAT}
    async with http.stream(
        "POST", url + "/v1/chat/completions", json=body, headers=dict(headers or {})
    ) as response:
        await response.aread()
    return response


def servers_by_request(collector: Collector) -> dict[str, Any]:
    return {s.attributes[sc.TG_REQUEST_ID]: s for s in collector.receiver.of_kind("SERVER")}


def exported(collector: Collector, request_id: str) -> bool:
    return request_id in servers_by_request(collector)


def decisions(metrics: str) -> dict[tuple[str, str], float]:
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    family = families[sc.TRACES]
    assert family.type == "counter"
    return {
        (s.labels["decision"], s.labels["reason"]): s.value
        for s in family.samples
        if s.name == sc.TRACES + "_total"
    }


async def test_only_remarkable_traces_are_exported_with_all_their_spans(
    collector: Collector, primary: Sim, fallback: Sim, client: httpx.AsyncClient
) -> None:
    """With a share of 0, a plain request's trace is dropped, while an erroring request's and a
    failed-over request's are exported whole (SERVER span and every attempt's CLIENT span);
    `/metrics` counts each decision by reason."""
    environ = {**collector.env, **FAST_EXPORT, "TAILGUARD_TRACES_TAIL_RATIO": "0"}
    async with traced_gateway(settings_for(primary, fallback), environ) as url:
        plain = await chat(client, url, "plain")
        broken = await chat(client, url, "broken")
        failover = await chat(client, url, "stalls", stream=True)
        assert (plain.status_code, broken.status_code, failover.status_code) == (200, 502, 200)
        assert failover.headers["x-tailguard-route"] == "ttft_failover"
        last = failover.headers["x-request-id"]
        async with asyncio.timeout(5):
            await collector.receiver.wait_for(lambda _: exported(collector, last))
        metrics = (await client.get(url + "/metrics")).text
    servers = servers_by_request(collector)
    assert set(servers) == {broken.headers["x-request-id"], last}
    error_server, failover_server = servers[broken.headers["x-request-id"]], servers[last]
    children = {
        server.span_id: sorted(
            s.name
            for s in collector.receiver.of_kind("CLIENT")
            if s.parent_span_id == server.span_id
        )
        for server in (error_server, failover_server)
    }
    assert children == {
        error_server.span_id: ["chat m@error_500_rate=1"],
        failover_server.span_id: ["chat ok", "chat slow@stall_rate=1"],
    }
    assert len(collector.receiver.spans) == 5  # nothing of the plain request
    counts = decisions(metrics)
    assert counts[("exported", "error")] == 1
    assert counts[("exported", "fallback")] == 1
    assert counts[("dropped", "rest")] == 1
    assert counts[("exported", "share")] == 0
    assert sum(counts.values()) == 3


async def test_a_hedged_request_is_exported_whole(
    collector: Collector, primary: Sim, fallback: Sim, client: httpx.AsyncClient
) -> None:
    """With a share of 0, a hedged stream's trace is kept, the attempt that lost included, and
    counted as a hedge."""
    settings = two(
        primary,
        fallback,
        "slow@prefill_base_ms=2000",
        budget={"ttft_ms": 400},
        on_ttft_miss="hedge",
        hedge_max_fraction=1.0,
    )
    environ = {**collector.env, **FAST_EXPORT, "TAILGUARD_TRACES_TAIL_RATIO": "0"}
    async with traced_gateway(settings, environ) as url:
        resp, _ = await stream_chat(client, url)
        assert resp.headers["x-tailguard-route"] == "hedge"
        request_id = resp.headers["x-request-id"]

        def attempts() -> list[Any]:
            server = servers_by_request(collector).get(request_id)
            spans = collector.receiver.of_kind("CLIENT")
            return [s for s in spans if server is not None and s.parent_span_id == server.span_id]

        async with asyncio.timeout(5):
            await collector.receiver.wait_for(lambda _: len(attempts()) == 2)
        metrics = (await client.get(url + "/metrics")).text
    assert sorted(s.attributes[sc.TG_ATTEMPT_OUTCOME] for s in attempts()) == ["hedge_lost", "won"]
    assert decisions(metrics)[("exported", "hedge")] == 1


async def test_share_of_one_exports_every_trace(
    collector: Collector, primary: Sim, fallback: Sim, client: httpx.AsyncClient
) -> None:
    """With a share of 1, plain requests are all exported, each with its attempt's span."""
    environ = {**collector.env, "TAILGUARD_TRACES_TAIL_RATIO": "1"}
    async with traced_gateway(settings_for(primary, fallback), environ) as url:
        ids = [(await chat(client, url, "plain")).headers["x-request-id"] for _ in range(3)]
        metrics = (await client.get(url + "/metrics")).text
    assert set(servers_by_request(collector)) == set(ids)
    assert len(collector.receiver.of_kind("CLIENT")) == 3
    # The last request's span may end just after its response: the counter has 2 or 3.
    assert decisions(metrics)[("exported", "share")] >= 2


async def test_a_sampled_client_traceparent_is_always_exported(
    collector: Collector, primary: Sim, fallback: Sim, client: httpx.AsyncClient
) -> None:
    """With a share of 0, a plain request whose client `traceparent` has the sampled flag is
    exported; the same request with the flag clear (sent first) is not."""
    environ = {**collector.env, **FAST_EXPORT, "TAILGUARD_TRACES_TAIL_RATIO": "0"}
    unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with traced_gateway(settings_for(primary, fallback), environ) as url:
        quiet = await chat(client, url, "plain", {"traceparent": unsampled})
        kept = await chat(client, url, "plain", {"traceparent": sampled})
        last = kept.headers["x-request-id"]
        async with asyncio.timeout(5):
            await collector.receiver.wait_for(lambda _: exported(collector, last))
        metrics = (await client.get(url + "/metrics")).text
    assert quiet.status_code == kept.status_code == 200
    (server,) = collector.receiver.of_kind("SERVER")
    assert server.attributes[sc.TG_REQUEST_ID] == last
    assert server.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert {s.trace_id for s in collector.receiver.spans} == {server.trace_id}
    counts = decisions(metrics)
    assert (counts[("exported", "sampled_parent")], counts[("dropped", "rest")]) == (1, 1)


async def test_an_explicit_head_sampler_turns_tail_sampling_off(
    collector: Collector, primary: Sim, fallback: Sim, client: httpx.AsyncClient
) -> None:
    """`OTEL_TRACES_SAMPLER=always_on` set explicitly: every trace is exported even with a share
    of 0, and the tail sampler decides nothing (the counter has no samples)."""
    environ = {
        **collector.env,
        "OTEL_TRACES_SAMPLER": "always_on",
        "TAILGUARD_TRACES_TAIL_RATIO": "0",
    }
    async with traced_gateway(settings_for(primary, fallback), environ) as url:
        ids = [(await chat(client, url, "plain")).headers["x-request-id"] for _ in range(2)]
        metrics = (await client.get(url + "/metrics")).text
    assert set(servers_by_request(collector)) == set(ids)
    assert len(collector.receiver.of_kind("CLIENT")) == 2
    assert decisions(metrics) == {}


@pytest.mark.parametrize("value", ["2", "-0.1", "half", "nan"])
def test_a_bad_ratio_is_refused_naming_the_variable(value: str) -> None:
    """A share outside 0..1, or not a number, is a configuration error naming the variable."""
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
        "TAILGUARD_TRACES_TAIL_RATIO": value,
    }
    with pytest.raises(ValueError, match="TAILGUARD_TRACES_TAIL_RATIO"):
        tracing_from_env(environ)


# --- the processor on its own, with the SDK's in-memory exporter ---------------------------------


def sampler(**bounds: int) -> tuple[TracerProvider, TailProcessor, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tail = TailProcessor(SimpleSpanProcessor(exporter), ratio=0.0, **bounds)
    provider = TracerProvider()
    provider.add_span_processor(tail)
    return provider, tail, exporter


def test_slo_miss_and_slow_keep_a_trace_and_a_late_attempt_follows_it() -> None:
    """A missed budget and a request slower than its deployment's p99 are kept; an attempt span
    that ends after its request's span follows the request's decision."""
    provider, tail, exporter = sampler()
    tracer = provider.get_tracer("test")
    cases: list[dict[str, Any]] = [
        {sc.TG_ROUTE: "primary", sc.TG_SLO_TTFT_MET: False},
        {sc.TG_ROUTE: "primary", sc.TG_SLOW: True},
        {sc.TG_ROUTE: "primary", sc.TG_SLO_TTFT_MET: True, sc.TG_SLOW: False},
    ]
    for attributes in cases:
        root = tracer.start_span("POST", kind=SpanKind.SERVER)
        late = tracer.start_span("chat", context=set_span_in_context(root), kind=SpanKind.CLIENT)
        root.set_attributes({**attributes, sc.HTTP_RESPONSE_STATUS_CODE: 200})
        root.end()
        late.end()
    names = [
        (s.name, dict(s.attributes or {}).get(sc.TG_SLOW)) for s in exporter.get_finished_spans()
    ]
    assert names == [("POST", None), ("chat", None), ("POST", True), ("chat", None)]
    assert tail.counts[("exported", "slo_miss")] == 1
    assert tail.counts[("exported", "slow")] == 1
    assert tail.counts[("dropped", "rest")] == 1
    assert tail.held() == (0, 0)


def test_overflow_drops_the_oldest_held_trace_and_counts_it() -> None:
    """At most `max_traces` traces are held: a third request's attempt evicts the oldest, whose
    spans (its root too, when it ends) are then dropped and counted once as `overflow`."""
    provider, tail, exporter = sampler(max_traces=2, max_spans=10)
    tracer = provider.get_tracer("test")
    roots = [tracer.start_span("POST", kind=SpanKind.SERVER) for _ in range(3)]
    for root in roots:
        tracer.start_span("chat", context=set_span_in_context(root)).end()
    assert tail.held() == (2, 2)
    for root in roots:
        root.set_attribute(sc.HTTP_RESPONSE_STATUS_CODE, 500)  # kept, had it been held
        root.end()
    assert len(exporter.get_finished_spans()) == 4  # two whole traces; nothing of the first
    assert tail.counts[("dropped", "overflow")] == 1
    assert tail.counts[("exported", "error")] == 2
    assert tail.held() == (0, 0)
