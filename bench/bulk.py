"""Bulk traffic: what micro-batching buys, and what bulk work costs interactive users.

Scenario. One simulated GPU server (`tailguard sim`, a process of its own) with one model,
`shared`, that serves both embeddings and chat from one pool of `max_batch` = 4 slots, FIFO:
an embeddings call holds a slot for 20 ms + 0.2 ms per input; a chat sequence holds one through
prefill (50 ms) and decode (16 tokens at 200 tokens/s, each step up to 50% slower as the pool
fills, `batch_slowdown`). Chat and embeddings share the slots because they name the same
simulated model (the simulator keeps one pool per model name and `max_batch`), so bulk
embeddings, bulk chat and interactive chat compete for the same capacity, as they would on one
GPU server. The gateway (`tailguard serve`, a real process) serves two model names on that one
deployment (`gpu/shared`):

- `embed`, with `batching: {max_batch_size: 64, max_wait_ms: 10, max_inflight: 4}`;
- `chat`, with a TTFT budget of 150 ms (about 3x its unloaded TTFT) and `on_ttft_miss: none`
  (one deployment: nothing to fail over to). `routing.bulk` keeps its defaults: one AIMD
  limit per deployment, shared by bulk chat requests and micro-batches (each takes one slot),
  starting at 4, halved when an interactive TTFT passes 80% of its budget, grown by one while
  they stay under 50% or no interactive request has been seen for a second.

Batched versus unbatched is the same model and the same deployment, told apart by the request
header alone: with `x-tailguard-priority: bulk` an embeddings request goes through the
deployment's micro-batch queue; without it (the model's priority is `interactive`) it goes
upstream on its own. A second model name without `batching` would not give an unbatched path:
the gateway keys its batch queues by deployment, so a bulk request to any model on a batched
deployment is batched.

Part A. `--requests` (2,000) single-input embeddings requests from `--workers` (64) clients back
to back (closed loop), unbatched and then batched: throughput, latency p50/p99, and inputs per
upstream call. Target: batched throughput >= 5x unbatched.

Part B. Interactive streaming chat, Poisson arrivals at `--rps` (5/s), for `--duration` seconds:
TTFT from each request's scheduled send time to its first content event (a request that got no first
token ranks above every answered one). (a) alone; (b) while bulk traffic saturates the server: 64
clients sending 8-input bulk embeddings requests back to back (512 inputs in play, so the batch
queue always has four full batches in flight and the upstream, not the gateway's CPU, is what
saturates) and 16 clients sending non-streaming bulk chat requests (through the AIMD gate, as the
batches are) back to back. The bulk clients run in a process of their own, started `--ramp` seconds
before the measurement (so interactive users arrive at a server already busy with a batch job, as
they do). Target: TTFT p99 (b) <= 1.2x (a), over the whole window; the p99 of the requests due 5 s
or more into it ("settled") is shown too, to tell the gate's reaction to the first interactive
requests from its steady state. Unless `--no-diagnostics`, also: the two kinds of bulk work one at a
time (which one hurts), and a what-if with bulk capped statically
(`routing.bulk.max_concurrency: 1`, `max_inflight: 1`). Every phase gets a fresh gateway (no gate
limit or latency window carried over). While bulk runs, the gate's limit
(`tailguard_bulk_concurrency_limit`) and queue are sampled every 250 ms.

The gateway is pinned to CPU 0; the upstream and the load generators share CPU 1. Percentiles
are nearest rank. A Markdown table and PASS/MISS per target are printed; the results go to
`bench/results/bulk-<timestamp>.json`. Exit status: 0 when every target passes, 1 when one
misses, 2 when the run failed.

    .venv/bin/python bench/bulk.py                     # ~6 minutes
    .venv/bin/python bench/bulk.py --quick             # ~2 minutes: 500 requests, 15 s per phase
    .venv/bin/python bench/bulk.py --parts B --no-diagnostics --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gateway.sketch import nearest_rank
from gateway.tools.load import (
    Client,
    LoadResult,
    Request,
    closed_loop,
    open_loop,
    poisson_arrivals,
    run_load,
)
from gateway.tools.stack import (
    Stack,
    cpu_layout,
    metric_samples,
    proc_cpu_s,
    start_gateway,
    start_sim,
    taskset,
)

try:  # `python -m bench.bulk` or `python bench/bulk.py`
    from bench._harness import (
        RESULTS_DIR,
        environment,
        sigterm_as_interrupt,
        write_results,
    )
except ImportError:
    from _harness import (  # type: ignore[no-redef,unused-ignore,import-not-found]
        RESULTS_DIR,
        environment,
        sigterm_as_interrupt,
        write_results,
    )

CHILD_FLAG: Final = "--load-child"

DEPLOYMENT: Final = "gpu/shared"
EMBED_MODEL: Final = "embed"
CHAT_MODEL: Final = "chat"
# One simulated server: embeddings and chat share its 4 slots (same model name, same max_batch).
SIM_PROFILE: Final[Mapping[str, float | int]] = {
    "max_batch": 4,
    "embed_base_ms": 20,
    "embed_ms_per_input": 0.2,
    "embedding_dims": 16,
    "prefill_base_ms": 50,
    "tokens_per_s": 200,
    "output_tokens": 16,
    "batch_slowdown": 0.5,
}
BATCHING: Final[Mapping[str, int]] = {
    "max_batch_size": 64,
    "max_wait_ms": 10,
    "max_inflight": 4,
    "max_queue": 4096,
}
TTFT_BUDGET_MS: Final = 150
CHAT_TOKENS: Final = 16
BULK_EMBED_CLIENTS: Final = 64
BULK_EMBED_INPUTS: Final = 8
BULK_CHAT_CLIENTS: Final = 16
# The what-if: bulk capped statically instead of steered.
CAPPED_BULK: Final[Mapping[str, int]] = {
    "initial_concurrency": 1,
    "min_concurrency": 1,
    "max_concurrency": 1,
}
CAPPED_INFLIGHT: Final = 1
SPEEDUP_TARGET: Final = 5.0
TTFT_RATIO_TARGET: Final = 1.2
GATE_SAMPLE_S: Final = 0.25
SETTLE_S: Final = 5.0  # "settled" TTFT: requests due this long or more into the window
NOISY_LAG_MS: Final = 10.0
BUSY_LOAD: Final = 0.7  # 1-minute load average above which the machine is not quiet


# --- the stack -----------------------------------------------------------------------------------


def gateway_config(
    sim_port: int, *, bulk: Mapping[str, int] | None = None, inflight: int | None = None
) -> dict[str, Any]:
    batching = dict(BATCHING)
    if inflight is not None:
        batching["max_inflight"] = inflight
    provider, model = DEPLOYMENT.split("/")
    deployment = {"provider": provider, "model": model}
    return {
        "server": {"host": "127.0.0.1", "access_log": False, "reload_on_change": False},
        "latency": {"store": "memory"},
        "providers": {provider: {"type": "openai", "base_url": f"http://127.0.0.1:{sim_port}/v1"}},
        "routing": {"bulk": dict(bulk or {})},
        "models": [
            {"name": EMBED_MODEL, "deployments": [deployment], "batching": batching},
            {
                "name": CHAT_MODEL,
                "deployments": [deployment],
                "budget": {"ttft_ms": TTFT_BUDGET_MS},
                "on_ttft_miss": "none",
            },
        ],
    }


def embed_request(inputs: int, *, bulk: bool) -> Request:
    text = "a document to index"
    request = Request.embeddings(EMBED_MODEL, text, bulk=bulk)
    if inputs == 1:
        return request
    body = json.dumps({"model": EMBED_MODEL, "input": [f"{text} {i}" for i in range(inputs)]})
    return Request(
        request.path, body.encode(), headers=request.headers, expect="embeddings", inputs=inputs
    )


def interactive_request() -> Request:
    return Request.chat(CHAT_MODEL, stream=True, max_tokens=CHAT_TOKENS, text="Hello there")


def bulk_chat_request() -> Request:
    return Request.chat(CHAT_MODEL, stream=False, bulk=True, max_tokens=CHAT_TOKENS)


def batch_totals(port: int) -> tuple[float, float]:
    """(inputs, upstream calls) the gateway has batched for the deployment so far."""
    label = f'deployment="{DEPLOYMENT}"'
    sums = metric_samples(port, "tailguard_batch_size_sum")
    counts = metric_samples(port, "tailguard_batch_size_count")
    return (
        sum(v for k, v in sums.items() if label in k),
        sum(v for k, v in counts.items() if label in k),
    )


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


@dataclass(frozen=True, slots=True)
class BulkMix:
    name: str
    embed_clients: int
    chat_clients: int


def bulk_loads(mix: BulkMix) -> list[dict[str, Any]]:
    loads = []
    if mix.embed_clients:
        r = embed_request(BULK_EMBED_INPUTS, bulk=True)
        loads.append(
            {
                "name": "bulk embeddings",
                "path": r.path,
                "body": r.body.decode(),
                "headers": dict(r.headers),
                "inputs": r.inputs,
                "expect": r.expect,
                "concurrency": mix.embed_clients,
            }
        )
    if mix.chat_clients:
        r = bulk_chat_request()
        loads.append(
            {
                "name": "bulk chat",
                "path": r.path,
                "body": r.body.decode(),
                "headers": dict(r.headers),
                "inputs": 1,
                "expect": r.expect,
                "concurrency": mix.chat_clients,
            }
        )
    return loads


def run_child(argv: Sequence[str]) -> int:
    """The bulk load process: closed loops from the JSON spec in argv[0]; one JSON object out."""
    spec = json.loads(argv[0])
    port, duration = int(spec["port"]), float(spec["duration_s"])

    async def one(load: dict[str, Any]) -> LoadResult:
        request = Request(
            load["path"],
            load["body"].encode(),
            headers=load["headers"],
            expect=load["expect"],
            inputs=load["inputs"],
        )
        async with Client(port) as client:
            return await closed_loop(
                client, request, concurrency=load["concurrency"], duration_s=duration
            )

    async def main() -> list[LoadResult]:
        return list(await asyncio.gather(*(one(load) for load in spec["loads"])))

    results = run_load(main)
    out = {
        load["name"]: {**r.summary(), "inputs_per_request": load["inputs"]}
        for load, r in zip(spec["loads"], results, strict=True)
    }
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


class GateSampler:
    """Reads the bulk gate's limit and queue from /metrics every GATE_SAMPLE_S, in a thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.limits: list[float] = []
        self.waiting: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gate-sampler", daemon=True)

    def _run(self) -> None:
        label = f'{{deployment="{DEPLOYMENT}"}}'
        while not self._stop.wait(GATE_SAMPLE_S):
            with contextlib.suppress(OSError, ValueError):
                limit = metric_samples(self.port, "tailguard_bulk_concurrency_limit").get(label)
                waiting = metric_samples(self.port, "tailguard_bulk_waiting").get(label)
                if limit is not None:
                    self.limits.append(limit)
                if waiting is not None:
                    self.waiting.append(waiting)

    def __enter__(self) -> GateSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, slots: int) -> dict[str, Any] | None:
        if not self.limits:
            return None
        return {
            "samples": len(self.limits),
            "limit_min": min(self.limits),
            "limit_median": statistics.median(self.limits),
            "limit_max": max(self.limits),
            # How often the gate let in at least as many bulk chats as the server has slots.
            "share_at_or_above_slots": sum(v >= slots for v in self.limits) / len(self.limits),
            "waiting_median": statistics.median(self.waiting) if self.waiting else None,
        }


