"""Tail-aware trace sampling: a real gateway exporting OTLP/HTTP to a real receiver on loopback.

A request's spans are recorded until its SERVER span ends and then exported together or dropped.
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
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Settings
from gateway.models import AttemptEnd, Usage
from gateway.telemetry import semconv as sc
from gateway.telemetry import tracing_from_env
from gateway.telemetry.tail import TailSampler, TailTrace
from tests.conftest import free_port, gateway_settings, run_gateway
from tests.telemetry.test_tracing import (
    CHAT,
    Collector,
    Sim,
    collector,
    stream_chat,
    two,
)
from tests.timing import scaled

__all__ = ["collector"]  # a fixture, used by name

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
    async with run_gateway(settings_for(primary, fallback), environ=environ) as gw:
        plain = await chat(client, gw.url, "plain")
        broken = await chat(client, gw.url, "broken")
        failover = await chat(client, gw.url, "stalls", stream=True)
        assert (plain.status_code, broken.status_code, failover.status_code) == (200, 502, 200)
        assert failover.headers["x-tailguard-route"] == "ttft_failover"
        last = failover.headers["x-request-id"]
        async with asyncio.timeout(scaled(5)):
            await collector.receiver.wait_for(lambda _: exported(collector, last))
        metrics = (await client.get(gw.url + "/metrics")).text
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
    async with run_gateway(settings, environ=environ) as gw:
        resp, _ = await stream_chat(client, gw.url)
        assert resp.headers["x-tailguard-route"] == "hedge"
        request_id = resp.headers["x-request-id"]

        def attempts() -> list[Any]:
            server = servers_by_request(collector).get(request_id)
            spans = collector.receiver.of_kind("CLIENT")
            return [s for s in spans if server is not None and s.parent_span_id == server.span_id]

        async with asyncio.timeout(scaled(5)):
            await collector.receiver.wait_for(lambda _: len(attempts()) == 2)
        metrics = (await client.get(gw.url + "/metrics")).text
    assert sorted(s.attributes[sc.TG_ATTEMPT_OUTCOME] for s in attempts()) == ["hedge_lost", "won"]
    assert decisions(metrics)[("exported", "hedge")] == 1


async def test_a_request_slower_than_its_deployments_p99_is_exported(
    collector: Collector, primary: Sim, client: httpx.AsyncClient
) -> None:
    """With a share of 0, quick requests are dropped; once the deployment's p99 is trusted, a
    request far slower than it (60 tokens at 200 tokens/s, against 1 token) is exported as
    `slow`, its span marked `tailguard.slow`."""
    deployment = "up/paced@tokens_per_s=200,output_tokens=60"
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": primary.base_url}},
        [{"name": "m", "deployments": [{"provider": "up", "model": deployment[3:]}]}],
        latency={"min_samples": 5},
    )
    environ = {**collector.env, **FAST_EXPORT, "TAILGUARD_TRACES_TAIL_RATIO": "0"}
    quick = {"model": "m", "max_tokens": 1, **CHAT}
    async with run_gateway(settings, environ=environ) as gw, asyncio.timeout(scaled(20)):
        while True:  # until the snapshot (refreshed every second) trusts the deployment
            response = await client.post(gw.url + "/v1/chat/completions", json=quick)
            assert response.status_code == 200
            view = (await client.get(gw.url + "/admin/latency")).json()
            if (view["deployments"].get(deployment) or {}).get("trusted"):
                break
        slow = await client.post(gw.url + "/v1/chat/completions", json={**quick, "max_tokens": 60})
        request_id = slow.headers["x-request-id"]
        await collector.receiver.wait_for(lambda _: exported(collector, request_id))
        metrics = (await client.get(gw.url + "/metrics")).text
    servers = servers_by_request(collector)
    assert servers[request_id].attributes[sc.TG_SLOW] is True
    # A quick request may itself land past a p99 of a few samples on a busy machine: exported
    # then, and for the same reason. Nothing is exported for any other reason.
    assert all(server.attributes.get(sc.TG_SLOW) is True for server in servers.values())
    counts = decisions(metrics)
    assert counts[("exported", "slow")] == len(servers)
    assert counts[("dropped", "rest")] >= 5
    assert sum(v for (decision, _), v in counts.items() if decision == "exported") == len(servers)


async def test_share_of_one_exports_every_trace(
    collector: Collector, primary: Sim, fallback: Sim, client: httpx.AsyncClient
) -> None:
    """With a share of 1, plain requests are all exported, each with its attempt's span."""
    environ = {**collector.env, "TAILGUARD_TRACES_TAIL_RATIO": "1"}
    async with run_gateway(settings_for(primary, fallback), environ=environ) as gw:
        ids = [(await chat(client, gw.url, "plain")).headers["x-request-id"] for _ in range(3)]
        metrics = (await client.get(gw.url + "/metrics")).text
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
    async with run_gateway(settings_for(primary, fallback), environ=environ) as gw:
        quiet = await chat(client, gw.url, "plain", {"traceparent": unsampled})
        kept = await chat(client, gw.url, "plain", {"traceparent": sampled})
        last = kept.headers["x-request-id"]
        async with asyncio.timeout(scaled(5)):
            await collector.receiver.wait_for(lambda _: exported(collector, last))
        metrics = (await client.get(gw.url + "/metrics")).text
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
    async with run_gateway(settings_for(primary, fallback), environ=environ) as gw:
        ids = [(await chat(client, gw.url, "plain")).headers["x-request-id"] for _ in range(2)]
        metrics = (await client.get(gw.url + "/metrics")).text
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


