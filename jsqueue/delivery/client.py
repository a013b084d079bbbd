"""One outbound SMTP delivery attempt for one destination domain, with aiosmtplib.

:func:`deliver` takes the MX targets (from a :class:`~jsqueue.delivery.resolver.Resolver`),
the envelope of the recipients at one domain, a re-openable body source and the worker
settings, and returns one :class:`~jsqueue.envelope.Reply` per recipient. It never raises
library errors: aiosmtplib, ``ssl`` and ``OSError`` failures become synthesised replies
(``remote_host`` None, the host named in the text) at this boundary.

Session, per target in order (RFC 5321 §3, §5.1):

1. TCP connect (``connect_timeout_s``) and greeting (``greeting_timeout_s``). EHLO with
   ``ehlo_name``; HELO when EHLO gets a 5xx.
2. STARTTLS per the domain's policy (``tls_policies[domain]`` else ``tls``; in smarthost mode
   keyed by the relay host): ``never``; ``opportunistic`` (no certificate checks; when the
   handshake fails the same address is retried in plaintext within the attempt and the
   downgrade is logged, RFC 7435); ``required`` (no plaintext; ``451 4.7.5`` and next MX when
   TLS cannot be had); ``required-with-verification`` (also checks the chain against
   ``tls_ca_file`` or the system store and the MX host name).
3. Capability checks before MAIL: a recipient whose local part is UTF-8 fails with
   ``554 5.6.7`` when the server lacks SMTPUTF8 (RFC 6531 §3.5); an ASCII local part at a
   U-label domain is sent as the A-label without SMTPUTF8. **Raw UTF-8 in the header section
   to a server without SMTPUTF8 fails every recipient with 554 5.6.7: jsqueue does not
   downgrade headers (RFC 6857 downgrading is lossy and breaks address fields).** An 8-bit
   body to a server without 8BITMIME is converted to 7-bit MIME
   (:func:`~jsqueue.delivery.transform.to_7bit`, which invalidates DKIM body signatures); if
   that is impossible, or the body is larger than :data:`MAX_CONVERT_OCTETS`, every recipient
   fails with ``554 5.6.3``. A SIZE limit smaller than the message fails every recipient
   with ``554 5.3.4`` without sending MAIL (RFC 1870 §6).
4. One transaction for all recipients: MAIL FROM (``SIZE=``, ``BODY=8BITMIME``, ``SMTPUTF8``,
   ``RET``/``ENVID`` when the server has DSN, RFC 3461), RCPT per recipient (``NOTIFY``,
   ``ORCPT``), DATA only when at least one RCPT was accepted; the final reply applies to
   every accepted recipient, refused ones keep their RCPT reply. The null reverse-path is
   sent as exactly ``MAIL FROM:<>``.
   ``ENVID`` and the address part of ``ORCPT`` are taken as stored in decoded form and
   xtext-encoded on the wire (RFC 3461 §4; non-ASCII as RFC 6533 ``\\x{HEX}`` with the
   ``utf-8`` address type).
5. The body is streamed from the source in chunks with our own dot-stuffing (RFC 5321
   §4.5.2) and flow control (at most one chunk plus the socket buffer in memory); bare CR
   and bare LF are sent as CRLF (§2.3.8), so no ``<LF>.<LF>`` can reach the next hop. The
   ``.`` terminator is sent only after the source finished without error; a failing source
   aborts the connection (nothing is delivered) and the accepted recipients get
   ``451 4.3.0``.

Smarthost targets (``MxTarget.relay``) get ``AUTH`` with ``worker.smarthost`` credentials,
only over TLS or to a loopback address; an AUTH failure defers (``451 4.7.8``), it never
bounces. Synthesised failures of the hop to a smarthost name the smarthost, not the
destination's mail exchangers: ``451 4.4.1 No answer from the smarthost (relay
[address]:port: ...)`` instead of ``No answer from any mail exchanger of the domain``, and
likewise for a lost connection and a timeout (``4.4.2``); the enhanced codes are the same
(RFC 3463 §3.5).

Moving on to the next target: connection failure, timeout, TLS failure (per policy),
a malformed reply, a non-220 greeting, EHLO/HELO refusal, and 421 anywhere before a
recipient was accepted. Not moving on: a reply to MAIL (5xx permanent / 4xx temporary for
all, e.g. greylisting), RCPT replies, anything after a recipient was accepted. When every
target failed, every recipient gets the last session failure as a temporary reply.
Commands are not pipelined (RFC 2920) in this version.

Connection cache (:class:`ConnectionCache`, optional): after a completed transaction the
session is kept open for the next delivery to the same target instead of QUIT, which then
starts at MAIL (RFC 5321 §4.1.1.4: the end of mail data clears the server's transaction
state). A cached session that fails before a recipient was accepted (the server closed it
while idle, a 421) is dropped and the same target is tried at once on a new connection.

Timeouts follow RFC 5321 §4.5.3.2 (``mail_timeout_s`` also bounds EHLO, STARTTLS and AUTH;
``data_block_timeout_s`` bounds each chunk's send).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import aiosmtplib
import idna
from aiosmtplib import SMTPResponse

from jsqueue.config import TlsPolicy, WorkerSettings
from jsqueue.delivery.resolver import MxTarget, Resolver
from jsqueue.delivery.transform import ConversionError, DotStuffer, has_8bit_headers, to_7bit
from jsqueue.envelope import Entry, Notify, Recipient
from jsqueue.errors import DeliveryError
from jsqueue.replies import (
    R451_AUTH_FAILED,
    R451_BODY_UNAVAILABLE,
    R451_CONNECT_FAILED,
    R451_CONNECTION_LOST,
    R451_PROTOCOL_ERROR,
    R451_SMARTHOST_CONNECT_FAILED,
    R451_SMARTHOST_CONNECTION_LOST,
    R451_SMARTHOST_TIMEOUT,
    R451_TIMEOUT,
    R451_TLS_REQUIRED,
    R501_BAD_FORWARD_PATH,
    R501_BAD_REVERSE_PATH,
    R554_8BIT_UNSUPPORTED,
    R554_SIZE_EXCEEDED,
    R554_SMTPUTF8_REQUIRED,
    Reply,
)

__all__ = [
    "MAX_CONVERT_OCTETS",
    "BodySource",
    "ConnectionCache",
    "DeliveryEnvelope",
    "DeliveryResult",
    "deliver",
    "deliver_domain",
    "to_reply",
]

log = logging.getLogger(__name__)

MAX_CONVERT_OCTETS = 64 * 1024 * 1024
"""Largest 8-bit body converted to 7-bit in memory; larger ones fail with 5.6.3."""

_QUIT_TIMEOUT_S = 5.0
_ENHANCED = re.compile(r"^([245])\.(\d{1,3})\.(\d{1,3})(?=\s|$)")
_NOTIFY_ORDER = (Notify.NEVER, Notify.SUCCESS, Notify.FAILURE, Notify.DELAY)


@dataclass(frozen=True)
class BodySource:
    """The raw message, re-readable once per connection.

    Attributes:
        open: zero-argument callable returning a fresh async iterator over the raw message
            (CRLF line ends, no dot-stuffing) in chunks of any size. Called once per
            session that reaches DATA (and once more for a header scan or 7-bit
            conversion); an exception from the iterator aborts that transaction.
        size: the message size in octets (RFC 1870 SIZE).
    """

    open: Callable[[], AsyncIterator[bytes]]
    size: int

    @classmethod
    def from_bytes(cls, data: bytes, chunk_size: int = 256 * 1024) -> BodySource:
        """A source over bytes already in memory, yielded in ``chunk_size`` slices."""

        async def chunks() -> AsyncIterator[bytes]:
            view = memoryview(data)
            for start in range(0, len(data), chunk_size):
                yield bytes(view[start : start + chunk_size])

        return cls(open=chunks, size=len(data))


@dataclass(frozen=True)
class DeliveryEnvelope:
    """What one attempt sends: the envelope restricted to one destination domain.

    Attributes:
        domain: routing domain of every recipient (A-label), keys the TLS policy.
        reverse_path: MAIL FROM address without brackets; ``""`` is the null path ``<>``.
        recipients: recipients to offer (one RCPT each; duplicates by address are sent once).
        smtputf8: the message was received with SMTPUTF8 (it may have UTF-8 headers).
        body_8bit: the message was received with BODY=8BITMIME.
        envid: RFC 3461 ENVID (decoded form; xtext-encoded on the wire).
        ret: RFC 3461 RET.
    """

    domain: str
    reverse_path: str
    recipients: tuple[Recipient, ...]
    smtputf8: bool = False
    body_8bit: bool = False
    envid: str | None = None
    ret: Literal["FULL", "HDRS"] | None = None

    @classmethod
    def from_entry(cls, entry: Entry, domain: str) -> DeliveryEnvelope:
        """The open (not final) recipients of ``domain`` in ``entry`` with its envelope."""
        return cls(
            domain=domain,
            reverse_path=entry.reverse_path,
            recipients=tuple(entry.open_recipients(domain)),
            smtputf8=entry.smtputf8,
            body_8bit=entry.body_8bit,
            envid=entry.envid,
            ret=entry.ret,
        )


@dataclass(frozen=True)
class DeliveryResult:
    """Outcome of one attempt.

    Attributes:
        replies: one reply per recipient address of the envelope: 2xx delivered (the next
            hop took responsibility, RFC 5321 §6.1), 4xx retry, 5xx bounce.
        mx_host: host name of the MX whose replies these are; None when no session got as
            far as MAIL (every reply synthesised).
        mx_address: the address connected to, or None.
        tried_host: host name (``MxTarget.host``: MX, implicit MX, address literal or
            smarthost) of the last target a connection was tried to, whether or not it
            answered; None when none was tried (DNS failure, no target). For logs.
        tls: the transaction ran over TLS.
        tls_version: e.g. ``"TLSv1.3"`` when ``tls``.
        dsn: the server advertised DSN, so NOTIFY/ORCPT/RET/ENVID were passed on (else a
            NOTIFY=SUCCESS recipient is owed a "relayed" DSN, RFC 3461 §4.1).
        converted_7bit: the body was converted to 7-bit MIME for this server.
    """

    replies: dict[str, Reply]
    mx_host: str | None = None
    mx_address: str | None = None
    tried_host: str | None = None
    tls: bool = False
    tls_version: str | None = None
    dsn: bool = False
    converted_7bit: bool = False

    @property
    def delivered(self) -> list[str]:
        """Addresses with a 2xx reply."""
        return [a for a, r in self.replies.items() if r.is_success]

    @property
    def deferred(self) -> list[str]:
        """Addresses with a 4xx reply."""
        return [a for a, r in self.replies.items() if r.is_temporary]

    @property
    def failed(self) -> list[str]:
        """Addresses with a 5xx reply."""
        return [a for a, r in self.replies.items() if r.is_permanent]


async def deliver_domain(
    resolver: Resolver,
    envelope: DeliveryEnvelope,
    body: BodySource,
    settings: WorkerSettings,
    cache: ConnectionCache | None = None,
) -> DeliveryResult:
    """Resolve ``envelope.domain`` and :func:`deliver`; resolver errors become replies.

    Returns:
        as :func:`deliver`; on a DNS failure every recipient gets the resolver's reply
        (e.g. ``550 5.1.10`` null MX, ``451 4.4.3`` SERVFAIL) and no connection is made.
    """
    try:
        targets = await resolver.resolve(envelope.domain)
    except DeliveryError as e:
        return DeliveryResult(replies={r.address: e.reply for r in envelope.recipients})
    return await deliver(targets, envelope, body, settings, cache)


async def deliver(
    targets: Sequence[MxTarget],
    envelope: DeliveryEnvelope,
    body: BodySource,
    settings: WorkerSettings,
    cache: ConnectionCache | None = None,
) -> DeliveryResult:
    """Run one delivery attempt over ``targets``; see the module docstring for the rules.

    Args:
        targets: addresses to try in order (at most one transaction succeeds).
        envelope: reverse-path, recipients of one domain and the message's flags.
        body: the raw message; opened once per session that sends DATA.
        settings: timeouts (seconds), TLS policy, EHLO name, MX port, smarthost AUTH.
        cache: sessions to reuse and to give the session back to; None = QUIT after each.

    Returns:
        one reply per recipient address; never raises for network, protocol or TLS errors.
        When every target failed, every recipient gets the last target's failure (e.g.
        ``451 4.4.1``, worded for the smarthost when the target is one) and ``tried_host``
        names that target.
    """
    recipients = list({r.address: r for r in envelope.recipients}.values())
    if not recipients:
        return DeliveryResult(replies={})
    if not targets:
        reply = _detail(R451_CONNECT_FAILED, "no mail exchanger to try")
        return DeliveryResult(replies={r.address: reply for r in recipients})
    body_cache = _BodyCache(body)
    last: Reply | None = None  # every target that did not return set it
    for target in targets:
        allow_tls = True
        while True:
            session = _Session(target, envelope, recipients, body_cache, settings, allow_tls)
            try:
                return await session.run(cache)
            except _TlsFallback as e:
                log.warning(
                    "%s [%s]: STARTTLS failed (%s); retrying in plaintext (opportunistic TLS)",
                    target.host,
                    target.address,
                    e,
                )
                allow_tls = False
            except _NextMx as e:
                log.info(
                    "%s [%s]: %s; trying the next %s",
                    target.host,
                    target.address,
                    e.reply,
                    "address of the smarthost" if target.relay else "MX",
                )
                last = e.reply
                break
    failed = last or _detail(R451_CONNECT_FAILED, "no mail exchanger answered")
    tried = targets[-1].host
    return DeliveryResult(replies={r.address: failed for r in recipients}, tried_host=tried)


# --------------------------------------------------------------------------------------
# internals


class _NextMx(Exception):
    """This target failed before any recipient was accepted; try the next one."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(str(reply))
        self.reply = reply


