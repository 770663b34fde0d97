"""Configuration problems as a newcomer can act on them: each one on a line of its own, with the
file and line it is on (or the `TAILGUARD_*` variable that set it), the key's path and the reason.

Nothing here prints a value from the file or the environment that could be a secret: a YAML
error shows its position, not the line; an override's value is shown only for keys that cannot
hold a secret, and never for an unknown key.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

ENV_PREFIX = "tailguard_"  # pydantic-settings matches it case-insensitively
# Values of environment overrides named like this are never printed.
_SECRET_NAME = re.compile(r"key|secret|token|pass|auth|url|sha|header", re.IGNORECASE)

Loc = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with the configuration, before it is printed."""

    loc: Loc  # the path, as pydantic gives it
    message: str
    label: str | None = None  # the path as printed (None: from `loc` and the document)
    at: Loc | None = None  # where to take its line from, when more precise than `loc`
    env: str | None = None  # the environment variable at fault, when known up front
    unknown_key: bool = False


@dataclass(frozen=True, slots=True)
class Override:
    """A `TAILGUARD_*` environment variable that pydantic-settings reads into the settings."""

    name: str  # as it is set
    path: tuple[str, ...]  # lowercased, split at `__`
    value: str


def overrides(schema: type[BaseModel]) -> list[Override]:
    """The `TAILGUARD_*` variables that set part of `schema` (not `TAILGUARD_CONFIG` etc.)."""
    found = []
    for name, value in os.environ.items():
        lowered = name.lower()
        if lowered.startswith(ENV_PREFIX):
            path = tuple(lowered.removeprefix(ENV_PREFIX).split("__"))
            if path[0] in schema.model_fields:
                found.append(Override(name, path, value))
    return found


def report(
    source: str,
    problems: list[Problem],
    document: Any,
    root: yaml.Node | None,
    schema: type[BaseModel],
    hints: list[str],
) -> str:
    """All problems as one message: one line each, in the file's order, those of the
    environment after, then the hints; a header when there are several."""
    env = overrides(schema)
    located: list[tuple[int, str]] = []
    from_env: list[str] = []
    for problem in problems:
        text = _from_environment(problem, env, document)
        if text is not None:
            from_env.append(text)
            continue
        line = line_of(root, problem.at or problem.loc)
        label = problem.label if problem.label is not None else label_of(problem.loc, document)
        inside = [o.name for o in env if _within(problem.loc, o.path)]
        note = f" (with {', '.join(inside)} set in the environment)" if inside else ""
        where = f"{source}:{line}" if line else source
        text = f"{where}: {label + ': ' if label else ''}{problem.message}{note}"
        located.append((line or 0, text))
    lines = [text for _, text in sorted(located, key=lambda item: item[0])] + from_env
    tail = [f"  hint: {hint}" for hint in hints]
    if len(lines) == 1:
        return "\n".join(lines + tail)
    header = (
        f"{source}: invalid configuration ({len(lines)} problems)"
        if located
        else f"invalid TAILGUARD_* environment variables ({len(lines)} problems)"
    )
    return "\n".join([header, *(f"  {line}" for line in lines), *tail])


def _from_environment(problem: Problem, env: list[Override], document: Any) -> str | None:
    """The problem's line when a `TAILGUARD_*` variable set the value at fault, else None."""
    if problem.env is not None and problem.env.lower().startswith(ENV_PREFIX):
        return f"{problem.env}: {problem.message}"
    lowered = tuple(str(part).lower() for part in problem.loc)
    for override in env:
        depth = len(override.path)
        if lowered[:depth] != override.path:
            continue
        if depth == len(lowered):
            shown = override.name
            if (
                not problem.unknown_key
                and not _SECRET_NAME.search(override.path[-1])
                and len(override.value) <= 64
                and override.value.isprintable()
            ):
                shown += f"={override.value}"
            return f"{shown}: {problem.message}"
        # A section given as JSON is merged over the file's: it is at fault if it holds the
        # key, or the key's parent while the file does not.
        rest = problem.loc[depth:]
        try:
            value = json.loads(override.value)
        except ValueError:
            value = None
        if _reaches(value, rest) or (
            _reaches(value, rest[:-1]) and not _reaches(document, problem.loc[:-1])
        ):
            nested: Any = value
            for part in reversed(override.path):
                nested = {part: nested}
            return f"{override.name}: {label_of(problem.loc, nested)}: {problem.message}"
    # A key missing from a section that only the environment creates.
    parent = lowered[:-1]
    if parent and not _reaches(document, problem.loc[:-1]):
        for override in env:
            if override.path[: len(parent)] == parent:
                return f"{override.name}: {label_of(problem.loc, document)}: {problem.message}"
    return None


def related(a: Loc, b: Loc) -> bool:
    """Whether one path holds the other."""
    depth = min(len(a), len(b))
    return a[:depth] == b[:depth]


def _within(loc: Loc, path: tuple[str, ...]) -> bool:
    """Whether `path` (an override) lies strictly inside the section at `loc`."""
    lowered = tuple(str(part).lower() for part in loc)
    return 0 < len(lowered) < len(path) and path[: len(lowered)] == lowered


def _reaches(value: Any, loc: Loc) -> bool:
    for part in loc:
        listed = isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)
        if not (listed or (isinstance(value, dict) and part in value)):
            return False
        value = value[part]
    return True


