"""The OpenAPI document describes the real API: Schemathesis fuzzes a running gateway with it.

The gateway runs on a zero-delay simulated upstream, so every answer it gives is one the document
must describe, and no answer may be a 5xx.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import hypothesis
import jsonschema_rs
import orjson
import pytest
import requests
import schemathesis
from hypothesis.strategies import SearchStrategy
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Err
from schemathesis.core.transport import Response as CheckedResponse
from schemathesis.openapi.checks import JsonSchemaError
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.specs.openapi.schemas import OpenApiSchema

from gateway.admission.auth import hash_key
from gateway.api import LLM_ROUTES, PRIORITY_HEADER, TOTAL_BUDGET_HEADER, TTFT_BUDGET_HEADER
from gateway.api.openapi import build_openapi
from gateway.config import Settings
from tests.conftest import Gateway, Upstream, gateway_settings, run_gateway

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
MAX_BODY_BYTES = 1024 * 1024
EXAMPLES = {GenerationMode.POSITIVE: 20, GenerationMode.NEGATIVE: 8}
# A budget shorter than the gateway's own work is answered 504 by design; generated budgets are
# lifted above this, so that any 5xx in the fuzz is a bug.
MIN_BUDGET_MS = 5_000


def fuzz_settings(upstream: Upstream) -> Settings:
    return gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [
            {"name": "chat", "deployments": [{"provider": "up", "model": "m"}]},
            {
                "name": "bulk",
                "deployments": [{"provider": "up", "model": "b"}],
                "priority": "bulk",
                "batching": {"max_batch_size": 4, "max_wait_ms": 1},
                "fallbacks": ["chat"],
            },
        ],
        server={"max_body_bytes": MAX_BODY_BYTES},
    )


@pytest.fixture
async def gateway(upstream: Upstream) -> AsyncIterator[Gateway]:
    async with run_gateway(fuzz_settings(upstream)) as gateway:
        yield gateway


def load_schema(url: str) -> OpenApiSchema:
    """The document the running gateway serves, checked against the OpenAPI 3.1 schema."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json", timeout=10)
    schema.validate()
    return schema


def _integers_as_integers(value: Any) -> Any:
    # JSON Schema counts 5.0 as an integer; the gateway, like OpenAI, wants integer fields
    # spelled as integers (5.0 is a 400), which a schema cannot say.
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, dict):
        return {key: _integers_as_integers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integers_as_integers(item) for item in value]
    return value


def _prepare(case: Case[Any]) -> Case[Any]:
    if isinstance(case.body, dict | list):
        case.body = _integers_as_integers(case.body)
    for name in (TTFT_BUDGET_HEADER, TOTAL_BUDGET_HEADER):
        value = case.headers.get(name) if case.headers else None
        if isinstance(value, int) and not isinstance(value, bool) and value < MIN_BUDGET_MS:
            case.headers[name] = value + MIN_BUDGET_MS
        elif isinstance(value, str) and value.isdigit() and int(value) < MIN_BUDGET_MS:
            case.headers[name] = str(int(value) + MIN_BUDGET_MS)
    return case


def _fuzz(url: str) -> dict[str, dict[int, int]]:
    """Run every operation, positive and (with a body to break) negative; statuses seen."""
    schema = load_schema(url)
    seen: dict[str, dict[int, int]] = {}
    with requests.Session() as session:
        for result in schema.get_all_operations():
            if isinstance(result, Err):
                raise result.err()
            operation = result.ok()
            modes = [GenerationMode.POSITIVE]
            if operation.method.upper() == "POST":
                modes.append(GenerationMode.NEGATIVE)
            for mode in modes:
                statuses = seen.setdefault(f"{operation.label} {mode.value}", {})
                _run(url, session, operation.as_strategy(generation_mode=mode), mode, statuses)
    return seen


