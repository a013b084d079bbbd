"""The ``jsqueue tls-report`` command: build a day's SMTP TLS reports (RFC 8460) from the
events stream and send them to each policy domain's ``rua`` (or print them with
``--dry-run``). Registered on the app of :mod:`.commands`."""

from __future__ import annotations

import asyncio
import json
from datetime import date, timedelta
from typing import Annotated

import typer

from jsqueue.cli.commands import _fail, _run_until_signal, _settings, app
from jsqueue.envelope import utcnow

__all__ = ["tls_report"]


@app.command("tls-report")
def tls_report(
    day: Annotated[
        str | None, typer.Option("--day", help="UTC day to report, YYYY-MM-DD (yesterday).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the reports as JSON; send nothing.")
    ] = False,
) -> None:
    """Build and send one UTC day's TLS reports (RFC 8460) from the events stream."""
    settings = _settings()
    try:
        wanted = date.fromisoformat(day) if day else (utcnow() - timedelta(days=1)).date()
    except ValueError as e:
        _fail(f"--day: {e}", 2)

    async def main(stop: asyncio.Event) -> None:
        from jsqueue.delivery.policy.reporting import TlsReporter
        from jsqueue.delivery.policy.tlsrpt import build_report, day_range, sessions_by_domain
        from jsqueue.runtime import nats_urls
        from jsqueue.store.jetstream import open_jetstream

        urls = nats_urls(settings)
        stores = await open_jetstream(settings.nats, urls, update=False)
        try:
            reporter = TlsReporter(settings, urls, stores)
            if dry_run:
                start, end = day_range(wanted)
                conf = settings.outbound_tls.report
                events = await reporter.events(wanted)
                for domain, sessions in sorted(sessions_by_domain(events, start, end).items()):
                    report = build_report(
                        domain,
                        sessions,
                        wanted,
                        organization=conf.organization,
                        contact=conf.contact,
                    )
                    typer.echo(json.dumps(report, indent=2))
                return
            for sent in await reporter.report_day(wanted):
                state = "sent" if sent.ok else "FAILED"
                typer.echo(f"{sent.domain} -> {sent.uri}: {state} ({sent.detail})")
        finally:
            await stores.close()

    _run_until_signal(main)
