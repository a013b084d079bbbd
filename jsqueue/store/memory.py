"""In-memory body store, entry store and scheduler with the same semantics as JetStream.

For tests and for reasoning about the contract; nothing here survives the process. The
contract suite (``tests/test_store_contract.py``) runs against these and the JetStream
implementations alike, revision conflicts and ack-wait redelivery included.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from datetime import datetime

from jsqueue.envelope import Entry, EntryState, WorkItem, utcnow
from jsqueue.errors import (
    BodyCorrupt,
    BodyNotFound,
    EntryDeleted,
    EntryExists,
    EntryNotFound,
    RevisionConflict,
    StoreError,
)
from jsqueue.names import check_domain, check_queue_id
from jsqueue.pacing import Pacer
from jsqueue.store.base import (
    BodyInfo,
    Due,
    Held,
    Keyed,
    PresenceMark,
    Stores,
    Versioned,
    check_ingest_key,
    encode_entry,
)

CHUNK = 256 * 1024
#: Largest stored entry, octets: the default maximum payload of a NATS server, so that an
#: entry refused by JetStream is refused here too.
MAX_VALUE_SIZE = 1024 * 1024


class MemoryBodyStore:
    """:class:`~jsqueue.store.base.BodyStore` in a dict."""

    def __init__(self) -> None:
        self._bodies: dict[str, tuple[bytes, str]] = {}

    async def put(
        self, queue_id: str, chunks: AsyncIterable[bytes], *, fresh: bool = False
    ) -> BodyInfo:
        """See :meth:`BodyStore.put`."""
        check_queue_id(queue_id)
        digest = hashlib.sha256()
        parts = []
        async for chunk in chunks:
            digest.update(chunk)
            parts.append(chunk)
        data = b"".join(parts)
        self._bodies[queue_id] = (data, digest.hexdigest())
        return BodyInfo(size=len(data), digest=digest.hexdigest())

    async def open(
        self, queue_id: str, *, expect: BodyInfo | None = None
    ) -> AsyncGenerator[bytes, None]:
        """See :meth:`BodyStore.open`.

        Raises:
            InvalidName: bad queue id.
            BodyNotFound: nothing stored under the id.
            BodyCorrupt: the bytes do not match the stored digest, or ``expect``.
        """
        check_queue_id(queue_id)
        try:
            data, expected = self._bodies[queue_id]
        except KeyError:
            raise BodyNotFound(queue_id) from None
        if expect is not None:
            expected = expect.digest if expect.size == len(data) else "size mismatch"
        digest = hashlib.sha256()
        for i in range(0, len(data), CHUNK):
            chunk = data[i : i + CHUNK]
            digest.update(chunk)
            if i + CHUNK >= len(data) and digest.hexdigest() != expected:
                raise BodyCorrupt(f"body {queue_id}: digest mismatch")
            yield chunk
        if not data and digest.hexdigest() != expected:
            raise BodyCorrupt(f"body {queue_id}: digest mismatch")

    async def info(self, queue_id: str) -> BodyInfo:
        """See :meth:`BodyStore.info`.

        Raises:
            InvalidName: bad queue id.
            BodyNotFound: nothing stored under the id.
        """
        check_queue_id(queue_id)
        try:
            data, digest = self._bodies[queue_id]
        except KeyError:
            raise BodyNotFound(queue_id) from None
        return BodyInfo(size=len(data), digest=digest)

    async def delete(self, queue_id: str) -> None:
        """See :meth:`BodyStore.delete`."""
        self._bodies.pop(check_queue_id(queue_id), None)

    async def discard(self, queue_id: str) -> None:
        """See :meth:`BodyStore.discard`: :meth:`delete`, which cannot fail here."""
        await self.delete(queue_id)

    def corrupt(self, queue_id: str) -> None:
        """Test hook: flip one stored byte so the digest no longer matches."""
        data, digest = self._bodies[queue_id]
        flipped = bytes([data[0] ^ 1]) + data[1:] if data else b"x"
        self._bodies[queue_id] = (flipped, digest)


class MemoryEntryStore:
    """:class:`~jsqueue.store.base.EntryStore` in a dict, with a global revision counter."""

    max_value_size: int = MAX_VALUE_SIZE

    def __init__(self) -> None:
        self._entries: dict[str, tuple[bytes, int]] = {}
        self._deleted: set[str] = set()
        self._seq = itertools.count(1)

    async def create(self, entry: Entry) -> int:
        """See :meth:`EntryStore.create`.

        Raises:
            InvalidName: bad queue id.
            EntryExists: an entry is already stored under the id.
            EntryTooLarge: the stored form is larger than :data:`MAX_VALUE_SIZE`.
        """
        check_queue_id(entry.id)
        if entry.id in self._entries:
            raise EntryExists(entry.id)
        data = encode_entry(entry, self.max_value_size)
        rev = next(self._seq)
        self._entries[entry.id] = (data, rev)
        self._deleted.discard(entry.id)
        return rev

    async def get(self, queue_id: str) -> Versioned:
        """See :meth:`EntryStore.get`.

        Raises:
            InvalidName: bad queue id.
            EntryDeleted: no entry, and one under the id was deleted.
            EntryNotFound: no entry was ever stored under the id.
        """
        check_queue_id(queue_id)
        try:
            data, rev = self._entries[queue_id]
        except KeyError:
            if queue_id in self._deleted:
                raise EntryDeleted(queue_id) from None
            raise EntryNotFound(queue_id) from None
        return Versioned(Entry.from_json(data), rev)

    async def get_many(self, queue_ids: Sequence[str]) -> list[Versioned | StoreError]:
        """See :meth:`EntryStore.get_many`.

        Raises:
            InvalidName: a bad queue id.
        """
        out: list[Versioned | StoreError] = []
        for queue_id in queue_ids:
            try:
                out.append(await self.get(queue_id))
            except StoreError as e:  # (InvalidName is not one: it is raised)
                out.append(e)
        return out

    async def update(self, entry: Entry, revision: int) -> int:
        """See :meth:`EntryStore.update`.

        Raises:
            InvalidName: bad queue id.
            RevisionConflict: the entry is gone or no longer at ``revision``.
            EntryTooLarge: the stored form is larger than :data:`MAX_VALUE_SIZE`.
        """
        current = self._entries.get(check_queue_id(entry.id))
        if current is None or current[1] != revision:
            raise RevisionConflict(f"entry {entry.id}: expected revision {revision}")
        data = encode_entry(entry, self.max_value_size)
        rev = next(self._seq)
        self._entries[entry.id] = (data, rev)
        return rev

    async def discard(self, queue_id: str) -> None:
        """See :meth:`EntryStore.discard`."""
        self._entries.pop(check_queue_id(queue_id), None)
        self._deleted.discard(queue_id)

    async def delete(self, queue_id: str, revision: int | None = None) -> None:
        """See :meth:`EntryStore.delete`.

        Raises:
            InvalidName: bad queue id.
            RevisionConflict: ``revision`` given and the entry is gone or no longer at it.
        """
        current = self._entries.get(check_queue_id(queue_id))
        if revision is not None and (current is None or current[1] != revision):
            raise RevisionConflict(f"entry {queue_id}: expected revision {revision}")
        self._entries.pop(queue_id, None)
        self._deleted.add(queue_id)

    async def page(
        self, *, state: EntryState | None = None, after: str | None = None, limit: int = 100
    ) -> list[Versioned]:
        """See :meth:`EntryStore.page`."""
        out: list[Versioned] = []
        for qid in sorted(self._entries):
            if after is not None and qid <= after:
                continue
            data, rev = self._entries[qid]
            entry = Entry.from_json(data)
            if state is None or entry.state == state:
                out.append(Versioned(entry, rev))
                if len(out) >= limit:
                    break
        return out

    async def count_by_state(self, pacer: Pacer | None = None) -> dict[EntryState, int]:
        """See :meth:`EntryStore.count_by_state`."""
        counts: dict[EntryState, int] = {}
        for data, _ in list(self._entries.values()):
            if pacer is not None:
                await pacer.step()
            st = Entry.from_json(data).state
            counts[st] = counts.get(st, 0) + 1
        return counts


class _MemoryDue:
    def __init__(self, sched: MemoryScheduler, item: WorkItem, token: int, deliveries: int):
        self.item = item
        self.deliveries = deliveries
        self._sched = sched
        self._token = token

    async def ack(self) -> None:
        self._sched._settle(self._token)

    async def term(self) -> None:
        self._sched._settle(self._token)

    async def retry(self, delay_s: float) -> None:
        if self._sched._settle(self._token):
            self._sched._push(self.item, self._sched._now() + max(0.0, delay_s), self.deliveries)

    async def in_progress(self) -> None:
        self._sched._touch(self._token)


class MemoryScheduler:
    """:class:`~jsqueue.store.base.Scheduler` on a heap of (due time, item).

    Like the JetStream consumer, an item handed out and not settled within ``ack_wait_s``
    comes back (with its delivery count raised).
    """

    def __init__(self, ack_wait_s: float = 30.0) -> None:
        self.ack_wait_s = ack_wait_s
        self._heap: list[tuple[float, int, WorkItem, int]] = []
        self._inflight: dict[int, tuple[WorkItem, float, int]] = {}
        self._counter = itertools.count()
        self._changed = asyncio.Event()

    @staticmethod
    def _now() -> float:
        return utcnow().timestamp()

    def _push(self, item: WorkItem, due: float, deliveries: int) -> None:
        heapq.heappush(self._heap, (due, next(self._counter), item, deliveries))
        self._changed.set()

    def _settle(self, token: int) -> bool:
        return self._inflight.pop(token, None) is not None

    def _touch(self, token: int) -> None:
        if token in self._inflight:
            item, _, deliveries = self._inflight[token]
            self._inflight[token] = (item, self._now() + self.ack_wait_s, deliveries)

    def _expire_inflight(self, now: float) -> None:
        for token, (item, deadline, deliveries) in list(self._inflight.items()):
            if deadline <= now:
                del self._inflight[token]
                self._push(item, now, deliveries)

    def _matches(self, item: WorkItem, queue_id: str, domain: str | None) -> bool:
        return item.queue_id == queue_id and (domain is None or item.domain == domain)

    async def schedule(self, item: WorkItem, at: datetime | None = None) -> None:
        """See :meth:`Scheduler.schedule`."""
        check_queue_id(item.queue_id)
        check_domain(item.domain)
        for _, _, queued, _ in self._heap:
            if queued == item:
                return
        self._push(item, at.timestamp() if at else self._now(), 0)

    async def fetch(self, batch: int, timeout_s: float) -> list[Due]:
        """See :meth:`Scheduler.fetch`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            now = self._now()
            self._expire_inflight(now)
            out: list[Due] = []
            while self._heap and self._heap[0][0] <= now and len(out) < batch:
                _, token, item, deliveries = heapq.heappop(self._heap)
                self._inflight[token] = (item, now + self.ack_wait_s, deliveries + 1)
                out.append(_MemoryDue(self, item, token, deliveries + 1))
            remaining = deadline - loop.time()
            if out or remaining <= 0:
                return out
            wake = [remaining]
            if self._heap:
                wake.append(max(0.0, self._heap[0][0] - now))
            wake += [max(0.0, d - now) for _, d, _ in self._inflight.values()]
            self._changed.clear()
            # A timeout here only means "time to look at the heap again".
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(wake) + 0.001)

    async def flush(self, item: WorkItem) -> None:
        """See :meth:`Scheduler.flush`."""
        self._remove(item.queue_id, item.domain)
        self._push(item, self._now(), 0)

    async def cancel(self, queue_id: str) -> None:
        """See :meth:`Scheduler.cancel`."""
        check_queue_id(queue_id)
        self._remove(queue_id, None)

    def _remove(self, queue_id: str, domain: str | None) -> None:
        self._heap = [h for h in self._heap if not self._matches(h[2], queue_id, domain)]
        heapq.heapify(self._heap)
        for token, (item, _, _) in list(self._inflight.items()):
            if self._matches(item, queue_id, domain):
                del self._inflight[token]

    async def backlog(self) -> int:
        """See :meth:`Scheduler.backlog`."""
        return len(self._heap) + len(self._inflight)


