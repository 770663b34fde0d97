"""The benchmarks' load client (`gateway.tools.load`) run in a process of its own, on a spec.

A process of its own can be pinned to a CPU (`taskset`) apart from the script that drives it,
and its CPU use is its alone. Two ways to drive load:

- closed loop: `concurrency` workers, each with its own connection, send back to back for
  `duration_s` seconds (or until `requests` are done). Measures throughput.
- open loop: one request every `1 / rate` seconds at fixed, precomputed times, whatever happened
  to the previous ones, on at most max(`concurrency`, 256) connections. The scripts compare two
  paths (straight to the upstream, through a proxy) measured by this one client, so a request's
  latency runs from when it went out: the client's own timer lag would be noise in the
  difference, and is reported apart (`send_lag_ms`; a script warns when it is high).

Every answer must be a complete chat completion with `expect_tokens` content tokens (when set);
TTFT is the time to the first `data:` event carrying content.

Around the measured window it reads utime+stime of the given processes from `/proc/<pid>/stat`,
so CPU per request covers exactly the requests in the window.

Run as `python bench/_load.py < spec.json`: the spec is a `LoadSpec` as JSON, the result is one
JSON object on stdout. `run_load` does that from another script (in a pinned subprocess).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.latency.sketch import nearest_rank
from gateway.tools.load import (
    Client,
    Request,
    closed_loop,
    even_arrivals,
    open_loop,
    run_async,
)
from gateway.tools.stack import proc_cpu_s

_REQUEST_TIMEOUT_S = 30.0


@dataclass(slots=True)
class LoadSpec:
    """One load run against one endpoint."""

    port: int
    body: str  # JSON request body
    mode: str = "closed"  # closed | open
    stream: bool = False
    host: str = "127.0.0.1"
    path: str = "/v1/chat/completions"
    concurrency: int = 32  # closed loop: workers; open loop: connection cap
    rate: float = 100.0  # open loop: requests per second
    duration_s: float = 10.0
    requests: int | None = None  # closed loop: stop after this many (default: time only)
    warmup_requests: int = 0  # sent before the window (opens the connections), not measured
    expect_tokens: int | None = None  # content tokens each answer must carry
    cpu_pids: dict[str, int] = field(default_factory=dict)  # name -> pid to charge CPU to
    headers: dict[str, str] = field(default_factory=dict)  # extra request headers (e.g. auth)


# --- measuring -----------------------------------------------------------------------------------


def cpu_times() -> dict[str, tuple[int, int]]:
    """Per CPU (`cpu0`, ...): (steal, total) jiffies from `/proc/stat`."""
    times: dict[str, tuple[int, int]] = {}
    with open("/proc/stat", encoding="ascii") as file:
        for line in file:
            name, _, rest = line.partition(" ")
            if name.startswith("cpu") and name != "cpu":
                values = [int(v) for v in rest.split()[:8]]  # user .. steal
                times[name] = (values[7] if len(values) > 7 else 0, sum(values))
    return times


def steal_percent(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> dict[str, float]:
    """Share of each CPU's time the hypervisor gave to someone else, between two readings."""
    shares: dict[str, float] = {}
    for name, (steal, total) in after.items():
        steal0, total0 = before.get(name, (steal, total))
        shares[name] = 100.0 * (steal - steal0) / max(total - total0, 1)
    return shares


def percentiles(values: Sequence[float]) -> dict[str, float | int]:
    """count, mean, p50/p90/p99/p99.9 (nearest rank) and max, in the unit of `values`."""
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    n = len(ordered)

    def rank(q: float) -> float:
        return ordered[nearest_rank(q, n) - 1]  # the gateway's one definition of nearest rank

    return {
        "count": n,
        "mean": sum(ordered) / n,
        "p50": rank(0.50),
        "p90": rank(0.90),
        "p99": rank(0.99),
        "p999": rank(0.999),
        "max": ordered[-1],
    }


# --- the run -------------------------------------------------------------------------------------


