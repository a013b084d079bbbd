"""The SMTP front end: accept mail durably, then answer ``250`` (DESIGN.md §2.1, §4).

An aiosmtpd server (one :class:`aiosmtpd.smtp.SMTP` protocol per connection, run on the
caller's event loop) whose DATA handler:

1. streams the message, with a ``Received:`` trace header prepended (RFC 5321 §4.4), into
   the body store in chunks while it is still arriving (the upload starts once a chunk is
   full, so a small or rejected message never touches the store before the terminator);
   with ``smtp.inline_body_max`` set (0, off, by default), a message of at most that many
   octets never goes to the body store: it is kept inline in its entry
   (:attr:`Entry.inline_body`), which saves the body's two synced writes and a round trip
   before the 250, and its purge after delivery;
2. once the body is stored, creates the queue entry (reverse-path, recipients with
   ORCPT/NOTIFY, HELO name, client address, size, digest, ENVID, RET, SMTPUTF8, 8-bit flag,
   arrival time, inline body) and, at the same time, schedules one work item per distinct
   recipient domain (a worker that gets an item before its entry tries again shortly:
   :data:`jsqueue.state.CREATE_GRACE_S`);
3. only when all of them are stored replies ``250 2.0.0 queued as <id>``.

If any step fails or takes longer than ``smtp.store_timeout_s`` the client gets
``451 4.3.0`` (never 250) and the front end deletes what it stored, best effort. What a
failed delete leaves behind is an orphan the queue must collect, not deliver: a body with no
entry, a work item without entry (dropped once its grace ends), or an entry none of whose
work items was published (the client was told 451 and will send the message again).

**Idempotent ingest.** With :attr:`Stores.ingest` present and ``smtp.dedupe_window_s`` > 0,
the SHA-256 of the envelope and the client's content (:func:`ingest_key`) is claimed in the
ingest log while the body is stored: one write that records the new queue id unless an
earlier one is recorded within the window (:meth:`IngestLog.claim`). A client that lost our
250 and sends the same transaction again within the window gets ``250`` with the first queue
id and no second copy. A remembered id counts only while its entry exists: if storing fails
after the claim, the entry is deleted and the next resend takes the record over (should that
delete fail too, the entry is one the reconciler re-queues, so the remembered id is still
delivered). Two identical transactions *in flight at the same time* can both be queued (the
second finds the first's record before its entry exists): at worst a duplicate, never a
loss.

**Protocol choices** (RFC numbers cite the rule followed):

- Extensions: PIPELINING (RFC 2920), SIZE (RFC 1870), 8BITMIME (RFC 6152), SMTPUTF8 (RFC 6531,
  only ever advertised together with 8BITMIME), ENHANCEDSTATUSCODES (RFC 2034, RFC 3463;
  every 2xx/4xx/5xx reply except the greeting and HELO/EHLO carries one), DSN (RFC 3461),
  STARTTLS (RFC 3207, when ``tls_cert``/``tls_key`` are set), AUTH PLAIN/LOGIN (RFC 4954,
  RFC 4616; only inside TLS and only when ``auth_file`` is set, see
  :mod:`jsqueue.frontend_auth`).
- DATA handling (end of data only at ``<CRLF>.<CRLF>``, bare CR/LF, dot unstuffing, 998-octet
  lines, size): :mod:`jsqueue.frontend_data`. Every rejection comes as exactly one reply
  after the terminator and leaves the session usable.
- Paths and parameters: :mod:`jsqueue.frontend_syntax`. The null reverse-path is accepted.
  A non-ASCII address without ``SMTPUTF8`` on MAIL gets ``553 5.6.7``.
- Relay control (RFC 5321 §3.6.2): RCPT is accepted only from ``relay_networks`` or an
  authenticated session; anyone else gets ``554 5.7.1``. The default networks are loopback.
- Limits: more than ``max_recipients`` RCPTs get ``452 4.5.3`` (RFC 5321 §4.5.3.1.10); a
  repeated recipient is acknowledged but stored once; more than ``max_sessions`` concurrent
  connections get ``421 4.7.0`` at the greeting and are closed; an idle session is closed
  after ``session_timeout_s`` with ``421 4.4.2``.
- STARTTLS (RFC 3207 §4.2, CASE-05): any plaintext the client pipelined behind STARTTLS is
  thrown away when TLS starts (aiosmtpd clears its read buffer; tested), and the session
  starts over: EHLO, AUTH and the transaction are forgotten.
- ``Received:`` (RFC 5321 §4.4, RFC 3848, RFC 6531 §4.3): ``from <helo> ([ip])``, ``by
  <hostname> (jsqueue) with ESMTP|ESMTPS|ESMTPA|ESMTPSA|UTF8SMTP… id <queue id>``, and
  ``for <rcpt>`` only when the message has exactly one recipient (RFC 5321 §7.2).

Logging: aiosmtpd logs every command at INFO on the ``mail.log`` logger (addresses included);
set that logger to WARNING in production.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import ipaddress
import json
import logging
import re
import ssl
from collections import defaultdict
from collections.abc import AsyncIterator, Coroutine
from datetime import datetime
from email.utils import format_datetime
from types import TracebackType
from typing import Any, Literal

from aiosmtpd.smtp import SMTP, Envelope, syntax

from jsqueue.config import SmtpSettings
from jsqueue.envelope import Entry, Recipient, WorkItem, routing_domain, utcnow
from jsqueue.errors import ConfigError, EntryNotFound, InvalidName, JsqueueError, listen_error
from jsqueue.events import NULL_OBSERVER, Observer, received_event
from jsqueue.frontend_auth import UserDB
from jsqueue.frontend_data import DataDecoder
from jsqueue.frontend_syntax import (
    SyntaxProblem,
    parse_envid,
    parse_mail_from,
    parse_notify,
    parse_orcpt,
    parse_rcpt_to,
    parse_ret,
    parse_size,
    require_utf8_allowed,
)
from jsqueue.names import new_queue_id
from jsqueue.replies import (
    R235_AUTH_OK,
    R250_QUEUED,
    R250_RECIPIENT_OK,
    R250_SENDER_OK,
    R421_LOCAL_ERROR,
    R421_SHUTTING_DOWN,
    R421_TIMEOUT,
    R421_TOO_MANY_SESSIONS,
    R451_LOCAL_ERROR,
    R452_TOO_MANY_RECIPIENTS,
    R501_BAD_PARAMETER,
    R502_NOT_IMPLEMENTED,
    R503_ALREADY_AUTHENTICATED,
    R503_BAD_SEQUENCE,
    R503_NEED_MAIL,
    R503_NEED_RCPT,
    R503_NESTED_MAIL,
    R503_TLS_ACTIVE,
    R504_AUTH_MECHANISM,
    R535_AUTH_FAILED,
    R538_ENCRYPTION_REQUIRED,
    R552_TOO_BIG,
    R554_RELAY_DENIED,
    R555_UNKNOWN_PARAMETER,
)
from jsqueue.store.base import BodyInfo, BodyStore, IngestLog, Stores
from jsqueue.store.layout import one_chunk

log = logging.getLogger(__name__)

#: Octets read from the socket per step while receiving DATA.
READ_SIZE = 64 * 1024
#: Octets handed to the body store per chunk (DESIGN.md §7: 256 KiB-1 MiB chunks are fast).
BODY_CHUNK = 256 * 1024
#: Longest MAIL/RCPT/AUTH command line accepted after EHLO (RFC 5321 §4.5.3.1.4 allows
#: extensions to raise the 512 limit: SIZE, SMTPUTF8, RET/ENVID/AUTH, ORCPT/NOTIFY).
EXTENDED_COMMAND_LIMIT = 1000
_GO_AHEAD = "354 End data with <CR><LF>.<CR><LF>"
_HAS_ENHANCED = re.compile(r"^[245]\d\d[ -][245]\.\d{1,3}\.\d{1,3}(?: |$)")
_DEFAULT_ENHANCED = {
    "500": "5.5.2",
    "501": "5.5.4",
    "502": "5.5.1",
    "503": "5.5.1",
    "504": "5.5.4",
    "530": "5.7.0",
    "535": "5.7.8",
    "538": "5.7.11",
    "552": "5.3.4",
    "553": "5.1.3",
    "555": "5.5.4",
}
_PRINTABLE_ONLY = re.compile(r"[^\x20-\x7e]")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HELO_DOMAIN_RE = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")


def with_enhanced_code(status: str) -> str:
    """Give a 2xx/4xx/5xx reply an enhanced status code if it has none (RFC 2034 §4).

    aiosmtpd's own replies (``500 Error: bad syntax``, ``221 Bye`` …) lack them; ours have them.
    """
    code = status[:3]
    if code[:1] not in ("2", "4", "5") or not code.isdigit() or _HAS_ENHANCED.match(status):
        return status
    sep = status[3:4] or " "
    enhanced = _DEFAULT_ENHANCED.get(code, f"{code[0]}.0.0")
    return f"{code}{sep}{enhanced} {status[4:]}".rstrip()


def server_tls_context(settings: SmtpSettings) -> ssl.SSLContext | None:
    """The STARTTLS context from ``tls_cert``/``tls_key`` (TLS 1.2 or later), None when unset.

    Raises:
        ConfigError: only one of the two is set, or they cannot be loaded.
    """
    if settings.tls_cert is None and settings.tls_key is None:
        return None
    if settings.tls_cert is None or settings.tls_key is None:
        raise ConfigError("smtp.tls_cert and smtp.tls_key must be set together")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"smtp.tls_cert/smtp.tls_key: {e}") from None
    return ctx


def ingest_key(
    *,
    reverse_path: str,
    recipients: list[Recipient],
    ret: str | None,
    envid: str | None,
    smtputf8: bool,
    auth_user: str | None,
    content_sha256: bytes,
) -> str:
    """The idempotent-ingest key: SHA-256 hex of the envelope and the client's content.

    ``content_sha256`` is the digest of the message as the client sent it (dots unstuffed),
    without our ``Received:`` header, which differs on every attempt.
    """
    envelope = [
        reverse_path,
        [[r.address, r.orcpt, sorted(r.notify or ())] for r in recipients],
        ret,
        envid,
        smtputf8,
        auth_user,
    ]
    h = hashlib.sha256(json.dumps(envelope, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    h.update(b"\0")
    h.update(content_sha256)
    return h.hexdigest()


def _sanitize_comment(text: str) -> str:
    return "".join(c if " " <= c <= "~" and c not in "()\\" else "?" for c in text[:100])


def _ip_literal(ip: str) -> str:
    return f"[IPv6:{ip}]" if ":" in ip else f"[{ip}]"


def _is_helo_name(helo: str) -> bool:
    if _HELO_DOMAIN_RE.match(helo) and len(helo) <= 253:
        return True
    if helo.startswith("[") and helo.endswith("]"):
        inner = helo[1:-1]
        try:
            if inner[:5].lower() == "ipv6:":
                ipaddress.IPv6Address(inner[5:])
            else:
                ipaddress.IPv4Address(inner)
        except ValueError:
            return False
        return True
    return False


def received_header(
    *,
    helo: str | None,
    client_ip: str,
    hostname: str,
    protocol: str,
    queue_id: str,
    recipient: str | None,
    tls: str | None,
    when: datetime,
) -> bytes:
    """The ``Received:`` trace field the front end prepends (RFC 5321 §4.4, RFC 5322 §3.6.7).

    Args:
        helo: the client's HELO/EHLO argument; used as the From-domain only when it is a
            domain or address literal, else kept in a comment.
        client_ip: the client's IP address (TCP-info, as an address literal).
        hostname: our name (By-domain).
        protocol: the ``with`` keyword (RFC 3848 / RFC 6531 §4.3), e.g. ``ESMTPSA``.
        queue_id: the ``id``.
        recipient: the ``for`` clause, given only when the message has exactly one recipient
            (RFC 5321 §7.2).
        tls: TLS version and cipher, as a comment.
        when: arrival time (aware).

    Returns:
        the folded field with CRLF line ends, UTF-8 encoded (only a UTF-8 local part in the
        ``for`` clause can make it non-ASCII; that recipient needs SMTPUTF8 anyway).
    """
    literal = _ip_literal(client_ip)
    if helo and _is_helo_name(helo):
        lines = [f"Received: from {helo} ({literal})"]
    else:
        lines = [f"Received: from {literal} ({literal})"]
        lines.append(f"\t(helo={_sanitize_comment(helo or '')})")
    if tls:
        lines.append(f"\t({_sanitize_comment(tls)})")
    lines.append(f"\tby {hostname} (jsqueue) with {protocol} id {queue_id}")
    if recipient is not None:
        # The domain as its A-label: an ASCII forward-path at a U-label domain must not make
        # the header section UTF-8 (it would then need SMTPUTF8 downstream, RFC 6531 §3.7.3).
        local, _, domain = recipient.rpartition("@")
        with contextlib.suppress(InvalidName):
            domain = routing_domain(recipient) if not domain.startswith("[") else domain
        lines.append(f"\tfor <{local}@{domain}>")
    lines[-1] += ";"
    lines.append(f"\t{format_datetime(when)}")
    return ("\r\n".join(lines) + "\r\n").encode("utf-8", "surrogateescape")


async def _stopped(fut: asyncio.Future[Any] | None) -> None:
    """Cancel ``fut`` unless done and wait until it has stopped; its outcome is not needed
    (a failure is reported by whoever noticed first)."""
    if fut is None:
        return
    fut.cancel()
    await asyncio.wait((fut,))
    if not fut.cancelled():
        fut.exception()  # retrieved, so asyncio does not report it as lost


class _BodyUpload:
    """Streams one message into :meth:`BodyStore.put` in :data:`BODY_CHUNK` chunks.

    The put starts when the first chunk is full (or at :meth:`finish`). Every hand-over waits
    at most ``timeout_s`` for the store; after a failure further writes are dropped and
    :attr:`error` says why. A message of at most ``inline_max`` octets (never more than
    :data:`BODY_CHUNK`) is not stored: :meth:`finish` leaves it in :attr:`inline`.
    """

    def __init__(
        self, bodies: BodyStore, queue_id: str, timeout_s: float, inline_max: int = 0
    ) -> None:
        self._bodies = bodies
        self._id = queue_id
        self._timeout_s = timeout_s
        self._inline_max = min(inline_max, BODY_CHUNK)
        self._buf = bytearray()
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=1)
        self._task: asyncio.Task[BodyInfo] | None = None
        self._touched = False
        self.error: BaseException | None = None
        self.inline: bytes | None = None

    async def write(self, data: bytes) -> None:
        if self.error is not None:
            return
        self._buf += data
        while len(self._buf) >= BODY_CHUNK and self.error is None:
            chunk = bytes(self._buf[:BODY_CHUNK])
            del self._buf[:BODY_CHUNK]
            await self._hand(chunk)
        if self.error is not None:
            self._buf.clear()

    async def _chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self._queue.get()) is not None:
            yield chunk

    async def _hand(self, item: bytes | None) -> None:
        if self._task is None:
            self._touched = True
            self._task = asyncio.create_task(self._bodies.put(self._id, self._chunks(), fresh=True))
        put = asyncio.ensure_future(self._queue.put(item))
        done, _ = await asyncio.wait(
            (put, self._task), timeout=self._timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if put in done:
            return
        put.cancel()
        if self._task.done() and not self._task.cancelled():
            self.error = self._task.exception() or RuntimeError("body store stopped reading")
        else:
            self.error = TimeoutError(f"body store took no chunk within {self._timeout_s} s")

    async def finish(self) -> BodyInfo:
        """Hand over the rest and wait for the store's answer; a message small enough to be
        kept inline is not stored but left in :attr:`inline` (size and digest computed here).

        Raises:
            StoreError, TimeoutError: whatever stopped the upload.
        """
        if self.error is not None:
            raise self.error
        if self._task is None:
            data = bytes(self._buf)
            self._buf.clear()
            if len(data) <= self._inline_max:
                self.inline = data
                return BodyInfo(size=len(data), digest=hashlib.sha256(data).hexdigest())
            self._touched = True
            return await self._bodies.put(self._id, one_chunk(data), fresh=True)
        for item in (bytes(self._buf), None):
            if item != b"":
                await self._hand(item)
            if self.error is not None:
                raise self.error
        self._buf.clear()
        return await self._task

    async def store_inline(self) -> BodyInfo:
        """Store the body :meth:`finish` left inline after all (the entry would be too large
        with it); :attr:`inline` is None afterwards.

        Raises:
            StoreError: the body store failed.
        """
        assert self.inline is not None
        data, self.inline = self.inline, None
        self._touched = True
        return await self._bodies.put(self._id, one_chunk(data), fresh=True)

    async def abort(self) -> None:
        """Stop the upload and delete whatever reached the store (best effort, logged)."""
        self._buf.clear()
        self.inline = None
        if self._task is not None:
            if not self._task.done():
                self._task.cancel()
            await asyncio.wait((self._task,))
            if not self._task.cancelled():
                self._task.exception()  # retrieved: the failure is reported by the caller
        if not self._touched:
            return
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._bodies.delete(self._id)
        except (JsqueueError, TimeoutError, OSError) as e:
            log.warning(
                "body %s: delete after a failed ingest failed (%s); left for the "
                "queue's orphan sweep",
                self._id,
                e,
            )


class _Transaction(Envelope):
    """One mail transaction (RFC 5321 §3.3): aiosmtpd resets it on RSET/EHLO/STARTTLS."""

    def __init__(self) -> None:
        super().__init__()
        self.reverse_path: str | None = None
        self.recipients: list[Recipient] = []
        self.seen: set[tuple[str, str]] = set()
        self.smtputf8 = False
        self.ret: Literal["FULL", "HDRS"] | None = None
        self.envid: str | None = None


class _ExceptionHook:
    """aiosmtpd handler: turns an unexpected error in a command into a 451 (logged)."""

    async def handle_exception(self, error: Exception) -> str:
        log.error("SMTP command failed unexpectedly", exc_info=error)
        return str(R451_LOCAL_ERROR)


def _client_ip(peer: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except (TypeError, IndexError, ValueError):
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class _Session(SMTP):
    """One SMTP connection. Overrides aiosmtpd's EHLO/HELO/MAIL/RCPT/DATA/AUTH/STARTTLS."""

    def __init__(self, server: SmtpServer) -> None:
        s = server.settings
        super().__init__(
            _ExceptionHook(),
            data_size_limit=s.max_message_size,
            enable_SMTPUTF8=True,
            hostname=s.hostname,
            ident="ESMTP jsqueue",
            tls_context=server.tls_context,
            require_starttls=s.require_tls,
            timeout=s.session_timeout_s,
            auth_require_tls=True,
            auth_exclude_mechanism=("PLAIN", "LOGIN"),  # smtp_AUTH below has its own
            loop=asyncio.get_running_loop(),
        )
        self._server = server
        self._settings = s
        # aiosmtpd keeps these limits in a class attribute that every EHLO raises further;
        # an instance dict with fixed values instead.
        self.command_size_limits = defaultdict(
            lambda: SMTP.command_size_limit,
            {c: EXTENDED_COMMAND_LIMIT for c in ("MAIL", "RCPT", "AUTH")},
        )
        self._refused = False
        self._released = False
        self._busy = False
        self._ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None

    # -- connection bookkeeping ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        first = self.transport is None and self._original_transport is None
        super().connection_made(transport)
        if first:
            self._ip = _client_ip(transport.get_extra_info("peername"))
            self._refused = not self._server._admit(self)

    def connection_lost(self, error: Exception | None) -> None:
        if not self._released:
            self._released = True
            self._server._release(self)
        super().connection_lost(error)

    async def _handle_client(self) -> None:
        if self._refused:
            await self.push(str(R421_TOO_MANY_SESSIONS))
            self._close()
            return
        await super()._handle_client()

    def _timeout_cb(self) -> None:
        log.info("%r idle timeout", self.session.peer if self.session else None)
        if self.transport is not None and not self.transport.is_closing():
            self._writer.write(f"{R421_TIMEOUT}\r\n".encode())
            self._close()

    def _create_envelope(self) -> _Transaction:
        return _Transaction()

    def _set_post_data_state(self) -> None:
        self.envelope = self._create_envelope()

    def _set_rset_state(self) -> None:
        self.envelope = self._create_envelope()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _transaction(self) -> _Transaction:
        # A method, not a property: aiosmtpd's __init__ evaluates every attribute
        # (inspect.getmembers) before the first envelope exists.
        assert isinstance(self.envelope, _Transaction)
        return self.envelope

    def begin_shutdown(self) -> None:
        """Close with ``421`` now if idle, else right after the current transaction's reply."""
        if not self._busy and self.transport is not None and not self.transport.is_closing():
            self._writer.write(f"{R421_SHUTTING_DOWN}\r\n".encode())
            self._close()

    def abort(self) -> None:
        """Drop the connection without another word (shutdown bound exceeded)."""
        if isinstance(self.transport, asyncio.WriteTransport):
            self.transport.abort()

    async def push(self, status: str | bytes) -> None:
        """Send one reply; str replies get an enhanced status code (RFC 2034 §4)."""
        if isinstance(status, bytes):
            await super().push(status)
            return
        # RFC 2034 §4: the greeting (and the STARTTLS 220) carry no enhanced code.
        if not status.startswith("220"):
            status = with_enhanced_code(status)
        # RFC 5321 §4.2, §4.5.3.1.5: one line of printable US-ASCII, at most 512 octets with
        # CRLF; some replies (ours and aiosmtpd's) quote client input.
        await super().push(_PRINTABLE_ONLY.sub("?", status)[:510])

    async def _reply(self, reply: object) -> None:
        await self.push(str(reply))

    # -- state helpers ------------------------------------------------------------------

    @property
    def _tls_active(self) -> bool:
        return self._tls_protocol is not None

    @property
    def _auth_user(self) -> str | None:
        if self.session is None or not self.session.authenticated:
            return None
        return str(self.session.auth_data)

    def _may_relay(self) -> bool:
        if self._auth_user is not None:
            return True
        ip = self._ip
        return ip is not None and any(ip in net for net in self._settings.relay_networks)

    def _protocol_name(self) -> str:
        """The ``with`` keyword of our Received: field (RFC 3848 §2, RFC 6531 §4.3)."""
        assert self.session is not None
        if not self.session.extended_smtp:
            return "SMTP"
        base = "UTF8SMTP" if self._transaction().smtputf8 else "ESMTP"
        return base + ("S" if self._tls_active else "") + ("A" if self._auth_user else "")

    def _tls_description(self) -> str | None:
        if self._tls_protocol is None:
            return None
        cipher = self._tls_protocol._extra.get("cipher")
        if not cipher:
            return None
        return f"{cipher[1]} {cipher[0]}"

    # -- commands -----------------------------------------------------------------------

    @syntax("EHLO hostname")
    async def smtp_EHLO(self, hostname: str | None) -> None:
        """RFC 5321 §4.1.1.1; capabilities per the module docstring."""
        if not hostname:
            await self.push("501 5.5.4 Syntax: EHLO hostname")
            return
        assert self.session is not None
        self._set_rset_state()
        self.session.extended_smtp = True
        self.session.host_name = hostname
        caps = [
            self.hostname,
            "PIPELINING",
            f"SIZE {self._settings.max_message_size}",
            "8BITMIME",
            "SMTPUTF8",
            "ENHANCEDSTATUSCODES",
            "DSN",
        ]
        if self.tls_context is not None and not self._tls_active:
            caps.append("STARTTLS")
        if self._server.users is not None and self._tls_active:
            caps.append("AUTH PLAIN LOGIN")
        lines = [f"250-{c}" for c in caps[:-1]] + [f"250 {caps[-1]}"]
        await SMTP.push(self, "\r\n".join(lines))  # no enhanced codes in EHLO (RFC 2034 §4)

    @syntax("HELO hostname")
    async def smtp_HELO(self, hostname: str | None) -> None:
        """RFC 5321 §4.1.1.1: plain SMTP, no extensions."""
        if not hostname:
            await self.push("501 5.5.4 Syntax: HELO hostname")
            return
        assert self.session is not None
        self._set_rset_state()
        self.session.extended_smtp = False
        self.session.host_name = hostname
        await SMTP.push(self, f"250 {self.hostname}")

    @syntax("STARTTLS", when="tls_context")
    async def smtp_STARTTLS(self, arg: str | None) -> None:
        """RFC 3207; without TLS settings 502, and a second STARTTLS inside TLS is refused."""
        if self.tls_context is None:
            await self._reply(R502_NOT_IMPLEMENTED)
            return
        if self._tls_active:
            await self._reply(R503_TLS_ACTIVE)
            return
        await super().smtp_STARTTLS(arg)

    @syntax("AUTH <mechanism> [initial-response]")
    async def smtp_AUTH(self, arg: str | None) -> None:
        """RFC 4954 with PLAIN (RFC 4616) and LOGIN, only inside TLS."""
        users = self._server.users
        assert self.session is not None
        if users is None:
            await self._reply(R502_NOT_IMPLEMENTED)
            return
        if await self.check_helo_needed("EHLO"):
            return
        if not self.session.extended_smtp or self._transaction().reverse_path is not None:
            await self._reply(R503_BAD_SEQUENCE)
            return
        if not self._tls_active:
            await self._reply(R538_ENCRYPTION_REQUIRED)
            return
        if self.session.authenticated:
            await self._reply(R503_ALREADY_AUTHENTICATED)
            return
        words = (arg or "").split()
        if not 1 <= len(words) <= 2:
            await self._reply(R501_BAD_PARAMETER)
            return
        mechanism, initial = words[0].upper(), (words[1] if len(words) == 2 else None)
        if mechanism == "PLAIN":
            creds = await self._auth_plain(initial)
        elif mechanism == "LOGIN":
            creds = await self._auth_login(initial)
        else:
            await self._reply(R504_AUTH_MECHANISM)
            return
        if creds is None:
            return
        user, password = creds
        if await users.verify(user, password):
            self.session.authenticated = True
            # aiosmtpd annotates auth_data as None; it is free-form per-session data.
            self.session.auth_data = user  # type: ignore[assignment]
            await self._reply(R235_AUTH_OK)
        else:
            log.info("%r AUTH %s failed for %r", self.session.peer, mechanism, user)
            await self._reply(R535_AUTH_FAILED)

    async def _response(self, initial: str | None, challenge: str) -> bytes | None:
        """An initial response (``=`` is empty) or the answer to a 334 challenge.

        Returns None after a reply was sent (cancelled or bad base64).
        """
        if initial is None:
            got = await self.challenge_auth(challenge)
            return got if isinstance(got, bytes) else None
        if initial == "=":
            return b""
        try:
            return base64.b64decode(initial, validate=True)
        except ValueError:
            await self.push("501 5.5.2 Cannot decode base64")
            return None

    async def _auth_plain(self, initial: str | None) -> tuple[str, bytes] | None:
        blob = await self._response(initial, "")
        if blob is None:
            return None
        parts = blob.split(b"\0")
        if len(parts) != 3:
            await self.push("501 5.5.2 Cannot split PLAIN credentials")
            return None
        authz, authc, password = parts
        try:
            user = authc.decode("utf-8")
        except UnicodeDecodeError:
            await self._reply(R535_AUTH_FAILED)
            return None
        if authz and authz != authc:  # acting as another user is not supported
            await self._reply(R535_AUTH_FAILED)
            return None
        return user, password

    async def _auth_login(self, initial: str | None) -> tuple[str, bytes] | None:
        raw_user = await self._response(initial, "Username:")
        if raw_user is None:
            return None
        password = await self._response(None, "Password:")
        if password is None:
            return None
        try:
            return raw_user.decode("utf-8"), password
        except UnicodeDecodeError:
            await self._reply(R535_AUTH_FAILED)
            return None

    @syntax("MAIL FROM: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_MAIL(self, arg: str | None) -> None:
        """RFC 5321 §4.1.1.2 with SIZE, BODY, SMTPUTF8, RET, ENVID and AUTH parameters."""
        if await self.check_helo_needed():
            return
        assert self.session is not None
        txn = self._transaction()
        if txn.reverse_path is not None:
            await self._reply(R503_NESTED_MAIL)
            return
        try:
            cmd = parse_mail_from(arg)
            if cmd.params and not self.session.extended_smtp:
                raise SyntaxProblem(R555_UNKNOWN_PARAMETER, "Parameters need EHLO")
            params = dict(cmd.params)
            smtputf8 = "SMTPUTF8" in params
            if params.pop("SMTPUTF8", None) is not None:
                raise SyntaxProblem(R501_BAD_PARAMETER, "SMTPUTF8 takes no value")
            if "SIZE" in params and parse_size(params.pop("SIZE")) > (
                self._settings.max_message_size
            ):
                raise SyntaxProblem(R552_TOO_BIG)
            if "BODY" in params and (params.pop("BODY") or "").upper() not in (
                "7BIT",
                "8BITMIME",
            ):
                raise SyntaxProblem(R501_BAD_PARAMETER, "BODY must be 7BIT or 8BITMIME")
            ret = parse_ret(params.pop("RET")) if "RET" in params else None
            envid = parse_envid(params.pop("ENVID")) if "ENVID" in params else None
            params.pop("AUTH", None)  # RFC 4954 §5: accepted, not relayed further
            if params:
                raise SyntaxProblem(
                    R555_UNKNOWN_PARAMETER, f"Parameter {next(iter(params))} not supported"
                )
            require_utf8_allowed(cmd.path, smtputf8)
        except SyntaxProblem as e:
            await self._reply(e.reply)
            return
        txn.reverse_path = cmd.path.address
        txn.mail_from = cmd.path.address or "<>"
        txn.smtputf8 = smtputf8
        txn.ret = "FULL" if ret == "FULL" else "HDRS" if ret == "HDRS" else None
        txn.envid = envid
        await self._reply(R250_SENDER_OK)

    @syntax("RCPT TO: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_RCPT(self, arg: str | None) -> None:
        """RFC 5321 §4.1.1.3 with NOTIFY and ORCPT (RFC 3461 §4.1, §4.2); relay control."""
        if await self.check_helo_needed():
            return
        assert self.session is not None
        txn = self._transaction()
        if txn.reverse_path is None:
            await self._reply(R503_NEED_MAIL)
            return
        try:
            cmd = parse_rcpt_to(arg)
            if cmd.params and not self.session.extended_smtp:
                raise SyntaxProblem(R555_UNKNOWN_PARAMETER, "Parameters need EHLO")
            require_utf8_allowed(cmd.path, txn.smtputf8)
            if not self._may_relay():
                raise SyntaxProblem(R554_RELAY_DENIED)
            params = dict(cmd.params)
            notify = parse_notify(params.pop("NOTIFY")) if "NOTIFY" in params else None
            orcpt = (
                parse_orcpt(params.pop("ORCPT"), smtputf8=txn.smtputf8)
                if "ORCPT" in params
                else None
            )
            if params:
                raise SyntaxProblem(
                    R555_UNKNOWN_PARAMETER, f"Parameter {next(iter(params))} not supported"
                )
        except SyntaxProblem as e:
            await self._reply(e.reply)
            return
        local = cmd.path.address.rpartition("@")[0]
        seen_key = (local, cmd.path.domain)
        if seen_key not in txn.seen:
            if len(txn.recipients) >= self._settings.max_recipients:
                await self._reply(R452_TOO_MANY_RECIPIENTS)
                return
            txn.seen.add(seen_key)
            txn.recipients.append(
                Recipient(
                    address=cmd.path.address, domain=cmd.path.domain, orcpt=orcpt, notify=notify
                )
            )
            txn.rcpt_tos.append(cmd.path.address)
        await self._reply(R250_RECIPIENT_OK)

    @syntax("DATA")
    async def smtp_DATA(self, arg: str | None) -> None:
        """RFC 5321 §4.1.1.4: receive, store, then exactly one reply (module docstring)."""
        if await self.check_helo_needed():
            return
        txn = self._transaction()
        if txn.reverse_path is None:
            await self._reply(R503_NEED_MAIL)
            return
        if not txn.recipients:
            await self._reply(R503_NEED_RCPT)
            return
        if arg:
            await self.push("501 5.5.4 Syntax: DATA")
            return
        self._busy = True
        try:
            reply = await self._receive(txn)
        finally:
            self._busy = False
            self._set_post_data_state()
        if reply is None:
            return
        await self.push(reply)
        if self._server.draining:
            await self._reply(R421_SHUTTING_DOWN)
            self._close()

    async def _receive(self, txn: _Transaction) -> str | None:
        """Read the message after 354 and store it; the reply, or None if already closed."""
        await self.push(_GO_AHEAD)
        queue_id = new_queue_id()
        settings = self._settings
        upload = _BodyUpload(
            self._server.stores.bodies,
            queue_id,
            settings.store_timeout_s,
            inline_max=settings.inline_body_max,
        )
        decoder = DataDecoder(
            max_size=settings.max_message_size, bare_line_endings=settings.bare_line_endings
        )
        content = hashlib.sha256()
        received = received_header(
            helo=self.session.host_name if self.session else None,
            client_ip=str(self._ip or "0.0.0.0"),
            hostname=self.hostname,
            protocol=self._protocol_name(),
            queue_id=queue_id,
            recipient=txn.recipients[0].address if len(txn.recipients) == 1 else None,
            tls=self._tls_description(),
            when=utcnow(),
        )
        try:
            await upload.write(received)
            while not decoder.done:
                data = await self._reader.read(READ_SIZE)
                if not data:
                    raise ConnectionResetError("client closed the connection during DATA")
                self._reset_timeout()
                out, rest = decoder.feed(data)
                if out:
                    content.update(out)
                    await upload.write(out)
                if rest:
                    # Pipelined commands after the terminator go back to the command loop.
                    self._reader._buffer[0:0] = rest  # type: ignore[attr-defined]  # no unread API
        except (asyncio.CancelledError, ConnectionError):
            self._server.spawn(upload.abort())
            raise
        except Exception:
            # The rest of the message may still be unread: answering and going on would
            # execute message text as commands. Close instead.
            log.exception("%s: receiving DATA failed", queue_id)
            self._server.spawn(upload.abort())
            await self._reply(R421_LOCAL_ERROR)
            self._close()
            return None
        if decoder.error is not None:
            await upload.abort()
            log.info("%s: rejected: %s", queue_id, decoder.error)
            return str(decoder.error)
        eight_bit = decoder.eight_bit or not received.isascii()
        # Storing is bounded by store_timeout_s; the idle timer must not cut it short.
        if self._timeout_handle is not None:
            self._timeout_handle.cancel()
        try:
            return await self._server.ingest.commit(
                queue_id,
                txn,
                upload,
                helo=self.session.host_name if self.session else None,
                client_address=str(self._ip) if self._ip else None,
                auth_user=self._auth_user,
                eight_bit=eight_bit,
                content_sha256=content.digest(),
            )
        finally:
            self._reset_timeout()


class _Ingest:
    """Commits a received message to the stores (module docstring, steps 1-4)."""

    def __init__(
        self, settings: SmtpSettings, stores: Stores, observer: Observer = NULL_OBSERVER
    ) -> None:
        self._settings = settings
        self._stores = stores
        self._observer = observer
        self._log: IngestLog | None = stores.ingest if settings.dedupe_window_s > 0 else None

    async def _earlier_copy(self, key: str, queue_id: str) -> str | None:
        """The queue id of an identical message queued within the window, if any; else
        ``queue_id`` is recorded under ``key`` (one write: :meth:`IngestLog.claim`).

        Best effort: a failing lookup counts as "none" (the message is then queued anew).
        A record whose entry does not exist (delivered and removed, or its ingest failed
        after the claim) is replaced by ours.
        """
        assert self._log is not None
        try:
            found = await self._log.claim(key, queue_id, self._settings.dedupe_window_s)
            if found is None:
                return None
            await self._stores.entries.get(found)
        except EntryNotFound:
            await self._record(key, queue_id)
            return None
        except (JsqueueError, OSError) as e:
            log.warning("ingest log lookup failed (%s); queueing as new", e)
            return None
        return found

    async def commit(
        self,
        queue_id: str,
        txn: _Transaction,
        upload: _BodyUpload,
        *,
        helo: str | None,
        client_address: str | None,
        auth_user: str | None,
        eight_bit: bool,
        content_sha256: bytes,
    ) -> str:
        """Store body, entry and work items; the reply to send (250 or 451)."""
        assert txn.reverse_path is not None
        key = None
        if self._log is not None:
            key = ingest_key(
                reverse_path=txn.reverse_path,
                recipients=txn.recipients,
                ret=txn.ret,
                envid=txn.envid,
                smtputf8=txn.smtputf8,
                auth_user=auth_user,
                content_sha256=content_sha256,
            )
        stage = "body"
        body: asyncio.Future[BodyInfo] | None = None
        try:
            async with asyncio.timeout(self._settings.store_timeout_s):
                # Body and ingest-log claim at the same time; the entry and the work items
                # once the body is stored (an entry never names a body that failed).
                body = asyncio.ensure_future(upload.finish())
                earlier = await self._earlier_copy(key, queue_id) if key is not None else None
                if earlier is not None:
                    await _stopped(body)
                    await upload.abort()
                    log.info("%s: resend of %s within the dedupe window", queue_id, earlier)
                    return f"{R250_QUEUED} {earlier}"
                info = await body
                entry = Entry(
                    id=queue_id,
                    reverse_path=txn.reverse_path,
                    recipients=txn.recipients,
                    created_at=utcnow(),
                    size=info.size,
                    digest=info.digest,
                    helo=helo,
                    client_address=client_address,
                    envid=txn.envid,
                    ret=txn.ret,
                    smtputf8=txn.smtputf8,
                    body_8bit=eight_bit,
                    inline_body=upload.inline,
                )
                if upload.inline is not None and not self._fits(entry):
                    entry.inline_body = None
                    info = await upload.store_inline()
                stage = "entry and work items"
                # Both at once: two round trips before the 250, not three. A worker that
                # gets an item before the entry is stored tries it again shortly
                # (jsqueue.state.CREATE_GRACE_S). Should either fail, the entry and items
                # are removed; a resend then finds the ingest record of this id without its
                # entry and takes its place.
                stored = await asyncio.gather(
                    self._stores.entries.create(entry),
                    *(
                        self._stores.scheduler.schedule(WorkItem(queue_id, d))
                        for d in entry.domains
                    ),
                    return_exceptions=True,
                )
                for result in stored:
                    if isinstance(result, BaseException):
                        raise result
        except (JsqueueError, TimeoutError, OSError) as e:
            log.warning("%s: not queued (%s failed: %r); answering 451", queue_id, stage, e)
            await _stopped(body)
            await self._cleanup(queue_id, upload, stage)
            return str(R451_LOCAL_ERROR)
        except Exception:  # a bug: still never 250 for what is not stored, and say so loudly
            log.exception("%s: not queued (%s failed unexpectedly); answering 451", queue_id, stage)
            await _stopped(body)
            await self._cleanup(queue_id, upload, stage)
            return str(R451_LOCAL_ERROR)
        log.info(
            "%s: queued from=<%s> nrcpt=%d size=%d",
            queue_id,
            txn.reverse_path,
            len(txn.recipients),
            info.size,
        )
        self._observer.emit(received_event(entry))
        return f"{R250_QUEUED} {queue_id}"

    def _fits(self, entry: Entry) -> bool:
        """Whether ``entry`` with its inline body stays within half the entry store's
        largest value (room for the replies and leases it gathers as it is delivered)."""
        return len(entry.to_json()) <= self._stores.entries.max_value_size // 2

    async def _record(self, key: str, queue_id: str) -> None:
        assert self._log is not None
        try:
            async with asyncio.timeout(self._settings.store_timeout_s):
                await self._log.record(key, queue_id)
        except (JsqueueError, TimeoutError, OSError) as e:
            # The message is queued; only the resend protection is missing.
            log.warning("%s: queued, but the ingest record failed (%s)", queue_id, e)

    async def _cleanup(self, queue_id: str, upload: _BodyUpload, stage: str) -> None:
        """Remove what a failed ingest stored: entry and work items first (so no worker
        starts on them), then the body. Best effort: a work item left behind is dropped
        once its grace ends, an entry left behind is the orphan sweep's."""
        if stage != "body":
            try:
                async with asyncio.timeout(self._settings.store_timeout_s):
                    await asyncio.gather(
                        self._stores.entries.delete(queue_id),
                        self._stores.scheduler.cancel(queue_id),
                    )
            except (JsqueueError, TimeoutError, OSError) as e:
                log.warning(
                    "%s: removing the entry after a failed ingest failed (%s); left for "
                    "the queue's orphan sweep",
                    queue_id,
                    e,
                )
        await upload.abort()


class SmtpServer:
    """The listening front end: one :class:`_Session` per connection on this event loop.

    Use :func:`serve_smtp`, or ``async with SmtpServer(settings, stores):``.
    """

    def __init__(
        self, settings: SmtpSettings, stores: Stores, observer: Observer = NULL_OBSERVER
    ) -> None:
        """Args:
        settings: the ``smtp`` settings section.
        stores: where messages go (JetStream or memory).
        observer: receives a ``received`` event per message queued (jsqueue.events).

        Raises:
            ConfigError: unusable TLS files, ``require_tls`` without them, or a bad auth file.
        """
        self.settings = settings
        self.stores = stores
        self.tls_context = server_tls_context(settings)
        if settings.require_tls and self.tls_context is None:
            raise ConfigError("smtp.require_tls needs smtp.tls_cert and smtp.tls_key")
        self.users = UserDB.load(settings.auth_file) if settings.auth_file else None
        self.ingest = _Ingest(settings, stores, observer)
        self.draining = False
        self._server: asyncio.Server | None = None
        self._sessions: set[_Session] = set()
        self._all_closed = asyncio.Event()
        self._all_closed.set()
        self._tasks: set[asyncio.Task[None]] = set()
        if stores.ingest is None and settings.dedupe_window_s > 0:
            log.warning("the store has no ingest log: resent messages are queued again")

    @property
    def active_sessions(self) -> int:
        """Connections currently admitted (refused ones are not counted)."""
        return len(self._sessions)

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) of the first listening socket; the real port when configured as 0.

        Raises:
            RuntimeError: not started.
        """
        if self._server is None or not self._server.sockets:
            raise RuntimeError("SMTP server not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    @property
    def port(self) -> int:
        """The listening port (see :attr:`address`)."""
        return self.address[1]

    def _admit(self, session: _Session) -> bool:
        if self.draining or len(self._sessions) >= self.settings.max_sessions:
            return False
        self._sessions.add(session)
        self._all_closed.clear()
        return True

    def _release(self, session: _Session) -> None:
        self._sessions.discard(session)
        if not self._sessions:
            self._all_closed.set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a cleanup in the background; :meth:`stop` waits for it."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        """Listen on ``settings.host:settings.port``.

        Raises:
            ListenError: the address cannot be bound (names ``smtp.host``/``smtp.port``).
        """
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: _Session(self),
                host=self.settings.host,
                port=self.settings.port,
                reuse_address=True,
            )
        except OSError as e:
            raise listen_error("smtp", self.settings.host, self.settings.port, e) from e
        log.info("SMTP front end listening on %s:%d", *self.address)

    def close(self) -> None:
        """Begin shutting down: stop listening, refuse new sessions, close idle sessions with
        ``421 4.3.2``; a session in DATA gets its reply first, then 421. Idempotent."""
        if self._server is None or self.draining:
            return
        self.draining = True
        self._server.close()
        for session in list(self._sessions):
            session.begin_shutdown()

    async def wait_closed(self, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s`` seconds) for every session to end, then drop the rest
        and wait for background cleanups. Call :meth:`close` first."""
        if self._server is None:
            return
        with contextlib.suppress(TimeoutError):  # the bound is reached: abort the rest below
            async with asyncio.timeout(timeout_s):
                await self._all_closed.wait()
        for session in list(self._sessions):
            session.abort()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
        await self._server.wait_closed()
        self._server = None

    async def stop(self, timeout_s: float = 10.0) -> None:
        """:meth:`close`, then :meth:`wait_closed` (graceful drain bounded by ``timeout_s``)."""
        self.close()
        await self.wait_closed(timeout_s)

    async def __aenter__(self) -> SmtpServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def serve_smtp(
    settings: SmtpSettings, stores: Stores, observer: Observer = NULL_OBSERVER
) -> SmtpServer:
    """Start the SMTP front end on the running event loop.

    Args:
        settings: the ``smtp`` settings section (listen address, limits, TLS, AUTH, relay
            networks, dedupe window, store timeout).
        stores: body store, entry store, scheduler and (optionally) ingest log.
        observer: receives a ``received`` event per message queued.

    Returns:
        the started server; ``await server.stop()`` to shut it down.

    Raises:
        ConfigError: bad TLS or auth file settings.
        OSError: the listen address cannot be bound.
    """
    server = SmtpServer(settings, stores, observer)
    await server.start()
    return server
