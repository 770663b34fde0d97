"""Replay a production-shaped LLM trace open-loop: plain proxy, Tailguard with one deployment and
Tailguard as configured, side by side, against latency-modelled upstreams.

The trace is generated (`bench/_trace_data.py`: the shape of the Azure LLM inference trace 2023,
conversation; seeded) unless `--trace PATH` names the real CSV (`TIMESTAMP, ContextTokens,
GeneratedTokens`). Every request is streamed, `max_tokens` = its output length, prompts of
~4 characters per token. Four arms run at once, each on its own copies of the upstreams
(`bench/_trace_upstream.py`, in this process; the same seeds, so every arm draws the same
latencies for the same request; `plain` and `configured` are sent a few ms after the pair, see
`STAGGER_S`):

- `direct`: the client straight to the primary (the reference for the paired overhead);
- `plain`: `bench/_refproxy.py`, a bare forwarding proxy, to the primary;
- `one`: `tailguard serve`, model `chat` on the primary alone (budgets, no rescue);
- `configured`: `tailguard serve`, `chat` on the primary and a second provider of the same
  model, `chat-fast` (a smaller model) as its fallback, hedging capped at 10%.

Upstreams: `primary` (large: ~150 ms + 40 ms per 1k prompt tokens, 6.5 ms per token, 4% of
first tokens stall 1.5-4 s), `second` (large elsewhere: ~350 ms + 60 ms/1k, 7.5 ms/token,
16 slots, 8 tokens per event and no usage chunk, 1% stalls) and `fast` (small: ~120 ms +
20 ms/1k, 4 ms/token). Budgets: TTFT 1 s, total 8 s. Scenarios (times for a 180 s run, scaled
with `--duration`): `steady`; `drift` (the primary 4x slower from 60 s to 120 s); `outage`
(the primary refuses connections from 80 s to 110 s).

    python bench/trace.py [--scenarios steady,drift,outage] [--duration 180] [--quick]

`--quick`: one 40 s scenario (steady unless `--scenarios` says). Results: a Markdown table per
scenario, and `bench/results/trace-<timestamp>.json`. The figures are the client's, measured
from each request's scheduled time; the paired overhead, from each copy's own send.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

if not __package__:  # `python bench/<script>.py`: `bench` is imported from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import aiohttp
import orjson

from bench import _trace_report as report
from bench._harness import (
    RESULTS_DIR,
    ROOT,
    environment,
    parse_modes,
    pin_client,
    post_stream,
    sigterm_as_interrupt,
    write_results,
)
from bench._trace_data import TraceRow, describe, prompt_text, read_trace, synthetic_trace
from bench._trace_upstream import LatencyModel, State, TraceUpstream
from gateway.tools.stack import Stack, free_port, serve
from gateway.tools.stream import StreamReader

ARMS: Final = ("direct", "plain", "one", "configured")
SCENARIOS: Final = ("steady", "drift", "outage")
# (state, start, end) in seconds of a 180 s run; scaled with the run's duration.
INCIDENTS: Final[dict[str, tuple[State, float, float] | None]] = {
    "steady": None,
    "drift": ("slow", 60.0, 120.0),
    "outage": ("down", 80.0, 110.0),
}
FULL_S: Final = 180.0
QUICK_S: Final = 40.0
PAIR_S: Final = 40.0  # the pair pass (direct and one alone), and with --quick
PAIR_QUICK_S: Final = 20.0
TTFT_BUDGET_MS: Final = 1000
TOTAL_BUDGET_MS: Final = 8000
HEDGE_MAX_FRACTION: Final = 0.10
REQUEST_TIMEOUT_S: Final = 60.0
# Seconds after the trace's time each arm's copy is sent. `direct` and `one` are the pair and go
# together; the other two follow a few ms later, out of step with the pair: the three proxies
# share a CPU (`bench/_harness.py`), and copies sent at the same instant reach them at the same
# instant all along their streams (the same draws), so `one` would queue behind the others' work
# on its first token and on every event after it.
STAGGER_S: Final = {"plain": 0.009, "configured": 0.017}

PRIMARY: Final = LatencyModel("large", 150, 40, 6.5, slots=64, stall_rate=0.04)
SECOND: Final = LatencyModel(
    "large", 350, 60, 7.5, slots=16, stall_rate=0.01, tokens_per_event=8, usage=False
)
FAST: Final = LatencyModel("small", 120, 20, 4.0, slots=64)
# deployment id (<provider>/<model>) -> (latency model, the model name clients send)
DEPLOYMENTS: Final = {
    "primary/large": (PRIMARY, "chat"),
    "second/large": (SECOND, "chat"),
    "fast/small": (FAST, "chat-fast"),
}
ARM_DEPLOYMENTS: Final = {
    "direct": ("primary/large",),
    "plain": ("primary/large",),
    "one": ("primary/large",),
    "configured": ("primary/large", "second/large", "fast/small"),
}
MODEL_OF: Final = {d: model for d, (_, model) in DEPLOYMENTS.items()}


def provider(port: int) -> dict[str, str]:
    return {"type": "openai", "base_url": f"http://127.0.0.1:{port}/v1"}


def gateway_config(arm: str, ports: dict[str, int]) -> dict[str, Any]:
    """`one`: the primary alone, budgets only; `configured`: both providers and the fallback."""
    budget = {"ttft_ms": TTFT_BUDGET_MS, "total_ms": TOTAL_BUDGET_MS}
    # The configured arm keeps its access log (in the run's logs: what each request's route was).
    server = {"host": "127.0.0.1", "access_log": arm == "configured"}
    common = {"latency": {"store": "memory"}, "server": server}
    if arm == "one":
        return {
            **common,
            "providers": {"primary": provider(ports["primary/large"])},
            "models": [
                {
                    "name": "chat",
                    "deployments": [{"provider": "primary", "model": "large"}],
                    "budget": budget,
                    "on_ttft_miss": "none",
                }
            ],
        }
    return {
        **common,
        "providers": {d.split("/")[0]: provider(p) for d, p in ports.items()},
        "models": [
            {
                "name": "chat",
                "deployments": [
                    {"provider": "primary", "model": "large", "weight": 2.0},
                    {"provider": "second", "model": "large"},
                ],
                "budget": budget,
                "fallbacks": ["chat-fast"],
                "on_ttft_miss": "hedge",
                "hedge_max_fraction": HEDGE_MAX_FRACTION,
            },
            {"name": "chat-fast", "deployments": [{"provider": "fast", "model": "small"}]},
        ],
    }


@dataclass(slots=True)
class Arm:
    name: str
    url: str
    upstreams: dict[str, TraceUpstream]  # by deployment id
    outcomes: list[report.Outcome]


async def one_request(
    session: aiohttp.ClientSession, arm: Arm, index: int, row: TraceRow, body: bytes, due: float
) -> None:
    if due > time.perf_counter():  # a staggered arm
        await asyncio.sleep(due - time.perf_counter())
    started = time.perf_counter()
    origin = min(due, started)
    outcome = report.Outcome(index, row.t, (len(body) + 3) // 4, lag_s=started - due)
    reader = StreamReader(errors_only_after_first=True)
    headers = {"content-type": "application/json", "x-request-id": f"tr-{index}"}
    streamed = await post_stream(session, arm.url, body, headers, reader)
    outcome.error = streamed.error
    if streamed.error is None:
        outcome.total_s = time.perf_counter() - origin
    if reader.t_first is not None:
        outcome.ttft_s = reader.t_first - origin
    outcome.deployment = streamed.headers.get("x-tailguard-deployment") or (
        "primary/large" if streamed.error is None else None
    )
    arm.outcomes.append(outcome)


def request_body(index: int, row: TraceRow) -> tuple[bytes, int]:
    """The request's body, and its prompt tokens as the upstreams count them."""
    prompt = prompt_text(index, row.context)
    body = {
        "model": "chat",
        "stream": True,
        "max_tokens": row.generated,
        "user": f"tr-{index}-{row.generated}",  # the upstreams' per-request draw, and its length
        "messages": [{"role": "user", "content": prompt}],
    }
    return orjson.dumps(body), (len(prompt) + 3) // 4


