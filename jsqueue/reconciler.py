"""The reconciler: a periodic sweep that puts the queue back in order after crashes.

KV is the truth and work items are triggers (DESIGN.md §2.2). Every writer stores things in
an order that keeps the queue safe at any crash point, but a crash *between* two writes can
leave one half without the other. What can be left, how, and what the sweep does:

- *open recipient, no work item* (front end or admin killed between storing the entry and
  publishing its work item; a work item purged or lost): re-queued (``Scheduler.flush``);
- *final entry, no work item* (worker killed between removing the body and the entry):
  re-queued, so that a worker finishes it (DSNs owed, removal);
- *body without entry* (front end answered 451 and its cleanup failed; entry deleted, body
  delete failed): deleted;
- *chunks without body meta* (front end killed mid-DATA): purged;
- *entry without body, never tried* (front end answered 451, deleted the body, but the
  entry delete failed): deleted;
- *final DSN entry* (kept on purpose, :mod:`jsqueue.bounce`): deleted after
  ``dsn_retention_s``.

**Recognising a lost trigger.** An open recipient of domain *d* whose due time lies more
than ``lost_trigger_after_s`` in the past, that no live lease covers, and for which the
work stream holds nothing on ``Names.work_subject(id, d)``. A deferred recipient's work item
stays in the stream (NAKed with a delay) until its destination is settled, and an item in
flight stays until it is acked, so an empty subject means the trigger is gone. Held
entries are skipped (their items are dropped on purpose until release).

**Choices.** A re-queued entry is delivered: at least once, never lost. An entry left by a
front end killed between storing it and publishing its work item belongs to a client that
got no ``250`` and may send the message again, so that message can arrive twice; a second
copy is the price of never losing one (RFC 5321 §6.1). An entry whose body vanished is
deleted only if it was never tried (only the front end's 451 path leaves that; the client
sends again); one that was tried is reported for an operator, not deleted.

**Safety.** Every action is decided twice: from the pass's snapshot, then again from a fresh
read of the entry, of that entry's subjects in the work stream and of its body, and only
what both agree on is done. Entries are deleted by revision (compare-and-set), bodies only
after a fresh "no entry". Running a pass twice, or two passes at once, is therefore
harmless. A lock still keeps it to one pass at a time across the cluster (it is an economy,
not what makes the sweep safe): a KV key created if absent with a per-message TTL
(``lock_ttl_s``) and renewed by compare-and-set during the pass.

**Cost of a pass.** Five stream-info requests (entry keys, work subjects, body meta and
chunk subjects, paged at 100k; no consumer), then reads only of entries that have no work
item at all (in a healthy queue: the final DSN entries of the retention period and entries
in transit; the key of a deleted entry stays listed until its marker expires, and is read
once, not every pass). Every ``full_scan_every``-th pass reads every key (to find an entry
that lost the work item of one of several domains) and every body meta (to find
unreferenced chunks); other passes read body metas only when there are more chunk sets than
bodies. A
subject that holds only a stale item (an older generation) counts as present until a worker
drops that item; the next pass sees the gap.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import math
import socket
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api

from jsqueue.config import ReconcilerSettings, Settings
from jsqueue.envelope import Entry, WorkItem, utcnow
from jsqueue.errors import (
    BodyNotFound,
    EntryNotFound,
    InvalidName,
    JsqueueError,
    ProvisioningError,
    RevisionConflict,
    StoreError,
    StoreUnavailable,
)
from jsqueue.names import Names, check_queue_id
from jsqueue.store.base import Stores
from jsqueue.store.jetstream import (
    JetStreamBodyStore,
    JetStreamEntryStore,
    JetStreamScheduler,
    close_nats,
    connect_nats,
)

log = logging.getLogger("jsqueue.reconciler")

#: Entries read (or body metas fetched) concurrently during a pass.
READ_BATCH = 64
#: How long stopping waits for the lock release, seconds.
RELEASE_TIMEOUT_S = 2.0
#: Key of the reconciler lock in the lock bucket.
LOCK_KEY = "reconciler"


def lock_bucket(names: Names) -> str:
    """KV bucket of cluster-wide locks (``<prefix>-locks``)."""
    return f"{names.prefix}-locks"


# --------------------------------------------------------------------------- pure decisions


class ActionKind(StrEnum):
    """What the sweep does about one entry."""

    REQUEUE = "requeue"  # an open domain lost its work item: publish a new one, due now
    FINISH = "finish"  # a final entry nobody will finish: hand it to a worker
    REMOVE = "remove"  # delete the entry (and body): expired final DSN, or bodiless never-tried
    REPORT = "report"  # inconsistent in a way only an operator should settle: log it


@dataclass(frozen=True)
class Action:
    """One decision of :func:`review`; ``item`` is the work item for REQUEUE / FINISH."""

    kind: ActionKind
    queue_id: str
    reason: str
    item: WorkItem | None = None


def _age_s(since: datetime, now: datetime) -> float:
    return (now - since).total_seconds()


def last_activity(entry: Entry) -> datetime:
    """The latest of the entry's arrival and its recipients' last attempts."""
    times = [entry.created_at, *(r.last_attempt_at for r in entry.recipients if r.last_attempt_at)]
    return max(times)


def review(
    entry: Entry,
    *,
    work_subjects: Collection[str],
    has_body: bool,
    names: Names,
    now: datetime,
    settings: ReconcilerSettings,
) -> list[Action]:
    """Decide what an entry needs (see the module docstring). Pure: no I/O.

    Args:
        entry: the entry as read.
        work_subjects: the work-stream subjects that hold at least one item of this entry
            (or a superset: subjects of other entries are ignored).
        has_body: whether a body is stored under the entry's id in the body store (an
            inline body, :attr:`Entry.inline_body`, counts as stored too).
        names: object names (for :meth:`Names.work_subject`).
        now: the current time, aware.
        settings: margins and retention.

    Returns:
        the actions, empty when the entry is consistent (or too young to judge).
    """
    qid = entry.id
    has_body = has_body or entry.inline_body is not None
    present = set(work_subjects)
    own = {names.work_subject(qid, d) for d in entry.domains}
    has_trigger = bool(own & present)
    if entry.is_final:
        idle_s = _age_s(last_activity(entry), now)
        if entry.is_dsn:
            if _age_s(entry.created_at, now) >= settings.dsn_retention_s:
                return [Action(ActionKind.REMOVE, qid, "final DSN entry past its retention")]
            if has_body and not has_trigger and idle_s >= settings.orphan_after_s:
                item = WorkItem(qid, entry.recipients[0].domain, entry.generation)
                return [Action(ActionKind.FINISH, qid, "final DSN entry still has its body", item)]
            return []
        if not has_trigger and idle_s >= settings.lost_trigger_after_s:
            item = WorkItem(qid, entry.recipients[0].domain, entry.generation)
            return [Action(ActionKind.FINISH, qid, "final entry left behind", item)]
        return []
    if entry.held:
        return []
    if not has_body:
        if _age_s(entry.created_at, now) < settings.orphan_after_s:
            return []
        if all(r.attempts == 0 for r in entry.recipients):
            return [Action(ActionKind.REMOVE, qid, "entry without body, never tried")]
        return [Action(ActionKind.REPORT, qid, "entry without body after delivery attempts")]
    actions = []
    for domain in entry.domains:
        due = entry.due_at(domain)
        if due is None or names.work_subject(qid, domain) in present:
            continue
        lease = entry.leases.get(domain)
        if lease is not None and lease.until > now:
            continue
        if _age_s(due, now) < settings.lost_trigger_after_s:
            continue
        item = WorkItem(qid, domain, entry.generation)
        actions.append(Action(ActionKind.REQUEUE, qid, f"work item for {domain} lost", item))
    return actions


def queue_id_of_subject(names: Names, subject: str) -> str | None:
    """The queue id in a work subject (``<prefix>.work.<id>.<domain>``), None if malformed."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[0] != names.prefix or parts[1] != "work":
        return None
    try:
        return check_queue_id(parts[2])
    except InvalidName:
        return None


