"""Non-streaming response translation: the parsed upstream body → the client's JSON bytes.

Also the vocabulary that request and stream translation share with it: stop reasons ↔ finish
reasons, response and tool-call ids in each wire's form, tool-call arguments as an input object,
and usage in each wire's accounting (cache reads and writes are part of OpenAI's `prompt_tokens`,
excluded from Anthropic's `input_tokens`).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Final

import orjson

from gateway.numbers import count
from gateway.providers.decode import openai_cache_tokens

_FINISH_REASONS: Final[dict[str, str]] = {
    "end_turn": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "stop_sequence": "stop",
    "refusal": "content_filter",
    "pause_turn": "stop",
    "model_context_window_exceeded": "length",
}
_STOP_REASONS: Final[dict[str, str]] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
_UNSAFE_TOOL_ID: Final = re.compile(r"[^A-Za-z0-9_-]")


def openai_finish_reason(stop_reason: str | None) -> str:
    """Anthropic `stop_reason` → OpenAI `finish_reason`."""
    return _FINISH_REASONS.get(stop_reason or "end_turn", "stop")


def anthropic_stop_reason(finish_reason: str | None) -> str:
    """OpenAI `finish_reason` → Anthropic `stop_reason`."""
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn")


def _openai_id(upstream_id: object) -> str:
    if not isinstance(upstream_id, str) or not upstream_id:
        return "chatcmpl-" + uuid.uuid4().hex
    return upstream_id if upstream_id.startswith("chatcmpl-") else "chatcmpl-" + upstream_id


def _anthropic_id(upstream_id: object) -> str:
    if not isinstance(upstream_id, str) or not upstream_id:
        return "msg_" + uuid.uuid4().hex
    return upstream_id if upstream_id.startswith("msg_") else "msg_" + upstream_id


def _tool_id(call_id: object) -> str:
    """Anthropic accepts only `[A-Za-z0-9_-]` in tool ids; other servers are laxer."""
    if not isinstance(call_id, str) or not call_id:
        return "toolu_" + uuid.uuid4().hex[:24]
    return _UNSAFE_TOOL_ID.sub("_", call_id)


def _arguments(arguments: object) -> dict[str, Any] | None:
    """Tool-call arguments (a JSON string) → the input object; None when not a JSON object."""
    if arguments is None or arguments == "":
        return {}  # some servers send no arguments for a function without parameters
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = orjson.loads(arguments) if isinstance(arguments, str | bytes) else None
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _openai_usage(usage: object) -> dict[str, Any]:
    """Anthropic usage → OpenAI usage: cache reads and writes are part of `prompt_tokens`; reads
    are `prompt_tokens_details.cached_tokens`, writes `prompt_tokens_details.cache_write_tokens`
    (present when there were any). A count that is not one (negative, a string, ...) counts
    as 0."""
    usage = usage if isinstance(usage, dict) else {}
    cached = count(usage.get("cache_read_input_tokens")) or 0
    written = count(usage.get("cache_creation_input_tokens")) or 0
    prompt = (count(usage.get("input_tokens")) or 0) + cached + written
    completion = count(usage.get("output_tokens")) or 0
    details: dict[str, int] = {"cached_tokens": cached}
    if written:
        details["cache_write_tokens"] = written
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    }


def _anthropic_usage(usage: object) -> dict[str, Any]:
    """OpenAI usage → Anthropic usage, with every field Anthropic's schema requires:
    `input_tokens` excludes the part read from the cache (`cache_read_input_tokens`) and the part
    written to it (`cache_creation_input_tokens`, all counted as 5-minute writes: chat has no
    TTLs); reasoning tokens are `output_tokens_details.thinking_tokens`. A count that is not one
    (negative, a string, ...) counts as 0."""
    usage = usage if isinstance(usage, dict) else {}
    prompt = count(usage.get("prompt_tokens")) or 0
    cached, written = (n or 0 for n in openai_cache_tokens(usage))
    return {
        "input_tokens": max(prompt - cached - written, 0),
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
        "cache_creation": {"ephemeral_5m_input_tokens": written, "ephemeral_1h_input_tokens": 0},
        "output_tokens": count(usage.get("completion_tokens")) or 0,
        "output_tokens_details": _thinking_tokens(usage),
        "server_tool_use": None,
        "service_tier": None,
        "inference_geo": None,
    }


def _thinking_tokens(usage: dict[str, Any]) -> dict[str, int] | None:
    """OpenAI's `completion_tokens_details.reasoning_tokens` as Anthropic's output details."""
    details = usage.get("completion_tokens_details")
    reasoning = count(details.get("reasoning_tokens")) if isinstance(details, dict) else None
    return None if reasoning is None else {"thinking_tokens": reasoning}


def anthropic_response_to_openai(data: dict[str, Any], *, model: str) -> bytes:
    """A Messages response → `chat.completion` JSON bytes (text, reasoning, tool calls, usage)."""
    texts: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for block in data.get("content") or ():
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text") or "")
        elif kind == "thinking":
            reasoning.append(block.get("thinking") or "")
        elif kind == "tool_use":
            tool_calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {
                        "name": block.get("name"),
                        "arguments": orjson.dumps(block.get("input") or {}).decode(),
                    },
                }
            )
        # redacted_thinking and server-tool blocks have no chat completions counterpart
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(texts) if texts or not tool_calls else None,
        "refusal": None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)  # vLLM's and DeepSeek's field
    return orjson.dumps(
        {
            "id": _openai_id(data.get("id")),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": openai_finish_reason(data.get("stop_reason")),
                }
            ],
            "usage": _openai_usage(data.get("usage")),
        }
    )


def _message_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # some servers answer with text parts
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""


TOOL_CALLER: Final = {"type": "direct"}
"""Who called a tool, as Anthropic's schema requires it on a `tool_use` block: the model."""


def openai_response_to_anthropic(data: dict[str, Any], *, model: str) -> bytes:
    """A `chat.completion` → Messages response JSON bytes (first choice only), with every field
    Anthropic's schema requires (`citations`, `caller`, `stop_details` and `container` as null
    or their defaults: chat has none of them).

    Tool-call arguments that are not a JSON object (cut off by `max_tokens`) become `{}`.
    """
    choices = data.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = _message_text(message.get("content"))
    if text:
        content.append({"type": "text", "text": text, "citations": None})
    if message.get("refusal"):
        content.append({"type": "text", "text": message["refusal"], "citations": None})
    calls = list(message.get("tool_calls") or ())
    if message.get("function_call"):
        calls.append({"function": message["function_call"]})
    for call in calls:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": _tool_id(call.get("id")),
                "name": function.get("name") or "",
                "input": _arguments(function.get("arguments")) or {},
                "caller": TOOL_CALLER,
            }
        )
    return orjson.dumps(
        {
            "id": _anthropic_id(data.get("id")),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": anthropic_stop_reason(choice.get("finish_reason")),
            "stop_sequence": None,
            "stop_details": None,
            "usage": _anthropic_usage(data.get("usage")),
            "container": None,
        }
    )
