"""The worker's record of an attempt for people and other systems: one log line per
recipient (text or JSON fields) and the attempt's events (:mod:`jsqueue.events`)."""

from __future__ import annotations

import logging
from datetime import datetime

from jsqueue import state
from jsqueue.delivery.base import Attempt
from jsqueue.envelope import Entry, Recipient
from jsqueue.events import EventKind, Observer, attempt_events, entry_event, recipient_event
from jsqueue.replies import Reply

__all__ = ["log_attempt", "log_expired", "log_interrupted", "log_outcome"]

log = logging.getLogger("jsqueue.worker")


def log_attempt(
    observer: Observer,
    source: str,
    entry: Entry,
    domain: str,
    recorded: state.Recorded,
    started: datetime,
    now: datetime,
    delivery: Attempt,
    *,
    events: bool = True,
) -> None:
    """One line per recipient, and (with ``events``) one event: the attempt's whole
    reply (the entry keeps it bounded). ``mx=`` is the host whose reply was recorded,
    else the host the attempt tried, else ``-`` (no host reached, e.g. a DNS failure);
    the JSON field ``mx`` is null in that last case. A recipient whose final ``.`` went
    out without a reply (``delivery.uncertain``) is logged ``uncertain=yes`` and its
    event carries ``uncertain: true`` (RFC 5321 §6.1: it may be delivered twice)."""
    tried = delivery.host
    took = (now - started).total_seconds()
    age = (now - entry.created_at).total_seconds()
    groups = (
        (EventKind.DELIVERED, recorded.delivered),
        (EventKind.DEFERRED, recorded.deferred),
        (EventKind.BOUNCED, recorded.bounced),
        (EventKind.EXPIRED, recorded.expired),
    )
    for kind, rcpts in groups:
        outcome = kind.value
        for r in rcpts:
            reply = delivery.replies.get(r.address) or r.last_reply
            mx = (reply.remote_host if reply else None) or tried
            uncertain = r.address in delivery.uncertain
            log_outcome(entry, r, domain, outcome, mx, reply, took, age, uncertain, delivery)
    if not events:
        return
    for event in attempt_events(
        entry,
        groups,
        source=source,
        at=now,
        duration_s=took,
        replies=delivery.replies,
        uncertain=delivery.uncertain,
        dkim=delivery.dkim,
    ):
        observer.emit(event)


def log_cut_further(
    observer: Observer, source: str, at: datetime, entry: Entry, domain: str, detail: str
) -> None:
    """Say that an attempt on ``domain`` was recorded with its replies cut further (the
    entry store refused them for their size): a warning and a ``too_large`` event."""
    log.warning("queue %s: entry too large; %s", entry.id, detail)
    observer.emit(entry_event(EventKind.TOO_LARGE, entry, source=source, at=at, detail=detail))


def log_interrupted(
    observer: Observer,
    source: str,
    at: datetime,
    entry: Entry,
    domain: str,
    why: str,
    uncertain: bool,
) -> None:
    """Say that an attempt on ``entry``'s ``domain`` ended without its outcome recorded
    (``why``: a stop at the drain bound, a crashed process's lease taken over) and is sent
    again. With ``uncertain`` its final dot went out (RFC 5321 §4.5.3.2.6); else it may
    have: where a crashed process stopped is not stored (that would cost a synced write per
    message). Either way the next hop may already have the message, and the send that
    follows may be a duplicate (RFC 5321 §6.1): a warning and an ``interrupted`` event
    (``uncertain: true``, ``domain``) say so."""
    how = "its final dot was sent" if uncertain else "it may have reached DATA"
    detail = f"{domain}: attempt interrupted ({why}); {how}: a possible duplicate"
    log.warning("queue %s: %s", entry.id, detail)
    event = entry_event(EventKind.INTERRUPTED, entry, source=source, at=at, detail=detail)
    observer.emit(event.model_copy(update={"domain": domain, "uncertain": True}))


def log_expired(observer: Observer, source: str, at: datetime, before: Entry, entry: Entry) -> None:
    """One line and one ``expired`` event per recipient, of any domain, that was open in
    ``before`` and is final in ``entry`` (its queue lifetime ran out, RFC 5321 §4.5.4.1)."""
    was_open = {r.address for r in before.recipients if not r.state.is_final}
    for r in entry.recipients:
        if r.address in was_open and r.state.is_final:
            log.info(
                "queue=%s to=<%s> outcome=expired",
                entry.id,
                r.address,
                extra={"queue_id": entry.id, "recipient": r.address, "outcome": "expired"},
            )
            observer.emit(recipient_event(EventKind.EXPIRED, entry, r, source=source, at=at))


def log_outcome(
    entry: Entry,
    r: Recipient,
    domain: str,
    outcome: str,
    mx: str | None,
    reply: Reply | None,
    took_s: float,
    age_s: float,
    uncertain: bool,
    delivery: Attempt,
) -> None:
    """One line: queue id, recipient, domain, outcome, the MX (``-`` when none was
    reached), the reply, attempts, how long the attempt took and the message's age
    (seconds), the next attempt, the TLS policy note (which policy applied and why, ``-``
    when no session ran), ``uncertain=yes`` after a final ``.`` without a reply (RFC 5321
    §6.1) and the DKIM signature; the same as JSON fields (``extra``)."""
    text = str(reply) if reply else None
    log.info(
        "queue=%s to=<%s> domain=%s outcome=%s mx=%s reply=%r attempts=%d "
        "took=%.3fs delay=%.0fs next=%s tls=%r%s%s",
        entry.id,
        r.address,
        domain,
        outcome,
        mx or "-",
        text or "",
        r.attempts,
        took_s,
        age_s,
        r.next_attempt_at.isoformat() if r.next_attempt_at else "-",
        str(reply.tls) if reply and reply.tls else "-",
        # RFC 5321 §6.1: the final "." went out, no reply came back
        " uncertain=yes (may be delivered twice)" if uncertain else "",
        f" dkim={delivery.dkim!r}" if delivery.dkim else "",
        extra={
            "queue_id": entry.id,
            "recipient": r.address,
            "domain": domain,
            "outcome": outcome,
            "mx": mx,
            "reply": text,
            "attempts": r.attempts,
            "took_s": round(took_s, 3),
            "delay_s": round(age_s, 3),
            "next_attempt_at": r.next_attempt_at,
            "uncertain": uncertain,
            # the note itself: JsonFormatter dumps it, only when JSON lines are written
            "tls": reply.tls if reply else None,
        },
    )
