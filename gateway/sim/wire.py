"""The OpenAI wire as the simulator speaks it: request bodies read and checked, replies, errors.

Reading a request validates it completely before anything is drawn or waited for, in a fixed
order (the first problem found is the one reported), and turns it into a small typed value the
engine plans from. Every refusal is a `BadRequestError`, rendered once as OpenAI's error object.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from gateway.sim.profile import SimProfile

__all__ = [
    "INBAND_ERROR",
    "JSON_HEADERS",
    "SSE_HEADERS",
    "BadRequestError",
    "ChatRequest",
    "CompletionsRequest",
    "EmbeddingsRequest",
    "SimConnectionReset",
    "SimReply",
    "error_body",
    "json_reply",
    "model_name",
    "parse_body",
    "rate_limited_reply",
    "read_chat",
    "read_completions",
    "read_embeddings",
    "server_error_reply",
]

JSON_HEADERS: Final = {"content-type": "application/json"}
SSE_HEADERS: Final = {"content-type": "text/event-stream", "cache-control": "no-cache"}
_MAX_N: Final = 128  # OpenAI's limit


class SimConnectionReset(Exception):  # noqa: N818 - the name is the public contract
    """The simulated server drops the connection (before headers, or mid-stream)."""


@dataclass(slots=True)
class SimReply:
    """One response: a complete JSON `body`, or a `stream` of SSE frames (never both).

    `stream` is an async generator of complete SSE events. It may raise `SimConnectionReset` part
    way (a cut stream). Whoever abandons it early must `aclose()` it: that frees its batch slot
    and counts it as cancelled.
    """

    status: int
    headers: dict[str, str]
    body: bytes | None = None
    stream: AsyncGenerator[bytes, None] | None = None


class BadRequestError(Exception):
    """A request refused before any work: rendered as an `invalid_request_error` at `status`."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        *,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def json_reply(status: int, body: bytes, headers: Mapping[str, str] = JSON_HEADERS) -> SimReply:
    return SimReply(status, dict(headers), body)


def rate_limited_reply(retry_after_s: float) -> SimReply:
    """A simulated 429, with `retry-after` in whole seconds when it is whole."""
    body = error_body(
        "Rate limit reached (simulated).", "rate_limit_error", None, "rate_limit_exceeded"
    )
    whole = retry_after_s == int(retry_after_s)
    retry_text = str(int(retry_after_s)) if whole else str(retry_after_s)
    return json_reply(429, body, {**JSON_HEADERS, "retry-after": retry_text})


def server_error_reply() -> SimReply:
    """A simulated 500."""
    body = error_body(
        "The server had an error while processing your request (simulated).", "server_error"
    )
    return json_reply(500, body)


INBAND_ERROR: Final = error_body(
    "The model failed to generate a response (simulated in-band error).",
    "server_error",
    None,
    "inband_error",
)
"""The error object a 200 answers with (in the body, or as the stream's first event)."""


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(request, dict):
        raise BadRequestError("the body must be a JSON object")
    return request


def model_name(request: dict[str, Any]) -> str:
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("'model' must be a non-empty string", "model")
    return model


# The checked requests are built once per request and never changed; they are not frozen
# because a frozen dataclass takes about four times as long to build.


@dataclass(slots=True)
class ChatRequest:
    """A chat completions request, checked."""

    messages: object  # as sent: under a seed, their JSON is what the text is a function of
    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    seed: int | None


@dataclass(slots=True)
class CompletionsRequest:
    """A completions request, checked: one or more prompts, `per_prompt` choices each."""

    prompts: list[tuple[bytes, int]]  # (key, tokens) per prompt; the key identifies its text
    max_tokens: int | None
    stream: bool
    include_usage: bool
    seed: int | None
    per_prompt: int  # `n`: choices per prompt


@dataclass(slots=True)
class EmbeddingsRequest:
    """An embeddings request, checked."""

    inputs: list[tuple[bytes, int]]  # (key, tokens) per input
    base64: bool
    dims: int


def read_chat(request: dict[str, Any], profile: SimProfile) -> ChatRequest:
    messages = request.get("messages")
    prompt_tokens = _text_tokens(_message_chars(messages))
    _check_context(profile.max_input_tokens, (prompt_tokens,), "messages")
    max_tokens = _max_tokens(request)
    stream = _stream_flag(request)
    usage = _include_usage(request)
    seed = _seed(request)
    return ChatRequest(messages, prompt_tokens, max_tokens, stream, usage, seed)


