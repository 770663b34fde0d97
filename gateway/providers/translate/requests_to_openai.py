"""Request translation from the Anthropic Messages wire to the OpenAI chat wire, as dicts.

`max_tokens` becomes `max_completion_tokens`; `thinking` and `output_config.effort` become
`reasoning_effort`; a `system` message in the conversation stays where it is, as a chat `system`
message; `metadata.user_id` becomes a hashed `safety_identifier`. Hints chat has no place for
(`top_k`, `context_management`, betas) are dropped, and so are Anthropic's prompt-cache markers
(`cache_control`, on the system prompt, content blocks and tools): where the caller says the
upstream takes one, they become a `prompt_cache_key` instead. What chat cannot express raises
`TranslationError` naming the field.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

import orjson

from gateway.errors import quote
from gateway.providers.translate.shapes import TranslationError, _dict, _list, _str

_ANTHROPIC_UNTRANSLATABLE: Final = ("mcp_servers", "container")
# Anthropic's effort levels → chat's `reasoning_effort` (its schema knows low, medium, high).
_EFFORTS: Final[dict[str, str]] = {
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}
_SAFETY_IDENTIFIER_CHARS: Final = 64  # OpenAI's limit; a sha256 in hex is exactly that long


def messages_request_to_openai(body: dict[str, Any], *, cache_hint: bool = False) -> dict[str, Any]:
    """An Anthropic Messages request body → an OpenAI chat completions request body.

    `max_tokens` becomes `max_completion_tokens` (what OpenAI's reasoning models require and vLLM
    accepts). `cache_hint`: the upstream takes `prompt_cache_key`, and the body marks a prefix
    with `cache_control` (the caller knows both cheaply). Raises TranslationError for what chat
    completions cannot express (server tools, MCP servers, images inside tool results, ...).
    """
    for key in _ANTHROPIC_UNTRANSLATABLE:
        if body.get(key):
            raise TranslationError(f"'{key}' cannot be sent to an OpenAI model", param=key)
    out: dict[str, Any] = {}
    if "model" in body:
        out["model"] = body["model"]
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    system_text = ""
    if system:
        system_text = system if isinstance(system, str) else _anthropic_text(system, "system")
        messages.append({"role": "system", "content": system_text})
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
        elif role == "system":
            # Claude Code's sub-agents send instructions mid-conversation: kept in place.
            content = message.get("content")
            text = content if isinstance(content, str) else _anthropic_text(content, where)
            messages.append({"role": "system", "content": text})
        else:
            raise TranslationError(
                f"'{where}.role' must be user, assistant or system", param=f"{where}.role"
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
    effort = _reasoning_effort(body.get("thinking"), body.get("output_config"))
    if effort is not None:
        out["reasoning_effort"] = effort
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user_id, str) and user_id:
        # Anthropic takes 256 characters, OpenAI 64: a hash keeps it distinct and in bounds
        # (and keeps an email address or the like from reaching a third party as sent).
        out["safety_identifier"] = hashlib.sha256(user_id.encode()).hexdigest()[
            :_SAFETY_IDENTIFIER_CHARS
        ]
    if cache_hint:
        # Requests of one user (else one system prompt) share a cache key, so that the
        # upstream routes them to the machine holding their prefix.
        seed = user_id if isinstance(user_id, str) and user_id else system_text
        out["prompt_cache_key"] = hashlib.sha256(b"prompt-cache:" + seed.encode()).hexdigest()[:32]
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


def _reasoning_effort(thinking: object, output_config: object) -> str | None:
    """`output_config.effort`, else the `thinking` budget, as chat's `reasoning_effort`; None
    when neither asks for reasoning (adaptive thinking leaves it to the model)."""
    if isinstance(output_config, dict):
        effort = output_config.get("effort")
        if isinstance(effort, str) and effort in _EFFORTS:
            return _EFFORTS[effort]
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool):
        return "medium"
    return "low" if budget < 4096 else "medium" if budget < 16384 else "high"


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
