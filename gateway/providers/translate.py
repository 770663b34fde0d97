"""Translate between the OpenAI chat wire and the Anthropic Messages wire. Pure: no I/O.

Requests are translated as dicts (the caller sets the upstream model afterwards). Responses are
translated from the parsed upstream body to the client's JSON bytes. Streams go through one
stateful translator per response: the attempt loop feeds it every decoded `Chunk` and forwards the
bytes it returns. The translators reuse `Chunk.data` (parsed once by the decoder) and splice
pre-built constant bytes around each delta, so the per-event cost is one small `orjson.dumps`.

What one wire cannot express raises `TranslationError` naming the field; hints that only steer
sampling on one side (penalties, seeds, `reasoning_effort`, `thinking`, `top_k` towards OpenAI)
are dropped rather than refused, so a fallback across wires keeps working.
"""

from __future__ import annotations

import base64
import re
import time
import uuid
from typing import Any, Final, Protocol

import orjson

from gateway.models import Chunk, InBandError
from gateway.providers.decode import ANTHROPIC_ERROR_STATUS
from gateway.sse import frame

DEFAULT_MAX_TOKENS: Final = 4096
"""Anthropic requires `max_tokens`; used when an OpenAI request does not set one."""


class TranslationError(ValueError):
    """A request or response that the other wire format cannot express; `param` names the field."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class StreamTranslator(Protocol):
    """Rewrites one response's stream into the client's wire format, one chunk at a time."""

    def feed(self, chunk: Chunk) -> bytes:
        """The bytes to send the client for this chunk; b"" when there is nothing to send."""
        ...


# --- shared vocabulary ---------------------------------------------------------------------------

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
_ANTHROPIC_ERROR_TYPES: Final[dict[int, str]] = {
    status: kind for kind, status in ANTHROPIC_ERROR_STATUS.items()
} | {408: "timeout_error", 422: "invalid_request_error", 503: "overloaded_error"}
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


def _dict(value: object, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TranslationError(f"'{param}' must be an object", param=param)
    return value


def _list(value: object, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise TranslationError(f"'{param}' must be an array", param=param)
    return value


def _str(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise TranslationError(f"'{param}' must be a string", param=param)
    return value


def _parse_data_url(url: str, param: str) -> tuple[str, str]:
    """`data:<media type>;base64,<data>` → (media type, base64 data)."""
    header, comma, data = url[5:].partition(",")
    media_type, _, encoding = header.partition(";")
    if not comma or encoding != "base64" or not media_type:
        raise TranslationError(f"'{param}' must be a base64 data URL", param=param)
    return media_type, data


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


# --- requests: OpenAI chat → Anthropic Messages ---------------------------------------------------

# Inputs that change what comes back in a way Messages cannot express.
_OPENAI_UNTRANSLATABLE: Final = ("functions", "function_call", "audio", "web_search_options")


def chat_request_to_anthropic(body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat completions request body → an Anthropic Messages request body.

    Raises TranslationError for what Messages cannot express (`n` > 1, logprobs, audio, legacy
    functions, `response_format: json_object`, non-function tools, ...).
    """
    n = body.get("n")
    if n is not None and n != 1:
        raise TranslationError("Anthropic models return one choice: 'n' must be 1", param="n")
    for key in _OPENAI_UNTRANSLATABLE:
        if body.get(key) is not None:
            raise TranslationError(f"'{key}' cannot be sent to an Anthropic model", param=key)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise TranslationError("Anthropic models do not return logprobs", param="logprobs")
    if "audio" in (body.get("modalities") or ()):
        raise TranslationError("Anthropic models do not produce audio", param="modalities")

    out: dict[str, Any] = {}
    if "model" in body:
        out["model"] = body["model"]
    system, messages = _messages_to_anthropic(_list(body.get("messages"), "messages"))
    if system:
        out["system"] = system
    out["messages"] = messages
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    out["max_tokens"] = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    temperature = body.get("temperature")
    if temperature is not None:
        # OpenAI allows 0-2, Anthropic 0-1: clamp rather than fail a fallback over a sampling hint.
        if isinstance(temperature, int | float) and temperature > 1:
            temperature = 1.0
        out["temperature"] = temperature
    for key in ("top_p", "top_k"):  # top_k: the vLLM extension, which Anthropic also has
        if body.get(key) is not None:
            out[key] = body[key]
    stop = body.get("stop")
    if stop is not None:
        out["stop_sequences"] = [stop] if isinstance(stop, str) else list(_list(stop, "stop"))
    if body.get("stream") is not None:
        out["stream"] = bool(body["stream"])
    user = body.get("user")
    if user is not None:
        out["metadata"] = {"user_id": _str(user, "user")}
    tools = body.get("tools")
    if tools:
        out["tools"] = [_tool_to_anthropic(tool, i) for i, tool in enumerate(_list(tools, "tools"))]
    tool_choice = _tool_choice_to_anthropic(body.get("tool_choice"))
    if tools and body.get("parallel_tool_calls") is False:
        tool_choice = tool_choice or {"type": "auto"}
        if tool_choice["type"] != "none":
            tool_choice["disable_parallel_tool_use"] = True
    if tool_choice is not None:
        out["tool_choice"] = tool_choice
    output_format = _response_format_to_anthropic(body.get("response_format"))
    if output_format is not None:
        out["output_config"] = {"format": output_format}
    return out


