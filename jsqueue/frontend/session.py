"""The aiosmtpd session of the front end: one :class:`InboundSession` per SMTP connection.

It overrides only what jsqueue does differently from :class:`aiosmtpd.smtp.SMTP`: EHLO/HELO
(capabilities), MAIL/RCPT (paths and parameters via :mod:`jsqueue.frontend.syntax`, relay
control, recipient limit), DATA (decoding via :mod:`jsqueue.frontend.data`, storing via
:mod:`jsqueue.frontend.ingest`, exactly one reply after the terminator), AUTH (via
:mod:`jsqueue.frontend.auth`), STARTTLS, admission, the idle timeout and the shutdown
``421``. Every reply comes from :mod:`jsqueue.replies`; replies worded by aiosmtpd itself get
an enhanced status code on the way out (RFC 2034 §4). The protocol choices are described in
docs/architecture.md, "The SMTP front end"; tests/test_frontend_aiosmtpd.py checks that every
private aiosmtpd name used here still exists.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import ipaddress
import logging
from collections import defaultdict, deque
from typing import TYPE_CHECKING

from aiosmtpd.smtp import SMTP, syntax

from jsqueue.envelope import Recipient, utcnow
from jsqueue.frontend.auth import login_credentials, plain_credentials
from jsqueue.frontend.data import DataDecoder
from jsqueue.frontend.ingest import NotQueued, Submission
from jsqueue.frontend.received import (
    protocol_keyword,
    received_header,
    stored_helo,
    tls_description,
)
from jsqueue.frontend.syntax import (
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
from jsqueue.frontend.transaction import (
    CommandReader,
    ErrorCount,
    ExceptionHook,
    Transaction,
    client_ip,
    data_refusal,
)
from jsqueue.frontend.wire import (
    as_closing,
    commands_in,
    is_closing,
    printable,
    reply_line,
    with_enhanced_code,
)
from jsqueue.names import new_queue_id
from jsqueue.replies import (
    R235_AUTH_OK,
    R250_QUEUED,
    R250_RECIPIENT_OK,
    R250_SENDER_OK,
    R354_START_INPUT,
    R421_LOCAL_ERROR,
    R421_SHUTTING_DOWN,
    R421_TIMEOUT,
    R421_TOO_MANY_ERRORS,
    R421_TOO_MANY_SESSIONS,
    R452_TOO_MANY_RECIPIENTS,
    R501_BAD_BASE64,
    R501_BAD_PARAMETER,
    R502_NOT_IMPLEMENTED,
    R503_ALREADY_AUTHENTICATED,
    R503_BAD_SEQUENCE,
    R503_NEED_MAIL,
    R503_NESTED_MAIL,
    R503_TLS_ACTIVE,
    R504_AUTH_MECHANISM,
    R535_AUTH_FAILED,
    R538_ENCRYPTION_REQUIRED,
    R552_TOO_BIG,
    R554_RELAY_DENIED,
    R555_UNKNOWN_PARAMETER,
    Reply,
    ehlo_reply,
    helo_reply,
)

if TYPE_CHECKING:
    from jsqueue.frontend.server import SmtpServer

log = logging.getLogger(__name__)

#: Queue ids a session remembers as its own (an identical message later in the same
#: session is a message of its own, never a resend; RFC 5321 §6.1).
MINE = 1000
#: Octets read from the socket per step while receiving DATA.
READ_SIZE = 64 * 1024
#: Longest MAIL/RCPT/AUTH command line accepted after EHLO (RFC 5321 §4.5.3.1.4 allows
#: extensions to raise the 512 limit: SIZE, SMTPUTF8, RET/ENVID/AUTH, ORCPT/NOTIFY).
EXTENDED_COMMAND_LIMIT = 1000


class InboundSession(SMTP):
    """One inbound SMTP connection (RFC 5321 server side) on the front end's event loop.

    Overrides aiosmtpd's EHLO/HELO/MAIL/RCPT/DATA/AUTH/STARTTLS commands and the connection
    hooks that admission, the idle timeout and shutdown need; everything else (RSET, NOOP,
    QUIT, VRFY, HELP, the command loop) is aiosmtpd's.
    """

    def __init__(self, server: SmtpServer) -> None:
        """Args:
        server: the front end that accepted the connection (settings, TLS context, users,
            ingest path, admission).
        """
        s = server.settings
        super().__init__(
            ExceptionHook(),
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
        # Resend protection (jsqueue.frontend.ingest): the content key and queue id of the
        # last 250 until the client sends a further command, and the forget that follows.
        self._queued: tuple[str, str] | None = None
        self._unconfirmed: tuple[str, str] | None = None
        self._pipelined = 0  # commands already received when the 250 went out
        self._mine: deque[str] = deque(maxlen=MINE)  # queued in this session: no resends
        self._forgetting: asyncio.Task[None] | None = None
        self._errors = ErrorCount(s.soft_error_limit, s.hard_error_limit, s.error_delay_s)

    # -- connection bookkeeping ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        first = self.transport is None and self._original_transport is None
        super().connection_made(transport)
        if first:
            self._ip = client_ip(transport.get_extra_info("peername"))
            self._refused = not self._server.admit(self, self._ip)

    def connection_lost(self, error: Exception | None) -> None:
        if not self._released:
            self._released = True
            self._server.release(self)
        super().connection_lost(error)

    def eof_received(self) -> bool | None:
        """The client shut down its sending side: the commands it sent before are still
        answered, and a message already terminated is stored before its 250 (``nc -N``,
        scripts; as Postfix's smtpd), where aiosmtpd stopped the session at once. The
        command loop then ends (:class:`CommandReader`). Over TLS, which has no half-close,
        as aiosmtpd."""
        if self.session is None or self.session.ssl is not None:
            return super().eof_received()
        log.info("%r end of input", self.session.peer)
        return asyncio.StreamReaderProtocol.eof_received(self)  # feed EOF, keep writing

    async def _handle_client(self) -> None:
        # aiosmtpd builds its reader inline; ours ends the command loop at the client's EOF.
        CommandReader.adopt(self._reader, self._settings.max_junk_commands, self._close_with)
        if self._refused:
            await self._reply(R421_TOO_MANY_SESSIONS)
            self._close()
            return
        await super()._handle_client()

    def _timeout_cb(self) -> None:
        log.info("%r idle timeout", self.session.peer if self.session else None)
        if self.transport is not None and not self.transport.is_closing():
            self._close_with(R421_TIMEOUT)

    def _create_envelope(self) -> Transaction:
        return Transaction()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _close_with(self, reply: Reply) -> None:
        """Send ``reply`` (a 421, RFC 5321 §3.8) and close, without yielding to the loop."""
        self._log_rejection(str(reply))
        self._writer.write(f"{reply}\r\n".encode())
        self._close()

    def _transaction(self) -> Transaction:
        # A method, not a property: aiosmtpd's __init__ evaluates every attribute
        # (inspect.getmembers) before the first envelope exists.
        assert isinstance(self.envelope, Transaction)
        return self.envelope

    def begin_shutdown(self) -> None:
        """Close with ``421 4.3.2`` now if idle, else right after the current transaction's
        reply (RFC 5321 §3.8). Idempotent."""
        if not self._busy and self.transport is not None and not self.transport.is_closing():
            self._writer.write(f"{R421_SHUTTING_DOWN}\r\n".encode())
            self._close()

    def abort(self) -> None:
        """Drop the connection without another word (shutdown bound exceeded). Idempotent."""
        if isinstance(self.transport, asyncio.WriteTransport):
            self.transport.abort()

    async def push(self, status: str | bytes) -> None:
        """Send one reply; str replies get an enhanced status code (RFC 2034 §4).

        The line is cut to printable US-ASCII of at most 510 octets before CRLF (RFC 5321
        §4.2, §4.5.3.1.5): some replies quote client input.

        Args:
            status: one reply (lines CRLF-joined) without the final CRLF; bytes go out as
                they are.

        Raises:
            ConnectionError: the client has gone (raised by the transport's drain).
            ConnectionResetError: the reply was the session's ``smtp.hard_error_limit``-th
                error (:class:`ErrorCount`): ``421 4.7.0`` went out, the connection is closed.
        """
        self._confirm()
        if self._forgetting is not None and is_closing(status):
            # QUIT: the forget is done before the 221, so a connection the client opens
            # next finds the earlier copy's protection ended.
            await asyncio.wait({self._forgetting})
        self._log_rejection(status)
        if pause_s := self._errors.add(status):  # past smtp.soft_error_limit
            await asyncio.sleep(pause_s)
        if isinstance(status, bytes):
            await super().push(status)
        else:  # RFC 2034 §4: the greeting (and the STARTTLS 220) carry no enhanced code.
            status = status if status.startswith("220") else with_enhanced_code(as_closing(status))
            await super().push(printable(status))
        if self._errors.exceeded:  # smtp.hard_error_limit: as Postfix's, 421 and close
            self._close_with(R421_TOO_MANY_ERRORS)
            self._reader._buffer.clear()  # type: ignore[attr-defined]  # pipelined: not run
            raise ConnectionResetError("too many errors")

    def _log_rejection(self, status: str | bytes) -> None:
        """Every 4yz/5yz reply a session sends (RFC 5321 §4.2.1: a refusal of a command,
        relay denied, too many recipients, storage failures, bare line endings, sizes,
        syntax, AUTH) is one log line with the client address and the transaction so far,
        and one count by reply code (``jsqueue_smtp_rejections_total{code}``)."""
        text = status if isinstance(status, str) else status.decode("ascii", "replace")
        code = text[:3]
        if not (code.isdigit() and code[0] in "45"):
            return
        txn = self.envelope if isinstance(self.envelope, Transaction) else None
        sender = txn.reverse_path if txn is not None else None
        log.info(
            "smtp rejection client=%s reply=%r from=%s rcpts=%d",
            self._ip or "-",
            text.split("\r\n", 1)[0][:200],
            "-" if sender is None else f"<{sender}>",
            len(txn.recipients) if txn is not None else 0,
            extra={"client": str(self._ip) if self._ip else None, "code": int(code)},
        )
        if self._server.on_reject is not None:
            self._server.on_reject(int(code))

    def _confirm(self) -> None:
        """A further command came after a ``250`` for a message (every command is answered
        through :meth:`push`, or through EHLO/HELO, which call this too): the client saw
        that 250, so its resend protection ends, in the background; not those already
        received when the 250 went out (RFC 2920 §3.1). A session that breaks right after a
        250 never gets here and keeps it (:meth:`Ingest.forget`)."""
        if self._unconfirmed is None:
            return
        if self._pipelined:  # sent in the same group as the data: not after the 250
            self._pipelined -= 1
            return
        key, queue_id = self._unconfirmed
        self._unconfirmed = None
        self._forgetting = self._server.spawn(self._server.ingest.forget(key, queue_id))

    async def _reply(self, reply: Reply, detail: str | None = None) -> None:
        await self.push(reply_line(reply, detail))

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

    # -- commands -----------------------------------------------------------------------

    @syntax("EHLO hostname")
    async def smtp_EHLO(self, hostname: str | None) -> None:
        """RFC 5321 §4.1.1.1; capabilities: PIPELINING (RFC 2920), SIZE (RFC 1870), 8BITMIME
        (RFC 6152), SMTPUTF8 (RFC 6531), ENHANCEDSTATUSCODES (RFC 2034), DSN (RFC 3461),
        STARTTLS (RFC 3207) before TLS, AUTH (RFC 4954) inside it."""
        self._confirm()
        if not hostname:
            await self._reply(R501_BAD_PARAMETER, "Syntax: EHLO hostname")
            return
        assert self.session is not None
        self._set_rset_state()  # type: ignore[no-untyped-call]  # unannotated in aiosmtpd
        self.session.extended_smtp = True
        self.session.host_name = hostname
        caps = [
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
        # Past our push: no enhanced codes in EHLO (RFC 2034 §4).
        await SMTP.push(self, ehlo_reply(self.hostname, caps))

    @syntax("HELO hostname")
    async def smtp_HELO(self, hostname: str | None) -> None:
        """RFC 5321 §4.1.1.1: plain SMTP, no extensions."""
        self._confirm()
        if not hostname:
            await self._reply(R501_BAD_PARAMETER, "Syntax: HELO hostname")
            return
        assert self.session is not None
        self._set_rset_state()  # type: ignore[no-untyped-call]  # unannotated in aiosmtpd
        self.session.extended_smtp = False
        self.session.host_name = hostname
        await SMTP.push(self, helo_reply(self.hostname))

    @syntax("STARTTLS", when="tls_context")
    async def smtp_STARTTLS(self, arg: str | None) -> None:
        """RFC 3207; without TLS settings 502, and a second STARTTLS inside TLS is refused.

        Plaintext pipelined behind STARTTLS is thrown away when TLS starts (RFC 3207 §4.2:
        aiosmtpd clears its read buffer) and the session starts over.
        """
        if self.tls_context is None:
            await self._reply(R502_NOT_IMPLEMENTED)
            return
        if self._tls_active:
            await self._reply(R503_TLS_ACTIVE)
            return
        await super().smtp_STARTTLS(arg)

    @property
    def auth_offered(self) -> bool:
        """Whether AUTH can be used here (an auth file is set); HELP lists it only then."""
        return self._server.users is not None

    @syntax("AUTH <mechanism> [initial-response]", when="auth_offered")
    async def smtp_AUTH(self, arg: str | None) -> None:
        """RFC 4954 with PLAIN (RFC 4616) and LOGIN, only inside TLS and with an auth file."""
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
            await self._reply(R501_BAD_BASE64)
            return None

    async def _auth_plain(self, initial: str | None) -> tuple[str, bytes] | None:
        blob = await self._response(initial, "")
        return None if blob is None else await self._credentials(plain_credentials(blob))

    async def _auth_login(self, initial: str | None) -> tuple[str, bytes] | None:
        raw_user = await self._response(initial, "Username:")
        password = None if raw_user is None else await self._response(None, "Password:")
        if raw_user is None or password is None:
            return None
        return await self._credentials(login_credentials(raw_user, password))

    async def _credentials(self, got: tuple[str, bytes] | Reply) -> tuple[str, bytes] | None:
        if isinstance(got, Reply):
            await self._reply(got)
            return None
        return got

    @syntax("MAIL FROM: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_MAIL(self, arg: str | None) -> None:
        """RFC 5321 §4.1.1.2 with SIZE (RFC 1870), BODY (RFC 6152), SMTPUTF8 (RFC 6531 §3.4),
        RET and ENVID (RFC 3461 §4.3, §4.4) and AUTH (RFC 4954 §5) parameters.

        Raises:
            SyntaxProblem: never out of this method: raised for a malformed, unsupported
                or too large parameter and answered here with its reply.
            ConnectionError: the client has gone while the reply was sent.
        """
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
        """RFC 5321 §4.1.1.3 with NOTIFY and ORCPT (RFC 3461 §4.1, §4.2); relay control
        (RFC 5321 §3.6.2) and the recipient limit (§4.5.3.1.10).

        Raises:
            SyntaxProblem: never out of this method: raised for a malformed or unsupported
                parameter or a refused relay and answered here with its reply.
            ConnectionError: the client has gone while the reply was sent.
        """
        if await self.check_helo_needed():
            return
        assert self.session is not None
        txn = self._transaction()
        if txn.reverse_path is None:
            await self._reply(R503_NEED_MAIL)
            return
        try:
            cmd = parse_rcpt_to(arg, self._settings.postmaster, self.hostname)
            if cmd.params and not self.session.extended_smtp:
                raise SyntaxProblem(R555_UNKNOWN_PARAMETER, "Parameters need EHLO")
            require_utf8_allowed(cmd.path, txn.smtputf8)
            # RFC 5321 §4.5.1: the postmaster is this system's own mailbox, open to anyone
            if not cmd.postmaster and not self._may_relay():
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
        """RFC 5321 §4.1.1.4: receive, store, then exactly one reply; pipelined commands
        after the terminator are executed next (RFC 2920 §3.1). After a refusal, a message
        sent without waiting for it is never run as commands (CommandReader.data_refused)."""
        txn = self._transaction()
        helo = bool(self.session and self.session.host_name)
        if (refusal := data_refusal(txn, arg, helo=helo)) is not None:
            await self._reply(refusal)
            assert isinstance(self._reader, CommandReader)
            self._reader.data_refused(self._smtp_methods, self._close_with)
            return
        self._busy = True
        reply: str | None = None
        try:
            try:
                reply = await self._receive(txn)
            finally:
                self._busy = False
            if reply is not None:  # before the reset: a refusal's log line names the envelope
                await self.push(reply)
        finally:
            self._set_post_data_state()  # type: ignore[no-untyped-call]  # unannotated in aiosmtpd
        if reply is None:
            return
        if self._server.draining:
            await self._reply(R421_SHUTTING_DOWN)
            self._close()
        elif self._queued is not None:  # a 250: protected until a further command comes
            self._unconfirmed, self._queued = self._queued, None
            # pipelined behind the data: sent before the 250 could be seen (RFC 2920 §3.1)
            self._pipelined = commands_in(self._reader._buffer)  # type: ignore[attr-defined]

    async def _receive(self, txn: Transaction) -> str | None:
        """Read the message after 354 and store it; the reply, or None if already closed.

        Raises:
            ConnectionResetError: the client closed the connection during DATA (the upload
                is aborted).
            ConnectionError: the client's connection failed while the 354 went out or the
                message was read (an upload begun is aborted).
            CancelledError: the task was cancelled (re-raised after cleanup: the upload is
                aborted).
        """
        assert txn.reverse_path is not None
        await self.push(R354_START_INPUT)
        queue_id = new_queue_id()
        settings = self._settings
        upload = self._server.ingest.upload(queue_id)
        decoder = DataDecoder(
            max_size=settings.max_message_size,
            bare_line_endings=settings.bare_line_endings,
            max_received=settings.max_received,
        )
        content = hashlib.sha256()
        received = received_header(
            helo=self.session.host_name if self.session else None,
            client_ip=str(self._ip or "0.0.0.0"),
            hostname=self.hostname,
            protocol=protocol_keyword(
                extended=bool(self.session and self.session.extended_smtp),
                smtputf8=txn.smtputf8,
                tls=self._tls_active,
                authenticated=self._auth_user is not None,
            ),
            queue_id=queue_id,
            recipient=txn.recipients[0].address if len(txn.recipients) == 1 else None,
            tls=tls_description(self.session.ssl if self._tls_active and self.session else None),
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
        # Storing is bounded by store_timeout_s; the idle timer must not cut it short.
        if self._timeout_handle is not None:
            self._timeout_handle.cancel()
        mail = Submission(
            reverse_path=txn.reverse_path,
            recipients=txn.recipients,
            content_sha256=content.digest(),
            ret=txn.ret,
            envid=txn.envid,
            smtputf8=txn.smtputf8,
            helo=stored_helo(helo) if (helo := self.session and self.session.host_name) else None,
            client_address=str(self._ip) if self._ip else None,
            auth_user=self._auth_user,
            eight_bit=decoder.eight_bit or not received.isascii(),
        )
        if self._forgetting is not None and not self._forgetting.done():
            # An earlier 250 of this session is forgotten before this claim (bounded by
            # store_timeout_s), so the same transaction sent again here is new mail.
            await asyncio.wait({self._forgetting})
        try:
            queued = await self._server.ingest.commit(upload, mail, self._mine)
        except NotQueued as e:
            return reply_line(e.reply)
        finally:
            self._reset_timeout()
        key = self._server.ingest.key_for(mail)
        self._queued = (key, queued) if key is not None else None
        self._mine.append(queued)
        self._errors.count = 0  # the limits count errors made without delivering mail
        return reply_line(R250_QUEUED, f"{R250_QUEUED.text} {queued}")
