"""The ``jsqueue`` command line (typer). Parses, loads settings, calls; holds no logic.

Exit codes: 0 success; 1 runtime failure (NATS unreachable, health check failed);
2 bad usage or an invalid setting (one line naming the setting, no traceback).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from jsqueue.config import Settings, load_settings
from jsqueue.errors import ConfigError, JsqueueError
from jsqueue.logs import setup_logging

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="jsqueue: a durable, distributed outbound SMTP queue on NATS JetStream.",
)
config_app = typer.Typer(help="Inspect the configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")

_state: dict[str, Path | None] = {"config": None}

ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="TOML settings file (else $JSQUEUE_CONFIG)."),
]


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"jsqueue: {message}", err=True)
    raise typer.Exit(code)


def _settings() -> Settings:
    try:
        settings = load_settings(_state["config"])
    except ConfigError as e:
        _fail(f"invalid configuration: {e}", 2)
    setup_logging(settings.log)
    return settings


def _run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop)`` with SIGTERM/SIGINT setting ``stop``; errors become one line."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        asyncio.run(runner())
    except ConfigError as e:
        _fail(f"invalid configuration: {e}", 2)
    except (JsqueueError, OSError) as e:
        _fail(str(e), 1)


@app.callback()
def _main(config: ConfigOption = None) -> None:
    _state["config"] = config


@app.command()
def up() -> None:
    """Run everything on this box: embedded nats-server (unless nats.urls is set), the
    SMTP front end and a delivery worker. Stops cleanly on SIGTERM / Ctrl-C."""
    from jsqueue.runtime import run_services

    settings = _settings()
    _run_until_signal(
        lambda stop: run_services(settings, stop, smtp=True, worker=True, embedded=True)
    )


@app.command()
def smtp() -> None:
    """Run the SMTP front end against NATS (nats.urls, else 127.0.0.1:nats.port)."""
    from jsqueue.runtime import run_services

    settings = _settings()
    _run_until_signal(
        lambda stop: run_services(settings, stop, smtp=True, worker=False, embedded=False)
    )


@app.command()
def worker() -> None:
    """Run a delivery worker against NATS (nats.urls, else 127.0.0.1:nats.port)."""
    from jsqueue.runtime import run_services

    settings = _settings()
    _run_until_signal(
        lambda stop: run_services(settings, stop, smtp=False, worker=True, embedded=False)
    )


@app.command()
def nats() -> None:
    """Run only the embedded nats-server (JetStream, nats.store_dir, nats.port)."""
    from jsqueue.runtime import embedded_nats

    settings = _settings()

    async def main(stop: asyncio.Event) -> None:
        async with embedded_nats(settings) as urls:
            typer.echo(f"nats-server ready on {', '.join(urls)}")
            await stop.wait()

    _run_until_signal(main)


@app.command()
def check() -> None:
    """Health probe: exit 0 when NATS answers and the queue's streams exist, else 1."""
    from jsqueue.runtime import nats_urls
    from jsqueue.store.jetstream import open_jetstream

    settings = _settings()

    async def main(stop: asyncio.Event) -> None:
        stores = await open_jetstream(settings.nats, nats_urls(settings))
        try:
            backlog = await stores.scheduler.backlog()
        finally:
            await stores.close()
        typer.echo(f"ok: NATS reachable, backlog {backlog}")

    _run_until_signal(main)


def _redacted(settings: Settings) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(settings.model_dump_json())
    return data


@config_app.command("show")
def config_show(
    as_json: Annotated[
        bool, typer.Option("--json", help="JSON instead of TOML-like text.")
    ] = False,
) -> None:
    """Print the effective configuration (defaults, file, environment), secrets hidden."""
    data = _redacted(_settings())
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    for section, values in data.items():
        typer.echo(f"[{section}]")
        for key, value in values.items():
            typer.echo(f"{key} = {json.dumps(value)}")
        typer.echo("")


def main() -> None:
    """Console-script entry point."""
    logging.captureWarnings(True)
    app(prog_name="jsqueue")
    sys.exit(0)
