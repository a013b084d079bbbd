"""Queue operations for operators: list, show, stats, flush, hold, release, delete, bounce.

What ``mailq`` / ``postqueue`` / ``postsuper`` do for Postfix, cluster-wide: every
operation works on the shared KV entries and work stream, from any machine that reaches
NATS. The CLI (``jsqueue queue ...``) only parses and renders; everything returns pydantic
models (``--json`` prints them).

Every change is a compare-and-set on the entry's KV revision, retried on a conflict with a
fresh read (DESIGN.md §2.3), so an action racing a worker loses nothing: a hold set while a
worker delivers survives the worker's recording CAS, and the worker's outcome survives the
hold. KV changes first, then the work stream (DESIGN.md §4):

* **flush** (``postqueue -f`` / ``-i`` / ``-s``): bump the generation, make the open
  recipients (of one domain, or all) due now, then ``Scheduler.flush`` one work item per
  open domain with the new generation; older items arrive stale and drop. A domain not
  flushed gets its item back at once, and the worker re-NAKs it until its own time. A
  running lease is never broken (the result names its owner and end); an expired one is
  dropped in the same compare-and-set.
* **hold** (``postsuper -h``): set the hold flag. Work items of a held entry drop on
  arrival; an attempt already under way finishes and is recorded.
* **release** (``postsuper -H``): clear the flag and reschedule like a flush.
* **delete** (``postsuper -d``): delete the entry by CAS, cancel its work items, delete its
  body. No delivery starts afterwards (a worker's claim is a CAS on a revision that no longer
  exists); a transaction already under way cannot be recalled (RFC 5321 §6.1). No DSN.
* **bounce**: open recipients become bounced with ``550 5.7.1`` (a 5yz, so the DSN reports a
  failure, not an expiry); the entry is rescheduled so a worker sends the DSN (RFC 3464) and
  removes it. Recipients whose domain a worker is delivering right now are left alone.

After republishing work items, a flush/release/bounce re-reads the entry: when another
action bumped the generation meanwhile, its item may have been purged by ours, so the item
is published again with the newest generation (two concurrent flushes cannot strand a
message). An action returns once KV and the stream are updated; a StoreUnavailable after
the KV change means "re-run the action" (every action is idempotent).

Events (``jsqueue.events``) are emitted for every change: flushed, held, released, deleted,
and one bounced per recipient.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import re
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from jsqueue import replies
from jsqueue.config import Settings
from jsqueue.envelope import (
    Entry,
    EntryState,
    Lease,
    RecipientState,
    UTCDateTime,
    WorkItem,
    routing_domain,
    utcnow,
)
from jsqueue.errors import (
    EntryNotFound,
    InvalidName,
    JsqueueError,
    RevisionConflict,
    StoreError,
)
from jsqueue.events import (
    NULL_OBSERVER,
    Event,
    EventKind,
    Observer,
    entry_event,
    open_publisher,
    recipient_event,
)
from jsqueue.names import check_queue_id
from jsqueue.replies import Reply
from jsqueue.state import release as release_lease
from jsqueue.store.base import Stores, Versioned
from jsqueue.store.layout import open_entry_body

#: Entries read per store request when scanning the whole queue (``EntryStore.page``).
SCAN_PAGE = 10_000
#: Compare-and-set tries of one action before it gives up (RevisionConflict).
CAS_TRIES = 20
#: Actions running concurrently in a bulk operation.
BULK_CONCURRENCY = 16
#: Republish rounds of a flush whose generation keeps being superseded.
RESCHEDULE_ROUNDS = 5
#: The states listed when no state is asked for: everything still in the queue.
OPEN_STATES = frozenset(
    {EntryState.HELD, EntryState.ACTIVE, EntryState.PENDING, EntryState.DEFERRED}
)


class Action(StrEnum):
    """An operator action on one entry."""

    FLUSH = "flush"
    HOLD = "hold"
    RELEASE = "release"
    DELETE = "delete"
    BOUNCE = "bounce"


class Outcome(StrEnum):
    """What an action did to one entry."""

    DONE = "done"  # changed as asked
    UNCHANGED = "unchanged"  # nothing to do (already held, nothing open ...)
    NOT_FOUND = "not-found"  # no such entry
    FAILED = "failed"  # storage error or too many conflicts: re-run the action


# --------------------------------------------------------------------------- models


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
    (:mod:`jsqueue.bounce`), and final entries a worker or the reconciler is about to
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


# --------------------------------------------------------------------------- filters


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """``"90"``, ``"90s"``, ``"15m"``, ``"2h"``, ``"3d"``, ``"1w"`` → seconds.

    Raises:
        ValueError: anything else.
    """
    match = _DURATION_RE.match(text)
    if not match:
        raise ValueError(f"invalid duration {text!r}: expected a number with s, m, h, d or w")
    return float(match[1]) * _UNIT_S[match[2].lower()]


class EntryFilter(BaseModel):
    """Which entries a listing or bulk action covers. All conditions must hold.

    Attributes:
        states: derived entry states; None means every state but ``done``.
        domain: a destination domain with an open recipient (any recipient for done
            entries); U-labels are converted to A-labels.
        sender: the reverse-path, case-insensitive; ``<>`` for the null reverse-path;
            ``@example.com`` for any sender at that domain.
        min_age_s: only entries at least this old, seconds.
        max_age_s: only entries at most this old, seconds.

    Raises:
        pydantic.ValidationError: ``domain`` cannot be a routing domain, or an age is < 0.
    """

    states: frozenset[EntryState] | None = None
    domain: str | None = None
    sender: str | None = None
    min_age_s: float | None = Field(None, ge=0)
    max_age_s: float | None = Field(None, ge=0)

    @field_validator("domain")
    @classmethod
    def _a_label(cls, domain: str | None) -> str | None:
        return routing_domain("x@" + domain) if domain is not None else None

    @property
    def is_empty(self) -> bool:
        """True when no condition was given (every open entry matches)."""
        return not (self.states or self.domain or self.sender) and (
            self.min_age_s is None and self.max_age_s is None
        )

    def store_state(self) -> EntryState | None:
        """The one state the store can filter on itself, if exactly one is asked for."""
        return next(iter(self.states)) if self.states and len(self.states) == 1 else None

    def matches(self, entry: Entry, now: datetime) -> bool:
        """Whether ``entry`` passes every condition at ``now``. Pure."""
        st = entry.state
        if st not in (self.states or OPEN_STATES):
            return False
        if self.domain is not None:
            final = entry.is_final
            if not any(
                r.domain == self.domain and (final or not r.state.is_final)
                for r in entry.recipients
            ):
                return False
        if self.sender is not None and not _sender_matches(self.sender, entry.reverse_path):
            return False
        age_s = (now - entry.created_at).total_seconds()
        if self.min_age_s is not None and age_s < self.min_age_s:
            return False
        return self.max_age_s is None or age_s <= self.max_age_s


def _sender_matches(pattern: str, reverse_path: str) -> bool:
    pattern = pattern.strip().casefold()
    if pattern in ("<>", ""):
        return reverse_path == ""
    if pattern.startswith("@"):
        return reverse_path.casefold().endswith(pattern)
    return reverse_path.casefold() == pattern.strip("<>")


# --------------------------------------------------------------------------- pure changes


def flushed(entry: Entry, now: datetime, domain: str | None = None) -> tuple[Entry | None, str]:
    """``entry`` with its open recipients (of ``domain``, or all) due ``now`` and a new
    generation; None (with the reason) when it is held, nothing is open, or every such
    recipient's destination is under a running lease. Pure.

    Leases (DESIGN.md §2.3), per destination domain:

    * a lease still running (``until`` after ``now``) is never broken: its worker may be in
      the middle of the SMTP transaction, and a second attempt could send the message twice.
      Its recipients are left as they are and the reason says ``<domain>: leased by <owner>
      until <time> UTC, tried then``: if that worker died, the destination is tried when the
      lease runs out; if it lives, its outcome sets the next attempt.
    * a lease that has run out (its worker died or gave up) is dropped and its active
      recipients become pending (deferred after an attempt) and due ``now``, as a worker's
      own claim would override it. The caller writes the result by compare-and-set, so a
      worker that claims the destination meanwhile wins and the flush is applied to its
      version.
    """
    if entry.held:
        return None, "held: release it instead"
    wanted = {
        r.domain
        for r in entry.recipients
        if not r.state.is_final and (domain is None or r.domain == domain)
    }
    if not wanted:
        return None, "nothing to deliver"
    live = {d: lease for d, lease in entry.leases.items() if d in wanted and lease.until > now}
    notes = [
        f"{d}: leased by {lease.owner} until {_ts(lease.until)} UTC, tried then if that worker "
        "is gone (a running lease is never broken: its worker may be mid-delivery)"
        for d, lease in sorted(live.items())
    ]
    free = wanted - live.keys()
    if not free:
        return None, "; ".join(notes)
    new = entry.model_copy(deep=True)
    new.generation += 1
    for d in sorted(free):
        ran_out = new.leases.get(d)
        if ran_out is not None:
            new = release_lease(new, d)
            notes.insert(0, f"{d}: lease of {ran_out.owner} expired {_ts(ran_out.until)} UTC")
    count = 0
    for r in new.recipients:
        if not r.state.is_final and r.domain in free:
            r.next_attempt_at = now
            count += 1
    return new, "; ".join([f"{count} recipient(s) due now", *notes])


def held(entry: Entry) -> tuple[Entry | None, str]:
    """``entry`` with the hold flag set; None when already held or final. Pure."""
    if entry.is_final:
        return None, "already final"
    if entry.held:
        return None, "already held"
    new = entry.model_copy(deep=True)
    new.held = True
    return new, "held"


def released(entry: Entry, now: datetime) -> tuple[Entry | None, str]:
    """``entry`` with the hold flag cleared, open recipients due ``now`` and a new
    generation; None when it is not held. Pure."""
    if not entry.held:
        return None, "not held"
    new = entry.model_copy(deep=True)
    new.held = False
    new.generation += 1
    for r in new.recipients:
        if not r.state.is_final:
            r.next_attempt_at = now
    return new, "released"


def bounced(entry: Entry, now: datetime, reply: Reply) -> tuple[Entry | None, str]:
    """``entry`` with every open recipient bounced with ``reply`` (``failed`` when the
    reverse-path is null: no DSN is owed, RFC 5321 §4.5.5) and a new generation. Recipients
    of a domain whose lease is still running (a worker is delivering) are left alone. Pure.
    """
    busy = {d for d, lease in entry.leases.items() if lease.until > now}
    targets = [r for r in entry.recipients if not r.state.is_final and r.domain not in busy]
    if not targets:
        return None, "being delivered: try again" if busy else "nothing to bounce"
    final = RecipientState.FAILED if entry.reverse_path == "" else RecipientState.BOUNCED
    new = entry.model_copy(deep=True)
    new.generation += 1
    for r in new.recipients:
        if not r.state.is_final and r.domain not in busy:
            r.state, r.last_reply, r.next_attempt_at = final, reply, None
            new.leases.pop(r.domain, None)
    note = f"; left {', '.join(sorted(busy))} alone (being delivered)" if busy else ""
    return new, f"{len(targets)} recipient(s) bounced{note}"


def _busy_note(entry: Entry, now: datetime) -> str:
    busy = sorted(d for d, lease in entry.leases.items() if lease.until > now)
    return f" (being delivered to {', '.join(busy)}: that attempt finishes)" if busy else ""


# --------------------------------------------------------------------------- operations


@dataclass(frozen=True)
class _Changed:
    before: Entry
    after: Entry | None
    detail: str


Progress = Callable[[int, int], None]
"""Bulk progress callback: ``(entries done, entries in total)``."""


class Admin:
    """Queue operations over one queue's stores (see the module docstring).

    Args:
        stores: the queue.
        observer: receives the events of every change (the events stream publisher).
        source: recorded as the events' ``source`` (who acted).
        clock: the current aware UTC time.
        concurrency: actions in flight in a bulk operation.
    """

    def __init__(
        self,
        stores: Stores,
        observer: Observer = NULL_OBSERVER,
        *,
        source: str = "admin",
        clock: Callable[[], datetime] = utcnow,
        concurrency: int = BULK_CONCURRENCY,
    ) -> None:
        self.stores = stores
        self.observer = observer
        self.source = source
        self.clock = clock
        self.concurrency = concurrency

    # ------------------------------------------------------------------ reading

    async def scan(
        self,
        flt: EntryFilter,
        *,
        after: str | None = None,
        page_size: int = SCAN_PAGE,
        first_page: int | None = None,
    ) -> AsyncGenerator[Versioned, None]:
        """Every entry matching ``flt`` in queue-id (arrival) order, page by page.

        Args:
            flt: which entries.
            after: start after this queue id.
            page_size: entries read per store request (1..10000).
            first_page: a smaller first request, so the first entries come quickly.

        Raises:
            StoreUnavailable.
        """
        now = self.clock()
        state = flt.store_state()
        size = first_page or page_size
        while True:
            page = await self.stores.entries.page(state=state, after=after, limit=size)
            for v in page:
                if flt.matches(v.entry, now):
                    yield v
            if len(page) < size:
                return
            after = page[-1].entry.id
            size = page_size

    async def page(
        self, flt: EntryFilter | None = None, *, after: str | None = None, limit: int = 100
    ) -> Page:
        """One page of ``queue ls``: at most ``limit`` matching entries after ``after``.

        Reads only as far as the page needs (the first page of a 100 000-entry queue costs
        one key listing and about ``limit`` reads).

        Raises:
            InvalidName: ``after`` is not a queue id.
            StoreUnavailable.
        """
        if after is not None:
            check_queue_id(after)
        flt = flt or EntryFilter()
        out: list[EntrySummary] = []
        size = min(10_000, max(limit, 100))
        async with contextlib.aclosing(self.scan(flt, after=after, page_size=size)) as found:
            async for v in found:
                out.append(EntrySummary.of(v.entry))
                if len(out) >= limit:
                    return Page(entries=out, next_after=out[-1].id)
        return Page(entries=out)

    async def show(self, queue_id: str) -> EntryDetail:
        """The whole entry with every recipient's attempts and last reply.

        Raises:
            EntryNotFound, InvalidName, StoreUnavailable.
        """
        return EntryDetail.of_versioned(await self.stores.entries.get(check_queue_id(queue_id)))

    async def body(self, queue_id: str) -> AsyncGenerator[bytes, None]:
        """Stream the stored message (raw RFC 5322, CRLF line ends), chunk by chunk: the
        entry's inline body, or the body store's copy (also of a body left without entry).

        Raises:
            BodyNotFound, BodyCorrupt, InvalidName, StoreUnavailable (from the iterator).
        """
        check_queue_id(queue_id)
        try:
            chunks = open_entry_body(
                self.stores.bodies, (await self.stores.entries.get(queue_id)).entry
            )
        except EntryNotFound:
            chunks = self.stores.bodies.open(queue_id)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def stats(self) -> QueueStats:
        """Counts by state and destination domain, the oldest open entry, the backlog.

        Counts the entries :meth:`page` lists (``queue ls`` without filters); final entries
        (kept DSN records) are counted in :attr:`QueueStats.kept` only. Reads every entry
        once (one pass, ``SCAN_PAGE`` entries per request): seconds for 100 000 entries, so
        not for a hot path. The backlog is None when the consumer cannot be asked.

        Raises:
            StoreUnavailable.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        by_state: dict[EntryState, int] = {}
        by_domain: dict[str, DomainStats] = {}
        oldest: Entry | None = None
        total = kept = 0
        async for v in self.scan(EntryFilter(states=frozenset(EntryState))):
            e = v.entry
            st = e.state
            if st not in OPEN_STATES:  # what `queue ls` leaves out by default: done
                kept += 1
                continue
            total += 1
            by_state[st] = by_state.get(st, 0) + 1
            if oldest is None or e.created_at < oldest.created_at:
                oldest = e
            seen: set[str] = set()
            for r in e.recipients:
                if r.state.is_final:
                    continue
                d = by_domain.setdefault(r.domain, DomainStats())
                d.recipients += 1
                d.deferred += r.state is RecipientState.DEFERRED
                if r.domain not in seen:
                    seen.add(r.domain)
                    d.entries += 1
        try:
            backlog: int | None = await self.stores.scheduler.backlog()
        except StoreError:
            backlog = None
        now = self.clock()
        ordered = dict(sorted(by_domain.items(), key=lambda kv: (-kv[1].recipients, kv[0])))
        return QueueStats(
            entries=total,
            by_state=by_state,
            kept=kept,
            by_domain=ordered,
            oldest_id=oldest.id if oldest else None,
            oldest_created_at=oldest.created_at if oldest else None,
            oldest_age_s=(now - oldest.created_at).total_seconds() if oldest else None,
            backlog=backlog,
            took_s=loop.time() - started,
        )

    # ------------------------------------------------------------------ actions

    async def _cas(
        self, queue_id: str, change: Callable[[Entry, datetime], tuple[Entry | None, str]]
    ) -> _Changed:
        for _ in range(CAS_TRIES):
            v = await self.stores.entries.get(queue_id)
            new, detail = change(v.entry, self.clock())
            if new is None:
                return _Changed(v.entry, None, detail)
            try:
                await self.stores.entries.update(new, v.revision)
            except RevisionConflict:
                continue
            return _Changed(v.entry, new, detail)
        raise RevisionConflict(f"entry {queue_id}: changed {CAS_TRIES} times meanwhile")

    async def _reschedule(self, entry: Entry) -> None:
        """Publish one due-now work item per open domain with ``entry``'s generation (the
        first domain when none is open, so a worker finishes the entry: DSNs, removal); then
        make sure no newer generation's item was purged by ours (module docstring)."""
        for _ in range(RESCHEDULE_ROUNDS):
            domains = [d for d in entry.domains if entry.open_recipients(d)] or entry.domains[:1]
            for domain in domains:
                await self.stores.scheduler.flush(WorkItem(entry.id, domain, entry.generation))
            try:
                current = (await self.stores.entries.get(entry.id)).entry
            except EntryNotFound:
                return
            if current.generation == entry.generation:
                return
            entry = current
        raise RevisionConflict(f"entry {entry.id}: generation keeps changing; flush it again")

    def _result(
        self, queue_id: str, action: Action, outcome: Outcome, detail: str, entry: Entry | None
    ) -> ActionResult:
        return ActionResult(
            queue_id=queue_id,
            action=action,
            outcome=outcome,
            detail=detail,
            state=entry.state if entry is not None else None,
        )

    async def flush(self, queue_id: str, domain: str | None = None) -> ActionResult:
        """Deliver now, overriding the backoff (``postqueue -i``; ``-s`` with ``domain``).

        Idempotent; takes effect within about a second (DESIGN.md §4). Held entries are left
        alone (release them). A destination under a running lease (a worker claimed it, and
        may be delivering or may have died) is not touched: that attempt finishes and its
        outcome sets the next attempt, or, if the worker is gone, the destination is tried
        when the lease runs out. The result says so with the lease's owner and end, and is
        UNCHANGED when nothing else was flushed. An expired lease is dropped by the same
        compare-and-set, so a destination left behind by a dead worker is tried now (see
        :func:`flushed`).

        Args:
            queue_id: the entry.
            domain: only recipients of this routing domain (A-label); all when None.

        Raises:
            EntryNotFound, InvalidName, StoreUnavailable, RevisionConflict (too many
            concurrent changes: re-run).
        """
        check_queue_id(queue_id)
        c = await self._cas(queue_id, lambda e, now: flushed(e, now, domain))
        if c.after is None:
            return self._result(queue_id, Action.FLUSH, Outcome.UNCHANGED, c.detail, c.before)
        await self._reschedule(c.after)
        self.observer.emit(
            entry_event(EventKind.FLUSHED, c.after, source=self.source, detail=c.detail)
        )
        return self._result(queue_id, Action.FLUSH, Outcome.DONE, c.detail, c.after)

    async def hold(self, queue_id: str) -> ActionResult:
        """Put the entry on hold (``postsuper -h``): nothing is attempted until released.

        Idempotent. An attempt already under way finishes and is recorded; the hold stays.

        Raises:
            EntryNotFound, InvalidName, StoreUnavailable, RevisionConflict.
        """
        check_queue_id(queue_id)
        c = await self._cas(queue_id, lambda e, now: held(e))
        if c.after is None:
            return self._result(queue_id, Action.HOLD, Outcome.UNCHANGED, c.detail, c.before)
        detail = c.detail + _busy_note(c.after, self.clock())
        self.observer.emit(entry_event(EventKind.HELD, c.after, source=self.source, detail=detail))
        return self._result(queue_id, Action.HOLD, Outcome.DONE, detail, c.after)

    async def release(self, queue_id: str) -> ActionResult:
        """Release a held entry (``postsuper -H``) and deliver it now, like a flush.

        Idempotent.

        Raises:
            EntryNotFound, InvalidName, StoreUnavailable, RevisionConflict.
        """
        check_queue_id(queue_id)
        c = await self._cas(queue_id, released)
        if c.after is None:
            return self._result(queue_id, Action.RELEASE, Outcome.UNCHANGED, c.detail, c.before)
        await self._reschedule(c.after)
        self.observer.emit(entry_event(EventKind.RELEASED, c.after, source=self.source))
        return self._result(queue_id, Action.RELEASE, Outcome.DONE, c.detail, c.after)

    async def delete(self, queue_id: str) -> ActionResult:
        """Delete the entry, its work items and its body (``postsuper -d``); no DSN.

        Idempotent: deleting a missing entry still removes leftover work items and body and
        answers NOT_FOUND. No delivery starts after this returns; a transaction already under
        way cannot be recalled (RFC 5321 §6.1), which the result's detail says.

        Raises:
            InvalidName, StoreUnavailable (the entry may be deleted already: re-run),
            RevisionConflict.
        """
        check_queue_id(queue_id)
        gone: Entry | None = None
        for _ in range(CAS_TRIES):
            try:
                v = await self.stores.entries.get(queue_id)
            except EntryNotFound:
                break
            try:
                await self.stores.entries.delete(queue_id, revision=v.revision)
            except RevisionConflict:
                continue
            gone = v.entry
            break
        else:
            raise RevisionConflict(f"entry {queue_id}: changed {CAS_TRIES} times meanwhile")
        await self.stores.scheduler.cancel(queue_id)
        await self.stores.bodies.delete(queue_id)
        if gone is None:
            return self._result(queue_id, Action.DELETE, Outcome.NOT_FOUND, "no such entry", None)
        detail = "deleted" + _busy_note(gone, self.clock())
        self.observer.emit(entry_event(EventKind.DELETED, gone, source=self.source, detail=detail))
        return self._result(queue_id, Action.DELETE, Outcome.DONE, detail, None)

    async def bounce(self, queue_id: str) -> ActionResult:
        """Bounce every open recipient with ``550 5.7.1`` and have the DSN sent.

        The entry is rescheduled at once; a worker sends the DSN (RFC 3464) to the
        reverse-path and removes the entry. Idempotent.

        Raises:
            EntryNotFound, InvalidName, StoreUnavailable, RevisionConflict.
        """
        check_queue_id(queue_id)
        reply = replies.R550_BOUNCED_BY_POSTMASTER
        c = await self._cas(queue_id, lambda e, now: bounced(e, now, reply))
        if c.after is None:
            return self._result(queue_id, Action.BOUNCE, Outcome.UNCHANGED, c.detail, c.before)
        await self._reschedule(c.after)
        now = self.clock()
        before = {r.address: r.state for r in c.before.recipients}
        for r in c.after.recipients:
            if r.state.is_final and not before[r.address].is_final:
                self.observer.emit(
                    recipient_event(EventKind.BOUNCED, c.after, r, source=self.source, at=now)
                )
        return self._result(queue_id, Action.BOUNCE, Outcome.DONE, c.detail, c.after)

    async def act(
        self, action: Action, queue_id: str, *, domain: str | None = None
    ) -> ActionResult:
        """Run one action; every error becomes a NOT_FOUND or FAILED result. Never raises
        :class:`~jsqueue.errors.JsqueueError`.

        Args:
            action: what to do.
            queue_id: the entry.
            domain: for FLUSH only: just this destination domain.
        """
        try:
            if action is Action.FLUSH:
                return await self.flush(queue_id, domain)
            if action is Action.HOLD:
                return await self.hold(queue_id)
            if action is Action.RELEASE:
                return await self.release(queue_id)
            if action is Action.DELETE:
                return await self.delete(queue_id)
            return await self.bounce(queue_id)
        except EntryNotFound:
            return self._result(queue_id, action, Outcome.NOT_FOUND, "no such entry", None)
        except InvalidName as e:
            return self._result(queue_id, action, Outcome.FAILED, str(e), None)
        except JsqueueError as e:
            return self._result(queue_id, action, Outcome.FAILED, f"{e}; re-run", None)

    async def select(self, flt: EntryFilter) -> list[str]:
        """Queue ids of every entry matching ``flt``, in arrival order.

        Raises:
            StoreUnavailable.
        """
        return [v.entry.id async for v in self.scan(flt)]

    async def apply(
        self,
        action: Action,
        queue_ids: Sequence[str],
        *,
        domain: str | None = None,
        progress: Progress | None = None,
    ) -> BulkResult:
        """Run ``action`` on each of ``queue_ids``, ``concurrency`` at a time.

        Args:
            action: what to do.
            queue_ids: the entries (e.g. from :meth:`select`).
            domain: for FLUSH only: just this destination domain.
            progress: called after each entry with (done, total).

        Returns:
            every result, in the order of ``queue_ids``, and the counts per outcome.
        """
        results: list[ActionResult | None] = [None] * len(queue_ids)
        todo = iter(enumerate(queue_ids))
        done = 0

        async def run() -> None:
            nonlocal done
            for i, queue_id in todo:
                results[i] = await self.act(action, queue_id, domain=domain)
                done += 1
                if progress is not None:
                    progress(done, len(queue_ids))

        await asyncio.gather(*(run() for _ in range(max(1, min(self.concurrency, len(queue_ids))))))
        final = [r for r in results if r is not None]
        counts: dict[Outcome, int] = {}
        for r in final:
            counts[r.outcome] = counts.get(r.outcome, 0) + 1
        return BulkResult(action=action, matched=len(queue_ids), counts=counts, results=final)


