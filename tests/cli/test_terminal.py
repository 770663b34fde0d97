"""`tailguard serve` in a terminal reads: one short line per request (status, model, route, TTFT,
total) on its stdout, and the JSON access log where `--access-log` says; off a terminal, JSON on
stdout as before. A real gateway process on the packaged config (simulated models)."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import httpx

from tests.conftest import free_port
from tests.timing import scaled

TAILGUARD = Path(sys.executable).parent / "tailguard"
CHAT = {"model": "chat-fast", "messages": [{"role": "user", "content": "hi"}]}


def start(*args: str, stdout: int | IO[bytes]) -> tuple[subprocess.Popen[bytes], str]:
    """A gateway whose port is bound (its banner printed): requests wait in its backlog until
    it serves, so none is sent too early."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAILGUARD_")}
    process = subprocess.Popen(
        [str(TAILGUARD), "serve", "--port", str(port), *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert process.stderr is not None
    banner = process.stderr.readline().decode()
    assert banner.startswith("Tailguard on"), banner + process.stderr.read().decode()
    return process, f"http://127.0.0.1:{port}"


def requests(url: str) -> None:
    with httpx.Client(timeout=scaled(30)) as client:
        assert client.post(url + "/v1/chat/completions", json=CHAT).status_code == 200
        missing = client.post(url + "/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert missing.status_code == 404


def stop(process: subprocess.Popen[bytes]) -> tuple[str, str]:
    """Its stdout when piped (else "") and the rest of its stderr; a clean stop (uvicorn
    re-raises the SIGTERM it got)."""
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=scaled(30))
    assert process.returncode in (0, -signal.SIGTERM)
    return (out or b"").decode(), err.decode()


def test_a_terminal_gets_one_line_per_request_and_the_file_the_json(tmp_path: Path) -> None:
    log = tmp_path / "access.jsonl"
    leader, follower = pty.openpty()
    process, url = start("--access-log", str(log), stdout=follower)
    os.close(follower)
    try:
        requests(url)
    finally:
        _, err = stop(process)
    # uvicorn's three start-up lines give way to one that says where to look.
    assert f"ready: {url}/ (the dashboard at {url}/dashboard); Ctrl-C stops" in err, err
    assert "Application startup complete" not in err and "Started server process" not in err
    shown = b""
    while True:  # the terminal's whole output, up to the closed end
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: every writer is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    lines = [line for line in shown.decode().splitlines() if re.match(r"\d\d:\d\d:\d\d ", line)]
    assert len(lines) == 2, shown
    assert re.fullmatch(
        r"\d\d:\d\d:\d\d 200 chat-fast primary  ttft [\d.,]+ ms  total [\d.,]+ ms  sim/fast",
        lines[0],
    ), lines
    assert re.fullmatch(
        r"\d\d:\d\d:\d\d 404 nope -  ttft -  total [\d.,]+ ms  model_not_found", lines[1]
    ), lines
    assert "{" not in shown.decode()  # no JSON on the terminal
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["status"], r["requested_model"]) for r in records] == [
        (200, "chat-fast"),
        (404, "nope"),
    ]
    assert records[0]["route"] == "primary" and records[0]["ttft_ms"] > 0


def test_off_a_terminal_stdout_gets_the_json() -> None:
    process, url = start(stdout=subprocess.PIPE)
    try:
        requests(url)
    finally:
        out, err = stop(process)
    assert "Application startup complete" in err  # off a terminal, uvicorn's lines as before
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["status"], r["requested_model"]) for r in records] == [
        (200, "chat-fast"),
        (404, "nope"),
    ]


def test_an_unwritable_access_log_is_one_line_before_the_banner(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAILGUARD_")}
    done = subprocess.run(
        [str(TAILGUARD), "serve", "--access-log", str(tmp_path / "no" / "such" / "dir.log")],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        env=env,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: --access-log: cannot write ")
    assert len(done.stderr.splitlines()) == 1 and "Tailguard on" not in done.stderr
