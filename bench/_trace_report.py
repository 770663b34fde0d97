"""The trace benchmark's figures, from what the client and the upstreams saw (no I/O here).

Per arm: SLO attainment (no error, first token within the TTFT budget and the answer within the
total budget, both from the request's scheduled time), errors, TTFT p50/p90/p99 and total p99,
the share served per deployment and per model, extra upstream requests (attempts the upstreams
received beyond one per client request), wasted prompt tokens (prompt tokens of attempts whose
prefill began and whose stream did not complete, over the client's prompt tokens) and the
recovery time after an incident. And the paired overhead: per request, the same draw direct
and through a gateway.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from bench._harness import percentiles_ms

RECOVERY_BIN_S: Final = 2.0
RECOVERY_ATTAINMENT: Final = 0.8  # a bin at or above it (and without errors) is "recovered"


@dataclass(slots=True)
class Outcome:
    """One client request of one arm."""

    index: int
    t: float  # scheduled, seconds from the run's start
    prompt_tokens: int
    ttft_s: float | None = None
    total_s: float | None = None
    error: str | None = None
    deployment: str | None = None
    lag_s: float = 0.0


def attained(o: Outcome, ttft_budget_s: float, total_budget_s: float) -> bool:
    return (
        o.error is None
        and o.ttft_s is not None
        and o.total_s is not None
        and o.ttft_s <= ttft_budget_s
        and o.total_s <= total_budget_s
    )


def recovery_s(
    outcomes: Sequence[Outcome],
    incident_end: float,
    ttft_budget_s: float,
    total_budget_s: float,
    bin_s: float = RECOVERY_BIN_S,
) -> float | None:
    """Seconds from `incident_end` to the start of the first `bin_s` bin (counted from the end,
    by scheduled time) from which on every bin has no error and attains at least 80%: 0.0 when
    the arm never noticed; None when it did not recover before the run ended."""
    bins: dict[int, list[Outcome]] = {}
    for o in outcomes:
        if o.t >= incident_end:
            bins.setdefault(int((o.t - incident_end) // bin_s), []).append(o)
    if not bins:
        return None
    last = max(bins)
    recovered_from: int | None = None
    for b in range(last, -1, -1):
        rows = bins.get(b, [])
        ok = all(o.error is None for o in rows) and (
            not rows
            or sum(attained(o, ttft_budget_s, total_budget_s) for o in rows) / len(rows)
            >= RECOVERY_ATTAINMENT
        )
        if not ok:
            break
        recovered_from = b
    return None if recovered_from is None else recovered_from * bin_s


HEALTHY_AFTER_S = 10.0  # the recovery the benchmark expects after an incident ends


def summarize(
    outcomes: Sequence[Outcome],
    attempts: Sequence[tuple[str, int, bool, bool]],
    model_of: Mapping[str, str],
    ttft_budget_s: float,
    total_budget_s: float,
    incident_end: float | None,
    *,
    incident_start: float | None = None,
    requested: str = "chat",
) -> dict[str, Any]:
    """One arm's figures. `attempts`: (upstream deployment, prompt tokens, completed, answered)
    for every request its upstreams received; `model_of`: deployment -> model name. The
    requested model's share while it is healthy counts the requests sent before the incident
    and from `HEALTHY_AFTER_S` after its end."""
    n = len(outcomes)
    healthy = [
        o
        for o in outcomes
        if incident_start is None
        or incident_end is None
        or o.t < incident_start
        or o.t >= incident_end + HEALTHY_AFTER_S
    ]
    kept = sum(o.error is None and model_of.get(o.deployment or "") == requested for o in healthy)
    ok = [o for o in outcomes if o.error is None]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    totals = [o.total_s for o in ok if o.total_s is not None]
    served = Counter(o.deployment or "?" for o in ok)
    by_model: Counter[str] = Counter()
    for deployment, count in served.items():
        by_model[model_of.get(deployment, "?")] += count
    client_tokens = sum(o.prompt_tokens for o in outcomes)
    wasted = sum(tokens for _, tokens, completed, _ in attempts if not completed)
    # Where the waste went: per deployment, (attempts, of them answered, prompt tokens).
    waste: dict[str, list[int]] = {}
    for deployment, tokens, completed, answered in attempts:
        if not completed:
            row = waste.setdefault(deployment, [0, 0, 0])
            row[0] += 1
            row[1] += answered
            row[2] += tokens
    errors = Counter((o.error or "")[:60] for o in outcomes if o.error is not None)
    return {
        "requests": n,
        "attainment": sum(attained(o, ttft_budget_s, total_budget_s) for o in outcomes) / n
        if n
        else None,
        "errors": n - len(ok),
        "error_kinds": dict(errors.most_common(5)),
        "ttft_ms": percentiles_ms(ttfts, missing=n - len(ttfts)),
        "total_ms": percentiles_ms(totals, missing=n - len(totals)),
        "served_by_deployment": {d: c / n for d, c in sorted(served.items())} if n else {},
        "served_by_model": {m: c / n for m, c in sorted(by_model.items())} if n else {},
        "requested_while_healthy": kept / len(healthy) if healthy else None,
        "upstream_requests": len(attempts),
        "extra_upstream_requests": (len(attempts) - n) / n if n else None,
        "wasted_prompt_tokens": wasted / client_tokens if client_tokens else None,
        "wasted_by_deployment": {
            d: {"attempts": a, "answered": answered, "prompt_tokens": t}
            for d, (a, answered, t) in sorted(waste.items())
        },
        "recovery_s": None
        if incident_end is None
        else recovery_s(outcomes, incident_end, ttft_budget_s, total_budget_s),
        "client_lag_ms": percentiles_ms([o.lag_s for o in outcomes]),
    }


def paired_overhead(direct: Sequence[Outcome], gateway: Sequence[Outcome]) -> dict[str, Any]:
    """Per request answered by both: gateway minus direct, TTFT and total, in ms percentiles.

    Each side counts from its own send, not from the scheduled time: the client sends the arms'
    copies one after another, so the later arm's wait for the earlier ones' sends (up to a few
    ms while the client is busy) is the client's, not the gateway's."""
    by_index = {o.index: o for o in direct if o.error is None and o.ttft_s is not None}
    ttft: list[float] = []
    total: list[float] = []
    for o in gateway:
        d = by_index.get(o.index)
        if d is None or o.error is not None or o.ttft_s is None or d.ttft_s is None:
            continue
        # The send's offset from the origin both figures count from (never negative).
        skew = max(o.lag_s, 0.0) - max(d.lag_s, 0.0)
        ttft.append(o.ttft_s - d.ttft_s - skew)
        if o.total_s is not None and d.total_s is not None:
            total.append(o.total_s - d.total_s - skew)
    # Differences can be negative: percentiles of the signed values, not of their sizes.
    return {"pairs": len(ttft), "ttft_ms": percentiles_ms(ttft), "total_ms": percentiles_ms(total)}


def _ms(value: object) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.0f}"


def _pct(value: object) -> str:
    return "-" if not isinstance(value, int | float) else f"{100 * value:.1f}%"


def table(scenario: str, arms: Mapping[str, Mapping[str, Any]]) -> str:
    """The Markdown table of one scenario, one row per arm."""
    lines = [
        f"### {scenario}",
        "",
        "| arm | attainment | errors | TTFT p50 / p90 / p99 ms | total p99 ms "
        "| served by model | requested model while healthy | served by deployment "
        "| extra upstream | wasted prompt | recovery s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in arms.items():
        ttft, total = r["ttft_ms"], r["total_ms"]
        models = ", ".join(f"{m} {_pct(s)}" for m, s in r["served_by_model"].items())
        deployments = ", ".join(f"{d} {_pct(s)}" for d, s in r["served_by_deployment"].items())
        recovery = r["recovery_s"]
        lines.append(
            f"| {name} | {_pct(r['attainment'])} | {r['errors']} "
            f"| {_ms(ttft.get('p50'))} / {_ms(ttft.get('p90'))} / {_ms(ttft.get('p99'))} "
            f"| {_ms(total.get('p99'))} | {models} | {_pct(r['requested_while_healthy'])} "
            f"| {deployments} "
            f"| {_pct(r['extra_upstream_requests'])} | {_pct(r['wasted_prompt_tokens'])} "
            f"| {'-' if recovery is None else f'{recovery:g}'} |"
        )
    return "\n".join(lines)


def overhead_line(paired: Mapping[str, Any], *, alone: bool = False) -> str:
    ttft, total = paired["ttft_ms"], paired["total_ms"]
    when = "the pair alone" if alone else "all four arms running"
    return (
        f"paired overhead, Tailguard one deployment vs direct ({paired['pairs']} pairs, "
        f"{when}): "
        f"TTFT {_signed(ttft.get('p50'))} / {_signed(ttft.get('p90'))} / "
        f"{_signed(ttft.get('p99'))} ms (p50 / p90 / p99), total {_signed(total.get('p50'))} / "
        f"{_signed(total.get('p99'))} ms (p50 / p99)"
    )


def _signed(value: object) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:+.1f}"
