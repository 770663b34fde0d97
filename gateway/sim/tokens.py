"""The simulator's tokenizer: four characters a token, over the prompt rendered as text.

A chat prompt renders as its tool definitions (their JSON), then each message's text in order:
a content string or the text parts of a content array, then the name and arguments of each
tool call, joined with nothing between them, so a conversation's rendering begins with its
history's. Token i is characters 4i to 4i + 4 of the rendering (an empty one is a single empty
token); a prompt sent as token ids is those tokens. `usage.prompt_tokens`, `POST /tokenize`, the
context limit and the prefix cache's blocks all read this one tokenization, so they agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

__all__ = ["BLOCK_TOKENS", "CHARS_PER_TOKEN", "block_hashes", "pieces", "text_tokens", "token_ids"]

CHARS_PER_TOKEN: Final = 4
BLOCK_TOKENS: Final = 16
"""Tokens per prefix-cache block (vLLM's default block size)."""
_VOCABULARY: Final = 50_000
_EMPTY_ID: Final = 1  # the one token of an empty prompt


def text_tokens(chars: int) -> int:
    """Tokens of a text of `chars` characters (never 0)."""
    return max(1, (chars + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN)


def pieces(text: str) -> list[str]:
    """The text of each token."""
    if not text:
        return [""]
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


def token_ids(prompt: str | Sequence[int]) -> list[int]:
    """Token ids: a stable hash of each token's text, or the ids a prompt was sent as."""
    if not isinstance(prompt, str):
        return list(prompt)
    if not prompt:
        return [_EMPTY_ID]
    return [
        2
        + int.from_bytes(hashlib.blake2b(p.encode(), digest_size=4).digest(), "little")
        % _VOCABULARY
        for p in pieces(prompt)
    ]


def block_hashes(prompt: str | Sequence[int]) -> list[bytes]:
    """The hash chain of the prompt's full blocks, as vLLM's prefix cache keys them: block i's
    hash covers its tokens and, through block i - 1's hash, everything before them."""
    hashes: list[bytes] = []
    previous = b""
    if isinstance(prompt, str):
        size = BLOCK_TOKENS * CHARS_PER_TOKEN
        blocks = [prompt[i : i + size].encode() for i in range(0, len(prompt) - size + 1, size)]
    else:
        size = BLOCK_TOKENS
        blocks = [
            b",".join(b"%d" % t for t in prompt[i : i + size])
            for i in range(0, len(prompt) - size + 1, size)
        ]
    for block in blocks:
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        hashes.append(previous)
    return hashes