# --- the sampler on its own, with the SDK's in-memory exporter ---------------------------------


def sampler(ratio: float = 0.0) -> tuple[TailSampler, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return TailSampler(SimpleSpanProcessor(exporter), ratio=ratio), exporter


def request(tail: TailSampler, parent: SpanContext | None = None) -> TailTrace:
    return tail.request("POST /v1/chat/completions", parent=parent, start_ns=1, attributes={})


def test_slo_miss_and_slow_keep_a_trace_and_a_late_attempt_follows_it() -> None:
    """A missed budget and a request slower than its deployment's p99 are kept; an attempt span
    that ends after its request's span follows the request's decision."""
    tail, exporter = sampler()
    cases: list[dict[str, Any]] = [
        {sc.TG_ROUTE: "primary", sc.TG_SLO_TTFT_MET: False},
        {sc.TG_ROUTE: "primary", sc.TG_SLOW: True},
        {sc.TG_ROUTE: "primary", sc.TG_SLO_TTFT_MET: True, sc.TG_SLOW: False},
    ]
    for attributes in cases:
        trace = request(tail)
        late, _ = trace.attempt(
            operation="chat", model="m", provider="openai", address=None, hedge=False
        )
        trace.end(status=200, attributes=attributes, error_type=None)
        trace.end_attempt(late, AttemptEnd("cancelled"))
    names = [
        (s.name, dict(s.attributes or {}).get(sc.TG_SLOW)) for s in exporter.get_finished_spans()
    ]
    assert names == [
        ("POST /v1/chat/completions", None),
        ("chat m", None),
        ("POST /v1/chat/completions", True),
        ("chat m", None),
    ]
    assert tail.counts[("exported", "slo_miss")] == 1
    assert tail.counts[("exported", "slow")] == 1
    assert tail.counts[("dropped", "rest")] == 1


def test_a_kept_trace_is_one_tree_under_the_client_parent() -> None:
    """The exported spans share one trace id (the client's), the request's span is the child of
    the client's span and each attempt the child of the request's; the traceparent sent
    upstream names the attempt's span. A failed attempt has an error status."""
    tail, exporter = sampler()
    client = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1))
    trace = request(tail, client)
    first, traceparent = trace.attempt(
        operation="chat", model="m", provider="openai", address="up:80", hedge=False
    )
    trace.end_attempt(first, AttemptEnd("error:status_500", "status_500"))
    second, _ = trace.attempt(
        operation="chat", model="m", provider="openai", address=None, hedge=False
    )
    trace.end_attempt(
        second, AttemptEnd("won", ttft_s=0.0123, usage=Usage(input_tokens=7), output_tokens=3)
    )
    trace.end(status=200, attributes={sc.TG_ROUTE: "failover", sc.TG_ATTEMPTS: 2}, error_type=None)
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.kind == SpanKind.SERVER)
    attempts = [s for s in spans if s.kind == SpanKind.CLIENT]
    assert trace.trace_id == format(0xABC, "032x")
    assert {s.context.trace_id for s in spans if s.context is not None} == {0xABC}
    assert root.parent is not None and root.parent.span_id == 0xDEF
    assert root.context is not None
    assert all(a.parent is not None and a.parent.span_id == root.context.span_id for a in attempts)
    assert traceparent == f"00-{0xABC:032x}-{first.span_id:016x}-01"
    assert [a.status.status_code.name for a in attempts] == ["ERROR", "UNSET"]
    assert dict(attempts[1].attributes or {})[sc.TG_TTFT_MS] == 12.3
    assert tail.counts[("exported", "fallback")] == 1


def test_a_dropped_trace_reaches_no_processor() -> None:
    """An unremarkable request at a share of 0 gives the batch processor nothing at all, and an
    attempt that ends later does not either."""
    tail, exporter = sampler(ratio=0.0)
    trace = request(tail)
    span, _ = trace.attempt(
        operation="chat", model="m", provider="openai", address=None, hedge=False
    )
    trace.end(status=200, attributes={sc.TG_ROUTE: "primary"}, error_type=None)
    trace.end_attempt(span, AttemptEnd("won"))
    assert exporter.get_finished_spans() == ()
    assert tail.counts[("dropped", "rest")] == 1
