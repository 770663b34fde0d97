"""Counting a request's input tokens with a deployment's own counter, without generating.

Each upstream protocol has its own counter, asked in the shape it takes:

- Anthropic: `POST {base}/v1/messages/count_tokens` (a Messages body) → `input_tokens`;
- OpenAI with `responses: native`: `POST {base}/responses/input_tokens` (a Responses body);
- vLLM: `POST {base without /v1}/tokenize` with the chat form (`messages`, `tools`) → `count`;
- simulated: the engine's own tokenizer (`SimEngine.count_tokens`), the one its usage reports.

Each adapter answers for itself (`Provider.counter`: an HTTP adapter names its counter's URL,
body and answer key, and `HTTPProvider.counter` posts it; the simulator's is
`simulated_counter`); one without a counter (an OpenAI-compatible chat API, Azure, Bedrock,
Gemini, Vertex) answers None, and the caller falls back on `estimate_tokens`. A counter's
failure is a `ProviderError` (an HTTP counter's is translated in `gateway.providers.http`, from
the transport's exceptions and the upstream's status, through the one table); what one wire
cannot express raises `TranslationError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from gateway.admission.validate import off_loop
from gateway.errors import ProviderError, upstream_error
from gateway.models import Wire
from gateway.numbers import count
from gateway.providers.translate import (
    TranslationError,
    chat_request_to_anthropic,
    messages_request_to_openai,
)
from gateway.providers.translate.items import responses_request_to_chat
from gateway.sim.wire import BadRequestError
from gateway.upstream import Counter, TokenQuery

CHARS_PER_TOKEN: Final = 4
"""The estimate's rule of thumb: about four characters of English text per token."""

# What each counter is sent of a body translated from the other wire: the input, not the
# generation settings (Anthropic's counter refuses `max_tokens`, for one).
_MESSAGES_INPUT: Final[tuple[str, ...]] = (
    "system",
    "messages",
    "tools",
    "tool_choice",
    "output_config",
)
_RESPONSES_INPUT: Final[tuple[str, ...]] = (
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)
_CHAT_INPUT: Final[tuple[str, ...]] = ("messages", "tools")
# Keys of a Responses request that only the gateway reads, never a counter.
_GATEWAY_ONLY: Final[tuple[str, ...]] = ("previous_response_id", "conversation", "store")
# Estimate: keys whose values are not text the model reads (ids, media, markers).
_NOT_TEXT: Final = frozenset(
    {
        "type",
        "role",
        "id",
        "call_id",
        "tool_call_id",
        "tool_use_id",
        "cache_control",
        "source",
        "image_url",
        "file",
        "file_id",
        "file_data",
        "data",
        "signature",
        "status",
        "detail",
    }
)


@dataclass(slots=True)
class CountQuery:
    """What a client asked to count, as it sent it: a Messages body (`wire` anthropic) or a
    Responses body (`wire` openai), without `model`. The shapes the other counters take are
    made from it on first use; each raises TranslationError naming what cannot be expressed."""

    wire: Wire
    body: dict[str, Any]
    size: int = 0  # bytes of the body as sent: large ones are translated off the event loop
    _chat: dict[str, Any] | None = field(default=None, init=False)

    def messages(self) -> dict[str, Any]:
        """The body for Anthropic's counter (a client's own Messages body passes untouched)."""
        if self.wire == "anthropic":
            return dict(self.body)
        translated = chat_request_to_anthropic(self._chat_full())
        return {k: translated[k] for k in _MESSAGES_INPUT if k in translated}

    def responses(self) -> dict[str, Any]:
        """The body for OpenAI's Responses counter (a client's own body passes untouched)."""
        if self.wire == "openai":
            return {k: v for k, v in self.body.items() if k not in _GATEWAY_ONLY}
        return chat_to_responses(self.chat())

    def chat(self) -> dict[str, Any]:
        """The chat form (`messages`, and `tools` when there are any), for vLLM-like counters."""
        chat = self._chat_full()
        return {k: chat[k] for k in _CHAT_INPUT if k in chat}

    def _chat_full(self) -> dict[str, Any]:
        if self._chat is None:
            if self.wire == "anthropic":
                subset = {k: self.body[k] for k in _MESSAGES_INPUT if k in self.body}
                self._chat = messages_request_to_openai(subset)
            else:
                subset = {k: self.body[k] for k in _RESPONSES_INPUT if k in self.body}
                self._chat = responses_request_to_chat(subset)
            self._chat.pop("model", None)
        return self._chat


