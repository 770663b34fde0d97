"""The generated reference pages of the docs: configuration keys, metrics and the command line.

Each page is rendered from the code that defines it (the pydantic models of `gateway.config`, the
collectors behind `GET /metrics`, the typer app), so it cannot drift from it: the test suite
fails while a page on disk differs from what `render()` gives. Regenerate with
`python -m gateway.cli.reference` (`make docs` does it before building the site). It lives with
the command line, the top floor, because it reads the CLI's own command tree.

Output is deterministic: source order where it means something (config keys, commands), sorted
where it does not (metrics), no timestamps, no machine-specific values.
"""

from __future__ import annotations

import argparse
import enum
import re
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import typer
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from gateway.config import Settings
from gateway.telemetry.catalogue import catalogue

CONFIG_PAGE = "reference/config.md"
METRICS_PAGE = "reference/metrics.md"
CLI_PAGE = "reference/cli.md"
REGENERATE = "python -m gateway.cli.reference"
_BANNER = f"<!-- Generated from the code by `{REGENERATE}`: do not edit by hand. -->\n\n"


def render() -> dict[str, str]:
    """Every generated page, by its path under the docs directory."""
    return {CONFIG_PAGE: config_page(), METRICS_PAGE: metrics_page(), CLI_PAGE: cli_page()}


def stale(docs_dir: Path) -> list[str]:
    """The generated pages under `docs_dir` that differ from what `render()` gives now."""
    pages = render()
    return [
        name
        for name, text in pages.items()
        if not (docs_dir / name).is_file() or (docs_dir / name).read_text("utf-8") != text
    ]


def write(docs_dir: Path) -> list[str]:
    """Write every generated page under `docs_dir`; return the ones that changed."""
    changed = []
    for name, text in render().items():
        path = docs_dir / name
        if path.is_file() and path.read_text("utf-8") == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, "utf-8")
        changed.append(name)
    return changed


# --- Markdown ------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """Text for one Markdown table cell: one line, pipes escaped, `<` escaped outside code."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _paragraphs(text: str) -> str:
    """A docstring or help text as Markdown paragraphs (lines joined, blank lines kept)."""
    blocks = re.split(r"\n\s*\n", text.strip())
    return "\n\n".join(" ".join(b.replace("\b", "").split()) for b in blocks if b.strip())


def _code(value: str) -> str:
    return f"`` {value} ``" if "`" in value else f"`{value}`"


# --- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Section:
    path: str  # the key path of the object, e.g. `models[].deployments[]`
    anchor: str
    intro: str
    rows: list[list[str]]


