"""The queue entry: envelope, recipients and their delivery state. Pure data, no I/O.

An :class:`Entry` is what the KV bucket stores under the queue id. Each :class:`Recipient`
carries its own state, attempts, last reply and next attempt time (DESIGN.md §2.4); the
entry's state is derived from its recipients, never stored on its own.

All timestamps are timezone-aware UTC datetimes; naive datetimes are rejected. Entries
round-trip through their stored form losslessly (:meth:`Entry.to_json` /
:meth:`Entry.from_json`): one line of JSON, followed by the raw message when the body is
kept inline (:attr:`Entry.inline_body`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Literal

import idna
from pydantic import AfterValidator, BaseModel, Field, field_serializer

from jsqueue.errors import InvalidName
from jsqueue.names import check_domain
from jsqueue.replies import Reply


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("timestamps must be timezone-aware")
    return value.astimezone(UTC)


UTCDateTime = Annotated[datetime, AfterValidator(_utc)]


def utcnow() -> datetime:
    """The current time as an aware UTC datetime."""
    return datetime.now(UTC)


class RecipientState(StrEnum):
    """Where one recipient stands.

    ``pending``: not tried yet. ``active``: a worker holds a lease and is delivering.
    ``deferred``: a temporary failure; retried at ``next_attempt_at``. ``delivered``: the next
    hop accepted it (RFC 5321 §6.1: responsibility passed on). ``bounced``: a permanent
    failure or expiry; a failure DSN is owed to the reverse-path (RFC 3464). ``failed``: a
    permanent failure for which no DSN can be sent (null reverse-path, NOTIFY=NEVER, or
    deleted/bounced by an operator without notice).
    """

    PENDING = "pending"
    ACTIVE = "active"
    DEFERRED = "deferred"
    DELIVERED = "delivered"
    BOUNCED = "bounced"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        """True for delivered, bounced and failed: nothing more will be attempted."""
        return self in _FINAL


_FINAL = frozenset({RecipientState.DELIVERED, RecipientState.BOUNCED, RecipientState.FAILED})


class EntryState(StrEnum):
    """An entry's overall state, derived from its recipients (see :attr:`Entry.state`)."""

    HELD = "held"
    ACTIVE = "active"
    PENDING = "pending"
    DEFERRED = "deferred"
    DONE = "done"


class Notify(StrEnum):
    """RFC 3461 §4.1 NOTIFY values."""

    NEVER = "NEVER"
    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"
    DELAY = "DELAY"


def xtext_encode(value: str) -> str:
    """``value`` as RFC 3461 §4 xtext, 7-bit: each UTF-8 octet outside ``!``..``~``, and
    ``+`` and ``=``, written ``+XX`` (upper-case hex). For ENVID (§4.4) and ASCII ORCPT
    addresses (§4.2). Pure."""
    return "".join(
        chr(b) if 0x21 <= b <= 0x7E and b not in (0x2B, 0x3D) else f"+{b:02X}"
        for b in value.encode("utf-8")
    )


def utf8_addr_xtext(address: str) -> str:
    """The RFC 6533 §3 ``utf-8-addr-xtext`` form of an address: 7-bit, with every character
    outside QCHAR (non-ASCII, controls, space, ``\\``, ``+``, ``=``) written as
    ``\\x{HEX}`` (the code point; ``+XX`` escapes are not part of this form). For
    ``utf-8`` ORCPT values and DSN address fields. Pure."""
    out = []
    for c in address:
        if "!" <= c <= "~" and c not in "\\+=":
            out.append(c)
        else:
            out.append(f"\\x{{{ord(c):02X}}}")
    return "".join(out)


