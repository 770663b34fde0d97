"""Help that reads: switches without a type, real metavars (`--port PORT`, `--out FILE`, `URL`)
instead of typer's `<bool>`, `<int>` and `<list[str]>`, and each command's summary in the command
list as one paragraph (a docstring's hard line breaks are not kept)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup


def tidy_param(param: Any) -> None:
    """Give `param` a metavar unless it has one: none for a switch, the choices for a choice,
    FILE for a path, N for an integer, SECONDS or NUMBER for a float, else its name in
    capitals. An argument shows no type: its name says what it is. Idempotent."""
    if isinstance(getattr(param, "help", None), str):
        param.help = " ".join(param.help.split())
    if param.param_type_name == "argument":
        param.display_type_rich = _no_type
    if param.metavar is not None:
        return
    descriptor = getattr(param, "type_descriptor", None)
    annotation = getattr(descriptor, "annotation", None)
    name = (param.name or "value").strip("_")
    if getattr(param, "is_flag", False):
        param.metavar = ""
    elif descriptor is not None and descriptor.is_choice and descriptor.choices:
        param.metavar = "|".join(str(getattr(c, "value", c)) for c in descriptor.choices)
    elif _is_path(annotation):
        param.metavar = "FILE"
    elif annotation is int and param.param_type_name == "option" and name not in _NAMED:
        param.metavar = "N"
    elif annotation is float:
        param.metavar = "SECONDS" if name in _SECONDS else "NUMBER"
    else:
        param.metavar = name.rsplit("_", 1)[-1].upper()  # --api-key KEY, --log-level LEVEL


_NAMED = {"port", "seed"}  # integers whose name says more than N
_SECONDS = {"duration", "timeout"}


def _no_type(ctx: Any) -> None:
    return None


def _is_path(annotation: Any) -> bool:
    return annotation is Path or (isinstance(annotation, type) and issubclass(annotation, Path))


def summary(text: str | None) -> str | None:
    """A docstring's first paragraph on one line."""
    if not text:
        return None
    return " ".join(text.strip().split("\n\n")[0].split())


class _Tidy:
    def get_params(self, ctx: Any) -> list[Any]:
        params: list[Any] = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            tidy_param(param)
        return params

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        """`URL`, not typer's `{URL}`, for a required argument (the usual convention)."""
        pieces: list[str] = super().collect_usage_pieces(ctx)  # type: ignore[misc]
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


class TidyCommand(_Tidy, TyperCommand):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.short_help = self.short_help or summary(self.help)


class TidyGroup(_Tidy, TyperGroup):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.short_help = self.short_help or summary(self.help)


def tidy_app(app: typer.Typer) -> None:
    """Make every command and group of `app` (recursively) use the tidy classes."""
    app.info.cls = TidyGroup
    for command in app.registered_commands:
        if command.cls is None or command.cls is TyperCommand:  # typer's default, not a choice
            command.cls = TidyCommand
    for group in app.registered_groups:
        if group.typer_instance is not None:
            tidy_app(group.typer_instance)
