"""The pluggable storage layer: body store, entry store, scheduler and ingest log, and the
reconciler's inventory and lock (Protocols).

Each Protocol has a JetStream implementation (:mod:`jsqueue.store.jetstream`) and an
in-memory one (:mod:`jsqueue.store.memory`) with the same semantics, revision conflicts
included; ``tests/test_store_contract.py`` runs one suite against both.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple, Protocol, runtime_checkable

from jsqueue.envelope import Entry, EntryState, WorkItem
from jsqueue.errors import EntryTooLarge, InvalidName, StoreError
from jsqueue.pacing import Pacer
from jsqueue.store.policies import PolicyCache

# re-exported: the destinations bucket's Protocol lives in its own module
from jsqueue.store.sites import DestinationStore as DestinationStore
from jsqueue.store.sites import Keyed as Keyed


@dataclass(frozen=True)
class BodyInfo:
    """What the body store knows of a stored body: size in octets and SHA-256 hex digest."""

    size: int
    digest: str


@dataclass(frozen=True)
class Versioned:
    """An entry together with the store revision it was read at (the CAS token)."""

    entry: Entry
    revision: int


@runtime_checkable
class BodyStore(Protocol):
    """Raw RFC 5322 message bodies keyed by queue id. Bodies are streamed, never held whole."""

    async def put(
        self, queue_id: str, chunks: AsyncIterable[bytes], *, fresh: bool = False
    ) -> BodyInfo:
        """Store a body from a stream of byte chunks; replaces any body under the same id.

        Args:
            queue_id: the body's name.
            chunks: the raw message in pieces of any size.
            fresh: the caller vouches that nothing was ever stored under ``queue_id`` (an
                id it just generated); a backend may then lay the body out so that
                :meth:`delete` takes one request. Wrongly set, a replaced body may read
                as corrupt.

        Returns:
            size (octets) and SHA-256 hex digest of what was stored.

        Raises:
            InvalidName: bad queue id.
            StoreUnavailable: the backend failed; nothing usable is left behind.
        """
        ...

    def open(self, queue_id: str, *, expect: BodyInfo | None = None) -> AsyncGenerator[bytes, None]:
        """Stream a stored body chunk by chunk.

        ``expect`` is the size and digest the caller already knows (the entry's, as
        returned by :meth:`put`): a backend may then skip reading its own record of them.
        A body that does not match ``expect`` raises :class:`BodyCorrupt`.

        The digest is checked as the stream ends: a mismatch raises :class:`BodyCorrupt`
        from the iterator instead of finishing, so a consumer that sends the final chunk only
        after the iterator is exhausted never delivers a damaged body.

        Raises:
            BodyNotFound: nothing stored under the id.
            BodyCorrupt: the bytes do not match the stored digest.
            StoreUnavailable: the backend failed.
        """
        ...

    async def info(self, queue_id: str) -> BodyInfo:
        """Size and digest of a stored body.

        Raises:
            InvalidName: bad queue id.
            BodyNotFound: nothing stored under the id.
            StoreUnavailable: the backend failed.
        """
        ...

    async def delete(self, queue_id: str) -> None:
        """Delete a body. Idempotent: deleting a missing body is not an error.

        Raises:
            InvalidName: bad queue id.
            StoreUnavailable: the backend failed.
        """
        ...

    async def discard(self, queue_id: str) -> None:
        """Delete the body of mail whose entry is gone, not waiting for the backend's
        answer where it can (the body of mail just delivered). Best effort: never raises
        for the backend; a discard it loses leaves an orphan body, which the reconciler's
        sweep removes (docs/architecture.md, "The reconciler: repairs after crashes"). Idempotent.

        Raises:
            InvalidName: bad queue id.
        """
        ...


@runtime_checkable
class EntryStore(Protocol):
    """Queue entries keyed by queue id, updated only by compare-and-set on the revision."""

    @property
    def max_value_size(self) -> int:
        """The largest stored form of an entry (:meth:`Entry.to_json`, inline body
        included) the store takes, octets; a larger one raises EntryTooLarge (a
        StoreError, not an outage: retrying cannot help). The front end keeps a body
        inline only while its entry stays well below it."""
        ...

    async def create(self, entry: Entry) -> int:
        """Store a new entry if none exists under its id.

        Returns:
            the new revision.

        Raises:
            EntryExists: an entry (not deleted) is already stored under the id.
            EntryTooLarge: the stored form is larger than :attr:`max_value_size` (nothing
                is written).
            InvalidName: bad queue id.
            StoreUnavailable: the backend failed.
        """
        ...

    async def get(self, queue_id: str) -> Versioned:
        """Read an entry and its revision.

        Raises:
            EntryDeleted: no entry, and the store knows it was deleted lately (an
                EntryNotFound).
            EntryNotFound: no entry under the id (not stored yet, or long gone).
            InvalidName: bad queue id.
            StoreUnavailable: the backend failed.
        """
        ...

    async def get_many(self, queue_ids: Sequence[str]) -> list[Versioned | StoreError]:
        """Many entries (repeats allowed) in few requests, for scans: per id, in order, the
        entry or the error :meth:`get` raises for it (a :class:`StoreError` for a value that
        is no entry). A read-only snapshot: "not found" is not confirmed on the stream leader
        (confirm it by :meth:`get`); "deleted" holds, as ids are never reused.

        Raises:
            InvalidName: a bad queue id.
            StoreUnavailable: the backend failed.
        """
        ...

    async def update(self, entry: Entry, revision: int) -> int:
        """Replace the entry if its stored revision is still ``revision`` (compare-and-set).

        Returns:
            the new revision.

        Raises:
            RevisionConflict: the entry changed (or was deleted) since ``revision`` was read.
            EntryTooLarge: the stored form is larger than :attr:`max_value_size` (nothing
                is written).
            InvalidName: bad queue id.
            StoreUnavailable: the backend failed.
        """
        ...

    async def delete(self, queue_id: str, revision: int | None = None) -> None:
        """Delete an entry; with ``revision``, only if it is still at that revision.

        Idempotent without ``revision``: deleting a missing entry is not an error.

        Raises:
            RevisionConflict: ``revision`` given and the entry changed meanwhile.
            InvalidName: bad queue id.
            StoreUnavailable: the backend failed.
        """
        ...

    async def discard(self, queue_id: str) -> None:
        """Remove the entry of a message whose ingest failed (it was answered ``451``),
        leaving no trace: :meth:`get` raises :class:`EntryNotFound` afterwards, never
        :class:`EntryDeleted`, as for an id never stored. The front end's resend
        protection tells the two apart (a deleted entry was stored, a resend of it is a
        copy; a discarded one was not). Idempotent.

        Raises:
            InvalidName: bad queue id.
            StoreUnavailable: the backend failed (the entry may still be there).
        """
        ...

    async def page(
        self, *, state: EntryState | None = None, after: str | None = None, limit: int = 100
    ) -> list[Versioned]:
        """One page of entries in queue-id (arrival) order, optionally of one state.

        Reads only as far as needed to fill the page, never the whole bucket up front.

        Args:
            state: only entries whose derived state is this.
            after: resume after this queue id (the last id of the previous page).
            limit: at most this many entries (1..10000).

        Raises:
            StoreUnavailable: the backend failed.
        """
        ...

    async def count_by_state(self, pacer: Pacer | None = None) -> dict[EntryState, int]:
        """Number of entries in each derived state (states with none are omitted).

        Args:
            pacer: rests the scan as it reads (:class:`~jsqueue.pacing.Pacer`: a scan of
                a large queue leaves the event loop to the mail); None reads at full speed.

        Raises:
            StoreUnavailable: the backend failed.
        """
        ...


@runtime_checkable
class Due(Protocol):
    """A work item handed to a worker because it is due. Only the worker settles it.

    Exactly one of :meth:`ack`, :meth:`retry` or :meth:`term` settles the item; until then
    it is redelivered after the ack wait unless :meth:`in_progress` extends it.
    """

    item: WorkItem
    deliveries: int

    async def ack(self) -> None:
        """Done: the item is removed for good."""
        ...

    async def retry(self, delay_s: float) -> None:
        """Hand the item back to be delivered again in ``delay_s`` seconds (>= 0)."""
        ...

    async def term(self) -> None:
        """Drop the item without delivering it again (stale, entry gone)."""
        ...

    async def in_progress(self) -> None:
        """Still working: restart the ack-wait timer."""
        ...


@runtime_checkable
class Scheduler(Protocol):
    """When to deliver what: the work stream (JetStream) or a heap (memory)."""

    async def schedule(self, item: WorkItem, at: datetime | None = None) -> None:
        """Make ``item`` due at ``at`` (now when None).

        Idempotent per (queue id, domain, generation) within the dedupe window.

        Raises:
            InvalidName: the item's queue id or domain is not valid.
            StoreUnavailable: the backend failed.
        """
        ...

    async def fetch(self, batch: int, timeout_s: float) -> list[Due]:
        """Wait up to ``timeout_s`` seconds for at most ``batch`` due items.

        Items that arrive before their scheduled time are handed back with the remaining
        delay, not returned. Returns an empty list on timeout.

        Raises:
            StoreUnavailable: the backend failed.
        """
        ...

    async def flush(self, item: WorkItem) -> None:
        """Replace every scheduled item of (queue id, domain) by ``item``, due now.

        Takes effect within about a second however long the old delay was (DESIGN.md §4).

        Raises:
            InvalidName: the item's queue id or domain is not valid.
            StoreUnavailable: the backend failed.
        """
        ...

    async def cancel(self, queue_id: str) -> None:
        """Remove every scheduled item of an entry. Idempotent.

        Raises:
            InvalidName: bad queue id.
            StoreUnavailable: the backend failed.
        """
        ...

    async def backlog(self) -> int:
        """Items scheduled and not yet settled (due, deferred and in flight).

        Raises:
            StoreUnavailable: the backend failed.
        """
        ...


@dataclass(frozen=True)
class AckPending:
    """The work consumer's load against its limit (DESIGN.md §2.6).

    Attributes:
        ack_pending: items delivered and not settled: in flight and NAK-delayed (deferred).
        waiting: items not yet delivered (fresh mail and items come due).
        limit: the consumer's ``max_ack_pending``; at ``ack_pending >= limit`` nothing new
            is delivered.
    """

    ack_pending: int
    waiting: int
    limit: int

    @property
    def ratio(self) -> float:
        """``ack_pending / limit``, 0 when there is no limit."""
        return self.ack_pending / self.limit if self.limit > 0 else 0.0

    @property
    def saturated(self) -> bool:
        """Whether the consumer has stopped delivering new items."""
        return self.limit > 0 and self.ack_pending >= self.limit


_INGEST_KEY_RE = re.compile(r"^[0-9a-f]{64}$")


def check_ingest_key(key: str) -> str:
    """Return ``key`` if it is an :class:`IngestLog` key: 64 lower-case hex characters.

    Raises:
        InvalidName: anything else.
    """
    if not isinstance(key, str) or not _INGEST_KEY_RE.match(key):
        raise InvalidName(f"invalid ingest key {key!r}: expected 64 lower-case hex characters")
    return key


class Held(NamedTuple):
    """The record under an ingest key as a compare-and-set sees it (:meth:`IngestLog.holder`).

    Attributes:
        queue_id: the queue id it names; None when there is none within the window asked
            for (never written, forgotten, or older).
        version: what :meth:`IngestLog.replace` must be given to write over it: 0 when
            the key has no record at all, a backend revision otherwise (it grows with
            every write, so a refreshed record has a new one).
    """

    queue_id: str | None
    version: int


@runtime_checkable
class IngestLog(Protocol):
    """Recently accepted messages by content key: the front end's idempotent ingest.

    A client that lost our ``250`` resends the same message; the front end finds the key of
    the first copy here and answers with its queue id instead of queueing a second copy.
    ``key`` is 64 lower-case hex characters (a SHA-256 of envelope and content), valid as a
    KV key. Records only need to live as long as the largest ``max_age_s`` asked for
    (``smtp.dedupe_window_s``); a backend may expire them after that.

    HTTP injection keeps its ``Idempotency-Key`` records here too (:mod:`jsqueue.http.inject`):
    a claim taken over, or renewed, with :meth:`holder` and :meth:`replace`
    (compare-and-set on the record's version).
    """

    async def lookup(self, key: str, max_age_s: float, *, consistent: bool = False) -> str | None:
        """The queue id recorded under ``key`` at most ``max_age_s`` seconds ago, else None.

        ``consistent``: the read sees every write acknowledged before it (on a replicated
        backend it asks the leader; otherwise a replica that lags may answer).

        Raises:
            InvalidName: ``key`` is not 64 lower-case hex characters.
            StoreUnavailable: the backend failed.
        """
        ...

    async def claim(self, key: str, queue_id: str, max_age_s: float) -> str | None:
        """Remember ``key`` -> ``queue_id`` unless ``key`` was recorded at most
        ``max_age_s`` seconds ago: lookup and record in one write (compare-and-set).

        Returns:
            None when ``queue_id`` is now recorded (also when it already was: a retried
            claim); else the queue id recorded earlier, which stays.

        Raises:
            InvalidName: bad key or queue id.
            StoreUnavailable: the backend failed.
        """
        ...

    async def holder(self, key: str, max_age_s: float) -> Held:
        """The record under ``key``, as :meth:`lookup` with ``consistent`` reads it, with
        its version for :meth:`replace`.

        Raises:
            InvalidName: bad key.
            StoreUnavailable: the backend failed.
        """
        ...

    async def replace(self, key: str, version: int, queue_id: str) -> bool:
        """Remember ``key`` -> ``queue_id`` as of now if the record is still at ``version``
        (a :class:`Held` read before; 0: no record yet): one compare-and-set write. Writing
        the id that is there already is a refresh: the record gets a new version.

        Returns:
            True when written; False when the record changed since ``version`` (nothing is
            written).

        Raises:
            InvalidName: bad key or queue id.
            StoreUnavailable: the backend failed.
        """
        ...

    async def record(self, key: str, queue_id: str) -> None:
        """Remember ``key`` -> ``queue_id`` as of now (overwrites an older record).

        Raises:
            InvalidName: bad key or queue id.
            StoreUnavailable: the backend failed.
        """
        ...

    async def forget(self, key: str, queue_id: str) -> None:
        """Remove the record under ``key`` if it still names ``queue_id``: the client
        proved it saw the ``250`` for that message (it sent a further command or QUIT), so
        an identical transaction later is a new message, not a resend. Idempotent; a
        record naming another queue id is left alone.

        Raises:
            InvalidName: bad key or queue id.
            StoreUnavailable.
        """
        ...


class Inventory(Protocol):
    """Cheap listings of what the queue's streams hold (no value reads, no consumers), for
    the reconciler (:mod:`jsqueue.reconciler`); JetStream:
    :mod:`jsqueue.store.jetstream.inventory`."""

    async def entry_ids(self) -> set[str]:
        """Keys of the entries bucket (recently deleted keys may be included).

        Raises:
            StoreUnavailable: the backend failed.
        """
        ...

    async def work_subjects(self, queue_id: str | None = None) -> set[str]:
        """Work-stream subjects holding at least one item (of one entry when given).

        Raises:
            StoreUnavailable: the backend failed.
        """
        ...

    async def body_ids(self) -> set[str]:
        """Queue ids that have a stored body.

        Raises:
            StoreUnavailable: the backend failed.
        """
        ...

    async def body_stored_at(self, queue_id: str) -> datetime | None:
        """When the body was stored (UTC), None when there is none.

        Raises:
            StoreUnavailable: the backend failed.
        """
        ...

    async def orphan_chunks(self, stored_before: datetime, *, thorough: bool) -> list[str]:
        """Chunk sets no body refers to, stored before ``stored_before``.

        Args:
            stored_before: only chunk sets whose first chunk is older.
            thorough: read every body's meta even when the counts look consistent.

        Raises:
            StoreUnavailable: the backend failed.
        """
        ...

    async def delete_chunks(self, chunk_set: str) -> None:
        """Remove one chunk set. Idempotent.

        Raises:
            StoreUnavailable: the backend failed.
        """
        ...


class Lock(Protocol):
    """A lease on being the one process of the cluster that does something (the
    reconciler's sweep, exporting the queue-wide gauges); JetStream:
    :mod:`jsqueue.store.jetstream.lock`."""

    async def acquire(self) -> bool:
        """Take (or keep) the lock; True when this process holds it now.

        Raises:
            StoreUnavailable: the answer is unknown (try again later).
        """
        ...

    async def renew(self) -> bool:
        """Extend the lock by its TTL; False when it was lost to someone else.

        Raises:
            StoreUnavailable: the answer is unknown.
        """
        ...

    async def release(self) -> None:
        """Give the lock up (if held). Best effort: it expires on its own anyway."""
        ...


@dataclass(frozen=True)
class PresenceMark:
    """A worker's presence as read: which process wrote it (``instance``) and the write's
    revision (it changes at every heartbeat)."""

    instance: str
    revision: int


class Presence(Protocol):
    """Which lease owners are alive: each worker re-writes its owner name's key every
    grace/3 with a time to live of the grace, so a key that is gone means a dead (or
    stopped) worker. JetStream: :mod:`jsqueue.store.jetstream.presence`."""

    async def beat(self, owner: str, instance: str, ttl_s: float, *, first: bool = False) -> bool:
        """Write ``owner``'s presence (by process ``instance``) to live ``ttl_s`` seconds.

        Args:
            owner: the lease owner name.
            instance: this process's random id.
            ttl_s: seconds until the mark expires without another beat (rounded up).
            first: create only if absent (a name taken meanwhile answers False).

        Returns:
            False only for a ``first`` write that found the name present. Idempotent
            otherwise.

        Raises:
            StoreUnavailable.
        """
        ...

    async def seen(self, owner: str) -> PresenceMark | None:
        """``owner``'s live mark, None when it is not present (one read).

        Raises:
            StoreUnavailable.
        """
        ...

    async def leave(self, owner: str) -> None:
        """Remove ``owner``'s mark (graceful stop). Best effort, never raises."""
        ...


@dataclass(frozen=True)
class Stores:
    """One backend's body store, entry store and scheduler, plus how to close them.

    ``ingest`` is optional: without it the front end accepts resent messages as new ones.
    ``lock`` makes a cluster-wide lock (name, TTL seconds), provisioned; None where the
    backend serves one process only (memory), whose process then holds every lock.
    ``presence`` is optional: without it no lease of another owner is ever taken over.
    ``destinations`` is optional: without it no destination limit holds across processes.
    """

    bodies: BodyStore
    entries: EntryStore
    scheduler: Scheduler
    close: Callable[[], Awaitable[None]]
    ingest: IngestLog | None = None
    lock: Callable[[str, float], Awaitable[Lock]] | None = None
    presence: Presence | None = None
    #: the cluster-wide MTA-STS policy cache; None = each worker keeps its own
    policies: PolicyCache | None = None
    destinations: DestinationStore | None = None


def encode_entry(entry: Entry, max_size: int) -> bytes:
    """An entry's stored form (:meth:`Entry.to_json`), for an entry store whose values may
    hold at most ``max_size`` octets.

    Raises:
        EntryTooLarge: the stored form is larger than ``max_size`` (nothing is written).
    """
    data = entry.to_json()
    if len(data) > max_size:
        raise EntryTooLarge(
            f"entry {entry.id}: {len(data)} octets exceed the maximum of {max_size}"
        )
    return data