class MemoryIngestLog:
    """:class:`~jsqueue.store.base.IngestLog` in an insertion-ordered dict (oldest first);
    a record's version is the number of writes this log had made when it was written."""

    def __init__(self) -> None:
        self._records: OrderedDict[str, tuple[str, float, int]] = OrderedDict()
        self._max_age_s = 0.0
        self._writes = 0

    async def lookup(self, key: str, max_age_s: float, *, consistent: bool = False) -> str | None:
        """See :meth:`IngestLog.lookup` (always consistent here)."""
        return (await self.holder(key, max_age_s)).queue_id

    async def holder(self, key: str, max_age_s: float) -> Held:
        """See :meth:`IngestLog.holder`."""
        check_ingest_key(key)
        self._max_age_s = max(self._max_age_s, max_age_s)
        found = self._records.get(key)
        if found is None:
            return Held(None, 0)
        if utcnow().timestamp() - found[1] > max_age_s:
            return Held(None, found[2])
        return Held(found[0], found[2])

    async def claim(self, key: str, queue_id: str, max_age_s: float) -> str | None:
        """See :meth:`IngestLog.claim`."""
        earlier = await self.lookup(key, max_age_s)
        if earlier is not None and earlier != check_queue_id(queue_id):
            return earlier
        await self.record(key, queue_id)
        return None

    async def replace(self, key: str, version: int, queue_id: str) -> bool:
        """See :meth:`IngestLog.replace`."""
        found = self._records.get(check_ingest_key(key))
        if (found[2] if found is not None else 0) != version:
            return False
        await self.record(key, queue_id)
        return True

    async def forget(self, key: str, queue_id: str) -> None:
        """See :meth:`IngestLog.forget`.

        Raises:
            InvalidName: bad key or queue id.
        """
        check_ingest_key(key)
        found = self._records.get(key)
        if found is not None and found[0] == check_queue_id(queue_id):
            del self._records[key]

    async def record(self, key: str, queue_id: str) -> None:
        """See :meth:`IngestLog.record`. Drops records older than the largest window seen."""
        check_ingest_key(key)
        now = utcnow().timestamp()
        self._writes += 1
        self._records[key] = (check_queue_id(queue_id), now, self._writes)
        self._records.move_to_end(key)
        while self._records:
            oldest = next(iter(self._records.values()))
            if now - oldest[1] <= self._max_age_s:
                break
            self._records.popitem(last=False)


