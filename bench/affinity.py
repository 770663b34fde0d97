"""Cache-aware routing across three vLLM servers: round robin vs queue-only vs Tailguard.

Scenario. Three simulated vLLM servers (`tailguard sim`, each with a prefix cache of 100k
tokens, vLLM's automatic prefix caching over 16-token blocks; prefill 0.15 ms a token, so a
history of 6k tokens takes 0.9 s to prefill and its next turn on the server that holds it
~0.05 s; 16 batch slots; 64 tokens at 40 tokens/s) behind one gateway (`tailguard serve`, a real
process) that serves them as three deployments of one model. Each mode gets its own gateway and
fresh servers:

- `round_robin`: the servers as providers of type `openai`, equal weights (no metrics read);
- `queue_only`: type `vllm`, metrics read every 0.5 s, `routing.affinity.enabled: false`: the
  predicted-queue routing alone;
- `tailguard`: the same with cache-aware routing on (its defaults).

Workloads (bench/_affinity_load.py). `shared`: multi-turn conversations, `--users` users (60)
with a mean think time of 2 s, histories growing from ~2k to ~6k tokens. `independent`:
Poisson arrivals (`--rate`, 8/s) of prompts of 1k to 8k tokens that share no prefix, for
queue_only and tailguard only: cache-aware routing must cost nothing there.

Reported per workload and mode: TTFT p50 and p99 (from each request's send to its first
content token; a request with none ranks above every answered one), the servers' prefix-cache
hit rate (their `vllm:prefix_cache_hits_total` over `..._queries_total`), each server's share of
the requests, the affinity decisions (`tailguard_affinity_decisions_total`) and errors.
Targets, printed with PASS/MISS: on `shared`, tailguard's TTFT p50 and p99 at most half of both
queue_only's and round_robin's; on `independent`, tailguard's within noise of queue_only's
(at most 15% + 25 ms above). Results go to `bench/results/affinity-<timestamp>.json`. Exit
status: 0 when every target passes, 1 when one misses, 2 when the run failed.

    .venv/bin/python bench/affinity.py           # ~9 minutes
    .venv/bin/python bench/affinity.py --quick   # ~4 minutes
    .venv/bin/python bench/affinity.py --overhead  # CPU per decision
"""

from __future__ import annotations

import argparse
import asyncio
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

from bench import _affinity_micro as micro
from bench._affinity_load import Outcome, conversations, independent, sim_prefix
from bench._harness import (
    RESULTS_DIR,
    ROOT,
    VENV_BIN,
    environment,
    parse_modes,
    percentiles_ms,
    pin_client,
    sigterm_as_interrupt,
    write_results,
)
from gateway.tools.stack import Stack, free_port, start_gateway

MODES: Final = ("round_robin", "queue_only", "tailguard")
WORKLOADS: Final = ("shared", "independent")
INDEPENDENT_MODES: Final = ("queue_only", "tailguard")
MODEL: Final = "chat"
SERVERS: Final = ("a", "b", "c")
UPSTREAM_MODEL: Final = "llama"
METRICS_INTERVAL_S: Final = 0.5
MAX_TOKENS: Final = 64
SPEEDUP_TARGET: Final = 2.0
NOISE_RATIO: Final = 1.15
NOISE_MS: Final = 25.0
PROFILE: Final[dict[str, Any]] = {
    "max_batch": 16,
    "prefill_base_ms": 20,
    "prefill_ms_per_token": 0.15,
    "tokens_per_s": 40,
    "batch_slowdown": 0.25,
    "output_tokens": MAX_TOKENS,
    "prefix_cache_tokens": 100_000,
    "kv_tokens_per_seq": 16_384,
}


# --- processes -----------------------------------------------------------------------------------


def start_sim(stack: Stack, name: str, port: int, seed: int) -> None:
    command = [str(VENV_BIN / "tailguard"), "sim", "--port", str(port), "--seed", str(seed)]
    for key, value in PROFILE.items():
        command += ["--set", f"{key}={value}"]
    stack.start_ready("upstream", command, f"{name}.log", f"http://127.0.0.1:{port}/health")


