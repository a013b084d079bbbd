"""Recording one delivery attempt's outcome by compare-and-set, for the worker (DESIGN.md
§2.3: the outcome of what was sent is written by the lease's holder before the work item is
settled). Two faults of a plain compare-and-set loop are ruled out here:

- **A write whose reply was lost** (a timeout after the server applied it, during a NATS
  restart or a leader election) is not applied a second time when it is tried again: the
  entry read after the lost compare-and-set shows the attempt
  (:func:`jsqueue.state.recorded_at`: every try records the same instant), and that is the
  outcome. Applied again, each deferred recipient's attempt would count twice, and a
  removal tried again would report the entry as deleted by someone else.
- **A lease another holds** (a worker that took the destination over after this one's lease
  or presence ran out, or a later process of the same name after this one hung) is not
  ended: :func:`jsqueue.state.taken_over` refuses the version, and
  :class:`~jsqueue.errors.LeaseLost` is raised. Written, the record would drop that
  worker's lease and overwrite its recipients' states while it delivers to them.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from jsqueue import state
from jsqueue.delivery.base import Attempt
from jsqueue.delivery.body import aclose
from jsqueue.envelope import Entry
from jsqueue.errors import (
    EntryNotFound,
    EntryTooLarge,
    LeaseLost,
    RevisionConflict,
    StoreUnavailable,
)
from jsqueue.events import EventKind, Observer, entry_event
from jsqueue.replies import R451_BODY_UNAVAILABLE, Reply
from jsqueue.retry import RetryPolicy
from jsqueue.store import cas, layout
from jsqueue.store.base import Due, Stores, Versioned

log = logging.getLogger("jsqueue.worker")

#: NAK delay of a destination whose attempt failed only because the body store was
#: unavailable, seconds: the queue's own trouble, tried again soon (not after
#: ``retry.base_s``) and not counted as an attempt of its recipients.
STORE_TROUBLE_RETRY_S = 5.0


def fenced(
    open_: Callable[[], AsyncIterator[bytes]], check: Callable[[], None]
) -> Callable[[], AsyncIterator[bytes]]:
    """The body streams of ``open_``, each calling ``check()`` once it has yielded its last
    chunk: the SMTP session writes the final dot only after the stream ends, so an
    exception from ``check`` abandons the transaction before its dot, and the next hop
    delivers nothing (RFC 5321 §4.1.1.4; the session answers the recipients 451). Made for
    the lease: a worker that was paused (SIGSTOP, a VM or GC pause) past its lease or its
    presence grace wakes mid-DATA while another worker may be delivering the same message.
    The check also runs after a whole read made before DATA (a DKIM signing or 7-bit
    conversion pass), where a raise abandons the transaction earlier still.

    Raises:
        Exception: from the stream, whatever ``check`` raises (the worker's
            :class:`~jsqueue.errors.LeaseLost`), and whatever ``open_``'s stream raises.
    """

    async def stream() -> AsyncIterator[bytes]:
        chunks = open_()
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await aclose(chunks)
        check()

    return stream


class Outcome(NamedTuple):
    """An attempt as recorded: the entry version written (or removed), what was recorded,
    whether the entry was removed instead of updated, and when."""

    version: Versioned
    recorded: state.Recorded
    removed: bool
    at: datetime


@dataclass(frozen=True, slots=True)
class _Unsure:
    """A write that failed without a verdict: it may have been applied."""

    entry: Entry
    recorded: state.Recorded
    revision: int
    removed: bool


@dataclass(slots=True)
class AttemptRecord:
    """The record of one attempt on ``domain``, written by :meth:`write` (tried again by
    the caller through an outage: each try knows what the earlier ones may have written).

    Attributes:
        stores: the entry store written, the body store an inline body may move to.
        domain: the destination domain attempted.
        delivery: the attempt's replies per recipient, DKIM note and DSN hand-over.
        at: the attempt's end, aware UTC: the same instant on every try.
        policy: when a 4yz is retried, or expires (:func:`jsqueue.state.record`).
        rng: jitter source of ``policy``.
        owner: the recording worker's lease owner name.
        instance: the recording process's id (the lease's ``instance``).
        removable: whether a recorded entry is removed instead of written (final, owing
            nothing): ``removable(entry, at)``.
        pause: the pause before compare-and-set try ``n`` (seconds).
        tries: compare-and-set tries per :meth:`write`.
    """

    stores: Stores
    domain: str
    delivery: Attempt
    at: datetime
    policy: RetryPolicy
    rng: random.Random
    owner: str
    instance: str
    removable: Callable[[Entry, datetime], bool]
    pause: cas.Pause
    tries: int
    _unsure: _Unsure | None = None

    async def write(self, start: Versioned, octets: int, turn: cas.Turn) -> Outcome | None:
        """Record the attempt, reply texts bounded to ``octets``; None when the entry was
        deleted meanwhile. The first try is on ``start`` (the claimed or renewed version),
        no re-read: a change since then fails the compare-and-set, and only then is the
        entry read again.

        Idempotent across calls: when an earlier call's write failed without a verdict and
        was applied after all, the version read shows it and is returned as the outcome.

        Raises:
            LeaseLost: the lease on ``domain`` is another's (nothing written).
            EntryTooLarge: the entry store refuses the recorded entry for its size.
            RevisionConflict: every try lost (``tries``).
            StoreUnavailable: a read or write failed (the write may have been applied;
                the next call tells).
            AssertionError: never: :func:`~jsqueue.store.cas.versions` raises
                RevisionConflict when its tries run out (an unreachable guard).
        """
        versions = cas.versions(self.stores.entries, start, tries=self.tries, pause=self.pause)
        async for v in versions:
            unsure = self._unsure
            if v is None:
                if unsure is not None and unsure.removed:  # the removal was applied
                    was = Versioned(unsure.entry, unsure.revision)
                    return Outcome(was, unsure.recorded, True, self.at)
                return None
            if unsure is not None and state.recorded_at(v.entry, self.domain, self.at):
                return Outcome(turn.saw(v), unsure.recorded, False, self.at)
            other = state.taken_over(v.entry, self.domain, self.owner, self.instance)
            if other is not None:
                raise LeaseLost(f"{self.domain} is leased by {other.owner} until {other.until}")
            new, recorded = state.record(
                v.entry,
                self.domain,
                self.delivery.replies,
                self.at,
                self.policy,
                self.rng,
                reply_octets=octets,
                dkim=self.delivery.dkim,
                next_hop_dsn=self.delivery.next_hop_dsn,
            )
            removed = self.removable(new, self.at)
            try:
                if removed:
                    # Done and nothing owed: the compare-and-set that would record the
                    # outcome removes the entry instead (one synced write less). The body
                    # goes after it (an inline body went with the entry); a crash in
                    # between leaves an orphan body for the reconciler, never an entry
                    # without its body.
                    await self.stores.entries.delete(new.id, revision=v.revision)
                    return Outcome(Versioned(new, v.revision), recorded, True, self.at)
                written = turn.saw(await layout.update_entry(self.stores, new, v.revision))
                return Outcome(written, recorded, False, self.at)
            except RevisionConflict:
                continue
            except StoreUnavailable:
                self._unsure = _Unsure(new, recorded, v.revision, removed)
                raise
        raise AssertionError("unreachable: versions() raises when its tries run out")


class HoldFor(NamedTuple):
    """What :func:`hold_too_large` holds: ``domain``'s lease of ``owner`` (process
    ``instance``) is given back, and ``error`` is the entry store's size refusal."""

    domain: str
    owner: str
    instance: str
    error: EntryTooLarge


