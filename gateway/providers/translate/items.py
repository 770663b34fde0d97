"""The Responses API over Chat Completions: a Responses request → a chat request, and a chat
answer → the Response object. Pure: no I/O.

A Responses conversation arrives here already whole: `previous_response_id` was expanded by the
edge from the gateway's own store into `input` items, so any upstream can continue it. What chat
cannot express (built-in tools, background mode, stored prompts, item references) raises
`TranslationError` naming it; hints that only steer generation where they are understood
(`reasoning.summary`, `text.verbosity`, `truncation`, `service_tier`) are dropped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, Final

import orjson

from gateway.numbers import count
from gateway.providers.translate.shapes import (
    TranslationError,
    optional_str,
    required_str,
    typed,
)
from gateway.providers.translate.tools import (
    NO_TOOLS,
    ToolNames,
    UnsupportedTools,
    chat_tool_choice,
    chat_tools,
    custom_arguments,
)

# Keys a Responses request may carry when translated, beyond the ones read below.
_DROPPED: Final = frozenset(
    {
        "store",  # the gateway stores; upstreams are asked to store nothing
        "previous_response_id",  # expanded into `input` before routing
        "conversation",  # expanded into `input` too
        "include",
        "metadata",
        "service_tier",
        "truncation",
        "stream_options",
        "background",
        "prompt_cache_retention",
        "max_tool_calls",
        "client_metadata",  # the client's own bookkeeping (Codex CLI's ids), for OpenAI only
    }
)
_READ: Final = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "top_logprobs",
        "text",
        "reasoning",
        "stream",
        "user",
        "safety_identifier",
        "prompt_cache_key",
    }
)
_ROLES: Final = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
}
_FINISHED: Final = {"length": "max_output_tokens", "content_filter": "content_filter"}


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


# --- request -------------------------------------------------------------------------------------


def responses_request_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses request (conversation already expanded) → a chat completions request,
    hosted tools dropped."""
    return translate_responses_request(body)[0]


