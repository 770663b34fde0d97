"""OpenTelemetry traces end to end: a real gateway exporting OTLP/HTTP to a real receiver on
loopback, with simulated upstreams that record the headers they were sent.

The gateway is configured through `run_gateway(environ=...)`, not the process environment (one
test also sets OTEL_BSP_* there, which the SDK reads itself: see its xfail companion). Its batch
processor exports when the app's lifespan ends (the tracer provider is shut down then), so
every test leaves the gateway's context before it looks at the spans.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import AuthSpec
from gateway.telemetry import semconv as sc
from gateway.telemetry import tracing_from_env
from tests.conftest import Upstream, free_port, gateway_settings, run_gateway, serve
from tests.fakes.otlp_receiver import ExportedSpan, OTLPReceiver
from tests.timing import eventually, scaled

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
PROMPT = "Tell me about tail latency."
CHAT = {"messages": [{"role": "user", "content": PROMPT}]}


# --- harness -------------------------------------------------------------------------------------


@dataclass
class Collector:
    receiver: OTLPReceiver
    url: str

    @property
    def env(self) -> dict[str, str]:
        """The least configuration that turns tracing on, pointed at this receiver."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.url, "TAILGUARD_TRACES_TAIL_RATIO": "1"}


Sim = Upstream  # a simulated upstream that records each request's headers


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    receiver = OTLPReceiver()
    async with serve(receiver) as url:
        yield Collector(receiver, url)


def one(
    upstream: Sim, model: str = "m", provider: dict[str, Any] | None = None, **spec: Any
) -> Any:
    """Model `m` on upstream model `model` at `upstream`."""
    return gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url, **(provider or {})}},
        [{"name": "m", "deployments": [{"provider": "up", "model": model}], **spec}],
    )


def two(primary: Sim, fallback: Sim, first: str, second: str = "ok", **spec: Any) -> Any:
    """Model `m` on `first` at the primary, falling back to model `b` on `second` at the
    fallback (expected TTFT 50 ms until it has statistics)."""
    return gateway_settings(
        {
            "p": {"type": "vllm", "base_url": primary.base_url},
            "f": {"type": "vllm", "base_url": fallback.base_url},
        },
        [
            {"name": "m", "deployments": [{"provider": "p", "model": first}], "fallbacks": ["b"]}
            | spec,
            {
                "name": "b",
                "deployments": [{"provider": "f", "model": second, "prior": {"ttft_ms": 50}}],
            },
        ],
    )


async def stream_chat(
    client: httpx.AsyncClient, url: str, headers: Mapping[str, str] | None = None
) -> tuple[httpx.Response, list[str]]:
    body = {"model": "m", "stream": True, **CHAT}
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=body, headers=dict(headers or {})
    ) as resp:
        lines = [line async for line in resp.aiter_lines() if line]
    return resp, lines


def parse_traceparent(value: str | None) -> tuple[str, str, str]:
    """(trace id, parent span id, flags) of a `traceparent` header."""
    assert value is not None, "no traceparent was sent upstream"
    version, trace_id, parent_id, flags = value.split("-")
    assert version == "00"
    return trace_id, parent_id, flags


def server_span(receiver: OTLPReceiver) -> ExportedSpan:
    (span,) = receiver.of_kind("SERVER")
    return span


def client_spans(receiver: OTLPReceiver) -> list[ExportedSpan]:
    return sorted(receiver.of_kind("CLIENT"), key=lambda s: s.start_ns)


# --- the spans of a request ----------------------------------------------------------------------


