"""The ``jsqueue`` commands (typer): each parses its options, loads the settings, calls the
runtime or the queue operations and prints what they return (:mod:`jsqueue.cli.render`, or
JSON); no logic of its own. Exit codes: 0 success; 1 runtime failure (NATS unreachable,
health check failed, an action failed); 2 bad usage or an invalid setting (one line naming
the setting, no traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

import typer
import uvloop
from pydantic import BaseModel, ValidationError

from jsqueue.admin import EntryFilter, parse_duration
from jsqueue.cli import dest
from jsqueue.cli.render import (
    LS_HEADER,
    json_safe,
    render_counts,
    render_detail,
    render_entry_lines,
    render_event,
    render_result,
    render_stats,
)
from jsqueue.config import MASK, Settings, load_settings, toml_text
from jsqueue.envelope import EntryState, utcnow
from jsqueue.errors import BodyNotFound, ConfigError, EntryNotFound, InvalidName, JsqueueError
from jsqueue.events import EventKind, tail
from jsqueue.logs import setup_logging
from jsqueue.names import check_queue_id
from jsqueue.operator_state import BREAK_WARNING
from jsqueue.tasks import cancel_and_wait
from jsqueue.views import Action, EntrySummary, Outcome

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


def reader_gone() -> NoReturn:
    """The reader of our output went away (``jsqueue queue ls | head``): end quietly with
    status 0, as Unix filters do. Standard output is pointed at /dev/null first, so the
    flush at exit cannot fail again.

    Raises:
        typer.Exit: always, with status 0.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise typer.Exit(0)


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
    """Run ``main(stop)`` with SIGTERM/SIGINT setting ``stop``; errors become one line.

    The event loop is uvloop's (libuv): the same asyncio API with less CPU per socket
    event, which the front end and the worker spend most of their time in (bench/).
    """

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        uvloop.run(runner())
    except BrokenPipeError:
        reader_gone()
    except ConfigError as e:
        _fail(f"invalid configuration: {e}", 2)
    except (JsqueueError, OSError) as e:
        _fail(str(e), 1)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"jsqueue {importlib.metadata.version('jsqueue')}")
        raise typer.Exit(0)


VersionOption = Annotated[
    bool,
    typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
]


@app.callback()
def _main(config: ConfigOption = None, version: VersionOption = False) -> None:
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
def nats(
    cluster: Annotated[
        bool,
        typer.Option(
            "--cluster",
            help="A local three-node cluster instead: client ports nats.port and the next "
            "two, route ports 6222-6224, stores under nats.store_dir/cluster.",
        ),
    ] = False,
) -> None:
    """Run only the embedded nats-server (JetStream, nats.store_dir, nats.port).

    Exits with status 1 as soon as the server dies (with ``--cluster``: once no node is
    left), so a supervisor sees it and restarts it, as ``jsqueue up`` does. Refused (exit
    2, one line) when ``nats.urls`` is set: the queue then uses those servers, and a local
    one started beside them would serve nobody.
    """
    from jsqueue.runtime import embedded_nats

    settings = _settings()
    if settings.nats.urls:
        _fail(
            f"nats.urls is set ({', '.join(_hide_url_password(u) for u in settings.nats.urls)}): "
            "jsqueue uses those servers and `jsqueue nats` starts none; unset nats.urls "
            "(JSQUEUE_NATS__URLS) to run the embedded one",
            2,
        )

    async def main(stop: asyncio.Event) -> None:
        if cluster:
            from jsqueue.nats_cluster import cluster_from_settings

            async with cluster_from_settings(settings.nats) as nodes:
                typer.echo(f"nats cluster ready on {', '.join(nodes.urls)}")
                typer.echo(
                    f"point jsqueue at it: JSQUEUE_NATS__URLS='{json.dumps(nodes.urls)}' "
                    "JSQUEUE_NATS__REPLICAS=3"
                )
                while not stop.is_set():
                    if not any(node.running for node in nodes.nodes):
                        raise JsqueueError("every node of the nats cluster died; stopped")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
            return
        died = asyncio.Event()

        def on_exit() -> None:
            died.set()
            stop.set()

        async with embedded_nats(settings, on_exit=on_exit) as urls:
            typer.echo(f"nats-server ready on {', '.join(urls)}")
            await stop.wait()
        if died.is_set():
            raise JsqueueError("the embedded nats-server died; stopped (start again to recover)")

    _run_until_signal(main)