async def hold_too_large(
    stores: Stores,
    start: Versioned | str,
    hold: HoldFor,
    observer: Observer,
    source: str,
    at: datetime,
    pause: Callable[[int], float],
    tries: int,
) -> None:
    """The entry store refuses what a worker has to write for its size: hold the entry (as
    an operator's hold does), give back the lease, keep the reason in ``last_error`` (left
    out when even it does not fit), say why (error log line, ``too_large`` and ``held``
    events). A size refusal is never retried as if it were an outage, which would send the
    message again after the lease. An entry deleted meanwhile is left so (logged).

    Raises:
        StoreUnavailable: nothing held.
        RevisionConflict: every one of ``tries`` compare-and-sets lost.
    """
    reason = f"entry too large to store ({hold.domain}): {hold.error}"

    async def write(entry: Entry, revision: int) -> Versioned:
        try:
            return Versioned(entry, await stores.entries.update(entry, revision))
        except EntryTooLarge:  # the reason itself does not fit beside the entry
            bare = entry.model_copy(update={"last_error": None})
            return Versioned(bare, await stores.entries.update(bare, revision))

    def held(entry: Entry) -> Entry | None:
        return state.hold(entry, hold.domain, hold.owner, reason, instance=hold.instance)

    try:
        changed = await cas.change(
            stores.entries, start, held, write=write, tries=tries, pause=pause
        )
    except EntryNotFound:
        qid = start if isinstance(start, str) else start.entry.id
        log.info("queue %s: deleted meanwhile (%s)", qid, reason)
        return
    entry = changed.after.entry if changed.after is not None else changed.before.entry
    log.error("queue %s: held: %s; release it to deliver again", entry.id, reason)
    for kind in (EventKind.TOO_LARGE, EventKind.HELD):
        observer.emit(entry_event(kind, entry, source=source, at=at, detail=reason))