class _TlsFallback(Exception):
    """Opportunistic STARTTLS failed in the handshake; reconnect in plaintext."""


class _Failed(Exception):
    """A library call failed; carries the synthesised reply."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(str(reply))
        self.reply = reply


def _detail(base: Reply, detail: str) -> Reply:
    return base.model_copy(update={"text": f"{base.text} ({detail})"})


#: MX-worded synthesised replies and their wording for the hop to the smarthost.
_SMARTHOST_WORDING = (
    (R451_CONNECT_FAILED, R451_SMARTHOST_CONNECT_FAILED),
    (R451_CONNECTION_LOST, R451_SMARTHOST_CONNECTION_LOST),
    (R451_TIMEOUT, R451_SMARTHOST_TIMEOUT),
)


def _hop_reply(base: Reply, relay: bool) -> Reply:
    """``base`` worded for the hop: its smarthost variant when ``relay`` (the target is
    ``worker.smarthost``) and one exists, else ``base`` itself. Codes never change."""
    if relay:
        for mx_worded, relay_worded in _SMARTHOST_WORDING:
            if base == mx_worded:
                return relay_worded
    return base


def _clean(text: str) -> str:
    """Server text as valid UTF-8 without control characters (it goes into JSON and DSNs)."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return "".join(c if c >= " " or c == "\n" else " " for c in text)


