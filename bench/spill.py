"""Spilling to a hosted fallback as a local vLLM fills up: round robin vs Tailguard.

Scenario. A local "vLLM" (`tailguard sim`: continuous batching, `max_batch` 16, ~40 ms to the
first token when a slot is free, 32 tokens at 40 tokens/s, each decode step up to 25% slower as
the batch fills) and a hosted fallback (`tailguard sim` standing in for a hosted API: ~400 ms to
the first token, no practical concurrency limit). The local server's capacity is computed from
its profile: `max_batch / (prefill + 31 steps at a full batch)`, ~15.9 requests/s. Each mode runs
its own gateway (`tailguard serve`, a real process) in front of fresh upstreams:

- `round_robin`: one model with two deployments of equal weight, local and hosted, no budget;
  the local provider is of type `openai` (no metrics read), so the order is the weighted draw;
- `tailguard`: the local server as a provider of type `vllm` (its `/metrics` read every 0.5 s;
  TTFT predicted from its queue), with a TTFT budget of 600 ms and the hosted model as its
  fallback (`fallbacks`, with an operator's prior of 450 ms for its TTFT).

Load. Open loop, streaming chat completions (`max_tokens` 32), Poisson arrivals stepping through
20, 40, 60, 80, 100, 120, 150 and 200% of the local capacity, `--step` seconds each, back to back
after a `--warmup` at 20% (not reported: routing needs statistics first). TTFT runs from a
request's scheduled send time to the first SSE event with content (no coordinated omission); a
request that got no first token ranks above every answered one. Percentiles are nearest rank.

Reported per step: TTFT p50 / p99, the share served locally (`x-tailguard-deployment`), the
routes (`x-tailguard-route`), errors, and the local server's queue as its own `/metrics` showed it
(`vllm:num_requests_waiting`, sampled every 0.25 s: mean and max) with the requests it aborted
(`vllm:request_success_total{finished_reason="abort"}`: attempts cut by a first-token deadline).
Targets, for `tailguard`, printed with PASS/MISS: TTFT p99 within the budget at every step, and
at least 90% served locally at every step below 80% load. Results go to
`bench/results/spill-<timestamp>.json`. Exit status: 0 when every target passes, 1 when one
misses, 2 when the run failed.

    .venv/bin/python bench/spill.py             # ~6 minutes: 2 modes x (10 s + 8 x 20 s)
    .venv/bin/python bench/spill.py --quick     # ~2 minutes: 2 modes x (5 s + 8 x 6 s)
    .venv/bin/python bench/spill.py --modes tailguard --step 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp

from gateway.providers.vllm import parse_metrics
from gateway.tools.stack import Stack, free_port, start_gateway

try:  # `python -m bench.spill` or `python bench/spill.py`
    from bench._harness import (
        RESULTS_DIR,
        ROOT,
        VENV_BIN,
        SSEReader,
        environment,
        parse_modes,
        percentiles_ms,
        pin_client,
        sigterm_as_interrupt,
        stream_chat_body,
        write_results,
    )
except ImportError:
    from _harness import (  # type: ignore[no-redef,unused-ignore,import-not-found]
        RESULTS_DIR,
        ROOT,
        VENV_BIN,
        SSEReader,
        environment,
        parse_modes,
        percentiles_ms,
        pin_client,
        sigterm_as_interrupt,
        stream_chat_body,
        write_results,
    )

MODES: Final = ("round_robin", "tailguard")
STEPS_PCT: Final = (20, 40, 60, 80, 100, 120, 150, 200)
WARMUP_PCT: Final = 20

MODEL: Final = "chat"
HOSTED_MODEL: Final = "chat-hosted"
LOCAL_DEPLOYMENT: Final = "local/llama"  # <provider>/<model>, as x-tailguard-deployment names it
HOSTED_DEPLOYMENT: Final = "hosted/remote"
TTFT_BUDGET_MS: Final = 600
HOSTED_PRIOR_TTFT_MS: Final = 450  # what an operator would write for a ~400 ms hosted model
METRICS_INTERVAL_S: Final = 0.5
MAX_TOKENS: Final = 32
LOCAL_SHARE_TARGET: Final = 0.90
LOCAL_SHARE_BELOW_PCT: Final = 80
PROMPT: Final = (
    "Explain in two sentences why a queue in front of a GPU makes time to first token grow."
)

LOCAL_PROFILE: Final[dict[str, Any]] = {
    "max_batch": 16,
    "prefill_base_ms": 40,
    "ttft_tail": "lognormal",
    "ttft_sigma": 0.2,
    "tokens_per_s": 40,
    "batch_slowdown": 0.25,
    "output_tokens": MAX_TOKENS,
}
HOSTED_PROFILE: Final[dict[str, Any]] = {
    "max_batch": 4096,
    "prefill_base_ms": 400,
    "ttft_tail": "lognormal",
    "ttft_sigma": 0.05,
    "tokens_per_s": 100,
    "output_tokens": MAX_TOKENS,
}

REQUEST_TIMEOUT_S: Final = 120.0
KEEPALIVE_S: Final = 2.0  # below uvicorn's 5 s idle timeout
QUEUE_SAMPLE_S: Final = 0.25
NOISY_LAG_MS: Final = 10.0
MAX_ERROR_SAMPLES: Final = 5


def local_capacity_rps(profile: dict[str, Any] = LOCAL_PROFILE) -> float:
    """Requests per second the local server completes with every slot busy: `max_batch` over
    one request's time at a full batch (prefill, then n - 1 decode steps slowed by
    `batch_slowdown`)."""
    step_s = (1 + float(profile["batch_slowdown"])) / float(profile["tokens_per_s"])
    request_s = float(profile["prefill_base_ms"]) / 1000 + (MAX_TOKENS - 1) * step_s
    return float(profile["max_batch"]) / request_s


# --- processes -----------------------------------------------------------------------------------


def start_sim(
    stack: Stack, name: str, port: int, profile: dict[str, Any], seed: int
) -> subprocess.Popen[bytes]:
    """`tailguard sim` with `profile` as `--set` overrides of its default profile."""
    command = [str(VENV_BIN / "tailguard"), "sim", "--port", str(port), "--seed", str(seed)]
    for key, value in profile.items():
        command += ["--set", f"{key}={value}"]
    return stack.start_ready("upstream", command, f"{name}.log", f"http://127.0.0.1:{port}/health")


def gateway_config(mode: str, port: int, local_port: int, hosted_port: int) -> dict[str, Any]:
    local_provider, local_model = LOCAL_DEPLOYMENT.split("/")
    hosted_provider, hosted_model = HOSTED_DEPLOYMENT.split("/")
    hosted = {"type": "openai", "base_url": f"http://127.0.0.1:{hosted_port}/v1"}
    local: dict[str, Any] = {"base_url": f"http://127.0.0.1:{local_port}/v1"}
    if mode == "round_robin":
        local["type"] = "openai"  # no metrics: the order is the weighted draw alone
        models: list[dict[str, Any]] = [
            {
                "name": MODEL,
                "deployments": [
                    {"provider": local_provider, "model": local_model, "weight": 1},
                    {"provider": hosted_provider, "model": hosted_model, "weight": 1},
                ],
            }
        ]
    else:
        local.update(type="vllm", metrics_interval_s=METRICS_INTERVAL_S)
        models = [
            {
                "name": MODEL,
                "deployments": [{"provider": local_provider, "model": local_model}],
                "budget": {"ttft_ms": TTFT_BUDGET_MS},
                "fallbacks": [HOSTED_MODEL],
            },
            {
                "name": HOSTED_MODEL,
                # The fallback sees only what spills, so its statistics take a while to be
                # trusted; until then the first-token deadline is planned on this prior.
                "deployments": [
                    {
                        "provider": hosted_provider,
                        "model": hosted_model,
                        "prior": {"ttft_ms": HOSTED_PRIOR_TTFT_MS},
                    }
                ],
            },
        ]
    return {
        "server": {"host": "127.0.0.1", "port": port, "access_log": False},
        "latency": {"store": "memory"},
        "providers": {local_provider: local, hosted_provider: hosted},
        "models": models,
    }


# --- the client ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """One client request, as the client saw it."""

    step: int  # index into the steps; -1: warm-up
    lag_s: float
    ttft_s: float | None = None
    status: int = 0
    deployment: str | None = None
    route: str | None = None
    error: str | None = None


async def one_request(
    session: aiohttp.ClientSession, url: str, body: bytes, step: int, due: float
) -> Outcome:
    started = time.perf_counter()
    origin = min(due, started)
    outcome = Outcome(step=step, lag_s=started - due)
    reader = SSEReader(errors_only_after_first=True)
    try:
        async with session.post(
            url, data=body, headers={"content-type": "application/json"}
        ) as response:
            outcome.status = response.status
            outcome.deployment = response.headers.get("x-tailguard-deployment")
            outcome.route = response.headers.get("x-tailguard-route")
            if response.status != 200:
                text = await response.read()
                outcome.error = f"status {response.status}: {text[:200]!r}"
            else:
                async for data in response.content.iter_any():
                    reader.feed(data, time.perf_counter())
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    if reader.t_first is not None:
        outcome.ttft_s = reader.t_first - origin
    if outcome.error is None:
        if reader.error is not None:
            outcome.error = reader.error
        elif not reader.done:
            outcome.error = "stream ended without [DONE]"
    return outcome


def schedule(
    rates: Sequence[float], seconds: Sequence[float], seed: int
) -> list[tuple[float, int]]:
    """Poisson arrivals (offset, phase) through consecutive phases of the given rates."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, int]] = []
    start = 0.0
    for phase, (rate, length) in enumerate(zip(rates, seconds, strict=True)):
        t = start + rng.expovariate(rate)
        while t < start + length:
            arrivals.append((t, phase))
            t += rng.expovariate(rate)
        start += length
    return arrivals


