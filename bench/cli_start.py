"""A newcomer's first run, timed: a fresh clone, then `make run` until the gateway answers
`GET /healthz` (the venv made and the serving dependencies installed on the way), then how fast
`tailguard --version` and `tailguard --help` answer from that venv.

    python3 bench/cli_start.py [--warm] [--runs 3] [--json]

`--warm` first makes one unmeasured clone and `make run`, so that pip's cache holds every wheel
(the figure the README quotes: "with a warm pip cache"). The clone is of this repository's
committed HEAD; each run uses a new temporary directory and removes it. Uses only the standard
library and `git`, `make` and `python3` on the PATH, as a fresh clone has nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SERVE_TIMEOUT_S = 900.0
CLI_RUNS = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def serves(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def first_run(workdir: Path) -> dict[str, float]:
    """Clone, `make run` until it serves; the seconds each took. Stops the gateway after."""
    clone = workdir / "tailguard"
    started = time.perf_counter()
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    cloned = time.perf_counter()
    port = free_port()
    log = (workdir / "make-run.log").open("wb")
    process = subprocess.Popen(
        ["make", "run", f"ARGS=--port {port}"],
        cwd=clone,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: make, tailguard and the workers
    )
    try:
        # A benchmark polls: the point is the wall time until a client is answered. The banner
        # (printed once the port is bound) says the port is this gateway's: on a shared machine
        # another process may take a port picked as free and answer on it.
        banner = f"Tailguard on http://127.0.0.1:{port} ".encode()
        while banner not in Path(log.name).read_bytes() or not serves(port):
            if process.poll() is not None:
                log.flush()
                tail = Path(log.name).read_text(errors="replace")[-2000:]
                raise SystemExit(f"make run exited ({process.returncode}):\n{tail}")
            if time.perf_counter() - cloned > SERVE_TIMEOUT_S:
                raise SystemExit(f"not serving after {SERVE_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
        serving = time.perf_counter()
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have exited on its own
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
        log.close()
    return {
        "load_average": os.getloadavg()[0],  # the machine's 1-minute load as it began serving
        "clone_s": cloned - started,
        "make_run_s": serving - cloned,
        "total_s": serving - started,
        **cli_times(clone / ".venv" / "bin" / "tailguard"),
    }


def cli_times(tailguard: Path) -> dict[str, float]:
    """The median and best wall time of `--version` and `--help` over CLI_RUNS runs each."""
    out: dict[str, float] = {}
    for flag in ("--version", "--help"):
        times = []
        for _ in range(CLI_RUNS):
            started = time.perf_counter()
            subprocess.run([str(tailguard), flag], capture_output=True, check=True)
            times.append(time.perf_counter() - started)
        name = flag.strip("-")
        out[f"{name}_median_s"] = statistics.median(times)
        out[f"{name}_best_s"] = min(times)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="measured first runs (default 1)")
    parser.add_argument("--warm", action="store_true", help="one unmeasured run first")
    parser.add_argument("--json", action="store_true", help="print the runs as JSON")
    args = parser.parse_args(argv)
    runs: list[dict[str, Any]] = []
    for i in range(args.runs + (1 if args.warm else 0)):
        workdir = Path(tempfile.mkdtemp(prefix="tailguard-first-run-"))
        try:
            result = first_run(workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if args.warm and i == 0:
            print(
                f"warm-up run: {result['total_s']:.1f} s, load {result['load_average']:.1f} "
                "(not counted)",
                file=sys.stderr,
            )
            continue
        runs.append(result)
        print(
            f"run {len(runs)}: {result['total_s']:.1f} s to serve, load "
            f"{result['load_average']:.1f}",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps({"load_average": os.getloadavg(), "runs": runs}, indent=2))
        return 0
    print(f"{os.cpu_count()} CPUs; --version and --help: the median of {CLI_RUNS} runs each")
    print(
        "| run | load average | clone (s) | make run until it serves (s) "
        "| --version (s) | --help (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for n, r in enumerate(runs, 1):
        print(
            f"| {n} | {r['load_average']:.1f} | {r['clone_s']:.1f} | {r['make_run_s']:.1f} "
            f"| {r['version_median_s']:.2f} | {r['help_median_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
