"""The delivery worker, orchestration only: fetch a due work item, check it against its entry
(KV is the truth, DESIGN.md §2.2), claim the destination by compare-and-set (§2.3), deliver
through a :class:`~jsqueue.delivery.base.Deliverer`, record each recipient's reply by
compare-and-set, finish (DSNs owed, removal) and only then settle the item. The state
transitions are :mod:`jsqueue.state`'s, the body layout :mod:`jsqueue.store.layout`'s, the
compare-and-set loop :mod:`jsqueue.store.cas`'s; ``docs/architecture.md`` (Delivery) says all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Protocol

from jsqueue import state
from jsqueue.admission import Gate, put_back
from jsqueue.attempt_log import log_attempt, log_cut_further, log_expired, log_interrupted
from jsqueue.config import WorkerSettings
from jsqueue.delivery.base import Attempt, BodySource, Deliverer
from jsqueue.delivery.committed import dot_sent
from jsqueue.destinations import Destinations
from jsqueue.envelope import Entry, Lease, utcnow
from jsqueue.errors import (
    EntryNotFound,
    EntryTooLarge,
    LeaseLost,
    RevisionConflict,
    StoreUnavailable,
)
from jsqueue.events import NULL_OBSERVER, Observer
from jsqueue.recording import AttemptRecord, BodyReads, HoldFor, fenced, hold_too_large
from jsqueue.replies import STORED_REPLY_OCTETS
from jsqueue.retry import RetryPolicy
from jsqueue.store import cas, layout, presence
from jsqueue.store.base import Due, Stores, Versioned
from jsqueue.tasks import cancel_and_wait

log = logging.getLogger("jsqueue.worker")

#: Compare-and-set tries to record one attempt's outcomes. Each conflict means another
#: writer got through (another destination's outcome or claim, an admin action), so the
#: tries are many, with a short random pause that grows: giving up would lose the record
#: of what was sent, and the next attempt would send it again.
RECORD_TRIES = 50
#: Longest pause between two recording tries, seconds.
RECORD_PAUSE_MAX_S = 0.1
#: Reply text kept per recipient on each try to record an attempt, octets: the bound every
#: entry keeps (:data:`~jsqueue.replies.STORED_REPLY_OCTETS`) first; while the entry store
#: refuses the entry as too large, the replies are cut further, then to their codes; then
#: the entry is held (:func:`jsqueue.recording.hold_too_large`).
REPLY_OCTET_STEPS = (STORED_REPLY_OCTETS, 64, 0)


@dataclass(slots=True)
class _Held:
    """The latest version of an entry whose destination this worker holds the lease on,
    while it delivers: :meth:`Worker._heartbeat` renews the lease on it."""

    version: Versioned


class Notifier(Protocol):
    """Sends the DSNs a settled entry owes (RFC 3464); see :mod:`jsqueue.dsn.notifier`."""

    async def notify(self, entry: Entry, now: datetime) -> Entry | None:
        """Enqueue every DSN owed; return the entry marked as notified, None if none owed.
        Idempotent: a DSN enqueued twice for the same event is stored once."""
        ...

    def owes(self, entry: Entry, now: datetime) -> bool:
        """Whether :meth:`notify` would enqueue or mark anything (pure, no I/O)."""
        ...


class Worker:
    """One worker process's delivery loop.

    Args:
        stores: body store, entry store and scheduler.
        deliverer: performs one delivery attempt.
        notifier: enqueues DSNs.
        settings: worker settings (concurrency, batch, lease, drain bound).
        policy: retry policy for ordinary mail.
        dsn_policy: retry policy for DSNs (shorter lifetime).
        owner: lease owner name; ``settings.lease_owner``, else the host name, when
            omitted. With a presence store, :meth:`run` adds a random suffix when another
            live worker uses the name (see :meth:`take_name`).
        clock: returns the current aware UTC time (tests pass a fake clock).
        rng: jitter source (retry delays, compare-and-set pauses).
        ack_wait_s: the work consumer's ack wait, seconds: the heartbeat keeps a long
            delivery's item alive within it.
        observer: receives an event per recorded recipient outcome (jsqueue.events).
        sites: the cluster-wide destination limits (:mod:`jsqueue.destinations`): each
            item's site is admitted before the claim; None = no limits.
    """

    def __init__(
        self,
        stores: Stores,
        deliverer: Deliverer,
        notifier: Notifier,
        settings: WorkerSettings,
        policy: RetryPolicy,
        dsn_policy: RetryPolicy | None = None,
        *,
        owner: str | None = None,
        clock: Callable[[], datetime] = utcnow,
        rng: random.Random | None = None,
        ack_wait_s: float = 60.0,
        observer: Observer = NULL_OBSERVER,
        sites: Destinations | None = None,
    ) -> None:
        self.stores = stores
        self.deliverer = deliverer
        self.notifier = notifier
        self.settings = settings
        self.policy = policy
        self.dsn_policy = dsn_policy or policy
        self.owner = owner or settings.lease_owner or socket.gethostname()
        #: this process's id in the presence bucket (tells a restart from a live namesake)
        self.instance = uuid.uuid4().hex
        #: until when its presence mark certainly stands (None without a presence store)
        self._liveness: presence.Liveness | None = None
        #: (queue id, domain) this process is claiming or delivering: its in-flight set
        self._busy: set[tuple[str, str]] = set()
        #: the entries tasks of this process work on: their writes take turns (cas.Turns)
        self._turns = cas.Turns()
        self.clock = clock
        self.rng = rng or random.Random()
        self.ack_wait_s = ack_wait_s
        self._tasks: set[asyncio.Task[None]] = set()
        self.handled = 0
        self.observer = observer
        self.sites = sites

    # ------------------------------------------------------------------ loop

    async def run(self, stop: asyncio.Event, *, idle_exit_s: float | None = None) -> None:
        """Deliver until ``stop`` is set, then drain (STYLE.md habit 10).

        Drain: stop fetching, let in-flight deliveries finish within
        ``settings.drain_timeout_s`` seconds (one past a final dot: up to
        ``data_final_timeout_s`` more, see :meth:`drain`), then hand what remains back for
        immediate redelivery (lease released, NAK without delay).

        Args:
            stop: set it (e.g. on SIGTERM) to drain and return.
            idle_exit_s: return once nothing was due and nothing was in flight for this many
                seconds (burst mode, for tests and one-shot runs); None = run until stopped.
        """
        await self.take_name()
        log.info("worker running, lease owner=%s", self.owner)
        beats = asyncio.create_task(self._presence_beats())
        halt = asyncio.Event()  # slots are kept until the drain is over
        upkeep = asyncio.create_task(self.sites.run(halt)) if self.sites else None
        try:
            await self._loop(stop, idle_exit_s)
        finally:
            halt.set()
            if upkeep is not None:
                await upkeep
            await cancel_and_wait(beats)
            with contextlib.suppress(asyncio.CancelledError):
                await beats
        if self.stores.presence is not None:
            await self.stores.presence.leave(self.owner)

    async def _loop(self, stop: asyncio.Event, idle_exit_s: float | None) -> None:
        idle_since: float | None = None
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            free = self.settings.concurrency - len(self._tasks)
            if free <= 0:
                # Every slot is taken: wait for one to end, or for the stop (SIGTERM), which
                # must start the drain bound now, not when a slow delivery ends.
                stopping = asyncio.create_task(stop.wait())
                await asyncio.wait({*self._tasks, stopping}, return_when=asyncio.FIRST_COMPLETED)
                await cancel_and_wait(stopping)
                continue
            try:
                batch = await self.stores.scheduler.fetch(min(self.settings.batch, free), 0.5)
            except StoreUnavailable as e:
                log.warning("fetch failed: %s", e)
                with contextlib.suppress(TimeoutError):  # a timeout is just "try again"
                    await asyncio.wait_for(stop.wait(), 1.0)
                continue
            sites = self.sites  # no entry read for an item its site puts back at once
            read = [d.item.queue_id for d in batch if not (sites and sites.full(d.item.domain))]
            ahead = await cas.read_ahead(self.stores.entries, read)
            for due in batch:
                task = asyncio.create_task(self._handle(due, ahead.get(due.item.queue_id)))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if batch or self._tasks:
                idle_since = None
            elif idle_exit_s is not None:
                idle_since = idle_since or loop.time()
                if loop.time() - idle_since >= idle_exit_s:
                    break
        await self.drain()
        await self.deliverer.close()

    # ------------------------------------------------------------------ presence

    async def take_name(self) -> None:
        """Register :attr:`owner` in the presence bucket before any claim; a name a live
        worker uses becomes ``<name>-<random>`` (:func:`jsqueue.store.presence.take_name`).
        Without a presence store nothing happens.

        Raises:
            StoreUnavailable: the presence bucket cannot be read or written.
        """
        if self.stores.presence is not None:
            grace_s = self.settings.presence_grace_s
            self._liveness = presence.Liveness(grace_s)
            self.owner = await presence.take_name(
                self.stores.presence, self.owner, self.instance, grace_s, self._liveness
            )
            if self.sites is not None:  # its slots and demand carry the name taken
                self.sites.rename(self.owner)

    async def _presence_beats(self) -> None:
        """Keep our presence alive (every ``presence_grace_s / 3`` seconds)."""
        if self.stores.presence is not None:
            grace_s = self.settings.presence_grace_s
            assert self._liveness is not None
            await presence.keep_alive(
                self.stores.presence, self.owner, self.instance, grace_s, self._liveness
            )

    async def _gone(self, lease: Lease) -> bool:
        """Whether the process that holds ``lease`` is known gone
        (:func:`~jsqueue.store.presence.process_gone`); False without a presence store."""
        known = self.stores.presence
        return known is not None and await presence.process_gone(known, lease.owner, lease.instance)

    def _standing_s(self) -> float:
        """Seconds this process's presence mark certainly stands yet (no other worker can
        take its leases over before), from its last beat that succeeded; half the grace
        without a presence store."""
        if self._liveness is None:
            return self.settings.presence_grace_s / 2
        return self._liveness.left_s(asyncio.get_running_loop().time())

    async def drain(self) -> None:
        """Finish in-flight deliveries within ``drain_timeout_s`` seconds, then give back
        the rest (lease released, item due at once): the bound holds whatever the next hops
        do, so a stop fits the pod's grace period. A delivery cut off after its final dot
        (no reply yet, RFC 5321 §4.5.3.2.6) may have reached the next hop: its give-back
        says so (log line, ``interrupted`` event with ``uncertain``), as the send that
        follows may be a duplicate (RFC 5321 §6.1)."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(self._tasks, timeout=self.settings.drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)

    # ------------------------------------------------------------------ one item

    async def _handle(self, due: Due, ahead: Versioned | None = None) -> None:
        keep = asyncio.create_task(self._keep_alive(due))
        try:
            await self._process(due, ahead)
            self.handled += 1
        except asyncio.CancelledError:
            await asyncio.shield(self._give_back(due, dot_sent(asyncio.current_task())))
            raise
        except EntryTooLarge as e:
            # A claim, expiry or DSN mark the entry store refuses for its size: retried, it
            # would be refused again. Hold the entry and say why.
            try:
                await self._hold(due, due.item.queue_id, e)
            except (StoreUnavailable, RevisionConflict) as failed:
                # Unsettled: the item comes back after the ack wait and is held then.
                log.warning("queue %s: could not hold: %s", due.item.queue_id, failed)
        except StoreUnavailable as e:
            # Leave the item unsettled: it comes back after the ack wait.
            log.warning("queue %s: store unavailable: %s", due.item.queue_id, e)
        except Exception:
            log.exception("queue %s: unexpected error; retrying in 60 s", due.item.queue_id)
            with contextlib.suppress(StoreUnavailable):  # unsettled items come back anyway
                await due.retry(60.0)
        finally:
            await cancel_and_wait(keep)

    async def _keep_alive(self, due: Due) -> None:
        """Keep ``due`` from redelivery from its fetch to its settlement: an in-progress
        acknowledgement every third of the ack wait, which can then be short, so a crashed
        worker's items come back soon (``nats.ack_wait_s``). A failed one is tried again."""
        interval = max(0.5, self.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(StoreUnavailable):
                await due.in_progress()

    async def _give_back(self, due: Due, uncertain: bool) -> None:
        """Drain path: release our lease and make the item due again at once. With
        ``uncertain`` (the final dot was sent, its reply not read) the next send may be a
        duplicate (RFC 5321 §6.1): a warning and an ``interrupted`` event say so."""
        with contextlib.suppress(StoreUnavailable, EntryNotFound, RevisionConflict):
            v = await self.stores.entries.get(due.item.queue_id)
            if uncertain:
                why, at = "this worker stopped", self.clock()
                log_interrupted(
                    self.observer, self._source, at, v.entry, due.item.domain, why, True
                )
            if state.holds(v.entry, due.item.domain, self.owner, self.instance):
                await self.stores.entries.update(
                    state.release(v.entry, due.item.domain), v.revision
                )
        with contextlib.suppress(StoreUnavailable):  # unsettled items come back anyway
            await due.retry(0.0)

    async def _get(self, queue_id: str) -> Versioned | None:
        try:
            return await self.stores.entries.get(queue_id)
        except EntryNotFound:
            return None

    def _policy(self, entry: Entry) -> RetryPolicy:
        return self.dsn_policy if entry.is_dsn or entry.reverse_path == "" else self.policy

    async def _process(self, due: Due, ahead: Versioned | None = None) -> None:
        """:meth:`_check_claim` (on ``ahead`` first, if read); give back an unused admission."""
        gate = Gate()
        try:
            async with self._turns.working_on(due.item.queue_id, ahead) as turn:
                await self._check_claim(due, gate, turn)
        finally:
            if self.sites is not None and gate.admission is not None:
                await self.sites.done(gate.admission, None)

    async def _check_claim(self, due: Due, gate: Gate, turn: cas.Turn) -> None:
        """Check the item against its entry and claim the destination, read again after
        a lost compare-and-set (:data:`~jsqueue.store.cas.CAS_TRIES` reads at most, then
        the item is tried again in a second); then deliver. The check and the claim are
        made in the entry's turn (the other domains' tasks of this process wait, so they
        read the claim instead of losing to it); the delivery is not."""
        item = due.item
        if self.sites is not None and (early := self.sites.early(item.domain)) is not None:
            await due.retry(early.delay_s)  # its site is full: not even the entry is read
            return
        async with turn.lock:
            claimed = await self._claim(due, gate, turn)
        if claimed is None:
            return
        key = (item.queue_id, item.domain)
        try:
            await self._attempt(due, claimed, gate, turn)
        finally:
            self._busy.discard(key)

    async def _claim(self, due: Due, gate: Gate, turn: cas.Turn) -> Versioned | None:
        """The loop of :meth:`_check_claim` (in the entry's turn): the claimed version, or
        None when the item was settled otherwise (dropped, put back, expired, retried).
        The item's key is in ``_busy`` when a version is returned. While another task of
        this process works on the entry, the first try is on the version it left in the
        turn (no read: one read per message, not per domain)."""
        item = due.item
        # The newest version another task of this process read or wrote (another domain of
        # the message): the claim is tried on it without a read. Only what a compare-and-set
        # checks is decided on it (the claim, an expiry); one that writes nothing (drop,
        # later) waits for the entry read now. A site that admits nothing puts the item back
        # on it too (the NAK does not depend on it; the site-down reply is best effort).
        seed = turn.newest
        start: Versioned | str = item.queue_id if seed is None else seed
        async for read in cas.reads(self.stores.entries, start, strict=False):
            v = None if isinstance(read, cas.Gone) else turn.saw(read)
            deleted = isinstance(read, cas.Gone) and read.deleted
            now = self.clock()
            key = (item.queue_id, item.domain)
            entry = v.entry if v else None
            verdict = state.check(
                entry, item, now, deleted=deleted, owner=self.owner, delivering=key in self._busy
            )
            if read is seed and verdict.verdict is not state.Verdict.DELIVER:
                continue
            dead: str | None = None
            lease = entry.leases.get(item.domain) if entry else None
            if verdict.leased_by is not None and lease and await self._gone(lease):
                dead, now = verdict.leased_by, self.clock()
                verdict = state.check(
                    entry,
                    item,
                    now,
                    deleted=deleted,
                    owner=self.owner,
                    delivering=key in self._busy,
                    dead_owner=dead,
                )
            if verdict.verdict is state.Verdict.DROP:
                log.debug("queue %s %s: drop (%s)", item.queue_id, item.domain, verdict.reason)
                if v is not None:
                    await self._finish(v)
                await due.term()
                return None
            if verdict.verdict is state.Verdict.LATER:
                log.debug("queue %s %s: %s", item.queue_id, item.domain, verdict.reason)
                delay_s = verdict.delay_s
                if verdict.leased_by is not None and self.stores.presence is not None:
                    # Another owner's lease: look at its presence again every fifth of the
                    # grace, so a crashed worker's mail goes soon after its mark lapses.
                    delay_s = min(delay_s, max(1.0, self.settings.presence_grace_s / 5))
                await due.retry(delay_s)
                return None
            assert v is not None
            policy = self._policy(v.entry)
            expired = state.expire_all(v.entry, item.domain, now, policy)
            try:
                if expired is None and key in self._busy:  # another task of ours claimed it
                    await due.retry(1.0)
                    return None
                if expired is None and self.sites is not None and gate.admission is None:
                    # before the claim: a full or dead site costs no lease write
                    gate.admission = await self.sites.admit(item.domain)
                if expired is None and gate.admission is not None and not gate.admission.go:
                    if gate.admission.reply is not None:  # down: no final try at the deadline
                        expired = state.expire_all(v.entry, item.domain, now, policy, tries=False)
                    if expired is None:
                        deadline = policy.deadline(v.entry.created_at)
                        await put_back(self.stores, due, v, gate.admission, self._source, deadline)
                        return None
                if expired is not None:
                    before = v.entry
                    v = await self._update(expired, v.revision)
                    log_expired(self.observer, self._source, self.clock(), before, v.entry)
                    await self._finish(v)
                    await due.ack()
                    return None
                lease_s, instance = self.settings.lease_s, self.instance
                claimed = state.claim(
                    v.entry, item.domain, self.owner, now, lease_s, instance=instance
                )
                old = v.entry.leases.get(item.domain)
                self._busy.add(key)
                try:
                    v = turn.saw(await self._update(claimed, v.revision))
                except BaseException:
                    self._busy.discard(key)
                    raise
            except RevisionConflict:
                continue
            if old is not None and old.until > now:
                whose = "a dead worker" if dead else "an earlier process of this worker"
                why = f"lease of {whose} {old.owner} taken over, until {old.until.isoformat()}"
                log_interrupted(self.observer, self._source, now, v.entry, item.domain, why, False)
            return v
        await due.retry(1.0)
        return None

    async def _attempt(self, due: Due, claimed: Versioned, gate: Gate, turn: cas.Turn) -> None:
        item, entry, started, held = due.item, claimed.entry, self.clock(), _Held(claimed)
        recipients = entry.open_recipients(item.domain)
        heartbeat = asyncio.create_task(self._heartbeat(item.domain, held, turn))
        fence = partial(self._still_held, item.domain, held, turn)
        reads = BodyReads(fenced(layout.delivery_body(self.stores, entry), fence))
        body = BodySource(reads.open, entry.size)  # (reads notes the queue's own trouble)
        try:
            delivery = await self.deliverer.deliver(entry, item.domain, recipients, body)
        finally:  # a lost cancellation would renew the lease after the delivery
            await cancel_and_wait(heartbeat)
        if self.sites is not None and gate.admission is not None:
            admission, gate.admission = gate.admission, None
            await self.sites.done(admission, delivery)
        async with turn.lock:  # the queue's own trouble alone is not recorded:
            if not await reads.given_back(self.stores, due, turn, held.version, delivery):
                await self._conclude(due, held, delivery, started, turn)

    async def _conclude(
        self, due: Due, held: _Held, delivery: Attempt, started: datetime, turn: cas.Turn
    ) -> None:
        """Record the attempt, log it, remove or finish the entry, settle the item (in the
        entry's turn; the first record try is on the newest version this process knows).
        A destination another worker took over meanwhile (:class:`LeaseLost`) is left to it:
        nothing is recorded, the item stays unsettled.

        Raises:
            StoreUnavailable: still, after the retries of :func:`cas.through_outage`.
        """
        item = due.item
        outcome = None
        record = AttemptRecord(
            self.stores,
            item.domain,
            delivery,
            self.clock(),
            self._policy(held.version.entry),
            self.rng,
            self.owner,
            self.instance,
            self._removable,
            self._pause,
            RECORD_TRIES,
        )
        for step, octets in enumerate(REPLY_OCTET_STEPS):
            start = turn.latest(held.version)
            # Lost to an outage, the record would mean a second copy (RFC 5321 §6.1).
            left_s = state.lease_left_s(
                start.entry, item.domain, self.owner, self.clock(), instance=self.instance
            )
            write = partial(record.write, start, octets, turn)
            try:  # while neither the lease nor this worker's presence can run out
                outcome = await cas.through_outage(write, min(0.9 * left_s, self._standing_s()))
            except EntryTooLarge as e:
                refused = e
                continue
            except StoreUnavailable:  # what the attempt did is still logged
                self._log_unrecorded(held.version.entry, item.domain, delivery, started, False)
                raise
            except LeaseLost as e:
                # Its new holder delivers and settles the destination; what this attempt
                # did (a delivery above all: it happened) is still logged and told.
                log.warning("queue %s: attempt not recorded: %s", item.queue_id, e)
                self._log_unrecorded(held.version.entry, item.domain, delivery, started, True)
                return
            if step and outcome is not None:
                detail = f"{item.domain}: replies recorded cut to {octets} octets ({refused})"
                v, at = outcome.version, self.clock()
                log_cut_further(self.observer, self._source, at, v.entry, item.domain, detail)
            break
        else:
            # Not even the recipients' states fit: log what the attempt did, hold.
            self._log_unrecorded(held.version.entry, item.domain, delivery, started, False)
            await self._hold(due, held.version, refused)
            return
        if outcome is None:
            # Deleted meanwhile (an operator's delete while the MX was answering): what the
            # attempt did is still logged and told, a delivery above all (it happened).
            log.info("queue %s: deleted during delivery", item.queue_id)
            self._log_unrecorded(held.version.entry, item.domain, delivery, started, True)
            await due.ack()
            return
        v, recorded, removed, now = outcome
        log_attempt(
            self.observer, self._source, v.entry, item.domain, recorded, started, now, delivery
        )
        if removed:
            if v.entry.inline_body is None:
                await self.stores.bodies.discard(v.entry.id)
            log.info("queue %s: done, removed", v.entry.id)
        else:
            if v.entry.inline_body is not None and recorded.retry_delay_s is not None:
                # Deferred: queued mail keeps only metadata in its entry (after the record).
                v = await layout.move_body_out(
                    self.stores, v, tries=RECORD_TRIES, pause=self._pause
                )
            await self._finish(v)
        if recorded.retry_delay_s is None:
            await due.ack()
        else:
            await due.retry(recorded.retry_delay_s)

    def _log_unrecorded(
        self, entry: Entry, domain: str, delivery: Attempt, started: datetime, events: bool
    ) -> None:
        """Log lines (and events with ``events``) of an attempt ``entry`` does not record."""
        now, o = self.clock(), self.observer
        policy, hop_dsn = self._policy(entry), delivery.next_hop_dsn
        _, done = state.record(
            entry, domain, delivery.replies, now, policy, self.rng, next_hop_dsn=hop_dsn
        )
        log_attempt(o, self._source, entry, domain, done, started, now, delivery, events=events)

    def _still_held(self, domain: str, held: _Held, turn: cas.Turn) -> None:
        """Before the final dot (:func:`~jsqueue.recording.fenced`): this process's lease
        on ``domain`` has not run out by its clock, and its presence mark certainly stands,
        so no other worker can have taken the destination over (DESIGN.md §2.3).

        Raises:
            LeaseLost: either may have lapsed (the process was paused): no dot is sent.
        """
        entry, now = turn.latest(held.version).entry, self.clock()
        if state.lease_left_s(entry, domain, self.owner, now, instance=self.instance) <= 0:
            raise LeaseLost(f"{domain}: the lease ran out before the final dot (a pause?)")
        alive = self._liveness
        if alive is not None and not alive.stands(asyncio.get_running_loop().time()):
            raise LeaseLost(f"{domain}: the presence may have lapsed before the final dot")

    async def _hold(self, due: Due, start: Versioned | str, error: EntryTooLarge) -> None:
        """The entry store refuses what this worker has to write for its size: hold the
        entry (:func:`~jsqueue.recording.hold_too_large`) and settle the work item. Nothing
        of the entry is sent again until it is released.

        Raises:
            StoreUnavailable: the item stays unsettled (it comes back after the ack wait).
            RevisionConflict: every try lost (:data:`RECORD_TRIES`); unsettled likewise.
        """
        held = HoldFor(due.item.domain, self.owner, self.instance, error)
        await hold_too_large(
            self.stores,
            start,
            held,
            self.observer,
            self._source,
            self.clock(),
            self._pause,
            RECORD_TRIES,
        )
        await due.ack()

    async def _update(self, entry: Entry, revision: int) -> Versioned:
        """Compare-and-set ``entry`` at ``revision`` (:func:`jsqueue.store.layout.update_entry`:
        an entry too large with its inline body is written without it).

        Raises:
            RevisionConflict: the entry changed since ``revision``.
            EntryTooLarge: too large even without an inline body (nothing written).
            StoreUnavailable: the entry store, or the body store the body is moved to, failed.
        """
        return await layout.update_entry(self.stores, entry, revision)

    @property
    def _source(self) -> str:
        return f"worker:{self.owner}"

    def _pause(self, attempt: int) -> float:
        """The random growing pause before recording try ``attempt``, seconds
        (:func:`jsqueue.store.cas.growing_pause`, up to :data:`RECORD_PAUSE_MAX_S`)."""
        return cas.growing_pause(self.rng, RECORD_PAUSE_MAX_S)(attempt)

    def _removable(self, entry: Entry, now: datetime) -> bool:
        """Final, not a DSN (those stay, see :meth:`_finish`) and owing no DSN."""
        return entry.is_final and not entry.is_dsn and not self.notifier.owes(entry, now)

    async def _heartbeat(self, domain: str, held: _Held, turn: cas.Turn) -> None:
        """During a long SMTP session, keep the lease on the destination: renewed by
        compare-and-set once half of ``lease_s`` has run (:func:`state.renewed`), so that it
        never runs out under a live worker and no flush, reconciler or other worker starts
        a second transaction beside this one (DESIGN.md §2.3). A failed beat (NATS
        unavailable) is tried again at the next. (The work item is kept alive by
        :meth:`_keep_alive` for the whole of its handling.)"""
        interval = max(0.5, self.settings.lease_s / 3)
        while True:
            await asyncio.sleep(interval)
            # A renewal is no larger than the claim: a size refusal is not expected here.
            with contextlib.suppress(StoreUnavailable, EntryTooLarge):
                async with turn.lock:
                    await self._renew(domain, held, turn)

    async def _renew(self, domain: str, held: _Held, turn: cas.Turn) -> None:
        """Renew our lease on ``domain`` in ``held`` when due; after a lost compare-and-set
        (an admin change, a DSN mark) the entry is read again and renewed at the next beat.

        Raises:
            StoreUnavailable: the write or the read after a lost compare-and-set failed.
            EntryTooLarge: the renewed entry is too large even without an inline body (not
                expected: a renewal is no larger than the claim).
        """
        held.version = turn.latest(held.version)
        entry = held.version.entry
        renewed = state.renewed(
            entry, domain, self.owner, self.clock(), self.settings.lease_s, instance=self.instance
        )
        if renewed is None:
            return
        try:
            held.version = turn.saw(await self._update(renewed, held.version.revision))
        except RevisionConflict:
            fresh = await self._get(entry.id)
            if fresh is not None:
                held.version = turn.saw(fresh)

    async def _finish(self, v: Versioned) -> None:
        """Send owed DSNs of a settled entry; delete a final entry and its body. Read again
        after a lost compare-and-set, :data:`~jsqueue.store.cas.CAS_TRIES` times at most
        (then the next work item of the entry finishes it)."""
        async for fresh in cas.versions(self.stores.entries, v, strict=False):
            if fresh is None:
                return
            v = fresh
            if not state.settled(v.entry, self.clock(), self._policy(v.entry)):
                return
            marked = await self.notifier.notify(v.entry, self.clock())
            try:
                if marked is not None:
                    v = await self._update(marked, v.revision)
                if v.entry.is_final:
                    # Entry first, as recording.py: a crash between leaves an orphan body. A
                    # DSN entry stays, so a DSN re-enqueued is not sent twice (dsn.notifier).
                    if not v.entry.is_dsn:
                        await self.stores.entries.delete(v.entry.id, revision=v.revision)
                    if v.entry.inline_body is None:
                        await self.stores.bodies.delete(v.entry.id)
                    how = (
                        "DSN done, body removed, entry kept" if v.entry.is_dsn else "done, removed"
                    )
                    log.info("queue %s: %s", v.entry.id, how)
                return
            except RevisionConflict:
                continue