def _body_unavailable(reply: Reply) -> bool:
    """Whether ``reply`` is ours for a body that could not be read during DATA (the
    transaction was abandoned before its final dot, RFC 5321 §4.1.1.4). Pure."""
    base = R451_BODY_UNAVAILABLE
    return (
        reply.remote_host is None
        and (reply.code, reply.enhanced) == (base.code, base.enhanced)
        and reply.text.startswith(base.text)
    )


class BodyReads:
    """The body streams of one attempt (``open_``, :func:`fenced`), noting whether the
    queue's own trouble ended one before its final dot: the body store was unavailable
    (:class:`~jsqueue.errors.StoreUnavailable`, raised once the store's own retries and its
    reads from the stream leader ran out), or the fence withheld the dot
    (:class:`~jsqueue.errors.LeaseLost`: this worker's presence beats failed in the same
    outage, or it was paused past its lease).

    A "not found" or a corrupt body is not noted: the store confirmed it on the stream
    leader, so it is the mail's outcome and is recorded as usual.
    """

    def __init__(self, open_: Callable[[], AsyncIterator[bytes]]) -> None:
        self._open = open_
        self.failure: StoreUnavailable | LeaseLost | None = None

    async def open(self) -> AsyncIterator[bytes]:
        """One stream of the body, as ``open_`` gives it; a StoreUnavailable or LeaseLost
        is noted and re-raised.

        Raises:
            StoreUnavailable: the body store failed (noted).
            LeaseLost: the fence withheld the final dot (noted).
            Exception: whatever else the stream raises.
        """
        chunks = self._open()
        try:
            async for chunk in chunks:
                yield chunk
        except (StoreUnavailable, LeaseLost) as e:
            self.failure = e
            raise
        finally:
            await aclose(chunks)

    async def given_back(
        self, stores: Stores, due: Due, turn: cas.Turn, held: Versioned, delivery: Attempt
    ) -> bool:
        """When the queue's own trouble (:attr:`failure`) was the attempt's only outcome
        (every recipient got our "body could not be read" reply: nothing was sent, nothing
        refused, RFC 5321 §4.1.1.4), give the destination back instead of recording the
        attempt: the lease is released (unless another worker has it meanwhile) and
        the item NAKed with :data:`STORE_TROUBLE_RETRY_S`, so the mail is not deferred for
        a backoff step (``retry.base_s``) and no attempt is counted for the queue's own
        trouble. Otherwise nothing happens and the attempt is recorded as usual.

        Returns:
            True when the destination was given back (the caller records nothing).

        Raises:
            StoreUnavailable: the NAK failed (the item comes back after the ack wait).
        """
        replies = delivery.replies.values()
        if self.failure is None or not replies or not all(map(_body_unavailable, replies)):
            return False
        domain = due.item.domain
        log.warning(
            "queue %s %s: no final dot (%s); the queue's own trouble, not counted as an "
            "attempt, tried again in %g s",
            due.item.queue_id,
            domain,
            self.failure,
            STORE_TROUBLE_RETRY_S,
        )
        v = turn.latest(held)
        # Best effort: a lease left behind runs out, and this worker may take it up again.
        with contextlib.suppress(StoreUnavailable, RevisionConflict, EntryTooLarge, EntryNotFound):
            released = state.release(v.entry, domain)
            turn.saw(await layout.update_entry(stores, released, v.revision))
        await due.retry(STORE_TROUBLE_RETRY_S)
        return True
