"""The server processes of a benchmark run: started as subprocesses, pinned, found ready, stopped.

A benchmark measures real processes, as in production: `tailguard sim` as the upstream and
`tailguard serve` as the gateway (plus whatever else a script needs), each started by one
`Stack`, pinned to a CPU of its own where there are enough of them, and stopped in reverse order
at the end. It imports no web framework and not `gateway.api`. Nothing here prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

__all__ = [
    "Stack",
    "cpu_layout",
    "free_port",
    "log_tail",
    "metric_samples",
    "proc_cpu_s",
    "serve",
    "start_gateway",
    "start_sim",
    "tailguard_argv",
    "taskset",
    "wait_ready",
]

READY_TIMEOUT_S: Final = 30.0
STOP_TIMEOUT_S: Final = 10.0


def tailguard_argv() -> list[str]:
    """The `tailguard` command of this interpreter's installation."""
    return [sys.executable, "-m", "gateway"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def cpu_layout() -> dict[str, int]:
    """Which CPU each role gets: the gateway one to itself, the upstream and the load the next
    ones (sharing one when there are only two). Empty when fewer than two CPUs are available."""
    if not hasattr(os, "sched_getaffinity"):
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    return {"gateway": cpus[0], "upstream": cpus[1], "load": cpus[2] if len(cpus) > 2 else cpus[1]}


def taskset(cpus: Mapping[str, int]) -> dict[str, list[str]]:
    """A command prefix per role that runs it on its CPU (`taskset -c N`); empty without
    `taskset`, and then the processes run unpinned."""
    found = shutil.which("taskset")
    if found is None:
        return {}
    return {role: [found, "-c", str(cpu)] for role, cpu in cpus.items()}


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(
    url: str, child: subprocess.Popen[bytes], log: Path, name: str | None = None
) -> None:
    """Poll `url` until it answers 200; fail with the log's tail if the process (`name`, by
    default its URL) exits first or is not ready in time."""
    what = name or url
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(
                f"{what} exited ({child.returncode}) before it was ready:\n{log_tail(log)}"
            )
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(url, timeout=1) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready after {READY_TIMEOUT_S:.0f} s:\n{log_tail(log)}")


@dataclass(slots=True)
class Stack:
    """The processes of one run, and where their logs go; stopped in reverse order.

    `pin` gives a role's command prefix (`taskset(cpus)`; no entry: unpinned), which pins a
    process from its first instruction, its threads and workers included. `cwd` is where the
    processes start (the caller's by default).
    """

    logs: Path
    pin: dict[str, list[str]] = field(default_factory=dict)
    cwd: Path | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    roles: dict[int, str] = field(default_factory=dict)  # pid -> role, to name one that died

    def start(
        self,
        role: str,
        command: Sequence[str],
        log_name: str,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `command` pinned for `role`, its output in `logs/log_name`; `env` replaces the
        inherited environment."""
        log = open(self.logs / log_name, "wb")  # noqa: SIM115 - the child owns it until the end
        try:
            child = subprocess.Popen(
                [*self.pin.get(role, []), *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.cwd,
                env=None if env is None else dict(env),
                start_new_session=True,  # Ctrl-C reaches the caller only; we stop them in order
            )
        finally:
            log.close()
        self.procs.append(child)
        self.roles[child.pid] = role
        return child

    def start_ready(
        self,
        role: str,
        command: Sequence[str],
        log_name: str,
        url: str,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """`start`, then wait until `url` answers 200 (the process is of no use before)."""
        child = self.start(role, command, log_name, env)
        wait_ready(url, child, self.logs / log_name, role)
        return child

    def stop(self) -> None:
        for child in reversed(self.procs):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in reversed(self.procs):
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self.procs.clear()


def start_sim(stack: Stack, profile: Mapping[str, Any], *, seed: int = 1) -> int:
    """A `tailguard sim` process whose default profile is `profile`; returns its port."""
    port = free_port()
    argv = [*tailguard_argv(), "sim", "--port", str(port), "--seed", str(seed)]
    for key, value in profile.items():
        shown = "-".join(str(v) for v in value) if isinstance(value, list | tuple) else value
        argv += ["--set", f"{key}={shown}"]
    stack.start_ready("upstream", argv, "upstream.log", f"http://127.0.0.1:{port}/health")
    return port


def serve(
    stack: Stack,
    port: int,
    config_path: Path,
    *,
    workers: int = 1,
    env: Mapping[str, str] | None = None,
    role: str = "gateway",
    log_name: str = "gateway.log",
) -> subprocess.Popen[bytes]:
    """`tailguard serve --config config_path`, once `/healthz` answers."""
    command = [*tailguard_argv(), "serve", "--config", str(config_path)]
    command += ["--port", str(port), "--log-level", "warning"]
    if workers != 1:
        command += ["--workers", str(workers)]
    return stack.start_ready(role, command, log_name, f"http://127.0.0.1:{port}/healthz", env)


def start_gateway(
    stack: Stack, config: Mapping[str, Any], port: int | None = None
) -> tuple[int, subprocess.Popen[bytes]]:
    """`tailguard serve` on `config` (written as JSON, which is YAML, with `server.port` set to
    `port`, a free one by default), once it is healthy: its port and process."""
    port = free_port() if port is None else port
    path = stack.logs / "gateway.yaml"
    document = {**config, "server": {**config.get("server", {}), "port": port}}
    path.write_text(json.dumps(document, indent=2) + "\n")
    return port, serve(stack, port, path)


def metric_samples(port: int, name: str) -> dict[str, float]:
    """Every sample of the Prometheus metric `name` on the gateway at `port`, by its label set
    (`{deployment="...",...}` as printed; "" for none)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            labels, _, value = line[len(name) :].rpartition(" ")
            with contextlib.suppress(ValueError):
                samples[labels.strip()] = float(value)
    return samples


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process (all its threads), in seconds (Linux); None where /proc is
    not there."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as file:
            fields = file.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # stat(5) fields 14, 15
