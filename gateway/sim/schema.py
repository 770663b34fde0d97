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

import contextlib
import math
import random
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import unquote

import orjson

from gateway.sim.pattern import Compiled, PatternError, compile_pattern, generate_match
from gateway.sim.values import (
    FORMATS,
    WORDS,
    SchemaError,
    canonical,
    fits,
    formatted,
    numeric,
    same,
    where,
    words,
)

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
_LOWER_BOUNDS: Final = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER_BOUNDS: Final = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_TYPE_KEYWORDS: Final = (  # the keywords that say what an untyped schema describes
    ("object", frozenset({"properties", "required", "additionalProperties", "minProperties"})),
    ("array", frozenset({"items", "prefixItems", "minItems", "maxItems"})),
    ("string", frozenset({"minLength", "maxLength", "pattern", "format"})),
    ("number", frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})),
    ("integer", frozenset({"multipleOf"})),
)
_SHALLOW_DEPTH: Final = 5  # from here on only what is required is generated
_MAX_DEPTH: Final = 40  # a schema that requires deeper values is refused
_MAX_COUNT: Final = 1000  # minItems / minProperties
_MAX_LENGTH: Final = 100_000  # minLength


def check(schema: object) -> None:
    """Raise SchemaError unless values can be generated for `schema` (drawing one to be sure)."""
    _Checker(schema).walk(schema, "", set())
    generate(schema, random.Random(0))


def generate(schema: object, rng: random.Random) -> Any:
    """A value valid against `schema` (already `check`ed), drawn from `rng`."""
    return _Generator(schema, rng).value(schema, "", 0)


def _resolve(root: object, ref: object, path: str) -> object:
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaError(f"{where(path)}: only local '$ref's (starting with '#') are supported")
    node = root
    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        raise SchemaError(f"{where(path)}: '$ref' {ref!r} is not a JSON pointer")
    for part in pointer.split("/")[1:] if pointer else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaError(f"{where(path)}: '$ref' {ref!r} points at nothing")
    return node


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any], path: str) -> dict[str, Any]:
    """One schema that both constrain (`allOf`, `$ref` siblings, an `anyOf` branch and the
    keywords beside it): bounds tightened, types and enums intersected, subschemas nested."""
    base, extra = _within(extra, base, path), _within(base, extra, path)
    merged = dict(base)
    if "prefixItems" in base or "prefixItems" in extra:  # position i: both schemas' item i
        count = max(len(base.get("prefixItems") or ()), len(extra.get("prefixItems") or ()))
        merged["prefixItems"] = [{"allOf": [_item(base, i), _item(extra, i)]} for i in range(count)]
    for key, value in extra.items():
        if key == "prefixItems":
            continue
        if key not in merged:
            merged[key] = value
            continue
        old = merged[key]
        if same(old, value):  # JSON equality: `const: false` and `const: 0` differ
            continue
        if key == "type":
            kinds = _intersect_types(old, value)
            if not kinds:
                raise SchemaError(f"{where(path)}: no type satisfies both schemas")
            merged[key] = kinds
        elif key == "properties" and isinstance(old, dict) and isinstance(value, dict):
            merged[key] = {
                **old,
                **{n: {"allOf": [old[n], v]} if n in old else v for n, v in value.items()},
            }
        elif key == "required" and isinstance(old, list) and isinstance(value, list):
            merged[key] = [*old, *(v for v in value if v not in old)]
        elif key in _LOWER_BOUNDS and not isinstance(old, bool) and not isinstance(value, bool):
            merged[key] = max(old, value)
        elif key in _UPPER_BOUNDS and not isinstance(old, bool) and not isinstance(value, bool):
            merged[key] = min(old, value)
        elif key == "enum" and isinstance(old, list) and isinstance(value, list):
            merged[key] = [v for v in old if any(same(v, w) for w in value)]
            if not merged[key]:
                raise SchemaError(f"{where(path)}: no value is in both enums")
        elif key in _SUBSCHEMAS:
            merged[key] = {"allOf": [old, value]}
        elif key in ("anyOf", "oneOf") and isinstance(old, list) and isinstance(value, list):
            merged[key] = [{"allOf": [a, b]} for a in old for b in value]
        elif key == "uniqueItems":
            merged[key] = bool(old) or bool(value)
        elif key == "allOf" and isinstance(old, list) and isinstance(value, list):
            merged[key] = [*old, *value]
        else:
            raise SchemaError(f"{where(path)}: '{key}' differs between schemas that both apply")
    return merged