def ttft_summary(result: LoadResult, after_s: float = 0.0) -> dict[str, Any]:
    """TTFT percentiles in ms of the requests due `after_s` or later into the window; a request
    without a first token (any time) ranks above every answered one (a percentile landing on
    one is None), so failing cannot look fast."""
    ordered = sorted(
        v for v, at in zip(result.ttfts_ms, result.ttft_at_s, strict=True) if at >= after_s
    )
    missing = result.ok + result.errors - len(result.ttfts_ms)
    n = len(ordered) + missing
    out: dict[str, Any] = {"count": n, "missing": missing}
    for label, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        rank = nearest_rank(q, n) if n else 0
        out[label] = ordered[rank - 1] if 0 < rank <= len(ordered) else None
    out["max"] = ordered[-1] if ordered and not missing else None
    return out


def interactive_phase(
    port: int,
    gateway_pid: int,
    sim_pid: int,
    opts: Options,
    cpus: Mapping[str, int],
    mix: BulkMix | None,
    stack: Stack,
) -> dict[str, Any]:
    """Interactive chat for opts.duration_s, alone or with `mix` running in a child process."""
    child: subprocess.Popen[bytes] | None = None
    if mix is not None:
        spec = {
            "port": port,
            "duration_s": opts.ramp_s + opts.duration_s + 1.0,
            "loads": bulk_loads(mix),
        }
        child = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), CHILD_FLAG, json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        stack.procs.append(child)  # stopped with the rest if anything goes wrong
        if "load" in cpus and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(child.pid, {cpus["load"]})
        time.sleep(opts.ramp_s)
    batched0 = batch_totals(port)
    watched = {"gateway": gateway_pid, "upstream": sim_pid}
    if child is not None:
        watched["bulk load"] = child.pid
    cpu0, wall0 = {k: proc_cpu_s(p) for k, p in watched.items()}, time.perf_counter()

    async def load() -> LoadResult:
        request = interactive_request()
        async with Client(port) as client:
            await client.warm_up(request, 0 if mix is not None else 3)
            arrivals = poisson_arrivals(opts.rps, opts.duration_s, opts.seed)
            return await open_loop(client, request, arrivals, duration_s=opts.duration_s)

    with GateSampler(port) as sampler:
        result = run_load(load, cpu=cpus.get("load"))
    cpu1, wall1 = {k: proc_cpu_s(p) for k, p in watched.items()}, time.perf_counter()
    batched1 = batch_totals(port)
    cpu: dict[str, float | None] = {}
    for key in watched:
        start, end = cpu0[key], cpu1[key]
        cpu[key] = (end - start) / (wall1 - wall0) if start is not None and end else None
    phase: dict[str, Any] = {
        "bulk": None,
        "interactive": result.summary(),
        "ttft_ms": ttft_summary(result),
        # Once the gate has had SETTLE_S to react to the first interactive requests.
        "ttft_ms_settled": ttft_summary(result, SETTLE_S),
        "ttft_at_s": [round(v, 3) for v in result.ttft_at_s],
        "ttfts_ms": [round(v, 2) for v in result.ttfts_ms],
        "cpu_share": cpu,  # of one CPU, over the measured window
        "gateway_cpu": cpu["gateway"],
        "gate": sampler.summary(int(SIM_PROFILE["max_batch"])),
        "gate_limit_samples": sampler.limits,
    }
    calls = batched1[1] - batched0[1]
    phase["batched_inputs_per_call"] = (batched1[0] - batched0[0]) / calls if calls else None
    if mix is not None and child is not None:
        phase["bulk"] = {
            "embed_clients": mix.embed_clients,
            "embed_inputs_per_request": BULK_EMBED_INPUTS,
            "chat_clients": mix.chat_clients,
        }
        out, err = child.communicate(timeout=opts.ramp_s + opts.duration_s + 120)
        with contextlib.suppress(ValueError):
            stack.procs.remove(child)
        if child.returncode != 0:
            raise RuntimeError(f"bulk load failed: {err.decode(errors='replace')[-2000:]}")
        phase["bulk_results"] = json.loads(out)
    return phase


