"""The report of `bench/overhead.py --field`: the targets with PASS/MISS computed from the run,
the table of every path, the ratios and the notes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from bench._field import FieldOptions

LABELS: Final = {
    "direct": "direct",
    "tailguard": "Tailguard",
    "baseline": "Tailguard (baseline)",
    "litellm": "LiteLLM",
    "portkey": "Portkey",
    "nginx": "nginx",
    "reference": "bare proxy",
}
TTFT_P99_LIMIT_MS: Final = 2.0
LIGHT_P99_LIMIT_MS: Final = 2.0  # added p99 at the lightest open-loop rate
FLOOR_RATIO: Final = 2.5  # CPU per request, every feature on, against the bare aiohttp proxy
WORKER_SPREAD: Final = 0.2  # each worker's share of requests within 20% of 1/N
WORKER_CPU_RATIO: Final = 1.1


# --- targets and the report ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    label: str
    value: float | None  # None: not measured (the comparison was skipped)
    limit: float
    at_least: bool = False  # the value must be >= limit (else <=)
    unit: str = "x"
    detail: str = ""

    def verdict(self) -> str:
        if self.value is None:
            return "SKIP"
        ok = self.value >= self.limit if self.at_least else self.value <= self.limit
        return "PASS" if ok else "MISS"

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.label,
            "value": self.value,
            "limit": self.limit,
            "at_least": self.at_least,
            "verdict": self.verdict(),
            "detail": self.detail,
        }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def targets(
    opts: FieldOptions, summary: dict[str, dict[str, Any]], scaled: dict[str, Any] | None = None
) -> list[Target]:
    tg, ll, ref = summary["tailguard"], summary.get("litellm"), summary.get("reference")

    def versus(label: str, key: str, unit: str, limit: float, at_least: bool = False) -> Target:
        mine = tg.get(key)
        theirs = ll.get(key) if ll is not None else None
        if ll is None:
            detail = "LiteLLM not measured"
        else:
            detail = f"Tailguard {fmt(mine, 3)} vs LiteLLM {fmt(theirs, 3)} {unit}"
        return Target(label, ratio(mine, theirs), limit, at_least=at_least, detail=detail)

    def floor(label: str, key: str) -> Target:
        mine, bare = tg.get(key), ref.get(key) if ref is not None else None
        detail = (
            f"Tailguard {fmt(mine, 3)} vs the bare proxy {fmt(bare, 3)} ms"
            if ref is not None
            else "the bare proxy not measured (--reference)"
        )
        return Target(label, ratio(mine, bare), FLOOR_RATIO, detail=detail)

    found = [
        floor(
            f"CPU per non-streaming request, every feature on, <= {FLOOR_RATIO:g}x the bare proxy",
            "cpu_ms",
        ),
        floor(
            f"CPU per {opts.tokens}-chunk stream, every feature on, <= {FLOOR_RATIO:g}x the bare "
            "proxy",
            "stream_cpu_ms",
        ),
        floor(
            f"CPU per paced {opts.tokens}-chunk stream, every feature on, <= {FLOOR_RATIO:g}x the "
            "bare proxy",
            "paced_cpu_ms",
        ),
        versus("CPU per non-streaming request <= 1/10 of LiteLLM's", "cpu_ms", "ms", 0.1),
        versus(
            f"CPU per {opts.tokens}-chunk stream <= 1/10 of LiteLLM's", "stream_cpu_ms", "ms", 0.1
        ),
        versus("single-worker throughput >= 10x LiteLLM's", "throughput_rps", "req/s", 10.0, True),
    ]
    found += [
        versus(
            f"added p99 at {rate:g} RPS <= 1/10 of LiteLLM's",
            f"open{rate:g}_added_p99_ms",
            "ms",
            0.1,
        )
        for rate in opts.rates
    ]
    light = min(opts.rates)
    found.append(
        Target(
            f"added p99 at {light:g} RPS <= {LIGHT_P99_LIMIT_MS:g} ms",
            tg.get(f"open{light:g}_added_p99_ms"),
            LIGHT_P99_LIMIT_MS,
            unit="ms",
            detail="open loop, vs direct",
        )
    )
    found.append(
        Target(
            f"streaming TTFT overhead p99 <= {TTFT_P99_LIMIT_MS:g} ms",
            tg.get("ttft_added_p99_ms"),
            TTFT_P99_LIMIT_MS,
            unit="ms",
            detail=f"at {opts.stream_rate:g} streams/s, vs direct",
        )
    )
    if scaled is not None:
        found += worker_targets(opts, scaled)
    return found


def worker_targets(opts: FieldOptions, scaled: dict[str, Any]) -> list[Target]:
    """Even workers: each one's share of the requests, and CPU per request against one worker."""
    n = opts.workers
    one, many = scaled["1"], scaled[str(n)]
    served = [v["local_requests"] for v in many["workers_seen"]]
    total = sum(served)
    spread = None
    if len(served) == n and total:
        spread = max(abs(count * n / total - 1.0) for count in served)
    shares = ", ".join(f"{100 * c / total:.1f}%" for c in served) if total else "none"
    return [
        Target(
            f"each of {n} workers serves 1/{n} of the requests +-{WORKER_SPREAD:.0%}",
            spread,
            WORKER_SPREAD,
            detail=f"largest deviation from 1/{n}; shares {shares} ({len(served)} seen)",
        ),
        Target(
            f"CPU per request with {n} workers <= {WORKER_CPU_RATIO:g}x one worker's",
            ratio(many["cpu_ms"], one["cpu_ms"]),
            WORKER_CPU_RATIO,
            detail=f"{fmt(many['cpu_ms'], 3)} vs {fmt(one['cpu_ms'], 3)} ms, saturated",
        ),
    ]


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(opts: FieldOptions, summary: dict[str, dict[str, Any]], paths: list[str]) -> list[str]:
    conc = opts.concurrency
    rows: list[tuple[str, str, int]] = [
        (f"throughput, non-streaming, c={conc} (req/s)", "throughput_rps", 0),
        (f"throughput, zero-delay streams, c={conc} (streams/s)", "stream_throughput_rps", 0),
        ("proxy CPU per non-streaming request, saturated (ms)", "cpu_ms", 3),
        (f"proxy CPU per {opts.tokens}-chunk stream, saturated (ms)", "stream_cpu_ms", 3),
        (
            f"proxy CPU per paced stream ({opts.paced_tps:g} tok/s, c={conc}) (ms)",
            "paced_cpu_ms",
            3,
        ),
    ]
    for rate in opts.rates:
        rows += [
            (
                f"latency p50 / p99 at {rate:g} RPS (ms)",
                f"open{rate:g}_p50_ms|open{rate:g}_p99_ms",
                2,
            ),
            (
                f"added p50 / p99 at {rate:g} RPS (ms)",
                f"open{rate:g}_added_p50_ms|open{rate:g}_added_p99_ms",
                2,
            ),
            (f"proxy CPU per request at {rate:g} RPS (ms)", f"open{rate:g}_cpu_ms", 3),
        ]
    srate = f"{opts.stream_rate:g}"
    rows += [
        (f"TTFT p50 / p99 at {srate} streams/s (ms)", "ttft_p50_ms|ttft_p99_ms", 2),
        (
            f"added TTFT p50 / p99 at {srate} streams/s (ms)",
            "ttft_added_p50_ms|ttft_added_p99_ms",
            2,
        ),
        ("errors", "errors", 0),
    ]
    header = ["", *(LABELS[p] for p in paths)]
    lines = [header]
    for label, keys, digits in rows:
        cells = [label]
        for path in paths:
            names = keys.split("|")
            got = [summary[path].get(k) for k in names]
            shown = any(v is not None for v in got)
            cell = " / ".join(fmt(v, digits) for v in got) if shown else ""
            # A phase with failed requests: every one failed (no figure to show), or some.
            failures = summary[path].get("failures", {}).values()
            failed = next((f for f in failures if names[0] in f["figures"]), None)
            if failed is not None and failed["all_failed"]:
                cell = f"failed: {failed['text']}"
            elif failed is not None and cell:
                cell += f" ({failed['errors']} failed)"
            cells.append(cell)
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for line in lines:
        out.append(
            "  ".join(
                [line[0].ljust(widths[0])]
                + [c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True)]
            )
        )
    return out


