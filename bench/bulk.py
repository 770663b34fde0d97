"""Bulk traffic: what micro-batching buys, and what bulk work costs interactive users.

Scenario. One simulated GPU server (`tailguard sim`, a process of its own) with one model,
`shared`, that serves both embeddings and chat from one pool of `max_batch` = 4 slots (vLLM's
`max_num_seqs`): an embeddings call holds a slot for 20 ms + 0.2 ms per input; a chat sequence
holds one through prefill (60 ms + 0.2 ms per prompt token) and decode (16 tokens, 10 ms each).
Chat and embeddings share the slots because they name the same simulated model (the simulator
keeps one pool per model name and `max_batch`), so bulk embeddings, bulk chat and interactive
chat compete for the same capacity, as they would on one GPU server. The gateway (`tailguard
serve`, a real process) reaches it as a provider of `type: vllm` whose `/metrics` it reads
every 0.25 s, and serves two model names on that one deployment (`gpu/shared`):

- `embed`, with `batching: {max_batch_size: 64, max_wait_ms: 10, max_inflight: 4}`;
- `chat`, with a TTFT budget of 250 ms and `on_ttft_miss: none` (one deployment: nothing to
  fail over to). `routing.bulk` keeps its defaults but for `embedding_inputs_per_slot: 64` (the
  simulator embeds a whole call on one slot, so a micro-batch weighs one slot-equivalent, as a
  bulk chat does).

Three server modes, each its own simulator, all in every run of part B:

- `fifo`: `scheduling_policy: fcfs`, first come, first served; the gateway sends no priority.
  Nothing but the gateway's admission keeps an interactive request from queueing behind bulk.
- `priority`: vLLM V1 as released: `scheduling_policy: priority` (`priority_preemption:
  kv_cache`), and the provider's `bulk_priority: 10`. The server serves interactive requests
  before waiting bulk, but preempts only for KV-cache room: with every slot taken by bulk an
  interactive request waits for a bulk sequence to end (vllm-project/vllm issue #40004).
- `priority-preempt`: the same with `priority_preemption: max_num_seqs`, a server that also
  preempts a running bulk sequence for an interactive request at a full batch (what vLLM's open
  pull requests propose).

Batched versus unbatched is the same model and the same deployment, told apart by the request
header alone: with `x-tailguard-priority: bulk` an embeddings request goes through the
deployment's micro-batch queue; without it (the model's priority is `interactive`) it goes
upstream on its own.

Part A (fifo server). `--requests` (2,000) single-input embeddings requests from `--workers`
(64) clients back to back (closed loop), unbatched and then batched: throughput, latency
p50/p99, and inputs per upstream call. Target: batched throughput >= 5x unbatched.

Part B, per server mode. Interactive streaming chat, Poisson arrivals at `--rps` (4/s), for
`--duration` seconds: TTFT from each request's scheduled send time to its first content event (a
request that got no first token ranks above every answered one). Phases: (a) `alone`; (b) `bulk
alone`: the bulk load and no interactive traffic, for its unloaded throughput; (c) `with bulk`:
interactive chat while bulk traffic saturates the server: 16 clients sending non-streaming bulk
chat requests (through the gate) back to back. The bulk clients run in a process of their own,
started `--ramp` seconds before the measurement (so interactive users arrive at a server
already busy with a batch job, as they do); their throughput is over their whole run, the ramp
included, in (b) and (c) alike. Targets: priority: TTFT p99 (c) <= 1.3x (a) and bulk throughput
(c) >= 50% of (b); priority-preempt: <= 1.2x and >= 70%; fifo: TTFT p99 (c) <= 2x (a). The p99
of the requests due 5 s or more into the window ("settled") is shown too. Unless
`--no-diagnostics`, also: bulk embeddings (64 clients of 8-input requests, micro-batched) alone
and with the bulk chat, and a what-if with bulk capped statically
(`routing.bulk.max_concurrency: 1`, `max_inflight: 1`).
Every phase gets a fresh gateway (no gate limit or latency window carried over). The gate's
limit (`tailguard_bulk_concurrency_limit`) and queue are sampled every 250 ms.

The gateway is pinned to CPU 0; the upstreams and the load generators share CPU 1. Percentiles
are nearest rank. A Markdown table and PASS/MISS per target are printed; the results go to
`bench/results/bulk-<timestamp>.json`. Exit status: 0 when every target passes, 1 when one
misses, 2 when the run failed.

    .venv/bin/python bench/bulk.py                     # ~15 minutes
    .venv/bin/python bench/bulk.py --quick             # ~5 minutes: 500 requests, 15 s per phase
    .venv/bin/python bench/bulk.py --parts B --no-diagnostics --duration 60
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

if not __package__:  # `python bench/<script>.py`: `bench` is imported from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench._bulk_phase import CHILD_FLAG, Window, run_child, run_phase
from bench._bulk_report import report, verdicts
from bench._bulk_setup import (
    BULK_CHAT_CLIENTS,
    BULK_EMBED_CLIENTS,
    BULK_EMBED_INPUTS,
    CAPPED_BULK,
    CAPPED_INFLIGHT,
    FULL_MIX,
    MODES,
    BulkMix,
    ServerMode,
    batch_totals,
    embed_request,
    gateway_config,
)
from bench._harness import RESULTS_DIR, environment, sigterm_as_interrupt, write_results
from gateway.tools.load import Client, LoadResult, Request, closed_loop, run_load
from gateway.tools.stack import Stack, cpu_layout, start_gateway, start_sim, taskset

BUSY_LOAD: Final = 0.7  # 1-minute load average above which the machine is not quiet


# --- part A --------------------------------------------------------------------------------------


def part_a(port: int, opts: Options, cpu: int | None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for label, bulk in (("unbatched", False), ("batched", True)):
        request = embed_request(1, bulk=bulk)
        print(f"part A, {label}: {opts.requests} requests from {opts.workers} clients ...")
        before = batch_totals(port)

        async def load(request: Request = request) -> LoadResult:
            async with Client(port) as client:
                await client.warm_up(request, opts.workers, width=opts.workers)
                return await closed_loop(
                    client, request, concurrency=opts.workers, requests=opts.requests
                )

        result = run_load(load, cpu=cpu)
        after = batch_totals(port)
        calls = after[1] - before[1]
        summary = result.summary()
        # Batched: from the gateway's batch-size histogram (the warm-up included); unbatched:
        # every request is an upstream call of one input.
        summary["inputs_per_call"] = (after[0] - before[0]) / calls if calls else 1.0
        results[label] = summary
        latency = summary["latency_ms"]
        print(
            f"  {result.ok} ok, {result.errors} errors, {result.throughput_rps:.0f} req/s, "
            f"p50 {latency.get('p50', 0):.1f} ms, p99 {latency.get('p99', 0):.1f} ms"
        )
    results["speedup"] = results["batched"]["throughput_rps"] / max(
        results["unbatched"]["throughput_rps"], 1e-9
    )
    return results


# --- part B --------------------------------------------------------------------------------------


def phases_of(opts: Options) -> list[tuple[str, BulkMix | None, dict[str, Any], bool]]:
    """(name, bulk mix, gateway overrides, interactive traffic) per phase."""
    phases: list[tuple[str, BulkMix | None, dict[str, Any], bool]] = [
        ("alone", None, {}, True),
        ("bulk alone", FULL_MIX, {}, False),
        ("with bulk", FULL_MIX, {}, True),
    ]
    if opts.diagnostics:
        phases += [
            ("bulk embeddings only", BulkMix("embeddings", BULK_EMBED_CLIENTS, 0), {}, True),
            (
                "bulk embeddings + chat",
                BulkMix("embeddings + chat", BULK_EMBED_CLIENTS, BULK_CHAT_CLIENTS),
                {},
                True,
            ),
            (
                "with bulk, capped (what-if)",
                FULL_MIX,
                {"bulk": CAPPED_BULK, "inflight": CAPPED_INFLIGHT},
                True,
            ),
        ]
    return phases


def part_b(
    mode: ServerMode,
    sim_port: int,
    sim_pid: int,
    opts: Options,
    cpus: Mapping[str, int],
    logs: Path,
) -> dict[str, dict[str, Any]]:
    window = Window(opts.rps, opts.duration_s, opts.ramp_s, opts.seed)
    phases: dict[str, dict[str, Any]] = {}
    for name, mix, overrides, interactive in phases_of(opts):
        # A fresh gateway per phase: no gate limit or latency window carried over.
        label = "".join(c for c in name if c.isalnum() or c == " ").replace(" ", "-")
        folder = logs / f"{mode.name}-{label}"
        folder.mkdir(exist_ok=True)
        stack = Stack(folder, taskset(cpus))
        try:
            port, gateway = start_gateway(stack, gateway_config(sim_port, mode, **overrides))
            what = f"interactive chat at {opts.rps:g}/s" if interactive else "no interactive"
            bulk = "" if mix is None else f" + bulk {mix.name}"
            print(f"part B, {mode.name}, {name}: {what}{bulk}, {opts.duration_s:g} s ...")
            pids = {"gateway": gateway.pid, "upstream": sim_pid}
            phase = run_phase(port, pids, window, cpus, mix, stack, interactive=interactive)
        finally:
            stack.stop()
        phase["gateway_overrides"] = overrides
        phases[name] = phase
        ttft = phase["ttft_ms"]
        if ttft is not None:
            print(
                f"  TTFT p50 {ttft['p50']}, p99 {ttft['p99']} ms, "
                f"{phase['interactive']['errors']} errors"
            )
    return phases


# --- entry point ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Options:
    parts: str
    modes: tuple[str, ...]
    requests: int
    workers: int
    rps: float
    duration_s: float
    ramp_s: float
    diagnostics: bool
    seed: int
    json_path: Path
    keep_logs: bool


def parse_args(argv: Sequence[str]) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="500 requests, 15 s per phase")
    parser.add_argument("--parts", default="AB", help="A, B or AB (AB)")
    every = ",".join(m.name for m in MODES)
    parser.add_argument("--modes", default=every, help=f"part B server modes ({every})")
    parser.add_argument("--requests", type=int, default=None, help="part A requests (2000)")
    parser.add_argument("--workers", type=int, default=64, help="part A clients (64)")
    parser.add_argument("--rps", type=float, default=4.0, help="interactive chats per second (4)")
    parser.add_argument("--duration", type=float, default=None, help="part B s per phase (60)")
    parser.add_argument("--ramp", type=float, default=3.0, help="bulk runs this long first (3)")
    parser.add_argument(
        "--no-diagnostics", action="store_true", help="part B: only alone, bulk alone and with bulk"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="bench/results/bulk-<time>.json")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    parts = args.parts.upper()
    if not parts or set(parts) - {"A", "B"}:
        parser.error("--parts: A, B or AB")
    requests = args.requests or (500 if args.quick else 2000)
    duration = args.duration or (15.0 if args.quick else 60.0)
    if requests <= 0 or args.workers <= 0 or args.rps <= 0 or duration <= 0 or args.ramp < 0:
        parser.error("--requests, --workers, --rps and --duration must be > 0, --ramp >= 0")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or set(modes) - {m.name for m in MODES}:
        parser.error(f"--modes: some of {every}")
    return Options(
        parts=parts,
        modes=modes,
        requests=requests,
        workers=args.workers,
        rps=args.rps,
        duration_s=duration,
        ramp_s=args.ramp,
        diagnostics=not args.no_diagnostics,
        seed=args.seed,
        json_path=args.json or RESULTS_DIR / f"bulk-{stamp}.json",
        keep_logs=args.keep_logs,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [CHILD_FLAG]:
        return run_child(args[1:])
    opts = parse_args(args)
    cpus = cpu_layout()
    if not cpus:
        print("warning: fewer than two CPUs: running unpinned", file=sys.stderr)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load_start is not None and load_start > BUSY_LOAD:
        print(
            f"warning: load average {load_start:.2f} before the start: something else is "
            "running, and the latencies will show it",
            file=sys.stderr,
        )
    logs = Path(tempfile.mkdtemp(prefix="tailguard-bulk-"))
    a: dict[str, Any] | None = None
    b: dict[str, dict[str, dict[str, Any]]] | None = None
    try:
        with sigterm_as_interrupt():
            for index, mode in enumerate(m for m in MODES if m.name in opts.modes):
                # One simulator per server mode, for its part of the run.
                (logs / f"sim-{mode.name}").mkdir()
                sim = Stack(logs / f"sim-{mode.name}", taskset(cpus))
                try:
                    sim_port = start_sim(sim, mode.profile(), seed=opts.seed)
                    if "A" in opts.parts and index == 0:
                        (logs / "part-a").mkdir()
                        stack = Stack(logs / "part-a", taskset(cpus))
                        try:
                            port, _ = start_gateway(stack, gateway_config(sim_port, mode))
                            a = part_a(port, opts, cpus.get("load"))
                        finally:
                            stack.stop()
                    if "B" in opts.parts:
                        b = b or {}
                        b[mode.name] = part_b(mode, sim_port, sim.procs[0].pid, opts, cpus, logs)
                finally:
                    sim.stop()
    except (KeyboardInterrupt, RuntimeError, OSError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"logs kept in {logs}", file=sys.stderr)
        return 2
    checks = verdicts(a, b)
    report(opts, a, b, checks)
    document = {
        "benchmark": "bulk",
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "options": {
            "parts": opts.parts,
            "modes": list(opts.modes),
            "requests": opts.requests,
            "workers": opts.workers,
            "rps": opts.rps,
            "duration_s": opts.duration_s,
            "ramp_s": opts.ramp_s,
            "seed": opts.seed,
            "pinned": cpus,
        },
        "upstream_profiles": {m.name: m.profile() for m in MODES if m.name in opts.modes},
        "gateway_configs": {m.name: gateway_config(0, m) for m in MODES if m.name in opts.modes},
        "what_if": {"routing.bulk": dict(CAPPED_BULK), "max_inflight": CAPPED_INFLIGHT},
        "bulk_load": {
            "embed_clients": BULK_EMBED_CLIENTS,
            "embed_inputs_per_request": BULK_EMBED_INPUTS,
            "chat_clients": BULK_CHAT_CLIENTS,
        },
        "environment": {
            **environment(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
        "part_a": a,
        "part_b": b,
        "targets": checks,
    }
    write_results(opts.json_path, document, logs, opts.keep_logs)
    return 0 if all(check["pass"] for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