# --------------------------------------------------------------------------- composition


def operator_name() -> str:
    """``admin:<user>@<host>``: who acted, for the events' ``source``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"admin:{user}@{socket.gethostname()}"


@contextlib.asynccontextmanager
async def open_admin(settings: Settings, *, events: bool = True) -> AsyncIterator[Admin]:
    """An :class:`Admin` connected to the configured NATS (``nats.urls``, else
    ``127.0.0.1:nats.port``), publishing events when ``events`` is set.

    On exit, buffered events are published (bounded by ``nats.request_timeout_s``) and the
    connections close.

    Raises:
        StoreUnavailable: NATS unreachable.
        ProvisioningError: see :func:`jsqueue.store.jetstream.provision`.
    """
    from jsqueue.runtime import nats_urls
    from jsqueue.store.jetstream import open_jetstream

    urls = nats_urls(settings)
    stores = await open_jetstream(settings.nats, urls)
    try:
        if not events:
            yield Admin(stores, source=operator_name())
            return
        async with open_publisher(settings.nats, urls) as publisher:
            yield Admin(stores, publisher, source=operator_name())
    finally:
        await stores.close()


# --------------------------------------------------------------------------- rendering


def _ts(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


def human_age(seconds: float) -> str:
    """``93784`` → ``1d 2h``; ``125`` → ``2m 5s``."""
    s = int(max(0.0, seconds))
    parts = [(s // 86400, "d"), (s % 86400 // 3600, "h"), (s % 3600 // 60, "m"), (s % 60, "s")]
    shown = [f"{n}{unit}" for n, unit in parts if n]
    return " ".join(shown[:2]) or "0s"


_MARK = {EntryState.HELD: "!", EntryState.ACTIVE: "*"}
LS_HEADER = f"{'-Queue ID-':<27} {'--Size--':>8} {'--Arrival (UTC)--':<19}  -Sender/Recipient-"


def render_entry_lines(e: EntrySummary) -> list[str]:
    """``mailq``-style lines of one entry: id (``!`` held, ``*`` active), size, arrival,
    sender; then per recipient its state, attempts, next attempt and last reply."""
    sender = e.reverse_path or "<>"
    lines = [f"{e.id}{_MARK.get(e.state, ' ')} {e.size:>8} {_ts(e.created_at):<19}  {sender}"]
    for r in e.recipients:
        info = f"{r.state.value}"
        if r.attempts:
            info += f", {r.attempts} attempt{'s' if r.attempts != 1 else ''}"
        if r.next_attempt_at and not r.state.is_final:
            info += f", next {_ts(r.next_attempt_at)}"
        lines.append(f"{'':>58}  {r.address}  [{info}]")
        if r.last_reply is not None:
            lines.append(f"{'':>60}({r.last_reply})")
    return lines


def render_detail(d: EntryDetail) -> list[str]:
    """``queue show`` lines: envelope fields, then every recipient."""
    lines = [
        f"id:           {d.id}",
        f"state:        {d.state.value}{' (held)' if d.held else ''}",
        f"arrival:      {_ts(d.created_at)} UTC",
        f"sender:       <{d.reverse_path}>",
        f"size:         {d.size} octets, sha256 {d.digest or '-'}, "
        + ("inline in the entry" if d.body_inline else "in the object store"),
        f"client:       {d.client_address or '-'} (helo {d.helo or '-'})",
        f"envid/ret:    {d.envid or '-'} / {d.ret or '-'}",
        f"smtputf8:     {d.smtputf8}, 8bit body: {d.body_8bit}, dsn: {d.is_dsn}",
        f"generation:   {d.generation} (revision {d.revision})",
    ]
    for domain, lease in d.leases.items():
        lines.append(f"lease:        {domain} by {lease.owner} until {_ts(lease.until)} UTC")
    if d.last_error:
        lines.append(f"last error:   {d.last_error}")
    lines.append("recipients:")
    for r in d.recipients:
        lines.append(f"  <{r.address}>  {r.state.value}, {r.attempts} attempt(s)")
        if r.orcpt:
            lines.append(f"      orcpt:   {r.orcpt}")
        lines.append(f"      last:    {_ts(r.last_attempt_at)}  next: {_ts(r.next_attempt_at)}")
        if r.last_reply is not None:
            host = r.last_reply.remote_host or "local"
            lines.append(f"      reply:   {r.last_reply} (from {host})")
    return lines


def render_stats(s: QueueStats, top: int = 20) -> list[str]:
    """``queue stats`` lines."""
    lines = [f"entries:      {s.entries}"]
    for st in EntryState:
        if s.by_state.get(st):
            lines.append(f"  {st.value:<10}  {s.by_state[st]}")
    if s.kept:
        lines.append(
            f"kept:         {s.kept} final records (DSN bookkeeping), not queued "
            "(queue ls --state done)"
        )
    if s.oldest_id is not None and s.oldest_age_s is not None:
        lines.append(f"oldest:       {s.oldest_id} ({human_age(s.oldest_age_s)} old)")
    lines.append(f"backlog:      {'unknown' if s.backlog is None else s.backlog} work items")
    if s.by_domain:
        lines.append("destinations (open recipients / deferred / entries):")
        for domain, d in list(s.by_domain.items())[:top]:
            lines.append(f"  {domain:<40} {d.recipients:>7} {d.deferred:>7} {d.entries:>7}")
        if len(s.by_domain) > top:
            lines.append(f"  ... {len(s.by_domain) - top} more")
    lines.append(f"(scanned in {s.took_s:.2f} s)")
    return lines


def render_result(r: ActionResult) -> str:
    """One line per action result."""
    return f"{r.queue_id}: {r.action.value} {r.outcome.value}{': ' + r.detail if r.detail else ''}"


def render_counts(b: BulkResult) -> str:
    """The summary line of a bulk action."""
    counts = ", ".join(f"{n} {o.value}" for o, n in sorted(b.counts.items()))
    return f"{b.action.value}: {b.matched} matched; {counts or 'nothing done'}"


def summaries_total(entries: Iterable[EntrySummary]) -> tuple[int, int]:
    """(entries, octets) of a listing, for the ``mailq`` closing line."""
    n = size = 0
    for e in entries:
        n += 1
        size += e.size
    return n, size


def render_event(e: Event) -> str:
    """One line per event: time, kind, queue id and what is known (recipient, reply ...)."""
    parts = [_ts(e.at), f"{e.kind.value:<9}", e.queue_id]
    if e.recipient is not None:
        parts.append(f"to=<{e.recipient}>")
    elif e.recipients is not None and e.kind is EventKind.RECEIVED:
        parts.append(f"from=<{e.reverse_path or ''}> to={','.join(e.recipients)} size={e.size}")
    if e.reply is not None:
        parts.append(f"({e.reply})")
    if e.next_attempt_at is not None:
        parts.append(f"next={_ts(e.next_attempt_at)}")
    if e.detail:
        parts.append(e.detail)
    if e.source:
        parts.append(f"by {e.source}")
    return " ".join(parts)
