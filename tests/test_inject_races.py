"""Idempotency-Key races between two API processes, made deterministic: two injectors (as two
pods) share one ingest log and one queue, and a gate in the ingest log holds one process
between two of its steps while the other runs. Whatever the interleaving, a retry with the
same key answers with the first queue id, and the same key with a different request is
refused (422) and stores nothing (draft-ietf-httpapi-idempotency-key-header §2.7).

The in-memory stores stand in for JetStream here because the race is in the injector's
order of reads and writes; ``test_http_inject`` runs the same races over HTTP and NATS."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from jsqueue.config import Settings
from jsqueue.errors import EntryNotFound, RequestRejected
from jsqueue.events import NULL_OBSERVER
from jsqueue.http.inject import Injector, NotQueued, Submitter
from jsqueue.http.message import Transaction, transaction
from jsqueue.http.models import InjectBody
from jsqueue.store.base import Held, IngestLog, Stores
from jsqueue.store.memory import MemoryIngestLog, open_memory

WHO = Submitter("app", "api:app", "127.0.0.1")
KEY = "order-4711"


def _tx(text: str) -> Transaction:
    body = InjectBody.model_validate(
        {
            "reverse_path": "app@example.test",
            "recipients": [{"address": "bob@dest.example.test"}],
            "raw": f"Subject: {text}\r\n\r\n{text}\r\n",
        }
    )
    return transaction(body, hostname="mx.example.test", max_size=1 << 20, max_recipients=10)


class _Gated:
    """An ingest log that passes everything to ``inner``, except that it can hold one
    process's calls: ``after_first_lookup`` holds the answer of the first lookup (read
    before the gate, answered after it), ``records_once_stored`` holds a record() made when
    the message it names already has an entry."""

    def __init__(self, inner: IngestLog, stores: Stores, box: list[IngestLog] | None = None):
        self.box = box if box is not None else [inner]  # shared: one log, as on NATS
        self.stores = stores
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()
        self.after_first_lookup = False
        self.records_once_stored = False
        self.hold_after_claim = False
        self.claim_barrier: asyncio.Barrier | None = None
        self.restart_once_stored = False
        self.claimed = asyncio.Event()
        self._lookups = 0
        self._claim_key: str | None = None
        self._held_once = False
        self._met = False
        self._restarted = False

    @property
    def inner(self) -> IngestLog:
        return self.box[0]

    async def _restart(self) -> None:
        """With ``restart_once_stored``: at this process's first call once its message has
        an entry, the log is lost (a NATS restart: the ingest log lives in memory)."""
        if self.restart_once_stored and not self._restarted and await self.stores.entries.page():
            self._restarted = True
            self.box[0] = MemoryIngestLog()

    async def _after_claim(self) -> None:
        """With ``hold_after_claim``: this process stops at its first step after its claim
        (as if it died there, or was slow), until the gate opens."""
        if self.hold_after_claim and self._claim_key is not None and not self._held_once:
            self._held_once = True
            self.waiting.set()
            await self.gate.wait()

    async def _claim_write(self, key: str) -> None:
        """With ``claim_barrier``: the first write of the claimed key (a take-over) waits
        until the other process makes its own."""
        if self.claim_barrier is not None and key == self._claim_key and not self._met:
            self._met = True
            await self.claim_barrier.wait()

    async def lookup(self, key: str, max_age_s: float, *, consistent: bool = False) -> str | None:
        await self._after_claim()
        found = await self.inner.lookup(key, max_age_s, consistent=consistent)
        self._lookups += 1
        if self.after_first_lookup and self._lookups == 1:
            self.waiting.set()
            await self.gate.wait()
        return found

    async def claim(self, key: str, queue_id: str, max_age_s: float) -> str | None:
        self._claim_key = key
        try:
            return await self.inner.claim(key, queue_id, max_age_s)
        finally:
            self.claimed.set()

    async def holder(self, key: str, max_age_s: float) -> Held:
        await self._after_claim()
        await self._restart()
        return await self.inner.holder(key, max_age_s)

    async def replace(self, key: str, version: int, queue_id: str) -> bool:
        await self._after_claim()
        await self._claim_write(key)
        written = await self.inner.replace(key, version, queue_id)
        await self._stall_after_restart()
        return written

    async def record(self, key: str, queue_id: str) -> None:
        await self._after_claim()
        await self._claim_write(key)
        await self._restart()
        if self.records_once_stored and await self._has_entry(queue_id):
            self.waiting.set()
            await self.gate.wait()
        await self.inner.record(key, queue_id)
        await self._stall_after_restart()

    async def _stall_after_restart(self) -> None:
        """With ``restart_once_stored``: the process stalls after its first write once
        the log was lost, until the gate opens."""
        if self._restarted and not self._held_once:
            self._held_once = True
            self.waiting.set()
            await self.gate.wait()

    async def forget(self, key: str, queue_id: str) -> None:
        await self.inner.forget(key, queue_id)

    async def _has_entry(self, queue_id: str) -> bool:
        try:
            await self.stores.entries.get(queue_id)
        except EntryNotFound:
            return False
        return True


class _Expiring(_Gated):
    """An ingest log that forgets records older than ``max_age_s`` on its own clock ``now``
    (as the JetStream ingest stream's ``max_age`` does), and whose clock moves on by
    ``store_s`` while a message is stored (before the first record() naming a stored one)."""

    def __init__(self, inner: IngestLog, stores: Stores, max_age_s: float, store_s: float):
        super().__init__(inner, stores)
        self.now = 0.0
        self.max_age_s = max_age_s
        self.store_s = store_s
        self._written: dict[str, float] = {}

    async def lookup(self, key: str, max_age_s: float, *, consistent: bool = False) -> str | None:
        at = self._written.get(key)
        if at is None or self.now - at > min(max_age_s, self.max_age_s):
            return None
        return await super().lookup(key, max_age_s, consistent=consistent)

    async def holder(self, key: str, max_age_s: float) -> Held:
        held = await super().holder(key, max_age_s)
        at = self._written.get(key)
        if at is None or self.now - at > min(max_age_s, self.max_age_s):
            return Held(None, held.version)
        return held

    async def replace(self, key: str, version: int, queue_id: str) -> bool:
        written = await super().replace(key, version, queue_id)
        if written:
            self._written[key] = self.now
        return written

    async def record(self, key: str, queue_id: str) -> None:
        if self.store_s and await self._has_entry(queue_id):
            self.now += self.store_s
            self.store_s = 0.0
        self._written[key] = self.now
        await super().record(key, queue_id)


def _processes(
    n: int, store_timeout_s: float = 0.3
) -> tuple[Stores, list[tuple[Injector, _Gated]]]:
    """``n`` injectors (as ``n`` API pods) over one queue, each with its own gate."""
    stores = open_memory()
    assert stores.ingest is not None
    settings = Settings()
    settings = settings.model_copy(
        update={"smtp": settings.smtp.model_copy(update={"store_timeout_s": store_timeout_s})}
    )
    out = []
    box: list[IngestLog] = [stores.ingest]
    for _ in range(n):
        gated = _Gated(stores.ingest, stores, box)
        own = dataclasses.replace(stores, ingest=gated)
        out.append((Injector(settings, own, NULL_OBSERVER), gated))
    return stores, out


def _two_processes() -> tuple[Stores, tuple[Injector, _Gated], tuple[Injector, _Gated]]:
    stores, (a, b) = _processes(2)
    return stores, a, b


async def _entries(stores: Stores) -> int:
    return len(await stores.entries.page())


async def test_a_retry_at_the_end_of_the_window_is_a_duplicate() -> None:
    """A store that took ``smtp.store_timeout_s``, and a retry just before the window ends
    (counted from the stored record) in a log that forgets records at the window's end: the
    request's fingerprint record must not have expired before its stored record (a 422 for a
    true retry)."""
    settings = Settings()
    window, store_s = settings.api.idempotency_window_s, settings.smtp.store_timeout_s
    stores = open_memory()
    assert stores.ingest is not None
    expiring = _Expiring(stores.ingest, stores, max_age_s=window, store_s=store_s)
    injector = Injector(settings, dataclasses.replace(stores, ingest=expiring), NULL_OBSERVER)
    first = await injector.inject(_tx("one"), WHO, idempotency_key=KEY, fingerprint="f1")
    expiring.now += window - 1.0
    retried = await injector.inject(_tx("one"), WHO, idempotency_key=KEY, fingerprint="f1")
    assert retried.duplicate and retried.queue_id == first.queue_id
    with pytest.raises(RequestRejected):
        await injector.inject(_tx("two"), WHO, idempotency_key=KEY, fingerprint="f2")
    assert await _entries(stores) == 1


async def test_a_retry_read_before_the_first_stored_is_a_duplicate() -> None:
    """B reads the ingest log before A writes anything and goes on after A has finished:
    B's retry (same request) answers with A's queue id, not 422, and stores nothing."""
    stores, (a, _), (b, b_log) = _two_processes()
    b_log.after_first_lookup = True
    tx = _tx("one")
    b_task = asyncio.create_task(b.inject(tx, WHO, idempotency_key=KEY, fingerprint="f1"))
    await b_log.waiting.wait()
    first = await a.inject(tx, WHO, idempotency_key=KEY, fingerprint="f1")
    b_log.gate.set()
    retried = await b_task
    assert not first.duplicate
    assert retried.duplicate and retried.queue_id == first.queue_id
    assert await _entries(stores) == 1


@pytest.mark.parametrize("same_request", [True, False])
async def test_a_request_that_sees_only_the_entry_is_judged_by_its_fingerprint(
    same_request: bool,
) -> None:
    """A's message is stored but A has not written its stored record yet when B (same key)
    arrives: B with the same request answers with A's id; B with a different request is
    refused (422), never answered with A's id (its message would be lost)."""
    stores, (a, a_log), (b, _) = _two_processes()
    a_log.records_once_stored = True
    a_task = asyncio.create_task(a.inject(_tx("one"), WHO, idempotency_key=KEY, fingerprint="f1"))
    await a_log.waiting.wait()
    if same_request:
        retried = await b.inject(_tx("one"), WHO, idempotency_key=KEY, fingerprint="f1")
    else:
        with pytest.raises(RequestRejected) as refused:
            await b.inject(_tx("two"), WHO, idempotency_key=KEY, fingerprint="f2")
        assert refused.value.status == 422
    a_log.gate.set()
    first = await a_task
    assert not first.duplicate
    if same_request:
        assert retried.duplicate and retried.queue_id == first.queue_id
    else:
        assert first.queue_id in str(refused.value)
    assert await _entries(stores) == 1


