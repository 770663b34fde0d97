"""The reply writer: OpenAI-shaped bodies, and the SSE frames of a stream prebuilt as bytes.

A stream's chunk head (id, created, model) is built once per stream and each word's tail once per
process, so a streamed token costs one bytes concatenation. Embedding vectors are a function of
the input alone.
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
from typing import Final

import orjson

from gateway.sim.planner import Plan
from gateway.sim.text import TOKENS, text

__all__ = ["DONE", "Frames", "ReplyWriter", "embeddings_body", "usage"]

DONE: Final = b"data: [DONE]\n\n"
_CHOICE_TAIL: Final = b',"logprobs":null,"finish_reason":null}]'
_VECTOR_CACHE_SIZE: Final = 4096


@dataclass(slots=True)
class Frames:
    """The SSE events of one streamed sequence, but for its usage chunk (counted at the end)."""

    first: bytes | None  # sent before the first token (chat's role chunk)
    token_head: bytes  # a token chunk is this, then the token's tail
    token_tails: tuple[bytes, ...]  # per word of the pseudo-text cycle
    finish: bytes
    usage_head: bytes | None  # None: the client asked for no usage chunk


class ReplyWriter:
    """Writes one engine's replies, numbering their ids (`<kind>-<engine prefix><counter>`)."""

    def __init__(self, id_prefix: str) -> None:
        self._ids = itertools.count(1)
        self._id_prefix = id_prefix

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{self._id_prefix}{next(self._ids):08x}"

    def chat_frames(self, plan: Plan, *, include_usage: bool) -> Frames:
        head = (
            b'data: {"id":"'
            + self._new_id("chatcmpl-").encode()
            + b'","object":"chat.completion.chunk","created":'
            + str(int(time.time())).encode()
            + b',"model":'
            + plan.target.model_json
            + b',"system_fingerprint":null,"choices":'
        )
        tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"
        role = head + b'[{"index":0,"delta":{"role":"assistant","content":""}' + _CHOICE_TAIL
        return Frames(
            first=role + tail,
            token_head=head + b'[{"index":0,"delta":{"content":',
            token_tails=_CHAT_TAILS[include_usage],
            finish=head
            + b'[{"index":0,"delta":{},"logprobs":null,"finish_reason":"'
            + plan.finish_reason.encode()
            + b'"}]'
            + tail,
            usage_head=head + b'[],"usage":' if include_usage else None,
        )

    def completion_frames(self, plan: Plan, *, include_usage: bool) -> Frames:
        head = (
            b'data: {"id":"'
            + self._new_id("cmpl-").encode()
            + b'","object":"text_completion","created":'
            + str(int(time.time())).encode()
            + b',"model":'
            + plan.target.model_json
            + b',"choices":'
        )
        tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"
        return Frames(
            first=None,
            token_head=head + b'[{"index":0,"text":',
            token_tails=_TEXT_TAILS[include_usage],
            finish=head
            + b'[{"index":0,"text":"","logprobs":null,"finish_reason":"'
            + plan.finish_reason.encode()
            + b'"}]'
            + tail,
            usage_head=head + b'[],"usage":' if include_usage else None,
        )

    def chat_body(self, model: str, plan: Plan) -> bytes:
        completion = {
            "id": self._new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text(plan.offset, plan.n),
                        "refusal": None,
                    },
                    "logprobs": None,
                    "finish_reason": plan.finish_reason,
                }
            ],
            "usage": usage(plan.prompt_tokens, plan.n),
        }
        return orjson.dumps(completion)

    def completions_body(self, model: str, plans: Sequence[Plan], prompt_tokens: int) -> bytes:
        """Choice `index` is the plan's position: `prompt * n + j`."""
        completion = {
            "id": self._new_id("cmpl-"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": i,
                    "text": text(p.offset, p.n),
                    "logprobs": None,
                    "finish_reason": p.finish_reason,
                }
                for i, p in enumerate(plans)
            ],
            "usage": usage(prompt_tokens, sum(p.n for p in plans)),
        }
        return orjson.dumps(completion)


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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


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
