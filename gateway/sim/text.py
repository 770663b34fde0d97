"""The simulator's pseudo-text: a cycle over a fixed word list, each sequence starting at a word.

A sequence's text is a function of (first word, token count) alone, so the planner draws only
the offset and the writer and the stream produce the same words from it.
"""

from __future__ import annotations

import itertools
from typing import Final

__all__ = ["TOKENS", "text"]

# fmt: off
_WORDS: Final = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "tired", "engineers", "measure", "tail", "latency", "of", "every", "streamed", "token",
    "under", "heavy", "load", "and", "note", "how", "queues", "grow", "when", "batches", "fill",
    "up", "so", "they", "route", "slow", "requests", "elsewhere", "before", "budgets", "run",
    "out", "then", "hedge", "once", "more", "because", "p99", "matters", "far", "beyond", "any",
    "mean",
)
# fmt: on
TOKENS: Final = tuple(word + " " for word in _WORDS)
"""One token per word, with its trailing space: what each streamed chunk carries."""
_CYCLE: Final = "".join(TOKENS)
_STARTS: Final = tuple(itertools.accumulate((len(t) for t in TOKENS), initial=0))


def text(offset: int, n: int) -> str:
    """`n` tokens of pseudo-text starting at word `offset` (the same text the stream sends)."""
    q, r = divmod(offset + n, len(TOKENS))
    return (_CYCLE * q + _CYCLE[: _STARTS[r]])[_STARTS[offset] :]
