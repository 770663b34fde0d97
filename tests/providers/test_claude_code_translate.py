"""What Claude Code sends, translated for an OpenAI-compatible deployment: a system message in the
middle of the conversation, thinking and effort, `context_management` and its betas, prompt-cache
markers and its long `metadata.user_id`; and the same request as sent to a native Anthropic
deployment. Requests go through a running gateway to a recording scripted upstream."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import orjson
import pytest

from gateway.providers.translate import TranslationError, messages_request_to_openai
from tests.conftest import gateway_settings, run_gateway, serve
from tests.fakes.agent_upstream import AgentUpstream

pytestmark = pytest.mark.timeout(30)

# Claude Code 2.1's user id: a JSON object with a device id and a session, 150 characters.
USER_ID: Final = (
    '{"device_id":"4d1d4c788b74a749f7d0af9ebc19605f93f8facd83b2b9a9eb316f5b03a4b113",'
    '"account_uuid":"","session_id":"e19b2f3b-4003-40e5-be09-79e91ee388b1"}'
)
BETAS: Final = (
    "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
    "advanced-tool-use-2025-11-20"
)
CLAUDE_CODE_REQUEST: Final[dict[str, Any]] = {
    "model": "coder",
    "max_tokens": 32000,
    "system": [
        {"type": "text", "text": "You are a Claude agent."},
        {"type": "text", "text": "Be careful.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {"role": "user", "content": "Fix the bug."},
        {"role": "assistant", "content": "Looking."},
        {
            "role": "system",
            "content": [{"type": "text", "text": "You are now a sub-agent: report back."}],
        },
        {
            "role": "user",
            "content": [{"type": "text", "text": "Go on.", "cache_control": {"type": "ephemeral"}}],
        },
    ],
    "metadata": {"user_id": USER_ID},
    "thinking": {"type": "enabled", "budget_tokens": 31999},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
}


def test_mid_conversation_system_message_keeps_its_place() -> None:
    """A `system` message between turns becomes a chat `system` message at the same place."""
    out = messages_request_to_openai(CLAUDE_CODE_REQUEST)
    assert [(m["role"], m["content"]) for m in out["messages"]] == [
        ("system", "You are a Claude agent.\n\nBe careful."),
        ("user", "Fix the bug."),
        ("assistant", "Looking."),
        ("system", "You are now a sub-agent: report back."),
        ("user", "Go on."),
    ]


def test_a_role_that_is_none_of_the_three_is_still_refused() -> None:
    """Only user, assistant and system turns exist on the Messages wire."""
    body = {"max_tokens": 5, "messages": [{"role": "developer", "content": "x"}]}
    with pytest.raises(TranslationError) as caught:
        messages_request_to_openai(body)
    assert caught.value.param == "messages[0].role"


@pytest.mark.parametrize(
    ("settings", "effort"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "low"),
        ({"thinking": {"type": "enabled", "budget_tokens": 8000}}, "medium"),
        ({"thinking": {"type": "enabled", "budget_tokens": 31999}}, "high"),
        ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}}, "low"),
        ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "max"}}, "high"),
        ({"output_config": {"effort": "xhigh"}}, "high"),
        ({"thinking": {"type": "adaptive"}}, None),
        ({"thinking": {"type": "disabled"}}, None),
    ],
)
def test_thinking_and_effort_become_reasoning_effort(
    settings: dict[str, Any], effort: str | None
) -> None:
    """`output_config.effort` wins; else an enabled thinking budget sets the effort; adaptive
    or disabled thinking leaves it to the upstream's default."""
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **settings}
    assert messages_request_to_openai(body).get("reasoning_effort") == effort


def test_user_id_becomes_a_hashed_safety_identifier() -> None:
    """A Claude Code user id (over OpenAI's limit of 64 characters) is sent hashed, as a
    `safety_identifier`, never as `user`."""
    assert len(USER_ID) >= 150
    out = messages_request_to_openai(CLAUDE_CODE_REQUEST)
    assert out["safety_identifier"] == hashlib.sha256(USER_ID.encode()).hexdigest()
    assert len(out["safety_identifier"]) == 64
    assert "user" not in out


