"""A scripted fake of Google's Gemini API and of Vertex AI's publisher endpoints, as an ASGI app.

Routes, written from the public REST references:

- Gemini API: `POST /v1beta/models/{model}:generateContent` and
  `:streamGenerateContent?alt=sse`, authenticated by `x-goog-api-key`. A wrong key gets what
  the real API answers: 400 INVALID_ARGUMENT "API key not valid" with an `ErrorInfo` whose
  reason is `API_KEY_INVALID`; no key, 403 PERMISSION_DENIED.
- Vertex AI: `POST /v1/projects/{p}/locations/{l}/publishers/google/models/{m}:generateContent`
  / `:streamGenerateContent?alt=sse` and `.../publishers/anthropic/models/{m}:rawPredict` /
  `:streamRawPredict`, authenticated by `Authorization: Bearer <token>`, which the token
  endpoint fake must have issued and not expired (else 401 UNAUTHENTICATED). Anthropic calls must
  carry `anthropic_version: vertex-2023-10-16` and no `model`; they are answered by an
  `AnthropicFake` (the model from the URL), so the Messages wire is the real one.

Gemini requests are held to the `GenerateContentRequest` schema: only its fields, `contents`
with roles `user`/`model` that alternate, each part exactly one kind of data (`text`,
`inlineData` with base64, `fileData`, `functionCall` with object `args`, `functionResponse`
with object `response`), function responses answering the previous turn's calls by name (and
by id, when the call had one), declarations with valid names, known `generationConfig` and
`toolConfig` fields. Anything else: 400 INVALID_ARGUMENT. Gemini 3 models (a model name with
`gemini-3`) also refuse a model turn's first function call without a `thoughtSignature`, and a
signature this fake never issued.

Answers are `GenerateContentResponse`s; streams are `data: <json>` events (no event names, no
terminator), the last with `finishReason` and `usageMetadata`. The model name is the script,
`name@directive,...` (`@` already belongs to Vertex's version ids: the fake reads the part after
the last `@`):

- default: a text answer of `words` (5) words, one word per event when streamed.
- `tool`: a `functionCall` of the first declared function with TOOL_ARGS (with an id on the
  Gemini API, none on Vertex, as the two do), or, when the last turn carries a
  `functionResponse`, the text AFTER_TOOL_TEXT.
- `thinking`: when `thinkingConfig.includeThoughts`, a thought part THOUGHT first
  (`thoughtsTokenCount`: 3). `cached=N`: `cachedContentTokenCount: N`.
- `safety`: one word, then `finishReason: SAFETY`. `blocked`: no candidates,
  `promptFeedback.blockReason: SAFETY`.
- `status=N`: that status as a Google error (429 RESOURCE_EXHAUSTED with a `RetryInfo` of 1s,
  503 UNAVAILABLE, 400 INVALID_ARGUMENT, 401 UNAUTHENTICATED echoing the credential it got,
  the worst case for a gateway that forwards error text).
- `slow_ms=N`: N ms before every event (before a whole answer).
- `inband_unavailable`: a 200 stream whose only event is an error (503 UNAVAILABLE), as Google
  sends one that fails after the response began.

Every request is recorded (`requests`); a stream the client leaves stops at its next pause and
counts in `streams_abandoned`; `wait_for(predicate)` returns once a predicate holds.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

from tests.fakes.anthropic_upstream import AnthropicFake, Received, answer_text
from tests.fakes.asgi import Watched, incoming, json_or_none

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

TOOL_ARGS: Final[dict[str, Any]] = {"city": "Paris", "days": 3}
AFTER_TOOL_TEXT: Final = "It is sunny in Paris."
THOUGHT: Final = "The user greets me; I greet back."
SKIP_SIGNATURE: Final = "skip_thought_signature_validator"

_GEMINI_PATH: Final = re.compile(
    r"^/v1beta/models/([^/:]+):(generateContent|streamGenerateContent)$"
)
_VERTEX_PATH: Final = re.compile(
    r"^/v1/projects/([^/]+)/locations/([^/]+)/publishers/(google|anthropic)/models/([^/:]+):"
    r"(generateContent|streamGenerateContent|rawPredict|streamRawPredict)$"
)
_REQUEST_FIELDS: Final = frozenset(
    {
        "contents",
        "systemInstruction",
        "tools",
        "toolConfig",
        "generationConfig",
        "safetySettings",
        "cachedContent",
        "labels",
    }
)
_GENERATION_FIELDS: Final = frozenset(
    {
        "stopSequences",
        "responseMimeType",
        "responseSchema",
        "responseJsonSchema",
        "candidateCount",
        "maxOutputTokens",
        "temperature",
        "topP",
        "topK",
        "seed",
        "presencePenalty",
        "frequencyPenalty",
        "responseLogprobs",
        "logprobs",
        "thinkingConfig",
        "mediaResolution",
    }
)
_THINKING_FIELDS: Final = frozenset({"thinkingBudget", "includeThoughts", "thinkingLevel"})
_PART_DATA: Final = ("text", "inlineData", "fileData", "functionCall", "functionResponse")
_PART_FIELDS: Final = frozenset({*_PART_DATA, "thought", "thoughtSignature"})
_FUNCTION_NAME: Final = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_.\-]{0,63}$")
_STATUS_NAMES: Final = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


class GoogleError(Exception):
    def __init__(self, status: int, message: str, details: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.status, self.message, self.details = status, message, details or []

    def body(self) -> bytes:
        error = {"code": self.status, "message": self.message, "status": _STATUS_NAMES[self.status]}
        if self.details:
            error["details"] = self.details
        return orjson.dumps({"error": error})


@dataclass
class Script:
    words: int = 5
    tool: bool = False
    thinking: bool = False
    cached: int = 0
    safety: bool = False
    blocked: bool = False
    status: int | None = None
    slow_ms: float = 0.0
    inband_unavailable: bool = False


def parse_script(model: str) -> Script:
    script = Script()
    _, at, spec = model.rpartition("@")
    if not at:
        return script
    for directive in filter(None, spec.split(",")):
        key, eq, value = directive.partition("=")
        if not eq and key in ("tool", "thinking", "safety", "blocked", "inband_unavailable"):
            setattr(script, key, True)
        elif eq and key in ("words", "cached", "status", "slow_ms"):
            setattr(script, key, float(value) if key == "slow_ms" else int(value))
        elif not directive[:1].isdigit():  # a Vertex version id (`@20250514`) is no script
            raise GoogleError(400, f"unknown script directive {directive!r}")
    return script


def _invalid(message: str) -> GoogleError:
    return GoogleError(400, f"Invalid JSON payload received. {message}")


class GeminiFake(Watched):
    """See the module docstring. `token_ok` checks a Vertex bearer token (the token fake's)."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        token_ok: Callable[[str], bool] | None = None,
        project: str = "my-project-123",
        location: str = "us-central1",
    ) -> None:
        self.api_key = api_key
        self.token_ok = token_ok
        self.project = project
        self.location = location
        self.anthropic = AnthropicFake()
        self.requests: list[Received] = []
        self.unauthorized = 0
        self.streams_abandoned = 0
        self.signatures: set[str] = set()
        self._ids = itertools.count(1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = await incoming(scope, receive, send)
        if received is None:
            return
        raw, headers = received
        body = json_or_none(raw)
        self.requests.append(Received(scope["method"], scope["path"], headers, body))
        await self.notify()
        try:
            route = self._route(scope, headers)
            if route[0] == "anthropic":
                await self._anthropic(scope, send, body, route[1], route[2])
                return
            _, model, stream, vertex = route
            query = scope.get("query_string", b"").decode()
            if stream and query != "alt=sse":
                raise GoogleError(400, "streaming here needs ?alt=sse")
            script = parse_script(model)
            self._check(body, model, vertex)
            if script.status is not None:
                credential = headers.get("x-goog-api-key") or headers.get("authorization", "")
                raise self._scripted(script.status, credential)
            events = self._answer(script, body, model, vertex)
            if script.inband_unavailable and stream:
                events = [orjson.loads(GoogleError(503, "The service is unavailable.").body())]
        except GoogleError as error:
            await _respond(send, error.status, error.body())
            return
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            await self._send_answer(send, gone, script, events, stream)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _send_answer(
        self,
        send: Send,
        gone: asyncio.Event,
        script: Script,
        events: list[dict[str, Any]],
        stream: bool,
    ) -> None:
        """The answer, whole or one event at a time; a pause ends early when the client leaves,
        and then nothing more is sent (counted in `streams_abandoned`)."""
        if not stream:
            if not await _pause(script.slow_ms, gone):
                await _respond(send, 200, orjson.dumps(_merge(events)))
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for event in events:
            if await _pause(script.slow_ms, gone):
                self.streams_abandoned += 1
                await self.notify()
                return
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + orjson.dumps(event) + b"\r\n\r\n",
                    "more_body": True,
                }
            )
        await send({"type": "http.response.body", "body": b""})

    # --- auth and routing -----------------------------------------------------------------------

    def _route(self, scope: Scope, headers: dict[str, str]) -> tuple[Any, ...]:
        if scope["method"] != "POST":
            raise GoogleError(404, "not found")
        path = scope["path"]
        if found := _GEMINI_PATH.match(path):
            key = headers.get("x-goog-api-key")
            if not key:
                raise GoogleError(403, "Method doesn't allow unregistered callers")
            if key != self.api_key:
                raise GoogleError(
                    400,
                    "API key not valid. Please pass a valid API key.",
                    [
                        {
                            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                            "reason": "API_KEY_INVALID",
                            "domain": "googleapis.com",
                        }
                    ],
                )
            return ("gemini", found[1], found[2] == "streamGenerateContent", False)
        if found := _VERTEX_PATH.match(path):
            token = headers.get("authorization", "").removeprefix("Bearer ")
            if self.token_ok is None or not self.token_ok(token):
                self.unauthorized += 1
                raise GoogleError(
                    401,
                    "Request had invalid authentication credentials. Expected OAuth 2 access "
                    "token, login cookie or other valid authentication credential.",
                )
            project, location, publisher, model, method = found.groups()
            if (project, location) != (self.project, self.location):
                raise GoogleError(404, f"Project {project} or location {location} not found")
            if publisher == "anthropic":
                if method not in ("rawPredict", "streamRawPredict"):
                    raise GoogleError(400, "Anthropic models take rawPredict / streamRawPredict")
                return ("anthropic", model, method == "streamRawPredict")
            if method not in ("generateContent", "streamGenerateContent"):
                raise GoogleError(400, f"{method} is not a Gemini method")
            return ("vertex", model, method == "streamGenerateContent", True)
        raise GoogleError(404, f"no route {path}")

    def _scripted(self, status: int, credential: str) -> GoogleError:
        if status == 429:
            retry = {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1s"}
            return GoogleError(429, "Resource has been exhausted (e.g. check quota).", [retry])
        if status == 503:
            return GoogleError(503, "The model is overloaded. Please try again later.")
        if status == 401:
            return GoogleError(401, f"Request had invalid authentication credentials: {credential}")
        return GoogleError(status, f"scripted status {status}")

    async def _anthropic(
        self, scope: Scope, send: Send, body: Any, model: str, stream: bool
    ) -> None:
        """Anthropic on Vertex: the Messages body minus `model`, plus `anthropic_version`."""
        if not isinstance(body, dict) or "model" in body:
            raise GoogleError(400, "model must not be in the body of a rawPredict call")
        if body.get("anthropic_version") != "vertex-2023-10-16":
            raise GoogleError(400, "anthropic_version: vertex-2023-10-16 is required")
        if bool(body.get("stream")) != stream:
            raise GoogleError(400, "stream must match the method (streamRawPredict)")
        forwarded = {k: v for k, v in body.items() if k != "anthropic_version"}
        forwarded["model"] = re.sub(r"@\d{8}$", "", model)  # Vertex's version id, not a script
        data = orjson.dumps(forwarded)
        sent = False

        async def receive() -> MutableMapping[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": data, "more_body": False}
            await asyncio.Event().wait()  # the gateway never leaves in these tests mid-request
            return {"type": "http.disconnect"}

        inner = {
            **scope,
            "path": "/v1/messages",
            "headers": [
                (b"anthropic-version", b"2023-06-01"),
                (b"content-type", b"application/json"),
            ],
        }
        await self.anthropic(inner, receive, send)

    # --- the request's schema -------------------------------------------------------------------

    def _check(self, body: Any, model: str, vertex: bool) -> None:
        if not isinstance(body, dict):
            raise _invalid("The body is not a JSON object.")
        for key in body:
            if key not in _REQUEST_FIELDS:
                raise _invalid(f'Unknown name "{key}": Cannot find field.')
        contents = body.get("contents")
        if not isinstance(contents, list) or not contents:
            raise GoogleError(400, "* GenerateContentRequest.contents: contents is not specified")
        system = body.get("systemInstruction")
        texts = system.get("parts") or [None] if isinstance(system, dict) else [None]
        if system is not None and not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in texts
        ):
            raise _invalid("systemInstruction must hold text parts")
        declared = self._check_tools(body)
        previous: dict[str, Any] | None = None
        for i, content in enumerate(contents):
            if not isinstance(content, dict) or content.get("role") not in ("user", "model"):
                raise GoogleError(400, f"contents[{i}].role must be user or model")
            parts = content.get("parts")
            if not isinstance(parts, list) or not parts:
                raise GoogleError(400, f"contents[{i}].parts must not be empty")
            if previous is not None and previous["role"] == content["role"]:
                raise GoogleError(400, f"contents[{i}]: roles must alternate")
            for j, part in enumerate(parts):
                self._check_part(part, f"contents[{i}].parts[{j}]", declared)
            calls = [p["functionCall"] for p in parts if "functionCall" in p]
            if calls and "gemini-3" in model:
                signature = next(p for p in parts if "functionCall" in p).get("thoughtSignature")
                if signature is None:
                    raise GoogleError(400, f"contents[{i}]: function call lacks thought_signature")
                if signature != SKIP_SIGNATURE and signature not in self.signatures:
                    raise GoogleError(400, f"contents[{i}]: thought_signature is not valid")
            responses = [p["functionResponse"] for p in parts if "functionResponse" in p]
            if responses:
                asked = [
                    p["functionCall"]
                    for p in (previous or {}).get("parts", ())
                    if "functionCall" in p
                ]
                if [r["name"] for r in responses] != [c["name"] for c in asked]:
                    raise GoogleError(
                        400,
                        "Please ensure that the number of function response parts is equal to "
                        "the number of function call parts of the function call turn.",
                    )
                for response, call in zip(responses, asked, strict=True):
                    if call.get("id") and response.get("id") != call["id"]:
                        raise GoogleError(400, f"contents[{i}]: functionResponse.id mismatch")
            previous = content
        if contents[-1]["role"] != "user":
            raise GoogleError(400, "the last content must come from the user")
        config = body.get("generationConfig")
        if config is not None:
            for key, value in config.items():
                if key not in _GENERATION_FIELDS:
                    raise _invalid(f"Unknown name \"{key}\" at 'generation_config'.")
                if key == "thinkingConfig" and not set(value) <= _THINKING_FIELDS:
                    raise _invalid("Unknown name in thinking_config.")
            if "thinkingLevel" in config.get("thinkingConfig", {}) and "gemini-3" not in model:
                raise GoogleError(400, "Thinking level is not supported for this model.")

    def _check_tools(self, body: dict[str, Any]) -> set[str]:
        declared: set[str] = set()
        for tool in body.get("tools") or ():
            for declaration in tool.get("functionDeclarations") or ():
                name = declaration.get("name")
                if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
                    raise GoogleError(400, f"function name {name!r} is not valid")
                schema = declaration.get("parametersJsonSchema", {})
                if not isinstance(schema, dict):
                    raise GoogleError(400, "parametersJsonSchema must be an object")
                declared.add(name)
        choice = body.get("toolConfig")
        if choice is not None:
            config = choice.get("functionCallingConfig") or {}
            if config.get("mode") not in ("AUTO", "ANY", "NONE", "VALIDATED"):
                raise _invalid("functionCallingConfig.mode is not valid")
            for name in config.get("allowedFunctionNames") or ():
                if name not in declared:
                    raise GoogleError(400, f"allowed function {name} is not declared")
        return declared

    def _check_part(self, part: Any, where: str, declared: set[str]) -> None:
        if not isinstance(part, dict) or not set(part) <= _PART_FIELDS:
            raise _invalid(f"{where} has unknown fields")
        kinds = [k for k in _PART_DATA if k in part]
        if len(kinds) != 1:
            raise GoogleError(400, f"{where}: a part holds exactly one kind of data")
        if "inlineData" in part:
            data = part["inlineData"]
            try:
                base64.b64decode(data["data"], validate=True)
            except (KeyError, TypeError, binascii.Error):
                raise GoogleError(400, f"{where}.inlineData.data is not base64") from None
            if not isinstance(data.get("mimeType"), str):
                raise GoogleError(400, f"{where}.inlineData.mimeType is required")
        if "functionCall" in part:
            call = part["functionCall"]
            if not isinstance(call.get("args"), dict) or call.get("name") not in declared:
                raise GoogleError(400, f"{where}.functionCall must name a declared function")
        if "functionResponse" in part:
            response = part["functionResponse"]
            if not isinstance(response.get("response"), dict) or not response.get("name"):
                raise GoogleError(400, f"{where}.functionResponse needs name and response")

    # --- answers --------------------------------------------------------------------------------

    def _answer(
        self, script: Script, body: dict[str, Any], model: str, vertex: bool
    ) -> list[dict[str, Any]]:
        response_id = f"fake-{next(self._ids):06d}"
        prompt = sum(
            len(str(p.get("text", "")).split())
            for c in [body.get("systemInstruction") or {}, *body["contents"]]
            for p in c.get("parts", ())
        )
        base = {"modelVersion": model.split("@")[0], "responseId": response_id}
        usage = {"promptTokenCount": prompt, "totalTokenCount": prompt}
        if script.blocked:
            feedback = {"blockReason": "SAFETY", "safetyRatings": []}
            return [{**base, "promptFeedback": feedback, "usageMetadata": usage}]
        thinking = (body.get("generationConfig") or {}).get("thinkingConfig") or {}
        parts: list[dict[str, Any]] = []
        thoughts = 0
        if script.thinking and thinking.get("includeThoughts"):
            parts.append({"text": THOUGHT, "thought": True})
            thoughts = 3
        last = body["contents"][-1]["parts"]
        answered = any("functionResponse" in p for p in last)
        finish = "STOP"
        if script.tool and not answered:
            name = body["tools"][0]["functionDeclarations"][0]["name"]
            call: dict[str, Any] = {"name": name, "args": TOOL_ARGS}
            if not vertex:
                call["id"] = f"fc-{response_id}"
            signature = base64.b64encode(f"sig/{response_id}+".encode()).decode()
            self.signatures.add(signature)
            parts.append({"functionCall": call, "thoughtSignature": signature})
        elif script.tool:
            parts.extend({"text": w + " "} for w in AFTER_TOOL_TEXT.split())
        else:
            words = answer_text(1 if script.safety else script.words).split()
            parts.extend({"text": (w if i == 0 else " " + w)} for i, w in enumerate(words))
            if script.safety:
                finish = "SAFETY"
        output = sum(len(str(p.get("text", "")).split()) for p in parts if not p.get("thought"))
        output += sum(1 for p in parts if "functionCall" in p)
        events = []
        for k, part in enumerate(parts):
            candidate: dict[str, Any] = {"content": {"role": "model", "parts": [part]}, "index": 0}
            event: dict[str, Any] = {**base, "candidates": [candidate]}
            if k == len(parts) - 1:
                candidate["finishReason"] = finish
                if finish == "SAFETY":
                    candidate["safetyRatings"] = [
                        {
                            "category": "HARM_CATEGORY_DANGEROUS_CONTENT",
                            "probability": "HIGH",
                            "blocked": True,
                        }
                    ]
                total = prompt + output + thoughts
                event["usageMetadata"] = {
                    "promptTokenCount": prompt,
                    "candidatesTokenCount": output,
                    "totalTokenCount": total,
                    **({"cachedContentTokenCount": script.cached} if script.cached else {}),
                    **({"thoughtsTokenCount": thoughts} if thoughts else {}),
                }
            else:
                event["usageMetadata"] = usage
            events.append(event)
        return events


def _merge(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's events as the one response `generateContent` gives."""
    last = events[-1]
    if "candidates" not in last:
        return last
    parts: list[dict[str, Any]] = []
    for event in events:
        for part in event["candidates"][0]["content"]["parts"]:
            if (
                parts
                and "text" in part
                and "text" in parts[-1]
                and (bool(part.get("thought")) == bool(parts[-1].get("thought")))
            ):
                parts[-1] = {**parts[-1], "text": parts[-1]["text"] + part["text"]}
            else:
                parts.append(part)
    candidate = {**last["candidates"][0], "content": {"role": "model", "parts": parts}}
    return {**last, "candidates": [candidate]}


async def _pause(ms: float, gone: asyncio.Event) -> bool:
    """Wait `ms` unless the client leaves first; whether it left."""
    if ms > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gone.wait(), ms / 1000)
    return gone.is_set()


async def _respond(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json; charset=UTF-8")],
        }
    )
    await send({"type": "http.response.body", "body": body})
