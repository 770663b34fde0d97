"""Request translation between the OpenAI chat wire and the Anthropic Messages wire, as dicts:
OpenAI chat → Anthropic Messages here, the other way in `requests_to_openai` (re-exported).

The caller sets the upstream model afterwards. What one wire cannot express raises
`TranslationError` naming the field; hints that only steer sampling on one side (penalties, seeds,
`reasoning_effort`, `thinking`, `top_k` towards OpenAI) are dropped rather than refused, so a
fallback across wires keeps working.

Anthropic prompt-cache markers (`cache_control`) that an OpenAI client put on content parts,
messages or tools are carried onto the blocks and tools they become; towards OpenAI, where no
server takes them, they are dropped, as are OpenAI's `prompt_cache_key` and
`prompt_cache_retention` towards Anthropic.
"""

from __future__ import annotations

import base64
from typing import Any, Final

from gateway.errors import quote
from gateway.providers.translate.requests_to_openai import messages_request_to_openai
from gateway.providers.translate.responses import _arguments, _tool_id
from gateway.providers.translate.shapes import (
    TranslationError,
    _dict,
    _list,
    _parse_data_url,
    _str,
)

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "TranslationError",
    "chat_request_to_anthropic",
    "messages_request_to_openai",
]

DEFAULT_MAX_TOKENS: Final = 4096
"""Anthropic requires `max_tokens`; used when an OpenAI request does not set one."""


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


def _marked(source: dict[str, Any], block: dict[str, Any]) -> dict[str, Any]:
    """`block`, given the `cache_control` marker `source` carries (some OpenAI clients send
    Anthropic's prompt-cache markers on chat content parts, messages and tools); a block's own
    marker wins over its message's, and one that is not an object is dropped."""
    marker = source.get("cache_control")
    if isinstance(marker, dict):
        block.setdefault("cache_control", marker)
    return block


def _system_blocks(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A system/developer message's content (a string or text parts) → non-empty text blocks
    (Anthropic refuses empty ones), with their cache markers."""
    content = message.get("content")
    blocks = []
    if isinstance(content, str):
        blocks.append({"type": "text", "text": content})
    elif content is not None:
        for j, part in enumerate(_list(content, f"{where}.content")):
            param = f"{where}.content[{j}]"
            part = _dict(part, param)
            if part.get("type") != "text":
                raise TranslationError(f"'{param}' must be a text part", param=f"{param}.type")
            blocks.append(_marked(part, {"type": "text", "text": _str(part.get("text"), param)}))
    blocks = [block for block in blocks if block["text"]]
    if blocks:
        _marked(message, blocks[-1])
    return blocks


def _system(blocks: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """The system prompt: one string, or its blocks when one carries a cache marker."""
    if any("cache_control" in block for block in blocks):
        return blocks
    return "\n\n".join(block["text"] for block in blocks)


def _messages_to_anthropic(
    messages: list[Any],
) -> tuple[str | list[dict[str, Any]], list[dict[str, Any]]]:
    system: list[dict[str, Any]] = []
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
            _marked(message, result)
            if tool_turn is None:
                tool_turn = []
                out.append({"role": "user", "content": tool_turn})
            tool_turn.append(result)  # consecutive results answer one assistant turn together
            continue
        tool_turn = None
        if role in ("system", "developer"):
            system.extend(_system_blocks(message, where))
        elif role == "user":
            out.append({"role": "user", "content": _user_to_anthropic(message, where)})
        elif role == "assistant":
            blocks = _assistant_to_anthropic(message, where)
            if blocks:  # Anthropic refuses empty turns; adjacent same-role turns it merges itself
                out.append({"role": "assistant", "content": blocks})
        else:
            raise TranslationError(
                f"'{where}.role' {quote(role)} cannot be sent to an Anthropic model",
                param=f"{where}.role",
            )
    return _system(system), out


def _user_to_anthropic(message: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        if content and isinstance(message.get("cache_control"), dict):
            return [_marked(message, {"type": "text", "text": content})]  # a marker needs a block
        return content
    blocks: list[dict[str, Any]] = []
    for j, part in enumerate(_list(content, f"{where}.content")):
        param = f"{where}.content[{j}]"
        part = _dict(part, param)
        kind = part.get("type")
        if kind == "text":
            block = {"type": "text", "text": _str(part.get("text"), f"{param}.text")}
        elif kind == "image_url":
            block = _image_to_anthropic(part.get("image_url"), f"{param}.image_url")
        elif kind == "file":
            block = _file_to_anthropic(_dict(part.get("file"), f"{param}.file"), param)
        else:
            raise TranslationError(
                f"'{param}' of type {quote(kind)} cannot be sent to an Anthropic model",
                param=f"{param}.type",
            )
        blocks.append(_marked(part, block))
    if blocks:
        _marked(message, blocks[-1])
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
            f"'{param}.file' of type {quote(media_type)} cannot be sent to an Anthropic model",
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
        text = _str(part.get("text"), f"{param}[{j}].text")
        blocks.append(_marked(part, {"type": "text", "text": text}))
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
                blocks.append(_marked(part, {"type": "text", "text": text}))
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
    if blocks:
        _marked(message, blocks[-1])
    return blocks


def _tool_to_anthropic(tool: object, i: int) -> dict[str, Any]:
    tool = _dict(tool, f"tools[{i}]")
    if tool.get("type") != "function":
        raise TranslationError(
            f"'tools[{i}]' of type {quote(tool.get('type'))} cannot be sent to an Anthropic model",
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
    return _marked(tool, out)


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
        f"'tool_choice' {quote(choice)} cannot be sent to an Anthropic model", param="tool_choice"
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
        f"'response_format' of type {quote(kind)} cannot be sent to an Anthropic model"
        " (use json_schema)",
        param="response_format",
    )
