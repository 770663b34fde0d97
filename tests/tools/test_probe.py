"""The latency probe: real HTTP against the simulated upstream and the gateway on loopback."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
import pytest

from gateway.tools.probe import (
    CONDITIONS,
    ProbeResult,
    filler_text,
    run_probe,
    summarize,
    tokens_per_s,
)
from gateway.tools.probe_report import markdown_report, summary_rows
from tests.conftest import Upstream, one_model, run_gateway, serve


def stat(summary: dict[str, dict[str, object]], condition: str, metric: str, q: str) -> float:
    value = summary[condition][metric]
    assert isinstance(value, dict)
    number = value[q]
    assert isinstance(number, float)
    return number


def number(summary: dict[str, dict[str, object]], condition: str, key: str) -> float:
    value = summary[condition][key]
    assert isinstance(value, int | float)
    return float(value)


# --- against the simulated upstream ---------------------------------------------------------------


async def test_long_prompt_moves_ttft(upstream: Upstream) -> None:
    """With a per-prompt-token prefill cost, the ~2-page prompt has a much higher TTFT p50."""
    model = "m@prefill_ms_per_token=0.1"  # ~1,570 prompt tokens: ~160 ms more prefill
    results = await run_probe(
        upstream.base_url, model, requests=5, conditions=("short", "long_prompt")
    )
    summary = summarize(results)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [number(summary, c, "n") for c in ("short", "long_prompt")] == [5, 5]
    short, long = (stat(summary, c, "ttft_ms", "p50") for c in ("short", "long_prompt"))
    # Differences, not ratios: a busy machine adds the same delay to both and can make the
    # short one's p50 large, but no load shortens the simulated prefill.
    assert long - short >= 80  # half of the ~160 ms of extra prefill
    assert long >= 100  # the prefill really happened: ~160 ms expected


async def test_long_output_moves_total_not_ttft(upstream: Upstream) -> None:
    """With a decode rate, a long answer multiplies total time while TTFT stays near short's.
    The decode is slow (2 s for the long answer) so that what it adds stands well above what a
    busy machine adds to every request."""
    tokens_per_s = 200
    model = f"m@tokens_per_s={tokens_per_s},output_tokens=400"  # 400 tokens: ~2 s of decoding
    results = await run_probe(
        upstream.base_url, model, requests=5, concurrency=5, conditions=("short", "long_output")
    )
    summary = summarize(results)
    assert all(r.ok for r in results), [r.error for r in results]
    assert number(summary, "long_output", "output_tokens_mean") == 400  # from the usage chunk
    assert number(summary, "short", "output_tokens_mean") == 32  # capped by max_tokens
    short_total, long_total = (
        stat(summary, c, "total_ms", "p50") for c in ("short", "long_output")
    )
    short_ttft, long_ttft = (stat(summary, c, "ttft_ms", "p50") for c in ("short", "long_output"))
    extra_ms = (400 - 32) / tokens_per_s * 1000
    assert long_total - short_total >= 0.5 * extra_ms  # half the extra decoding, in ms
    # TTFT shifts by a small fraction of what total time does: the prompts are the same size.
    assert abs(long_ttft - short_ttft) < 0.25 * (long_total - short_total)
    rate = number(summary, "long_output", "tokens_per_s_p50")
    assert 0.6 * tokens_per_s < rate < 1.5 * tokens_per_s  # the simulated rate, through HTTP


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("error_500_rate=1", "HTTP 500"),
        ("error_429_rate=1", "HTTP 429"),
        ("inband_error_rate=1", "in-stream error"),
        ("cut_rate=1,output_tokens=20", ""),
        ("reset_rate=1", ""),
    ],
)
async def test_errors_are_counted_not_raised(upstream: Upstream, fault: str, message: str) -> None:
    """Every failing request becomes an error in its condition's count; the probe still finishes."""
    results = await run_probe(upstream.base_url, f"m@{fault}", requests=3)
    summary = summarize(results)
    assert list(summary) == list(CONDITIONS)
    for condition in CONDITIONS:
        assert summary[condition]["n"] == 3
        assert summary[condition]["errors"] == 3
        assert summary[condition]["ttft_ms"] == dict.fromkeys(("p50", "p95", "p99", "mean", "max"))
    assert all(not r.ok and r.error and message in r.error for r in results)
    report = markdown_report(summary, base_url=upstream.base_url, model="m")
    assert "9 of 9 requests failed" in report
    assert "| short | 0/3 | - | - | - |" in report