def gateway_config(mode: str, ports: dict[str, int]) -> dict[str, Any]:
    providers: dict[str, Any] = {}
    for name in SERVERS:
        provider: dict[str, Any] = {"base_url": f"http://127.0.0.1:{ports[name]}/v1"}
        if mode == "round_robin":
            provider["type"] = "openai"  # no metrics: the weighted draw alone
        else:
            provider.update(type="vllm", metrics_interval_s=METRICS_INTERVAL_S)
        providers[name] = provider
    return {
        "server": {"host": "127.0.0.1", "access_log": False},
        "latency": {"store": "memory"},
        "providers": providers,
        "models": [
            {
                "name": MODEL,
                "deployments": [
                    {"provider": name, "model": UPSTREAM_MODEL, "weight": 1} for name in SERVERS
                ],
            }
        ],
        "routing": {"affinity": {"enabled": mode == "tailguard"}},
    }


def scraped(port: int) -> None:
    """Return once the gateway has read every server's `/metrics` (its `/admin/latency`)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/latency", timeout=5) as r:
            states = [v.get("state") for v in json.loads(r.read()).get("vllm", {}).values()]
        if len(states) == len(SERVERS) and set(states) == {"ok"}:
            return
        time.sleep(0.1)
    raise RuntimeError("the gateway never read the servers' /metrics")


def decisions(port: int) -> dict[str, float]:
    """The gateway's `tailguard_affinity_decisions_total`, by outcome."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        page = response.read().decode()
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("tailguard_affinity_decisions_total{"):
            outcome = line.partition('outcome="')[2].partition('"')[0]
            out[outcome] = out.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# --- one run -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Options:
    modes: list[str]
    workloads: list[str]
    duration_s: float
    users: int
    think_s: float
    rate: float
    seed: int
    json_path: Path
    keep_logs: bool
    overhead: bool


def run(
    workload: str, mode: str, opts: Options, pin: dict[str, list[str]], logs: Path
) -> dict[str, Any]:
    stack = Stack(logs=logs, pin=pin, cwd=ROOT)
    try:
        ports = {name: free_port() for name in SERVERS}
        for index, name in enumerate(SERVERS):
            start_sim(stack, name, ports[name], opts.seed + index)
        config = gateway_config(mode, ports)
        port, _ = start_gateway(stack, config)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        if mode != "round_robin":
            scraped(port)
        started = time.monotonic()
        if workload == "shared":
            work = conversations(
                url,
                MODEL,
                users=opts.users,
                duration_s=opts.duration_s,
                think_s=opts.think_s,
                max_tokens=MAX_TOKENS,
                seed=opts.seed,
            )
        else:
            work = independent(
                url,
                MODEL,
                rate=opts.rate,
                duration_s=opts.duration_s,
                max_tokens=MAX_TOKENS,
                seed=opts.seed,
            )
        outcomes = asyncio.run(work)
        took = time.monotonic() - started
        metrics = [f"http://127.0.0.1:{ports[name]}/metrics" for name in SERVERS]
        prefix = asyncio.run(sim_prefix(metrics))
        affinity = decisions(port)
    finally:
        stack.stop()
    return summarize(workload, mode, outcomes, prefix, affinity, took)


def summarize(
    workload: str,
    mode: str,
    outcomes: Sequence[Outcome],
    prefix: Sequence[tuple[float, float]],
    affinity: dict[str, float],
    took: float,
) -> dict[str, Any]:
    n = len(outcomes)
    start = min((o.sent for o in outcomes), default=0.0)
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    failed = [o for o in outcomes if o.error is not None]
    hits, queries = sum(h for h, _ in prefix), sum(q for _, q in prefix)
    served = Counter(o.deployment or f"(status {o.status})" for o in outcomes)
    later = [o.ttft_s for o in outcomes if o.turn > 0 and o.ttft_s is not None]
    return {
        "workload": workload,
        "mode": mode,
        "requests": n,
        "ttft_ms": percentiles_ms(ttfts, missing=n - len(ttfts)),
        "ttft_ms_after_first_turn": percentiles_ms(later),
        "prefix_hit_rate": hits / queries if queries else None,
        "prefix_by_server": {
            s: {"hits": h, "queries": q} for s, (h, q) in zip(SERVERS, prefix, strict=True)
        },
        "share": {
            f"{s}/{UPSTREAM_MODEL}": served[f"{s}/{UPSTREAM_MODEL}"] / n if n else None
            for s in SERVERS
        },
        "affinity": affinity,
        "errors": len(failed),
        "error_samples": [o.error for o in failed[:5]],
        "prompt_tokens_mean": sum(o.prompt_chars for o in outcomes) / n / 4 if n else None,
        "wall_s": took,
        # Per request: seconds since the run began, turn, body bytes, TTFT ms, deployment, the
        # affinity decision and the conversation ("<user>.<conversation>").
        "requests_seen": [
            [
                round(o.sent - start, 3),
                o.turn,
                o.prompt_chars,
                None if o.ttft_s is None else round(o.ttft_s * 1000, 1),
                o.deployment,
                o.affinity,
                o.conversation,
            ]
            for o in outcomes
        ],
    }


# --- the report ----------------------------------------------------------------------------------