def _openai_text(content: object, param: str) -> str:
    """A system/developer message's content (a string or text parts) → one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(_list(content, param)):
        part = _dict(part, f"{param}[{j}]")
        if part.get("type") != "text":
            raise TranslationError(
                f"'{param}[{j}]' must be a text part", param=f"{param}[{j}].type"
            )
        texts.append(_str(part.get("text"), f"{param}[{j}].text"))
    return "\n\n".join(texts)


def _messages_to_anthropic(messages: list[Any]) -> tuple[str, list[dict[str, Any]]]:
    system: list[str] = []
    out: list[dict[str, Any]] = []
    tool_turn: list[dict[str, Any]] | None = None  # the user turn that collects tool results
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        message = _dict(message, where)
        role = message.get("role")
        if role == "tool":
            call_id = _str(message.get("tool_call_id"), f"{where}.tool_call_id")
            result: dict[str, Any] = {"type": "tool_result", "tool_use_id": _tool_id(call_id)}
            content = message.get("content")
            if content is not None:
                result["content"] = _tool_result_to_anthropic(content, f"{where}.content")
            if tool_turn is None:
                tool_turn = []
                out.append({"role": "user", "content": tool_turn})
            tool_turn.append(result)  # consecutive results answer one assistant turn together
            continue
        tool_turn = None
        if role in ("system", "developer"):
            text = _openai_text(message.get("content"), f"{where}.content")
            if text:
                system.append(text)
        elif role == "user":
            out.append({"role": "user", "content": _user_to_anthropic(message, where)})
        elif role == "assistant":
            blocks = _assistant_to_anthropic(message, where)
            if blocks:  # Anthropic refuses empty turns; adjacent same-role turns it merges itself
                out.append({"role": "assistant", "content": blocks})
        else:
            raise TranslationError(
                f"'{where}.role' {role!r} cannot be sent to an Anthropic model",
                param=f"{where}.role",
            )
    return "\n\n".join(system), out


def _user_to_anthropic(message: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return content
    blocks: list[dict[str, Any]] = []
    for j, part in enumerate(_list(content, f"{where}.content")):
        param = f"{where}.content[{j}]"
        part = _dict(part, param)
        kind = part.get("type")
        if kind == "text":
            blocks.append({"type": "text", "text": _str(part.get("text"), f"{param}.text")})
        elif kind == "image_url":
            blocks.append(_image_to_anthropic(part.get("image_url"), f"{param}.image_url"))
        elif kind == "file":
            blocks.append(_file_to_anthropic(_dict(part.get("file"), f"{param}.file"), param))
        else:
            raise TranslationError(
                f"'{param}' of type {kind!r} cannot be sent to an Anthropic model",
                param=f"{param}.type",
            )
    return blocks


def _image_to_anthropic(image: object, param: str) -> dict[str, Any]:
    url = image.get("url") if isinstance(image, dict) else image
    url = _str(url, f"{param}.url")
    if url.startswith("data:"):
        media_type, data = _parse_data_url(url, f"{param}.url")
        source = {"type": "base64", "media_type": media_type, "data": data}
    elif url.startswith(("https://", "http://")):
        source = {"type": "url", "url": url}
    else:
        raise TranslationError(f"'{param}.url' must be a data or http(s) URL", param=f"{param}.url")
    return {"type": "image", "source": source}


def _file_to_anthropic(file: dict[str, Any], param: str) -> dict[str, Any]:
    file_data = file.get("file_data")
    if not isinstance(file_data, str) or not file_data.startswith("data:"):
        raise TranslationError(
            f"'{param}.file' must carry file_data as a data URL (file ids are OpenAI's own)",
            param=f"{param}.file.file_data",
        )
    media_type, data = _parse_data_url(file_data, f"{param}.file.file_data")
    block: dict[str, Any] = {"type": "document"}
    if media_type == "application/pdf":
        block["source"] = {"type": "base64", "media_type": media_type, "data": data}
    elif media_type == "text/plain":
        try:
            text = base64.b64decode(data, validate=True).decode("utf-8", "replace")
        except ValueError:
            raise TranslationError(
                f"'{param}.file.file_data' is not valid base64", param=f"{param}.file.file_data"
            ) from None
        block["source"] = {"type": "text", "media_type": media_type, "data": text}
    else:
        raise TranslationError(
            f"'{param}.file' of type {media_type!r} cannot be sent to an Anthropic model",
            param=f"{param}.file.file_data",
        )
    filename = file.get("filename")
    if isinstance(filename, str) and filename:
        block["title"] = filename
    return block


def _tool_result_to_anthropic(content: object, param: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    blocks = []
    for j, part in enumerate(_list(content, param)):
        part = _dict(part, f"{param}[{j}]")
        if part.get("type") != "text":
            raise TranslationError(
                f"'{param}[{j}]' must be a text part", param=f"{param}[{j}].type"
            )
        blocks.append({"type": "text", "text": _str(part.get("text"), f"{param}[{j}].text")})
    return blocks


def _assistant_to_anthropic(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    content = message.get("content")
    if isinstance(content, str):
        if content:
            blocks.append({"type": "text", "text": content})
    elif content is not None:
        for j, part in enumerate(_list(content, f"{where}.content")):
            param = f"{where}.content[{j}]"
            part = _dict(part, param)
            kind = part.get("type")
            text = part.get("text") if kind == "text" else part.get("refusal")
            if kind not in ("text", "refusal"):
                raise TranslationError(f"'{param}' must be a text part", param=f"{param}.type")
            if _str(text, f"{param}.{kind}"):
                blocks.append({"type": "text", "text": text})
    tool_calls = message.get("tool_calls")
    for j, call in enumerate(_list(tool_calls, f"{where}.tool_calls") if tool_calls else ()):
        param = f"{where}.tool_calls[{j}]"
        call = _dict(call, param)
        function = _dict(call.get("function"), f"{param}.function")
        tool_input = _arguments(function.get("arguments"))
        if tool_input is None:
            raise TranslationError(
                f"'{param}.function.arguments' must be a JSON object",
                param=f"{param}.function.arguments",
            )
        blocks.append(
            {
                "type": "tool_use",
                "id": _tool_id(_str(call.get("id"), f"{param}.id")),
                "name": _str(function.get("name"), f"{param}.function.name"),
                "input": tool_input,
            }
        )
    return blocks


def _tool_to_anthropic(tool: object, i: int) -> dict[str, Any]:
    tool = _dict(tool, f"tools[{i}]")
    if tool.get("type") != "function":
        raise TranslationError(
            f"'tools[{i}]' of type {tool.get('type')!r} cannot be sent to an Anthropic model",
            param=f"tools[{i}].type",
        )
    function = _dict(tool.get("function"), f"tools[{i}].function")
    out: dict[str, Any] = {"name": _str(function.get("name"), f"tools[{i}].function.name")}
    description = function.get("description")
    if description:
        out["description"] = description
    out["input_schema"] = function.get("parameters") or {"type": "object", "properties": {}}
    if function.get("strict") is True:
        out["strict"] = True
    return out


def _tool_choice_to_anthropic(choice: object) -> dict[str, Any] | None:
    if choice is None:
        return None
    if choice == "auto":
        return {"type": "auto"}
    if choice == "none":
        return {"type": "none"}
    if choice == "required":
        return {"type": "any"}
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = _dict(choice.get("function"), "tool_choice.function")
        return {"type": "tool", "name": _str(function.get("name"), "tool_choice.function.name")}
    raise TranslationError(
        f"'tool_choice' {choice!r} cannot be sent to an Anthropic model", param="tool_choice"
    )


def _response_format_to_anthropic(response_format: object) -> dict[str, Any] | None:
    if response_format is None:
        return None
    response_format = _dict(response_format, "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = _dict(response_format.get("json_schema"), "response_format.json_schema")
        schema = _dict(spec.get("schema"), "response_format.json_schema.schema")
        return {"type": "json_schema", "schema": schema}
    raise TranslationError(
        f"'response_format' of type {kind!r} cannot be sent to an Anthropic model"
        " (use json_schema)",
        param="response_format",
    )


# --- requests: Anthropic Messages → OpenAI chat ---------------------------------------------------

_ANTHROPIC_UNTRANSLATABLE: Final = ("mcp_servers", "container")


def messages_request_to_openai(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request body → an OpenAI chat completions request body.

    `max_tokens` becomes `max_completion_tokens` (what OpenAI's reasoning models require and vLLM
    accepts). Raises TranslationError for what chat completions cannot express (server tools,
    MCP servers, images inside tool results, ...).
    """
    for key in _ANTHROPIC_UNTRANSLATABLE:
        if body.get(key):
            raise TranslationError(f"'{key}' cannot be sent to an OpenAI model", param=key)
    out: dict[str, Any] = {}
    if "model" in body:
        out["model"] = body["model"]
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        text = system if isinstance(system, str) else _anthropic_text(system, "system")
        messages.append({"role": "system", "content": text})
    for i, message in enumerate(_list(body.get("messages"), "messages")):
        where = f"messages[{i}]"
        message = _dict(message, where)
        role = message.get("role")
        if role == "user":
            messages.extend(_anthropic_user_to_openai(message.get("content"), where))
        elif role == "assistant":
            converted = _anthropic_assistant_to_openai(message.get("content"), where)
            if converted is not None:
                messages.append(converted)
        else:
            raise TranslationError(
                f"'{where}.role' must be user or assistant", param=f"{where}.role"
            )
    out["messages"] = messages
    if body.get("max_tokens") is not None:
        out["max_completion_tokens"] = body["max_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            out[key] = body[key]
    stop = body.get("stop_sequences")
    if stop:
        out["stop"] = list(_list(stop, "stop_sequences"))
    if body.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}  # Anthropic clients always get usage
    elif body.get("stream") is not None:
        out["stream"] = False
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and metadata.get("user_id") is not None:
        out["user"] = metadata["user_id"]
    tools = body.get("tools")
    if tools:
        out["tools"] = [_tool_to_openai(tool, i) for i, tool in enumerate(_list(tools, "tools"))]
    tool_choice = body.get("tool_choice")
    if tool_choice is not None:
        tool_choice = _dict(tool_choice, "tool_choice")
        out["tool_choice"] = _tool_choice_to_openai(tool_choice)
        if tools and tool_choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    output_config = body.get("output_config")
    if isinstance(output_config, dict) and output_config.get("format") is not None:
        output_format = _dict(output_config["format"], "output_config.format")
        if output_format.get("type") != "json_schema":
            raise TranslationError(
                "'output_config.format' must be json_schema", param="output_config.format.type"
            )
        schema = _dict(output_format.get("schema"), "output_config.format.schema")
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema, "strict": True},
        }
    return out