async def test_streamed_chat_continues_the_client_trace(
    collector: Collector, primary: Sim, client: httpx.AsyncClient
) -> None:
    """A streamed chat request with a client `traceparent` gives one SERVER span in the client's
    trace, parented by the client's span, and one CLIENT span `chat <upstream model>` under it,
    carrying the GenAI attributes (operation, provider, request and response model, token usage,
    finish reasons, server address), the attempt's outcome and its TTFT. The upstream is sent a
    `traceparent` whose parent is that CLIENT span."""
    settings = one(primary, budget={"ttft_ms": 5000, "total_ms": 20000})
    async with run_gateway(settings, environ=collector.env) as gw:
        resp, lines = await stream_chat(client, gw.url, {"traceparent": TRACEPARENT})
    assert resp.status_code == 200
    assert lines[-1] == "data: [DONE]"
    receiver = collector.receiver
    assert len(receiver.spans) == 2, receiver.spans

    server = server_span(receiver)
    assert server.name == "POST /v1/chat/completions"
    assert server.trace_id == CLIENT_TRACE
    assert server.parent_span_id == CLIENT_SPAN
    assert server.status != "ERROR"
    assert server.attributes[sc.HTTP_RESPONSE_STATUS_CODE] == 200
    assert server.attributes[sc.HTTP_REQUEST_METHOD] == "POST"
    assert server.attributes[sc.HTTP_ROUTE] == "/v1/chat/completions"
    assert server.attributes[sc.GEN_AI_OPERATION_NAME] == "chat"
    assert server.attributes[sc.GEN_AI_REQUEST_MODEL] == "m"
    assert server.attributes[sc.TG_ROUTE] == "primary"
    assert server.attributes[sc.TG_DEPLOYMENT] == "up/m"
    assert server.attributes[sc.TG_ATTEMPTS] == 1
    assert server.attributes[sc.TG_REQUEST_ID] == resp.headers["x-request-id"]
    assert server.attributes[sc.TG_BUDGET_TTFT_MS] == 5000
    assert server.attributes[sc.TG_BUDGET_TOTAL_MS] == 20000
    assert server.attributes[sc.TG_TTFT_MS] > 0
    assert server.resource["service.name"] == "tailguard"

    (attempt,) = client_spans(receiver)
    assert attempt.name == "chat m"
    assert attempt.trace_id == CLIENT_TRACE
    assert attempt.parent_span_id == server.span_id
    assert attempt.status != "ERROR"
    attrs = attempt.attributes
    assert attrs[sc.GEN_AI_OPERATION_NAME] == "chat"
    assert attrs[sc.GEN_AI_PROVIDER_NAME] == "vllm"
    assert attrs[sc.GEN_AI_REQUEST_MODEL] == "m"
    assert attrs[sc.GEN_AI_RESPONSE_MODEL] == "m"
    assert attrs[sc.GEN_AI_USAGE_INPUT_TOKENS] > 0
    assert attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    assert attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] in (["stop"], ["length"])
    assert attrs[sc.SERVER_ADDRESS] == "127.0.0.1"
    assert attrs[sc.TG_ATTEMPT_OUTCOME] == "won"
    assert attrs[sc.TG_ATTEMPT_HEDGE] is False
    assert 0 < attrs[sc.TG_TTFT_MS] <= server.attributes[sc.TG_TTFT_MS]
    # The attempt lies inside the request.
    assert server.start_ns <= attempt.start_ns <= attempt.end_ns <= server.end_ns

    (sent,) = primary.traceparents()
    trace_id, parent_id, flags = parse_traceparent(sent)
    assert (trace_id, parent_id, flags) == (CLIENT_TRACE, attempt.span_id, "01")


async def test_failover_gives_one_client_span_per_attempt(
    collector: Collector, primary: Sim, fallback: Sim, client: httpx.AsyncClient
) -> None:
    """A stalled primary cut at its first-token deadline and the fallback that served are two
    CLIENT spans under the one SERVER span: `ttft_deadline` (not an error), then `won`; each
    upstream was sent its own attempt's span as the parent."""
    settings = two(primary, fallback, "slow@stall_rate=1", budget={"ttft_ms": 300})
    async with run_gateway(settings, environ=collector.env) as gw:
        resp, _ = await stream_chat(client, gw.url)
        async with asyncio.timeout(
            scaled(5)
        ):  # the cut stream reached the primary before the flush
            await primary.engine.stats.wait_for(lambda s: s.cancelled == 1)
    assert resp.status_code == 200
    assert resp.headers["x-tailguard-route"] == "ttft_failover"
    receiver = collector.receiver
    server = server_span(receiver)
    assert server.parent_span_id == ""  # no client trace: the gateway starts one
    assert server.attributes[sc.TG_ROUTE] == "ttft_failover"
    assert server.attributes[sc.TG_ATTEMPTS] == 2
    assert server.attributes[sc.TG_DEPLOYMENT] == "f/ok"
    assert server.attributes[sc.TG_BUDGET_TTFT_MS] == 300

    cut, won = client_spans(receiver)
    assert [cut.name, won.name] == ["chat slow@stall_rate=1", "chat ok"]
    for span in (cut, won):
        assert span.trace_id == server.trace_id
        assert span.parent_span_id == server.span_id
    assert cut.attributes[sc.TG_ATTEMPT_OUTCOME] == "ttft_deadline"
    assert cut.status != "ERROR"
    assert sc.ERROR_TYPE not in cut.attributes
    assert won.attributes[sc.TG_ATTEMPT_OUTCOME] == "won"
    assert won.attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    assert cut.end_ns <= won.end_ns

    assert parse_traceparent(primary.traceparents()[0])[:2] == (server.trace_id, cut.span_id)
    assert parse_traceparent(fallback.traceparents()[0])[:2] == (server.trace_id, won.span_id)