async def incident(arms: Sequence[Arm], start: float, spec: tuple[State, float, float]) -> None:
    """Switch every arm's primary into the incident's state and back, at the same times."""
    state, at, end = spec
    primaries = [arm.upstreams["primary/large"] for arm in arms]
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    for upstream in primaries:
        await upstream.set_state(state)
    await asyncio.sleep(max(0.0, start + end - time.perf_counter()))
    for upstream in primaries:
        await upstream.set_state("normal")


async def replay(
    rows: Sequence[TraceRow], arms: Sequence[Arm], spec: tuple[State, float, float] | None
) -> None:
    bodies = [request_body(i, row) for i, row in enumerate(rows)]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    with quiet_gc():
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            start = time.perf_counter() + 0.5
            tasks: list[asyncio.Task[None]] = []
            if spec is not None:
                tasks.append(asyncio.create_task(incident(arms, start, spec)))
            for i, row in enumerate(rows):
                due = start + row.t
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                for arm in arms:
                    at = due + STAGGER_S.get(arm.name, 0.0)
                    task = one_request(session, arm, i, row, bodies[i][0], at)
                    tasks.append(asyncio.create_task(task))
            await asyncio.gather(*tasks)


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """The collector as the gateway runs it (`gateway.api.tune_gc`), for the replay. The client
    and every upstream share this process's one event loop: with the default thresholds a full
    collection over the trace's bodies and the results pauses it for 40-90 ms, and a pause that
    falls between the direct copy's event and the gateway copy's lands on one arm only."""
    previous = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()


