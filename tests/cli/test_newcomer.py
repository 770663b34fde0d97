"""What a newcomer does first: `tailguard --version`, `-h`, and `tailguard serve` from wherever
they happen to be, with no config of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

from gateway import __version__
from gateway.config import PACKAGED_CONFIG, config_path, load_settings
from tests.conftest import free_port
from tests.timing import eventually, scaled

TAILGUARD = Path(sys.executable).parent / "tailguard"
REPO = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(TAILGUARD), *args], capture_output=True, text=True, timeout=scaled(30), cwd=cwd
    )


def test_version_is_the_packages() -> None:
    """`--version` (and `-V`) print the one version, the same the installed metadata carries."""
    for flag in ("--version", "-V"):
        done = run(flag)
        assert (done.returncode, done.stdout) == (0, f"tailguard {__version__}\n")
    assert version("tailguard") == __version__


@pytest.mark.parametrize("command", [[], ["serve"], ["check-config"], ["keys", "new"]])
def test_short_help_works_everywhere(command: list[str]) -> None:
    short, long = run(*command, "-h"), run(*command, "--help")
    assert short.returncode == 0, short.stderr
    assert short.stdout == long.stdout and "Usage: tailguard" in short.stdout


def test_the_repository_default_is_the_packaged_one() -> None:
    """`config/gateway.yaml` (what the docs and `make run` point at) is the file that ships in
    the package, not a copy that can drift from it."""
    assert (REPO / "config" / "gateway.yaml").resolve() == PACKAGED_CONFIG.resolve()
    assert PACKAGED_CONFIG.is_file()


def test_the_default_is_looked_up_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit path, else $TAILGUARD_CONFIG, else ./config/gateway.yaml, else the package's."""
    monkeypatch.delenv("TAILGUARD_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert config_path() == PACKAGED_CONFIG
    assert load_settings().model("chat-large") is not None  # it loads, from any directory
    local = tmp_path / "config" / "gateway.yaml"
    local.parent.mkdir()
    local.write_text(PACKAGED_CONFIG.read_text())
    assert config_path() == Path("config/gateway.yaml")
    monkeypatch.setenv("TAILGUARD_CONFIG", "/elsewhere.yaml")
    assert config_path() == Path("/elsewhere.yaml")
    assert config_path("mine.yaml") == Path("mine.yaml")


def serve_in(directory: Path, port: int) -> subprocess.Popen[str]:
    """`tailguard serve` started in `directory`, with no `TAILGUARD_*` variable set."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TAILGUARD_")}
    return subprocess.Popen(
        [str(TAILGUARD), "serve", "--port", str(port)],
        cwd=directory,
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_serve_from_any_directory_uses_the_packaged_defaults(tmp_path: Path) -> None:
    """`cd /tmp && tailguard serve`: the embedded defaults are served, and the start-up lines
    say which file was loaded."""
    port = free_port()
    process = serve_in(tmp_path, port)
    try:
        async with httpx.AsyncClient(timeout=1) as http:

            async def answered() -> httpx.Response | None:  # bounded wait for the port to answer
                try:
                    return await http.get(f"http://127.0.0.1:{port}/v1/models")
                except httpx.TransportError:
                    assert process.poll() is None, process.communicate()[1]
                    return None

            models = await eventually(
                answered, within_s=20, what="the gateway to start", every_s=0.05
            )
        assert models.status_code == 200
        served = {m["id"] for m in models.json()["data"]}
        assert served == {m.name for m in load_settings(PACKAGED_CONFIG).models}
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=scaled(20))
    assert f"config: {PACKAGED_CONFIG}" in stderr, stderr