async def test_hedge_spans_are_marked(
    collector: Collector, primary: Sim, fallback: Sim, client: httpx.AsyncClient
) -> None:
    """A hedge's CLIENT span says it is one (`tailguard.attempt.hedge`); the attempt it beat ends
    as `hedge_lost`, and the SERVER span's route is `hedge`."""
    settings = two(
        primary,
        fallback,
        "slow@prefill_base_ms=2000",
        budget={"ttft_ms": 400},
        on_ttft_miss="hedge",
        hedge_max_fraction=1.0,
    )
    async with run_gateway(settings, environ=collector.env) as gw:
        resp, _ = await stream_chat(client, gw.url)
        async with asyncio.timeout(scaled(5)):
            await primary.engine.stats.wait_for(lambda s: s.cancelled == 1)
    assert resp.headers["x-tailguard-route"] == "hedge"
    server = server_span(collector.receiver)
    assert server.attributes[sc.TG_ROUTE] == "hedge"
    lost, hedge = client_spans(collector.receiver)
    assert lost.attributes[sc.TG_ATTEMPT_OUTCOME] == "hedge_lost"
    assert lost.attributes[sc.TG_ATTEMPT_HEDGE] is False
    assert hedge.attributes[sc.TG_ATTEMPT_OUTCOME] == "won"
    assert hedge.attributes[sc.TG_ATTEMPT_HEDGE] is True
    assert {lost.parent_span_id, hedge.parent_span_id} == {server.span_id}


async def test_upstream_error_marks_both_spans(
    collector: Collector, primary: Sim, client: httpx.AsyncClient
) -> None:
    """An upstream 500 with nothing to fall back to: the CLIENT span has `error.type` and an ERROR
    status; the SERVER span records the 502 the client got, as an error."""
    async with run_gateway(one(primary, "bad@error_500_rate=1"), environ=collector.env) as gw:
        resp = await client.post(gw.url + "/v1/chat/completions", json={"model": "m", **CHAT})
    assert resp.status_code == 502
    server = server_span(collector.receiver)
    assert server.attributes[sc.HTTP_RESPONSE_STATUS_CODE] == 502
    assert server.status == "ERROR"
    assert server.attributes[sc.ERROR_TYPE]
    (attempt,) = client_spans(collector.receiver)
    assert attempt.name == "chat bad@error_500_rate=1"
    assert attempt.parent_span_id == server.span_id
    assert attempt.status == "ERROR"
    assert attempt.attributes[sc.ERROR_TYPE]
    assert attempt.attributes[sc.TG_ATTEMPT_OUTCOME].startswith("error:")


# --- what is never recorded or forwarded ---------------------------------------------------------


async def test_no_secret_reaches_a_span_and_baggage_is_not_forwarded(
    collector: Collector, primary: Sim, client: httpx.AsyncClient
) -> None:
    """The provider's key and extra headers, the client's credentials, its baggage and (without
    content capture) its prompt appear nowhere in what is exported: not in a span's name,
    attributes, events or status, nor anywhere in the raw export bytes. The upstream gets the
    provider's key, never the client's credentials or baggage."""
    settings = one(
        primary,
        provider={"api_key": "sk-test-SECRET-abc123", "headers": {"x-api-key": "hdr-SECRET-xyz"}},
    )
    body = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": "prompt-SECRET"}],
    }
    headers = {
        "authorization": "Bearer client-SECRET-999",
        "baggage": "user=SECRET",
        "traceparent": TRACEPARENT,
    }
    async with run_gateway(settings, environ=collector.env) as gw:
        async with client.stream(
            "POST", gw.url + "/v1/chat/completions", json=body, headers=headers
        ) as resp:
            await resp.aread()
        failed = await client.post(  # an upstream error, whose text a span might carry
            gw.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "prompt-SECRET"}]},
            headers={**headers, "x-tailguard-ttft-budget-ms": "SECRET"},
        )
    assert resp.status_code == 200
    assert failed.status_code == 400
    receiver = collector.receiver
    assert receiver.spans
    for span in receiver.spans:
        text = orjson.dumps(
            [span.name, span.attributes, span.events, span.status_message, span.resource]
        ).decode()
        assert "SECRET" not in text, span
    for export in receiver.exports:
        assert b"SECRET" not in export.body
    (sent,) = primary.headers()
    assert "baggage" not in sent
    assert sent["authorization"] == "Bearer sk-test-SECRET-abc123"
    assert sent["x-api-key"] == "hdr-SECRET-xyz"
    assert "client-SECRET-999" not in orjson.dumps(sent).decode()


