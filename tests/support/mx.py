"""Fake MX servers for delivery tests, on loopback addresses only (127.0.2.x, ::1).

The worker connects to every MX on one configured port (``WorkerSettings.mx_port``), so
fake MXes for different hosts share one port on different loopback addresses:
:func:`shared_port` finds a port free on all of them.

Two servers, both run in the test's event loop (``async with``):

* :class:`SmtpdMx` - a real aiosmtpd server with scripted replies: per-recipient RCPT
  replies, MAIL/DATA replies, advertised extensions (no 8BITMIME, SMTPUTF8, SIZE with or
  without a number), STARTTLS with a trustme certificate, AUTH. It records every
  transaction (envelope, raw DATA stream, unstuffed message) and counts connections. Being
  aiosmtpd, it is strict in the ways real servers are (it answers ``500`` to a non-ASCII
  command unless SMTPUTF8 is on, and ``555`` to MAIL/RCPT parameters it does not know).
* :class:`ScriptedMx` - a raw line-based server for what aiosmtpd cannot do: multi-line
  greetings, arbitrary (even malformed) EHLO replies, DSN parameters, STARTTLS that aborts
  the handshake or presents an expired / wrong-name certificate, TLS 1.2 only, dropping the
  connection at any step, and sink mode (hash instead of keep) for very large messages.
  With default arguments it is also the *trap*: it records any connection.

Both record :class:`Session` objects (one per TCP connection) with the command lines seen
and the :class:`Transaction` objects completed in them. Example::

    port = shared_port(["127.0.2.70"])
    async with SmtpdMx("127.0.2.70", port, rcpt_replies={"c@x.test": "550 5.1.1 no"}) as mx:
        settings = WorkerSettings(mx_port=port)
        result = await deliver(targets, envelope, body, settings)
        assert mx.delivered[0].rcpt_to == ["a@x.test"]
        assert "DATA" in mx.sessions[0].verbs()

:class:`Certs` makes trustme CAs and server TLS contexts (valid, expired, wrong name,
untrusted) and the CA file for ``WorkerSettings.tls_ca_file``.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import trustme
from aiosmtpd.smtp import SMTP as AiosmtpdSMTP
from aiosmtpd.smtp import AuthResult, Envelope, LoginPassword
from aiosmtpd.smtp import Session as AiosmtpdSession

CLOSE = "<close>"
"""Use as a reply to drop the connection instead of answering."""

SILENT = "<silent>"
"""Use as a reply to answer nothing at all (the client's timeout has to fire)."""

DEFAULT_EXTENSIONS = ("PIPELINING", "8BITMIME", "ENHANCEDSTATUSCODES", "SIZE 52428800")


def shared_port(hosts: Sequence[str], attempts: int = 50) -> int:
    """A TCP port that is free on every one of ``hosts`` right now.

    Raises:
        OSError: no such port found in ``attempts`` tries.
    """
    for _ in range(attempts):
        socks: list[socket.socket] = []
        try:
            first = _bind(hosts[0], 0)
            socks.append(first)
            port = int(first.getsockname()[1])
            for host in hosts[1:]:
                socks.append(_bind(host, port))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(f"no common free port on {hosts}")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def ipv6_loopback_available() -> bool:
    """True when a TCP socket can be bound to ``::1``."""
    try:
        _bind("::1", 0).close()
    except OSError:
        return False
    return True


@dataclass
class Transaction:
    """One MAIL..DATA transaction that reached the end of data.

    Attributes:
        mail_from: reverse-path without brackets (``""`` for ``<>``).
        mail_params: MAIL parameters as sent, e.g. ``["SIZE=123", "BODY=8BITMIME"]``.
        rcpt_to: forward-paths the server accepted, as sent.
        rcpt_params: parameters per accepted forward-path.
        raw: the DATA stream as received (dot-stuffed, CRLF), without the final ``.`` line;
            None in sink mode.
        content: the message after unstuffing (RFC 5321 §4.5.2); None in sink mode.
        size: octets of the unstuffed message.
        sha256: hex digest of the unstuffed message.
        longest_line: longest unstuffed line in octets, CRLF excluded.
        tls: the transaction ran over TLS.
        reply: the reply sent after the end of data.
    """

    mail_from: str
    mail_params: list[str]
    rcpt_to: list[str] = field(default_factory=list)
    rcpt_params: dict[str, list[str]] = field(default_factory=dict)
    raw: bytes | None = None
    content: bytes | None = None
    size: int = 0
    sha256: str = ""
    longest_line: int = 0
    tls: bool = False
    reply: str = ""

    @property
    def accepted(self) -> bool:
        """The end-of-data reply was 2xx: the message counts as delivered."""
        return self.reply.startswith("2")


@dataclass
class Session:
    """One TCP connection to a fake MX.

    Attributes:
        peer: the client's address.
        commands: every command line received (UTF-8, undecodable bytes escaped), in order,
            message content excluded.
        transactions: transactions that reached the end of data.
        tls: STARTTLS completed.
        tls_version: negotiated TLS version.
        closed: the connection has ended.
        beside: sessions of the same server open when this one was accepted (neither
            closed nor past QUIT: what a receiver's limit per client counts;
            :class:`ScriptedMx` only).
        reads: the command lines that arrived in each read of the server (one TCP read,
            message content excluded), in order: a pipelined group (RFC 2920) is one read
            holding MAIL, every RCPT and DATA (:class:`SmtpdMx` only).
    """

    peer: Any
    commands: list[str] = field(default_factory=list)
    reads: list[list[str]] = field(default_factory=list)
    transactions: list[Transaction] = field(default_factory=list)
    tls: bool = False
    tls_version: str | None = None
    closed: bool = False
    beside: int = 0

    def verbs(self) -> list[str]:
        """The command verbs in order, upper case (``["EHLO", "MAIL", ...]``)."""
        return [c.split(" ", 1)[0].upper() for c in self.commands]

    def read_verbs(self) -> list[list[str]]:
        """The command verbs of each read (see ``reads``), upper case."""
        return [[c.split(" ", 1)[0].upper() for c in read] for read in self.reads]

    def rcpt_counts(self) -> list[int]:
        """RCPT commands sent after each MAIL, in order (a reused session has several)."""
        counts: list[int] = []
        for verb in self.verbs():
            if verb == "MAIL":
                counts.append(0)
            elif verb == "RCPT" and counts:
                counts[-1] += 1
        return counts


class _MxBase:
    """Shared recording and lifecycle."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.sessions: list[Session] = []
        self._server: asyncio.AbstractServer | None = None
        self._changed = asyncio.Event()

    @property
    def connections(self) -> int:
        """TCP connections accepted so far."""
        return len(self.sessions)

    @property
    def transactions(self) -> list[Transaction]:
        """Every transaction that reached the end of data, accepted or not, in order."""
        return [t for s in self.sessions for t in s.transactions]

    @property
    def delivered(self) -> list[Transaction]:
        """Transactions answered 2xx after the data: copies the MX now holds."""
        return [t for t in self.transactions if t.accepted]

    @property
    def commands(self) -> list[str]:
        """Every command line of every session, in order."""
        return [c for s in self.sessions for c in s.commands]

    def _notify(self) -> None:
        self._changed.set()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Wait until ``predicate()`` is true, re-checking on every recorded event.

        Raises:
            TimeoutError: still false after ``timeout_s`` seconds.
        """
        async with asyncio.timeout(timeout_s):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

    async def stop(self) -> None:
        """Stop listening and close the server."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Any:
        await self.start()  # type: ignore[attr-defined]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


# ------------------------------------------------------------------------------------------
# raw scripted server


class ScriptedMx(_MxBase):
    """A raw, line-based fake MX whose every reply is scripted.

    Replies are strings; a multi-line reply is lines separated by ``\\n`` (each sent with
    CRLF; an empty line is sent as a bare CRLF, which makes a malformed reply). ``CLOSE``
    drops the connection instead of replying, ``SILENT`` sends nothing. Attributes may be
    changed between deliveries (e.g. a greylisting server that later accepts).

    Args:
        host: loopback address to bind.
        port: TCP port (0 = any; see :func:`shared_port`).
        name: host name used in the default replies.
        greeting: whole greeting reply (default ``220 <name> ESMTP``).
        ehlo: whole EHLO reply; default built from ``extensions`` (+ STARTTLS when ``tls``
            or ``tls_abort``).
        extensions: EHLO keywords for the default EHLO reply.
        mail, rcpt, data, end_of_data, rset, quit, helo: replies to those commands;
            ``end_of_data`` may be a callable ``(transaction) -> reply``.
        rcpt_replies: RCPT reply per forward-path (case-insensitive), else ``rcpt``.
        tls: server TLS context: STARTTLS is offered and completed with it.
        tls_abort: STARTTLS is offered, answered 220, and the connection is reset as soon
            as the ClientHello arrives (CASE-20 variant A).
        smtputf8: accept non-ASCII command lines; otherwise they get ``500 5.5.2``.
        keep_data: keep ``raw``/``content`` of transactions; False = sink (hash and size).
        read_limit: the line reader's buffer limit, octets; it buffers up to twice that
            before it stops reading (memory tests lower it: the MX shares their process).
        max_line_length: answer ``550 5.5.2 line too long`` after the data when a line of
            the message is longer (CASE-25).
        hook: ``(session, line) -> reply | None``: called first for every command line;
            a non-None reply is sent instead of the scripted one (and the command is not
            otherwise processed).
        hold: when set, the reply to the end of data waits until this event is set (a slow
            server: the client sits in the final-reply wait, RFC 5321 §4.5.3.2.6); the
            transaction counts in :attr:`held` meanwhile.
        extra_replies: a reply sent unasked right after the reply to a verb (``{"MAIL":
            "250 2.1.0 again"}``: two replies to one command; for ``"DATA"`` right after
            the ``354``, i.e. before the client could send the data or its final dot).
        tls_inject: text sent in cleartext in the same write as the ``220`` to STARTTLS
            (lines separated by ``\\n``), as a man in the middle injects replies for the
            commands after the handshake (the CVE-2011-0411 class, RFC 3207 §4.2).
        trickle: when set, every reply after the greeting goes out in pieces of this many
            octets, one write each with a pause between (TCP_NODELAY: one segment each),
            so replies and their lines are split across segments; :attr:`pieces` counts
            the writes.
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        name: str = "mx.example.test",
        greeting: str | None = None,
        ehlo: str | None = None,
        extensions: Sequence[str] = DEFAULT_EXTENSIONS,
        helo: str | None = None,
        mail: str = "250 2.1.0 ok",
        rcpt: str = "250 2.1.5 ok",
        rcpt_replies: Mapping[str, str] | None = None,
        data: str = "354 go ahead",
        end_of_data: str | Callable[[Transaction], str] = "250 2.0.0 ok",
        rset: str = "250 2.0.0 ok",
        quit: str = "221 2.0.0 bye",
        tls: ssl.SSLContext | None = None,
        tls_abort: bool = False,
        smtputf8: bool = False,
        keep_data: bool = True,
        read_limit: int = 4 * 1024 * 1024,
        max_line_length: int | None = None,
        hook: Callable[[Session, str], str | None] | None = None,
        hold: asyncio.Event | None = None,
        trickle: int | None = None,
        extra_replies: Mapping[str, str] | None = None,
        tls_inject: str | None = None,
    ) -> None:
        super().__init__(host, port)
        self.tls_inject = tls_inject
        self.extra_replies = {k.upper(): v for k, v in (extra_replies or {}).items()}
        self.trickle = trickle
        self.pieces = 0
        self._writers: list[asyncio.StreamWriter] = []
        self.hold = hold
        self.held = 0
        self.name = name
        self.greeting = greeting or f"220 {name} ESMTP"
        self.extensions = list(extensions)
        self.ehlo = ehlo
        self.helo = helo or f"250 {name}"
        self.mail = mail
        self.rcpt = rcpt
        self.rcpt_replies = {k.lower(): v for k, v in (rcpt_replies or {}).items()}
        self.data = data
        self.end_of_data = end_of_data
        self.rset = rset
        self.quit = quit
        self.tls = tls
        self.tls_abort = tls_abort
        self.smtputf8 = smtputf8
        self.keep_data = keep_data
        self.read_limit = read_limit
        self.max_line_length = max_line_length
        self.hook = hook

    async def push(self, text: str) -> int:
        """Send ``text`` (lines separated by ``\\n``) unasked on every open connection, as a
        server that writes while the client sent nothing (e.g. on an idle cached session).

        Returns:
            the number of connections written to.
        """
        sent = 0
        for writer in list(self._writers):
            if not writer.is_closing():
                await self._send(writer, text)
                sent += 1
        return sent

    async def start(self) -> ScriptedMx:
        """Start listening on (host, port); ``port`` is set when it was 0."""
        self._server = await asyncio.start_server(
            self._handle, self.host, self.port, limit=self.read_limit
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def _ehlo_reply(self, session: Session) -> str:
        if self.ehlo is not None:
            return self.ehlo
        keywords = list(self.extensions)
        if (self.tls is not None or self.tls_abort) and not session.tls:
            keywords.append("STARTTLS")
        lines = [self.name, *keywords]
        return "\n".join(
            f"250{'-' if i < len(lines) - 1 else ' '}{line}" for i, line in enumerate(lines)
        )

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = Session(peer=writer.get_extra_info("peername"))
        session.beside = sum(not s.closed and "QUIT" not in s.verbs() for s in self.sessions)
        self.sessions.append(session)
        self._writers.append(writer)
        self._notify()
        try:
            await self._converse(session, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the client went away: nothing more to record
        finally:
            self._writers.remove(writer)
            writer.close()
            session.closed = True
            self._notify()

    async def _send(self, writer: asyncio.StreamWriter, reply: str) -> bool:
        if reply == CLOSE:
            writer.transport.abort()
            return False
        if reply == SILENT:
            return True
        octets = b"".join(line.encode() + b"\r\n" for line in reply.split("\n"))
        if self.trickle is None or reply == self.greeting:
            writer.write(octets)
            await writer.drain()
            return True
        for start in range(0, len(octets), self.trickle):
            writer.write(octets[start : start + self.trickle])
            await writer.drain()
            self.pieces += 1
            await asyncio.sleep(0.005)
        return True

    async def _converse(
        self, session: Session, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if not await self._send(writer, self.greeting):
            return
        tx: Transaction | None = None
        while True:
            line = await reader.readuntil(b"\r\n")
            text = line[:-2].decode("utf-8", "surrogateescape")
            session.commands.append(text)
            self._notify()
            if self.hook is not None:
                hooked = self.hook(session, text)
                if hooked is not None:
                    if not await self._send(writer, hooked):
                        return
                    continue
            if not line.isascii() and not self.smtputf8:
                await self._send(writer, "500 5.5.2 syntax error (non-ASCII)")
                continue
            verb, _, arg = text.partition(" ")
            verb = verb.upper()
            if verb == "EHLO":
                tx = None
                reply = self._ehlo_reply(session)
            elif verb == "HELO":
                tx = None
                reply = self.helo
            elif verb == "STARTTLS" and (self.tls is not None or self.tls_abort):
                ready = "220 2.0.0 ready to start TLS"
                if self.tls_inject is not None:
                    ready += "\n" + self.tls_inject
                if not await self._send(writer, ready):
                    return
                if self.tls_abort:
                    await reader.read(1)  # the ClientHello has arrived: reset
                    writer.transport.abort()
                    return
                assert self.tls is not None
                await writer.start_tls(self.tls)
                session.tls = True
                ssl_object = writer.get_extra_info("ssl_object")
                session.tls_version = ssl_object.version() if ssl_object else None
                tx = None
                continue
            elif verb == "MAIL":
                reply = self.mail
                if reply.startswith("2"):
                    path, params = _parse_path(arg, "FROM:")
                    tx = Transaction(mail_from=path, mail_params=params, tls=session.tls)
            elif verb == "RCPT":
                path, params = _parse_path(arg, "TO:")
                reply = self.rcpt_replies.get(path.lower(), self.rcpt)
                if tx is None:
                    reply = "503 5.5.1 need MAIL first"
                elif reply.startswith("2"):
                    tx.rcpt_to.append(path)
                    tx.rcpt_params[path] = params
            elif verb == "DATA":
                if tx is None or not tx.rcpt_to:
                    reply = "503 5.5.1 need RCPT first"
                else:
                    if not await self._send(writer, self.data):
                        return
                    if "DATA" in self.extra_replies:
                        await self._send(writer, self.extra_replies["DATA"])
                    if not self.data.startswith("354"):
                        continue
                    await self._read_data(reader, tx)
                    if self.hold is not None:
                        self.held += 1
                        self._notify()
                        await self.hold.wait()
                    if self.max_line_length is not None and tx.longest_line > self.max_line_length:
                        reply = "550 5.5.2 line too long"
                    elif callable(self.end_of_data):
                        reply = self.end_of_data(tx)
                    else:
                        reply = self.end_of_data
                    tx.reply = reply
                    session.transactions.append(tx)
                    self._notify()
                    tx = None
            elif verb == "RSET":
                tx = None
                reply = self.rset
            elif verb == "NOOP":
                reply = "250 2.0.0 ok"
            elif verb == "QUIT":
                await self._send(writer, self.quit)
                return
            else:
                reply = "502 5.5.2 command not recognized"
            if not await self._send(writer, reply):
                return
            if verb in self.extra_replies and verb != "DATA":
                await self._send(writer, self.extra_replies[verb])

    async def _read_data(self, reader: asyncio.StreamReader, tx: Transaction) -> None:
        raw = bytearray() if self.keep_data else None
        content = bytearray() if self.keep_data else None
        digest = hashlib.sha256()
        while True:
            line = await reader.readuntil(b"\r\n")
            if line == b".\r\n":
                break
            if raw is not None:
                raw += line
            plain = line[1:] if line.startswith(b".") else line
            digest.update(plain)
            tx.size += len(plain)
            tx.longest_line = max(tx.longest_line, len(plain) - 2)
            if content is not None:
                content += plain
        tx.raw = bytes(raw) if raw is not None else None
        tx.content = bytes(content) if content is not None else None
        tx.sha256 = digest.hexdigest()


def _parse_path(arg: str, keyword: str) -> tuple[str, list[str]]:
    """``FROM:<a@b> SIZE=1`` -> ``("a@b", ["SIZE=1"])``."""
    rest = arg[len(keyword) :] if arg.upper().startswith(keyword) else arg
    rest = rest.strip()
    if rest.startswith("<"):
        end = rest.find(">")
        path, params = rest[1:end], rest[end + 1 :]
    else:
        path, _, params = rest.partition(" ")
    return path, params.split()


def trap(host: str, port: int = 0) -> ScriptedMx:
    """A server that must never be contacted: assert ``trap.connections == 0`` afterwards."""
    return ScriptedMx(host, port, name="trap.example.test")


# ------------------------------------------------------------------------------------------
# aiosmtpd-based server


class _RecordingSMTP(AiosmtpdSMTP):
    """aiosmtpd's SMTP protocol, also recording command lines and the raw DATA stream.

    Records which command lines came in which read (``Session.reads``), so a test can
    count the client's round trips; aiosmtpd answers pipelined commands in order.
    """

    def __init__(self, mx: SmtpdMx, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mx = mx
        self.record = Session(peer=None)
        self.in_data = False
        self.data_buffer = bytearray()
        self.line_buffer = bytearray()
        mx.sessions.append(self.record)
        mx._notify()

    def data_received(self, data: bytes) -> None:
        if self.in_data:
            self.data_buffer += data
        else:
            self.line_buffer += data
            lines: list[str] = []
            while (end := self.line_buffer.find(b"\r\n")) >= 0:
                line = bytes(self.line_buffer[:end])
                del self.line_buffer[: end + 2]
                lines.append(line.decode("utf-8", "surrogateescape"))
            self.record.commands.extend(lines)
            if lines:
                self.record.reads.append(lines)
            self.mx._notify()
        super().data_received(data)

    async def smtp_DATA(self, arg: str) -> None:
        self.in_data = True
        self.data_buffer.clear()
        try:
            await super().smtp_DATA(arg)
        finally:
            self.in_data = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.record.peer is None and self.session is not None:
            self.record.peer = self.session.peer

    def connection_lost(self, error: Exception | None) -> None:
        super().connection_lost(error)
        self.record.closed = True
        self.mx._notify()


class SmtpdMx(_MxBase):
    """An aiosmtpd-based fake MX with scripted replies and full recording.

    Args:
        host: loopback address to bind.
        port: TCP port (0 = any; see :func:`shared_port`).
        name: host name in the greeting and EHLO reply.
        size: SIZE limit advertised and enforced; 0 = ``SIZE`` without a number; None =
            no SIZE extension.
        eight_bit: advertise 8BITMIME.
        smtputf8: advertise SMTPUTF8 (else non-ASCII commands get ``500``).
        extra_extensions: more EHLO keywords (e.g. ``["DSN"]``; aiosmtpd itself rejects
            unknown MAIL/RCPT parameters with 555).
        pipelining: advertise PIPELINING (RFC 2920; aiosmtpd handles pipelined commands
            but does not advertise it itself).
        tls: server TLS context: STARTTLS offered.
        users: AUTH PLAIN/LOGIN credentials (user -> password); AUTH only after STARTTLS.
        mail_reply: reply to MAIL instead of accepting.
        rcpt_replies: reply per forward-path (case-insensitive); default ``250 2.1.5 ok``.
        data_reply: reply after the data, or a callable ``(transaction) -> reply``;
            default ``250 2.0.0 ok``.
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        name: str = "mx.example.test",
        size: int | None = 52428800,
        eight_bit: bool = True,
        smtputf8: bool = False,
        extra_extensions: Sequence[str] = (),
        pipelining: bool = False,
        tls: ssl.SSLContext | None = None,
        users: Mapping[str, str] | None = None,
        mail_reply: str | None = None,
        rcpt_replies: Mapping[str, str] | None = None,
        data_reply: str | Callable[[Transaction], str] | None = None,
    ) -> None:
        super().__init__(host, port)
        self.name = name
        self.size = size
        self.eight_bit = eight_bit
        self.smtputf8 = smtputf8
        self.extra_extensions = list(extra_extensions) + (["PIPELINING"] if pipelining else [])
        self.tls = tls
        self.users = dict(users or {})
        self.mail_reply = mail_reply
        self.rcpt_replies = {k.lower(): v for k, v in (rcpt_replies or {}).items()}
        self.data_reply = data_reply

    async def start(self) -> SmtpdMx:
        """Start listening on (host, port); ``port`` is set when it was 0."""
        loop = asyncio.get_running_loop()
        handler = _Handler(self)

        def factory() -> _RecordingSMTP:
            return _RecordingSMTP(
                self,
                handler,
                hostname=self.name,
                ident="ESMTP fake",
                data_size_limit=self.size or None,
                enable_SMTPUTF8=self.smtputf8,
                tls_context=self.tls,
                authenticator=self._authenticate if self.users else None,
                auth_require_tls=True,
                loop=loop,
            )

        self._server = await loop.create_server(factory, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def _authenticate(
        self,
        server: AiosmtpdSMTP,
        session: AiosmtpdSession,
        envelope: Envelope,
        mechanism: str,
        auth_data: Any,
    ) -> AuthResult:
        if isinstance(auth_data, LoginPassword):
            user = auth_data.login.decode()
            ok = self.users.get(user) == auth_data.password.decode()
            return AuthResult(success=ok, handled=False, auth_data=user if ok else None)
        return AuthResult(success=False, handled=False)


class _Handler:
    """aiosmtpd hooks for :class:`SmtpdMx`."""

    def __init__(self, mx: SmtpdMx) -> None:
        self.mx = mx

    async def handle_EHLO(
        self,
        server: _RecordingSMTP,
        session: AiosmtpdSession,
        envelope: Envelope,
        hostname: str,
        responses: list[str],
    ) -> list[str]:
        session.host_name = hostname
        mx = self.mx
        lines = [r[4:] for r in responses]
        if not mx.eight_bit:
            lines = [x for x in lines if x.upper() != "8BITMIME"]
        if mx.size == 0:
            lines.insert(1, "SIZE")
        lines = lines[:-1] + mx.extra_extensions + lines[-1:]
        return [f"250{'-' if i < len(lines) - 1 else ' '}{x}" for i, x in enumerate(lines)]

    def handle_STARTTLS(self, server: _RecordingSMTP, session: Any, envelope: Any) -> bool:
        # aiosmtpd calls this hook synchronously once the handshake is done.
        server.record.tls = True
        ssl_object = server.transport.get_extra_info("ssl_object") if server.transport else None
        server.record.tls_version = ssl_object.version() if ssl_object else None
        return True

    async def handle_MAIL(
        self,
        server: _RecordingSMTP,
        session: AiosmtpdSession,
        envelope: Envelope,
        address: str,
        mail_options: list[str],
    ) -> str:
        reply = self.mx.mail_reply or "250 2.1.0 ok"
        if reply.startswith("2"):
            # aiosmtpd takes an empty mail_from for "no MAIL yet" (503 at RCPT), so the
            # null reverse-path is kept as "<>" here and recorded as "" below.
            envelope.mail_from = address or "<>"
            envelope.mail_options.extend(mail_options)
        return reply

    async def handle_RCPT(
        self,
        server: _RecordingSMTP,
        session: AiosmtpdSession,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> str:
        reply = self.mx.rcpt_replies.get(address.lower(), "250 2.1.5 ok")
        if reply.startswith("2"):
            envelope.rcpt_tos.append(address)
            envelope.rcpt_options.extend(rcpt_options)
        return reply

    async def handle_DATA(
        self, server: _RecordingSMTP, session: AiosmtpdSession, envelope: Envelope
    ) -> str:
        raw = bytes(server.data_buffer)
        if raw.endswith(b"\r\n.\r\n"):
            raw = raw[:-3]
        elif raw == b".\r\n":
            raw = b""
        content = envelope.original_content or b""
        tx = Transaction(
            mail_from="" if envelope.mail_from in ("<>", None) else envelope.mail_from,
            mail_params=list(envelope.mail_options),
            rcpt_to=list(envelope.rcpt_tos),
            raw=raw,
            content=content,
            size=len(content),
            sha256=hashlib.sha256(content).hexdigest(),
            longest_line=max((len(x) for x in content.split(b"\r\n")), default=0),
            tls=session.ssl is not None,
        )
        spec = self.mx.data_reply
        reply = spec(tx) if callable(spec) else (spec or "250 2.0.0 ok")
        tx.reply = reply
        server.record.transactions.append(tx)
        self.mx._notify()
        return reply


# ------------------------------------------------------------------------------------------
# certificates


class Certs:
    """trustme CAs and server certificates for STARTTLS tests.

    ``ca`` is the CA the client may trust (write it with :meth:`ca_file`); ``rogue`` is a CA
    nobody trusts (its certificates stand in for self-signed ones).
    """

    def __init__(self) -> None:
        self.ca = trustme.CA()
        self.rogue = trustme.CA()

    def ca_file(self, directory: Path) -> Path:
        """Write the trusted CA certificate as PEM into ``directory``; returns the path."""
        path = directory / "ca.pem"
        self.ca.cert_pem.write_to_path(str(path))
        return path

    def server_context(
        self,
        *names: str,
        expired: bool = False,
        untrusted: bool = False,
        max_tls12: bool = False,
    ) -> ssl.SSLContext:
        """A server-side context with a certificate for ``names``.

        Args:
            names: DNS names in the certificate's SAN.
            expired: notAfter in 2020 (CASE-20 variant C).
            untrusted: issued by the rogue CA (CASE-20 variant B: self-signed stand-in).
            max_tls12: refuse TLS 1.3 (CASE-20 variant D).
        """
        issuer = self.rogue if untrusted else self.ca
        if expired:
            cert = issuer.issue_cert(
                *names,
                not_before=datetime(2019, 1, 1),
                not_after=datetime(2020, 1, 1),
            )
        else:
            cert = issuer.issue_cert(*names, not_after=datetime.now() + timedelta(days=30))
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(ctx)
        if max_tls12:
            ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        return ctx
