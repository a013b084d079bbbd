"""Pure state transitions of a queue entry that an operator asks for (:mod:`jsqueue.admin`):
:func:`flushed` and :func:`requeued` (deliver now, as ``postqueue -f`` / ``-i``),
:func:`held` and :func:`released_from_hold` (the hold flag, not a lease) and :func:`bounced`,
each returning ``(entry or None, detail)``: the new entry for the caller to write by
compare-and-set (DESIGN.md §2.3), or None when there is nothing to change, and a detail for
the operator. None does I/O; applying one again to a newer revision after a lost
compare-and-set is safe: each looks only at the entry it is given. The worker's transitions
are :mod:`jsqueue.state`'s.
"""

from __future__ import annotations

from datetime import datetime

from jsqueue.envelope import Entry, RecipientState
from jsqueue.replies import Reply
from jsqueue.state import copy_entry, release

__all__ = ["BREAK_WARNING", "bounced", "flushed", "held", "released_from_hold", "requeued"]


def _at(value: datetime) -> str:
    """``value`` as ``YYYY-MM-DD HH:MM:SS`` (UTC, as stored), for the details operators read."""
    return value.strftime("%Y-%m-%d %H:%M:%S")


#: What a broken live lease risks, for the operators' details and warnings.
BREAK_WARNING = (
    "a transaction under way cannot be recalled: the message may be sent twice (RFC 5321 §6.1)"
)


def _breaks(
    entry: Entry, now: datetime, dead: frozenset[str], break_live: bool
) -> tuple[set[str], list[str]]:
    """Running leases of ``entry`` that an operator's action takes: those of ``dead``
    owners (not present) and, with ``break_live``, every one; with a note each."""
    taken: set[str] = set()
    notes: list[str] = []
    for d, lease in sorted(entry.leases.items()):
        if lease.until <= now:
            continue
        if lease.owner in dead:
            taken.add(d)
            notes.append(f"{d}: lease of {lease.owner} broken (that worker is not present)")
        elif break_live:
            taken.add(d)
            notes.append(f"{d}: live lease of {lease.owner} broken: {BREAK_WARNING}")
    return taken, notes