# --------------------------------------------------------------------------- ports


class Inventory(Protocol):
    """Cheap listings of what the queue's streams hold (no value reads, no consumers)."""

    async def entry_ids(self) -> set[str]:
        """Keys of the entries bucket (recently deleted keys may be included).

        Raises:
            StoreUnavailable.
        """
        ...

    async def work_subjects(self, queue_id: str | None = None) -> set[str]:
        """Work-stream subjects holding at least one item (of one entry when given).

        Raises:
            StoreUnavailable.
        """
        ...

    async def body_ids(self) -> set[str]:
        """Queue ids that have a stored body.

        Raises:
            StoreUnavailable.
        """
        ...

    async def body_stored_at(self, queue_id: str) -> datetime | None:
        """When the body was stored (UTC), None when there is none.

        Raises:
            StoreUnavailable.
        """
        ...

    async def orphan_chunks(self, stored_before: datetime, *, thorough: bool) -> list[str]:
        """Chunk sets no body refers to, stored before ``stored_before``.

        Args:
            stored_before: only chunk sets whose first chunk is older.
            thorough: read every body's meta even when the counts look consistent.

        Raises:
            StoreUnavailable.
        """
        ...

    async def delete_chunks(self, chunk_set: str) -> None:
        """Remove one chunk set. Idempotent.

        Raises:
            StoreUnavailable.
        """
        ...


