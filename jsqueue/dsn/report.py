"""Building delivery status notifications (RFC 3464 inside an RFC 6522 multipart/report),
pure and without I/O: who one DSN about a failure, delay or success lists
(:func:`recipients_to_report`, honouring RFC 3461 NOTIFY and never reporting mail from
``<>``, RFC 5321 §4.5.5), and the DSN itself as CRLF bytes (:func:`build_dsn`: a
human-readable part, the ``message/delivery-status`` fields of RFC 3464 §2.2 / §2.3 with
RFC 3463 status codes, and the returned content of RFC 3461 §4.3 RET); the decisions taken
(dates, status synthesis, diagnostic types, address types, returned content) are listed in
docs/architecture.md (Operations and DSNs).
"""

from __future__ import annotations

import base64
import email.policy
import ipaddress
import quopri
import re
import textwrap
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from email.parser import BytesParser
from email.utils import format_datetime
from enum import StrEnum

from jsqueue.envelope import Entry, Notify, Recipient, RecipientState, utf8_addr_xtext
from jsqueue.replies import Reply

DEFAULT_NOTIFY = frozenset({Notify.FAILURE, Notify.DELAY})
"""NOTIFY assumed when the client gave none (RFC 3461 §4.1)."""

DIAGNOSTIC_TYPE_LOCAL = "X-jsqueue"
"""RFC 3464 §2.3.6 diagnostic-type for replies jsqueue synthesised itself."""

_MAX_LINE = 78  # RFC 5322 §2.1.1 recommended line length
_MAX_LINE_OCTETS = 998  # RFC 5322 §2.1.1 limit, CRLF excluded
_HARD_WORD = 900  # split words longer than this: RFC 5322 §2.1.1 limits lines to 998 octets
_ENHANCED_RE = re.compile(r"^[245]\.\d{1,3}\.\d{1,3}$")
_CTL_RE = re.compile(r"[\x00-\x1f\x7f]")
_NEWLINE_RE = re.compile(rb"\r?\n")
_FIELD_LINE_RE = re.compile(rb"[\x21-\x39\x3b-\x7e]+[ \t]*:")  # RFC 5322 §3.6.8 field-name


class DsnEvent(StrEnum):
    """What happened to the recipients a DSN reports (RFC 3461 §4.1 NOTIFY conditions)."""

    FAILURE = "failure"
    DELAY = "delay"
    SUCCESS = "success"


class Action(StrEnum):
    """RFC 3464 §2.3.3 Action values."""

    FAILED = "failed"
    DELAYED = "delayed"
    DELIVERED = "delivered"
    RELAYED = "relayed"
    EXPANDED = "expanded"


_EVENT_NOTIFY = {
    DsnEvent.FAILURE: Notify.FAILURE,
    DsnEvent.DELAY: Notify.DELAY,
    DsnEvent.SUCCESS: Notify.SUCCESS,
}
_EVENT_STATES = {
    DsnEvent.FAILURE: frozenset({RecipientState.BOUNCED}),
    DsnEvent.DELAY: frozenset({RecipientState.DEFERRED}),
    DsnEvent.SUCCESS: frozenset({RecipientState.DELIVERED}),
}
_EVENT_ACTION = {
    DsnEvent.FAILURE: Action.FAILED,
    DsnEvent.DELAY: Action.DELAYED,
    DsnEvent.SUCCESS: Action.RELAYED,
}


def _utc(value: datetime, name: str) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be a timezone-aware datetime")
    return value.astimezone(UTC)


# --------------------------------------------------------------------------- selection


def wants_notice(recipient: Recipient, event: DsnEvent) -> bool:
    """Whether the recipient's NOTIFY asks for a DSN on ``event`` (RFC 3461 §4.1).

    NEVER suppresses everything; no NOTIFY means :data:`DEFAULT_NOTIFY`; SUCCESS is only
    reported when asked for explicitly.
    """
    notify = DEFAULT_NOTIFY if recipient.notify is None else recipient.notify
    if Notify.NEVER in notify:
        return False
    return _EVENT_NOTIFY[event] in notify