def to_reply(
    response: SMTPResponse, remote_host: str | None, *, intermediate_ok: bool = False
) -> Reply:
    """Turn an aiosmtplib response into a :class:`Reply`.

    Every line of a multi-line reply is kept (joined with ``\\n``); the enhanced status code
    (RFC 2034, RFC 3463) is taken from the first line when its class matches the basic code
    and removed from the start of each line that repeats it. A code outside 2xx/4xx/5xx (3xx
    only where ``intermediate_ok``, i.e. the 354 to DATA) becomes ``451 4.5.0`` protocol error
    (RFC 5321 §4.2.1), so callers never see an impossible reply.

    Args:
        response: code and text as parsed by aiosmtplib.
        remote_host: the MX host name to record in the reply.
        intermediate_ok: accept 3xx (positive intermediate) codes.
    """
    code = response.code
    valid = 200 <= code <= 599 and (intermediate_ok or not 300 <= code < 400)
    if not valid:
        return _detail(R451_PROTOCOL_ERROR, f"{remote_host}: unexpected reply code {code}")
    lines = _clean(response.message).split("\n")
    enhanced: str | None = None
    m = _ENHANCED.match(lines[0])
    if m and m.group(1) == str(code)[0]:
        enhanced = m.group(0)
        lines = [
            line[len(enhanced) :].lstrip() if line.startswith(enhanced) else line for line in lines
        ]
    return Reply(code=code, enhanced=enhanced, text="\n".join(lines), remote_host=remote_host)


