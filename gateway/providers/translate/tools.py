"""The Responses API's tools on a chat upstream, and the calls of them on the way back. Pure.

Function tools pass as they are. A `namespace` tool is flattened into its functions (each keeps
its own name unless another tool has it; then it is `<namespace>__<name>`), and a call of one
comes back with its `namespace` and its own name. A freeform `custom` tool whose input is plain
text becomes a function of one string argument, `input`, and a call of it comes back as a
`custom_tool_call` with that `input`: nothing is lost either way. A custom tool held to a
grammar is not freeform (the function could not hold the model to the grammar), so it counts
with the hosted tools (`web_search`, `file_search`, `local_shell`, `mcp`, `image_generation`,
`code_interpreter`, ...) that only an upstream serving the Responses API runs: the model's
`unsupported_tools` policy drops them (the answer names them: `ToolNames.dropped`) or refuses
the request.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson

from gateway.providers.translate.shapes import TranslationError, optional_str, required_str, typed

UnsupportedTools = Literal["drop", "refuse"]

_NAMESPACED: Final = "{namespace}__{name}"
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_.:\-]")
_LABEL_CHARS: Final = 80
CUSTOM_ARGUMENT: Final = "input"
_CUSTOM_PARAMETERS: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {CUSTOM_ARGUMENT: {"type": "string", "description": "The tool's input."}},
    "required": [CUSTOM_ARGUMENT],
    "additionalProperties": False,
}


@dataclass(slots=True)
class ToolNames:
    """How one request's tools were named on the chat wire: what a call of each maps back to,
    and the tools the policy dropped (each as `type`, or `type:name` when it has a name)."""

    # chat name → (namespace, name, custom) for every tool not sent under its own plain name
    # or not a function: a plain function tool is absent (its call needs no mapping).
    origins: dict[str, tuple[str | None, str, bool]] = field(default_factory=dict)
    # (namespace, name) → chat name, for the calls a conversation replays
    chat: dict[tuple[str | None, str], str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)

    def chat_name(self, namespace: str | None, name: str) -> str:
        found = self.chat.get((namespace, name))
        if found is not None:
            return found
        return _NAMESPACED.format(namespace=namespace, name=name) if namespace else name

    def call_item(self, call_id: str, chat_name: str, arguments: str) -> dict[str, Any]:
        """The output item for a chat tool call: a `function_call` (with its `namespace` when
        it came from one) or a `custom_tool_call` whose `input` is the one string argument."""
        origin = self.origins.get(chat_name)
        if origin is None:
            return function_call_item(call_id, chat_name, arguments)
        namespace, name, custom = origin
        if custom:
            item = custom_call_item(call_id, name, custom_input(arguments))
        else:
            item = function_call_item(call_id, name, arguments)
        if namespace is not None:
            item["namespace"] = namespace
        return item


NO_TOOLS: Final = ToolNames()


def function_call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": "fc_" + uuid.uuid4().hex,
        "type": "function_call",
        "status": "completed",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def custom_call_item(call_id: str, name: str, text: str) -> dict[str, Any]:
    return {
        "id": "ctc_" + uuid.uuid4().hex,
        "type": "custom_tool_call",
        "status": "completed",
        "call_id": call_id,
        "name": name,
        "input": text,
    }


def custom_input(arguments: str) -> str:
    """A custom tool call's input from the function arguments a chat model wrote for it; a
    model that wrote something else has its text passed on as it is."""
    try:
        parsed = orjson.loads(arguments) if arguments else {}
    except orjson.JSONDecodeError:
        return arguments
    value = parsed.get(CUSTOM_ARGUMENT) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


def custom_arguments(text: str) -> str:
    """A replayed custom tool call's input as the arguments of its function."""
    return orjson.dumps({CUSTOM_ARGUMENT: text}).decode()


