"""``jsqueue token`` (the HTTP API's bearer tokens) and ``jsqueue inject`` (sendmail-like
local submission), registered on the app of :mod:`jsqueue.cli.commands`.

``jsqueue inject`` writes to NATS directly, through the same ingest path as the SMTP front
end and the HTTP API (:class:`jsqueue.http.inject.Injector`): a script or cron job on a
host that reaches NATS needs neither a running front end nor a token, and exit 0 means
the message is stored durably (like Postfix's ``sendmail`` dropping into the maildrop
queue, but with the queue itself as the drop). Exit status as sendmail's (sysexits.h):
0 ``EX_OK``; 64 ``EX_USAGE`` (bad options, no recipient, a bad ``-f``); 65 ``EX_DATAERR``
(a message that cannot be queued: bare CR, a line over 998 octets, over
``smtp.max_message_size``); 67 ``EX_NOUSER`` (a recipient address that is not a mailbox);
75 ``EX_TEMPFAIL`` (NATS unreachable or failing: nothing is stored, try again); 78
``EX_CONFIG`` (an invalid setting).
"""

from __future__ import annotations

import argparse
import email.utils
import getpass
import re
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import pydantic
import typer
import uvloop

from jsqueue.cli.commands import _state, app
from jsqueue.config import Settings, load_settings
from jsqueue.envelope import Notify
from jsqueue.errors import ConfigError, JsqueueError, RequestRejected, StoreUnavailable
from jsqueue.http.auth import Role, add_token, parse_tokens, read_tokens_file, remove_token
from jsqueue.http.message import Transaction, check_reverse_path, checked_envelope, crlf
from jsqueue.http.models import RecipientSpec
from jsqueue.logs import setup_logging

EX_OK = 0
EX_USAGE = 64
EX_DATAERR = 65
EX_NOUSER = 67
EX_UNAVAILABLE = 69
EX_SOFTWARE = 70
EX_TEMPFAIL = 75
EX_CONFIG = 78

token_app = typer.Typer(
    help="Bearer tokens of the HTTP API (api.tokens_file).", no_args_is_help=True
)

FileOption = Annotated[
    Path | None, typer.Option("--file", help="Tokens file (default: api.tokens_file).")
]


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"jsqueue: {message}", err=True)
    raise typer.Exit(code)


def _tokens_file(path: Path | None) -> Path:
    if path is not None:
        return path
    try:
        settings = load_settings(_state["config"])
    except ConfigError as e:
        _fail(f"invalid configuration: {e}", 2)
    if settings.api.tokens_file is None:
        _fail("no tokens file: set api.tokens_file or give --file", 2)
    return settings.api.tokens_file


@token_app.command("add")
def token_add(
    name: Annotated[str, typer.Argument(help="Token name (shown in logs and events).")],
    role: Annotated[Role, typer.Option("--role", help="read, admin (implies read), inject.")],
    file: FileOption = None,
) -> None:
    """Mint a token: its hash line goes into the tokens file, the token is printed once.

    For a Kubernetes Secret, mint into a local file and put that file into the Secret.
    """
    path = _tokens_file(file)
    try:
        token = add_token(path, name, role)
    except (ValueError, ConfigError, OSError) as e:
        _fail(str(e), 1)
    typer.echo(token)
    typer.echo(f"token {name!r} ({role.value}) added to {path}; it is shown only now", err=True)


@token_app.command("ls")
def token_ls(file: FileOption = None) -> None:
    """List the tokens' names and roles (the tokens themselves are not stored)."""
    path = _tokens_file(file)
    try:
        tokens = parse_tokens(read_tokens_file(path), str(path))
    except (ConfigError, OSError) as e:
        _fail(str(e), 1)
    for t in sorted(tokens.values(), key=lambda t: t.name):
        typer.echo(f"{t.name}\t{t.role.value}")


@token_app.command("rm")
def token_rm(
    name: Annotated[str, typer.Argument(help="Token name.")], file: FileOption = None
) -> None:
    """Revoke a token: remove its line (a running API stops accepting it within a second)."""
    path = _tokens_file(file)
    try:
        found = remove_token(path, name)
    except (ConfigError, OSError) as e:
        _fail(str(e), 1)
    if not found:
        _fail(f"no token named {name!r} in {path}", 1)


# --------------------------------------------------------------------------- inject