async def test_a_gateway_key_is_named_in_the_span_never_carried(
    collector: Collector, primary: Sim, client: httpx.AsyncClient
) -> None:
    """With API keys on, the server span says which key (its configured name); the key itself,
    accepted or refused, is nowhere in the export."""
    from gateway.admission.auth import hash_key

    key = "tg-client-SECRET-key-1"
    settings = one(primary).model_copy(
        update={
            "auth": AuthSpec.model_validate({"keys": [{"name": "team-a", "sha256": hash_key(key)}]})
        }
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with run_gateway(settings, environ=collector.env) as gw:
        ok = await client.post(
            gw.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )
        refused = await client.post(
            gw.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": "Bearer tg-wrong-SECRET-2"},
        )
    assert ok.status_code == 200 and refused.status_code == 401
    servers = [s for s in collector.receiver.spans if s.attributes.get(sc.TG_KEY)]
    assert [s.attributes[sc.TG_KEY] for s in servers] == ["team-a"]
    for export in collector.receiver.exports:
        assert b"SECRET" not in export.body


# --- configuration from OTEL_* -------------------------------------------------------------------


async def test_exporter_headers_and_service_name_come_from_the_environment(
    collector: Collector, primary: Sim, client: httpx.AsyncClient
) -> None:
    """`OTEL_EXPORTER_OTLP_HEADERS` (percent-decoded) is sent with every export, and
    `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` become the resource's attributes."""
    environ = {
        **collector.env,
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20collector-token,x-tenant=t1",
        "OTEL_SERVICE_NAME": "tg-under-test",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
    }
    async with run_gateway(one(primary), environ=environ) as gw:
        resp, _ = await stream_chat(client, gw.url)
    assert resp.status_code == 200
    receiver = collector.receiver
    assert receiver.exports and not receiver.refused
    for export in receiver.exports:
        assert export.headers["authorization"] == "Bearer collector-token"
        assert export.headers["x-tenant"] == "t1"
        assert export.headers["content-type"] == "application/x-protobuf"
    assert len(receiver.spans) == 2
    for span in receiver.spans:
        assert span.resource["service.name"] == "tg-under-test"
        assert span.resource["deployment.environment"] == "test"


async def test_sampler_always_off_exports_nothing_but_still_propagates(
    collector: Collector, primary: Sim, client: httpx.AsyncClient
) -> None:
    """`OTEL_TRACES_SAMPLER=always_off`: requests are served and nothing is exported, but the
    upstream still gets a `traceparent` (unsampled) continuing the client's trace."""
    environ = {**collector.env, "OTEL_TRACES_SAMPLER": "always_off"}
    async with run_gateway(one(primary), environ=environ) as gw:
        resp, lines = await stream_chat(client, gw.url, {"traceparent": TRACEPARENT})
        plain = await client.post(gw.url + "/v1/chat/completions", json={"model": "m", **CHAT})
    assert resp.status_code == 200 and lines[-1] == "data: [DONE]"
    assert plain.status_code == 200
    assert collector.receiver.exports == [] and collector.receiver.refused == []
    first, second = primary.traceparents()
    trace_id, parent_id, flags = parse_traceparent(first)
    assert trace_id == CLIENT_TRACE
    assert parent_id != CLIENT_SPAN  # a span of the gateway's, though not recorded
    assert int(flags, 16) & 1 == 0  # not sampled
    assert int(parse_traceparent(second)[2], 16) & 1 == 0


async def test_collector_down_costs_nothing(primary: Sim, client: httpx.AsyncClient) -> None:
    """With the collector's port closed, 20 requests are all served, the gateway still shuts down
    promptly (the final flush is bounded by the exporter's timeout), and /metrics exposes the
    dropped-spans counter."""
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "0.5",  # tracing.py: values <= 1000 are seconds
    }
    async with asyncio.timeout(scaled(8)):
        async with run_gateway(one(primary), environ=environ) as gw:
            for _ in range(10):
                resp, lines = await stream_chat(client, gw.url)
                assert resp.status_code == 200 and lines[-1] == "data: [DONE]"
                plain = await client.post(
                    gw.url + "/v1/chat/completions", json={"model": "m", **CHAT}
                )
                assert plain.status_code == 200
            metrics = await client.get(gw.url + "/metrics")
    assert primary.engine.stats.completed == 20
    families = {f.name: f for f in text_string_to_metric_families(metrics.text)}
    dropped = families[sc.SPANS_DROPPED]
    assert dropped.type == "counter"
    assert [s.name for s in dropped.samples] == [sc.SPANS_DROPPED + "_total"]


