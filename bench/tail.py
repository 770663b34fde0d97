"""Tail latency under a heavy-tailed primary: TTFT with no help, with failover and with hedging.

Scenario. Two simulated upstreams, each a real HTTP server in a process of its own
(`bench/_upstream.py`, with one behaviour): the primary answers its first token in ~150 ms,
except that 8% of its requests stall 2-4 s first; the fallback answers in a flat ~300 ms. The
gateway (`tailguard serve`, a real uvicorn process) serves one model `chat` on the primary
(through a provider of type `openai`, so a cut attempt closes a real HTTP stream), with a TTFT
budget of 600 ms and `chat-fallback` (the fallback upstream) as its fallback. The same run is
repeated once per `on_ttft_miss` mode, each with a fresh gateway and fresh upstreams:

- `none`: no routing (no budget, no fallback): a plain proxy, the client waits for the primary;
- `failover`: an attempt that misses its first-token deadline is cut and the next one starts;
- `hedge`: a second attempt races the first, at most `hedge_max_fraction` (0.10) of requests.

Load. Open loop: streaming chat completions (`max_tokens` 16) with Poisson arrivals at `--rps`,
whatever happened to the earlier ones, for `--warmup` seconds (not reported: routing needs
`latency.min_samples` first) and then `--duration` measured seconds. TTFT runs from a request's
scheduled send time to the first SSE event carrying content, so client-side queueing shows up
in it (no coordinated omission). Percentiles are nearest rank (k = ceil(q n)).

Reported per mode: TTFT p50/p99/p99.9; errors (non-200, an error event, or a stream without
`[DONE]`; a request that got no first token ranks in the TTFT percentiles above every answered
one, so a mode cannot look fast by failing its slow requests); the share served by the primary
(`x-tailguard-deployment`); the routes taken (`x-tailguard-route`); and the extra upstream
requests: requests received by both upstreams for the measured requests, divided by the measured
requests, minus one. The upstreams count what they receive themselves, by the `x-request-id` the
gateway forwards. The targets for `hedge` are printed with PASS/MISS; the results go to
`bench/results/tail-<timestamp>.json`. Exit status: 0 when every target passes (or `hedge` did
not run), 1 when one misses, 2 when the run failed.

    .venv/bin/python bench/tail.py            # ~7 minutes: 3 modes x (10 s warm-up + 120 s)
    .venv/bin/python bench/tail.py --quick    # ~2 minutes: 5 s warm-up + 30 s per mode
    .venv/bin/python bench/tail.py --modes failover,hedge --rps 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

if not __package__:  # `python bench/<script>.py`: `bench` is imported from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import aiohttp

from bench._harness import (
    RESULTS_DIR,
    ROOT,
    environment,
    parse_modes,
    pin_client,
    post_stream,
    sigterm_as_interrupt,
    stream_chat_body,
    write_results,
)
from bench._harness import percentiles_ms as _percentiles_ms
from bench._upstream import REQUEST_ID_PREFIX, STATS_PATH, start_upstream
from gateway.tools.load import poisson_arrivals, run_async
from gateway.tools.stack import Stack, free_port, start_gateway
from gateway.tools.stream import StreamReader

MODES: Final = ("none", "failover", "hedge")
TAIL_QUANTILES: Final = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99), ("p99.9", 0.999))

MODEL: Final = "chat"
FALLBACK_MODEL: Final = "chat-fallback"
PRIMARY_DEPLOYMENT: Final = "primary/chat-primary"  # <provider>/<model>, as the header names it
FALLBACK_DEPLOYMENT: Final = "fallback/chat-fallback"
TTFT_BUDGET_MS: Final = 600
TOTAL_BUDGET_MS: Final = 30_000
# The design notes: an 8% stall share needs a hedge cap of about 0.10.
HEDGE_MAX_FRACTION: Final = 0.10
MAX_TOKENS: Final = 16
PROMPT: Final = "Explain in one sentence why tail latency matters for interactive LLM applications."

# The slight lognormal jitter keeps the primary's fast path from being one exact value, which no
# real deployment is; p99 of the fast path stays under ~200 ms.
PRIMARY_PROFILE: Final[dict[str, Any]] = {
    "prefill_base_ms": 150,
    "ttft_tail": "lognormal",
    "ttft_sigma": 0.1,
    "slow_rate": 0.08,
    "slow_ms": [2000, 4000],
    "tokens_per_s": 100,
    "output_tokens": MAX_TOKENS,
}
FALLBACK_PROFILE: Final[dict[str, Any]] = {
    "prefill_base_ms": 300,
    "tokens_per_s": 100,
    "output_tokens": MAX_TOKENS,
}

FALLBACK_PRIOR_TTFT_MS: Final = 330  # what an operator would write for a ~300 ms fallback
REQUEST_TIMEOUT_S: Final = 60.0  # well past the total budget: a hung request shows as an error
# uvicorn closes idle connections after 5 s; reusing one as it closes fails for no reason of ours.
KEEPALIVE_S: Final = 2.0
# Above this the client's own timer lag, not the gateway, moves the percentiles.
NOISY_LAG_MS: Final = 10.0
MAX_ERROR_SAMPLES: Final = 5


# --- processes -----------------------------------------------------------------------------------


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as response:
        data: dict[str, Any] = json.loads(response.read())
    return data


def received(stats: dict[str, Any], phase: str | None = None) -> int:
    """Chat requests an upstream counted (`bench/_upstream.py`'s rows), in `phase` or in all."""
    return sum(int(r["requests"]) for r in stats["rows"] if phase is None or r["phase"] == phase)


def gateway_config(mode: str, port: int, primary_port: int, fallback_port: int) -> dict[str, Any]:
    primary_provider, primary_model = PRIMARY_DEPLOYMENT.split("/")
    fallback_provider, fallback_model = FALLBACK_DEPLOYMENT.split("/")
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "latency": {"store": "memory"},
        "providers": {
            primary_provider: {"type": "openai", "base_url": f"http://127.0.0.1:{primary_port}/v1"},
            fallback_provider: {
                "type": "openai",
                "base_url": f"http://127.0.0.1:{fallback_port}/v1",
            },
        },
        "models": [
            {
                "name": MODEL,
                "deployments": [{"provider": primary_provider, "model": primary_model}],
                # No routing: a plain proxy, without a budget to plan for or a fallback.
                **(
                    {}
                    if mode == "none"
                    else {
                        "budget": {"ttft_ms": TTFT_BUDGET_MS, "total_ms": TOTAL_BUDGET_MS},
                        "fallbacks": [FALLBACK_MODEL],
                        "on_ttft_miss": mode,
                        "hedge_max_fraction": HEDGE_MAX_FRACTION,
                    }
                ),
            },
            {
                "name": FALLBACK_MODEL,
                # The fallback only sees the requests it rescues, so its own statistics take a
                # while to be trusted; until then its deadline is planned on this prior.
                "deployments": [
                    {
                        "provider": fallback_provider,
                        "model": fallback_model,
                        "prior": {"ttft_ms": FALLBACK_PRIOR_TTFT_MS},
                    }
                ],
            },
        ],
    }


