"""What the `tailguard` commands share: the error console, the `--config` option, loading a
config or exiting (with every problem `serve` would meet), the auth summary line, printing wide
tables, and URLs made printable."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from rich.table import Table

    from gateway.config import Settings

# The CLI imports the config layer (pydantic models, a second or more) only in the commands that
# load a config, so that `--version` and `--help` answer at once. Hence this copy of its name.
CONFIG_PATH_ENV = "TAILGUARD_CONFIG"  # gateway.config.CONFIG_PATH_ENV (a test keeps them equal)
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
    """The settings of `config`, checked as `serve` would use them. Any problem ends the
    command (exit 2) after printing all of them, one a line, with no traceback."""
    from gateway.config import ConfigError, config_path, load_settings

    try:
        settings = load_settings(config)
    except ConfigError as exc:
        fail(str(exc))
    problems = startup_problems(settings, str(config_path(config)))
    if len(problems) == 1:
        fail(problems[0])
    if problems:
        source = config_path(config)
        fail(f"{source}: {len(problems)} problems\n" + "\n".join(f"  {p}" for p in problems))
    return settings


def fail(message: str) -> NoReturn:
    """Print `message` as an error and end the command with exit status 2."""
    # soft_wrap: never folded at the terminal's width, so `file:line:` and paths stay whole.
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def startup_problems(settings: Settings, source: str) -> list[str]:
    """What would stop a valid config from serving: a Redis URL the stores cannot use, or no
    API keys on a non-loopback interface without `server.allow_unauthenticated`."""
    from gateway.admission.auth import exposed_without_keys
    from gateway.redis import parse_redis_url

    problems = []
    latency = settings.latency
    urls = []
    if latency.store == "redis" and latency.redis_url is not None:
        urls.append(("latency.redis_url", latency.redis_url.get_secret_value()))
    auth = settings.auth
    if (
        auth is not None
        and auth.rate_limits.redis_url is not None
        and rate_limit_store(settings) == "redis"
    ):
        urls.append(("auth.rate_limits.redis_url", auth.rate_limits.redis_url.get_secret_value()))
    for key, url in urls:
        try:
            parse_redis_url(url)
        except ValueError as exc:  # the message never repeats the URL's secrets
            problems.append(f"{source}: {key}: {exc}")
    if exposed_without_keys(settings):
        problems.append(
            f"{source}: server.host: no API keys are configured, so the gateway only listens on "
            f"loopback, not on {settings.server.host}. Configure auth.keys (see `tailguard keys "
            "new`), or set server.allow_unauthenticated (serve --allow-unauthenticated) if "
            "something in front of it authenticates."
        )
    return problems


def rate_limit_store(settings: Settings) -> str | None:
    """Where the keys' rpm/tpm counters live, as `open_rate_limiter` decides (None: no key has
    a rate limit)."""
    auth = settings.auth
    if auth is None or not any(key.rpm or key.tpm for key in auth.keys):
        return None
    spec = auth.rate_limits
    shared = spec.store == "redis" or (
        spec.store == "auto" and (spec.redis_url is not None or settings.latency.store == "redis")
    )
    url = spec.redis_url or settings.latency.redis_url
    return "redis" if shared and url is not None else "memory"


def auth_summary(settings: Settings) -> str:
    """Who may call the gateway, as the config really has it: the keys and whether rate limits
    are on, or, with no keys, why it is open (loopback, or `allow_unauthenticated`)."""
    from gateway.admission.auth import is_loopback

    auth = settings.auth
    host = settings.server.host
    if auth is None or not auth.enabled:
        if is_loopback(host):
            return "auth off (loopback only)"
        if settings.server.allow_unauthenticated:
            return f"auth off — allow_unauthenticated (anyone who reaches {host} may call models)"
        return f"auth off — refused: no API keys on {host}, which is not loopback"
    clients = _count(len(auth.keys), "client key")
    if not auth.keys:
        clients += " (no key may call models)"
    limited = sum(1 for key in auth.keys if key.rpm or key.tpm)
    store = rate_limit_store(settings)
    limits = (
        f"rate limits on for {_count(limited, 'key')} ({store})" if store else "rate limits off"
    )
    return f"auth on: {clients}, {_count(len(auth.admin_keys), 'admin key')}; {limits}"


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def print_wide(tables: list[Table], out: Console | None = None) -> None:
    """Print tables; when piped, as wide as their rows rather than folded into 80 columns."""
    out = out or Console()
    if not out.is_terminal and out.file is sys.stdout:
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
