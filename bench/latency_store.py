"""What sharing latency statistics through Redis costs: the Redis store against the memory store.

Setup. One zero-delay simulated upstream, one throwaway `redis-server`, and two gateways with the
same model: one with `latency.store: memory`, one with `latency.store: redis`. Both gateways are
pinned to CPU 0 and are loaded one at a time; the upstream, Redis and the load generator share
CPU 1 (`taskset`).

Load. `bench/_load.py`, open loop at `--rate` requests/s (default 200), streaming and not, in
alternating rounds (memory, redis, memory, redis, ...) so that drift on a noisy machine hits both
alike; each figure is the median over the rounds. Direct-to-upstream is measured in every round
too, so "added" latency is the gateway's percentile minus the direct one.

Redis commands. Before each Redis round the server's statistics are reset (`CONFIG RESETSTAT`);
after it, `INFO commandstats` gives every command the gateway sent (flushes, refreshes, index
upkeep), amortised over the round's requests.

Targets: the Redis store's added latency within 5% of the memory store's (p50; the machine's own
noise is reported next to it), and fewer than 0.5 Redis commands per request.

    .venv/bin/python bench/latency_store.py            # ~2 minutes
    .venv/bin/python bench/latency_store.py --quick    # ~40 s
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # `python bench/<script>.py`: `bench` is imported from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import redis

from bench._harness import sigterm_as_interrupt
from bench._load import LoadSpec, run_load
from bench.overhead import (
    MODEL,
    ROOT,
    VENV_BIN,
    Stack,
    pinning,
    request_body,
)
from gateway.tools.stack import free_port, wait_ready

DEFAULT_JSON = ROOT / "bench" / "results" / "latency_store.json"
TOKENS = 20
# Commands the benchmark itself sends while measuring: not the gateway's.
OWN_COMMANDS = {"info", "config|resetstat", "config", "ping"}


def start_upstream(stack: Stack, port: int, tokens: int) -> subprocess.Popen[bytes]:
    command = [str(VENV_BIN / "tailguard"), "sim", "--port", str(port), "--seed", "1"]
    command += ["--set", f"output_tokens={tokens}"]
    child = stack.start("upstream", command, "upstream.log")
    wait_ready(f"http://127.0.0.1:{port}/health", child, stack.logs / "upstream.log")
    return child


def start_redis(stack: Stack, port: int) -> subprocess.Popen[bytes]:
    command = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    child = stack.start("upstream", command, "redis.log")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return child
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def start_gateway(
    stack: Stack, name: str, port: int, upstream_port: int, redis_port: int | None
) -> subprocess.Popen[bytes]:
    latency = (
        f"latency: {{store: redis, redis_url: 'redis://127.0.0.1:{redis_port}/0'}}\n"
        if redis_port is not None
        else "latency: {store: memory}\n"
    )
    config = stack.logs / f"{name}.yaml"
    config.write_text(
        f"server: {{host: 127.0.0.1, port: {port}}}\n"
        + latency
        + f'providers: {{up: {{type: vllm, base_url: "http://127.0.0.1:{upstream_port}/v1"}}}}\n'
        + f"models: [{{name: {MODEL}, deployments: [{{provider: up, model: {MODEL}}}]}}]\n"
    )
    command = [str(VENV_BIN / "tailguard"), "serve", "--config", str(config)]
    command += ["--port", str(port), "--log-level", "warning"]
    child = stack.start("gateway", command, f"{name}.log")
    wait_ready(f"http://127.0.0.1:{port}/healthz", child, stack.logs / f"{name}.log")
    return child


def gateway_commands(stats: dict[str, Any]) -> int:
    return sum(
        int(value["calls"])
        for name, value in stats.items()
        if name.removeprefix("cmdstat_") not in OWN_COMMANDS
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    pin, warning = pinning()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="tailguard-bench-") as tmp:
        stack = Stack(logs=Path(tmp), pin=pin, cwd=ROOT)
        try:
            ports = {"upstream": free_port(), "redis": free_port()}
            start_upstream(stack, ports["upstream"], TOKENS)
            start_redis(stack, ports["redis"])
            ports["memory"], ports["redis_gw"] = free_port(), free_port()
            gateways = {
                "memory": start_gateway(stack, "memory", ports["memory"], ports["upstream"], None),
                "redis": start_gateway(
                    stack, "redis", ports["redis_gw"], ports["upstream"], ports["redis"]
                ),
            }
            client = redis.Redis(port=ports["redis"])
            try:
                return measure(args, stack, ports, gateways, client)
            finally:
                client.close()
        finally:
            stack.stop()


def measure(
    args: argparse.Namespace,
    stack: Stack,
    ports: dict[str, int],
    gateways: dict[str, subprocess.Popen[bytes]],
    client: redis.Redis,
) -> dict[str, Any]:
    target_port = {
        "direct": ports["upstream"],
        "memory": ports["memory"],
        "redis": ports["redis_gw"],
    }

    def load(path: str, stream: bool, *, warm: bool = False) -> dict[str, Any]:
        spec = LoadSpec(
            port=target_port[path],
            body=request_body(stream),
            stream=stream,
            mode="closed" if warm else "open",
            rate=args.rate,
            concurrency=32,
            duration_s=1.0 if warm else args.duration,
            requests=300 if warm else None,
            warmup_requests=20,
            expect_tokens=TOKENS,
            cpu_pids={} if path == "direct" else {"proxy": gateways[path].pid},
        )
        return run_load(spec, prefix=stack.pin["load"], procs=stack.procs)

    for path in ("direct", "memory", "redis"):
        for stream in (False, True):
            load(path, stream, warm=True)

    rows: dict[str, dict[str, list[float]]] = {}
    commands_per_request: list[float] = []
    errors = 0

    def note(key: str, path: str, value: float) -> None:
        rows.setdefault(key, {}).setdefault(path, []).append(value)

    for round_ in range(args.rounds):
        order = ("memory", "redis") if round_ % 2 == 0 else ("redis", "memory")
        for stream in (False, True):
            kind = "stream" if stream else "request"
            direct = load("direct", stream)
            for path in order:
                if path == "redis":
                    client.config_resetstat()
                result = load(path, stream)
                if path == "redis":
                    sent = gateway_commands(client.info("commandstats"))
                    commands_per_request.append(sent / max(1, result["ok"]))
                errors += result["errors"] + direct["errors"]
                metric = "ttft_ms" if stream else "latency_ms"
                for q in ("p50", "p99"):
                    note(f"{kind} added {q}", path, result[metric][q] - direct[metric][q])
                cpu = result["cpu_ms_per_request"].get("proxy")
                if cpu is not None:
                    note(f"{kind} CPU ms", path, cpu)
                print(
                    f"  round {round_ + 1} {kind:<7} {path:<6} {result['ok']:>5} ok  "
                    f"{metric.split('_')[0]} p50 {result[metric]['p50']:6.2f} ms "
                    f"(direct {direct[metric]['p50']:.2f})  CPU {cpu or 0:.3f} ms/req",
                    flush=True,
                )
    summary = {
        key: {path: statistics.median(values) for path, values in paths.items()}
        for key, paths in rows.items()
    }
    summary["redis commands per request"] = {"redis": statistics.median(commands_per_request)}
    return {"summary": summary, "errors": errors, "rate": args.rate, "rounds": args.rounds}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="requests/s (open loop)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 s")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where results go")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration = 2, 3.0
    with sigterm_as_interrupt():
        results = run(args)
    summary = results["summary"]
    print(f"\n{'median over rounds':<34}{'memory':>10}{'redis':>10}")
    for key, paths in summary.items():
        memory, shared = paths.get("memory"), paths.get("redis")
        print(
            f"{key:<34}{'' if memory is None else f'{memory:10.3f}':>10}"
            f"{'' if shared is None else f'{shared:10.3f}':>10}"
        )
    added_memory = summary["request added p50"]["memory"]
    added_redis = summary["request added p50"]["redis"]
    per_request = summary["redis commands per request"]["redis"]
    checks = [
        (
            "Redis store added latency p50 within 5% of the memory store (+ 0.05 ms noise floor)",
            added_redis <= added_memory * 1.05 + 0.05,
            f"{added_redis:.3f} ms vs {added_memory:.3f} ms",
        ),
        ("Redis commands per request < 0.5", per_request < 0.5, f"{per_request:.3f}"),
        ("no failed requests", results["errors"] == 0, str(results["errors"])),
    ]
    print()
    for label, passed, value in checks:
        print(f"  {'PASS' if passed else 'FAIL'}  {label}: {value}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nresults: {args.json}")
    return 0 if all(passed for _, passed, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
