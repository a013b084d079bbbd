"""One outbound SMTP session with one target (:class:`OutboundSession`): connect, greeting,
EHLO/HELO, STARTTLS per policy, AUTH to a smarthost, then one transaction for every recipient
of the destination with the body streamed and dot-stuffed (RFC 5321 §3, §4.5.2); library
errors become replies here. :mod:`jsqueue.delivery.client` runs one per target in order.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Iterable

import aiosmtplib
from aiosmtplib import SMTPResponse

from jsqueue.config import TlsPolicy, WorkerSettings
from jsqueue.delivery.base import BodySource, DeliveryEnvelope, DeliveryResult
from jsqueue.delivery.body import BodyCache, aclose
from jsqueue.delivery.commands import plan_transaction
from jsqueue.delivery.committed import mark_dot_sent
from jsqueue.delivery.connections import (
    CacheKey,
    ConnectionCache,
    IdleSession,
    abort_connection,
    quit_smtp,
)
from jsqueue.delivery.pipelining import pipelined_transaction
from jsqueue.delivery.policy.decision import MANUAL, TlsPlan
from jsqueue.delivery.resolver import MxTarget
from jsqueue.delivery.responses import (
    hop_reply,
    rcpt_reply,
    refused,
    to_reply,
    too_many_recipients,
    with_detail,
)
from jsqueue.delivery.signals import Failed, LoopsBack, NextMx, TlsFallback, is_loopback, ours
from jsqueue.delivery.starttls import starttls
from jsqueue.delivery.sync import Desync, GuardedSMTP, check_sync, impossible_reply
from jsqueue.delivery.transform import DotStuffer
from jsqueue.envelope import Recipient
from jsqueue.replies import (
    R451_AUTH_FAILED,
    R451_BODY_UNAVAILABLE,
    R451_CONNECT_FAILED,
    R451_CONNECTION_LOST,
    R451_PROTOCOL_ERROR,
    R451_TIMEOUT,
    R501_BAD_FORWARD_PATH,
    R501_BAD_REVERSE_PATH,
    R554_LOOPS_BACK,
    Reply,
    TlsNote,
)

__all__ = ["LoopsBack", "NextMx", "OutboundSession", "TlsFallback"]

log = logging.getLogger(__name__)


class OutboundSession:
    """One outbound SMTP connection to one target, for one transaction (package-internal).

    Args:
        target: the address to connect to (MX, implicit MX, literal or smarthost).
        envelope: reverse-path and flags of the message.
        recipients: the recipients to offer, duplicates removed.
        body: the attempt's body (shared by its sessions).
        settings: timeouts (seconds), TLS policies, EHLO name, MX port, smarthost AUTH.
        allow_tls: False after an opportunistic STARTTLS failed on this address.
        fresh: this session retries recipients after a desynchronised reply: it takes no
            cached connection, and a second desynchronisation defers them (4.5.0), or,
            when no body went out (:attr:`desynced_unsent`), the client moves on to the
            next MX.
    """

    def __init__(
        self,
        target: MxTarget,
        envelope: DeliveryEnvelope,
        recipients: list[Recipient],
        body: BodyCache,
        settings: WorkerSettings,
        allow_tls: bool,
        fresh: bool = False,
        plan: TlsPlan | None = None,
    ) -> None:
        self.target = target
        self.plan = plan  # the TLS policy decided for this MX (None: worker.tls only)
        self.tls_note: TlsNote | None = None
        self.fresh = fresh
        self.desynced = False  # a desynchronised reply left carry for a fresh connection
        # Out of sync before any final dot of the session's first transaction: nothing of
        # the message reached the server (RFC 5321 §4.1.1.4), no reply of it counts.
        self.desynced_unsent = False
        self.host = target.host
        self.envelope = envelope
        self.recipients = recipients
        self.body = body
        self.settings = settings
        self.allow_tls = allow_tls
        self.smtp: aiosmtplib.SMTP | None = None
        self.tls = False
        #: TLS came up under a policy that may go without it (opportunistic, MTA-STS testing)
        self.tls_optional = False
        self.tls_version: str | None = None
        self.dsn = False
        self.converted = False
        self.opened_at = 0.0
        # Set once the reply to the final "." was read on a connection still usable.
        self.reusable = False
        self.uncertain: set[str] = set()  # accepted; final "." sent, no usable reply
        # Recipients a recipient limit left for a further transaction (RFC 5321 §4.5.3.1.10).
        self.carry: list[Recipient] = []
        if target.relay and settings.smarthost is not None:
            # The relay hop's TLS policy is keyed by the relay's name, not the destination.
            self.policy = settings.tls_policies.get(target.host.lower(), settings.tls)
        else:
            self.policy = settings.tls_policies.get(envelope.domain.lower(), settings.tls)
        if plan is not None and plan.label != MANUAL:
            self.policy = plan.session_policy

    # -- plumbing ------------------------------------------------------------------------

    def where(self) -> str:
        """``host [address]`` for logs and reply texts; ``host [address]:port`` for a target
        with its own port (the smarthost)."""
        where = f"{self.host} [{self.target.address}]"
        return where if self.target.port is None else f"{where}:{self.target.port}"

    def _fail(self, base: Reply, detail: str) -> Reply:
        """A synthesised failure of this hop: ``base`` (worded for the smarthost when the
        target is one, see :func:`hop_reply`) with ``detail`` appended."""
        return with_detail(hop_reply(base, self.target.relay), detail)

    def _result(self, replies: dict[str, Reply]) -> DeliveryResult:
        return DeliveryResult(
            replies=replies,
            mx_host=self.host,
            mx_address=self.target.address,
            tried_host=self.host,
            tls=self.tls,
            tls_version=self.tls_version,
            dsn=self.dsn,
            dsn_accepted=(
                frozenset(a for a, r in replies.items() if r.is_success)
                if self.dsn
                else frozenset()
            ),
            converted_7bit=self.converted,
            dkim=self.body.dkim(self.converted),
            uncertain=frozenset(self.uncertain),
        )

    def _translate(self, exc: BaseException, stage: str) -> Failed:
        where = self.where()
        if isinstance(exc, Failed):
            return exc
        if isinstance(exc, TimeoutError | aiosmtplib.SMTPTimeoutError):
            return Failed(self._fail(R451_TIMEOUT, f"{where}: {stage}: timed out"))
        if isinstance(exc, aiosmtplib.SMTPResponseException):  # (a refused greeting is a
            # ConnectionError too: the server's reply, never "connection lost")
            if exc.code < 0:  # a malformed reply (sync.GuardedProtocol; CASE-19 variant M)
                return Failed(with_detail(R451_PROTOCOL_ERROR, f"{where}: {stage}: {exc.message}"))
            return Failed(to_reply(SMTPResponse(exc.code, exc.message), self.host))
        if isinstance(exc, aiosmtplib.SMTPServerDisconnected | ConnectionError):
            return Failed(self._fail(R451_CONNECTION_LOST, f"{where}: {stage}: {exc}"))
        if isinstance(exc, ssl.SSLError):
            return Failed(self._fail(R451_CONNECTION_LOST, f"{where}: {stage}: TLS: {exc}"))
        if isinstance(exc, aiosmtplib.SMTPException | ValueError):
            return Failed(with_detail(R451_PROTOCOL_ERROR, f"{where}: {stage}: {exc}"))
        return Failed(self._fail(R451_CONNECTION_LOST, f"{where}: {stage}: {exc!r}"))

    async def _command(
        self, stage: str, timeout_s: float, *args: bytes, intermediate_ok: bool = False
    ) -> Reply:
        """Send one command once the connection is in sync and read its reply.

        Raises:
            Desync: unexpected data is pending before the command (:func:`check_sync`), or
                the reply is impossible for MAIL, RCPT or DATA (:func:`impossible_reply`,
                as in the pipelined group).
            Failed: the library failed (lost, timed out, malformed); carries the reply.
        """
        assert self.smtp is not None
        await check_sync(self.smtp, stage)
        try:
            response = await self.smtp.execute_command(*args, timeout=timeout_s)
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
            raise self._translate(e, stage) from e
        if stage in ("MAIL", "RCPT", "DATA") and impossible_reply(stage, response):
            raise Desync(stage, f"{response.code} {response.message}".encode()[:512])
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
            raise NextMx(self._fail(R451_CONNECT_FAILED, f"{self.where()}: {e}")) from e
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
            raise NextMx(self._fail(R451_CONNECT_FAILED, f"{where}: {reason}")) from e
        try:
            self.smtp = GuardedSMTP(
                sock=sock,
                local_hostname=s.ehlo_name,
                timeout=s.greeting_timeout_s,
                start_tls=False,
                validate_certs=False,
            )
        except ValueError as e:  # e.g. an EHLO name with white space
            sock.close()
            raise NextMx(self._fail(R451_CONNECT_FAILED, f"{self.where()}: {e}")) from e
        try:
            greeting = await self.smtp.connect()
        except aiosmtplib.SMTPConnectResponseError as e:
            reply = self._translate(e, "greeting").reply
            raise NextMx(self._as_temporary(reply, "greeting")) from e
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
            raise NextMx(self._translate(e, "greeting").reply) from e
        self.opened_at = loop.time()
        log.debug("%s: greeting %s", self.where(), greeting)

    def _as_temporary(self, reply: Reply, stage: str) -> Reply:
        """A session-level refusal (greeting, EHLO) is retried later, never a bounce; the
        server that refused stays its ``remote_host``: it answered (the destination limits
        take that for no outage, :func:`jsqueue.limits.is_connection_failure`)."""
        if reply.is_temporary:
            return reply
        refused = f"{self.where()} refused the session at {stage}: {reply}"
        return self._fail(R451_CONNECT_FAILED, refused).model_copy(
            update={"remote_host": reply.remote_host}
        )

    async def _hello(self) -> dict[str, str]:
        """EHLO (HELO after a 5xx); returns the lower-cased extension table.

        Raises:
            NextMx: EHLO got 421 or a temporary reply, the HELO after a permanent one was
                refused, or a command failed (timeout, lost connection, unparsable reply).
        """
        assert self.smtp is not None
        s = self.settings
        response, reply = await self._command_or_next(
            "EHLO", s.mail_timeout_s, b"EHLO", s.ehlo_name.encode()
        )
        if reply.is_success:
            self._not_myself(response, "EHLO")
            # Lets aiosmtplib's starttls()/login() see the extensions without a new EHLO.
            self.smtp.last_ehlo_response = response
            return dict(self.smtp.esmtp_extensions)
        if reply.code == 421 or not reply.is_permanent:
            raise NextMx(self._as_temporary(reply, "EHLO"))
        response, helo = await self._command_or_next(
            "HELO", s.mail_timeout_s, b"HELO", s.ehlo_name.encode()
        )
        if not helo.is_success:
            raise NextMx(self._as_temporary(helo, "HELO"))
        self._not_myself(response, "HELO")
        self.smtp.last_helo_response = response
        return {}

    def _not_myself(self, response: SMTPResponse, verb: str) -> None:
        """RFC 5321 §5.1: a next hop that answers EHLO/HELO with this queue's own name is
        this queue (an MX or smarthost pointing back at it).

        Raises:
            LoopsBack: ``554 5.4.6`` "mail for <domain> loops back to myself".
        """
        if not self.tls and self.policy in (TlsPolicy.REQUIRED, TlsPolicy.VERIFY):
            return  # told only on the EHLO after STARTTLS: this one an attacker could forge
        s = self.settings
        name = ours(response.message, [s.ehlo_name, *s.own_names])
        if name is not None:
            detail = (
                f"mail for {self.envelope.domain} loops back to myself: {self.where()} "
                f"answered {verb} as {name}"
            )
            raise LoopsBack(with_detail(R554_LOOPS_BACK, detail))

    async def _command_or_next(
        self, stage: str, timeout_s: float, *args: bytes
    ) -> tuple[SMTPResponse, Reply]:
        """A command before any recipient is accepted: any failure means next MX.

        Raises:
            NextMx: the command failed (SMTP error, timeout, lost connection, unparsable
                reply); carries the synthesised reply.
            Desync: data out of sync with the commands (RFC 5321 §4.2; see :mod:`.sync`).
        """
        assert self.smtp is not None
        await check_sync(self.smtp, stage)
        try:
            response = await self.smtp.execute_command(*args, timeout=timeout_s)
            return response, to_reply(response, self.host)
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
            raise NextMx(self._translate(e, stage).reply) from e

    async def _starttls(self, extensions: dict[str, str]) -> dict[str, str]:
        """STARTTLS per policy (:func:`jsqueue.delivery.starttls.starttls`, which raises
        NextMx or TlsFallback); returns the extensions to use afterwards."""
        return await starttls(self, extensions)

    async def _auth(self) -> None:
        smarthost = self.settings.smarthost
        if not (self.target.relay and smarthost and smarthost.username):
            return
        assert self.smtp is not None
        if not self.tls and not is_loopback(self.target.address):
            raise NextMx(
                with_detail(
                    R451_AUTH_FAILED, f"{self.where()}: refusing to send credentials without TLS"
                )
            )
        password = smarthost.password.get_secret_value() if smarthost.password else ""
        await check_sync(self.smtp, "AUTH")
        try:
            await self.smtp.login(
                smarthost.username, password, timeout=self.settings.mail_timeout_s
            )
        except aiosmtplib.SMTPAuthenticationError as e:
            raise NextMx(
                with_detail(R451_AUTH_FAILED, f"{self.where()}: {e.code} {e.message}")
            ) from e
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
            raise NextMx(with_detail(R451_AUTH_FAILED, f"{self.where()}: {e}")) from e

    # -- the session ---------------------------------------------------------------------

    def _cache_key(self) -> CacheKey:
        t = self.target
        return CacheKey(
            t.host,
            t.address,
            t.port or self.settings.mx_port,
            t.relay,
            self.policy,
            self.allow_tls,
            f"{self.plan.label} {self.plan.policy_id}" if self.plan else "",
        )

    async def run(self, cache: ConnectionCache | None = None) -> DeliveryResult:
        """Connect (or reuse a cached session), greet, STARTTLS, AUTH, then one transaction
        (RFC 5321 §3); hand a reusable connection to ``cache``, else QUIT. Not idempotent:
        it may send the message.

        Args:
            cache: sessions to reuse and to give this one back to; None = QUIT after.

        Returns:
            one reply per recipient; library errors become replies.

        Raises:
            NextMx: this target failed before any recipient was accepted.
            TlsFallback: opportunistic STARTTLS failed; retry the address in plaintext.
        """
        if cache is not None and not self.fresh:
            idle = cache.take(self._cache_key())
            if idle is not None:
                self.smtp, self.tls, self.tls_version = idle.smtp, idle.tls, idle.tls_version
                self.tls_note = idle.tls_note
                self.opened_at = idle.opened_at
                try:
                    result = await self._transactions(idle.extensions)
                except NextMx as e:
                    if e.settled:  # it answered for recipients: alive, and failing now
                        await self._quit()
                        raise
                    # Closed while idle (EOF, 421 ...): not this target's fault, and no
                    # recipient was accepted. Go on with a new connection.
                    log.debug("%s: cached session unusable (%s); reconnecting", self.where(), e)
                    await self._quit()
                    self.smtp, self.tls, self.tls_version = None, False, None
                else:
                    await self._release(cache, idle.extensions)
                    return result
        extensions: dict[str, str] = {}
        if cache is not None:
            await cache.opening()  # the destination limits make room for a new session
        try:
            await self._connect()
            extensions = await self._hello()
            extensions = await self._starttls(extensions)
            await self._auth()
            result = await self._transactions(extensions)
        except Desync as e:  # before any transaction (greeting, EHLO, STARTTLS, AUTH)
            replies: dict[str, Reply] = {}
            self._desynced(e, self.recipients, replies)
            await self._quit()
            return self._result(replies)
        except NextMx as e:
            await self._quit()
            if self.tls_optional and not e.settled and _lost(e.reply):
                # The TLS session broke (EOF, timeout) before anyone was accepted: as a
                # failed handshake, once more in plaintext (RFC 7435 §3; Postfix too).
                raise TlsFallback(f"the TLS session failed: {e.reply.text}") from e
            raise
        except BaseException:
            await self._quit()
            raise
        await self._release(cache, extensions)
        return result

    async def _release(self, cache: ConnectionCache | None, extensions: dict[str, str]) -> None:
        """Hand a reusable connection to the cache; QUIT any other."""
        smtp = self.smtp
        if cache is not None and smtp is not None and self.reusable and smtp.is_connected:
            idle = IdleSession(
                smtp, extensions, self.tls, self.tls_version, self.opened_at, None, self.tls_note
            )
            if cache.put(self._cache_key(), idle):
                self.smtp = None
                return
        await self._quit()

    async def _quit(self) -> None:
        smtp, self.smtp = self.smtp, None
        if smtp is not None:
            await quit_smtp(smtp, self.where())

    async def _transactions(self, extensions: dict[str, str]) -> DeliveryResult:
        """One transaction for the recipients, then one more on this connection for those
        a recipient limit left over (RFC 5321 §4.5.3.1.10), while each accepts someone and
        the connection stays usable; what is left then is in :attr:`carry` (also when a
        further transaction got only limit replies: a new connection may take them).

        Raises:
            NextMx: the first transaction failed before any recipient was accepted.
        """
        try:
            result = await self._transaction(extensions, self.recipients)
        except Desync as e:
            replies: dict[str, Reply] = {}
            self._desynced(e, self.recipients, replies)
            return self._result(replies)
        replies = dict(result.replies)
        while self.carry and self.reusable and self.smtp is not None and self.smtp.is_connected:
            pending, self.carry, self.reusable = self.carry, [], False
            log.info(
                "%s: recipient limit; %d recipient(s) in a further transaction",
                self.where(),
                len(pending),
            )
            try:
                more = await self._transaction(extensions, pending)
            except Desync as e:
                self._desynced(e, pending, replies)
                break
            except NextMx as e:
                # The connection failed before this one accepted anyone (e.g. closed after
                # the data): earlier transactions stand, these go in a new session.
                log.info("%s: %s; recipients left for a new session", self.where(), e.reply)
                replies.update(e.settled)
                self.carry = [r for r in pending if r.address not in e.settled]
                self.reusable = False
                break
            replies.update(more.replies)
            got = more.replies
            if all(r.address in got and too_many_recipients(got[r.address]) for r in pending):
                # A limit per connection, not per transaction: this connection took none of
                # them, a new one may (RFC 5321 §4.5.3.1.10). :func:`_rest` stops at the
                # first session that takes no one.
                self.carry = pending
                break
        return self._result(replies)

    def _desynced(self, e: Desync, pending: list[Recipient], replies: dict[str, Reply]) -> None:
        """A reply out of sync in the transaction of ``pending``: drop the connection;
        none of its replies count except ``e.replies`` (uncertain ones after a final dot).
        The rest are offered again on a fresh connection (:attr:`carry`), or, when this is
        that fresh connection, deferred with ``4.5.0``; ``replies`` gets their 4.5.0 in
        either case (kept when the fresh connection cannot be had). Sets
        :attr:`desynced_unsent` when this was before any final dot of the session's first
        transaction (or before it): :func:`~jsqueue.delivery.client.deliver` then tries a
        fresh connection and after it the next MX (RFC 5321 §5.1), never deferring the
        message at a server that cannot keep its replies in sync while another MX waits."""
        rest = [r for r in pending if r.address not in e.replies]
        self.desynced_unsent = not e.replies and len(rest) == len(self.recipients)
        log.warning(
            "%s: desynchronised reply detected before %s (unexpected %r); dropping the "
            "connection%s",
            self.where(),
            e.stage,
            e.data,
            ", retrying on a fresh one"
            if not self.fresh
            else ", trying the next MX"
            if self.desynced_unsent
            else "",
        )
        abort_connection(self.smtp)
        self.reusable = False
        replies.update(e.replies)
        detail = f"{self.where()}: desynchronised reply before {e.stage}"
        for r in rest:
            replies[r.address] = with_detail(R451_PROTOCOL_ERROR, detail)
        if not self.fresh and rest:
            self.carry, self.desynced = rest, True

    async def _transaction(
        self, extensions: dict[str, str], recipients: list[Recipient]
    ) -> DeliveryResult:
        plan = await plan_transaction(self.envelope, recipients, extensions, self.body, self.host)
        self.converted = self.converted or plan.converted
        self.dsn = self.dsn if plan.dsn is None else plan.dsn
        replies = plan.replies
        if plan.mail is None or plan.body is None or not plan.rcpts:
            return self._result(replies)
        if self.settings.pipelining and "pipelining" in extensions:
            return await pipelined_transaction(self, plan, recipients)  # RFC 2920

        def all_get(reply: Reply, addresses: Iterable[str]) -> DeliveryResult:
            for a in addresses:
                replies[a] = reply
            return self._result(replies)

        paths = [a for a, _ in plan.rcpts]
        try:
            mail = await self._command("MAIL", self.settings.mail_timeout_s, *plan.mail)
        except Failed as e:
            if isinstance(e.__cause__, ValueError):
                return all_get(with_detail(R501_BAD_REVERSE_PATH, str(e.__cause__)), paths)
            raise NextMx(e.reply) from e
        if mail.code == 421:
            raise NextMx(mail)
        if not mail.is_success:
            return all_get(mail, paths)

        accepted: list[str] = []
        by_address = {r.address: r for r in recipients}
        offered = plan.rcpts
        for index, (address, args) in enumerate(offered):
            try:
                reply = await self._command("RCPT", self.settings.rcpt_timeout_s, *args)
            except Failed as e:
                if isinstance(e.__cause__, ValueError):
                    replies[address] = with_detail(R501_BAD_FORWARD_PATH, str(e.__cause__))
                    continue
                # Lost, timed out, malformed: no body went out, so no recipient has the
                # message; those refused so far stay refused, the next MX gets the rest,
                # as when a pipelined group is answered short (RFC 2920 §3.1).
                raise NextMx(e.reply, refused(replies)) from e
            if reply.code == 421:  # the server closes the channel (RFC 5321 §3.8)
                raise NextMx(reply, refused(replies))
            # RFC 5321 §4.5.3.1.10: 452 (or a 552, to be treated as temporary) is never
            # a bounce; the server's recipient limit sends the rest in a further transaction.
            reply, limit = rcpt_reply(reply, self.host)
            if limit and accepted:
                # The limit is reached: the rest go in a further transaction.
                self.carry = [by_address[a] for a, _ in offered[index:]]
                for a, _ in offered[index:]:
                    replies[a] = reply
                break
            replies[address] = reply
            if reply.is_success:
                accepted.append(address)
        if not accepted:
            await check_sync(self.smtp, "the next command")  # the refusals stand only then
            return self._result(replies)
        return await self._data(plan.body, accepted, replies)

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
        except Failed as e:  # lost, timed out, malformed: no body went out (as 421 below)
            raise NextMx(e.reply, refused(replies)) from e
        if start.code == 421:  # no body went out: the next MX, as in the pipelined group;
            raise NextMx(start, refused(replies))  # the refusals stand (RFC 5321 §3.3)
        if start.code != 354:
            if not (start.is_temporary or start.is_permanent):
                start = with_detail(R451_PROTOCOL_ERROR, f"{self.where()}: {start.code} to DATA")
            return accepted_get(start)
        return await self._body(body, accepted, replies)

    async def _body(
        self, body: BodySource, accepted: list[str], replies: dict[str, Reply]
    ) -> DeliveryResult:
        """After ``354``: the body, dot-stuffed, then the final dot and its reply (RFC 5321
        §4.1.1.4); the accepted recipients get that reply (uncertain when none came).

        Raises:
            Desync: data out of sync before or after the final dot (:mod:`.sync`).
        """

        def accepted_get(reply: Reply) -> DeliveryResult:
            for a in accepted:
                replies[a] = reply
            return self._result(replies)

        s = self.settings
        assert self.smtp is not None and self.smtp.protocol is not None
        protocol = self.smtp.protocol
        stuffer = DotStuffer()
        iterator = body.open()
        held = b""  # the latest stuffed chunk: the last one goes out with the terminator
        dot_sent = False
        try:
            while True:
                try:
                    chunk = await anext(iterator)
                except StopAsyncIteration:
                    break
                except Exception as e:  # any failure of the body store aborts the transaction
                    log.warning("%s: body source failed during DATA: %r", self.where(), e)
                    abort_connection(self.smtp)
                    return accepted_get(with_detail(R451_BODY_UNAVAILABLE, repr(e)))
                out = stuffer.feed(chunk)
                if out and held:
                    protocol.write(held)
                    async with asyncio.timeout(s.data_block_timeout_s):
                        # FlowControlMixin's drain (aiosmtplib has no public drain): waits
                        # while the transport's write buffer is above its high-water mark.
                        await protocol._drain_helper()
                held = out or held
            await check_sync(self.smtp, "the final dot")  # else no dot: nothing delivered
            # The terminator is written (in one write with the last chunk: one system call
            # for a small message) and the reply awaited with no await in between, so the
            # reply cannot arrive before aiosmtplib expects it.
            protocol.write(held + stuffer.finish())
            dot_sent = True
            mark_dot_sent()  # a drain now waits for the reply (RFC 5321 §6.1)
            response = await protocol.read_response(timeout=s.data_final_timeout_s)
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
            abort_connection(self.smtp)
            failure = self._translate(e, "DATA")
            if not dot_sent:
                return accepted_get(failure.reply)
            return self._uncertain(accepted, replies, failure.reply)
        finally:
            await aclose(iterator)
        reply = to_reply(response, self.host)
        if reply.remote_host is None:  # a code no final reply has (1yz, 3yz): unusable
            abort_connection(self.smtp)
            return self._uncertain(accepted, replies, reply)
        try:
            await check_sync(self.smtp, "the next command")
        except Desync as e:  # which of the lines answered the dot is unknown
            detail = f"desynchronised reply to the final dot ({reply})"
            desync_reply = with_detail(R451_PROTOCOL_ERROR, f"{self.where()}: {detail}")
            uncertain = self._uncertain(accepted, {}, desync_reply)
            raise Desync(e.stage, e.data, dict(uncertain.replies)) from e
        self.reusable = reply.code != 421
        return accepted_get(reply)

    def _uncertain(
        self, accepted: list[str], replies: dict[str, Reply], failure: Reply
    ) -> DeliveryResult:
        """The final "." went out and no usable reply came back (connection lost, timeout,
        unreadable reply): the next hop may have taken the message (RFC 5321 §4.5.3.2.6,
        §6.1). The accepted recipients are deferred with ``failure`` and marked uncertain."""
        what = "outcome uncertain, the message may be delivered twice"
        log.warning("%s: no reply to the final dot (%s); %s", self.where(), failure, what)
        detail = "after the final dot: the message may have been delivered"
        reply = with_detail(failure, detail)
        if not reply.is_temporary:
            reply = with_detail(R451_PROTOCOL_ERROR, f"{failure}; {detail}")
        for a in accepted:
            replies[a] = reply
        self.uncertain.update(accepted)
        return self._result(replies)


def _lost(reply: Reply) -> bool:
    """Whether ``reply`` is our own for a connection lost or timed out (``4.4.2``), not a
    server's reply. Pure."""
    return reply.remote_host is None and reply.enhanced == R451_CONNECTION_LOST.enhanced