def _xtext(value: str) -> str:
    """RFC 3461 §4 xtext; non-ASCII characters as RFC 6533 ``\\x{HEX}``."""
    out = []
    for ch in value:
        o = ord(ch)
        if o > 126:
            out.append(f"\\x{{{o:X}}}")
        elif o < 33 or ch in "+=":
            out.append(f"+{o:02X}")
        else:
            out.append(ch)
    return "".join(out)


def _orcpt(value: str) -> str:
    addr_type, sep, address = value.partition(";")
    if not sep:
        addr_type, address = "rfc822", value
    if not address.isascii():
        addr_type = "utf-8"
    return f"{addr_type};{_xtext(address)}"


def _notify(notify: Iterable[Notify]) -> str:
    return ",".join(n.value for n in _NOTIFY_ORDER if n in set(notify))


def _split(address: str) -> tuple[str, str]:
    local, at, domain = address.rpartition("@")
    return (local, domain) if at else (address, "")


def _ascii_domain(domain: str) -> str | None:
    if domain.isascii():
        return domain
    try:
        return idna.encode(domain.rstrip("."), uts46=True).decode("ascii")
    except idna.IDNAError:
        return None


def _path(address: str, utf8: bool) -> str | None:
    """The path as sent in MAIL/RCPT (without brackets); None when it needs SMTPUTF8."""
    if address == "":
        return ""
    if utf8 or address.isascii():
        return address
    local, domain = _split(address)
    if not local.isascii():
        return None
    ascii_domain = _ascii_domain(domain)
    return None if ascii_domain is None else f"{local}@{ascii_domain}"


def _size_limit(extensions: dict[str, str]) -> int | None:
    if "size" not in extensions:
        return None
    value = extensions["size"].strip().split(" ")[0]
    return int(value) if value.isdigit() and int(value) > 0 else None


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


