"""The latency report of a running gateway, as Markdown and JSON (`tailguard report`).

Built from what the gateway already serves, fetched by the command: `GET /admin/latency` (the
rolling window's percentiles, per prompt-size band, SLO counts, the configured budgets, the
router's counters) and `GET /metrics` (the per-request stage histogram and the requests per
deployment). Per model: TTFT and total time p50/p95/p99 for short and long prompts, each stage
of a request against the budget, SLO attainment, and what the router did.

A prompt-size class merges several bands, whose raw samples the gateway does not expose. The
class's quantile is an upper bound computed from the bands' own quantiles and counts: the
smallest value at which, by each band's quantiles, at least that share of the class's requests is
known to have been at or under it. It is never lower than the truth (within the sketch's 2%), is
exact for a class of one band, and is at most the worst band's quantile. When a band's tail was
cut (censored observations), the class's quantile may be unknown; it is then given as null with
the value it is known to exceed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from gateway.latency.prompt_size import BANDS, band_label, band_of
from gateway.telemetry import semconv as sc

LONG_FROM_KIB: Final = 8  # by default a request body of 8 KiB or more is a long prompt
# Where a class may start: a band's lower edge (the bands double from 2 KiB to 128 KiB).
CLASS_EDGES_KIB: Final = tuple(1 << b for b in range(1, BANDS))
CLASSES: Final = ("short", "long")
QUANTILES: Final = ("p50", "p95", "p99")
_LEVELS: Final = (("p50", 0.50), ("p90", 0.90), ("p95", 0.95), ("p99", 0.99))
_WANTED: Final = {"p50": 0.50, "p95": 0.95, "p99": 0.99}
DASH: Final = "—"
_NO_FALLBACK: Final[dict[str, Any]] = dict(
    requests=0, served=0, share=None, routes={}, fallbacks={}
)
Quantiles = dict[str, Any]


# --- Prometheus text, the little of it the report reads ------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_samples(text: str, names: Iterable[str]) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus exposition whose name is one of
    `names`; malformed lines are skipped."""
    wanted = set(names)
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        found = _SAMPLE.match(line)
        if found is None or found.group(1) not in wanted:
            continue
        labels = {
            key: re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group()], value)
            for key, value in _LABEL.findall(found.group(2) or "")
        }
        try:
            out.append((found.group(1), labels, float(found.group(3))))
        except ValueError:
            continue
    return out