def _run(
    url: str,
    session: requests.Session,
    cases: SearchStrategy[Case[Any]],
    mode: GenerationMode,
    statuses: dict[int, int],
) -> None:
    @hypothesis.settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        derandomize=True,
        database=None,
        # No shrinking: a failure already comes with a curl line that reproduces it.
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=cases.map(_prepare))
    def run(case: Case[Any]) -> None:
        response = case.call_and_validate(base_url=url, session=session, checks=CHECKS, timeout=10)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    run()


# Every operation gets its examples: the run grows with the routes (about a minute on its own).
@pytest.mark.timeout(300)
@pytest.mark.slow
async def test_every_operation_answers_as_documented(gateway: Gateway) -> None:
    """Generated requests, valid and invalid, to every operation get no 5xx and only answers
    the document describes: statuses, media types, headers and bodies (each streamed event)."""
    seen = await asyncio.to_thread(_fuzz, gateway.url)
    llm = {
        label: statuses
        for label, statuses in seen.items()
        if label.split(" ")[0] == "POST" and label.split(" ")[1] in LLM_ROUTES
    }
    assert len(llm) == 2 * len(LLM_ROUTES)
    for label, statuses in llm.items():
        # Valid requests reach the answers, invalid ones the refusals.
        assert (200 if label.endswith("positive") else 400) in statuses, label


async def test_document_describes_the_gateway(gateway: Gateway) -> None:
    """The served document is valid OpenAPI 3.1 whose schemas are valid JSON Schema, with the
    LLM operations, the headers the gateway reads, and the configured model names."""
    schema = await asyncio.to_thread(load_schema, gateway.url)
    document = schema.raw_schema
    assert document["openapi"] == "3.1.0"
    for definition in document["components"]["schemas"].values():
        jsonschema_rs.meta.validate(definition)
    for path in LLM_ROUTES:
        operation = document["paths"][path]["post"]
        assert {"200", "400", "401", "403", "404", "413", "429", "502", "503", "504"} <= set(
            operation["responses"]
        )
        assert {"x-request-id", "x-tailguard-model"} <= set(
            operation["responses"]["200"]["headers"]
        )
    parameters = {p["name"] for p in document["components"]["parameters"].values()}
    assert {TTFT_BUDGET_HEADER, TOTAL_BUDGET_HEADER, PRIORITY_HEADER} <= parameters
    assert {"x-request-id", "traceparent"} <= parameters
    assert document["components"]["schemas"]["ModelName"]["enum"] == ["chat", "bulk"]
    # No keys configured: credentials are optional, which the empty requirement says.
    assert {} in document["paths"]["/v1/messages"]["post"]["security"]
    schemes = document["components"]["securitySchemes"]
    assert schemes["bearer"]["scheme"] == "bearer"
    assert schemes["apiKey"]["name"] == "x-api-key"


def _call(schema: OpenApiSchema, url: str, path: str, **case: Any) -> CheckedResponse:
    operation = schema[path]["POST"]
    return operation.Case(**case).call_and_validate(base_url=url, checks=CHECKS, timeout=10)


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "chat", "messages": [{"role": "user", "content": "Hi"}], **extra}


def _respond(**extra: Any) -> dict[str, Any]:
    return {"model": "chat", "input": "Hi", **extra}


_PARTS = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]


