"""`tailguard serve`: validate the config, bind the port, then run the gateway under uvicorn.

Everything that can stop a start-up and is the operator's to fix (an unreadable or invalid
config, a bad Redis URL, a port in use) is found before the banner that says the gateway is on,
and reported as one line with its exit status (docs/operations.md, "Exit codes")."""

from __future__ import annotations

import errno
import os
import socket
import sys
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.markup import escape

from gateway.cli.common import ConfigOption, auth_summary, err, fail, load_or_exit

if TYPE_CHECKING:
    import uvicorn

EXIT_STARTUP_FAILED = 3  # the app did not start (uvicorn's STARTUP_FAILURE)
EXIT_CANNOT_LISTEN = 4  # the address cannot be bound: in use, not permitted, not this machine's


def serve(
    config: ConfigOption = None,
    host: Annotated[
        str | None, typer.Option(help="Interface to bind (overrides server.host).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind (overrides server.port).")] = None,
    workers: Annotated[
        int | None, typer.Option(help="Worker processes (overrides server.workers).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    allow_unauthenticated: Annotated[
        bool,
        typer.Option(
            "--allow-unauthenticated",
            help="Listen beyond loopback with no API keys (server.allow_unauthenticated).",
        ),
    ] = False,
    access_log: Annotated[
        str | None,
        typer.Option(
            "--access-log",
            metavar="FILE",
            help="Append the JSON access log to FILE ('-': stdout). Default: stdout, or, when "
            "stdout is a terminal, one short line per request there instead.",
        ),
    ] = None,
) -> None:
    """Start the gateway. The config is validated and the port bound before it says it is on."""
    import uvicorn

    from gateway.config import (
        ACCESS_LOG_ENV,
        CONFIG_PATH_ENV,
        HUMAN_LOG_ENV,
        LOG_LEVEL_ENV,
        config_path,
    )
    from gateway.server.workers import listen

    # Who may connect is decided again on every reload, in every worker: the flags that bear on
    # it are passed on as `TAILGUARD_*` overrides, so each later load of the file sees them.
    if host is not None:
        os.environ["TAILGUARD_SERVER__HOST"] = host
    if allow_unauthenticated:
        os.environ["TAILGUARD_SERVER__ALLOW_UNAUTHENTICATED"] = "true"
    settings = load_or_exit(config)
    if access_log not in (None, "-"):
        try:  # an unwritable file is the operator's to fix, and said before the gateway is on
            open(access_log, "a", encoding="utf-8").close()
        except OSError as exc:
            fail(f"--access-log: cannot write {access_log} ({exc.strerror})")
    bind_host = settings.server.host
    bind_port = settings.server.port if port is None else port
    try:
        sock = listen(bind_host, bind_port)
    except OSError as exc:
        cannot_listen(bind_host, bind_port, exc)
    count = workers or settings.server.workers
    names = ", ".join(m.name for m in settings.models)
    auth = auth_summary(settings)  # a refused exposure never gets here: load_or_exit stops it
    style = "yellow" if auth.startswith("auth off —") else "default"
    err.print(
        f"Tailguard on {_url(bind_host, bind_port)}  ({count} worker{'s' if count > 1 else ''}; "
        f"latency store: {settings.latency.store}; models: {escape(names)})\n"
        f"[{style}]{escape(auth)}[/]\nconfig: {escape(str(config_path(config)))}",
        highlight=False,
        soft_wrap=True,  # a log line: never folded at 80 columns, so a path stays whole
    )
    options: dict[str, Any] = {
        "host": bind_host,
        "port": bind_port,
        "loop": "uvloop",
        # uvicorn's httptools protocol plus limits on header size, header read time and the
        # requests one connection may have queued.
        "http": "gateway.server.protocol:GuardedHttpToolsProtocol",
        "lifespan": "on",
        "access_log": False,
        "log_level": log_level,
        # Streams still running after this are ended with an error event (see Proxy).
        "timeout_graceful_shutdown": settings.server.shutdown_grace_s,
        "proxy_headers": False,  # the gateway is the edge; X-Forwarded-* is not trusted blindly
    }
    from gateway.telemetry import configure_logging

    human = sys.stdout.isatty()
    configure_logging(log_level, access_file=access_log, human=human)
    if count == 1:
        from gateway.api import create_app, tune_gc

        app = create_app(settings, config_path=config_path(config))
        tune_gc()
        if human and log_level == "info":
            # A person at a terminal: one "ready" line instead of uvicorn's three start-up ones.
            options["log_level"] = "warning"
            server = _announcing(uvicorn.Config(app, **options))
        else:
            server = uvicorn.Server(uvicorn.Config(app, **options))
        try:
            server.run(sockets=[sock])  # the socket bound above: no second bind to fail
        finally:
            sock.close()
        if not server.started:  # the lifespan failed: uvicorn has logged why
            raise typer.Exit(EXIT_STARTUP_FAILED)
        return
    # Workers are separate processes: each loads the same (already validated) file. This
    # process accepts and deals the connections out to them (gateway/server/workers.py).
    os.environ[CONFIG_PATH_ENV] = str(config_path(config).resolve())
    os.environ[LOG_LEVEL_ENV] = log_level
    os.environ[ACCESS_LOG_ENV] = access_log or ""
    os.environ[HUMAN_LOG_ENV] = "1" if human else ""
    from gateway.server.workers import serve_workers

    status = serve_workers(count, options, grace_s=settings.server.shutdown_grace_s, listener=sock)
    raise typer.Exit(status)


def _announcing(config: uvicorn.Config) -> uvicorn.Server:
    """uvicorn's server, saying once that it serves, and where to look (uvicorn is imported
    only by `serve`, so the class is made here)."""
    import uvicorn

    class Announcing(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                where = _url(self.config.host, self.config.port)
                err.print(
                    f"ready: {where}/ (the dashboard at {where}/dashboard); Ctrl-C stops",
                    highlight=False,
                    soft_wrap=True,
                )

    return Announcing(config)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def cannot_listen(host: str, port: int, exc: OSError) -> NoReturn:
    """One line saying why the address cannot be bound and what to do; exit status 4."""
    where = _url(host, port)
    if exc.errno == errno.EADDRINUSE:
        other = port + 1 if port < 65535 else 8081
        why = (
            f"port {port} is in use (another gateway?). Pick another: `tailguard serve --port "
            f'{other}` or `make run ARGS="--port {other}"`, or set server.port.'
        )
    elif exc.errno == errno.EACCES:
        why = "permission denied (ports below 1024 need privileges): pick another with --port."
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = f"{host} is not an address of this machine: check --host or server.host."
    else:
        why = exc.strerror or str(exc)
    err.print(
        f"[bold red]error:[/] cannot listen on {escape(where)}: {escape(why)}",
        highlight=False,
        soft_wrap=True,
    )
    raise typer.Exit(EXIT_CANNOT_LISTEN)