# --- the client ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """One client request, as the client saw it."""

    phase: str  # warmup | measure
    lag_s: float  # how late the request actually started after its scheduled time
    ttft_s: float | None = None  # from the scheduled time to the first content event
    total_s: float | None = None
    status: int = 0
    deployment: str | None = None
    route: str | None = None
    attempts: int | None = None
    error: str | None = None


async def one_request(
    session: aiohttp.ClientSession, url: str, body: bytes, request_id: str, phase: str, due: float
) -> Outcome:
    started = time.perf_counter()
    # From the scheduled time, so a late start counts against the request; from the actual start
    # only when the timer fired early.
    origin = min(due, started)
    outcome = Outcome(phase=phase, lag_s=started - due)
    headers = {"content-type": "application/json", "x-request-id": request_id}
    reader = StreamReader()
    outcome.status, answered, outcome.error, broken = await post_stream(
        session, url, body, headers, reader
    )
    if not broken:
        outcome.total_s = time.perf_counter() - origin
    outcome.deployment = answered.get("x-tailguard-deployment")
    outcome.route = answered.get("x-tailguard-route")
    with contextlib.suppress(ValueError):
        outcome.attempts = int(answered.get("x-tailguard-attempts", ""))
    if reader.t_first is not None:
        outcome.ttft_s = reader.t_first - origin
    return outcome


async def fetch_stats(session: aiohttp.ClientSession, urls: dict[str, str]) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for name, url in urls.items():
        async with session.get(url) as response:
            stats[name] = await response.json()
    return stats