CANONICAL: list[tuple[str, dict[str, Any], dict[str, str], int]] = [
    ("/v1/chat/completions", _chat(), {}, 200),
    ("/v1/chat/completions", _chat(stream=True, stream_options={"include_usage": True}), {}, 200),
    ("/v1/completions", {"model": "chat", "prompt": "Hi"}, {}, 200),
    ("/v1/completions", {"model": "chat", "prompt": "Hi", "stream": True}, {}, 200),
    ("/v1/embeddings", {"model": "chat", "input": ["a", "b"]}, {}, 200),
    ("/v1/embeddings", {"model": "bulk", "input": "a"}, {}, 200),
    ("/v1/messages", {"model": "chat", "max_tokens": 5, "messages": _chat()["messages"]}, {}, 200),
    (
        "/v1/messages",
        {"model": "chat", "max_tokens": 5, "stream": True, "messages": _chat()["messages"]},
        {},
        200,
    ),
    ("/v1/chat/completions", _chat(model="nope"), {}, 404),
    ("/v1/messages", {"model": "nope", "max_tokens": 5, "messages": _chat()["messages"]}, {}, 404),
    ("/v1/chat/completions", _chat(stream="yes"), {}, 400),
    ("/v1/messages", {"model": "chat", "messages": _chat()["messages"]}, {}, 400),
    ("/v1/chat/completions", _chat(), {TTFT_BUDGET_HEADER: "0"}, 400),
    ("/v1/chat/completions", _chat(), {TOTAL_BUDGET_HEADER: "3600001"}, 400),
    ("/v1/chat/completions", _chat(), {TOTAL_BUDGET_HEADER: "3600000"}, 200),
    ("/v1/chat/completions", _chat(), {TTFT_BUDGET_HEADER: "9", TOTAL_BUDGET_HEADER: "8"}, 400),
    (
        "/v1/messages",
        {"model": "chat", "max_tokens": 5, "messages": [{}]},
        {PRIORITY_HEADER: "x"},
        400,
    ),
    ("/v1/chat/completions", _chat(max_tokens=0), {}, 400),  # the upstream refuses it
    ("/v1/embeddings", {"model": "chat", "input": "a", "stream": True}, {}, 400),
    ("/v1/responses", _respond(), {}, 200),
    ("/v1/responses", _respond(input=_PARTS, stream=True, max_output_tokens=16), {}, 200),
    ("/v1/responses", {"model": "chat"}, {}, 400),
    ("/v1/responses", _respond(model="nope"), {}, 404),
    ("/v1/responses", _respond(tools=[{"type": "web_search"}]), {}, 200),  # dropped, and said
    ("/v1/responses", _respond(conversation="conv_1"), {}, 404),  # no such conversation
    ("/v1/responses", _respond(max_output_tokens=15), {}, 400),
    ("/v1/chat/completions", _chat(filler="x" * MAX_BODY_BYTES), {}, 413),
    ("/v1/messages", {"model": "chat", "filler": "x" * MAX_BODY_BYTES}, {}, 413),
]


async def test_canonical_requests_answer_as_documented(gateway: Gateway) -> None:
    """Each endpoint's answers, streamed or not, and its refusals in its own wire's error shape
    (unknown model, wrong type, missing field, bad header, too large) match the document."""

    def call() -> list[tuple[str, int, int]]:
        schema = load_schema(gateway.url)
        return [
            (path, status, _call(schema, gateway.url, path, body=body, headers=headers).status_code)
            for path, body, headers, status in CANONICAL
        ]

    for path, expected, status in await asyncio.to_thread(call):
        assert status == expected, path


async def test_stored_responses_answer_as_documented(gateway: Gateway) -> None:
    """A response created through the gateway is read, listed and deleted as the document says;
    once deleted, reading or deleting it again is the documented 404."""

    def call() -> list[tuple[str, str, int]]:
        schema = load_schema(gateway.url)
        created = _call(schema, gateway.url, "/v1/responses", body=_respond(input=_PARTS))
        assert created.status_code == 200
        ids = {"response_id": orjson.loads(created.content)["id"]}
        steps = [
            ("/v1/responses/{response_id}", "GET", {}),
            ("/v1/responses/{response_id}/input_items", "GET", {"limit": 1, "order": "asc"}),
            ("/v1/responses/{response_id}", "DELETE", {}),
            ("/v1/responses/{response_id}", "GET", {}),
            ("/v1/responses/{response_id}", "DELETE", {}),
        ]
        seen = []
        for path, method, query in steps:
            case = schema[path][method].Case(path_parameters=ids, query=query)
            response = case.call_and_validate(base_url=gateway.url, checks=CHECKS, timeout=10)
            seen.append((method, path, response.status_code))
        return seen

    statuses = [status for _, _, status in await asyncio.to_thread(call)]
    assert statuses == [200, 200, 200, 404, 404]