@dataclass(slots=True)
class LocalView:
    """The local server's own account, per phase: its queue samples and abort counter."""

    waiting: list[list[float]]
    aborts: list[float]  # the counter at each phase's end


async def local_metrics(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(waiting, aborted so far) from the local server's `/metrics`."""
    async with session.get(url) as response:
        text = await response.text()
    aborted = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            aborted += float(line.rsplit(" ", 1)[1])
    return parse_metrics(text).waiting, aborted


async def drive(
    gateway_url: str, local_metrics_url: str, arrivals: Sequence[tuple[float, int]], phases: int
) -> tuple[list[Outcome], LocalView]:
    url = gateway_url + "/v1/chat/completions"
    body = stream_chat_body(MODEL, MAX_TOKENS, PROMPT)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    view = LocalView(waiting=[[] for _ in range(phases)], aborts=[0.0] * phases)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[Outcome]] = []
        phase_now = 0
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                with contextlib.suppress(aiohttp.ClientError, ValueError, TimeoutError):
                    waiting, aborted = await local_metrics(session, local_metrics_url)
                    view.waiting[phase_now].append(waiting)
                    view.aborts[phase_now] = aborted
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), QUEUE_SAMPLE_S)

        watcher = asyncio.create_task(watch())
        t0 = time.perf_counter() + 0.05
        for offset, phase in arrivals:
            due = t0 + offset
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            phase_now = phase
            tasks.append(loop.create_task(one_request(session, url, body, phase - 1, due)))
        outcomes = list(await asyncio.gather(*tasks))
        stop.set()
        await watcher
        with contextlib.suppress(aiohttp.ClientError, ValueError, TimeoutError):
            view.aborts[-1] = (await local_metrics(session, local_metrics_url))[1]
    return outcomes, view


