"""What operators see of the queue: the pydantic models the queue operations
(:mod:`jsqueue.admin`) return and the CLI prints, as text (:mod:`jsqueue.cli.render`) or as
JSON (``--json``); data only, no I/O. Sizes are octets, ages and durations seconds, times
aware UTC.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field

from jsqueue.envelope import Entry, EntryState, Lease, RecipientState, UTCDateTime
from jsqueue.replies import Reply
from jsqueue.store.base import Versioned


class Action(StrEnum):
    """An operator action on one entry."""

    FLUSH = "flush"
    HOLD = "hold"
    RELEASE = "release"
    DELETE = "delete"
    BOUNCE = "bounce"
    REQUEUE = "requeue"


class Outcome(StrEnum):
    """What an action did to one entry."""

    DONE = "done"  # changed as asked
    UNCHANGED = "unchanged"  # nothing to do (already held, nothing open ...)
    NOT_FOUND = "not-found"  # no such entry
    FAILED = "failed"  # storage error or too many conflicts: re-run the action


class RecipientView(BaseModel):
    """One recipient as operators see it: state, attempts, last reply, schedule."""

    address: str
    domain: str
    state: RecipientState
    attempts: int
    last_attempt_at: UTCDateTime | None = None
    next_attempt_at: UTCDateTime | None = None
    last_reply: Reply | None = None
    orcpt: str | None = None
    dsn_sent: bool = False


class EntrySummary(BaseModel):
    """One line group of ``queue ls``: envelope, size, arrival and recipients."""

    id: str
    state: EntryState
    size: int = Field(description="message size, octets")
    created_at: UTCDateTime
    reverse_path: str
    held: bool
    is_dsn: bool
    recipients: list[RecipientView]

    @classmethod
    def of(cls, entry: Entry) -> EntrySummary:
        """The summary of ``entry``."""
        return cls(
            id=entry.id,
            state=entry.state,
            size=entry.size,
            created_at=entry.created_at,
            reverse_path=entry.reverse_path,
            held=entry.held,
            is_dsn=entry.is_dsn,
            recipients=[_recipient_view(entry, i) for i in range(len(entry.recipients))],
        )


class EntryDetail(EntrySummary):
    """Everything ``queue show`` prints: the summary plus envelope details and leases."""

    revision: int
    generation: int
    digest: str
    helo: str | None = None
    client_address: str | None = None
    envid: str | None = None
    ret: Literal["FULL", "HDRS"] | None = None
    smtputf8: bool = False
    body_8bit: bool = False
    leases: dict[str, Lease] = Field(default_factory=dict)
    last_error: str | None = None
    body_inline: bool = False
    dkim: str | None = None

    @classmethod
    def of_versioned(cls, v: Versioned) -> EntryDetail:
        """The detail of a stored entry at its revision."""
        e = v.entry
        return cls(
            **EntrySummary.of(e).model_dump(),
            revision=v.revision,
            generation=e.generation,
            digest=e.digest,
            helo=e.helo,
            client_address=e.client_address,
            envid=e.envid,
            ret=e.ret,
            smtputf8=e.smtputf8,
            body_8bit=e.body_8bit,
            leases=e.leases,
            last_error=e.last_error,
            body_inline=e.inline_body is not None,
            dkim=e.dkim,
        )


class Page(BaseModel):
    """One page of a listing; pass ``next_after`` as ``after`` for the next one (None: done)."""

    entries: list[EntrySummary]
    next_after: str | None = None


class ActionResult(BaseModel):
    """What one action did to one entry."""

    queue_id: str
    action: Action
    outcome: Outcome
    detail: str = ""
    state: EntryState | None = Field(None, description="entry state afterwards, if it exists")


class BulkResult(BaseModel):
    """The results of one action over many entries, with counts per outcome."""

    action: Action
    matched: int
    counts: dict[Outcome, int]
    results: list[ActionResult]

    @property
    def ok(self) -> bool:
        """True when no entry failed or was missing."""
        return not (self.counts.get(Outcome.FAILED) or self.counts.get(Outcome.NOT_FOUND))


class DomainStats(BaseModel):
    """Open recipients of one destination domain."""

    recipients: int = 0
    deferred: int = 0
    entries: int = 0


class QueueStats(BaseModel):
    """``queue stats``: counts by state and destination, the oldest message, the backlog.

    ``entries`` and ``by_state`` count the messages still queued, the same set ``queue ls``
    lists (states held, active, pending, deferred). Final entries still in the bucket are
    not queued messages and are counted apart in ``kept``: finished DSNs kept for
    ``reconciler.dsn_retention_s`` so a DSN re-enqueued after a crash is not sent twice
    (:mod:`jsqueue.dsn.notifier`), and final entries a worker or the reconciler is about to
    remove.
    """

    entries: int = Field(description="queued messages (what `queue ls` lists)")
    by_state: dict[EntryState, int] = Field(description="queued messages by state")
    kept: int = Field(0, description="final entries kept (DSN bookkeeping): not queued")
    by_domain: dict[str, DomainStats] = Field(
        description="open recipients per destination domain, most first"
    )
    oldest_id: str | None = None
    oldest_created_at: UTCDateTime | None = None
    oldest_age_s: float | None = Field(None, description="age of the oldest open entry, s")
    backlog: int | None = Field(None, description="work items not settled; None if unknown")
    took_s: float = Field(description="time the scan took, seconds")


def _recipient_view(entry: Entry, index: int) -> RecipientView:
    r = entry.recipients[index]
    return RecipientView(
        address=r.address,
        domain=r.domain,
        state=r.state,
        attempts=r.attempts,
        last_attempt_at=r.last_attempt_at,
        next_attempt_at=r.next_attempt_at,
        last_reply=r.last_reply,
        orcpt=r.orcpt,
        dsn_sent=r.dsn_sent,
    )


class DestinationView(BaseModel):
    """One destination site as ``dest ls`` / ``dest show`` (and later the HTTP API) show it,
    read from the destinations bucket, so cluster-wide.

    Attributes:
        site: the site (a destination domain, or a group name from ``destinations.groups``).
        sessions: session slots held across the cluster (open SMTP sessions, and idle ones
            kept for reuse).
        holders: worker name -> slots it holds (``dest show`` only; empty in listings).
        limit: the configured session limit.
        allowed: sessions allowed now (lower while throttled or while connection failures
            are counted).
        status: ``up``, ``down`` (dead site, RFC 5321 §4.5.4.1) or ``probe``.
        down_until: end of the cool-off, when down.
        failures: consecutive connection-level failures counted.
        throttled_until: when a throttle (a 421 or throttling 4yz) starts to wear off.
        message_rate: the message rate limit (``100/m``), None when off.
        connection_rate: the connection rate limit, None when off.
        queued: work items queued for the site, None when not counted (site groups, or
            a listing asked not to count).
    """

    site: str
    sessions: int
    holders: dict[str, int] = Field(default_factory=dict)
    limit: int
    allowed: int
    status: Literal["up", "down", "probe"]
    down_until: UTCDateTime | None = None
    failures: int = 0
    throttled_until: UTCDateTime | None = None
    message_rate: str | None = None
    connection_rate: str | None = None
    queued: int | None = None


class DestinationList(BaseModel):
    """Every destination site the cluster holds something for (``dest ls``; HTTP
    ``GET /api/v1/destinations``), by name.

    Attributes:
        sites: one view per site (without ``holders``).
    """

    sites: list[DestinationView]