class _Parser(argparse.ArgumentParser):
    """sendmail's options; a usage error exits with EX_USAGE (64), not argparse's 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        sys.stderr.write(f"jsqueue inject: {message}\n")
        raise SystemExit(EX_USAGE)


def _parser() -> _Parser:
    p = _Parser(
        prog="jsqueue inject",
        description="Queue the message on standard input (sendmail-like).",
    )
    p.add_argument("-f", dest="sender", help="envelope sender (reverse-path); '<>' is null")
    p.add_argument("-F", dest="fullname", help="accepted, ignored (the From header is kept)")
    p.add_argument("-t", action="store_true", help="recipients from To, Cc, Bcc (Bcc removed)")
    p.add_argument(
        "-i", action="store_true", help="a line with a single '.' does not end the message"
    )
    p.add_argument("-o", action="append", default=[], help="-oi is -i; other -o ignored")
    p.add_argument("-N", dest="notify", help="DSN NOTIFY: never, or success,failure,delay")
    p.add_argument("-R", dest="ret", choices=["full", "hdrs", "FULL", "HDRS"], help="DSN RET")
    p.add_argument("-V", dest="envid", help="DSN ENVID")
    p.add_argument("-v", action="store_true", help="print the queue id")
    p.add_argument("recipients", nargs="*", help="forward-paths")
    return p


_HEADER_END = re.compile(rb"\r\n\r\n")


def header_recipients(data: bytes) -> tuple[list[str], bytes]:
    """``-t``: the addresses of To, Cc and Bcc (RFC 5322 §3.6.3), and the message with its
    Bcc fields removed (the rest byte for byte). ``data`` has CRLF line ends. A field name
    followed by white space before its colon (``Bcc :``, RFC 5322 §4.5 obsolete syntax) is
    that field.

    Raises:
        RequestRejected: a To, Cc or Bcc field is not UTF-8 (RFC 6532 §3.2), so its
            addresses cannot be known (they are never guessed).
    """
    m = _HEADER_END.search(data)
    head, body = (data[: m.end()], data[m.end() :]) if m else (data, b"")
    fields: list[tuple[bytes, list[bytes]]] = []  # (name, lines), continuations unfolded
    for line in head.split(b"\r\n"):
        if line[:1] in (b" ", b"\t") and fields:
            fields[-1][1].append(line)  # a folded continuation (RFC 5322 §2.2.3)
        else:
            fields.append((line.partition(b":")[0].rstrip(b" \t"), [line]))
    values = []
    for wanted in (b"to", b"cc", b"bcc"):
        for name, lines in fields:
            if name.lower() != wanted:
                continue
            raw = b" ".join(x.strip(b" \t") for x in lines).partition(b":")[2]
            try:
                values.append(raw.decode("utf-8"))
            except UnicodeError:
                raise RequestRejected(
                    f"-t: the {name.decode('ascii', 'replace')} field is not UTF-8"
                ) from None
    addresses = [a for _, a in email.utils.getaddresses(values) if a]
    kept = [line for name, lines in fields if name.lower() != b"bcc" for line in lines]
    return addresses, b"\r\n".join(kept) + body


def _read_message(stop_at_dot: bool) -> bytes:
    data = sys.stdin.buffer.read()
    if stop_at_dot:
        lines = data.split(b"\n")
        for i, line in enumerate(lines):
            if line.rstrip(b"\r") == b".":
                data = b"\n".join(lines[:i]) + (b"\n" if i else b"")
                break
    return data


def _inject_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        settings: Settings = load_settings(_state["config"])
    except ConfigError as e:
        typer.echo(f"jsqueue: invalid configuration: {e}", err=True)
        return EX_CONFIG
    setup_logging(settings.log)
    user = _user()
    sender = args.sender if args.sender is not None else f"{user}@{settings.smtp.hostname}"
    try:
        check_reverse_path(sender)
    except RequestRejected as e:
        typer.echo(f"jsqueue inject: -f: {e}", err=True)
        return EX_USAGE
    stop_at_dot = not (args.i or "i" in args.o)
    raw = _read_message(stop_at_dot)
    if len(raw) > settings.smtp.max_message_size:
        typer.echo(
            f"jsqueue inject: the message is {len(raw)} octets; at most "
            f"{settings.smtp.max_message_size} (smtp.max_message_size)",
            err=True,
        )
        return EX_DATAERR
    try:
        data = crlf(raw)
    except RequestRejected as e:
        typer.echo(f"jsqueue inject: {e}", err=True)
        return EX_DATAERR
    addresses = [_bare(a) for a in args.recipients]
    if args.t:
        try:
            found, data = header_recipients(data)
        except RequestRejected as e:
            typer.echo(f"jsqueue inject: {e}", err=True)
            return EX_DATAERR
        addresses += found
    if not addresses:
        typer.echo("jsqueue inject: no recipients (give them, or -t)", err=True)
        return EX_USAGE
    notify: list[Notify] | None = None
    if args.notify:
        try:
            notify = [Notify(w.strip().upper()) for w in args.notify.split(",")]
        except ValueError:
            notify = []
        if not notify or (Notify.NEVER in notify and len(notify) > 1):  # RFC 3461 §4.1
            typer.echo(
                f"jsqueue inject: -N {args.notify}: never, or any of success, failure, delay",
                err=True,
            )
            return EX_USAGE
    specs: list[RecipientSpec] = []
    for a in addresses:
        try:
            specs.append(RecipientSpec(address=a, notify=notify))
        except pydantic.ValidationError as e:
            why = "; ".join(str(err["msg"]) for err in e.errors())
            typer.echo(f"jsqueue inject: recipient {a!r}: {why}", err=True)
            return EX_NOUSER
    try:
        env = checked_envelope(sender, specs, max_recipients=settings.smtp.max_recipients)
    except (RequestRejected, ValueError) as e:
        typer.echo(f"jsqueue inject: {str(e).splitlines()[0]}", err=True)
        return EX_NOUSER
    envid = None
    if args.envid is not None:
        from jsqueue.envelope import xtext_encode
        from jsqueue.frontend.syntax import SyntaxProblem, parse_envid

        try:
            envid = parse_envid(xtext_encode(args.envid))
        except SyntaxProblem as e:
            typer.echo(f"jsqueue inject: -V: {e}", err=True)
            return EX_USAGE
    ret = args.ret.upper() if args.ret else None
    tx = Transaction(env.reverse_path, env.recipients, data, env.smtputf8, envid, ret)
    return uvloop.run(_store(settings, tx, user, verbose=args.v))


def _bare(argument: str) -> str:
    """A command-line recipient as its address: ``Name <a@b.test>`` and ``<a@b.test>`` as
    ``a@b.test`` (RFC 5322 §3.4 name-addr, as sendmail takes them); anything else as it is
    (a quoted local part with ``<`` in it stays whole)."""
    if argument.rstrip().endswith(">") and "<" in argument:
        _, address = email.utils.parseaddr(argument)
        if address:
            return address
    return argument


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


async def _store(settings: Settings, tx: Transaction, user: str, *, verbose: bool) -> int:
    import socket

    from jsqueue.http.inject import NotQueued, Submitter
    from jsqueue.runtime import open_injector

    who = Submitter(f"local:{user}", f"local:{user}@{socket.gethostname()}", "127.0.0.1", "local")
    try:
        async with open_injector(settings) as injector:
            result = await injector.inject(tx, who)
    except (NotQueued, StoreUnavailable, OSError) as e:
        typer.echo(f"jsqueue inject: not queued ({e}); try again", err=True)
        return EX_TEMPFAIL
    except RequestRejected as e:  # the message itself (a mail loop)
        typer.echo(f"jsqueue inject: not queued: {e}", err=True)
        return EX_DATAERR
    except JsqueueError as e:
        typer.echo(f"jsqueue inject: not queued ({e})", err=True)
        return EX_UNAVAILABLE
    if verbose:
        typer.echo(result.queue_id)
    return EX_OK


def inject(ctx: typer.Context) -> None:
    """sendmail-like: queue the message on standard input. jsqueue inject [-f SENDER] [-t]
    [-i] [-N NOTIFY] [-R full|hdrs] [-V ENVID] [-v] RCPT... (--help for all).

    Raises:
        typer.Exit: always, with the sysexits.h status (module docstring).
    """
    raise typer.Exit(_inject_main(list(ctx.args)))


def register() -> None:
    """Add ``token`` and ``inject`` to the ``jsqueue`` app. Idempotent."""
    if any(g.name == "token" for g in app.registered_groups):
        return
    app.add_typer(token_app, name="token")
    app.command(
        "inject",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )(inject)