async def run(spec: LoadSpec) -> dict[str, Any]:
    """Warm up, run the measured loop and summarise it, CPU and steal read around the loop."""
    request = Request(
        spec.path,
        spec.body.encode(),
        stream=spec.stream,
        headers=spec.headers,
        expect="chat",
        tokens=spec.expect_tokens,
    )
    closed = spec.mode == "closed"
    limit = None if closed else max(spec.concurrency, 256)
    async with Client(
        spec.port, host=spec.host, limit=limit, timeout_s=_REQUEST_TIMEOUT_S
    ) as client:
        width = spec.concurrency if closed else min(spec.concurrency, 4)
        await client.warm_up(request, spec.warmup_requests, width)
        pids = spec.cpu_pids
        cpu0 = {name: proc_cpu_s(pid) or 0.0 for name, pid in pids.items()}
        self_cpu0 = _self_cpu_s()
        machine0 = cpu_times()
        if closed:
            result = await closed_loop(
                client,
                request,
                concurrency=spec.concurrency,
                duration_s=spec.duration_s,
                requests=spec.requests,
            )
        else:
            arrivals = even_arrivals(spec.rate, spec.duration_s)
            result = await open_loop(
                client, request, arrivals, duration_s=spec.duration_s, from_schedule=False
            )
        cpu = {name: (proc_cpu_s(pid) or 0.0) - cpu0[name] for name, pid in pids.items()}
        self_cpu = _self_cpu_s() - self_cpu0
        steal = steal_percent(machine0, cpu_times())
    sent = result.ok + result.errors
    elapsed = max(result.wall_s, 1e-9)  # to the last answer, in both modes
    ms = 1000.0
    return {
        "mode": spec.mode,
        "stream": spec.stream,
        "port": spec.port,
        "concurrency": spec.concurrency,
        "rate": spec.rate if spec.mode == "open" else None,
        "requests": sent,
        "ok": result.ok,
        "errors": result.errors,
        "error_samples": result.error_samples,
        "elapsed_s": elapsed,
        "throughput_rps": result.ok / elapsed,
        "latency_ms": percentiles(result.latencies_ms),
        "ttft_ms": percentiles(result.ttfts_ms) if spec.stream else None,
        "send_lag_ms": percentiles(result.send_lag_ms) if result.send_lag_ms else None,
        "cpu_s": cpu,
        "cpu_ms_per_request": {name: s * ms / max(sent, 1) for name, s in cpu.items()},
        "loadgen_cpu_ms_per_request": self_cpu * ms / max(sent, 1),
        "steal_percent": steal,
    }


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    spec = LoadSpec(**json.loads(sys.stdin.read()))
    result = run_async(run(spec))
    sys.stdout.write(json.dumps(result) + "\n")


# --- for the benchmark scripts -------------------------------------------------------------------


def run_load(
    spec: LoadSpec,
    *,
    prefix: Sequence[str] = (),
    procs: list[subprocess.Popen[bytes]] | None = None,
) -> dict[str, Any]:
    """Run `spec` in a fresh process started under `prefix` (e.g. `taskset -c 1`).

    The child is appended to `procs` while it runs, so a caller's cleanup can stop it.
    """
    command = [*prefix, sys.executable, os.path.abspath(__file__)]
    child = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    if procs is not None:
        procs.append(child)
    try:
        timeout = spec.duration_s + 60 + spec.warmup_requests * 0.05
        out, err = child.communicate(json.dumps(asdict(spec)).encode(), timeout=timeout)
    except BaseException:
        child.kill()
        child.wait()
        raise
    finally:
        if procs is not None:
            with contextlib.suppress(ValueError):
                procs.remove(child)
    if child.returncode != 0:
        raise RuntimeError(
            f"load generator failed ({child.returncode}): {err.decode(errors='replace')[-2000:]}"
        )
    result: dict[str, Any] = json.loads(out)
    return result


if __name__ == "__main__":
    main()