async def test_a_stuck_collector_drops_spans_and_counts_them(
    primary: Sim, client: httpx.AsyncClient
) -> None:
    """A collector that takes connections and never answers holds the exporter for its timeout;
    with a queue of two, the spans of the requests served meanwhile are dropped, not buffered,
    and `/metrics` counts every one of them. The requests themselves are all served."""
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(64)  # connections complete in the kernel's backlog; nothing reads them
        environ = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{blackhole.getsockname()[1]}",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1500",
            "TAILGUARD_TRACES_TAIL_RATIO": "1",
            "OTEL_BSP_MAX_QUEUE_SIZE": "2",
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2",
        }
        async with asyncio.timeout(scaled(20)):
            async with run_gateway(one(primary), environ=environ) as gw:
                for _ in range(10):
                    plain = await client.post(
                        gw.url + "/v1/chat/completions", json={"model": "m", **CHAT}
                    )
                    assert plain.status_code == 200
                metrics = await client.get(gw.url + "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(metrics.text)}
    # Ten requests make at least ten spans; at most two wait in the queue and two are in the
    # stuck export, so at least six were dropped while the exporter waited.
    assert families[sc.SPANS_DROPPED].samples[0].value >= 6


def test_exporter_timeout_is_in_milliseconds() -> None:
    """`OTEL_EXPORTER_OTLP_TIMEOUT` is in milliseconds (OpenTelemetry spec): with 500, the final
    flush to a collector whose port is closed gives up after about half a second."""
    tracing = tracing_from_env(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "500",
            "TAILGUARD_TRACES_TAIL_RATIO": "1",
        }
    )
    trace = tracing.request(
        "POST /v1/chat/completions", traceparent=None, arrived=time.perf_counter(), attributes={}
    )
    assert trace is not None
    trace.end(status=200, attributes={}, error_type=None)
    flushing = threading.Thread(target=tracing.shutdown, daemon=True)
    flushing.start()
    flushing.join(1.5)  # a 0.5 s budget; a retry backoff of 1 s, 2 s, ... means seconds
    hung = flushing.is_alive()
    if hung:  # stop the exporter's retries, so they do not log on into later tests
        processor = tracing._processor
        assert processor is not None
        processor.span_exporter.shutdown()
        flushing.join(5)
    assert not hung, "the flush to a down collector outlived its 500 ms timeout"


