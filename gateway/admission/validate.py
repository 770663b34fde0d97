"""Request checks at the edge: just the fields the gateway relies on, with OpenAI-style messages.

Everything else in a body is the upstream's business and is forwarded untouched, so every body
accepted must be one that can be forwarded and that means to the upstream what it meant here:
nested at most `MAX_JSON_DEPTH` levels (so any path may re-serialise or translate it), and with
no key twice in one object (parsers differ on which one counts; the gateway checks the last).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any, Final, TypeVar

import orjson

from gateway.errors import QUOTE_CHARS, BodyTooLargeError, InvalidRequestError, quote
from gateway.models import MAX_JSON_DEPTH, Call, Endpoint

__all__ = [
    "MAX_JSON_DEPTH",
    "OFF_LOOP_BYTES",
    "OUTPUT_LENGTH_FIELDS",
    "check_json_values",
    "check_messages",
    "invalid_type",
    "load_body",
    "missing_param",
    "off_loop",
    "parse_call",
]

T = TypeVar("T")

OFF_LOOP_BYTES: Final = 256 * 1024
"""Bodies at least this large are parsed, checked and translated in a worker thread (see
`off_loop`). Below it the thread hop costs more than it saves: a 256 KiB body of small
messages parses in about 5 ms."""


async def off_loop(size: int, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` for a body of `size` bytes: in a worker thread when the body is large, so
    that its Python-level work (checks, translation, estimates) leaves the event loop free: the
    thread gives up the GIL every few ms. A single C call, such as orjson's parse, holds the
    GIL throughout wherever it runs: that part is bounded only by the body limits."""
    if size < OFF_LOOP_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


def check_json_values(raw: bytes, limit: int, what: str) -> None:
    """Refuse, before parsing, a body that may hold more than `limit` JSON values: it has more
    commas and colons than that (an upper bound on its keys and array elements; punctuation
    inside strings counts too). Parsing costs per value, not per byte: this bounds it. Raises
    BodyTooLargeError."""
    found = raw.count(b",") + raw.count(b":")
    if found > limit:
        raise BodyTooLargeError(
            f"The {what} body is too large: it holds about {found} JSON values (commas and "
            f"colons), over the limit of {limit}."
        )


_ORJSON_MAX_DEPTH: Final = 254
# Serialising the body inside this many arrays fails exactly when it is nested too deeply.
_WRAPPING: Final = _ORJSON_MAX_DEPTH - MAX_JSON_DEPTH

OUTPUT_LENGTH_FIELDS: Final[dict[Endpoint, tuple[str, ...]]] = {
    # vLLM takes `max_completion_tokens or max_tokens`: both are output lengths, each is capped.
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "embeddings": (),
    "messages": ("max_tokens",),
    "responses": ("max_output_tokens",),
}
"""The fields of a body, by endpoint, whose value is the output length the request asks for."""

_TYPE_NAMES: Final[dict[type, str]] = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    list: "an array",
    dict: "an object",
    type(None): "null",
}


def invalid_type(param: str, expected: str, value: object) -> InvalidRequestError:
    got = _TYPE_NAMES.get(type(value), "a value")
    return InvalidRequestError(
        f"Invalid type for '{param}': expected {expected}, but got {got} instead.",
        param=param,
        code="invalid_type",
    )


def missing_param(param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def _optional_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid_type(name, "a boolean", value)
    return value


def _optional_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_type(name, "an integer", value)
    if value < minimum:
        raise InvalidRequestError(
            f"Invalid '{name}': integer below minimum value. Expected a value >= {minimum}, "
            f"but got {value} instead.",
            param=name,
            code="integer_below_min_value",
        )
    return value


def _required_list(body: dict[str, Any], name: str) -> list[Any]:
    if name not in body or body[name] is None:
        raise missing_param(name)
    value = body[name]
    if not isinstance(value, list):
        raise invalid_type(name, "an array", value)
    if not value:
        raise InvalidRequestError(
            f"Invalid '{name}': empty array. Expected an array with minimum length 1, "
            "but got an empty array instead.",
            param=name,
            code="empty_array",
        )
    return value


def check_messages(body: dict[str, Any]) -> None:
    for index, message in enumerate(_required_list(body, "messages")):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid_type(param, "an object", message)
        role = message.get("role")
        if role is None:
            raise missing_param(f"{param}.role")
        if not isinstance(role, str):
            raise invalid_type(f"{param}.role", "a string", role)


# Top-level fields of a Responses request and the JSON types each may have (null aside): the
# translation reads or echoes them into the Response object, so a wrong type must be refused
# here, naming the field, rather than forwarded or echoed back.
_RESPONSES_FIELDS: Final[dict[str, tuple[tuple[type, ...], str]]] = {
    "input": ((str, list), "a string or an array"),
    "instructions": ((str, list), "a string or an array"),
    "previous_response_id": ((str,), "a string"),
    "tools": ((list,), "an array"),
    "tool_choice": ((str, dict), "a string or an object"),
    "include": ((list,), "an array"),
    "text": ((dict,), "an object"),
    "reasoning": ((dict,), "an object"),
    "metadata": ((dict,), "an object"),
    "stream_options": ((dict,), "an object"),
    "user": ((str,), "a string"),
    "safety_identifier": ((str,), "a string"),
    "prompt_cache_key": ((str,), "a string"),
    "prompt_cache_retention": ((str,), "a string"),
    "service_tier": ((str,), "a string"),
    "truncation": ((str,), "a string"),
}


def _typed(value: object, param: str, types: tuple[type, ...], expected: str) -> None:
    """Refuse a non-null value of another JSON type (a boolean is no number here)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
        raise invalid_type(param, expected, value)


def _responses(body: dict[str, Any]) -> None:
    conversation = body.get("conversation")
    if conversation is not None:
        # Kept by the gateway (gateway/api/conversations.py), expanded into `input` before
        # routing as `previous_response_id` is; the two are exclusive, as OpenAI has them.
        named = conversation.get("id") if isinstance(conversation, dict) else conversation
        if not isinstance(named, str) or not named:
            raise invalid_type("conversation", "a conversation id or an object with one", named)
        if body.get("previous_response_id") is not None:
            raise InvalidRequestError(
                "Mutually exclusive parameters: provide only one of 'previous_response_id' "
                "or 'conversation'.",
                param="conversation",
                code="mutually_exclusive_parameters",
            )
    elif body.get("input") is None and body.get("previous_response_id") is None:
        raise missing_param("input")
    for name, (types, expected) in _RESPONSES_FIELDS.items():
        _typed(body.get(name), name, types, expected)
    for name in ("store", "parallel_tool_calls", "background"):
        _optional_bool(body, name)
    for name in ("temperature", "top_p"):
        _typed(body.get(name), name, (int, float), "a number")
    _optional_int(body, "top_logprobs", 0)
    for index, entry in enumerate(body.get("include") or ()):
        _typed(entry, f"include[{index}]", (str,), "a string")
    text = body.get("text") or {}
    _typed(text.get("format"), "text.format", (dict,), "an object")
    _typed(text.get("verbosity"), "text.verbosity", (str,), "a string")
    reasoning = body.get("reasoning") or {}
    for name in ("effort", "summary"):
        _typed(reasoning.get(name), f"reasoning.{name}", (str,), "a string")


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(
        f"The request body is nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays "
        "and objects are accepted.",
        code="json_too_deep",
    )


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InvalidRequestError(
                    f"The request body has the key {quote(key)} more than once in one object.",
                    param=key[:QUOTE_CHARS],
                    code="duplicate_key",
                )
            seen.add(key)
    return found


_ESCAPED_COLON: Final = re.compile(rb"\\u003[aA]")


def _count(data: bytes, byte: bytes) -> int:
    """How often `byte` occurs in `data`. `bytes.count` compares byte by byte; deleting them
    finds each with memchr, about ten times faster on a large body (and copies nothing when
    there are none)."""
    return len(data) - len(data.replace(byte, b""))


def load_body(raw: bytes) -> Any:
    """The parsed body, refused if it could not be forwarded as it was understood."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):
            raise _too_deep() from None
        raise InvalidRequestError(
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, "
            "but what was sent was not valid JSON.)",
            code="invalid_json",
        ) from None
    # One serialisation (C speed, a fraction of the parse) gives the body as parsed. When the
    # client sent it in the same compact form (JavaScript, httpx) the bytes are equal and no
    # key can have been dropped; otherwise its key-value pairs are counted against the raw
    # body's. Nested in `_WRAPPING` lists it also checks the depth; only a body with more
    # brackets than the limit can be that deep, so the others (nearly all) skip the wrapping.
    wrapped: Any = body
    if _count(raw, b"[") + _count(raw, b"{") > MAX_JSON_DEPTH:
        for _ in range(_WRAPPING):
            wrapped = [wrapped]
    try:
        parsed = orjson.dumps(wrapped)
    except orjson.JSONEncodeError:  # a parsed body can fail only on its depth
        raise _too_deep() from None
    if parsed == raw:
        return body
    # Every pair has one colon outside strings; strings keep theirs when re-serialised, except
    # a colon escaped as \u003a. Equal counts without that escape: no key was dropped.
    if _count(raw, b":") != _count(parsed, b":") or _ESCAPED_COLON.search(raw):
        json.loads(raw.decode(), object_pairs_hook=_unique_keys)  # the exact check, rarely needed
    return body


def parse_call(endpoint: Endpoint, raw: bytes) -> Call:
    """Parse and check a request body. Raises InvalidRequestError naming the offending param."""
    body = load_body(raw)
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.", code="invalid_type")
    model = body.get("model")
    if model is None:
        raise missing_param("model")
    if not isinstance(model, str):
        raise invalid_type("model", "a string", model)

    stream = _optional_bool(body, "stream")
    include_usage = False
    max_tokens: int | None = None
    n = 1
    if endpoint == "chat":
        check_messages(body)
        # Both may be sent, and servers differ on which wins: the larger is what may be used.
        lengths = [_optional_int(body, name, 0) for name in OUTPUT_LENGTH_FIELDS["chat"]]
        max_tokens = max((v for v in lengths if v is not None), default=None)
        n = _optional_int(body, "n", 1) or 1
    elif endpoint == "completions":
        prompt = body.get("prompt")
        if prompt is None:
            raise missing_param("prompt")
        if not isinstance(prompt, str | list):
            raise invalid_type("prompt", "a string or an array", prompt)
        max_tokens = _optional_int(body, "max_tokens", 0)
        n = _optional_int(body, "n", 1) or 1
        _optional_int(body, "best_of", 1)  # generated on the server: capped as `n` is
    elif endpoint == "embeddings":
        value = body.get("input")
        if value is None:
            raise missing_param("input")
        if not isinstance(value, str | list):
            raise invalid_type("input", "a string or an array", value)
        if isinstance(value, list) and not value:
            raise InvalidRequestError(
                "Invalid 'input': empty array. Expected an array with minimum length 1, "
                "but got an empty array instead.",
                param="input",
                code="empty_array",
            )
        if stream:
            raise InvalidRequestError(
                "Embeddings cannot be streamed.", param="stream", code="invalid_value"
            )
    elif endpoint == "responses":
        _responses(body)
        max_tokens = _optional_int(body, "max_output_tokens", 16)
    else:  # Anthropic Messages
        check_messages(body)
        if body.get("max_tokens") is None:
            raise missing_param("max_tokens")
        max_tokens = _optional_int(body, "max_tokens", 1)
        system = body.get("system")
        if system is not None and not isinstance(system, str | list):
            raise invalid_type("system", "a string or an array", system)

    if stream and endpoint in ("chat", "completions"):
        options = body.get("stream_options")
        if options is not None:
            if not isinstance(options, dict):
                raise invalid_type("stream_options", "an object", options)
            include_usage = _optional_bool(options, "include_usage")
    elif endpoint == "messages":
        include_usage = True  # Anthropic streams always carry usage
    return Call(
        endpoint=endpoint,
        model=model,
        body=body,
        raw=raw,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        n=n,
    )