class Recipient(BaseModel):
    """One forward-path of the envelope and its delivery state.

    ``address`` is the forward-path as received (UTF-8 local parts allowed, RFC 6531);
    ``domain`` is the routing domain: the A-label, lower-case form used for MX lookup,
    subjects and keys. ``orcpt`` and ``notify`` are the RFC 3461 §4.2 / §4.1 parameters
    (``notify`` None means the default, FAILURE[,DELAY] at the MTA's discretion).

    ``next_hop_dsn``: the recipient was delivered to a next hop that advertised DSN, with
    the NOTIFY/ORCPT parameters passed on in its RCPT; reporting its success is that hop's
    business, jsqueue sends no success DSN for it (RFC 3461 §5.2.1, §6.2.1). Left out of the
    stored form when False, so entries written before it existed load unchanged.
    """

    address: str
    domain: str
    orcpt: str | None = None
    notify: frozenset[Notify] | None = None
    state: RecipientState = RecipientState.PENDING
    attempts: int = Field(default=0, ge=0)
    last_attempt_at: UTCDateTime | None = None
    next_attempt_at: UTCDateTime | None = None
    last_reply: Reply | None = None
    delay_notified_at: UTCDateTime | None = None
    dsn_sent: bool = False
    next_hop_dsn: bool = Field(False, exclude_if=lambda v: not v)

    @field_serializer("notify")
    def _notify_sorted(self, notify: frozenset[Notify] | None) -> list[str] | None:
        # A set's order depends on how it was built: sorted, equal entries give equal JSON.
        return None if notify is None else sorted(n.value for n in notify)

    @classmethod
    def from_address(
        cls, address: str, *, orcpt: str | None = None, notify: frozenset[Notify] | None = None
    ) -> Recipient:
        """Build a pending recipient, deriving its routing domain.

        Raises:
            InvalidName: the address has no usable domain.
        """
        return cls(address=address, domain=routing_domain(address), orcpt=orcpt, notify=notify)


class Lease(BaseModel):
    """A worker's claim on delivering one destination domain of an entry (DESIGN.md §2.3).

    ``instance`` is the claiming process's presence id: it tells a live worker's lease
    from one a later process of the same name took over. None in leases written before
    it was recorded (they are told apart by ``owner`` only).
    """

    owner: str
    until: UTCDateTime
    instance: str | None = None


class Entry(BaseModel):
    """One queued message: the envelope plus every recipient's delivery state.

    ``reverse_path`` is the MAIL FROM address without brackets; ``""`` is the null
    reverse-path ``<>`` used by DSNs (RFC 5321 §4.5.5). ``generation`` is bumped by admin
    actions that re-schedule the entry; work items carrying an older generation are stale.

    ``inline_body`` is the raw message (RFC 5322, CRLF line ends) when the front end kept
    a small body with its entry instead of in the object store (``smtp.inline_body_max``,
    off by default; DESIGN.md §1 puts bodies in the object store): one synced write instead
    of three at ingest, and nothing to purge after delivery. A worker moves it to the body
    store when the message is deferred (:mod:`jsqueue.worker`), so queued mail keeps
    metadata only. None means the body is in the body store under the entry's id. It is
    never part of the JSON (nor of admin output or events); :meth:`to_json` appends it
    after the JSON line.

    ``dkim`` is what the last attempt did about DKIM (RFC 6376) for the bytes it sent
    (``d=… s=… a=…``, ``unsigned: <why>``; :attr:`jsqueue.delivery.base.DeliveryResult.dkim`).

    ``request_digest`` is the SHA-256 (hex) of the HTTP inject request that stored the
    message under an ``Idempotency-Key`` (:mod:`jsqueue.http.inject`): a retry with the same
    key is compared with it, also after a NATS restart lost the ingest log; None otherwise.
    """

    id: str
    reverse_path: str
    recipients: list[Recipient]
    created_at: UTCDateTime
    size: int = Field(ge=0)
    digest: str = ""
    helo: str | None = None
    client_address: str | None = None
    envid: str | None = None
    ret: Literal["FULL", "HDRS"] | None = None
    smtputf8: bool = False
    body_8bit: bool = False
    generation: int = 0
    held: bool = False
    last_error: str | None = None
    leases: dict[str, Lease] = Field(default_factory=dict)
    is_dsn: bool = False
    dkim: str | None = None
    # left out of the stored form when None (most entries: SMTP mail), not "null" in each
    request_digest: str | None = Field(None, exclude_if=lambda v: v is None)
    inline_body: bytes | None = Field(None, exclude=True, repr=False)

    @property
    def state(self) -> EntryState:
        """Overall state, derived from the recipients and the hold flag.

        held > active (any recipient being delivered) > pending > deferred > done.
        """
        states = {r.state for r in self.recipients}
        if self.held and not states <= _FINAL:
            return EntryState.HELD
        for rs, es in (
            (RecipientState.ACTIVE, EntryState.ACTIVE),
            (RecipientState.PENDING, EntryState.PENDING),
            (RecipientState.DEFERRED, EntryState.DEFERRED),
        ):
            if rs in states:
                return es
        return EntryState.DONE

    @property
    def is_final(self) -> bool:
        """True when every recipient is delivered, bounced or failed."""
        return all(r.state.is_final for r in self.recipients)

    @property
    def domains(self) -> list[str]:
        """Distinct routing domains of the recipients, in first-seen order."""
        return list(dict.fromkeys(r.domain for r in self.recipients))

    def open_recipients(self, domain: str) -> list[Recipient]:
        """Recipients of ``domain`` that still need a delivery attempt (not final)."""
        return [r for r in self.recipients if r.domain == domain and not r.state.is_final]

    def due_at(self, domain: str) -> datetime | None:
        """When the next attempt for ``domain`` is due: the earliest ``next_attempt_at`` of its
        open recipients (a pending recipient with none set is due at once); None when the
        domain has no open recipient."""
        open_ = self.open_recipients(domain)
        if not open_:
            return None
        return min(r.next_attempt_at or self.created_at for r in open_)

    def to_json(self) -> bytes:
        """Serialise to the stored form (the KV value): the entry as one line of UTF-8 JSON
        (compact JSON never holds a raw LF), then, for an inline body, LF and the body's
        octets unchanged (no base64, no escaping)."""
        data = self.model_dump_json(exclude_defaults=False).encode()
        if self.inline_body is None:
            return data
        return b"".join((data, b"\n", self.inline_body))

    @classmethod
    def from_json(cls, data: bytes) -> Entry:
        """Parse a KV value written by :meth:`to_json` (with or without an inline body).

        Raises:
            pydantic.ValidationError: the bytes are not a valid entry.
        """
        head, sep, body = data.partition(b"\n")
        entry = cls.model_validate_json(head)
        if sep:
            entry.inline_body = body
        return entry