def ratios(summary: dict[str, dict[str, Any]], opts: FieldOptions) -> list[str]:
    tg = summary["tailguard"]
    keys = [
        ("CPU/request", "cpu_ms"),
        ("CPU/stream", "stream_cpu_ms"),
        ("throughput", "throughput_rps"),
    ]
    keys += [(f"added p99 @{r:g}", f"open{r:g}_added_p99_ms") for r in opts.rates]
    keys.append(("added TTFT p99", "ttft_added_p99_ms"))
    out = []
    for other in ("baseline", "litellm", "portkey", "nginx", "reference"):
        if other not in summary:
            continue
        failed = {  # figures of phases in which every request failed, on either side
            key
            for side in (tg, summary[other])
            for f in side.get("failures", {}).values()
            if f["all_failed"]
            for key in f["figures"]
        }
        parts = [
            f"{name} {fmt(ratio(tg.get(key), summary[other].get(key)), 3)}"
            for name, key in keys
            if key not in failed
        ]
        skipped = [name for name, key in keys if key in failed]
        line = f"  Tailguard / {LABELS[other]}: " + ", ".join(parts)
        out.append(line + (f" (failed, not compared: {', '.join(skipped)})" if skipped else ""))
    return out


def overload_notes(opts: FieldOptions, summary: dict[str, dict[str, Any]]) -> list[str]:
    """Open-loop rates above what a proxy can serve at all: its latencies there are queueing."""
    notes = []
    for path, s in summary.items():
        capacity, streams = s.get("throughput_rps"), s.get("stream_throughput_rps")
        for rate in opts.rates:
            if capacity is not None and rate > capacity:
                notes.append(
                    f"{LABELS[path]} serves at most {capacity:.0f} req/s: at {rate:g} RPS it is "
                    "overloaded and its latency is mostly queueing"
                )
        if streams is not None and opts.stream_rate > streams:
            notes.append(
                f"{LABELS[path]} serves at most {streams:.0f} streams/s: at "
                f"{opts.stream_rate:g} streams/s its TTFT is mostly queueing"
            )
    return notes


