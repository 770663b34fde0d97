"""A latency probe for any OpenAI-compatible endpoint: separate prefill cost from decode cost.

Three conditions, each run `requests` times with streaming on:

- `short`: a short prompt and a short answer, the baseline;
- `long_prompt`: a ~2-page prompt and a short answer, which moves time to first token (prefill);
- `long_output`: a short prompt and a long answer, which moves total time (decode) but not TTFT.

TTFT is the time to the first event carrying content, total the time to `[DONE]`, and the decode
rate of one request is (output tokens - 1) / (total - TTFT): the first token belongs to prefill.
Failed requests are counted per condition and left out of the percentiles. The write-up of a
summary (table rows, Markdown, the interpretation) is in `probe_report`.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import aiohttp
import orjson

from gateway.latency.sketch import latency_report, nearest_rank
from gateway.sse import SSEFramingError, SSEParser

__all__ = [
    "CONDITIONS",
    "CONDITION_SPECS",
    "Condition",
    "ProbeResult",
    "filler_text",
    "run_probe",
    "summarize",
    "tokens_per_s",
]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One probe request. Latencies are in milliseconds; failed requests carry `error` only."""

    condition: str
    ok: bool
    ttft_ms: float | None
    total_ms: float | None
    output_tokens: int | None
    error: str | None


@dataclass(frozen=True, slots=True)
class Condition:
    """What one condition sends: its prompt and `max_tokens`, and how a report describes it."""

    description: str
    prompt: str
    max_tokens: int


# fmt: off
_FILLER: Final = (
    "The harbour office opens at dawn, when the first ferries leave for the outer islands.",
    "Clerks record every departure in a ledger that has been kept in the same format for decades.",
    "Each entry lists the vessel, the crew, the cargo and the weather observed at the breakwater.",
    "On calm days the ledger fills quickly, because small boats come and go without delay.",
    "In a storm the pages stay almost empty, and the clerks spend the hours mending old charts.",
    "Visitors often ask why the office still writes by hand when a computer would be faster.",
    "The harbour master answers that paper survives floods, power cuts and careless updates.",
    "Once a year the ledgers are carried to the town archive and stored on oak shelves.",
    "Historians use them to trace how trade, fishing and travel changed over the century.",
    "The oldest volume records a winter when ice closed the harbour for eleven weeks.",
)
# fmt: on


def filler_text(words: int = 1_000) -> str:
    """Deterministic prose of at least `words` words (~2 pages at 1,000), in paragraphs."""
    paragraphs: list[str] = []
    count = 0
    index = 0
    while count < words:
        # Rotating the sentences keeps paragraphs distinct, as a real document's would be.
        sentences = [_FILLER[(index + k) % len(_FILLER)] for k in range(len(_FILLER))]
        paragraph = f"Section {index + 1}. " + " ".join(sentences)
        paragraphs.append(paragraph)
        count += len(paragraph.split())
        index += 1
    return "\n\n".join(paragraphs)


CONDITION_SPECS: Final[dict[str, Condition]] = {
    "short": Condition(
        "short prompt, short answer",
        "In one sentence, what is a latency budget?",
        32,
    ),
    "long_prompt": Condition(
        "~2-page prompt, short answer",
        "Read this document:\n\n"
        + filler_text()
        + "\n\nIn one sentence, what is the document about?",
        32,
    ),
    "long_output": Condition(
        "short prompt, long answer",
        "Write about 500 words on how a harbour office keeps its records. Do not stop early.",
        512,
    ),
}
CONDITIONS: Final = tuple(CONDITION_SPECS)

ProgressCallback = Callable[[str, int, int], None]