def routing_domain(address: str) -> str:
    """The routing domain of a mailbox: the part after the last ``@``, as an A-label.

    U-labels are converted to A-labels with IDNA 2008 / UTS #46 (RFC 5890, RFC 6531 §3.2:
    the MX lookup uses the A-label form). The local part is never touched.

    Raises:
        InvalidName: no ``@``, an empty domain, or a domain that cannot be an A-label.
    """
    _, at, domain = address.rpartition("@")
    if not at or not domain:
        raise InvalidName(f"address {address!r} has no domain")
    domain = domain.rstrip(".")
    if domain.startswith("[") and domain.endswith("]"):
        return check_domain(_literal(domain))
    try:
        ascii_domain = domain if domain.isascii() else idna.encode(domain, uts46=True).decode()
    except idna.IDNAError as e:
        raise InvalidName(f"domain {domain!r} cannot be converted to an A-label") from e
    return check_domain(ascii_domain)


def address_literal(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address of an RFC 5321 §4.1.3 address literal: ``[`` an IPv4 address (dotted
    decimal, no leading zeros) or ``IPv6:`` (any case) and an IPv6 address ``]``; None for
    anything else, general literals included. An IPv6 zone ID (``%eth0``), which Python's
    parser accepts, is no part of the grammar: None. Pure."""
    if not (text.startswith("[") and text.endswith("]")):
        return None
    inner = text[1:-1]
    try:
        if inner[:5].lower() == "ipv6:":
            return None if "%" in inner else ipaddress.IPv6Address(inner[5:])
        return ipaddress.IPv4Address(inner)
    except ValueError:
        return None


def _literal(literal: str) -> str:
    """An IPv6 address literal in one spelling (RFC 5321 §4.1.3: ``IPv6:`` in any case,
    the address in any RFC 4291 form): ``[IPv6:`` and the RFC 5952 form, so that one host
    is one destination; anything else as it is."""
    ip = address_literal(literal)
    return f"[IPv6:{ip.compressed}]" if isinstance(ip, ipaddress.IPv6Address) else literal


@dataclass(frozen=True)
class WorkItem:
    """A trigger: deliver queue entry ``queue_id`` to destination ``domain``.

    ``generation`` must equal the entry's generation when it arrives, otherwise the item is
    stale (superseded by a flush) and is dropped (DESIGN.md §2.2).
    """

    queue_id: str
    domain: str
    generation: int = 0
