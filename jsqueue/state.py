"""Pure state transitions of a queue entry: each takes the entry (and ``now``) and returns a
new entry for the caller to write by compare-and-set (DESIGN.md §2.3); none does I/O. The
worker's side: :func:`check` whether a work item may be delivered, :func:`claim` and
:func:`renewed` a destination's lease, :func:`release` it without an outcome, :func:`record`
the replies (bounded), :func:`expire_all` what ran out of time, :func:`hold` an entry the
store refuses. The operators' side is :mod:`jsqueue.operator_state`. Applying a transition
again to a newer revision after a lost compare-and-set is safe: each function only looks at
the entry it is given.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

from jsqueue import replies
from jsqueue.envelope import Entry, Lease, Recipient, RecipientState, WorkItem
from jsqueue.names import queue_id_time
from jsqueue.replies import Reply
from jsqueue.retry import Expire, RetryPolicy, delay_until_s, is_due

#: The front end stores a message's entry and publishes its work items at the same time
#: (:mod:`jsqueue.frontend.ingest`), so a work item can arrive before its entry. For this many
#: seconds after the queue id's creation time, "no entry" means "not stored yet" (or the
#: ingest failed and the client was told 451), and the item is tried again shortly;
#: afterwards it is dropped. Covers publish retries across a cluster election and clock
#: differences between hosts.
CREATE_GRACE_S = 60.0
#: Seconds before a work item that arrived ahead of its entry is tried again.
CREATE_RETRY_S = 0.5


class Verdict(StrEnum):
    """What to do with a work item before any SMTP is spoken (DESIGN.md §2.2)."""

    DELIVER = "deliver"
    DROP = "drop"  # entry gone, stale generation, held, or nothing left for the domain
    LATER = "later"  # not yet due, or another worker's lease is still running


@dataclass(frozen=True)
class Check:
    """The answer of :func:`check`: a verdict, why, and for LATER the delay in seconds."""

    verdict: Verdict
    reason: str
    delay_s: float = 0.0
    #: for LATER under another owner's running lease: that owner (whose presence the
    #: worker may look up, then check again with ``dead_owner``)
    leased_by: str | None = None


def check(
    entry: Entry | None,
    item: WorkItem,
    now: datetime,
    *,
    tolerance_s: float = 1.0,
    deleted: bool = False,
    owner: str | None = None,
    delivering: bool = False,
    dead_owner: str | None = None,
) -> Check:
    """Decide whether ``item`` may be delivered now, re-checking it against KV (the truth).

    Args:
        entry: the entry as read from the entry store; None when it is gone.
        item: the work item that arrived.
        now: current time, aware.
        tolerance_s: seconds of earliness still treated as due.
        deleted: with ``entry`` None, the store knows it was deleted (not "not yet").
        owner: the checking worker's lease owner name. A running lease of that name is
            left over from an earlier process of the same worker (it restarted after a
            crash) unless ``delivering``, and counts as free.
        delivering: this process is delivering ``item``'s destination right now (it is in
            its in-flight set): its own lease is respected.
        dead_owner: an owner found not present (no heartbeat within the grace): its
            running lease is stale and counts as free.

    Returns:
        LATER for a missing (not deleted) entry whose id is younger than
        :data:`CREATE_GRACE_S`; DROP for a deleted (or older missing) entry, a stale
        generation, a held entry or a destination with no open recipient; LATER (with the
        remaining delay) for an early redelivery (after a crash JetStream may redeliver a
        NAKed item at ack wait, DESIGN.md §7) or while another worker's lease runs; DELIVER
        otherwise.
    """
    if entry is None:
        young = (now - queue_id_time(item.queue_id)).total_seconds() < CREATE_GRACE_S
        if young and not deleted:
            return Check(Verdict.LATER, "entry not stored yet", CREATE_RETRY_S)
        return Check(Verdict.DROP, "entry gone")
    if item.generation != entry.generation:
        return Check(Verdict.DROP, f"stale generation {item.generation} != {entry.generation}")
    if entry.held:
        return Check(Verdict.DROP, "held")
    due = entry.due_at(item.domain)
    if due is None:
        return Check(Verdict.DROP, "no open recipient for the domain")
    lease = entry.leases.get(item.domain)
    if (
        lease is not None
        and lease.until > now
        and not lease_free(lease, owner, delivering, dead_owner)
    ):
        return Check(
            Verdict.LATER,
            f"leased by {lease.owner}",
            delay_until_s(lease.until, now),
            leased_by=None if lease.owner == owner else lease.owner,
        )
    if not is_due(due, now, tolerance_s=tolerance_s):
        return Check(Verdict.LATER, "not yet due", delay_until_s(due, now))
    return Check(Verdict.DELIVER, "due")


def lease_free(lease: Lease, owner: str | None, delivering: bool, dead_owner: str | None) -> bool:
    """Whether a running ``lease`` may be taken over: it is ``owner``'s own (a worker that
    restarted with the same name) and ``owner`` is not ``delivering`` it, or its owner is
    ``dead_owner`` (not present). Pure."""
    if owner is not None and lease.owner == owner:
        return not delivering
    return dead_owner is not None and lease.owner == dead_owner


def copy_entry(entry: Entry) -> Entry:
    """A copy whose recipients and leases may be changed without touching ``entry``.

    Cheaper than a deep copy: the values inside a recipient and a lease (strings,
    datetimes, frozensets, replies) are immutable or only ever replaced, never changed.
    """
    return entry.model_copy(
        update={
            "recipients": [r.model_copy() for r in entry.recipients],
            "leases": dict(entry.leases),
        }
    )


def claim(
    entry: Entry,
    domain: str,
    owner: str,
    now: datetime,
    lease_s: float,
    *,
    instance: str | None = None,
) -> Entry:
    """Take a lease on ``domain`` and mark its open recipients active (DESIGN.md §2.3).

    Args:
        entry: the entry as read.
        domain: the destination domain (A-label).
        owner: the worker's name, recorded in the lease.
        now: the current time, aware UTC.
        lease_s: the lease's length, seconds.
        instance: the claiming process's id, recorded in the lease (:func:`holds`).

    Returns:
        a new entry; the caller writes it by compare-and-set before talking SMTP.
    """
    new = copy_entry(entry)
    until = now + timedelta(seconds=lease_s)
    new.leases[domain] = Lease(owner=owner, until=until, instance=instance)
    for r in new.open_recipients(domain):
        r.state = RecipientState.ACTIVE
    return new


def holds(entry: Entry, domain: str, owner: str, instance: str | None = None) -> bool:
    """Whether the lease on ``domain`` is ``owner``'s, and with ``instance`` that process's:
    a lease of the same name that a later process took over (the earlier one hung past its
    presence grace, then woke) is not. A lease or a caller without an instance is told by
    the name alone. Pure (DESIGN.md §2.3)."""
    lease = entry.leases.get(domain)
    if lease is None or lease.owner != owner:
        return False
    return instance is None or lease.instance is None or lease.instance == instance


def renewed(
    entry: Entry,
    domain: str,
    owner: str,
    now: datetime,
    lease_s: float,
    *,
    instance: str | None = None,
) -> Entry | None:
    """``entry`` with ``owner``'s lease on ``domain`` extended to ``now + lease_s`` (seconds),
    once at most half of ``lease_s`` is left (DESIGN.md §2.3: a live worker's lease never runs out,
    so nothing that takes over expired leases, a flush or another worker's claim, can start
    a second transaction beside a slow one). Pure.

    Returns:
        the new entry (the caller writes it by compare-and-set); None when the lease is not
        ``owner``'s, or not ``instance``'s (:func:`holds`: released, taken over) or more
        than half of ``lease_s`` is left.
    """
    if not holds(entry, domain, owner, instance):
        return None
    lease = entry.leases[domain]
    if (lease.until - now).total_seconds() > lease_s / 2:
        return None
    new = copy_entry(entry)
    until = now + timedelta(seconds=lease_s)
    new.leases[domain] = lease.model_copy(update={"until": until})
    return new


def lease_left_s(
    entry: Entry, domain: str, owner: str, now: datetime, *, instance: str | None = None
) -> float:
    """Seconds left of ``owner``'s lease on ``domain`` at ``now``; 0 when it ran out or is
    not ``owner``'s (:func:`holds`, with ``instance``). Until then no other worker claims
    the destination (DESIGN.md §2.3), so an outcome may still be recorded without the
    message being sent twice. Pure."""
    if not holds(entry, domain, owner, instance):
        return 0.0
    return max(0.0, (entry.leases[domain].until - now).total_seconds())


def taken_over(entry: Entry, domain: str, owner: str, instance: str | None = None) -> Lease | None:
    """The lease on ``domain`` when it is another's than ``owner``'s (``instance``'s, see
    :func:`holds`): another worker, or a later process of the same name, took the
    destination over, and an outcome ``owner`` records now would end that lease and
    overwrite its recipients' states mid-delivery. None when the lease is ``owner``'s or
    there is none (released: the outcome may be recorded). Pure (DESIGN.md §2.3)."""
    lease = entry.leases.get(domain)
    if lease is None or holds(entry, domain, owner, instance):
        return None
    return lease


def recorded_at(entry: Entry, domain: str, at: datetime) -> bool:
    """Whether an attempt on ``domain`` that ended at ``at`` is recorded in ``entry``: a
    recipient of ``domain`` has ``at`` as its last attempt. ``at`` is the recording
    worker's clock to the microsecond, so a write whose reply was lost (a timeout after
    the server applied it) is told apart from one that was not applied, and is not
    applied twice (which would count the attempt twice). Pure."""
    return any(r.last_attempt_at == at for r in entry.recipients if r.domain == domain)


def release(entry: Entry, domain: str) -> Entry:
    """Give the lease on ``domain`` back without an outcome (drain): recipients become due.

    A lease, not the hold flag: an operator's release of a held entry is
    :func:`jsqueue.operator_state.released_from_hold`. Idempotent: without a lease on
    ``domain`` only active recipients change.

    Returns:
        a new entry with the lease removed and active recipients deferred to now.
    """
    new = copy_entry(entry)
    new.leases.pop(domain, None)
    for r in new.open_recipients(domain):
        if r.state is RecipientState.ACTIVE:
            r.state = RecipientState.DEFERRED if r.attempts else RecipientState.PENDING
    return new


def site_deferred(entry: Entry, domain: str, reply: Reply, until: datetime) -> Entry | None:
    """``domain``'s open recipients deferred without a connection because the destination
    site is a dead site (RFC 5321 §4.5.4.1): ``reply`` (``451 4.4.1 … site down until …``)
    becomes their last reply, with the failure they last had kept in its text ("; last
    failure: 451 4.4.1 … connection refused", as Postfix's "delivery temporarily suspended:
    <cause>"), so that a delay or expiry DSN still names the cause; ``until`` becomes their
    next attempt; their attempt count stays (no attempt was made). Recipients under a
    lease are not touched. Pure.

    Returns:
        the new entry (written by compare-and-set), None when nothing would change.
    """
    if domain in entry.leases:
        return None
    new = copy_entry(entry)
    changed = False
    for r in new.open_recipients(domain):
        suspended = _with_cause(reply, r.last_reply)
        if r.last_reply != suspended or r.next_attempt_at != until:
            r.last_reply, r.next_attempt_at = suspended, until
            r.state = RecipientState.DEFERRED
            changed = True
    return new if changed else None


_CAUSE = "; last failure: "


def _with_cause(reply: Reply, previous: Reply | None) -> Reply:
    """The site-down ``reply`` with the real failure ``previous`` stood for: ``previous``
    itself, or the cause an earlier site-down reply kept (never nested)."""
    if previous is None or previous.is_success:
        return reply
    if previous.text.startswith(replies.R451_SITE_DOWN.text) and previous.remote_host is None:
        cause = previous.text.partition(_CAUSE)[2]
    else:
        cause = str(previous)
    if not cause:
        return reply
    return reply.model_copy(update={"text": reply.text + _CAUSE + cause}).bounded()


def hold(
    entry: Entry, domain: str, owner: str, reason: str | None, *, instance: str | None = None
) -> Entry:
    """Hold ``entry`` because a worker cannot store what it did with ``domain`` (the entry
    store refuses the entry as too large): ``owner``'s lease on ``domain`` is given back as
    by :func:`release` (another owner's stays), the hold flag is set as by an operator's
    hold (work items of a held entry drop on arrival, so nothing is sent until it is
    released) and ``reason`` is kept in ``last_error``. Pure.

    Returns:
        a new entry; the caller writes it by compare-and-set.
    """
    new = release(entry, domain) if holds(entry, domain, owner, instance) else copy_entry(entry)
    new.held = True
    new.last_error = reason
    return new


@dataclass
class Recorded:
    """What :func:`record` did, for logging, events and the NAK delay."""

    delivered: list[Recipient] = field(default_factory=list)
    deferred: list[Recipient] = field(default_factory=list)
    bounced: list[Recipient] = field(default_factory=list)
    expired: list[Recipient] = field(default_factory=list)
    retry_delay_s: float | None = None


def record(
    entry: Entry,
    domain: str,
    outcomes: Mapping[str, Reply],
    now: datetime,
    policy: RetryPolicy,
    rng: random.Random,
    *,
    reply_octets: int = replies.STORED_REPLY_OCTETS,
    dkim: str | None = None,
    next_hop_dsn: Collection[str] = frozenset(),
) -> tuple[Entry, Recorded]:
    """Apply one attempt's per-recipient replies to the open recipients of ``domain``.

    2yz → delivered; 5yz → bounced (failed when the reverse-path is null: no DSN is owed,
    RFC 5321 §4.5.5); 4yz → deferred to the policy's next instant, or bounced as expired
    when the lifetime ran out (the last remote reply kept for the DSN, RFC 3464 §2.3.6). A
    recipient without a reply in ``outcomes`` counts as a temporary protocol error.

    Each reply is kept with its text bounded to ``reply_octets`` octets
    (:meth:`Reply.bounded`), so that what an entry records of an attempt stays within what
    the entry store takes however many recipients answered at length; callers log and
    publish the replies of ``outcomes``, which are whole.

    Args:
        entry: the claimed entry.
        domain: the destination domain attempted.
        outcomes: the attempt's reply per recipient address.
        now: the attempt's end, aware.
        policy: when a 4yz is retried, or expires.
        rng: jitter source of ``policy``.
        reply_octets: the longest reply text kept per recipient, octets.
        dkim: the attempt's DKIM signing (kept as ``Entry.dkim`` when not None).
        next_hop_dsn: addresses the next hop accepted after advertising DSN, the
            NOTIFY/ORCPT parameters passed on: a delivered one is marked
            :attr:`~jsqueue.envelope.Recipient.next_hop_dsn`, so it gets no success DSN
            (RFC 3461 §5.2.1, §6.2.1).

    Returns:
        the new entry (lease on ``domain`` dropped) and a summary; ``retry_delay_s`` is the
        NAK delay for the work item, None when nothing of ``domain`` is left to retry.
    """
    new = copy_entry(entry)
    new.leases.pop(domain, None)
    if dkim is not None:
        new.dkim = dkim
    done = Recorded()
    final_fail = RecipientState.FAILED if entry.reverse_path == "" else RecipientState.BOUNCED
    for r in new.open_recipients(domain):
        reply = outcomes.get(r.address, replies.R451_PROTOCOL_ERROR)
        r.attempts += 1
        r.last_attempt_at = now
        r.last_reply = reply.bounded(reply_octets)
        if reply.is_success:
            r.state, r.next_attempt_at = RecipientState.DELIVERED, None
            r.next_hop_dsn = r.address in next_hop_dsn
            done.delivered.append(r)
        elif reply.is_permanent:
            r.state, r.next_attempt_at = final_fail, None
            done.bounced.append(r)
        else:
            decision = policy.after_failure(
                attempt=r.attempts, created_at=entry.created_at, now=now, rng=rng
            )
            if isinstance(decision, Expire):
                r.state, r.next_attempt_at = final_fail, None
                done.expired.append(r)
            else:
                r.state, r.next_attempt_at = RecipientState.DEFERRED, decision.at
                done.deferred.append(r)
    due = new.due_at(domain)
    if due is not None:
        done.retry_delay_s = delay_until_s(due, now)
    return new, done


def expire_all(
    entry: Entry, domain: str, now: datetime, policy: RetryPolicy, *, tries: bool = True
) -> Entry | None:
    """Bounce the open recipients of ``domain`` whose lifetime ran out before an attempt.

    A recipient that failed before and whose next attempt was scheduled within the lifetime
    (at the latest *at* the deadline, the policy's final try: :mod:`jsqueue.retry`) is owed
    that attempt, however late it comes (a due time is reached a moment after it, or after
    a worker outage): the domain is attempted, and the failure of that try expires it
    (:func:`record`), as RFC 5321 §4.5.4.1 gives up only after retries. Only recipients
    not owed an attempt expire here: never tried (a message older than its lifetime when
    first picked up), or put off past the deadline without an attempt (a flush after the
    deadline); with ``tries`` False (the destination site is down: no try can be made now,
    RFC 5321 §4.5.4.1) every open recipient past the deadline expires. Open recipients of
    the other domains that no attempt holds and no final try is owed expire with them, so
    that one DSN reports them all (RFC 3464 §2; :func:`settled` waits for the tries owed).

    Returns:
        the new entry, or None when the lifetime has not run out, or (with ``tries``) an
        open recipient of ``domain`` is owed its final try.
    """
    deadline = policy.deadline(entry.created_at)
    open_ = entry.open_recipients(domain)
    if now < deadline or not open_:
        return None
    if tries and any(_owed_a_try(r, deadline) for r in open_):
        return None
    new = copy_entry(entry)
    new.leases.pop(domain, None)
    final_fail = RecipientState.FAILED if entry.reverse_path == "" else RecipientState.BOUNCED
    for r in new.recipients:
        here = r.domain == domain
        if r.state.is_final or (not here and (r.domain in new.leases or _owed_a_try(r, deadline))):
            continue
        r.state, r.next_attempt_at = final_fail, None
        if r.last_reply is None:
            r.last_reply = replies.R451_EXPIRED
    return new


def _owed_a_try(r: Recipient, deadline: datetime) -> bool:
    """Whether ``r`` failed and is owed its next try, due by ``deadline`` (jsqueue.retry)."""
    return bool(r.attempts) and r.next_attempt_at is not None and r.next_attempt_at <= deadline


def settled(entry: Entry, now: datetime | None = None, policy: RetryPolicy | None = None) -> bool:
    """True when no recipient is pending or active, nor (with ``now`` and ``policy``, from
    :meth:`RetryPolicy.expiring_from` on: a failure then expires its recipient) deferred and
    owed its final try, due by the end of the lifetime: every destination has had its say.

    DSNs are sent only for a settled entry, so that one DSN lists every recipient the event
    concerns across all destination domains (RFC 3464 §2: one report per message and event),
    also those of several domains whose lifetime ran out together, one of them expired a
    moment before the deadline (less than ``min_delay_s`` was left for a retry)."""
    deadline = None
    if policy is not None and now is not None and now >= policy.expiring_from(entry.created_at):
        deadline = policy.deadline(entry.created_at)
    return not any(
        r.state in (RecipientState.PENDING, RecipientState.ACTIVE)
        or (
            deadline is not None and r.state is RecipientState.DEFERRED and _owed_a_try(r, deadline)
        )
        for r in entry.recipients
    )
