"""The write-up of a latency probe's summary: table rows, and a Markdown report that reads the
numbers back as sentences (what the prompt's length moved, what the answer's length moved).

Works on what `probe.summarize` returns, so a summary saved as JSON renders the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

from gateway.tools.probe import CONDITION_SPECS

__all__ = ["SUMMARY_COLUMNS", "markdown_report", "summary_rows"]


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


# --- interpretation ------------------------------------------------------------------------------

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
        f"`{name}`: {spec.description} (max_tokens {spec.max_tokens})"
        for name in summary
        if (spec := CONDITION_SPECS.get(name)) is not None
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