class Lock(Protocol):
    """A lease on being the one reconciler of the cluster."""

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


# --------------------------------------------------------------------------- orchestration


class LockLost(JsqueueError):
    """The reconciler lock was lost (or could not be renewed) during a pass."""


@dataclass
class Report:
    """What one pass found and did (counts), for logs and tests."""

    entries_listed: int = 0
    entries_read: int = 0
    requeued: list[WorkItem] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    reported: list[str] = field(default_factory=list)
    orphan_bodies: list[str] = field(default_factory=list)
    orphan_chunks: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """Whether the pass did anything."""
        done = (self.requeued, self.finished, self.removed, self.orphan_bodies, self.orphan_chunks)
        return any(done)


class Reconciler:
    """Runs sweeps (module docstring) every ``settings.interval_s`` while holding the lock.

    Args:
        stores: the queue's stores (the scheduler re-queues, the stores delete).
        inventory: listings of the streams.
        lock: the cluster-wide lock.
        settings: the ``reconciler`` settings section.
        names: object names.
        clock: returns the current aware UTC time.
    """

    def __init__(
        self,
        stores: Stores,
        inventory: Inventory,
        lock: Lock,
        settings: ReconcilerSettings,
        names: Names,
        *,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.stores = stores
        self.inventory = inventory
        self.lock = lock
        self.settings = settings
        self.names = names
        self.clock = clock
        self.passes = 0
        self.last_report: Report | None = None
        self._renewed_at = 0.0
        self._gone: set[str] = set()  # keys read as deleted by the last passes

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep every ``interval_s`` seconds until ``stop`` is set; first sweep at once.

        Only the lock holder sweeps; the others keep trying to take the lock. Failures of
        NATS are logged and the next pass tries again. The lock is released on the way out.
        Every ``full_scan_every``-th pass of this process is a full one.
        """
        try:
            while not stop.is_set():
                try:
                    full = self.passes % self.settings.full_scan_every == 0
                    report = await self.run_once(full=full)
                    if report.changed or report.reported:
                        log.info("reconciler pass: %s", _summary(report))
                except LockLost as e:
                    log.debug("reconciler: %s", e)
                except StoreUnavailable as e:
                    log.warning("reconciler pass failed: %s", e)
                except Exception:  # a bug must not end the sweeping for good: log, go on
                    log.exception("reconciler pass failed unexpectedly")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.interval_s)
        finally:
            # Bounded: with NATS gone a release would wait out the request timeout, and the
            # lock expires on its own anyway.
            with contextlib.suppress(JsqueueError, TimeoutError):
                async with asyncio.timeout(RELEASE_TIMEOUT_S):
                    await self.lock.release()

    async def _keep_lock(self) -> None:
        """Renew the lock when a third of its TTL has passed since the last renewal.

        Raises:
            LockLost: someone else holds it now, or the renewal failed.
        """
        if time.monotonic() - self._renewed_at < self.settings.lock_ttl_s / 3:
            return
        try:
            held = await self.lock.renew()
        except StoreUnavailable as e:
            raise LockLost(f"lock renewal failed ({e}); pass abandoned") from e
        if not held:
            raise LockLost("lock taken over by another reconciler; pass abandoned")
        self._renewed_at = time.monotonic()

    async def run_once(self, *, full: bool = True) -> Report:
        """One sweep under the lock (taken, or kept, first; renewed as the pass goes).

        Args:
            full: read every entry and every body meta, not only the suspicious ones.

        Returns:
            what was found and done.

        Raises:
            LockLost: another reconciler holds the lock, or it was lost mid-pass.
            StoreUnavailable: a listing failed (nothing half-done: every action is whole).
        """
        if not await self.lock.acquire():
            raise LockLost("another reconciler holds the lock")
        self._renewed_at = time.monotonic()
        report = Report()
        inv = self.inventory
        ids = await inv.entry_ids()
        subjects = await inv.work_subjects()
        bodies = await inv.body_ids()
        report.entries_listed = len(ids)
        with_trigger: dict[str, set[str]] = {}
        for s in subjects:
            qid = queue_id_of_subject(self.names, s)
            if qid is not None:
                with_trigger.setdefault(qid, set()).add(s)
        # Keys of deleted entries stay listed until their marker expires: read each once.
        known_gone = set() if full else self._gone & ids
        to_read = sorted(ids if full else ids - with_trigger.keys() - known_gone)
        live: set[str] = ids - set(to_read) - known_gone
        self._gone = set(known_gone)
        for i in range(0, len(to_read), READ_BATCH):
            await self._keep_lock()
            batch = to_read[i : i + READ_BATCH]
            entries = await asyncio.gather(*(self._scan_read(qid) for qid in batch))
            report.entries_read += len(batch)
            for qid, entry in zip(batch, entries, strict=True):
                if entry is None:
                    self._gone.add(qid)
                    continue
                if isinstance(entry, StoreError):
                    live.add(qid)  # its body is not an orphan
                    report.reported.append(qid)
                    log.error("reconciler: queue %s: %s; needs an operator", qid, entry)
                    continue
                live.add(entry.id)
                actions = review(
                    entry,
                    work_subjects=with_trigger.get(entry.id, ()),
                    has_body=entry.id in bodies,
                    names=self.names,
                    now=self.clock(),
                    settings=self.settings,
                )
                for action in actions:
                    await self._keep_lock()
                    await self._act(action, report)
        await self._sweep_bodies(bodies - live, report)
        await self._keep_lock()
        cutoff = self._ago(self.settings.orphan_after_s)
        for chunk_set in await inv.orphan_chunks(cutoff, thorough=full):
            await self._keep_lock()
            await inv.delete_chunks(chunk_set)
            report.orphan_chunks.append(chunk_set)
            log.info("reconciler: purged chunk set %s that no body refers to", chunk_set)
        self.passes += 1
        self.last_report = report
        return report

    async def close(self) -> None:
        """Close the stores (and so the connection of :func:`open_reconciler`)."""
        await self.stores.close()

    def _ago(self, seconds: float) -> datetime:
        return datetime.fromtimestamp(self.clock().timestamp() - seconds, UTC)

    async def _read(self, queue_id: str) -> Entry | None:
        try:
            return (await self.stores.entries.get(queue_id)).entry
        except EntryNotFound:
            return None

    async def _scan_read(self, queue_id: str) -> Entry | StoreError | None:
        """:meth:`_read`, with an unreadable entry (not an outage) as a value to report."""
        try:
            return await self._read(queue_id)
        except StoreUnavailable:
            raise
        except StoreError as e:
            return e

    async def _act(self, action: Action, report: Report) -> None:
        """Re-decide ``action`` from fresh reads and carry it out if it still holds."""
        qid = action.queue_id
        try:
            current = await self.stores.entries.get(qid)
        except EntryNotFound:
            return
        subjects = await self.inventory.work_subjects(qid)
        # An inline body travels with the entry: no body store request for it.
        has_body = current.entry.inline_body is not None or await self._has_body(qid)
        again = review(
            current.entry,
            work_subjects=subjects,
            has_body=has_body,
            names=self.names,
            now=self.clock(),
            settings=self.settings,
        )
        if action not in again:
            log.debug("reconciler: %s %s no longer needed", action.kind, qid)
            return
        if action.kind in (ActionKind.REQUEUE, ActionKind.FINISH):
            assert action.item is not None
            await self.stores.scheduler.flush(action.item)
            if action.kind is ActionKind.REQUEUE:
                report.requeued.append(action.item)
            else:
                report.finished.append(qid)
            log.warning("reconciler: queue %s: %s; re-queued", qid, action.reason)
        elif action.kind is ActionKind.REMOVE:
            try:
                await self.stores.entries.delete(qid, revision=current.revision)
            except RevisionConflict:
                return
            await self.stores.bodies.delete(qid)
            await self.stores.scheduler.cancel(qid)
            report.removed.append(qid)
            entry = current.entry
            level = logging.INFO if entry.is_dsn else logging.WARNING
            log.log(
                level,
                "reconciler: queue %s: %s; removed (from=<%s> to=%s)",
                qid,
                action.reason,
                entry.reverse_path,
                ",".join(f"<{r.address}>" for r in entry.recipients),
            )
        else:
            report.reported.append(qid)
            log.error("reconciler: queue %s: %s; needs an operator", qid, action.reason)

    async def _has_body(self, queue_id: str) -> bool:
        try:
            await self.stores.bodies.info(queue_id)
        except BodyNotFound:
            return False
        return True

    async def _sweep_bodies(self, candidates: Iterable[str], report: Report) -> None:
        """Delete bodies without an entry that are older than ``orphan_after_s``."""
        cutoff = self._ago(self.settings.orphan_after_s)
        for qid in sorted(candidates):
            await self._keep_lock()
            stored_at = await self.inventory.body_stored_at(qid)
            if stored_at is None or stored_at > cutoff:
                continue
            if await self._read(qid) is not None:
                continue
            await self.stores.bodies.delete(qid)
            report.orphan_bodies.append(qid)
            log.info("reconciler: deleted body %s that has no entry", qid)


def _summary(report: Report) -> str:
    return (
        f"{report.entries_read}/{report.entries_listed} entries read, "
        f"{len(report.requeued)} re-queued, {len(report.finished)} handed over to finish, "
        f"{len(report.removed)} removed, {len(report.reported)} reported, "
        f"{len(report.orphan_bodies)} orphan bodies, {len(report.orphan_chunks)} chunk sets"
    )


# --------------------------------------------------------------------------- JetStream


_JS_API = "$JS.API"
_ERR_WRONG_LAST_SEQ = (10071, 10164)
_HDR_EXPECTED = "Nats-Expected-Last-Subject-Sequence"
_NatsFailure = (nats.errors.Error, asyncio.TimeoutError, OSError)


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


class _ApiRefused(Exception):
    """The JetStream API answered with an error."""

    def __init__(self, err: dict[str, Any]) -> None:
        self.code = int(err.get("code", 0))
        self.err_code = int(err.get("err_code", 0))
        super().__init__(f"{err.get('description')} (status {self.code}, error {self.err_code})")


async def _api(nc: NATS, subject: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    """One JetStream API request, raw JSON in and out.

    Raises:
        _ApiRefused: the server answered with an error.
        StoreUnavailable: no answer.
    """
    data = json.dumps(body).encode() if body is not None else b""
    try:
        msg = await nc.request(f"{_JS_API}.{subject}", data, timeout=timeout_s)
    except _NatsFailure as e:
        raise StoreUnavailable(f"JetStream API {subject}: {e or type(e).__name__}") from e
    resp = json.loads(msg.data)
    if "error" in resp:
        raise _ApiRefused(resp["error"])
    return resp


async def stream_subjects(
    nc: NATS, stream: str, subjects_filter: str, timeout_s: float
) -> dict[str, int]:
    """Subjects of ``stream`` matching ``subjects_filter`` that hold messages, with counts.

    Stream-info requests paged by the server (100k subjects each); no consumer.

    Raises:
        StoreUnavailable.
    """
    found: dict[str, int] = {}
    offset = 0
    while True:
        body = {"subjects_filter": subjects_filter, "offset": offset}
        try:
            resp = await _api(nc, f"STREAM.INFO.{stream}", body, timeout_s)
        except _ApiRefused as e:
            raise StoreUnavailable(f"stream {stream}: list subjects: {e}") from e
        subjects = resp.get("state", {}).get("subjects") or {}
        found.update(subjects)
        offset += len(subjects)
        if not subjects or offset >= int(resp.get("total", 0)):
            return found


class JetStreamInventory:
    """:class:`Inventory` on the JetStream streams of :mod:`jsqueue.store.jetstream`.

    Args:
        nc: a connected client.
        names: object names.
        bodies: the body store (for its stream and subject layout).
        entries: the entry store (for its key listing).
        timeout_s: per-request timeout, seconds.
    """

    def __init__(
        self,
        nc: NATS,
        names: Names,
        bodies: JetStreamBodyStore,
        entries: JetStreamEntryStore,
        *,
        timeout_s: float = 5.0,
    ) -> None:
        self._nc = nc
        self.names = names
        self.bodies = bodies
        self.entries = entries
        self._timeout_s = timeout_s

    async def entry_ids(self) -> set[str]:
        """See :meth:`Inventory.entry_ids`."""
        return set(await self.entries.keys())

    async def work_subjects(self, queue_id: str | None = None) -> set[str]:
        """See :meth:`Inventory.work_subjects`."""
        names = self.names
        flt = names.work_subjects_of(queue_id) if queue_id else names.work_subjects
        found = await stream_subjects(self._nc, names.work_stream, flt, self._timeout_s)
        return set(found)

    async def body_ids(self) -> set[str]:
        """See :meth:`Inventory.body_ids`."""
        prefix = f"$O.{self.bodies.bucket}.M."
        found = await stream_subjects(self._nc, self.bodies.stream, prefix + ">", self._timeout_s)
        ids = set()
        for subject in found:
            try:
                ids.add(check_queue_id(base64.urlsafe_b64decode(subject[len(prefix) :]).decode()))
            except (binascii.Error, UnicodeDecodeError, InvalidName):
                continue  # not a queue body: none of ours
        return ids

    async def _first_time(self, subject: str) -> datetime | None:
        try:
            msg = await self.bodies.js.get_msg(
                self.bodies.stream, seq=1, subject=subject, next=True, direct=True
            )
        except nats.js.errors.NotFoundError:
            return None
        except _NatsFailure as e:
            raise StoreUnavailable(f"{subject}: read: {e or type(e).__name__}") from e
        return _utc(msg.time) if msg.time is not None else None

    async def body_stored_at(self, queue_id: str) -> datetime | None:
        """See :meth:`Inventory.body_stored_at`: the time of the body's meta message."""
        return await self._first_time(self.bodies.meta_subject(queue_id))

    async def orphan_chunks(self, stored_before: datetime, *, thorough: bool) -> list[str]:
        """See :meth:`Inventory.orphan_chunks`."""
        bucket, stream = self.bodies.bucket, self.bodies.stream
        chunk_prefix = f"$O.{bucket}.C."
        chunks = await stream_subjects(self._nc, stream, chunk_prefix + ">", self._timeout_s)
        metas = await stream_subjects(self._nc, stream, f"$O.{bucket}.M.>", self._timeout_s)
        if not chunks or (len(chunks) <= len(metas) and not thorough):
            return []
        referenced: set[str] = set()
        meta_subjects = sorted(metas)
        for i in range(0, len(meta_subjects), READ_BATCH):
            batch = meta_subjects[i : i + READ_BATCH]
            nuids = await asyncio.gather(*(self._nuid(s) for s in batch))
            referenced.update(n for n in nuids if n)
        orphans = []
        for subject in sorted(chunks):
            nuid = subject[len(chunk_prefix) :]
            if nuid in referenced:
                continue
            first = await self._first_time(subject)
            if first is not None and first < stored_before:
                orphans.append(nuid)
        return orphans

    async def _nuid(self, meta_subject: str) -> str | None:
        try:
            msg = await self.bodies.js.get_msg(
                self.bodies.stream, subject=meta_subject, direct=True
            )
        except nats.js.errors.NotFoundError:
            return None
        except _NatsFailure as e:
            raise StoreUnavailable(f"{meta_subject}: read: {e or type(e).__name__}") from e
        try:
            meta = json.loads(msg.data or b"{}")
        except ValueError:
            return None
        nuid = meta.get("nuid") if isinstance(meta, dict) else None
        return nuid if isinstance(nuid, str) else None

    async def delete_chunks(self, chunk_set: str) -> None:
        """See :meth:`Inventory.delete_chunks`."""
        try:
            await self.bodies.js.purge_stream(
                self.bodies.stream, subject=self.bodies.chunk_subject(chunk_set)
            )
        except _NatsFailure as e:
            raise StoreUnavailable(f"chunks {chunk_set}: purge: {e or type(e).__name__}") from e


class JetStreamLock:
    """:class:`Lock` as one key of the KV bucket :func:`lock_bucket`.

    The value names the owner. Taking the lock is a create-if-absent (expected last
    subject sequence 0, or the sequence of a release marker); every write carries a
    per-message TTL (``Nats-TTL``), so a holder that dies loses the lock after ``ttl_s``
    without anyone's clock being involved. Renewing is a compare-and-set on the revision
    of our last write. A write whose reply was lost is recognised by its owner field.

    Args:
        nc: a connected client.
        names: object names.
        ttl_s: lock lifetime after the last renewal, seconds (rounded up, >= 1).
        owner: this process's name; host name + random suffix when None.
        replicas: replica count of the bucket.
        timeout_s: per-request timeout, seconds.
        key: which lock.
    """

    def __init__(
        self,
        nc: NATS,
        names: Names,
        *,
        ttl_s: float,
        owner: str | None = None,
        replicas: int = 1,
        timeout_s: float = 5.0,
        key: str = LOCK_KEY,
    ) -> None:
        self._nc = nc
        self.js = nc.jetstream(timeout=timeout_s)
        self.bucket = lock_bucket(names)
        self.stream = f"KV_{self.bucket}"
        self.subject = f"$KV.{self.bucket}.{key}"
        self.ttl_s = max(1, math.ceil(ttl_s))
        self.owner = owner or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.replicas = replicas
        self._timeout_s = timeout_s
        self._rev: int | None = None

    @property
    def held(self) -> bool:
        """Whether this process believes it holds the lock (as of its last write)."""
        return self._rev is not None

    async def provision(self) -> None:
        """Create the lock bucket if missing (bring its replica count in line). Idempotent.

        Raises:
            ProvisioningError: the server refused to create or update it.
            StoreUnavailable.
        """
        wanted = {
            "name": self.stream,
            "subjects": [f"$KV.{self.bucket}.>"],
            "retention": "limits",
            "storage": "file",
            "num_replicas": self.replicas,
            "discard": "new",
            "max_msgs_per_subject": 1,
            "allow_rollup_hdrs": True,
            "deny_delete": True,
            "allow_direct": True,
            "allow_msg_ttl": True,
        }
        try:
            info = await _api(self._nc, f"STREAM.INFO.{self.stream}", None, self._timeout_s)
        except _ApiRefused as e:
            if e.code != 404:
                raise ProvisioningError(f"stream {self.stream}: {e}") from e
            try:
                await _api(self._nc, f"STREAM.CREATE.{self.stream}", wanted, self._timeout_s)
                return
            except _ApiRefused as ce:
                if ce.err_code == 10058:  # created concurrently
                    return
                raise ProvisioningError(f"stream {self.stream}: cannot create: {ce}") from ce
        config = info["config"]
        if config.get("num_replicas") != self.replicas or not config.get("allow_msg_ttl"):
            try:
                await _api(
                    self._nc, f"STREAM.UPDATE.{self.stream}", {**config, **wanted}, self._timeout_s
                )
            except _ApiRefused as e:
                raise ProvisioningError(f"stream {self.stream}: cannot update: {e}") from e

    async def _current(self) -> api.RawStreamMsg | None:
        try:
            return await self.js.get_msg(self.stream, subject=self.subject)
        except nats.js.errors.NotFoundError:
            return None
        except _NatsFailure as e:
            raise StoreUnavailable(f"lock {self.subject}: read: {e or type(e).__name__}") from e

    def _owner_of(self, msg: api.RawStreamMsg) -> str | None:
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
            return None
        try:
            value = json.loads(msg.data)
        except ValueError:
            return None
        owner = value.get("owner") if isinstance(value, dict) else None
        return owner if isinstance(owner, str) else None

    async def _write(self, expected: int, *, release: bool = False) -> int | None:
        """CAS-write our value (or a release marker); the new revision, None if refused."""
        headers = {_HDR_EXPECTED: str(expected), "Nats-TTL": f"{self.ttl_s}s"}
        data = b""
        if release:
            headers.update({"KV-Operation": "DEL", "Nats-TTL": "1s"})
        else:
            data = json.dumps({"owner": self.owner, "ttl_s": self.ttl_s}).encode()
        try:
            ack = await self.js.publish(self.subject, data, headers=headers)
        except nats.js.errors.APIError as e:
            if e.err_code in _ERR_WRONG_LAST_SEQ:
                return None
            raise StoreUnavailable(f"lock {self.subject}: write: {e}") from e
        except _NatsFailure as e:
            raise StoreUnavailable(f"lock {self.subject}: write: {e or type(e).__name__}") from e
        return int(ack.seq)

    async def acquire(self) -> bool:
        """See :meth:`Lock.acquire`."""
        if self._rev is not None:
            return await self.renew()
        current = await self._current()
        if current is not None:
            owner = self._owner_of(current)
            if owner is not None and owner != self.owner:
                return False
            if owner == self.owner:  # our write landed although its reply was lost
                assert current.seq is not None
                self._rev = current.seq
                return await self.renew()
        expected = 0 if current is None or current.seq is None else current.seq
        self._rev = await self._write(expected)
        return self._rev is not None

    async def renew(self) -> bool:
        """See :meth:`Lock.renew`."""
        if self._rev is None:
            return False
        rev = await self._write(self._rev)
        if rev is None:
            current = await self._current()
            mine = current is not None and self._owner_of(current) == self.owner
            self._rev = current.seq if mine and current is not None else None
            return self._rev is not None
        self._rev = rev
        return True

    async def release(self) -> None:
        """See :meth:`Lock.release`: a delete marker (compare-and-set) that expires in 1 s."""
        if self._rev is None:
            return
        rev, self._rev = self._rev, None
        with contextlib.suppress(StoreUnavailable):
            await self._write(rev, release=True)


async def open_reconciler(settings: Settings, urls: list[str]) -> Reconciler:
    """A :class:`Reconciler` on its own NATS connection (its listings stay off the
    worker's connection), with the lock bucket provisioned.

    The queue's own streams must exist (``open_jetstream`` provisions them).

    Returns:
        the reconciler; :meth:`Reconciler.close` closes its connection.

    Raises:
        StoreUnavailable: NATS unreachable.
        ProvisioningError: the lock bucket cannot be created.
    """
    nats_settings = settings.nats
    names = Names(nats_settings.prefix)
    timeout_s = nats_settings.request_timeout_s
    nc = await connect_nats(nats_settings, urls)
    try:
        bodies = JetStreamBodyStore(nc, names, timeout_s=timeout_s)
        entries = JetStreamEntryStore(nc, names, timeout_s=timeout_s)
        scheduler = JetStreamScheduler(nc, names, timeout_s=timeout_s)
        lock = JetStreamLock(
            nc,
            names,
            ttl_s=settings.reconciler.lock_ttl_s,
            replicas=nats_settings.replicas,
            timeout_s=timeout_s,
        )
        await lock.provision()
    except BaseException:
        await close_nats(nc)
        raise

    async def close() -> None:
        await close_nats(nc)

    stores = Stores(bodies, entries, scheduler, close)
    inventory = JetStreamInventory(nc, names, bodies, entries, timeout_s=timeout_s)
    return Reconciler(stores, inventory, lock, settings.reconciler, names)