def scaling_lines(opts: FieldOptions, found: dict[str, Any]) -> list[str]:
    many = found[str(opts.workers)]
    lines = [
        f"  1 worker : {found['1']['throughput_rps']:.0f} req/s "
        f"(CPU {fmt(found['1']['cpu_ms'], 3)} ms/req)",
        f"  {opts.workers} workers: {many['throughput_rps']:.0f} req/s "
        f"(CPU {fmt(many['cpu_ms'], 3)} ms/req), speedup {fmt(found['speedup'])}x",
    ]
    sent = many["requests_sent"]
    for i, view in enumerate(many["workers_seen"], 1):
        lines.append(
            f"  worker {i}: served {view['local_requests']} itself; /admin/latency counts "
            f"{view['shared_requests']} of the {sent} requests sent"
        )
    verdict = "verified" if found["sharing_verified"] else "NOT verified"
    lines.append(f"  statistics shared through Redis: {verdict}")
    return lines


def feature_lines(found: list[dict[str, Any]]) -> list[str]:
    lines, above = [], None
    for row in found:
        cpu = row["cpu_ms"]
        step = "" if above is None or cpu is None else f"  ({cpu - above:+.3f} ms)"
        lines.append(
            f"  {row['variant']:<42} {fmt(cpu, 3)} ms/req  {fmt(row['throughput_rps'], 0)} req/s"
            + step
        )
        above = cpu
    return lines
