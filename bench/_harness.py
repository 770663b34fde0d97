"""What the benchmark scripts share: their child processes, CPU pinning, summaries and results.

Every script starts real processes (`tailguard sim`, `tailguard serve`), waits until they answer,
pins them with `taskset` and writes a JSON document; one copy of that keeps the scripts measuring
the same way. Nothing here measures: each script keeps its own client and its own figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from gateway.sketch import nearest_rank

ROOT: Final = Path(__file__).resolve().parent.parent
VENV_BIN: Final = Path(sys.executable).parent
RESULTS_DIR: Final = ROOT / "bench" / "results"
READY_TIMEOUT_S: Final = 30.0


# --- processes -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Stack:
    """The processes of one run, and where their logs go; stopped in reverse order."""

    logs: Path
    pin: dict[str, list[str]]  # role -> taskset prefix (no entry: unpinned)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    roles: dict[int, str] = field(default_factory=dict)  # pid -> role, to name one that died

    def start(
        self,
        role: str,
        command: Sequence[str],
        log_name: str,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `command` pinned for `role`; `env` replaces the inherited environment."""
        log = open(self.logs / log_name, "wb")  # noqa: SIM115 - the child owns it until the end
        try:
            child = subprocess.Popen(
                [*self.pin.get(role, []), *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env=None if env is None else dict(env),
                start_new_session=True,  # Ctrl-C reaches us only; we stop them in order
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
        wait_ready(url, child, self.logs / log_name)
        return child

    def stop_all(self) -> None:
        for child in reversed(self.procs):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for child in reversed(self.procs):
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self.procs.clear()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(url: str, child: subprocess.Popen[bytes], log: Path) -> None:
    """Poll `url` until it answers 200; fail with the log's tail if the process exits first."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({child.returncode}):\n{log_tail(log)}")
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(url, timeout=1) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{url}: not ready after {READY_TIMEOUT_S:.0f} s:\n{log_tail(log)}")


def start_gateway(stack: Stack, port: int, config: dict[str, Any]) -> subprocess.Popen[bytes]:
    """`tailguard serve` on `config` (written as JSON, which is YAML), once it is healthy."""
    path = stack.logs / "gateway.yaml"
    path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
    return serve(stack, port, path)


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
    command = [str(VENV_BIN / "tailguard"), "serve", "--config", str(config_path)]
    command += ["--port", str(port), "--log-level", "warning"]
    if workers != 1:
        command += ["--workers", str(workers)]
    return stack.start_ready(role, command, log_name, f"http://127.0.0.1:{port}/healthz", env)


def pinning() -> tuple[dict[str, list[str]], str | None]:
    """taskset prefixes per role, and a warning when the processes cannot be pinned.

    The gateway gets CPU 0 to itself; the upstreams (mostly asleep) and this client share CPU 1,
    so the client's parsing never delays the gateway it measures.
    """
    taskset = shutil.which("taskset")
    if taskset is None:
        return {}, "taskset not found: running unpinned"
    if not {0, 1} <= os.sched_getaffinity(0):
        return {}, f"CPUs 0 and 1 are not both available ({sorted(os.sched_getaffinity(0))})"
    return {"gateway": [taskset, "-c", "0"], "upstream": [taskset, "-c", "1"]}, None


def pin_client() -> tuple[dict[str, list[str]], str | None]:
    """`pinning()`, and this process moved to CPU 1 beside the upstreams (or a warning printed)."""
    pin, warning = pinning()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    elif hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {1})  # the client shares CPU 1 with the upstreams
    return pin, warning


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM as Ctrl-C, so a killed run still stops its children in order."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- the client ----------------------------------------------------------------------------------


class SSEReader:
    """Just enough SSE to find the first content event, an error event and `[DONE]`.

    With `errors_only_after_first`, events after the first content are parsed only when they
    may hold an error (cheaper for a client under heavy load).
    """

    __slots__ = ("buffer", "done", "error", "errors_only_after_first", "t_first")

    def __init__(self, errors_only_after_first: bool = False) -> None:
        self.buffer = b""
        self.t_first: float | None = None
        self.done = False
        self.error: str | None = None
        self.errors_only_after_first = errors_only_after_first

    def feed(self, data: bytes, now: float) -> None:
        buffer = (self.buffer + data if self.buffer else data).replace(b"\r\n", b"\n")
        start = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            self._event(buffer[start:end], now)
            start = end + 2
        self.buffer = buffer[start:]

    def _event(self, event: bytes, now: float) -> None:
        lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if not lines:
            return  # comments, keep-alives
        payload = b"\n".join(lines)
        if payload == b"[DONE]":
            self.done = True
            return
        if self.errors_only_after_first and self.t_first is not None and b'"error"' not in payload:
            return  # only the first content event and errors matter
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.error = f"bad event {payload[:80]!r}"
            return
        if not isinstance(obj, dict):
            self.error = f"bad event {payload[:80]!r}"
        elif "error" in obj:
            self.error = f"error event {payload[:200]!r}"
        elif self.t_first is None:
            for choice in obj.get("choices") or ():
                delta = choice.get("delta") if isinstance(choice, dict) else None
                content = delta.get("content") if isinstance(delta, dict) else None
                if isinstance(content, str) and content:
                    self.t_first = now
                    return


def stream_chat_body(model: str, max_tokens: int, prompt: str) -> bytes:
    """One streaming chat completion request, the same bytes for every request of a run."""
    return orjson.dumps(
        {
            "model": model,
            "stream": True,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}],
        }
    )


# --- figures and results -------------------------------------------------------------------------


def percentiles_ms(
    values_s: Sequence[float],
    missing: int = 0,
    quantiles: Sequence[tuple[str, float]] = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)),
    with_mean: bool = False,
) -> dict[str, float | None]:
    """count, (mean,) the `quantiles` (nearest rank) and max, in ms.

    `missing` values rank above every measured one: a request that never got a first token
    missed any budget, and leaving it out would flatter the mode that fails the most. A
    percentile that lands on one is None.
    """
    ordered = sorted(v * 1000.0 for v in values_s)
    n = len(ordered) + missing
    result: dict[str, float | None] = {"count": n, "missing": missing}
    if not n:
        return result
    if with_mean:
        result["mean"] = sum(ordered) / len(ordered) if ordered else None
    for label, q in quantiles:
        rank = nearest_rank(q, n)
        result[label] = ordered[rank - 1] if rank <= len(ordered) else None
    result["max"] = None if missing else ordered[-1]
    return result


def parse_modes(parser: argparse.ArgumentParser, text: str, known: Sequence[str]) -> list[str]:
    """`--modes`: a comma-separated subset of `known`, each at most once (else a usage error)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in known for m in modes) or len(set(modes)) != len(modes):
        parser.error(f"--modes: a comma-separated subset of {', '.join(known)}")
    return modes


def environment() -> dict[str, Any]:
    """What a result depends on besides the code's options: Python, platform, CPUs, commit."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["git"] = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
    return info


def write_results(path: Path, document: dict[str, Any], logs: Path, keep_logs: bool) -> None:
    """Write the results document, say where, and keep or remove the run's logs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nresults: {path}")
    if keep_logs:
        print(f"logs: {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
