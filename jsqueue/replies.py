"""SMTP replies jsqueue sends or synthesises, as one checked table (RFC 5321 §4.2, RFC 3463):
each constant is named ``R<code>_<MEANING>`` and its enhanced status code's class digit
matches the basic code's first digit (``tests/test_replies.py`` checks both); with the
:class:`Reply` model and the bound on what an entry keeps of one.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

#: Octets of reply text a queue entry keeps per recipient (:meth:`Reply.bounded`). Replies
#: are recorded in the entry of every recipient they answer, and the entry store takes
#: entries up to a fixed size (NATS's max_payload): 1 000 recipients answered with a long
#: multi-line reply each would not fit whole. The full text goes to the log line and the
#: event of the attempt; the entry, and the DSN made from it, keep its start.
STORED_REPLY_OCTETS = 512
#: Appended to a reply text cut by :meth:`Reply.bounded`.
CUT_MARKER = " [...]"


class TlsNote(BaseModel):
    """Which outbound TLS policy applied to the session a reply came from, and why TLS was
    or was not used (RFC 8461, RFC 7672, RFC 7435).

    ``policy`` is ``dane``, ``mta-sts enforce``, ``mta-sts testing``, ``opportunistic`` or
    ``manual`` (``worker.tls_policies``); ``result`` is ``success`` or an RFC 8460 §4.3
    result type (``certificate-host-mismatch``, ``validation-failure``, ``dnssec-invalid``
    ...), or ``none`` where no policy asked anything; ``detail`` says why in words.
    ``policy_id`` is the MTA-STS policy id, ``mx`` the MX host name of the session;
    ``earlier`` the notes of the sessions of the same attempt that failed before this one
    (other MXes, a failed handshake before a plaintext retry), for TLS reports.
    """

    model_config = ConfigDict(frozen=True)

    policy: str
    result: str = "none"
    detail: str = ""
    tls: bool = False
    mx: str | None = None
    policy_id: str | None = None
    earlier: tuple[TlsNote, ...] = ()

    def bounded(self, max_octets: int) -> TlsNote:
        """This note as a queue entry keeps it: ``detail`` cut to an eighth of
        ``max_octets`` (characters), ``earlier`` and ``mx`` (the reply's remote host)
        dropped; the attempt's event and log line keep the whole note. Pure and
        idempotent."""
        keep = max(0, max_octets // 8)
        if len(self.detail) <= keep and not self.earlier and self.mx is None:
            return self
        return self.model_copy(update={"detail": self.detail[:keep], "earlier": (), "mx": None})

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Fields at their default are left out of the JSON (entries keep one per reply)."""
        data: dict[str, Any] = handler(self)
        defaults = {"result": "none", "detail": "", "tls": False, "mx": None}
        for key, value in defaults.items():
            if key in data and data[key] == value:
                del data[key]
        for key in ("policy_id", "earlier"):
            if not data.get(key):
                data.pop(key, None)
        return data

    def __str__(self) -> str:
        used = "TLS" if self.tls else "no TLS"
        return f"{self.policy}: {used}; {self.detail}" if self.detail else f"{self.policy}: {used}"


class Reply(BaseModel):
    """An SMTP reply: basic code, enhanced status code, text, and who sent it.

    ``text`` keeps every line of a multi-line reply, joined with ``\\n`` (RFC 5321 §4.2.1).
    ``remote_host`` is the MX host name (or address) that answered; None when jsqueue
    synthesised the reply itself (DNS failure, timeout, expiry).
    """

    model_config = ConfigDict(frozen=True)

    code: int = Field(ge=200, le=599)
    enhanced: str | None = None
    text: str = ""
    remote_host: str | None = None
    #: the TLS policy of the session that gave (or caused) the reply; None when none ran
    tls: TlsNote | None = None
    #: the code and enhanced code as the server sent them (``"552 5.2.2"``) when the reply
    #: is recorded under another code (RFC 5321 §4.5.3.1.10: a 552 to RCPT is taken as
    #: 452, temporary); None when recorded as sent. A DSN's Diagnostic-Code shows these
    #: (RFC 3464 §2.3.6: the code the remote MTA issued). Left out of the JSON when None.
    sent: str | None = Field(None, exclude_if=lambda v: v is None)

    @property
    def is_permanent(self) -> bool:
        """5yz: permanent negative completion (RFC 5321 §4.2.1)."""
        return self.code >= 500

    @property
    def is_temporary(self) -> bool:
        """4yz: transient negative completion (RFC 5321 §4.2.1)."""
        return 400 <= self.code < 500

    @property
    def is_success(self) -> bool:
        """2yz: positive completion (RFC 5321 §4.2.1)."""
        return 200 <= self.code < 300

    def bounded(self, max_octets: int = STORED_REPLY_OCTETS) -> Reply:
        """This reply with a text of at most ``max_octets`` octets of UTF-8, as a queue
        entry keeps it.

        A longer text (the lines of a multi-line reply joined with ``\\n``, RFC 5321
        §4.2.1) is cut at a character boundary, never inside a UTF-8 sequence, and ends in
        :data:`CUT_MARKER`; when not even one octet of text fits beside the marker, the
        text is the marker alone (``[...]``). Code, enhanced code and remote host are kept.
        Pure and idempotent: a bounded reply is returned unchanged.

        Args:
            max_octets: the longest text kept, octets (>= 0).

        Returns:
            ``self`` when its text fits, else a copy with the cut text.
        """
        note = self.tls.bounded(max_octets) if self.tls is not None else None
        data = self.text.encode("utf-8")
        if len(data) <= max_octets:
            return self if note is self.tls else self.model_copy(update={"tls": note})
        head = data[: max(0, max_octets - len(CUT_MARKER))].decode("utf-8", "ignore").rstrip()
        text = head + CUT_MARKER if head else CUT_MARKER.strip()
        return self.model_copy(update={"text": text, "tls": note})

    def __str__(self) -> str:
        lines = self.text.split("\n") if self.text else [""]
        prefix = f"{self.code} {self.enhanced} " if self.enhanced else f"{self.code} "
        return " ".join(prefix + line if i == 0 else line for i, line in enumerate(lines)).strip()


def _r(code: int, enhanced: str, text: str) -> Reply:
    return Reply(code=code, enhanced=enhanced, text=text)


# Front end (RFC 5321 §4.2.2, RFC 3463 §3)
R250_SENDER_OK = _r(250, "2.1.0", "Sender OK")
R250_RECIPIENT_OK = _r(250, "2.1.5", "Recipient OK")
R451_LOCAL_ERROR = _r(451, "4.3.0", "Requested action aborted: local error in processing")
R421_SHUTTING_DOWN = _r(421, "4.3.2", "Service shutting down, try again later")
R421_TOO_MANY_SESSIONS = _r(421, "4.7.0", "Too many connections, try again later")
R452_TOO_MANY_RECIPIENTS = _r(452, "4.5.3", "Too many recipients")
R452_STORAGE_FULL = _r(452, "4.3.1", "Insufficient system storage, try again later")
R501_BAD_REVERSE_PATH = _r(501, "5.1.7", "Bad sender address syntax")
R501_BAD_FORWARD_PATH = _r(501, "5.1.3", "Bad recipient address syntax")
R501_BAD_PARAMETER = _r(501, "5.5.4", "Invalid command arguments")
R503_BAD_SEQUENCE = _r(503, "5.5.1", "Bad sequence of commands")
R550_BARE_LINE_ENDING = _r(550, "5.6.11", "Bare CR or LF in message content is not accepted")
R552_TOO_BIG = _r(552, "5.3.4", "Message size exceeds fixed maximum message size")
R553_BAD_MAILBOX = _r(553, "5.1.3", "Mailbox name not allowed")
R554_RELAY_DENIED = _r(554, "5.7.1", "Relay access denied")
R535_AUTH_FAILED = _r(535, "5.7.8", "Authentication credentials invalid")
R538_ENCRYPTION_REQUIRED = _r(538, "5.7.11", "Encryption required for requested authentication")
# Front end, continued (jsqueue/frontend/)
R250_QUEUED = _r(250, "2.0.0", "queued as")  # the queue id follows the text
R235_AUTH_OK = _r(235, "2.7.0", "Authentication successful")
R421_TIMEOUT = _r(421, "4.4.2", "Idle timeout exceeded, closing connection")
R421_LOCAL_ERROR = _r(421, "4.3.0", "Local error in processing, closing connection")
R421_DATA_TOO_SOON = _r(
    421, "4.5.0", "Message sent before the DATA reply, closing connection (RFC 2920 3.1)"
)
R421_TOO_MUCH_JUNK = _r(421, "4.7.0", "Too many commands without mail, closing connection")
R421_TOO_MANY_ERRORS = _r(421, "4.7.0", "Too many errors, closing connection")
R500_DATA_LINE_TOO_LONG = _r(500, "5.5.2", "Message has a line longer than 998 octets")
R554_TOO_MANY_HOPS = _r(554, "5.4.6", "Too many Received: header fields: mail loop")
R550_NO_POSTMASTER = _r(550, "5.1.1", "No postmaster mailbox here (smtp.postmaster is not set)")
R502_NOT_IMPLEMENTED = _r(502, "5.5.1", "Command not implemented")
R503_ALREADY_AUTHENTICATED = _r(503, "5.5.1", "Already authenticated")
R503_TLS_ACTIVE = _r(503, "5.5.1", "TLS already active")
R503_NEED_HELO = _r(503, "5.5.1", "Send EHLO or HELO first")
R503_NEED_MAIL = _r(503, "5.5.1", "Need MAIL command first")
R503_NEED_RCPT = _r(503, "5.5.1", "Need RCPT command first")
R503_NESTED_MAIL = _r(503, "5.5.1", "Sender already given")
R504_AUTH_MECHANISM = _r(504, "5.5.4", "Unrecognized authentication type")
R553_SMTPUTF8_REQUIRED = _r(553, "5.6.7", "Non-ASCII address needs SMTPUTF8 on MAIL FROM")
R555_UNKNOWN_PARAMETER = _r(555, "5.5.4", "MAIL FROM/RCPT TO parameter not recognized")
R500_SYNTAX_ERROR = _r(500, "5.5.2", "Syntax error, command unrecognized")
R501_BAD_BASE64 = _r(501, "5.5.2", "Cannot decode base64")
R501_BAD_PLAIN_CREDENTIALS = _r(501, "5.5.2", "Cannot split PLAIN credentials")
R530_STARTTLS_REQUIRED = _r(530, "5.7.0", "Must issue a STARTTLS command first")
#: The enhanced code a reply worded by aiosmtpd itself gets (RFC 2034 §4): that of the
#: constant here with the same basic code; any other basic code gets ``<class>.0.0``.
_GENERIC = (
    R500_SYNTAX_ERROR,
    R501_BAD_PARAMETER,
    R502_NOT_IMPLEMENTED,
    R503_BAD_SEQUENCE,
    R504_AUTH_MECHANISM,
    R530_STARTTLS_REQUIRED,
    R535_AUTH_FAILED,
    R538_ENCRYPTION_REQUIRED,
    R552_TOO_BIG,
    R553_BAD_MAILBOX,
    R555_UNKNOWN_PARAMETER,
)
_GENERIC_ENHANCED = {r.code: r.enhanced for r in _GENERIC}


def generic_enhanced(code: int) -> str:
    """The enhanced status code for a reply with basic ``code`` that carries none.

    Args:
        code: a basic reply code, 200..599.

    Returns:
        the enhanced code of the front-end constant in :data:`_GENERIC` with that basic code,
        else ``<first digit>.0.0`` (RFC 3463 §3.1: "other or undefined status").
    """
    return _GENERIC_ENHANCED.get(code) or f"{str(code)[0]}.0.0"


# Front-end replies that carry no enhanced status code (RFC 2034 §4: not the greeting, not
# HELO/EHLO, not 3yz), so they are plain text, outside the checked table above.
#: RFC 5321 §4.1.1.4, §4.2.2: the go-ahead after DATA.
R354_START_INPUT = "354 End data with <CR><LF>.<CR><LF>"


def helo_reply(domain: str) -> str:
    """The reply to HELO: ``250 <domain>`` (RFC 5321 §4.1.1.1)."""
    return f"250 {domain}"


def ehlo_reply(domain: str, keywords: list[str]) -> str:
    """The reply to EHLO: our domain, then one extension keyword per line, CRLF-joined
    (RFC 5321 §4.1.1.1, §4.2.1: ``250-`` on every line but the last)."""
    lines = [domain, *keywords]
    return "\r\n".join(f"250{'-' if i < len(lines) - 1 else ' '}{ln}" for i, ln in enumerate(lines))


# Synthesised by the worker for failures without a remote reply (RFC 3463 §3.2, §3.5, RFC 7505)
R550_NULL_MX = _r(550, "5.1.10", "Recipient domain does not accept mail (null MX, RFC 7505)")
R550_NO_SUCH_DOMAIN = _r(550, "5.1.2", "Recipient domain does not exist (NXDOMAIN)")
R451_DNS_TEMPFAIL = _r(451, "4.4.3", "Temporary DNS failure looking up the recipient domain")
R451_CONNECT_FAILED = _r(451, "4.4.1", "No answer from any mail exchanger of the domain")
#: Deferred without connecting: the site is a dead site until its cool-off ends (RFC 5321
#: §4.5.4.1); jsqueue.destinations appends "site <site> down until <time>".
R451_SITE_DOWN = _r(451, "4.4.1", "Delivery to this site is suspended")
R451_CONNECTION_LOST = _r(451, "4.4.2", "Connection to the mail exchanger was lost")
R451_PROTOCOL_ERROR = _r(451, "4.5.0", "Protocol error in the remote reply")
R451_TLS_REQUIRED = _r(451, "4.7.5", "TLS required by policy but could not be established")
R554_SIZE_EXCEEDED = _r(554, "5.3.4", "Message too big for the destination (SIZE)")
R554_SMTPUTF8_REQUIRED = _r(554, "5.6.7", "Destination does not support SMTPUTF8 (RFC 6531)")
R554_8BIT_UNSUPPORTED = _r(554, "5.6.3", "Destination does not support 8-bit content")
R554_LOOPS_BACK = _r(554, "5.4.6", "Mail loops back to myself")
R550_MX_HOST_NOT_FOUND = _r(550, "5.4.4", "No address found for any mail exchanger of the domain")
R451_TIMEOUT = _r(451, "4.4.2", "Timed out waiting for the mail exchanger")
R451_AUTH_FAILED = _r(451, "4.7.8", "Authentication with the relay host failed")
R451_BODY_UNAVAILABLE = _r(451, "4.3.0", "The message body could not be read; delivery aborted")
R451_EXPIRED = _r(451, "4.4.7", "Message expired in the queue")
# The same failures on the hop to the smarthost (``worker.smarthost``), worded for it: the
# relay is one configured host, not the destination's mail exchangers (RFC 3463 §3.5).
R451_SMARTHOST_CONNECT_FAILED = _r(451, "4.4.1", "No answer from the smarthost")
R451_SMARTHOST_CONNECTION_LOST = _r(451, "4.4.2", "Connection to the smarthost was lost")
R451_SMARTHOST_TIMEOUT = _r(451, "4.4.2", "Timed out waiting for the smarthost")
R451_SMARTHOST_DNS = _r(451, "4.4.3", "Temporary DNS failure looking up the smarthost")

# Operator actions (jsqueue/admin.py): a 5yz so the DSN reports a failure, not an expiry
R550_BOUNCED_BY_POSTMASTER = _r(550, "5.7.1", "Message bounced by the postmaster")
