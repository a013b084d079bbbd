"""What becomes of a work item that asked the destination limits (composition): the
:class:`Admission` that :meth:`jsqueue.destinations.Destinations.admit` answers, the
:class:`Gate` a work item holds it in, and :func:`put_back` for an item not admitted (a full,
throttled or dead site; RFC 5321 §4.5.4.1). ``docs/architecture.md`` (Destinations).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from jsqueue import state
from jsqueue.envelope import utcnow
from jsqueue.errors import EntryTooLarge, RevisionConflict, StoreUnavailable
from jsqueue.replies import R451_SITE_DOWN, Reply
from jsqueue.retry import MIN_DELAY_S
from jsqueue.store import layout
from jsqueue.store.base import Due, Stores, Versioned

__all__ = ["Admission", "Gate", "put_back", "site_down_reply"]

log = logging.getLogger("jsqueue.destinations")


def site_down_reply(site: str, until: datetime) -> Reply:
    """The reply recorded for mail deferred without connecting because its site is down:
    ``451 4.4.1 site <site> down until <time>`` (RFC 5321 §4.5.4.1; RFC 3463 4.4.1 "no
    answer from host"). Pure."""
    stamp = until.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return R451_SITE_DOWN.model_copy(
        update={"text": f"{R451_SITE_DOWN.text}: site {site} down until {stamp}"}
    )


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer to :meth:`Destinations.admit`.

    Attributes:
        site: the site the domain counts against.
        go: deliver now (a session unit is reserved: call :meth:`Destinations.done`).
        delay_s: when not ``go``, seconds to put the item back for (jittered); it is not a
            delivery attempt.
        reason: ``full``, ``capped``, ``rate``, ``down`` or ``probing`` when not ``go``;
            empty otherwise.
        reply: for ``down``: the 451 4.4.1 reply to record for the deferred recipients.
        probe: ``go`` as the one probe of a dead site whose cool-off ran out.
        at: when ``go``: the event loop's time of the admission (for the hold time).
    """

    site: str
    go: bool
    delay_s: float = 0.0
    reason: str = ""
    reply: Reply | None = None
    probe: bool = False
    at: float = 0.0


@dataclass
class Gate:
    """The admission one work item holds between :meth:`Destinations.admit` and
    :meth:`Destinations.done` (None before, and after it was handed back)."""

    admission: Admission | None = None


async def put_back(
    stores: Stores,
    due: Due,
    v: Versioned,
    admission: Admission,
    source: str,
    deadline: datetime | None = None,
) -> None:
    """Put a work item that was not admitted back, without a delivery attempt: NAK with
    the admission's delay. For a dead site (RFC 5321 §4.5.4.1) the open recipients of the
    item's domain first get the ``451 4.4.1 … site down until …`` reply and the end of the
    cool-off as their next attempt, by compare-and-set (a lost one is not retried: the
    item is put back all the same, and the entry shows the reply at the next deferral).
    A cool-off that ends after the message's ``deadline`` (the end of its lifetime) puts
    it back until the deadline only: the worker then makes the final try, or expires it
    while the site is still down, at the deadline and not a cool-off later.

    Raises:
        StoreUnavailable: the NAK failed (the item comes back after the ack wait).
    """
    item = due.item
    delay_s = admission.delay_s
    if admission.reply is not None:
        now = utcnow()
        until = now + timedelta(seconds=delay_s)
        if deadline is not None and deadline < until:
            until = max(deadline, now + timedelta(seconds=MIN_DELAY_S))
            delay_s = (until - now).total_seconds()
        new = state.site_deferred(v.entry, item.domain, admission.reply, until)
        if new is not None:
            with contextlib.suppress(RevisionConflict, EntryTooLarge, StoreUnavailable):
                await layout.update_entry(stores, new, v.revision)
        log.info(
            "queue=%s domain=%s outcome=deferred reply=%r next=%s (%s)",
            item.queue_id,
            item.domain,
            str(admission.reply),
            until.isoformat(),
            source,
            extra={
                "queue_id": item.queue_id,
                "domain": item.domain,
                "outcome": "deferred",
                "reply": str(admission.reply),
                "next_attempt_at": until,
                "site": admission.site,
            },
        )
    else:
        log.debug(
            "queue %s %s: site %s %s; back in %.1f s",
            item.queue_id,
            item.domain,
            admission.site,
            admission.reason,
            admission.delay_s,
        )
    await due.retry(delay_s)
