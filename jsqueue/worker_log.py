"""The attempt log line of one recipient (:func:`log_outcome`): the text the worker logs
for each recorded outcome and the same facts as JSON fields, on the ``jsqueue.worker``
logger. Kept apart from :mod:`jsqueue.worker` so the loop stays orchestration."""

from __future__ import annotations

import logging

from jsqueue.delivery.base import Attempt
from jsqueue.envelope import Entry, Recipient
from jsqueue.replies import Reply

__all__ = ["log_outcome"]

log = logging.getLogger("jsqueue.worker")


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
    log.info(
        "queue=%s to=<%s> domain=%s outcome=%s mx=%s reply=%r attempts=%d "
        "took=%.3fs delay=%.0fs next=%s tls=%r%s%s",
        entry.id,
        r.address,
        domain,
        outcome,
        mx or "-",
        str(reply) if reply else "",
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
            "reply": str(reply) if reply else None,
            "attempts": r.attempts,
            "took_s": round(took_s, 3),
            "delay_s": round(age_s, 3),
            "next_attempt_at": r.next_attempt_at,
            "uncertain": uncertain,
            "tls": reply.tls.model_dump() if reply and reply.tls else None,
        },
    )
