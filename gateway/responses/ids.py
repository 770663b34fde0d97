"""The ids of the responses and conversations the gateway makes (`resp_...`, `conv_...`), which
say when they were made.

A stored response is written to Redis off the request path, so for a moment (longer while
Redis fails over) a replica other than the one that made it may not find it yet. The id tells
that replica whether the response is recent enough for its write to be still pending: then the
answer is 503 `store_unavailable` (try again), not "not found". An id made for a request with
`store: false` carries no time, since nothing will ever be written.
"""

from __future__ import annotations

import re
import time
import uuid

__all__ = ["minted_at", "new_conversation_id", "new_response_id"]

_MARKED = re.compile(r"(?:resp|conv)_t([0-9a-f]{8})[0-9a-f]{24}")


def new_response_id(*, stored: bool = True, now: float | None = None) -> str:
    """A fresh response id: `resp_t<8 hex digits: unix seconds><24 random hex digits>` when the
    response is to be stored, else `resp_<32 random hex digits>`."""
    if not stored:
        return "resp_" + uuid.uuid4().hex
    seconds = int(time.time() if now is None else now) & 0xFFFFFFFF
    return f"resp_t{seconds:08x}{uuid.uuid4().hex[:24]}"


def new_conversation_id(*, now: float | None = None) -> str:
    """A fresh conversation id, `conv_t<8 hex digits: unix seconds><24 random hex digits>`: a
    conversation is stored as a response is, and its id says when in the same way."""
    seconds = int(time.time() if now is None else now) & 0xFFFFFFFF
    return f"conv_t{seconds:08x}{uuid.uuid4().hex[:24]}"


def minted_at(response_id: str) -> int | None:
    """When the gateway made this id (unix seconds), or None: not one of its stored ids."""
    found = _MARKED.fullmatch(response_id)
    return int(found.group(1), 16) if found is not None else None
