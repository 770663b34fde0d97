"""Routing on traffic shaped like production, against a plain proxy in the same run.

Each scenario runs two simulated upstreams (`primary`, `fallback`; each a real HTTP server in a
process of its own, `bench/_upstream.py`) and `tailguard serve`, and sends the same open-loop
Poisson schedule of streaming chat completions to each configuration: the plain proxy (the
client's model on the primary, no budget, no fallback) and the routed one(s), each on fresh
processes. TTFT and total time run from a request's scheduled send (no coordinated omission);
a request that got no first token ranks above every answered one.

- `mixed`: 80% short (~100 tokens), 20% long (~16k tokens) prompts; primary 100 ms + 0.05
  ms/token prefill (long ~900 ms), fallback 60 ms + 0.02 ms/token (long ~380 ms); TTFT budget
  600 ms; `hedge` at caps 0.05 and (full mode) 0.25.
- `total`: model `capable` (TPOT 40 ms) with fallback `fast` (TPOT 10 ms), 400 output tokens,
  total budget 8 s, no priors, no warm-up; judged from 30 s after the start.
- `heavy`: both deployments stall 2-4 s on 8% of requests (else ~150 / ~300 ms); TTFT budget
  600 ms, `hedge` cap 0.10.
- `drift`: the primary (~150 ms, 1% at 0.7-1 s) turns slow (~900 ms) for a spell, then
  recovers; fallback ~350 ms; `hedge` cap 0.05.
- `outage`: the primary answers 500 to everything for a spell; fallback ~300 ms.
- `replicas`: two gateways sharing the latency store in Redis, the client alternating between
  them; the primary of `bench/tail.py` (8% stalls), `hedge` cap 0.05.

Per scenario one table: per prompt class TTFT p50/p99/p99.9, total p99, SLO attainment (the
share of requests the client saw answered in full within the budget), the share per deployment
(`x-tailguard-deployment`), extra upstream requests (received by the upstreams, counted by the
forwarded `x-request-id`, over client requests, minus one) and wasted prefill (prompt tokens of
the upstream streams the gateway closed before their end, over the prompt tokens the client
sent); then the per-period figures and PASS/MISS per target. Results go to
`bench/results/scenarios-<time>.json`. Exit status: 0 when every target passes, 1 when one
misses, 2 when the run failed.

    .venv/bin/python bench/scenarios.py --quick                 # every scenario, ~8 minutes
    .venv/bin/python bench/scenarios.py                         # full length, ~30 minutes
    .venv/bin/python bench/scenarios.py --quick --scenarios mixed,outage
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

if not __package__:  # `python bench/<script>.py`: `bench` is imported from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import redis

from bench._harness import (
    RESULTS_DIR,
    environment,
    parse_modes,
    pin_client,
    sigterm_as_interrupt,
    write_results,
)
from bench._scenario_run import Scenario, Timing, Variant, run_variant

PLAIN: Final = Variant("plain proxy")
Results = dict[str, dict[str, Any]]  # variant name -> figures (run_variant)


# --- targets -------------------------------------------------------------------------------------


def verdict(
    config: str, label: str, value: float | None, limit: float, unit: str, at_most: bool
) -> dict[str, Any]:
    """One target; a missing value (no request, or no first token) misses."""
    passed = value is not None and (value <= limit if at_most else value >= limit)
    return {
        "config": config,
        "target": label,
        "value": value,
        "limit": limit,
        "unit": unit,
        "pass": passed,
    }


def routed(results: Results) -> Iterator[tuple[str, dict[str, Any]]]:
    return ((name, r) for name, r in results.items() if name != PLAIN.name)


def never_worse(scenario: Scenario, timing: Timing, results: Results) -> list[dict[str, Any]]:
    """The property every scenario checks: no more misses and no higher p99.9 than plain."""
    plain = results[PLAIN.name]["overall"]
    metric = f"{scenario.judged_by}_ms"
    plain_tail = plain[metric].get("p99.9")
    out = []
    for name, result in routed(results):
        overall = result["overall"]
        out.append(
            verdict(name, "misses <= plain proxy's", overall["misses"], plain["misses"], "n", True)
        )
        tail = overall[metric].get("p99.9")
        found = verdict(
            name, f"{scenario.judged_by.upper()} p99.9 <= plain proxy's", tail, 0.0, "ms", True
        )
        # None is "no token": slower than any answer, and no slower than another None.
        found["limit"] = plain_tail
        found["pass"] = plain_tail is None or (tail is not None and tail <= plain_tail)
        out.append(found)
    return out


def mixed_targets(scenario: Scenario, timing: Timing, results: Results) -> list[dict[str, Any]]:
    plain = results[PLAIN.name]
    out = []
    for name, r in routed(results):
        short, long = r["classes"]["short"], r["classes"]["long"]
        long_elsewhere = (
            1.0 - long["primary_requests"] / long["requests"] if long["requests"] else 0
        )
        overall = r["overall"]
        out += [
            verdict(name, "short prompts on the primary >= 95%", short["share"].get("primary", 0), 0.95, "share", False),  # noqa: E501
            verdict(name, "long prompts started on the fallback >= 95%", long_elsewhere, 0.95, "share", False),  # noqa: E501
            verdict(name, "extra upstream requests <= 5%", overall["extra_upstream_fraction"], 0.05, "share", True),  # noqa: E501
            verdict(name, "wasted prefill <= 2% of prompt tokens", overall["wasted_fraction"], 0.02, "share", True),  # noqa: E501
            verdict(name, "attainment >= plain proxy's", overall["attainment"], plain["overall"]["attainment"], "share", False),  # noqa: E501
        ]  # fmt: skip
        for cls in ("short", "long"):
            value = r["classes"][cls]["attainment"]
            out.append(verdict(name, f"{cls} attainment >= 99%", value, 0.99, "share", False))
    return out + never_worse(scenario, timing, results)


def total_targets(scenario: Scenario, timing: Timing, results: Results) -> list[dict[str, Any]]:
    out = []
    for name, r in routed(results):
        value = r["periods"]["from 30 s"]["attainment"]
        out.append(verdict(name, "attainment from 30 s >= 95%", value, 0.95, "share", False))
    return out + never_worse(scenario, timing, results)


def heavy_targets(scenario: Scenario, timing: Timing, results: Results) -> list[dict[str, Any]]:
    budget = float(scenario.budget["ttft_ms"])
    out = []
    for name, r in routed(results):
        p99 = r["overall"]["ttft_ms"].get("p99")
        extra = r["overall"]["extra_upstream_fraction"]
        out.append(verdict(name, "TTFT p99 <= budget", p99, budget, "ms", True))
        out.append(verdict(name, "extra upstream requests <= 10%", extra, 0.10, "share", True))
    return out + never_worse(scenario, timing, results)


def within_budget_misses(result: dict[str, Any]) -> int:
    periods = result["periods"]
    return int(periods["before"]["misses"]) + int(periods["after"]["misses"])


def drift_targets(scenario: Scenario, timing: Timing, results: Results) -> list[dict[str, Any]]:
    plain = within_budget_misses(results[PLAIN.name])
    out = []
    for name, r in routed(results):
        out.append(
            verdict(
                name,
                "misses while the primary is within budget <= plain proxy's",
                within_budget_misses(r),
                plain,
                "n",
                True,
            )
        )
        out.append(
            verdict(name, "traffic back within 10 s of recovery", r["recovery_s"], 10.0, "s", True)
        )
    return out + never_worse(scenario, timing, results)


def outage_targets(scenario: Scenario, timing: Timing, results: Results) -> list[dict[str, Any]]:
    out = []
    for name, r in routed(results):
        errors = r["overall"]["errors"]
        out.append(
            verdict(name, "client errors while the fallback is healthy", errors, 0, "n", True)
        )
    return out + never_worse(scenario, timing, results)


def replicas_targets(scenario: Scenario, timing: Timing, results: Results) -> list[dict[str, Any]]:
    caps = {
        v.name: float((v.routing or {}).get("hedge_max_fraction", 0.05)) for v in scenario.variants
    }
    out = []
    for name, r in routed(results):
        limit = caps[name] + 0.01
        label = f"extra upstream requests <= cap + 1 point ({limit:.0%})"
        extra = r["overall"]["extra_upstream_fraction"]
        out.append(verdict(name, label, extra, limit, "share", True))
    return out + never_worse(scenario, timing, results)


# --- the scenarios -------------------------------------------------------------------------------


def hedge(cap: float, *, full_only: bool = False) -> Variant:
    return Variant(
        f"hedge {cap:g}", {"on_ttft_miss": "hedge", "hedge_max_fraction": cap}, full_only
    )


def flat(ms: float, **more: Any) -> dict[str, Any]:
    """A prefill of about `ms` with a slight lognormal jitter, as no real deployment is exact."""
    return {"prefill_base_ms": ms, "ttft_tail": "lognormal", "ttft_sigma": 0.1} | more


STALLS: Final = {"slow_rate": 0.08, "slow_ms": [2000, 4000]}
STEADY: Final = (Timing(5, 20), Timing(10, 120))  # quick, full

SCENARIOS: Final = (
    Scenario(
        name="mixed",
        title="mixed prompt sizes: 80% ~100 tokens, 20% ~16k tokens; TTFT budget 600 ms",
        rps=20,
        long_share=0.2,
        max_tokens=16,
        primary={"normal": {"prefill_base_ms": 100, "prefill_ms_per_token": 0.05,
                            "ttft_tail": "lognormal", "ttft_sigma": 0.05, "tokens_per_s": 100}},
        fallback={"normal": {"prefill_base_ms": 60, "prefill_ms_per_token": 0.02,
                             "ttft_tail": "lognormal", "ttft_sigma": 0.05, "tokens_per_s": 100}},
        budget={"ttft_ms": 600},
        variants=(PLAIN, hedge(0.05), hedge(0.25, full_only=True)),
        quick=STEADY[0],
        full=STEADY[1],
        targets=mixed_targets,
    ),
    Scenario(
        name="total",
        title="total budget 8 s, no priors: capable (TPOT 40 ms) -> fast (TPOT 10 ms), 400 tokens",
        rps=3,
        long_share=0.0,
        max_tokens=400,
        primary={"normal": {"prefill_base_ms": 100, "tokens_per_s": 25, "output_tokens": 400}},
        fallback={"normal": {"prefill_base_ms": 100, "tokens_per_s": 100, "output_tokens": 400}},
        budget={"total_ms": 8000},
        variants=(PLAIN, Variant("routed", {})),
        quick=Timing(0, 45, periods=(("from 30 s", 30, 45),)),
        full=Timing(0, 150, periods=(("from 30 s", 30, 150),)),
        client_model="capable",
        fallback_model="fast",
        targets=total_targets,
    ),
    Scenario(
        name="heavy",
        title="both deployments heavy-tailed (8% at 2-4 s, else ~150 / ~300 ms); TTFT budget 600",
        rps=20,
        long_share=0.0,
        max_tokens=16,
        primary={"normal": flat(150, tokens_per_s=100, **STALLS)},
        fallback={"normal": flat(300, tokens_per_s=100, **STALLS)},
        budget={"ttft_ms": 600},
        variants=(PLAIN, hedge(0.10)),
        quick=STEADY[0],
        full=STEADY[1],
        targets=heavy_targets,
    ),
    Scenario(
        name="drift",
        title="drift and recovery: primary ~150 ms turns ~900 ms, then recovers; fallback ~350 ms",
        rps=20,
        long_share=0.0,
        max_tokens=16,
        primary={
            "normal": flat(150, tokens_per_s=100, slow_rate=0.01, slow_ms=[700, 1000]),
            "slow": flat(900, tokens_per_s=100),
        },
        fallback={"normal": flat(350, tokens_per_s=100)},
        budget={"ttft_ms": 600},
        variants=(PLAIN, hedge(0.05)),
        quick=Timing(
            5, 30,
            events=((12, "primary", "slow"), (20, "primary", "normal")),
            periods=(("before", 5, 12), ("slow", 12, 20), ("after", 20, 35)),
            recovery_s=20,
        ),
        full=Timing(
            10, 120,
            events=((50, "primary", "slow"), (80, "primary", "normal")),
            periods=(("before", 10, 50), ("slow", 50, 80), ("after", 80, 130)),
            recovery_s=80,
        ),
        targets=drift_targets,
    ),
    Scenario(
        name="outage",
        title="outage: the primary answers 500 to everything for a spell; fallback ~300 ms",
        rps=20,
        long_share=0.0,
        max_tokens=16,
        primary={"normal": flat(150, tokens_per_s=100), "down": {"error_500_rate": 1.0}},
        fallback={"normal": flat(300, tokens_per_s=100)},
        budget={"ttft_ms": 600},
        variants=(PLAIN, hedge(0.05)),
        quick=Timing(
            5, 25,
            events=((10, "primary", "down"), (20, "primary", "normal")),
            periods=(("before", 5, 10), ("outage", 10, 20), ("after", 20, 30)),
        ),
        full=Timing(
            10, 120,
            events=((40, "primary", "down"), (70, "primary", "normal")),
            periods=(("before", 10, 40), ("outage", 40, 70), ("after", 70, 130)),
        ),
        targets=outage_targets,
    ),
    Scenario(
        name="replicas",
        title="two replicas sharing Redis; primary 8% at 2-4 s (else ~150 ms), fallback ~300 ms",
        rps=20,
        long_share=0.0,
        max_tokens=16,
        primary={"normal": flat(150, tokens_per_s=100, **STALLS)},
        fallback={"normal": {"prefill_base_ms": 300, "tokens_per_s": 100}},
        budget={"ttft_ms": 600},
        variants=(PLAIN, hedge(0.05)),
        quick=STEADY[0],
        full=STEADY[1],
        replicas=2,
        targets=replicas_targets,
    ),
)  # fmt: skip
BY_NAME: Final = {s.name: s for s in SCENARIOS}


# --- Redis for the replicas ----------------------------------------------------------------------


@contextmanager
def borrowed_redis() -> Iterator[str]:
    """An empty database of the local Redis (127.0.0.1:6379); its latency keys deleted after."""
    for db in range(15, 0, -1):  # the high ones are the least likely to be in use
        client = redis.Redis(port=6379, db=db)
        try:
            if client.dbsize() == 0:
                break
        finally:
            client.close()
    else:
        raise RuntimeError("the local Redis has no empty database to borrow")
    try:
        yield f"redis://127.0.0.1:6379/{db}"
    finally:
        client = redis.Redis(port=6379, db=db)
        try:
            keys = list(client.scan_iter(match="tg:*", count=1000))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


# --- the report ----------------------------------------------------------------------------------


def fmt_ms(value: float | None) -> str:
    return "no token" if value is None else f"{value:,.0f} ms"


def fmt_share(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value * 100:+.1f}%" if signed else f"{value * 100:.1f}%"


def fmt_value(value: float | None, unit: str) -> str:
    if unit == "ms":
        return fmt_ms(value)
    if value is None:
        return "none"
    if unit == "share":
        return fmt_share(value)
    return f"{value:g} s" if unit == "s" else f"{value:g}"


def share_text(share: dict[str, float]) -> str:
    return " / ".join(f"{name} {fmt_share(v)}" for name, v in share.items()) or "-"


def gateway_account(scenario: Scenario, result: dict[str, Any]) -> str:
    """`/admin/latency` for the client's model, summed over replicas that do not share a store:
    its window (60 s by default) may hold warm-up requests, and its prompt tokens are estimated
    from body bytes."""
    totals = {"client_requests": 0, "hedges": 0, "attempts": 0, "tokens": 0, "met": 0, "judged": 0}
    slo = scenario.judged_by
    views = result["gateway_view"]
    if result["config"]["latency"]["store"] == "redis":
        views = views[:1]  # every replica shows the same shared window
    for view in views:
        stats = view["models"].get(scenario.client_model) or {}
        totals["client_requests"] += stats.get("client_requests") or 0
        totals["hedges"] += stats.get("hedges") or 0
        wasted = stats.get("wasted") or {}
        totals["attempts"] += wasted.get("attempts") or 0
        totals["tokens"] += wasted.get("prompt_tokens") or 0
        judged = (stats.get("slo") or {}).get(slo) or {}
        totals["met"] += judged.get("met") or 0
        totals["judged"] += judged.get("judged") or 0
    clients, judged = totals["client_requests"], totals["judged"]
    rescues = totals["hedges"] / clients if clients else None
    return (
        f"{clients} client requests, rescues {fmt_share(rescues)}, "
        f"{totals['attempts']} wasted attempts ({totals['tokens']:,} prompt tokens), "
        f"{slo} attainment {fmt_share(totals['met'] / judged if judged else None)} "
        f"of {judged} judged"
    )


def report(scenario: Scenario, timing: Timing, results: Results) -> list[dict[str, Any]]:
    """Print the scenario's table and targets; return the verdicts."""
    print(f"\n### {scenario.name}: {scenario.title}\n")
    print(
        f"{scenario.rps:g} requests/s open loop, {timing.warmup_s:g} s warm-up + "
        f"{timing.duration_s:g} s measured; budget {scenario.budget}\n"
    )
    print(
        "| config | prompts | requests | TTFT p50 | p99 | p99.9 | total p99 | SLO attainment "
        "| served by | extra upstream requests | wasted prefill tokens | errors |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for name, r in results.items():
        rows = list(r["classes"].items())
        if len(rows) > 1:
            rows.append(("all", r["overall"]))
        for cls, f in rows:
            ttft = f["ttft_ms"]
            wasted = f"{f['wasted_prompt_tokens']:,} ({fmt_share(f['wasted_fraction'])})"
            if (after := f["wasted_prompt_tokens"] - f["wasted_before_first_token"]) > 0:
                wasted += f", {after:,} after the 1st token"
            print(
                f"| {name} | {cls} | {f['requests']} | {fmt_ms(ttft.get('p50'))} "
                f"| {fmt_ms(ttft.get('p99'))} | {fmt_ms(ttft.get('p99.9'))} "
                f"| {fmt_ms(f['total_ms'].get('p99'))} | {fmt_share(f['attainment'])} "
                f"| {share_text(f['share'])} "
                f"| {fmt_share(f['extra_upstream_fraction'], signed=True)} | {wasted} "
                f"| {f['errors']} |"
            )
    if timing.periods:
        print(
            "\n| config | period (s from start) | requests | misses | errors | TTFT p99 "
            "| served by |"
        )
        print("|---|---|---:|---:|---:|---:|---|")
        for name, r in results.items():
            for period, lo, hi in timing.periods:
                f = r["periods"][period]
                print(
                    f"| {name} | {period} ({lo:g}-{hi:g}) | {f['requests']} | {f['misses']} "
                    f"| {f['errors']} | {fmt_ms(f['ttft_ms'].get('p99'))} "
                    f"| {share_text(f['share'])} |"
                )
    if timing.recovery_s is not None:
        for name, r in results.items():
            back = r["recovery_s"]
            shown = "never in the run" if back is None else f"{back:g} s"
            print(
                f"{name}: traffic back on the primary (>= 80% per 1 s bin) {shown} after recovery"
            )
    if any((r["overall"]["extra_upstream_fraction"] or 0) < 0 for r in results.values()):
        print("(a negative extra share: requests the gateway answered without any upstream)")
    for name, r in results.items():
        print(f"{name}: the gateway's own account: {gateway_account(scenario, r)}")
    for name, r in results.items():
        if r["overall"]["errors"]:
            sample = r["overall"]["error_samples"][0][:160]
            print(f"{name}: {r['overall']['errors']} errors, e.g. {sample}")
        if (lag := r["send_lag_ms"].get("p99") or 0.0) > 10:
            print(f"{name}: warning: the client started requests late (p99 {lag:.1f} ms)")
    verdicts = scenario.targets(scenario, timing, results)
    print("\ntargets:")
    for v in verdicts:
        print(
            f"  {'PASS' if v['pass'] else 'MISS'}  {v['config']}: {v['target']}: "
            f"{fmt_value(v['value'], v['unit'])} (limit {fmt_value(v['limit'], v['unit'])})"
        )
    return verdicts


# --- entry point ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short runs (each scenario ~1 min)")
    parser.add_argument(
        "--scenarios", default=",".join(BY_NAME), help=f"comma-separated, of {', '.join(BY_NAME)}"
    )
    parser.add_argument(
        "--measure-s", type=float, default=None, help="override the measured seconds (smoke runs)"
    )
    parser.add_argument(
        "--warmup-s", type=float, default=None, help="override the warm-up seconds (smoke runs)"
    )
    parser.add_argument("--seed", type=int, default=1, help="arrivals and upstream draws (1)")
    parser.add_argument("--json", type=Path, default=None, help="results file")
    parser.add_argument("--keep-logs", action="store_true", help="keep the configs and logs")
    args = parser.parse_args(argv)
    args.scenarios = parse_modes(parser, args.scenarios, tuple(BY_NAME))
    if args.measure_s is not None and args.measure_s <= 0:
        parser.error("--measure-s must be > 0")
    if args.warmup_s is not None and args.warmup_s < 0:
        parser.error("--warmup-s must be >= 0")
    return args


def timing_of(scenario: Scenario, args: argparse.Namespace) -> Timing:
    timing = scenario.quick if args.quick else scenario.full
    if args.measure_s is None and args.warmup_s is None:
        return timing
    return Timing(
        timing.warmup_s if args.warmup_s is None else args.warmup_s,
        timing.duration_s if args.measure_s is None else args.measure_s,
        timing.events,
        timing.periods,
        timing.recovery_s,
    )


def run_scenario(
    scenario: Scenario, args: argparse.Namespace, pin: dict[str, list[str]], logs: Path
) -> tuple[Timing, Results]:
    timing = timing_of(scenario, args)
    results: Results = {}
    with borrowed_redis() if scenario.replicas > 1 else _no_redis() as redis_url:
        for variant in scenario.variants:
            if variant.full_only and args.quick:
                continue
            print(f"{scenario.name} / {variant.name}: {timing.end_s:g} s ...", flush=True)
            where = logs / f"{scenario.name}-{variant.name.replace(' ', '-')}"
            where.mkdir()
            result = run_variant(scenario, variant, timing, args.seed, pin, where, redis_url)
            results[variant.name] = result
            o = result["overall"]
            print(
                f"  {o['requests']} requests, {o['errors']} errors, attainment "
                f"{fmt_share(o['attainment'])}, {result['wall_s']:g} s",
                flush=True,
            )
    return timing, results


@contextmanager
def _no_redis() -> Iterator[None]:
    yield None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    pin, warning = pin_client()
    logs = Path(tempfile.mkdtemp(prefix="tailguard-scenarios-"))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    document: dict[str, Any] = {
        "benchmark": "scenarios",
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "options": {"quick": args.quick, "seed": args.seed, "pinned": warning is None},
        "environment": environment(),
        "scenarios": {},
    }
    verdicts: list[dict[str, Any]] = []
    try:
        with sigterm_as_interrupt():
            for name in args.scenarios:
                scenario = BY_NAME[name]
                timing, results = run_scenario(scenario, args, pin, logs)
                found = report(scenario, timing, results)
                verdicts += found
                document["scenarios"][name] = {
                    "title": scenario.title,
                    "budget": scenario.budget,
                    "rps": scenario.rps,
                    "timing": {"warmup_s": timing.warmup_s, "duration_s": timing.duration_s,
                               "events": timing.events, "periods": timing.periods},
                    "profiles": {"primary": scenario.primary, "fallback": scenario.fallback},
                    "results": results,
                    "targets": found,
                }  # fmt: skip
    except (KeyboardInterrupt, RuntimeError, OSError, redis.RedisError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"logs kept in {logs}", file=sys.stderr)
        return 2
    write_results(
        args.json or RESULTS_DIR / f"scenarios-{stamp}.json", document, logs, args.keep_logs
    )
    return 0 if all(v["pass"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
