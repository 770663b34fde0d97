"""A scripted fake of AWS Bedrock's Converse and ConverseStream APIs, as a bare ASGI app.

Written from the Bedrock runtime API reference: `POST /model/{modelId}/converse` answers JSON,
`POST /model/{modelId}/converse-stream` answers `application/vnd.amazon.eventstream`, binary
frames encoded here from the documented format (prelude: total length, headers length, prelude
CRC32; headers; payload; message CRC32), each with `:message-type` `event` (and `:event-type`)
or `exception` (and `:exception-type`). Errors are a status, `x-amzn-ErrorType` and
`{"message": ...}`.

It checks what it receives like the real service does:

- authentication: a SigV4 signature (service `bedrock`, the fake's region), recomputed with
  botocore's signer from the credentials the fake knows and compared (403
  `InvalidSignatureException` on a mismatch, `UnrecognizedClientException` for an unknown access
  key or session token, a stale `X-Amz-Date` refused), or a Bedrock API key as a bearer token;
- the body: Converse's shape (`messages` alternating from `user`, each content block one known
  member, `toolUse`/`toolResult` only with a `toolConfig`, `inferenceConfig` and
  `performanceConfig` types); a bad one gets 400 `ValidationException`.

The model id is the script, `anthropic.claude-x-v1:0@directive,...`: `words=N` (default 5),
`tool` (a tool call, or a text answer once a toolResult came back), `reasoning` (a signed
reasoning block first), `cached=N` (cache reads), `latency_ms=N` (the reported latency),
`slow_ms=N` (before each delta), `throttle`, `not_ready`, `unavailable` (429/429/503 errors),
`stream_exception=TYPE` (an exception frame before any content), `exception_after=N` (a
`modelStreamErrorException` frame after N text deltas), `echo` (a ValidationException whose
message repeats the request's `Authorization` and security token), `stop=REASON` (that
`stopReason`), `corrupt` (a text frame whose payload no longer matches its CRC).

`StsFake` is STS's `AssumeRoleWithWebIdentity`, for the web identity link of the chain.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hmac
import re
import struct
import zlib
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qsl, unquote

import orjson
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from tests.fakes.asgi import Watched, incoming, json_or_none

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

WORDS: Final = ("Hello", "from", "the", "fake", "Bedrock", "answering", "every", "question")
TOOL_TEXT: Final = "Let me check."
TOOL_INPUT: Final[dict[str, Any]] = {"city": "Paris", "days": 3}
TOOL_JSON_PARTS: Final = ('{"city": ', '"Paris", "da', 'ys": 3}')
AFTER_TOOL_TEXT: Final = "It is sunny in Paris."
REASONING: Final = ("Thinking ", "about it.")
SIGNATURE: Final = "sig-EqQBCkgIARABGAIiQL"
REGION: Final = "us-east-1"
_PATH = re.compile(r"^/model/([^/]+)/(converse|converse-stream)$")
_AUTH = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/([^/]+)/aws4_request, "
    r"SignedHeaders=([a-z0-9;\-]+), Signature=([0-9a-f]{64})$"
)
_BLOCKS: Final = frozenset(
    {"text", "image", "document", "toolUse", "toolResult", "reasoningContent", "cachePoint"}
)
MAX_SKEW_S: Final = 300  # SigV4 refuses a request dated more than 5 minutes off


def answer_text(words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


def encode_frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream message: string headers (type 7), CRC32s over prelude and message."""
    encoded = b"".join(
        struct.pack(">B", len(name.encode())) + name.encode() + b"\x07"
        + struct.pack(">H", len(value.encode())) + value.encode()
        for name, value in headers.items()
    )  # fmt: skip
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack(">II", total, len(encoded))
    prelude += struct.pack(">I", zlib.crc32(prelude))
    message = prelude + encoded + payload
    return message + struct.pack(">I", zlib.crc32(message))


def event_frame(kind: str, payload: dict[str, Any]) -> bytes:
    headers = {":event-type": kind, ":content-type": "application/json", ":message-type": "event"}
    return encode_frame(headers, orjson.dumps(payload))


def exception_frame(kind: str, message: str) -> bytes:
    headers = {
        ":exception-type": kind,
        ":content-type": "application/json",
        ":message-type": "exception",
    }
    return encode_frame(headers, orjson.dumps({"message": message}))