def recipients_to_report(
    entry: Entry,
    event: DsnEvent,
    *,
    now: datetime | None = None,
    delay_warning_after_s: float | None = None,
    delay_warning_interval_s: float = 86400.0,
) -> list[Recipient]:
    """Every recipient one DSN about ``event`` must list, in envelope order.

    Rules: nothing for the null reverse-path or for a DSN entry (RFC 5321 §4.5.5, RFC 3461
    §6.1: bounces never bounce); nothing for a recipient already reported
    (``dsn_sent``); NOTIFY as in :func:`wants_notice`. Per event:

    * FAILURE: recipients in state ``bounced`` (``failed`` means "no DSN owed").
    * DELAY: recipients in state ``deferred``, when warnings are enabled
      (``delay_warning_after_s`` set), the entry is at least that old, and the recipient was
      not warned within ``delay_warning_interval_s`` (``delay_notified_at``).
    * SUCCESS: recipients in state ``delivered``, except those delivered to a next hop
      that advertised DSN and received their NOTIFY/ORCPT (``next_hop_dsn``): it reports
      their success itself (RFC 3461 §5.2.1, §6.2.1), so neither ``delivered`` nor
      ``relayed`` comes from jsqueue.

    Args:
        entry: the queue entry, with the outcomes already recorded.
        event: which kind of DSN.
        now: current time, timezone-aware; required for DELAY.
        delay_warning_after_s: age of the entry, seconds, before the first delay warning;
            None disables delay warnings (``DsnSettings.delay_warning_after_s``).
        delay_warning_interval_s: seconds between repeated warnings for one recipient.

    Returns:
        the recipients to list; empty when no DSN is to be sent.

    Raises:
        ValueError: DELAY with warnings enabled but ``now`` missing or naive.
    """
    if entry.reverse_path == "" or entry.is_dsn:
        return []
    warn_cutoff: datetime | None = None
    if event is DsnEvent.DELAY:
        if delay_warning_after_s is None:
            return []
        if now is None:
            raise ValueError("now is required for delay warnings")
        now_utc = _utc(now, "now")
        if now_utc - entry.created_at < timedelta(seconds=delay_warning_after_s):
            return []
        warn_cutoff = now_utc - timedelta(seconds=delay_warning_interval_s)
    states = _EVENT_STATES[event]
    chosen = []
    for r in entry.recipients:
        if r.state not in states or r.dsn_sent or not wants_notice(r, event):
            continue
        if event is DsnEvent.SUCCESS and r.next_hop_dsn:
            continue
        if (
            warn_cutoff is not None
            and r.delay_notified_at is not None
            and r.delay_notified_at > warn_cutoff
        ):
            continue
        chosen.append(r)
    return chosen


def action_for(event: DsnEvent) -> Action:
    """The RFC 3464 §2.3.3 Action jsqueue reports for ``event``.

    FAILURE → failed, DELAY → delayed, SUCCESS → relayed (RFC 3461 §5.2.2: handed to a next
    hop that does not support DSN; jsqueue never performs final delivery itself, and a
    next hop that supports DSN reports success itself, see :func:`recipients_to_report`).
    """
    return _EVENT_ACTION[event]


def returns_full(entry: Entry, max_returned_size: int) -> bool:
    """Whether the DSN returns the full message (else only its headers).

    True only for ``RET=FULL`` (RFC 3461 §4.3) with ``entry.size`` <= ``max_returned_size``;
    no RET means headers only (our default). The caller reads the whole body when True and
    only the first chunks (see :func:`header_block`) otherwise.

    Args:
        entry: the queue entry.
        max_returned_size: the limit, octets (``DsnSettings.max_returned_size``).
    """
    return entry.ret == "FULL" and entry.size <= max_returned_size


