"""SMTP command-argument syntax for the front end: pure parsers of paths (RFC 5321 §4.1.2,
RFC 6531 §3.3), ESMTP parameters and DSN values (RFC 3461 §4, xtext), each returning a value
or raising :class:`SyntaxProblem` with the reply to send, so the session stays a thin table of
checks; the grammar followed: docs/architecture.md, "Command syntax".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from jsqueue.envelope import Notify, address_literal, routing_domain
from jsqueue.errors import InvalidName
from jsqueue.replies import (
    R501_BAD_FORWARD_PATH,
    R501_BAD_PARAMETER,
    R501_BAD_REVERSE_PATH,
    R550_NO_POSTMASTER,
    R553_BAD_MAILBOX,
    R553_SMTPUTF8_REQUIRED,
    Reply,
)

#: RFC 5321 §4.5.3.1.3: the longest path, angle brackets excluded ("256 octets" includes them).
MAX_PATH_OCTETS = 254
#: RFC 3461 §4.4: ENVID is at most 100 characters.
MAX_ENVID = 100
#: RFC 3461 §4.2: ORCPT (type, ";" and xtext) is at most 500 characters.
MAX_ORCPT = 500

# UTF8-non-ascii (RFC 6531 §3.3 via RFC 6532 §3.1), minus the C1 controls and the lone
# surrogates that stand for undecodable bytes (surrogateescape).
_U = "\u00a0-\ud7ff\ue000-\U0010ffff"
_ATEXT = "A-Za-z0-9!#$%&'*+/=?^_`{|}~\\-" + _U
_ATOM = f"[{_ATEXT}]+"
_DOT_STRING = f"{_ATOM}(?:\\.{_ATOM})*"
_QUOTED = f'"(?:[\\x20\\x21\\x23-\\x5b\\x5d-\\x7e{_U}]|\\\\[\\x20-\\x7e])*"'
_LET_DIG = f"[A-Za-z0-9{_U}]"
_SUB_DOMAIN = f"{_LET_DIG}(?:[A-Za-z0-9{_U}-]*{_LET_DIG})?"
_DOMAIN = f"{_SUB_DOMAIN}(?:\\.{_SUB_DOMAIN})*"
_LITERAL = r"\[[^\[\]\\\x00-\x20\x7f]+\]"
_MAILBOX_RE = re.compile(f"(?P<local>{_DOT_STRING}|{_QUOTED})@(?P<domain>{_DOMAIN}|{_LITERAL})")
_ROUTE_RE = re.compile(f"@(?:{_DOMAIN}|{_LITERAL})(?:,@(?:{_DOMAIN}|{_LITERAL}))*:")
_KEYWORD_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
_VALUE_RE = re.compile(f"[\\x21-\\x3c\\x3e-\\x7e{_U}]+")
_XTEXT_RE = re.compile(r"(?:[\x21-\x2a\x2c-\x3c\x3e-\x7e]|\+[0-9A-F]{2})*")
_ADDR_TYPE_RE = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+")


def _is_utf8_char(ch: str) -> bool:
    """A non-ASCII character allowed in addresses: not a C1 control, not a lone surrogate."""
    return ch >= "\u00a0" and not "\ud800" <= ch <= "\udfff"


class SyntaxProblem(Exception):
    """An argument the front end refuses; ``reply`` is what the client gets."""

    def __init__(self, reply: Reply, detail: str | None = None) -> None:
        super().__init__(detail or reply.text)
        self.reply = reply if detail is None else reply.model_copy(update={"text": detail})


@dataclass(frozen=True)
class Path:
    """A parsed reverse- or forward-path.

    Attributes:
        address: the mailbox without angle brackets (``""`` for the null path ``<>``).
        domain: the routing domain (A-label, lower case; RFC 5890); ``""`` for ``<>``.
        utf8: the mailbox contains non-ASCII characters (needs SMTPUTF8, RFC 6531 §3.4).
    """

    address: str
    domain: str
    utf8: bool


@dataclass
class Command:
    """A MAIL or RCPT argument split into its path and ESMTP parameters; ``postmaster``:
    the path was this system's postmaster, rewritten to its address (RFC 5321 §4.5.1)."""

    path: Path
    params: dict[str, str | None] = field(default_factory=dict)
    postmaster: bool = False