def translate_responses_request(
    body: Mapping[str, Any], unsupported_tools: UnsupportedTools = "drop"
) -> tuple[dict[str, Any], ToolNames]:
    """A Responses request (conversation already expanded) → a chat completions request, and
    how its tools were named (what the answer's calls map back to, and what was dropped)."""
    for key in body:
        if key not in _READ and key not in _DROPPED:
            raise TranslationError(f"'{key}' is not supported by this upstream", param=key)
    if body.get("background"):
        raise TranslationError("background responses are not supported", param="background")
    if body.get("max_tool_calls") is not None:
        raise TranslationError(
            "'max_tool_calls' is not supported by this upstream", param="max_tool_calls"
        )
    names = NO_TOOLS
    tools: list[dict[str, Any]] = []
    if body.get("tools"):
        tools, names = chat_tools(body["tools"], unsupported_tools)
    out: dict[str, Any] = {"model": body.get("model")}
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    elif isinstance(instructions, list):
        messages.extend(chat_messages(instructions, param="instructions"))
    messages.extend(chat_messages(body.get("input"), param="input", names=names))
    if not messages:
        raise TranslationError("'input' must not be empty", param="input")
    out["messages"] = messages
    if tools:  # tool settings without tools are refused by OpenAI's chat: only with them
        out["tools"] = tools
        if (choice := body.get("tool_choice")) is not None:
            out["tool_choice"] = chat_tool_choice(choice, names)
        if body.get("parallel_tool_calls") is not None:
            out["parallel_tool_calls"] = body["parallel_tool_calls"]
    for key in ("temperature", "top_p", "prompt_cache_key"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("max_output_tokens") is not None:
        out["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("top_logprobs") is not None:
        out["logprobs"] = True
        out["top_logprobs"] = body["top_logprobs"]
    elif isinstance(include := body.get("include"), list) and (
        "message.output_text.logprobs" in include
    ):
        out["logprobs"] = True
    user = body.get("safety_identifier") or body.get("user")
    if isinstance(user, str):
        out["user"] = user
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort"):
        out["reasoning_effort"] = reasoning["effort"]
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and (response_format := _response_format(fmt)) is not None:
        out["response_format"] = response_format
    if body.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out, names


def chat_messages(
    items: object, *, param: str, names: ToolNames = NO_TOOLS
) -> list[dict[str, Any]]:
    """Responses input (a string or items) → chat messages. Consecutive tool calls (and the
    assistant text before them) become one assistant message with `tool_calls`; a call of a
    namespaced or custom tool takes the name its tool was given on the chat wire (`names`)."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise TranslationError(f"'{param}' must be a string or an array of items", param=param)
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"{param}[{index}]"
        if not isinstance(item, dict):
            raise TranslationError(f"'{where}' must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind in _CALLS:
            _add_call(messages, _call(item, kind, where, names))
        elif kind in _CALL_OUTPUTS:
            # A local shell call's output names its call by `call_id`, or by `id` in the
            # API reference's older shape.
            call_id = item.get("call_id") if "call_id" in item else item.get("id")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": required_str({"call_id": call_id}, "call_id", where),
                    "content": _output_text(item.get("output"), where),
                }
            )
        elif kind in _SKIPPED:
            continue
        else:
            raise TranslationError(
                _REFUSED.get(kind, f"input items of type '{kind}' are not supported")
                + " by this upstream",
                param=f"{where}.type",
            )
    return messages


# Input items a chat upstream cannot take back and needs not: it reasons afresh (reasoning,
# `encrypted_content` included, is OpenAI's to read), and a web search call's results are in
# the answer that followed it.
_SKIPPED: Final = frozenset({"reasoning", "web_search_call"})
_CALLS: Final = frozenset({"function_call", "custom_tool_call", "local_shell_call"})
_CALL_OUTPUTS: Final = frozenset(
    {"function_call_output", "custom_tool_call_output", "local_shell_call_output"}
)
_REFUSED: Final = {
    "item_reference": (
        "input items of type 'item_reference' point at items an upstream stored; a "
        "translated conversation must carry the items themselves (send them, or continue it "
        "with 'previous_response_id', which the gateway expands), and cannot be resolved"
    ),
    "compaction": (
        "input items of type 'compaction' hold a conversation's history encrypted by the "
        "upstream that compacted it; only that upstream can read it, not this one (compact "
        "the conversation on the client instead)"
    ),
}


def _call(item: dict[str, Any], kind: str, where: str, names: ToolNames) -> dict[str, Any]:
    """A replayed tool call → a chat tool call."""
    call_id = required_str(item, "call_id", where)
    if kind == "local_shell_call":
        action = item.get("action")
        name, arguments = "local_shell", orjson.dumps(action if action is not None else {}).decode()
    else:
        namespace = item.get("namespace")
        name = names.chat_name(
            namespace if isinstance(namespace, str) and namespace else None,
            required_str(item, "name", where),
        )
        if kind == "custom_tool_call":
            arguments = custom_arguments(optional_str(item, "input", where))
        else:
            arguments = optional_str(item, "arguments", where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    given = item.get("role")
    role = _ROLES.get(given) if isinstance(given, str) else None
    if role is None:
        raise TranslationError(
            f"'{where}.role' must be one of user, assistant, system or developer",
            param=f"{where}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise TranslationError(
            f"'{where}.content' must be a string or an array", param=f"{where}.content"
        )
    parts = [_part(part, f"{where}.content[{i}]") for i, part in enumerate(content)]
    if role != "user" and all(p["type"] == "text" for p in parts):
        # System and assistant messages take text only on most servers: join it.
        text = "".join(p["text"] for p in parts)
        return {"role": role, "content": text}
    return {"role": role, "content": parts}


def _part(part: object, where: str) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise TranslationError(f"'{where}' must be an object", param=where)
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": optional_str(part, "text", where)}
    if kind == "refusal":
        return {"type": "text", "text": optional_str(part, "refusal", where)}
    if kind == "input_image":
        url = part.get("image_url")
        if url is not None and not isinstance(url, str):
            raise TranslationError(
                f"'{where}.image_url' must be a string", param=f"{where}.image_url"
            )
        if url is None:
            raise TranslationError(
                "images by 'file_id' are not supported by this upstream: send 'image_url'",
                param=f"{where}.file_id",
            )
        image: dict[str, Any] = {"url": url}
        if detail := optional_str(part, "detail", where):
            image["detail"] = detail
        return {"type": "image_url", "image_url": image}
    if kind == "input_file":
        file: dict[str, Any] = {
            key: value
            for key in ("file_data", "file_id", "filename")
            if (value := optional_str(part, key, where))
        }
        if not file:
            raise TranslationError(
                "'input_file' needs 'file_data' or 'file_id' for this upstream", param=where
            )
        return {"type": "file", "file": file}
    raise TranslationError(
        f"content parts of type '{kind}' are not supported", param=f"{where}.type"
    )


def _output_text(output: object, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        texts = []
        for index, part in enumerate(output):
            at = f"{where}.output[{index}]"
            if not isinstance(part, dict):
                raise TranslationError(f"'{at}' must be an object", param=at)
            texts.append(optional_str(part, "text", at))
        return "".join(texts)
    raise TranslationError(
        f"'{where}.output' must be a string or an array", param=f"{where}.output"
    )


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        where = "text.format"
        typed(fmt, "description", str, "a string", where)
        typed(fmt, "schema", dict, "an object", where)
        typed(fmt, "strict", bool, "a boolean", where)
        schema: dict[str, Any] = {"name": optional_str(fmt, "name", where) or "response"}
        for key in ("schema", "strict", "description"):
            if fmt.get(key) is not None:
                schema[key] = fmt[key]
        return {"type": "json_schema", "json_schema": schema}
    raise TranslationError(f"text.format '{kind}' is not supported", param="text.format.type")


# --- response ------------------------------------------------------------------------------------


def responses_usage(usage: object) -> dict[str, Any]:
    """Chat usage → Responses usage (cached and reasoning tokens in their details)."""
    usage = usage if isinstance(usage, dict) else {}
    prompt = count(usage.get("prompt_tokens")) or 0
    completion = count(usage.get("completion_tokens")) or 0
    prompt_details = usage.get("prompt_tokens_details")
    completion_details = usage.get("completion_tokens_details")
    cached = prompt_details.get("cached_tokens") if isinstance(prompt_details, dict) else None
    reasoning = (
        completion_details.get("reasoning_tokens") if isinstance(completion_details, dict) else None
    )
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": count(cached) or 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": count(reasoning) or 0},
        "total_tokens": prompt + completion,
    }


def response_shell(request: Mapping[str, Any], response_id: str, model: str) -> dict[str, Any]:
    """The Response object's fields that echo the request, with no output yet: every field the
    Open Responses specification requires, with the defaults the upstream applied where the
    request left a setting out (sampling at 1, no penalties)."""
    text = request.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    reasoning = request.get("reasoning")
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "completed_at": None,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"),
        "model": model,
        "output": [],
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": {
            "effort": reasoning.get("effort") if isinstance(reasoning, dict) else None,
            "summary": _string(reasoning.get("summary")) if isinstance(reasoning, dict) else None,
        },
        "store": request.get("store", True) is not False,
        "temperature": _number(request.get("temperature"), 1.0),
        "top_p": _number(request.get("top_p"), 1.0),
        "presence_penalty": _number(request.get("presence_penalty"), 0.0),
        "frequency_penalty": _number(request.get("frequency_penalty"), 0.0),
        "top_logprobs": _integer(request.get("top_logprobs"), 0),
        "service_tier": "default",
        "text": {"format": fmt if isinstance(fmt, dict) else {"type": "text"}},
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": _echoed_tools(request.get("tools")),
        "truncation": "disabled",
        "usage": None,
        "safety_identifier": _string(request.get("safety_identifier")),
        "prompt_cache_key": _string(request.get("prompt_cache_key")),
        "metadata": request.get("metadata") or {},
    } | ({"user": user} if isinstance(user := request.get("user"), str) else {})


def _number(value: object, default: float) -> float:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else default


def _integer(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _string(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _echoed_tools(tools: object) -> list[dict[str, Any]]:
    """The function tools the model was offered, each with every field the Response object
    spells out (null where the request left one out)."""
    if not isinstance(tools, list):
        return []
    return [
        {
            "type": "function",
            "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
            "strict": tool.get("strict"),
        }
        for tool in tools
        if isinstance(tool, dict) and tool.get("type") == "function"
    ]


def finish(response: dict[str, Any], finish_reason: str | None, usage: object) -> None:
    """Mark a Response done: completed, or incomplete with the reason chat gave."""
    reason = _FINISHED.get(finish_reason or "")
    response["status"] = "incomplete" if reason else "completed"
    response["completed_at"] = None if reason else int(time.time())
    response["incomplete_details"] = {"reason": reason} if reason else None
    response["usage"] = responses_usage(usage)


def message_item(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {
        "id": new_id("msg_"),
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [
            {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        ],
    }


def reasoning_item(text: str) -> dict[str, Any]:
    return {
        "id": new_id("rs_"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def chat_to_response(
    data: Mapping[str, Any],
    request: Mapping[str, Any],
    response_id: str,
    model: str,
    names: ToolNames = NO_TOOLS,
) -> dict[str, Any]:
    """A `chat.completion` (first choice) → the Response object; tool calls map back to the
    request's tools by `names`."""
    response = response_shell(request, response_id, model)
    choices = data.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = response["output"]
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        output.append(reasoning_item(reasoning))
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    if isinstance(content, list):
        text = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    if text or not message.get("tool_calls"):
        logprobs = choice.get("logprobs")
        tokens = logprobs.get("content") if isinstance(logprobs, dict) else None
        output.append(message_item(text, _logprobs(tokens)))
    if message.get("refusal"):
        item = message_item("")
        item["content"] = [{"type": "refusal", "refusal": message["refusal"]}]
        output.append(item)
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        output.append(
            names.call_item(
                call.get("id") or new_id("call_"),
                function.get("name") or "",
                function.get("arguments") or "",
            )
        )
    finish(response, choice.get("finish_reason"), data.get("usage"))
    return response


def _logprobs(tokens: object) -> list[Any]:
    """Chat token logprobs → Responses output_text logprobs (the same fields)."""
    if not isinstance(tokens, list):
        return []
    return [
        {
            "token": t.get("token", ""),
            "logprob": t.get("logprob", 0.0),
            "bytes": t.get("bytes") or [],
            "top_logprobs": [
                {
                    "token": o.get("token", ""),
                    "logprob": o.get("logprob", 0.0),
                    "bytes": o.get("bytes") or [],
                }
                for o in t.get("top_logprobs") or ()
                if isinstance(o, dict)
            ],
        }
        for t in tokens
        if isinstance(t, dict)
    ]


def output_items_as_input(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A Response's output as input items of the next turn (what `previous_response_id` adds)."""
    items: list[dict[str, Any]] = []
    for item in response.get("output") or ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            text = "".join(
                p.get("text") or p.get("refusal") or ""
                for p in item.get("content") or ()
                if isinstance(p, dict)
            )
            items.append({"type": "message", "role": "assistant", "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            payload = "arguments" if kind == "function_call" else "input"
            call = {
                "type": kind,
                "call_id": item.get("call_id"),
                "name": item.get("name"),
                payload: item.get(payload) or "",
            }
            if item.get("namespace"):
                call["namespace"] = item["namespace"]
            items.append(call)
        # reasoning items are not replayed: chat upstreams cannot take them back
    return items


def input_items(body: Mapping[str, Any]) -> list[Any]:
    """A request's `input` as a list of items (a string is one user message)."""
    value = body.get("input")
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []
