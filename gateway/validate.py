"""Request checks at the edge: just the fields the gateway relies on, with OpenAI-style messages.

Everything else in a body is the upstream's business and is forwarded untouched.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from gateway.errors import InvalidRequestError
from gateway.models import Call, Endpoint

_TYPE_NAMES: Final[dict[type, str]] = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    list: "an array",
    dict: "an object",
    type(None): "null",
}


def _invalid_type(param: str, expected: str, value: object) -> InvalidRequestError:
    got = _TYPE_NAMES.get(type(value), "a value")
    return InvalidRequestError(
        f"Invalid type for '{param}': expected {expected}, but got {got} instead.",
        param=param,
        code="invalid_type",
    )


def _missing(param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def _optional_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _invalid_type(name, "a boolean", value)
    return value


def _optional_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid_type(name, "an integer", value)
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
        raise _missing(name)
    value = body[name]
    if not isinstance(value, list):
        raise _invalid_type(name, "an array", value)
    if not value:
        raise InvalidRequestError(
            f"Invalid '{name}': empty array. Expected an array with minimum length 1, "
            "but got an empty array instead.",
            param=name,
            code="empty_array",
        )
    return value


def _messages(body: dict[str, Any]) -> None:
    for index, message in enumerate(_required_list(body, "messages")):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _invalid_type(param, "an object", message)
        role = message.get("role")
        if role is None:
            raise _missing(f"{param}.role")
        if not isinstance(role, str):
            raise _invalid_type(f"{param}.role", "a string", role)


def parse_call(endpoint: Endpoint, raw: bytes) -> Call:
    """Parse and check a request body. Raises InvalidRequestError naming the offending param."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequestError(
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, "
            "but what was sent was not valid JSON.)",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.", code="invalid_type")
    model = body.get("model")
    if model is None:
        raise _missing("model")
    if not isinstance(model, str):
        raise _invalid_type("model", "a string", model)

    stream = _optional_bool(body, "stream")
    include_usage = False
    max_tokens: int | None = None
    n = 1
    if endpoint == "chat":
        _messages(body)
        max_tokens = _optional_int(body, "max_completion_tokens", 0)
        if max_tokens is None:
            max_tokens = _optional_int(body, "max_tokens", 0)
        n = _optional_int(body, "n", 1) or 1
    elif endpoint == "completions":
        prompt = body.get("prompt")
        if prompt is None:
            raise _missing("prompt")
        if not isinstance(prompt, str | list):
            raise _invalid_type("prompt", "a string or an array", prompt)
        max_tokens = _optional_int(body, "max_tokens", 0)
        n = _optional_int(body, "n", 1) or 1
    elif endpoint == "embeddings":
        value = body.get("input")
        if value is None:
            raise _missing("input")
        if not isinstance(value, str | list):
            raise _invalid_type("input", "a string or an array", value)
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
    else:  # Anthropic Messages
        _messages(body)
        if body.get("max_tokens") is None:
            raise _missing("max_tokens")
        max_tokens = _optional_int(body, "max_tokens", 1)
        system = body.get("system")
        if system is not None and not isinstance(system, str | list):
            raise _invalid_type("system", "a string or an array", system)

    if stream and endpoint in ("chat", "completions"):
        options = body.get("stream_options")
        if options is not None:
            if not isinstance(options, dict):
                raise _invalid_type("stream_options", "an object", options)
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