def flushed(
    entry: Entry,
    now: datetime,
    domain: str | None = None,
    *,
    dead: frozenset[str] = frozenset(),
    break_live: bool = False,
) -> tuple[Entry | None, str]:
    """Make the open recipients (of ``domain``, or all) due ``now`` under a new generation.

    What ``postqueue -f`` / ``-i`` / ``-s`` does (DESIGN.md §4): the caller writes the new
    entry by compare-and-set and publishes one work item per open domain with the new
    generation, so older items arrive stale and drop. Leases (DESIGN.md §2.3), per
    destination domain:

    * a lease still running (``until`` after ``now``) is never broken: its worker may be in
      the middle of the SMTP transaction, and a second attempt could send the message twice
      (RFC 5321 §6.1). Its recipients are left as they are and the detail says
      ``<domain>: leased by <owner> until <time> UTC, tried then ...``: if that worker died,
      the destination is tried when the lease runs out; if it lives, its outcome sets the
      next attempt.
    * a running lease of an owner in ``dead`` (not present: no heartbeat within the
      grace, so nobody is mid-transaction) is broken, and with ``break_live`` every running
      lease is, the detail warning that the message may be sent twice.
    * a lease that has run out (its worker died or gave up) is dropped and its active
      recipients become pending (deferred after an attempt) and due ``now``, as a worker's
      own claim would override it. A worker that claims the destination meanwhile wins the
      compare-and-set and the flush is applied to its version.

    Args:
        entry: the entry as read.
        now: the current time, aware UTC.
        domain: only recipients of this routing domain (A-label); all when None.
        dead: lease owners known not to be present.
        break_live: break running leases of live owners too (``--break-lease``).

    Returns:
        ``(new entry, detail)``: the detail counts the recipients made due and names every
        lease kept or dropped. ``(None, reason)`` when the entry is held, nothing matching
        is open, or every matching destination is under a running lease. Idempotent up to
        the generation, which every applied flush bumps.
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
    taken, broken = _breaks(entry, now, dead, break_live)
    live = {
        d: lease
        for d, lease in entry.leases.items()
        if d in wanted and lease.until > now and d not in taken
    }
    notes = [*(n for n in broken if n.split(":")[0] in wanted)]
    notes += [
        f"{d}: leased by {lease.owner} until {_at(lease.until)} UTC, tried then if that worker "
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
            new = release(new, d)
            if d not in taken:
                notes.insert(0, f"{d}: lease of {ran_out.owner} expired {_at(ran_out.until)} UTC")
    count = 0
    for r in new.recipients:
        if not r.state.is_final and r.domain in free:
            r.next_attempt_at = now
            count += 1
    return new, "; ".join([f"{count} recipient(s) due now", *notes])


def requeued(
    entry: Entry, now: datetime, *, dead: frozenset[str] = frozenset()
) -> tuple[Entry | None, str]:
    """Requeue (``postsuper -r``): drop every lease, make every open recipient pending
    again (deferred when tried before; attempts kept) and due ``now`` under a new
    generation; the caller publishes new work items. A running lease of a live owner (not
    in ``dead``) is broken too, and the detail warns that the message may be sent twice
    (RFC 5321 §6.1). Held entries stay held (release them). Pure.

    Args:
        entry: the entry as read.
        now: the current time, aware UTC.
        dead: lease owners known not to be present.

    Returns:
        ``(new entry, detail)``; ``(None, reason)`` when held or nothing is open.
        Idempotent up to the generation, which every applied requeue bumps.
    """
    if entry.held:
        return None, "held: release it instead"
    open_domains = {r.domain for r in entry.recipients if not r.state.is_final}
    if not open_domains:
        return None, "nothing to deliver"
    _, notes = _breaks(entry, now, dead, True)
    new = copy_entry(entry)
    new.generation += 1
    for d in list(new.leases):
        new = release(new, d)
    count = 0
    for r in new.recipients:
        if not r.state.is_final:
            r.state = RecipientState.DEFERRED if r.attempts else RecipientState.PENDING
            r.next_attempt_at = now
            count += 1
    return new, "; ".join([f"{count} recipient(s) requeued, due now", *notes])


def held(entry: Entry) -> tuple[Entry | None, str]:
    """Set the hold flag (``postsuper -h``): work items of a held entry drop on arrival
    (:func:`check`); an attempt already under way finishes and is recorded.

    Args:
        entry: the entry as read.

    Returns:
        ``(new entry, "held")``; ``(None, reason)`` when the entry is already held or final.
        Idempotent.
    """
    if entry.is_final:
        return None, "already final"
    if entry.held:
        return None, "already held"
    new = entry.model_copy(deep=True)
    new.held = True
    return new, "held"


def released_from_hold(entry: Entry, now: datetime) -> tuple[Entry | None, str]:
    """Clear the hold flag (``postsuper -H``) and make the open recipients due ``now`` under
    a new generation, like :func:`flushed`. Not :func:`release`, which gives a lease back.

    Args:
        entry: the entry as read.
        now: the current time, aware UTC.

    Returns:
        ``(new entry, "released")``; ``(None, "not held")`` when the hold flag is not set.
        Idempotent.
    """
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
    """Bounce every open recipient with ``reply`` under a new generation (an operator's
    bounce); a worker then sends the DSN (RFC 3464) and removes the entry.

    The state is ``bounced``, or ``failed`` when the reverse-path is null: no DSN is owed
    (RFC 5321 §4.5.5). ``reply`` should be a 5yz, so the DSN reports a failure rather than
    an expiry (RFC 3463 §3.5 ``4.4.7``, see :mod:`jsqueue.dsn.report`). Recipients of a
    domain whose lease is still running (a worker is delivering) are left alone; the lease
    of every bounced domain is dropped.

    Args:
        entry: the entry as read.
        now: the current time, aware UTC.
        reply: the last reply recorded for each bounced recipient.

    Returns:
        ``(new entry, detail)`` naming the count and the domains left alone; ``(None,
        reason)`` when nothing is open or every open recipient's domain is being delivered.
        Idempotent: a second bounce finds nothing open.
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
