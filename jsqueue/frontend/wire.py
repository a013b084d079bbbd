"""Reply lines as the front end puts them on the wire: the table's replies rendered
(:func:`reply_line`), enhanced status codes added where aiosmtpd's own replies lack them
(:func:`with_enhanced_code`, RFC 2034 §4), lines cut to what RFC 5321 allows
(:func:`printable`), aiosmtpd's goodbye as a 421 (:func:`as_closing`), the QUIT reply
recognised (:func:`is_closing`), and the commands a client has already sent counted
(:func:`commands_in`). Pure, no I/O.
"""

from __future__ import annotations

import re

from jsqueue.replies import Reply, generic_enhanced

_HAS_ENHANCED = re.compile(r"^[245]\d\d[ -][245]\.\d{1,3}\.\d{1,3}(?: |$)")
_PRINTABLE_ONLY = re.compile(r"[^\x20-\x7e]")


def with_enhanced_code(status: str) -> str:
    """Give a 2xx/4xx/5xx reply line an enhanced status code if it has none (RFC 2034 §4).

    aiosmtpd's own replies (``500 Error: bad syntax``, ``221 Bye`` …) lack them; ours have
    them. The code added is :func:`jsqueue.replies.generic_enhanced` of the basic code.

    Args:
        status: one reply line without CRLF, e.g. ``221 Bye``.

    Returns:
        the line with ``x.y.z`` after the basic code; unchanged when it has one already or
        is not a 2xx/4xx/5xx reply (3xx carry none).
    """
    code = status[:3]
    if code[:1] not in ("2", "4", "5") or not code.isdigit() or _HAS_ENHANCED.match(status):
        return status
    sep = status[3:4] or " "
    return f"{code}{sep}{generic_enhanced(int(code))} {status[4:]}".rstrip()


#: aiosmtpd's replies that come with the end of the session, as RFC 5321 §3.8 has them: a
#: server that closes the transmission channel says so with 421 (aiosmtpd says 502).
_CLOSING = {
    "502 5.5.1 Too many unrecognized commands, goodbye.": (
        "421 4.7.0 Too many unrecognized commands, closing connection"
    ),
}


def as_closing(status: str) -> str:
    """``status``, or the ``421`` line that replaces an aiosmtpd reply sent just before it
    closes the session (RFC 5321 §3.8: the client then knows the session is over and
    tries again later, where a 5yz reads as a refusal of the command)."""
    return _CLOSING.get(status, status)


def reply_line(reply: Reply, detail: str | None = None) -> str:
    """``reply`` as its reply line; ``detail`` replaces the table's text when given."""
    return str(reply if detail is None else reply.model_copy(update={"text": detail}))


def printable(status: str) -> str:
    """``status`` cut to printable US-ASCII of at most 510 octets, the longest reply line
    before CRLF (RFC 5321 §4.2, §4.5.3.1.5): some replies quote client input."""
    return _PRINTABLE_ONLY.sub("?", status)[:510]


def is_closing(status: str | bytes) -> bool:
    """Whether ``status`` is the 221 that answers QUIT (RFC 5321 §4.1.1.10)."""
    return (
        status[:3] if isinstance(status, str) else status[:3].decode("ascii", "replace")
    ) == "221"


def commands_in(buffered: bytes) -> int:
    """How many commands ``buffered`` (received, not yet read) holds, a partial last line
    counted: commands the client sent before it could see the reply now going out (RFC
    2920 §3.1: the message content may be followed by further commands in its group)."""
    return buffered.count(b"\n") + (bool(buffered) and not buffered.endswith(b"\n"))
