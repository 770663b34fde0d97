"""Messages answers the gateway writes from a chat upstream, held to Anthropic's official
OpenAPI schema as `llm-comply` (pinned) bundles it: every non-streamed body and every streamed
event, for text, tool calls, image input and reasoning; and `llm-comply` itself run against a
gateway on a translated deployment.

A strictly typed client (Go, Java, Rust SDKs, generated clients) refuses a message that lacks a
required field, so each field the schema requires must be there, null where chat has nothing to
say.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import httpx
import orjson
import pytest

from gateway.config import Settings
from gateway.models import Chunk
from gateway.providers.decode import OpenAIStreamDecoder
from gateway.providers.translate import OpenAIToAnthropicStream, openai_response_to_anthropic
from gateway.scrubbing import Scrubber
from gateway.sse import SSEParser
from tests.conftest import Gateway, gateway_settings, run_gateway
from tests.schemas import parse_sse, problems, stream_schema

pytestmark = pytest.mark.timeout(60)

# A 1x1 PNG: what an agent sends when a screenshot is part of the conversation.
PIXEL: Final = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
    )
).decode()
WEATHER_TOOL: Final = {
    "name": "get_weather",
    "description": "Current weather",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def translated_settings() -> Settings:
    """Two models on the in-process simulator (an OpenAI-compatible chat server): one plain,
    one that reasons before it answers, asked for by Claude's model names."""
    return gateway_settings(
        {
            "sim": {
                "type": "simulated",
                "seed": 3,
                "profiles": {
                    "plain": {"output_tokens": 6},
                    "thinker": {"output_tokens": 6, "reasoning_tokens": 5},
                },
            }
        },
        [
            {"name": "plain", "deployments": [{"provider": "sim", "model": "plain"}]},
            {
                "name": "thinker",
                "aliases": ["claude-*"],
                "deployments": [{"provider": "sim", "model": "thinker"}],
            },
        ],
    )


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    async with run_gateway(translated_settings()) as gw:
        yield gw


def schema_errors(data: Any, schema: str) -> list[str]:
    return problems("messages", schema, data)


def event_errors(stream: bytes) -> tuple[list[str], list[dict[str, Any]]]:
    """Every event of an Anthropic stream validated by its own schema; the events' data."""
    errors: list[str] = []
    events: list[dict[str, Any]] = []
    for name, data in parse_sse(stream):
        if not isinstance(data, dict):
            continue
        events.append(data)
        if name != data.get("type"):
            errors.append(f"event {name!r} carries {data.get('type')!r}")
        if data["type"] == "ping":
            continue
        document, schema = stream_schema("messages", data)
        errors += [f"{data['type']}: {e}" for e in problems(document, schema, data)]
    return errors, events


REQUESTS: Final[dict[str, dict[str, Any]]] = {
    "text": {
        "model": "plain",
        "max_tokens": 64,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Say hello."}],
    },
    "tools": {
        "model": "plain",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "any"},
    },
    "image": {
        "model": "plain",
        "max_tokens": 64,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe this image."},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": PIXEL},
                    },
                ],
            }
        ],
    },
    "thinking": {
        "model": "thinker",
        "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "What is 15 * 37?"}],
    },
    "tool_result": {
        "model": "plain",
        "max_tokens": 64,
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                        "caller": {"type": "direct"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}],
            },
        ],
    },
}
EXPECTED_BLOCKS: Final = {
    "text": {"text"},
    "tools": {"tool_use"},
    "image": {"text"},
    "thinking": {"thinking", "text"},
    "tool_result": {"text"},
}