def header_block(data: bytes, *, complete: bool = False) -> bytes | None:
    """The header section at the start of a message (RFC 5322 §2.1), as raw bytes.

    Works on the first chunk(s) of a body: no decoding happens, so 8-bit and UTF-8 headers
    (RFC 6532) pass through untouched. Line ends are normalised to CRLF. The section is
    the header fields and their folded continuation lines (RFC 5322 §2.2, §2.2.3); it ends
    at the empty line, or at the first line that is neither a field (``name:``) nor a
    continuation of one: a message whose body follows its fields without the empty line
    (or that starts with body text) must not have that text returned as headers
    (RFC 3461 §4.3: ``RET=HDRS`` returns the headers only).

    Args:
        data: a prefix of the message (or the whole message).
        complete: ``data`` is the whole message; a message without an empty line or a
            line of body text is then all header.

    Returns:
        the header lines, each ending in CRLF, without the empty separator line (``b""`` when
        the message starts with an empty line or with a line that is no header field);
        None when ``data`` ends before the header section does and ``complete`` is False
        (read more and call again).
    """
    lines: list[bytes] = []
    pos = 0
    while True:
        match = _NEWLINE_RE.search(data, pos)
        if match is None:
            if not complete:
                return None
            line = data[pos:]
            if line and _is_header_line(line, bool(lines)):
                lines.append(line)
            break
        line = data[pos : match.start()]
        if not _is_header_line(line, bool(lines)):
            break
        lines.append(line)
        pos = match.end()
    return b"".join(line + b"\r\n" for line in lines)


def _is_header_line(line: bytes, after_field: bool) -> bool:
    """A header field's first line, or (``after_field``) a folded continuation of one
    (RFC 5322 §2.2, §3.6.8; white space before the colon is obsolete syntax, §4.5)."""
    if line[:1] in (b" ", b"\t"):
        return after_field
    return _FIELD_LINE_RE.match(line) is not None


# --------------------------------------------------------------------------- formatting


def format_date(value: datetime) -> str:
    """An RFC 5322 §3.3 date-time in UTC with a numeric zone, e.g.
    ``Mon, 02 Mar 2026 09:00:05 +0000``.

    Raises:
        ValueError: ``value`` is naive.
    """
    return format_datetime(_utc(value, "date").replace(microsecond=0))


def _clean(text: str) -> str:
    """One line of header text: control characters (CR, LF, NUL ...) become spaces."""
    return _CTL_RE.sub(" ", text).strip()


def _ascii(text: str) -> str:
    """Header text restricted to US-ASCII (RFC 3464 §2.1.1: *text is ASCII)."""
    return "".join(c if " " <= c <= "~" else "?" for c in _clean(text))


def address_field(address: str) -> str:
    """An RFC 3464 §2.3.2 address field value: ``rfc822; addr`` for ASCII addresses,
    ``utf-8; <utf-8-addr-xtext>`` for internationalised ones (RFC 6533 §3)."""
    if address.isascii():
        return f"rfc822; {_ascii(address)}"
    return f"utf-8; {utf8_addr_xtext(_clean(address))}"


def _original_recipient(orcpt: str) -> str:
    addr_type, sep, value = orcpt.partition(";")
    if not sep:
        addr_type, value = "rfc822", orcpt
    value = value.strip()
    addr_type = _ascii(addr_type) or "rfc822"
    if not value.isascii() or addr_type.lower() == "utf-8":  # one rule with the ORCPT sent
        return f"utf-8; {utf8_addr_xtext(_clean(value))}"
    return f"{addr_type}; {_ascii(value)}"


def _mta_name(host: str) -> str:
    host = _ascii(host)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return f"dns; {host}"
    return f"dns; [{host}]"


def _fold(name: str, segments: Sequence[str]) -> str:
    """``Name: value`` folded at white space to about 78 columns (RFC 5322 §2.2.3); each
    segment starts on a line of its own, so unfolding joins segments with one space."""
    lines: list[str] = []
    current = f"{name}:"
    line_has_word = False
    for index, segment in enumerate(segments):
        words = [
            w[i : i + _HARD_WORD] for w in segment.split() for i in range(0, len(w), _HARD_WORD)
        ]
        if index > 0 and words and line_has_word:
            lines.append(current)
            current, line_has_word = "", False
        for word in words:
            if line_has_word and len(current) + 1 + len(word) > _MAX_LINE:
                lines.append(current)
                current, line_has_word = "", False
            current += " " + word
            line_has_word = True
    lines.append(current)
    return "\r\n".join(lines) + "\r\n"


def _reply_lines(reply: Reply) -> list[str]:
    """The reply as text lines, the first one prefixed with its codes."""
    lines = [_ascii(line) for line in reply.text.split("\n")] if reply.text else [""]
    lines = [line for line in lines if line] or [""]
    if reply.sent is not None:  # recorded under another code: the server's own codes
        prefix = _ascii(reply.sent)
    else:
        prefix = str(reply.code)
        if reply.enhanced and not lines[0].startswith(reply.enhanced):
            prefix += " " + _ascii(reply.enhanced)
    lines[0] = f"{prefix} {lines[0]}".strip()
    return lines


