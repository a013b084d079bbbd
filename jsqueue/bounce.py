"""Enqueueing DSNs: the seam between recorded outcomes and RFC 3464 reports.

:class:`DsnNotifier` looks at a settled entry, asks :mod:`jsqueue.dsn` which recipients a
failure, delay or success DSN must list (RFC 3461 NOTIFY, null reverse-path rules), renders
one DSN per event, and enqueues it as a new queue entry from the null reverse-path ``<>``
to the original reverse-path (RFC 5321 §4.5.5), delivered like any other mail.

Idempotent: a DSN's queue id is derived from the original id, the event and the reported
recipients' attempt counts (:func:`~jsqueue.names.derived_queue_id`), and entries are
created if absent, so a worker that crashes between enqueueing and marking the original
enqueues nothing twice. DSN entries are kept (body removed) once final for the same reason.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime

from jsqueue import dsn
from jsqueue.config import DsnSettings
from jsqueue.envelope import Entry, Recipient, RecipientState, WorkItem
from jsqueue.errors import EntryExists
from jsqueue.names import derived_queue_id
from jsqueue.retry import RetryPolicy
from jsqueue.store.base import Stores
from jsqueue.store.layout import one_chunk, open_entry_body

log = logging.getLogger("jsqueue.bounce")

_EVENTS = (dsn.DsnEvent.FAILURE, dsn.DsnEvent.DELAY, dsn.DsnEvent.SUCCESS)


class DsnNotifier:
    """Enqueues the DSNs an entry owes (the worker's ``Notifier``).

    Args:
        stores: where DSN bodies and entries go.
        settings: reporting MTA name, returned-content limit, delay warnings, postmaster.
        policy: the ordinary retry policy (its lifetime gives Will-Retry-Until).
    """

    def __init__(self, stores: Stores, settings: DsnSettings, policy: RetryPolicy) -> None:
        self.stores = stores
        self.settings = settings
        self.policy = policy
        self.dropped = 0

    async def notify(self, entry: Entry, now: datetime) -> Entry | None:
        """Enqueue every DSN ``entry`` owes and return it marked, or None if none was owed.

        Failure and success DSNs mark their recipients ``dsn_sent``; delay warnings set
        ``delay_notified_at``. Recipients of a DSN that failed for good are logged and
        counted as dropped (a DSN never gets a DSN), with an optional copy to the
        configured postmaster.

        Raises:
            StoreUnavailable: the DSN could not be stored; nothing is marked.
        """
        marked = entry.model_copy(deep=True)
        changed = False
        for event, rcpts in self._reports(entry, now):
            await self._enqueue(entry, entry.reverse_path, rcpts, event, now)
            addresses = {r.address for r in rcpts}
            for r in marked.recipients:
                if r.address in addresses:
                    if event is dsn.DsnEvent.DELAY:
                        r.delay_notified_at = now
                    else:
                        r.dsn_sent = True
            changed = True
        changed |= await self._double_bounce(entry, marked, now)
        return marked if changed else None

    def owes(self, entry: Entry, now: datetime) -> bool:
        """Whether :meth:`notify` would enqueue or mark anything for ``entry`` (no I/O).

        False lets the worker remove a final entry without recording its outcome first.
        """
        return bool(self._reports(entry, now) or _double_bounced(entry))

    def _reports(self, entry: Entry, now: datetime) -> list[tuple[dsn.DsnEvent, list[Recipient]]]:
        """The DSNs owed: (event, recipients to list) for every event with recipients."""
        found = []
        for event in _EVENTS:
            rcpts = dsn.recipients_to_report(
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
            await self._enqueue(entry, postmaster, failed, dsn.DsnEvent.FAILURE, now)
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
        event: dsn.DsnEvent,
        now: datetime,
    ) -> None:
        key = "|".join([event.value, to, *(f"{r.address}#{r.attempts}" for r in rcpts)])
        dsn_id = derived_queue_id(entry.id, key)
        report_on = entry if entry.reverse_path else entry.model_copy(update={"reverse_path": to})
        original = await self._original(report_on)
        message = dsn.build_dsn(
            report_on,
            rcpts,
            dsn.action_for(event),
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
            dsn.action_for(event).value,
            to,
            ",".join(r.address for r in rcpts),
        )

    async def _original(self, entry: Entry) -> bytes:
        """The returned content: the whole message (RET=FULL within the limit) or headers."""
        full = dsn.returns_full(entry, self.settings.max_returned_size)
        data = bytearray()
        async with contextlib.aclosing(open_entry_body(self.stores.bodies, entry)) as chunks:
            async for chunk in chunks:
                data += chunk
                if not full and dsn.header_block(bytes(data)) is not None:
                    break
        if full:
            return bytes(data)
        return dsn.header_block(bytes(data), complete=True) or b""


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
