"""A latency probe for any OpenAI-compatible endpoint: separate prefill cost from decode cost.

Three conditions, each run `requests` times with streaming on:

- `short`: a short prompt and a short answer, the baseline;
- `long_prompt`: a ~2-page prompt and a short answer, which moves time to first token (prefill);
- `long_output`: a short prompt and a long answer, which moves total time (decode) but not TTFT.

TTFT is the time to the first event carrying content, total the time to `[DONE]`, and the decode
rate of one request is (output tokens - 1) / (total - TTFT): the first token belongs to prefill.
Failed requests are counted per condition and left out of the percentiles.
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

from gateway.sketch import latency_report, nearest_rank
from gateway.sse import SSEFramingError, SSEParser

__all__ = [
    "CONDITIONS",
    "SUMMARY_COLUMNS",
    "ProbeResult",
    "filler_text",
    "markdown_report",
    "run_probe",
    "summarize",
    "summary_rows",
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
class _Condition:
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


_CONDITIONS: Final[dict[str, _Condition]] = {
    "short": _Condition(
        "short prompt, short answer",
        "In one sentence, what is a latency budget?",
        32,
    ),
    "long_prompt": _Condition(
        "~2-page prompt, short answer",
        "Read this document:\n\n"
        + filler_text()
        + "\n\nIn one sentence, what is the document about?",
        32,
    ),
    "long_output": _Condition(
        "short prompt, long answer",
        "Write about 500 words on how a harbour office keeps its records. Do not stop early.",
        512,
    ),
}
CONDITIONS: Final = tuple(_CONDITIONS)

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
    unknown = [name for name in conditions if name not in _CONDITIONS]
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
            condition = _CONDITIONS[name]
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


def _number(entry: Mapping[str, object] | None, key: str, stat: str | None = None) -> float | None:
    """A statistic from a summary entry (`summarize` builds them untyped, for JSON)."""
    if entry is None:
        return None
    value = entry.get(key)
    if stat is not None:
        value = value.get(stat) if isinstance(value, dict) else None
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if abs(value) < 10 else f"{value:,.0f}"


def _plain(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


SUMMARY_COLUMNS: Final = (
    "condition",
    "ok/n",
    "TTFT p50",
    "TTFT p95",
    "TTFT p99",
    "total p50",
    "total p95",
    "total p99",
    "tokens/s p50",
    "output tokens",
)
"""Headers of `summary_rows`; latencies are in milliseconds, output tokens a mean."""


def summary_rows(summary: Mapping[str, Mapping[str, object]]) -> list[list[str]]:
    """The summary as table rows of formatted cells (for Markdown and terminal tables alike)."""
    rows: list[list[str]] = []
    for name, entry in summary.items():
        ok, n = _number(entry, "ok"), _number(entry, "n")
        rows.append(
            [
                name,
                f"{_plain(ok)}/{_plain(n)}",
                *(_ms(_number(entry, "ttft_ms", q)) for q in ("p50", "p95", "p99")),
                *(_ms(_number(entry, "total_ms", q)) for q in ("p50", "p95", "p99")),
                _plain(_number(entry, "tokens_per_s_p50")),
                _plain(_number(entry, "output_tokens_mean")),
            ]
        )
    return rows


# Interpretation.

_MOVED: Final = 1.5  # a ratio beyond this (either way) counts as a real shift
_NOISE_MS: Final = 5.0  # differences below this are loopback jitter, whatever their ratio


def _ratio(before: float, after: float) -> float:
    return after / before if before > 0 else math.inf


def _verb(before: float, after: float) -> str:
    ratio = _ratio(before, after)
    if abs(after - before) < _NOISE_MS:
        return "barely moved"
    if ratio >= _MOVED:
        return "raised"
    if ratio <= 1 / _MOVED:
        return "lowered"
    return "barely moved"


def _times(before: float, after: float) -> str:
    ratio = _ratio(before, after)
    return "from zero" if math.isinf(ratio) else f"{ratio:.1f}x"


def _close(a: float, b: float) -> bool:
    return abs(a - b) < max(_NOISE_MS, 0.25 * max(a, b))


def _signed_ms(value: float) -> str:
    return ("+" if value >= 0 else "-") + _ms(abs(value)) + " ms"


def _prefill_sentence(short: Mapping[str, object], long: Mapping[str, object]) -> str | None:
    before, after = _number(short, "ttft_ms", "p50"), _number(long, "ttft_ms", "p50")
    if before is None or after is None:
        return None
    rate_before = _number(short, "tokens_per_s_p50")
    rate_after = _number(long, "tokens_per_s_p50")
    if rate_before is None or rate_after is None:
        rates = ""
    elif _close(rate_before, rate_after):
        rates = f" while tokens/s stayed at about {_plain(rate_after)}"
    else:
        rates = f" while tokens/s went from {_plain(rate_before)} to {_plain(rate_after)}"
    verb = _verb(before, after)
    if verb == "raised":
        why = "prefill cost grows with prompt length"
    else:
        why = (
            "prefilling ~2 pages is cheap next to this endpoint's fixed per-request cost, "
            "so it does not show at this sample size"
        )
    return (
        f"A ~2-page prompt {verb} TTFT p50 from {_ms(before)} ms to {_ms(after)} ms "
        f"({_times(before, after)}){rates}: {why}."
    )


def _decode_sentence(short: Mapping[str, object], long: Mapping[str, object]) -> str | None:
    before, after = _number(short, "total_ms", "p50"), _number(long, "total_ms", "p50")
    ttft_before, ttft_after = _number(short, "ttft_ms", "p50"), _number(long, "ttft_ms", "p50")
    tokens_before = _number(short, "output_tokens_mean")
    tokens_after = _number(long, "output_tokens_mean")
    if None in (before, after, ttft_before, ttft_after, tokens_before, tokens_after):
        return None
    assert before is not None and after is not None  # for the type checker
    assert ttft_before is not None and ttft_after is not None
    assert tokens_before is not None and tokens_after is not None
    ttft_close = _close(ttft_before, ttft_after)
    if ttft_close:
        ttft = f"TTFT p50 stayed close ({_ms(ttft_before)} ms vs {_ms(ttft_after)} ms)"
    else:
        ttft = f"TTFT p50 moved from {_ms(ttft_before)} ms to {_ms(ttft_after)} ms"
    verb = _verb(before, after)
    if tokens_after < _MOVED * tokens_before:
        why = "the endpoint stopped early, so this run cannot show decode cost"
    elif verb != "raised":
        why = "decoding is fast enough here that output length hardly matters"
    elif ttft_close:
        why = "decode time grows with output length, while prefill depends on the prompt alone"
    else:
        why = (
            "decode time grows with output length; the prompts are the same size, so the TTFT "
            "shift is queueing or noise, not prefill"
        )
    return (
        f"Asking for a long answer ({_plain(tokens_after)} output tokens on average vs "
        f"{_plain(tokens_before)}) {verb} total p50 from {_ms(before)} ms to {_ms(after)} ms "
        f"({_times(before, after)}) while {ttft}: {why}."
    )


def _per_token_sentence(short: Mapping[str, object], long: Mapping[str, object]) -> str | None:
    rate = _number(long, "tokens_per_s_p50")
    before, after = _number(short, "total_ms", "p50"), _number(long, "total_ms", "p50")
    tokens_before = _number(short, "output_tokens_mean")
    tokens_after = _number(long, "output_tokens_mean")
    if None in (rate, before, after, tokens_before, tokens_after):
        return None
    assert rate is not None and before is not None and after is not None
    assert tokens_before is not None and tokens_after is not None
    if tokens_after - tokens_before < 1 or rate <= 0:
        return None
    per_token = (after - before) / (tokens_after - tokens_before)
    implied = 1000 / rate
    agree = "in line with" if 1 / _MOVED <= per_token / implied <= _MOVED else "against"
    return (
        f"Each extra output token added about {per_token:.2f} ms to total p50, {agree} the "
        f"decode rate of {_plain(rate)} tokens/s ({implied:.2f} ms per token): tokens are "
        "generated one after another, each needing its own pass through the model, so total time "
        "is roughly TTFT plus output tokens divided by the decode rate."
    )


def _takeaway_sentence(
    short: Mapping[str, object], prompt: Mapping[str, object], output: Mapping[str, object]
) -> str | None:
    ttft_short, ttft_prompt = _number(short, "ttft_ms", "p50"), _number(prompt, "ttft_ms", "p50")
    total_short = _number(short, "total_ms", "p50")
    total_output = _number(output, "total_ms", "p50")
    tokens_short = _number(short, "output_tokens_mean")
    tokens_output = _number(output, "output_tokens_mean")
    if None in (ttft_short, ttft_prompt, total_short, total_output, tokens_short, tokens_output):
        return None
    assert ttft_short is not None and ttft_prompt is not None
    assert total_short is not None and total_output is not None
    assert tokens_short is not None and tokens_output is not None
    return (
        f"So the prompt sets when the answer starts ({_signed_ms(ttft_prompt - ttft_short)} "
        f"TTFT p50 for ~2 pages) and the answer's length sets when it ends "
        f"({_signed_ms(total_output - total_short)} total p50 for "
        f"{_plain(tokens_output - tokens_short)} more tokens): trim the context to start "
        "sooner, cap max_tokens to finish sooner."
    )


def _interpretation(summary: Mapping[str, Mapping[str, object]]) -> list[str]:
    short = summary.get("short")
    prompt = summary.get("long_prompt")
    output = summary.get("long_output")
    sentences: list[str | None] = []
    if short is None:
        return ["Without the `short` baseline the conditions cannot be compared."]
    if prompt is not None:
        sentences.append(_prefill_sentence(short, prompt))
    if output is not None:
        sentences.append(_decode_sentence(short, output))
        sentences.append(_per_token_sentence(short, output))
    if prompt is not None and output is not None:
        sentences.append(_takeaway_sentence(short, prompt, output))
    found = [s for s in sentences if s is not None]
    if len(found) < len(sentences):
        found.append("Some comparisons are missing because a condition had no successful request.")
    return found


def markdown_report(
    summary: Mapping[str, Mapping[str, object]], *, base_url: str, model: str
) -> str:
    """A Markdown latency report: the table per condition, an interpretation and any errors."""
    lines = [
        f"# Latency probe: `{model}`",
        "",
        f"Endpoint `{base_url}`. Every request streams; TTFT is the time to the first content "
        "token, total the time to `[DONE]`, both in milliseconds with nearest-rank percentiles "
        "over the successful requests. Tokens/s is (output tokens - 1) / (total - TTFT).",
        "",
        "| " + " | ".join(SUMMARY_COLUMNS) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(SUMMARY_COLUMNS))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in summary_rows(summary)]
    described = [
        f"`{name}`: {_CONDITIONS[name].description} (max_tokens {_CONDITIONS[name].max_tokens})"
        for name in summary
        if name in _CONDITIONS
    ]
    if described:
        lines += ["", "Conditions: " + "; ".join(described) + "."]
    lines += ["", "## Interpretation", "", " ".join(_interpretation(summary))]
    failed = [(name, entry) for name, entry in summary.items() if _number(entry, "errors")]
    if failed:
        errors = sum(_number(entry, "errors") or 0 for _, entry in failed)
        total = sum(_number(entry, "n") or 0 for entry in summary.values())
        lines += [
            "",
            "## Errors",
            "",
            f"{errors:.0f} of {total:.0f} requests failed and are left out of the percentiles.",
            "",
        ]
        for name, entry in failed:
            examples = entry.get("error_examples")
            shown = (
                "; ".join("`" + str(e).replace("`", "'") + "`" for e in examples)
                if isinstance(examples, list)
                else ""
            )
            count = _number(entry, "errors") or 0
            lines.append(f"- `{name}`: {count:.0f} failed" + (f" ({shown})" if shown else ""))
    return "\n".join(lines) + "\n"