def diagnostic_code(reply: Reply) -> list[str]:
    """The RFC 3464 §2.3.6 Diagnostic-Code value as segments, one per reply line.

    ``smtp; <code> <enhanced> <line 1>`` followed by every further line of a multi-line reply
    (RFC 5321 §4.2.1); the codes as the server sent them (``Reply.sent``: a 552 to RCPT
    recorded as 452 shows ``552``); type ``X-jsqueue`` when no remote MTA sent the reply.
    """
    kind = "smtp" if reply.remote_host else DIAGNOSTIC_TYPE_LOCAL
    lines = _reply_lines(reply)
    lines[0] = f"{kind}; {lines[0]}"
    return lines


def _is_expired(recipient: Recipient, action: Action) -> bool:
    reply = recipient.last_reply
    return action is Action.FAILED and (reply is None or reply.is_temporary)


def status_code(recipient: Recipient, action: Action) -> str:
    """The RFC 3464 §2.3.4 Status for a reported recipient (RFC 3463 code).

    Expired (failed with a temporary or no last reply): ``4.4.7`` (RFC 3463 §3.5, delivery
    time expired), except after this queue's own security or policy deferral (last reply
    ``4.7.x`` with no ``remote_host``, e.g. ``4.7.5`` when a TLS policy could not be met,
    ``4.7.8`` when the relay's authentication failed): ``5.7.x``, so the DSN names that
    failure (RFC 3463 §3.8). A server's own ``4.7.x`` (greylisting ``451 4.7.1``, rate
    limits ``421 4.7.0``) is no permanent refusal: ``4.4.7``, with the reply in the
    Diagnostic-Code. Otherwise the last reply's enhanced code when well-formed and of the
    same class as the basic code, else the class synthesised from the basic code
    (``5.0.0``, ``4.0.0``, ``2.0.0``), else from the action.
    """
    if _is_expired(recipient, action):
        last = recipient.last_reply
        if last is None or last.remote_host is not None:
            return "4.4.7"
        enhanced = last.enhanced or ""
        if enhanced.startswith("4.7.") and _ENHANCED_RE.match(enhanced):
            return "5" + enhanced[1:]
        return "4.4.7"
    reply = recipient.last_reply
    if reply is not None:
        enhanced = reply.enhanced or ""
        if _ENHANCED_RE.match(enhanced) and enhanced[0] == str(reply.code)[0]:
            return enhanced
        return f"{reply.code // 100}.0.0"
    return {Action.FAILED: "5.0.0", Action.DELAYED: "4.0.0"}.get(action, "2.0.0")


# --------------------------------------------------------------------------- building


_SUBJECTS = {
    Action.FAILED: "Undelivered Mail Returned to Sender",
    Action.DELAYED: "Delayed Mail (still being retried)",
    Action.DELIVERED: "Successful Mail Delivery Report",
    Action.RELAYED: "Successful Mail Delivery Report",
    Action.EXPANDED: "Successful Mail Delivery Report",
}

_INTRO = {
    Action.FAILED: (
        "Your message could not be delivered to the recipients listed below. "
        "This is a permanent error; the mail system has given up."
    ),
    Action.DELAYED: (
        "Your message has not yet been delivered to the recipients listed below. "
        "The mail system will keep trying; you do not need to resend it."
    ),
    Action.DELIVERED: "Your message was delivered to the recipients listed below.",
    Action.RELAYED: (
        "Your message was handed on to the recipients' mail servers listed below. "
        "They do not report delivery, so this is the last notice you will get."
    ),
    Action.EXPANDED: "Your message was delivered to the recipients listed below.",
}