def chat_tools(tools: object, policy: UnsupportedTools) -> tuple[list[dict[str, Any]], ToolNames]:
    """A Responses request's `tools` → chat function tools, and how their names map back."""
    if not isinstance(tools, list):
        raise TranslationError("'tools' must be an array", param="tools")
    names = ToolNames()
    out: list[dict[str, Any]] = []
    # Plain names first: a namespaced function takes a qualified name only where it must.
    taken = {
        tool.get("name")
        for tool in tools
        if isinstance(tool, dict) and tool.get("type") in ("function", "custom")
    }
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise TranslationError(f"'{where}' must be an object", param=where)
        kind = tool.get("type")
        if kind == "namespace":
            namespace = required_str(tool, "name", where)
            members = tool.get("tools")
            if not isinstance(members, list):
                raise TranslationError(f"'{where}.tools' must be an array", param=f"{where}.tools")
            for number, member in enumerate(members):
                at = f"{where}.tools[{number}]"
                if not isinstance(member, dict):
                    raise TranslationError(f"'{at}' must be an object", param=at)
                name = required_str(member, "name", at)
                chat_name = (
                    name
                    if name not in taken
                    else _NAMESPACED.format(namespace=namespace, name=name)
                )
                taken.add(chat_name)
                translated = _member(member, at, chat_name, names, policy)
                if translated is not None:
                    names.origins[chat_name] = (namespace, name, _is_custom(member))
                    names.chat[namespace, name] = chat_name
                    out.append(translated)
            continue
        if kind in ("function", "custom"):
            name = required_str(tool, "name", where)
            translated = _member(tool, where, name, names, policy)
            if translated is not None:
                if kind == "custom":
                    names.origins[name] = (None, name, True)
                out.append(translated)
            continue
        _unsupported(tool, where, names, policy)
    return out, names


def _is_custom(tool: Mapping[str, Any]) -> bool:
    return tool.get("type") == "custom"


def _member(
    tool: dict[str, Any], where: str, chat_name: str, names: ToolNames, policy: UnsupportedTools
) -> dict[str, Any] | None:
    """A function or custom tool → a chat function named `chat_name`; None when dropped."""
    kind = tool.get("type")
    typed(tool, "description", str, "a string", where)
    if kind == "custom":
        fmt = tool.get("format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            _unsupported(tool, where, names, policy, why="its input is held to a grammar")
            return None
        function: dict[str, Any] = {"name": chat_name, "parameters": _CUSTOM_PARAMETERS}
        if description := optional_str(tool, "description", where):
            function["description"] = description
        return {"type": "function", "function": function}
    if kind != "function":
        _unsupported(tool, where, names, policy)
        return None
    typed(tool, "parameters", dict, "an object", where)
    typed(tool, "strict", bool, "a boolean", where)
    function = {"name": chat_name}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _unsupported(
    tool: dict[str, Any],
    where: str,
    names: ToolNames,
    policy: UnsupportedTools,
    *,
    why: str = "only an upstream serving the Responses API natively runs it",
) -> None:
    kind = tool.get("type")
    if policy == "refuse":
        raise TranslationError(
            f"tools of type '{kind}' are not available from this upstream ({why}; it takes "
            "function tools, and freeform custom tools as functions); its model is set to "
            "refuse such requests rather than drop the tool (unsupported_tools: refuse)",
            param=f"{where}.type",
        )
    label = tool.get("name") or tool.get("server_label")
    named = f"{kind}:{label}" if isinstance(label, str) and label else str(kind)
    # Named in a response header and the access log: the client's text, kept to a safe set.
    names.dropped.append(_UNSAFE.sub("_", named)[:_LABEL_CHARS])


def chat_tool_choice(choice: object, names: ToolNames) -> object:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        namespace = choice.get("namespace")
        name = required_str(choice, "name", "tool_choice")
        chat_name = names.chat_name(namespace if isinstance(namespace, str) else None, name)
        return {"type": "function", "function": {"name": chat_name}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        mode = choice.get("mode")
        return "required" if mode == "required" else "auto"
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise TranslationError(
        f"tool_choice '{kind}' is not supported by this upstream", param="tool_choice"
    )