def targets(results: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    verdicts: list[dict[str, Any]] = []
    shared = results.get("shared", {})
    if "tailguard" in shared:
        mine = shared["tailguard"]["ttft_ms"]
        for other in ("queue_only", "round_robin"):
            if other not in shared:
                continue
            theirs = shared[other]["ttft_ms"]
            for level in ("p50", "p99"):
                ours, base = mine.get(level), theirs.get(level)
                ratio = base / ours if ours and base else None
                verdicts.append(
                    {
                        "target": f"shared: TTFT {level} >= {SPEEDUP_TARGET:g}x lower than {other}",
                        "value": ratio,
                        "pass": ratio is not None and ratio >= SPEEDUP_TARGET,
                    }
                )
    alone = results.get("independent", {})
    if "tailguard" in alone and "queue_only" in alone:
        for level in ("p50", "p99"):
            ours = alone["tailguard"]["ttft_ms"].get(level)
            base = alone["queue_only"]["ttft_ms"].get(level)
            verdicts.append(
                {
                    "target": f"independent: TTFT {level} within noise of queue_only "
                    f"(<= {NOISE_RATIO:g}x + {NOISE_MS:g} ms)",
                    "value": ours / base if ours and base else None,
                    "pass": ours is not None
                    and base is not None
                    and ours <= base * NOISE_RATIO + NOISE_MS,
                }
            )
    return verdicts


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(opts: Options, results: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    print()
    print(
        f"3 servers: max_batch {PROFILE['max_batch']}, prefill {PROFILE['prefill_ms_per_token']} "
        f"ms/token, prefix cache {PROFILE['prefix_cache_tokens']} tokens each; {opts.duration_s:g} "
        f"s per run; shared: {opts.users} users, think {opts.think_s:g} s; independent: "
        f"{opts.rate:g}/s"
    )
    print()
    print(
        "| workload | mode | requests | mean prompt tokens | TTFT p50 ms | TTFT p99 ms "
        "| prefix-cache hit rate | load share a / b / c | affinity hit / bounded / queue / miss "
        "| errors |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---|---:|")
    for workload, modes in results.items():
        for mode, r in modes.items():
            share = " / ".join(f"{(v or 0) * 100:.0f}%" for v in r["share"].values())
            aff = r["affinity"]
            decided = (
                " / ".join(f"{aff.get(k, 0):.0f}" for k in ("hit", "bounded", "queue", "miss"))
                if aff
                else "-"
            )
            rate = r["prefix_hit_rate"]
            print(
                f"| {workload} | {mode} | {r['requests']} | {fmt(r['prompt_tokens_mean'])} "
                f"| {fmt(r['ttft_ms'].get('p50'))} | {fmt(r['ttft_ms'].get('p99'))} "
                f"| {fmt(None if rate is None else rate * 100, 1)}% | {share} | {decided} "
                f"| {r['errors']} |"
            )
            if r["errors"]:
                print(f"  {workload}/{mode}: e.g. {r['error_samples'][0][:160]}")
    verdicts = targets(results)
    if verdicts:
        print("\ntargets:")
        for v in verdicts:
            shown = "-" if v["value"] is None else f"{v['value']:.2f}x"
            print(f"  {'PASS' if v['pass'] else 'MISS'}  {v['target']}: {shown}")
    return verdicts


# --- entry point ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds per run (90)")
    parser.add_argument("--quick", action="store_true", help="35 s per run")
    parser.add_argument("--users", type=int, default=60, help="conversations at once (60)")
    parser.add_argument("--think", type=float, default=2.0, help="mean think time, s (2)")
    parser.add_argument("--rate", type=float, default=8.0, help="independent prompts/s (8)")
    parser.add_argument("--modes", default=",".join(MODES), help="of " + ", ".join(MODES))
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="of " + ", ".join(WORKLOADS)
    )
    parser.add_argument("--seed", type=int, default=1, help="questions and upstream draws (1)")
    parser.add_argument("--json", type=Path, default=None, help="results file")
    parser.add_argument("--keep-logs", action="store_true", help="keep the configs and logs")
    parser.add_argument(
        "--overhead", action="store_true", help="only time one decision's added CPU (no servers)"
    )
    args = parser.parse_args(argv)
    modes = parse_modes(parser, args.modes, MODES)
    workloads = parse_modes(parser, args.workloads, WORKLOADS)
    duration = 35.0 if args.quick else args.duration
    if duration <= 0 or args.users <= 0 or args.rate <= 0 or args.think <= 0:
        parser.error("--duration, --users, --rate and --think must be > 0")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Options(
        modes=modes,
        workloads=workloads,
        duration_s=duration,
        users=args.users,
        think_s=args.think,
        rate=args.rate,
        seed=args.seed,
        json_path=args.json or RESULTS_DIR / f"affinity-{stamp}.json",
        keep_logs=args.keep_logs,
        overhead=args.overhead,
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.overhead:
        micro.print_table(micro.measure())
        return 0
    pin, warning = pin_client()
    logs = Path(tempfile.mkdtemp(prefix="tailguard-affinity-"))
    results: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        with sigterm_as_interrupt():
            for workload in opts.workloads:
                for mode in opts.modes:
                    if workload == "independent" and mode not in INDEPENDENT_MODES:
                        continue
                    print(f"{workload} / {mode}: {opts.duration_s:g} s ...", flush=True)
                    where = logs / f"{workload}-{mode}"
                    where.mkdir()
                    result = run(workload, mode, opts, pin, where)
                    results.setdefault(workload, {})[mode] = result
                    ttft = result["ttft_ms"]
                    print(
                        f"  {result['requests']} requests, TTFT p50 {fmt(ttft.get('p50'))} ms, "
                        f"p99 {fmt(ttft.get('p99'))} ms",
                        flush=True,
                    )
    except (KeyboardInterrupt, RuntimeError, OSError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"logs kept in {logs}", file=sys.stderr)
        return 2
    verdicts = report(opts, results)
    document = {
        "benchmark": "affinity",
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "options": {
            "modes": opts.modes,
            "workloads": opts.workloads,
            "duration_s": opts.duration_s,
            "users": opts.users,
            "think_s": opts.think_s,
            "rate": opts.rate,
            "seed": opts.seed,
            "max_tokens": MAX_TOKENS,
            "metrics_interval_s": METRICS_INTERVAL_S,
            "pinned": warning is None,
        },
        "profile": PROFILE,
        "environment": environment(),
        "results": results,
        "targets": verdicts,
    }
    write_results(opts.json_path, document, logs, opts.keep_logs)
    return 0 if all(v["pass"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