class MemoryPresence:
    """:class:`~jsqueue.store.base.Presence` in a dict: owner -> (instance, revision, expiry
    on the event loop's clock)."""

    def __init__(self) -> None:
        self._marks: dict[str, tuple[str, int, float]] = {}
        self._revision = 0

    def _live(self, owner: str) -> tuple[str, int, float] | None:
        mark = self._marks.get(owner)
        if mark is not None and mark[2] <= asyncio.get_running_loop().time():
            del self._marks[owner]
            return None
        return mark

    async def beat(self, owner: str, instance: str, ttl_s: float, *, first: bool = False) -> bool:
        """See :meth:`Presence.beat`."""
        if first and self._live(owner) is not None:
            return False
        self._revision += 1
        expiry = asyncio.get_running_loop().time() + math.ceil(ttl_s)
        self._marks[owner] = (instance, self._revision, expiry)
        return True

    async def seen(self, owner: str) -> PresenceMark | None:
        """See :meth:`Presence.seen`."""
        mark = self._live(owner)
        return None if mark is None else PresenceMark(mark[0], mark[1])

    async def leave(self, owner: str) -> None:
        """See :meth:`Presence.leave`."""
        self._marks.pop(owner, None)


class MemoryDestinations:
    """:class:`~jsqueue.store.base.DestinationStore` in a dict: key -> (value, revision,
    expiry on the event loop's clock). Revisions grow across all keys, as stream sequences
    do; an expired key reads as absent with revision 0, a deleted one at its delete's."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[dict[str, object] | None, int, float]] = {}
        self._revision = 0

    def _read(self, key: str) -> Keyed:
        item = self._keys.get(key)
        if item is None:
            return Keyed(None, 0)
        if item[2] <= asyncio.get_running_loop().time():
            del self._keys[key]
            return Keyed(None, 0)
        return Keyed(item[0], item[1])

    async def get(self, key: str) -> Keyed:
        """See :meth:`DestinationStore.get`."""
        return self._read(key)

    async def get_many(self, keys: Sequence[str]) -> dict[str, Keyed]:
        """See :meth:`DestinationStore.get_many`."""
        return {key: self._read(key) for key in keys}

    async def put(
        self, key: str, value: dict[str, object], *, revision: int | None, ttl_s: float
    ) -> int | None:
        """See :meth:`DestinationStore.put`."""
        if revision is not None and self._read(key).revision != revision:
            return None
        self._revision += 1
        expiry = asyncio.get_running_loop().time() + max(1, math.ceil(ttl_s))
        self._keys[key] = (dict(value), self._revision, expiry)
        return self._revision

    async def delete(self, key: str, *, revision: int | None) -> bool:
        """See :meth:`DestinationStore.delete`: the key reads as absent at a new revision
        for a second, then as never written."""
        current = self._read(key)
        if revision is not None and current.revision != revision:
            return False
        if current.value is None:
            return True
        self._revision += 1
        self._keys[key] = (None, self._revision, asyncio.get_running_loop().time() + 1)
        return True

    async def keys(self, prefix: str) -> list[str]:
        """See :meth:`DestinationStore.keys`."""
        return sorted(k for k in list(self._keys) if k.startswith(prefix) and self._read(k).value)

    async def queued(self, domain: str) -> int | None:
        """See :meth:`DestinationStore.queued`: not known here (None)."""
        return None


def open_memory(ack_wait_s: float = 30.0) -> Stores:
    """A fresh in-memory body store, entry store, scheduler and ingest log."""

    async def _close() -> None:
        return None

    return Stores(
        MemoryBodyStore(),
        MemoryEntryStore(),
        MemoryScheduler(ack_wait_s),
        _close,
        MemoryIngestLog(),
        presence=MemoryPresence(),
        destinations=MemoryDestinations(),
    )
