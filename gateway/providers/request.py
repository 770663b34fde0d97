"""Shape one client call for one provider: the upstream body and how to translate the answer."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson

from gateway.errors import InvalidRequestError
from gateway.models import Call, Chunk, UpstreamRequest
from gateway.providers.translate import (
    AnthropicToOpenAIStream,
    OpenAIPassthrough,
    OpenAIToAnthropicStream,
    StreamTranslator,
    TranslationError,
    anthropic_response_to_openai,
    chat_request_to_anthropic,
    messages_request_to_openai,
    openai_response_to_anthropic,
)
from gateway.providers.translate.events import (
    AnthropicToResponsesStream,
    ChatToResponsesStream,
    ResponsesEvents,
    ResponsesPassthrough,
    ResponsesResult,
    anthropic_body_to_response,
    chat_body_to_response,
    native_body,
)
from gateway.providers.translate.items import translate_responses_request
from gateway.providers.translate.tools import UnsupportedTools
from gateway.responses.ids import new_response_id
from gateway.upstream import Provider

_STREAMED_WITH_USAGE = ("chat", "completions")
_SENDABLE_DEPTH = 254  # orjson serialises no deeper
# Headers every upstream is sent (see `gateway.api.admit.read_headers`): when these are all a
# request has, there is nothing to hold back from any upstream.
_EVERYWHERE: Final = frozenset({"x-request-id", "traceparent"})


def is_agent_header(name: str) -> bool:
    """A coding agent's session headers (Codex CLI's), forwarded only to an upstream that
    serves the Responses API natively: they mean something to OpenAI, nothing to others."""
    return name in AGENT_HEADERS or name.startswith("x-codex-")


AGENT_HEADERS: Final = frozenset(
    {"session-id", "session_id", "thread-id", "conversation_id", "conversation-id", "originator"}
)


class _Raw:
    """Same wire on both sides: forward every event untouched."""

    __slots__ = ()

    def feed(self, chunk: Chunk) -> bytes:
        return chunk.raw


_RAW = _Raw()
# The first `"model": "..."` of a body or event: a key, since a quote inside a string is escaped.
_MODEL_FIELD: Final = re.compile(rb'"model":\s*"(?:[^"\\]|\\.)*"')


class _Renamed:
    """An answer forwarded as-is but for its `model` field, which names what the client asked
    for. Bodies and events put `model` before their content, so the first one is the answer's."""

    __slots__ = ("_field", "_inner")

    def __init__(self, inner: StreamTranslator, name: str) -> None:
        self._inner = inner
        self._field = b'"model":' + orjson.dumps(name)

    def feed(self, chunk: Chunk) -> bytes:
        return self.rename(self._inner.feed(chunk))

    def rename(self, data: bytes) -> bytes:
        if b'"model"' not in data:
            return data
        return _MODEL_FIELD.sub(lambda _: self._field, data, count=1)


@dataclass(slots=True)
class Prepared:
    """The upstream request for one attempt, and how its answer reaches the client."""

    request: UpstreamRequest
    stream: StreamTranslator  # a fresh one per attempt: translators keep per-stream state
    body: Callable[[Chunk], bytes]  # non-streaming response body in the client's wire format
    # Responses API only: how a stream cut after commit ends (code, message → the last
    # events), and the Response object once the answer is complete (what the store keeps).
    fail: Callable[[str, str], bytes] | None = None
    result: ResponsesResult | None = None
    dropped: tuple[str, ...] = ()  # tools translation left out (`x-tailguard-dropped-tools`)


def prepare(
    call: Call,
    provider: Provider,
    upstream_model: str,
    headers: dict[str, str],
    unsupported_tools: UnsupportedTools = "drop",
) -> Prepared:
    """Raises InvalidRequestError when the call cannot be expressed in the provider's format.
    `unsupported_tools`: what the model does with Responses tools a translated upstream cannot
    run (`drop` them, or `refuse` the request)."""
    if not headers.keys() <= _EVERYWHERE:
        headers = _headers_for(call, provider, headers)
    try:
        return _prepare(call, provider, upstream_model, headers, unsupported_tools)
    except TranslationError as exc:
        raise InvalidRequestError(
            f"{provider.name}/{upstream_model}: {exc}", param=exc.param
        ) from None
    except orjson.JSONEncodeError as exc:
        # Only what translation parses out of strings (tool-call arguments) can be this deep:
        # the body itself was held to MAX_JSON_DEPTH when it arrived. orjson's error is a
        # TypeError: anything else is a bug in translation, not the client's.
        if "recursion" not in str(exc).lower():
            raise
        raise InvalidRequestError(
            f"{provider.name}/{upstream_model}: the request is nested too deeply to be sent "
            f"once translated (at most {_SENDABLE_DEPTH} levels of arrays and objects).",
            code="json_too_deep",
        ) from None


def _headers_for(call: Call, provider: Provider, headers: dict[str, str]) -> dict[str, str]:
    """The client's headers this upstream may see: Anthropic's betas go to Anthropic only, an
    agent's session headers to a native Responses upstream only."""
    native = call.endpoint == "responses" and provider.wire == "openai"
    native = native and provider.supports("responses")
    anthropic = provider.wire == "anthropic"
    return {
        name: value
        for name, value in headers.items()
        if (anthropic or name != "anthropic-beta") and (native or not is_agent_header(name))
    }