async def test_stalled_request_times_out_as_an_error(upstream: Upstream) -> None:
    """A request that never answers is cut at the timeout and counted, not waited on forever."""
    results = await run_probe(
        upstream.base_url, "m@stall_rate=1", requests=1, conditions=("short",), timeout_s=0.2
    )
    assert results == [ProbeResult("short", False, None, None, None, "timed out after 0.2 s")]


async def test_progress_is_reported_once_per_request(upstream: Upstream) -> None:
    """`progress(condition, done, total)` is called after each request, conditions in order."""
    calls: list[tuple[str, int, int]] = []
    results = await run_probe(
        upstream.base_url,
        "m",
        requests=3,
        concurrency=2,
        progress=lambda condition, done, total: calls.append((condition, done, total)),
    )
    assert len(results) == 9
    assert calls == [(c, done, 3) for c in CONDITIONS for done in (1, 2, 3)]


async def test_probe_through_the_gateway(upstream: Upstream) -> None:
    """The probe measures the gateway itself, which passes prefill cost through to TTFT."""
    settings = one_model(upstream.base_url, "m@prefill_ms_per_token=0.1")
    async with run_gateway(settings) as gw:
        results = await run_probe(
            gw.base_url,
            "m",
            requests=3,
            headers={"x-tailguard-ttft-budget-ms": "5000"},
        )
    assert all(r.ok for r in results), [r.error for r in results]
    summary = summarize(results)
    assert stat(summary, "long_prompt", "ttft_ms", "p50") >= 2 * stat(
        summary, "short", "ttft_ms", "p50"
    )
    (samples,) = gw.recorder.samples.values()
    assert len(samples) == 9  # every probe request reached the upstream through the gateway


