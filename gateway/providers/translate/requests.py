"""Request translation between the OpenAI chat wire and the Anthropic Messages wire, as dicts.

The caller sets the upstream model afterwards. What one wire cannot express raises
`TranslationError` naming the field; hints that only steer sampling on one side (penalties, seeds,
`reasoning_effort`, `thinking`, `top_k` towards OpenAI) are dropped rather than refused, so a
fallback across wires keeps working.
"""

from __future__ import annotations

import base64
from typing import Any, Final

import orjson

from gateway.errors import quote
from gateway.providers.translate.responses import _arguments, _tool_id

DEFAULT_MAX_TOKENS: Final = 4096
"""Anthropic requires `max_tokens`; used when an OpenAI request does not set one."""


class TranslationError(ValueError):
    """A request or response that the other wire format cannot express; `param` names the field."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


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
                f"'{where}.role' {quote(role)} cannot be sent to an Anthropic model",
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
                f"'{param}' of type {quote(kind)} cannot be sent to an Anthropic model",
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
                f"'{param}' of type {quote(kind)} cannot be sent to an OpenAI model",
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
            f"'{param}.source' of type {quote(kind)} cannot be sent to an OpenAI model",
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
        f"'{param}.source' of type {quote(kind)} cannot be sent to an OpenAI model",
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
                f"'{param}' of type {quote(kind)} cannot be sent to an OpenAI model",
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
            f"'tools[{i}]': the server tool {quote(kind)} cannot be sent to an OpenAI model",
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
    raise TranslationError(
        f"'tool_choice.type' {quote(kind)} is not known", param="tool_choice.type"
    )
