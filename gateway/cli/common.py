"""What the `tailguard` commands share: the error console, the `--config` option, loading a
config or exiting, printing wide tables, and URLs made printable."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gateway.config import CONFIG_PATH_ENV, ConfigError, Settings, load_settings

err = Console(stderr=True)
ADMIN_KEY_ENV = "TAILGUARD_ADMIN_KEY"
DEFAULT_GATEWAY_URL = "http://127.0.0.1:8080"

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help=f"Config file (default: ${CONFIG_PATH_ENV}, else ./config/gateway.yaml, else the "
        "packaged defaults).",
    ),
]


def load_or_exit(config: Path | None) -> Settings:
    """The settings of `config`; an invalid config is printed and ends the command (exit 2)."""
    try:
        return load_settings(config)
    except ConfigError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(code=2) from None


def print_wide(tables: list[Table]) -> None:
    """Print tables; when piped, as wide as their rows rather than folded into 80 columns."""
    out = Console()
    if not out.is_terminal:
        wide = out.options.update_width(10_000)
        out = Console(width=max(out.width, *(out.measure(t, options=wide).maximum for t in tables)))
    for table in tables:
        out.print(table)


def without_userinfo(url: str | None) -> str:
    """A URL as printable: credentials embedded in it (`user:pass@`) are masked."""
    return "(in-process)" if url is None else redact_url(url)


_SECRET_PARAMETER = re.compile(r"pass|secret|token|key|auth|sig", re.IGNORECASE)


def redact_url(url: str) -> str:
    """A URL as printable: the password in its user info (the whole user info when it has no
    password), secret-looking query values and any fragment become `***`. The user info is taken
    to end at the last `@` before the query, so a password with an unencoded `/` is masked too."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***"
    rest, hash_, _ = rest.partition("#")
    location, question, query = rest.partition("?")
    credentials, at, location = location.rpartition("@")
    if at:
        user, colon, _ = credentials.partition(":")
        location = (f"{user}:***@" if colon and user else "***@") + location
    if question:
        masked = []
        for part in query.split("&"):
            name, equals, _ = part.partition("=")
            masked.append(f"{name}=***" if equals and _SECRET_PARAMETER.search(name) else part)
        location += "?" + "&".join(masked)
    return f"{scheme}://{location}" + ("#***" if hash_ else "")
