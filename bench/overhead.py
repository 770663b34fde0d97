"""What the gateway adds: the same load sent straight to an upstream and through the gateway.

Setup. The simulated upstream (`tailguard sim`) with two models: `bench` answers at once (no
sleeps: all of a stream's events are written back to back), `bench-paced` decodes at
`--paced-tps` tokens/s (default 100), so each event reaches the proxy in a network read of its
own, as from a real model. Every answer carries 20 content tokens. The gateway (`tailguard
serve`, one uvicorn worker) routes both model names to that upstream. The gateway is pinned to
CPU 0; the upstream and the load generator share CPU 1 (`taskset`), so the gateway's own work
never competes with the traffic around it. Everything is on 127.0.0.1.

Load. `bench/_load.py`, in a process of its own: raw HTTP/1.1 on keep-alive connections, parsed
with httptools on uvloop, so the client costs little next to what it measures. Every path gets
exactly the same generator, request bytes and schedule; only the port differs. Every answer is
checked (status, 20 content tokens, `[DONE]` at the end of a stream).

Phases, each run on every path (direct, then the gateway) after a warm-up of both:
1. closed loop, 32 concurrent non-streaming chat completions for `--duration` seconds:
   throughput, and the gateway's CPU per request when saturated.
2. open loop, non-streaming, 100 requests/s at fixed send times: latency p50/p99 measured from
   each request's scheduled time (or its actual start when the timer fired early), so a stall
   cannot hide behind the requests it delayed (no coordinated omission).
3. open loop, streaming, 50 streams/s of 20 content chunks: TTFT (to the first `data:` event with
   a non-empty `delta.content`) and total time, p50/p99.
4. closed loop, 32 concurrent zero-delay streams: stream throughput, CPU per stream when
   saturated (the events of a stream arrive in a read or two: the cheapest case).
5. closed loop, 32 concurrent paced streams (~0.2 s each at 100 tokens/s): CPU per stream with
   one read, parse and write per event, the figure the per-stream target is checked against.

Costs. The gateway's CPU time (utime+stime of the process from `/proc/<pid>/stat`, read by the
load generator right before the first and after the last request of a window) divided by the
requests in that window: the steady figure on a noisy machine, where latency percentiles wander.
The per-request target is checked against the saturated figure (phase 1). The open-loop figures
are higher because at a light, even load every request also pays for waking an idle process
(cold caches, a loop iteration per event). `--reference` runs every phase through a bare aiohttp
proxy too (`bench/_refproxy.py`), the floor of a Python proxy on the machine at hand. RSS
(`VmRSS`, and the peak `VmHWM`) after the warm-up and at the end.

Noise. The load generator also reports the hypervisor's steal time per CPU (`/proc/stat`) and its
own timer lateness; when either is high the run says its latency percentiles mean little.

"Added" latency is the gateway's percentile minus the direct one. The targets are printed with
PASS/FAIL; the results go to `bench/results/overhead.json` (or `--json PATH`). The exit status is
0 when every target passes, 1 when one fails, 2 when the run itself failed.

    .venv/bin/python bench/overhead.py              # ~2 minutes
    .venv/bin/python bench/overhead.py --quick      # smoke run, ~40 s
    .venv/bin/python bench/overhead.py --reference  # also the bare proxy, ~3 minutes

Against the field (`bench/_field.py`, `bench/_contenders.py`, `bench/_portkey.py`):
`--litellm`, `--portkey`, `--nginx`, `--field` (all three) measure Tailguard with every feature
on (budgets and fallbacks, the Redis latency store, traces exported over OTLP, the access log,
API keys) against LiteLLM's proxy (the pinned release, in its own virtualenv in
`bench/.venvs/litellm`, made on first use), Portkey's open-source gateway (`@portkey-ai/gateway`
on `node`, installed with npm into `bench/.node/portkey` on first use) and nginx `proxy_pass`,
`--repeat` times, medians; a contender that cannot be found or installed is skipped with a
message, and a phase whose requests all fail on a path is shown as failed, with the status and
the reason. `--workers N` adds Tailguard's throughput with 1 and N workers sharing statistics
through Redis; `--profile` samples the gateway with py-spy under saturated load and measures what
each of its features costs.

    .venv/bin/python bench/overhead.py --field --workers 2 --profile   # ~20 minutes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if not __package__:  # `python bench/<script>.py`: `bench` is imported from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench import _field as field_run
from bench._harness import sigterm_as_interrupt
from bench._load import LoadSpec, run_load
from gateway.tools.stack import Stack as _Stack
from gateway.tools.stack import free_port, serve

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
DEFAULT_JSON = ROOT / "bench" / "results" / "overhead.json"
MODEL = "bench"  # answers at once: all of a stream's events are written back to back
PACED_MODEL = "bench-paced"  # decodes at --paced-tps: one network read per event, as in production
PROMPT = "Explain in one sentence why tail latency matters for interactive LLM applications."
# Above these, latency percentiles say more about the machine than about the gateway.
NOISY_STEAL_PERCENT = 2.0
NOISY_LAG_MS = 2.0

# The targets: (key in the summary, label, limit, unit).
TARGETS: tuple[tuple[str, str, float, str], ...] = (
    ("cpu_ms_per_request", "gateway CPU per non-streaming request (saturated)", 1.0, "ms"),
    ("cpu_ms_per_stream", "gateway CPU per {tokens}-chunk stream (paced, c={conc})", 2.0, "ms"),
    ("added_p50_ms", "added latency p50 at {rate:g} RPS", 1.0, "ms"),
    ("added_p99_ms", "added latency p99 at {rate:g} RPS", 3.0, "ms"),
    ("added_ttft_p50_ms", "added TTFT p50 ({srate:g} streams/s)", 1.0, "ms"),
)


@dataclass(slots=True)
class Options:
    duration_s: float
    warmup_s: float
    concurrency: int
    rate: float
    stream_rate: float
    tokens: int
    paced_tps: float
    json_path: Path
    keep_logs: bool
    reference: bool
    field: field_run.FieldOptions | None = None  # set: the comparison against the field


@dataclass(slots=True)
class Stack(_Stack):
    """The processes of one run (roles: gateway, reference, upstream, load), and run notes."""

    notes: list[str] = field(default_factory=list)


# --- helpers -------------------------------------------------------------------------------------


def memory_kib(pid: int) -> dict[str, int]:
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as file:
        for line in file:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                values[name] = int(rest.split()[0])
    return values


def pinning() -> tuple[dict[str, list[str]], str | None]:
    """taskset prefixes per role; a warning when the processes cannot be pinned."""
    unpinned: dict[str, list[str]] = {"gateway": [], "reference": [], "upstream": [], "load": []}
    taskset = shutil.which("taskset")
    if taskset is None:
        return unpinned, "taskset not found: running unpinned, CPU figures are noisier"
    available = os.sched_getaffinity(0)
    if not {0, 1} <= available:
        return unpinned, f"CPUs 0 and 1 are not both available ({sorted(available)}): unpinned"
    return {
        "gateway": [taskset, "-c", "0"],
        "reference": [taskset, "-c", "0"],
        "upstream": [taskset, "-c", "1"],
        "load": [taskset, "-c", "1"],
    }, None


def request_body(stream: bool, model: str = MODEL) -> str:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":"))


# --- the run -------------------------------------------------------------------------------------


def start_upstream(stack: Stack, port: int, opts: Options) -> subprocess.Popen[bytes]:
    profiles = stack.logs / "sim.yaml"
    profiles.write_text(
        f"default: {{output_tokens: {opts.tokens}}}\n"
        f"profiles: {{{PACED_MODEL}: {{output_tokens: {opts.tokens}, "
        f"tokens_per_s: {opts.paced_tps:g}}}}}\n"
    )
    command = [
        str(VENV_BIN / "tailguard"),
        "sim",
        "--port",
        str(port),
        "--seed",
        "1",
        "--profile",
        str(profiles),
    ]
    return stack.start_ready("upstream", command, "upstream.log", f"http://127.0.0.1:{port}/health")


def start_gateway(stack: Stack, port: int, upstream_port: int) -> subprocess.Popen[bytes]:
    config = stack.logs / "gateway.yaml"
    config.write_text(
        f"server: {{host: 127.0.0.1, port: {port}}}\n"
        f'providers: {{up: {{type: vllm, base_url: "http://127.0.0.1:{upstream_port}/v1"}}}}\n'
        "models:\n"
        + "".join(
            f"  - {{name: {name}, deployments: [{{provider: up, model: {name}}}]}}\n"
            for name in (MODEL, PACED_MODEL)
        )
    )
    return serve(stack, port, config)


def start_reference(stack: Stack, port: int, upstream_port: int) -> subprocess.Popen[bytes]:
    script = str(Path(__file__).with_name("_refproxy.py"))
    upstream = f"http://127.0.0.1:{upstream_port}/v1"
    command = [sys.executable, script, str(port), upstream]
    return stack.start_ready("reference", command, "ref.log", f"http://127.0.0.1:{port}/healthz")


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    title: str
    stream: bool
    mode: str  # closed | open
    paced: bool = False  # the upstream decodes at --paced-tps instead of answering at once


PHASES = (
    Phase("closed", "closed loop, non-streaming", stream=False, mode="closed"),
    Phase("open", "open loop, non-streaming", stream=False, mode="open"),
    Phase("stream", "open loop, streaming", stream=True, mode="open"),
    Phase("closed_stream", "closed loop, streaming", stream=True, mode="closed"),
    Phase("paced_stream", "closed loop, paced streaming", stream=True, mode="closed", paced=True),
)


def measure(
    opts: Options, stack: Stack, ports: dict[str, int], pids: dict[str, int]
) -> dict[str, Any]:
    """Every phase on every path; returns the raw results per phase and path."""
    paths = [path for path in ("direct", "gateway", "reference") if path in ports]

    def load(path: str, label: str, **kw: Any) -> dict[str, Any]:
        charged = {"upstream": pids["upstream"]}
        if path != "direct":
            charged["proxy"] = pids[path]
        spec = LoadSpec(port=ports[path], cpu_pids=charged, expect_tokens=opts.tokens, **kw)
        started = time.monotonic()
        result = run_load(spec, prefix=stack.pin["load"], procs=stack.procs)
        took = time.monotonic() - started
        cpu = result["cpu_ms_per_request"].get("proxy")
        extra = f"  {path} CPU {cpu:.3f} ms/req" if cpu is not None else ""
        p50 = result["latency_ms"].get("p50", float("nan"))
        steal = max(result["steal_percent"].values(), default=0.0)
        print(
            f"  {label:<14} {path:<9} {result['ok']:>6} ok {result['errors']:>3} errors "
            f"{result['throughput_rps']:>7.0f} req/s  p50 {p50:6.2f} ms{extra}  "
            f"(steal {steal:.1f}%, {took:.1f} s)",
            flush=True,
        )
        if result["errors"]:
            print(f"    errors: {result['error_samples']}", file=sys.stderr)
        return result

    bodies = {False: request_body(False), True: request_body(True)}
    paced_body = request_body(True, PACED_MODEL)
    results: dict[str, Any] = {}

    print("warm-up", flush=True)
    warm = max(50, round(opts.warmup_s * 500))
    for path in paths:
        for stream in (False, True):
            load(
                path,
                "warm-up (sse)" if stream else "warm-up",
                body=bodies[stream],
                stream=stream,
                mode="closed",
                concurrency=opts.concurrency,
                duration_s=opts.warmup_s,
                requests=warm,
            )
    results["rss_after_warmup_kib"] = memory_kib(pids["gateway"])

    for phase in PHASES:
        rate = opts.stream_rate if phase.stream else opts.rate
        detail = f", {rate:g}/s" if phase.mode == "open" else f", concurrency {opts.concurrency}"
        if phase.paced:
            detail += f", {opts.paced_tps:g} tokens/s"
        print(phase.title + detail, flush=True)
        kw: dict[str, Any] = {
            "body": paced_body if phase.paced else bodies[phase.stream],
            "stream": phase.stream,
            "mode": phase.mode,
            "duration_s": opts.duration_s,
            "concurrency": opts.concurrency,
            "rate": rate,
            "warmup_requests": 2 * opts.concurrency if phase.mode == "closed" else 20,
        }
        results[phase.name] = {path: load(path, phase.name, **kw) for path in paths}
    results["rss_end_kib"] = memory_kib(pids["gateway"])
    return results


def summarize(raw: dict[str, Any], proxy: str = "gateway") -> dict[str, Any]:
    """The headline figures of `proxy` (the gateway, or the reference proxy) against direct."""

    def q(phase: str, path: str, metric: str, quantile: str) -> float:
        value: float = raw[phase][path][metric][quantile]
        return value

    def added(phase: str, metric: str, quantile: str) -> float:
        return q(phase, proxy, metric, quantile) - q(phase, "direct", metric, quantile)

    def cpu(phase: str) -> float:
        value: float = raw[phase][proxy]["cpu_ms_per_request"]["proxy"]
        return value

    summary: dict[str, Any] = {
        "throughput_direct_rps": raw["closed"]["direct"]["throughput_rps"],
        "throughput_rps": raw["closed"][proxy]["throughput_rps"],
        "stream_throughput_rps": raw["closed_stream"][proxy]["throughput_rps"],
        # Saturated (closed loop): the steady per-request cost the targets are set against.
        "cpu_ms_per_request": cpu("closed"),
        # A stream's cost depends on how its events arrive: one network read per event (paced, as
        # from a real model) is the honest figure; zero-delay streams arrive in a read or two.
        "cpu_ms_per_stream": cpu("paced_stream"),
        "cpu_ms_per_stream_burst": cpu("closed_stream"),
        # At a light, even load every request also pays for waking an idle process.
        "cpu_ms_per_request_open": cpu("open"),
        "cpu_ms_per_stream_open": cpu("stream"),
        "added_p50_ms": added("open", "latency_ms", "p50"),
        "added_p99_ms": added("open", "latency_ms", "p99"),
        "added_ttft_p50_ms": added("stream", "ttft_ms", "p50"),
        "added_ttft_p99_ms": added("stream", "ttft_ms", "p99"),
        "added_paced_ttft_p50_ms": added("paced_stream", "ttft_ms", "p50"),
        "errors": sum(raw[p.name][path]["errors"] for p in PHASES for path in ("direct", proxy)),
        # How much the machine itself disturbed the run.
        "steal_max_percent": max(
            max(raw[p.name][path]["steal_percent"].values(), default=0.0)
            for p in PHASES
            for path in ("direct", proxy)
        ),
        "send_lag_p99_max_ms": max(
            raw[p.name][path]["send_lag_ms"]["p99"]
            for p in PHASES
            if p.mode == "open"
            for path in ("direct", proxy)
        ),
    }
    if proxy == "gateway":
        summary |= {
            "rss_after_warmup_mib": raw["rss_after_warmup_kib"]["VmRSS"] / 1024,
            "rss_end_mib": raw["rss_end_kib"]["VmRSS"] / 1024,
            "rss_peak_mib": raw["rss_end_kib"]["VmHWM"] / 1024,
        }
    return summary


def report(opts: Options, raw: dict[str, Any], summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Print the table and the targets; return the verdicts."""
    reference = "reference" in raw["closed"]
    paths = ["direct", "gateway", *(["reference"] if reference else [])]
    rows: list[list[str]] = []

    def fmt(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}"

    def versus(direct: float | None, value: float | None, ratio: bool) -> str:
        if direct is None or value is None:
            return ""
        return f"{value / direct:.2f}x" if ratio else f"{value - direct:+.2f}"

    def row(label: str, phase: str, metric: str, quantile: str) -> None:
        values = {path: raw[phase][path][metric][quantile] for path in paths}
        line = [
            label,
            fmt(values["direct"]),
            fmt(values["gateway"]),
            versus(values["direct"], values["gateway"], False),
        ]
        if reference:
            line += [fmt(values["reference"]), versus(values["direct"], values["reference"], False)]
        rows.append(line)

    def cpu_row(label: str, phase: str) -> None:
        per = {path: raw[phase][path]["cpu_ms_per_request"] for path in paths}
        line = [label, "", fmt(per["gateway"]["proxy"]), ""]
        if reference:
            line += [fmt(per["reference"]["proxy"]), ""]
        rows.append(line)

    conc, rate, srate = opts.concurrency, f"{opts.rate:g}", f"{opts.stream_rate:g}"
    tps = f"{opts.paced_tps:g}"
    throughputs = (
        ("closed", f"closed c={conc} requests/s"),
        ("closed_stream", f"closed c={conc} streams/s"),
        ("paced_stream", f"paced c={conc} streams/s ({tps} tok/s)"),
    )
    for phase, label in throughputs:
        values = {path: raw[phase][path]["throughput_rps"] for path in paths}
        line = [
            label,
            f"{values['direct']:.0f}",
            f"{values['gateway']:.0f}",
            versus(values["direct"], values["gateway"], True),
        ]
        if reference:
            line += [
                f"{values['reference']:.0f}",
                versus(values["direct"], values["reference"], True),
            ]
        rows.append(line)
    for quantile in ("p50", "p99"):
        row(f"closed c={conc} latency {quantile} (ms)", "closed", "latency_ms", quantile)
    for quantile in ("p50", "p90", "p99", "max"):
        row(f"open {rate}/s latency {quantile} (ms)", "open", "latency_ms", quantile)
    for metric, name in (("ttft_ms", "TTFT"), ("latency_ms", "total")):
        for quantile in ("p50", "p99"):
            row(f"stream {srate}/s {name} {quantile} (ms)", "stream", metric, quantile)
    for quantile in ("p50", "p99"):
        row(f"paced c={conc} TTFT {quantile} (ms)", "paced_stream", "ttft_ms", quantile)
    row(f"paced c={conc} total p50 (ms)", "paced_stream", "latency_ms", "p50")
    chunks = f"{opts.tokens}-chunk stream"
    cpu_row(f"CPU ms / request (closed c={conc})", "closed")
    cpu_row(f"CPU ms / request (open {rate}/s)", "open")
    cpu_row(f"CPU ms / {chunks} (paced c={conc})", "paced_stream")
    cpu_row(f"CPU ms / {chunks} (zero-delay, closed c={conc})", "closed_stream")
    cpu_row(f"CPU ms / {chunks} (zero-delay, open {srate}/s)", "stream")
    rows.append(
        [
            "gateway RSS warm-up / end / peak (MiB)",
            "",
            f"{summary['rss_after_warmup_mib']:.1f} / {summary['rss_end_mib']:.1f} / "
            f"{summary['rss_peak_mib']:.1f}",
            "",
        ]
        + (["", ""] if reference else [])
    )

    header = ["", "direct", "gateway", "added/ratio"]
    if reference:
        header += ["bare proxy", "added/ratio"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for line in [header, *rows]:
        cells = [line[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(line[1:], widths[1:], strict=True)]
        print("  ".join(cells))
    if reference:
        print(
            "(bare proxy: bench/_refproxy.py, aiohttp behind a bare ASGI app: the floor on "
            "this machine)"
        )

    print()
    verdicts = []
    for key, template, limit, unit in TARGETS:
        label = template.format(
            rate=opts.rate, srate=opts.stream_rate, tokens=opts.tokens, conc=opts.concurrency
        )
        value = summary[key]
        passed = value <= limit
        verdicts.append(
            {"target": label, "key": key, "value": value, "limit": limit, "pass": passed}
        )
        print(
            f"  {'PASS' if passed else 'FAIL'}  {label}: {value:.3f} {unit} (target <= {limit:g})"
        )
    if summary["errors"]:
        print(f"  FAIL  {summary['errors']} requests failed (see the JSON for samples)")

    steal, lag = summary["steal_max_percent"], summary["send_lag_p99_max_ms"]
    print(
        f"\nmachine noise: up to {steal:.1f}% of a CPU stolen by the hypervisor in a phase; "
        f"load generator timer lag p99 up to {lag:.2f} ms"
    )
    if steal > NOISY_STEAL_PERCENT or lag > NOISY_LAG_MS:
        print(
            "warning: the machine was too busy for the latency percentiles of this run to mean "
            "much (the CPU figures hold better); run again when it is quiet"
        )
    return verdicts


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--duration",
        type=float,
        default=10.0,
        help="seconds per measured phase and path (default 10)",
    )
    parser.add_argument("--quick", action="store_true", help="2.5 s phases: a smoke run")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop workers")
    parser.add_argument("--rate", type=float, default=100.0, help="open-loop requests/s")
    parser.add_argument("--stream-rate", type=float, default=50.0, help="open-loop streams/s")
    parser.add_argument("--tokens", type=int, default=20, help="content chunks per answer")
    parser.add_argument(
        "--paced-tps",
        type=float,
        default=100.0,
        help="decode speed of the paced streams, tokens/s (default 100)",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also run every phase through a bare aiohttp proxy (the floor on this machine)",
    )
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the temporary directory with configs and process logs",
    )
    field = parser.add_argument_group(
        "against the field",
        "Tailguard with every feature on against LiteLLM, Portkey and nginx (any of these flags; "
        "results go to bench/results/overhead-field.json unless --json)",
    )
    field.add_argument(
        "--litellm",
        action="store_true",
        help="compare with LiteLLM's proxy (installed into bench/.venvs/litellm on first use)",
    )
    field.add_argument(
        "--portkey",
        action="store_true",
        help="compare with Portkey's gateway (installed into bench/.node/portkey on first use)",
    )
    field.add_argument("--nginx", action="store_true", help="compare with nginx proxy_pass")
    field.add_argument(
        "--field",
        action="store_true",
        help="all of --litellm, --portkey and --nginx, and --reference",
    )
    field.add_argument(
        "--repeat", type=int, default=3, help="rounds of every phase; medians (default 3)"
    )
    field.add_argument(
        "--workers",
        type=int,
        default=1,
        help="N > 1: also Tailguard's throughput with 1 and N workers sharing Redis",
    )
    field.add_argument(
        "--profile",
        action="store_true",
        help="sample the gateway with py-spy under saturation; measure what each feature costs",
    )
    field.add_argument(
        "--baseline",
        type=Path,
        metavar="CHECKOUT",
        help="also Tailguard from another checkout (e.g. a `git worktree` of an older commit), "
        "every feature on, as one more path of the same run",
    )
    args = parser.parse_args(argv)
    if args.baseline is not None and not (args.baseline / "gateway" / "__main__.py").exists():
        parser.error(f"--baseline: {args.baseline} holds no gateway package")
    duration = 2.5 if args.quick else args.duration
    if min(duration, args.rate, args.stream_rate, args.paced_tps, args.concurrency) <= 0:
        parser.error("--duration, --rate, --stream-rate, --paced-tps, --concurrency: must be > 0")
    if args.repeat < 1 or not 1 <= args.workers <= 64:
        parser.error("--repeat: at least 1; --workers: 1 to 64")
    against = (
        args.litellm
        or args.portkey
        or args.nginx
        or args.field
        or args.workers > 1
        or args.profile
        or args.baseline is not None
    )
    field_options = None
    if against:
        json_path = args.json
        if json_path == DEFAULT_JSON:
            json_path = DEFAULT_JSON.with_name("overhead-field.json")
        field_options = field_run.FieldOptions(
            litellm=args.litellm or args.field,
            nginx=args.nginx or args.field,
            portkey=args.portkey or args.field,
            reference=args.reference or args.field,
            repeat=1 if args.quick else args.repeat,
            duration_s=duration,
            warmup_s=1.0 if args.quick else 3.0,
            concurrency=args.concurrency,
            stream_rate=args.stream_rate,
            tokens=args.tokens,
            paced_tps=args.paced_tps,
            workers=args.workers,
            profile=args.profile,
            json_path=json_path,
            keep_logs=args.keep_logs,
            baseline=args.baseline.resolve() if args.baseline is not None else None,
        )
    return Options(
        duration_s=duration,
        warmup_s=1.0 if args.quick else 3.0,
        concurrency=args.concurrency,
        rate=args.rate,
        stream_rate=args.stream_rate,
        tokens=args.tokens,
        paced_tps=args.paced_tps,
        json_path=args.json,
        keep_logs=args.keep_logs,
        reference=args.reference,
        field=field_options,
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.field is not None:
        return field_run.run(opts.field)
    pin, warning = pinning()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    logs = Path(tempfile.mkdtemp(prefix="tailguard-bench-"))
    stack = Stack(logs=logs, pin=pin, cwd=ROOT)
    if warning:
        stack.notes.append(warning)
    ok = False
    try:
        with sigterm_as_interrupt():
            ports = {"direct": free_port(), "gateway": free_port()}
            upstream = start_upstream(stack, ports["direct"], opts)
            gateway = start_gateway(stack, ports["gateway"], ports["direct"])
            pids = {"upstream": upstream.pid, "gateway": gateway.pid}
            if opts.reference:
                ports["reference"] = free_port()
                pids["reference"] = start_reference(stack, ports["reference"], ports["direct"]).pid
            pinned = "unpinned" if warning else "gateway on CPU 0, upstream and load on CPU 1"
            print(
                f"upstream :{ports['direct']} (pid {upstream.pid}), gateway :{ports['gateway']} "
                f"(pid {gateway.pid}); {pinned}; {opts.duration_s:g} s per phase",
                flush=True,
            )
            raw = measure(opts, stack, ports, pids)
            for child in stack.procs:
                if child.poll() is not None:
                    role = stack.roles.get(child.pid, "a process")
                    raise RuntimeError(f"the {role} exited during the run (see --keep-logs)")
        summary = summarize(raw)
        verdicts = report(opts, raw, summary)
        document = {
            "benchmark": "overhead",
            "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": {
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
            },
            "options": {
                "duration_s": opts.duration_s,
                "warmup_s": opts.warmup_s,
                "concurrency": opts.concurrency,
                "rate": opts.rate,
                "stream_rate": opts.stream_rate,
                "tokens": opts.tokens,
                "paced_tps": opts.paced_tps,
                "pinned": warning is None,
                "reference": opts.reference,
            },
            "notes": stack.notes,
            "summary": summary,
            "reference_summary": summarize(raw, "reference") if opts.reference else None,
            "targets": verdicts,
            "phases": raw,
        }
        opts.json_path.parent.mkdir(parents=True, exist_ok=True)
        opts.json_path.write_text(json.dumps(document, indent=2) + "\n")
        print(f"\nresults: {opts.json_path}")
        ok = all(v["pass"] for v in verdicts) and not summary["errors"]
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        stack.stop()
        if opts.keep_logs:
            print(f"logs: {logs}", file=sys.stderr)
        else:
            shutil.rmtree(logs, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
