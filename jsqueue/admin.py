"""Queue operations for operators (list, show, stats, flush, hold, release, delete, bounce):
what ``mailq`` / ``postqueue`` / ``postsuper`` do for Postfix, cluster-wide, on the shared KV
entries and work stream, each returning a pydantic model of :mod:`jsqueue.views` that the CLI
(:mod:`jsqueue.cli`) renders. Every change is a pure transition of :mod:`jsqueue.state`
written by the one compare-and-set loop (:mod:`jsqueue.store.cas`), KV first, then the work
stream (DESIGN.md §2.3, §4); how the actions meet a running delivery is told in
docs/architecture.md (Operations and DSNs).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from pydantic import BaseModel, Field, field_validator

from jsqueue import replies
from jsqueue.envelope import Entry, EntryState, RecipientState, WorkItem, routing_domain, utcnow
from jsqueue.errors import EntryNotFound, InvalidName, JsqueueError, RevisionConflict, StoreError
from jsqueue.events import NULL_OBSERVER, EventKind, Observer, entry_event, recipient_event
from jsqueue.names import check_queue_id
from jsqueue.operator_state import bounced, flushed, held, released_from_hold, requeued
from jsqueue.store import cas
from jsqueue.store.base import Stores, Versioned
from jsqueue.store.layout import open_entry_body
from jsqueue.views import (
    Action,
    ActionResult,
    BulkResult,
    DomainStats,
    EntryDetail,
    EntrySummary,
    Outcome,
    Page,
    QueueStats,
)

#: Entries read per store request when scanning the whole queue (``EntryStore.page``).
SCAN_PAGE = 10_000
#: Compare-and-set tries of one action before it gives up (RevisionConflict).
ACTION_TRIES = 20
#: Actions running concurrently in a bulk operation.
BULK_CONCURRENCY = 16
#: Republish rounds of a flush whose generation keeps being superseded.
RESCHEDULE_ROUNDS = 5
#: The states listed when no state is asked for: everything still in the queue.
OPEN_STATES = frozenset(
    {EntryState.HELD, EntryState.ACTIVE, EntryState.PENDING, EntryState.DEFERRED}
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


# --------------------------------------------------------------------------- operations


def _same(entry: Entry) -> Entry:
    """The entry unchanged: what a compare-and-set delete writes (nothing but the revision)."""
    return entry


def _busy_note(entry: Entry, now: datetime) -> str:
    busy = sorted(d for d, lease in entry.leases.items() if lease.until > now)
    return f" (being delivered to {', '.join(busy)}: that attempt finishes)" if busy else ""


@dataclass(frozen=True)
class _Changed:
    before: Entry
    after: Entry | None
    detail: str


Progress = Callable[[int, int], None]
"""Bulk progress callback: ``(entries done, entries in total)``."""


class Admin:
    """Queue operations over one queue's stores (docs/architecture.md, Operations and DSNs).

    Every action is idempotent: after a StoreUnavailable or RevisionConflict, run it again.

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

        Yields:
            each matching entry at its revision.

        Raises:
            StoreUnavailable: NATS failed.
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
            StoreUnavailable: NATS failed.
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
            InvalidName: ``queue_id`` is not a queue id.
            EntryNotFound: no such entry.
            StoreUnavailable: NATS failed.
        """
        return EntryDetail.of_versioned(await self.stores.entries.get(check_queue_id(queue_id)))

    async def body(self, queue_id: str) -> AsyncGenerator[bytes, None]:
        """Stream the stored message (raw RFC 5322, CRLF line ends), chunk by chunk: the
        entry's inline body, or the body store's copy (also of a body left without entry).

        Yields:
            the message's chunks (bytes) in order.

        Raises:
            InvalidName: ``queue_id`` is not a queue id.
            BodyNotFound: neither the entry nor the body store has the message.
            BodyCorrupt: the stored body does not match its SHA-256 digest.
            StoreUnavailable: NATS failed.
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
            StoreUnavailable: reading the entries failed.
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

    async def _change(
        self, queue_id: str, fn: Callable[[Entry, datetime], tuple[Entry | None, str]]
    ) -> _Changed:
        """Apply the pure transition ``fn`` (at the current time) by compare-and-set.

        Raises:
            EntryNotFound: no such entry.
            RevisionConflict: :data:`ACTION_TRIES` writes lost their race.
            StoreUnavailable: a read or write failed.
        """
        detail = ""

        def apply(entry: Entry) -> Entry | None:
            nonlocal detail
            new, detail = fn(entry, self.clock())
            return new

        c = await cas.change(self.stores.entries, queue_id, apply, tries=ACTION_TRIES)
        return _Changed(c.before.entry, c.after.entry if c.after else None, detail)

    async def _reschedule(self, entry: Entry) -> None:
        """Publish one due-now work item per open domain with ``entry``'s generation (the
        first domain when none is open, so a worker finishes the entry: DSNs, removal); then
        make sure no newer generation's item was purged by ours (docs/architecture.md).

        Raises:
            RevisionConflict: the entry's generation kept changing for
                :data:`RESCHEDULE_ROUNDS` rounds (flush it again).
            StoreUnavailable: a publish or a read failed.
        """
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

    async def _dead_owners(self, queue_id: str) -> frozenset[str]:
        """Owners of the entry's running leases that are not present (no heartbeat within
        their grace): their leases can be broken safely. Empty without a presence store.

        Raises:
            EntryNotFound, StoreUnavailable.
        """
        presence = self.stores.presence
        if presence is None:
            return frozenset()
        now = self.clock()
        entry = (await self.stores.entries.get(queue_id)).entry
        owners = {lease.owner for lease in entry.leases.values() if lease.until > now}
        return frozenset([o for o in sorted(owners) if await presence.seen(o) is None])

    async def flush(
        self, queue_id: str, domain: str | None = None, *, break_lease: bool = False
    ) -> ActionResult:
        """Deliver now, overriding the backoff (``postqueue -i``; ``-s`` with ``domain``).

        Makes the open recipients due by compare-and-set (:func:`jsqueue.operator_state.flushed`),
        then publishes one work item per open domain with the new generation; takes effect
        within about a second (DESIGN.md §4). Held entries are left alone (release them). A
        destination under a running lease is not touched (its attempt finishes; RFC 5321
        §6.1), which the detail says with the lease's owner and end; an expired lease is
        dropped by the same compare-and-set, and so is a running lease whose owner is not
        present (a dead worker: nobody is mid-transaction). With ``break_lease`` a live
        worker's lease is broken too, which the detail warns about: a transaction under way
        cannot be recalled and the message may be sent twice (RFC 5321 §6.1). Idempotent.

        Args:
            queue_id: the entry.
            domain: only recipients of this routing domain (A-label); all when None.
            break_lease: break running leases of live workers too.

        Returns:
            DONE with the entry's state afterwards, or UNCHANGED (held, nothing open, every
            matching destination leased) with the reason in ``detail``.

        Raises:
            InvalidName: ``queue_id`` is not a queue id.
            EntryNotFound: no such entry.
            RevisionConflict: the entry kept changing meanwhile (KV, or its generation while
                republishing): re-run.
            StoreUnavailable: NATS failed; the KV change may be made already: re-run.
        """
        check_queue_id(queue_id)
        dead = await self._dead_owners(queue_id)
        c = await self._change(
            queue_id, lambda e, now: flushed(e, now, domain, dead=dead, break_live=break_lease)
        )
        if c.after is None:
            return self._result(queue_id, Action.FLUSH, Outcome.UNCHANGED, c.detail, c.before)
        await self._reschedule(c.after)
        self.observer.emit(
            entry_event(EventKind.FLUSHED, c.after, source=self.source, detail=c.detail)
        )
        return self._result(queue_id, Action.FLUSH, Outcome.DONE, c.detail, c.after)

    async def requeue(self, queue_id: str) -> ActionResult:
        """Requeue (``postsuper -r``): drop every lease, a new generation, every open
        recipient due now, attempts kept (:func:`jsqueue.operator_state.requeued`); then publish
        the new work items. A live worker's lease is broken too, and the detail warns: a
        transaction under way cannot be recalled, the message may be sent twice (RFC 5321
        §6.1). Held entries are left alone (release them). One ``requeued`` event.
        Idempotent.

        Returns:
            DONE, or UNCHANGED (held, nothing open) with the reason in ``detail``.

        Raises:
            InvalidName: ``queue_id`` is not a queue id.
            EntryNotFound: no such entry.
            RevisionConflict: the entry kept changing meanwhile: re-run.
            StoreUnavailable: NATS failed; the KV change may be made already: re-run.
        """
        check_queue_id(queue_id)
        dead = await self._dead_owners(queue_id)
        c = await self._change(queue_id, lambda e, now: requeued(e, now, dead=dead))
        if c.after is None:
            return self._result(queue_id, Action.REQUEUE, Outcome.UNCHANGED, c.detail, c.before)
        await self._reschedule(c.after)
        self.observer.emit(
            entry_event(EventKind.REQUEUED, c.after, source=self.source, detail=c.detail)
        )
        return self._result(queue_id, Action.REQUEUE, Outcome.DONE, c.detail, c.after)

    async def hold(self, queue_id: str) -> ActionResult:
        """Put the entry on hold (``postsuper -h``): nothing is attempted until released.

        An attempt already under way finishes and is recorded; the hold stays (the detail
        names the destinations being delivered). Its work items drop on arrival. Idempotent.

        Returns:
            DONE, or UNCHANGED when the entry is already held or final.

        Raises:
            InvalidName: ``queue_id`` is not a queue id.
            EntryNotFound: no such entry.
            RevisionConflict: the entry kept changing meanwhile: re-run.
            StoreUnavailable: NATS failed: re-run.
        """
        check_queue_id(queue_id)
        c = await self._change(queue_id, lambda e, now: held(e))
        if c.after is None:
            return self._result(queue_id, Action.HOLD, Outcome.UNCHANGED, c.detail, c.before)
        detail = c.detail + _busy_note(c.after, self.clock())
        self.observer.emit(entry_event(EventKind.HELD, c.after, source=self.source, detail=detail))
        return self._result(queue_id, Action.HOLD, Outcome.DONE, detail, c.after)

    async def release(self, queue_id: str) -> ActionResult:
        """Release a held entry (``postsuper -H``) and deliver it now, like a flush.

        Clears the hold flag by compare-and-set (:func:`jsqueue.operator_state.released_from_hold`),
        then publishes work items with the new generation. Idempotent.

        Returns:
            DONE, or UNCHANGED when the entry is not held.

        Raises:
            InvalidName: ``queue_id`` is not a queue id.
            EntryNotFound: no such entry.
            RevisionConflict: the entry kept changing meanwhile: re-run.
            StoreUnavailable: NATS failed; the flag may be cleared already: re-run.
        """
        check_queue_id(queue_id)
        c = await self._change(queue_id, released_from_hold)
        if c.after is None:
            return self._result(queue_id, Action.RELEASE, Outcome.UNCHANGED, c.detail, c.before)
        await self._reschedule(c.after)
        self.observer.emit(entry_event(EventKind.RELEASED, c.after, source=self.source))
        return self._result(queue_id, Action.RELEASE, Outcome.DONE, c.detail, c.after)

    async def delete(self, queue_id: str) -> ActionResult:
        """Delete the entry, its work items and its body (``postsuper -d``); no DSN.

        The entry goes by compare-and-set on its revision, then its work items and body.
        Idempotent: deleting a missing entry still removes leftover work items and body and
        answers NOT_FOUND. No delivery starts after this returns; a transaction already under
        way cannot be recalled (RFC 5321 §6.1), which the result's detail says.

        Returns:
            DONE (state None), or NOT_FOUND when there was no entry.

        Raises:
            InvalidName: ``queue_id`` is not a queue id.
            RevisionConflict: the entry kept changing meanwhile: re-run.
            StoreUnavailable: NATS failed; the entry may be deleted already: re-run.
        """
        check_queue_id(queue_id)

        async def delete_at(entry: Entry, revision: int) -> Versioned:
            await self.stores.entries.delete(queue_id, revision=revision)
            return Versioned(entry, revision)

        gone: Entry | None = None
        with contextlib.suppress(EntryNotFound):  # deleted before or meanwhile
            entries = self.stores.entries
            c = await cas.change(entries, queue_id, _same, write=delete_at, tries=ACTION_TRIES)
            gone = c.before.entry
        await self.stores.scheduler.cancel(queue_id)
        await self.stores.bodies.delete(queue_id)
        if gone is None:
            return self._result(queue_id, Action.DELETE, Outcome.NOT_FOUND, "no such entry", None)
        detail = "deleted" + _busy_note(gone, self.clock())
        self.observer.emit(entry_event(EventKind.DELETED, gone, source=self.source, detail=detail))
        return self._result(queue_id, Action.DELETE, Outcome.DONE, detail, None)

    async def bounce(self, queue_id: str) -> ActionResult:
        """Bounce every open recipient with ``550 5.7.1`` and have the DSN sent.

        A 5yz with RFC 3463 ``5.7.1``, so the DSN reports a failure, not an expiry
        (:func:`jsqueue.operator_state.bounced`; recipients of a destination being
        delivered are left alone). The entry is rescheduled at once; a worker sends the one
        DSN (RFC 3464) to the reverse-path and removes the entry. One ``bounced`` event per
        recipient.
        Idempotent.

        Returns:
            DONE, or UNCHANGED when nothing is open or everything open is being delivered.

        Raises:
            InvalidName: ``queue_id`` is not a queue id.
            EntryNotFound: no such entry.
            RevisionConflict: the entry kept changing meanwhile: re-run.
            StoreUnavailable: NATS failed; the recipients may be bounced already: re-run.
        """
        check_queue_id(queue_id)
        reply = replies.R550_BOUNCED_BY_POSTMASTER
        c = await self._change(queue_id, lambda e, now: bounced(e, now, reply))
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
        self,
        action: Action,
        queue_id: str,
        *,
        domain: str | None = None,
        break_lease: bool = False,
    ) -> ActionResult:
        """Run one action; every error becomes a NOT_FOUND or FAILED result. Never raises
        :class:`~jsqueue.errors.JsqueueError`. Idempotent as each action is.

        Args:
            action: what to do.
            queue_id: the entry.
            domain: for FLUSH only: just this destination domain.
            break_lease: for FLUSH only: break live workers' leases too.

        Returns:
            the action's result; NOT_FOUND for a missing entry, FAILED (with the error in
            ``detail``) for an invalid id, a storage error or too many conflicts.
        """
        try:
            if action is Action.FLUSH:
                return await self.flush(queue_id, domain, break_lease=break_lease)
            if action is Action.REQUEUE:
                return await self.requeue(queue_id)
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
            StoreUnavailable: NATS failed.
        """
        return [v.entry.id async for v in self.scan(flt)]

    async def apply(
        self,
        action: Action,
        queue_ids: Sequence[str],
        *,
        domain: str | None = None,
        break_lease: bool = False,
        progress: Progress | None = None,
    ) -> BulkResult:
        """Run ``action`` on each of ``queue_ids``, ``concurrency`` at a time.

        Args:
            action: what to do.
            queue_ids: the entries (e.g. from :meth:`select`).
            domain: for FLUSH only: just this destination domain.
            break_lease: for FLUSH only: break live workers' leases too.
            progress: called after each entry with (done, total).

        Returns:
            every result, in the order of ``queue_ids``, and the counts per outcome. Never
            raises :class:`~jsqueue.errors.JsqueueError` (see :meth:`act`).
        """
        results: list[ActionResult | None] = [None] * len(queue_ids)
        todo = iter(enumerate(queue_ids))
        done = 0

        async def run() -> None:
            nonlocal done
            for i, queue_id in todo:
                results[i] = await self.act(
                    action, queue_id, domain=domain, break_lease=break_lease
                )
                done += 1
                if progress is not None:
                    progress(done, len(queue_ids))

        await asyncio.gather(*(run() for _ in range(max(1, min(self.concurrency, len(queue_ids))))))
        final = [r for r in results if r is not None]
        counts: dict[Outcome, int] = {}
        for r in final:
            counts[r.outcome] = counts.get(r.outcome, 0) + 1
        return BulkResult(action=action, matched=len(queue_ids), counts=counts, results=final)
