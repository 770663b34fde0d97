"""What a request's choices generate beyond their length: the parameters that shape an answer.

Stop sequences, log probabilities, tools and `tool_choice`, `response_format`, and vLLM's
`min_tokens` / `ignore_eos`, read into one `Generation` per request. Tool schemas and JSON
schemas are checked here (`gateway.sim.schema`), before anything is drawn: one the simulator
cannot satisfy is refused with a 400 naming the parameter, code `unsupported_parameter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, TypeGuard

from gateway.sim import schema
from gateway.sim.wire import BadRequestError

__all__ = [
    "MAX_TOP_LOGPROBS",
    "UNSUPPORTED",
    "Generation",
    "Tool",
    "flag",
    "is_int",
    "read_chat_logprobs",
    "read_response_format",
    "read_stops",
    "read_tool_choice",
    "read_tools",
    "refuse_set",
]

MAX_TOP_LOGPROBS: Final = 20
UNSUPPORTED: Final = "unsupported_parameter"
_JSON_OBJECT_SCHEMA: Final = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
}


@dataclass(slots=True, frozen=True)
class Tool:
    """A function the model may call, and the schema its arguments are drawn from."""

    name: str
    parameters: object


@dataclass(slots=True)
class Generation:
    """What a request's choices generate beyond their length and words, read once."""

    stop: tuple[str, ...] = ()
    include_stop: bool = False
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per token (top_logprobs); None: no logprobs
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"  # none | auto | required
    forced: str | None = None  # the one function `tool_choice` names
    parallel: bool = True
    after_tool_result: bool = False  # the last message is a tool's result
    json_schema: object = None  # content drawn from this schema (json_object / json_schema)
    echo: bool = False

    def plain(self) -> bool:
        """Nothing but pseudo-text: the engine's fastest path."""
        return (
            not self.stop
            and self.logprobs is None
            and not self.tools
            and self.json_schema is None
            and not self.min_tokens
            and not self.ignore_eos
            and not self.echo
        )


def is_int(value: object) -> TypeGuard[int]:
    """An integer, not a boolean (JSON's `true` is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def refuse_set(request: dict[str, Any], keys: frozenset[str]) -> None:
    """OpenAI parameters the simulator cannot honour: refused unless null."""
    for key in request:
        if key in keys and request[key] is not None:
            raise BadRequestError(
                f"'{key}' is not supported by the simulator", key, code=UNSUPPORTED
            )


def flag(request: dict[str, Any], key: str) -> bool:
    """A boolean parameter, false when absent or null."""
    value = request.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequestError(f"'{key}' must be a boolean", key)
    return value


def read_stops(request: dict[str, Any], generation: Generation) -> None:
    """`stop` (empty strings dropped), `include_stop_str_in_output`, `min_tokens`, `ignore_eos`."""
    stop = request.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = stop
    else:
        raise BadRequestError("'stop' must be a string or an array of strings", "stop")
    generation.stop = tuple(s for s in stops if s)
    generation.include_stop = flag(request, "include_stop_str_in_output")
    min_tokens = request.get("min_tokens")
    if min_tokens is not None:
        if not is_int(min_tokens) or min_tokens < 0:
            raise BadRequestError("'min_tokens' must be an integer >= 0", "min_tokens")
        generation.min_tokens = min_tokens
    generation.ignore_eos = flag(request, "ignore_eos")


def read_chat_logprobs(request: dict[str, Any], generation: Generation) -> None:
    """Chat's `logprobs` (a flag) and `top_logprobs` (which needs it)."""
    wanted = flag(request, "logprobs")
    top = request.get("top_logprobs")
    if top is not None:
        if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequestError(
                f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs"
            )
        if not wanted:
            raise BadRequestError("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    if wanted:
        generation.logprobs = top or 0


def read_tools(tools: object) -> tuple[Tool, ...]:
    """Function tools, each with an object schema the generator can satisfy (checked now)."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise BadRequestError("'tools' must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise BadRequestError(
                f"'{where}.type' must be 'function': the simulator calls functions only",
                f"{where}.type",
                code=UNSUPPORTED,
            )
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str) or not name:
            raise BadRequestError(
                f"'{where}.function' must be an object with a non-empty 'name'",
                f"{where}.function",
            )
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise BadRequestError(
                f"'{where}.function.parameters' must be a JSON schema of type object",
                f"{where}.function.parameters",
            )
        parameters = {**parameters, "type": "object"}
        _check_schema(parameters, f"{where}.function.parameters")
        out.append(Tool(name, parameters))
    return tuple(out)


def _check_schema(value: object, param: str) -> None:
    try:
        schema.check(value)
    except schema.SchemaError as exc:
        raise BadRequestError(
            f"'{param}': the simulator cannot generate values for this schema: {exc}",
            param,
            code=UNSUPPORTED,
        ) from None


def read_tool_choice(request: dict[str, Any], generation: Generation) -> None:
    """`tool_choice` (none, auto, required, a named function, allowed tools) and
    `parallel_tool_calls`; read after the tools."""
    choice = request.get("tool_choice")
    names = {tool.name for tool in generation.tools}
    if not isinstance(request.get("parallel_tool_calls"), bool | None):
        raise BadRequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    generation.parallel = request.get("parallel_tool_calls") is not False
    if choice is None or choice == "auto":
        return
    if choice == "none":
        generation.tool_choice = "none"
        return
    if choice == "required":
        if not generation.tools:
            raise BadRequestError("'tool_choice' is required but there are no 'tools'", "tools")
        generation.tool_choice = "required"
        return
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise BadRequestError(
                f"'tool_choice' names a function that is not in 'tools': {name!r}",
                "tool_choice",
            )
        generation.tool_choice, generation.forced = "required", name
        return
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = choice.get("allowed_tools")
        mode = allowed.get("mode") if isinstance(allowed, dict) else None
        listed = allowed.get("tools") if isinstance(allowed, dict) else None
        if mode not in ("auto", "required") or not isinstance(listed, list):
            raise BadRequestError(
                "'tool_choice.allowed_tools' must have a mode (auto or required) and tools",
                "tool_choice",
            )
        keep = set()
        for entry in listed:
            function = entry.get("function") if isinstance(entry, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if name not in names:
                raise BadRequestError(
                    f"'tool_choice.allowed_tools' names a function not in 'tools': {name!r}",
                    "tool_choice",
                )
            keep.add(name)
        generation.tools = tuple(t for t in generation.tools if t.name in keep)
        generation.tool_choice = str(mode)
        return
    raise BadRequestError(
        "'tool_choice' must be 'none', 'auto', 'required', a function or allowed tools",
        "tool_choice",
    )


def read_response_format(request: dict[str, Any], generation: Generation) -> None:
    """`response_format`: text, a JSON object, or JSON valid against a schema (checked now)."""
    response_format = request.get("response_format")
    if response_format is None:
        return
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        generation.json_schema = _JSON_OBJECT_SCHEMA
        return
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise BadRequestError(
                "'response_format.json_schema' must be an object", "response_format"
            )
        value = spec.get("schema", {})
        _check_schema(value, "response_format.json_schema.schema")
        generation.json_schema = value
        return
    raise BadRequestError(
        "'response_format.type' must be 'text', 'json_object' or 'json_schema'",
        "response_format",
        code=UNSUPPORTED if isinstance(kind, str) else None,
    )