# --- against a scripted endpoint ------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Scripted:
    """An ASGI app that records each request and answers with fixed SSE frames."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()  # startup
            await send({"type": "lifespan.startup.complete"})
            await receive()  # shutdown
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.requests.append((scope["path"], headers, orjson.loads(body)))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
            }
        )
        for frame in self.frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_request_shape_and_counting_without_usage() -> None:
    """Requests stream with usage asked for, carry the key and extra headers, and without a usage
    chunk output tokens are the content events (`delta.content` or `text`), skipping empty ones."""
    app = Scripted(
        [
            b": keep-alive\n\n",
            b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
            b'data: {"choices":[{"delta":{"content":"Hello"}}]}\n\n',
            b'data: {"choices":[{"text":" there"}]}\r\n\r\n',
            b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n',
            b"data: [DONE]\n\n",
        ]
    )
    async with serve(app) as url:
        results = await run_probe(
            url + "/v1/",
            "probe-model",
            requests=2,
            api_key="sk-test",
            headers={"x-tailguard-ttft-budget-ms": "800"},
        )
    assert [(r.ok, r.output_tokens) for r in results] == [(True, 2)] * 6
    assert all(r.ttft_ms is not None and r.total_ms is not None for r in results)
    path, headers, body = app.requests[0]
    assert path == "/v1/chat/completions"
    assert headers["authorization"] == "Bearer sk-test"
    assert headers["x-tailguard-ttft-budget-ms"] == "800"
    assert body["model"] == "probe-model"
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert [r[2]["max_tokens"] for r in app.requests] == [32, 32, 32, 32, 512, 512]
    prompts = [r[2]["messages"][0]["content"] for r in app.requests]
    assert len(set(prompts)) == 6  # each prompt is unique, so a prefix cache cannot skip prefill
    assert len(prompts[2].split()) > 1_000 > len(prompts[0].split())


async def test_stream_without_done_is_an_error() -> None:
    """A stream that ends before `[DONE]` is a failure, however much content it carried."""
    app = Scripted([b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'])
    async with serve(app) as url:
        results = await run_probe(url + "/v1", "m", requests=1, conditions=("short",))
    assert [r.error for r in results] == ["the stream ended before [DONE]"]


# --- summaries and the report, from hand-made results ---------------------------------------------


def ok(condition: str, ttft: float, total: float, tokens: int) -> ProbeResult:
    return ProbeResult(condition, True, ttft, total, tokens, None)


def test_summarize_uses_nearest_rank_percentiles() -> None:
    """p50, p95 and p99 are the ceil(q * n)-th smallest successful values; failures are counted."""
    results = [ok("short", float(v), float(v) + 100, 11) for v in range(20, 0, -1)]
    results.append(ProbeResult("short", False, None, None, None, "HTTP 500: boom"))
    summary = summarize(results)
    entry = summary["short"]
    assert (entry["n"], entry["ok"], entry["errors"]) == (21, 20, 1)
    assert entry["ttft_ms"] == {"p50": 10.0, "p95": 19.0, "p99": 20.0, "mean": 10.5, "max": 20.0}
    assert entry["total_ms"] == {
        "p50": 110.0,
        "p95": 119.0,
        "p99": 120.0,
        "mean": 110.5,
        "max": 120.0,
    }
    assert entry["tokens_per_s_p50"] == 100.0  # 10 tokens after the first in 100 ms
    assert entry["output_tokens_mean"] == 11.0
    assert entry["error_examples"] == ["HTTP 500: boom"]


def test_tokens_per_s_needs_two_tokens_and_decode_time() -> None:
    """The decode rate is undefined for one token, no decode time, or a failed request."""
    assert tokens_per_s(ok("short", 10, 110, 11)) == 100.0
    assert tokens_per_s(ok("short", 10, 110, 1)) is None
    assert tokens_per_s(ok("short", 10, 10, 5)) is None
    assert tokens_per_s(ProbeResult("short", False, None, None, None, "x")) is None


def handmade_summary() -> dict[str, dict[str, object]]:
    results = []
    for _ in range(4):
        # 31 tokens after the first in 620 ms: 50 tokens/s in every condition.
        results.append(ok("short", 100, 720, 32))
        results.append(ok("long_prompt", 400, 1020, 32))
        results.append(ok("long_output", 110, 110 + 511 * 20, 512))
    results.append(ProbeResult("long_output", False, None, None, None, "timed out after 120 s"))
    return summarize(results)


def test_markdown_report_has_table_and_interpretation() -> None:
    """The report tabulates each condition and explains, from the numbers, prefill vs decode."""
    report = markdown_report(handmade_summary(), base_url="http://localhost:8080/v1", model="llama")
    assert report.startswith("# Latency probe: `llama`\n")
    assert "| short | 4/4 | 100 | 100 | 100 | 720 | 720 | 720 | 50 | 32 |" in report
    assert "| long_prompt | 4/4 | 400 | 400 | 400 | 1,020 | 1,020 | 1,020 | 50 | 32 |" in report
    assert "| long_output | 4/5 | 110 | 110 | 110 | 10,330 | 10,330 | 10,330 | 50 | 512 |" in report
    assert (
        "A ~2-page prompt raised TTFT p50 from 100 ms to 400 ms (4.0x) while tokens/s stayed at "
        "about 50: prefill cost grows with prompt length."
    ) in report
    assert (
        "Asking for a long answer (512 output tokens on average vs 32) raised total p50 from "
        "720 ms to 10,330 ms (14.3x) while TTFT p50 stayed close (100 ms vs 110 ms): decode time "
        "grows with output length, while prefill depends on the prompt alone."
    ) in report
    assert "Each extra output token added about 20.02 ms to total p50, in line with" in report
    assert "(+300 ms TTFT p50 for ~2 pages)" in report
    assert "(+9,610 ms total p50 for 480 more tokens)" in report
    assert "1 of 13 requests failed" in report
    assert "- `long_output`: 1 failed (`timed out after 120 s`)" in report


def test_report_says_when_prefill_does_not_show() -> None:
    """When the long prompt does not move TTFT, the report says so instead of claiming it did."""
    results = [ok("short", 100, 200, 10), ok("long_prompt", 102, 202, 10)]
    report = markdown_report(summarize(results), base_url="u", model="m")
    assert "A ~2-page prompt barely moved TTFT p50 from 100 ms to 102 ms (1.0x)" in report
    assert "prefill cost grows" not in report


def test_summary_rows_format_missing_values_as_dashes() -> None:
    """A condition without a successful request shows dashes, not NaN or zero."""
    summary = summarize([ProbeResult("short", False, None, None, None, "x")])
    assert summary_rows(summary) == [["short", "0/1", *["-"] * 8]]


def test_filler_is_deterministic_and_about_two_pages() -> None:
    """The long prompt is the same ~1,000 words on every run."""
    text = filler_text()
    assert text == filler_text()
    assert 1_000 <= len(text.split()) < 1_200