def _item(schema: Mapping[str, Any], index: int) -> object:
    prefix = schema.get("prefixItems") or ()
    return prefix[index] if index < len(prefix) else schema.get("items", True)


def _within(owner: Mapping[str, Any], other: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    """`other` with the properties that `owner` does not name held to `owner`'s
    `additionalProperties`, which applies to them once both schemas are one."""
    allowed = owner.get("additionalProperties", True)
    if allowed is True or not ({"properties", "required"} & other.keys()):
        return other
    known = owner.get("properties") or {}
    properties = dict(other.get("properties") or {})
    for name in [*properties, *(other.get("required") or ())]:
        if name in known:
            continue
        if allowed is False:
            if name in (other.get("required") or ()):
                raise SchemaError(f"{where(path)}: '{name}' is required and also forbidden")
            properties.pop(name, None)
        elif name in properties:
            properties[name] = {"allOf": [properties[name], allowed]}
    return {**other, "properties": properties}


def _intersect_types(old: object, value: object) -> list[str]:
    first = [str(k) for k in (old if isinstance(old, list) else [old])]
    second = [str(k) for k in (value if isinstance(value, list) else [value])]
    kinds = [k for k in first if k in second]
    if "number" in first and "integer" in second and "integer" not in kinds:
        kinds.append("integer")
    if "integer" in first and "number" in second and "integer" not in kinds:
        kinds.append("integer")
    return kinds


def _number(node: Mapping[str, Any], key: str, path: str) -> float | None:
    value = node.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SchemaError(f"{where(path)}: '{key}' must be a number")
    return value


def _count(node: Mapping[str, Any], key: str, path: str, limit: int) -> int | None:
    value = node.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(f"{where(path)}: '{key}' must be a non-negative integer")
    if key.startswith("min") and value > limit:
        raise SchemaError(f"{where(path)}: '{key}' above {limit} is not supported")
    return value


class _Checker:
    """The static reading of a schema: every subschema once, references followed once."""

    def __init__(self, root: object) -> None:
        self.root = root

    def walk(self, node: object, path: str, seen: set[int]) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise SchemaError(f"{where(path)}: a schema must be an object or a boolean")
        if id(node) in seen:
            return
        seen.add(id(node))
        for key in node:
            if key in _UNSUPPORTED:
                raise SchemaError(f"{where(path)}: '{key}' is not supported")
        if "$ref" in node:
            self.walk(_resolve(self.root, node["$ref"], path), f"{path}/$ref", seen)
        self._types(node, path)
        if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
            raise SchemaError(f"{where(path)}: 'enum' must be a non-empty array")
        required = node.get("required")
        if required is not None and (
            not isinstance(required, list) or not all(isinstance(r, str) for r in required)
        ):
            raise SchemaError(f"{where(path)}: 'required' must be an array of strings")
        self._bounds(node, path)
        if "format" in node and not isinstance(node["format"], str):
            raise SchemaError(f"{where(path)}: 'format' must be a string")
        pattern = node.get("pattern")
        if pattern is not None:
            if not isinstance(pattern, str):
                raise SchemaError(f"{where(path)}: 'pattern' must be a string")
            try:
                compile_pattern(pattern)
            except PatternError as exc:
                raise SchemaError(f"{where(path)}: {exc}") from None
        for key in _SUBSCHEMA_LISTS:
            if key in node:
                branches = node[key]
                if not isinstance(branches, list) or (key != "prefixItems" and not branches):
                    raise SchemaError(f"{where(path)}: '{key}' must be a non-empty array")
                for i, branch in enumerate(branches):
                    self.walk(branch, f"{path}/{key}/{i}", seen)
        for key in _SUBSCHEMA_MAPS:
            if key in node:
                members = node[key]
                if not isinstance(members, dict):
                    raise SchemaError(f"{where(path)}: '{key}' must be an object")
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
            raise SchemaError(f"{where(path)}: 'type' must be one of {', '.join(_TYPES)}")

    def _bounds(self, node: Mapping[str, Any], path: str) -> None:
        for key in ("minimum", "maximum", "multipleOf"):
            _number(node, key, path)
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if not isinstance(node.get(key), bool):  # draft 4 spells them as flags
                _number(node, key, path)
        multiple = node.get("multipleOf")
        if multiple is not None and multiple <= 0:
            raise SchemaError(f"{where(path)}: 'multipleOf' must be greater than 0")
        for low, high, limit in (
            ("minItems", "maxItems", _MAX_COUNT),
            ("minLength", "maxLength", _MAX_LENGTH),
            ("minProperties", "maxProperties", _MAX_COUNT),
        ):
            least = _count(node, low, path, limit)
            most = _count(node, high, path, limit)
            if least is not None and most is not None and least > most:
                raise SchemaError(f"{where(path)}: '{low}' is greater than '{high}'")
        if not isinstance(node.get("uniqueItems", False), bool):
            raise SchemaError(f"{where(path)}: 'uniqueItems' must be a boolean")


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
            raise SchemaError(f"{where(path)}: the schema 'false' allows no value")
        if node is True or not isinstance(node, dict):
            return words(self.rng, 1, 3)
        if "$ref" in node:
            target = _resolve(self.root, node["$ref"], path)
            siblings = {k: v for k, v in node.items() if k != "$ref"}
            if isinstance(target, bool) or not siblings:
                return self.value(target, path, depth + 1)
            if not isinstance(target, dict):
                raise SchemaError(f"{where(path)}: '$ref' must point at a schema")
            return self.value(_merge(target, siblings, path), path, depth + 1)
        if "allOf" in node:
            merged = {k: v for k, v in node.items() if k != "allOf"}
            for branch in node["allOf"]:
                if branch is True:
                    continue
                if isinstance(branch, dict) and "$ref" in branch:
                    branch = _resolve(self.root, branch["$ref"], path)
                if not isinstance(branch, dict):
                    raise SchemaError(f"{where(path)}: 'allOf' allows no value")
                merged = _merge(merged, branch, path)
            return self.value(merged, path, depth + 1)
        for key in ("anyOf", "oneOf"):
            if key in node:
                return self._branch(node, key, path, depth)
        if "const" in node or "enum" in node:
            options = [node["const"]] if "const" in node else node["enum"]
            if "const" in node and "enum" in node:
                options = [v for v in options if any(same(v, e) for e in node["enum"])]
            options = [v for v in options if fits(v, node)]
            if not options:
                raise SchemaError(f"{where(path)}: no value of 'enum'/'const' meets the schema")
            return options[0] if len(options) == 1 else self.rng.choice(options)
        kinds = self._kinds(node, depth)
        for i, kind in enumerate(kinds):
            try:
                return self._typed(kind, node, path, depth)
            except SchemaError:
                if i == len(kinds) - 1:  # no other type to try
                    raise
        raise AssertionError("unreachable: a schema has at least one type")

    def _branch(self, node: Mapping[str, Any], key: str, path: str, depth: int) -> Any:
        """A value of one branch (with the keywords beside it): drawn, the others tried after
        it; past the shallow depth the simplest goes first."""
        branches = list(node[key])
        if depth >= _SHALLOW_DEPTH:
            first = self._simplest(branches)
            branches.remove(first)
            branches.insert(0, first)
        else:
            self.rng.shuffle(branches)
        siblings = {k: v for k, v in node.items() if k != key}
        for i, branch in enumerate(branches):
            try:
                if isinstance(branch, dict) and siblings:
                    branch = _merge(siblings, branch, path)
                elif branch is True and siblings:
                    branch = siblings
                return self.value(branch, f"{path}/{key}", depth + 1)
            except SchemaError:
                if i == len(branches) - 1:
                    raise
        raise AssertionError("unreachable: a branch list is never empty")

    def _typed(self, kind: str, node: Mapping[str, Any], path: str, depth: int) -> Any:
        if kind == "object":
            return self._object(node, path, depth)
        if kind == "array":
            return self._array(node, path, depth)
        if kind == "string":
            return self._string(node, path)
        if kind in ("integer", "number"):
            return numeric(self.rng, node, path, integer=kind == "integer")
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

    def _kinds(self, node: Mapping[str, Any], depth: int) -> list[str]:
        """The types to try, the drawn one first (scalars first past the shallow depth).

        Without `type` any value is allowed: the one its keywords describe first, then values
        those keywords do not constrain."""
        kind = node.get("type")
        if isinstance(kind, str):
            return [kind]
        if isinstance(kind, list):
            kinds = list(kind)
            if len(kinds) > 1:
                if depth >= _SHALLOW_DEPTH:
                    kinds.sort(key=lambda k: k not in _SCALARS)
                else:
                    self.rng.shuffle(kinds)
            return kinds
        keys = node.keys()
        inferred = [k for k, words in _TYPE_KEYWORDS if keys & words]
        return [*inferred, *(k for k in ("string", "boolean", "null") if k not in inferred)]

    def _object(self, node: Mapping[str, Any], path: str, depth: int) -> dict[str, Any]:
        properties = node.get("properties") or {}
        required = list(dict.fromkeys(node.get("required") or []))
        least = node.get("minProperties") or 0
        most = node.get("maxProperties")
        if most is not None and least > most:
            raise SchemaError(f"{where(path)}: 'minProperties' is greater than 'maxProperties'")
        if most is not None and len(required) > most:
            raise SchemaError(f"{where(path)}: more properties are required than maxProperties")
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
            if name in required:
                out[name] = self.value(sub, f"{path}/properties/{name}", depth + 1)
            elif name in chosen:
                # An optional property with no valid value is left out.
                with contextlib.suppress(SchemaError):
                    out[name] = self.value(sub, f"{path}/properties/{name}", depth + 1)
        for name in required:
            if name not in out:  # required but not described: the extra schema says what
                out[name] = self._extra(extra, f"{path}/required/{name}", depth)
        i = 0
        while len(out) < least and (most is None or len(out) < most):
            name = f"{WORDS[i % len(WORDS)]}_{i}"
            i += 1
            if name not in out:
                out[name] = self._extra(extra, f"{path}/minProperties", depth)
        return out

    def _extra(self, extra: object, path: str, depth: int) -> Any:
        if extra is False:
            raise SchemaError(f"{where(path)}: needs a property that the schema forbids")
        return self.value(extra, path, depth + 1)

    def _array(self, node: Mapping[str, Any], path: str, depth: int) -> list[Any]:
        prefix = node.get("prefixItems") or []
        items = node.get("items", True)
        least = node.get("minItems") or 0
        most = node.get("maxItems")
        if most is not None and least > most:
            raise SchemaError(f"{where(path)}: 'minItems' is greater than 'maxItems'")
        if depth >= _SHALLOW_DEPTH:
            count = least
        else:
            high = least + 2 if most is None else min(most, least + 2)
            count = self.rng.randint(max(least, min(1, high)), max(least, high))
        if items is False:
            if count > len(prefix):
                count = len(prefix)
            if count < least:
                raise SchemaError(f"{where(path)}: 'minItems' exceeds the items allowed")
        out: list[Any] = []
        unique = node.get("uniqueItems") is True
        seen: set[bytes] = set()
        attempts = 0
        while len(out) < count:
            i = len(out)
            sub = prefix[i] if i < len(prefix) else items
            try:
                value = self.value(sub, f"{path}/items/{i}", depth + 1)
            except SchemaError:
                if len(out) < least:
                    raise
                break  # enough items, and no valid one more
            if unique:
                key = orjson.dumps(canonical(value), option=orjson.OPT_SORT_KEYS)
                if key in seen:
                    attempts += 1
                    if attempts > 20 * (count + 1):
                        if len(out) >= least:
                            break
                        raise SchemaError(f"{where(path)}: cannot draw enough unique items")
                    continue
                seen.add(key)
            out.append(value)
        return out

    def _string(self, node: Mapping[str, Any], path: str) -> str:
        least = node.get("minLength") or 0
        most = node.get("maxLength")
        if most is not None and least > most:
            raise SchemaError(f"{where(path)}: 'minLength' is greater than 'maxLength'")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            compiled = self.patterns.get(pattern)
            if compiled is None:
                compiled = self.patterns[pattern] = compile_pattern(pattern)
            text = generate_match(compiled, self.rng, least, most)
            if text is None:
                raise SchemaError(
                    f"{where(path)}: no string of the allowed length matches {pattern!r}"
                )
            return text
        fmt = node.get("format")
        if fmt in FORMATS:
            text = formatted(self.rng, str(fmt))
            if least <= len(text) and (most is None or len(text) <= most):
                return text
        text = words(self.rng, 1, 4)
        while len(text) < least:
            text += " " + words(self.rng, 1, 4)
        if most is not None and len(text) > most:
            text = text[:most].rstrip()
        return text.ljust(least, "x")
