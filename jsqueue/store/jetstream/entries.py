"""Entries: :class:`JetStreamEntryStore`, the entry store on a JetStream KV bucket (key =
queue id, revision = stream sequence), with every write a compare-and-set that recognises
its own earlier try, and key listings by stream-info request instead of a consumer.
"""

from __future__ import annotations

import asyncio
import bisect
import uuid
from collections.abc import AsyncGenerator, Sequence

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api
from pydantic import ValidationError

from jsqueue.envelope import Entry, EntryState
from jsqueue.errors import (
    EntryDeleted,
    EntryExists,
    EntryNotFound,
    RevisionConflict,
    StoreError,
)
from jsqueue.names import Names, check_queue_id, kv_subject_prefix, kv_subjects
from jsqueue.pacing import Pacer
from jsqueue.store.base import Versioned, encode_entry
from jsqueue.store.jetstream.api import (
    DIRECT_BATCH,
    HDR_EXPECTED_LAST_SUBJ_SEQ,
    HDR_KV_OP,
    HDR_MARKER_REASON,
    HDR_MSG_ID,
    HDR_ROLLUP,
    HDR_TTL,
    PUBLISH_ATTEMPTS,
    DirectBatch,
    get_confirmed,
    get_stored,
    is_wrong_last_seq,
    publish,
    stream_subjects,
    translate,
    unavailable,
)

#: Lifetime of a KV delete marker, seconds: afterwards the key is simply absent.
DELETE_MARKER_TTL_S = 900
#: Keys read at a time when scanning the KV bucket: one batched direct get (or as many
#: concurrent direct gets from a server older than 2.11).
SCAN_BATCH = DIRECT_BATCH
#: Octets of a KV write's headers (message id, expected revision) left out of the value
#: size an entry may have.
KV_HEADER_ROOM = 1024


class _WrongRevision(Exception):
    """The subject's last sequence was not the expected one (and not by our own write)."""


def _is_marker(msg: api.RawStreamMsg) -> bool:
    headers = msg.headers or {}
    return headers.get(HDR_KV_OP) in ("DEL", "PURGE") or HDR_MARKER_REASON in headers