def read_completions(request: dict[str, Any], profile: SimProfile) -> CompletionsRequest:
    prompts = _pieces(request.get("prompt"), "prompt")
    _check_context(profile.max_input_tokens, [t for _, t in prompts], "prompt")
    max_tokens = _max_tokens(request)
    stream = _stream_flag(request)
    usage = _include_usage(request)
    seed = _seed(request)
    per_prompt = _choices_per_prompt(request)
    if stream and len(prompts) > 1:
        raise BadRequestError("streaming supports a single prompt only", "prompt")
    if stream and per_prompt > 1:
        raise BadRequestError("streaming supports n = 1 only", "n")
    return CompletionsRequest(prompts, max_tokens, stream, usage, seed, per_prompt)


def read_embeddings(request: dict[str, Any], profile: SimProfile) -> EmbeddingsRequest:
    inputs = _pieces(request.get("input"), "input")
    _check_context(profile.max_input_tokens, [t for _, t in inputs], "input")
    encoding = request.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise BadRequestError("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dims = request.get("dimensions") or profile.embedding_dims
    if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= 65536:
        raise BadRequestError("'dimensions' must be an integer in [1, 65536]", "dimensions")
    return EmbeddingsRequest(inputs, encoding == "base64", dims)


def _text_tokens(chars: int) -> int:
    return max(1, (chars + 3) // 4)


def _message_chars(messages: object) -> int:
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("'messages' must be a non-empty array of messages", "messages")
    chars = 0
    for message in messages:
        if not isinstance(message, dict):
            raise BadRequestError("each message must be an object", "messages")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(text := part.get("text"), str):
                    chars += len(text)
        elif content is not None:
            raise BadRequestError("a message's 'content' must be a string or an array", "messages")
    return chars


def _pieces(value: object, param: str) -> list[tuple[bytes, int]]:
    """Prompts or embedding inputs as (key, tokens): a string, strings, token array(s).

    The key identifies the text (it hashes embedding vectors and seeded completions): a string's
    UTF-8 bytes, or a NUL byte and the JSON of a token array.
    """
    if isinstance(value, str):
        return [(value.encode(), _text_tokens(len(value)))]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [(v.encode(), _text_tokens(len(v))) for v in value]
        if all(isinstance(v, int) for v in value):
            return [(b"\x00" + orjson.dumps(value), len(value))]
        if all(isinstance(v, list) and v and all(isinstance(t, int) for t in v) for v in value):
            return [(b"\x00" + orjson.dumps(v), len(v)) for v in value]
    raise BadRequestError(
        f"'{param}' must be a string, an array of strings or an array of token arrays", param
    )


def _check_context(limit: int | None, tokens: Sequence[int], param: str) -> None:
    """Reject the whole request when any one input is longer than the profile's limit."""
    if limit is None:
        return
    for i, count in enumerate(tokens):
        if count > limit:
            where = f"{param} {i}" if len(tokens) > 1 else f"the {param}"
            raise BadRequestError(
                f"This model's maximum context length is {limit} tokens, however you requested "
                f"{count} tokens ({count} in {where}). Please reduce the length of the {param}.",
                param,
                code="context_length_exceeded",
            )


def _seed(request: dict[str, Any]) -> int | None:
    seed = request.get("seed")
    if seed is None:
        return None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise BadRequestError("'seed' must be an integer", "seed")
    return seed


def _choices_per_prompt(request: dict[str, Any]) -> int:
    n = request.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= _MAX_N:
        raise BadRequestError(f"'n' must be an integer in [1, {_MAX_N}]", "n")
    return n


def _max_tokens(request: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = request.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequestError(f"'{name}' must be an integer >= 1", name)
        return value
    return None


def _include_usage(request: dict[str, Any]) -> bool:
    options = request.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BadRequestError("'stream_options' must be an object", "stream_options")
    return options.get("include_usage") is True


def _stream_flag(request: dict[str, Any]) -> bool:
    stream = request.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be a boolean", "stream")
    return stream
