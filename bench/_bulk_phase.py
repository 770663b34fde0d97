"""bench/bulk.py's phases: the bulk load process, the gate sampler, one measured window."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench._bulk_setup import (
    BULK_EMBED_INPUTS,
    DEPLOYMENT,
    SIM_PROFILE,
    BulkMix,
    batch_totals,
    bulk_loads,
    interactive_request,
)
from gateway.latency.sketch import nearest_rank
from gateway.tools.load import (
    Client,
    LoadResult,
    Request,
    closed_loop,
    open_loop,
    poisson_arrivals,
    run_load,
)
from gateway.tools.stack import Stack, metric_samples, proc_cpu_s

CHILD_FLAG: Final = "--load-child"
GATE_SAMPLE_S: Final = 0.25
SETTLE_S: Final = 5.0  # "settled" TTFT: requests due this long or more into the window
MAIN: Final = Path(__file__).resolve().parent / "bulk.py"


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
        self.trusted: list[float] = []  # tailguard_bulk_server_preempts (priority servers)
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
                trusted = metric_samples(self.port, "tailguard_bulk_server_preempts").get(label)
                if trusted is not None:
                    self.trusted.append(trusted)

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
            # How often the gate believed the server preempts bulk for interactive requests,
            # and the first sample where it did not (a priority server only).
            "server_preempts_share": (
                sum(self.trusted) / len(self.trusted) if self.trusted else None
            ),
            "distrusted_after_s": next(
                (i * GATE_SAMPLE_S for i, v in enumerate(self.trusted) if not v), None
            ),
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


@dataclass(frozen=True, slots=True)
class Window:
    """One phase's measured window: interactive arrivals and how long bulk runs first."""

    rps: float
    duration_s: float
    ramp_s: float
    seed: int


def run_phase(
    port: int,
    pids: Mapping[str, int],
    window: Window,
    cpus: Mapping[str, int],
    mix: BulkMix | None,
    stack: Stack,
    *,
    interactive: bool = True,
) -> dict[str, Any]:
    """Interactive chat for `window.duration_s` (or, without `interactive`, just the wait),
    alone or with `mix` running in a child process from `window.ramp_s` before."""
    child: subprocess.Popen[bytes] | None = None
    if mix is not None:
        spec = {
            "port": port,
            "duration_s": window.ramp_s + window.duration_s + 1.0,
            "loads": bulk_loads(mix),
        }
        child = subprocess.Popen(
            [sys.executable, str(MAIN), CHILD_FLAG, json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        stack.procs.append(child)  # stopped with the rest if anything goes wrong
        if "load" in cpus and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(child.pid, {cpus["load"]})
        time.sleep(window.ramp_s)
    batched0 = batch_totals(port)
    watched = dict(pids)
    if child is not None:
        watched["bulk load"] = child.pid
    cpu0, wall0 = {k: proc_cpu_s(p) for k, p in watched.items()}, time.perf_counter()

    async def load() -> LoadResult:
        request = interactive_request()
        async with Client(port) as client:
            await client.warm_up(request, 0 if mix is not None else 3)
            arrivals = poisson_arrivals(window.rps, window.duration_s, window.seed)
            return await open_loop(client, request, arrivals, duration_s=window.duration_s)

    with GateSampler(port) as sampler:
        if interactive:
            result: LoadResult | None = run_load(load, cpu=cpus.get("load"))
        else:
            result = None
            time.sleep(window.duration_s)
    cpu1, wall1 = {k: proc_cpu_s(p) for k, p in watched.items()}, time.perf_counter()
    batched1 = batch_totals(port)
    preempted = metric_samples(port, "tailguard_bulk_preemptions_total")
    cpu: dict[str, float | None] = {}
    for key in watched:
        start, end = cpu0[key], cpu1[key]
        cpu[key] = (end - start) / (wall1 - wall0) if start is not None and end else None
    phase: dict[str, Any] = {
        "bulk": None,
        "interactive": result.summary() if result is not None else None,
        "ttft_ms": ttft_summary(result) if result is not None else None,
        # Once the gate has had SETTLE_S to react to the first interactive requests.
        "ttft_ms_settled": ttft_summary(result, SETTLE_S) if result is not None else None,
        "ttft_at_s": [round(v, 3) for v in result.ttft_at_s] if result is not None else [],
        "ttfts_ms": [round(v, 2) for v in result.ttfts_ms] if result is not None else [],
        "cpu_share": cpu,  # of one CPU, over the measured window
        "gateway_cpu": cpu["gateway"],
        "gate": sampler.summary(int(SIM_PROFILE["max_batch"])),
        "gate_limit_samples": sampler.limits,
        # Bulk work the gate took a FIFO server's slot back from (a fresh gateway per phase).
        "preemptions": preempted.get(f'{{deployment="{DEPLOYMENT}"}}', 0.0),
    }
    calls = batched1[1] - batched0[1]
    phase["batched_inputs_per_call"] = (batched1[0] - batched0[0]) / calls if calls else None
    if mix is not None and child is not None:
        phase["bulk"] = {
            "embed_clients": mix.embed_clients,
            "embed_inputs_per_request": BULK_EMBED_INPUTS,
            "chat_clients": mix.chat_clients,
        }
        out, err = child.communicate(timeout=window.ramp_s + window.duration_s + 120)
        with contextlib.suppress(ValueError):
            stack.procs.remove(child)
        if child.returncode != 0:
            raise RuntimeError(f"bulk load failed: {err.decode(errors='replace')[-2000:]}")
        phase["bulk_results"] = json.loads(out)
    return phase
