"""What ``POST /api/v1/inject`` turns into a mail transaction: the envelope checked as the
SMTP front end checks MAIL and RCPT (:mod:`jsqueue.frontend.syntax`), and the RFC 5322
message, given raw or built with the standard library's ``email`` package. Pure: no I/O.

Line ends become CRLF (RFC 5322 §2.1: a bare LF in raw input is taken as a line end, a
bare CR is refused as at the SMTP front end); a line over 998 octets is refused (RFC 5322
§2.1.1), as the front end does. Nothing else in a raw message is changed: what is stored,
and delivered, is the given octets after the ``Received:`` trace field.
"""

from __future__ import annotations

import base64
import binascii
import email.policy
import email.utils
import re
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Literal

from jsqueue.envelope import Recipient, utf8_addr_xtext, xtext_encode
from jsqueue.errors import RequestRejected
from jsqueue.frontend.syntax import SyntaxProblem, parse_envid, parse_mailbox, parse_orcpt
from jsqueue.http.models import BuiltMessage, InjectBody, RecipientSpec

#: RFC 5322 §2.1.1: at most 998 octets per line, CRLF excluded.
MAX_LINE = 998
_BARE_CR = re.compile(rb"\r(?!\n)")


@dataclass(frozen=True)
class Transaction:
    """A checked envelope and message, ready for the ingest path.

    Attributes:
        reverse_path: MAIL FROM (``""`` for ``<>``).
        recipients: the forward-paths, repeats removed, in order.
        data: the message, CRLF line ends, without our trace field.
        smtputf8: some address is non-ASCII (RFC 6531 §3.4).
        envid: ENVID decoded, or None.
        ret: RET, or None.
    """

    reverse_path: str
    recipients: list[Recipient]
    data: bytes
    smtputf8: bool
    envid: str | None
    ret: Literal["FULL", "HDRS"] | None


def crlf(data: bytes) -> bytes:
    """``data`` with every line ending in CRLF (a bare LF becomes CRLF).

    Raises:
        RequestRejected: a bare CR (RFC 5321 §2.3.8), or a line over 998 octets.
    """
    if _BARE_CR.search(data):
        raise RequestRejected("the message has a bare CR (RFC 5321 §2.3.8)")
    if b"\n" in data and b"\r\n" not in data:
        data = data.replace(b"\n", b"\r\n")
    elif data.count(b"\n") != data.count(b"\r\n"):
        data = re.sub(rb"(?<!\r)\n", b"\r\n", data)
    if data and not data.endswith(b"\r\n"):
        data += b"\r\n"
    for number, line in enumerate(data.split(b"\r\n"), 1):
        if len(line) > MAX_LINE:
            raise RequestRejected(
                f"line {number} is {len(line)} octets; at most {MAX_LINE} (RFC 5322 §2.1.1)"
            )
    return data


def _mailbox(address: str, what: str) -> tuple[str, str, bool]:
    try:
        path = parse_mailbox(address)
    except ValueError as e:
        raise RequestRejected(f"{what} {address[:80]!r}: {e}") from e
    return path.address, path.domain, path.utf8


def _addresses(values: list[str], what: str) -> list[str]:
    """The addr-specs of header address lists (``Name <a@b>, c@d``).

    Raises:
        RequestRejected: an entry without an address.
    """
    out = []
    try:
        pairs = email.utils.getaddresses(values)
    except (ValueError, TypeError, AttributeError, IndexError) as e:
        raise RequestRejected(f"{what}: not an address list") from e
    for _name, addr in pairs:
        if not addr:
            raise RequestRejected(f"{what}: an entry has no address")
        out.append(addr)
    return out


def _recipient(spec: RecipientSpec, smtputf8: bool) -> Recipient:
    address, domain, _ = _mailbox(spec.address, "recipient")
    orcpt = None
    if spec.orcpt is not None:
        kind, semi, addr = spec.orcpt.partition(";")
        if not semi:
            raise RequestRejected("orcpt must be 'addr-type;address' (RFC 3461 §4.2)")
        try:
            # the address as given: encoded in the form its type decodes (RFC 6533 §3)
            utf8 = kind.lower() == "utf-8"
            encoded = utf8_addr_xtext(addr) if utf8 else xtext_encode(addr)
            orcpt = parse_orcpt(f"{kind};{encoded}", smtputf8=smtputf8)
        except (SyntaxProblem, UnicodeError) as e:
            raise RequestRejected(f"orcpt of {address}: {e}") from e
    notify = frozenset(spec.notify) if spec.notify is not None else None
    if notify is not None and (not notify or ("NEVER" in notify and len(notify) > 1)):
        raise RequestRejected(f"notify of {address}: NEVER must stand alone (RFC 3461 §4.1)")
    if notify is not None and len(notify) != len(spec.notify or ()):
        raise RequestRejected(f"notify of {address}: a value is repeated")
    return Recipient(address=address, domain=domain, orcpt=orcpt, notify=notify)


