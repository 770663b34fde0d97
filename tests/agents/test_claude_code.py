"""The real Claude Code (`claude -p`, pinned) through the gateway, on a native Anthropic deployment
and on a translated chat-completions deployment, against a scripted upstream on loopback.

The scripted model calls Claude Code's `Bash` tool to write a file in the agent's working
directory, then answers with text once it sees the tool's result: the file exists and the run
ends with that answer. The agent runs in a temporary HOME and working directory, with telemetry,
auto-updates and non-essential traffic off, and a proxy that refuses anything not on loopback.

Claude Code is installed by `.ci/run` (`npm install --prefix .cache/agents/claude-code`); when it
is missing the test installs it there itself, and skips only when npm cannot reach its registry.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import pytest

from gateway.config import Settings
from tests.conftest import Gateway, free_port, gateway_settings, run_gateway, serve
from tests.fakes.agent_upstream import FINAL_TEXT, AgentUpstream
from tests.timing import scaled

pytestmark = pytest.mark.timeout(240)

CLAUDE_CODE_VERSION: Final = "2.1.332"
ROOT: Final = Path(__file__).resolve().parents[2]
PREFIX: Final = ROOT / ".cache" / "agents" / "claude-code"
CLAUDE: Final = PREFIX / "node_modules" / ".bin" / "claude"
PROOF: Final = "proof.txt"
COMMAND: Final = f"echo written-by-the-agent > {PROOF} && cat {PROOF}"


async def _run(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Any:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=cwd,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), scaled(180))
    return process.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace")


async def installed_claude() -> Path:
    """The pinned Claude Code, installed under `.cache/agents/` if it is not there yet."""
    if CLAUDE.exists():
        code, out, _ = await _run(str(CLAUDE), "--version")
        if code == 0 and out.startswith(CLAUDE_CODE_VERSION):
            return CLAUDE
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: Claude Code cannot be installed")
    code, _, err = await _run(
        npm, "view", f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}", "version"
    )
    if code != 0:
        pytest.skip(f"the npm registry cannot be reached: {err.strip()[-300:]}")
    PREFIX.mkdir(parents=True, exist_ok=True)
    code, out, err = await _run(
        npm,
        "install",
        "--prefix",
        str(PREFIX),
        "--no-audit",
        "--no-fund",
        f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}",
    )
    assert code == 0, f"npm install failed: {out[-1000:]} {err[-2000:]}"
    return CLAUDE


def native_settings(upstream: str) -> Settings:
    """Claude Code's model names (any `claude-*`) on an Anthropic deployment."""
    return gateway_settings(
        {"anthropic": {"type": "anthropic", "base_url": upstream, "api_key": "upstream-key"}},
        [
            {
                "name": "coder",
                "aliases": ["claude-*"],
                "deployments": [{"provider": "anthropic", "model": "claude-sonnet-4-5"}],
            }
        ],
    )


def translated_settings(upstream: str) -> Settings:
    """Claude Code's model names (any `claude-*`) on an OpenAI-compatible deployment, answered
    with the name asked for."""
    return gateway_settings(
        {"openai": {"type": "openai", "base_url": upstream + "/v1", "api_key": "upstream-key"}},
        [
            {
                "name": "coder",
                "aliases": ["claude-*"],
                "answer_model": "requested",
                "deployments": [{"provider": "openai", "model": "gpt-5-mini"}],
            }
        ],
    )


def agent_env(home: Path, base_url: str) -> dict[str, str]:
    """Claude Code's environment: the gateway, a key, a fresh HOME, nothing but loopback."""
    dead_proxy = f"http://127.0.0.1:{free_port()}"  # refuses: no traffic leaves the machine
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "SHELL": shutil.which("bash") or "/bin/bash",
        "LANG": "C.UTF-8",
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "sk-ant-test-gateway-key",
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
        "HTTPS_PROXY": dead_proxy,
        "HTTP_PROXY": dead_proxy,
        "NO_PROXY": "127.0.0.1,localhost",
    }


@pytest.fixture
async def claude() -> Path:
    return await installed_claude()


@pytest.fixture(params=[False, True], ids=["direct", "sub-agent"])
async def fake(request: pytest.FixtureRequest) -> AsyncIterator[tuple[AgentUpstream, str]]:
    """The scripted model: it runs the shell tool itself, or hands the task to a sub-agent
    (Claude Code's `Agent` tool: a conversation of its own, with its own system prompt)."""
    agent = AgentUpstream(COMMAND, delegate=request.param)
    async with serve(agent) as url:
        yield agent, url


async def run_claude(claude: Path, gateway: Gateway, tmp_path: Path, *, base_url: str) -> Any:
    """`claude -p` in `tmp_path/work`; its JSON result."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    code, out, err = await _run(
        str(claude),
        "-p",
        "Create the file proof.txt in the current directory with the shell, then say done.",
        "--model",
        "claude-sonnet-4-5",
        "--allowedTools",
        "Bash",
        "--output-format",
        "json",
        "--max-turns",
        "4",
        env=agent_env(home, base_url),
        cwd=work,
    )
    assert code == 0, f"claude exited {code}: {out[-2000:]} {err[-2000:]}"
    result = json.loads(out)
    assert (work / PROOF).read_text() == "written-by-the-agent\n"
    return result


async def test_claude_code_on_a_native_deployment(
    claude: Path, fake: tuple[AgentUpstream, str], tmp_path: Path
) -> None:
    """Through an Anthropic deployment, Claude Code's Bash tool runs the scripted command and
    the run completes with the model's final answer."""
    agent, url = fake
    async with run_gateway(native_settings(url)) as gateway:
        result = await run_claude(claude, gateway, tmp_path, base_url=gateway.url)
    assert result["is_error"] is False
    assert result["result"].startswith(FINAL_TEXT)
    assert agent.tool_results and "written-by-the-agent" in agent.tool_results[-1]
    assert {r.path for r in agent.requests} == {"/v1/messages"}


async def test_claude_code_on_a_translated_deployment(
    claude: Path, fake: tuple[AgentUpstream, str], tmp_path: Path
) -> None:
    """Through an OpenAI-compatible deployment, Claude Code's conversation (its system prompt,
    tools, thinking, cache markers and metadata) translates, its Bash tool runs the scripted
    command, and the run completes with the model's final answer."""
    agent, url = fake
    async with run_gateway(translated_settings(url)) as gateway:
        result = await run_claude(claude, gateway, tmp_path, base_url=gateway.url)
    assert result["is_error"] is False
    assert result["result"].startswith(FINAL_TEXT)
    assert agent.tool_results and "written-by-the-agent" in agent.tool_results[-1]
    assert {r.path for r in agent.requests} == {"/v1/chat/completions"}
    for received in agent.requests:
        assert received.body["model"] == "gpt-5-mini"
        assert len(received.body.get("safety_identifier", "")) <= 64
        assert "user" not in received.body