@app.command()
def check() -> None:
    """Health probe: exit 0 when NATS answers and the queue's streams exist, else 1."""
    from jsqueue.runtime import nats_urls
    from jsqueue.store.jetstream import queue_backlog

    settings = _settings()

    async def main(stop: asyncio.Event) -> None:
        backlog = await queue_backlog(settings.nats, nats_urls(settings))
        typer.echo(f"ok: NATS reachable, queue set up, backlog {backlog}")

    _run_until_signal(main)


def _hide_url_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:{MASK}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


def _redacted(settings: Settings) -> dict[str, Any]:
    """Settings as JSON data with every secret masked: SecretStr fields (pydantic prints
    them as ``**********``) and passwords inside NATS URLs."""
    data: dict[str, Any] = json.loads(settings.model_dump_json())
    data["nats"]["urls"] = [_hide_url_password(u) for u in data["nats"]["urls"]]
    return data


@config_app.command("show")
def config_show(
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of TOML.")] = False,
) -> None:
    """Print the effective configuration (defaults, file, environment) as TOML that
    ``--config`` reads back; secrets are left out (named in a comment)."""
    data = _redacted(_settings())
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    typer.echo(toml_text(data), nl=False)


# --------------------------------------------------------------------------- queue


queue_app = typer.Typer(
    help="List, inspect and act on the queue, cluster-wide (like mailq, postqueue, postsuper).",
    no_args_is_help=True,
)
app.add_typer(queue_app, name="queue")
events_app = typer.Typer(help="Follow the events stream.", no_args_is_help=True)
app.add_typer(events_app, name="events")

JsonOption = Annotated[
    bool, typer.Option("--json", help="JSON output; listings print one object per line.")
]
StateOption = Annotated[
    list[EntryState] | None,
    typer.Option("--state", help="Only entries in this state (repeatable); default: not done."),
]
DomainOption = Annotated[
    str | None, typer.Option("--domain", help="Only entries with an open recipient at DOMAIN.")
]
SenderOption = Annotated[
    str | None,
    typer.Option("--sender", help="Only this reverse-path ('<>' = null, '@dom' = a domain)."),
]
MinAgeOption = Annotated[
    str | None, typer.Option("--min-age", help="Only entries at least this old (90s, 15m, 2h, 3d).")
]
MaxAgeOption = Annotated[
    str | None, typer.Option("--max-age", help="Only entries at most this old (90s, 15m, 2h, 3d).")
]
IdsArgument = Annotated[
    list[str] | None,
    typer.Argument(help="Queue ids; '-' reads them from standard input.", show_default=False),
]
AllOption = Annotated[bool, typer.Option("--all", help="Every entry still in the queue.")]


def _filter(
    states: list[EntryState] | None,
    domain: str | None,
    sender: str | None,
    min_age: str | None,
    max_age: str | None,
) -> EntryFilter:
    """Options to an EntryFilter; a bad value is a usage error (exit 2)."""
    try:
        return EntryFilter(
            states=frozenset(states) if states else None,
            domain=domain,
            sender=sender,
            min_age_s=parse_duration(min_age) if min_age is not None else None,
            max_age_s=parse_duration(max_age) if max_age is not None else None,
        )
    except ValidationError as e:
        err = e.errors()[0]
        where = "--" + "-".join(str(x) for x in err["loc"]).replace("_s", "").replace("_", "-")
        _fail(f"{where}: {err['msg']}", 2)
    except (ValueError, JsqueueError) as e:
        _fail(str(e).splitlines()[0], 2)


def _echo_json(model: BaseModel) -> None:
    typer.echo(json_safe(model.model_dump_json()))


