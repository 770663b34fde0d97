"""The `tailguard` command: serve the gateway, check a config, run the simulated upstream, run
offline simulations (`simulate ...`), show a running gateway's latency statistics, and probe any
OpenAI-compatible endpoint's latency.

`app` is the typer application (one module per command or group of commands registers here);
`main` is the console script.
"""

from __future__ import annotations

from typing import Annotated

import typer

from gateway import __version__
from gateway.cli import bench, check, keys, probe, serve, sim, stats
from gateway.cli.tidy import tidy_app

app = typer.Typer(
    name="tailguard",
    help="Tailguard: a latency-aware LLM API gateway.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tailguard {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Tailguard: a latency-aware LLM API gateway."""


# The order of registration is the order of `tailguard --help`.
app.command()(serve.serve)
app.command("check-config")(check.check_config)
app.command()(sim.sim)
app.add_typer(sim.simulate_app)
app.command()(stats.stats)
app.command()(probe.probe)
app.command()(stats.report)
app.add_typer(keys.keys_app)
app.add_typer(bench.bench_app)
tidy_app(app)


def main() -> None:
    app(prog_name="tailguard")  # not `python -m gateway` in the usage lines