async def _aclose(iterator: AsyncIterator[bytes]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


class _BodyCache:
    """The body as sent to the current server: original, or converted to 7-bit (kept for
    the rest of the attempt), plus the header scan result."""

    def __init__(self, source: BodySource) -> None:
        self.source = source
        self._converted: bytes | None = None
        self._conversion_error: str | None = None
        self._headers_8bit: bool | None = None

    async def headers_8bit(self) -> bool:
        """Whether the header section has octets >= 0x80 (reads only the header section)."""
        if self._headers_8bit is None:
            tail = b""
            found = False
            first = True
            iterator = self.source.open()
            try:
                async for chunk in iterator:
                    data = tail + chunk
                    if first and data.startswith(b"\r\n"):
                        break  # no header section at all
                    first = False
                    end = data.find(b"\r\n\r\n")
                    if has_8bit_headers(data if end < 0 else data[:end]):
                        found = True
                        break
                    if end >= 0:
                        break
                    tail = data[-3:]
            finally:
                await _aclose(iterator)
            self._headers_8bit = found
        return self._headers_8bit

    async def converted(self) -> bytes:
        """The body converted to 7-bit MIME.

        Raises:
            ConversionError: see :func:`to_7bit`, or the body is too large to convert.
        """
        if self._conversion_error is not None:
            raise ConversionError(self._conversion_error)
        if self._converted is None:
            try:
                if self.source.size > MAX_CONVERT_OCTETS:
                    raise ConversionError(
                        f"{self.source.size} octets is too large to convert to 7-bit"
                    )
                parts = []
                iterator = self.source.open()
                try:
                    async for chunk in iterator:
                        parts.append(chunk)
                finally:
                    await _aclose(iterator)
                self._converted = to_7bit(b"".join(parts))
            except ConversionError as e:
                self._conversion_error = str(e)
                raise
        return self._converted


async def _quit(smtp: aiosmtplib.SMTP, where: str) -> None:
    """QUIT (bounded by :data:`_QUIT_TIMEOUT_S`) and close; never raises."""
    try:
        if smtp.is_connected:
            await smtp.execute_command(b"QUIT", timeout=_QUIT_TIMEOUT_S)
    except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
        log.debug("%s: QUIT failed: %s", where, e)
    finally:
        smtp.close()


class _CacheKey(NamedTuple):
    """What a cached session must match to be reused: the same MX host name (the name
    in replies, SNI and certificate checks), address and port, the same hop kind (relay
    sessions are authenticated) and the same TLS policy and fallback state."""

    host: str
    address: str
    port: int
    relay: bool
    policy: TlsPolicy
    allow_tls: bool


@dataclass
class _Idle:
    """A connected session between transactions, as the cache keeps it."""

    smtp: aiosmtplib.SMTP
    extensions: dict[str, str]
    tls: bool
    tls_version: str | None
    opened_at: float
    timer: asyncio.TimerHandle | None = None


class ConnectionCache:
    """Outbound SMTP sessions kept open between deliveries to the same target.

    A session whose transaction completed (the reply to the final ``.`` was read, and it
    was not 421) is kept idle for ``idle_s`` seconds instead of being closed with QUIT; the
    next delivery to the same target (MX host name, address, port, TLS policy) within that
    time starts at MAIL, without TCP connect, greeting, EHLO, STARTTLS or AUTH (RFC 5321
    §4.1.1.4: the end of mail data resets the server's transaction state). A session is
    not reused once ``max_age_s`` seconds passed since its connect. The roles of Postfix's
    ``smtp_connection_cache_time_limit`` and ``smtp_connection_reuse_time_limit``.

    Idle sessions past ``idle_s`` get QUIT in the background; :meth:`close` QUITs every
    idle session and waits for that. Not thread-safe (one event loop).

    Args:
        idle_s: seconds an idle session is kept; 0 keeps none (every session ends in QUIT).
        max_age_s: seconds from connect after which a session is no longer reused.
        max_idle: idle sessions kept per target at most (more are closed).
    """

    def __init__(self, idle_s: float = 2.0, max_age_s: float = 300.0, max_idle: int = 20) -> None:
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        self.max_idle = max_idle
        self._idle: dict[_CacheKey, list[_Idle]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def idle(self) -> int:
        """Idle sessions held right now."""
        return sum(len(v) for v in self._idle.values())

    def take(self, key: _CacheKey) -> _Idle | None:
        """The most recently used idle session for ``key`` still fit for reuse, or None."""
        pool = self._idle.get(key)
        now = asyncio.get_running_loop().time()
        found: _Idle | None = None
        while pool and found is None:
            idle = pool.pop()
            if idle.timer is not None:
                idle.timer.cancel()
            if now - idle.opened_at < self.max_age_s and idle.smtp.is_connected:
                found = idle
            else:
                self._close(key, idle)
        if pool is not None and not pool:
            del self._idle[key]  # no empty pool per target ever seen
        return found

    def put(self, key: _CacheKey, idle: _Idle) -> bool:
        """Keep ``idle`` for reuse; False (and nothing kept) when the cache will not."""
        loop = asyncio.get_running_loop()
        if (
            self._closed
            or self.idle_s <= 0
            or len(self._idle.get(key, ())) >= self.max_idle
            or loop.time() - idle.opened_at >= self.max_age_s
        ):
            return False
        idle.timer = loop.call_later(self.idle_s, self._expire, key, idle)
        self._idle.setdefault(key, []).append(idle)
        return True

    def _expire(self, key: _CacheKey, idle: _Idle) -> None:
        pool = self._idle.get(key)
        if pool is not None and idle in pool:
            pool.remove(idle)
            if not pool:
                del self._idle[key]
            self._close(key, idle)

    def _close(self, key: _CacheKey, idle: _Idle) -> None:
        task = asyncio.get_running_loop().create_task(
            _quit(idle.smtp, f"{key.host} [{key.address}] (idle)")
        )
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """QUIT every idle session and keep no more. Idempotent."""
        self._closed = True
        for key, pool in list(self._idle.items()):
            for idle in pool:
                if idle.timer is not None:
                    idle.timer.cancel()
                self._close(key, idle)
        self._idle.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


class _Session:
    """One connection to one target (internal)."""

    def __init__(
        self,
        target: MxTarget,
        envelope: DeliveryEnvelope,
        recipients: list[Recipient],
        body: _BodyCache,
        settings: WorkerSettings,
        allow_tls: bool,
    ) -> None:
        self.target = target
        self.host = target.host
        self.envelope = envelope
        self.recipients = recipients
        self.body = body
        self.settings = settings
        self.allow_tls = allow_tls
        self.smtp: aiosmtplib.SMTP | None = None
        self.tls = False
        self.tls_version: str | None = None
        self.dsn = False
        self.converted = False
        self.opened_at = 0.0
        # Set once the reply to the final "." was read on a connection still usable.
        self.reusable = False
        if target.relay and settings.smarthost is not None:
            # The relay hop's TLS policy is keyed by the relay's name, not the destination.
            self.policy = settings.tls_policies.get(target.host.lower(), settings.tls)
        else:
            self.policy = settings.tls_policies.get(envelope.domain.lower(), settings.tls)

    # -- plumbing ------------------------------------------------------------------------

    def _where(self) -> str:
        """``host [address]`` for logs and reply texts; ``host [address]:port`` for a target
        with its own port (the smarthost)."""
        where = f"{self.host} [{self.target.address}]"
        return where if self.target.port is None else f"{where}:{self.target.port}"

    def _fail(self, base: Reply, detail: str) -> Reply:
        """A synthesised failure of this hop: ``base`` (worded for the smarthost when the
        target is one, see :func:`_hop_reply`) with ``detail`` appended."""
        return _detail(_hop_reply(base, self.target.relay), detail)

    def _result(self, replies: dict[str, Reply]) -> DeliveryResult:
        return DeliveryResult(
            replies=replies,
            mx_host=self.host,
            mx_address=self.target.address,
            tried_host=self.host,
            tls=self.tls,
            tls_version=self.tls_version,
            dsn=self.dsn,
            converted_7bit=self.converted,
        )

    def _translate(self, exc: BaseException, stage: str) -> _Failed:
        where = self._where()
        if isinstance(exc, _Failed):
            return exc
        if isinstance(exc, TimeoutError | aiosmtplib.SMTPTimeoutError):
            return _Failed(self._fail(R451_TIMEOUT, f"{where}: {stage}: timed out"))
        if isinstance(exc, aiosmtplib.SMTPServerDisconnected | ConnectionError):
            return _Failed(self._fail(R451_CONNECTION_LOST, f"{where}: {stage}: {exc}"))
        if isinstance(exc, ssl.SSLError):
            return _Failed(self._fail(R451_CONNECTION_LOST, f"{where}: {stage}: TLS: {exc}"))
        if isinstance(exc, aiosmtplib.SMTPResponseException):
            if exc.code < 0:  # aiosmtplib could not parse the reply (e.g. CASE-19 variant M)
                return _Failed(_detail(R451_PROTOCOL_ERROR, f"{where}: {stage}: {exc.message}"))
            return _Failed(to_reply(SMTPResponse(exc.code, exc.message), self.host))
        if isinstance(exc, aiosmtplib.SMTPException | ValueError):
            return _Failed(_detail(R451_PROTOCOL_ERROR, f"{where}: {stage}: {exc}"))
        return _Failed(self._fail(R451_CONNECTION_LOST, f"{where}: {stage}: {exc!r}"))

    async def _command(
        self, stage: str, timeout_s: float, *args: bytes, intermediate_ok: bool = False
    ) -> Reply:
        """Send one command; library failures raise :class:`_Failed` with the reply."""
        assert self.smtp is not None
        try:
            response = await self.smtp.execute_command(*args, timeout=timeout_s)
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
            raise self._translate(e, stage) from e
        return to_reply(response, self.host, intermediate_ok=intermediate_ok)

    async def _connect(self) -> None:
        s = self.settings
        port = self.target.port or s.mx_port
        address = self.target.address
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        loop = asyncio.get_running_loop()
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            raise _NextMx(self._fail(R451_CONNECT_FAILED, f"{self._where()}: {e}")) from e
        try:
            sock.setblocking(False)
            # asyncio only disables Nagle itself for sockets made with proto=IPPROTO_TCP.
            # Without this the terminator written after the body waits for the server's
            # delayed ACK: ~40 ms per message.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with asyncio.timeout(s.connect_timeout_s):
                await loop.sock_connect(sock, (address, port))
        except (OSError, TimeoutError) as e:
            sock.close()
            reason = "timed out" if isinstance(e, TimeoutError) else str(e)
            where = f"{self.host} [{address}]:{port}"
            raise _NextMx(self._fail(R451_CONNECT_FAILED, f"{where}: {reason}")) from e
        try:
            self.smtp = aiosmtplib.SMTP(
                sock=sock,
                local_hostname=s.ehlo_name,
                timeout=s.greeting_timeout_s,
                start_tls=False,
                validate_certs=False,
            )
        except ValueError as e:  # e.g. an EHLO name with white space
            sock.close()
            raise _NextMx(self._fail(R451_CONNECT_FAILED, f"{self._where()}: {e}")) from e
        try:
            greeting = await self.smtp.connect()
        except aiosmtplib.SMTPConnectResponseError as e:
            reply = self._translate(e, "greeting").reply
            raise _NextMx(self._as_temporary(reply, "greeting")) from e
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
            raise _NextMx(self._translate(e, "greeting").reply) from e
        self.opened_at = loop.time()
        log.debug("%s: greeting %s", self._where(), greeting)

    def _as_temporary(self, reply: Reply, stage: str) -> Reply:
        """A session-level refusal (greeting, EHLO) is retried later, never a bounce."""
        if reply.is_temporary:
            return reply
        return self._fail(
            R451_CONNECT_FAILED, f"{self._where()} refused the session at {stage}: {reply}"
        )

    async def _hello(self) -> dict[str, str]:
        """EHLO (HELO after a 5xx); returns the lower-cased extension table."""
        assert self.smtp is not None
        s = self.settings
        response, reply = await self._command_or_next(
            "EHLO", s.mail_timeout_s, b"EHLO", s.ehlo_name.encode()
        )
        if reply.is_success:
            # Lets aiosmtplib's starttls()/login() see the extensions without a new EHLO.
            self.smtp.last_ehlo_response = response
            return dict(self.smtp.esmtp_extensions)
        if reply.code == 421 or not reply.is_permanent:
            raise _NextMx(self._as_temporary(reply, "EHLO"))
        response, helo = await self._command_or_next(
            "HELO", s.mail_timeout_s, b"HELO", s.ehlo_name.encode()
        )
        if not helo.is_success:
            raise _NextMx(self._as_temporary(helo, "HELO"))
        self.smtp.last_helo_response = response
        return {}

    async def _command_or_next(
        self, stage: str, timeout_s: float, *args: bytes
    ) -> tuple[SMTPResponse, Reply]:
        """A command before any recipient is accepted: any failure means next MX."""
        assert self.smtp is not None
        try:
            response = await self.smtp.execute_command(*args, timeout=timeout_s)
            return response, to_reply(response, self.host)
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
            raise _NextMx(self._translate(e, stage).reply) from e

    def _tls_context(self) -> ssl.SSLContext:
        if self.policy is TlsPolicy.VERIFY:
            ca = self.settings.tls_ca_file
            ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
        else:
            # RFC 7435: opportunistic (and "required" without verification) encrypts
            # against passive listeners only; any certificate is accepted.
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    async def _starttls(self, extensions: dict[str, str]) -> dict[str, str]:
        """STARTTLS per policy; returns the extensions to use afterwards."""
        assert self.smtp is not None
        policy = self.policy
        if policy is TlsPolicy.NEVER or (policy is TlsPolicy.OPPORTUNISTIC and not self.allow_tls):
            return extensions
        required = policy in (TlsPolicy.REQUIRED, TlsPolicy.VERIFY)
        if "starttls" not in extensions:
            if required:
                raise _NextMx(_detail(R451_TLS_REQUIRED, f"{self._where()}: STARTTLS not offered"))
            return extensions
        sni = None if _literal_like(self.host) else self.host
        if policy is TlsPolicy.VERIFY and sni is None:
            raise _NextMx(_detail(R451_TLS_REQUIRED, f"{self._where()}: no name to verify"))
        try:
            await self.smtp.starttls(
                server_hostname=sni,
                tls_context=self._tls_context(),
                timeout=self.settings.mail_timeout_s,
            )
        except aiosmtplib.SMTPResponseException as e:
            # The server refused STARTTLS (e.g. 454) but the plaintext session is intact.
            if e.code == 421 or required or not self.smtp.is_connected:
                reason = f"STARTTLS refused: {e.code} {e.message}"
                base = R451_TLS_REQUIRED if required else R451_CONNECTION_LOST
                raise _NextMx(self._fail(base, f"{self._where()}: {reason}")) from e
            log.warning(
                "%s: STARTTLS refused (%s %s); continuing in plaintext",
                self._where(),
                e.code,
                e.message,
            )
            return extensions
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
            if required:
                raise _NextMx(_detail(R451_TLS_REQUIRED, f"{self._where()}: {e}")) from e
            raise _TlsFallback(str(e) or type(e).__name__) from e
        self.tls = True
        ssl_object = self.smtp.get_transport_info("ssl_object")
        if isinstance(ssl_object, ssl.SSLObject):
            self.tls_version = ssl_object.version()
        return await self._hello()

    async def _auth(self) -> None:
        smarthost = self.settings.smarthost
        if not (self.target.relay and smarthost and smarthost.username):
            return
        assert self.smtp is not None
        if not self.tls and not _is_loopback(self.target.address):
            raise _NextMx(
                _detail(
                    R451_AUTH_FAILED, f"{self._where()}: refusing to send credentials without TLS"
                )
            )
        password = smarthost.password.get_secret_value() if smarthost.password else ""
        try:
            await self.smtp.login(
                smarthost.username, password, timeout=self.settings.mail_timeout_s
            )
        except aiosmtplib.SMTPAuthenticationError as e:
            raise _NextMx(
                _detail(R451_AUTH_FAILED, f"{self._where()}: {e.code} {e.message}")
            ) from e
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
            raise _NextMx(_detail(R451_AUTH_FAILED, f"{self._where()}: {e}")) from e

    # -- the session ---------------------------------------------------------------------

    def _cache_key(self) -> _CacheKey:
        t = self.target
        return _CacheKey(
            t.host, t.address, t.port or self.settings.mx_port, t.relay, self.policy, self.allow_tls
        )

    async def run(self, cache: ConnectionCache | None = None) -> DeliveryResult:
        if cache is not None:
            idle = cache.take(self._cache_key())
            if idle is not None:
                self.smtp, self.tls, self.tls_version = idle.smtp, idle.tls, idle.tls_version
                self.opened_at = idle.opened_at
                try:
                    result = await self._transaction(idle.extensions)
                except _NextMx as e:
                    # Closed while idle (EOF, 421 ...): not this target's fault, and no
                    # recipient was accepted. Go on with a new connection.
                    log.debug("%s: cached session unusable (%s); reconnecting", self._where(), e)
                    await self._quit()
                    self.smtp, self.tls, self.tls_version = None, False, None
                else:
                    await self._release(cache, idle.extensions)
                    return result
        extensions: dict[str, str] = {}
        try:
            await self._connect()
            extensions = await self._hello()
            extensions = await self._starttls(extensions)
            await self._auth()
            result = await self._transaction(extensions)
        except BaseException:
            await self._quit()
            raise
        await self._release(cache, extensions)
        return result

    async def _release(self, cache: ConnectionCache | None, extensions: dict[str, str]) -> None:
        """Hand a reusable connection to the cache; QUIT any other."""
        smtp = self.smtp
        if cache is not None and smtp is not None and self.reusable and smtp.is_connected:
            idle = _Idle(smtp, extensions, self.tls, self.tls_version, self.opened_at)
            if cache.put(self._cache_key(), idle):
                self.smtp = None
                return
        await self._quit()

    async def _quit(self) -> None:
        smtp, self.smtp = self.smtp, None
        if smtp is not None:
            await _quit(smtp, self._where())

    async def _transaction(self, extensions: dict[str, str]) -> DeliveryResult:
        env = self.envelope
        replies: dict[str, Reply] = {}
        server_utf8 = "smtputf8" in extensions
        needs_utf8 = (
            env.smtputf8
            or not env.reverse_path.isascii()
            or any(not r.address.isascii() for r in self.recipients)
        )
        use_utf8 = server_utf8 and needs_utf8
        everyone = [r.address for r in self.recipients]

        def all_get(reply: Reply, addresses: Iterable[str] = everyone) -> DeliveryResult:
            for a in addresses:
                replies[a] = reply
            return self._result(replies)

        utf8_reply = R554_SMTPUTF8_REQUIRED
        reverse = _path(env.reverse_path, use_utf8)
        if reverse is None:
            return all_get(
                _detail(utf8_reply, f"{self.host} lacks SMTPUTF8; sender {env.reverse_path}")
            )
        if env.smtputf8 and not use_utf8 and await self.body.headers_8bit():
            return all_get(_detail(utf8_reply, f"{self.host} lacks SMTPUTF8; UTF-8 in the header"))
        paths: dict[str, str] = {}
        for r in self.recipients:
            p = _path(r.address, use_utf8)
            if p is None:
                replies[r.address] = _detail(utf8_reply, f"{self.host} lacks SMTPUTF8")
            else:
                paths[r.address] = p
        if not paths:
            return self._result(replies)

        # 8-bit body to a server without 8BITMIME: convert (RFC 6152 §3) or fail 5.6.3.
        body_source: BodySource = self.body.source
        body_8bit = env.body_8bit
        if body_8bit and "8bitmime" not in extensions:
            try:
                converted = await self.body.converted()
            except ConversionError as e:
                reply = R554_8BIT_UNSUPPORTED
                return all_get(_detail(reply, f"{self.host} lacks 8BITMIME; {e}"), paths)
            body_source = BodySource.from_bytes(converted)
            body_8bit = False
            self.converted = True

        limit = _size_limit(extensions)
        if limit is not None and body_source.size > limit:
            reply = R554_SIZE_EXCEEDED
            return all_get(
                _detail(reply, f"{body_source.size} octets > {self.host} SIZE {limit}"), paths
            )

        self.dsn = "dsn" in extensions
        params: list[bytes] = []
        if "size" in extensions:
            params.append(f"SIZE={body_source.size}".encode())
        if body_8bit and "8bitmime" in extensions:
            params.append(b"BODY=8BITMIME")
        if use_utf8:
            params.append(b"SMTPUTF8")
        if self.dsn:
            if env.ret:
                params.append(f"RET={env.ret}".encode())
            if env.envid:
                params.append(f"ENVID={_xtext(env.envid)}".encode())
        encoding = "utf-8" if use_utf8 else "ascii"
        try:
            mail_arg = f"FROM:<{reverse}>".encode(encoding)
        except UnicodeEncodeError:
            return all_get(R501_BAD_REVERSE_PATH, paths)
        try:
            mail = await self._command(
                "MAIL", self.settings.mail_timeout_s, b"MAIL", mail_arg, *params
            )
        except _Failed as e:
            if isinstance(e.__cause__, ValueError):
                return all_get(_detail(R501_BAD_REVERSE_PATH, str(e.__cause__)), paths)
            raise _NextMx(e.reply) from e
        if mail.code == 421:
            raise _NextMx(mail)
        if not mail.is_success:
            return all_get(mail, paths)

        accepted: list[str] = []
        for address, path in paths.items():
            rcpt_params: list[bytes] = []
            recipient = next(r for r in self.recipients if r.address == address)
            if self.dsn:
                if recipient.notify:
                    rcpt_params.append(f"NOTIFY={_notify(recipient.notify)}".encode())
                if recipient.orcpt:
                    rcpt_params.append(f"ORCPT={_orcpt(recipient.orcpt)}".encode())
            try:
                reply = await self._command(
                    "RCPT",
                    self.settings.rcpt_timeout_s,
                    b"RCPT",
                    f"TO:<{path}>".encode(encoding),
                    *rcpt_params,
                )
            except _Failed as e:
                if isinstance(e.__cause__, ValueError):
                    replies[address] = _detail(R501_BAD_FORWARD_PATH, str(e.__cause__))
                    continue
                if not accepted:
                    raise _NextMx(e.reply) from e
                return all_get(e.reply, [a for a in paths if a in accepted or a not in replies])
            if reply.code == 421:
                if not accepted:
                    raise _NextMx(reply)
                return all_get(reply, [a for a in paths if a in accepted or a not in replies])
            replies[address] = reply
            if reply.is_success:
                accepted.append(address)
        if not accepted:
            return self._result(replies)
        return await self._data(body_source, accepted, replies)

    async def _data(
        self, body: BodySource, accepted: list[str], replies: dict[str, Reply]
    ) -> DeliveryResult:
        def accepted_get(reply: Reply) -> DeliveryResult:
            for a in accepted:
                replies[a] = reply
            return self._result(replies)

        s = self.settings
        try:
            start = await self._command(
                "DATA", s.data_init_timeout_s, b"DATA", intermediate_ok=True
            )
        except _Failed as e:
            return accepted_get(e.reply)
        if start.code != 354:
            if not (start.is_temporary or start.is_permanent):
                start = _detail(R451_PROTOCOL_ERROR, f"{self._where()}: {start.code} to DATA")
            return accepted_get(start)

        assert self.smtp is not None and self.smtp.protocol is not None
        protocol = self.smtp.protocol
        stuffer = DotStuffer()
        iterator = body.open()
        held = b""  # the latest stuffed chunk: the last one goes out with the terminator
        try:
            while True:
                try:
                    chunk = await anext(iterator)
                except StopAsyncIteration:
                    break
                except Exception as e:  # any failure of the body store aborts the transaction
                    log.warning("%s: body source failed during DATA: %r", self._where(), e)
                    self._abort()
                    return accepted_get(_detail(R451_BODY_UNAVAILABLE, repr(e)))
                out = stuffer.feed(chunk)
                if out and held:
                    protocol.write(held)
                    async with asyncio.timeout(s.data_block_timeout_s):
                        # FlowControlMixin's drain (aiosmtplib has no public drain): waits
                        # while the transport's write buffer is above its high-water mark.
                        await protocol._drain_helper()
                held = out or held
            # The terminator is written (in one write with the last chunk: one system call
            # for a small message) and the reply awaited with no await in between, so the
            # reply cannot arrive before aiosmtplib expects it.
            protocol.write(held + stuffer.finish())
            response = await protocol.read_response(timeout=s.data_final_timeout_s)
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
            self._abort()
            failure = self._translate(e, "DATA")
            return accepted_get(failure.reply)
        finally:
            await _aclose(iterator)
        reply = to_reply(response, self.host)
        self.reusable = reply.code != 421
        return accepted_get(reply)

    def _abort(self) -> None:
        """Drop the connection without the terminator: the server discards the message."""
        smtp = self.smtp
        if smtp is None:
            return
        transport = smtp.transport
        if isinstance(transport, asyncio.WriteTransport):
            transport.abort()
        smtp.close()


def _literal_like(host: str) -> bool:
    if host.startswith("["):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
