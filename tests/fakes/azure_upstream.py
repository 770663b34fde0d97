"""A fake of Azure OpenAI's chat completions API, as a bare ASGI app, written from Azure's REST
reference (data-plane inference, 2024-10-21, and the v1 API).

Paths: `POST /openai/deployments/{deployment}/chat/completions?api-version=<date>` (the
api-version must be one the fake knows, else Azure's 404 / 400) and
`POST /openai/v1/chat/completions` (the deployment is the body's `model`; no dated
api-version); the Responses API at `/openai/v1/responses` and
`/openai/responses?api-version=2025-04-01-preview`, answered by `ResponsesFake`.

Auth: the `api-key` header, or `Authorization: Bearer <token>` where the token is one of
`tokens` (mutable: a test rotates them); anything else is Azure's 401 body, which echoes what it
received (the worst case for a gateway that forwards error text).

Answers are shaped like Azure's: a stream's first event has empty `choices` and
`prompt_filter_results`; every choice carries `content_filter_results`; after the finish an
event whose choice holds only filter results and offsets (the asynchronous filter's
annotation); usage (with `prompt_tokens_details.cached_tokens`) when `stream_options.
include_usage` asks. A body has `prompt_filter_results` and per-choice filter results.

The deployment's name is its script, by prefix:

- anything: a text answer (`WORDS`). With `tools`, a `tool_calls` answer calling the first tool
  with `TOOL_ARGS`; when the last message is a `tool` result, `AFTER_TOOL_TEXT`.
- `filtered-...`: 400 with code `content_filter` (the prompt tripped the filter).
- `unsafe-...`: the answer stops after two words with `finish_reason: content_filter`.
- `busy-...`: 429 with `retry-after-ms: 30000` and `retry-after: 30` (Azure's throttling).
- `slow-...`: waits `slow_ms` before answering (the pause ends when the client leaves).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qs, unquote

import orjson

from tests.fakes.asgi import Watched, incoming
from tests.fakes.responses_upstream import ResponsesFake

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

API_VERSIONS: Final = frozenset({"2024-10-21", "2025-04-01-preview"})
WORDS: Final = ("Hello", " from", " the", " fake", " Azure", " deployment.")
TOOL_ARGS: Final = '{"city": "Paris"}'
AFTER_TOOL_TEXT: Final = "It is sunny in Paris."
UNDERLYING_MODEL: Final = "gpt-4o-2024-08-06"
SAFE: Final[dict[str, Any]] = {
    kind: {"filtered": False, "severity": "safe"}
    for kind in ("hate", "self_harm", "sexual", "violence")
}
UNSAFE: Final[dict[str, Any]] = SAFE | {"violence": {"filtered": True, "severity": "high"}}
PROMPT_FILTER: Final = [{"prompt_index": 0, "content_filter_results": SAFE}]
_DEPLOYMENTS: Final = "/openai/deployments/"
_V1: Final = "/openai/v1/chat/completions"
_RESPONSES: Final = ("/openai/v1/responses", "/openai/responses")
RESPONSES_VERSION: Final = "2025-04-01-preview"  # the dated versions that have the Responses API


@dataclass(frozen=True, slots=True)
class Received:
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any
    deployment: str | None


class RefusedError(Exception):
    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None):
        super().__init__(status)
        self.status, self.body, self.headers = status, body, headers or {}


def _error(http_status: int, code: str, message: str, **extra: Any) -> RefusedError:
    return RefusedError(http_status, {"error": {"code": code, "message": message, **extra}})


class AzureFake(Watched):
    """The fake as an ASGI 3 application; see the module docstring."""

    def __init__(
        self, *, api_key: str | None = None, tokens: set[str] | None = None, slow_ms: float = 0
    ) -> None:
        self.api_key = api_key
        self.tokens = tokens if tokens is not None else set()
        self.slow_ms = slow_ms
        self.requests: list[Received] = []
        self.refused: list[int] = []  # the status of every refusal, in order
        self.responses = ResponsesFake()
        self.abandoned = 0
        self._ids = itertools.count(1)

    def served(self, deployment: str) -> int:
        return sum(1 for r in self.requests if r.deployment == deployment)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = await incoming(scope, receive, send)
        if received is None:
            return
        raw, headers = received
        query = parse_qs(scope["query_string"].decode())
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        if scope["path"] in _RESPONSES:
            await self._responses(scope, query, headers, body, bytes(raw), send)
            return
        watcher = asyncio.create_task(watch())
        try:
            deployment = None
            try:
                deployment = self._route(scope, query, body)
                self.requests.append(Received(scope["path"], query, headers, body, deployment))
                self._authenticate(headers)
                self._check_body(body, deployment)
                await self._answer(send, gone, deployment, body)
            except RefusedError as refusal:
                if deployment is None:
                    self.requests.append(Received(scope["path"], query, headers, body, None))
                self.refused.append(refusal.status)
                await _send(send, refusal.status, orjson.dumps(refusal.body), refusal.headers)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await self.notify()

    async def _responses(
        self,
        scope: Scope,
        query: dict[str, list[str]],
        headers: dict[str, str],
        body: Any,
        raw: bytes,
        send: Send,
    ) -> None:
        """Azure's Responses API (`/openai/v1/responses`, or `/openai/responses` with a dated
        api-version): the deployment is the body's `model`; the answer is `ResponsesFake`'s."""
        deployment = body.get("model") if isinstance(body, dict) else None
        self.requests.append(Received(scope["path"], query, headers, body, deployment))
        try:
            if scope["path"] == _RESPONSES[1] and query.get("api-version") != [RESPONSES_VERSION]:
                raise _error(400, "BadRequest", "API version not supported")
            self._authenticate(headers)
            if not isinstance(deployment, str) or not deployment:
                raise _error(400, "BadRequest", "model is required", param="model")
        except RefusedError as refusal:
            self.refused.append(refusal.status)
            await _send(send, refusal.status, orjson.dumps(refusal.body), refusal.headers)
            return

        async def replay() -> MutableMapping[str, Any]:
            return {"type": "http.request", "body": raw, "more_body": False}

        await self.responses({**scope, "path": "/v1/responses"}, replay, send)

    # --- checks --------------------------------------------------------------------------------

    def _route(self, scope: Scope, query: dict[str, list[str]], body: Any) -> str:
        path = scope["path"]
        if scope["method"] != "POST":
            raise _error(405, "405", "Method not allowed")
        if path == _V1:
            if "api-version" in query and query["api-version"] != ["preview"]:
                raise _error(400, "BadRequest", "API version not supported")
            model = body.get("model") if isinstance(body, dict) else None
            if not isinstance(model, str) or not model:
                raise _error(400, "BadRequest", "model is required", param="model")
            return model
        if path.startswith(_DEPLOYMENTS) and path.endswith("/chat/completions"):
            deployment = unquote(path[len(_DEPLOYMENTS) : -len("/chat/completions")])
            versions = query.get("api-version")
            if not versions:
                raise _error(404, "404", "Resource not found")
            if versions[0] not in API_VERSIONS:
                raise _error(400, "BadRequest", "API version not supported")
            if not deployment or "/" in deployment:
                raise _error(404, "404", "Resource not found")
            return deployment
        raise _error(404, "404", "Resource not found")

    def _authenticate(self, headers: dict[str, str]) -> None:
        key = headers.get("api-key")
        if key is not None:
            if self.api_key is None or key != self.api_key:
                raise _error(
                    401,
                    "401",
                    f"Access denied due to invalid subscription key {key} or wrong API endpoint. "
                    "Make sure to provide a valid key for an active subscription and use a "
                    "correct regional API endpoint for your resource.",
                )
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or token not in self.tokens:
            raise _error(
                401,
                "401",
                f"Unauthorized. Access token is missing, invalid, audience is incorrect "
                f"(https://cognitiveservices.azure.com), or have expired: Bearer {token}",
            )

    def _check_body(self, body: Any, deployment: str) -> None:
        if not isinstance(body, dict):
            raise _error(400, "BadRequest", "The request body is not valid JSON.")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _error(400, "BadRequest", "'messages' is a required property", param="messages")
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in (
                "system",
                "developer",
                "user",
                "assistant",
                "tool",
            ):
                raise _error(400, "BadRequest", "invalid message", param="messages")
        if deployment.startswith("filtered-"):
            raise _error(
                400,
                "content_filter",
                "The response was filtered due to the prompt triggering Azure OpenAI's content "
                "management policy. Please modify your prompt and retry.",
                param="prompt",
                status=400,
                innererror={
                    "code": "ResponsibleAIPolicyViolation",
                    "content_filter_result": UNSAFE,
                },
            )
        if deployment.startswith("busy-"):
            raise RefusedError(
                429,
                {
                    "error": {
                        "code": "429",
                        "message": "Requests to the ChatCompletions_Create Operation under "
                        "Azure OpenAI API version 2024-10-21 have exceeded token rate limit of "
                        "your current OpenAI S0 pricing tier. Please retry after 30 seconds.",
                    }
                },
                {"retry-after-ms": "30000", "retry-after": "30"},
            )

    # --- answers -------------------------------------------------------------------------------

    async def _answer(
        self, send: Send, gone: asyncio.Event, deployment: str, body: dict[str, Any]
    ) -> None:
        if deployment.startswith("slow-"):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone.wait(), self.slow_ms / 1000)
            if gone.is_set():
                self.abandoned += 1
                return
        tools = body.get("tools") or []
        last = body["messages"][-1]
        call = None
        if tools and last.get("role") != "tool":
            call = {"name": tools[0]["function"]["name"], "id": f"call_{next(self._ids):04d}"}
        text = AFTER_TOOL_TEXT if last.get("role") == "tool" else "".join(WORDS)
        finish = "tool_calls" if call else "stop"
        if deployment.startswith("unsafe-"):
            text, finish = "".join(WORDS[:2]), "content_filter"
        prompt = sum(len(str(m.get("content") or "").split()) for m in body["messages"])
        completion = 1 if call else len(text.split())
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        answer_id = f"chatcmpl-fake{next(self._ids):06d}"
        headers = {"apim-request-id": f"apim-{answer_id}", "x-request-id": answer_id}
        if body.get("stream"):
            events = _stream(answer_id, text, call, finish, usage, body)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        *((k.encode(), v.encode()) for k, v in headers.items()),
                    ],
                }
            )
            for event in events:
                if gone.is_set():
                    self.abandoned += 1
                    return
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if call else text,
            "refusal": None,
        }
        if call:
            message["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": TOOL_ARGS},
                }
            ]
        filtered = UNSAFE if finish == "content_filter" else SAFE
        answer = {
            "id": answer_id,
            "object": "chat.completion",
            "created": 1733000000,
            "model": UNDERLYING_MODEL,
            "system_fingerprint": "fp_azure",
            "prompt_filter_results": PROMPT_FILTER,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": None,
                    "content_filter_results": filtered,
                }
            ],
            "usage": usage,
        }
        await _send(send, 200, orjson.dumps(answer), headers)


def _stream(
    answer_id: str,
    text: str,
    call: dict[str, str] | None,
    finish: str,
    usage: dict[str, Any],
    body: dict[str, Any],
) -> list[bytes]:
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def chunk(choices: list[Any], **more: Any) -> bytes:
        event = {
            "id": answer_id,
            "object": "chat.completion.chunk",
            "created": 1733000000,
            "model": UNDERLYING_MODEL,
            "system_fingerprint": "fp_azure",
            "choices": choices,
            **more,
        }
        if include_usage and "usage" not in event:
            event["usage"] = None
        return b"data: " + orjson.dumps(event) + b"\n\n"

    def delta(content: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": content,
            "finish_reason": finish_reason,
            "logprobs": None,
            "content_filter_results": SAFE if content else {},
        }

    # The prompt's filter results come first, in an event of their own (Azure's quirk).
    events = [
        b"data: "
        + orjson.dumps(
            {
                "choices": [],
                "created": 0,
                "id": "",
                "model": "",
                "object": "",
                "prompt_filter_results": PROMPT_FILTER,
            }
        )
        + b"\n\n",
        chunk([delta({"role": "assistant", "content": ""}) | {"content_filter_results": {}}]),
    ]
    if call:
        start: dict[str, Any] = {"index": 0, "id": call["id"], "type": "function"}
        start["function"] = {"name": call["name"], "arguments": ""}
        events.append(chunk([delta({"tool_calls": [start]})]))
        for part in ('{"city"', ': "Paris"}'):
            events.append(
                chunk([delta({"tool_calls": [{"index": 0, "function": {"arguments": part}}]})])
            )
    else:
        words = text.split(" ")
        for index, word in enumerate(words):
            events.append(chunk([delta({"content": word if index == 0 else " " + word})]))
    final = delta({}, finish)
    final["content_filter_results"] = UNSAFE if finish == "content_filter" else {}
    events.append(chunk([final]))
    # The asynchronous filter's annotation of the text already sent: filter results only.
    events.append(
        chunk(
            [
                {
                    "index": 0,
                    "finish_reason": None,
                    "content_filter_results": SAFE,
                    "content_filter_offsets": {
                        "check_offset": 0,
                        "start_offset": 0,
                        "end_offset": len(text),
                    },
                }
            ]
        )
    )
    if include_usage:
        events.append(chunk([], usage=usage))
    events.append(b"data: [DONE]\n\n")
    return events


async def _send(send: Send, status: int, body: bytes, headers: dict[str, str]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                *((k.encode(), v.encode()) for k, v in headers.items()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
