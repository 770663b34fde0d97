"""Anthropic Messages <-> AWS Bedrock Converse, both ways. Pure: no I/O, no botocore.

The Bedrock provider presents the Messages wire to the rest of the gateway: a Messages request
body is rewritten here into a Converse body, and Converse's answer (a JSON body, or the events of
ConverseStream) is rewritten into the Messages body or Messages SSE events, so the commit point,
the pre-commit bounds, the idle timeout and usage accounting see what an Anthropic upstream sends.

What has no Converse form is dropped (`metadata`, `service_tier`, `container`, `mcp_servers`,
`disable_parallel_tool_use`, a cache point's `ttl`, citations); what cannot be sent at all (an
image or document by URL) raises `TranslationError` naming the field.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any, Final

import orjson

from gateway.numbers import count
from gateway.providers.translate import TranslationError

_IMAGE_FORMATS: Final = {
    "image/png": "png",
    "image/jpeg": "jpeg",
    "image/gif": "gif",
    "image/webp": "webp",
}
_DOCUMENT_FORMATS: Final = {
    "application/pdf": "pdf",
    "text/plain": "txt",
    "text/csv": "csv",
    "text/html": "html",
    "text/markdown": "md",
}
_CACHE_POINT: Final[dict[str, Any]] = {"cachePoint": {"type": "default"}}

# Converse stop reasons -> Messages stop reasons (a guardrail or content filter is a refusal).
STOP_REASONS: Final = {
    "end_turn": "end_turn",
    "tool_use": "tool_use",
    "max_tokens": "max_tokens",
    "stop_sequence": "stop_sequence",
    "guardrail_intervened": "refusal",
    "content_filtered": "refusal",
    "model_context_window_exceeded": "model_context_window_exceeded",
}

# Keys of `additionalModelRequestFields` taken from the Messages body as they are (Claude on
# Bedrock reads them there; other model families ignore or refuse them).
_PASSED_FIELDS: Final = ("top_k", "thinking", "output_config", "context_management")


# --- requests ------------------------------------------------------------------------------------


def messages_to_converse(
    body: dict[str, Any], *, latency: str | None = None, betas: list[str] | None = None
) -> dict[str, Any]:
    """A Converse request body for a Messages request body (its `model` and `stream` are in the
    URL instead). `latency`: `performanceConfig.latency`; `betas`: `anthropic-beta` values."""
    out: dict[str, Any] = {"messages": _messages(body.get("messages"))}
    system = _system(body.get("system"))
    if system:
        out["system"] = system
    inference: dict[str, Any] = {}
    for source, target in (
        ("max_tokens", "maxTokens"),
        ("temperature", "temperature"),
        ("top_p", "topP"),
        ("stop_sequences", "stopSequences"),
    ):
        if body.get(source) is not None:
            inference[target] = body[source]
    if inference:
        out["inferenceConfig"] = inference
    tools = _tool_config(body.get("tools"), body.get("tool_choice"))
    if tools is not None and not (_choice_none(body) and not _uses_tools(out["messages"])):
        out["toolConfig"] = tools
    extra = {key: body[key] for key in _PASSED_FIELDS if body.get(key) is not None}
    if betas:
        extra["anthropic_beta"] = betas
    if extra:
        out["additionalModelRequestFields"] = extra
    if latency is not None:
        out["performanceConfig"] = {"latency": latency}
    return out


def _system(system: object) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"text": system}] if system else []
    if not isinstance(system, list):
        raise TranslationError("system must be a string or a list of text blocks", param="system")
    out: list[dict[str, Any]] = []
    for block in system:
        if not isinstance(block, dict) or block.get("type") != "text":
            raise TranslationError("system blocks must be text blocks", param="system")
        if block.get("text"):
            out.append({"text": block["text"]})
        if block.get("cache_control"):
            out.append(_CACHE_POINT)
    return out


def _messages(messages: object) -> list[dict[str, Any]]:
    """Converse wants turns that alternate: consecutive turns of one role are merged."""
    if not isinstance(messages, list):
        raise TranslationError("messages must be a list", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise TranslationError("each message needs role user or assistant", param="messages")
        content = list(_content(message.get("content"), f"messages[{i}].content"))
        if out and out[-1]["role"] == message["role"]:
            out[-1]["content"].extend(content)
        else:
            out.append({"role": message["role"], "content": content})
    return out


def _content(content: object, param: str) -> Iterator[dict[str, Any]]:
    if isinstance(content, str):
        if content:
            yield {"text": content}
        return
    if not isinstance(content, list):
        raise TranslationError("content must be a string or a list of blocks", param=param)
    for block in content:
        if not isinstance(block, dict):
            raise TranslationError("content blocks must be objects", param=param)
        converted = _block(block, param)
        if converted is not None:
            yield converted
        if block.get("cache_control") or _nested_cache_control(block):
            yield _CACHE_POINT


def _nested_cache_control(block: dict[str, Any]) -> bool:
    """A tool result's own blocks may carry the mark; Converse's point goes after the result."""
    nested = block.get("content") if block.get("type") == "tool_result" else None
    return isinstance(nested, list) and any(
        isinstance(part, dict) and part.get("cache_control") for part in nested
    )


def _block(block: dict[str, Any], param: str) -> dict[str, Any] | None:
    kind = block.get("type")
    if kind == "text":
        return {"text": block["text"]} if block.get("text") else None
    if kind == "image":
        return {"image": _image(block.get("source"), param)}
    if kind == "document":
        return {"document": _document(block, param)}
    if kind == "tool_use":
        return {
            "toolUse": {
                "toolUseId": block.get("id"),
                "name": block.get("name"),
                "input": block.get("input") if block.get("input") is not None else {},
            }
        }
    if kind == "tool_result":
        result: dict[str, Any] = {
            "toolUseId": block.get("tool_use_id"),
            "content": _tool_result_content(block.get("content"), param),
        }
        if block.get("is_error"):
            result["status"] = "error"
        return {"toolResult": result}
    if kind == "thinking":
        text: dict[str, Any] = {"text": block.get("thinking") or ""}
        if block.get("signature"):
            text["signature"] = block["signature"]
        return {"reasoningContent": {"reasoningText": text}}
    if kind == "redacted_thinking":
        return {"reasoningContent": {"redactedContent": block.get("data") or ""}}
    raise TranslationError(f"content of type {kind!r} cannot be sent to Bedrock", param=param)


def _image(source: object, param: str) -> dict[str, Any]:
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise TranslationError("Bedrock takes images as base64 data, not by URL", param=param)
    media = source.get("media_type")
    if media not in _IMAGE_FORMATS:
        raise TranslationError(f"image type {media!r} is not one Bedrock takes", param=param)
    return {"format": _IMAGE_FORMATS[media], "source": {"bytes": source.get("data")}}


def _document(block: dict[str, Any], param: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") not in ("base64", "text"):
        raise TranslationError("Bedrock takes documents as base64 data or text", param=param)
    media = source.get("media_type")
    if media not in _DOCUMENT_FORMATS:
        raise TranslationError(f"document type {media!r} is not one Bedrock takes", param=param)
    data = source.get("data") or ""
    if source["type"] == "text":  # Converse wants the bytes, base64-encoded in its JSON
        data = base64.b64encode(str(data).encode()).decode()
    # Converse requires a name (letters, digits, spaces, hyphens, brackets).
    name = "".join(c for c in str(block.get("title") or "document") if c.isalnum() or c in " -")
    return {
        "format": _DOCUMENT_FORMATS[media],
        "name": name.strip() or "document",
        "source": {"bytes": data},
    }


def _tool_result_content(content: object, param: str) -> list[dict[str, Any]]:
    if content is None or content == "":
        return [{"text": ""}]
    if isinstance(content, str):
        return [{"text": content}]
    if not isinstance(content, list):
        raise TranslationError("tool_result content must be a string or a list", param=param)
    out: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            out.append({"text": block["text"]})
        elif kind == "image":
            out.append({"image": _image(block.get("source"), param)})
        elif kind == "document":
            out.append({"document": _document(block, param)})
        else:
            raise TranslationError(f"tool_result content of type {kind!r}", param=param)
    return out or [{"text": ""}]


def _tool_config(tools: object, choice: object) -> dict[str, Any] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise TranslationError("tools must be a list", param="tools")
    specs: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict) or "input_schema" not in tool:
            # Anthropic's server tools (web search, code execution) have no Converse form.
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise TranslationError(f"tool of type {kind!r} cannot run on Bedrock", param="tools")
        spec: dict[str, Any] = {
            "name": tool.get("name"),
            "inputSchema": {"json": tool["input_schema"]},
        }
        if tool.get("description"):
            spec["description"] = tool["description"]
        specs.append({"toolSpec": spec})
        if tool.get("cache_control"):
            specs.append(_CACHE_POINT)
    config: dict[str, Any] = {"tools": specs}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "any"):
        config["toolChoice"] = {kind: {}}
    elif kind == "tool" and isinstance(choice, dict):
        config["toolChoice"] = {"tool": {"name": choice.get("name")}}
    # `none` has no Converse form: the tools are left out, unless earlier turns used them
    # (Converse then requires them declared, and the model may call one).
    return config


def _choice_none(body: dict[str, Any]) -> bool:
    choice = body.get("tool_choice")
    return isinstance(choice, dict) and choice.get("type") == "none"


def _uses_tools(messages: list[dict[str, Any]]) -> bool:
    return any(
        "toolUse" in block or "toolResult" in block
        for message in messages
        for block in message["content"]
    )


# --- responses -----------------------------------------------------------------------------------


def stop_reason(value: object) -> str:
    return STOP_REASONS.get(value, "end_turn") if isinstance(value, str) else "end_turn"


def usage_of(usage: object) -> dict[str, int]:
    """Messages usage from Converse usage (both count cache reads and writes apart)."""
    fields = usage if isinstance(usage, dict) else {}
    out = {
        "input_tokens": count(fields.get("inputTokens")) or 0,
        "output_tokens": count(fields.get("outputTokens")) or 0,
    }
    read = count(fields.get("cacheReadInputTokens"))
    write = count(fields.get("cacheWriteInputTokens"))
    if read is not None:
        out["cache_read_input_tokens"] = read
    if write is not None:
        out["cache_creation_input_tokens"] = write
    return out


def latency_ms(metrics: object) -> int | None:
    return count(metrics.get("latencyMs")) if isinstance(metrics, dict) else None


def converse_to_message(answer: dict[str, Any], *, model: str, message_id: str) -> dict[str, Any]:
    """A Messages response body for a Converse response body."""
    output = answer.get("output")
    message = output.get("message") if isinstance(output, dict) else None
    blocks = message.get("content") if isinstance(message, dict) else None
    if not isinstance(blocks, list):
        raise ValueError("no output.message.content in the Converse answer")
    content = [c for c in (_answer_block(block) for block in blocks) if c is not None]
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(answer.get("stopReason")),
        "stop_sequence": _stop_sequence(answer),
        "usage": usage_of(answer.get("usage")),
    }


def _stop_sequence(answer: dict[str, Any]) -> str | None:
    fields = answer.get("additionalModelResponseFields")
    found = fields.get("stop_sequence") if isinstance(fields, dict) else None
    return found if isinstance(found, str) else None


def _answer_block(block: object) -> dict[str, Any] | None:
    if not isinstance(block, dict):
        return None
    if "text" in block:
        return {"type": "text", "text": block["text"]}
    if "toolUse" in block:
        use = block["toolUse"]
        return {
            "type": "tool_use",
            "id": use.get("toolUseId"),
            "name": use.get("name"),
            "input": use.get("input") if isinstance(use.get("input"), dict) else {},
        }
    if "reasoningContent" in block:
        reasoning = block["reasoningContent"]
        if "redactedContent" in reasoning:
            return {"type": "redacted_thinking", "data": reasoning["redactedContent"]}
        text = reasoning.get("reasoningText") or {}
        return {
            "type": "thinking",
            "thinking": text.get("text") or "",
            "signature": text.get("signature") or "",
        }
    return None  # citations, guardrail traces, images: no Messages block carries them back


# --- streams -------------------------------------------------------------------------------------

_EXCEPTION_TYPES: Final = {
    "throttlingException": "rate_limit_error",
    "serviceQuotaExceededException": "rate_limit_error",
    "serviceUnavailableException": "overloaded_error",
    "modelNotReadyException": "overloaded_error",
    "validationException": "invalid_request_error",
    "modelTimeoutException": "timeout_error",
    "accessDeniedException": "permission_error",
}


def sse(kind: str, obj: dict[str, Any]) -> tuple[bytes, bytes]:
    """An SSE frame and its data line's JSON."""
    data = orjson.dumps(obj)
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n", data