def _human_text(
    entry: Entry,
    recipients: Sequence[Recipient],
    action: Action,
    reporting_mta: str,
    will_retry_until: datetime | None,
) -> str:
    para = [
        f"This is the mail system at {reporting_mta}.",
        textwrap.fill(_INTRO[action], 72),
    ]
    if action is Action.DELAYED and will_retry_until is not None:
        para.append(f"Delivery will be attempted until {format_date(will_retry_until)}.")
    para.append(
        textwrap.fill(
            f"The message was received on {format_date(entry.created_at)} "
            f"from <{_clean(entry.reverse_path)}>.",
            72,
        )
    )
    for r in recipients:
        block = [f"<{_clean(r.address)}>: {_recipient_summary(r, action)}"]
        reply = r.last_reply
        if reply is not None:
            who = f"{_clean(reply.remote_host)} said:" if reply.remote_host else "reason:"
            block.append(f"    {who}")
            block.extend(
                textwrap.wrap(
                    " ".join(_reply_lines(reply)),
                    72,
                    initial_indent="      ",
                    subsequent_indent="      ",
                    break_on_hyphens=False,
                )
            )
            if reply.sent is not None:  # recorded under another code (delivery.responses)
                note = f"(its {_ascii(reply.sent)} to RCPT was taken as temporary: RFC 5321 "
                block.append(f"      {note}section 4.5.3.1.10)")
        para.append("\n".join(block))
    return "\n\n".join(para) + "\n"


def _recipient_summary(recipient: Recipient, action: Action) -> str:
    if _is_expired(recipient, action):
        n = recipient.attempts
        tries = f" after {n} attempt{'s' if n != 1 else ''}" if n else ""
        return f"delivery time expired{tries}"
    return {
        Action.FAILED: "delivery failed",
        Action.DELAYED: "delivery delayed",
        Action.DELIVERED: "delivered",
        Action.RELAYED: "relayed",
        Action.EXPANDED: "expanded",
    }[action]


def _status_part(
    entry: Entry,
    recipients: Sequence[Recipient],
    action: Action,
    reporting_mta: str,
    will_retry_until: datetime | None,
) -> str:
    out = []
    if entry.envid:
        out.append(_fold("Original-Envelope-Id", [_ascii(entry.envid)]))
    out.append(f"Reporting-MTA: dns; {reporting_mta}\r\n")
    out.append(f"Arrival-Date: {format_date(entry.created_at)}\r\n")
    for r in recipients:
        out.append("\r\n")
        if r.orcpt:
            out.append(_fold("Original-Recipient", [_original_recipient(r.orcpt)]))
        out.append(_fold("Final-Recipient", [address_field(r.address)]))
        out.append(f"Action: {action.value}\r\n")
        out.append(f"Status: {status_code(r, action)}\r\n")
        reply = r.last_reply
        if reply is not None and reply.remote_host:
            out.append(f"Remote-MTA: {_mta_name(reply.remote_host)}\r\n")
        if reply is not None:
            out.append(_fold("Diagnostic-Code", diagnostic_code(reply)))
        if r.last_attempt_at is not None:
            out.append(f"Last-Attempt-Date: {format_date(r.last_attempt_at)}\r\n")
        if action is Action.DELAYED and will_retry_until is not None:
            out.append(f"Will-Retry-Until: {format_date(will_retry_until)}\r\n")
    return "".join(out)


def _base64_lines(data: bytes) -> bytes:
    encoded = base64.b64encode(data)
    return b"".join(encoded[i : i + 76] + b"\r\n" for i in range(0, len(encoded), 76))


def _too_long(text: str, first: int = 0) -> bool:
    """A line of ``text`` is over 998 octets (RFC 5322 §2.1.1); ``first`` octets precede
    its first line (a header's ``Name: ``)."""
    lines = text.splitlines() or [""]
    return first + len(lines[0]) > _MAX_LINE_OCTETS or any(
        len(line) > _MAX_LINE_OCTETS for line in lines[1:]
    )


def fits_rfc822(message: bytes) -> bool:
    """Whether an 8-bit message can be returned as ``message/rfc822``.

    That type admits no encoding but 7bit, 8bit and binary (RFC 2046 §5.2.1), so for a
    next hop without 8BITMIME its content must be made 7-bit part by part (RFC 6152 §3,
    RFC 2045 §6), which only works when the 8-bit octets (and lines over 998 octets) are
    all in the bodies of leaf parts. A header section anywhere in it (of the message, of a
    MIME part, of an enclosed message) with UTF-8 or other 8-bit octets (RFC 6532 §3.3) or
    an over-long line, or such a preamble or epilogue, rules it out: such a message is
    returned as ``message/global`` (RFC 6532 §3.7), which may be base64-encoded whole
    (§3.5). Pure: parses, no I/O.

    Args:
        message: the whole message, CRLF line ends.
    """
    parsed = BytesParser(policy=email.policy.compat32).parsebytes(message)
    for part in parsed.walk():
        for name, value in part.raw_items():
            if not value.isascii() or _too_long(value, len(name) + 2):
                return False
        if part.is_multipart():
            for text in (part.preamble, part.epilogue):
                if text and (not text.isascii() or _too_long(text)):
                    return False
    return True