@dataclass(frozen=True, slots=True)
class Received:
    path: str  # with the model id decoded
    model: str
    stream: bool
    headers: dict[str, str]
    body: Any


@dataclass(slots=True)
class Script:
    words: int = 5
    tool: bool = False
    reasoning: bool = False
    cached: int = 0
    latency_ms: int = 42
    slow_ms: float = 0.0
    throttle: bool = False
    not_ready: bool = False
    unavailable: bool = False
    stream_exception: str | None = None
    exception_after: int | None = None
    stop: str | None = None
    corrupt: bool = False


def parse_script(model: str) -> Script:
    script = Script()
    _, _, spec = model.partition("@")
    for directive in filter(None, spec.split(",")):
        key, eq, value = directive.partition("=")
        if key == "echo":
            continue  # answered by the checks
        if not eq:
            setattr(script, key, True)
        elif key in ("stream_exception", "stop"):
            setattr(script, key, value)
        else:
            setattr(script, key, float(value) if key == "slow_ms" else int(value))
    return script


class RefusedError(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


@dataclass
class BedrockFake(Watched):
    """The fake as an ASGI 3 application. `credentials`: access key -> (secret, session token);
    `api_keys`: accepted Bedrock API keys."""

    credentials: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    api_keys: tuple[str, ...] = ()
    region: str = REGION
    requests: list[Received] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # error types answered, in order
    streams_finished: int = 0
    streams_abandoned: int = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = await incoming(scope, receive, send)
        if received is None:
            return
        raw, headers = received
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            raw_path = scope["raw_path"].decode("latin-1")
            try:
                model, stream, body = self._check(scope["method"], raw_path, headers, bytes(raw))
                script = parse_script(model)
                self._scripted_error(script)
            except RefusedError as refusal:
                self.refused.append(refusal.kind)
                await self.notify()
                await _error(send, refusal)
                return
            if stream:
                await self._stream(send, gone, script, body)
            else:
                await _pause(script.slow_ms, gone)
                await _json(send, 200, self._answer(script, body))
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    # --- checks --------------------------------------------------------------------------------

    def _check(
        self, method: str, raw_path: str, headers: dict[str, str], raw: bytes
    ) -> tuple[str, bool, dict[str, Any]]:
        found = _PATH.match(raw_path)
        if method != "POST" or found is None:
            raise RefusedError(
                404, "UnknownOperationException", f"no operation {method} {raw_path}"
            )
        model, stream = unquote(found.group(1)), found.group(2) == "converse-stream"
        body = json_or_none(raw)
        self.requests.append(
            Received(f"/model/{model}/{found.group(2)}", model, stream, headers, body)
        )
        self._authenticate(raw_path, headers, raw)
        if "/" in found.group(1) or ":" in found.group(1):
            raise RefusedError(
                400, "ValidationException", "the model id in the path is not encoded"
            )
        if not isinstance(body, dict):
            raise RefusedError(400, "SerializationException", "the body is not a JSON object")
        validate(body)
        if "@echo" in model:  # the worst case: an error that repeats the request's credentials
            echoed = f"{headers.get('authorization')} {headers.get('x-amz-security-token')}"
            raise RefusedError(400, "ValidationException", f"Malformed input: {echoed}")
        return model, stream, body

    def _authenticate(self, raw_path: str, headers: dict[str, str], raw: bytes) -> None:
        auth = headers.get("authorization", "")
        if auth.startswith("Bearer "):
            if not any(hmac.compare_digest(auth[7:], key) for key in self.api_keys):
                raise RefusedError(403, "UnrecognizedClientException", "Invalid API Key format")
            return
        found = _AUTH.match(auth)
        if found is None:
            raise RefusedError(403, "MissingAuthenticationTokenException", "Missing Authentication")
        access_key, day, region, service, signed, signature = found.groups()
        if access_key not in self.credentials:
            raise RefusedError(
                403, "UnrecognizedClientException", "The security token included is invalid."
            )
        secret, token = self.credentials[access_key]
        if token is not None and headers.get("x-amz-security-token") != token:
            raise RefusedError(
                403, "UnrecognizedClientException", "The security token included is invalid."
            )
        if (region, service) != (self.region, "bedrock"):
            raise RefusedError(403, "InvalidSignatureException", "Credential should be scoped well")
        stamp = headers.get("x-amz-date", "")
        try:
            when = datetime.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.UTC)
        except ValueError:
            raise RefusedError(403, "IncompleteSignatureException", "bad X-Amz-Date") from None
        now = datetime.datetime.now(datetime.UTC)
        if abs((now - when).total_seconds()) > MAX_SKEW_S or stamp[:8] != day:
            raise RefusedError(403, "InvalidSignatureException", "Signature expired")
        names = signed.split(";")
        if "host" not in names or any(name not in headers for name in names):
            raise RefusedError(403, "InvalidSignatureException", "a signed header is missing")
        request = AWSRequest(
            method="POST",
            url=f"http://{headers['host']}{raw_path}",
            data=raw,
            headers={name: headers[name] for name in names},
        )
        request.context["timestamp"] = stamp
        signer = SigV4Auth(Credentials(access_key, secret, token), "bedrock", region)
        canonical = signer.canonical_request(request)
        expected = signer.signature(signer.string_to_sign(request, canonical), request)
        if not hmac.compare_digest(expected, signature):
            raise RefusedError(
                403,
                "InvalidSignatureException",
                "The request signature we calculated does not match the signature you provided.",
            )

    @staticmethod
    def _scripted_error(script: Script) -> None:
        if script.throttle:
            raise RefusedError(429, "ThrottlingException", "Too many requests, please wait.")
        if script.not_ready:
            raise RefusedError(429, "ModelNotReadyException", "Model is not ready for inference.")
        if script.unavailable:
            raise RefusedError(503, "ServiceUnavailableException", "Service unavailable.")

    # --- answers -------------------------------------------------------------------------------

    def _plan(self, script: Script, body: dict[str, Any]) -> tuple[list[str], str, str | None]:
        """Text deltas, stop reason, and the tool to call (None: no call)."""
        if script.tool:
            last = body["messages"][-1]["content"]
            if any("toolResult" in block for block in last):
                return [AFTER_TOOL_TEXT], "end_turn", None
            tools = body.get("toolConfig", {}).get("tools") or []
            name = next((t["toolSpec"]["name"] for t in tools if "toolSpec" in t), "get_weather")
            return [TOOL_TEXT], "tool_use", name
        limit = body.get("inferenceConfig", {}).get("maxTokens", 4096)
        words = min(script.words, limit)
        deltas = [WORDS[i % len(WORDS)] + (" " if i < words - 1 else "") for i in range(words)]
        stop = script.stop or ("max_tokens" if words < script.words else "end_turn")
        return deltas, stop, None

    def _usage(self, script: Script, body: dict[str, Any], output: int) -> dict[str, int]:
        words = sum(len(text.split()) for text in _texts(body))
        usage = {"inputTokens": words, "outputTokens": output}
        usage["totalTokens"] = words + output + script.cached
        if script.cached:
            usage["cacheReadInputTokens"] = script.cached
            usage["cacheWriteInputTokens"] = 0
        return usage

    def _answer(self, script: Script, body: dict[str, Any]) -> dict[str, Any]:
        deltas, stop, tool = self._plan(script, body)
        content: list[dict[str, Any]] = []
        if script.reasoning:
            reasoning = {"text": "".join(REASONING), "signature": SIGNATURE}
            content.append({"reasoningContent": {"reasoningText": reasoning}})
        content.append({"text": "".join(deltas)})
        if tool is not None:
            use = {"toolUseId": "tooluse_fake01", "name": tool, "input": TOOL_INPUT}
            content.append({"toolUse": use})
        answer: dict[str, Any] = {
            "output": {"message": {"role": "assistant", "content": content}},
            "stopReason": stop,
            "usage": self._usage(script, body, len(deltas) + (tool is not None)),
            "metrics": {"latencyMs": script.latency_ms},
        }
        if "performanceConfig" in body:
            answer["performanceConfig"] = body["performanceConfig"]
        return answer

    async def _stream(
        self, send: Send, gone: asyncio.Event, script: Script, body: dict[str, Any]
    ) -> None:
        headers = [
            (b"content-type", b"application/vnd.amazon.eventstream"),
            (b"x-amzn-requestid", b"5e1f0c8a-fake-4bed-rock-000000000001"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            for frame in self._frames(script, body):
                if frame is None:
                    await _pause(script.slow_ms, gone)
                    continue
                if gone.is_set():
                    raise ConnectionError
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            self.streams_finished += 1
        except (ConnectionError, OSError):
            self.streams_abandoned += 1
        await self.notify()

    def _frames(self, script: Script, body: dict[str, Any]) -> Iterator[bytes | None]:
        """The frames of an answer; None where the script pauses."""
        deltas, stop, tool = self._plan(script, body)
        yield event_frame("messageStart", {"role": "assistant"})
        if script.stream_exception:
            yield exception_frame(script.stream_exception, "Scripted stream exception.")
            return
        index = 0
        if script.reasoning:
            for part in REASONING:
                yield None
                payload = {"contentBlockIndex": 0, "delta": {"reasoningContent": {"text": part}}}
                yield event_frame("contentBlockDelta", payload)
            sign = {"contentBlockIndex": 0, "delta": {"reasoningContent": {"signature": SIGNATURE}}}
            yield event_frame("contentBlockDelta", sign)
            yield event_frame("contentBlockStop", {"contentBlockIndex": 0})
            index = 1
        for i, text in enumerate(deltas):
            if script.exception_after is not None and i == script.exception_after:
                yield exception_frame("modelStreamErrorException", "The model stream failed.")
                return
            yield None
            # The real stream pads events with a `p` field of filler characters.
            payload = {"contentBlockIndex": index, "delta": {"text": text}, "p": "abcdef"}
            frame = event_frame("contentBlockDelta", payload)
            if script.corrupt:  # a flipped bit: the message CRC no longer matches
                frame = frame[:-5] + bytes([frame[-5] ^ 1]) + frame[-4:]
            yield frame
        yield event_frame("contentBlockStop", {"contentBlockIndex": index})
        if tool is not None:
            index += 1
            start = {"toolUse": {"toolUseId": "tooluse_fake01", "name": tool}}
            yield event_frame("contentBlockStart", {"contentBlockIndex": index, "start": start})
            for part in TOOL_JSON_PARTS:
                delta = {"toolUse": {"input": part}}
                yield event_frame("contentBlockDelta", {"contentBlockIndex": index, "delta": delta})
            yield event_frame("contentBlockStop", {"contentBlockIndex": index})
        yield event_frame("messageStop", {"stopReason": stop})
        usage = self._usage(script, body, len(deltas) + (tool is not None))
        metadata: dict[str, Any] = {"usage": usage, "metrics": {"latencyMs": script.latency_ms}}
        if "performanceConfig" in body:
            metadata["performanceConfig"] = body["performanceConfig"]
        yield event_frame("metadata", metadata)


def validate(body: dict[str, Any]) -> None:
    """Converse's request shape; raises RefusedError (400 ValidationException) saying why."""

    def bad(message: str) -> RefusedError:
        return RefusedError(400, "ValidationException", message)

    known = {
        "messages",
        "system",
        "inferenceConfig",
        "toolConfig",
        "additionalModelRequestFields",
        "performanceConfig",
        "guardrailConfig",
        "requestMetadata",
        "promptVariables",
        "additionalModelResponseFieldPaths",
    }
    if extra := set(body) - known:
        raise bad(f"unknown fields: {sorted(extra)}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list")
    for i, message in enumerate(messages):
        role = "user" if i % 2 == 0 else "assistant"
        if message.get("role") != role:
            raise bad("A conversation must alternate between user and assistant roles.")
        content = message.get("content")
        if not isinstance(content, list) or not content:
            raise bad(f"messages.{i}.content must be a non-empty list")
        for block in content:
            if not isinstance(block, dict) or len(block) != 1 or not set(block) <= _BLOCKS:
                raise bad(f"messages.{i}.content has an invalid block: {block!r:.80}")
            if ("toolUse" in block or "toolResult" in block) and "toolConfig" not in body:
                raise bad("toolConfig field must be defined when using toolUse and toolResult")
            if "text" in block and not (isinstance(block["text"], str) and block["text"]):
                raise bad("text content blocks must be non-empty")
    system = body.get("system", [])
    if not isinstance(system, list) or any(len(b) != 1 for b in system):
        raise bad("system must be a list of text or cachePoint blocks")
    inference = body.get("inferenceConfig", {})
    types = {
        "maxTokens": int,
        "temperature": float | int,
        "topP": float | int,
        "stopSequences": list,
    }
    for key, value in inference.items():
        if key not in types or not isinstance(value, types[key]):
            raise bad(f"inferenceConfig.{key} is invalid")
    tools = body.get("toolConfig")
    if tools is not None:
        for tool in tools.get("tools") or ():
            spec = tool.get("toolSpec")
            if spec is None and "cachePoint" not in tool:
                raise bad("each tool needs a toolSpec")
            if spec is not None and not isinstance(spec.get("inputSchema", {}).get("json"), dict):
                raise bad("toolSpec.inputSchema.json must be an object")
        choice = tools.get("toolChoice")
        if choice is not None and (len(choice) != 1 or not set(choice) <= {"auto", "any", "tool"}):
            raise bad("toolChoice must be one of auto, any, tool")
    performance = body.get("performanceConfig")
    if performance is not None and performance.get("latency") not in ("standard", "optimized"):
        raise bad("performanceConfig.latency must be standard or optimized")


def _texts(body: dict[str, Any]) -> Iterator[str]:
    for block in body.get("system") or ():
        if "text" in block:
            yield block["text"]
    for message in body.get("messages") or ():
        for block in message.get("content") or ():
            if "text" in block:
                yield block["text"]


async def _json(
    send: Send, status: int, obj: dict[str, Any], extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    data = orjson.dumps(obj)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"x-amzn-requestid", b"5e1f0c8a-fake-4bed-rock-000000000002"),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _error(send: Send, refusal: RefusedError) -> None:
    kind = f"{refusal.kind}:http://internal.amazon.com/coral/com.amazon.bedrock/"
    await _json(
        send, refusal.status, {"message": refusal.message}, [(b"x-amzn-errortype", kind.encode())]
    )


async def _pause(ms: float, gone: asyncio.Event) -> None:
    if ms <= 0:
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(ms / 1000):
            await gone.wait()


@dataclass
class StsFake:
    """AWS STS's `AssumeRoleWithWebIdentity` (query protocol: a form POST, an XML answer), for
    the web identity link of the credential chain: it checks the role and the token it is sent
    and issues the given temporary credentials."""

    role_arn: str
    web_token: str
    issued: tuple[str, str, str]  # access key, secret, session token
    calls: int = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = await incoming(scope, receive, send)
        if received is None:
            return
        raw = received[0]
        form = dict(parse_qsl(raw.decode()))
        ok = (
            form.get("Action") == "AssumeRoleWithWebIdentity"
            and form.get("RoleArn") == self.role_arn
            and form.get("WebIdentityToken") == self.web_token
        )
        self.calls += 1
        key, secret, token = self.issued
        expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
        body = (
            (
                '<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
                "<AssumeRoleWithWebIdentityResult><Credentials>"
                f"<AccessKeyId>{key}</AccessKeyId><SecretAccessKey>{secret}</SecretAccessKey>"
                f"<SessionToken>{token}</SessionToken>"
                f"<Expiration>{expiry.strftime('%Y-%m-%dT%H:%M:%SZ')}</Expiration>"
                "</Credentials><AssumedRoleUser>"
                "<Arn>arn:aws:sts::123456789012:assumed-role/bedrock/test</Arn>"
                "<AssumedRoleId>AROAFAKE:test</AssumedRoleId></AssumedRoleUser>"
                "</AssumeRoleWithWebIdentityResult>"
                "<ResponseMetadata><RequestId>sts-fake-1</RequestId></ResponseMetadata>"
                "</AssumeRoleWithWebIdentityResponse>"
            )
            if ok
            else (
                '<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error>'
                "<Type>Sender</Type><Code>InvalidIdentityToken</Code>"
                "<Message>Couldn't retrieve verification key</Message></Error>"
                "<RequestId>sts-fake-2</RequestId></ErrorResponse>"
            )
        ).encode()
        headers = [(b"content-type", b"text/xml"), (b"content-length", str(len(body)).encode())]
        await send(
            {"type": "http.response.start", "status": 200 if ok else 400, "headers": headers}
        )
        await send({"type": "http.response.body", "body": body})
