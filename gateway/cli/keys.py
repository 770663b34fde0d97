"""`tailguard keys ...`: make API keys and the config lines that admit them."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from gateway.cli.common import err

keys_app = typer.Typer(
    name="keys",
    help="Make gateway API keys and the config lines that admit them.",
    no_args_is_help=True,
)


@keys_app.command("new")
def keys_new(
    name: Annotated[str, typer.Argument(help="The key's name in logs, traces and metrics.")],
    admin: Annotated[
        bool, typer.Option("--admin", help="An admin key (for /admin/* and /dashboard).")
    ] = False,
    models: Annotated[
        str | None,
        typer.Option(
            metavar="MODEL,...", help="Comma-separated models the key may use (default: all)."
        ),
    ] = None,
    rpm: Annotated[int | None, typer.Option(min=1, help="Requests per minute.")] = None,
    tpm: Annotated[int | None, typer.Option(min=1, help="Tokens per minute.")] = None,
) -> None:
    """Generate a key. The key goes to stdout once, for the client; stderr gets the line for
    the config (under `auth.keys`, or `auth.admin_keys` with --admin), which holds only its hash."""
    from gateway.admission.auth import new_key
    from gateway.config import KeySpec

    try:
        KeySpec(name=name, sha256="0" * 64)
    except ValueError:
        err.print(
            "[bold red]error:[/] a key name is 1-64 letters, digits, '.', '_' or '-'",
            highlight=False,
        )
        raise typer.Exit(code=2) from None
    key, digest = new_key()
    entry: dict[str, Any] = {"name": name, "sha256": digest}
    if not admin:
        if models:
            entry["models"] = [m.strip() for m in models.split(",") if m.strip()]
        if rpm is not None:
            entry["rpm"] = rpm
        if tpm is not None:
            entry["tpm"] = tpm
    section = "admin_keys" if admin else "keys"
    line = json.dumps(entry, separators=(", ", ": "))
    err.print(f"# add under auth.{section}:\n- {line}", highlight=False, markup=False)
    typer.echo(key)


@keys_app.command("hash")
def keys_hash() -> None:
    """Print the SHA-256 of a key read from stdin (to configure a key made elsewhere)."""
    import sys

    from gateway.admission.auth import hash_key

    key = sys.stdin.readline().strip()
    if not key:
        err.print("[bold red]error:[/] no key on stdin", highlight=False)
        raise typer.Exit(code=2)
    typer.echo(hash_key(key))
