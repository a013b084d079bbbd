"""One contract suite for every storage backend (memory and JetStream).

Each test runs once per backend through the parametrised ``stores`` fixture, so the
in-memory fake cannot drift from JetStream (STYLE.md habit 2). Time-dependent tests use
the 2 s ack wait of the test stores and delays of at most 3 s; they wait with ``fetch``
timeouts (the event being awaited), never with bare sleeps.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from jsqueue.envelope import EntryState, RecipientState, WorkItem, utcnow
from jsqueue.errors import (
    BodyCorrupt,
    BodyNotFound,
    EntryDeleted,
    EntryExists,
    EntryNotFound,
    EntryTooLarge,
    InvalidName,
    RevisionConflict,
)
from jsqueue.names import new_queue_id
from jsqueue.pacing import Pacer
from jsqueue.store.base import (
    BodyInfo,
    BodyStore,
    Due,
    EntryStore,
    Scheduler,
    Stores,
)
from jsqueue.store.cache import UNCACHED_MAX, CachedBodyStore
from jsqueue.store.jetstream.bodies import JetStreamBodyStore
from jsqueue.store.layout import open_entry_body
from support.nats import (
    ACK_WAIT_S,
    backlog_is,
    chunks_of,
    corrupt_body,
    fetch_one,
    loop_time,
    make_entry,
    read_body,
)
from support.queue import eventually


def test_backends_satisfy_protocols(stores: Stores) -> None:
    assert isinstance(stores.bodies, BodyStore)
    assert isinstance(stores.entries, EntryStore)
    assert isinstance(stores.scheduler, Scheduler)


# --------------------------------------------------------------------------- bodies


async def test_body_round_trip(stores: Stores) -> None:
    qid = new_queue_id()
    data = b"Subject: hi\r\n\r\nhello\r\n"
    info = await stores.bodies.put(qid, chunks_of(data, 5))
    assert info.size == len(data)
    assert info.digest == hashlib.sha256(data).hexdigest()
    assert await stores.bodies.info(qid) == info
    assert await read_body(stores, qid) == data


async def test_multi_megabyte_body_is_streamed_in_chunks(stores: Stores) -> None:
    qid = new_queue_id()
    data = os.urandom(3 * 1024 * 1024 + 12345)
    info = await stores.bodies.put(qid, chunks_of(data, 8192))
    assert info.size == len(data)
    sizes = []
    parts = []
    async for chunk in stores.bodies.open(qid):
        sizes.append(len(chunk))
        parts.append(chunk)
    assert b"".join(parts) == data
    assert len(sizes) >= 3
    assert max(sizes) <= 1024 * 1024


async def test_empty_body(stores: Stores) -> None:
    qid = new_queue_id()
    info = await stores.bodies.put(qid, chunks_of(b""))
    assert info.size == 0
    assert await read_body(stores, qid) == b""


async def test_body_put_replaces(stores: Stores) -> None:
    qid = new_queue_id()
    await stores.bodies.put(qid, chunks_of(b"old body"))
    info = await stores.bodies.put(qid, chunks_of(b"new body!"))
    assert await read_body(stores, qid) == b"new body!"
    assert await stores.bodies.info(qid) == info


async def test_body_missing_and_delete(stores: Stores) -> None:
    qid = new_queue_id()
    with pytest.raises(BodyNotFound):
        await read_body(stores, qid)
    with pytest.raises(BodyNotFound):
        await stores.bodies.info(qid)
    await stores.bodies.delete(qid)  # idempotent
    await stores.bodies.put(qid, chunks_of(b"x" * 1000))
    await stores.bodies.delete(qid)
    await stores.bodies.delete(qid)
    with pytest.raises(BodyNotFound):
        await read_body(stores, qid)


@pytest.mark.parametrize("size", [0, 100, 2 * 1024 * 1024 + 7])
async def test_fresh_body_round_trip_and_delete(stores: Stores, size: int) -> None:
    """``put(fresh=True)`` (a new queue id, as the front end stores) reads back the same and
    is deleted without a trace; on JetStream meta and chunks share one name and go in one
    purge, from a store that opened the body and from one that did not."""
    data = os.urandom(size)
    for opened in (True, False):
        qid = new_queue_id()
        info = await stores.bodies.put(qid, chunks_of(data, 65536), fresh=True)
        assert info.digest == hashlib.sha256(data).hexdigest()
        bodies = stores.bodies
        if isinstance(bodies, JetStreamBodyStore) and size:
            token = bodies.meta_subject(qid).rsplit(".", 1)[1]
            chunks = await bodies.js.stream_info(
                bodies.stream, subjects_filter=bodies.chunk_subject(token)
            )
            assert chunks.state.subjects == {bodies.chunk_subject(token): -(-size // (1 << 19))}
        if opened:
            assert await read_body(stores, qid) == data
        await stores.bodies.delete(qid)
        with pytest.raises(BodyNotFound):
            await stores.bodies.info(qid)
        await stores.bodies.discard(qid)  # idempotent too
        if isinstance(bodies, JetStreamBodyStore):
            token = bodies.meta_subject(qid).rsplit(".", 1)[1]
            for subject in (bodies.meta_subject(qid), bodies.chunk_subject(token)):
                info_ = await bodies.js.stream_info(bodies.stream, subjects_filter=subject)
                assert not info_.state.subjects, subject


async def _subjects(stores: Stores) -> set[str]:
    """The subjects the body stream holds (empty for the memory store)."""
    bodies = stores.bodies
    if not isinstance(bodies, JetStreamBodyStore):
        return set()
    info = await bodies.js.stream_info(bodies.stream, subjects_filter=">")
    return set(info.state.subjects or {})


async def _body_gone(stores: Stores, queue_id: str, before: set[str]) -> bool:
    """No meta and no chunk of ``queue_id`` left: not found, and the body stream holds no
    subject that it did not hold before the body was stored."""
    try:
        await stores.bodies.info(queue_id)
    except BodyNotFound:
        return await _subjects(stores) <= before
    return False


@pytest.mark.parametrize("size", [0, 100, 2 * 1024 * 1024 + 7])
async def test_discarded_bodies_go_without_a_trace(stores: Stores, size: int) -> None:
    """``discard`` (the body of mail just delivered): a fresh body this store opened goes
    in a purge sent without awaiting an answer, any other as by ``delete``; either way
    meta and chunks are gone soon after, and a discarded body reads as not found."""
    data = os.urandom(size)
    for fresh, opened in ((True, True), (True, False), (False, True)):
        before = await _subjects(stores)
        qid = new_queue_id()
        await stores.bodies.put(qid, chunks_of(data, 65536), fresh=fresh)
        assert (
            size == 0
            or not isinstance(stores.bodies, JetStreamBodyStore)
            or (await _subjects(stores) > before)
        )
        if opened:
            assert await read_body(stores, qid) == data
        await stores.bodies.discard(qid)
        await eventually(
            functools.partial(_body_gone, stores, qid, before),
            what=f"body gone (fresh={fresh}, opened={opened})",
        )
        with pytest.raises(BodyNotFound):
            await read_body(stores, qid)


async def read_expecting(stores: Stores, queue_id: str, expect: BodyInfo) -> bytes:
    return b"".join([c async for c in stores.bodies.open(queue_id, expect=expect)])


@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize("size", [0, 4096, 2 * 1024 * 1024 + 7])
async def test_open_with_the_expected_size_and_digest(
    stores: Stores, fresh: bool, size: int
) -> None:
    """``open(expect=...)`` (the entry's size and digest, as the worker reads) returns the
    body; a body that is not the expected one raises BodyCorrupt before its last chunk."""
    qid = new_queue_id()
    data = os.urandom(size)
    info = await stores.bodies.put(qid, chunks_of(data, 100_000), fresh=fresh)
    assert await read_expecting(stores, qid, info) == data
    for wrong in (
        BodyInfo(size=info.size + 1, digest=info.digest),
        BodyInfo(size=info.size, digest=hashlib.sha256(b"other").hexdigest()),
    ):
        received = []
        with pytest.raises(BodyCorrupt):
            async for chunk in stores.bodies.open(qid, expect=wrong):
                received.append(chunk)
        assert sum(map(len, received)) < max(size, 1)
    with pytest.raises(BodyNotFound):
        await read_expecting(stores, new_queue_id(), info)


async def test_fresh_body_read_with_expect_needs_no_meta(js_stores: Stores) -> None:
    """JetStream: the worker's read of a fresh body takes the chunks by name, without the
    meta record (shown by removing the meta behind the store's back)."""
    bodies = js_stores.bodies
    assert isinstance(bodies, JetStreamBodyStore)
    qid = new_queue_id()
    data = os.urandom(3000)
    info = await bodies.put(qid, chunks_of(data), fresh=True)
    await bodies.js.purge_stream(bodies.stream, subject=bodies.meta_subject(qid))
    assert await read_expecting(js_stores, qid, info) == data
    with pytest.raises(BodyNotFound):
        await read_body(js_stores, qid)


@pytest.mark.parametrize("size", [100, 2 * 1024 * 1024 + 7])
async def test_corrupt_body_raises_before_last_chunk(stores: Stores, size: int) -> None:
    qid = new_queue_id()
    data = os.urandom(size)
    await stores.bodies.put(qid, chunks_of(data))
    await corrupt_body(stores, qid)
    received = 0
    with pytest.raises(BodyCorrupt):
        async for chunk in stores.bodies.open(qid):
            received += len(chunk)
    assert received < size  # the final chunk was never handed out


async def test_failing_source_stores_nothing(stores: Stores) -> None:
    class ClientGone(Exception):
        pass

    async def broken() -> AsyncIterator[bytes]:
        yield os.urandom(700 * 1024)
        raise ClientGone

    qid = new_queue_id()
    with pytest.raises(ClientGone):  # the caller's own error, not a store error
        await stores.bodies.put(qid, broken())
    with pytest.raises(BodyNotFound):
        await stores.bodies.info(qid)


async def test_body_invalid_id(stores: Stores) -> None:
    for bad in ("", "a.b", "*", ">", "has space", "X" * 26):
        with pytest.raises(InvalidName):
            await stores.bodies.put(bad, chunks_of(b"x"))
        with pytest.raises(InvalidName):
            await read_body(stores, bad)
        with pytest.raises(InvalidName):
            await stores.bodies.info(bad)


# --------------------------------------------------------------------------- entries


async def test_entry_create_get_update(stores: Stores) -> None:
    entry = make_entry()
    rev = await stores.entries.create(entry)
    got = await stores.entries.get(entry.id)
    assert got.entry == entry and got.revision == rev
    with pytest.raises(EntryExists):
        await stores.entries.create(entry)

    changed = entry.model_copy(update={"generation": 1})
    rev2 = await stores.entries.update(changed, rev)
    assert rev2 > rev
    assert await stores.entries.get(entry.id) == type(got)(changed, rev2)
    with pytest.raises(RevisionConflict):
        await stores.entries.update(entry, rev)  # stale revision
    with pytest.raises(RevisionConflict):
        await stores.entries.update(make_entry(), 1)  # never created


async def test_entry_with_an_inline_body(stores: Stores) -> None:
    """An inline body (``smtp.inline_body_max``) is stored, read, updated and listed with its entry,
    octet for octet; an entry larger than ``max_value_size`` is refused, nothing stored."""
    body = b"Subject: inline\r\n\r\n" + bytes(range(256)) * 16 + b"\r\n"
    entry = make_entry().model_copy(update={"inline_body": body, "size": len(body)})
    rev = await stores.entries.create(entry)
    assert (await stores.entries.get(entry.id)).entry.inline_body == body
    changed = entry.model_copy(update={"generation": 2})
    rev = await stores.entries.update(changed, rev)
    [listed] = await stores.entries.page()
    assert listed.entry == changed and listed.entry.inline_body == body
    assert listed.revision == rev

    limit = stores.entries.max_value_size
    assert limit >= 512 * 1024
    too_big = make_entry().model_copy(update={"inline_body": b"x" * limit})
    with pytest.raises(EntryTooLarge):
        await stores.entries.create(too_big)
    with pytest.raises(EntryNotFound):
        await stores.entries.get(too_big.id)
    with pytest.raises(EntryTooLarge):
        await stores.entries.update(changed.model_copy(update={"inline_body": b"x" * limit}), rev)
    assert (await stores.entries.get(entry.id)).entry.inline_body == body


async def test_an_entry_body_is_read_inline_or_from_the_body_store(stores: Stores) -> None:
    """:func:`open_entry_body`: the inline body or the stored one, either checked against
    the entry's size and digest (BodyCorrupt, as :meth:`BodyStore.open` raises)."""
    body = b"Subject: b\r\n\r\n" + b"z" * 5000 + b"\r\n"
    info = BodyInfo(size=len(body), digest=hashlib.sha256(body).hexdigest())
    inline = make_entry().model_copy(
        update={"inline_body": body, "size": info.size, "digest": info.digest}
    )
    stored = make_entry().model_copy(update={"size": info.size, "digest": info.digest})
    await stores.bodies.put(stored.id, chunks_of(body, 1000), fresh=True)
    for entry in (inline, stored):
        assert b"".join([c async for c in open_entry_body(stores.bodies, entry)]) == body
    damaged = inline.model_copy(update={"inline_body": body[:-3] + b"Z\r\n"})
    wrong_size = stored.model_copy(update={"size": info.size + 1})
    for entry in (damaged, wrong_size):
        with pytest.raises(BodyCorrupt):
            _ = [c async for c in open_entry_body(stores.bodies, entry)]
    with pytest.raises(BodyNotFound):
        _ = [c async for c in open_entry_body(stores.bodies, make_entry())]


async def test_entry_not_found_and_invalid(stores: Stores) -> None:
    with pytest.raises(EntryNotFound):
        await stores.entries.get(new_queue_id())
    for bad in ("", "a.b", "q*", "q>", "a b", "0" * 27):
        with pytest.raises(InvalidName):
            await stores.entries.get(bad)
        with pytest.raises(InvalidName):
            await stores.entries.delete(bad)


async def test_entry_delete(stores: Stores) -> None:
    entry = make_entry()
    rev = await stores.entries.create(entry)
    with pytest.raises(RevisionConflict):
        await stores.entries.delete(entry.id, revision=rev + 1000)
    with pytest.raises(EntryNotFound) as never_stored:
        await stores.entries.get(new_queue_id())
    assert not isinstance(never_stored.value, EntryDeleted)  # "not yet" for a new id
    await stores.entries.delete(entry.id, revision=rev)
    with pytest.raises(EntryDeleted):  # a worker drops its items at once
        await stores.entries.get(entry.id)
    await stores.entries.delete(entry.id)  # idempotent without a revision
    with pytest.raises(RevisionConflict):
        await stores.entries.update(entry, rev)  # gone
    with pytest.raises(RevisionConflict):
        await stores.entries.delete(entry.id, revision=rev)
    assert await stores.entries.page() == []
    # A deleted id can be created again.
    rev3 = await stores.entries.create(entry)
    assert (await stores.entries.get(entry.id)).revision == rev3


async def test_get_many_answers_each_id_as_get_would(stores: Stores) -> None:
    """A batched read: one item per id, in order (repeats too), each the entry and its
    revision or the error ``get`` raises for it; an invalid id is refused as by ``get``."""
    a, b, deleted = make_entry(), make_entry(), make_entry()
    rev_a, rev_b = await stores.entries.create(a), await stores.entries.create(b)
    await stores.entries.delete(deleted.id, revision=await stores.entries.create(deleted))
    never = new_queue_id()
    got = await stores.entries.get_many([a.id, deleted.id, never, b.id, a.id])
    assert [type(g).__name__ for g in got] == [
        "Versioned",
        "EntryDeleted",
        "EntryNotFound",
        "Versioned",
        "Versioned",
    ]
    assert got[0] == await stores.entries.get(a.id) and got[0] == got[4]
    assert got[3] == await stores.entries.get(b.id)
    assert [g.revision for g in (got[0], got[3]) if not isinstance(g, Exception)] == [
        rev_a,
        rev_b,
    ]
    assert await stores.entries.get_many([]) == []
    with pytest.raises(InvalidName):
        await stores.entries.get_many([a.id, "a.b"])


async def test_entry_discard_leaves_no_trace(stores: Stores) -> None:
    """``discard`` (an ingest that failed after the entry was written): afterwards the id
    reads as never stored (EntryNotFound, not EntryDeleted), no page lists it, and it
    can be created again. Idempotent, on a missing id too."""
    entry = make_entry()
    await stores.entries.create(entry)
    await stores.entries.discard(entry.id)
    with pytest.raises(EntryNotFound) as gone:
        await stores.entries.get(entry.id)
    assert not isinstance(gone.value, EntryDeleted)
    assert entry.id not in [v.entry.id for v in await stores.entries.page()]
    await stores.entries.discard(entry.id)
    await stores.entries.discard(new_queue_id())
    with pytest.raises(InvalidName):
        await stores.entries.discard("a.b")
    rev = await stores.entries.create(entry)
    assert (await stores.entries.get(entry.id)).revision == rev


async def test_concurrent_updaters_exactly_one_wins(stores: Stores) -> None:
    entry = make_entry()
    rev = await stores.entries.create(entry)
    for round_ in range(5):
        a = entry.model_copy(update={"last_error": f"a{round_}"})
        b = entry.model_copy(update={"last_error": f"b{round_}"})
        results = await asyncio.gather(
            stores.entries.update(a, rev), stores.entries.update(b, rev), return_exceptions=True
        )
        wins = [r for r in results if isinstance(r, int)]
        losses = [r for r in results if isinstance(r, RevisionConflict)]
        assert len(wins) == 1 and len(losses) == 1, results
        rev = wins[0]
        assert (await stores.entries.get(entry.id)).revision == rev


async def test_page_in_key_order_with_state_filter(stores: Stores) -> None:
    base_ms = 1_700_000_000_000
    states = [
        RecipientState.PENDING,
        RecipientState.DEFERRED,
        RecipientState.DELIVERED,
        RecipientState.PENDING,
        RecipientState.DEFERRED,
        RecipientState.PENDING,
        RecipientState.BOUNCED,
    ]
    ids = [new_queue_id(now_ms=base_ms + i) for i in range(len(states))]
    # Create in reverse, then update the first: write order differs from key order.
    revs = {}
    for qid, st in reversed(list(zip(ids, states, strict=True))):
        revs[qid] = await stores.entries.create(make_entry(qid, st))
    await stores.entries.update(make_entry(ids[0], RecipientState.PENDING), revs[ids[0]])

    first = await stores.entries.page(limit=3)
    assert [v.entry.id for v in first] == ids[:3]
    second = await stores.entries.page(after=first[-1].entry.id, limit=3)
    assert [v.entry.id for v in second] == ids[3:6]
    third = await stores.entries.page(after=second[-1].entry.id, limit=3)
    assert [v.entry.id for v in third] == ids[6:]
    assert await stores.entries.page(after=ids[-1]) == []

    pending = await stores.entries.page(state=EntryState.PENDING, limit=2)
    assert [v.entry.id for v in pending] == [ids[0], ids[3]]
    rest = await stores.entries.page(state=EntryState.PENDING, after=ids[3], limit=2)
    assert [v.entry.id for v in rest] == [ids[5]]
    done = await stores.entries.page(state=EntryState.DONE)
    assert [v.entry.id for v in done] == [ids[2], ids[6]]
    for v in first:
        assert v.revision == (await stores.entries.get(v.entry.id)).revision


async def test_count_by_state(stores: Stores) -> None:
    assert await stores.entries.count_by_state() == {}
    for st in (RecipientState.PENDING, RecipientState.PENDING, RecipientState.DEFERRED):
        await stores.entries.create(make_entry(None, st))
    await stores.entries.create(make_entry(None, RecipientState.DELIVERED, RecipientState.ACTIVE))
    await stores.entries.create(make_entry(None, RecipientState.PENDING, held=True))
    gone = make_entry()
    await stores.entries.create(gone)
    await stores.entries.delete(gone.id)
    assert await stores.entries.count_by_state() == {
        EntryState.PENDING: 2,
        EntryState.DEFERRED: 1,
        EntryState.ACTIVE: 1,
        EntryState.HELD: 1,
    }


async def test_count_by_state_rests_as_its_pacer_asks(stores: Stores) -> None:
    """A paced depth scan (a million entries in production) counts the same and rests as
    it reads: the pacer's rests are taken, not skipped, by every backend."""
    for _ in range(3):
        await stores.entries.create(make_entry(None))
    rests: list[float] = []
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0  # every look at the clock: a second of work
        return now[0]

    async def sleep(seconds: float) -> None:
        rests.append(seconds)

    pacer = Pacer(0.25, slice_s=0.5, clock=clock, sleep=sleep)
    assert await stores.entries.count_by_state(pacer) == {EntryState.PENDING: 3}
    assert rests and all(r == pytest.approx(3.0) for r in rests)  # 1 s worked, 3 s rested


# --------------------------------------------------------------------------- scheduler


async def test_schedule_fetch_ack(stores: Stores) -> None:
    s = stores.scheduler
    item = WorkItem(new_queue_id(), "example.com", 3)
    await s.schedule(item)
    due = await fetch_one(s, 2.0)
    assert due.item == item
    assert due.deliveries == 1
    await due.ack()
    await backlog_is(s, 0)
    assert await s.fetch(10, 0.3) == []


async def test_not_yet_due_item_not_returned_early(stores: Stores) -> None:
    s = stores.scheduler
    item = WorkItem(new_queue_id(), "example.com")
    at = utcnow() + timedelta(seconds=1.5)
    await s.schedule(item, at)
    assert await s.fetch(10, 0.5) == []
    due = await fetch_one(s, 3.0)
    assert utcnow() >= at - timedelta(milliseconds=50)
    assert due.item == item
    await due.ack()


async def test_retry_with_delay(stores: Stores) -> None:
    s = stores.scheduler
    await s.schedule(WorkItem(new_queue_id(), "example.com"))
    due = await fetch_one(s, 2.0)
    start = loop_time()
    await due.retry(1.0)
    assert await s.fetch(10, 0.5) == []
    again = await fetch_one(s, 3.0)
    assert 0.9 <= loop_time() - start <= 2.5
    assert again.item == due.item
    assert again.deliveries == 2
    await again.ack()
    await backlog_is(s, 0)


async def test_term_drops_item(stores: Stores) -> None:
    s = stores.scheduler
    await s.schedule(WorkItem(new_queue_id(), "example.com"))
    due = await fetch_one(s, 2.0)
    await due.term()
    await due.ack()  # settling twice is a no-op
    await backlog_is(s, 0)
    assert await s.fetch(10, 0.3) == []  # backlog 0: it cannot come back


async def test_unsettled_item_redelivered_after_ack_wait(stores: Stores) -> None:
    s = stores.scheduler
    await s.schedule(WorkItem(new_queue_id(), "example.com"))
    due = await fetch_one(s, 2.0)
    start = loop_time()
    again = await fetch_one(s, ACK_WAIT_S + 2.0)
    assert ACK_WAIT_S - 0.2 <= loop_time() - start <= ACK_WAIT_S + 1.5
    assert again.item == due.item and again.deliveries == 2
    await again.ack()


async def test_in_progress_extends_ack_wait(stores: Stores) -> None:
    s = stores.scheduler
    await s.schedule(WorkItem(new_queue_id(), "example.com"))
    due = await fetch_one(s, 2.0)
    assert await s.fetch(10, 1.2) == []
    await due.in_progress()
    # Without in_progress it would be back 2 s after the fetch (0.8 s from now).
    assert await s.fetch(10, 1.5) == []
    again = await fetch_one(s, 2.0)
    assert again.deliveries == 2
    await again.ack()


async def test_flush_of_deferred_item_takes_effect_within_a_second(stores: Stores) -> None:
    s = stores.scheduler
    qid = new_queue_id()
    # An item deferred by a NAK for an hour ...
    await s.schedule(WorkItem(qid, "example.com"))
    due = await fetch_one(s, 2.0)
    await due.retry(3600)
    # ... and one scheduled an hour ahead.
    await s.schedule(WorkItem(qid, "example.net"), utcnow() + timedelta(hours=1))
    assert await s.fetch(10, 0.3) == []
    start = loop_time()
    await s.flush(WorkItem(qid, "example.com", 1))
    await s.flush(WorkItem(qid, "example.net", 0))  # same generation as the purged one
    got: list[Due] = []
    while len(got) < 2 and loop_time() - start < 3.0:
        got += await s.fetch(10, 3.0 - (loop_time() - start))
    assert loop_time() - start <= 1.5
    assert sorted((d.item.domain, d.item.generation) for d in got) == [
        ("example.com", 1),
        ("example.net", 0),
    ]
    for d in got:
        await d.ack()
    await backlog_is(s, 0)


async def test_cancel_removes_every_item_of_an_entry(stores: Stores) -> None:
    s = stores.scheduler
    qid, other = new_queue_id(), new_queue_id()
    await s.schedule(WorkItem(qid, "example.com"))
    await s.schedule(WorkItem(qid, "example.net"), utcnow() + timedelta(hours=1))
    await s.schedule(WorkItem(other, "example.com"))
    await s.cancel(qid)
    await s.cancel(qid)  # idempotent
    due = await fetch_one(s, 2.0)
    assert due.item.queue_id == other
    await due.ack()
    await backlog_is(s, 0)
    with pytest.raises(InvalidName):
        await s.cancel("not.an.id")


async def test_backlog_counts_due_deferred_and_in_flight(stores: Stores) -> None:
    s = stores.scheduler
    assert await s.backlog() == 0
    await s.schedule(WorkItem(new_queue_id(), "a.example"))
    await s.schedule(WorkItem(new_queue_id(), "b.example"))
    await s.schedule(WorkItem(new_queue_id(), "c.example"), utcnow() + timedelta(hours=1))
    assert await s.backlog() == 3
    got = await s.fetch(10, 2.0)
    assert len(got) == 2
    assert await s.backlog() == 3
    await got[0].ack()
    await backlog_is(s, 2)
    await got[1].retry(3600)
    await backlog_is(s, 2)


async def test_schedule_is_idempotent(stores: Stores) -> None:
    s = stores.scheduler
    item = WorkItem(new_queue_id(), "example.com", 0)
    await s.schedule(item)
    await s.schedule(item)
    await s.schedule(WorkItem(item.queue_id, "example.com", 1))  # a new generation is new
    got = await s.fetch(10, 2.0)
    got += await s.fetch(10, 0.3)
    assert sorted(d.item.generation for d in got) == [0, 1]
    for d in got:
        await d.ack()


async def test_schedule_rejects_invalid_names(stores: Stores) -> None:
    s = stores.scheduler
    for item in (
        WorkItem("not-a-queue-id", "example.com"),
        WorkItem(new_queue_id(), "exa mple.com"),
        WorkItem(new_queue_id(), "example.*"),
        WorkItem(new_queue_id(), ">"),
        WorkItem(new_queue_id(), ""),
    ):
        with pytest.raises(InvalidName):
            await s.schedule(item)
    assert await s.backlog() == 0


# --------------------------------------------------------------------------- ingest log


async def test_ingest_claim_records_once_per_window(stores: Stores) -> None:
    """IngestLog.claim: the first claim of a key records its id; a claim of another id
    within the window gets the first back (and changes nothing); a repeated claim of the
    same id succeeds (a retried write); past the window the key is taken over."""
    log = stores.ingest
    assert log is not None
    key = hashlib.sha256(os.urandom(8)).hexdigest()
    first, second = new_queue_id(), new_queue_id()
    assert await log.claim(key, first, 60) is None
    assert await log.claim(key, second, 60) == first
    assert await log.claim(key, first, 60) is None
    assert await log.lookup(key, 60) == first
    assert await log.lookup(key, 60, consistent=True) == first  # the leader's answer
    assert await log.claim(key, second, -1) is None  # the record is older than the window
    assert await log.lookup(key, 60) == second
    assert await log.lookup(key, -1, consistent=True) is None  # past the window
    with pytest.raises(InvalidName):
        await log.claim("A" * 64, first, 60)


async def test_ingest_replace_is_a_compare_and_set_on_the_version_read(stores: Stores) -> None:
    """IngestLog.holder / replace: a key without a record is version 0 and ``replace(0)``
    takes it; a write with a version read before another write is refused and changes
    nothing; rewriting the same id is a refresh with a new version; a record past the
    window or forgotten names nothing, and its version takes its place."""
    log = stores.ingest
    assert log is not None
    key = hashlib.sha256(os.urandom(8)).hexdigest()
    first, second = new_queue_id(), new_queue_id()
    assert await log.holder(key, 60) == (None, 0)
    assert await log.replace(key, 0, first)
    held = await log.holder(key, 60)
    assert held.queue_id == first and held.version != 0
    assert not await log.replace(key, 0, second)  # a record is there now
    assert await log.replace(key, held.version, first)  # a refresh
    refreshed = await log.holder(key, 60)
    assert refreshed.queue_id == first and refreshed.version != held.version
    assert not await log.replace(key, held.version, second)  # read before the refresh
    assert await log.lookup(key, 60) == first
    expired = await log.holder(key, -1)
    assert expired == (None, refreshed.version)
    assert await log.replace(key, expired.version, second)
    assert await log.claim(key, first, 60) == second
    await log.forget(key, second)

    async def forgotten() -> bool:
        return (await log.holder(key, 60)).queue_id is None

    await eventually(forgotten, what="the forgotten record gone")
    assert await log.replace(key, (await log.holder(key, 60)).version, first)
    assert await log.lookup(key, 60, consistent=True) == first
    with pytest.raises(InvalidName):
        await log.holder("A" * 64, 60)


async def test_ingest_forget_removes_only_the_record_of_that_queue_id(stores: Stores) -> None:
    """IngestLog.forget: the record goes when it still names that queue id (the client saw
    its 250); a record naming another id stays; forgetting twice or a missing key is fine.
    On JetStream the delete is sent without awaiting an answer: the next claim on the same
    connection is stored after it (one stream, in order), a read may come a moment early."""
    log = stores.ingest
    assert log is not None
    key = hashlib.sha256(os.urandom(8)).hexdigest()
    first, second = new_queue_id(), new_queue_id()
    assert await log.claim(key, first, 60) is None
    await log.forget(key, second)
    assert await log.lookup(key, 60) == first
    await log.forget(key, first)
    assert await log.claim(key, second, 60) is None  # a new message takes the key
    assert await log.lookup(key, 60) == second
    await log.forget(key, second)

    async def forgotten() -> bool:
        return await log.lookup(key, 60) is None

    await eventually(forgotten, what="the forgotten record gone")
    await log.forget(key, second)  # idempotent
    assert await log.claim(key, second, 60) is None  # and taken again
    assert await log.lookup(key, 60) == second
    await log.forget(hashlib.sha256(b"never").hexdigest(), first)
    with pytest.raises(InvalidName):
        await log.forget("A" * 64, first)


def test_queue_ids_never_repeat_within_one_millisecond() -> None:
    """Ids made in the same millisecond by any number of processes differ: 80 random bits
    after the time (a restart or a second front end cannot repeat an id)."""
    ids = {new_queue_id(now_ms=1_700_000_000_000) for _ in range(20_000)}
    assert len(ids) == 20_000


# --------------------------------------------------------------------------- body cache

MIB = 1024 * 1024


@pytest.fixture
async def cache(stores: Stores, tmp_path: Path) -> AsyncIterator[CachedBodyStore]:
    c = CachedBodyStore(stores.bodies, max_bytes=3 * MIB, directory=tmp_path / "cache")
    yield c
    await c.close()


async def read_cached(cache: CachedBodyStore, queue_id: str) -> bytes:
    return b"".join([chunk async for chunk in cache.open(queue_id)])


async def test_cache_downloads_on_the_second_open_then_serves_the_file(
    stores: Stores, cache: CachedBodyStore
) -> None:
    """The first open streams from the store and writes no file (a body read once, the
    common case, costs no disk work); the second downloads it; later ones hit the file."""
    assert isinstance(cache, BodyStore)
    qid = new_queue_id()
    data = os.urandom(MIB + 3)
    info = await cache.put(qid, chunks_of(data))
    assert await read_cached(cache, qid) == data
    assert not cache.cached(qid) and list(cache.directory.iterdir()) == []
    assert await read_cached(cache, qid) == data
    assert await read_cached(cache, qid) == data
    assert (cache.misses, cache.hits) == (2, 1)
    assert cache.cached(qid) and cache.used_bytes == len(data)
    assert await cache.info(qid) == info
    await stores.bodies.delete(qid)  # behind the cache's back: still served from the file
    assert await read_cached(cache, qid) == data
    await cache.delete(qid)
    assert not cache.cached(qid) and cache.used_bytes == 0
    with pytest.raises(BodyNotFound):
        await read_cached(cache, qid)


async def test_small_bodies_are_served_but_not_cached(
    stores: Stores, cache: CachedBodyStore
) -> None:
    """Up to UNCACHED_MAX octets a body is read from the store on every open (two direct
    gets cost less than a file written, read and removed); one octet more and it is cached
    as a file from its second open on."""
    small, small_data = new_queue_id(), os.urandom(UNCACHED_MAX)
    larger, larger_data = new_queue_id(), os.urandom(UNCACHED_MAX + 1)
    for qid, data in ((small, small_data), (larger, larger_data)):
        await stores.bodies.put(qid, chunks_of(data, 1000))
    for _ in range(3):
        assert await read_cached(cache, small) == small_data
        assert await read_cached(cache, larger) == larger_data
    assert (cache.misses, cache.hits) == (5, 1)
    assert not cache.cached(small) and cache.cached(larger)
    assert [p.name for p in cache.directory.iterdir()] == [f"{larger}.body"]
    await stores.bodies.delete(small)
    with pytest.raises(BodyNotFound):
        await read_cached(cache, small)


async def test_cache_smaller_than_a_small_body(stores: Stores, tmp_path: Path) -> None:
    """A cache limit below UNCACHED_MAX still serves whole bodies, straight from the store."""
    tiny = CachedBodyStore(stores.bodies, max_bytes=1000, directory=tmp_path / "tiny")
    qid, data = new_queue_id(), os.urandom(3000)
    await stores.bodies.put(qid, chunks_of(data, 700))
    try:
        assert await read_cached(tiny, qid) == data
        assert not tiny.cached(qid)
    finally:
        await tiny.close()


async def test_cache_is_a_bounded_lru(stores: Stores, cache: CachedBodyStore) -> None:
    bodies = {}
    for name in ("a", "b", "c"):
        bodies[name] = (new_queue_id(), os.urandom(MIB + MIB // 5))
        await stores.bodies.put(bodies[name][0], chunks_of(bodies[name][1]))
    for name in ("a", "a", "b", "b", "a", "c", "c"):  # a used after b: b is least recent
        qid, data = bodies[name]
        assert await read_cached(cache, qid) == data
    assert cache.cached(bodies["a"][0]) and cache.cached(bodies["c"][0])
    assert not cache.cached(bodies["b"][0])
    assert cache.used_bytes <= cache.max_bytes
    assert len(list(cache.directory.iterdir())) == 2
    big, big_data = new_queue_id(), os.urandom(4 * MIB)  # larger than the cache: streamed
    await stores.bodies.put(big, chunks_of(big_data))
    for _ in range(2):
        assert await read_cached(cache, big) == big_data
    assert not cache.cached(big)


@pytest.mark.parametrize("size", [1000, UNCACHED_MAX + 1])
async def test_cache_never_keeps_a_corrupt_body(
    stores: Stores, cache: CachedBodyStore, size: int
) -> None:
    """Streamed (first open) or downloaded (second), a corrupt body raises and leaves no
    file behind."""
    qid = new_queue_id()
    await stores.bodies.put(qid, chunks_of(os.urandom(size), 1000))
    await corrupt_body(stores, qid)
    for _ in range(2):
        with pytest.raises(BodyCorrupt):
            await read_cached(cache, qid)
    assert not cache.cached(qid)
    assert list(cache.directory.iterdir()) == []


async def test_damaged_cache_file_is_detected_and_dropped(
    stores: Stores, cache: CachedBodyStore
) -> None:
    qid = new_queue_id()
    data = os.urandom(MIB)
    await stores.bodies.put(qid, chunks_of(data))
    for _ in range(2):
        assert await read_cached(cache, qid) == data
    (path,) = cache.directory.iterdir()
    raw = bytearray(path.read_bytes())
    raw[10] ^= 1
    path.write_bytes(bytes(raw))
    received = 0
    with pytest.raises(BodyCorrupt):
        async for chunk in cache.open(qid):
            received += len(chunk)
    assert received < len(data)
    assert not cache.cached(qid)
    assert await read_cached(cache, qid) == data  # read from the store again


async def test_jetstream_body_reads_create_no_consumers(js_stores: Stores) -> None:
    """DESIGN.md §7: a consumer per read exhausts the stream's consumer limit."""
    qid = new_queue_id()
    data = os.urandom(600 * 1024)
    await js_stores.bodies.put(qid, chunks_of(data))
    reads = await asyncio.gather(*(read_body(js_stores, qid) for _ in range(50)))
    assert all(r == data for r in reads)
    bodies = js_stores.bodies
    assert isinstance(bodies, JetStreamBodyStore)
    info = await bodies.js.stream_info(bodies.stream)
    assert info.state.consumer_count == 0


async def test_presence_marks_expire_and_first_write_finds_a_live_name(stores: Stores) -> None:
    """Presence (issue item 4): a beat is seen with its process and a revision that changes
    at every beat; a first write of a live name is refused; a mark expires after its time to
    live, and leave removes it at once."""
    presence = stores.presence
    assert presence is not None
    assert await presence.seen("pod-a") is None
    assert await presence.beat("pod-a", "p1", 1.0, first=True)
    first = await presence.seen("pod-a")
    assert first is not None and first.instance == "p1"
    assert not await presence.beat("pod-a", "p2", 1.0, first=True)
    assert await presence.beat("pod-a", "p1", 1.0)
    second = await presence.seen("pod-a")
    assert second is not None and second.revision != first.revision
    for _ in range(50):  # the 1 s time to live runs out (polled; no event to wait for)
        if await presence.seen("pod-a") is None:
            break
        await asyncio.sleep(0.1)
    assert await presence.seen("pod-a") is None
    assert await presence.beat("pod-a", "p2", 30.0, first=True)
    await presence.leave("pod-a")
    assert await presence.seen("pod-a") is None
