"""The reply writer: OpenAI-shaped bodies, and the SSE frames of a stream prebuilt as bytes.

A stream's chunk head (id, created, model) is built once per stream and each word's tail once per
process, so a streamed token of plain pseudo-text costs one bytes concatenation; a choice with
more to it (reasoning, tool calls, JSON, log probabilities, a stop sequence) has each of its
token frames built before the first is sent. Each choice of a stream has its own frames, with
its `index`. Embedding vectors are a function of the input alone.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import math
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from gateway.sim.output import Output, TokenLogprob
from gateway.sim.planner import Plan
from gateway.sim.text import TOKENS, text

__all__ = ["DONE", "Frames", "ReplyWriter", "embeddings_body", "request_usage", "usage"]

DONE: Final = b"data: [DONE]\n\n"
_CHOICE_TAIL: Final = b',"logprobs":null,"finish_reason":null}]'
_VECTOR_CACHE_SIZE: Final = 4096


@dataclass(slots=True)
class Frames:
    """The SSE events of one streamed choice (the request's usage chunk comes after them all).

    Token `i` is `tokens[i]` (None: a token that shows nothing), or, for plain pseudo-text
    (`tokens` None), `token_head` and the tail of word `offset + i`.
    """

    first: bytes | None  # sent before the first token (chat's role chunk, an echoed prompt)
    token_head: bytes
    token_tails: tuple[bytes, ...]  # per word of the pseudo-text cycle
    finish: bytes
    tokens: list[bytes | None] | None = None


@dataclass(slots=True)
class StreamHead:
    """What every chunk of one stream starts and ends with."""

    head: bytes  # `data: {"id":...,"choices":`
    tail: bytes  # closes the chunk (with `"usage":null` when a usage chunk will follow)
    usage_head: bytes | None  # None: the client asked for no usage chunk


class ReplyWriter:
    """Writes one engine's replies, numbering their ids (`<kind>-<engine prefix><counter>`)."""

    def __init__(self, id_prefix: str) -> None:
        self._ids = itertools.count(1)
        self._id_prefix = id_prefix

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{self._id_prefix}{next(self._ids):08x}"

    def _stream_head(self, plan: Plan, kind: bytes, *, include_usage: bool) -> StreamHead:
        chat = kind == b"chat.completion.chunk"
        head = (
            b'data: {"id":"'
            + self._new_id("chatcmpl-" if chat else "cmpl-").encode()
            + b'","object":"'
            + kind
            + b'","created":'
            + str(int(time.time())).encode()
            + b',"model":'
            + plan.target.model_json
            + b',"choices":'  # no `system_fingerprint`: the schema wants a string or nothing
        )
        tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"
        return StreamHead(head, tail, head + b'[],"usage":' if include_usage else None)

    def chat_frames(
        self, plans: Sequence[Plan], *, include_usage: bool
    ) -> tuple[list[Frames], StreamHead]:
        """The frames of each choice (plan `i` is choice `i`) and the stream's head."""
        stream = self._stream_head(plans[0], b"chat.completion.chunk", include_usage=include_usage)
        head, tail = stream.head, stream.tail
        frames = []
        for i, plan in enumerate(plans):
            start = head + b'[{"index":%d,"delta":' % i
            frames.append(
                Frames(
                    first=start + b'{"role":"assistant","content":""}' + _CHOICE_TAIL + tail,
                    token_head=start + b'{"content":',
                    token_tails=_CHAT_TAILS[include_usage],
                    finish=start
                    + b'{},"logprobs":null,"finish_reason":"'
                    + plan.finish_reason.encode()
                    + b'"}]'
                    + tail,
                    tokens=None if plan.output is None else _chat_tokens(start, tail, plan.output),
                )
            )
        return frames, stream

    def completion_frames(
        self, plans: Sequence[Plan], *, include_usage: bool
    ) -> tuple[list[Frames], StreamHead]:
        """The frames of each choice (plan `i` is choice `i`) and the stream's head."""
        stream = self._stream_head(plans[0], b"text_completion", include_usage=include_usage)
        head, tail = stream.head, stream.tail
        frames = []
        for i, plan in enumerate(plans):
            start = head + b'[{"index":%d,"text":' % i
            output = plan.output
            first = None
            if output is not None and output.echo:
                logprobs = _completion_logprobs(output.echo_logprobs, 0)
                first = _text_chunk(start, output.echo, logprobs, tail)
            frames.append(
                Frames(
                    first=first,
                    token_head=start,
                    token_tails=_TEXT_TAILS[include_usage],
                    finish=start
                    + b'"","logprobs":null,"finish_reason":"'
                    + plan.finish_reason.encode()
                    + b'"}]'
                    + tail,
                    tokens=None if output is None else _text_tokens(start, tail, output),
                )
            )
        return frames, stream

    def chat_body(self, model: str, plans: Sequence[Plan], usage: dict[str, Any]) -> bytes:
        completion = {
            "id": self._new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [_chat_choice(i, plan) for i, plan in enumerate(plans)],
            "usage": usage,
        }
        return orjson.dumps(completion)

    def completions_body(self, model: str, plans: Sequence[Plan], usage: dict[str, Any]) -> bytes:
        """Choice `index` is the plan's position: `prompt * n + j`."""
        choices = []
        for i, plan in enumerate(plans):
            output = plan.output
            if output is None:
                choice_text, logprobs = text(plan.offset, plan.n), None
            else:
                answer = output.text() or ""
                choice_text = output.echo + answer
                logprobs = _completion_logprobs_body(output)
            choices.append(
                {
                    "index": i,
                    "text": choice_text,
                    "logprobs": logprobs,
                    "finish_reason": plan.finish_reason,
                }
            )
        completion = {
            "id": self._new_id("cmpl-"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage,
        }
        return orjson.dumps(completion)


def _chat_choice(index: int, plan: Plan) -> dict[str, Any]:
    output = plan.output
    if output is None:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text(plan.offset, plan.n),
            "refusal": None,
        }
        logprobs = None
    else:
        message = {"role": "assistant", "content": output.text(), "refusal": None}
        if output.reasoning:
            message["reasoning_content"] = "".join(output.reasoning)
        if output.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in output.tool_calls
            ]
        logprobs = None
        if output.logprobs is not None:
            entries = [_chat_logprob(entry) for entry in output.logprobs]
            logprobs = {"content": entries if output.content is not None else None, "refusal": None}
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": plan.finish_reason,
    }