def test_cache_markers_become_a_prompt_cache_key_only_when_asked() -> None:
    """With a cache hint, the marked prompt gets a `prompt_cache_key` stable across a session
    (and distinct from the safety identifier); without one, nothing is added."""
    hinted = messages_request_to_openai(CLAUDE_CODE_REQUEST, cache_hint=True)
    again = messages_request_to_openai(
        {**CLAUDE_CODE_REQUEST, "messages": CLAUDE_CODE_REQUEST["messages"][:1]}, cache_hint=True
    )
    assert hinted["prompt_cache_key"] == again["prompt_cache_key"]
    assert len(hinted["prompt_cache_key"]) == 32
    assert not hinted["safety_identifier"].startswith(hinted["prompt_cache_key"])
    assert "prompt_cache_key" not in messages_request_to_openai(CLAUDE_CODE_REQUEST)


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[AgentUpstream, str]]:
    fake = AgentUpstream("true")
    async with serve(fake) as url:
        yield fake, url


@pytest.mark.parametrize("provider_type", ["openai", "vllm"])
async def test_claude_code_request_reaches_a_chat_deployment(
    upstream: tuple[AgentUpstream, str], provider_type: str
) -> None:
    """Through the gateway, Claude Code's request reaches a chat upstream in chat's terms: the
    sub-agent's system message in place, `reasoning_effort`, a hashed `safety_identifier`, a
    `prompt_cache_key` for OpenAI's own API only; `thinking`, `context_management`,
    `cache_control` and the `anthropic-beta` header left behind."""
    fake, url = upstream
    settings = gateway_settings(
        {"up": {"type": provider_type, "base_url": url + "/v1", "api_key": "k"}},
        [{"name": "coder", "deployments": [{"provider": "up", "model": "gpt-5-mini"}]}],
    )
    async with (
        run_gateway(settings) as gateway,
        httpx.AsyncClient(base_url=gateway.url, timeout=10) as client,
    ):
        response = await client.post(
            "/v1/messages",
            json=CLAUDE_CODE_REQUEST,
            headers={"anthropic-beta": BETAS, "anthropic-version": "2023-06-01"},
        )
    assert response.status_code == 200, response.text
    assert response.json()["content"][0]["type"] == "text"
    (received,) = fake.requests
    body = received.body
    assert received.path == "/v1/chat/completions"
    assert [m["role"] for m in body["messages"]] == [
        "system",
        "user",
        "assistant",
        "system",
        "user",
    ]
    assert body["reasoning_effort"] == "high"
    assert body["safety_identifier"] == hashlib.sha256(USER_ID.encode()).hexdigest()
    assert ("prompt_cache_key" in body) is (provider_type == "openai")
    for dropped in ("thinking", "context_management", "metadata", "user", "output_config"):
        assert dropped not in body
    assert b"cache_control" not in orjson.dumps(body)
    assert "anthropic-beta" not in received.headers


async def test_claude_code_request_reaches_a_native_deployment_as_sent(
    upstream: tuple[AgentUpstream, str],
) -> None:
    """A native Anthropic deployment gets the system message, thinking, context management,
    cache markers, metadata and betas as Claude Code sent them."""
    fake, url = upstream
    settings = gateway_settings(
        {"up": {"type": "anthropic", "base_url": url, "api_key": "k"}},
        [{"name": "coder", "deployments": [{"provider": "up", "model": "claude-sonnet-4-5"}]}],
    )
    async with (
        run_gateway(settings) as gateway,
        httpx.AsyncClient(base_url=gateway.url, timeout=10) as client,
    ):
        response = await client.post(
            "/v1/messages", json=CLAUDE_CODE_REQUEST, headers={"anthropic-beta": BETAS}
        )
    assert response.status_code == 200, response.text
    (received,) = fake.requests
    assert received.body == {**CLAUDE_CODE_REQUEST, "model": "claude-sonnet-4-5"}
    assert received.headers["anthropic-beta"] == BETAS