def _returned_part(entry: Entry, original: bytes, max_returned_size: int) -> bytes | None:
    if not original:
        return None
    if returns_full(entry, max_returned_size) and len(original) <= max_returned_size:
        content = _NEWLINE_RE.sub(b"\r\n", original)
        if not content.endswith(b"\r\n"):
            content += b"\r\n"
        if content.isascii():
            head = b"Content-Type: message/rfc822\r\nContent-Transfer-Encoding: 7bit\r\n"
        elif fits_rfc822(content):
            head = b"Content-Type: message/rfc822\r\nContent-Transfer-Encoding: 8bit\r\n"
        else:
            head = b"Content-Type: message/global\r\nContent-Transfer-Encoding: 8bit\r\n"
        return head + b"\r\n" + content
    headers = _bounded_fields(header_block(original, complete=True) or b"")
    if headers.isascii():
        head = b"Content-Type: text/rfc822-headers\r\nContent-Transfer-Encoding: 7bit\r\n"
        return head + b"\r\n" + headers
    head = (
        b"Content-Type: text/rfc822-headers; charset=utf-8\r\nContent-Transfer-Encoding: base64\r\n"
    )
    return head + b"\r\n" + _base64_lines(headers)


#: The most of an original's header section a headers-only return carries, octets: RFC 3461
#: §4.3 leaves the amount to the MTA, and a section of megabytes (thousands of fields, which
#: the front end takes within the message size) would make a DSN the sender's MX may refuse,
#: so that the sender never learns of the failure. 100 KiB is Postfix's per-header bound and
#: more than any real header section needs.
RETURNED_HEADERS_MAX_OCTETS = 100 * 1024


def _bounded_fields(headers: bytes, limit: int = RETURNED_HEADERS_MAX_OCTETS) -> bytes:
    """``headers`` (CRLF lines) cut before the first field (with its continuation lines,
    RFC 5322 §2.2.3) that would take it past ``limit`` octets; whole when it fits."""
    if len(headers) <= limit:
        return headers
    kept, size = [], 0
    for field_ in re.split(rb"\r\n(?=[^ \t])", headers.removesuffix(b"\r\n")):
        size += len(field_) + 2
        if size > limit:
            break
        kept.append(field_ + b"\r\n")
    return b"".join(kept)


def _text_part(text: str) -> bytes:
    body = text.replace("\r\n", "\n")
    if body.isascii():
        head = "Content-Type: text/plain; charset=us-ascii\r\nContent-Transfer-Encoding: 7bit\r\n"
        return (head + "\r\n" + body.replace("\n", "\r\n")).encode("ascii")
    encoded = quopri.encodestring(body.encode("utf-8")).replace(b"\n", b"\r\n")
    head_qp = (
        b"Content-Type: text/plain; charset=utf-8\r\n"
        b"Content-Transfer-Encoding: quoted-printable\r\n"
    )
    return head_qp + b"\r\n" + encoded


def _check_mta_name(name: str) -> str:
    if not name or not name.isascii() or _CTL_RE.search(name) or " " in name:
        raise ValueError(f"reporting MTA name {name!r} is not an ASCII host name")
    return name


