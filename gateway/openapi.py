"""The OpenAPI document: the framework's own for the GET routes, written out for the LLM endpoints.

The LLM endpoints are served by the edge middleware, outside the framework's routing, so nothing
describes them unless this module does. Request bodies are described as `gateway.validate` checks
them (required fields, types, ranges) plus the OpenAI and Anthropic shapes their fields take; the
gateway forwards any other field untouched, so every object stays open to more properties.
Streamed answers are `text/event-stream`; their schema describes one event (`data`, and `event`
when the wire names events), as OpenAPI 3.2's `itemSchema` does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Final, Literal, get_args

from gateway.config import Priority, Settings
from gateway.routing.plan import Route

Schema = dict[str, Any]

MAX_BUDGET_MS: Final = 3_600_000  # the same bound the edge checks budget headers against
REQUEST_ID_PATTERN: Final = r"^[A-Za-z0-9._:\-]{1,128}$"

_Wire = Literal["openai", "anthropic"]

# Statuses an LLM endpoint answers besides 200, and when.
_ERROR_STATUSES: Final[dict[int, str]] = {
    400: "The request is invalid: unparseable JSON, a wrong type or missing field (`param` "
    "names it), an invalid budget or priority header, or an upstream refused the request itself "
    "(its message, secrets scrubbed).",
    401: "A gateway API key is required and was missing or wrong (only when keys are configured).",
    403: "The key may not do this: an admin key calling a model, or a client key outside its "
    "models (only when keys are configured).",
    404: "The model does not exist (`code: model_not_found`; the message lists the names).",
    408: "The request body did not arrive within `server.read_timeout_s`.",
    413: "The body exceeds `server.max_body_bytes`, or an upstream refused it as too large.",
    422: "An upstream refused the request as unprocessable; its status and message are kept.",
    429: "The key went over its requests or tokens per minute, or every candidate deployment "
    "was rate-limited (`retry-after`).",
    431: "The request headers are too large.",
    500: "The gateway failed to process the request (a bug).",
    502: "Every candidate failed: connect failure, reset, an invalid upstream answer, or an "
    "upstream 401/403/404 (the message names the deployment).",
    503: "Too many requests in flight, every candidate was overloaded or is cooling down after "
    "failures (`code: deployments_cooling_down`, `retry-after`), or the gateway is shutting down.",
    504: "An upstream timed out, or the total budget ran out before the first token "
    "(`code: budget_exceeded`).",
}

_ANTHROPIC_ERROR_TYPES: Final = (
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
    "timeout_error",
)

_ANTHROPIC_EVENTS: Final = (
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
    "ping",
    "error",
)


def build_openapi(
    base: Callable[[], dict[str, Any]], settings: Settings | None = None
) -> dict[str, Any]:
    """The whole document: `base()` (the framework's, left unchanged) extended with the LLM
    endpoints. With `settings`, `model` is an enum of the configured model names, and credentials
    are marked required when API keys are configured."""
    document = copy.deepcopy(base())
    document["openapi"] = "3.1.0"
    info = document.setdefault("info", {"title": "Tailguard", "version": "0"})
    info.setdefault(
        "description",
        "A latency-aware LLM API gateway speaking the OpenAI and Anthropic wire formats. "
        "Every response carries `x-request-id`; answers carry `x-tailguard-*` headers saying "
        "which deployment served and why. Credentials are required only when the gateway has "
        "API keys configured (`auth`): client keys for `/v1/*`, admin keys for `/admin/*` and "
        "`/dashboard`.",
    )
    names = [m.name for m in settings.models] if settings is not None else None
    auth = settings.auth if settings is not None else None
    keys = auth is not None and bool(auth.keys or auth.admin_keys)
    paths = document.setdefault("paths", {})
    for path, item in paths.items():
        get = item.get("get")
        if get is not None and path in _GET_RESPONSES:
            get["responses"] = _GET_RESPONSES[path](names)
            guard = _GUARDED_GETS.get(path)
            if guard is not None:
                get["responses"].update(
                    {str(s): {"$ref": f"#/components/responses/OpenAI{s}"} for s in (401, 403)}
                )
                get["security"] = _security(guard, keys)
    paths.update(_llm_paths(keys))
    components = document.setdefault("components", {})
    components.setdefault("schemas", {}).update(_schemas(names))
    components.setdefault("parameters", {}).update(_PARAMETERS)
    components.setdefault("headers", {}).update(_HEADERS)
    components.setdefault("responses", {}).update(_error_responses())
    components.setdefault("securitySchemes", {}).update(_SECURITY_SCHEMES)
    return document


# --- small builders ------------------------------------------------------------------------------


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _or_null(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _object(properties: dict[str, Schema], required: tuple[str, ...] = (), **extra: Any) -> Schema:
    schema: Schema = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = list(required)
    return schema


def _header(name: str) -> Schema:
    return {"$ref": f"#/components/headers/{name}"}


def _json(schema: Schema) -> dict[str, Schema]:
    return {"application/json": {"schema": schema}}


_STRING: Final[Schema] = {"type": "string"}
_INTEGER: Final[Schema] = {"type": "integer"}
_BOOLEAN_OR_NULL: Final[Schema] = {"type": ["boolean", "null"]}


# --- request bodies ------------------------------------------------------------------------------


def _model(names: list[str] | None) -> Schema:
    schema: Schema = {
        "type": "string",
        "description": "A configured model name (`GET /v1/models`).",
    }
    if names is not None:
        schema["enum"] = names
    return schema


def _count(minimum: int, description: str) -> Schema:
    return {"type": ["integer", "null"], "minimum": minimum, "description": description}


def _chat_request(names: list[str] | None) -> Schema:
    return _object(
        {
            "model": _model(names),
            "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
            "stream": {**_BOOLEAN_OR_NULL, "default": False},
            "stream_options": {
                **_object({"include_usage": _BOOLEAN_OR_NULL}, additionalProperties=True),
                "type": ["object", "null"],
                "description": "Read when `stream` is true: `include_usage` adds a final "
                "usage chunk.",
            },
            "max_tokens": _count(0, "Upper bound on generated tokens."),
            "max_completion_tokens": _count(0, "Takes precedence over `max_tokens`."),
            "n": _count(1, "Choices to generate."),
            "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
            "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
            "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
            "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
            "stop": _stop(),
            "seed": {"type": ["integer", "null"]},
            "user": _STRING,
            "tools": {"type": "array", "items": _ref("ChatTool")},
            "tool_choice": {
                "anyOf": [
                    {"type": "string", "enum": ["none", "auto", "required"]},
                    _object(
                        {
                            "type": {"const": "function"},
                            "function": _object({"name": _STRING}, ("name",)),
                        },
                        ("type", "function"),
                    ),
                ]
            },
            "parallel_tool_calls": _BOOLEAN_OR_NULL,
            "response_format": _object(
                {
                    "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                    "json_schema": _object(
                        {"name": _STRING, "schema": {"type": "object"}, "strict": _BOOLEAN_OR_NULL},
                        ("name",),
                    ),
                },
                ("type",),
            ),
        },
        ("model", "messages"),
        additionalProperties=True,
    )


def _stop() -> Schema:
    return {
        "anyOf": [
            _STRING,
            {"type": "array", "items": _STRING, "maxItems": 4},
            {"type": "null"},
        ]
    }


def _chat_message() -> Schema:
    return _object(
        {
            "role": {
                "type": "string",
                "enum": ["system", "developer", "user", "assistant", "tool", "function"],
                "description": "The gateway itself checks only that this is a string; "
                "the deployment decides which roles it accepts.",
            },
            "content": {
                "anyOf": [
                    _STRING,
                    {"type": "array", "items": _ref("ChatContentPart")},
                    {"type": "null"},
                ]
            },
            "name": _STRING,
            "tool_call_id": _STRING,
            "tool_calls": {"type": "array", "items": _ref("ChatToolCall")},
            "refusal": {"type": ["string", "null"]},
        },
        ("role",),
        additionalProperties=True,
    )


def _chat_content_part() -> Schema:
    return {
        "anyOf": [
            _object({"type": {"const": "text"}, "text": _STRING}, ("type", "text")),
            _object(
                {
                    "type": {"const": "image_url"},
                    "image_url": _object(
                        {"url": _STRING, "detail": {"enum": ["auto", "low", "high"]}}, ("url",)
                    ),
                },
                ("type", "image_url"),
            ),
            _object(
                {
                    "type": {"const": "input_audio"},
                    "input_audio": _object(
                        {"data": _STRING, "format": {"enum": ["wav", "mp3"]}}, ("data", "format")
                    ),
                },
                ("type", "input_audio"),
            ),
            _object(
                {
                    "type": {"const": "file"},
                    "file": _object(
                        {"file_data": _STRING, "file_id": _STRING, "filename": _STRING}
                    ),
                },
                ("type", "file"),
            ),
            _object({"type": {"const": "refusal"}, "refusal": _STRING}, ("type", "refusal")),
        ]
    }


def _chat_tool_call() -> Schema:
    return _object(
        {
            "id": _STRING,
            "type": {"const": "function"},
            "function": _object({"name": _STRING, "arguments": _STRING}, ("name", "arguments")),
        },
        ("id", "type", "function"),
    )


def _chat_tool() -> Schema:
    return _object(
        {
            "type": {"const": "function"},
            "function": _object(
                {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "description": _STRING,
                    "parameters": {"type": "object"},
                    "strict": _BOOLEAN_OR_NULL,
                },
                ("name",),
            ),
        },
        ("type", "function"),
    )


def _tokens_or_text() -> Schema:
    """A prompt or embedding input: text, texts, token ids, or arrays of token ids."""
    tokens = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    return {
        "anyOf": [
            _STRING,
            {"type": "array", "minItems": 1, "items": _STRING},
            tokens,
            {"type": "array", "minItems": 1, "items": tokens},
        ]
    }


def _completion_request(names: list[str] | None) -> Schema:
    return _object(
        {
            "model": _model(names),
            "prompt": _tokens_or_text(),
            "stream": {**_BOOLEAN_OR_NULL, "default": False},
            "stream_options": {
                **_object({"include_usage": _BOOLEAN_OR_NULL}, additionalProperties=True),
                "type": ["object", "null"],
            },
            "max_tokens": _count(0, "Upper bound on generated tokens per choice."),
            "n": _count(1, "Choices per prompt."),
            "echo": _BOOLEAN_OR_NULL,
            "suffix": {"type": ["string", "null"]},
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
            "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
            "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
            "stop": _stop(),
            "seed": {"type": ["integer", "null"]},
            "user": _STRING,
        },
        ("model", "prompt"),
        additionalProperties=True,
    )


def _embedding_request(names: list[str] | None) -> Schema:
    return _object(
        {
            "model": _model(names),
            "input": _tokens_or_text(),
            "encoding_format": {"type": "string", "enum": ["float", "base64"]},
            "dimensions": {"type": "integer", "minimum": 1},
            "user": _STRING,
            "stream": {
                "enum": [False, None],
                "description": "Embeddings cannot be streamed: `true` is a 400.",
            },
        },
        ("model", "input"),
        additionalProperties=True,
    )


def _messages_request(names: list[str] | None) -> Schema:
    return _object(
        {
            "model": _model(names),
            "messages": {"type": "array", "minItems": 1, "items": _ref("AnthropicMessage")},
            "max_tokens": {"type": "integer", "minimum": 1},
            "system": {"anyOf": [_STRING, {"type": "array", "items": _ref("AnthropicTextBlock")}]},
            "stream": {**_BOOLEAN_OR_NULL, "default": False},
            "stop_sequences": {"type": "array", "items": _STRING},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 0},
            "metadata": _object({"user_id": {"type": ["string", "null"]}}),
            "tools": {"type": "array", "items": _ref("AnthropicTool")},
            "tool_choice": _object(
                {
                    "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
                    "name": _STRING,
                    "disable_parallel_tool_use": {"type": "boolean"},
                },
                ("type",),
            ),
        },
        ("model", "messages", "max_tokens"),
        additionalProperties=True,
    )


def _anthropic_message() -> Schema:
    """A user turn or an assistant turn; each role has its own kinds of content block."""
    note = "The gateway itself checks only that `role` is a string."
    return {
        "anyOf": [
            _object(
                {"role": {"const": role}, "content": {"anyOf": [_STRING, blocks]}},
                ("role", "content"),
                additionalProperties=True,
                description=note,
            )
            for role, blocks in (
                ("user", {"type": "array", "items": _ref("AnthropicUserBlock")}),
                ("assistant", {"type": "array", "items": _ref("AnthropicAssistantBlock")}),
            )
        ]
    }


def _anthropic_text_block() -> Schema:
    return _object(
        {"type": {"const": "text"}, "text": _STRING}, ("type", "text"), additionalProperties=True
    )


def _anthropic_user_block() -> Schema:
    image_source = {
        "anyOf": [
            _object(
                {
                    "type": {"const": "base64"},
                    "media_type": {"enum": ["image/jpeg", "image/png", "image/gif", "image/webp"]},
                    "data": _STRING,
                },
                ("type", "media_type", "data"),
            ),
            _object({"type": {"const": "url"}, "url": _STRING}, ("type", "url")),
        ]
    }
    document_source = {
        "anyOf": [
            _object(
                {
                    "type": {"const": "base64"},
                    "media_type": {"const": "application/pdf"},
                    "data": _STRING,
                },
                ("type", "media_type", "data"),
            ),
            _object(
                {"type": {"const": "text"}, "media_type": {"const": "text/plain"}, "data": _STRING},
                ("type", "media_type", "data"),
            ),
            _object({"type": {"const": "url"}, "url": _STRING}, ("type", "url")),
        ]
    }
    return {
        "anyOf": [
            _ref("AnthropicTextBlock"),
            _object({"type": {"const": "image"}, "source": image_source}, ("type", "source")),
            _object(
                {"type": {"const": "document"}, "source": document_source, "title": _STRING},
                ("type", "source"),
            ),
            _object(
                {
                    "type": {"const": "tool_result"},
                    "tool_use_id": _STRING,
                    "content": {
                        "anyOf": [_STRING, {"type": "array", "items": _ref("AnthropicTextBlock")}]
                    },
                    "is_error": {"type": "boolean"},
                },
                ("type", "tool_use_id"),
            ),
        ]
    }


def _anthropic_assistant_block() -> Schema:
    return {
        "anyOf": [
            _ref("AnthropicTextBlock"),
            _object(
                {
                    "type": {"const": "tool_use"},
                    "id": _STRING,
                    "name": _STRING,
                    "input": {"type": "object"},
                },
                ("type", "id", "name", "input"),
            ),
            _object(
                {"type": {"const": "thinking"}, "thinking": _STRING, "signature": _STRING},
                ("type", "thinking", "signature"),
            ),
            _object({"type": {"const": "redacted_thinking"}, "data": _STRING}, ("type", "data")),
        ]
    }


def _anthropic_tool() -> Schema:
    return _object(
        {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "description": _STRING,
            "input_schema": {"type": "object"},
        },
        ("name", "input_schema"),
        additionalProperties=True,
    )


# --- response bodies -----------------------------------------------------------------------------


def _usage() -> Schema:
    count = {"type": "integer", "minimum": 0}
    return _object(
        {"prompt_tokens": count, "completion_tokens": count, "total_tokens": count},
        ("prompt_tokens", "total_tokens"),
    )


def _openai_object(kind: str, choice: Schema) -> Schema:
    return _object(
        {
            "id": _STRING,
            "object": {"const": kind},
            "created": _INTEGER,
            "model": _STRING,
            "choices": {"type": "array", "items": choice},
            "usage": _or_null(_ref("Usage")),
        },
        ("id", "object", "created", "model", "choices"),
    )


def _choice(**fields: Schema) -> Schema:
    return _object(
        {"index": _INTEGER, "finish_reason": {"type": ["string", "null"]}, **fields},
        ("index", *fields),
    )


def _chat_completion() -> Schema:
    message = _object(
        {
            "role": {"const": "assistant"},
            "content": {"type": ["string", "null"]},
            "tool_calls": {"type": "array", "items": _ref("ChatToolCall")},
            "refusal": {"type": ["string", "null"]},
        },
        ("role",),
    )
    return _openai_object("chat.completion", _choice(message=message))


def _embedding_list() -> Schema:
    return _object(
        {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": _object(
                    {
                        "object": {"const": "embedding"},
                        "index": _INTEGER,
                        "embedding": {
                            "anyOf": [
                                {"type": "array", "items": {"type": "number"}},
                                {"type": "string", "description": "base64 float32 values"},
                            ]
                        },
                    },
                    ("object", "index", "embedding"),
                ),
            },
            "model": _STRING,
            "usage": _ref("Usage"),
        },
        ("object", "data", "model"),
    )


def _anthropic_response() -> Schema:
    return _object(
        {
            "id": _STRING,
            "type": {"const": "message"},
            "role": {"const": "assistant"},
            "model": _STRING,
            "content": {"type": "array", "items": _object({"type": _STRING}, ("type",))},
            "stop_reason": {"type": ["string", "null"]},
            "stop_sequence": {"type": ["string", "null"]},
            "usage": _object(
                {"input_tokens": _INTEGER, "output_tokens": _INTEGER}, ("output_tokens",)
            ),
        },
        ("id", "type", "role", "model", "content", "stop_reason", "usage"),
    )


def _anthropic_stream_data() -> Schema:
    return {
        **_object({"type": {"type": "string", "enum": list(_ANTHROPIC_EVENTS)}}, ("type",)),
        "if": _object({"type": {"const": "error"}}, ("type",)),
        "then": _object({"error": _ref("AnthropicErrorDetail")}, ("error",)),
    }


def _openai_error() -> Schema:
    return _object(
        {
            "error": _object(
                {
                    "message": _STRING,
                    "type": _STRING,
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                ("message", "type", "param", "code"),
            )
        },
        ("error",),
    )


def _anthropic_error() -> Schema:
    return _object(
        {"type": {"const": "error"}, "error": _ref("AnthropicErrorDetail")}, ("type", "error")
    )


def _openai_event(chunk: str) -> Schema:
    """One OpenAI stream event: a chunk, the error that ends a stream cut short, or [DONE]."""
    return _object(
        {
            "data": {
                "type": "string",
                "if": {"const": "[DONE]"},
                "else": {
                    "contentMediaType": "application/json",
                    "contentSchema": {"anyOf": [_ref(chunk), _ref("OpenAIError")]},
                },
            }
        },
        ("data",),
        description="One server-sent event. The stream ends with `data: [DONE]`; a stream that "
        "fails after it began ends with one error object and no `[DONE]`.",
    )


def _anthropic_event() -> Schema:
    return _object(
        {
            "event": {"type": "string", "enum": list(_ANTHROPIC_EVENTS)},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": _ref("AnthropicStreamData"),
            },
        },
        ("event", "data"),
        description="One server-sent event of the Messages stream; a stream that fails after "
        "it began ends with an `error` event.",
    )


def _schemas(names: list[str] | None) -> dict[str, Schema]:
    chunk_choice = _choice(delta={"type": "object"})
    text_choice = _choice(text=_STRING)
    return {
        "ChatCompletionRequest": _chat_request(names),
        "ChatMessage": _chat_message(),
        "ChatContentPart": _chat_content_part(),
        "ChatToolCall": _chat_tool_call(),
        "ChatTool": _chat_tool(),
        "CompletionRequest": _completion_request(names),
        "EmbeddingRequest": _embedding_request(names),
        "MessagesRequest": _messages_request(names),
        "AnthropicMessage": _anthropic_message(),
        "AnthropicTextBlock": _anthropic_text_block(),
        "AnthropicUserBlock": _anthropic_user_block(),
        "AnthropicAssistantBlock": _anthropic_assistant_block(),
        "AnthropicTool": _anthropic_tool(),
        "Usage": _usage(),
        "ChatCompletion": _chat_completion(),
        "ChatCompletionChunk": _openai_object("chat.completion.chunk", chunk_choice),
        "Completion": _openai_object("text_completion", text_choice),
        "CompletionChunk": _openai_object("text_completion", text_choice),
        "EmbeddingList": _embedding_list(),
        "AnthropicResponse": _anthropic_response(),
        "AnthropicStreamData": _anthropic_stream_data(),
        "OpenAIError": _openai_error(),
        "AnthropicError": _anthropic_error(),
        "AnthropicErrorDetail": _object(
            {"type": {"enum": list(_ANTHROPIC_ERROR_TYPES)}, "message": _STRING},
            ("type", "message"),
        ),
        "ChatCompletionEvent": _openai_event("ChatCompletionChunk"),
        "CompletionEvent": _openai_event("CompletionChunk"),
        "AnthropicEvent": _anthropic_event(),
        "ModelList": _object(
            {
                "object": {"const": "list"},
                "data": {
                    "type": "array",
                    "items": _object(
                        {
                            "id": _model(names),
                            "object": {"const": "model"},
                            "created": _INTEGER,
                            "owned_by": _STRING,
                        },
                        ("id", "object", "created", "owned_by"),
                    ),
                },
            },
            ("object", "data"),
        ),
    }


# --- parameters, headers, security ---------------------------------------------------------------


def _budget_parameter(name: str, what: str) -> Schema:
    return {
        "name": name,
        "in": "header",
        "required": False,
        "description": f"Overrides the model's {what} budget, in whole milliseconds. Any other "
        "value is a 400 naming the header; a TTFT budget above the total budget is a 400 too.",
        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_BUDGET_MS},
    }


_PARAMETERS: Final[dict[str, Schema]] = {
    "TTFTBudget": _budget_parameter("x-tailguard-ttft-budget-ms", "first-token"),
    "TotalBudget": _budget_parameter("x-tailguard-total-budget-ms", "total"),
    "Priority": {
        "name": "x-tailguard-priority",
        "in": "header",
        "required": False,
        "description": "Overrides the model's priority class (case-insensitive); any other "
        "value is a 400. Bulk requests may be micro-batched or wait for admission.",
        "schema": {"type": "string", "enum": list(get_args(Priority))},
    },
    "RequestId": {
        "name": "x-request-id",
        "in": "header",
        "required": False,
        "description": "Kept (and sent upstream) when it matches the pattern; otherwise the "
        "gateway makes a new one. Returned on every response.",
        "schema": {"type": "string", "pattern": REQUEST_ID_PATTERN},
    },
    "Traceparent": {
        "name": "traceparent",
        "in": "header",
        "required": False,
        "description": "W3C trace context, forwarded upstream when valid (all-zero ids are "
        "not); an invalid one is ignored.",
        "schema": {"type": "string", "pattern": "^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"},
    },
    "AnthropicBeta": {
        "name": "anthropic-beta",
        "in": "header",
        "required": False,
        "description": "Forwarded to Anthropic deployments only.",
        "schema": _STRING,
    },
    "StainlessRetryCount": {
        "name": "x-stainless-retry-count",
        "in": "header",
        "required": False,
        "description": "Sent by the OpenAI and Anthropic SDKs: above 0, the request is the "
        "client's own retry, which is failed over but never hedged.",
        "schema": {"type": "integer", "minimum": 0},
    },
}


def _response_header(description: str, schema: Schema, *, required: bool) -> Schema:
    return {"description": description, "required": required, "schema": schema}


_HEADERS: Final[dict[str, Schema]] = {
    "RequestId": _response_header(
        "The request's id (the client's when valid).",
        {"type": "string", "pattern": REQUEST_ID_PATTERN},
        required=True,
    ),
    "Model": _response_header(
        "The model that served (differs from the requested one after a fallback).",
        _STRING,
        required=True,
    ),
    "Deployment": _response_header("`<provider>/<model>` that served.", _STRING, required=True),
    "Route": _response_header(
        "Why the serving deployment was tried.",
        {"type": "string", "enum": list(get_args(Route))},
        required=True,
    ),
    "Attempts": _response_header(
        "Upstream attempts made.", {"type": "integer", "minimum": 1}, required=True
    ),
    "OverheadMs": _response_header(
        "Gateway time before the first upstream request plus relaying the committing event.",
        {"type": "number", "minimum": 0},
        required=True,
    ),
    "ServerTiming": _response_header(
        "`route`, one `attemptN` per attempt, `connect`, and `ttft` or `upstream`.",
        _STRING,
        required=True,
    ),
    "UpstreamRequestId": _response_header(
        "The upstream's own request id, when it sent one.",
        {"type": "string", "pattern": REQUEST_ID_PATTERN},
        required=False,
    ),
    "ShouldRetry": _response_header(
        "The gateway already tried more than one deployment: SDKs should not retry.",
        {"type": "string", "enum": ["false"]},
        required=False,
    ),
    "RetryAfter": _response_header(
        "Seconds to wait before retrying.", {"type": "integer", "minimum": 0}, required=False
    ),
    "WWWAuthenticate": _response_header(
        "`Bearer`, or `Basic` on the admin routes (so a browser asks for the admin key).",
        _STRING,
        required=True,
    ),
    **{
        f"RateLimit{part.title()}{kind.title()}": _response_header(
            f"The key's {kind} per minute: {what}.",
            schema,
            required=False,
        )
        for kind in ("requests", "tokens")
        for part, what, schema in (
            ("limit", "the limit", {"type": "integer", "minimum": 0}),
            ("remaining", "what is left", {"type": "integer", "minimum": 0}),
            ("reset", "when it is full again, as a duration such as `6m0s`", _STRING),
        )
    },
}

_RATE_LIMIT_HEADERS: Final[dict[str, Schema]] = {
    f"x-ratelimit-{part}-{kind}": _header(f"RateLimit{part.title()}{kind.title()}")
    for kind in ("requests", "tokens")
    for part in ("limit", "remaining", "reset")
}

_SECURITY_SCHEMES: Final[dict[str, Schema]] = {
    "bearer": {
        "type": "http",
        "scheme": "bearer",
        "description": "A gateway API key as `Authorization: Bearer <key>`; required only when "
        "the gateway has API keys configured (`auth.keys`).",
    },
    "apiKey": {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "A gateway API key, as Anthropic SDKs send it (`/v1/messages`); required "
        "only when the gateway has API keys configured (`auth.keys`).",
    },
    "basic": {
        "type": "http",
        "scheme": "basic",
        "description": "An admin key as the password (any user name), what a browser sends "
        "for the dashboard; required only when the gateway has API keys configured.",
    },
}

# Routes the framework serves that need a key once keys are configured, and which schemes.
_GUARDED_GETS: Final[dict[str, tuple[str, ...]]] = {
    "/v1/models": ("bearer",),
    "/admin/latency": ("bearer", "basic"),
    "/dashboard": ("bearer", "basic"),
}


def _security(schemes: tuple[str, ...], keys: bool) -> list[Schema]:
    # Without keys configured requests are not authenticated: the empty requirement says so.
    return ([] if keys else [{}]) + [{scheme: []} for scheme in schemes]


# --- operations ----------------------------------------------------------------------------------


def _error_responses() -> dict[str, Schema]:
    responses: dict[str, Schema] = {}
    for wire, schema in (("OpenAI", "OpenAIError"), ("Anthropic", "AnthropicError")):
        for status, description in _ERROR_STATUSES.items():
            headers = {"x-request-id": _header("RequestId")}
            if status == 401:
                headers["www-authenticate"] = _header("WWWAuthenticate")
            if status in (429, 503):
                headers["retry-after"] = _header("RetryAfter")
            if status == 429:
                headers.update(_RATE_LIMIT_HEADERS)
            if status >= 429:
                headers["x-should-retry"] = _header("ShouldRetry")
            responses[f"{wire}{status}"] = {
                "description": description,
                "headers": headers,
                "content": _json(_ref(schema)),
            }
    return responses


def _success_headers() -> dict[str, Schema]:
    return {
        "x-request-id": _header("RequestId"),
        "x-tailguard-model": _header("Model"),
        "x-tailguard-deployment": _header("Deployment"),
        "x-tailguard-route": _header("Route"),
        "x-tailguard-attempts": _header("Attempts"),
        "x-tailguard-overhead-ms": _header("OverheadMs"),
        "server-timing": _header("ServerTiming"),
        "x-upstream-request-id": _header("UpstreamRequestId"),
        "x-should-retry": _header("ShouldRetry"),
        **_RATE_LIMIT_HEADERS,
    }


def _operation(
    *,
    operation_id: str,
    summary: str,
    description: str,
    body: str,
    answer: str,
    event: str | None,
    wire: _Wire,
    keys: bool,
) -> Schema:
    content: dict[str, Schema] = _json(_ref(answer))
    if event is not None:
        content["text/event-stream"] = {"schema": _ref(event)}
    parameters = ["TTFTBudget", "TotalBudget", "Priority", "RequestId", "Traceparent"]
    parameters += ["AnthropicBeta", "StainlessRetryCount"]
    errors = "OpenAI" if wire == "openai" else "Anthropic"
    schemes = ("bearer", "apiKey") if wire == "anthropic" else ("bearer",)
    return {
        "operationId": operation_id,
        "summary": summary,
        "description": description,
        "tags": ["LLM"],
        "parameters": [{"$ref": f"#/components/parameters/{name}"} for name in parameters],
        "requestBody": {"required": True, "content": _json(_ref(body))},
        "security": _security(schemes, keys),
        "responses": {
            "200": {
                "description": "The answer, as the serving deployment produced it (translated "
                "when its wire differs)."
                + (" Streamed as server-sent events when `stream` is true." if event else ""),
                "headers": _success_headers(),
                "content": content,
            },
            **{
                str(status): {"$ref": f"#/components/responses/{errors}{status}"}
                for status in _ERROR_STATUSES
            },
        },
    }


def _llm_paths(keys: bool) -> dict[str, Schema]:
    return {
        "/v1/chat/completions": {
            "post": _operation(
                operation_id="createChatCompletion",
                summary="OpenAI chat completion",
                description="Served by OpenAI-compatible, vLLM, Anthropic (translated) and "
                "simulated deployments, streaming or not.",
                body="ChatCompletionRequest",
                answer="ChatCompletion",
                event="ChatCompletionEvent",
                wire="openai",
                keys=keys,
            )
        },
        "/v1/completions": {
            "post": _operation(
                operation_id="createCompletion",
                summary="OpenAI legacy completion",
                description="Served by OpenAI-compatible, vLLM and simulated deployments.",
                body="CompletionRequest",
                answer="Completion",
                event="CompletionEvent",
                wire="openai",
                keys=keys,
            )
        },
        "/v1/embeddings": {
            "post": _operation(
                operation_id="createEmbedding",
                summary="OpenAI embeddings",
                description="Never streamed.",
                body="EmbeddingRequest",
                answer="EmbeddingList",
                event=None,
                wire="openai",
                keys=keys,
            )
        },
        "/v1/messages": {
            "post": _operation(
                operation_id="createMessage",
                summary="Anthropic Messages",
                description="Passed through to Anthropic deployments, translated for the "
                "others. Errors are Anthropic-shaped.",
                body="MessagesRequest",
                answer="AnthropicResponse",
                event="AnthropicEvent",
                wire="anthropic",
                keys=keys,
            )
        },
    }


# --- the framework's GET routes ------------------------------------------------------------------


def _get(description: str, content: dict[str, Schema]) -> dict[str, Schema]:
    return {
        "200": {
            "description": description,
            "headers": {"x-request-id": _header("RequestId")},
            "content": content,
        }
    }


def _open(required: tuple[str, ...] = (), **properties: Schema) -> Schema:
    return _object(properties, required, additionalProperties=True)


_GET_RESPONSES: Final[dict[str, Callable[[list[str] | None], dict[str, Schema]]]] = {
    "/v1/models": lambda names: _get("The configured model names.", _json(_ref("ModelList"))),
    "/admin/latency": lambda names: _get(
        "Rolling percentiles per deployment and model, cooldowns, the store's health, the "
        "configured models and request counters.",
        _json(
            _open(
                ("deployments", "models", "store", "config", "counters"),
                deployments={"type": "object"},
                models={"type": "object"},
                store={"type": "object"},
                config={"type": "object"},
                counters={"type": "object"},
            )
        ),
    ),
    "/dashboard": lambda names: _get(
        "The live dashboard, one self-contained page.", {"text/html": {"schema": _STRING}}
    ),
    "/metrics": lambda names: _get(
        "Prometheus text exposition.", {"text/plain": {"schema": _STRING}}
    ),
    "/healthz": lambda names: _get("Liveness.", _json(_open(("status",), status={"const": "ok"}))),
    "/readyz": lambda names: _get(
        "Readiness, with providers, models, the latency store and the config's state (still 200 "
        "when the store is degraded: requests do not depend on it).",
        _json(
            _open(
                ("status", "providers", "models", "latency_store", "config"),
                status={"const": "ready"},
                providers={"type": "array", "items": _STRING},
                models={"type": "array", "items": _STRING},
                latency_store={"type": "object"},
                config={"type": "object"},
            )
        ),
    ),
}
