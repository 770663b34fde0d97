"""`bench/overhead.py --litellm/--nginx/--field`: Tailguard, with every feature on, against
LiteLLM's proxy and nginx `proxy_pass`, in front of the same simulated upstream, one worker
each, under the same load generator in one run.

What each path is:
- direct: the load generator straight to the upstream (`tailguard sim`, zero delay).
- tailguard: `tailguard serve`, one worker, with latency-budget routing (every model has a
  budget and a fallback model), the Redis latency store (a throwaway `redis-server`), traces
  exported over OTLP/HTTP to a sink in its own process, the access log, and API-key auth (every
  request carries the key; an admin key reads `/admin/latency` and `/metrics`).
- litellm: `litellm --num_workers 1` from `bench/.venvs/litellm`, with LiteLLM's production
  settings (no database, master key = the same key, no spend/error logs, `set_verbose: false`,
  `json_logs`, `LITELLM_LOG=ERROR`, `LITELLM_MODE=PRODUCTION`, uvloop).
- portkey: Portkey's open-source gateway (`@portkey-ai/gateway`, `bench/.node/portkey`), one
  `node` process, routed by request headers (`x-portkey-provider: openai`,
  `x-portkey-custom-host` at the upstream; see `bench/_portkey.py`).
- nginx: one worker process, keep-alive upstream, `proxy_buffering off`: the practical floor.
- reference (`--reference`): the bare aiohttp forwarder of `bench/_refproxy.py`.

Every proxy is pinned to CPU 0; the upstream, the load generator, Redis and the OTLP sink share
CPU 1. Each phase runs on every path, `--repeat` times in rotating order, and every figure is the
median over the repeats ("added" figures: the median of the per-repeat differences to direct in
the same repeat). CPU per request is the proxy's CPU time (all its processes) over the requests of
a window. A phase in which every request to a path failed is reported as failed (the status, and
the exception the proxy logged or the error body's message), not as figures.

Phases: saturated closed loop (c=`--concurrency`) non-streaming, zero-delay streaming and paced
streaming (`--paced-tps`, one network read per event); open loop non-streaming at each of
`FIELD_RATES` requests/s; open loop streaming at `--stream-rate` (TTFT).

`--workers N` (N > 1) adds a scaling run: Tailguard alone with 1 and then N workers (`tailguard
serve --workers N`, not pinned), each on a fresh Redis, saturated; afterwards `/admin/latency` is
asked on fresh connections until every worker has answered (each worker's own route counters
tell them apart) and each must report the whole run's request count from the shared store.
`--profile` samples the single-worker gateway with py-spy under saturated load
(`bench/_profile.py`), then measures what each feature costs: Tailguard with its features taken
away one at a time (tracing sampled at 0%, no tracing, no access log, nothing), saturated.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from bench import _contenders as contenders
from bench import _portkey
from bench import _profile as profiling
from bench._field_report import (
    LABELS,
    feature_lines,
    fmt,
    overload_notes,
    ratio,
    ratios,
    scaling_lines,
    table,
    targets,
)
from bench._harness import ROOT, VENV_BIN, environment, sigterm_as_interrupt
from bench._load import LoadSpec, run_load
from gateway.tools.stack import Stack, free_port, proc_cpu_s

MODEL: Final = "bench"
PACED_MODEL: Final = "bench-paced"
MODELS: Final = (MODEL, PACED_MODEL)
PROMPT: Final = "Explain in one sentence why tail latency matters for interactive LLM applications."
FIELD_RATES: Final = (20.0, 100.0)
MIN_OPEN_REQUESTS: Final = 300  # per open-loop window: p99 then rests on the 3 slowest, not 1
PROXIES: Final = ("tailguard", "baseline", "litellm", "portkey", "nginx", "reference")
ROLES: Final = {  # path -> its role in the Stack (and so its CPU pinning)
    "tailguard": "gateway",
    "baseline": "gateway",
    "litellm": "litellm",
    "portkey": "portkey",
    "nginx": "nginx",
    "reference": "reference",
}
_CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
NOISY_STEAL_PERCENT: Final = 2.0
_PORTKEY_HEADERS_SHOWN: Final = {  # in the results, for what differs from run to run
    "authorization": "Bearer <the bench key>",
    "x-portkey-custom-host": "http://127.0.0.1:<upstream port>/v1",
}


@dataclass(frozen=True, slots=True)
class FieldOptions:
    litellm: bool
    nginx: bool
    portkey: bool
    reference: bool
    repeat: int
    duration_s: float
    warmup_s: float
    concurrency: int
    stream_rate: float
    tokens: int
    paced_tps: float
    workers: int
    profile: bool
    json_path: Path
    keep_logs: bool
    rates: tuple[float, ...] = FIELD_RATES
    baseline: Path | None = None  # another checkout, run as the path `baseline`


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    title: str
    stream: bool
    mode: str  # closed | open
    rate: float = 0.0
    paced: bool = False


def phases(opts: FieldOptions) -> list[Phase]:
    found = [
        Phase("sat", "saturated, non-streaming", stream=False, mode="closed"),
        Phase("sat_stream", "saturated, zero-delay streams", stream=True, mode="closed"),
        Phase("paced", "closed loop, paced streams", stream=True, mode="closed", paced=True),
    ]
    found += [
        Phase(f"open{rate:g}", f"open loop {rate:g}/s", stream=False, mode="open", rate=rate)
        for rate in opts.rates
    ]
    found.append(
        Phase("ttft", f"open loop {opts.stream_rate:g} streams/s", True, "open", opts.stream_rate)
    )
    return found


def pinning() -> tuple[dict[str, list[str]], str | None]:
    """Every proxy on CPU 0; everything around it on CPU 1."""
    taskset = shutil.which("taskset")
    if taskset is None:
        return {}, "taskset not found: running unpinned, CPU figures are noisier"
    if not {0, 1} <= os.sched_getaffinity(0):
        return {}, f"CPUs 0 and 1 are not both available ({sorted(os.sched_getaffinity(0))})"
    cpu0, cpu1 = [taskset, "-c", "0"], [taskset, "-c", "1"]
    pin = {role: cpu0 for role in ("gateway", "litellm", "portkey", "nginx", "reference")}
    pin |= {role: cpu1 for role in ("upstream", "load", "redis", "otlp", "profiler")}
    return pin, None


def body(stream: bool, model: str = MODEL) -> str:
    document: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
    if stream:
        document["stream"] = True
    return json.dumps(document, separators=(",", ":"))


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def cpu0_jiffies() -> tuple[int, int]:
    """(process time, all) jiffies of CPU 0 from /proc/stat. Interrupt time is left out of the
    first: it is mostly the loopback traffic of the run itself."""
    with open("/proc/stat", encoding="ascii") as file:
        for line in file:
            if line.startswith("cpu0 "):
                user, nice, system, idle, iowait, irq, softirq = map(int, line.split()[1:8])
                return user + nice + system, user + nice + system + idle + iowait + irq + softirq
    return 0, 0


# --- one load window -----------------------------------------------------------------------------


@dataclass(slots=True)
class Runner:
    """Runs load windows against the paths, charging CPU to each proxy's processes."""

    stack: Stack
    opts: FieldOptions
    ports: dict[str, int]
    cpu_pids: dict[str, list[int]] = field(default_factory=dict)  # path -> its processes
    sent: dict[str, int] = field(default_factory=dict)  # path -> requests sent (all windows)
    # path -> what its requests carry (default: the bench key); Portkey adds its routing
    headers: dict[str, dict[str, str]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)  # path -> its log, read when requests fail

    def load(self, path: str, label: str, **kw: Any) -> dict[str, Any]:
        charged = {f"proxy.{i}": pid for i, pid in enumerate(self.cpu_pids.get(path, []))}
        spec = LoadSpec(
            port=self.ports[path],
            cpu_pids=charged,
            expect_tokens=self.opts.tokens,
            headers=dict(self.headers.get(path, contenders.AUTH_HEADERS)),
            **kw,
        )
        pids = self.cpu_pids.get(path, [])
        log = self.logs.get(path)
        log_start = contenders.log_size(log) if log is not None else 0
        started = time.monotonic()
        busy0, all0 = cpu0_jiffies()
        mine0 = sum(_cpu_s(pid) for pid in pids)
        result = run_load(spec, prefix=self.stack.pin.get("load", []), procs=self.stack.procs)
        busy1, all1 = cpu0_jiffies()
        mine1 = sum(_cpu_s(pid) for pid in pids)
        took = time.monotonic() - started
        if result["errors"] and log is not None:
            result["log_errors"] = contenders.log_errors(log, log_start)
        per = result["cpu_ms_per_request"]
        result["proxy_cpu_ms"] = sum(per.values()) if per else None
        # Other processes on the proxy's CPU (other work on a shared machine): the noise that
        # the hypervisor's steal time does not show.
        if self.stack.pin.get(ROLES.get(path, "")) and all1 > all0:
            others = (busy1 - busy0) - (mine1 - mine0) * _CLK_TCK
            result["foreign_cpu0_percent"] = max(0.0, 100.0 * others / (all1 - all0))
        self.sent[path] = self.sent.get(path, 0) + result["requests"] + kw.get("warmup_requests", 0)
        cpu = result["proxy_cpu_ms"]
        p50 = result["latency_ms"].get("p50", float("nan"))
        p99 = result["latency_ms"].get("p99", float("nan"))
        steal = max(result["steal_percent"].values(), default=0.0)
        foreign = result.get("foreign_cpu0_percent")
        print(
            f"  {label:<16} {path:<10} {result['ok']:>6} ok {result['errors']:>4} err "
            f"{result['throughput_rps']:>7.0f}/s  p50 {p50:7.2f}  p99 {p99:7.2f} ms"
            + (f"  CPU {cpu:.3f} ms/req" if cpu is not None else "")
            + f"  (steal {steal:.1f}%"
            + (f", others on CPU 0 {foreign:.0f}%" if foreign is not None else "")
            + f", {took:.0f} s)",
            flush=True,
        )
        if result["errors"]:
            logged = "".join(f"; logged {e!r}" for e in result.get("log_errors", [])[:1])
            print(f"    errors: {result['error_samples'][:2]}{logged}", file=sys.stderr, flush=True)
        return result

    def phase(self, path: str, phase: Phase) -> dict[str, Any]:
        opts = self.opts
        model = PACED_MODEL if phase.paced else MODEL
        duration = opts.duration_s
        if phase.mode == "open":
            duration = max(duration, MIN_OPEN_REQUESTS / phase.rate)
        return self.load(
            path,
            phase.name,
            body=body(phase.stream, model),
            stream=phase.stream,
            mode=phase.mode,
            duration_s=duration,
            concurrency=opts.concurrency,
            rate=phase.rate or 100.0,
            warmup_requests=2 * opts.concurrency if phase.mode == "closed" else 20,
        )

    def warm_up(self, path: str) -> None:
        opts = self.opts
        for stream in (False, True):
            self.load(
                path,
                "warm-up (sse)" if stream else "warm-up",
                body=body(stream),
                stream=stream,
                mode="closed",
                concurrency=opts.concurrency,
                duration_s=opts.warmup_s,
                requests=max(50, round(opts.warmup_s * 300)),
            )


