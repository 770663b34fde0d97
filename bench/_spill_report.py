"""The spill benchmark's summaries, targets and table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench._harness import percentiles_ms
from bench._spill_client import (
    Outcome,
)
from bench._spill_setup import (
    HOSTED_PROFILE,
    LOCAL_DEPLOYMENT,
    LOCAL_PROFILE,
    LOCAL_SHARE_BELOW_PCT,
    LOCAL_SHARE_TARGET,
    MAX_ERROR_SAMPLES,
    NOISY_LAG_MS,
    OVERLOAD_FROM_PCT,
    OVERLOAD_SHARE_TARGET,
    TTFT_BUDGET_MS,
    WARMUP_PCT,
    Options,
    local_capacity_rps,
)


def summarize(pct: int, rate: float, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    n = len(outcomes)
    failed = [o for o in outcomes if o.error is not None]
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    deployments = Counter(o.deployment or f"(status {o.status})" for o in outcomes)
    routes = Counter(o.route or f"(status {o.status})" for o in outcomes)
    by_route: dict[str, list[float]] = {}
    for o in outcomes:
        if o.ttft_s is not None:
            by_route.setdefault(f"{o.route} -> {o.deployment}", []).append(o.ttft_s)
    return {
        "load_pct": pct,
        "rate_rps": rate,
        "requests": n,
        "ttft_ms": percentiles_ms(ttfts, missing=n - len(ttfts)),
        # Where the slow ones come from: TTFT per (route, serving deployment).
        "ttft_ms_by_route": {key: percentiles_ms(values) for key, values in by_route.items()},
        "local_share": deployments[LOCAL_DEPLOYMENT] / n if n else None,
        "deployments": dict(deployments.most_common()),
        "routes": dict(routes.most_common()),
        "errors": len(failed),
        "error_samples": [o.error for o in failed[:MAX_ERROR_SAMPLES]],
    }


# --- the report ----------------------------------------------------------------------------------


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    verdicts = []
    for step in result["steps"]:
        p99 = step["ttft_ms"].get("p99")
        verdicts.append(
            {
                "target": f"{step['load_pct']}%: TTFT p99 <= {TTFT_BUDGET_MS} ms",
                "value": p99,
                "pass": p99 is not None and p99 <= TTFT_BUDGET_MS,
            }
        )
    for step in result["steps"]:
        if step["load_pct"] < LOCAL_SHARE_BELOW_PCT:
            share = step["local_share"]
            verdicts.append(
                {
                    "target": f"{step['load_pct']}%: served locally >= {LOCAL_SHARE_TARGET:.0%}",
                    "value": share,
                    "pass": share is not None and share >= LOCAL_SHARE_TARGET,
                }
            )
    for step in result["steps"]:
        if step["load_pct"] >= OVERLOAD_FROM_PCT:
            share = step["local_share"]
            verdicts.append(
                {
                    "target": f"{step['load_pct']}%: served locally >= {OVERLOAD_SHARE_TARGET:.0%}",
                    "value": share,
                    "pass": share is not None and share >= OVERLOAD_SHARE_TARGET,
                }
            )
    return verdicts


def fmt_ms(value: float | None) -> str:
    return "no token" if value is None else f"{value:.0f}"


def fmt_share(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def short_routes(routes: dict[str, int], n: int) -> str:
    if not n:
        return "-"
    return ", ".join(f"{name} {count / n:.0%}" for name, count in routes.items())


def report(opts: Options, results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    capacity = local_capacity_rps()
    print()
    print(
        f"local: max_batch {LOCAL_PROFILE['max_batch']}, capacity {capacity:.1f} requests/s "
        f"(computed); hosted: ~{HOSTED_PROFILE['prefill_base_ms']} ms TTFT; TTFT budget "
        f"{TTFT_BUDGET_MS} ms (tailguard); {opts.step_s:g} s per step after {opts.warmup_s:g} s "
        f"at {WARMUP_PCT}%"
    )
    print()
    print(
        "| load | rate/s | mode | requests | TTFT p50 ms | TTFT p99 ms | served locally "
        "| local queue mean / max | local aborts | errors | routes |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for index, pct in enumerate(opts.steps_pct):
        for mode, result in results.items():
            step = result["steps"][index]
            ttft = step["ttft_ms"]
            waiting = step["local_waiting"]
            queue = (
                "-" if waiting["mean"] is None else f"{waiting['mean']:.1f} / {waiting['max']:.0f}"
            )
            print(
                f"| {pct}% | {step['rate_rps']:.1f} | {mode} | {step['requests']} "
                f"| {fmt_ms(ttft.get('p50'))} | {fmt_ms(ttft.get('p99'))} "
                f"| {fmt_share(step['local_share'])} | {queue} | {step['local_aborted']:.0f} "
                f"| {step['errors']} | {short_routes(step['routes'], step['requests'])} |"
            )
    for mode, result in results.items():
        for step in result["steps"]:
            if step["errors"]:
                print(
                    f"{mode} {step['load_pct']}%: {step['errors']} errors, e.g. "
                    f"{step['error_samples'][0][:160]}"
                )
        lag = result["send_lag_ms"].get("p99") or 0.0
        if lag > NOISY_LAG_MS:
            print(f"{mode}: warning: the client started requests late (p99 {lag:.1f} ms)")
    if "tailguard" not in results:
        return []
    verdicts = targets(results["tailguard"])
    print("\ntailguard targets:")
    for verdict in verdicts:
        value = verdict["value"]
        shown = fmt_share(value) if "locally" in verdict["target"] else f"{fmt_ms(value)} ms"
        print(f"  {'PASS' if verdict['pass'] else 'MISS'}  {verdict['target']}: {shown}")
    if "round_robin" in results:
        print("\nround_robin against the same targets (for comparison):")
        for verdict in targets(results["round_robin"]):
            value = verdict["value"]
            shown = fmt_share(value) if "locally" in verdict["target"] else f"{fmt_ms(value)} ms"
            print(f"  {'pass' if verdict['pass'] else 'miss'}  {verdict['target']}: {shown}")
    return verdicts