# --- one mode ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Options:
    modes: list[str]
    step_s: float
    warmup_s: float
    steps_pct: tuple[int, ...]
    seed: int
    json_path: Path
    keep_logs: bool


def run_mode(mode: str, opts: Options, pin: dict[str, list[str]], logs: Path) -> dict[str, Any]:
    capacity = local_capacity_rps()
    stack = Stack(logs=logs, pin=pin, cwd=ROOT)
    try:
        ports = {"local": free_port(), "hosted": free_port(), "gateway": free_port()}
        start_sim(stack, "local", ports["local"], LOCAL_PROFILE, opts.seed)
        start_sim(stack, "hosted", ports["hosted"], HOSTED_PROFILE, opts.seed + 1)
        config = gateway_config(mode, ports["gateway"], ports["local"], ports["hosted"])
        start_gateway(stack, config, ports["gateway"])
        pcts = (WARMUP_PCT, *opts.steps_pct)
        rates = [capacity * pct / 100 for pct in pcts]
        seconds = [opts.warmup_s, *([opts.step_s] * len(opts.steps_pct))]
        arrivals = schedule(rates, seconds, opts.seed)
        started = time.monotonic()
        outcomes, view = asyncio.run(
            drive(
                f"http://127.0.0.1:{ports['gateway']}",
                f"http://127.0.0.1:{ports['local']}/metrics",
                arrivals,
                len(pcts),
            )
        )
        took = time.monotonic() - started
    finally:
        stack.stop()
    steps = []
    for index, pct in enumerate(opts.steps_pct):
        phase = index + 1
        aborted = view.aborts[phase] - view.aborts[phase - 1]
        steps.append(summarize(pct, rates[phase], [o for o in outcomes if o.step == index]))
        samples = view.waiting[phase]
        steps[-1]["local_waiting"] = {
            "mean": sum(samples) / len(samples) if samples else None,
            "max": max(samples) if samples else None,
            "samples": len(samples),
        }
        steps[-1]["local_aborted"] = aborted
    warm = [o for o in outcomes if o.step < 0]
    return {
        "mode": mode,
        "capacity_rps": capacity,
        "steps": steps,
        "warmup": {"requests": len(warm), "errors": sum(o.error is not None for o in warm)},
        "send_lag_ms": percentiles_ms([max(o.lag_s, 0.0) for o in outcomes]),
        "wall_s": took,
        "config": config,
    }


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