class JetStreamEntryStore:
    """:class:`~jsqueue.store.base.EntryStore` on a JetStream KV bucket (key = queue id).

    The value is :meth:`Entry.to_json` (an inline body after the JSON line); its size is
    bounded by the server's maximum payload (:attr:`max_value_size`).

    The revision is the KV revision (stream sequence). Reads are direct gets. A delete
    writes a purge marker (``KV-Operation: PURGE``, rolled up, so the value is gone) that
    itself expires after :data:`DELETE_MARKER_TTL_S`; a deleted key reads as
    EntryNotFound and can be created again.

    Cost of the listing calls: :meth:`page` and :meth:`count_by_state` get the key list in
    one stream-info request (subjects filter; ~0.13 s and ~4 MB for 100k keys, paged by the
    server at 100k), sort it, then read values ``SCAN_BATCH`` at a time, each batch by one
    batched direct get (:class:`~jsqueue.store.jetstream.api.DirectBatch`):
    :meth:`page` only as many as it needs to fill the page, :meth:`count_by_state` all of
    them. Neither creates a consumer. Values changed during a scan are read as of the moment
    they are fetched (no snapshot).

    Args:
        nc: a connected client.
        names: object names.
        timeout_s: per-request timeout, seconds.
    """

    def __init__(self, nc: NATS, names: Names, *, timeout_s: float = 5.0) -> None:
        self.js = nc.jetstream(timeout=timeout_s)
        self.bucket = names.entries_bucket
        self.stream = names.entries_stream
        self._nc = nc
        self._pre = kv_subject_prefix(self.bucket)
        self._timeout_s = timeout_s
        self._batch = DirectBatch(nc)

    @property
    def max_value_size(self) -> int:
        """The server's maximum payload, octets (less room for the KV headers)."""
        return max(0, (self._nc.max_payload or 1024 * 1024) - KV_HEADER_ROOM)

    async def _last(self, queue_id: str, *, leader: bool = False) -> api.RawStreamMsg | None:
        return await get_stored(
            self.js, self.stream, self._pre + queue_id, what=f"entry {queue_id}", leader=leader
        )

    async def _last_many(self, queue_ids: Sequence[str]) -> dict[str, api.RawStreamMsg]:
        """The last message of each key that has one (direct gets: not confirmed on the
        stream leader), by batched direct get where the server has it.

        Raises:
            StoreUnavailable: a read failed, timed out or was refused (no stream).
        """
        if self._batch.supported:
            subjects = [self._pre + q for q in queue_ids]
            with translate(f"entries: read {len(queue_ids)}"):
                found = await self._batch.last(self.stream, subjects, self._timeout_s)
            return {subject[len(self._pre) :]: msg for subject, msg in found.items()}
        msgs = await asyncio.gather(*(self._last(q) for q in queue_ids))
        return {q: m for q, m in zip(queue_ids, msgs, strict=True) if m is not None}

    async def _write(
        self, queue_id: str, data: bytes, headers: dict[str, str], last: int | None
    ) -> int:
        """Publish one KV write; with ``last``, only if the key's revision is still ``last``.

        Returns:
            the new revision.

        Raises:
            _WrongRevision: the CAS failed (someone else wrote since ``last``).
            StoreUnavailable: the publish timed out, found no stream leader or was refused
                otherwise, or the connection failed.
            unavailable: the StoreUnavailable above, as built by
                :func:`~jsqueue.store.jetstream.api.unavailable`.
        """
        msg_id = f"{queue_id}:{uuid.uuid4().hex}"
        hdrs = {**headers, HDR_MSG_ID: msg_id}
        if last is not None:
            hdrs[HDR_EXPECTED_LAST_SUBJ_SEQ] = str(last)
        what = f"entry {queue_id}: write"
        budget_s = PUBLISH_ATTEMPTS * self._timeout_s
        try:
            ack = await publish(
                self.js, self._pre + queue_id, data, hdrs, what=what, budget_s=budget_s
            )
            return ack.seq
        except nats.js.errors.APIError as e:
            if not is_wrong_last_seq(e):
                raise unavailable(what, e) from e
            # Refused: either someone else wrote, or an earlier try of ours that timed out
            # was stored after all (the check precedes dedupe on the server). Asked of the
            # stream leader: a follower's direct get may not have our write yet.
            current = await get_confirmed(
                self.js,
                self.stream,
                self._pre + queue_id,
                what=f"entry {queue_id}",
                settled=lambda _: False,  # the leader's answer, never a replica's
                tries=PUBLISH_ATTEMPTS,
                budget_s=budget_s,
            )
            if current is not None and (current.headers or {}).get(HDR_MSG_ID) == msg_id:
                assert current.seq is not None
                return current.seq
            raise _WrongRevision() from e

    @staticmethod
    def _decode(queue_id: str, msg: api.RawStreamMsg) -> Versioned:
        assert msg.seq is not None
        try:
            return Versioned(Entry.from_json(msg.data or b""), msg.seq)
        except ValidationError as e:
            raise StoreError(f"entry {queue_id}: stored value is not a valid entry: {e}") from e

    async def create(self, entry: Entry) -> int:
        """See :meth:`EntryStore.create`.

        Raises:
            InvalidName: bad queue id.
            EntryTooLarge: the stored form is larger than :attr:`max_value_size`.
            EntryExists: an entry (not deleted) is already stored under the id.
            StoreUnavailable: a read or the write failed.
        """
        check_queue_id(entry.id)
        data = encode_entry(entry, self.max_value_size)
        try:
            return await self._write(entry.id, data, {}, last=0)
        except _WrongRevision:
            pass
        current = await self._last(entry.id)
        if current is None or _is_marker(current):
            # Deleted (marker not yet expired) or the marker just expired: take its place.
            try:
                return await self._write(
                    entry.id, data, {}, last=current.seq if current is not None else 0
                )
            except _WrongRevision:
                pass
        raise EntryExists(entry.id)

    async def get(self, queue_id: str) -> Versioned:
        """See :meth:`EntryStore.get`.

        "Not found" is confirmed on the stream leader: with replicas, a direct get may be
        answered by a follower that has not applied the newest writes yet (a replica that
        was just restarted and is catching up; measured), and a worker that took such an
        answer for "entry gone" would drop a work item for good (DESIGN.md §2.2). A stale
        *found* answer is harmless: its revision fails the compare-and-set.

        Raises:
            InvalidName: bad queue id.
            EntryNotFound: no entry under the id (confirmed on the stream leader).
            EntryDeleted: the key holds a delete marker (the entry was deleted lately).
            StoreError: the stored value is not a valid entry.
            StoreUnavailable: the read failed.
        """
        check_queue_id(queue_id)
        msg = await get_confirmed(
            self.js,
            self.stream,
            self._pre + queue_id,
            what=f"entry {queue_id}",
            settled=lambda m: not _is_marker(m),
        )
        if msg is None:
            raise EntryNotFound(queue_id)
        if _is_marker(msg):
            raise EntryDeleted(queue_id)
        return self._decode(queue_id, msg)

    async def get_many(self, queue_ids: Sequence[str]) -> list[Versioned | StoreError]:
        """See :meth:`EntryStore.get_many`: one batched direct get per
        :data:`~jsqueue.store.jetstream.api.DIRECT_BATCH` ids (a replica may answer, and no
        answer is confirmed on the stream leader).

        Raises:
            InvalidName: a bad queue id.
            StoreUnavailable: a read failed.
        """
        for queue_id in queue_ids:
            check_queue_id(queue_id)
        msgs = await self._last_many(queue_ids)
        out: list[Versioned | StoreError] = []
        for queue_id in queue_ids:
            msg = msgs.get(queue_id)
            if msg is None:
                out.append(EntryNotFound(queue_id))
            elif _is_marker(msg):
                out.append(EntryDeleted(queue_id))
            else:
                try:
                    out.append(self._decode(queue_id, msg))
                except StoreError as e:
                    out.append(e)
        return out

    async def update(self, entry: Entry, revision: int) -> int:
        """See :meth:`EntryStore.update`.

        Raises:
            InvalidName: bad queue id.
            RevisionConflict: ``revision`` is below 1, or the key is no longer at it.
            EntryTooLarge: the stored form is larger than :attr:`max_value_size`.
            StoreUnavailable: the write failed.
        """
        check_queue_id(entry.id)
        if revision < 1:
            raise RevisionConflict(f"entry {entry.id}: expected revision {revision}")
        try:
            return await self._write(
                entry.id, encode_entry(entry, self.max_value_size), {}, last=revision
            )
        except _WrongRevision as e:
            raise RevisionConflict(f"entry {entry.id}: expected revision {revision}") from e

    async def delete(self, queue_id: str, revision: int | None = None) -> None:
        """See :meth:`EntryStore.delete`. Leaves a purge marker that expires on its own.

        Raises:
            InvalidName: bad queue id.
            RevisionConflict: ``revision`` given and below 1, or the key is no longer at it.
            StoreUnavailable: the write failed.
        """
        check_queue_id(queue_id)
        if revision is not None and revision < 1:
            raise RevisionConflict(f"entry {queue_id}: expected revision {revision}")
        headers = {HDR_KV_OP: "PURGE", HDR_ROLLUP: "sub", HDR_TTL: f"{DELETE_MARKER_TTL_S}s"}
        try:
            await self._write(queue_id, b"", headers, last=revision)
        except _WrongRevision as e:
            raise RevisionConflict(f"entry {queue_id}: expected revision {revision}") from e

    async def discard(self, queue_id: str) -> None:
        """See :meth:`EntryStore.discard`: the key's messages purged from the stream (one
        JetStream API request), no marker written.

        Raises:
            InvalidName: bad queue id.
            StoreUnavailable: the purge failed.
        """
        check_queue_id(queue_id)
        with translate(f"entry {queue_id}: discard"):
            await self.js.purge_stream(self.stream, subject=self._pre + queue_id)

    async def keys(self) -> list[str]:
        """Every key in the bucket (deleted keys whose marker has not expired included),
        sorted. One stream-info request per 100k keys; no consumer.

        Raises:
            StoreUnavailable: no answer, or the server refused the request.
        """
        found = await stream_subjects(
            self._nc,
            self.stream,
            kv_subjects(self.bucket),
            self._timeout_s,
            what="entries: list keys",
        )
        return sorted(s[len(self._pre) :] for s in found)

    async def _scan(
        self, after: str | None, pacer: Pacer | None = None, batch_size: int = SCAN_BATCH
    ) -> AsyncGenerator[Versioned, None]:
        keys = await self.keys()
        start = bisect.bisect_right(keys, after) if after is not None else 0
        for i in range(start, len(keys), batch_size):
            if pacer is not None:
                await pacer.step()
            batch = keys[i : i + batch_size]
            msgs = await self._last_many(batch)
            for key in batch:
                msg = msgs.get(key)
                if msg is not None and not _is_marker(msg):
                    yield self._decode(key, msg)

    async def page(
        self, *, state: EntryState | None = None, after: str | None = None, limit: int = 100
    ) -> list[Versioned]:
        """See :meth:`EntryStore.page`."""
        out: list[Versioned] = []
        if limit < 1:
            return out
        # a batch no larger than the page: a page of 50 does not read 256 entries
        scan = self._scan(after, batch_size=min(SCAN_BATCH, limit))
        try:
            async for v in scan:
                if state is None or v.entry.state == state:
                    out.append(v)
                    if len(out) >= limit:
                        break
        finally:
            await scan.aclose()
        return out

    async def count_by_state(self, pacer: Pacer | None = None) -> dict[EntryState, int]:
        """See :meth:`EntryStore.count_by_state`. Reads every entry (see class docstring)."""
        counts: dict[EntryState, int] = {}
        async for v in self._scan(None, pacer):
            st = v.entry.state
            counts[st] = counts.get(st, 0) + 1
        return counts
