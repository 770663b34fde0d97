"""What stops `tailguard serve` is said in one line, before any banner claims the gateway is on,
with the documented exit status: a port in use (and how to pick another), an unreadable config,
a bad Redis URL (whose secrets are not repeated)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli.serve import EXIT_CANNOT_LISTEN
from tests.timing import scaled

TAILGUARD = Path(sys.executable).parent / "tailguard"


def serve(*args: str, **environ: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAILGUARD_")}
    return subprocess.run(
        [str(TAILGUARD), "serve", *args],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        env={**env, **environ},
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert done.stdout == ""
    assert "Tailguard on" not in done.stderr and "startup complete" not in done.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_one_line_with_the_way_out(workers: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve("--port", str(port), "--workers", workers)
    assert done.returncode == EXIT_CANNOT_LISTEN == 4
    line = one_line(done)
    assert f"cannot listen on http://127.0.0.1:{port}: port {port} is in use" in line
    assert f"--port {port + 1}" in line and f'make run ARGS="--port {port + 1}"' in line


def test_an_unreadable_config_is_one_line(tmp_path: Path) -> None:
    for path in (tmp_path / "missing.yaml", tmp_path):
        done = serve("--config", str(path))
        assert done.returncode == 2
        assert one_line(done).startswith(f"error: {path}: cannot read the file")


def test_a_bad_redis_url_is_one_line_without_its_secrets() -> None:
    done = serve(
        TAILGUARD_LATENCY__STORE="redis",
        TAILGUARD_LATENCY__REDIS_URL="http://user:hunter2@cache:6379/0",
    )
    assert done.returncode == 2
    line = one_line(done)
    assert "latency.redis_url" in line and "unsupported scheme" in line
    assert "hunter2" not in done.stderr
