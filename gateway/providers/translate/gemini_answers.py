"""Gemini answers → the OpenAI chat wire: whole responses and streams, as the client-facing bytes
an OpenAI-compatible server would send. Pure: no I/O.

What maps, per candidate (one chat choice each, by `index`):

- `text` parts → `content`; `thought: true` parts → `reasoning_content`; `functionCall` parts →
  `tool_calls` (arguments as JSON text; the call's id and `thoughtSignature` packed into the
  tool-call id, see `translate.gemini.call_id`).
- `finishReason`: STOP → `stop` (`tool_calls` when it called a function), MAX_TOKENS → `length`,
  SAFETY, RECITATION, BLOCKLIST, PROHIBITED_CONTENT, SPII, IMAGE_SAFETY, LANGUAGE →
  `content_filter`, anything else → `stop`. A prompt blocked outright (`promptFeedback.blockReason`,
  no candidates) is one choice with no content and `content_filter`.
- `usageMetadata`: `promptTokenCount` (+ `toolUsePromptTokenCount`) → `prompt_tokens`,
  `candidatesTokenCount` + `thoughtsTokenCount` → `completion_tokens`,
  `cachedContentTokenCount` → `prompt_tokens_details.cached_tokens`, `thoughtsTokenCount` →
  `completion_tokens_details.reasoning_tokens`.
- `responseId` → the id (`chatcmpl-` prefixed), `modelVersion` → `model`.

Dropped: `safetyRatings`, `citationMetadata`, `groundingMetadata`, `avgLogprobs`/`logprobsResult`,
`urlContextMetadata`, the thought signature of a text part, and parts chat has no place for
(`inlineData` output, `executableCode`, `codeExecutionResult`, `fileData`).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Final

import orjson

from gateway.numbers import count
from gateway.providers.translate.gemini import call_id
from gateway.sse import frame

_FILTERED: Final = frozenset(
    {
        "SAFETY",
        "RECITATION",
        "BLOCKLIST",
        "PROHIBITED_CONTENT",
        "SPII",
        "IMAGE_SAFETY",
        "LANGUAGE",
    }
)
_DONE: Final = b"data: [DONE]\n\n"


def finish_reason(reason: object, called: bool) -> str:
    if reason == "MAX_TOKENS":
        return "length"
    if reason in _FILTERED:
        return "content_filter"
    return "tool_calls" if called else "stop"


def chat_usage(meta: object) -> dict[str, Any]:
    """`usageMetadata` → a chat `usage` object."""
    meta = meta if isinstance(meta, dict) else {}
    prompt = (count(meta.get("promptTokenCount")) or 0) + (
        count(meta.get("toolUsePromptTokenCount")) or 0
    )
    thoughts = count(meta.get("thoughtsTokenCount")) or 0
    completion = (count(meta.get("candidatesTokenCount")) or 0) + thoughts
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": count(meta.get("cachedContentTokenCount")) or 0},
        "completion_tokens_details": {"reasoning_tokens": thoughts},
    }


def _new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _chat_id(data: dict[str, Any]) -> str:
    response_id = data.get("responseId")
    if isinstance(response_id, str) and response_id:
        return "chatcmpl-" + response_id
    return "chatcmpl-" + secrets.token_hex(12)


def _tool_call(part: dict[str, Any], function: dict[str, Any], index: int) -> dict[str, Any]:
    gemini_id = function.get("id")
    signature = part.get("thoughtSignature")
    return {
        "index": index,
        "id": call_id(
            gemini_id if isinstance(gemini_id, str) else None,
            signature if isinstance(signature, str) else None,
            _new_call_id(),
        ),
        "type": "function",
        "function": {
            "name": str(function.get("name") or ""),
            "arguments": orjson.dumps(function.get("args") or {}).decode(),
        },
    }


def _parts(candidate: dict[str, Any]) -> list[dict[str, Any]]:
    content = candidate.get("content")
    parts = content.get("parts") if isinstance(content, dict) else None
    return [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []


def gemini_response_to_chat(data: dict[str, Any], *, model: str) -> dict[str, Any]:
    """A whole `GenerateContentResponse` → a `chat.completion` object."""
    choices = []
    for position, candidate in enumerate(c for c in data.get("candidates") or () if c):
        index = candidate.get("index", position)
        text: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        for part in _parts(candidate):
            if isinstance(function := part.get("functionCall"), dict):
                calls.append(_tool_call(part, function, len(calls)))
            elif isinstance(value := part.get("text"), str):
                (thoughts if part.get("thought") else text).append(value)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(text) if text or not calls else None,
            "refusal": None,
        }
        if thoughts:
            message["reasoning_content"] = "".join(thoughts)
        if calls:
            for call in calls:
                del call["index"]
            message["tool_calls"] = calls
        reason = finish_reason(candidate.get("finishReason"), bool(calls))
        if reason == "content_filter" and not text:
            message["content"] = None
        choices.append(
            {"index": index, "message": message, "logprobs": None, "finish_reason": reason}
        )
    if not choices:  # the prompt itself was blocked (promptFeedback.blockReason)
        message = {"role": "assistant", "content": None, "refusal": None}
        choices.append(
            {"index": 0, "message": message, "logprobs": None, "finish_reason": "content_filter"}
        )
    return {
        "id": _chat_id(data),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": data.get("modelVersion") or model,
        "choices": choices,
        "usage": chat_usage(data.get("usageMetadata")),
    }


class GeminiToChatStream:
    """`streamGenerateContent?alt=sse` events → `chat.completion.chunk` SSE frames.

    Each event's parts become deltas as they arrive (a function call arrives whole: one delta
    with its name and all its arguments); a candidate's `finishReason` becomes its finish
    chunk. `end()` (the upstream's stream is over) adds the usage chunk (with `include_usage`)
    and `[DONE]`, but only when every candidate finished: a stream cut short stays unfinished.
    """

    __slots__ = (
        "_called",
        "_finished",
        "_head",
        "_include_usage",
        "_model",
        "_started",
        "_tail",
        "_usage",
        "_usage_null",
        "blocked",
    )

    def __init__(self, *, model: str, include_usage: bool) -> None:
        self._model = model
        self._include_usage = include_usage
        self._usage_null = b',"usage":null' if include_usage else b""
        self._tail = b',"logprobs":null,"finish_reason":null}]' + self._usage_null + b"}\n\n"
        self._head = b""
        self._started: set[int] = set()
        self._finished: set[int] = set()
        self._called: dict[int, int] = {}  # candidate index → tool calls so far
        self._usage: object = None
        self.blocked = False

    def _begin(self, data: dict[str, Any]) -> None:
        common = orjson.dumps(
            {
                "id": _chat_id(data),
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": data.get("modelVersion") or self._model,
            }
        )
        self._head = b"data: " + common[:-1] + b',"choices":[{"index":'

    def _delta(self, index: int, delta: bytes) -> bytes:
        return self._head + b"%d" % index + b',"delta":' + delta + self._tail

    def _finish(self, index: int, reason: str) -> bytes:
        return (
            self._head
            + b'%d,"delta":{},"logprobs":null,"finish_reason":"%b"}]' % (index, reason.encode())
            + self._usage_null
            + b"}\n\n"
        )

    def feed(self, data: dict[str, Any]) -> bytes:
        """One upstream event's chunks."""
        if not self._head:
            self._begin(data)
        if data.get("usageMetadata") is not None:
            self._usage = data["usageMetadata"]
        out = b""
        candidates = [c for c in data.get("candidates") or () if isinstance(c, dict)]
        for position, candidate in enumerate(candidates):
            index = candidate.get("index", position)
            index = index if type(index) is int and 0 <= index < 128 else position
            if index not in self._started:
                self._started.add(index)
                out += self._delta(index, b'{"role":"assistant","content":""}')
            for part in _parts(candidate):
                out += self._part(index, part)
            reason = candidate.get("finishReason")
            if reason:
                self._finished.add(index)
                out += self._finish(index, finish_reason(reason, index in self._called))
        feedback = data.get("promptFeedback")
        if not candidates and isinstance(feedback, dict) and feedback.get("blockReason"):
            self.blocked = True
            if 0 not in self._started:
                self._started.add(0)
                out += self._delta(0, b'{"role":"assistant","content":""}')
            self._finished.add(0)
            out += self._finish(0, "content_filter")
        return out

    def _part(self, index: int, part: dict[str, Any]) -> bytes:
        function = part.get("functionCall")
        if isinstance(function, dict):
            position = self._called.get(index, 0)
            self._called[index] = position + 1
            call = orjson.dumps({"tool_calls": [_tool_call(part, function, position)]})
            return self._delta(index, call)
        text = part.get("text")
        if not isinstance(text, str) or not text:
            return b""
        key = b'{"reasoning_content":' if part.get("thought") else b'{"content":'
        return self._delta(index, key + orjson.dumps(text) + b"}")

    @property
    def complete(self) -> bool:
        return bool(self._finished) and self._finished >= self._started

    def end(self) -> bytes:
        """The frames after the upstream's last event: usage and `[DONE]` once complete."""
        if not self.complete:
            return b""
        if not self._include_usage:
            return _DONE
        head = self._head.removeprefix(b"data: ").split(b',"choices"', 1)[0]
        usage = orjson.dumps(chat_usage(self._usage))
        return frame(head + b',"choices":[],"usage":' + usage + b"}") + _DONE
