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
Targets, for `tailguard`, printed with PASS/MISS: TTFT p99 within the budget at every step, at
least 90% served locally at every step below 80% load, and at least 40% from 150% on (the local
server keeps serving what it can rather than sitting idle while the fallback serves).

Part `burst` (bench/_spill_burst.py): three local servers behind one model, idle until their
pages read empty, then a burst of twice their slots within one scrape interval; no server may
take more than its fair share (by slots) plus 20 points. Results go to
`bench/results/spill-<timestamp>.json`. Exit status: 0 when every target passes, 1 when one
misses, 2 when the run failed.

    .venv/bin/python bench/spill.py             # ~6 minutes: 2 modes x (10 s + 8 x 20 s)
    .venv/bin/python bench/spill.py --quick     # ~2 minutes: 2 modes x (5 s + 8 x 6 s)
    .venv/bin/python bench/spill.py --modes tailguard --step 30
    .venv/bin/python bench/spill.py --parts burst   # ~15 s

Modules: `_spill_setup` (profiles, configs, options), `_spill_client` (the open-loop client),
`_spill_report` (summaries, targets, the table), `_spill_burst` (the burst part).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # `python bench/<script>.py`: `bench` is imported from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench._harness import (
    RESULTS_DIR,
    ROOT,
    environment,
    parse_modes,
    percentiles_ms,
    pin_client,
    sigterm_as_interrupt,
    write_results,
)
from bench._spill_burst import BURST_PROFILE, burst_report, burst_targets, run_burst
from bench._spill_client import drive, schedule
from bench._spill_report import report, summarize
from bench._spill_setup import (
    HOSTED_PROFILE,
    LOCAL_PROFILE,
    MAX_TOKENS,
    METRICS_INTERVAL_S,
    MODES,
    STEPS_PCT,
    TTFT_BUDGET_MS,
    WARMUP_PCT,
    Options,
    gateway_config,
    local_capacity_rps,
    start_sim,
)
from gateway.tools.stack import Stack, free_port, start_gateway

PARTS = ("ramp", "burst")


# --- one mode ------------------------------------------------------------------------------------


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
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated, of ramp, burst (both)"
    )
    args = parser.parse_args(argv)
    modes = parse_modes(parser, args.modes, MODES)
    parts = tuple(parse_modes(parser, args.parts, PARTS))
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
        parts=parts,
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    pin, warning = pin_client()
    logs = Path(tempfile.mkdtemp(prefix="tailguard-spill-"))
    results: dict[str, dict[str, Any]] = {}
    burst: dict[str, Any] | None = None
    total_s = opts.warmup_s + opts.step_s * len(opts.steps_pct)
    modes = opts.modes if "ramp" in opts.parts else []
    try:
        with sigterm_as_interrupt():
            for mode in modes:
                print(f"{mode}: {total_s:g} s of rising load ...", flush=True)
                (logs / mode).mkdir()
                result = run_mode(mode, opts, pin, logs / mode)
                results[mode] = result
                worst = max(
                    (s["ttft_ms"].get("p99") or float("inf") for s in result["steps"]),
                    default=0.0,
                )
                print(f"  worst step TTFT p99 {worst:.0f} ms, {result['wall_s']:.0f} s", flush=True)
            if "burst" in opts.parts:
                print("burst: a wave, an idle spell, a burst ...", flush=True)
                (logs / "burst").mkdir()
                burst = run_burst(pin, logs / "burst", opts.seed)
    except (KeyboardInterrupt, RuntimeError, OSError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"logs kept in {logs}", file=sys.stderr)
        return 2
    verdicts = report(opts, results) if results else []
    if burst is not None:
        burst_report(burst)
        verdicts += burst_targets(burst)
        print("\nburst target:")
        for verdict in verdicts[-1:]:
            mark = "PASS" if verdict["pass"] else "MISS"
            print(f"  {mark}  {verdict['target']}: {verdict['value']:.1%}")
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
            "parts": list(opts.parts),
        },
        "local_capacity_rps": local_capacity_rps(),
        "profiles": {"local": LOCAL_PROFILE, "hosted": HOSTED_PROFILE, "burst": BURST_PROFILE},
        "environment": environment(),
        "results": results,
        "burst": burst,
        "targets": {"tailguard": verdicts} if verdicts else {},
    }
    write_results(opts.json_path, document, logs, opts.keep_logs)
    return 0 if all(v["pass"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