async def test_two_retries_after_the_first_died_store_once() -> None:
    """A claims the key and dies; B and C (the client's retries, through two other pods)
    wait out ``smtp.store_timeout_s`` and take over at the same moment: exactly one stores
    (the take-over is a compare-and-set on the claim), the other answers with its id."""
    stores, procs = _processes(3)
    (a, a_log), (b, b_log), (c, c_log) = procs
    a_log.hold_after_claim = True
    b_log.claim_barrier = c_log.claim_barrier = asyncio.Barrier(2)
    tx = _tx("one")
    dead = asyncio.create_task(a.inject(tx, WHO, idempotency_key=KEY, fingerprint="f1"))
    await a_log.waiting.wait()
    results = await asyncio.gather(
        b.inject(tx, WHO, idempotency_key=KEY, fingerprint="f1"),
        c.inject(tx, WHO, idempotency_key=KEY, fingerprint="f1"),
    )
    dead.cancel()
    assert sorted(r.duplicate for r in results) == [False, True]
    assert len({r.queue_id for r in results}) == 1
    assert await _entries(stores) == 1


@pytest.mark.parametrize("same_request", [True, False])
async def test_a_first_request_slower_than_the_bound_stores_nothing(same_request: bool) -> None:
    """A claims the key and stalls (a huge upload) past ``smtp.store_timeout_s``; B takes
    the claim over and stores. When A goes on, it finds its claim taken and stores nothing
    (503); A's client's retry then gets B's id, or 422 when B was a different request."""
    stores, (a, a_log), (b, _) = _two_processes()
    a_log.hold_after_claim = True
    slow = asyncio.create_task(a.inject(_tx("one"), WHO, idempotency_key=KEY, fingerprint="f1"))
    await a_log.waiting.wait()
    fingerprint = "f1" if same_request else "f2"
    taken = await b.inject(_tx("one"), WHO, idempotency_key=KEY, fingerprint=fingerprint)
    a_log.gate.set()
    with pytest.raises(NotQueued) as refused:
        await slow
    assert refused.value.reason == "its Idempotency-Key was taken over by a retry"
    assert not taken.duplicate
    assert [v.entry.id for v in await stores.entries.page()] == [taken.queue_id]
    if same_request:
        retried = await a.inject(_tx("one"), WHO, idempotency_key=KEY, fingerprint="f1")
        assert retried.duplicate and retried.queue_id == taken.queue_id
    else:
        with pytest.raises(RequestRejected):
            await a.inject(_tx("one"), WHO, idempotency_key=KEY, fingerprint="f1")


async def test_a_retry_while_the_log_is_lost_after_the_first_stored_is_a_duplicate() -> None:
    """NATS restarts (the ingest log, in memory, is lost) just after A's entry is written;
    A claims its key again and writes its records anew, and B, the identical retry, comes
    while A is between those writes and finds A's claim and entry: B answers with A's id
    (never 422 "a different request": the entry carries the request's digest), and one
    message is stored."""
    stores, ((a, a_log), (b, b_log)) = _processes(2, store_timeout_s=5.0)
    a_log.restart_once_stored = True
    tx = _tx("one")
    first = asyncio.create_task(a.inject(tx, WHO, idempotency_key=KEY, fingerprint="f1"))
    await a_log.waiting.wait()
    retry = asyncio.create_task(b.inject(tx, WHO, idempotency_key=KEY, fingerprint="f1"))
    claimed = asyncio.create_task(b_log.claimed.wait())
    await asyncio.wait({retry, claimed}, return_when=asyncio.FIRST_COMPLETED)
    a_log.gate.set()
    retried, stored = await retry, await first
    claimed.cancel()
    assert not stored.duplicate
    assert retried.duplicate and retried.queue_id == stored.queue_id
    assert await _entries(stores) == 1
