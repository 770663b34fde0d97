"""Values drawn from a JSON schema: the simulator's tool-call arguments and structured content.

`check` reads a schema once, before anything is drawn for the request, and raises `SchemaError`
for one the generator cannot honour (a keyword it does not implement, a malformed value, a
constraint no value meets); `generate` then draws a value valid against it from an RNG, so the
same seed gives the same value.

Supported: `type` (one or a list), `enum`, `const`; objects (`properties`,
`required`, `additionalProperties`, `minProperties`, `maxProperties`); arrays (`items`,
`prefixItems`, `minItems`, `maxItems`, `uniqueItems`); strings (`minLength`, `maxLength`,
`format` for the common formats, `pattern` in the subset `gateway.sim.pattern` builds); integers
and numbers (`minimum`, `maximum`, both exclusive forms, `multipleOf`); booleans and null;
`anyOf`, `oneOf` (one branch is drawn), `allOf` (merged), and local `$ref`s (`#`, `#/$defs/...`,
`#/definitions/...`, any JSON pointer into the document), recursive ones included. Unknown
keywords are annotations, as JSON Schema says; the ones that constrain a value in a way this
module cannot (`not`, `if`/`then`/`else`, `contains`, `patternProperties`, ...) are refused.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import unquote

import orjson

from gateway.sim.pattern import Compiled, PatternError, compile_pattern, generate_match
from gateway.sim.text import TOKENS

__all__ = ["SchemaError", "check", "generate"]

_TYPES: Final = ("object", "array", "string", "integer", "number", "boolean", "null")
_SCALARS: Final = ("null", "boolean", "integer", "number", "string")
_UNSUPPORTED: Final = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "patternProperties",
        "propertyNames",
        "unevaluatedItems",
        "$dynamicRef",
        "$recursiveRef",
    }
)
_SUBSCHEMA_LISTS: Final = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS: Final = ("properties", "$defs", "definitions")
_SUBSCHEMAS: Final = ("items", "additionalProperties", "unevaluatedProperties")
_SHALLOW_DEPTH: Final = 5  # from here on only what is required is generated
_MAX_DEPTH: Final = 40  # a schema that requires deeper values is refused
_MAX_COUNT: Final = 1000  # minItems / minProperties
_MAX_LENGTH: Final = 100_000  # minLength
_DEFAULT_SPAN: Final = 100  # an unbounded integer or number is drawn within this of its bound
_WORDS: Final = tuple(token.strip() for token in TOKENS)
_FORMATS: Final = frozenset(
    {"date-time", "date", "time", "email", "uuid", "uri", "url", "hostname", "ipv4", "ipv6"}
)


class SchemaError(ValueError):
    """A schema the simulator cannot draw values for; the message says where and why."""


def check(schema: object) -> None:
    """Raise SchemaError unless values can be generated for `schema` (drawing one to be sure)."""
    _Checker(schema).walk(schema, "", set())
    generate(schema, random.Random(0))


def generate(schema: object, rng: random.Random) -> Any:
    """A value valid against `schema` (already `check`ed), drawn from `rng`."""
    return _Generator(schema, rng).value(schema, "", 0)


def _type_of(value: object) -> str:
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


def _canonical(value: Any) -> Any:
    """A value as JSON Schema compares it for `uniqueItems`: 1 and 1.0 are the same."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value


def _where(path: str) -> str:
    return path or "the schema"


