"""Signals between :class:`~jsqueue.delivery.session.OutboundSession` and
:func:`~jsqueue.delivery.client.deliver` (:class:`NextMx`, :class:`TlsFallback`,
:class:`Failed`), never raised out of the package, and two address tests the session needs.
"""

from __future__ import annotations

import ipaddress

from jsqueue.replies import Reply

__all__ = ["Failed", "NextMx", "TlsFallback", "is_loopback", "literal_like"]


class NextMx(Exception):
    """This target failed before any recipient was accepted: try the next one (RFC 5321
    §5.1). A signal from :class:`OutboundSession` to :func:`~jsqueue.delivery.client.deliver`,
    never raised out of the package.

    Attributes:
        reply: the synthesised (or remote) reply that explains the failure; every recipient
            gets the last one when no target is left.
    """

    def __init__(self, reply: Reply) -> None:
        super().__init__(str(reply))
        self.reply = reply


class TlsFallback(Exception):
    """Opportunistic STARTTLS failed in the handshake: reconnect to the same address in
    plaintext (RFC 7435). A signal to :func:`~jsqueue.delivery.client.deliver`, never raised
    out of the package."""


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
