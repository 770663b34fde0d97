"""What the gateway writes, checked against the official API schemas that `llm-comply` bundles
(its version is pinned in pyproject.toml): OpenAI's OpenAPI document for the chat wire, the Open
Responses specification for the Responses API, Anthropic's OpenAPI document for Messages.

`validate(wire, schema_name, obj)` checks one object; `validate_stream(wire, body)` parses an SSE
body and checks every event against the schema its type names (chat chunks, Responses events,
Messages events), as well as each event's `event:` line against its `type`.

OpenAPI 3.0's `nullable: true` is read as OpenAI's own answers and SDKs read it: null is
admitted beside an `enum` (`finish_reason: null` on every chunk but the last) and beside a `$ref`
(`usage: null` on the chunks before the usage chunk) too, where llm-comply's loader admits it
only beside a `type`. Nothing else in the documents is changed.

One liberty, stated where it is taken: OpenAI's API and its SDKs name the reasoning text events
`response.reasoning_text.delta`/`.done`, which the Open Responses specification calls
`response.reasoning.delta`/`.done` with the same fields. Those are checked against the
specification's schema for the same fields (the OpenAI document bundled here predates them).
"""

from __future__ import annotations

import contextlib
import functools
import json
import pathlib
import tempfile
import warnings
from collections.abc import AsyncIterator
from typing import Any, Final, Literal

import llm_comply  # type: ignore[import-untyped]  # ships no type information
import orjson
from llm_comply.schema import (  # type: ignore[import-untyped]
    SSE_EVENT_TO_SCHEMA,
    SpecLoader,
)

from tests.conftest import Gateway, gateway_settings, run_gateway, serve
from tests.fakes.anthropic_upstream import AnthropicFake

SchemaWire = Literal["chat", "responses", "messages"]

SPECS: Final = pathlib.Path(llm_comply.__file__).parent / "specs"
_FILES: Final[dict[SchemaWire, str]] = {
    "chat": "openai_chat.json",
    "responses": "openresponses.json",
    "messages": "anthropic.json",
}
# Responses event types the specification spells differently (see the module docstring).
_RESPONSES_ALIASES: Final = {
    "response.reasoning_text.delta": "response.reasoning.delta",
    "response.reasoning_text.done": "response.reasoning.done",
}
_MESSAGES_EVENTS: Final = {
    "message_start": "MessageStartEvent",
    "content_block_start": "ContentBlockStartEvent",
    "content_block_delta": "ContentBlockDeltaEvent",
    "content_block_stop": "ContentBlockStopEvent",
    "message_delta": "MessageDeltaEvent",
    "message_stop": "MessageStopEvent",
    "error": "ErrorResponse",
}
ERROR_SCHEMAS: Final[dict[SchemaWire, tuple[SchemaWire, str]]] = {
    "chat": ("chat", "ErrorResponse"),
    "responses": ("chat", "ErrorResponse"),  # the Responses API's errors are OpenAI's
    "messages": ("messages", "ErrorResponse"),
}


def _nullable(node: Any) -> Any:
    """`nullable: true` beside an `enum` or a `$ref` made explicit (see the module docstring)."""
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable(value) for key, value in node.items()}
    if node.get("nullable") is True:
        if "enum" in node and None not in node["enum"]:
            node["enum"] = [*node["enum"], None]
        if "$ref" in node:
            ref = {"$ref": node.pop("$ref")}
            node.pop("nullable")
            return {"anyOf": [ref, {"type": "null"}], **node}
    return node


@functools.cache
def spec(wire: SchemaWire) -> SpecLoader:
    document = json.loads((SPECS / _FILES[wire]).read_text())
    document["components"] = _nullable(document.get("components", {}))
    with tempfile.TemporaryDirectory() as folder:  # the loader reads the document whole
        path = pathlib.Path(folder) / _FILES[wire]
        path.write_text(json.dumps(document))
        return SpecLoader(str(path))


def problems(wire: SchemaWire, schema_name: str, obj: Any) -> list[str]:
    """What the schema `schema_name` of `wire`'s document refuses in `obj` (empty: valid)."""
    loader = spec(wire)
    if loader.get_schema(schema_name) is None:
        return [f"{wire}: no schema named {schema_name!r}"]
    with warnings.catch_warnings():
        # llm-comply resolves `$ref`s with jsonschema's RefResolver, deprecated but working.
        warnings.simplefilter("ignore", DeprecationWarning)
        found: list[str] = loader.validate(obj, schema_name)
        return found