# --- the counters --------------------------------------------------------------------------------


def simulated_counter(
    engine: Any, *, deployment: str, upstream_model: str, query: TokenQuery
) -> Counter:
    """The in-process simulator's counter: its engine's own tokenizer, the one its usage
    reports; a request it cannot take fails as its HTTP server would answer it."""

    async def simulated() -> int:
        try:
            tokens = await off_loop(query.size, _simulated_count, engine, upstream_model, query)
        except BadRequestError as exc:
            raise upstream_error(
                deployment=deployment,
                status=exc.status,
                detail=exc.message,
                headers={},
                param=exc.param,
            ) from None
        return counted(tokens, deployment)

    return simulated


def _simulated_count(engine: Any, upstream_model: str, query: TokenQuery) -> int:
    return int(engine.count_tokens({"model": upstream_model, **query.chat()}))


def counted(value: object, deployment: str) -> int:
    """A counter's answer as a token count; a `ProviderError` if it holds none."""
    tokens = count(value)
    if tokens is None:
        raise ProviderError(
            "the token counter answered without a count", deployment=deployment, kind="invalid"
        )
    return tokens


# --- the other wire ------------------------------------------------------------------------------


def chat_to_responses(chat: Mapping[str, Any]) -> dict[str, Any]:
    """Chat messages and function tools → a Responses body's `input` and `tools` (what an
    Anthropic client's request becomes for OpenAI's Responses counter)."""
    items: list[dict[str, Any]] = []
    for message in chat.get("messages") or ():
        role = message.get("role")
        if role == "tool":
            output = message.get("content")
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message.get("tool_call_id"),
                    "output": output if isinstance(output, str) else _joined(output),
                }
            )
            continue
        content = message.get("content")
        if content:
            items.append({"role": role, "content": _parts(content, role)})
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            items.append(
                {
                    "type": "function_call",
                    "call_id": call.get("id"),
                    "name": function.get("name"),
                    "arguments": function.get("arguments") or "",
                }
            )
    body: dict[str, Any] = {"input": items}
    tools = chat.get("tools")
    if tools:
        body["tools"] = [{"type": "function", **(t.get("function") or {})} for t in tools]
    return body


def _parts(content: object, role: object) -> object:
    if not isinstance(content, list):
        return content
    text_type = "output_text" if role == "assistant" else "input_text"
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": text_type, "text": part.get("text") or ""})
        elif kind == "image_url":
            image = part.get("image_url") or {}
            parts.append({"type": "input_image", "image_url": image.get("url"), "detail": "auto"})
        elif kind == "file":
            parts.append({"type": "input_file", **(part.get("file") or {})})
        else:
            raise TranslationError(f"content of type '{kind}' cannot be counted", param="messages")
    return parts


def _joined(content: object) -> str:
    if not isinstance(content, list):
        return ""
    return "".join(p.get("text") or "" for p in content if isinstance(p, dict))


# --- the estimate --------------------------------------------------------------------------------


def estimate_tokens(query: CountQuery) -> int:
    """About one token per CHARS_PER_TOKEN characters of the text the model reads: the
    messages (or input), the system prompt (or instructions) and the tool definitions. Media
    (images, files) are not counted. Never 0: a request always costs a token."""
    body = query.body
    if query.wire == "anthropic":
        chars = _chars(body.get("system")) + _chars(body.get("messages"))
    else:
        chars = _chars(body.get("instructions")) + _chars(body.get("input"))
    tools = body.get("tools")
    if tools:
        chars += len(orjson.dumps(tools))  # definitions are JSON schemas: every byte is read
    return max(1, math.ceil(chars / CHARS_PER_TOKEN))


def _chars(value: object) -> int:
    return sum(len(text) for text in _texts(value))


def _texts(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key in _NOT_TEXT:
                continue
            if key == "input" and isinstance(item, dict):  # a tool_use block's arguments
                yield orjson.dumps(item).decode()
            else:
                yield from _texts(item)
