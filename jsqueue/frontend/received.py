"""The ``Received:`` trace field the front end prepends to every message it accepts.

Pure text, no I/O (RFC 5321 §4.4, RFC 5322 §3.6.7, RFC 3848, RFC 6531 §4.3): ``from <helo>
([ip])``, ``by <hostname> (jsqueue) with ESMTP|ESMTPS|ESMTPA|ESMTPSA|UTF8SMTP… id <queue id>``,
and ``for <rcpt>`` only when the message has exactly one recipient (RFC 5321 §7.2); a HELO
argument that is neither a domain nor an address literal goes into a comment.
"""

from __future__ import annotations

import contextlib
import re
from datetime import datetime
from email.utils import format_datetime
from typing import Any

from jsqueue.envelope import address_literal, routing_domain
from jsqueue.errors import InvalidName

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HELO_DOMAIN_RE = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")


def _sanitize_comment(text: str) -> str:
    return "".join(c if " " <= c <= "~" and c not in "()\\" else "?" for c in text[:100])


#: Characters of an EHLO argument not kept in the entry: controls, DEL, C1 controls, and
#: the lone surrogates that stand for octets that are not UTF-8.
_HELO_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def tls_description(ssl_info: dict[str, Any] | None) -> str | None:
    """The TLS part of the ``Received:`` field (``<protocol> <cipher>``, RFC 3848 §4) from a
    TLS session's aiosmtpd ``ssl`` info (its ``cipher`` is Python's ``SSLSocket.cipher()``
    triple); None without TLS or cipher. Pure."""
    cipher = ssl_info.get("cipher") if ssl_info else None
    return f"{cipher[1]} {cipher[0]}" if cipher else None


def stored_helo(helo: str) -> str:
    """The client's EHLO/HELO argument as its entry keeps it: what the client sent (RFC
    5321 §4.1.1.1 asks for a domain or address literal, but clients send anything), at
    most 255 characters, with each control character and each octet that is not UTF-8 as
    ``?``. The entry is JSON (a lone surrogate cannot be stored: every message of such a
    session would be refused 451), and operators read it on terminals. Pure."""
    return _HELO_UNSAFE.sub("?", helo[:255])


def _ip_literal(ip: str) -> str:
    return f"[IPv6:{ip}]" if ":" in ip else f"[{ip}]"


def _is_helo_name(helo: str) -> bool:
    if _HELO_DOMAIN_RE.match(helo) and len(helo) <= 253:
        return True
    # an address literal (RFC 5321 §4.1.3), else the text goes in the (helo=...) comment
    return address_literal(helo) is not None


def protocol_keyword(*, extended: bool, smtputf8: bool, tls: bool, authenticated: bool) -> str:
    """The ``with`` keyword of the ``Received:`` field (RFC 3848 §2, RFC 6531 §4.3).

    Args:
        extended: the client greeted with EHLO (False: HELO, plain ``SMTP``).
        smtputf8: the transaction's MAIL command carried ``SMTPUTF8``.
        tls: the session runs inside TLS (STARTTLS, RFC 3207).
        authenticated: the client authenticated (AUTH, RFC 4954).

    Returns:
        ``SMTP``, or ``ESMTP``/``UTF8SMTP`` followed by ``S`` (TLS) and ``A`` (AUTH).
    """
    if not extended:
        return "SMTP"
    base = "UTF8SMTP" if smtputf8 else "ESMTP"
    return base + ("S" if tls else "") + ("A" if authenticated else "")


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

    Pure; the same arguments always give the same octets.

    Args:
        helo: the client's HELO/EHLO argument; used as the From-domain only when it is a
            domain or address literal, else kept in a comment.
        client_ip: the client's IP address (TCP-info, as an address literal).
        hostname: our name (By-domain).
        protocol: the ``with`` keyword (RFC 3848 / RFC 6531 §4.3), e.g. ``ESMTPSA``; see
            :func:`protocol_keyword`.
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