def validate(wire: SchemaWire, schema_name: str, obj: Any) -> None:
    """Fail naming every refusal when `obj` is not valid by the schema."""
    found = problems(wire, schema_name, obj)
    assert not found, f"not a valid {wire} {schema_name}: {found}\n{_short(obj)}"


def validate_error(wire: SchemaWire, obj: Any) -> None:
    """An error body as the wire's official error schema describes it."""
    document, name = ERROR_SCHEMAS[wire]
    validate(document, name, obj)


def parse_sse(body: bytes | str) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of each event in an SSE body; `[DONE]` is kept as a string."""
    text = body.decode() if isinstance(body, bytes) else body
    events: list[tuple[str | None, Any]] = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            joined = "\n".join(data)
            events.append((name, joined if joined == "[DONE]" else orjson.loads(joined)))
    return events


def stream_schema(wire: SchemaWire, data: dict[str, Any]) -> tuple[SchemaWire, str]:
    """The document and schema one stream event is checked against."""
    if wire == "chat":
        if "error" in data:
            return "chat", "ErrorResponse"
        return "chat", "CreateChatCompletionStreamResponse"
    kind = str(data.get("type"))
    if wire == "responses":
        return "responses", SSE_EVENT_TO_SCHEMA.get(_RESPONSES_ALIASES.get(kind, kind), kind)
    return "messages", _MESSAGES_EVENTS.get(kind, kind)


def validate_stream(wire: SchemaWire, body: bytes | str | list[tuple[str | None, Any]]) -> None:
    """Every event of a stream valid by its schema; a typed event's `event:` line names it."""
    events = body if isinstance(body, list) else parse_sse(body)
    assert events, "an empty stream"
    found: list[str] = []
    for index, (name, data) in enumerate(events):
        if data == "[DONE]" or (wire == "messages" and data == {"type": "ping"}):
            continue  # `ping` has no schema of its own in Anthropic's document
        typed = isinstance(data, dict) and "type" in data and wire != "chat"
        if typed and name is not None and name != data["type"]:
            found.append(f"event {index}: `event: {name}` but type {data['type']!r}")
        document, schema = stream_schema(wire, data)
        if wire == "responses" and data.get("type") in _RESPONSES_ALIASES:
            data = {**data, "type": _RESPONSES_ALIASES[data["type"]]}
        found += [f"event {index} ({schema}): {p}" for p in problems(document, schema, data)]
    assert not found, f"invalid {wire} stream events: {found}\n{_short(events)}"


def _short(obj: Any) -> str:
    text = orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode()
    return text if len(text) < 4000 else text[:4000] + "..."


ANTHROPIC_KEY: Final = "sk-ant-api03-configured-upstream-key-0123456789"


@contextlib.asynccontextmanager
async def wire_gateway(reasoning_model: str, *more: tuple[str, str, str]) -> AsyncIterator[Gateway]:
    """A gateway over the simulator (chat; `reasoning_model` a simulated model that reasons)
    and the Messages fake behind translated deployments (`claude`, and `claude-tools`, which
    always calls a tool); `more`: further (name, provider, model) deployments."""
    fake = AnthropicFake(api_key=ANTHROPIC_KEY)
    async with serve(fake) as anthropic_url:
        providers = {
            "local": {"type": "simulated", "default_profile": {"output_tokens": 6}},
            "thinking": {
                "type": "simulated",
                "default_profile": {"output_tokens": 6, "reasoning_tokens": 4},
            },
            "anthropic": {"type": "anthropic", "base_url": anthropic_url, "api_key": ANTHROPIC_KEY},
        }
        models = [
            {"name": name, "deployments": [{"provider": p, "model": m}]}
            for name, p, m in (
                ("sim", "local", "sim"),
                (reasoning_model, "thinking", "sim"),
                ("claude", "anthropic", "claude-x"),
                ("claude-tools", "anthropic", "claude-x@tool"),
                *more,
            )
        ]
        async with run_gateway(gateway_settings(providers, models)) as gw:
            yield gw