async def run_scenario(
    name: str,
    rows: Sequence[TraceRow],
    duration_s: float,
    seed: int,
    stack: Stack,
    logs: Path,
    arm_names: Sequence[str] = ARMS,
) -> dict[str, Any]:
    scale = duration_s / FULL_S
    raw = INCIDENTS.get(name)  # "pair": none
    spec = None if raw is None else (raw[0], raw[1] * scale, raw[2] * scale)
    arms: list[Arm] = []
    for arm_name in arm_names:
        upstreams = {
            d: TraceUpstream(DEPLOYMENTS[d][0], seed=seed + i)
            for i, d in enumerate(ARM_DEPLOYMENTS[arm_name])
        }
        for upstream in upstreams.values():
            await upstream.start()
        ports = {d: u.port for d, u in upstreams.items()}
        if arm_name == "direct":
            url = f"http://127.0.0.1:{ports['primary/large']}/v1/chat/completions"
        elif arm_name == "plain":
            port = free_port()
            command = [sys.executable, str(ROOT / "bench" / "_refproxy.py"), str(port)]
            command.append(f"http://127.0.0.1:{ports['primary/large']}/v1")
            stack.start_ready("gateway", command, f"{name}-plain.log", f"http://127.0.0.1:{port}/")
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
        else:
            port = free_port()
            config = gateway_config(arm_name, ports)
            path = logs / f"{name}-{arm_name}.yaml"
            path.write_text(orjson.dumps(config, option=orjson.OPT_INDENT_2).decode())
            serve(stack, port, path, log_name=f"{name}-{arm_name}.log")
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
        arms.append(Arm(arm_name, url, upstreams, []))
    try:
        await replay(rows, arms, spec)
    finally:
        for arm in arms:
            for upstream in arm.upstreams.values():
                await upstream.stop()
    results: dict[str, Any] = {}
    for arm in arms:
        attempts = [
            (d, a.prompt_tokens, a.completed or not a.prefilling, a.answered)
            for d, u in arm.upstreams.items()
            for a in u.attempts
            if a.key.startswith("tr-")
        ]
        outcomes = sorted(arm.outcomes, key=lambda o: o.index)
        results[arm.name] = report.summarize(
            outcomes,
            attempts,
            MODEL_OF,
            TTFT_BUDGET_MS / 1000,
            TOTAL_BUDGET_MS / 1000,
            None if spec is None else spec[2],
            incident_start=None if spec is None else spec[1],
        )
        arm.outcomes = outcomes
    by_name = {arm.name: arm.outcomes for arm in arms}
    paired = report.paired_overhead(by_name["direct"], by_name["one"])
    return {"incident": spec, "arms": results, "paired_overhead": paired}