async def drive(
    gateway_url: str,
    stats_urls: dict[str, str],
    arrivals: Sequence[float],
    warmup_s: float,
) -> tuple[list[Outcome], dict[str, Any]]:
    """Send every request at its arrival time; return the outcomes and the upstream counters
    read when the warm-up ended (used only if the gateway does not forward `x-request-id`)."""
    url = gateway_url + "/v1/chat/completions"
    body = stream_chat_body(MODEL, MAX_TOKENS, PROMPT)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    boundary: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks: list[asyncio.Task[Outcome]] = []
        t0 = time.perf_counter() + 0.05
        snapshot_due = t0 + warmup_s
        for index, offset in enumerate(arrivals):
            due = t0 + offset
            if not boundary and offset >= warmup_s:
                if (delay := snapshot_due - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)
                boundary = await fetch_stats(session, stats_urls)
            if (delay := due - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            phase = "measure" if offset >= warmup_s else "warmup"
            # <prefix><phase><class>: one short prompt for every request
            request_id = f"{REQUEST_ID_PREFIX}{phase[0]}s-{index:06d}"
            tasks.append(
                asyncio.create_task(one_request(session, url, body, request_id, phase, due))
            )
        outcomes = list(await asyncio.gather(*tasks))
    return outcomes, boundary


# --- one mode ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Options:
    modes: list[str]
    rps: float
    duration_s: float
    warmup_s: float
    seed: int
    json_path: Path
    keep_logs: bool
    stall_ms: tuple[int, int] = (2000, 4000)

    @property
    def primary_profile(self) -> dict[str, Any]:
        return {**PRIMARY_PROFILE, "slow_ms": list(self.stall_ms)}


def percentiles_ms(values_s: Sequence[float], missing: int = 0) -> dict[str, float | None]:
    """count, mean, p50/p90/p99/p99.9 (nearest rank) and max, in ms (see `_harness`)."""
    return _percentiles_ms(values_s, missing, TAIL_QUANTILES, with_mean=True)


def run_mode(mode: str, opts: Options, pin: dict[str, list[str]], logs: Path) -> dict[str, Any]:
    stack = Stack(logs=logs, pin=pin, cwd=ROOT)  # the upstreams run as `-m bench._upstream`
    try:
        ports = {"primary": free_port(), "fallback": free_port(), "gateway": free_port()}
        # The same seeds in every mode: the primary draws its stalls in the same order, so the
        # modes differ in how the gateway reacts, not in the luck of the draw.
        primary = {"normal": opts.primary_profile}
        start_upstream(stack, "primary", ports["primary"], primary, opts.seed)
        fallback = {"normal": FALLBACK_PROFILE}
        start_upstream(stack, "fallback", ports["fallback"], fallback, opts.seed + 1)
        config = gateway_config(mode, ports["gateway"], ports["primary"], ports["fallback"])
        start_gateway(stack, config, ports["gateway"])
        stats_urls = {
            name: f"http://127.0.0.1:{ports[name]}{STATS_PATH}" for name in ("primary", "fallback")
        }
        arrivals = poisson_arrivals(opts.rps, opts.warmup_s + opts.duration_s, opts.seed)
        started = time.monotonic()
        outcomes, boundary = run_async(
            drive(f"http://127.0.0.1:{ports['gateway']}", stats_urls, arrivals, opts.warmup_s)
        )
        took = time.monotonic() - started
        end = {name: get_json(url) for name, url in stats_urls.items()}
    finally:
        stack.stop()
    result = summarize(mode, outcomes, boundary, end)
    result["wall_s"] = took
    result["config"] = config
    return result


def header_missing(outcome: Outcome) -> str:
    return f"(status {outcome.status})" if outcome.status else "(no response)"


def summarize(
    mode: str, outcomes: Sequence[Outcome], boundary: dict[str, Any], end: dict[str, Any]
) -> dict[str, Any]:
    measured = [o for o in outcomes if o.phase == "measure"]
    warm = [o for o in outcomes if o.phase == "warmup"]
    n = len(measured)
    failed = [o for o in measured if o.error is not None]
    ttfts = [o.ttft_s for o in measured if o.ttft_s is not None]
    routes = Counter(o.route or header_missing(o) for o in measured)
    deployments = Counter(o.deployment or header_missing(o) for o in measured)
    attempts = [o.attempts for o in measured if o.attempts is not None]

    tagged = sum(received(end[name], "measure") for name in end)
    if tagged:
        upstream_requests = tagged
        method = "x-request-id counted by the upstreams (measured requests only)"
    else:  # the gateway did not forward the ids: everything after the warm-up ended
        upstream_requests = sum(
            received(end[name]) - (received(boundary[name]) if name in boundary else 0)
            for name in end
        )
        method = (
            "upstream counters from the end of the warm-up to the end of the run "
            "(x-request-id was not forwarded; approximate at the boundary)"
        )
    return {
        "mode": mode,
        "requests": n,
        # Requests without a first token rank as slower than any: see percentiles_ms.
        "ttft_ms": percentiles_ms(ttfts, missing=n - len(ttfts)),
        "ttft_ms_answered": percentiles_ms(ttfts),
        "total_ms": percentiles_ms([o.total_s for o in measured if o.total_s is not None]),
        "errors": len(failed),
        "error_samples": [o.error for o in failed[:MAX_ERROR_SAMPLES]],
        "served_by_primary": deployments[PRIMARY_DEPLOYMENT] / n if n else 0.0,
        "routes": dict(routes.most_common()),
        "deployments": dict(deployments.most_common()),
        "upstream_requests": upstream_requests,
        "upstream_counting": method,
        "extra_upstream_fraction": upstream_requests / n - 1.0 if n else 0.0,
        # The gateway's own account of the same thing, as a cross-check.
        "extra_attempts_fraction": sum(attempts) / len(attempts) - 1.0 if attempts else None,
        "upstream_stats": end,
        "send_lag_ms": percentiles_ms([max(o.lag_s, 0.0) for o in outcomes]),
        "warmup": {"requests": len(warm), "errors": sum(o.error is not None for o in warm)},
    }


# --- the report ----------------------------------------------------------------------------------


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    ttft = result["ttft_ms"]
    budget = float(TTFT_BUDGET_MS)
    checks = (
        ("TTFT p99 <= budget", ttft.get("p99"), budget, "ms", True),
        ("TTFT p99.9 <= 1.5x budget", ttft.get("p99.9"), 1.5 * budget, "ms", True),
        ("served by primary >= 85%", result["served_by_primary"], 0.85, "share", False),
        ("extra upstream requests <= 10%", result["extra_upstream_fraction"], 0.10, "share", True),
    )
    verdicts = []
    for label, value, limit, unit, at_most in checks:
        passed = value is not None and (value <= limit if at_most else value >= limit)
        verdicts.append(
            {"target": label, "value": value, "limit": limit, "unit": unit, "pass": passed}
        )
    return verdicts


def fmt_ms(value: float | None) -> str:
    return "no token" if value is None else f"{value:.0f} ms"


def fmt_share(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value * 100:+.1f}%" if signed else f"{value * 100:.1f}%"


def report(opts: Options, results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Print the tables and the hedge targets; return the verdicts."""
    print()
    print(
        f"{opts.rps:g} requests/s open loop (Poisson), {opts.duration_s:g} s measured after "
        f"{opts.warmup_s:g} s warm-up; TTFT budget {TTFT_BUDGET_MS} ms; primary: 8% stall "
        f"{opts.stall_ms[0]}-{opts.stall_ms[1]} ms, else ~150 ms; fallback: ~300 ms"
    )
    print()
    print(
        "| mode | TTFT p50 | p99 | p99.9 | served by primary | extra upstream requests | errors |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, result in results.items():
        ttft = result["ttft_ms"]
        print(
            f"| {mode} | {fmt_ms(ttft.get('p50'))} | {fmt_ms(ttft.get('p99'))} "
            f"| {fmt_ms(ttft.get('p99.9'))} | {fmt_share(result['served_by_primary'])} "
            f"| {fmt_share(result['extra_upstream_fraction'], signed=True)} "
            f"| {result['errors']} / {result['requests']} |"
        )
    print()
    print("| mode | routes (x-tailguard-route) | gateway attempts - 1 | TTFT p99 of answered |")
    print("|---|---|---:|---:|")
    for mode, result in results.items():
        n = max(result["requests"], 1)
        routes = ", ".join(f"{name} {count / n:.1%}" for name, count in result["routes"].items())
        print(
            f"| {mode} | {routes} | {fmt_share(result['extra_attempts_fraction'], True)} "
            f"| {fmt_ms(result['ttft_ms_answered'].get('p99'))} |"
        )

    print(
        "\nTTFT: from the scheduled send time; a request that got no first token (an error) "
        'ranks above every answered one ("no token": the percentile lands on such a request)'
    )
    counts = [int(result["ttft_ms"]["count"]) for result in results.values()]
    if counts and min(counts) < 1000:
        print(
            f"note: p99.9 of {min(counts)} requests is the max or next to it; "
            "run the full duration for a steadier figure"
        )
    methods = {result["upstream_counting"] for result in results.values()}
    print("extra upstream requests: " + "; ".join(sorted(methods)))
    for mode, result in results.items():
        if result["errors"]:
            print(f"{mode}: {result['errors']} errors, e.g. {result['error_samples'][0][:160]}")
        lag = result["send_lag_ms"].get("p99", 0.0)
        if lag > NOISY_LAG_MS:
            print(f"{mode}: warning: the client started requests late (p99 {lag:.1f} ms)")

    if "hedge" not in results:
        return []
    verdicts = targets(results["hedge"])
    print("\nhedge targets:")
    for verdict in verdicts:
        value, limit = verdict["value"], verdict["limit"]
        if verdict["unit"] == "ms":
            shown = f"{fmt_ms(value)} (limit {limit:.0f} ms)"
        else:
            shown = f"{fmt_share(value)} (limit {limit:.0%})"
        print(f"  {'PASS' if verdict['pass'] else 'MISS'}  {verdict['target']}: {shown}")
    return verdicts


# --- entry point ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=120.0, help="measured seconds (120)")
    parser.add_argument("--warmup", type=float, default=10.0, help="unreported seconds first (10)")
    parser.add_argument("--rps", type=float, default=20.0, help="mean arrival rate (20)")
    parser.add_argument("--quick", action="store_true", help="30 s measured, 5 s warm-up")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, of none, failover, hedge"
    )
    parser.add_argument("--seed", type=int, default=1, help="arrivals and upstream draws (1)")
    parser.add_argument(
        "--json", type=Path, default=None, help="results file (bench/results/tail-<time>.json)"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the configs and logs")
    parser.add_argument(
        "--stall-ms",
        default="2000,4000",
        help="LO,HI: how long the primary's slow 8%% wait before their first token (2000,4000); "
        "e.g. 450,900 for a tail that recovers soon after the deadline, where hedging beats "
        "failover",
    )
    args = parser.parse_args(argv)
    try:
        low, high = (int(part) for part in args.stall_ms.split(","))
    except ValueError:
        parser.error("--stall-ms: two whole numbers of milliseconds, LO,HI")
    if not 0 <= low <= high:
        parser.error("--stall-ms: need 0 <= LO <= HI")
    modes = parse_modes(parser, args.modes, MODES)
    duration = 30.0 if args.quick else args.duration
    warmup = 5.0 if args.quick else args.warmup
    if duration <= 0 or args.rps <= 0 or warmup < 0:
        parser.error("--duration and --rps must be > 0, --warmup >= 0")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Options(
        modes=modes,
        rps=args.rps,
        duration_s=duration,
        warmup_s=warmup,
        seed=args.seed,
        json_path=args.json or RESULTS_DIR / f"tail-{stamp}.json",
        keep_logs=args.keep_logs,
        stall_ms=(low, high),
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    pin, warning = pin_client()
    logs = Path(tempfile.mkdtemp(prefix="tailguard-tail-"))
    results: dict[str, dict[str, Any]] = {}
    failed = False
    try:
        with sigterm_as_interrupt():
            for mode in opts.modes:
                print(
                    f"{mode}: {opts.warmup_s:g} s warm-up + {opts.duration_s:g} s at "
                    f"{opts.rps:g} requests/s ...",
                    flush=True,
                )
                (logs / mode).mkdir()
                result = run_mode(mode, opts, pin, logs / mode)
                results[mode] = result
                ttft = result["ttft_ms"]
                print(
                    f"  {result['requests']} requests, {result['errors']} errors, TTFT p50 "
                    f"{fmt_ms(ttft.get('p50'))} p99 {fmt_ms(ttft.get('p99'))}, "
                    f"{result['wall_s']:.0f} s",
                    flush=True,
                )
    except (KeyboardInterrupt, RuntimeError, OSError) as exc:
        failed = True
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"logs kept in {logs}", file=sys.stderr)
    if failed:
        return 2
    verdicts = report(opts, results)
    document = {
        "benchmark": "tail",
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "options": {
            "modes": opts.modes,
            "rps": opts.rps,
            "duration_s": opts.duration_s,
            "warmup_s": opts.warmup_s,
            "seed": opts.seed,
            "max_tokens": MAX_TOKENS,
            "ttft_budget_ms": TTFT_BUDGET_MS,
            "hedge_max_fraction": HEDGE_MAX_FRACTION,
            "pinned": warning is None,
        },
        "profiles": {"primary": opts.primary_profile, "fallback": FALLBACK_PROFILE},
        "environment": environment(),
        "results": results,
        "targets": {"hedge": verdicts} if verdicts else {},
    }
    write_results(opts.json_path, document, logs, opts.keep_logs)
    return 0 if all(v["pass"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
