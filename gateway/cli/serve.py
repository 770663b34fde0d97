"""`tailguard serve`: validate the config, then run the gateway under uvicorn."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.markup import escape

from gateway.cli.common import ConfigOption, auth_summary, err, load_or_exit


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
) -> None:
    """Start the gateway. The config is validated before the port is bound."""
    import uvicorn

    from gateway.config import CONFIG_PATH_ENV, LOG_LEVEL_ENV, config_path

    # Who may connect is decided again on every reload, in every worker: the flags that bear on
    # it are passed on as `TAILGUARD_*` overrides, so each later load of the file sees them.
    if host is not None:
        os.environ["TAILGUARD_SERVER__HOST"] = host
    if allow_unauthenticated:
        os.environ["TAILGUARD_SERVER__ALLOW_UNAUTHENTICATED"] = "true"
    settings = load_or_exit(config)
    bind_host = settings.server.host
    bind_port = settings.server.port if port is None else port
    count = workers or settings.server.workers
    names = ", ".join(m.name for m in settings.models)
    auth = auth_summary(settings)  # a refused exposure never gets here: load_or_exit stops it
    style = "yellow" if auth.startswith("auth off —") else "default"
    err.print(
        f"Tailguard on http://{bind_host}:{bind_port}  ({count} worker{'s' if count > 1 else ''}; "
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
        "http": "gateway.protocol:GuardedHttpToolsProtocol",
        "lifespan": "on",
        "access_log": False,
        "log_level": log_level,
        # Streams still running after this are ended with an error event (see Proxy).
        "timeout_graceful_shutdown": settings.server.shutdown_grace_s,
        "proxy_headers": False,  # the gateway is the edge; X-Forwarded-* is not trusted blindly
    }
    from gateway.telemetry import configure_logging

    configure_logging(log_level)
    if count == 1:
        from gateway.api import create_app, tune_gc

        app = create_app(settings, config_path=config_path(config))
        tune_gc()
        uvicorn.run(app, **options)
        return
    # Workers are separate processes: each loads the same (already validated) file. This
    # process accepts and deals the connections out to them (gateway/workers.py).
    os.environ[CONFIG_PATH_ENV] = str(config_path(config).resolve())
    os.environ[LOG_LEVEL_ENV] = log_level
    from gateway.workers import serve_workers

    status = serve_workers(count, options, grace_s=settings.server.shutdown_grace_s)
    raise typer.Exit(status)