def part_b(
    sim_port: int, sim_pid: int, opts: Options, cpus: Mapping[str, int], logs: Path
) -> dict[str, dict[str, Any]]:
    mixes: list[tuple[str, BulkMix | None, dict[str, Any]]] = [
        ("alone", None, {}),
        ("with bulk", BulkMix("embeddings + chat", BULK_EMBED_CLIENTS, BULK_CHAT_CLIENTS), {}),
    ]
    if opts.diagnostics:
        mixes += [
            ("bulk embeddings only", BulkMix("embeddings", BULK_EMBED_CLIENTS, 0), {}),
            ("bulk chat only", BulkMix("chat", 0, BULK_CHAT_CLIENTS), {}),
            (
                "with bulk, capped (what-if)",
                BulkMix("embeddings + chat", BULK_EMBED_CLIENTS, BULK_CHAT_CLIENTS),
                {"bulk": CAPPED_BULK, "inflight": CAPPED_INFLIGHT},
            ),
        ]
    phases: dict[str, dict[str, Any]] = {}
    for name, mix, overrides in mixes:
        # A fresh gateway per phase: no gate limit or latency window carried over.
        folder = logs / name.replace(" ", "-").replace(",", "").replace("(", "").replace(")", "")
        folder.mkdir(exist_ok=True)
        stack = Stack(folder, taskset(cpus))
        try:
            port, gateway = start_gateway(stack, gateway_config(sim_port, **overrides))
            gateway_pid = gateway.pid
            bulk = "" if mix is None else f" + bulk {mix.name}"
            print(
                f"part B, {name}: interactive chat at {opts.rps:g}/s{bulk}, "
                f"{opts.duration_s:g} s ..."
            )
            phase = interactive_phase(port, gateway_pid, sim_pid, opts, cpus, mix, stack)
        finally:
            stack.stop()
        phase["gateway_overrides"] = overrides
        phases[name] = phase
        ttft = phase["ttft_ms"]
        print(
            f"  TTFT p50 {fmt_ms(ttft['p50'])}, p99 {fmt_ms(ttft['p99'])}, "
            f"{phase['interactive']['errors']} errors"
        )
    return phases