def _stage_histograms(text: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(model, stage) -> {"buckets": [(upper bound s, cumulative count)], "count": n}."""
    bucket, count = sc.STAGE_DURATION + "_bucket", sc.STAGE_DURATION + "_count"
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for name, labels, value in parse_samples(text, (bucket, count)):
        key = (labels.get("model", ""), labels.get("stage", ""))
        entry = out.setdefault(key, {"buckets": [], "count": 0})
        if name == count:
            entry["count"] = int(value)
        else:
            entry["buckets"].append((float(labels.get("le", "+Inf")), value))
    for entry in out.values():
        entry["buckets"].sort()
    return out


def histogram_quantile(
    buckets: Sequence[tuple[float, float]], q: float
) -> tuple[float | None, float | None]:
    """(value, beyond) in seconds of quantile `q` of cumulative buckets, interpolated linearly
    inside its bucket (as Prometheus' `histogram_quantile`): (None, None) with no observations,
    and (None, the last finite bound) when it falls in the `+Inf` bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None, None
    rank = q * buckets[-1][1]
    lower = previous = 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if upper == float("inf"):
                return None, lower
            inside = cumulative - previous
            share = (rank - previous) / inside if inside else 1.0
            return lower + (upper - lower) * share, None
        lower, previous = upper, cumulative
    return None, lower


# --- prompt-size classes -----------------------------------------------------------------------


def _value(stats: Mapping[str, Any], name: str) -> float:
    """A band's quantile in ms; infinity when it lies beyond every cut (null), or is absent."""
    value = stats.get(name)
    return float("inf") if value is None else float(value)


def _merge(parts: Sequence[tuple[int, Mapping[str, Any]]]) -> Quantiles:
    """Quantiles of the union of `parts`, (count, {p50, p90, p95, p99, beyond_ms}) each: the upper
    bound described in the module docstring, or null with the lower bound in `beyond_ms`."""
    parts = [(n, stats) for n, stats in parts if n > 0]
    total = sum(n for n, _ in parts)
    out: Quantiles = {
        "count": total,
        "censored": sum(int(s.get("censored") or 0) for _, s in parts),
    }
    beyond: dict[str, float] = {}
    if not total:
        return {**{q: None for q in QUANTILES}, **out, "beyond_ms": beyond}
    levels = [(n, [(level, _value(s, name)) for name, level in _LEVELS], s) for n, s in parts]
    points = sorted({v for _, values, _ in levels for _, v in values if v != float("inf")})
    cuts = sorted({float(s["beyond_ms"]) for _, _, s in levels if s.get("beyond_ms") is not None})
    for name, q in _WANTED.items():
        need = q * total - 1e-9
        upper = None
        for x in points:
            # At least this many requests are known to be <= x: each band's highest level <= x.
            known = sum(
                n * max((lv for lv, v in values if v <= x), default=0.0) for n, values, _ in levels
            )
            if known >= need:
                upper = x
                break
        out[name] = upper
        if upper is None:
            beyond[name] = _lower_bound(levels, sorted({*points, *cuts}), need)
    return {**out, "beyond_ms": beyond}


def _lower_bound(
    levels: Sequence[tuple[int, Sequence[tuple[float, float]], Mapping[str, Any]]],
    points: Sequence[float],
    need: float,
) -> float:
    """The first of `points` at which `need` requests can have been at or under it: the class's
    quantile is at least that. Each band has at most its lowest level whose value exceeds x (a
    value beyond every cut is known to exceed x only below the band's latest cut)."""
    found = 0.0
    for x in points:
        at_most = 0.0
        for n, values, stats in levels:
            cut = stats.get("beyond_ms")
            limit = float("inf") if cut is None else float(cut)
            above = [lv for lv, v in values if v > x and (v != float("inf") or x < limit)]
            at_most += n * min(above, default=1.0)
        if at_most >= need:
            return x
        found = x
    return found


def class_quantiles(bands: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """TTFT and total time of a class's bands, merged: the band labels, the request count and,
    for each metric, {p50, p95, p99, count, censored, beyond_ms}. `bands` are entries of
    `/admin/latency`'s `ttft_by_prompt`."""
    ttft = [(int(b.get("count") or 0), b) for b in bands]
    total = [
        (int((b.get("total_ms") or {}).get("count") or 0), b.get("total_ms") or {}) for b in bands
    ]
    return {
        "prompts": [str(b.get("prompt") or band_label(int(b.get("band", 0)))) for b in bands],
        "requests": sum(n for n, _ in ttft),
        "ttft_ms": _merge(ttft),
        "total_ms": _merge(total),
    }


def _window_quantiles(stats: Mapping[str, Any] | None) -> Quantiles:
    """A metric of `/admin/latency` in the report's shape; a null quantile is beyond its cut."""
    stats = stats or {}
    out: Quantiles = {q: stats.get(q) for q in QUANTILES}
    out["count"] = int(stats.get("count") or 0)
    out["censored"] = int(stats.get("censored") or 0)
    cut = stats.get("beyond_ms")
    out["beyond_ms"] = {q: cut for q in QUANTILES if out[q] is None and cut is not None}
    return out


# --- the report --------------------------------------------------------------------------------


def build_report(
    latency: Mapping[str, Any],
    metrics: str,
    *,
    source: str,
    models: Sequence[str] | None = None,
    long_from_kib: int = LONG_FROM_KIB,
    now: float | None = None,
) -> dict[str, Any]:
    """The report as a JSON-ready dict, from the body of `/admin/latency` and the text of
    `/metrics`; every configured model, or those named in `models` (in config order). Prompts
    of `long_from_kib` KiB or more (one of `CLASS_EDGES_KIB`; ValueError otherwise) are long."""
    if long_from_kib not in CLASS_EDGES_KIB:
        raise ValueError(f"long_from_kib must be one of {CLASS_EDGES_KIB}, not {long_from_kib}")
    long_band = band_of(long_from_kib << 10)
    every = [m for m in (latency.get("config") or {}).get("models") or [] if "name" in m]
    by_name = {m["name"]: m for m in every}
    specs = every if models is None else [m for m in every if m["name"] in models]
    stages = _stage_histograms(metrics)
    served: dict[str, dict[str, int]] = {}
    for _, labels, value in parse_samples(metrics, (sc.REQUESTS + "_total",)):
        by = served.setdefault(labels.get("model", ""), {})
        deployment = labels.get("deployment") or "none"
        by[deployment] = by.get(deployment, 0) + int(value)
    counters = latency.get("counters") or {}
    return {
        "source": source,
        "generated_at": round(time.time() if now is None else now, 3),
        "window_s": latency.get("window_s"),
        "latency_source": latency.get("source"),
        "snapshot_age_s": latency.get("age_s"),
        "classes": {"short": f"<{long_from_kib} KiB", "long": f">={long_from_kib} KiB"},
        "models": {
            spec["name"]: _model(
                spec,
                (latency.get("models") or {}).get(spec["name"]) or {},
                latency.get("deployments") or {},
                stages,
                counters,
                served.get(spec["name"], {}),
                long_band,
                by_name,
            )
            for spec in specs
        },
    }


def _model(
    spec: Mapping[str, Any],
    stats: Mapping[str, Any],
    deployments: Mapping[str, Any],
    stages: Mapping[tuple[str, str], Mapping[str, Any]],
    counters: Mapping[str, Any],
    served: Mapping[str, int],
    long_band: int,
    specs: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    name = spec["name"]
    given = spec.get("budget") or {}
    budget = {key: given.get(key) for key in ("ttft_ms", "total_ms", "tpot_ms")}
    bands = sorted(stats.get("ttft_by_prompt") or [], key=lambda b: int(b.get("band", 0)))
    latency = {
        "short": class_quantiles([b for b in bands if int(b.get("band", 0)) < long_band]),
        "long": class_quantiles([b for b in bands if int(b.get("band", 0)) >= long_band]),
        "all": {
            "prompts": ["all"],
            "requests": int((stats.get("ttft_ms") or {}).get("count") or 0),
            "ttft_ms": _window_quantiles(stats.get("ttft_ms")),
            "total_ms": _window_quantiles(stats.get("total_ms")),
        },
    }
    own = list(spec.get("deployments") or [])
    fallbacks = list(spec.get("fallbacks") or [])
    # The router's candidates: the model's deployments, then its fallbacks'.
    candidates: dict[str, str | None] = dict.fromkeys(own)
    for fallback in fallbacks:
        for deployment in (specs.get(fallback) or {}).get("deployments") or []:
            candidates.setdefault(deployment, fallback)
    cooldowns = counters.get("cooldowns") or {}
    return {
        "budget": budget,
        "deployments": own,
        "fallbacks": fallbacks,
        "on_ttft_miss": spec.get("on_ttft_miss"),
        "hedge_max_fraction": spec.get("hedge_max_fraction"),
        "latency": latency,
        "stages": [_stage(stages.get((name, stage)), stage, budget) for stage in sc.STAGES],
        "slo": {
            slo: _slo(stats, slo, budget.get(f"{slo}_ms")) for slo in ("ttft", "total", "tpot")
        },
        # What fallback models served of its requests since start, and by which route.
        "fallback_served": {**_NO_FALLBACK, **((counters.get("fallback") or {}).get(name) or {})},
        "router": {
            "routes": dict((counters.get("routes") or {}).get(name) or {}),
            "served_by": dict(sorted(served.items())),
            "hedges": dict((counters.get("hedges") or {}).get(name) or {}),
            "rescues": stats.get("hedges"),
            "client_requests": stats.get("client_requests"),
            "extra_load": stats.get("extra_load"),
            "wasted": dict(stats.get("wasted") or {}),
            "cooldowns": {d: cooldowns[d] for d in candidates if d in cooldowns},
        },
        "per_deployment": [
            _deployment(d, via, deployments.get(d) or {}) for d, via in candidates.items()
        ],
    }


def _stage_budget(stage: str, budget: Mapping[str, Any]) -> float | None:
    ttft, total = budget.get("ttft_ms"), budget.get("total_ms")
    if stage == "ttft":
        return ttft
    if stage == "total":
        return total
    if stage == "decode" and ttft is not None and total is not None:
        return float(total - ttft)  # what the total budget leaves after the first token
    return None


def _stage(
    found: Mapping[str, Any] | None, stage: str, budget: Mapping[str, Any]
) -> dict[str, Any]:
    row: dict[str, Any] = {"stage": stage, "count": 0, "beyond_ms": {}}
    buckets = found["buckets"] if found else []
    for name, q in (("p50", 0.50), ("p95", 0.95)):
        value, beyond = histogram_quantile(buckets, q)
        row[f"{name}_ms"] = None if value is None else round(value * 1000, 3)
        if beyond is not None:
            row["beyond_ms"][name] = round(beyond * 1000, 3)
    row["count"] = int(found["count"]) if found else 0
    limit = row["budget_ms"] = _stage_budget(stage, budget)
    p95, over = row["p95_ms"], row["beyond_ms"].get("p95")
    row["within_budget"] = None
    if limit is not None and p95 is not None:
        row["within_budget"] = p95 <= limit
    elif limit is not None and over is not None and over >= limit:
        row["within_budget"] = False
    return row


def _slo(stats: Mapping[str, Any], slo: str, budget_ms: float | None) -> dict[str, Any]:
    counts = (stats.get("slo") or {}).get(slo) or {}
    p99 = _window_quantiles(stats.get(f"{slo}_ms"))
    within = None
    if budget_ms is not None:
        if p99["p99"] is not None:
            within = p99["p99"] <= budget_ms
        elif p99["beyond_ms"].get("p99", -1.0) >= budget_ms:
            within = False
    return {
        "budget_ms": budget_ms,
        "met": counts.get("met"),
        "judged": counts.get("judged"),
        "attainment": counts.get("attainment"),
        "p99_ms": p99["p99"],
        "p99_beyond_ms": p99["beyond_ms"].get("p99"),
        "p99_within_budget": within,
    }


def _deployment(deployment: str, via: str | None, stats: Mapping[str, Any]) -> dict[str, Any]:
    """One candidate deployment's window (all its traffic, not only this model's); `via`: the
    fallback model it belongs to, None for the model's own."""
    slo = stats.get("slo") or {}
    return {
        "deployment": deployment,
        "fallback": via,
        "requests": stats.get("requests"),
        "errors": stats.get("errors"),
        "ttft_ms": _window_quantiles(stats.get("ttft_ms")),
        "total_ms": _window_quantiles(stats.get("total_ms")),
        "attainment": {k: (slo.get(k) or {}).get("attainment") for k in ("ttft", "total")},
        "cooldown_until": stats.get("cooldown_until"),
    }


# --- Markdown ----------------------------------------------------------------------------------


def _ms(value: float | None, beyond: float | None = None) -> str:
    """A time in ms for a table cell: "—" unknown, "> N ms" known only to exceed N."""
    if value is None:
        return DASH if beyond is None else f"> {_number(beyond)} ms"
    return _number(value)


def _number(value: float) -> str:
    if value < 1:
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def _count(value: Any) -> str:
    return DASH if value is None else f"{int(value):,}"


def _share(value: Any) -> str:
    return DASH if value is None else f"{float(value) * 100:.1f}%"


def _yes(value: bool | None) -> str:
    return DASH if value is None else ("yes" if value else "no")


def _budget(value: float | None) -> str:
    return DASH if value is None else f"{_number(float(value))} ms"


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], left: int = 1) -> list[str]:
    align = ["---"] * left + ["--:"] * (len(header) - left)
    return [_row(header), _row(align), *(_row(r) for r in rows), ""]


def _quantile_cells(stats: Mapping[str, Any]) -> list[str]:
    beyond = stats.get("beyond_ms") or {}
    return [_ms(stats.get(q), beyond.get(q)) for q in QUANTILES]


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown, one section per model."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(report.get("generated_at") or 0))
    window = report.get("window_s")
    classes = report.get("classes") or {}
    age = report.get("snapshot_age_s")
    store = report.get("latency_source") or DASH
    lines = [
        "# Latency report",
        "",
        f"Gateway {report.get('source')}, {when}. Times in ms.",
        "",
        f"- Latencies by prompt size, SLO attainment, extra load and waste: the last "
        f"{_count(window)} s (latency store {store}, snapshot "
        f"{DASH if age is None else f'{float(age):.1f}'} s old), timed per upstream attempt.",
        "- Stages, routes and hedges: since this gateway process started, timed from the "
        "request's arrival.",
        f"- Short prompts: request bodies {classes.get('short', DASH)}; long: "
        f"{classes.get('long', DASH)}. A class's quantile is an upper bound merged from its "
        "prompt-size bands.",
        f'- "{DASH}": no data. "> N ms": known only to exceed N ms (the slower observations '
        "were cut).",
        "",
    ]
    for name, model in (report.get("models") or {}).items():
        lines += _model_markdown(name, model)
    return "\n".join(lines).rstrip() + "\n"


def _model_markdown(name: str, model: Mapping[str, Any]) -> list[str]:
    budget = model["budget"]
    limits = [
        f"{label} {_budget(budget.get(key))}"
        for label, key in (("TTFT", "ttft_ms"), ("total", "total_ms"), ("TPOT", "tpot_ms"))
        if budget.get(key) is not None
    ]
    cap = model.get("hedge_max_fraction")
    lines = [
        f"## {name}",
        "",
        f"Budget: {', '.join(limits) or 'none'}. Deployments: "
        f"{', '.join(f'`{d}`' for d in model['deployments']) or DASH}; fallbacks: "
        f"{', '.join(f'`{f}`' for f in model['fallbacks']) or 'none'}; on a TTFT miss: "
        f"{model.get('on_ttft_miss') or DASH} (rescue cap {_share(cap)}).",
        "",
        "### TTFT and total by prompt size",
        "",
    ]
    rows = []
    for klass in (*CLASSES, "all"):
        row = model["latency"][klass]
        prompts = ", ".join(row["prompts"]) or DASH
        rows.append(
            [
                klass,
                prompts,
                _count(row["requests"]),
                *_quantile_cells(row["ttft_ms"]),
                *_quantile_cells(row["total_ms"]),
            ]
        )
    header = ["class", "prompts", "requests", "TTFT p50", "TTFT p95", "TTFT p99"]
    lines += _table([*header, "total p50", "total p95", "total p99"], rows, left=2)
    lines += ["### Stages against the budget", ""]
    rows = []
    for stage in model["stages"]:
        beyond = stage["beyond_ms"]
        rows.append(
            [
                stage["stage"],
                _ms(stage["p50_ms"], beyond.get("p50")),
                _ms(stage["p95_ms"], beyond.get("p95")),
                _budget(stage["budget_ms"]),
                _yes(stage["within_budget"]),
                _count(stage["count"]),
            ]
        )
    lines += _table(["stage", "p50", "p95", "budget", "p95 within budget", "requests"], rows)
    lines += [
        "Overhead is the gateway's own time (before the first attempt, and relaying the first "
        "token); queue the wait for a bulk slot; connect until the winning attempt's response "
        "headers; TTFT until the first token reached the client (streams); decode from the "
        "first token to the last; total until the last byte. Stage quantiles are interpolated "
        "in the histogram's buckets; the decode budget is what the total budget leaves after "
        "the TTFT budget.",
        "",
        "### SLO attainment",
        "",
    ]
    rows = []
    for slo, label in (("ttft", "TTFT"), ("total", "total"), ("tpot", "TPOT")):
        entry = model["slo"][slo]
        rows.append(
            [
                label,
                _budget(entry["budget_ms"]),
                _share(entry["attainment"]),
                _count(entry["met"]),
                _count(entry["judged"]),
                _ms(entry["p99_ms"], entry["p99_beyond_ms"]),
                _yes(entry["p99_within_budget"]),
            ]
        )
    header = ["SLO", "budget", "attainment", "met", "judged", "p99", "p99 within budget"]
    lines += _table(header, rows)
    lines += _fallback_markdown(model["fallback_served"])
    lines += _router_markdown(model["router"], cap)
    lines += [
        "### Deployments",
        "",
        "The candidates in the router's order, over the window, with all their traffic.",
        "",
    ]
    rows = []
    for entry in model["per_deployment"]:
        ttft, total = entry["ttft_ms"], entry["total_ms"]
        rows.append(
            [
                f"`{entry['deployment']}`"
                + (f" (fallback `{entry['fallback']}`)" if entry["fallback"] else ""),
                _count(entry["requests"]),
                _count(entry["errors"]),
                _ms(ttft["p50"], ttft["beyond_ms"].get("p50")),
                _ms(ttft["p99"], ttft["beyond_ms"].get("p99")),
                _ms(total["p99"], total["beyond_ms"].get("p99")),
                _share(entry["attainment"]["ttft"]),
                _share(entry["attainment"]["total"]),
                "open" if entry["cooldown_until"] else "closed",
            ]
        )
    header = ["deployment", "attempts", "errors", "TTFT p50", "TTFT p99", "total p99"]
    lines += _table([*header, "TTFT attainment", "total attainment", "breaker"], rows)
    return lines


def _fallback_markdown(fallback: Mapping[str, Any]) -> list[str]:
    routes = ", ".join(f"{route} {_count(n)}" for route, n in sorted(fallback["routes"].items()))
    models = ", ".join(f"`{name}` {_count(n)}" for name, n in fallback["fallbacks"].items())
    return [
        f"Served by a fallback model: {_share(fallback['share'])} ({_count(fallback['served'])} "
        f"of {_count(fallback['requests'])} requests since start)"
        + (f"; by route: {routes}; by fallback: {models}" if routes else "")
        + ".",
        "",
    ]


def _router_markdown(router: Mapping[str, Any], cap: Any) -> list[str]:
    lines = ["### What the router did", ""]
    routes = router["routes"]
    answered = sum(routes.values())
    rows = [
        [route, _count(n), _share(n / answered if answered else None)]
        for route, n in sorted(routes.items(), key=lambda item: -item[1])
    ]
    lines += _table(["route", "requests", "share"], rows or [[DASH, DASH, DASH]])
    served = router["served_by"]
    total = sum(served.values())
    rows = [[f"`{d}`", _count(n), _share(n / total if total else None)] for d, n in served.items()]
    lines += _table(["served by", "requests", "share"], rows or [[DASH, DASH, DASH]])
    hedges = router["hedges"]
    wasted = router["wasted"]
    cooldowns = router["cooldowns"]
    lines += [
        f"Hedges: {_count(hedges.get('started', 0))} started, {_count(hedges.get('won', 0))} "
        f"won, {_count(hedges.get('denied', 0))} denied over the cap. Latency rescues (hedges "
        f"and deadline failovers) in the window: {_count(router['rescues'])} for "
        f"{_count(router['client_requests'])} client requests, an extra load of "
        f"{_share(router['extra_load'])} (cap {_share(cap)}). Wasted: "
        f"{_count(wasted.get('attempts'))} attempts started and thrown away, "
        f"{_count(wasted.get('prompt_tokens'))} prompt tokens. Breaker openings: "
        + (", ".join(f"`{d}` {n}" for d, n in cooldowns.items()) or "none")
        + ".",
        "",
    ]
    return lines