def _chat_logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode()),
        "top_logprobs": [
            {"token": token, "logprob": logprob, "bytes": list(token.encode())}
            for token, logprob in entry.top
        ],
    }


def _chat_tokens(start: bytes, tail: bytes, output: Output) -> list[bytes | None]:
    """One frame per generated token: reasoning, then content or tool calls."""
    frames: list[bytes | None] = [
        start + b'{"reasoning_content":' + orjson.dumps(piece) + b"}" + _CHOICE_TAIL + tail
        for piece in output.reasoning
    ]
    if output.content is not None:
        logprobs = iter(output.logprobs or ())
        for piece in output.content:
            if not piece:
                frames.append(None)  # generated, hidden by the stop sequence
                continue
            chunk_logprobs = b"null"
            if output.logprobs is not None:
                entry = _chat_logprob(next(logprobs))
                chunk_logprobs = orjson.dumps({"content": [entry], "refusal": None})
            frames.append(
                start
                + b'{"content":'
                + orjson.dumps(piece)
                + b'},"logprobs":'
                + chunk_logprobs
                + b',"finish_reason":null}]'
                + tail
            )
    for k, call in enumerate(output.tool_calls):
        opening = {
            "index": k,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        frames.append(_tool_delta(start, tail, opening))
        frames.extend(
            _tool_delta(start, tail, {"index": k, "function": {"arguments": fragment}})
            for fragment in call.fragments
        )
    return frames


def _tool_delta(start: bytes, tail: bytes, call: dict[str, Any]) -> bytes:
    return start + b'{"tool_calls":[' + orjson.dumps(call) + b"]}" + _CHOICE_TAIL + tail


def _text_chunk(start: bytes, piece: str, logprobs: object, tail: bytes) -> bytes:
    return (
        start
        + orjson.dumps(piece)
        + b',"logprobs":'
        + orjson.dumps(logprobs)
        + b',"finish_reason":null}]'
        + tail
    )


def _text_tokens(start: bytes, tail: bytes, output: Output) -> list[bytes | None]:
    frames: list[bytes | None] = []
    entries = iter(output.logprobs or ())
    position = len(output.echo)
    for piece in output.content or ():
        if not piece:
            frames.append(None)
            continue
        logprobs = None
        if output.logprobs is not None:
            logprobs = _completion_logprobs([next(entries)], position)
        frames.append(_text_chunk(start, piece, logprobs, tail))
        position += len(piece)
    return frames


def _completion_logprobs(entries: Sequence[TokenLogprob], position: int) -> dict[str, Any] | None:
    """The completions API's logprobs object for `entries`, the first at `position`."""
    if not entries:
        return None
    offsets = list(itertools.accumulate((len(e.token) for e in entries[:-1]), initial=position))
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            dict(e.top) if e.top else ({e.token: e.logprob} if e.logprob is not None else None)
            for e in entries
        ],
        "text_offset": offsets,
    }


