"""`tailguard bench batching`: what a micro-batch queue's `max_wait_ms` costs and buys, measured
against a real gateway process.

`run_batching_bench` starts a simulated upstream (`python -m gateway sim`) whose embeddings call
costs 20 ms + 0.2 ms per input with at most 4 calls at once, and a gateway (`python -m gateway
serve`) with one model per `max_wait_ms` under test, each batched (64 inputs at most, 4 batches
in flight) onto a deployment of its own. Both workloads send single-input embeddings requests marked
`x-tailguard-priority: bulk`, because embeddings and completions are what the gateway
micro-batches (chat is never batched):

- `interactive`: sparse, latency-sensitive arrivals: an open loop of Poisson arrivals at
  `interactive_rps` (20/s), each request's latency measured from its scheduled send time;
- `bulk`: a backlog: a closed loop of `bulk_concurrency` (256: enough to fill all four batches
  in flight) clients sending back to back.

For each (workload, max_wait_ms) it reports p50/p99 latency, throughput, errors and the mean
inputs per upstream call (from the gateway's `tailguard_batch_size` histogram), and it
recommends a `max_wait_ms` per workload with the reason computed from those numbers
(`recommend`): for interactive traffic the lowest p99 (p99s within 10% count as equal; the
shorter wait wins), for bulk traffic the highest throughput (throughputs within 5% count as
equal; then the lower p99, then the shorter wait). Percentiles are nearest rank.

The load runs in a thread of its own with its own event loop (`load`, the benchmarks' one
client), pinned, like the two server processes (`stack`), to its own CPU when there are enough
of them. Nothing here prints: progress goes through the caller's callback.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal

from gateway.tools.load import (
    Client,
    LoadResult,
    Request,
    closed_loop,
    open_loop,
    poisson_arrivals,
    run_load,
    summary_ms,
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

__all__ = [
    "DEFAULT_DURATION_S",
    "BatchingBenchReport",
    "BatchingRow",
    "Recommendation",
    "Workload",
    "recommend",
    "run_batching_bench",
]

DEFAULT_DURATION_S: Final = 10.0  # measured seconds per (workload, max_wait_ms): ~75 s in all
DEFAULT_WAITS_MS: Final = (5, 20, 100)
SIM_PROFILE: Final[Mapping[str, float | int]] = {
    "embed_base_ms": 20,
    "embed_ms_per_input": 0.2,
    "max_batch": 4,  # upstream calls that run at once; more queue FIFO
    "embedding_dims": 16,
}
BATCHING: Final[Mapping[str, int]] = {"max_batch_size": 64, "max_inflight": 4, "max_queue": 4096}
INTERACTIVE_RPS: Final = 20.0
BULK_CONCURRENCY: Final = 256  # enough to fill every in-flight batch: 4 x 64
THROUGHPUT_TIE: Final = 0.05  # throughputs within 5% of the best count as equal (bulk)
P99_TIE: Final = 0.10  # p99s within 10% of the lowest count as equal
SMALL_BATCH: Final = 8.0  # mean inputs per upstream call below which batches "stay small"
ARRIVAL_LIMITED: Final = 0.9  # served >= 90% of the offered rate: the arrivals set throughput
LOAD_BOUND: Final = 0.85  # a load generator busier than this may be what limits throughput
MAX_ERROR_SHARE: Final = 0.01  # a setting that failed more requests than this is not recommended

Workload = Literal["interactive", "bulk"]
WORKLOADS: Final[tuple[Workload, ...]] = ("interactive", "bulk")


@dataclass(frozen=True, slots=True)
class BatchingRow:
    """One (workload, max_wait_ms) measurement. Latencies in milliseconds."""

    workload: Workload
    max_wait_ms: int
    requests: int  # answered correctly
    errors: int
    throughput_rps: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_batch: float | None = None  # inputs per upstream call, from the gateway's metrics
    offered_rps: float | None = None  # open loop: the arrival rate
    gateway_cpu: float | None = None  # share of one CPU the gateway process used meanwhile
    load_cpu: float | None = None  # share of one CPU the load generator used (1.0: it limits)


@dataclass(frozen=True, slots=True)
class Recommendation:
    workload: Workload
    max_wait_ms: int
    reason: str


@dataclass(frozen=True, slots=True)
class BatchingBenchReport:
    rows: tuple[BatchingRow, ...]
    recommendations: tuple[Recommendation, ...]
    setup: Mapping[str, Any]
    notes: tuple[str, ...] = ()

    def row(self, workload: Workload, max_wait_ms: int) -> BatchingRow:
        for row in self.rows:
            if row.workload == workload and row.max_wait_ms == max_wait_ms:
                return row
        raise KeyError((workload, max_wait_ms))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable data."""
        return {
            "benchmark": "batching",
            "setup": dict(self.setup),
            "rows": [asdict(row) for row in self.rows],
            "recommendations": [asdict(r) for r in self.recommendations],
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def cells(self) -> list[list[str]]:
        """One row of `COLUMNS` per measurement, formatted."""
        rows = []
        for r in self.rows:
            batch = "-" if r.mean_batch is None else f"{r.mean_batch:.1f}"
            cpu = "-" if r.gateway_cpu is None else f"{r.gateway_cpu:.0%}"
            load = "-" if r.load_cpu is None else f"{r.load_cpu:.0%}"
            rows.append(
                [
                    r.workload,
                    f"{r.max_wait_ms:,}",
                    f"{r.throughput_rps:,.0f}",
                    f"{r.p50_ms:,.1f}",
                    f"{r.p99_ms:,.1f}",
                    batch,
                    cpu,
                    load,
                    f"{r.errors:,}",
                ]
            )
        return rows

    def conclusions(self) -> list[str]:
        """The recommendations, then the notes, one a line."""
        lines = [f"{r.workload}: {r.max_wait_ms} ms — {r.reason}" for r in self.recommendations]
        return lines + [f"note: {note}" for note in self.notes]

    def markdown(self) -> str:
        """The results as a Markdown table and the recommendations, one per line."""
        lines = [
            "| " + " | ".join(COLUMNS) + " |",
            "|---|" + "---:|" * (len(COLUMNS) - 1),
            *("| " + " | ".join(row) + " |" for row in self.cells()),
            "",
            *self.conclusions(),
        ]
        return "\n".join(lines)


COLUMNS: Final = (
    "workload",
    "max_wait_ms",
    "throughput (req/s)",
    "p50 (ms)",
    "p99 (ms)",
    "inputs per upstream call",
    "gateway CPU",
    "load generator CPU",
    "errors",
)


def _usable(rows: Sequence[BatchingRow]) -> list[BatchingRow]:
    """Rows that failed at most MAX_ERROR_SHARE of their requests (all of them if none did)."""
    good = [r for r in rows if r.errors <= MAX_ERROR_SHARE * max(r.requests + r.errors, 1)]
    return good or list(rows)


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if value < 100 else f"{value:.0f} ms"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "-"


def recommend(workload: Workload, rows: Sequence[BatchingRow]) -> Recommendation:
    """The `max_wait_ms` to use for `workload`, and why, from its measured rows.

    - interactive: the lowest p99; p99s within P99_TIE (10%) of the lowest count as equal and
      the shortest wait among them wins. Latency is what such traffic needs, and sparse
      arrivals, not the batching, set its throughput.
    - bulk: the highest throughput, where throughputs within THROUGHPUT_TIE (5%) of the best
      count as equal; among those the lowest p99 (again within P99_TIE), then the shortest wait.

    Settings that failed more than MAX_ERROR_SHARE of their requests are passed over.
    """
    mine = sorted((r for r in rows if r.workload == workload), key=lambda r: r.max_wait_ms)
    if not mine:
        raise ValueError(f"no rows for workload {workload!r}")
    usable = _usable(mine)
    failed = [r.max_wait_ms for r in mine if r not in usable]
    skipped = f"; passed over for errors: {', '.join(f'{w} ms' for w in failed)}" if failed else ""
    if workload == "interactive":
        best = _lowest_p99(usable)
        low, high = mine[0], mine[-1]
        others = [f"{_ms(r.p99_ms)} at {r.max_wait_ms} ms" for r in usable if r is not best]
        parts = [f"p99 {_ms(best.p99_ms)}" + (f" vs {', '.join(others)}" if others else "")]
        if high is not low and high.max_wait_ms > low.max_wait_ms:
            grew = high.p99_ms - low.p99_ms
            waited = high.max_wait_ms - low.max_wait_ms
            parts.append(
                f"p99 moves {grew:+.0f} ms from {low.max_wait_ms} to {high.max_wait_ms} ms of "
                f"wait ({grew / waited:.2f} ms per ms waited)"
            )
        offered = best.offered_rps
        if offered and all(r.throughput_rps >= ARRIVAL_LIMITED * offered for r in usable):
            tps = [r.throughput_rps for r in usable]
            note = (
                f"throughput ({min(tps):.0f}-{max(tps):.0f} req/s) is set by the arrivals "
                f"({offered:g} req/s), not by batching"
            )
            batches = [r.mean_batch for r in usable if r.mean_batch is not None]
            if batches and max(batches) < SMALL_BATCH:
                note += (
                    f"; batches stay small ({min(batches):.1f}-{max(batches):.1f} inputs), so "
                    "a request mostly waits out the timer"
                )
            parts.append(note)
        return Recommendation(workload, best.max_wait_ms, "; ".join(parts) + skipped)
    top = max(r.throughput_rps for r in usable)
    tied = [r for r in usable if r.throughput_rps >= (1 - THROUGHPUT_TIE) * top]
    best = _lowest_p99(tied)
    fastest = max(usable, key=lambda r: (r.throughput_rps, -r.max_wait_ms))
    if best.throughput_rps >= fastest.throughput_rps:
        reason = f"highest throughput, {best.throughput_rps:.0f} req/s"
    else:
        reason = (
            f"throughput {best.throughput_rps:.0f} req/s, within {THROUGHPUT_TIE:.0%} of the "
            f"best ({fastest.throughput_rps:.0f} at {fastest.max_wait_ms} ms)"
        )
    behind = [r for r in usable if r not in tied]
    if behind:
        reason += (
            " (" + ", ".join(f"{r.throughput_rps:.0f} at {r.max_wait_ms} ms" for r in behind) + ")"
        )
    clauses = []
    safer = False
    for r in tied:
        if r is best:
            continue
        versus = f"{_ms(best.p99_ms)} vs {_ms(r.p99_ms)}"
        if r.p99_ms > best.p99_ms * (1 + P99_TIE):
            clauses.append(
                f"p99 {_ratio(r.p99_ms, best.p99_ms)} lower than at {r.max_wait_ms} ms ({versus})"
            )
        else:
            clauses.append(f"p99 on a par with {r.max_wait_ms} ms ({versus})")
            safer = safer or r.max_wait_ms > best.max_wait_ms
    if clauses:
        reason += "; " + ", ".join(clauses)
    else:
        reason += f"; p99 {_ms(best.p99_ms)}"
    if safer:
        reason += "; the shorter wait costs less latency when bulk traffic thins out"
    if best.mean_batch is not None:
        reason += f"; {best.mean_batch:.1f} inputs per upstream call"
    return Recommendation(workload, best.max_wait_ms, reason + skipped)


def _lowest_p99(rows: Sequence[BatchingRow]) -> BatchingRow:
    """The shortest wait among the rows whose p99 is within P99_TIE of the lowest."""
    floor = min(r.p99_ms for r in rows)
    return min((r for r in rows if r.p99_ms <= floor * (1 + P99_TIE)), key=lambda r: r.max_wait_ms)


def _batching_config(waits_ms: Sequence[int], sim_port: int) -> dict[str, Any]:
    """One model per wait, `embed-w<ms>`, each batched onto a deployment of its own."""
    return {
        "server": {"host": "127.0.0.1", "access_log": False, "reload_on_change": False},
        "latency": {"store": "memory"},
        "providers": {
            "sim": {"type": "openai", "base_url": f"http://127.0.0.1:{sim_port}/v1"},
        },
        "models": [
            {
                "name": f"embed-w{wait}",
                "deployments": [{"provider": "sim", "model": f"emb-w{wait}"}],
                "batching": {**BATCHING, "max_wait_ms": wait},
            }
            for wait in waits_ms
        ],
    }


def _batch_totals(port: int, deployment: str) -> tuple[float, float]:
    """(inputs, upstream calls) batched so far for `deployment`'s embeddings."""
    label = f'deployment="{deployment}"'
    sums = metric_samples(port, "tailguard_batch_size_sum")
    counts = metric_samples(port, "tailguard_batch_size_count")
    inputs = sum(v for k, v in sums.items() if label in k)
    calls = sum(v for k, v in counts.items() if label in k)
    return inputs, calls


def _run_workload(
    workload: Workload,
    port: int,
    request: Request,
    *,
    rate: float,
    concurrency: int,
    duration_s: float,
    seed: int,
    cpu: int | None,
) -> LoadResult:
    """One measured step, after a few unmeasured requests (which open the connections): Poisson
    arrivals at `rate` (interactive), or `concurrency` clients back to back (bulk)."""

    async def interactive() -> LoadResult:
        async with Client(port) as client:
            await client.warm_up(request, 3)
            arrivals = poisson_arrivals(rate, duration_s, seed)
            return await open_loop(client, request, arrivals, duration_s=duration_s)

    async def bulk() -> LoadResult:
        async with Client(port) as client:
            await client.warm_up(request, concurrency, width=concurrency)
            return await closed_loop(
                client, request, concurrency=concurrency, duration_s=duration_s
            )

    return run_load(interactive if workload == "interactive" else bulk, cpu=cpu)


def run_batching_bench(
    *,
    duration_s: float,
    waits_ms: Sequence[int] = DEFAULT_WAITS_MS,
    progress: Callable[[str], None] | None = None,
    interactive_rps: float = INTERACTIVE_RPS,
    bulk_concurrency: int = BULK_CONCURRENCY,
    seed: int = 1,
) -> BatchingBenchReport:
    """Measure each workload at each `max_wait_ms` for `duration_s` seconds (each, so the run
    takes about 2 x len(waits_ms) x duration_s plus a few seconds of start-up) and recommend a
    wait per workload. `progress` gets a line of text as each step starts and ends."""
    waits = sorted(set(int(w) for w in waits_ms))
    if not waits or waits[0] < 0:
        raise ValueError("waits_ms: at least one wait, none negative")
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    say = progress or (lambda line: None)
    cpus = cpu_layout()
    rows: list[BatchingRow] = []
    logs = Path(tempfile.mkdtemp(prefix="tailguard-bench-"))
    pin = taskset(cpus)
    stack = Stack(logs, pin)
    try:
        say("starting the simulated upstream and the gateway ...")
        sim_port = start_sim(stack, SIM_PROFILE, seed=seed)
        port, gateway = start_gateway(stack, _batching_config(waits, sim_port))
        gateway_pid = gateway.pid
        for workload in WORKLOADS:
            for wait in waits:
                model = f"embed-w{wait}"
                request = Request.embeddings(model)
                before = _batch_totals(port, f"sim/emb-w{wait}")
                cpu0, wall0 = proc_cpu_s(gateway_pid), time.perf_counter()
                if workload == "interactive":
                    say(
                        f"interactive, max_wait_ms {wait}: {interactive_rps:g} req/s (Poisson) "
                        f"for {duration_s:g} s ..."
                    )
                else:
                    say(
                        f"bulk, max_wait_ms {wait}: {bulk_concurrency} clients back to back "
                        f"for {duration_s:g} s ..."
                    )
                result = _run_workload(
                    workload,
                    port,
                    request,
                    rate=interactive_rps,
                    concurrency=bulk_concurrency,
                    duration_s=duration_s,
                    seed=seed,
                    cpu=cpus.get("load"),
                )
                cpu1, wall1 = proc_cpu_s(gateway_pid), time.perf_counter()
                after = _batch_totals(port, f"sim/emb-w{wait}")
                calls = after[1] - before[1]
                latency = summary_ms(result.latencies_ms)
                row = BatchingRow(
                    workload=workload,
                    max_wait_ms=wait,
                    requests=result.ok,
                    errors=result.errors,
                    throughput_rps=result.throughput_rps,
                    p50_ms=latency.get("p50", 0.0),
                    p99_ms=latency.get("p99", 0.0),
                    max_ms=latency.get("max", 0.0),
                    # Includes the warm-up requests on both sides: a close enough mean.
                    mean_batch=(after[0] - before[0]) / calls if calls else None,
                    offered_rps=interactive_rps if workload == "interactive" else None,
                    gateway_cpu=(
                        (cpu1 - cpu0) / (wall1 - wall0)
                        if cpu0 is not None and cpu1 is not None
                        else None
                    ),
                    load_cpu=result.client_cpu_s / result.elapsed_s if result.elapsed_s else None,
                )
                rows.append(row)
                errors = (
                    f", {row.errors} errors ({result.error_samples[0][:80]})" if row.errors else ""
                )
                say(
                    f"  {row.throughput_rps:.0f} req/s, p50 {_ms(row.p50_ms)}, "
                    f"p99 {_ms(row.p99_ms)}{errors}"
                )
    finally:
        stack.stop()
        with contextlib.suppress(OSError):
            for path in logs.iterdir():
                path.unlink()
            logs.rmdir()
    recommendations = tuple(recommend(w, rows) for w in WORKLOADS)
    setup = {
        "upstream": {
            **SIM_PROFILE,
            "note": "tailguard sim: an embeddings call costs embed_base_ms + embed_ms_per_input "
            "x inputs; at most max_batch calls run at once, the rest queue FIFO",
        },
        "batching": {**BATCHING, "max_wait_ms": waits},
        "requests": "single-input /v1/embeddings with x-tailguard-priority: bulk (embeddings "
        "and completions are what the gateway micro-batches; chat is never batched)",
        "workloads": {
            "interactive": f"open loop, Poisson arrivals at {interactive_rps:g} req/s; latency "
            "from each request's scheduled send time",
            "bulk": f"closed loop, {bulk_concurrency} clients sending back to back",
        },
        "duration_s": duration_s,
        "percentiles": "nearest rank",
        "pinned": cpus,
    }
    notes: list[str] = []
    if not cpus:
        notes.append("fewer than two CPUs: the gateway, upstream and load share them")
    elif not pin:
        notes.append("taskset not found: the gateway and the upstream ran unpinned")
    busy = [r for r in rows if r.load_cpu is not None and r.load_cpu > LOAD_BOUND]
    if busy:
        notes.append(
            "the load generator used most of a CPU in "
            + ", ".join(f"{r.workload} {r.max_wait_ms} ms ({r.load_cpu or 0:.0%})" for r in busy)
            + ": those throughputs are a floor of what the gateway can do"
        )
    return BatchingBenchReport(tuple(rows), recommendations, setup, tuple(notes))
