"""How the envelope goes on the wire: MAIL/RCPT paths (an A-label domain for a server without
SMTPUTF8, RFC 6531 §3.2), the RFC 3461 parameters (ORCPT, with RFC 6533 ``utf-8``
addresses; NOTIFY) and the server's RFC 1870 SIZE limit. Pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable

import idna

from jsqueue.envelope import Notify, utf8_addr_xtext, xtext_encode

__all__ = ["notify_param", "orcpt_param", "size_limit", "smtp_path"]

_NOTIFY_ORDER = (Notify.NEVER, Notify.SUCCESS, Notify.FAILURE, Notify.DELAY)


def orcpt_param(value: str) -> str:
    """The ORCPT value for a stored ``type;address`` (``rfc822`` when no type is given),
    always 7-bit: an ``rfc822`` address as xtext (RFC 3461 §4.2: ``+XX``); a ``utf-8``
    one, or any non-ASCII address, as ``utf-8;`` and RFC 6533 §3 ``utf-8-addr-xtext``
    (``\\x{HEX}``, which has no ``+XX``: ``+`` is ``\\x{2B}``). Pure."""
    addr_type, sep, address = value.partition(";")
    if not sep:
        addr_type, address = "rfc822", value
    if addr_type.strip().lower() == "utf-8" or not address.isascii():
        return f"utf-8;{utf8_addr_xtext(address)}"
    return f"{addr_type};{xtext_encode(address)}"


def notify_param(notify: Iterable[Notify]) -> str:
    """The NOTIFY value (RFC 3461 §4.1): the keywords in a fixed order, comma-separated."""
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


def smtp_path(address: str, utf8: bool) -> str | None:
    """The path as sent in MAIL/RCPT, without brackets (RFC 5321 §4.1.2). Pure.

    Args:
        address: the stored address; ``""`` is the null reverse-path.
        utf8: the transaction uses SMTPUTF8 (RFC 6531).

    Returns:
        the address; without SMTPUTF8 a U-label domain as its A-label (RFC 6531 §3.2);
        None when it cannot go without SMTPUTF8 (a UTF-8 local part, a domain with no
        A-label form).
    """
    if address == "":
        return ""
    if utf8 or address.isascii():
        return address
    local, domain = _split(address)
    if not local.isascii():
        return None
    ascii_domain = _ascii_domain(domain)
    return None if ascii_domain is None else f"{local}@{ascii_domain}"


def size_limit(extensions: dict[str, str]) -> int | None:
    """The server's SIZE limit in octets from its EHLO extensions (RFC 1870 §4); None when
    it has no SIZE extension or announces no positive number."""
    if "size" not in extensions:
        return None
    value = extensions["size"].strip().split(" ")[0]
    return int(value) if value.isdigit() and int(value) > 0 else None