def _split_path(text: str) -> tuple[str, str]:
    """Split ``<path> params`` at the closing bracket (quoted ``>`` do not count).

    Raises:
        ValueError: no opening ``<``, or no closing ``>`` outside quotes.
    """
    if not text.startswith("<"):
        raise ValueError("path must be enclosed in angle brackets")
    quoted = escaped = False
    for i in range(1, len(text)):
        ch = text[i]
        if escaped:
            escaped = False
        elif ch == "\\" and quoted:
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == ">" and not quoted:
            return text[1:i], text[i + 1 :]
    raise ValueError("unterminated path")


def _check_literal(literal: str) -> None:
    """Validate an address literal (RFC 5321 §4.1.3); general literals are refused.

    Raises:
        ValueError: neither an IPv4 address nor ``IPv6:`` and an IPv6 address.
    """
    if address_literal(literal) is None:
        raise ValueError(f"bad address literal {literal}")


def parse_mailbox(text: str) -> Path:
    """Parse a bare mailbox (``local@domain``) per RFC 5321 §4.1.2 / RFC 6531 §3.3.

    Returns:
        the mailbox with its routing domain (U-labels converted to A-labels).

    Raises:
        ValueError: not a mailbox, a bad address literal, too long, or a domain that has no
            A-label form.
    """
    m = _MAILBOX_RE.fullmatch(text)
    if m is None:
        raise ValueError("not a mailbox")
    if len(text.encode("utf-8", "surrogateescape")) > MAX_PATH_OCTETS:
        raise ValueError("path longer than 256 octets (RFC 5321 section 4.5.3.1.3)")
    domain = m.group("domain")
    if domain.startswith("["):
        _check_literal(domain)
    try:
        routing = routing_domain(text)
    except InvalidName as e:
        raise ValueError(str(e)) from e
    return Path(address=text, domain=routing, utf8=not text.isascii())


def parse_params(text: str) -> dict[str, str | None]:
    """Parse ``esmtp-param *(SP esmtp-param)`` (RFC 5321 §4.1.2, RFC 6531 §3.3).

    Returns:
        upper-cased keyword -> value (None when the parameter has no ``=value``).

    Raises:
        SyntaxProblem: 501 5.5.4 for a malformed or repeated parameter.
    """
    params: dict[str, str | None] = {}
    for word in text.split(" "):
        if not word:
            continue
        key, eq, value = word.partition("=")
        if not _KEYWORD_RE.fullmatch(key) or (eq and not _VALUE_RE.fullmatch(value)):
            raise SyntaxProblem(R501_BAD_PARAMETER, f"Malformed parameter {word[:40]!r}")
        key = key.upper()
        if key in params:
            raise SyntaxProblem(R501_BAD_PARAMETER, f"Parameter {key} given twice")
        params[key] = value if eq else None
    return params


def _path_command(
    arg: str | None,
    keyword: str,
    *,
    reverse: bool,
    postmaster: str | None = None,
    own_domain: str | None = None,
) -> Command:
    bad = R501_BAD_REVERSE_PATH if reverse else R501_BAD_FORWARD_PATH
    if not arg or arg[: len(keyword)].upper() != keyword:
        raise SyntaxProblem(bad, f"Syntax: {'MAIL FROM' if reverse else 'RCPT TO'}:<address>")
    rest = arg[len(keyword) :].lstrip(" ")
    if any(ch in rest for ch in "\r\n\t\x00"):
        raise SyntaxProblem(bad)
    try:
        inner, after = _split_path(rest)
    except ValueError as e:
        raise SyntaxProblem(bad, f"{bad.text}: {e}") from e
    if after and not after.startswith(" "):
        raise SyntaxProblem(bad)
    params = parse_params(after)
    if inner == "":
        if not reverse:
            raise SyntaxProblem(bad, "The null path <> is not a recipient")
        return Command(Path("", "", False), params)
    route = _ROUTE_RE.match(inner)
    mailbox = inner[route.end() :] if route else inner
    mine = ("postmaster", f"postmaster@{own_domain}".lower() if own_domain else None)
    rewritten = postmaster is not None and mailbox.lower() in mine
    if rewritten:
        if not postmaster:
            raise SyntaxProblem(R550_NO_POSTMASTER)
        mailbox = postmaster  # RFC 5321 §4.1.1.3, §4.5.1: this system's postmaster
    if any("\udc80" <= ch <= "\udcff" for ch in mailbox):
        raise SyntaxProblem(bad, f"{bad.text}: not valid UTF-8")
    try:
        path = parse_mailbox(mailbox)
    except ValueError as e:
        if "@" in mailbox and _MAILBOX_RE.fullmatch(mailbox):
            raise SyntaxProblem(R553_BAD_MAILBOX, f"{R553_BAD_MAILBOX.text}: {e}") from e
        raise SyntaxProblem(bad, f"{bad.text}: {e}") from e
    return Command(path, params, postmaster=rewritten)