# --- the report ----------------------------------------------------------------------------------


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def fmt_ms(value: float | None) -> str:
    return "no token" if value is None else f"{value:.1f} ms"


def verdicts(a: dict[str, Any] | None, b: dict[str, dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    if a is not None:
        out.append(
            {
                "target": f"batched throughput >= {SPEEDUP_TARGET:g}x unbatched",
                "value": a["speedup"],
                "limit": SPEEDUP_TARGET,
                "pass": a["speedup"] >= SPEEDUP_TARGET,
            }
        )
    if b is not None:
        alone = b["alone"]["ttft_ms"]["p99"]
        loaded = b["with bulk"]["ttft_ms"]["p99"]
        ratio = loaded / alone if alone and loaded is not None else None
        out.append(
            {
                "target": f"interactive TTFT p99 with bulk <= {TTFT_RATIO_TARGET:g}x without",
                "value": ratio,
                "limit": TTFT_RATIO_TARGET,
                "pass": ratio is not None and ratio <= TTFT_RATIO_TARGET,
            }
        )
    return out


def report(
    opts: Options,
    a: dict[str, Any] | None,
    b: dict[str, dict[str, Any]] | None,
    checks: list[dict[str, Any]],
) -> None:
    print()
    print(
        "Upstream: one `tailguard sim`, 4 slots shared FIFO by embeddings (20 ms + 0.2 ms/input) "
        "and chat (50 ms prefill, 16 tokens at 200/s); gateway batching "
        f"max_batch_size {BATCHING['max_batch_size']}, max_wait_ms {BATCHING['max_wait_ms']}, "
        f"max_inflight {BATCHING['max_inflight']}"
    )
    if a is not None:
        print()
        print(
            f"Part A: {opts.requests} single-input embeddings requests, {opts.workers} clients "
            "back to back"
        )
        print()
        print("| path | throughput (req/s) | p50 | p99 | inputs per upstream call | errors |")
        print("|---|---:|---:|---:|---:|---:|")
        for label in ("unbatched", "batched"):
            r = a[label]
            latency = r["latency_ms"]
            print(
                f"| {label} | {r['throughput_rps']:.0f} | {fmt_ms(latency.get('p50'))} "
                f"| {fmt_ms(latency.get('p99'))} | {r['inputs_per_call']:.1f} | {r['errors']} |"
            )
        print(f"\nspeedup: {a['speedup']:.1f}x")
    if b is not None:
        print()
        print(
            f"Part B: interactive streaming chat, {opts.rps:g}/s Poisson, {opts.duration_s:g} s "
            f"per phase; TTFT budget {TTFT_BUDGET_MS} ms; bulk = {BULK_EMBED_CLIENTS} clients x "
            f"{BULK_EMBED_INPUTS}-input embeddings + {BULK_CHAT_CLIENTS} clients of bulk chat"
        )
        print()
        print(
            f"| phase | TTFT p50 | p90 | p99 | p99 vs alone | p99 after {SETTLE_S:g} s "
            "| errors | bulk embeddings (inputs/s) | bulk chat (req/s) "
            "| gate limit min/median/max | gateway CPU |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
        alone = b["alone"]["ttft_ms"]["p99"]
        for name, phase in b.items():
            ttft = phase["ttft_ms"]
            ratio = f"{ttft['p99'] / alone:.2f}x" if ttft["p99"] is not None and alone else "-"
            bulk = phase.get("bulk_results") or {}
            emb = bulk.get("bulk embeddings")
            chat = bulk.get("bulk chat")
            emb_s = f"{emb['throughput_rps'] * emb['inputs_per_request']:.0f}" if emb else "-"
            chat_s = f"{chat['throughput_rps']:.1f}" if chat else "-"
            gate = phase["gate"]
            gate_s = (
                f"{gate['limit_min']:.0f} / {gate['limit_median']:.0f} / {gate['limit_max']:.0f}"
                if gate
                else "-"
            )
            cpu = phase["gateway_cpu"]
            settled = phase["ttft_ms_settled"]["p99"]
            settled_s = fmt_ms(settled) + (
                f" ({settled / alone:.2f}x)" if settled is not None and alone else ""
            )
            if not phase["ttft_ms_settled"]["count"]:
                settled_s = "-"  # the window is shorter than SETTLE_S
            print(
                f"| {name} | {fmt_ms(ttft['p50'])} | {fmt_ms(ttft['p90'])} "
                f"| {fmt_ms(ttft['p99'])} | {ratio} | {settled_s} "
                f"| {phase['interactive']['errors']} "
                f"| {emb_s} | {chat_s} | {gate_s} | {'-' if cpu is None else f'{cpu:.0%}'} |"
            )
        for name, phase in b.items():
            shares = phase["cpu_share"]
            side = sum(v or 0.0 for k, v in shares.items() if k != "gateway")
            if side > 0.8:
                print(
                    f"{name}: warning: CPU 1 (upstream {shares['upstream'] or 0:.0%}, bulk load "
                    f"{shares.get('bulk load') or 0:.0%}) was busy: the upstream's timers may "
                    "run late"
                )
            lag = (phase["interactive"].get("send_lag_ms") or {}).get("p99", 0.0)
            if lag > NOISY_LAG_MS:
                print(f"{name}: warning: the client started requests late (p99 {lag:.1f} ms)")
            for load in (phase.get("bulk_results") or {}).values():
                if load["errors"]:
                    print(f"{name}: bulk errors {load['errors']}: {load['error_samples'][:1]}")
            if phase["interactive"]["errors"]:
                print(f"{name}: interactive errors: {phase['interactive']['error_samples'][:1]}")
        for name, phase in b.items():
            gate = phase["gate"]
            if gate and "bulk chat" in (phase.get("bulk_results") or {}):
                print(
                    f"{name}: gate limit >= the server's {SIM_PROFILE['max_batch']} slots in "
                    f"{gate['share_at_or_above_slots']:.0%} of samples (first: "
                    f"{phase['gate_limit_samples'][0]:.0f}); bulk requests (chats and batches) "
                    f"waiting at the gate, median {gate['waiting_median']:.0f}"
                )
        count = b["alone"]["ttft_ms"]["count"]
        if count < 1000:
            k = count - nearest_rank(0.99, count) + 1
            which = "the largest value" if k == 1 else f"the {ordinal(k)} largest value"
            print(f"note: p99 of {count} requests is {which}; run longer for a steadier figure")
    print("\ntargets:")
    for check in checks:
        value = "-" if check["value"] is None else f"{check['value']:.2f}x"
        print(f"  {'PASS' if check['pass'] else 'MISS'}  {check['target']}: {value}")


# --- entry point ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Options:
    parts: str
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
    parser.add_argument("--requests", type=int, default=None, help="part A requests (2000)")
    parser.add_argument("--workers", type=int, default=64, help="part A clients (64)")
    parser.add_argument("--rps", type=float, default=5.0, help="interactive chats per second (5)")
    parser.add_argument("--duration", type=float, default=None, help="part B s per phase (60)")
    parser.add_argument("--ramp", type=float, default=3.0, help="bulk runs this long first (3)")
    parser.add_argument(
        "--no-diagnostics", action="store_true", help="part B: only alone and with bulk"
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
    return Options(
        parts=parts,
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
    b: dict[str, dict[str, Any]] | None = None
    sim = Stack(logs, taskset(cpus))
    try:
        with sigterm_as_interrupt():
            sim_port = start_sim(sim, SIM_PROFILE, seed=opts.seed)
            if "A" in opts.parts:
                (logs / "part-a").mkdir()
                stack = Stack(logs / "part-a", taskset(cpus))
                try:
                    port, _ = start_gateway(stack, gateway_config(sim_port))
                    a = part_a(port, opts, cpus.get("load"))
                finally:
                    stack.stop()
            if "B" in opts.parts:
                b = part_b(sim_port, sim.procs[0].pid, opts, cpus, logs)
    except (KeyboardInterrupt, RuntimeError, OSError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"logs kept in {logs}", file=sys.stderr)
        return 2
    finally:
        sim.stop()
    checks = verdicts(a, b)
    report(opts, a, b, checks)
    document = {
        "benchmark": "bulk",
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "options": {
            "parts": opts.parts,
            "requests": opts.requests,
            "workers": opts.workers,
            "rps": opts.rps,
            "duration_s": opts.duration_s,
            "ramp_s": opts.ramp_s,
            "seed": opts.seed,
            "pinned": cpus,
        },
        "upstream_profile": dict(SIM_PROFILE),
        "gateway_config": gateway_config(0),
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