def run_pair(
    rows: Sequence[TraceRow], seconds: float, seed: int, pin: dict[str, list[str]], logs: Path
) -> dict[str, Any]:
    """The paired overhead with `direct` and `one` alone: the first `seconds` of the steady
    trace, so that neither the plain proxy nor the configured gateway takes the CPU from the
    pair (on a small machine, waiting for a core is most of what four arms add to its tail)."""
    head = [row for row in rows if row.t < seconds]
    stack = Stack(logs=logs, pin=pin, cwd=ROOT)
    try:
        found = asyncio.run(
            run_scenario("pair", head, FULL_S, seed, stack, logs, arm_names=("direct", "one"))
        )
    finally:
        stack.stop()
    paired: dict[str, Any] = found["paired_overhead"]
    return paired


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--scenarios", default=None, help="comma-separated: steady,drift,outage")
    parser.add_argument("--duration", type=float, default=None, help="seconds of trace (180)")
    parser.add_argument("--requests", type=int, default=None, help="at most this many requests")
    parser.add_argument("--rate", type=float, default=7.8, help="generated trace: requests/s")
    parser.add_argument("--trace", type=Path, default=None, help="the Azure CSV to replay")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one 40 s scenario (steady)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--pair-s",
        type=float,
        default=None,
        help="seconds of the steady trace replayed by direct and one alone, for the paired "
        "overhead without the other arms on the CPU (0: none; default 40, --quick 20)",
    )
    args = parser.parse_args(argv)
    default = "steady" if args.quick else ",".join(SCENARIOS)
    args.scenarios = parse_modes(parser, args.scenarios or default, SCENARIOS)
    if args.duration is None:
        args.duration = QUICK_S if args.quick else FULL_S
    if not 5.0 <= args.duration <= 900.0:
        parser.error("--duration: 5 to 900 seconds")
    if args.pair_s is None:
        args.pair_s = PAIR_QUICK_S if args.quick else PAIR_S
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trace is not None:
        rows = read_trace(args.trace, args.duration, args.requests)
    else:
        rows = synthetic_trace(args.duration, args.seed, args.rate, args.requests)
    if not rows:
        print("the trace has no requests in that span", file=sys.stderr)
        return 2
    shape = describe(rows)
    source = str(args.trace) if args.trace else f"generated (seed {args.seed})"
    print(f"trace: {source}: {shape}")
    pin, warning = pin_client()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = RESULTS_DIR / f"trace-{stamp}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    scenarios: dict[str, Any] = {}
    with sigterm_as_interrupt():
        for name in args.scenarios:
            stack = Stack(logs=logs, pin=pin, cwd=ROOT)
            try:
                scenarios[name] = asyncio.run(
                    run_scenario(name, rows, args.duration, args.seed, stack, logs)
                )
            finally:
                stack.stop()
            print()
            print(report.table(name, scenarios[name]["arms"]))
            print()
            print(report.overhead_line(scenarios[name]["paired_overhead"]))
        pair = None
        if args.pair_s > 0:
            pair = run_pair(rows, args.pair_s, args.seed, pin, logs)
            print()
            print(report.overhead_line(pair, alone=True))
    document = {
        "benchmark": "trace",
        "trace": {"source": source, **shape},
        "duration_s": args.duration,
        "budgets_ms": {"ttft": TTFT_BUDGET_MS, "total": TOTAL_BUDGET_MS},
        "hedge_max_fraction": HEDGE_MAX_FRACTION,
        "upstreams": {d: m.__repr__() for d, (m, _) in DEPLOYMENTS.items()},
        "pinning_warning": warning,
        "environment": environment(),
        "scenarios": scenarios,
        "paired_overhead_alone": pair,
    }
    write_results(args.out or RESULTS_DIR / f"trace-{stamp}.json", document, logs, args.keep_logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
