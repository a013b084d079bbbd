"""Delivery state transitions of a queue entry. Pure: takes ``now``, returns new entries.

The worker reads an entry, asks :func:`check` whether a work item may be delivered, claims
the destination with :func:`claim`, delivers, and records the replies with :func:`record`;
every result is written back by compare-and-set (DESIGN.md §2.3). Applying the same
transition to a newer revision after a conflict is safe: each function only looks at the
entry it is given.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
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


def check(
    entry: Entry | None,
    item: WorkItem,
    now: datetime,
    *,
    tolerance_s: float = 1.0,
    deleted: bool = False,
) -> Check:
    """Decide whether ``item`` may be delivered now, re-checking it against KV (the truth).

    Args:
        entry: the entry as read from the entry store; None when it is gone.
        item: the work item that arrived.
        now: current time, aware.
        tolerance_s: seconds of earliness still treated as due.
        deleted: with ``entry`` None, the store knows it was deleted (not "not yet").

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
    if lease is not None and lease.until > now:
        return Check(Verdict.LATER, f"leased by {lease.owner}", delay_until_s(lease.until, now))
    if not is_due(due, now, tolerance_s=tolerance_s):
        return Check(Verdict.LATER, "not yet due", delay_until_s(due, now))
    return Check(Verdict.DELIVER, "due")


def _copy(entry: Entry) -> Entry:
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


def claim(entry: Entry, domain: str, owner: str, now: datetime, lease_s: float) -> Entry:
    """Take a lease on ``domain`` and mark its open recipients active (DESIGN.md §2.3).

    Returns:
        a new entry; the caller writes it by compare-and-set before talking SMTP.
    """
    new = _copy(entry)
    new.leases[domain] = Lease(owner=owner, until=now + timedelta(seconds=lease_s))
    for r in new.open_recipients(domain):
        r.state = RecipientState.ACTIVE
    return new


def renewed(entry: Entry, domain: str, owner: str, now: datetime, lease_s: float) -> Entry | None:
    """``entry`` with ``owner``'s lease on ``domain`` extended to ``now + lease_s`` (seconds),
    once at most half of ``lease_s`` is left (DESIGN.md §2.3: a live worker's lease never runs out,
    so nothing that takes over expired leases, a flush or another worker's claim, can start
    a second transaction beside a slow one). Pure.

    Returns:
        the new entry (the caller writes it by compare-and-set); None when the lease is not
        ``owner``'s (released, taken over) or more than half of ``lease_s`` is left.
    """
    lease = entry.leases.get(domain)
    if lease is None or lease.owner != owner:
        return None
    if (lease.until - now).total_seconds() > lease_s / 2:
        return None
    new = _copy(entry)
    new.leases[domain] = Lease(owner=owner, until=now + timedelta(seconds=lease_s))
    return new


def release(entry: Entry, domain: str) -> Entry:
    """Give the lease on ``domain`` back without an outcome (drain): recipients become due.

    Returns:
        a new entry with the lease removed and active recipients deferred to now.
    """
    new = _copy(entry)
    new.leases.pop(domain, None)
    for r in new.open_recipients(domain):
        if r.state is RecipientState.ACTIVE:
            r.state = RecipientState.DEFERRED if r.attempts else RecipientState.PENDING
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
) -> tuple[Entry, Recorded]:
    """Apply one attempt's per-recipient replies to the open recipients of ``domain``.

    2yz → delivered; 5yz → bounced (failed when the reverse-path is null: no DSN is owed,
    RFC 5321 §4.5.5); 4yz → deferred to the policy's next instant, or bounced as expired
    when the lifetime ran out (the last remote reply kept for the DSN, RFC 3464 §2.3.6). A
    recipient without a reply in ``outcomes`` counts as a temporary protocol error.

    Returns:
        the new entry (lease on ``domain`` dropped) and a summary; ``retry_delay_s`` is the
        NAK delay for the work item, None when nothing of ``domain`` is left to retry.
    """
    new = _copy(entry)
    new.leases.pop(domain, None)
    done = Recorded()
    final_fail = RecipientState.FAILED if entry.reverse_path == "" else RecipientState.BOUNCED
    for r in new.open_recipients(domain):
        reply = outcomes.get(r.address, replies.R451_PROTOCOL_ERROR)
        r.attempts += 1
        r.last_attempt_at = now
        r.last_reply = reply
        if reply.is_success:
            r.state, r.next_attempt_at = RecipientState.DELIVERED, None
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


def expire_all(entry: Entry, domain: str, now: datetime, policy: RetryPolicy) -> Entry | None:
    """Bounce the open recipients of ``domain`` whose lifetime ran out before an attempt.

    Returns:
        the new entry, or None when the lifetime has not run out (RFC 5321 §4.5.4.1).
    """
    if now < policy.deadline(entry.created_at) or not entry.open_recipients(domain):
        return None
    new = _copy(entry)
    new.leases.pop(domain, None)
    final_fail = RecipientState.FAILED if entry.reverse_path == "" else RecipientState.BOUNCED
    for r in new.open_recipients(domain):
        r.state, r.next_attempt_at = final_fail, None
        if r.last_reply is None:
            r.last_reply = replies.R451_EXPIRED
    return new


def settled(entry: Entry) -> bool:
    """True when no recipient is pending or active: every destination has had its say.

    DSNs are sent only for a settled entry, so that one DSN lists every recipient the event
    concerns across all destination domains (RFC 3464 §2: one report per message and event).
    """
    return not any(
        r.state in (RecipientState.PENDING, RecipientState.ACTIVE) for r in entry.recipients
    )
