"""A newcomer's first five minutes, as the README has them: every command of its shell blocks is
run as pasted (bash, from the repository's root) against a running gateway, and must succeed.

Two commands are not run, because they install: `make run` (it would set up `.venv` and install
the serving dependencies; this test starts the same `tailguard serve` itself) and `make test`
(it would install the test toolchain, then run this suite inside itself). The others run with
the environment this suite runs in (`VENV`, `NO_INSTALL=1`, so no target installs anything) and
the gateway's address in `GATEWAY`; in the pasted text only `http://127.0.0.1:8080` becomes the
test gateway's address (another process may hold port 8080)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.timing import scaled

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TAILGUARD = Path(sys.executable).parent / "tailguard"
DEFAULT_URL = "http://127.0.0.1:8080"

INSTALLS = {
    "make run": "installs the serving dependencies into .venv; the test serves the same itself",
    "make test": "installs the test toolchain into .venv, then runs this suite within itself",
}
# What each command must print besides succeeding: it did its job, not just exit 0.
SHOWS = {
    "make tour": "x-tailguard-route: ",
    "make stats": "SLO attainment",
    "make report": "chat-fast",
    "make probe": "TTFT",
    "curl": '"choices"',
}


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def commands(text: str) -> list[str]:
    """The commands of the README's bash blocks, one per entry (continued lines joined)."""
    found = []
    for block in blocks(text, "bash"):
        for command in re.sub(r"\\\n", " ", block).splitlines():
            if command.strip() and not command.lstrip().startswith("#"):
                found.append(command.strip())
    return found


def skipped(command: str) -> str | None:
    for prefix, why in INSTALLS.items():
        if command == prefix or command.startswith(prefix + " "):
            return why
    return None


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    """`tailguard serve` on the packaged config, as `make run` starts it, on a free port. Its
    banner comes after the port is bound: requests sent then wait in the backlog."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAILGUARD_")}
    process = subprocess.Popen(
        [str(TAILGUARD), "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    assert process.stderr is not None
    banner = process.stderr.readline().decode()
    try:
        assert banner.startswith("Tailguard on"), banner + process.stderr.read().decode()
        yield f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=scaled(30))


def test_the_readme_has_the_first_five_minutes() -> None:
    """The commands this test runs are there, and only `make run`/`make test` are skipped."""
    found = commands(README)
    assert [c.split("#")[0].strip() for c in found if skipped(c)] == ["make run", "make test"]
    for shown in SHOWS:
        assert any(c.startswith(shown) for c in found), shown


@pytest.mark.parametrize(
    "command",
    [c for c in commands(README) if not skipped(c)],
    ids=lambda c: c.split("#")[0].strip(),
)
def test_each_command_works_as_pasted(gateway: str, command: str) -> None:
    env = {
        **os.environ,
        "VENV": sys.prefix,  # the environment this suite runs in, used as it is
        "NO_INSTALL": "1",
        "GATEWAY": gateway,
    }
    env.pop("MAKEFLAGS", None)
    done = subprocess.run(
        ["bash", "-c", command.replace(DEFAULT_URL, gateway)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    shown = next(text for start, text in SHOWS.items() if command.startswith(start))
    assert shown in done.stdout, done.stdout + done.stderr


def test_tour_py_is_the_readme_s_tour() -> None:
    """Every line of the README's Python block is in tour.py (the base URL aside: tour.py
    takes another on its command line, for `make tour GATEWAY=...`)."""
    (tour,) = blocks(README, "python")
    script = (ROOT / "tour.py").read_text()
    for line in tour.splitlines():
        if line.strip() and "base_url=" not in line:
            assert line in script, line
    assert f'"{DEFAULT_URL}/v1"' in script


def test_every_make_target_and_script_the_readme_names_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", makefile, re.MULTILINE))
    named = set(re.findall(r"`make ([a-z-]+)", README)) | {
        c.split()[1] for c in commands(README) if c.startswith("make ")
    }
    assert named and named <= targets, named - targets
    for script in re.findall(r"\.venv/bin/python ([\w/]+\.py)", README):
        assert (ROOT / script).is_file(), script