class ConverseStreamTranslator:
    """ConverseStream events in, Messages SSE events out (as `(event, frame, data)` triples).

    Converse sends no start for a text or reasoning block (its first delta opens it) and its
    usage after the stop reason (`messageStop`, then `metadata`): `message_delta` waits for the
    usage, and `finish()` sends what is still owed when the stream ends without it.
    """

    def __init__(self, *, model: str, message_id: str) -> None:
        self._model = model
        self._id = message_id
        self._open: dict[int, int] = {}  # Converse block index -> Messages index, while open
        self._next = 0
        self._started = False
        self._stop: str | None = None
        self._stop_sequence: str | None = None
        self._finished = False
        self.latency_ms: int | None = None

    def event(self, kind: str, payload: dict[str, Any]) -> list[tuple[str, bytes, bytes]]:
        out: list[tuple[str, bytes, bytes]] = []
        if not self._started and kind != "metadata":
            out.append(self._message_start())
        if kind == "contentBlockStart":
            start = payload.get("start") or {}
            use = start.get("toolUse")
            if isinstance(use, dict):
                block = {"type": "tool_use", "id": use.get("toolUseId"), "name": use.get("name")}
                out.append(self._open_block(payload, {**block, "input": {}}))
        elif kind == "contentBlockDelta":
            out.extend(self._delta(payload))
        elif kind == "contentBlockStop":
            index = self._open.pop(_index(payload), None)
            if index is not None:
                out.append(("content_block_stop", *sse("content_block_stop", _stop_obj(index))))
        elif kind == "messageStop":
            self._stop = stop_reason(payload.get("stopReason"))
            self._stop_sequence = _stop_sequence(payload)
        elif kind == "metadata":
            self.latency_ms = latency_ms(payload.get("metrics"))
            if not self._started:
                out.append(self._message_start())
            out.extend(self._finish(usage_of(payload.get("usage"))))
        return out

    def finish(self) -> list[tuple[str, bytes, bytes]]:
        """What ends the stream when it ended after `messageStop` but without `metadata`."""
        if self._stop is None or self._finished:
            return []
        return self._finish(None)

    @property
    def complete(self) -> bool:
        return self._finished

    def _message_start(self) -> tuple[str, bytes, bytes]:
        self._started = True
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return (
            "message_start",
            *sse("message_start", {"type": "message_start", "message": message}),
        )

    def _open_block(
        self, payload: dict[str, Any], block: dict[str, Any]
    ) -> tuple[str, bytes, bytes]:
        index = self._open[_index(payload)] = self._next
        self._next += 1
        obj = {"type": "content_block_start", "index": index, "content_block": block}
        return ("content_block_start", *sse("content_block_start", obj))

    def _delta(self, payload: dict[str, Any]) -> list[tuple[str, bytes, bytes]]:
        out: list[tuple[str, bytes, bytes]] = []
        delta = payload.get("delta") or {}
        key = _index(payload)
        reasoning = delta.get("reasoningContent")
        if "text" in delta:
            if key not in self._open:
                out.append(self._open_block(payload, {"type": "text", "text": ""}))
            inner: dict[str, Any] = {"type": "text_delta", "text": delta["text"]}
        elif isinstance(delta.get("toolUse"), dict):
            if key not in self._open:  # a tool use always starts; be lenient anyway
                out.append(self._open_block(payload, {"type": "tool_use", "input": {}}))
            inner = {"type": "input_json_delta", "partial_json": delta["toolUse"].get("input", "")}
        elif isinstance(reasoning, dict):
            if "redactedContent" in reasoning:
                if key not in self._open:
                    block = {"type": "redacted_thinking", "data": reasoning["redactedContent"]}
                    out.append(self._open_block(payload, block))
                return out
            if key not in self._open:
                block = {"type": "thinking", "thinking": "", "signature": ""}
                out.append(self._open_block(payload, block))
            if "signature" in reasoning:
                inner = {"type": "signature_delta", "signature": reasoning["signature"]}
            else:
                inner = {"type": "thinking_delta", "thinking": reasoning.get("text", "")}
        else:
            return out  # citations and future deltas: nothing in Messages to carry them
        obj = {"type": "content_block_delta", "index": self._open[key], "delta": inner}
        out.append(("content_block_delta", *sse("content_block_delta", obj)))
        return out

    def _finish(self, usage: dict[str, int] | None) -> list[tuple[str, bytes, bytes]]:
        if self._finished:
            return []
        self._finished = True
        out = [
            ("content_block_stop", *sse("content_block_stop", _stop_obj(index)))
            for index in sorted(self._open.values())
        ]
        self._open.clear()
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": self._stop or "end_turn",
                "stop_sequence": self._stop_sequence,
            },
            "usage": usage or {"output_tokens": 0},
        }
        out.append(("message_delta", *sse("message_delta", delta)))
        out.append(("message_stop", *sse("message_stop", {"type": "message_stop"})))
        return out


def exception_event(exception_type: str, message: str) -> tuple[str, bytes, bytes]:
    """A Messages `error` event for an exception inside ConverseStream (`message` scrubbed)."""
    kind = _EXCEPTION_TYPES.get(exception_type, "api_error")
    obj = {"type": "error", "error": {"type": kind, "message": f"{exception_type}: {message}"}}
    return ("error", *sse("error", obj))


def _index(payload: dict[str, Any]) -> int:
    index = payload.get("contentBlockIndex")
    return index if isinstance(index, int) else 0


def _stop_obj(index: int) -> dict[str, Any]:
    return {"type": "content_block_stop", "index": index}
