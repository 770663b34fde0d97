"""Translate between the OpenAI chat wire and the Anthropic Messages wire. Pure: no I/O.

Requests are translated as dicts (the caller sets the upstream model afterwards). Responses are
translated from the parsed upstream body to the client's JSON bytes. Streams go through one
stateful translator per response: the attempt loop feeds it every decoded `Chunk` and forwards the
bytes it returns. The translators reuse `Chunk.data` (parsed once by the decoder) and splice
pre-built constant bytes around each delta, so the per-event cost is one small `orjson.dumps`.

What one wire cannot express raises `TranslationError` naming the field; hints that only steer
sampling on one side (penalties, seeds, `reasoning_effort`, `thinking`, `top_k` towards OpenAI)
are dropped rather than refused, so a fallback across wires keeps working.

Request translation lives in `requests`, response translation (and the stop-reason, id and usage
vocabulary) in `responses`, and the stream translators in `streams`; this package re-exports what
callers use.
"""

from __future__ import annotations

from gateway.providers.translate.requests import (
    DEFAULT_MAX_TOKENS,
    TranslationError,
    chat_request_to_anthropic,
    messages_request_to_openai,
)
from gateway.providers.translate.responses import (
    anthropic_response_to_openai,
    openai_response_to_anthropic,
)
from gateway.providers.translate.streams import (
    AnthropicToOpenAIStream,
    OpenAIPassthrough,
    OpenAIToAnthropicStream,
    StreamTranslator,
)

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "AnthropicToOpenAIStream",
    "OpenAIPassthrough",
    "OpenAIToAnthropicStream",
    "StreamTranslator",
    "TranslationError",
    "anthropic_response_to_openai",
    "chat_request_to_anthropic",
    "messages_request_to_openai",
    "openai_response_to_anthropic",
]
