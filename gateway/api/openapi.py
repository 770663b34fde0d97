"""The OpenAPI document: the framework's own for the GET routes, hand-written for the rest.

The LLM endpoints are served by the edge middleware, outside the framework's routing, so only
`static/openapi.yaml` describes them: request bodies as `gateway.admission.validate` checks
them, the OpenAI and Anthropic shapes of their fields, and each answer, streamed or not. This
module merges that file into the framework's document and adds what follows from the code or the
config: the request headers the edge reads, the headers of every answer, every error status with
the body of the endpoint's wire, the configured model names, and whether credentials are
required.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, get_args

import yaml

from gateway.config import Priority, Settings
from gateway.errors import should_retry
from gateway.routing.plan import Route

Document = dict[str, Any]

SPEC_PATH: Final = Path(__file__).parent.parent / "static" / "openapi.yaml"

# Statuses an LLM endpoint answers besides 200, and when.
ERROR_STATUSES: Final[dict[int, str]] = {
    400: "The request is invalid: unparseable JSON, a wrong type or missing field (`param` "
    "names it), an invalid budget or priority header, or an upstream refused the request itself "
    "(its message, secrets scrubbed).",
    401: "A key is required and was missing or wrong (only when keys are configured).",
    403: "The key may not do this: an admin key calling a model, or a client key outside its "
    "models (only when keys are configured).",
    404: "The model does not exist (`code: model_not_found`; the message lists the names).",
    408: "The request's headers or body did not arrive within `server.read_timeout_s` (a "
    "refusal before the headers were read is OpenAI-shaped on every path, without request id).",
    413: "The body exceeds `server.max_body_bytes`, or an upstream refused it as too large.",
    422: "An upstream refused the request as unprocessable; its status and message are kept.",
    429: "The key went over its requests or tokens per minute, or every candidate deployment "
    "was rate-limited (`retry-after`).",
    431: "The request's headers exceed `server.max_header_bytes` (OpenAI-shaped on every path, "
    "without request id; the connection is closed).",
    500: "The gateway failed to process the request (a bug).",
    502: "Every candidate failed: connect failure, reset, an invalid upstream answer, or an "
    "upstream 401/403/404 (the message names the deployment).",
    503: "Too many requests in flight, every candidate was overloaded or is cooling down after "
    "failures (`code: deployments_cooling_down`, `retry-after`), or the gateway is shutting down.",
    504: "An upstream timed out, or the total budget ran out before the first token "
    "(`code: budget_exceeded`).",
}

# Request headers the edge reads on the LLM endpoints (components/parameters).
_LLM_PARAMETERS: Final = (
    "TTFTBudget",
    "TotalBudget",
    "SLOTTFT",
    "SLOTPOT",
    "Priority",
    "RequestId",
    "Traceparent",
    "AnthropicBeta",
    "StainlessRetryCount",
)

_ANTHROPIC_PATHS: Final = frozenset({"/v1/messages"})  # errors in Anthropic's shape
# Refused by the HTTP protocol layer, before the app sees the request: OpenAI-shaped whatever
# the path, and without a request id.
_PROTOCOL_STATUSES: Final = frozenset({408, 431})

_RATE_LIMIT_HEADERS: Final = {
    "OpenAI": {
        f"x-ratelimit-{part}-{kind}": f"RateLimit{part.title()}{kind.title()}"
        for kind in ("requests", "tokens")
        for part in ("limit", "remaining", "reset")
    },
    # Anthropic's spelling, on /v1/messages: the same counts, the reset as an RFC 3339 time.
    "Anthropic": {
        f"anthropic-ratelimit-{kind}-{part}": (
            "AnthropicRateLimitReset"
            if part == "reset"
            else f"RateLimit{part.title()}{kind.title()}"
        )
        for kind in ("requests", "tokens")
        for part in ("limit", "remaining", "reset")
    },
}


@functools.cache
def _hand_written() -> Document:
    document: Document = yaml.safe_load(SPEC_PATH.read_text(encoding="utf-8"))
    return document


def build_openapi(base: Callable[[], Document], settings: Settings | None = None) -> Document:
    """The whole document: `base()` (the framework's, not modified) with the hand-written part
    merged in. With `settings`, credentials are required when keys are configured, and `model`
    is an enum of the configured model names when they are not; without `settings`, `model` is
    any string and credentials are optional."""
    document = copy.deepcopy(base())
    spec = copy.deepcopy(_hand_written())
    document["openapi"] = "3.1.0"
    document.setdefault("info", {"title": "Tailguard", "version": "0"}).setdefault(
        "description",
        "A latency-aware LLM API gateway speaking the OpenAI and Anthropic wire formats. Every "
        "response carries `x-request-id`; every answer carries `x-tailguard-*` headers saying "
        "which deployment served and why. Credentials are required only when the gateway has "
        "keys configured (`auth`): client keys for `/v1/*`, admin keys for `/admin/*` and "
        "`/dashboard`.",
    )
    auth = settings.auth if settings is not None else None
    keys = auth is not None and bool(auth.keys or auth.admin_keys)

    components = spec["components"]
    if settings is not None and not keys:
        # With keys configured the names are not public (this document is served to anyone).
        components["schemas"]["ModelName"]["enum"] = [m.name for m in settings.models]
    components["parameters"]["Priority"]["schema"]["enum"] = list(get_args(Priority))
    components["headers"]["Route"]["schema"]["enum"] = list(get_args(Route))
    # The file's own responses (a route's particular answers) and one per error status and wire.
    components["responses"] = components.get("responses", {}) | _error_responses()
    merged = document.setdefault("components", {})
    for section, entries in components.items():
        merged.setdefault(section, {}).update(entries)

    paths = document.setdefault("paths", {})
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            errors = "Anthropic" if path in _ANTHROPIC_PATHS else "OpenAI"
            if method == "post" and not path.startswith("/v1/conversations"):
                _complete_llm_operation(operation, errors)
            else:
                for status in (*_PROTOCOL_STATUSES, 500):
                    operation["responses"][str(status)] = _response_ref(errors, status)
            if "security" in operation:
                for status in (401, 403):
                    operation["responses"][str(status)] = _response_ref(errors, status)
                if not keys:  # nothing is authenticated: the empty requirement says so
                    operation["security"].insert(0, {})
            known = paths.get(path, {}).get(method)
            if known is not None:
                known.update(operation)  # keeps the framework's summary and operationId
            elif method == "post":
                paths.setdefault(path, {})[method] = operation
    _add_count_operations(document, keys)
    return document


def _complete_llm_operation(operation: Document, errors: str) -> None:
    operation["parameters"] = [
        {"$ref": f"#/components/parameters/{name}"} for name in _LLM_PARAMETERS
    ]
    answer = operation["responses"]["200"]
    answer["headers"] = {
        "x-request-id": _header("RequestId"),
        "x-tailguard-model": _header("Model"),
        "x-tailguard-deployment": _header("Deployment"),
        "x-tailguard-route": _header("Route"),
        "x-tailguard-attempts": _header("Attempts"),
        "x-tailguard-overhead-ms": _header("OverheadMs"),
        "server-timing": _header("ServerTiming"),
        "x-upstream-request-id": _header("UpstreamRequestId"),
        "x-should-retry": _header("ShouldRetry"),
        "x-tailguard-dropped-tools": _header("DroppedTools"),
        **{name: _header(component) for name, component in _RATE_LIMIT_HEADERS[errors].items()},
    }
    for status in ERROR_STATUSES:
        operation["responses"][str(status)] = _response_ref(errors, status)


def _error_responses() -> Document:
    """One response per error status and wire, named like `OpenAI404`."""
    responses: Document = {}
    for errors in ("OpenAI", "Anthropic"):
        for status, description in ERROR_STATUSES.items():
            schema: Document = {"$ref": f"#/components/schemas/{errors}Error"}
            headers = {"x-request-id": _header("RequestId")}
            if status in _PROTOCOL_STATUSES:
                headers = {"x-request-id": _header("RequestIdIfRead")}
                if errors == "Anthropic":
                    schema = {"anyOf": [schema, {"$ref": "#/components/schemas/OpenAIError"}]}
            if status == 401:
                headers["www-authenticate"] = _header("WWWAuthenticate")
            if should_retry(status):
                headers["retry-after"] = _header("RetryAfter")
            if status == 429:
                headers.update({n: _header(c) for n, c in _RATE_LIMIT_HEADERS[errors].items()})
            headers["x-should-retry"] = _header("ShouldRetry")
            responses[f"{errors}{status}"] = {
                "description": description,
                "headers": headers,
                "content": {"application/json": {"schema": schema}},
            }
    return responses


def _header(name: str) -> Document:
    return {"$ref": f"#/components/headers/{name}"}


def _response_ref(errors: str, status: int) -> Document:
    return {"$ref": f"#/components/responses/{errors}{status}"}


# --- the token-counting endpoints ----------------------------------------------------------------

# Statuses a counting endpoint answers besides 200: no upstream failure is among them (every
# counter failing gives the estimate), nor a rate limit (counting is not charged).
_COUNT_STATUSES: Final = (400, 401, 403, 404, 408, 413, 422, 431, 500, 503)
_COUNT_SCHEMAS: Final[Document] = {
    "CountTokensRequest": {
        "type": "object",
        "description": "What `POST /v1/messages` would be sent, without generation settings.",
        "properties": {
            "model": {"$ref": "#/components/schemas/ModelName"},
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": {"$ref": "#/components/schemas/AnthropicMessage"},
            },
            "system": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"$ref": "#/components/schemas/AnthropicTextBlock"}},
                ]
            },
            "tools": {"type": "array", "items": {"$ref": "#/components/schemas/AnthropicTool"}},
            "tool_choice": {  # as on POST /v1/messages
                "type": "object",
                "properties": {
                    "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
                    "name": {"type": "string"},
                    "disable_parallel_tool_use": {"type": "boolean"},
                },
                "required": ["type"],
            },
        },
        "additionalProperties": True,
        "required": ["model", "messages"],
    },
    "InputTokensRequest": {
        "type": "object",
        "description": "What `POST /v1/responses` would be sent, without generation settings; "
        "`previous_response_id` counts the stored conversation too.",
        "properties": {
            "model": {"$ref": "#/components/schemas/ModelName"},
            "input": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "minItems": 1, "items": {"type": "object"}},
                ]
            },
            "instructions": {
                "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]
            },
            "tools": {"type": "array", "items": {"type": "object"}},
            "previous_response_id": {"type": "string"},
        },
        "additionalProperties": True,
        "required": ["model"],
        "anyOf": [{"required": ["input"]}, {"required": ["previous_response_id"]}],
    },
    "TokenCount": {
        "type": "object",
        "properties": {
            "input_tokens": {"type": "integer", "minimum": 0},
            "estimated": {"const": True, "description": "Present when no counter answered."},
        },
        "additionalProperties": False,
        "required": ["input_tokens"],
    },
    "InputTokenCount": {
        "type": "object",
        "properties": {
            "object": {"const": "response.input_tokens"},
            "input_tokens": {"type": "integer", "minimum": 0},
            "estimated": {"const": True, "description": "Present when no counter answered."},
        },
        "additionalProperties": False,
        "required": ["object", "input_tokens"],
    },
}
_COUNT_HEADERS: Final[Document] = {
    "TokenCountSource": {
        "description": "`upstream`: a deployment's own counter answered; `estimate`: none could "
        "(about four characters a token).",
        "required": True,
        "schema": {"type": "string", "enum": ["upstream", "estimate"]},
    },
    "CountingDeployment": {
        "description": "`<provider>/<model>` whose counter answered (absent for an estimate).",
        "required": False,
        "schema": {"type": "string"},
    },
}
# path → (operationId, summary, errors' wire, request schema, answer schema, security schemes)
_COUNT_OPERATIONS: Final = {
    "/v1/messages/count_tokens": (
        "countMessageTokens",
        "Anthropic token counting",
        "Anthropic",
        "CountTokensRequest",
        "TokenCount",
        ("bearer", "apiKey"),
    ),
    "/v1/responses/input_tokens": (
        "countResponseInputTokens",
        "OpenAI Responses input token counting",
        "OpenAI",
        "InputTokensRequest",
        "InputTokenCount",
        ("bearer",),
    ),
}


def _add_count_operations(document: Document, keys: bool) -> None:
    """The counting endpoints: the model's deployments' own counters, else an estimate."""
    components = document["components"]
    components.setdefault("schemas", {}).update(copy.deepcopy(_COUNT_SCHEMAS))
    components.setdefault("headers", {}).update(copy.deepcopy(_COUNT_HEADERS))
    for path, (
        operation_id,
        summary,
        errors,
        request,
        answer,
        schemes,
    ) in _COUNT_OPERATIONS.items():
        security: list[Document] = [{scheme: []} for scheme in schemes]
        if not keys:
            security.insert(0, {})
        responses: Document = {
            "200": {
                "description": "The count, from the first deployment whose counter answered, "
                "else an estimate.",
                "headers": {
                    "x-request-id": _header("RequestId"),
                    "x-tailguard-model": _header("Model"),
                    "x-tailguard-token-count": _header("TokenCountSource"),
                    "x-tailguard-deployment": _header("CountingDeployment"),
                },
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{answer}"}}
                },
            }
        }
        for status in _COUNT_STATUSES:
            responses[str(status)] = _response_ref(errors, status)
        document.setdefault("paths", {}).setdefault(path, {})["post"] = {
            "operationId": operation_id,
            "summary": summary,
            "description": "Counts the request's input tokens with the model's deployments' own "
            "counters, in order; nothing is generated. Errors are "
            f"{errors}-shaped.",
            "tags": ["LLM"],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}
                },
            },
            "security": security,
            "responses": responses,
        }