def _prepare(
    call: Call,
    provider: Provider,
    upstream_model: str,
    headers: dict[str, str],
    unsupported_tools: UnsupportedTools,
) -> Prepared:
    stream = call.stream
    answer = call.answer_model or upstream_model  # the `model` of a translated answer
    # vLLM with priority scheduling serves bulk requests after interactive ones.
    extra: dict[str, Any] = {}
    if call.priority == "bulk" and provider.bulk_priority is not None:
        extra["priority"] = provider.bulk_priority
    if call.endpoint == "responses":
        return _prepare_responses(call, provider, upstream_model, headers, extra, unsupported_tools)
    if call.wire == provider.wire:
        if call.wire == "openai":
            translator: StreamTranslator = OpenAIPassthrough(include_usage=call.include_usage)
            # Always ask for usage: token counts feed the latency statistics.
            want_usage = stream and call.endpoint in _STREAMED_WITH_USAGE and not call.include_usage
            if upstream_model == call.model and not want_usage and not extra:
                body = call.raw
            else:
                changed: dict[str, Any] = {**call.body, "model": upstream_model, **extra}
                if want_usage:
                    changed["stream_options"] = {
                        **(call.body.get("stream_options") or {}),
                        "include_usage": True,
                    }
                body = orjson.dumps(changed)
        else:
            translator = _RAW
            body = (
                call.raw
                if upstream_model == call.model
                else orjson.dumps({**call.body, "model": upstream_model})
            )
        # OpenAI events reach an OpenAI client untouched: most need not even be parsed.
        request = UpstreamRequest(
            call.endpoint, body, stream, headers, passthrough=call.wire == "openai"
        )
        if call.answer_model is not None and call.answer_model != upstream_model:
            renamed = _Renamed(translator, call.answer_model)
            return Prepared(request, renamed, lambda chunk: renamed.rename(chunk.raw))
        return Prepared(request, translator, _RAW.feed)  # a body, like an event, is forwarded as-is

    if call.wire == "openai":  # OpenAI chat to an Anthropic upstream
        translated = chat_request_to_anthropic(call.body)
        translated["model"] = upstream_model
        request = UpstreamRequest("messages", orjson.dumps(translated), stream, headers)

        def to_openai(chunk: Chunk) -> bytes:
            return anthropic_response_to_openai(chunk.data or {}, model=answer)

        return Prepared(
            request,
            AnthropicToOpenAIStream(model=answer, include_usage=call.include_usage),
            to_openai,
        )

    # Anthropic Messages to an OpenAI-compatible upstream. OpenAI's own API takes a prompt
    # cache key: a byte search finds whether the client marked a prefix to cache.
    cache_hint = provider.system == "openai" and b'"cache_control"' in call.raw
    translated = messages_request_to_openai(call.body, cache_hint=cache_hint)
    translated["model"] = upstream_model
    translated.update(extra)
    request = UpstreamRequest("chat", orjson.dumps(translated), stream, headers)

    def to_anthropic(chunk: Chunk) -> bytes:
        return openai_response_to_anthropic(chunk.data or {}, model=answer)

    return Prepared(request, OpenAIToAnthropicStream(model=answer), to_anthropic)


def _prepare_responses(
    call: Call,
    provider: Provider,
    upstream_model: str,
    headers: dict[str, str],
    extra: dict[str, Any],
    unsupported_tools: UnsupportedTools,
) -> Prepared:
    """A Responses call: forwarded to an upstream that serves it natively, else translated to
    chat completions or Messages. The conversation (`previous_response_id`, `conversation`) was
    expanded into `input` at the edge, so the upstream is asked to store nothing."""
    result = ResponsesResult()
    stream = call.stream
    if provider.wire == "openai" and provider.supports("responses"):
        native = {
            k: v for k, v in call.body.items() if k not in ("previous_response_id", "conversation")
        }
        native.update(model=upstream_model, store=False)
        passthrough = ResponsesPassthrough(result)
        request = UpstreamRequest("responses", orjson.dumps(native), stream, headers)

        def forward(chunk: Chunk) -> bytes:
            return native_body(chunk.data, chunk.raw, result)

        if call.answer_model is not None and call.answer_model != upstream_model:
            renamed = _Renamed(passthrough, call.answer_model)
            return Prepared(
                request,
                renamed,
                lambda chunk: renamed.rename(forward(chunk)),
                passthrough.fail,
                result,
            )
        return Prepared(request, passthrough, forward, passthrough.fail, result)

    chat, names = translate_responses_request(call.body, unsupported_tools)
    chat["model"] = upstream_model
    answer = call.answer_model or upstream_model  # the `model` of the Response object
    dropped = tuple(names.dropped)
    response_id = new_response_id(stored=call.body.get("store") is not False)
    events = ResponsesEvents(call.body, response_id, answer, result, names)
    if provider.wire == "anthropic":
        translated = chat_request_to_anthropic(chat)
        translated["model"] = upstream_model
        request = UpstreamRequest("messages", orjson.dumps(translated), stream, headers)

        def from_anthropic(chunk: Chunk) -> bytes:
            return anthropic_body_to_response(
                chunk.data or {}, call.body, response_id, answer, result, names
            )

        translator: StreamTranslator = AnthropicToResponsesStream(events, answer)
        return Prepared(request, translator, from_anthropic, events.fail, result, dropped)

    chat.update(extra)
    request = UpstreamRequest("chat", orjson.dumps(chat), stream, headers)

    def from_chat(chunk: Chunk) -> bytes:
        return chat_body_to_response(
            chunk.data or {}, call.body, response_id, answer, result, names
        )

    translator = ChatToResponsesStream(events)
    return Prepared(request, translator, from_chat, events.fail, result, dropped)