# --- entry point ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--step", type=float, default=20.0, help="seconds per load step (20)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds at 20%% first (10)")
    parser.add_argument("--quick", action="store_true", help="6 s per step, 5 s warm-up")
    parser.add_argument(
        "--steps",
        default=",".join(str(p) for p in STEPS_PCT),
        help="load steps in %% of the local capacity (20,40,60,80,100,120,150,200)",
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, of round_robin, tailguard"
    )
    parser.add_argument("--seed", type=int, default=1, help="arrivals and upstream draws (1)")
    parser.add_argument(
        "--json", type=Path, default=None, help="results file (bench/results/spill-<time>.json)"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the configs and logs")
    args = parser.parse_args(argv)
    modes = parse_modes(parser, args.modes, MODES)
    try:
        steps = tuple(int(p) for p in args.steps.split(","))
    except ValueError:
        parser.error("--steps: whole percentages, e.g. 20,60,100")
    if not steps or min(steps) <= 0:
        parser.error("--steps: percentages above 0")
    step_s = 6.0 if args.quick else args.step
    warmup = 5.0 if args.quick else args.warmup
    if step_s <= 0 or warmup <= 0:
        parser.error("--step and --warmup must be > 0")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Options(
        modes=modes,
        step_s=step_s,
        warmup_s=warmup,
        steps_pct=steps,
        seed=args.seed,
        json_path=args.json or RESULTS_DIR / f"spill-{stamp}.json",
        keep_logs=args.keep_logs,
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    pin, warning = pin_client()
    logs = Path(tempfile.mkdtemp(prefix="tailguard-spill-"))
    results: dict[str, dict[str, Any]] = {}
    total_s = opts.warmup_s + opts.step_s * len(opts.steps_pct)
    try:
        with sigterm_as_interrupt():
            for mode in opts.modes:
                print(f"{mode}: {total_s:g} s of rising load ...", flush=True)
                (logs / mode).mkdir()
                result = run_mode(mode, opts, pin, logs / mode)
                results[mode] = result
                worst = max(
                    (s["ttft_ms"].get("p99") or float("inf") for s in result["steps"]),
                    default=0.0,
                )
                print(f"  worst step TTFT p99 {worst:.0f} ms, {result['wall_s']:.0f} s", flush=True)
    except (KeyboardInterrupt, RuntimeError, OSError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"logs kept in {logs}", file=sys.stderr)
        return 2
    verdicts = report(opts, results)
    document = {
        "benchmark": "spill",
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "options": {
            "modes": opts.modes,
            "step_s": opts.step_s,
            "warmup_s": opts.warmup_s,
            "steps_pct": list(opts.steps_pct),
            "seed": opts.seed,
            "max_tokens": MAX_TOKENS,
            "ttft_budget_ms": TTFT_BUDGET_MS,
            "metrics_interval_s": METRICS_INTERVAL_S,
            "pinned": warning is None,
        },
        "local_capacity_rps": local_capacity_rps(),
        "profiles": {"local": LOCAL_PROFILE, "hosted": HOSTED_PROFILE},
        "environment": environment(),
        "results": results,
        "targets": {"tailguard": verdicts} if verdicts else {},
    }
    write_results(opts.json_path, document, logs, opts.keep_logs)
    return 0 if all(v["pass"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