async def test_every_documented_responses_field_is_taken_when_translated(gateway: Gateway) -> None:
    """Each field the document lists for `/v1/responses` is one the translation to chat takes
    (so `additionalProperties: false` refuses only what the gateway refuses)."""

    def call() -> int:
        schema = load_schema(gateway.url)
        fields = schema.raw_schema["components"]["schemas"]["ResponsesRequest"]["properties"]
        body = {**{name: None for name in fields}, **_respond()}
        return _call(schema, gateway.url, "/v1/responses", body=body).status_code

    assert await asyncio.to_thread(call) == 200


async def test_unparseable_json_is_a_documented_400(gateway: Gateway) -> None:
    """A body that is not JSON gets the documented 400 in the endpoint's own error shape."""

    def call() -> list[int]:
        schema = load_schema(gateway.url)
        statuses = []
        for path in LLM_ROUTES:
            raw = requests.post(gateway.url + path, data=b"{nope", timeout=10)
            schema[path]["POST"].Case(body={}).validate_response(raw, checks=CHECKS)
            statuses.append(raw.status_code)
        return statuses

    assert await asyncio.to_thread(call) == [400] * len(LLM_ROUTES)


def _tampered(response: CheckedResponse, content: bytes) -> CheckedResponse:
    headers = {name: list(values) for name, values in response.headers.items()}
    return CheckedResponse(
        status_code=response.status_code,
        headers=headers,
        content=content,
        request=response.request,
        elapsed=response.elapsed,
        verify=response.verify,
        encoding="utf-8",
    )


BAD_STREAMS: list[tuple[str, dict[str, Any], bytes]] = [
    (
        "/v1/responses",
        _respond(stream=True),
        b'event: response.created\ndata: {"type": "response.created", "response": {}}\n\n',
    ),
    (
        "/v1/responses",
        _respond(stream=True),
        b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", '
        b'"sequence_number": 3, "item_id": "msg_1", "output_index": 0, "delta": 7}\n\n',
    ),
    ("/v1/chat/completions", _chat(stream=True), b'data: {"choices": "no"}\n\ndata: [DONE]\n\n'),
    ("/v1/chat/completions", _chat(stream=True), b'data: {"error": {"message": 1}}\n\n'),
    ("/v1/completions", {"model": "chat", "prompt": "x", "stream": True}, b"data: [DONE!]\n\n"),
    (
        "/v1/messages",
        {"model": "chat", "max_tokens": 5, "stream": True, "messages": _chat()["messages"]},
        b'event: message_start\ndata: {"message": {}}\n\n',
    ),
    (
        "/v1/messages",
        {"model": "chat", "max_tokens": 5, "stream": True, "messages": _chat()["messages"]},
        b'event: error\ndata: {"type": "error", "error": {"type": "made_up", "message": ""}}\n\n',
    ),
]


async def test_stream_schemas_are_not_vacuous(gateway: Gateway) -> None:
    """The streamed-event schemas really constrain events: a real stream passes, the same
    response with a malformed event in it fails the response schema check."""

    def check(schema: OpenApiSchema, path: str, body: dict[str, Any], content: bytes) -> None:
        response = _call(schema, gateway.url, path, body=body)
        assert response.headers["content-type"][0].startswith("text/event-stream")
        case = schema[path]["POST"].Case(body=body)
        with pytest.raises(FailureGroup) as caught:
            case.validate_response(
                _tampered(response, content), checks=[response_schema_conformance]
            )
        assert [type(failure) for failure in caught.value.exceptions] == [JsonSchemaError]

    def check_all() -> None:
        schema = load_schema(gateway.url)
        for path, body, content in BAD_STREAMS:
            check(schema, path, body, content)

    await asyncio.to_thread(check_all)