def parse_mail_from(arg: str | None) -> Command:
    """Parse the argument of ``MAIL`` (``FROM:<reverse-path> [params]``; RFC 5321 §4.1.1.2).

    Raises:
        SyntaxProblem: 501 5.1.7 for a malformed path, 553 5.1.3 for an unroutable domain,
            501 5.5.4 for malformed parameters.
    """
    return _path_command(arg, "FROM:", reverse=True)


def parse_rcpt_to(
    arg: str | None, postmaster: str | None = None, own_domain: str | None = None
) -> Command:
    """Parse the argument of ``RCPT`` (``TO:<forward-path> [params]``; RFC 5321 §4.1.1.3).

    Args:
        arg: what follows ``RCPT``.
        postmaster: the address ``RCPT TO:<Postmaster>`` (no domain, any case) stands for:
            RFC 5321 §4.1.1.3 and §4.5.1 require it to be accepted; ``""`` (none
            configured) refuses it with ``550 5.1.1``; None treats it as an address without
            a domain.
        own_domain: this system's own name (``smtp.hostname``): ``postmaster@`` it, in
            any case, stands for ``postmaster`` too (§4.5.1).

    Raises:
        SyntaxProblem: 501 5.1.3 for a malformed or null path, 553 5.1.3 for an unroutable
            domain, 501 5.5.4 for malformed parameters.
    """
    return _path_command(arg, "TO:", reverse=False, postmaster=postmaster, own_domain=own_domain)


def require_utf8_allowed(path: Path, smtputf8: bool) -> None:
    """A non-ASCII address needs ``SMTPUTF8`` on MAIL (RFC 6531 §3.4, §3.5).

    Raises:
        SyntaxProblem: 553 5.6.7.
    """
    if path.utf8 and not smtputf8:
        raise SyntaxProblem(R553_SMTPUTF8_REQUIRED)


def check_xtext(value: str) -> str:
    """Return ``value`` if it is valid ``xtext`` (RFC 3461 §4), upper-case hex required.

    Raises:
        ValueError: a character outside xtext or a bad ``+XX`` escape.
    """
    if not _XTEXT_RE.fullmatch(value):
        raise ValueError("not xtext")
    return value


def xtext_decode(value: str) -> str:
    """Decode ``xtext`` (RFC 3461 §4): ``+XX`` becomes the octet with that hex value.

    Raises:
        ValueError: not valid xtext, or the octets are not UTF-8.
    """
    return _xtext_decode_mixed(check_xtext(value))


def parse_notify(value: str | None) -> frozenset[Notify]:
    """Parse ``NOTIFY=`` (RFC 3461 §4.1): ``NEVER`` alone, or SUCCESS/FAILURE/DELAY.

    Raises:
        SyntaxProblem: 501 5.5.4 for a missing, unknown, repeated or combined-with-NEVER value.
    """
    if not value:
        raise SyntaxProblem(R501_BAD_PARAMETER, "NOTIFY needs a value")
    words = value.upper().split(",")
    try:
        kinds = [Notify(w) for w in words]
    except ValueError:
        raise SyntaxProblem(R501_BAD_PARAMETER, f"Bad NOTIFY value {value[:40]!r}") from None
    if len(set(kinds)) != len(kinds) or (Notify.NEVER in kinds and len(kinds) > 1):
        raise SyntaxProblem(R501_BAD_PARAMETER, "NOTIFY=NEVER must stand alone, no repeats")
    return frozenset(kinds)