def line_of(root: yaml.Node | None, loc: Loc) -> int | None:
    """The line (1-based) of `loc` in the file: of its key, or of the deepest part of it that
    is there (for a missing key, its section); None for the root or without a node tree."""
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                    node, line = value, key.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if not 0 <= part < len(node.value):
                return line
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def label_of(loc: Loc, document: Any) -> str:
    """A path as printed: `models[chat-fast].deployments[0].provider`, list items by their
    `name` when they have one; "" for the root."""
    path = ""
    node: Any = document
    for part in loc:
        if isinstance(part, int):
            label = f"[{part}]"
            if isinstance(node, list) and 0 <= part < len(node):
                node = node[part]
                if isinstance(node, dict) and isinstance(node.get("name"), str):
                    label = f"[{node['name']}]"
            else:
                node = None
            path += label
            continue
        path = f"{path}.{part}" if path else str(part)
        node = node.get(part) if isinstance(node, dict) else None
    return path


# --- YAML ----------------------------------------------------------------------------------------

_YAML_HINTS = {
    "found character '\\t'": "YAML indents with spaces: this line has a tab",
    "mapping values are not allowed here": "a value that contains ': ' must be quoted, or this "
    "line is indented differently from the keys beside it",
    "expected <block end>": "this line is indented differently from the keys beside it",
    "found unexpected end of stream": "a quote or bracket opened above is never closed",
    "could not determine a constructor": "YAML tags (!!...) are not allowed: write a plain value",
}


def parse_yaml(text: str, file: Path) -> tuple[Any, yaml.Node | None]:
    """The document and its node tree (where each key is, for the lines of later problems).
    Raises ValueError with a printable message: `file:line:column: reason`, where the parser
    was and, for a common slip, a hint. The offending line itself is not shown: it could hold a
    secret written into the file."""
    try:
        loader = yaml.SafeLoader(text)  # checks every character first (ReaderError)
    except yaml.reader.ReaderError as exc:
        raise ValueError(_unreadable(text, file, exc)) from None
    try:
        root = loader.get_single_node()
        return (loader.construct_document(root) if root is not None else None), root
    except yaml.MarkedYAMLError as exc:
        raise ValueError(_marked(file, exc)) from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{file}: not valid YAML ({type(exc).__name__})") from None
    finally:
        loader.dispose()


def _unreadable(text: str, file: Path, exc: yaml.reader.ReaderError) -> str:
    """A character YAML does not allow (a control character, say), with its position."""
    line = text.count("\n", 0, exc.position) + 1
    column = exc.position - text.rfind("\n", 0, exc.position)
    code = exc.character if isinstance(exc.character, int) else ord(exc.character)
    return (
        f"{file}:{line}:{column}: {exc.reason} (character #x{code:04x})\n"
        f"  the file is not valid YAML at line {line}, column {column}"
    )


def _marked(file: Path, exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    problem = exc.problem or exc.context or "not valid YAML"
    if mark is None:
        return f"{file}: not valid YAML: {problem}"
    line, column = mark.line + 1, mark.column + 1
    detail = f"the file is not valid YAML at line {line}, column {column}"
    if exc.problem and exc.context:
        detail += f", {exc.context}"
        start = exc.context_mark
        if start is not None and (start.line, start.column) != (mark.line, mark.column):
            detail += f" that starts at line {start.line + 1}, column {start.column + 1}"
    lines = [f"{file}:{line}:{column}: {problem}", f"  {detail}"]
    lines += [f"  hint: {hint}" for key, hint in _YAML_HINTS.items() if key in problem]
    return "\n".join(lines)


# --- the schema ----------------------------------------------------------------------------------


def did_you_mean(schema: type[BaseModel], loc: Loc) -> str:
    """For an unknown key at `loc`: the known key it is closest to, if one is close."""
    kind = annotation_at(schema, loc[:-1])
    known = list(kind.model_fields) if _is_model(kind) else []
    close = difflib.get_close_matches(str(loc[-1]), known, n=1) if loc else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def is_structured(schema: type[BaseModel], path: Loc) -> bool:
    """Whether the setting at `path` is a section, a list or a mapping (or not in the schema):
    what pydantic-settings decodes from an environment variable as JSON."""
    kind = annotation_at(schema, path)
    return kind is None or _is_model(kind) or get_origin(kind) in (dict, tuple, list)


def annotation_at(schema: type[BaseModel], loc: Loc) -> Any:
    """The schema's type at `loc`, without `Annotated` or `| None` (None: no such path)."""
    kind: Any = schema
    for part in loc:
        kind = _unwrapped(kind)
        origin = get_origin(kind)
        if origin in (dict, tuple, list):  # `part` is a key or an index
            kind = get_args(kind)[-1 if origin is dict else 0]
        elif _is_model(kind):
            field = kind.model_fields.get(str(part))
            if field is None:
                return None
            kind = field.annotation
        else:
            return None
    return _unwrapped(kind)


def _is_model(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, BaseModel)


def _unwrapped(kind: Any) -> Any:
    while True:
        if get_origin(kind) is Annotated:
            kind = get_args(kind)[0]
            continue
        if get_origin(kind) in (Union, UnionType):
            rest = [arg for arg in get_args(kind) if arg is not type(None)]
            if len(rest) == 1:
                kind = rest[0]
                continue
        return kind