def _anthropic_text(blocks: object, param: str) -> str:
    texts = []
    for j, block in enumerate(_list(blocks, param)):
        block = _dict(block, f"{param}[{j}]")
        if block.get("type") != "text":
            raise TranslationError(f"'{param}[{j}]' must be a text block", param=f"{param}[{j}]")
        texts.append(_str(block.get("text"), f"{param}[{j}].text"))
    return "\n\n".join(texts)


def _anthropic_user_to_openai(content: object, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(_list(content, f"{where}.content")):
        param = f"{where}.content[{j}]"
        block = _dict(block, param)
        kind = block.get("type")
        if kind == "tool_result":
            # Tool results come first in an Anthropic user turn; OpenAI wants one message each.
            tool_messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _str(block.get("tool_use_id"), f"{param}.tool_use_id"),
                    "content": _tool_result_to_openai(block.get("content"), f"{param}.content"),
                }
            )
        elif kind == "text":
            parts.append({"type": "text", "text": _str(block.get("text"), f"{param}.text")})
        elif kind == "image":
            parts.append(_image_to_openai(_dict(block.get("source"), f"{param}.source"), param))
        elif kind == "document":
            parts.append(_document_to_openai(block, param))
        else:
            raise TranslationError(
                f"'{param}' of type {kind!r} cannot be sent to an OpenAI model",
                param=f"{param}.type",
            )
    if not parts:
        return tool_messages
    if len(parts) == 1 and parts[0]["type"] == "text":
        return [*tool_messages, {"role": "user", "content": parts[0]["text"]}]
    return [*tool_messages, {"role": "user", "content": parts}]


