"""The streaming proxy core, end to end: real gateway and real simulated upstream on loopback."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.latency import MemoryRecorder, Sample
from tests.conftest import Gateway, Upstream, gateway_settings, one_model, run_gateway, serve
from tests.fakes.asgi import lifespan, read_body
from tests.timing import scaled

CHAT = {"messages": [{"role": "user", "content": "Say something."}]}


def chat(model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, **CHAT, **extra}


async def sse_lines(response: httpx.Response) -> list[str]:
    return [line async for line in response.aiter_lines() if line]


def contents(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        if line.startswith("data: {"):
            event = orjson.loads(line[6:])
            for choice in event.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    out.append(text)
    return out


def only_sample(gw: Gateway) -> Sample:
    ((samples),) = gw.recorder.samples.values()
    return samples[-1]


# --- streaming -----------------------------------------------------------------------------------


async def test_stream_reaches_client_while_upstream_still_generates(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """The first content token is forwarded while the upstream is still streaming (no buffering)."""
    async with run_gateway(
        one_model(upstream.base_url, "m@tokens_per_s=20,output_tokens=10")
    ) as gw:
        request = chat(stream=True)
        async with client.stream("POST", gw.base_url + "/chat/completions", json=request) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            lines = resp.aiter_lines()
            async for line in lines:
                if contents([line]):
                    break
            # The upstream has 9 more tokens to send at 50 ms each: it must still be streaming.
            assert upstream.stats.open_streams == 1
            rest = [line async for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert len(contents(rest)) == 9


async def test_stream_headers_report_the_decision(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A served stream names model, deployment, route, attempts, overhead and server timing."""
    async with (
        run_gateway(one_model(upstream.base_url)) as gw,
        client.stream(
            "POST",
            gw.base_url + "/chat/completions",
            json=chat(stream=True),
            headers={"x-request-id": "abc-123"},
        ) as resp,
    ):
        await resp.aread()
    assert resp.headers["x-tailguard-model"] == "m"
    assert resp.headers["x-tailguard-deployment"] == "up/m"
    assert resp.headers["x-tailguard-route"] == "primary"
    assert resp.headers["x-tailguard-attempts"] == "1"
    assert resp.headers["x-request-id"] == "abc-123"
    assert float(resp.headers["x-tailguard-overhead-ms"]) >= 0
    stages = [part.split(";")[0] for part in resp.headers["server-timing"].split(", ")]
    assert stages == ["route", "attempt1", "connect", "ttft"]


async def test_usage_chunk_only_when_asked(upstream: Upstream, client: httpx.AsyncClient) -> None:
    """The gateway always asks upstream for usage but forwards it only when the client asked."""
    async with run_gateway(one_model(upstream.base_url)) as gw:
        url = gw.base_url + "/chat/completions"
        async with client.stream("POST", url, json=chat(stream=True)) as resp:
            plain = await sse_lines(resp)
        request = chat(stream=True, stream_options={"include_usage": True})
        async with client.stream("POST", url, json=request) as resp:
            with_usage = await sse_lines(resp)
    assert not any('"usage":{' in line for line in plain)
    usage = [orjson.loads(line[6:]) for line in with_usage if '"usage":{' in line]
    assert len(usage) == 1
    assert usage[0]["choices"] == []
    assert usage[0]["usage"]["completion_tokens"] == 5
    # Statistics got the token count either way.
    samples = list(gw.recorder.samples["up/m"])
    assert [s.output_tokens for s in samples] == [5, 5]


