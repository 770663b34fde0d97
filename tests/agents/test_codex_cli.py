"""OpenAI's Codex CLI, the real program (pinned: `CODEX_VERSION`), runs a task through the gateway
with `codex exec`, on a deployment that serves the Responses API natively, on one translated to
chat completions and on one translated to Anthropic's Messages: the scripted upstream
(tests/fakes/agent_upstream.py) has it run a shell command, then answers once it sees the
command's output. The command's file appearing in the agent's working directory, and Codex
ending with the final answer, are the proof that the loop went round.

The npm package is installed once into `.cache/agents/` under the repository (`.ci/run` installs
it before the suite); where npm cannot reach its registry the tests are skipped, saying so. Codex
runs in a temporary directory with its own home, analytics, feedback and update checks off, and
talks to the gateway on loopback only.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import orjson
import pytest

from tests.conftest import Gateway, gateway_settings, run_gateway, serve
from tests.fakes.agent_upstream import COMMAND, FINAL_TEXT, PROOF_FILE, AgentUpstream
from tests.timing import scaled

pytestmark = pytest.mark.timeout(240)

CODEX_VERSION: Final = "0.171.0"
PACKAGE: Final = f"@openai/codex@{CODEX_VERSION}"
CACHE: Final = Path(__file__).resolve().parents[2] / ".cache" / "agents"
CODEX: Final = CACHE / "node_modules" / ".bin" / "codex"
KEY_VARIABLE: Final = "TAILGUARD_API_KEY"


def _installed() -> bool:
    manifest = CACHE / "node_modules" / "@openai" / "codex" / "package.json"
    try:
        return bool(orjson.loads(manifest.read_bytes()).get("version") == CODEX_VERSION)
    except (OSError, orjson.JSONDecodeError):
        return False


@pytest.fixture(scope="session")
def codex() -> Iterator[Path]:
    """The pinned Codex CLI, installed on first use (one installer at a time across workers)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: Codex CLI {CODEX_VERSION} cannot be installed")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _installed():
            done = subprocess.run(
                [npm, "install", "--prefix", str(CACHE), "--no-audit", "--no-fund", PACKAGE],
                capture_output=True,
                text=True,
                timeout=scaled(180),
                check=False,
            )
            if done.returncode != 0 or not _installed():
                pytest.skip(
                    f"npm could not install {PACKAGE} (is the npm registry reachable?): "
                    + (done.stderr.strip().splitlines() or ["no output"])[-1]
                )
    yield CODEX


@pytest.fixture
async def upstream() -> AsyncIterator[AgentUpstream]:
    fake = AgentUpstream()
    async with serve(fake) as url:
        fake.url = url
        yield fake


@pytest.fixture
async def gateway(upstream: AgentUpstream) -> AsyncIterator[Gateway]:
    """One model per route to the same scripted upstream."""
    url = upstream.url + "/v1"
    providers = {
        "native": {"type": "openai", "base_url": url, "responses": "native"},
        "chat": {"type": "openai", "base_url": url},
        "claude": {"type": "anthropic", "base_url": upstream.url, "api_key": "sk-ant-test"},
    }
    models = [
        {"name": name, "deployments": [{"provider": provider, "model": f"{provider}-upstream"}]}
        for name, provider in (
            ("codex-native", "native"),
            ("codex-chat", "chat"),
            ("codex-claude", "claude"),
        )
    ]
    async with run_gateway(gateway_settings(providers, models)) as gw:
        yield gw


def codex_command(codex: Path, base_url: str, model: str) -> list[str]:
    """`codex exec` on a Tailguard model: the configuration docs/clients/codex.md shows."""
    provider = (
        f'{{name="Tailguard", base_url="{base_url}", wire_api="responses", '
        f'env_key="{KEY_VARIABLE}", request_max_retries=0, stream_max_retries=0}}'
    )
    settings = [
        "model_provider=tailguard",
        f"model_providers.tailguard={provider}",
        "analytics.enabled=false",
        "feedback.enabled=false",
        "check_for_update_on_startup=false",
    ]
    command = [str(codex), "exec", "--skip-git-repo-check", "--strict-config"]
    for setting in settings:
        command += ["-c", setting]
    # The scripted upstream decides the command; the test's temporary directory is the sandbox.
    command += ["--dangerously-bypass-approvals-and-sandbox", "-m", model]
    return [*command, f"Run `{COMMAND}` in the shell, then say what happened."]


async def run_codex(codex: Path, gateway: Gateway, model: str, workdir: Path) -> str:
    """Run Codex in `workdir` with its own home; its final message (stdout)."""
    home = workdir.parent / "home"
    home.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(home),
        KEY_VARIABLE: "unused",  # the gateway runs without keys here
        "NO_PROXY": "127.0.0.1",
        "LANG": "C.UTF-8",
    }
    process = await asyncio.create_subprocess_exec(
        *codex_command(codex, gateway.base_url, model),
        cwd=workdir,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), scaled(120))
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


def _tool_names(tools: list[dict[str, Any]]) -> set[str]:
    return {t.get("name") or t.get("function", {}).get("name") for t in tools}


@pytest.mark.parametrize(
    ("model", "path"),
    [
        ("codex-native", "/v1/responses"),
        ("codex-chat", "/v1/chat/completions"),
        ("codex-claude", "/v1/messages"),
    ],
)
async def test_codex_runs_a_shell_command_and_completes(
    codex: Path,
    gateway: Gateway,
    upstream: AgentUpstream,
    tmp_path: Path,
    model: str,
    path: str,
) -> None:
    """Codex's shell tool runs the command the upstream asked for, Codex sends its output
    back, and the task ends with the upstream's final answer, on every route."""
    fake = upstream
    workdir = tmp_path / "work"
    workdir.mkdir()
    final = await run_codex(codex, gateway, model, workdir)
    assert (workdir / PROOF_FILE).read_text().strip() == "ran-by-the-agent"
    assert FINAL_TEXT in final
    sent = [r for r in fake.requests if r.path == path]
    assert len(sent) >= 2, [r.path for r in fake.requests]
    first = sent[0]
    if model == "codex-native":
        # Native: Codex's request as it sent it, its session headers with it.
        assert "client_metadata" in first.body
        assert first.headers["originator"] == "codex_exec"
        assert first.headers.get("session-id") and first.headers.get("x-codex-turn-metadata")
        return
    # Translated: no session headers, no hosted tools; the namespace's functions flattened.
    assert not {"originator", "session-id", "x-codex-turn-metadata"} & first.headers.keys()
    names = _tool_names(first.body["tools"])
    assert "exec_command" in names and "spawn_agent" in names
    assert "web_search" not in names and None not in names