async def run_probe(
    base_url: str,
    model: str,
    *,
    requests: int = 20,
    concurrency: int = 1,
    conditions: Sequence[str] = CONDITIONS,
    api_key: str | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 120,
    progress: ProgressCallback | None = None,
) -> list[ProbeResult]:
    """Stream `requests` chat completions per condition from `base_url` (ending in `/v1`).

    Conditions run one after another, each with up to `concurrency` requests in flight, so one
    condition's load never skews another's numbers. `progress(condition, done, total)` is called
    after each request. Failures become results with `ok=False`; nothing is raised for them.
    """
    if requests < 1:
        raise ValueError("requests must be at least 1")
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")
    unknown = [name for name in conditions if name not in CONDITION_SPECS]
    if unknown:
        raise ValueError(f"unknown condition(s) {unknown}; expected some of {list(CONDITIONS)}")
    url = base_url.rstrip("/") + "/chat/completions"
    send_headers = {"content-type": "application/json", "accept": "text/event-stream"}
    if api_key:
        send_headers["authorization"] = f"Bearer {api_key}"
    send_headers.update(headers or {})
    # Servers with prefix caching (vLLM's default) would skip the prefill of a repeated prompt, so
    # every prompt starts with a marker unique to this run and request.
    run = secrets.token_hex(4)
    connector = aiohttp.TCPConnector(limit=concurrency)
    # trust_env stays off: a proxy in the path would be measured as if it were the endpoint.
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    results: list[ProbeResult] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for name in conditions:
            condition = CONDITION_SPECS[name]
            bodies = [
                orjson.dumps(
                    {
                        "model": model,
                        "messages": [
                            {"role": "user", "content": f"[probe {run}-{i}] {condition.prompt}"}
                        ],
                        "max_tokens": condition.max_tokens,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                )
                for i in range(requests)
            ]
            results += await _run_condition(
                session, url, send_headers, name, bodies, concurrency, timeout_s, progress
            )
    return results


async def _run_condition(
    session: aiohttp.ClientSession,
    url: str,
    headers: Mapping[str, str],
    name: str,
    bodies: Sequence[bytes],
    concurrency: int,
    timeout_s: float,
    progress: ProgressCallback | None,
) -> list[ProbeResult]:
    results: list[ProbeResult | None] = [None] * len(bodies)
    pending = iter(range(len(bodies)))  # shared by the workers: each index is taken once
    done = 0

    async def worker() -> None:
        nonlocal done
        for i in pending:
            results[i] = await _request(session, url, headers, name, bodies[i], timeout_s)
            done += 1
            if progress is not None:
                progress(name, done, len(bodies))

    async with asyncio.TaskGroup() as group:
        for _ in range(min(concurrency, len(bodies))):
            group.create_task(worker())
    return [result for result in results if result is not None]


def _failed(condition: str, error: str) -> ProbeResult:
    return ProbeResult(condition, False, None, None, None, error)


async def _request(
    session: aiohttp.ClientSession,
    url: str,
    headers: Mapping[str, str],
    condition: str,
    body: bytes,
    timeout_s: float,
) -> ProbeResult:
    start = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                text = await response.text(errors="replace")
                return _failed(condition, f"HTTP {response.status}: {_error_message(text)}")
            content_type = response.headers.get("content-type", "")
            if not content_type.startswith("text/event-stream"):
                return _failed(condition, f"expected an event stream, got {content_type!r}")
            parser = SSEParser()
            ttft_ms: float | None = None
            content_events = 0
            usage_tokens: int | None = None
            async for chunk in response.content.iter_any():
                for event in parser.feed(chunk):
                    data = event.data
                    if not data:  # a keep-alive comment
                        continue
                    if data == b"[DONE]":
                        total_ms = (time.perf_counter() - start) * 1000
                        if ttft_ms is None:
                            return _failed(condition, "the stream carried no content")
                        tokens = usage_tokens if usage_tokens is not None else content_events
                        return ProbeResult(condition, True, ttft_ms, total_ms, tokens, None)
                    try:
                        payload = orjson.loads(data)
                    except orjson.JSONDecodeError:
                        return _failed(condition, f"malformed event: {_clip(data.decode())}")
                    if not isinstance(payload, dict):
                        continue
                    if "error" in payload:
                        return _failed(condition, f"in-stream error: {_error_message(data)}")
                    if _has_content(payload):
                        content_events += 1
                        if ttft_ms is None:
                            ttft_ms = (time.perf_counter() - start) * 1000
                    usage = payload.get("usage")
                    if isinstance(usage, dict) and isinstance(
                        completion := usage.get("completion_tokens"), int
                    ):
                        usage_tokens = completion
            return _failed(condition, "the stream ended before [DONE]")
    except TimeoutError:
        return _failed(condition, f"timed out after {timeout_s:g} s")
    except (aiohttp.ClientError, OSError, SSEFramingError, UnicodeDecodeError) as exc:
        detail = str(exc)
        return _failed(condition, type(exc).__name__ + (f": {_clip(detail)}" if detail else ""))


def _has_content(payload: dict[str, object]) -> bool:
    """True if the first choice carries text: `delta.content` (chat) or `text` (completions)."""
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta")
    content = delta.get("content") if isinstance(delta, dict) else None
    return bool(content if isinstance(content, str) else choice.get("text"))


def _error_message(body: str | bytes) -> str:
    """The `error.message` of an OpenAI-shaped error body, else the body itself, clipped."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        payload = None
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and isinstance(message := error.get("message"), str):
            return _clip(message)
        if isinstance(error, str):
            return _clip(error)
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return _clip(text.strip()) or "(empty body)"


def _clip(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# Summaries.


def tokens_per_s(result: ProbeResult) -> float | None:
    """The decode rate of one request; None when it cannot be measured (one token, or failed)."""
    if (
        not result.ok
        or result.ttft_ms is None
        or result.total_ms is None
        or result.output_tokens is None
        or result.output_tokens < 2
        or result.total_ms <= result.ttft_ms
    ):
        return None
    return (result.output_tokens - 1) / ((result.total_ms - result.ttft_ms) / 1000)


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p95, p99, mean and max (nearest rank); all None without values."""
    if not values:
        return dict.fromkeys(("p50", "p95", "p99", "mean", "max"))
    report = latency_report(values)
    ordered = sorted(values)
    return {
        "p50": report["p50"],
        "p95": ordered[nearest_rank(0.95, len(ordered)) - 1],
        "p99": report["p99"],
        "mean": report["mean"],
        "max": report["max"],
    }


def summarize(results: Sequence[ProbeResult]) -> dict[str, dict[str, object]]:
    """Per condition (in order of appearance): request counts and latency statistics.

    Each entry has `n`, `ok`, `errors`, `ttft_ms` and `total_ms` (dicts of p50, p95, p99, mean,
    max), `tokens_per_s_p50`, `output_tokens_mean` and `error_examples` (up to three distinct
    messages). Statistics without a successful request are None, so the summary is valid JSON.
    """
    grouped: dict[str, list[ProbeResult]] = {}
    for result in results:
        grouped.setdefault(result.condition, []).append(result)
    summary: dict[str, dict[str, object]] = {}
    for name, group in grouped.items():
        ok = [r for r in group if r.ok]
        rates = [rate for r in ok if (rate := tokens_per_s(r)) is not None]
        tokens = [r.output_tokens for r in ok if r.output_tokens is not None]
        examples: list[str] = []
        for r in group:
            if r.error is not None and r.error not in examples and len(examples) < 3:
                examples.append(r.error)
        summary[name] = {
            "n": len(group),
            "ok": len(ok),
            "errors": len(group) - len(ok),
            "ttft_ms": _stats([r.ttft_ms for r in ok if r.ttft_ms is not None]),
            "total_ms": _stats([r.total_ms for r in ok if r.total_ms is not None]),
            "tokens_per_s_p50": _stats(rates)["p50"],
            "output_tokens_mean": math.fsum(tokens) / len(tokens) if tokens else None,
            "error_examples": examples,
        }
    return summary