@queue_app.command("ls")
def queue_ls(
    states: StateOption = None,
    domain: DomainOption = None,
    sender: SenderOption = None,
    min_age: MinAgeOption = None,
    max_age: MaxAgeOption = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most N entries.")] = None,
    after: Annotated[
        str | None, typer.Option("--after", help="Start after this queue id (paging).")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """List the queue like mailq: id (! held, * active), size, arrival, sender, then each
    recipient with its state, attempts and last reply. Streams page by page."""
    settings = _settings()
    flt = _filter(states, domain, sender, min_age, max_age)
    if after is not None:
        try:
            check_queue_id(after)
        except JsqueueError as e:
            _fail(str(e), 2)

    async def main(stop: asyncio.Event) -> None:
        from jsqueue.runtime import open_admin

        shown = octets = 0
        last: str | None = None
        async with open_admin(settings, events=False) as adm:
            if not as_json:
                typer.echo(LS_HEADER)
            scan = adm.scan(flt, after=after, first_page=min(limit or 100, 100))
            async with contextlib.aclosing(scan) as found:
                async for v in found:
                    summary = EntrySummary.of(v.entry)
                    if as_json:
                        _echo_json(summary)
                    else:
                        typer.echo("\n".join(render_entry_lines(summary)))
                    shown, octets, last = shown + 1, octets + summary.size, summary.id
                    if shown % 100 == 0:
                        sys.stdout.flush()
                    if (limit is not None and shown >= limit) or stop.is_set():
                        break
        if not as_json:
            typer.echo(f"-- {octets / 1024:.0f} Kbytes in {shown} Requests.")
        if limit is not None and shown >= limit and last is not None:
            typer.echo(f"(limit reached; continue with --after {last})", err=True)

    _run_until_signal(main)


@queue_app.command("show")
def queue_show(
    queue_id: Annotated[str, typer.Argument(help="Queue id.")],
    body: Annotated[bool, typer.Option("--body", help="Print the stored message only.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Show one entry: envelope, every recipient's attempts, last reply and schedule."""
    settings = _settings()

    async def main(stop: asyncio.Event) -> None:
        from jsqueue.runtime import open_admin

        async with open_admin(settings, events=False) as adm:
            try:
                if body:
                    out = sys.stdout.buffer
                    async with contextlib.aclosing(adm.body(queue_id)) as chunks:
                        async for chunk in chunks:
                            out.write(chunk)
                    out.flush()
                    return
                detail = await adm.show(queue_id)
            except (EntryNotFound, BodyNotFound):
                _fail(f"no such entry: {queue_id}", 1)
            except InvalidName as e:
                _fail(str(e), 2)
        if as_json:
            _echo_json(detail)
        else:
            typer.echo("\n".join(render_detail(detail)))

    _run_until_signal(main)


@queue_app.command("stats")
def queue_stats(
    top: Annotated[int, typer.Option("--top", min=1, help="Destinations shown.")] = 20,
    as_json: JsonOption = False,
) -> None:
    """Counts by state and destination domain, the oldest entry's age, the backlog."""
    settings = _settings()

    async def main(stop: asyncio.Event) -> None:
        from jsqueue.runtime import open_admin

        async with open_admin(settings, events=False) as adm:
            stats = await adm.stats()
        if as_json:
            _echo_json(stats)
        else:
            typer.echo("\n".join(render_stats(stats, top)))

    _run_until_signal(main)


def _bulk(
    action: Action,
    ids: list[str] | None,
    flt: EntryFilter,
    all_: bool,
    as_json: bool,
    break_lease: bool = False,
) -> None:
    """Run ``action`` on the given ids, or on every entry the filter (or --all) selects;
    ``-`` as the only id reads the ids from standard input (like ``postsuper -d -``).

    Raises:
        typer.Exit: status 2 for a usage error (no ids on standard input, a line there that
            is no queue id, ids together with a filter or --all, neither given) or an
            invalid configuration; 1 when an action failed or the queue could not be
            reached; 0 when the reader of the output went away.
    """
    if ids == ["-"]:
        ids = _ids_from_stdin()
        if not ids:
            _fail("no queue ids on standard input", 2)
    if ids and (all_ or not flt.is_empty):
        _fail("give queue ids or a filter / --all, not both", 2)
    if not ids and not all_ and flt.is_empty:
        _fail("give queue ids, a filter (--state, --domain, --sender, --min-age...) or --all", 2)
    if break_lease or action is Action.REQUEUE:
        typer.echo(
            f"warning: {action.value} breaks the leases of live workers: {BREAK_WARNING}",
            err=True,
        )
    settings = _settings()
    exit_code = 0

    async def main(stop: asyncio.Event) -> None:
        nonlocal exit_code
        from jsqueue.runtime import open_admin

        async with open_admin(settings) as adm:
            queue_ids = list(ids) if ids else await adm.select(flt)
            domain = flt.domain if action is Action.FLUSH else None
            if len(queue_ids) > 1 and sys.stderr.isatty():  # elsewhere it prints its label
                with typer.progressbar(
                    length=len(queue_ids), label=action.value, file=sys.stderr
                ) as bar:
                    result = await adm.apply(
                        action,
                        queue_ids,
                        domain=domain,
                        break_lease=break_lease,
                        progress=lambda done, total: bar.update(1),
                    )
            else:
                result = await adm.apply(action, queue_ids, domain=domain, break_lease=break_lease)
        if as_json:
            _echo_json(result)
        else:
            many = len(result.results) > 50
            for r in result.results:
                if not many or r.outcome in (Outcome.FAILED, Outcome.NOT_FOUND):
                    typer.echo(render_result(r))
            typer.echo(render_counts(result))
        exit_code = 0 if result.ok else 1

    _run_until_signal(main)
    if exit_code:
        raise typer.Exit(exit_code)


def _ids_from_stdin() -> list[str]:
    """Queue ids from standard input: the first word of each non-empty line, without the
    ``*`` / ``!`` marks ``queue ls`` puts on active and held entries; a word that is no
    queue id is a usage error (exit 2) naming its line."""
    ids: list[str] = []
    for number, line in enumerate(sys.stdin, 1):
        words = line.split()
        if not words:
            continue
        word = words[0].rstrip("*!")
        try:
            ids.append(check_queue_id(word))
        except InvalidName:
            _fail(f"standard input line {number}: not a queue id: {words[0][:40]!r}", 2)
    return ids


_BULK_HELP = {
    Action.FLUSH: "Deliver now, overriding the backoff (with --domain: only that destination).",
    Action.HOLD: "Put entries on hold: nothing is attempted until they are released.",
    Action.RELEASE: "Release held entries and deliver them now.",
    Action.DELETE: "Delete entries with their bodies and work items; no DSN is sent.",
    Action.BOUNCE: "Bounce every open recipient (550 5.7.1) and send the DSN to the sender.",
    Action.REQUEUE: "Requeue (postsuper -r): drop leases, due now, attempts kept. A live "
    "worker's transaction cannot be recalled: the message may be sent twice.",
}
BreakLeaseOption = Annotated[
    bool,
    typer.Option(
        "--break-lease",
        help="Also break live workers' leases (the message may be sent twice, RFC 5321 §6.1).",
    ),
]


def _register_bulk(action: Action) -> None:
    """``jsqueue queue <action> [ID…] [filters] [--all]``: one command per admin action."""

    def command(
        ids: IdsArgument = None,
        states: StateOption = None,
        domain: DomainOption = None,
        sender: SenderOption = None,
        min_age: MinAgeOption = None,
        max_age: MaxAgeOption = None,
        all_: AllOption = False,
        as_json: JsonOption = False,
    ) -> None:
        _bulk(action, ids, _filter(states, domain, sender, min_age, max_age), all_, as_json)

    def flush_command(
        ids: IdsArgument = None,
        states: StateOption = None,
        domain: DomainOption = None,
        sender: SenderOption = None,
        min_age: MinAgeOption = None,
        max_age: MaxAgeOption = None,
        all_: AllOption = False,
        as_json: JsonOption = False,
        break_lease: BreakLeaseOption = False,
    ) -> None:
        flt = _filter(states, domain, sender, min_age, max_age)
        _bulk(action, ids, flt, all_, as_json, break_lease)

    chosen = flush_command if action is Action.FLUSH else command
    chosen.__doc__ = _BULK_HELP[action]
    queue_app.command(action.value)(chosen)


for _action in Action:
    _register_bulk(_action)


@events_app.command("tail")
def events_tail(
    kinds: Annotated[
        list[EventKind] | None, typer.Option("--kind", help="Only this kind (repeatable).")
    ] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="Start this long ago (90s, 15m, 2h, 3d).")
    ] = None,
    from_start: Annotated[
        bool, typer.Option("--from-start", help="Start with the oldest event kept.")
    ] = False,
    count: Annotated[
        int | None, typer.Option("--count", min=1, help="Exit after N events.")
    ] = None,
    queue_id: Annotated[
        str | None, typer.Option("--id", help="Only the events of this queue id.")
    ] = None,
    until_end: Annotated[
        bool,
        typer.Option("--until-end", help="Exit once the events stored so far are printed."),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Follow the events stream (new events only, unless --since or --from-start)."""
    settings = _settings()
    if queue_id is not None:
        try:
            check_queue_id(queue_id)
        except InvalidName as e:
            _fail(str(e), 2)
    try:
        start = utcnow() - timedelta(seconds=parse_duration(since)) if since else None
    except ValueError as e:
        _fail(str(e), 2)

    async def main(stop: asyncio.Event) -> None:
        from jsqueue.runtime import nats_urls

        seen = 0

        async def follow() -> None:
            nonlocal seen
            stream = tail(
                settings.nats,
                nats_urls(settings),
                kinds=kinds or (),
                since=start,
                from_start=from_start,
                queue_id=queue_id,
                until_end=until_end,
            )
            async with contextlib.aclosing(stream) as events:
                async for event in events:
                    line = json_safe(event.to_json().decode()) if as_json else render_event(event)
                    typer.echo(line)
                    sys.stdout.flush()
                    seen += 1
                    if count is not None and seen >= count:
                        return

        task = asyncio.create_task(follow())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not task.done():
            await cancel_and_wait(task)
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return
        task.result()

    _run_until_signal(main)


dest.register(app, _settings, _run_until_signal, _echo_json)