def build_message(msg: BuiltMessage, hostname: str) -> bytes:
    """The RFC 5322 message of ``msg`` (``email.message.EmailMessage``, MIME as needed),
    CRLF line ends, with ``Date`` and ``Message-ID`` (at ``hostname``); Bcc is not a header.

    Raises:
        RequestRejected: a header with CR/LF or an invalid name, bad attachment base64, a bad
            content type.
    """
    utf8 = any(not a.isascii() for a in [msg.from_, *msg.to, *msg.cc])
    policy = email.policy.SMTPUTF8 if utf8 else email.policy.SMTP
    m = EmailMessage(policy=policy)
    try:
        m["From"] = msg.from_
        if msg.to:
            m["To"] = ", ".join(msg.to)
        if msg.cc:
            m["Cc"] = ", ".join(msg.cc)
        if msg.reply_to:
            m["Reply-To"] = msg.reply_to
        m["Subject"] = msg.subject
        m["Date"] = email.utils.formatdate(usegmt=False)
        m["Message-ID"] = email.utils.make_msgid(domain=hostname)
        for name, value in msg.headers.items():
            if not re.fullmatch(r"[!-9;-~]{1,76}", name) or name.lower() == "bcc":
                raise RequestRejected(f"header name {name[:40]!r} is not allowed")
            m[name] = value
        if msg.text is not None or msg.html is None:
            m.set_content(msg.text or "")
            if msg.html is not None:
                m.add_alternative(msg.html, subtype="html")
        else:
            m.set_content(msg.html, subtype="html")
        for att in msg.attachments:
            maintype, _, subtype = att.content_type.partition("/")
            try:
                content = base64.b64decode(att.content_base64, validate=True)
            except (binascii.Error, ValueError) as e:
                raise RequestRejected(f"attachment {att.filename!r}: invalid base64") from e
            m.add_attachment(content, maintype=maintype, subtype=subtype, filename=att.filename)
        return crlf(m.as_bytes(policy=policy))
    except RequestRejected:
        raise
    # The email package's refusals; its header parser also fails with AttributeError or
    # IndexError on some malformed address lists.
    except (ValueError, TypeError, LookupError, AttributeError, IndexError) as e:
        raise RequestRejected(f"message: {e!r}"[:300]) from e


def transaction(
    body: InjectBody, *, hostname: str, max_size: int, max_recipients: int
) -> Transaction:
    """Check the envelope and make the message of an inject request.

    Args:
        body: the request.
        hostname: our name, for the ``Message-ID`` of built messages.
        max_size: ``smtp.max_message_size``, octets.
        max_recipients: ``smtp.max_recipients``.

    Raises:
        RequestRejected: status 413 for a message over ``max_size``; 422 for a bad
            address, DSN parameter or message, no recipient, or more than
            ``max_recipients``.
    """
    if body.message is not None:
        data = build_message(body.message, hostname)
        reverse = body.reverse_path
        if reverse is None:
            found = _addresses([body.message.from_], "from")
            if len(found) != 1:
                raise RequestRejected("from must hold one address, or give reverse_path")
            reverse = found[0]
        specs = body.recipients or [
            RecipientSpec.model_construct(address=a, notify=None, orcpt=None)
            for a in _addresses([*body.message.to, *body.message.cc, *body.message.bcc], "to")
        ]
    else:
        if body.raw is not None:
            try:
                raw = body.raw.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestRejected("raw is not valid Unicode text (a lone surrogate)") from e
        else:
            try:
                raw = base64.b64decode(body.raw_base64 or "", validate=True)
            except (binascii.Error, ValueError) as e:
                raise RequestRejected("raw_base64 is not valid base64") from e
        if len(raw) > max_size:
            raise RequestRejected(f"the message is {len(raw)} octets; at most {max_size}", 413)
        data = crlf(raw)
        assert body.reverse_path is not None and body.recipients is not None
        reverse, specs = body.reverse_path, body.recipients
    if len(data) > max_size:
        raise RequestRejected(f"the message is {len(data)} octets; at most {max_size}", 413)
    envelope = checked_envelope(reverse, specs, max_recipients=max_recipients)
    envid = None
    if body.envid is not None:
        try:
            envid = parse_envid(xtext_encode(body.envid))
        except (SyntaxProblem, UnicodeError) as e:
            raise RequestRejected(f"envid: {e}") from e
    return Transaction(
        envelope.reverse_path, envelope.recipients, data, envelope.smtputf8, envid, body.ret
    )


@dataclass(frozen=True)
class Envelope:
    """A checked reverse-path and forward-paths (see :func:`checked_envelope`)."""

    reverse_path: str
    recipients: list[Recipient]
    smtputf8: bool


def check_reverse_path(reverse_path: str) -> tuple[str, bool]:
    """(the reverse-path, whether it is non-ASCII); ``""`` or ``<>`` is the null path.

    Raises:
        RequestRejected: not a mailbox (RFC 5321 §4.1.2).
    """
    if reverse_path in ("", "<>"):
        return "", False
    address, _, utf8 = _mailbox(reverse_path.strip("<>"), "reverse_path")
    return address, utf8


def checked_envelope(
    reverse_path: str, specs: list[RecipientSpec], *, max_recipients: int
) -> Envelope:
    """The envelope checked as MAIL and RCPT are at the front end: mailboxes (RFC 5321
    §4.1.2, RFC 6531 §3.3), NOTIFY and ORCPT (RFC 3461), repeats removed, the recipient
    limit (RFC 5321 §4.5.3.1.10). SMTPUTF8 is implied by any non-ASCII address.

    Raises:
        RequestRejected: a bad reverse-path or recipient, no recipient, or more than
            ``max_recipients`` (422).
    """
    reverse, smtputf8 = check_reverse_path(reverse_path)
    if not specs:
        raise RequestRejected("no recipient")
    smtputf8 = smtputf8 or any(not s.address.isascii() for s in specs)
    recipients: list[Recipient] = []
    seen: set[tuple[str, str]] = set()
    for spec in specs:
        r = _recipient(spec, smtputf8)
        key = (r.address.rpartition("@")[0], r.domain)
        if key not in seen:
            seen.add(key)
            recipients.append(r)
    if len(recipients) > max_recipients:
        raise RequestRejected(f"{len(recipients)} recipients; at most {max_recipients}")
    return Envelope(reverse, recipients, smtputf8)
