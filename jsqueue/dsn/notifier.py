"""Enqueueing DSNs: :class:`DsnNotifier` turns a settled entry's recorded outcomes into
the DSNs it owes (built by :mod:`jsqueue.dsn.report`, RFC 3464) and queues each as a new
entry from the null reverse-path ``<>`` to the original reverse-path (RFC 5321 §4.5.5),
delivered like any other mail; idempotent through derived queue ids and create-if-absent
(docs/architecture.md, Operations and DSNs).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime

from jsqueue.config import DsnSettings
from jsqueue.dsn import report
from jsqueue.envelope import Entry, Recipient, RecipientState, WorkItem
from jsqueue.errors import EntryExists
from jsqueue.names import derived_queue_id
from jsqueue.retry import RetryPolicy
from jsqueue.store.base import Stores
from jsqueue.store.layout import one_chunk, open_entry_body

log = logging.getLogger("jsqueue.bounce")

_EVENTS = (report.DsnEvent.FAILURE, report.DsnEvent.DELAY, report.DsnEvent.SUCCESS)


class DsnNotifier:
    """Enqueues the DSNs an entry owes (the worker's ``Notifier``).

    One DSN per event (failure, delay, success) lists every recipient that event concerns
    (see :func:`jsqueue.state.settled`). Its queue id is derived from the original id, the
    event, the addressee and the reported recipients' attempt counts
    (:func:`~jsqueue.names.derived_queue_id`) and its entry is created if absent, so a
    worker that crashes between enqueueing and marking the original enqueues nothing twice;
    finished DSN entries are kept (body removed) for the same reason.

    Args:
        stores: where DSN bodies and entries go.
        settings: reporting MTA name, returned-content limit (octets), delay warnings
            (seconds), postmaster.
        policy: the ordinary retry policy (its lifetime gives Will-Retry-Until,
            RFC 3464 §2.3.9).

    Attributes:
        dropped: recipients of mail from ``<>`` that failed for good and got no DSN
            (RFC 5321 §4.5.5), counted since start.
    """

    def __init__(self, stores: Stores, settings: DsnSettings, policy: RetryPolicy) -> None:
        self.stores = stores
        self.settings = settings
        self.policy = policy
        self.dropped = 0

    async def notify(self, entry: Entry, now: datetime) -> Entry | None:
        """Enqueue every DSN ``entry`` owes and return it marked, or None if none was owed.

        Failure and success DSNs mark their recipients ``dsn_sent``; delay warnings set
        ``delay_notified_at`` (RFC 3461 §4.1 NOTIFY). Recipients of mail from ``<>`` (or of
        a DSN) that failed for good are logged and counted as dropped (a DSN never gets a
        DSN, RFC 5321 §4.5.5), with an optional copy to the configured postmaster. The
        caller writes the marked entry by compare-and-set; idempotent until it has (see
        the class docstring).

        Args:
            entry: the settled entry, outcomes recorded.
            now: the current time, aware UTC (the DSNs' Date, the delay warning clock).

        Returns:
            a marked copy of ``entry``, or None when it owed nothing.

        Raises:
            StoreUnavailable: a DSN could not be stored; nothing is marked.
            BodyNotFound: the original's body is gone, so the returned content cannot be
                read (RFC 3461 §4.3); nothing is marked.
            BodyCorrupt: the original's body does not match its digest; nothing is marked.
            InvalidName: the DSN's addressee has no usable routing domain.
            ValueError: ``dsn.reporting_mta`` is not an ASCII host name.
        """
        marked = entry.model_copy(deep=True)
        changed = False
        for event, rcpts in self._reports(entry, now):
            await self._enqueue(entry, entry.reverse_path, rcpts, event, now)
            addresses = {r.address for r in rcpts}
            for r in marked.recipients:
                if r.address in addresses:
                    if event is report.DsnEvent.DELAY:
                        r.delay_notified_at = now
                    else:
                        r.dsn_sent = True
            changed = True
        changed |= await self._double_bounce(entry, marked, now)
        return marked if changed else None

    def owes(self, entry: Entry, now: datetime) -> bool:
        """Whether :meth:`notify` would enqueue or mark anything for ``entry`` (no I/O).

        False lets the worker remove a final entry without recording its outcome first.

        Args:
            entry: the entry, outcomes recorded.
            now: the current time, aware UTC (for delay warnings).
        """
        return bool(self._reports(entry, now) or _double_bounced(entry))

    def _reports(
        self, entry: Entry, now: datetime
    ) -> list[tuple[report.DsnEvent, list[Recipient]]]:
        """The DSNs owed: (event, recipients to list) for every event with recipients."""
        found = []
        for event in _EVENTS:
            rcpts = report.recipients_to_report(
                entry,
                event,
                now=now,
                delay_warning_after_s=self.settings.delay_warning_after_s,
                delay_warning_interval_s=self.settings.delay_warning_interval_s,
            )
            if rcpts:
                found.append((event, rcpts))
        return found

    async def _double_bounce(self, entry: Entry, marked: Entry, now: datetime) -> bool:
        """A DSN (or other mail from ``<>``) failed for good: drop it, log, maybe copy."""
        failed = _double_bounced(entry)
        if not failed:
            return False
        for r in failed:
            log.warning(
                "queue=%s to=<%s> outcome=dropped reason=%r (mail from <> gets no DSN)",
                entry.id,
                r.address,
                str(r.last_reply) if r.last_reply else "",
            )
        self.dropped += len(failed)
        postmaster = self.settings.postmaster
        if postmaster and all(r.address != postmaster for r in entry.recipients):
            await self._enqueue(entry, postmaster, failed, report.DsnEvent.FAILURE, now)
        addresses = {r.address for r in failed}
        for r in marked.recipients:
            if r.address in addresses:
                r.dsn_sent = True
        return True

    async def _enqueue(
        self,
        entry: Entry,
        to: str,
        rcpts: list[Recipient],
        event: report.DsnEvent,
        now: datetime,
    ) -> None:
        key = "|".join([event.value, to, *(f"{r.address}#{r.attempts}" for r in rcpts)])
        dsn_id = derived_queue_id(entry.id, key)
        report_on = entry if entry.reverse_path else entry.model_copy(update={"reverse_path": to})
        original = await self._original(report_on)
        message = report.build_dsn(
            report_on,
            rcpts,
            report.action_for(event),
            reporting_mta=self.settings.reporting_mta,
            now=now,
            original=original,
            max_returned_size=self.settings.max_returned_size,
            will_retry_until=self.policy.deadline(entry.created_at),
            message_id=f"<{dsn_id}@{self.settings.reporting_mta}>",
        )
        info = await self.stores.bodies.put(dsn_id, one_chunk(message))
        recipient = Recipient.from_address(to)
        dsn_entry = Entry(
            id=dsn_id,
            reverse_path="",
            recipients=[recipient],
            created_at=now,
            size=info.size,
            digest=info.digest,
            smtputf8=not to.isascii(),
            body_8bit=not message.isascii(),
            is_dsn=True,
        )
        try:
            await self.stores.entries.create(dsn_entry)
        except EntryExists:
            log.info("queue=%s dsn=%s already enqueued", entry.id, dsn_id)
        await self.stores.scheduler.schedule(WorkItem(dsn_id, recipient.domain, 0))
        log.info(
            "queue=%s dsn=%s action=%s to=<%s> recipients=%s",
            entry.id,
            dsn_id,
            report.action_for(event).value,
            to,
            ",".join(r.address for r in rcpts),
        )

    async def _original(self, entry: Entry) -> bytes:
        """The returned content: the whole message (RET=FULL within the limit) or headers."""
        full = report.returns_full(entry, self.settings.max_returned_size)
        data = bytearray()
        async with contextlib.aclosing(open_entry_body(self.stores.bodies, entry)) as chunks:
            async for chunk in chunks:
                data += chunk
                if not full and report.header_block(bytes(data)) is not None:
                    break
        if full:
            return bytes(data)
        return report.header_block(bytes(data), complete=True) or b""


def _double_bounced(entry: Entry) -> list[Recipient]:
    """Recipients of mail from ``<>`` (or of a DSN) that failed for good and were not yet
    dropped: they get no DSN (RFC 5321 §4.5.5), only a log line and a postmaster copy."""
    if not (entry.reverse_path == "" or entry.is_dsn):
        return []
    return [
        r
        for r in entry.recipients
        if r.state in (RecipientState.FAILED, RecipientState.BOUNCED) and not r.dsn_sent
    ]