def _completion_logprobs_body(output: Output) -> dict[str, Any] | None:
    if output.logprobs is None:
        return None
    return _completion_logprobs([*output.echo_logprobs, *output.logprobs], 0) or {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }


def request_usage(
    plans: Sequence[Plan], prompt_tokens: int, per_prompt: int = 1, *, chat: bool = True
) -> dict[str, Any]:
    """The usage of a request whose choices are `plans` (`per_prompt` for each prompt).

    Cached tokens (when the model has a prefix cache) are those of each prompt's first choice;
    reasoning tokens show when the profile generates them (chat only).
    """
    profile = plans[0].target.profile
    cached = None
    if plans[0].target.cache is not None:
        cached = sum(plan.cached_tokens for plan in plans[::per_prompt])
    reasoning = None
    if chat and profile.reasoning_tokens:
        reasoning = sum(len(p.output.reasoning) for p in plans if p.output is not None)
    return usage(prompt_tokens, sum(p.n for p in plans), cached=cached, reasoning=reasoning)


def embeddings_body(
    model: str, inputs: Sequence[tuple[bytes, int]], dims: int, *, b64: bool, tokens: int
) -> bytes:
    data = [
        {"object": "embedding", "index": i, "embedding": _vector(key, dims)[b64]}
        for i, (key, _) in enumerate(inputs)
    ]
    body = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return orjson.dumps(body)


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    *,
    cached: int | None = None,
    reasoning: int | None = None,
) -> dict[str, Any]:
    """OpenAI's usage object; the details only for what the model simulates."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


@functools.lru_cache(maxsize=_VECTOR_CACHE_SIZE)
def _vector(key: bytes, dims: int) -> tuple[tuple[float, ...], str]:
    """A unit vector derived from the input alone, as floats and as base64 float32 (LE)."""
    raw = struct.unpack(f"<{dims}H", hashlib.shake_128(key).digest(2 * dims))
    centred = [v - 32767.5 for v in raw]  # never all zero: each |v| >= 0.5
    norm = math.sqrt(math.fsum(v * v for v in centred))
    packed = struct.pack(f"<{dims}f", *(v / norm for v in centred))
    # Both encodings carry the same float32 values.
    return struct.unpack(f"<{dims}f", packed), base64.b64encode(packed).decode()


def _tails(choice_tail: bytes) -> dict[bool, tuple[bytes, ...]]:
    """Per word, the bytes after the chunk head, with and without `"usage":null`."""
    return {
        with_usage: tuple(
            orjson.dumps(token) + choice_tail + (b',"usage":null}\n\n' if with_usage else b"}\n\n")
            for token in TOKENS
        )
        for with_usage in (False, True)
    }


_CHAT_TAILS: Final = _tails(b"}" + _CHOICE_TAIL)  # closes the delta object first
_TEXT_TAILS: Final = _tails(_CHOICE_TAIL)