# --- the run -------------------------------------------------------------------------------------


def measure(runner: Runner, paths: list[str]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every phase on every path, `repeat` times with the path order rotated each time."""
    opts = runner.opts
    print("warm-up", flush=True)
    for path in paths:
        runner.warm_up(path)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for round_ in range(opts.repeat):
        order = paths[round_ % len(paths) :] + paths[: round_ % len(paths)]
        for phase in phases(opts):
            print(f"[{round_ + 1}/{opts.repeat}] {phase.title}", flush=True)
            for path in order:
                results.setdefault(phase.name, {}).setdefault(path, []).append(
                    runner.phase(path, phase)
                )
    return results


def summarize(
    opts: FieldOptions, raw: dict[str, dict[str, list[dict[str, Any]]]], paths: list[str]
) -> dict[str, dict[str, Any]]:
    """Per path: medians over the repeats (and the spread of the key ones), and per phase with
    failed requests a record of them. Windows in which every request failed give no figures."""

    def values(phase: str, path: str, pick: Callable[[dict[str, Any]], Any]) -> list[float]:
        return [v for r in raw[phase][path] if r["ok"] and (v := pick(r)) is not None]

    def quantile(metric: str, q: str) -> Callable[[dict[str, Any]], Any]:
        return lambda r: (r[metric] or {}).get(q)

    def added(phase: str, path: str, metric: str, q: str) -> list[float]:
        pairs = zip(raw[phase][path], raw[phase]["direct"], strict=True)
        return [
            a - b
            for mine, direct in pairs
            if mine["ok"]
            and direct["ok"]
            and (a := quantile(metric, q)(mine)) is not None
            and (b := quantile(metric, q)(direct)) is not None
        ]

    summary: dict[str, dict[str, Any]] = {}
    for path in paths:
        s: dict[str, Any] = {}
        figures: dict[str, list[str]] = {}  # phase -> the summary keys measured in it
        for phase, key in (("sat", ""), ("sat_stream", "stream_"), ("paced", "paced_")):
            thr = values(phase, path, lambda r: r["throughput_rps"])
            cpu = values(phase, path, lambda r: r["proxy_cpu_ms"])
            s[f"{key}throughput_rps"] = median(thr)
            s[f"{key}cpu_ms"] = median(cpu)
            s[f"{key}cpu_ms_range"] = [min(cpu), max(cpu)] if cpu else None
            figures[phase] = [f"{key}throughput_rps", f"{key}cpu_ms", f"{key}cpu_ms_range"]
        for rate in opts.rates:
            name, before = f"open{rate:g}", set(s)
            for q in ("p50", "p99"):
                s[f"{name}_{q}_ms"] = median(values(name, path, quantile("latency_ms", q)))
                if path != "direct":
                    diffs = added(name, path, "latency_ms", q)
                    s[f"{name}_added_{q}_ms"] = median(diffs)
                    s[f"{name}_added_{q}_ms_range"] = [min(diffs), max(diffs)] if diffs else None
            s[f"{name}_cpu_ms"] = median(values(name, path, lambda r: r["proxy_cpu_ms"]))
            figures[name] = [k for k in s if k not in before]
        before = set(s)
        for q in ("p50", "p99"):
            s[f"ttft_{q}_ms"] = median(values("ttft", path, quantile("ttft_ms", q)))
            if path != "direct":
                diffs = added("ttft", path, "ttft_ms", q)
                s[f"ttft_added_{q}_ms"] = median(diffs)
                s[f"ttft_added_{q}_ms_range"] = [min(diffs), max(diffs)] if diffs else None
        figures["ttft"] = [k for k in s if k not in before]
        foreign = [
            f
            for runs in raw.values()
            for r in runs.get(path, [])
            if (f := r.get("foreign_cpu0_percent")) is not None
        ]
        s["foreign_cpu0_percent_median"] = median(foreign)
        s["foreign_cpu0_percent_max"] = max(foreign, default=None)
        s["errors"] = sum(r["errors"] for runs in raw.values() for r in runs.get(path, []))
        s["steal_max_percent"] = max(
            max(r["steal_percent"].values(), default=0.0)
            for runs in raw.values()
            for r in runs.get(path, [])
        )
        s["failures"] = {
            phase: record
            for phase, runs in raw.items()
            if (record := _failures(runs.get(path, []), figures.get(phase, []))) is not None
        }
        summary[path] = s
    return summary


def _failures(runs: list[dict[str, Any]], figures: list[str]) -> dict[str, Any] | None:
    """What failed in one phase on one path (None: nothing): how many, the status and reason
    (`text`, e.g. `500 (TypeError: immutable)`), and whether every request failed, in which
    case the summary keys in `figures` hold no figure."""
    errors = sum(r["errors"] for r in runs)
    if not errors:
        return None
    samples = [sample for r in runs for sample in r["error_samples"]]
    logged = Counter(e for r in runs for e in r.get("log_errors", []))
    status, reason = contenders.failure_cause(samples, [e for e, _ in logged.most_common()])
    if status is not None:
        text = f"{status} ({reason})" if reason else str(status)
    else:
        text = reason or "errors"
    return {
        "all_failed": not any(r["ok"] for r in runs),
        "errors": errors,
        "requests": sum(r["requests"] for r in runs),
        "status": status,
        "reason": reason,
        "text": text,
        "samples": samples[:3],
        "logged": [e for e, _ in logged.most_common(3)],
        "figures": figures,
    }


# --- sharing through Redis and worker scaling ----------------------------------------------------


def admin_views(port: int, attempts: int = 24) -> list[dict[str, Any]]:
    """`/admin/latency` on fresh connections, one view per distinct worker that answered."""
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(attempts):
        view = json.loads(
            contenders.get(f"http://127.0.0.1:{port}/admin/latency", contenders.ADMIN_HEADERS)
        )
        routes = view.get("counters", {}).get("routes", {})
        local = sum(sum(v.values()) for m, v in routes.items() if m in MODELS)
        shared = sum((view.get("models", {}).get(m) or {}).get("requests", 0) for m in MODELS)
        identity = json.dumps(routes, sort_keys=True)  # per-process counters tell workers apart
        seen[identity] = {"local_requests": local, "shared_requests": shared}
    return list(seen.values())


def _cpu_s(pid: int) -> float:
    return proc_cpu_s(pid) or 0.0  # None: the process is gone, it used nothing more


def stop(stack: Stack, child: subprocess.Popen[bytes]) -> None:
    child.terminate()
    try:
        child.wait(timeout=15)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    with contextlib.suppress(ValueError):
        stack.procs.remove(child)


def scaling(runner: Runner, upstream_port: int, otlp_port: int) -> dict[str, Any]:
    """Saturated throughput of Tailguard with 1 and with N workers, and the shared statistics."""
    opts, stack = runner.opts, runner.stack
    found: dict[str, Any] = {}
    for workers in (1, opts.workers):
        redis_port, port = free_port(), free_port()
        redis = contenders.start_redis(stack, redis_port, f"redis-w{workers}.log")
        gateway = contenders.start_tailguard(
            stack,
            port=port,
            upstream_port=upstream_port,
            redis_port=redis_port,
            otlp_port=otlp_port,
            models=MODELS,
            workers=workers,
            role="scaling",  # not pinned: the workers may use both CPUs
            name=f"tailguard-w{workers}",
        )
        path = f"tailguard-w{workers}"
        runner.ports[path] = port
        time.sleep(1.0)  # uvicorn's workers are up once /healthz answers from one of them
        runner.cpu_pids[path] = contenders.descendants(gateway.pid)
        print(f"Tailguard, {workers} worker(s): processes {runner.cpu_pids[path]}", flush=True)
        runner.warm_up(path)
        runs = [runner.phase(path, phases(opts)[0]) for _ in range(opts.repeat)]
        time.sleep(3.0)  # a flush (1 s) and a snapshot refresh after the last request
        views = admin_views(port)
        stop(stack, gateway)
        stop(stack, redis)
        found[str(workers)] = {
            "throughput_rps": median([r["throughput_rps"] for r in runs]),
            "throughput_rps_runs": [r["throughput_rps"] for r in runs],
            "cpu_ms": median([r["proxy_cpu_ms"] for r in runs if r["proxy_cpu_ms"] is not None]),
            "requests_sent": runner.sent.get(path, 0),
            "errors": sum(r["errors"] for r in runs),
            "workers_seen": views,
        }
    one, many = found["1"]["throughput_rps"], found[str(opts.workers)]["throughput_rps"]
    found["speedup"] = ratio(many, one)
    views = found[str(opts.workers)]["workers_seen"]
    sent = found[str(opts.workers)]["requests_sent"]
    found["sharing_verified"] = (
        len(views) == opts.workers
        and all(v["shared_requests"] == sent for v in views)
        and sum(v["local_requests"] for v in views) == sent
    )
    return found


# --- profiling -----------------------------------------------------------------------------------


def profile(runner: Runner, pid: int) -> dict[str, Any]:
    """py-spy on the single-worker gateway under saturated non-streaming and streaming load."""
    py_spy = profiling.find_py_spy(VENV_BIN)
    if py_spy is None:
        print("profile: skipped, py-spy not found (.venv/bin/pip install py-spy)", flush=True)
        return {"skipped": "py-spy not found"}
    found: dict[str, Any] = {}
    opts = runner.opts
    for phase in phases(opts)[:2]:
        out = runner.stack.logs / f"profile-{phase.name}.txt"
        spy = profiling.start(
            py_spy, pid, opts.duration_s + 1, out, runner.stack.pin.get("profiler", [])
        )
        time.sleep(0.5)  # py-spy attaches before the window starts
        runner.phase("tailguard", phase)
        _, err = spy.communicate(timeout=opts.duration_s + 60)
        if not out.exists():
            message = err.decode(errors="replace").strip().splitlines()[:1]
            print(f"profile: py-spy failed: {message}", flush=True)
            found[phase.name] = {"error": message}
            continue
        result = profiling.analyse(out.read_text())
        for line in profiling.render(f"profile, {phase.title}", result):
            print(line)
        found[phase.name] = result.as_dict()
    return found


def feature_costs(runner: Runner, upstream_port: int, otlp_port: int) -> list[dict[str, Any]]:
    """Saturated CPU per request of Tailguard with its features taken away one at a time: all
    variants run side by side (each pinned to CPU 0 in its turn), in rotating rounds."""
    opts, stack = runner.opts, runner.stack
    redis_port = free_port()
    started = [contenders.start_redis(stack, redis_port, "redis-variants.log")]
    variants = []
    for i, (label, config, env) in enumerate(
        contenders.feature_variants(0, upstream_port, redis_port, otlp_port, MODELS)
    ):
        path, port = f"variant{i}", free_port()
        config["server"]["port"] = port
        child = contenders.start_tailguard(
            stack,
            port=port,
            upstream_port=upstream_port,
            redis_port=redis_port,
            otlp_port=otlp_port,
            models=MODELS,
            name=path,
            config=config,
            env=env,
        )
        started.append(child)
        runner.ports[path], runner.cpu_pids[path] = port, [child.pid]
        variants.append((label, path))
    print("what each feature costs (saturated, non-streaming):", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {path: [] for _, path in variants}
    for round_ in range(opts.repeat):
        shift = round_ % len(variants)
        for _, path in variants[shift:] + variants[:shift]:
            runs[path].append(runner.phase(path, phases(opts)[0]))
    for child in reversed(started):
        stop(stack, child)
    found = []
    for label, path in variants:
        cpu = median([r["proxy_cpu_ms"] for r in runs[path] if r["proxy_cpu_ms"] is not None])
        thr = median([r["throughput_rps"] for r in runs[path]])
        found.append({"variant": label, "cpu_ms": cpu, "throughput_rps": thr})
    return found


# --- main ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _logs(keep: bool) -> Iterator[Path]:
    logs = Path(tempfile.mkdtemp(prefix="tailguard-field-"))
    try:
        yield logs
    finally:
        if keep:
            print(f"logs: {logs}", file=sys.stderr)
        else:
            shutil.rmtree(logs, ignore_errors=True)


def run(opts: FieldOptions) -> int:
    """The whole comparison; 0 when every target passes, 1 when one is missed, 2 on failure."""
    notes: list[str] = []
    litellm = nginx = portkey = None
    if opts.litellm:
        litellm = contenders.find_litellm(install=True)
        if litellm.path is None:
            notes.append(f"LiteLLM skipped: {litellm.reason}")
    if opts.portkey:
        portkey = _portkey.find_portkey(install=True)
        if portkey.path is None:
            notes.append(f"Portkey skipped: {portkey.reason}")
    if opts.nginx:
        nginx = contenders.find_nginx()
        if nginx.path is None:
            notes.append(f"nginx skipped: {nginx.reason}")
    for note in notes:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    pin, warning = pinning()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
        notes.append(warning)
    with _logs(opts.keep_logs) as logs:
        stack = Stack(logs=logs, pin=pin, cwd=ROOT)
        try:
            with sigterm_as_interrupt():
                return _run(opts, stack, notes, litellm, nginx, portkey)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        except (RuntimeError, OSError, urllib.error.URLError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        finally:
            stack.stop()


def _run(
    opts: FieldOptions,
    stack: Stack,
    notes: list[str],
    litellm: contenders.Found | None,
    nginx: contenders.Found | None,
    portkey: contenders.Found | None,
) -> int:
    ports = {"direct": free_port(), "tailguard": free_port()}
    redis_port, otlp_port = free_port(), free_port()
    upstream = contenders.start_upstream(
        stack, ports["direct"], opts.tokens, PACED_MODEL, opts.paced_tps
    )
    contenders.start_redis(stack, redis_port)
    contenders.start_otlp_sink(stack, otlp_port)
    roots = {
        "tailguard": contenders.start_tailguard(
            stack,
            port=ports["tailguard"],
            upstream_port=ports["direct"],
            redis_port=redis_port,
            otlp_port=otlp_port,
            models=MODELS,
        ).pid
    }
    versions: dict[str, str] = contenders.tool_versions()
    if opts.baseline is not None:
        ports["baseline"] = free_port()
        roots["baseline"] = _start_baseline(stack, opts.baseline, ports, otlp_port).pid
        versions["baseline"] = _revision(opts.baseline)
    if litellm is not None and litellm.path is not None:
        ports["litellm"] = free_port()
        roots["litellm"] = contenders.start_litellm(
            stack, litellm.path, ports["litellm"], ports["direct"], MODELS
        ).pid
        versions["litellm"] = litellm.version or "?"
    headers: dict[str, dict[str, str]] = {}
    if portkey is not None and portkey.path is not None:
        ports["portkey"] = free_port()
        roots["portkey"] = _portkey.start_portkey(stack, portkey.path, ports["portkey"]).pid
        headers["portkey"] = _portkey.request_headers(ports["direct"])
        versions |= _portkey.versions(portkey)
    if nginx is not None and nginx.path is not None:
        ports["nginx"] = free_port()
        roots["nginx"] = contenders.start_nginx(
            stack, nginx.path, ports["nginx"], ports["direct"]
        ).pid
        versions["nginx"] = nginx.version or "?"
    if opts.reference:
        ports["reference"] = free_port()
        roots["reference"] = contenders.start_reference(
            stack, ports["reference"], ports["direct"]
        ).pid
    paths = ["direct", *(p for p in PROXIES if p in ports)]
    runner = Runner(stack, opts, ports, headers=headers)
    # Where each path says why a request failed (nginx's own errors go to its error log).
    logged = {"direct": "upstream.log", "nginx": "nginx/nginx-error.log", "reference": "ref.log"}
    runner.logs = {p: stack.logs / logged.get(p, f"{p}.log") for p in paths}
    time.sleep(0.5)  # nginx forks its worker after it answers; let it settle
    runner.cpu_pids = {path: contenders.descendants(pid) for path, pid in roots.items()}
    print(
        "paths: "
        + ", ".join(f"{LABELS[p]} :{ports[p]}" for p in paths)
        + f" (upstream pid {upstream.pid}); versions: "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"; {opts.duration_s:g} s windows, {opts.repeat} repeats",
        flush=True,
    )
    auth = _auth_state(ports["tailguard"])
    raw = measure(runner, paths)
    checks = _checks(ports["tailguard"], otlp_port, runner.sent.get("tailguard", 0))
    checks["auth"] = auth
    for child in stack.procs:
        if child.poll() is not None:
            role = stack.roles.get(child.pid, "a process")
            raise RuntimeError(f"the {role} exited during the run (see --keep-logs)")
    summary = summarize(opts, raw, paths)
    profile_result = profile(runner, roots["tailguard"]) if opts.profile else None
    costs = feature_costs(runner, ports["direct"], otlp_port) if opts.profile else None
    scaled = scaling(runner, ports["direct"], otlp_port) if opts.workers > 1 else None

    print()
    for line in table(opts, summary, paths):
        print(line)
    ratio_lines = ratios(summary, opts)
    if ratio_lines:
        print()
    for line in ratio_lines:
        print(line)
    print(
        f"\nTailguard features: auth {checks['auth']}; Redis store {checks['store']}; "
        f"{checks['spans']} spans received by the OTLP sink for {checks['requests']} requests "
        f"({checks['spans_dropped']} dropped by the exporter)"
    )
    if costs is not None:
        print(f"\nwhat each feature costs (saturated, non-streaming, median of {opts.repeat}):")
        for line in feature_lines(costs):
            print(line)
    if scaled is not None:
        print(f"\nscaling, saturated non-streaming, c={opts.concurrency}, Tailguard not pinned:")
        for line in scaling_lines(opts, scaled):
            print(line)
    verdicts = targets(opts, summary, scaled)
    print()
    for target in verdicts:
        shown = fmt(target.value, 3) + ("" if target.unit == "x" else f" {target.unit}")
        limit = f"{'>=' if target.at_least else '<='} {target.limit:g}"
        print(f"  {target.verdict():<4}  {target.label}: {shown} (target {limit}; {target.detail})")
    errors = sum(s["errors"] for s in summary.values())
    if errors:
        print(f"  note: {errors} requests failed in total (see the JSON for samples)")
    for note in overload_notes(opts, summary):
        print(f"  note: {note}")
    steal = max(s["steal_max_percent"] for s in summary.values())
    print(f"\nmachine noise: up to {steal:.1f}% of a CPU stolen by the hypervisor in a window")
    foreign = [
        (LABELS[p], s["foreign_cpu0_percent_median"], s["foreign_cpu0_percent_max"])
        for p, s in summary.items()
        if s.get("foreign_cpu0_percent_median") is not None
    ]
    if foreign:
        print(
            "other processes on CPU 0 while a proxy ran (median / max of the windows): "
            + ", ".join(f"{name} {fmt(a, 0)}% / {fmt(b, 0)}%" for name, a, b in foreign)
        )
    if steal > NOISY_STEAL_PERCENT:
        print("warning: a busy machine; the CPU figures and the ratios hold better than latencies")

    document = {
        "benchmark": "overhead-field",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": environment(),
        "versions": versions,
        "settings": {
            "litellm_env": contenders.LITELLM_ENV,
            "litellm_general_settings": {
                k: ("<the bench key>" if k == "master_key" else v)
                for k, v in contenders.LITELLM_GENERAL_SETTINGS.items()
            },
            "litellm_settings": contenders.LITELLM_SETTINGS,
            "litellm_command": "litellm --config <file> --host 127.0.0.1 --num_workers 1",
            "portkey_command": "node <@portkey-ai/gateway>/build/start-server.js --port=<port> "
            + " ".join(_portkey.PORTKEY_ARGS),
            "portkey_env": _portkey.PORTKEY_ENV,
            "portkey_headers": _portkey.request_headers(0) | _PORTKEY_HEADERS_SHOWN,
            "nginx_conf": contenders.NGINX_CONF,
            "tailguard_config": contenders.tailguard_config(0, 0, 0, MODELS),
        },
        "options": {
            "duration_s": opts.duration_s,
            "repeat": opts.repeat,
            "concurrency": opts.concurrency,
            "rates": list(opts.rates),
            "stream_rate": opts.stream_rate,
            "tokens": opts.tokens,
            "paced_tps": opts.paced_tps,
            "pinned": not any("taskset" in n or "CPUs" in n for n in notes),
        },
        "notes": notes,
        "checks": checks,
        "summary": summary,
        "targets": [t.as_dict() for t in verdicts],
        "scaling": scaled,
        "profile": profile_result,
        "feature_costs": costs,
        "phases": raw,
    }
    opts.json_path.parent.mkdir(parents=True, exist_ok=True)
    opts.json_path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nresults: {opts.json_path}")
    missed = any(t.verdict() == "MISS" for t in verdicts)
    # A contender's failures are its result, shown in the table; ours fail the run.
    ours = sum(summary[p]["errors"] for p in ("direct", "tailguard", "reference") if p in summary)
    return 1 if missed or ours else 0


def _start_baseline(
    stack: Stack, checkout: Path, ports: dict[str, int], otlp_port: int
) -> subprocess.Popen[bytes]:
    """Tailguard from `checkout`, every feature on, with a Redis of its own (the two must not
    share statistics or rate-limit buckets). `python -m gateway` imports the package of its
    working directory first, so the process runs that checkout's code."""
    redis_port = free_port()
    contenders.start_redis(stack, redis_port, "redis-baseline.log")
    here, stack.cwd = stack.cwd, checkout
    try:
        return contenders.start_tailguard(
            stack,
            port=ports["baseline"],
            upstream_port=ports["direct"],
            redis_port=redis_port,
            otlp_port=otlp_port,
            models=MODELS,
            name="baseline",
        )
    finally:
        stack.cwd = here


def _revision(checkout: Path) -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(checkout), "log", "-1", "--format=%h %cs"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return str(checkout)
    return done.stdout.strip() or str(checkout)


def _auth_state(port: int) -> str:
    """Whether a request without the key is refused (auth enforced) or served."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=body(False).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return f"configured, not enforced (a request without the key got {response.status})"
    except urllib.error.HTTPError as exc:
        return f"enforced (a request without the key got {exc.code})"


def _checks(port: int, otlp_port: int, requests: int) -> dict[str, Any]:
    """That the features really ran: store health, spans exported, spans dropped."""
    time.sleep(6.0)  # the span exporter's schedule delay is 5 s
    view = json.loads(
        contenders.get(f"http://127.0.0.1:{port}/admin/latency", contenders.ADMIN_HEADERS)
    )
    metrics = contenders.get(f"http://127.0.0.1:{port}/metrics", contenders.ADMIN_HEADERS)
    dropped = 0.0
    for line in metrics.decode().splitlines():
        if line.startswith("tailguard_trace_spans_dropped"):
            dropped = float(line.split()[-1])
    store = view.get("store", {})
    return {
        "store": f"{store.get('type')} {store.get('state')}",
        "store_health": store,
        "spans": contenders.otlp_stats(otlp_port)["spans"],
        "spans_dropped": int(dropped),
        "requests": requests,
    }
