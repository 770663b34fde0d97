"""The request trace the trace benchmark replays: a generated one, or the Azure CSV if you have it.

The Azure LLM inference trace 2023 (`AzureLLMInferenceTrace_conv.csv`, `_code.csv`, columns
`TIMESTAMP, ContextTokens, GeneratedTokens`; published by Microsoft under CC-BY 4.0) is not
shipped here. `synthetic_trace` generates one with the same shape, deterministically from a
seed (see `docs/performance.md`):

- arrivals: open loop, gamma-distributed gaps (shape 0.5: burstier than Poisson, coefficient of
  variation 1.4) with a mean rate of 7.8 requests/s;
- prompt sizes: lognormal (median ~715 tokens, sigma 1.0), clipped to 1..14,000: mean ~1,155;
- output lengths: lognormal (median ~145 tokens, sigma 0.9), clipped to 1..1,000: mean ~211.

`read_trace` reads the real CSV (timestamps as `2023-11-16 18:15:46.6805900` or seconds).
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Final, NamedTuple

RATE_PER_S: Final = 7.8
GAP_SHAPE: Final = 0.5  # gamma shape of the gaps between arrivals: < 1 is burstier than Poisson
CONTEXT_MU: Final = 6.57  # ln(~715)
CONTEXT_SIGMA: Final = 1.0
CONTEXT_MAX: Final = 14_000
OUTPUT_MU: Final = 4.98  # ln(~145)
OUTPUT_SIGMA: Final = 0.9
OUTPUT_MAX: Final = 1_000


class TraceRow(NamedTuple):
    """One request: seconds from the trace's start, prompt tokens, output tokens."""

    t: float
    context: int
    generated: int


def synthetic_trace(
    duration_s: float, seed: int, rate: float = RATE_PER_S, limit: int | None = None
) -> list[TraceRow]:
    """Requests arriving in `[0, duration_s)`, at most `limit` of them; the same for a seed."""
    rng = random.Random(seed)
    rows: list[TraceRow] = []
    t = 0.0
    while limit is None or len(rows) < limit:
        t += rng.gammavariate(GAP_SHAPE, 1.0 / (rate * GAP_SHAPE))
        if t >= duration_s:
            break
        context = min(CONTEXT_MAX, max(1, round(rng.lognormvariate(CONTEXT_MU, CONTEXT_SIGMA))))
        generated = min(OUTPUT_MAX, max(1, round(rng.lognormvariate(OUTPUT_MU, OUTPUT_SIGMA))))
        rows.append(TraceRow(t, context, generated))
    return rows


def _seconds(text: str) -> float:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    # The Azure files carry 7 fractional digits; datetime takes at most 6.
    head, dot, fraction = text.partition(".")
    stamp = datetime.fromisoformat(head + (dot + fraction[:6] if dot else ""))
    return stamp.timestamp()


def read_trace(path: Path, duration_s: float, limit: int | None = None) -> list[TraceRow]:
    """The first `duration_s` seconds of a CSV with `TIMESTAMP, ContextTokens, GeneratedTokens`
    (at most `limit` rows), times from its first row; output lengths clipped to 1..1,000."""
    rows: list[TraceRow] = []
    start: float | None = None
    with path.open(newline="") as file:
        for record in csv.DictReader(file, skipinitialspace=True):
            at = _seconds(record["TIMESTAMP"])
            start = at if start is None else start
            if at - start >= duration_s or (limit is not None and len(rows) >= limit):
                break
            context = max(1, int(record["ContextTokens"]))
            generated = min(OUTPUT_MAX, max(1, int(record["GeneratedTokens"])))
            rows.append(TraceRow(at - start, context, generated))
    return rows


def describe(rows: Sequence[TraceRow]) -> dict[str, float]:
    """Requests, rate and the means and maxima of the sizes, for the report's header."""
    if not rows:
        return {"requests": 0}
    span = rows[-1].t if len(rows) > 1 else 1.0
    contexts = [r.context for r in rows]
    outputs = [r.generated for r in rows]
    return {
        "requests": len(rows),
        "rate_per_s": round(len(rows) / span, 2) if span > 0 else math.inf,
        "context_mean": round(sum(contexts) / len(rows), 1),
        "context_max": max(contexts),
        "generated_mean": round(sum(outputs) / len(rows), 1),
        "generated_max": max(outputs),
    }


def prompt_text(index: int, context_tokens: int) -> str:
    """A prompt of ~`context_tokens` tokens as the upstreams count them (characters / 4), its
    start unique per request so no two requests share a prefix."""
    head = f"Request {index}. "
    filler = "lorem ipsum dolor sit amet, "
    length = max(len(head), 4 * context_tokens)
    return (head + filler * (length // len(filler) + 1))[:length]