async def test_spans_dropped_by_a_full_queue_are_counted(
    collector: Collector, primary: Sim, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a stuck collector and an export queue of two spans, spans beyond what is queued or
    being exported are dropped, requests are still served at once, and every span is either
    exported (once the collector answers) or counted in `tailguard_trace_spans_dropped_total`."""
    bsp = {
        "OTEL_BSP_MAX_QUEUE_SIZE": "2",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2",
        "OTEL_BSP_SCHEDULE_DELAY": "60000",
    }
    # The batch size and delay are read by the SDK from the process environment (see the
    # OTEL_BSP_MAX_QUEUE_SIZE xfail below); given in both places so the test holds either way.
    for name, setting in bsp.items():
        monkeypatch.setenv(name, setting)
    environ = {**collector.env, **bsp, "OTEL_EXPORTER_OTLP_TIMEOUT": "5000"}
    receiver = collector.receiver
    receiver.hold()
    async with run_gateway(one(primary), environ=environ) as gw:
        for _ in range(4):
            async with asyncio.timeout(scaled(2)):  # a stuck collector never slows a request
                resp, lines = await stream_chat(client, gw.url)
            assert resp.status_code == 200 and lines[-1] == "data: [DONE]"
        async with asyncio.timeout(scaled(3)):
            await receiver.wait_for(lambda r: r.held == 1)
        receiver.release()

        async def accounted() -> tuple[float] | None:
            metrics = await client.get(gw.url + "/metrics")
            families = {f.name: f for f in text_string_to_metric_families(metrics.text)}
            dropped = families[sc.SPANS_DROPPED].samples[0].value
            return (dropped,) if dropped + len(receiver.spans) == 8 else None

        # Every one of the eight spans ends up exported or counted as dropped (the last
        # request's spans end just after its last byte; the export thread drains the rest).
        (dropped,) = await eventually(
            accounted, within_s=10, what="every span exported or counted as dropped"
        )
    # At most four fit (a batch of two being exported, two queued): the rest were dropped; how
    # many more depends on when the export thread took its first batch.
    assert dropped >= 4


def test_a_small_export_queue_is_accepted() -> None:
    """OTEL_BSP_MAX_QUEUE_SIZE below the default export batch size (512) is a valid setting:
    the batch is capped at the queue size, and the OTEL_BSP_* settings come from `environ`."""
    tracing = tracing_from_env(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "5000",
            "OTEL_BSP_MAX_QUEUE_SIZE": "100",
        }
    )
    try:
        assert tracing.enabled
    finally:
        tracing.shutdown()


async def test_a_refused_request_has_a_server_span(
    collector: Collector, primary: Sim, client: httpx.AsyncClient
) -> None:
    """An unknown model (404) is still a client request: one SERVER span in the client's trace
    with the status and an error type, and no CLIENT span."""
    async with run_gateway(one(primary), environ=collector.env) as gw:
        resp = await client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "no-such-model", **CHAT},
            headers={"traceparent": TRACEPARENT},
        )
    assert resp.status_code == 404
    assert client_spans(collector.receiver) == []
    server = server_span(collector.receiver)
    assert server.trace_id == CLIENT_TRACE
    assert server.attributes[sc.HTTP_RESPONSE_STATUS_CODE] == 404
    assert server.attributes[sc.ERROR_TYPE] == "model_not_found"
    assert "no-such-model" not in orjson.dumps(server.attributes).decode()


async def test_no_otel_environment_means_no_tracing(
    collector: Collector, primary: Sim, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without OTEL_* variables in `environ` tracing is off, even when the process environment
    has an endpoint: requests are served, nothing is exported, and the client's `traceparent` is
    forwarded upstream unchanged."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
    assert os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] == collector.url
    async with run_gateway(one(primary), environ={}) as gw:
        resp, lines = await stream_chat(client, gw.url, {"traceparent": TRACEPARENT})
        plain = await client.post(gw.url + "/v1/chat/completions", json={"model": "m", **CHAT})
    assert resp.status_code == 200 and lines[-1] == "data: [DONE]"
    assert plain.status_code == 200
    assert collector.receiver.exports == [] and collector.receiver.refused == []
    assert primary.traceparents() == [TRACEPARENT, None]


# --- prompt capture ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "captured"),
    [(None, False), ("false", False), ("true", True)],
    ids=["unset", "false", "true"],
)
async def test_prompt_is_captured_only_when_enabled(
    collector: Collector,
    primary: Sim,
    client: httpx.AsyncClient,
    setting: str | None,
    captured: bool,
) -> None:
    """The prompt is never on a span unless OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT
    is true; then the CLIENT span carries the messages as `gen_ai.input.messages`."""
    environ = dict(collector.env)
    if setting is not None:
        environ["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = setting
    async with run_gateway(one(primary), environ=environ) as gw:
        resp, _ = await stream_chat(client, gw.url)
    assert resp.status_code == 200
    (attempt,) = client_spans(collector.receiver)
    server = server_span(collector.receiver)
    assert sc.GEN_AI_INPUT_MESSAGES not in server.attributes
    if not captured:
        assert sc.GEN_AI_INPUT_MESSAGES not in attempt.attributes
        assert PROMPT.encode() not in b"".join(e.body for e in collector.receiver.exports)
        return
    messages = orjson.loads(attempt.attributes[sc.GEN_AI_INPUT_MESSAGES])
    assert messages == CHAT["messages"]
