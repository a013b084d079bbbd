"""The reconciler: a periodic sweep, one pass at a time across the cluster (a lock), that
puts the queue back in order after crashes: it re-queues entries whose work item was lost
(soon after a start or a NATS reconnect: a recovery pass with a short margin, since on one
replica the work stream is written without an fsync per item),
hands final entries nobody will finish to a worker, and deletes orphan bodies, chunk sets and
expired DSN entries, deciding each action twice (from a snapshot, then from fresh reads) so
that repeated or concurrent passes are harmless; :func:`review` is the pure decision, and
docs/architecture.md ("The reconciler: repairs after crashes") the full rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from jsqueue.config import ReconcilerSettings, Settings
from jsqueue.envelope import Entry, WorkItem, utcnow
from jsqueue.errors import (
    BodyNotFound,
    EntryDeleted,
    EntryNotFound,
    JsqueueError,
    LockLost,
    RevisionConflict,
    StoreError,
    StoreUnavailable,
)
from jsqueue.names import Names
from jsqueue.pacing import SLICE_S, Pacer, cycle_rest, failure_backoff_s
from jsqueue.store.base import Inventory, Lock, Stores
from jsqueue.store.jetstream import close_nats, connect_nats
from jsqueue.store.jetstream.bodies import JetStreamBodyStore
from jsqueue.store.jetstream.entries import JetStreamEntryStore
from jsqueue.store.jetstream.inventory import JetStreamInventory
from jsqueue.store.jetstream.lock import JetStreamLock
from jsqueue.store.jetstream.work import JetStreamScheduler

log = logging.getLogger("jsqueue.reconciler")

#: Entries read at a time during a pass (one batched read, :meth:`EntryStore.get_many`).
READ_BATCH = 256
#: How long stopping waits for the lock release, seconds.
RELEASE_TIMEOUT_S = 2.0
#: A recovery pass due within this many seconds is made now (timers fire a little early).
TIMER_SLACK_S = 0.05
#: The largest share of its process's time the passes take (a sweep of a million entries
#: must not keep a worker busy, nor its event loop from the mail): a regular pass rests
#: while it reads (:class:`~jsqueue.pacing.Pacer`), and the pause after any pass is long
#: enough for its work to be at most this share of pass and pause (:func:`cycle_rest`).
PASS_SHARE = 0.1


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
    """Decide what an entry needs (the rules: docs/architecture.md, "The reconciler: repairs
    after crashes"). Pure: no I/O.

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


# --------------------------------------------------------------------------- orchestration


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
    rested_s: float = 0.0  # seconds the pass rested to leave the event loop to the mail

    @property
    def changed(self) -> bool:
        """Whether the pass did anything."""
        done = (self.requeued, self.finished, self.removed, self.orphan_bodies, self.orphan_chunks)
        return any(done)


class Reconciler:
    """Runs sweeps (:func:`review`) every ``settings.interval_s`` while holding the lock.

    Args:
        stores: the queue's stores (the scheduler re-queues, the stores delete).
        inventory: listings of the streams.
        lock: the cluster-wide lock.
        settings: the ``reconciler`` settings section.
        names: object names.
        clock: returns the current aware UTC time.
        slice_s: work between two rests of a regular pass, seconds (:class:`Pacer`).
        rng: the jitter source of the pause after a failed pass.

    Attributes:
        pacer: the pacer of the pass under way (None between passes).
        failed_passes: passes of this process that failed (NATS unavailable, or a bug),
            since it started; exported as ``jsqueue_reconciler_failed_passes_total``.
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
        slice_s: float = SLICE_S,
        rng: random.Random | None = None,
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
        self._margins = settings  # the margins of the pass under way (see run_once)
        # Monotonic time of the next recovery pass, None when none is wanted: one comes
        # recovery_margin_s after the start (what a crash left is older by then), and one
        # after every NATS reconnect (nats_reconnected).
        self._recovery_at: float | None = time.monotonic() + settings.recovery_margin_s
        self._wake = asyncio.Event()
        self.slice_s = slice_s
        self.pacer: Pacer | None = None
        self._pause_s = settings.interval_s  # from the end of the last pass to the next
        self.failed_passes = 0
        self._failures_in_row = 0
        # Monotonic time before which no pass starts (after a failed one), whatever asks
        # for it: a recovery pass wanted after a reconnect waits for it too.
        self._not_before = 0.0
        self._rng = rng or random.Random()

    def nats_reconnected(self) -> None:
        """Ask for a recovery pass ``recovery_margin_s`` seconds from now: the NATS server
        may have restarted and lost the last work items it was given (on one replica the
        work stream is not synced per write, ``nats.work_fsync``); a regular pass under way
        stops resting (:meth:`Pacer.hurry`), so the recovery pass is not kept waiting by
        the pacing of a large queue's pass. Never blocks;
        idempotent (a second call before the pass moves it later)."""
        self._recovery_at = time.monotonic() + self.settings.recovery_margin_s
        self._wake.set()
        if self.pacer is not None:  # a regular pass under way ends without more rests
            self.pacer.hurry()

    async def _pause(self, stop: asyncio.Event) -> None:
        """Wait for the next pass: ``interval_s``, or until a recovery pass is due (a
        reconnect meanwhile moves that sooner), or until ``stop`` is set."""
        while not stop.is_set():
            self._wake.clear()
            waits = (asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait()))
            done, _ = await asyncio.wait(
                waits, timeout=self._wait_s(), return_when=asyncio.FIRST_COMPLETED
            )
            for w in waits:
                w.cancel()
            if not done:  # the wait ran out: a pass is due
                return

    def _wait_s(self) -> float:
        """Seconds until the next pass: the pause after the last one (:func:`cycle_rest`),
        or sooner for a recovery pass (which is not paced: what a crash left is wanted back
        soon)."""
        now = time.monotonic()
        wait = self._pause_s
        if self._recovery_at is not None:
            wait = max(0.0, min(wait, self._recovery_at - now))
        return max(wait, self._not_before - now)

    def _failed(self) -> None:
        """Count a failed pass and hold off the next one (:func:`failure_backoff_s`:
        exponential from ``failed_pass_pause_s`` up to ``failed_pass_pause_max_s``, with
        jitter). A recovery pass still wanted stays wanted, after the pause: without it, a
        pass failing at once (a cluster electing its leaders answers in milliseconds) was
        followed by the next at once, thousands of requests a second to a cluster that
        was trying to recover."""
        self.failed_passes += 1
        self._failures_in_row += 1
        s = self.settings
        pause_s = failure_backoff_s(
            self._failures_in_row,
            s.failed_pass_pause_s,
            s.failed_pass_pause_max_s,
            self._rng.random(),
        )
        self._not_before = time.monotonic() + pause_s
        log.info(
            "reconciler: %d failed passes in a row; the next in %.1f s",
            self._failures_in_row,
            pause_s,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep every ``interval_s`` seconds until ``stop`` is set; first sweep at once.
        Passes take at most :data:`PASS_SHARE` of the time, however large the queue: a
        regular pass rests as it reads (:class:`Pacer`), and a pass whose work took long
        (a recovery pass, which does not rest) stretches the pause after it
        (:func:`cycle_rest`; a stretched pause is logged).

        Only the lock holder sweeps; the others keep trying to take the lock. A pass that
        fails (NATS unavailable, or a bug) is logged and counted (:attr:`failed_passes`),
        and the next one waits (``failed_pass_pause_s``, doubled per failure in a row up to
        ``failed_pass_pause_max_s``, with jitter); a recovery pass still wanted is made
        after that pause. The lock is released on the way out.
        Every ``full_scan_every``-th pass of this process is a full one. The pass
        ``recovery_margin_s`` after the start, and the one as long after each NATS reconnect
        (:meth:`nats_reconnected`), is a recovery pass (``run_once(recovery=True)``).
        """
        try:
            while not stop.is_set():
                asked = self._recovery_at
                # (a timer may fire a little early: a recovery pass due within it is due)
                recovery = asked is not None and asked <= time.monotonic() + TIMER_SLACK_S
                started = time.monotonic()
                rested = 0.0
                try:
                    full = self.passes % self.settings.full_scan_every == 0
                    report = await self.run_once(full=full, recovery=recovery)
                    rested = report.rested_s
                    if recovery and self._recovery_at == asked:  # no reconnect meanwhile
                        self._recovery_at = None
                    self._failures_in_row, self._not_before = 0, 0.0
                    if report.changed or report.reported:
                        log.info("reconciler pass: %s", _summary(report))
                except LockLost as e:
                    log.debug("reconciler: %s", e)
                    self._failures_in_row, self._not_before = 0, 0.0
                    if recovery and self._recovery_at == asked:  # the holder makes its own
                        self._recovery_at = None
                except StoreUnavailable as e:
                    log.warning("reconciler pass failed: %s", e)
                    self._failed()
                except Exception:  # a bug must not end the sweeping for good: log, go on
                    log.exception("reconciler pass failed unexpectedly")
                    self._failed()
                if self.pacer is not None:  # the pass failed: its rests are not work either
                    rested, self.pacer = self.pacer.rested_s, None
                wall = time.monotonic() - started
                busy = wall - rested
                self._pause_s = cycle_rest(self.settings.interval_s, busy, wall, PASS_SHARE)
                if self._pause_s > self.settings.interval_s:
                    log.info(
                        "reconciler: the pass worked %.1f s; the next in %.0f s, not %.0f s "
                        "(passes take at most %.0f %% of the time)",
                        busy,
                        self._pause_s,
                        self.settings.interval_s,
                        100 * PASS_SHARE,
                    )
                await self._pause(stop)
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

    async def run_once(self, *, full: bool = True, recovery: bool = False) -> Report:
        """One sweep under the lock (taken, or kept, first; renewed as the pass goes).

        Args:
            full: read every entry and every body meta, not only the suspicious ones.
            recovery: a pass after a start or a NATS restart: an open recipient without a
                work item is re-queued once ``recovery_margin_s`` overdue instead of
                ``lost_trigger_after_s`` (the items published just before a crash of a
                one-replica server may be lost: the work stream is not synced per write).
                A re-queue too many is harmless (DESIGN.md §2.2: the item is checked
                against KV on arrival).

        A regular pass rests as it reads entries and bodies (:class:`Pacer` at
        :data:`PASS_SHARE`, each rest at most a third of ``lock_ttl_s``, the lock renewed
        between), so that a pass over a million entries leaves the event loop to the mail;
        a recovery pass does not rest.

        Returns:
            what was found and done (``rested_s``: seconds rested).

        Raises:
            LockLost: another reconciler holds the lock, or it was lost mid-pass.
            StoreUnavailable: a listing failed (nothing half-done: every action is whole).
        """
        if not await self.lock.acquire():
            raise LockLost("another reconciler holds the lock")
        self._renewed_at = time.monotonic()
        self._margins = self.settings
        if recovery:
            short = min(self.settings.recovery_margin_s, self.settings.lost_trigger_after_s)
            self._margins = self.settings.model_copy(update={"lost_trigger_after_s": short})
        report = Report()
        pacer = self.pacer = Pacer(
            1.0 if recovery else PASS_SHARE,
            slice_s=self.slice_s,
            max_rest_s=self.settings.lock_ttl_s / 3,
        )
        inv = self.inventory
        ids = await inv.entry_ids()
        subjects = await inv.work_subjects()
        bodies = await inv.body_ids()
        report.entries_listed = len(ids)
        # A tuple per entry, not a set: at a million entries that is ~170 MB less.
        with_trigger: dict[str, tuple[str, ...]] = {}
        for s in subjects:
            qid = self.names.queue_id_of_work_subject(s)
            if qid is not None:
                with_trigger[qid] = (*with_trigger.get(qid, ()), s)
        del subjects  # not kept through a pass that may last many minutes
        # Keys of deleted entries stay listed until their marker expires: read each once.
        known_gone = set() if full else self._gone & ids
        to_read = sorted(ids if full else ids - with_trigger.keys() - known_gone)
        live: set[str] = set() if full else ids - set(to_read) - known_gone
        self._gone = set(known_gone)
        for i in range(0, len(to_read), READ_BATCH):
            await self._keep_lock()
            batch = to_read[i : i + READ_BATCH]
            entries = await self._scan_reads(batch)
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
                    settings=self._margins,
                )
                for action in actions:
                    await self._keep_lock()
                    await self._act(action, report)
            await pacer.step()
        await self._sweep_bodies(bodies - live, report, pacer)
        await self._keep_lock()
        cutoff = self._ago(self.settings.orphan_after_s)
        for chunk_set in await inv.orphan_chunks(cutoff, thorough=full):
            await self._keep_lock()
            await inv.delete_chunks(chunk_set)
            report.orphan_chunks.append(chunk_set)
            log.info("reconciler: purged chunk set %s that no body refers to", chunk_set)
        report.rested_s = pacer.rested_s
        self.pacer = None
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

    async def _scan_reads(self, queue_ids: list[str]) -> list[Entry | StoreError | None]:
        """:meth:`_scan_read` of each id, in few requests (:meth:`EntryStore.get_many`): an
        entry deleted (its marker still listed: most of the ids a pass reads under load,
        the messages delivered since the last pass) costs no request of its own; only an
        id missing altogether is read again, confirmed on the stream leader by
        :meth:`_scan_read` (a replica catching up may not have a new entry yet).

        Raises:
            StoreUnavailable: a read failed.
        """
        read = await self.stores.entries.get_many(queue_ids)
        out: list[Entry | StoreError | None] = []
        for queue_id, got in zip(queue_ids, read, strict=True):
            if isinstance(got, EntryDeleted):
                out.append(None)
            elif isinstance(got, EntryNotFound):
                out.append(await self._scan_read(queue_id))
            elif isinstance(got, StoreError):
                out.append(got)
            else:
                out.append(got.entry)
        return out

    async def _scan_read(self, queue_id: str) -> Entry | StoreError | None:
        """:meth:`_read`, with an unreadable entry (not an outage) as a value to report.

        Raises:
            StoreUnavailable: the read failed (an outage: re-raised, not reported).
        """
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
            settings=self._margins,
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

    async def _sweep_bodies(self, candidates: Iterable[str], report: Report, pacer: Pacer) -> None:
        """Delete bodies without an entry that are older than ``orphan_after_s``."""
        cutoff = self._ago(self.settings.orphan_after_s)
        for qid in sorted(candidates):
            await pacer.step()
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
    made: list[Reconciler] = []

    async def reconnected() -> None:
        for reconciler in made:
            reconciler.nats_reconnected()

    nc = await connect_nats(nats_settings, urls, on_reconnected=reconnected)
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
    made.append(Reconciler(stores, inventory, lock, settings.reconciler, names))
    return made[0]
