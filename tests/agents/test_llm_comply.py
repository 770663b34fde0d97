"""`llm-comply` (pinned in pyproject.toml), the third-party conformance runner, against a running
gateway: the OpenAI chat and Open Responses suites pass on the simulator and on a deployment
translated from Anthropic's Messages API. The runner is its own process; the gateway and the
Messages fake run in the test's loop, so it is awaited, never waited on."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import llm_comply.test_case  # type: ignore[import-untyped]
import pytest
from llm_comply.tests import get_tests  # type: ignore[import-untyped]

from tests.conftest import Gateway
from tests.schemas import wire_gateway
from tests.timing import scaled

pytestmark = pytest.mark.timeout(180)

RUNNER: Final = Path(sys.executable).with_name("llm-comply")
# Errors that cannot be avoided, by their text (`-i`), and why.
IGNORED: Final[dict[str, str]] = {
    "unknown SSE event type: response.reasoning_text.": (
        "OpenAI's API and SDKs name the reasoning text events `response.reasoning_text.delta` "
        "and `.done`; the Open Responses specification calls them `response.reasoning.delta` "
        "and `.done` (same fields), which OpenAI's SDK would not recognise. The gateway speaks "
        "OpenAI's names; tests/schemas.py checks them against the specification's schema."
    ),
}


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    """Simulated models (one named like a reasoning model, so the reasoning tests run) and the
    Messages fake behind translated deployments."""
    async with wire_gateway("gpt-5-sim") as gw:
        yield gw


def suite_ids(fmt: str, *, tools: bool) -> str:
    """The ids of the suite's tool-calling tests, or of all its others (`-f`)."""
    return ",".join(
        t.id
        for t in get_tests(fmt)
        if (t.category == llm_comply.test_case.TestCategory.TOOLS) == tools
    )


async def comply(gateway: Gateway, fmt: str, model: str, only: str) -> dict[str, Any]:
    """Run llm-comply's tests `only` of suite `fmt` against `model`; its JSON summary."""
    args = ["run", "--format", fmt, "-u", gateway.base_url, "-m", model, "-k", "unused", "--json"]
    args += ["-f", only]
    if IGNORED:
        args += ["-i", ",".join(IGNORED)]
    process = await asyncio.create_subprocess_exec(
        str(RUNNER),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NO_COLOR": "1"},
    )
    out, err = await asyncio.wait_for(process.communicate(), scaled(120))
    assert out, err.decode()
    summary: dict[str, Any] = json.loads(out[out.index(b"{") :])
    return summary


def failures(summary: dict[str, Any]) -> dict[str, list[str]]:
    return {r["id"]: r["errors"] for r in summary["results"] if r["status"] == "failed"}


# (suite, model, whether the run is the suite's tool-calling tests or all its others). The
# scripted Messages deployments answer either in text or with a tool call, whatever is asked:
# each runs the tests it can answer.
RUNS: Final = [
    ("openai-chat", "sim", False),
    ("openai-chat", "sim", True),
    ("openai-chat", "claude", False),
    ("openai-chat", "claude-tools", True),
    # Named like a reasoning model, so the runner's reasoning test runs. The chat suite's runs
    # on `sim`, where the runner skips it: it sends `reasoning` on chat completions, which
    # OpenAI's chat API does not define and the simulator refuses.
    ("open-responses", "gpt-5-sim", False),
    ("open-responses", "sim", True),
    ("open-responses", "claude", False),
    ("open-responses", "claude-tools", True),
]


@pytest.mark.parametrize(("fmt", "model", "tools"), RUNS)
async def test_llm_comply_passes(gateway: Gateway, fmt: str, model: str, tools: bool) -> None:
    """Every test of the suite passes, on the simulator and translated from Messages."""
    summary = await comply(gateway, fmt, model, suite_ids(fmt, tools=tools))
    assert failures(summary) == {}, json.dumps(summary, indent=2)
    assert summary["summary"]["failed"] == 0
    assert summary["summary"]["passed"] >= summary["summary"]["total"] - 1  # at most one skip
