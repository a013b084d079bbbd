"""The ``jsqueue dest`` commands: ``dest ls`` and ``dest show SITE`` print the destination
sites as the cluster holds them (:mod:`jsqueue.destinations_admin`), as text or JSON. No logic
of their own; :func:`register` adds them to the main app (the helpers are passed in, so this
module does not import :mod:`jsqueue.cli.commands`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated

import typer
from pydantic import BaseModel

from jsqueue.config import Settings
from jsqueue.config.destinations import check_site
from jsqueue.errors import InvalidName
from jsqueue.views import DestinationView

__all__ = ["register", "render_destination", "render_destinations"]

#: Column heads of ``dest ls``.
LS_HEADER = (
    f"{'SITE':<32} {'SESSIONS':>8} {'LIMIT':>5} {'NOW':>4} {'STATUS':<6} {'QUEUED':>7}  UNTIL"
)


JsonOption = Annotated[bool, typer.Option("--json", help="JSON, one object per line.")]
QueuedOption = Annotated[
    bool, typer.Option("--queued/--no-queued", help="Count each site's queue.")
]

SiteArgument = Annotated[str, typer.Argument(help="Site: a domain, or a group's name.")]


def _ts(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


def render_destinations(views: list[DestinationView]) -> list[str]:
    """``dest ls``: one line per site (sessions open across the cluster, configured limit,
    sessions allowed now, status, queued work items, end of a cool-off or throttle)."""
    lines = [LS_HEADER]
    for v in views:
        until = v.down_until or v.throttled_until
        queued = "-" if v.queued is None else str(v.queued)
        lines.append(
            f"{v.site:<32} {v.sessions:>8} {v.limit:>5} {v.allowed:>4} {v.status:<6} "
            f"{queued:>7}  {_ts(until)}"
        )
    return lines


def render_destination(v: DestinationView) -> list[str]:
    """``dest show SITE``: the site in full, one field per line."""
    holders = ", ".join(f"{k}={n}" for k, n in sorted(v.holders.items())) or "-"
    return [
        f"site:             {v.site}",
        f"status:           {v.status}"
        + (f" until {_ts(v.down_until)} UTC" if v.down_until else ""),
        f"sessions:         {v.sessions} open of {v.limit} (allowed now: {v.allowed})",
        f"held by:          {holders}",
        f"failures:         {v.failures} consecutive connection failure(s)",
        f"throttled until:  {_ts(v.throttled_until)}",
        f"message rate:     {v.message_rate or 'unlimited'}",
        f"connection rate:  {v.connection_rate or 'unlimited'}",
        f"queued:           {'-' if v.queued is None else v.queued}",
    ]


def register(
    app: typer.Typer,
    settings: Callable[[], Settings],
    run: Callable[[Callable[[asyncio.Event], Awaitable[None]]], None],
    echo_json: Callable[[BaseModel], None],
) -> None:
    """Add the ``dest`` group to ``app``: ``settings`` loads the settings (exit 2 on a bad
    one), ``run`` runs a main coroutine until a signal, ``echo_json`` prints one model."""
    dest_app = typer.Typer(help="Destination sites: sessions, limits, dead sites.")
    app.add_typer(dest_app, name="dest")

    @dest_app.command("ls")
    def dest_ls(
        queued: QueuedOption = True,
        as_json: JsonOption = False,
    ) -> None:
        """List the sites the cluster holds slots, rates or a state for: sessions open,
        limit, allowed now, up/down, queued work items."""
        loaded = settings()

        async def main(stop: asyncio.Event) -> None:
            from jsqueue.destinations_admin import list_destinations
            from jsqueue.runtime import open_admin

            async with open_admin(loaded, events=False) as adm:
                store = adm.stores.destinations
                if store is None:  # not for the JetStream stores, which always have one
                    raise typer.Exit(1)
                views = await list_destinations(store, loaded.destinations, queued=queued)
            if as_json:
                for v in views:
                    echo_json(v)
            else:
                typer.echo("\n".join(render_destinations(views)))

        run(main)

    @dest_app.command("show")
    def dest_show(
        site: SiteArgument,
        as_json: JsonOption = False,
    ) -> None:
        """Show one site: slots by worker, limit, status and cool-off, rates, queued.

        Raises:
            Exit: code 2 when SITE names no site (a wildcard, white space ...).
        """
        try:
            name = check_site(site)
        except InvalidName as e:  # a usage error: one line, exit 2, nothing read
            typer.echo(f"jsqueue: {e}", err=True)
            raise typer.Exit(2) from e
        loaded = settings()

        async def main(stop: asyncio.Event) -> None:
            from jsqueue.destinations_admin import show_destination
            from jsqueue.runtime import open_admin

            async with open_admin(loaded, events=False) as adm:
                store = adm.stores.destinations
                if store is None:
                    raise typer.Exit(1)
                view = await show_destination(store, loaded.destinations, name)
            if as_json:
                echo_json(view)
            else:
                typer.echo("\n".join(render_destination(view)))

        run(main)