def build_dsn(
    entry: Entry,
    recipients: Sequence[Recipient],
    action: Action,
    *,
    reporting_mta: str,
    now: datetime,
    original: bytes,
    max_returned_size: int = 1_000_000,
    will_retry_until: datetime | None = None,
    message_id: str | None = None,
) -> bytes:
    """Render one DSN about ``recipients`` of ``entry`` (RFC 3464, RFC 6522, RFC 3461 §6).

    The result is a complete RFC 5322 message, CRLF line ends, to be queued with the null
    reverse-path ``<>`` (RFC 5321 §4.5.5) to ``entry.reverse_path``. Its parts:

    1. ``text/plain``: names every reported recipient and its reason.
    2. ``message/delivery-status``: per-message fields (RFC 3464 §2.2: Original-Envelope-Id
       when ENVID was given, Reporting-MTA, Arrival-Date = acceptance instant) and one group
       per recipient (§2.3: Original-Recipient from ORCPT, Final-Recipient, Action, Status,
       Remote-MTA, Diagnostic-Code, Last-Attempt-Date, Will-Retry-Until for ``delayed``).
    3. the returned content (see :func:`returns_full`); omitted when ``original`` is empty.

    Not idempotent: each call makes a new Message-ID unless ``message_id`` is given. The
    caller marks the recipients ``dsn_sent`` (or ``delay_notified_at``) by CAS after queueing.
    Whether a DSN is owed at all is :func:`recipients_to_report`'s business; this function
    only refuses to address one to ``<>``. (A postmaster copy of a failed DSN is built by
    passing the DSN's entry with ``reverse_path`` replaced by the postmaster address.)

    Args:
        entry: the original message's queue entry.
        recipients: the recipients to report, e.g. from :func:`recipients_to_report`.
        action: the RFC 3464 §2.3.3 Action for all of them (see :func:`action_for`).
        reporting_mta: this MTA's DNS name (``DsnSettings.reporting_mta``).
        now: the current time, timezone-aware (the DSN's Date).
        original: the whole original message, or at least its header section (the first
            chunks of the body); see :func:`returns_full` and :func:`header_block`.
        max_returned_size: RET=FULL limit, octets (``DsnSettings.max_returned_size``).
        will_retry_until: end of the queue lifetime, timezone-aware; used for ``delayed``.
        message_id: the DSN's Message-ID including ``<>``; a new unique one when None.

    Returns:
        the DSN as bytes: 7-bit ASCII, except for an 8-bit original returned under RET=FULL
        (queue it as 8-bit: ``not data.isascii()``) and a UTF-8 reverse-path in ``To:``.

    Raises:
        ValueError: the entry has the null reverse-path (bounces never bounce), no
            recipients, a naive datetime, or a reporting MTA name that is not an ASCII
            host name.
    """
    if entry.reverse_path == "":
        raise ValueError("no DSN for a message from the null reverse-path (RFC 5321 §4.5.5)")
    if not recipients:
        raise ValueError("a DSN needs at least one recipient (RFC 3464 §2.1)")
    reporting_mta = _check_mta_name(reporting_mta)
    date = format_date(now)
    if will_retry_until is not None:
        _utc(will_retry_until, "will_retry_until")
    msgid = _ascii(message_id) if message_id else f"<{uuid.uuid4().hex}@{reporting_mta}>"

    text = _text_part(_human_text(entry, recipients, action, reporting_mta, will_retry_until))
    status = _status_part(entry, recipients, action, reporting_mta, will_retry_until)
    status_bytes = (
        "Content-Type: message/delivery-status\r\nContent-Transfer-Encoding: 7bit\r\n\r\n" + status
    ).encode("ascii")
    returned = _returned_part(entry, original, max_returned_size)
    parts = [text, status_bytes] + ([returned] if returned is not None else [])

    boundary = f"jsqueue-{uuid.uuid4().hex}"
    while any(boundary.encode() in p for p in parts):  # pragma: no cover - 128 random bits
        boundary = f"jsqueue-{uuid.uuid4().hex}"

    to = _clean(entry.reverse_path)
    head = (
        f"From: Mail Delivery System <MAILER-DAEMON@{reporting_mta}>\r\n"
        f"To: <{to}>\r\n"
        f"Subject: {_SUBJECTS[action]}\r\n"
        f"Date: {date}\r\n"
        f"Message-ID: {msgid}\r\n"
        "Auto-Submitted: auto-replied\r\n"
        "MIME-Version: 1.0\r\n"
        "Content-Type: multipart/report; report-type=delivery-status;\r\n"
        f' boundary="{boundary}"\r\n'
        "\r\n"
        "This is a MIME-encapsulated delivery status notification (RFC 3464).\r\n"
    ).encode()
    delimiter = f"\r\n--{boundary}\r\n".encode()
    body = b"".join(delimiter + p for p in parts)
    return head + body + f"\r\n--{boundary}--\r\n".encode()