async def test_cut_stream_ends_with_error_event_not_done(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """An upstream failure after the first byte ends the stream with an error event, no [DONE]."""
    settings = one_model(upstream.base_url, "m@cut_rate=1,output_tokens=10")
    url = "/chat/completions"
    async with (
        run_gateway(settings) as gw,
        client.stream("POST", gw.base_url + url, json=chat(stream=True)) as resp,
    ):
        lines = await sse_lines(resp)
    assert resp.status_code == 200
    assert contents(lines)  # some tokens made it before the cut
    assert "data: [DONE]" not in lines
    error = orjson.loads(lines[-1][6:])["error"]
    assert error["code"] == "upstream_stream_error"
    assert "up/m" in error["message"]
    sample = only_sample(gw)
    assert sample.ok is False


async def test_recorder_gets_ttft_tpot_and_tokens(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Each finished stream hands TTFT, TPOT, total time and token counts to the recorder."""
    async with (
        run_gateway(one_model(upstream.base_url, "m@tokens_per_s=100,output_tokens=6")) as gw,
        client.stream("POST", gw.base_url + "/chat/completions", json=chat(stream=True)) as resp,
    ):
        await resp.aread()
    sample = only_sample(gw)
    assert sample.ok
    assert sample.output_tokens == 6
    assert sample.ttft_s is not None and sample.tpot_s is not None
    assert sample.total_s >= sample.ttft_s
    assert 0.005 <= sample.tpot_s <= 0.2  # 10 ms per token, with a wide margin


# --- client disconnects --------------------------------------------------------------------------


async def test_disconnect_mid_stream_closes_upstream(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A client leaving mid-stream makes the upstream see its connection closed at once."""
    model = "m@tokens_per_s=20,output_tokens=200"
    async with run_gateway(one_model(upstream.base_url, model)) as gw:
        async with client.stream(
            "POST", gw.base_url + "/chat/completions", json=chat(stream=True)
        ) as resp:
            seen = 0
            async for line in resp.aiter_lines():
                seen += len(contents([line]))
                if seen == 2:
                    break
            left = time.perf_counter()
        async with asyncio.timeout(scaled(5)):
            await upstream.stats.wait_for(lambda s: s.cancelled == 1 and s.open_streams == 0)
        noticed = time.perf_counter() - left
    assert noticed < 1.0


async def test_disconnect_before_first_token_closes_upstream(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A client leaving while the upstream is still silent cancels the upstream request."""
    async with run_gateway(one_model(upstream.base_url, "m@stall_rate=1")) as gw:
        # No header can come before the first token, so the client gives up while waiting.
        request = asyncio.create_task(
            client.post(gw.base_url + "/chat/completions", json=chat(stream=True))
        )
        async with asyncio.timeout(scaled(5)):
            await upstream.stats.wait_for(lambda s: s.requests == 1)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        async with asyncio.timeout(scaled(5)):
            await upstream.stats.wait_for(lambda s: s.cancelled == 1)


async def test_disconnect_on_non_streaming_request_closes_upstream(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A non-streaming client that gives up cancels the upstream call too."""
    async with run_gateway(one_model(upstream.base_url, "m@stall_rate=1")) as gw:
        request = asyncio.create_task(client.post(gw.base_url + "/chat/completions", json=chat()))
        async with asyncio.timeout(scaled(5)):
            await upstream.stats.wait_for(lambda s: s.requests == 1)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        async with asyncio.timeout(scaled(5)):
            await upstream.stats.wait_for(lambda s: s.cancelled == 1)


# --- errors made by the gateway ------------------------------------------------------------------


async def test_bad_requests_get_openai_shaped_400s(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Malformed JSON, wrong types and missing fields are 400s naming the param, never 422s."""
    async with run_gateway(one_model(upstream.base_url)) as gw:
        url = gw.base_url + "/chat/completions"
        cases = [
            (b"{not json", None, "invalid_json"),
            (orjson.dumps(chat(stream="yes")), "stream", "invalid_type"),
            (orjson.dumps({"model": "m"}), "messages", "missing_required_parameter"),
            (orjson.dumps({"messages": CHAT["messages"]}), "model", "missing_required_parameter"),
            (orjson.dumps(chat(max_tokens="10")), "max_tokens", "invalid_type"),
            (orjson.dumps(chat(n=0)), "n", "integer_below_min_value"),
            (orjson.dumps([1, 2]), None, "invalid_type"),
        ]
        for body, param, code in cases:
            resp = await client.post(
                url, content=body, headers={"content-type": "application/json"}
            )
            error = resp.json()["error"]
            assert (resp.status_code, error["param"], error["code"]) == (400, param, code), body
            assert error["type"] == "invalid_request_error"
            assert resp.headers["x-request-id"]
    assert upstream.stats.requests == 0


async def test_unknown_model_is_404_listing_models(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """An unknown model is a 404 model_not_found that lists the configured names."""
    async with run_gateway(one_model(upstream.base_url)) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat("gpt-9"))
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "Available models: m" in error["message"]


async def test_oversized_body_is_refused_before_it_is_read(upstream: Upstream) -> None:
    """A declared body over the limit gets a 413 without the gateway waiting for the body."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [{"name": "m", "deployments": [{"provider": "up", "model": "m"}]}],
        server={"max_body_bytes": 1000},
    )
    async with run_gateway(settings) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100000000\r\n\r\n{"
        )
        await writer.drain()
        async with asyncio.timeout(
            scaled(5)
        ):  # the body never comes: the answer must not wait for it
            head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        await writer.wait_closed()
        assert head.startswith(b"HTTP/1.1 413")

        async def chunks() -> AsyncIterator[bytes]:  # no content-length: counted as it streams
            for _ in range(10):
                yield b" " * 500

        async with httpx.AsyncClient() as http:
            resp = await http.post(gw.base_url + "/chat/completions", content=chunks())
        assert resp.status_code == 413
        assert resp.json()["error"]["type"] == "invalid_request_error"


async def test_unknown_route_and_method_are_openai_shaped(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Routes that do not exist answer in the OpenAI error shape too."""
    async with run_gateway(one_model(upstream.base_url)) as gw:
        missing = await client.post(gw.base_url + "/nope", json={})
        wrong = await client.get(gw.base_url + "/chat/completions")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "invalid_request_error"
    assert wrong.status_code == 405


async def test_request_id_is_generated_and_honoured(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Every response carries x-request-id; a valid incoming one is kept, a bad one replaced."""
    async with run_gateway(one_model(upstream.base_url)) as gw:
        plain = await client.get(gw.url + "/healthz")
        kept = await client.post(
            gw.base_url + "/chat/completions", json=chat(), headers={"x-request-id": "job-7"}
        )
        replaced = await client.get(gw.url + "/healthz", headers={"x-request-id": "x" * 300})
    assert plain.headers["x-request-id"].startswith("req_")
    assert kept.headers["x-request-id"] == "job-7"
    assert replaced.headers["x-request-id"].startswith("req_")


# --- upstream failures ---------------------------------------------------------------------------


class Scripted:
    """An OpenAI-compatible upstream that answers every request with one scripted response."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = headers or {}
        self.requests: list[dict[str, str]] = []  # each request's headers
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        body = await read_body(receive)
        self.requests.append({k.decode(): v.decode() for k, v in scope["headers"]})
        self.bodies.append(body)
        headers = [(b"content-type", b"application/json")]
        headers += [(k.encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


@pytest.mark.parametrize(
    ("status", "body", "expected_status", "expected_message"),
    [
        # vLLM's old flat error shape, and its newer wrapped one: the client's request is bad.
        (
            400,
            b'{"object":"error","message":"too long","type":"BadRequestError","code":400}',
            400,
            "too long",
        ),
        (
            400,
            b'{"error":{"message":"bad temp","type":"BadRequestError","param":null,"code":400}}',
            400,
            "bad temp",
        ),
        (422, b'{"detail":"nope"}', 422, "nope"),
        # Our configuration's fault: a 502 naming the deployment.
        (401, b'{"error":{"message":"Incorrect API key sk-abcdef123456"}}', 502, "credentials"),
        (404, b'{"error":{"message":"no such model"}}', 502, "404"),
        (500, b"<html>oops</html>", 502, "HTML"),
    ],
)
async def test_upstream_error_statuses_are_mapped(
    client: httpx.AsyncClient,
    status: int,
    body: bytes,
    expected_status: int,
    expected_message: str,
) -> None:
    """Upstream errors reach the client with the right status, in the OpenAI shape, no secrets."""
    fake = Scripted(status, body)
    async with serve(fake) as url, run_gateway(one_model(url + "/v1")) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat())
    assert resp.status_code == expected_status
    error = resp.json()["error"]
    assert expected_message in error["message"]
    assert "sk-abcdef123456" not in resp.text
    if expected_status == 502:
        assert "up/m" in error["message"]


async def test_upstream_gets_request_id_and_traceparent(client: httpx.AsyncClient) -> None:
    """The request id and a valid traceparent go upstream; the client's credentials do not."""
    fake = Scripted(200, b'{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}]}')
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with serve(fake) as url, run_gateway(one_model(url + "/v1")) as gw:
        resp = await client.post(
            gw.base_url + "/chat/completions",
            json=chat(),
            headers={
                "x-request-id": "r-1",
                "traceparent": traceparent,
                "authorization": "Bearer client-secret",
                "baggage": "user=alice",
            },
        )
    assert resp.status_code == 200
    # The gateway also reads a vLLM provider's /metrics, which carries no request id.
    (sent,) = [r for r in fake.requests if "content-type" in r]
    assert sent["x-request-id"] == "r-1"
    assert sent["traceparent"] == traceparent
    assert "authorization" not in sent
    assert "baggage" not in sent


async def test_connect_failure_is_502(client: httpx.AsyncClient) -> None:
    """An upstream that refuses connections gives a 502 that names the deployment."""
    with socket.socket() as sock:  # a port that was free a moment ago, now closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with run_gateway(one_model(f"http://127.0.0.1:{port}/v1")) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat())
    assert resp.status_code == 502
    assert "up/m" in resp.json()["error"]["message"]


async def test_upstream_timeout_is_504(upstream: Upstream, client: httpx.AsyncClient) -> None:
    """An upstream that never answers within the read timeout gives a 504."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url, "read_timeout_ms": 200}},
        [{"name": "m", "deployments": [{"provider": "up", "model": "m@stall_rate=1"}]}],
    )
    async with run_gateway(settings) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat())
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "upstream_timeout"


# --- fallback before commit ----------------------------------------------------------------------


def two_deployments(upstream: Upstream, first: str, second: str = "ok", **model: Any) -> Any:
    return gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [
            {
                "name": "m",
                "deployments": [
                    {"provider": "up", "model": first, "weight": 1e9},
                    {"provider": "up", "model": second, "weight": 1e-9},
                ],
                **model,
            }
        ],
    )


@pytest.mark.parametrize(
    "first",
    ["bad@error_500_rate=1", "bad@error_429_rate=1", "bad@reset_rate=1", "bad@inband_error_rate=1"],
)
@pytest.mark.parametrize("stream", [True, False])
async def test_errors_before_commit_fall_back(
    upstream: Upstream, client: httpx.AsyncClient, first: str, stream: bool
) -> None:
    """A retryable failure before the first token moves on to the next deployment."""
    async with run_gateway(two_deployments(upstream, first)) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat(stream=stream))
    assert resp.status_code == 200
    assert resp.headers["x-tailguard-route"] == "error_fallback"
    assert resp.headers["x-tailguard-attempts"] == "2"
    assert resp.headers["x-tailguard-deployment"] == "up/ok"
    assert resp.headers["x-should-retry"] == "false"
    if stream:
        assert resp.text.rstrip().endswith("data: [DONE]")
    failed = gw.recorder.samples[f"up/{first}"][-1]
    assert failed.ok is False


async def test_rejected_request_is_not_retried(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """An upstream 400 means the request itself is bad: no other deployment is tried."""
    async with run_gateway(two_deployments(upstream, "bad@no_such_knob=1")) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat())
    assert resp.status_code == 400
    assert upstream.stats.requests == 0  # the sim refused it while parsing; "ok" was never called


async def test_stalled_primary_fails_over_at_the_ttft_budget(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A primary that sends no first token within the TTFT budget is rescued, and the next
    serves. Its successor has never been measured, so it is explored by a hedge at half the
    budget (trusting it with a failover could only guess); the stalled one is closed once the
    hedge answers."""
    settings = two_deployments(
        upstream, "slow@stall_rate=1", budget={"ttft_ms": 300}, on_ttft_miss="failover"
    )
    async with run_gateway(settings) as gw:
        started = time.perf_counter()
        resp = await client.post(gw.base_url + "/chat/completions", json=chat(stream=True))
        elapsed = time.perf_counter() - started
    assert resp.status_code == 200
    assert resp.headers["x-tailguard-route"] == "hedge"
    assert resp.headers["x-tailguard-deployment"] == "up/ok"
    assert 0.15 <= elapsed < 3.0  # hedged at half the budget, leaving the rest to the next one
    async with asyncio.timeout(scaled(5)):
        await upstream.stats.wait_for(lambda s: s.cancelled == 1)  # the slow one was closed


@pytest.mark.parametrize(
    ("model", "status"),
    [("bad@error_500_rate=1", 502), ("bad@error_429_rate=1", 429)],
)
async def test_all_candidates_failing_gives_one_status(
    upstream: Upstream, client: httpx.AsyncClient, model: str, status: int
) -> None:
    """When every deployment fails, the status summarises them and says not to retry."""
    async with run_gateway(two_deployments(upstream, model, model.replace("bad", "worse"))) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat())
    assert resp.status_code == status
    assert resp.json()["error"]["code"] in ("all_candidates_failed", "rate_limit_exceeded")
    assert resp.headers["x-should-retry"] == "false"
    if status == 429:
        assert resp.headers["retry-after"] == "1"


async def test_fallback_model_serves_when_primary_model_fails(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A model's `fallbacks` are tried after its own deployments, and the header says which."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [
            {
                "name": "big",
                "deployments": [{"provider": "up", "model": "x@error_500_rate=1"}],
                "fallbacks": ["small"],
            },
            {"name": "small", "deployments": [{"provider": "up", "model": "small"}]},
        ],
    )
    async with run_gateway(settings) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat("big"))
    assert resp.status_code == 200
    assert resp.headers["x-tailguard-model"] == "small"
    assert resp.headers["x-tailguard-deployment"] == "up/small"


async def test_non_streaming_request_is_bounded_by_total_budget_only(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A non-streaming answer longer than the TTFT budget is fine; the total budget bounds it."""
    model = "m@tokens_per_s=100,output_tokens=20"  # ~200 ms of decoding
    settings = one_model(upstream.base_url, model, budget={"ttft_ms": 50, "total_ms": 5000})
    async with run_gateway(settings) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat())
    assert resp.status_code == 200
    slow = one_model(upstream.base_url, "m@stall_rate=1", budget={"ttft_ms": 50, "total_ms": 300})
    async with run_gateway(slow) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat())
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "budget_exceeded"
    async with asyncio.timeout(scaled(5)):
        await upstream.stats.wait_for(lambda s: s.cancelled == 1)


async def test_fallbacks_are_followed_transitively(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A fallback's own fallbacks are candidates too, each deployment tried once."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [
            {
                "name": "a",
                "deployments": [{"provider": "up", "model": "x@error_500_rate=1"}],
                "fallbacks": ["b"],
            },
            {
                "name": "b",
                "deployments": [{"provider": "up", "model": "y@error_500_rate=1"}],
                "fallbacks": ["c"],
            },
            {
                "name": "c",
                "deployments": [
                    {"provider": "up", "model": "x@error_500_rate=1"},
                    {"provider": "up", "model": "z"},
                ],
            },
        ],
    )
    async with run_gateway(settings) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat("a"))
    assert resp.status_code == 200
    assert resp.headers["x-tailguard-model"] == "c"
    assert resp.headers["x-tailguard-attempts"] == "3"


# --- per-request budgets -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "param"),
    [
        ({"x-tailguard-ttft-budget-ms": "soon"}, "x-tailguard-ttft-budget-ms"),
        ({"x-tailguard-ttft-budget-ms": "0"}, "x-tailguard-ttft-budget-ms"),
        ({"x-tailguard-total-budget-ms": "-5"}, "x-tailguard-total-budget-ms"),
        ({"x-tailguard-total-budget-ms": "99999999999"}, "x-tailguard-total-budget-ms"),
        (
            {"x-tailguard-ttft-budget-ms": "900", "x-tailguard-total-budget-ms": "500"},
            "x-tailguard-ttft-budget-ms",
        ),
    ],
)
async def test_invalid_budget_header_is_a_400_naming_it(
    upstream: Upstream, client: httpx.AsyncClient, headers: dict[str, str], param: str
) -> None:
    """A budget header that is not a sensible number of milliseconds is refused, by name."""
    async with run_gateway(one_model(upstream.base_url)) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat(), headers=headers)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_header")
    assert upstream.stats.requests == 0


async def test_ttft_budget_header_overrides_the_config(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A request's TTFT budget header replaces the model's: a stalled primary is cut by it."""
    settings = two_deployments(
        upstream, "slow@stall_rate=1", budget={"ttft_ms": 60_000}, on_ttft_miss="failover"
    )
    async with run_gateway(settings) as gw:
        started = time.perf_counter()
        resp = await client.post(
            gw.base_url + "/chat/completions",
            json=chat(stream=True),
            headers={"x-tailguard-ttft-budget-ms": "300"},
        )
        elapsed = time.perf_counter() - started
    assert resp.status_code == 200
    assert resp.headers["x-tailguard-route"] == "hedge"  # an unmeasured successor: explored
    assert elapsed < 5.0  # the configured 60 s budget would have waited far longer


async def test_total_budget_header_bounds_a_non_streaming_request(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A total budget header gives a 504 when no answer comes in time, and frees the upstream."""
    async with run_gateway(one_model(upstream.base_url, "m@stall_rate=1")) as gw:
        resp = await client.post(
            gw.base_url + "/chat/completions",
            json=chat(),
            headers={"x-tailguard-total-budget-ms": "200"},
        )
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "budget_exceeded"
    async with asyncio.timeout(scaled(5)):
        await upstream.stats.wait_for(lambda s: s.cancelled == 1)


class ScriptedStream(Scripted):
    """An upstream that answers every request with one scripted SSE body."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await super().__call__(scope, receive, send)
            return
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


class FailingRecorder(MemoryRecorder):
    """A recorder whose storage is broken: every sample raises (a fault inside the gateway)."""

    def record(self, sample: Sample) -> None:
        raise RuntimeError("the statistics store is broken")


@pytest.mark.parametrize(
    ("path", "shape"), [("/chat/completions", "openai"), ("/messages", "anthropic")]
)
async def test_unexpected_failure_is_answered_in_the_client_wire(
    client: httpx.AsyncClient, path: str, shape: str
) -> None:
    """A failure inside the gateway itself (here: the statistics store raising while a failed
    attempt is recorded) is answered in the client's error shape, never as a bare text 500."""
    fake = Scripted(500, b'{"error":{"message":"boom","type":"server_error"}}')
    body = {"model": "m", "max_tokens": 5, "stream": True, "messages": CHAT["messages"]}
    async with serve(fake) as url:
        # An `openai` provider: no background /metrics reader of a vLLM server to race with.
        settings = gateway_settings(
            {"up": {"type": "openai", "base_url": url + "/v1"}},
            [{"name": "m", "deployments": [{"provider": "up", "model": "m"}]}],
        )
        async with run_gateway(settings, recorder=FailingRecorder()) as gw:
            resp = await client.post(gw.base_url + path, json=body)
    assert resp.status_code == 500
    error = resp.json()
    if shape == "anthropic":
        assert (error["type"], error["error"]["type"]) == ("error", "api_error")
    else:
        assert error["error"]["code"] == "internal_error"


async def test_garbage_usage_counts_are_ignored_not_fatal(client: httpx.AsyncClient) -> None:
    """Usage counts no number can be made of are ignored: the translated stream is served to
    its end, counts and all, instead of failing."""
    events = (
        b'data: {"id":"1","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
        b'data: {"id":"1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
        b'data: {"id":"1","choices":[],"usage":{"prompt_tokens":"12","completion_tokens":[]}}\n\n'
        b"data: [DONE]\n\n"
    )
    fake = ScriptedStream(200, events)
    body = {"model": "m", "max_tokens": 5, "stream": True, "messages": CHAT["messages"]}
    async with serve(fake) as url, run_gateway(one_model(url + "/v1")) as gw:
        resp = await client.post(gw.base_url + "/messages", json=body)
    assert resp.status_code == 200
    assert "event: error" not in resp.text
    assert resp.text.rstrip().splitlines()[-1] == 'data: {"type":"message_stop"}'


async def test_stream_answered_with_a_json_body_is_not_relayed(client: httpx.AsyncClient) -> None:
    """An upstream that answers a streaming request with a plain JSON body fails the attempt."""
    fake = Scripted(200, b'{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}]}')
    async with serve(fake) as url, run_gateway(one_model(url + "/v1")) as gw:
        resp = await client.post(gw.base_url + "/chat/completions", json=chat(stream=True))
    assert resp.status_code == 502
    assert "without a stream" in resp.json()["error"]["message"]


async def test_budget_headers_with_odd_digits_are_400(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """Unicode digits and absurdly long numbers in a budget header are a 400, not a 500."""
    async with run_gateway(one_model(upstream.base_url)) as gw:
        for value in ("\u00b2".encode(), b"1" * 5000):
            resp = await client.post(
                gw.base_url + "/chat/completions",
                json=chat(),
                headers=[(b"x-tailguard-ttft-budget-ms", value)],
            )
            assert resp.status_code == 400


async def test_total_budget_header_tightens_a_configured_ttft_budget(
    upstream: Upstream, client: httpx.AsyncClient
) -> None:
    """A total budget header below the model's configured TTFT budget is accepted (the TTFT
    deadline shrinks to fit), not refused."""
    settings = one_model(upstream.base_url, budget={"ttft_ms": 800, "total_ms": 10_000})
    async with run_gateway(settings) as gw:
        for stream in (False, True):
            resp = await client.post(
                gw.base_url + "/chat/completions",
                json=chat(stream=stream),
                headers={"x-tailguard-total-budget-ms": "500"},
            )
            assert resp.status_code == 200
