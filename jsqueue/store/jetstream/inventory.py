"""Inventory: :class:`JetStreamInventory`, cheap listings of what the queue's streams hold
(entry keys, work subjects, body metas and chunk sets) by stream-info requests and direct
gets, never a consumer; the reconciler (:mod:`jsqueue.reconciler`) decides from them.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import nats.js.errors
from nats.aio.client import Client as NATS

from jsqueue.errors import InvalidName, StoreUnavailable
from jsqueue.names import (
    Names,
    check_queue_id,
    object_chunk_prefix,
    object_chunk_subjects,
    object_meta_subjects,
    object_name_of_meta_subject,
)
from jsqueue.store.jetstream.api import NATS_FAILURES, stream_subjects
from jsqueue.store.jetstream.bodies import JetStreamBodyStore
from jsqueue.store.jetstream.entries import JetStreamEntryStore

#: Body metas fetched concurrently when looking for unreferenced chunk sets.
READ_BATCH = 64


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


class JetStreamInventory:
    """:class:`~jsqueue.store.base.Inventory` on the streams of the JetStream stores: key
    and subject listings by stream-info request, first-message times by direct get.

    Args:
        nc: a connected client.
        names: object names.
        bodies: the body store (for its stream and subject layout).
        entries: the entry store (for its key listing).
        timeout_s: per-request timeout, seconds.
    """

    def __init__(
        self,
        nc: NATS,
        names: Names,
        bodies: JetStreamBodyStore,
        entries: JetStreamEntryStore,
        *,
        timeout_s: float = 5.0,
    ) -> None:
        self._nc = nc
        self.names = names
        self.bodies = bodies
        self.entries = entries
        self._timeout_s = timeout_s

    async def entry_ids(self) -> set[str]:
        """See :meth:`Inventory.entry_ids`."""
        return set(await self.entries.keys())

    async def work_subjects(self, queue_id: str | None = None) -> set[str]:
        """See :meth:`Inventory.work_subjects`."""
        names = self.names
        flt = names.work_subjects_of(queue_id) if queue_id else names.work_subjects
        found = await stream_subjects(self._nc, names.work_stream, flt, self._timeout_s)
        return set(found)

    async def body_ids(self) -> set[str]:
        """See :meth:`Inventory.body_ids`."""
        bucket = self.bodies.bucket
        found = await stream_subjects(
            self._nc, self.bodies.stream, object_meta_subjects(bucket), self._timeout_s
        )
        ids = set()
        for subject in found:
            name = object_name_of_meta_subject(bucket, subject)
            if name is None:
                continue  # not a meta token we wrote: none of ours
            try:
                ids.add(check_queue_id(name))
            except InvalidName:
                continue  # not a queue body: none of ours
        return ids

    async def _first_time(self, subject: str) -> datetime | None:
        try:
            msg = await self.bodies.js.get_msg(
                self.bodies.stream, seq=1, subject=subject, next=True, direct=True
            )
        except nats.js.errors.NotFoundError:
            return None
        except NATS_FAILURES as e:
            raise StoreUnavailable(f"{subject}: read: {e or type(e).__name__}") from e
        return _utc(msg.time) if msg.time is not None else None

    async def body_stored_at(self, queue_id: str) -> datetime | None:
        """See :meth:`Inventory.body_stored_at`: the time of the body's meta message."""
        return await self._first_time(self.bodies.meta_subject(queue_id))

    async def orphan_chunks(self, stored_before: datetime, *, thorough: bool) -> list[str]:
        """See :meth:`Inventory.orphan_chunks`."""
        bucket, stream = self.bodies.bucket, self.bodies.stream
        chunk_prefix = object_chunk_prefix(bucket)
        chunks = await stream_subjects(
            self._nc, stream, object_chunk_subjects(bucket), self._timeout_s
        )
        metas = await stream_subjects(
            self._nc, stream, object_meta_subjects(bucket), self._timeout_s
        )
        if not chunks or (len(chunks) <= len(metas) and not thorough):
            return []
        referenced: set[str] = set()
        meta_subjects = sorted(metas)
        for i in range(0, len(meta_subjects), READ_BATCH):
            batch = meta_subjects[i : i + READ_BATCH]
            nuids = await asyncio.gather(*(self._nuid(s) for s in batch))
            referenced.update(n for n in nuids if n)
        orphans = []
        for subject in sorted(chunks):
            nuid = subject[len(chunk_prefix) :]
            if nuid in referenced:
                continue
            first = await self._first_time(subject)
            if first is not None and first < stored_before:
                orphans.append(nuid)
        return orphans

    async def _nuid(self, meta_subject: str) -> str | None:
        try:
            msg = await self.bodies.js.get_msg(
                self.bodies.stream, subject=meta_subject, direct=True
            )
        except nats.js.errors.NotFoundError:
            return None
        except NATS_FAILURES as e:
            raise StoreUnavailable(f"{meta_subject}: read: {e or type(e).__name__}") from e
        try:
            meta = json.loads(msg.data or b"{}")
        except ValueError:
            return None
        nuid = meta.get("nuid") if isinstance(meta, dict) else None
        return nuid if isinstance(nuid, str) else None

    async def delete_chunks(self, chunk_set: str) -> None:
        """See :meth:`Inventory.delete_chunks`.

        Raises:
            StoreUnavailable: the purge failed (NATS error, timeout, socket).
        """
        try:
            await self.bodies.js.purge_stream(
                self.bodies.stream, subject=self.bodies.chunk_subject(chunk_set)
            )
        except NATS_FAILURES as e:
            raise StoreUnavailable(f"chunks {chunk_set}: purge: {e or type(e).__name__}") from e
