"""What a pipelining flood costs the gateway in memory: its RSS before and after floods of
pipelined `GET /healthz`, run again and again.

Setup. One `tailguard serve` process (one worker, uvloop, as deployed), with a one-model config
on the in-process simulated provider (no upstream: `/healthz` is all that is sent). No pinning:
the gateway's memory is measured, not its speed.

Floods. Each round opens `--connections` raw connections (1, then 5 by default) and sends
`--requests` pipelined `GET /healthz` on each in one write (41 bytes a request), then either
reads every answer (`read`: each connection must get all of them, all 200) or closes right after
sending (`abandon`: what the gateway read and had not answered is its to drop). Every flood
runs `--runs` times, so that memory kept from one run shows as growth in the next.

Figures. `VmRSS` of the gateway (`/proc/<pid>/status`) before the first round and after each,
once the gateway holds no more connections than before the round (its descriptors are back to
their count at rest), and the peak `VmHWM` at the end. Growth that stays after the connections
closed is what the process kept.

Bounded: every round has `--round-timeout` seconds (default 120); a round that overruns fails
the run (exit status 2). Exit status 0 when every round completed.

    .venv/bin/python bench/pipeline.py                      # 30,000 a connection, ~1-3 minutes
    .venv/bin/python bench/pipeline.py --requests 5000      # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

if not __package__:  # `python bench/<script>.py`: `bench` is imported from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench._harness import RESULTS_DIR, ROOT, environment, sigterm_as_interrupt, write_results
from gateway.tools.stack import Stack, start_gateway

REQUEST: Final = b"GET /healthz HTTP/1.1\r\nhost: gateway\r\n\r\n"
ANSWER: Final = b"HTTP/1.1 200 "
CONFIG: Final = {
    "providers": {"sim": {"type": "simulated", "seed": 1}},
    "models": [{"name": "m", "deployments": [{"provider": "sim", "model": "m"}]}],
    "server": {"access_log": False},
}
SETTLE_S: Final = 30.0  # for the gateway to close what the clients closed


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def flood(port: int, requests: int, read: bool) -> int:
    """One connection: `requests` pipelined in one write; with `read`, every answer read (the
    number of 200s is returned), else the connection closed once everything is sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(REQUEST * requests)
        if not read:
            await writer.drain()
            return 0
        seen, tail = 0, b""
        while seen < requests:
            chunk = await reader.read(1 << 16)
            if not chunk:
                break
            window = tail + chunk
            seen += window.count(ANSWER)
            tail = window[-(len(ANSWER) - 1) :]
        await writer.drain()
        return seen
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def settle(pid: int, fds: int) -> None:
    """Wait until the gateway holds no more descriptors than at rest (its clients are gone)."""
    deadline = time.monotonic() + SETTLE_S
    while open_fds(pid) > fds:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway still holds {open_fds(pid) - fds} connection(s)")
        await asyncio.sleep(0.1)


async def rounds(port: int, pid: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    await asyncio.sleep(0.5)  # let start-up's last allocations land before the baseline
    fds = open_fds(pid)
    done: list[dict[str, Any]] = [
        {"round": "start", "rss_kib": status_kib(pid, "VmRSS"), "hwm_kib": status_kib(pid, "VmHWM")}
    ]
    print(f"{'round':<28}{'answers':>12}{'seconds':>9}{'RSS MiB':>10}{'growth':>9}")
    print(f"{'start':<28}{'':>12}{'':>9}{done[0]['rss_kib'] / 1024:>10.1f}")
    previous = done[0]["rss_kib"]
    for mode in args.modes:
        for connections in args.connections:
            for run in range(1, args.runs + 1):
                name = f"{mode} {connections}x{args.requests} #{run}"
                started = time.monotonic()
                counts = await asyncio.wait_for(
                    asyncio.gather(
                        *(flood(port, args.requests, mode == "read") for _ in range(connections))
                    ),
                    args.round_timeout,
                )
                await settle(pid, fds)
                took = time.monotonic() - started
                rss = status_kib(pid, "VmRSS")
                complete = mode != "read" or all(c == args.requests for c in counts)
                done.append(
                    {
                        "round": name,
                        "answers": sum(counts),
                        "complete": complete,
                        "seconds": round(took, 2),
                        "rss_kib": rss,
                        "hwm_kib": status_kib(pid, "VmHWM"),
                    }
                )
                shown = f"{sum(counts)}" if mode == "read" else "-"
                print(
                    f"{name:<28}{shown:>12}{took:>9.1f}{rss / 1024:>10.1f}"
                    f"{(rss - previous) / 1024:>+9.1f}{'' if complete else '  INCOMPLETE'}"
                )
                previous = rss
    return done


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30_000, help="per connection")
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--runs", type=int, default=2, help="times each flood is sent")
    parser.add_argument("--modes", nargs="+", choices=["read", "abandon"], default=["read"])
    parser.add_argument("--round-timeout", type=float, default=120.0, help="seconds per round")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "pipeline.json")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="tailguard-pipeline-"))
    stack = Stack(logs=logs, cwd=ROOT)
    try:
        with sigterm_as_interrupt():
            port, gateway = start_gateway(stack, CONFIG)
            results = asyncio.run(rounds(port, gateway.pid, args))
    except (TimeoutError, RuntimeError, OSError) as exc:
        print(f"run failed: {exc!r}", file=sys.stderr)
        return 2
    finally:
        stack.stop()
    final = results[-1]
    print(f"\npeak RSS (VmHWM): {final['hwm_kib'] / 1024:.1f} MiB")
    document = {
        "environment": environment(),
        "options": {k: v for k, v in vars(args).items() if k not in ("json", "keep_logs")},
        "rounds": results,
    }
    write_results(args.json, document, logs, args.keep_logs)
    return 0 if all(r.get("complete", True) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
