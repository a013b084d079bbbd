"""Signals between :class:`~jsqueue.delivery.session.OutboundSession` and
:func:`~jsqueue.delivery.client.deliver` (:class:`NextMx`, :class:`TlsFallback`,
:class:`Failed`, :class:`LoopsBack`), never raised out of the package, and the address and
name tests the session needs.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from jsqueue.replies import Reply

__all__ = [
    "Failed",
    "LoopsBack",
    "NextMx",
    "TlsFallback",
    "is_loopback",
    "literal_like",
    "ours",
    "telling_names",
]


class NextMx(Exception):
    """This target failed before any recipient was accepted: try the next one (RFC 5321
    §5.1). A signal from :class:`OutboundSession` to :func:`~jsqueue.delivery.client.deliver`,
    never raised out of the package.

    Attributes:
        reply: the synthesised (or remote) reply that explains the failure; every recipient
            gets the last one when no target is left.
        settled: recipients the target refused before it failed (their RCPT got a 4yz or
            5yz reply, then a ``421`` or a lost connection ended the transaction): those
            replies stand and only the others go to the next target (RFC 5321 §3.3: each
            RCPT reply is the server's answer for that recipient).
    """

    def __init__(self, reply: Reply, settled: dict[str, Reply] | None = None) -> None:
        super().__init__(str(reply))
        self.reply = reply
        self.settled = settled or {}


class LoopsBack(NextMx):
    """The target is this queue itself (it answered EHLO with one of this queue's names):
    RFC 5321 §5.1, the client that finds itself among the MXes drops that MX and every MX
    of the same or a lower preference, so no further target of the attempt is tried.

    Attributes:
        reply: ``554 5.4.6`` "mail for <domain> loops back to myself" (RFC 3463 X.4.6).
    """


def ours(ehlo_reply: str, names: Iterable[str]) -> str | None:
    """The name a next hop gave in its EHLO (or HELO) reply text (the first word of the
    first line, RFC 5321 §4.1.1.1) when it is one of ``names`` (case-insensitive, a final
    dot ignored); None otherwise. Names without a dot and ``localhost...`` are never
    matched: servers that call themselves so are many and none of them is known to be us.
    Pure."""
    words = ehlo_reply.split("\n", 1)[0].split()
    if not words:
        return None
    given = words[0].rstrip(".").lower()
    return given if given in telling_names(names) else None


def telling_names(names: Iterable[str]) -> set[str]:
    """Those of ``names`` that can tell this queue in a next hop's EHLO reply (lower
    case, no final dot): not ``localhost...``, not without a dot. Empty: loops are found
    only by counting ``Received:`` fields (RFC 5321 §6.3). Pure."""
    return {
        n.rstrip(".").lower()
        for n in names
        if "." in n.rstrip(".") and not n.lower().startswith("localhost")
    }


class TlsFallback(Exception):
    """Opportunistic STARTTLS failed in the handshake, or the TLS session broke (EOF,
    timeout) before any recipient was accepted: reconnect to the same address in plaintext
    (RFC 7435). A signal to :func:`~jsqueue.delivery.client.deliver`, never raised out of
    the package."""


class Failed(Exception):
    """A library call failed; carries the synthesised reply (package-internal)."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(str(reply))
        self.reply = reply


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback IP address (AUTH without TLS is allowed there)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def literal_like(host: str) -> bool:
    """Whether ``host`` is an address (literal or bare IP), so not a name for SNI."""
    if host.startswith("["):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