def _resolve(root: object, ref: object, path: str) -> object:
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaError(f"{_where(path)}: only local '$ref's (starting with '#') are supported")
    node = root
    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        raise SchemaError(f"{_where(path)}: '$ref' {ref!r} is not a JSON pointer")
    for part in pointer.split("/")[1:] if pointer else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaError(f"{_where(path)}: '$ref' {ref!r} points at nothing")
    return node


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Both schemas at once, approximately: properties joined, required united, else `extra`."""
    merged = dict(base)
    for key, value in extra.items():
        if key == "properties" and isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = {**merged[key], **value}
        elif key == "required" and isinstance(merged.get(key), list) and isinstance(value, list):
            merged[key] = [*merged[key], *(v for v in value if v not in merged[key])]
        else:
            merged[key] = value
    return merged


def _number(node: Mapping[str, Any], key: str, path: str) -> float | None:
    value = node.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SchemaError(f"{_where(path)}: '{key}' must be a number")
    return value


def _count(node: Mapping[str, Any], key: str, path: str, limit: int) -> int | None:
    value = node.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(f"{_where(path)}: '{key}' must be a non-negative integer")
    if key.startswith("min") and value > limit:
        raise SchemaError(f"{_where(path)}: '{key}' above {limit} is not supported")
    return value


class _Checker:
    """The static reading of a schema: every subschema once, references followed once."""

    def __init__(self, root: object) -> None:
        self.root = root

    def walk(self, node: object, path: str, seen: set[int]) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise SchemaError(f"{_where(path)}: a schema must be an object or a boolean")
        if id(node) in seen:
            return
        seen.add(id(node))
        for key in node:
            if key in _UNSUPPORTED:
                raise SchemaError(f"{_where(path)}: '{key}' is not supported")
        if "$ref" in node:
            self.walk(_resolve(self.root, node["$ref"], path), f"{path}/$ref", seen)
        self._types(node, path)
        if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
            raise SchemaError(f"{_where(path)}: 'enum' must be a non-empty array")
        required = node.get("required")
        if required is not None and (
            not isinstance(required, list) or not all(isinstance(r, str) for r in required)
        ):
            raise SchemaError(f"{_where(path)}: 'required' must be an array of strings")
        self._bounds(node, path)
        pattern = node.get("pattern")
        if pattern is not None:
            if not isinstance(pattern, str):
                raise SchemaError(f"{_where(path)}: 'pattern' must be a string")
            try:
                compile_pattern(pattern)
            except PatternError as exc:
                raise SchemaError(f"{_where(path)}: {exc}") from None
        for key in _SUBSCHEMA_LISTS:
            if key in node:
                branches = node[key]
                if not isinstance(branches, list) or (key != "prefixItems" and not branches):
                    raise SchemaError(f"{_where(path)}: '{key}' must be a non-empty array")
                for i, branch in enumerate(branches):
                    self.walk(branch, f"{path}/{key}/{i}", seen)
        for key in _SUBSCHEMA_MAPS:
            if key in node:
                members = node[key]
                if not isinstance(members, dict):
                    raise SchemaError(f"{_where(path)}: '{key}' must be an object")
                for name, member in members.items():
                    self.walk(member, f"{path}/{key}/{name}", seen)
        for key in _SUBSCHEMAS:
            if key in node:
                self.walk(node[key], f"{path}/{key}", seen)

    def _types(self, node: Mapping[str, Any], path: str) -> None:
        kind = node.get("type")
        if kind is None:
            return
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in _TYPES for k in kinds):
            raise SchemaError(f"{_where(path)}: 'type' must be one of {', '.join(_TYPES)}")

    def _bounds(self, node: Mapping[str, Any], path: str) -> None:
        for key in ("minimum", "maximum", "multipleOf"):
            _number(node, key, path)
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if not isinstance(node.get(key), bool):  # draft 4 spells them as flags
                _number(node, key, path)
        multiple = node.get("multipleOf")
        if multiple is not None and multiple <= 0:
            raise SchemaError(f"{_where(path)}: 'multipleOf' must be greater than 0")
        for low, high, limit in (
            ("minItems", "maxItems", _MAX_COUNT),
            ("minLength", "maxLength", _MAX_LENGTH),
            ("minProperties", "maxProperties", _MAX_COUNT),
        ):
            least = _count(node, low, path, limit)
            most = _count(node, high, path, limit)
            if least is not None and most is not None and least > most:
                raise SchemaError(f"{_where(path)}: '{low}' is greater than '{high}'")
        if not isinstance(node.get("uniqueItems", False), bool):
            raise SchemaError(f"{_where(path)}: 'uniqueItems' must be a boolean")


class _Generator:
    """One draw: the schema's root (for `$ref`s) and the RNG."""

    def __init__(self, root: object, rng: random.Random) -> None:
        self.root = root
        self.rng = rng
        self.patterns: dict[str, Compiled] = {}

    def value(self, node: object, path: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise SchemaError(
                f"the schema requires values nested deeper than {_MAX_DEPTH} levels "
                f"(at {path[:80]}...)"
            )
        if node is False:
            raise SchemaError(f"{_where(path)}: the schema 'false' allows no value")
        if node is True or not isinstance(node, dict):
            return _words(self.rng, 1, 3)
        if "$ref" in node:
            target = _resolve(self.root, node["$ref"], path)
            siblings = {k: v for k, v in node.items() if k != "$ref"}
            if isinstance(target, bool) or not siblings:
                return self.value(target, path, depth + 1)
            if not isinstance(target, dict):
                raise SchemaError(f"{_where(path)}: '$ref' must point at a schema")
            return self.value(_merge(target, siblings), path, depth + 1)
        if "allOf" in node:
            merged = {k: v for k, v in node.items() if k != "allOf"}
            for branch in node["allOf"]:
                if branch is True:
                    continue
                if isinstance(branch, dict) and "$ref" in branch:
                    branch = _resolve(self.root, branch["$ref"], path)
                if not isinstance(branch, dict):
                    raise SchemaError(f"{_where(path)}: 'allOf' allows no value")
                merged = _merge(merged, branch)
            return self.value(merged, path, depth + 1)
        if "const" in node or "enum" in node:
            options = [node["const"]] if "const" in node else node["enum"]
            if "type" in node:  # only the values of an allowed type
                kinds = node["type"] if isinstance(node["type"], list) else [node["type"]]
                options = [
                    v
                    for v in options
                    if _type_of(v) in kinds or (_type_of(v) == "integer" and "number" in kinds)
                ]
                if not options:
                    raise SchemaError(f"{_where(path)}: no value of 'enum'/'const' has the type")
            return options[0] if len(options) == 1 else self.rng.choice(options)
        for key in ("anyOf", "oneOf"):
            if key in node:
                branches = node[key]
                branch = (
                    self._simplest(branches)
                    if depth >= _SHALLOW_DEPTH
                    else self.rng.choice(branches)
                )
                siblings = {k: v for k, v in node.items() if k != key}
                if isinstance(branch, dict) and siblings:
                    branch = _merge(siblings, branch)
                return self.value(branch, f"{path}/{key}", depth + 1)
        kind = self._kind(node, depth)
        if kind == "object":
            return self._object(node, path, depth)
        if kind == "array":
            return self._array(node, path, depth)
        if kind == "string":
            return self._string(node, path)
        if kind in ("integer", "number"):
            return _numeric(self.rng, node, path, integer=kind == "integer")
        if kind == "boolean":
            return self.rng.random() < 0.5
        return None

    def _simplest(self, branches: list[Any]) -> Any:
        """Past the shallow depth: a branch that needs no nesting, when there is one."""
        for branch in branches:
            if branch is True or (
                isinstance(branch, dict)
                and "$ref" not in branch
                and branch.get("type") in (*_SCALARS, None)
                and "properties" not in branch
                and "items" not in branch
            ):
                return branch
        return branches[0]

    def _kind(self, node: Mapping[str, Any], depth: int) -> str:
        kind = node.get("type")
        kinds: list[str]
        if isinstance(kind, str):
            kinds = [kind]
        elif isinstance(kind, list):
            kinds = list(kind)
        elif {"properties", "required", "additionalProperties", "minProperties"} & node.keys():
            kinds = ["object"]
        elif {"items", "prefixItems", "minItems", "maxItems"} & node.keys():
            kinds = ["array"]
        elif {"minLength", "maxLength", "pattern", "format"} & node.keys():
            kinds = ["string"]
        elif {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & node.keys():
            kinds = ["number"]
        elif "multipleOf" in node:
            kinds = ["integer"]
        else:
            kinds = ["string"]
        if len(kinds) > 1 and depth >= _SHALLOW_DEPTH:
            scalars = [k for k in kinds if k in _SCALARS]
            kinds = scalars or kinds
        return kinds[0] if len(kinds) == 1 else self.rng.choice(kinds)

    def _object(self, node: Mapping[str, Any], path: str, depth: int) -> dict[str, Any]:
        properties = node.get("properties") or {}
        required = list(dict.fromkeys(node.get("required") or []))
        least = node.get("minProperties") or 0
        most = node.get("maxProperties")
        if most is not None and len(required) > most:
            raise SchemaError(f"{_where(path)}: more properties are required than maxProperties")
        extra = node.get("additionalProperties", node.get("unevaluatedProperties", True))
        optional = [name for name in properties if name not in required]
        room = len(optional) if most is None else most - len(required)
        chosen: list[str] = []
        if depth < _SHALLOW_DEPTH:  # deeper down, only what is required
            chosen = [name for name in optional if self.rng.random() < 0.5][:room]
        for name in optional:  # then enough for minProperties
            if len(required) + len(chosen) >= least or len(chosen) >= room:
                break
            if name not in chosen:
                chosen.append(name)
        out: dict[str, Any] = {}
        for name, sub in properties.items():
            if name in required or name in chosen:
                out[name] = self.value(sub, f"{path}/properties/{name}", depth + 1)
        for name in required:
            if name not in out:  # required but not described: the extra schema says what
                out[name] = self._extra(extra, f"{path}/required/{name}", depth)
        i = 0
        while len(out) < least and (most is None or len(out) < most):
            name = f"{_WORDS[i % len(_WORDS)]}_{i}"
            i += 1
            if name not in out:
                out[name] = self._extra(extra, f"{path}/minProperties", depth)
        return out

    def _extra(self, extra: object, path: str, depth: int) -> Any:
        if extra is False:
            raise SchemaError(f"{_where(path)}: needs a property that the schema forbids")
        return self.value(extra, path, depth + 1)

    def _array(self, node: Mapping[str, Any], path: str, depth: int) -> list[Any]:
        prefix = node.get("prefixItems") or []
        items = node.get("items", True)
        least = node.get("minItems") or 0
        most = node.get("maxItems")
        if isinstance(items, list):  # draft 4-7 tuples
            prefix, items = items, node.get("additionalItems", True)
        if depth >= _SHALLOW_DEPTH:
            count = least
        else:
            high = least + 2 if most is None else min(most, least + 2)
            count = self.rng.randint(max(least, min(1, high)), max(least, high))
        if items is False:
            if count > len(prefix):
                count = len(prefix)
            if count < least:
                raise SchemaError(f"{_where(path)}: 'minItems' exceeds the items allowed")
        out: list[Any] = []
        unique = node.get("uniqueItems") is True
        seen: set[bytes] = set()
        attempts = 0
        while len(out) < count:
            i = len(out)
            sub = prefix[i] if i < len(prefix) else items
            value = self.value(sub, f"{path}/items/{i}", depth + 1)
            if unique:
                key = orjson.dumps(_canonical(value), option=orjson.OPT_SORT_KEYS)
                if key in seen:
                    attempts += 1
                    if attempts > 20 * (count + 1):
                        if len(out) >= least:
                            break
                        raise SchemaError(f"{_where(path)}: cannot draw enough unique items")
                    continue
                seen.add(key)
            out.append(value)
        return out

    def _string(self, node: Mapping[str, Any], path: str) -> str:
        least = node.get("minLength") or 0
        most = node.get("maxLength")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            compiled = self.patterns.get(pattern)
            if compiled is None:
                compiled = self.patterns[pattern] = compile_pattern(pattern)
            text = generate_match(compiled, self.rng, least, most)
            if text is None:
                raise SchemaError(
                    f"{_where(path)}: no string of the allowed length matches {pattern!r}"
                )
            return text
        fmt = node.get("format")
        if fmt in _FORMATS:
            text = _formatted(self.rng, str(fmt))
            if least <= len(text) and (most is None or len(text) <= most):
                return text
        text = _words(self.rng, 1, 4)
        while len(text) < least:
            text += " " + _words(self.rng, 1, 4)
        if most is not None and len(text) > most:
            text = text[:most].rstrip()
        return text.ljust(least, "x")


def _words(rng: random.Random, least: int, most: int) -> str:
    start = rng.randrange(len(_WORDS))
    count = rng.randint(least, most)
    return " ".join(_WORDS[(start + i) % len(_WORDS)] for i in range(count))


def _formatted(rng: random.Random, fmt: str) -> str:
    date = f"20{rng.randint(20, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    time = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
    word = rng.choice(_WORDS)
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


def _numeric(
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
        minimum = 0 if maximum is None else maximum - _DEFAULT_SPAN
    low: float = minimum
    high: float = low + _DEFAULT_SPAN if maximum is None else maximum
    multiple: float | None = node.get("multipleOf")
    if integer or multiple is not None:
        step: float = 1 if multiple is None else multiple
        if integer and step != int(step):  # a fractional step: search the integers
            step = 1
        first = math.floor(low / step) + 1 if low_open else math.ceil(low / step)
        last = math.ceil(high / step) - 1 if high_open else math.floor(high / step)
        if first > last:
            raise SchemaError(f"{_where(path)}: no value lies within the bounds")
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
        raise SchemaError(f"{_where(path)}: no value found for 'multipleOf' {multiple}")
    if high < low or (high == low and (low_open or high_open)):
        raise SchemaError(f"{_where(path)}: no value lies within the bounds")
    drawn = round(rng.uniform(low, high), 2)
    inside = low < drawn < high
    on_closed_bound = (drawn == low and not low_open) or (drawn == high and not high_open)
    return drawn if inside or on_closed_bound else (low + high) / 2
