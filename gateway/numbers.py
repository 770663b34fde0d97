"""Numbers that come from outside (upstream headers and bodies, a vLLM `/metrics` page), read so
that no value can raise: a value out of range is clamped or ignored, never passed on as `inf`,
`nan` or a negative count.

A leaf: imports nothing of the gateway, so every room may use it.
"""

from __future__ import annotations

import email.utils
import math
import re
from typing import Final

MAX_WAIT_S: Final = 86_400.0  # a `retry-after` beyond a day is read as a day
MAX_TOKENS: Final = 100_000_000  # more than any response's token count: a larger one is a lie

# RFC 9110 delay-seconds is digits; OpenAI's `retry-after-ms` may carry a fraction. Nothing else
# (no sign, exponent, `inf`, `nan` or Python's `1_000`) is a number here.
_DECIMAL: Final = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def decimal(text: str | None, *, ceiling: float) -> float | None:
    """A non-negative decimal (`12`, `0.5`), clamped to `ceiling` (so is one too long for a
    float, which reads as `inf`); None for anything else."""
    if text is None:
        return None
    text = text.strip()
    if not _DECIMAL.fullmatch(text):
        return None
    return min(float(text), ceiling)


def delay_until(text: str | None, now: float, *, ceiling: float = MAX_WAIT_S) -> float | None:
    """Seconds from `now` (Unix time) to an HTTP date, in [0, ceiling]; None if not a date."""
    if not text:
        return None
    try:
        when = email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError, OverflowError, IndexError):
        return None
    return min(max(0.0, when - now), ceiling)


def retry_after_s(
    seconds: str | None, millis: str | None, now: float, *, ceiling: float = MAX_WAIT_S
) -> float | None:
    """The wait an upstream asked for: `retry-after-ms` first, then `retry-after` (seconds or an
    HTTP date); in [0, ceiling], or None when neither header holds a usable value."""
    wait = decimal(millis, ceiling=ceiling * 1000)
    if wait is not None:
        return wait / 1000
    wait = decimal(seconds, ceiling=ceiling)
    if wait is not None:
        return wait
    return delay_until(seconds, now, ceiling=ceiling)


def wait_or_none(value: float | None, *, ceiling: float = MAX_WAIT_S) -> float | None:
    """A wait in seconds made safe to round: None stays None and so does `nan`; the rest is
    clamped to [0, ceiling] (`inf` included)."""
    if value is None or math.isnan(value):
        return None
    return min(max(0.0, value), ceiling)


def count(value: object, *, ceiling: int = MAX_TOKENS) -> int | None:
    """A token count from a JSON body: an int (not a bool) in [0, ceiling], else None."""
    if type(value) is not int or not 0 <= value <= ceiling:
        return None
    return value


def gauge(value: float, *, ceiling: float) -> float | None:
    """A sampled value (queue length, counter, bucket count): finite and non-negative, clamped
    to `ceiling`; None for `nan`, an infinity or a negative value."""
    if not math.isfinite(value) or value < 0:
        return None
    return min(value, ceiling)


def bound(text: str | None) -> float | None:
    """A histogram bucket's upper bound (`0.5`, `+Inf`); None when it is not one."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isnan(value) or value < 0 else value