def _tool_result_to_openai(content: object, param: str) -> str | list[dict[str, Any]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(_list(content, param)):
        block = _dict(block, f"{param}[{j}]")
        if block.get("type") != "text":
            raise TranslationError(
                f"'{param}[{j}]': OpenAI tool results carry text only", param=f"{param}[{j}].type"
            )
        parts.append({"type": "text", "text": _str(block.get("text"), f"{param}[{j}].text")})
    if len(parts) == 1:
        return str(parts[0]["text"])
    return parts


def _image_to_openai(source: dict[str, Any], param: str) -> dict[str, Any]:
    kind = source.get("type")
    if kind == "base64":
        media_type = _str(source.get("media_type"), f"{param}.source.media_type")
        data = _str(source.get("data"), f"{param}.source.data")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        url = _str(source.get("url"), f"{param}.source.url")
    else:
        raise TranslationError(
            f"'{param}.source' of type {kind!r} cannot be sent to an OpenAI model",
            param=f"{param}.source.type",
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _document_to_openai(block: dict[str, Any], param: str) -> dict[str, Any]:
    source = _dict(block.get("source"), f"{param}.source")
    kind = source.get("type")
    if kind == "text":
        return {"type": "text", "text": _str(source.get("data"), f"{param}.source.data")}
    if kind == "base64" and source.get("media_type") == "application/pdf":
        data = _str(source.get("data"), f"{param}.source.data")
        title = block.get("title")
        return {
            "type": "file",
            "file": {
                "filename": title if isinstance(title, str) and title else "document.pdf",
                "file_data": f"data:application/pdf;base64,{data}",
            },
        }
    raise TranslationError(
        f"'{param}.source' of type {kind!r} cannot be sent to an OpenAI model",
        param=f"{param}.source.type",
    )


def _anthropic_assistant_to_openai(content: object, where: str) -> dict[str, Any] | None:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for j, block in enumerate(_list(content, f"{where}.content")):
        param = f"{where}.content[{j}]"
        block = _dict(block, param)
        kind = block.get("type")
        if kind == "text":
            texts.append(_str(block.get("text"), f"{param}.text"))
        elif kind == "tool_use":
            tool_calls.append(
                {
                    "id": _str(block.get("id"), f"{param}.id"),
                    "type": "function",
                    "function": {
                        "name": _str(block.get("name"), f"{param}.name"),
                        "arguments": orjson.dumps(block.get("input") or {}).decode(),
                    },
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # chat completions has no way to send reasoning back
        else:
            raise TranslationError(
                f"'{param}' of type {kind!r} cannot be sent to an OpenAI model",
                param=f"{param}.type",
            )
    if not texts and not tool_calls:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _tool_to_openai(tool: object, i: int) -> dict[str, Any]:
    tool = _dict(tool, f"tools[{i}]")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise TranslationError(
            f"'tools[{i}]': the server tool {kind!r} cannot be sent to an OpenAI model",
            param=f"tools[{i}].type",
        )
    function: dict[str, Any] = {"name": _str(tool.get("name"), f"tools[{i}].name")}
    if tool.get("description"):
        function["description"] = tool["description"]
    function["parameters"] = _dict(tool.get("input_schema"), f"tools[{i}].input_schema")
    if tool.get("strict") is True:
        function["strict"] = True
    return {"type": "function", "function": function}


def _tool_choice_to_openai(choice: dict[str, Any]) -> str | dict[str, Any]:
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        name = _str(choice.get("name"), "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise TranslationError(f"'tool_choice.type' {kind!r} is not known", param="tool_choice.type")


# --- responses -----------------------------------------------------------------------------------


def _openai_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic usage → OpenAI usage: cache reads and writes are part of `prompt_tokens`."""
    usage = usage or {}
    cached = usage.get("cache_read_input_tokens") or 0
    prompt = (
        (usage.get("input_tokens") or 0) + cached + (usage.get("cache_creation_input_tokens") or 0)
    )
    completion = usage.get("output_tokens") or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _anthropic_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI usage → Anthropic usage: `input_tokens` excludes the cached part."""
    usage = usage or {}
    prompt = usage.get("prompt_tokens") or 0
    details = usage.get("prompt_tokens_details")
    cached = (details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    out: dict[str, Any] = {
        "input_tokens": max(prompt - cached, 0),
        "output_tokens": usage.get("completion_tokens") or 0,
    }
    if cached:
        out["cache_read_input_tokens"] = cached
    return out


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


def openai_response_to_anthropic(data: dict[str, Any], *, model: str) -> bytes:
    """A `chat.completion` → Messages response JSON bytes (first choice only).

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
        content.append({"type": "text", "text": text})
    if message.get("refusal"):
        content.append({"type": "text", "text": message["refusal"]})
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
            "usage": _anthropic_usage(data.get("usage")),
        }
    )


# --- streams -------------------------------------------------------------------------------------

_DONE_FRAME: Final = b"data: [DONE]\n\n"


def _is_comment(raw: bytes) -> bool:
    return raw.startswith(b":")  # keep-alives are valid SSE on both wires: forward them


def openai_error_frame(error: InBandError) -> bytes:
    """An in-band upstream error as the OpenAI stream error event openai-python raises on."""
    return frame(
        orjson.dumps(
            {
                "error": {
                    "message": error.message,
                    "type": error.type,
                    "param": None,
                    "code": error.code,
                }
            }
        )
    )


def anthropic_error_frame(error: InBandError) -> bytes:
    """An in-band upstream error as an Anthropic `event: error`."""
    kind = error.type
    if kind not in ANTHROPIC_ERROR_STATUS:
        kind = _ANTHROPIC_ERROR_TYPES.get(error.status or 500, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": error.message}}
    return frame(orjson.dumps(body), event="error")


class OpenAIPassthrough:
    """OpenAI upstream to OpenAI client: forwards every event untouched, except the usage-only
    chunk when the client did not ask for `stream_options.include_usage` (the gateway always asks
    upstream, for its own accounting)."""

    __slots__ = ("_include_usage",)

    def __init__(self, *, include_usage: bool) -> None:
        self._include_usage = include_usage

    def feed(self, chunk: Chunk) -> bytes:
        if (
            chunk.usage is not None
            and not self._include_usage
            and chunk.data is not None
            and not chunk.data.get("choices")
        ):
            return b""
        return chunk.raw


class AnthropicToOpenAIStream:
    """Anthropic Messages stream events → `chat.completion.chunk` SSE frames.

    Every chunk shares one id, `created` and `model`; with `include_usage` the others carry
    `"usage": null` and a usage chunk precedes `[DONE]`. An in-band error becomes OpenAI's error
    event (the attempt loop may send its own instead).
    """

    __slots__ = (
        "_cache_write_tokens",
        "_cached_tokens",
        "_created",
        "_head",
        "_id",
        "_include_usage",
        "_input_tokens",
        "_model",
        "_output_tokens",
        "_tail",
        "_tools",
        "_usage_null",
    )

    def __init__(self, *, model: str, include_usage: bool) -> None:
        self._model = model
        self._include_usage = include_usage
        self._created = int(time.time())
        self._usage_null = b',"usage":null' if include_usage else b""
        self._tail = b',"logprobs":null,"finish_reason":null}]' + self._usage_null + b"}\n\n"
        self._id = ""
        self._head = b""  # `data: {..."choices":[{"index":0,"delta":`, set at message_start
        self._tools: dict[int, int] = {}  # Anthropic block index → OpenAI tool_calls index
        self._input_tokens = 0
        self._cached_tokens = 0
        self._cache_write_tokens = 0
        self._output_tokens = 0

    def _start(self, message_id: object) -> None:
        self._id = _openai_id(message_id)
        common = orjson.dumps(
            {
                "id": self._id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": self._model,
            }
        )
        self._head = b"data: " + common[:-1] + b',"choices":[{"index":0,"delta":'

    def _chunk(self, delta: bytes) -> bytes:
        if not self._head:
            self._start(None)
        return self._head + delta + self._tail

    def _count(self, usage: dict[str, Any] | None) -> None:
        # message_start and message_delta both carry counts; later ones are cumulative totals.
        if not usage:
            return
        if usage.get("input_tokens") is not None:
            self._input_tokens = usage["input_tokens"]
        if usage.get("cache_read_input_tokens") is not None:
            self._cached_tokens = usage["cache_read_input_tokens"]
        if usage.get("cache_creation_input_tokens") is not None:
            self._cache_write_tokens = usage["cache_creation_input_tokens"]
        if usage.get("output_tokens") is not None:
            self._output_tokens = usage["output_tokens"]

    def feed(self, chunk: Chunk) -> bytes:
        if chunk.error is not None:
            return openai_error_frame(chunk.error)
        data = chunk.data
        if data is None:
            return chunk.raw if _is_comment(chunk.raw) else b""
        kind = data.get("type")
        if kind == "content_block_delta":
            delta = data["delta"]
            delta_type = delta.get("type")
            if delta_type == "text_delta":
                text = delta.get("text")
                return self._chunk(b'{"content":' + orjson.dumps(text) + b"}") if text else b""
            if delta_type == "thinking_delta":
                text = delta.get("thinking")
                if not text:
                    return b""
                return self._chunk(b'{"reasoning_content":' + orjson.dumps(text) + b"}")
            if delta_type == "input_json_delta":
                tool = self._tools.get(data.get("index", -1))
                arguments = delta.get("partial_json")
                if tool is None or not arguments:
                    return b""
                return self._chunk(
                    b'{"tool_calls":[{"index":%d,"function":{"arguments":%b}}]}'
                    % (tool, orjson.dumps(arguments))
                )
            return b""  # signature_delta, citations_delta
        if kind == "content_block_start":
            block = data.get("content_block") or {}
            block_type = block.get("type")
            if block_type == "tool_use":
                tool = self._tools[data.get("index", -1)] = len(self._tools)
                call = {
                    "index": tool,
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": ""},
                }
                return self._chunk(orjson.dumps({"tool_calls": [call]}))
            if block_type == "text" and block.get("text"):
                return self._chunk(b'{"content":' + orjson.dumps(block["text"]) + b"}")
            return b""
        if kind == "message_start":
            message = data.get("message") or {}
            self._start(message.get("id"))
            self._count(message.get("usage"))
            return self._chunk(b'{"role":"assistant","content":""}')
        if kind == "message_delta":
            self._count(data.get("usage"))
            finish = openai_finish_reason((data.get("delta") or {}).get("stop_reason"))
            if not self._head:
                self._start(None)
            return (
                self._head
                + b'{},"logprobs":null,"finish_reason":"'
                + finish.encode()
                + b'"}]'
                + self._usage_null
                + b"}\n\n"
            )
        if kind == "message_stop":
            if not self._include_usage:
                return _DONE_FRAME
            prompt = self._input_tokens + self._cached_tokens + self._cache_write_tokens
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": self._output_tokens,
                "total_tokens": prompt + self._output_tokens,
                "prompt_tokens_details": {"cached_tokens": self._cached_tokens},
            }
            if not self._head:
                self._start(None)
            body = {
                "id": self._id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": self._model,
                "choices": [],
                "usage": usage,
            }
            return frame(orjson.dumps(body)) + _DONE_FRAME
        return b""  # ping, content_block_stop, events added to the API later


_MESSAGE_STOP: Final = frame(b'{"type":"message_stop"}', event="message_stop")
_BLOCK_START: Final = b'event: content_block_start\ndata: {"type":"content_block_start","index":'
_BLOCK_STOP: Final = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":'
_BLOCK_DELTA: Final = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
_TEXT_DELTA: Final = b'{"type":"text_delta","text":'
_THINKING_DELTA: Final = b'{"type":"thinking_delta","thinking":'
_JSON_DELTA: Final = b'{"type":"input_json_delta","partial_json":'
_EMPTY_BLOCKS: Final[dict[str, bytes]] = {
    "text": b'{"type":"text","text":""}',
    "thinking": b'{"type":"thinking","thinking":"","signature":""}',
}


class OpenAIToAnthropicStream:
    """`chat.completion.chunk` frames → Anthropic Messages stream events.

    Text, reasoning and each tool call get their own content block, opened when their first delta
    arrives; `[DONE]` closes the open block and sends `message_delta` (stop reason and usage,
    remembered from the upstream's finish and usage chunks) and `message_stop`. The upstream must
    be asked for `stream_options.include_usage`, or output tokens are reported as 0.
    """

    __slots__ = (
        "_cached_tokens",
        "_delta_head",
        "_finish_reason",
        "_finished",
        "_input_tokens",
        "_last_tool",
        "_last_tool_id",
        "_model",
        "_next_block",
        "_open",
        "_output_tokens",
        "_started",
        "_tools",
    )

    def __init__(self, *, model: str) -> None:
        self._model = model
        self._started = False
        self._finished = False
        self._next_block = 0
        self._open: str | None = None  # kind of the open block: text, thinking or tool
        self._delta_head = b""  # `content_block_delta` prefix of the open block
        self._tools: dict[int, int] = {}  # OpenAI tool_calls index → block index
        self._last_tool: int | None = None
        self._last_tool_id: object = None
        self._finish_reason: str | None = None
        self._input_tokens: int | None = None
        self._cached_tokens = 0
        self._output_tokens = 0

    def feed(self, chunk: Chunk) -> bytes:
        if self._finished:
            return b""
        if chunk.error is not None:
            self._finished = True  # an error event ends an Anthropic stream
            return anthropic_error_frame(chunk.error)
        data = chunk.data
        if data is None:
            if chunk.done:
                return self._finish()
            return chunk.raw if _is_comment(chunk.raw) else b""
        out = b"" if self._started else self._message_start(data)
        usage = data.get("usage")
        if usage:
            self._count(usage)
        choices = data.get("choices")
        if choices:
            choice = choices[0]
            delta = choice.get("delta")
            if delta:
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if reasoning:
                    out += self._text("thinking", _THINKING_DELTA, reasoning)
                text = delta.get("content")
                if text:
                    out += self._text("text", _TEXT_DELTA, text)
                refusal = delta.get("refusal")
                if refusal:
                    out += self._text("text", _TEXT_DELTA, refusal)
                tool_calls = delta.get("tool_calls")
                if tool_calls:
                    for call in tool_calls:
                        out += self._tool(call)
            finish_reason = choice.get("finish_reason")
            if finish_reason:
                self._finish_reason = finish_reason
        return out

    def _count(self, usage: dict[str, Any]) -> None:
        details = usage.get("prompt_tokens_details")
        cached = (details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        prompt = usage.get("prompt_tokens")
        if prompt is not None:
            self._input_tokens = max(prompt - cached, 0)
            self._cached_tokens = cached
        self._output_tokens = usage.get("completion_tokens") or self._output_tokens

    def _message_start(self, data: dict[str, Any]) -> bytes:
        self._started = True
        message: dict[str, Any] = {
            "id": _anthropic_id(data.get("id")),
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self._input_tokens or 0, "output_tokens": 0},
        }
        return frame(
            orjson.dumps({"type": "message_start", "message": message}), event="message_start"
        )

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return _BLOCK_STOP + b"%d}\n\n" % (self._next_block - 1)

    def _open_block(self, kind: str, content_block: bytes) -> bytes:
        out = self._close()
        index = self._next_block
        self._next_block += 1
        self._open = kind
        self._delta_head = _BLOCK_DELTA + b'%d,"delta":' % index
        return out + _BLOCK_START + b'%d,"content_block":%b}\n\n' % (index, content_block)

    def _text(self, kind: str, head: bytes, text: str) -> bytes:
        out = b"" if self._open == kind else self._open_block(kind, _EMPTY_BLOCKS[kind])
        return out + self._delta_head + head + orjson.dumps(text) + b"}}\n\n"

    def _tool(self, call: dict[str, Any]) -> bytes:
        index = call.get("index")
        if not isinstance(index, int):
            # Servers that omit it send one call at a time; a new id starts the next one.
            call_id = call.get("id")
            last = self._last_tool
            new = last is None or (call_id is not None and call_id != self._last_tool_id)
            index = len(self._tools) if new or last is None else last
        function = call.get("function") or {}
        out = b""
        block = self._tools.get(index)
        if block is None:
            block_body = orjson.dumps(
                {
                    "type": "tool_use",
                    "id": _tool_id(call.get("id")),
                    "name": function.get("name") or "",
                    "input": {},
                }
            )
            out = self._open_block("tool", block_body)
            block = self._tools[index] = self._next_block - 1
            self._last_tool = index
            self._last_tool_id = call.get("id")
        arguments = function.get("arguments")
        if not arguments:
            return out
        head = (
            self._delta_head
            if block == self._next_block - 1
            else _BLOCK_DELTA + b'%d,"delta":' % block  # a late delta for an earlier call
        )
        return out + head + _JSON_DELTA + orjson.dumps(arguments) + b"}}\n\n"

    def _finish(self) -> bytes:
        self._finished = True
        out = b"" if self._started else self._message_start({})
        out += self._close()
        usage: dict[str, Any] = {"output_tokens": self._output_tokens}
        if self._input_tokens is not None:
            usage["input_tokens"] = self._input_tokens
            if self._cached_tokens:
                usage["cache_read_input_tokens"] = self._cached_tokens
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": anthropic_stop_reason(self._finish_reason),
                "stop_sequence": None,
            },
            "usage": usage,
        }
        return out + frame(orjson.dumps(delta), event="message_delta") + _MESSAGE_STOP
