"""What a delivery attempt takes and gives back: the body source, the envelope of one
destination domain, the results, and the :class:`Deliverer` seam the worker calls. Pure data
and Protocols, no I/O: the delivery adapters and the worker both import them from here, so no
adapter imports the worker (composition) to learn its types.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from jsqueue.envelope import Entry, Recipient
from jsqueue.replies import Reply


@dataclass(frozen=True)
class BodySource:
    """The raw message of one entry, re-readable once per connection.

    Attributes:
        open: zero-argument callable returning a fresh async iterator over the raw message
            (RFC 5322, CRLF line ends, no dot-stuffing) in chunks of any size, from the
            start at each call. Called once per session that reaches DATA (and once more
            for a header scan or 7-bit conversion); an exception from the iterator (e.g.
            ``BodyNotFound`` after an admin delete) aborts that transaction before its
            final dot (RFC 5321 §4.1.1.4).
        size: the message size in octets (RFC 1870 SIZE).
    """

    open: Callable[[], AsyncIterator[bytes]]
    size: int

    @classmethod
    def from_bytes(cls, data: bytes, chunk_size: int = 256 * 1024) -> BodySource:
        """A source over bytes already in memory, yielded in ``chunk_size``-octet slices."""

        async def chunks() -> AsyncIterator[bytes]:
            view = memoryview(data)
            for start in range(0, len(data), chunk_size):
                yield bytes(view[start : start + chunk_size])

        return cls(open=chunks, size=len(data))


@dataclass(frozen=True)
class DeliveryEnvelope:
    """What one attempt sends: the envelope restricted to one destination domain.

    Attributes:
        domain: routing domain of every recipient (A-label), keys the TLS policy.
        reverse_path: MAIL FROM address without brackets; ``""`` is the null path ``<>``.
        recipients: recipients to offer (one RCPT each; duplicates by address are sent once).
        smtputf8: the message was received with SMTPUTF8 (it may have UTF-8 headers).
        body_8bit: the message was received with BODY=8BITMIME.
        envid: RFC 3461 ENVID (decoded form; xtext-encoded on the wire).
        ret: RFC 3461 RET.
    """

    domain: str
    reverse_path: str
    recipients: tuple[Recipient, ...]
    smtputf8: bool = False
    body_8bit: bool = False
    envid: str | None = None
    ret: Literal["FULL", "HDRS"] | None = None

    @classmethod
    def from_entry(cls, entry: Entry, domain: str) -> DeliveryEnvelope:
        """The open (not final) recipients of ``domain`` in ``entry`` with its envelope
        (reverse-path, SMTPUTF8 and 8BITMIME flags, RFC 3461 ENVID and RET). Pure."""
        return cls(
            domain=domain,
            reverse_path=entry.reverse_path,
            recipients=tuple(entry.open_recipients(domain)),
            smtputf8=entry.smtputf8,
            body_8bit=entry.body_8bit,
            envid=entry.envid,
            ret=entry.ret,
        )


@dataclass(frozen=True)
class DeliveryResult:
    """Outcome of one SMTP attempt, as the client saw it.

    Attributes:
        replies: one reply per recipient address of the envelope: 2xx delivered (the next
            hop took responsibility, RFC 5321 §6.1), 4xx retry, 5xx bounce.
        mx_host: host name of the MX whose replies these are; None when no session got as
            far as MAIL (every reply synthesised).
        mx_address: the address connected to, or None.
        tried_host: host name (``MxTarget.host``: MX, implicit MX, address literal or
            smarthost) of the last target a connection was tried to, whether or not it
            answered; None when none was tried (DNS failure, no target). For logs.
        tls: the transaction ran over TLS.
        tls_version: e.g. ``"TLSv1.3"`` when ``tls``.
        dsn: the server advertised DSN, so NOTIFY/ORCPT/RET/ENVID were passed on (else a
            NOTIFY=SUCCESS recipient is owed a "relayed" DSN, RFC 3461 §4.1).
        dsn_accepted: the addresses a server that advertised DSN accepted (2yz) with the
            NOTIFY/ORCPT parameters passed on in their RCPT: that next hop now reports
            their delivery, so no success DSN is owed for them (RFC 3461 §5.2.1, §6.2.1).
            Per address, since recipients over a limit may go in a further session.
        converted_7bit: the body was converted to 7-bit MIME for this server.
        dkim: what was done about DKIM (RFC 6376) for the bytes sent: ``d=… s=… a=…``
            per signature of ours, ``unsigned: <why>``, a note when a 7-bit conversion may
            have broken the message's own signatures; None when no key applies.
        uncertain: addresses whose outcome is unknown: the final ``.`` of DATA was sent
            and then the connection died, the reply timed out or could not be read
            (RFC 5321 §4.5.3.2.6, §6.1). They carry a 4yz reply (retried), yet the next
            hop may have taken the message: it may be delivered twice.
    """

    replies: dict[str, Reply]
    mx_host: str | None = None
    mx_address: str | None = None
    tried_host: str | None = None
    tls: bool = False
    tls_version: str | None = None
    dsn: bool = False
    dsn_accepted: frozenset[str] = frozenset()
    converted_7bit: bool = False
    uncertain: frozenset[str] = frozenset()
    dkim: str | None = None

    @property
    def delivered(self) -> list[str]:
        """Addresses with a 2xx reply."""
        return [a for a, r in self.replies.items() if r.is_success]

    @property
    def deferred(self) -> list[str]:
        """Addresses with a 4xx reply."""
        return [a for a, r in self.replies.items() if r.is_temporary]

    @property
    def failed(self) -> list[str]:
        """Addresses with a 5xx reply."""
        return [a for a, r in self.replies.items() if r.is_permanent]


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one delivery attempt of one destination domain came back with, for the worker.

    Attributes:
        replies: a reply for every recipient address offered (2yz, 4yz or 5yz), whole (the
            entry keeps them bounded, :meth:`~jsqueue.replies.Reply.bounded`).
        host: the host name last connected to or tried (MX, implicit MX, address literal or
            smarthost), also when it did not answer; None when no connection was tried
            (e.g. the MX lookup failed). Logged as ``mx=`` for replies jsqueue synthesised.
        uncertain: addresses whose 4yz reply follows a final ``.`` that may have reached
            the next hop (see :attr:`DeliveryResult.uncertain`): logged ``uncertain=yes``,
            their events carry ``uncertain: true``.
        dkim: the DKIM signing of the message sent (see :attr:`DeliveryResult.dkim`):
            logged ``dkim=``, in the events and in ``queue show``.
        reached: the MX host whose server answered as far as MAIL (the session was up),
            None when none did (no address answered, TLS or the greeting failed, or no
            connection was tried): the destination limits count connection failures by it.
        next_hop_dsn: addresses accepted by a next hop that advertised DSN, the NOTIFY and
            ORCPT parameters passed on (see :attr:`DeliveryResult.dsn_accepted`): recorded
            as :attr:`~jsqueue.envelope.Recipient.next_hop_dsn`, they get no success DSN
            from jsqueue (RFC 3461 §5.2.1, §6.2.1).
    """

    replies: Mapping[str, Reply]
    host: str | None = None
    uncertain: frozenset[str] = frozenset()
    dkim: str | None = None
    reached: str | None = None
    next_hop_dsn: frozenset[str] = frozenset()


class Deliverer(Protocol):
    """Delivers one entry's open recipients of one destination domain (one attempt)."""

    async def deliver(
        self, entry: Entry, domain: str, recipients: Sequence[Recipient], body: BodySource
    ) -> Attempt:
        """One attempt: MX lookup, SMTP session(s) (RFC 5321 §5.1 order of MX hosts).

        Args:
            entry: the claimed entry (envelope, flags).
            domain: the destination domain.
            recipients: the open recipients of ``domain`` to offer.
            body: the message, opened once per session that reaches DATA.

        Returns:
            a reply for every recipient address and the host tried. Never raises for
            remote or DNS trouble: failures come back as 4yz/5yz replies. Not idempotent:
            each call may send the message.
        """
        ...

    async def close(self) -> None:
        """Release what outlives one attempt (cached SMTP sessions). Idempotent."""
        ...
