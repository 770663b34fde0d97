"""JSON values as JSON Schema sees them, and the scalars the schema generator draws.

Types (a whole float is an integer), equality (`false` is not `0`), whether an `enum` value
meets the keywords beside it, and the draws of words, formatted strings and bounded numbers.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping
from typing import Any, Final, TypeGuard

from gateway.sim.text import TOKENS

__all__ = [
    "FORMATS",
    "SchemaError",
    "canonical",
    "fits",
    "formatted",
    "numeric",
    "same",
    "type_of",
    "where",
    "words",
]

DEFAULT_SPAN: Final = 100  # an unbounded integer or number is drawn within this of its bound
WORDS: Final = tuple(token.strip() for token in TOKENS)
FORMATS: Final = frozenset(
    {"date-time", "date", "time", "email", "uuid", "uri", "url", "hostname", "ipv4", "ipv6"}
)


class SchemaError(ValueError):
    """A schema the simulator cannot draw values for; the message says where and why."""


def type_of(value: object) -> str:
    """The JSON type of a JSON value (a whole float is an integer, as JSON Schema says)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def fits(value: object, node: Mapping[str, Any]) -> bool:
    """Whether an `enum`/`const` value meets the type and the scalar bounds beside it."""
    kind = type_of(value)
    kinds = node.get("type")
    if kinds is not None:
        allowed = kinds if isinstance(kinds, list) else [kinds]
        if kind not in allowed and not (kind == "integer" and "number" in allowed):
            return False
    if isinstance(value, str):
        pattern = node.get("pattern")
        return (
            len(value) >= (node.get("minLength") or 0)
            and len(value) <= node.get("maxLength", len(value))
            and (not isinstance(pattern, str) or re.search(pattern, value) is not None)
        )
    if isinstance(value, int | float) and not isinstance(value, bool):
        low, high = node.get("minimum"), node.get("maximum")
        ex_low, ex_high = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
        multiple = node.get("multipleOf")
        return not (
            (low is not None and (value < low or (ex_low is True and value == low)))
            or (high is not None and (value > high or (ex_high is True and value == high)))
            or (is_number(ex_low) and value <= ex_low)
            or (is_number(ex_high) and value >= ex_high)
            or (multiple is not None and value / multiple != int(value / multiple))
        )
    return True


def same(a: object, b: object) -> bool:
    """JSON equality: `false` is not `0`, at any depth (`[false]` is not `[0]`)."""
    if type_of(a) != type_of(b):
        return False
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(canonical(a) == canonical(b))


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def canonical(value: Any) -> Any:
    """A value as JSON Schema compares it for `uniqueItems`: 1 and 1.0 are the same."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    return value


def where(path: str) -> str:
    return path or "the schema"


def words(rng: random.Random, least: int, most: int) -> str:
    start = rng.randrange(len(WORDS))
    count = rng.randint(least, most)
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(count))


def formatted(rng: random.Random, fmt: str) -> str:
    date = f"20{rng.randint(20, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    time = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
    word = rng.choice(WORDS)
    if fmt == "date-time":
        return f"{date}T{time}Z"
    if fmt == "date":
        return date
    if fmt == "time":
        return f"{time}Z"
    if fmt == "email":
        return f"{word}@example.com"
    if fmt == "uuid":
        digits = f"{rng.getrandbits(128):032x}"
        return f"{digits[:8]}-{digits[8:12]}-4{digits[13:16]}-a{digits[17:20]}-{digits[20:]}"
    if fmt in ("uri", "url"):
        return f"https://example.com/{word}"
    if fmt == "hostname":
        return f"{word}.example.com"
    if fmt == "ipv4":
        return ".".join(str(rng.randint(1, 254)) for _ in range(4))
    return f"2001:db8::{rng.randint(1, 0xFFFF):x}"


def numeric(
    rng: random.Random, node: Mapping[str, Any], path: str, *, integer: bool
) -> int | float:
    minimum: float | None = node.get("minimum")
    maximum: float | None = node.get("maximum")
    low_open = high_open = False
    ex_low, ex_high = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
    if ex_low is True:  # draft 4: a flag on `minimum`
        low_open = True
    elif (
        isinstance(ex_low, int | float)
        and ex_low is not False
        and (minimum is None or ex_low >= minimum)
    ):
        minimum, low_open = ex_low, True
    if ex_high is True:
        high_open = True
    elif (
        isinstance(ex_high, int | float)
        and ex_high is not False
        and (maximum is None or ex_high <= maximum)
    ):
        maximum, high_open = ex_high, True
    if minimum is None:
        minimum = 0 if maximum is None else maximum - DEFAULT_SPAN
    low: float = minimum
    high: float = low + DEFAULT_SPAN if maximum is None else maximum
    multiple: float | None = node.get("multipleOf")
    if integer or multiple is not None:
        step: float = 1 if multiple is None else multiple
        if integer and step != int(step):  # a fractional step: search the integers
            step = 1
        first = math.floor(low / step) + 1 if low_open else math.ceil(low / step)
        last = math.ceil(high / step) - 1 if high_open else math.floor(high / step)
        if first > last:
            raise SchemaError(f"{where(path)}: no value lies within the bounds")
        for _ in range(50):
            k = rng.randint(first, last)
            if integer or isinstance(step, int):
                whole = int(k * step)
                if multiple is None or whole / multiple == int(whole / multiple):
                    return whole
                continue
            value = float(round(k * step, 12))
            if int(value / step) == value / step and low <= value <= high:
                return value
        raise SchemaError(f"{where(path)}: no value found for 'multipleOf' {multiple}")
    if high < low or (high == low and (low_open or high_open)):
        raise SchemaError(f"{where(path)}: no value lies within the bounds")
    drawn = round(rng.uniform(low, high), 2)
    inside = low < drawn < high
    on_closed_bound = (drawn == low and not low_open) or (drawn == high and not high_open)
    return drawn if inside or on_closed_bound else (low + high) / 2