@pytest.mark.parametrize("case", sorted(REQUESTS))
async def test_translated_message_validates(gateway: Gateway, case: str) -> None:
    """A non-streamed Messages answer translated from chat validates against `Message`."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        response = await client.post("/v1/messages", json=REQUESTS[case])
    assert response.status_code == 200, response.text
    message = response.json()
    assert schema_errors(message, "Message") == []
    assert {block["type"] for block in message["content"]} == EXPECTED_BLOCKS[case]


@pytest.mark.parametrize("case", sorted(REQUESTS))
async def test_translated_stream_events_validate(gateway: Gateway, case: str) -> None:
    """Every streamed event translated from chat validates against its event schema."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        response = await client.post("/v1/messages", json={**REQUESTS[case], "stream": True})
    assert response.status_code == 200, response.text
    errors, events = event_errors(response.content)
    assert errors == []
    kinds = [event["type"] for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    started = {e["content_block"]["type"] for e in events if e["type"] == "content_block_start"}
    assert started == EXPECTED_BLOCKS[case]


CACHED_USAGE: Final = {
    "prompt_tokens": 300,
    "completion_tokens": 42,
    "total_tokens": 342,
    "prompt_tokens_details": {"cached_tokens": 256, "cache_write_tokens": 4},
    "completion_tokens_details": {"reasoning_tokens": 30},
}


def test_usage_with_cache_and_reasoning_validates() -> None:
    """Cache reads, writes and reasoning tokens land in Anthropic's own usage fields, in a body
    that validates; a refusal is a text block with its citations."""
    completion = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "refusal": "No."},
                "finish_reason": "content_filter",
            }
        ],
        "usage": CACHED_USAGE,
    }
    message = orjson.loads(openai_response_to_anthropic(completion, model="gpt-5"))
    assert schema_errors(message, "Message") == []
    assert message["usage"] == {
        "input_tokens": 40,
        "cache_creation_input_tokens": 4,
        "cache_read_input_tokens": 256,
        "cache_creation": {"ephemeral_5m_input_tokens": 4, "ephemeral_1h_input_tokens": 0},
        "output_tokens": 42,
        "output_tokens_details": {"thinking_tokens": 30},
        "server_tool_use": None,
        "service_tier": None,
        "inference_geo": None,
    }


def test_stream_usage_with_cache_and_reasoning_validates() -> None:
    """A streamed answer's final `message_delta` carries the cumulative counts Anthropic's
    schema requires, cache and reasoning included."""
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "gpt-5"}
    frames = [
        {**chunk, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
        {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**chunk, "choices": [], "usage": CACHED_USAGE},
    ]
    raw = b"".join(b"data: " + orjson.dumps(f) + b"\n\n" for f in frames) + b"data: [DONE]\n\n"
    decoder = OpenAIStreamDecoder(scrub=Scrubber.GENERIC)
    translator = OpenAIToAnthropicStream(model="gpt-5")
    chunks: list[Chunk] = [decoder.decode(event) for event in SSEParser().feed(raw)]
    out = b"".join(translator.feed(c) for c in chunks)
    errors, events = event_errors(out)
    assert errors == []
    assert events[-2]["usage"] == {
        "input_tokens": 40,
        "cache_creation_input_tokens": 4,
        "cache_read_input_tokens": 256,
        "output_tokens": 42,
        "output_tokens_details": {"thinking_tokens": 30},
        "server_tool_use": None,
    }


LLM_COMPLY: Final = Path(sys.executable).with_name("llm-comply")


@pytest.mark.timeout(120)
async def test_llm_comply_anthropic_on_a_translated_deployment(gateway: Gateway) -> None:
    """`llm-comply --format anthropic` against the gateway, its Messages requests served by a
    chat upstream: every test passes, schema validation included; asked for by a Claude model
    name, none is skipped (its thinking test runs for Claude models only)."""
    assert LLM_COMPLY.exists(), "llm-comply is a test dependency (pyproject.toml)"
    process = await asyncio.create_subprocess_exec(
        str(LLM_COMPLY),
        "--format",
        "anthropic",
        "--base-url",
        gateway.base_url,
        "--api-key",
        "unused",
        "--model",
        "claude-sonnet-4-5",
        "--json",
        "--timeout",
        "30",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NO_COLOR": "1"},
    )
    stdout, stderr = await process.communicate()
    report = json.loads(stdout)
    failed = [r for r in report["results"] if r["status"] != "passed"]
    assert failed == [], json.dumps(failed, indent=1)[:4000] + stderr.decode()[-2000:]
    assert report["summary"]["passed"] == report["summary"]["total"] == 9