def test_document_without_settings_leaves_model_open() -> None:
    """Built without settings (for tooling), `model` is any string and credentials optional."""
    document = build_openapi(lambda: {"openapi": "3.1.0", "info": {"title": "t", "version": "1"}})
    assert "enum" not in document["components"]["schemas"]["ModelName"]
    assert {} in document["paths"]["/v1/chat/completions"]["post"]["security"]


def test_keys_make_credentials_required() -> None:
    """With API keys configured, the document marks credentials as required."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": "http://127.0.0.1:9/v1"}},
        [{"name": "m", "deployments": [{"provider": "up", "model": "m"}]}],
        auth={"keys": [{"name": "team", "sha256": "a" * 64}]},
    )
    document = build_openapi(lambda: {"openapi": "3.1.0", "info": {}, "paths": {}}, settings)
    for path in LLM_ROUTES:
        security = document["paths"][path]["post"]["security"]
        assert {} not in security
        assert {"bearer": []} in security
    assert {"apiKey": []} in document["paths"]["/v1/messages"]["post"]["security"]
    # The document is public: with keys configured it does not list the model names.
    assert "enum" not in document["components"]["schemas"]["ModelName"]
    assert orjson.loads(orjson.dumps(document)) == document  # plain JSON all the way down


CLIENT_KEY, ADMIN_KEY = "tg-fuzz-client-key", "tg-fuzz-admin-key"


async def test_keys_and_rate_limits_answer_as_documented(upstream: Upstream) -> None:
    """With keys configured, missing, wrong and misplaced keys, an exhausted rate limit and the
    rate-limit headers on answers all match the document."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [{"name": "chat", "deployments": [{"provider": "up", "model": "m"}]}],
        auth={
            "keys": [{"name": "team", "sha256": hash_key(CLIENT_KEY), "rpm": 1}],
            "admin_keys": [{"name": "ops", "sha256": hash_key(ADMIN_KEY)}],
        },
    )
    bearer = {"authorization": f"Bearer {CLIENT_KEY}"}
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    llm = [
        ("/v1/chat/completions", {}, 401),
        ("/v1/chat/completions", {"authorization": "Bearer wrong"}, 401),
        ("/v1/chat/completions", admin, 403),
        ("/v1/messages", {}, 401),
        ("/v1/messages", {"x-api-key": CLIENT_KEY}, 200),
        ("/v1/chat/completions", bearer, 429),  # rpm 1, used by the request before
    ]
    admin_routes = [("/v1/models", {}, 401), ("/admin/latency", bearer, 403)]
    admin_routes.append(("/admin/latency", admin, 200))

    def call(url: str) -> list[tuple[str, int, int]]:
        schema = load_schema(url)
        seen = []
        for path, headers, status in llm:
            body = {**_chat(), "max_tokens": 5}
            response = _call(schema, url, path, body=body, headers=headers)
            seen.append((path, status, response.status_code))
        for path, headers, status in admin_routes:
            case = schema[path]["GET"].Case(headers=headers)
            response = case.call_and_validate(base_url=url, checks=CHECKS, timeout=10)
            seen.append((path, status, response.status_code))
        return seen

    async with run_gateway(settings) as keyed:
        for path, expected, status in await asyncio.to_thread(call, keyed.url):
            assert status == expected, path


async def test_a_wrong_method_names_the_allowed_ones(gateway: Gateway) -> None:
    """A method a route does not serve is a 405 whose `allow` header lists the ones it does."""
    async with httpx.AsyncClient(base_url=gateway.url) as client:
        llm = await client.get("/v1/chat/completions")
        health = await client.post("/healthz")
    assert (llm.status_code, llm.headers.get("allow")) == (405, "POST")
    assert (health.status_code, health.headers.get("allow")) == (405, "GET")