def _anchor(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-") or "top-level"


def config_page() -> str:
    sections: list[_Section] = []
    seen: dict[type[BaseModel], str] = {}  # a model -> the key path of its section
    _config_section(Settings, "", "", sections, seen)
    out = [
        _BANNER,
        "# Configuration reference\n\n",
        "Every key of the config file, from the models that validate it. Key paths use `[]` for ",
        "an item of a list and `<provider>`-style placeholders for a name you choose. Keys can ",
        "also be set from the environment: `TAILGUARD_` plus the path in capitals, nested with ",
        "`__` (`TAILGUARD_SERVER__PORT=9000`; a list or a map as JSON, ",
        "`TAILGUARD_AUTH__KEYS='[...]'`). Unknown keys are errors. ",
        "See [the configuration guide](../configuration.md) for how the file is found and ",
        "validated.\n",
    ]
    for section in sections:
        title = section.path or "Top level"
        out.append(f"\n## {_code(title) if section.path else title} {{ #{section.anchor} }}\n\n")
        if section.intro:
            out.append(section.intro + "\n\n")
        out.append(_table(["Key", "Type", "Default", "Description"], section.rows))
    return "".join(out)


def _config_section(
    model: type[BaseModel],
    path: str,
    intro: str,
    sections: list[_Section],
    seen: dict[type[BaseModel], str],
) -> None:
    section = _Section(path, _anchor(path), intro, [])
    seen[model] = path
    sections.append(section)
    nested: dict[type[BaseModel], str] = {}  # models first reached here, by their key path
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        description = _paragraphs(field.description or "")
        target, suffix = _model_in(field.annotation, name)
        if target is None:
            kind = _type_text(field.annotation, list(field.metadata))
        else:
            # A model reached twice is described once, where it was first reached.
            where = seen.get(target) or nested.setdefault(target, key + suffix)
            shape = {"": "object", "[]": "list of objects"}.get(suffix, "map of objects")
            kind = f"{shape}, see [{_code(where)}](#{_anchor(where)})"
        section.rows.append([_code(key), kind, _default_text(field), description])
    for target, sub_path in nested.items():
        if target not in seen:
            intro = _paragraphs(target.__doc__ or "")
            _config_section(target, sub_path, intro, sections, seen)


def _model_in(annotation: Any, name: str) -> tuple[type[BaseModel] | None, str]:
    """The pydantic model a field holds (itself, as list items or as map values), and the key
    path suffix that reaches it: "", "[]" or ".<name>"."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    origin = get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    if origin in (Union, types.UnionType) and len(args) == 1:
        return _model_in(args[0], name)
    if origin in (tuple, list) and args:
        inner, _ = _model_in(args[0], name)
        return inner, "[]"
    if origin is dict and len(args) == 2:
        inner, _ = _model_in(args[1], name)
        return inner, f".<{name.removesuffix('s')}>"
    return None, ""


_SCALARS: dict[Any, str] = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    SecretStr: "string (secret)",
    type(None): "null",
}


def _type_text(annotation: Any, metadata: list[Any]) -> str:
    base = _bare_type(annotation)
    limits = ", ".join(_constraint(m) for m in metadata if _constraint(m))
    return f"{base} ({limits})" if limits else base


def _bare_type(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if origin is Annotated:
        return _type_text(args[0], list(args[1:]))
    if origin is Literal:
        return "one of " + ", ".join(_code(str(a)) for a in args)
    if origin in (Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        text = " or ".join(_bare_type(a) for a in present)
        return f"{text}, or null" if len(present) < len(args) else text
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"list of {_bare_type(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(_bare_type(a) for a in args) + "]"
    if origin is list:
        return f"list of {_bare_type(args[0])}"
    if origin is dict:
        return f"map of {_bare_type(args[1])}"
    return getattr(annotation, "__name__", str(annotation))


def _constraint(meta: Any) -> str:
    if isinstance(meta, FieldInfo):
        return ", ".join(c for c in map(_constraint, meta.metadata) if c)
    bounds = ((at.Ge, "ge", "≥"), (at.Gt, "gt", ">"), (at.Le, "le", "≤"), (at.Lt, "lt", "<"))
    for kind, attr, sign in bounds:
        if isinstance(meta, kind):
            return f"{sign} {getattr(meta, attr)}"
    if isinstance(meta, at.MinLen):
        return "non-empty" if meta.min_length == 1 else f"length ≥ {meta.min_length}"
    pattern = getattr(meta, "pattern", None)
    return f"matching {_code(pattern)}" if isinstance(pattern, str) else ""


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
    else:
        value = field.default
    if value is PydanticUndefined or isinstance(value, BaseModel):
        return "—"  # an object: each of its keys has its own default
    return _code(_yaml(value))


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return _yaml(value.value)
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return repr(value)


# --- metrics -------------------------------------------------------------------------------------


def _metric_rows() -> list[list[str]]:
    return [
        [_code(m.name), m.type, ", ".join(_code(label) for label in m.labels) or "—", m.help]
        for m in catalogue()
    ]


def metrics_page() -> str:
    return "".join(
        [
            _BANNER,
            "# Metrics reference\n\n",
            "Everything `GET /metrics` exposes (Prometheus text format), from the collectors the ",
            "gateway registers. Histograms add the `_bucket`, `_sum` and `_count` series. Label ",
            "values come from fixed vocabularies and the config (see ",
            "[Observability](../observability.md#metrics)); `process_*` are prometheus_client's ",
            "process metrics, read from `/proc` at scrape time. Every value is per process.\n\n",
            _table(["Metric", "Type", "Labels", "Description"], _metric_rows()),
        ]
    )


# --- command line --------------------------------------------------------------------------------


def cli_page() -> str:
    from gateway.cli import app  # the CLI imports most of the gateway: only when asked

    out = [
        _BANNER,
        "# Command-line reference\n\n",
        "Every `tailguard` command with its arguments and options, as `--help` shows them.\n",
    ]
    out += list(_command_sections(typer.main.get_command(app), ["tailguard"]))
    return "".join(out)


def _command_sections(command: Any, path: list[str]) -> Iterator[str]:
    # `command` is the click-style command typer builds (typer may vendor click: duck-typed).
    ctx = typer.Context(command, info_name=path[-1])
    name = " ".join(path)
    yield f"\n## `{name}` {{ #{_anchor(name)} }}\n\n"
    if command.help:
        yield _paragraphs(command.help) + "\n\n"
    usage = " ".join([name, *command.collect_usage_pieces(ctx)])
    yield f"```\n{usage}\n```\n\n"
    params = [p for p in command.params if not getattr(p, "hidden", False)]
    if params:
        rows = [_param_row(p, ctx) for p in params]
        yield _table(["Argument or option", "Type", "Default", "Description"], rows)
    if not hasattr(command, "commands"):  # a command, not a group
        return
    if params:
        yield "\n"  # two tables need a blank line between them, or Markdown reads one
    names: list[str] = command.list_commands(ctx)
    rows = []
    for sub in names:
        child = command.get_command(ctx, sub)
        summary = _paragraphs(child.help or "").split(". ")[0].rstrip(".")
        rows.append([f"[`{name} {sub}`](#{_anchor(name + ' ' + sub)})", summary])
    yield _table(["Command", "Description"], rows)
    for sub in names:
        yield from _command_sections(command.get_command(ctx, sub), [*path, sub])


def _param_row(param: Any, ctx: Any) -> list[str]:
    is_argument = not param.opts or not param.opts[0].startswith("-")
    if is_argument:
        flags = _code(param.name.upper())
    else:
        opts = sorted(param.opts, key=lambda o: (o.startswith("--"), o))
        flags = ", ".join(_code(o) for o in [*opts, *param.secondary_opts])
    if getattr(param, "is_flag", False):
        kind = "flag"
    else:
        shown = param.display_type(ctx) if hasattr(param, "display_type") else param.type.name
        kind = re.sub(r"^list\[(.*)\]$", r"\1", shown.strip("<>")).removesuffix(" range")
        if "|" in kind:
            kind = "one of " + ", ".join(_code(choice) for choice in kind.split("|"))
    limits = []
    if getattr(param, "min", None) is not None:
        limits.append(f"≥ {param.min}")
    if getattr(param, "max", None) is not None:
        limits.append(f"≤ {param.max}")
    if limits:
        kind = f"{kind} ({', '.join(limits)})"
    if param.multiple:
        kind += ", repeatable"
    if param.required:
        default = "required"
    elif param.default is None or (getattr(param, "is_flag", False) and not param.default):
        default = "—"
    else:
        default = _code(_yaml(param.default))
    help_text = _paragraphs(getattr(param, "help", None) or "")
    if param.envvar:
        help_text += f" Environment: `{param.envvar}`."
    return [flags, kind, default, help_text.strip()]


# --- entry point ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.split("\n")[0])
    parser.add_argument("--docs-dir", type=Path, default=Path("docs"), help="default: docs")
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a page is out of date"
    )
    args = parser.parse_args(argv)
    if args.check:
        outdated = stale(args.docs_dir)
        for name in outdated:
            print(f"{args.docs_dir / name} is out of date: run `{REGENERATE}`", file=sys.stderr)
        return 1 if outdated else 0
    for name in write(args.docs_dir):
        print(f"wrote {args.docs_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