def parse_orcpt(value: str | None, *, smtputf8: bool) -> str:
    """Validate ``ORCPT=addr-type;xtext`` (RFC 3461 §4.2; ``utf-8`` type per RFC 6533 §3).

    Returns:
        ``addr-type;address`` with the xtext decoded (and for ``utf-8`` the RFC 6533
        ``\\x{HEX}`` escapes): the entry stores decoded values, and the SMTP client
        re-encodes them for the next hop (RFC 3461 §4.2).

    Raises:
        SyntaxProblem: 501 5.5.4.
    """
    if not value or len(value) > MAX_ORCPT:
        raise SyntaxProblem(R501_BAD_PARAMETER, "ORCPT needs addr-type;address (<= 500)")
    addr_type, semi, addr = value.partition(";")
    if not semi or not _ADDR_TYPE_RE.fullmatch(addr_type) or not addr:
        raise SyntaxProblem(R501_BAD_PARAMETER, "ORCPT must be addr-type;address")
    # RFC 6533 §3: with SMTPUTF8 a utf-8 ORCPT may carry UTF-8 characters unencoded.
    unitext = smtputf8 and addr_type.lower() == "utf-8"
    if any(not c.isascii() and (not unitext or not _is_utf8_char(c)) for c in addr):
        raise SyntaxProblem(R501_BAD_PARAMETER, "ORCPT address is not valid xtext")
    try:
        xtext_decode("".join(c if c.isascii() else "x" for c in addr))
        decoded = _xtext_decode_mixed(addr)
        if addr_type.lower() == "utf-8":
            decoded = _embedded_unicode_decode(decoded)
    except (ValueError, UnicodeDecodeError):
        raise SyntaxProblem(R501_BAD_PARAMETER, "ORCPT address is not valid xtext") from None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in decoded):
        raise SyntaxProblem(R501_BAD_PARAMETER, "ORCPT address contains control characters")
    return f"{addr_type};{decoded}"


_EMBEDDED_UNICODE_RE = re.compile(r"\\x\{([0-9A-Fa-f]{1,6})\}")


def _embedded_unicode_decode(value: str) -> str:
    """Decode RFC 6533 §3 ``EmbeddedUnicodeChar`` escapes (``\\x{HEX}``, the code point
    in 1-6 hex digits) of a ``utf-8`` address, the form a client without SMTPUTF8 must use
    for non-ASCII characters and for ``+``, ``=`` and ``\\`` themselves.

    Raises:
        ValueError: a code point beyond U+10FFFF or a surrogate.
    """

    def char(m: re.Match[str]) -> str:
        code = int(m.group(1), 16)
        if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            raise ValueError(f"\\x{{{m.group(1)}}} is not a character")
        return chr(code)

    return _EMBEDDED_UNICODE_RE.sub(char, value)


def _xtext_decode_mixed(value: str) -> str:
    """Decode ``+XX`` escapes; raw UTF-8 characters (RFC 6533 unitext) pass through."""
    out = bytearray()
    i = 0
    while i < len(value):
        if value[i] == "+":
            out.append(int(value[i + 1 : i + 3], 16))
            i += 3
        else:
            out += value[i].encode()
            i += 1
    return out.decode("utf-8")


def parse_ret(value: str | None) -> str:
    """Parse ``RET=FULL|HDRS`` (RFC 3461 §4.3), case-insensitive.

    Raises:
        SyntaxProblem: 501 5.5.4.
    """
    ret = (value or "").upper()
    if ret not in ("FULL", "HDRS"):
        raise SyntaxProblem(R501_BAD_PARAMETER, "RET must be FULL or HDRS")
    return ret


def parse_envid(value: str | None) -> str:
    """Validate ``ENVID=xtext`` (RFC 3461 §4.4), at most 100 characters, printable when decoded.

    Returns:
        the decoded ENVID (stored decoded; xtext-encoded again towards the next hop).

    Raises:
        SyntaxProblem: 501 5.5.4.
    """
    if not value or len(value) > MAX_ENVID:
        raise SyntaxProblem(R501_BAD_PARAMETER, "ENVID needs 1..100 characters of xtext")
    try:
        decoded = xtext_decode(value)
    except (ValueError, UnicodeDecodeError):
        raise SyntaxProblem(R501_BAD_PARAMETER, "ENVID is not valid xtext") from None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in decoded):
        raise SyntaxProblem(R501_BAD_PARAMETER, "ENVID contains control characters")
    return decoded


def parse_size(value: str | None) -> int:
    """Parse ``SIZE=n`` (RFC 1870 §6): 1..20 digits.

    Raises:
        SyntaxProblem: 501 5.5.4.
    """
    if not value or not value.isascii() or not value.isdigit() or len(value) > 20:
        raise SyntaxProblem(R501_BAD_PARAMETER, "SIZE must be a number of octets")
    return int(value)
