"""Batched direct gets (``jsqueue.store.jetstream.api.DirectBatch``, nats-server >= 2.11
``multi_last``): the entry store's scans and the reconciler read many entries per request.
Counted on the real nats-server connection, not timed."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence

import nats.js.errors
import pytest

from jsqueue.config import NatsSettings
from jsqueue.envelope import Entry
from jsqueue.errors import EntryDeleted, EntryNotFound, StoreError, StoreUnavailable
from jsqueue.names import new_queue_id
from jsqueue.nats_server import EmbeddedNats
from jsqueue.store.base import Stores, Versioned
from jsqueue.store.cas import READ_AHEAD_TIMEOUT_S, read_ahead
from jsqueue.store.jetstream import api, connect_nats
from jsqueue.store.jetstream.api import DIRECT_BATCH, DirectBatch
from jsqueue.store.jetstream.entries import JetStreamEntryStore
from support.nats import make_entry, unique_names


def store_of(stores: Stores) -> JetStreamEntryStore:
    entries = stores.entries
    assert isinstance(entries, JetStreamEntryStore)
    return entries


async def stored(stores: Stores, count: int) -> list[Entry]:
    made = [make_entry() for _ in range(count)]
    for e in made:
        await stores.entries.create(e)
    return made


def requests_sent(entries: JetStreamEntryStore) -> int:
    return int(entries._nc.stats["out_msgs"])


async def test_many_entries_cost_one_request_per_batch(js_stores: Stores) -> None:
    """600 ids (entries, delete markers and never-stored ids mixed) are read in
    ceil(600 / DIRECT_BATCH) requests, not one (or two, for a marker) each, and every
    answer is what ``get`` says of the id."""
    entries = store_of(js_stores)
    made = await stored(js_stores, 400)
    for e in made[::4]:  # a hundred deleted: their markers stay listed
        await entries.delete(e.id)
    ids = [e.id for e in made] + [new_queue_id() for _ in range(200)]
    before = requests_sent(entries)
    got = await entries.get_many(ids)
    assert requests_sent(entries) - before == math.ceil(len(ids) / DIRECT_BATCH)
    for qid, g in zip(ids, got, strict=True):
        try:
            want: Versioned | StoreError = await entries.get(qid)
        except EntryNotFound as e:
            want = e
        if isinstance(want, Versioned):
            assert g == want
        else:
            assert type(g) is type(want), qid
    assert sum(isinstance(g, EntryDeleted) for g in got) == 100


async def test_count_by_state_scans_in_batches(js_stores: Stores) -> None:
    """The depth scan reads the bucket a batch per request: 300 entries, one key listing
    and two reads. A page (``queue ls``, the dashboard's list) reads a batch of its own
    size, not the scan's."""
    entries = store_of(js_stores)
    await stored(js_stores, 300)
    before = requests_sent(entries)
    counts = await entries.count_by_state()
    assert sum(counts.values()) == 300
    assert requests_sent(entries) - before == 1 + math.ceil(300 / DIRECT_BATCH)
    before, received = requests_sent(entries), int(entries._nc.stats["in_msgs"])
    page = await entries.page(limit=10)
    assert len(page) == 10
    assert requests_sent(entries) - before == 2, "a key listing and one batch"
    # the listing's answer, the page's 10 entries and the batch's end: not 256 entries
    assert int(entries._nc.stats["in_msgs"]) - received == 1 + 10 + 1


async def test_a_batch_cut_at_its_byte_bound_is_asked_for_again(
    js_stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server stops a batch at ``max_bytes`` and says how many it left out; those are
    asked for again until every entry is read."""
    entries = store_of(js_stores)
    made = await stored(js_stores, 40)
    monkeypatch.setattr(api, "DIRECT_BATCH_BYTES", 4096)
    before = requests_sent(entries)
    got = await entries.get_many([e.id for e in made])
    assert [g.entry.id for g in got if isinstance(g, Versioned)] == [e.id for e in made]
    assert requests_sent(entries) - before > 1


async def test_an_unreadable_value_is_answered_for_its_id_alone(js_stores: Stores) -> None:
    """A KV value that is not an entry comes back as the StoreError ``get`` raises for
    it; the other ids of the batch are read."""
    entries = store_of(js_stores)
    good = await stored(js_stores, 2)
    bad = new_queue_id()
    await entries.js.publish(f"$KV.{entries.bucket}.{bad}", b"not an entry")
    got = await entries.get_many([good[0].id, bad, good[1].id])
    assert isinstance(got[0], Versioned) and isinstance(got[2], Versioned)
    assert isinstance(got[1], StoreError) and not isinstance(got[1], EntryNotFound)


async def test_a_server_without_batches_is_read_one_get_each(
    js_stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before nats-server 2.11 a batched get answers one message only: the store reads
    each id by its own direct get there, with the same answers."""
    entries = store_of(js_stores)
    made = await stored(js_stores, 5)
    await entries.delete(made[0].id)
    ids = [e.id for e in made] + [new_queue_id()]
    batched = await entries.get_many(ids)
    assert DirectBatch(entries._nc).supported  # the server of the tests is newer
    monkeypatch.setattr(DirectBatch, "supported", property(lambda self: False))
    before = requests_sent(entries)
    single = await entries.get_many(ids)
    assert requests_sent(entries) - before == len(ids)
    assert [type(g) for g in single] == [type(g) for g in batched]
    assert [g for g in single if isinstance(g, Versioned)] == [
        g for g in batched if isinstance(g, Versioned)
    ]


async def test_no_stream_is_an_outage_not_an_answer(
    nats_server: EmbeddedNats, nats_settings: NatsSettings
) -> None:
    """A batch to a stream that is not there (no responders: 503, as during a lost
    leader) is a StoreUnavailable of the read, never "not found" for every id; the
    worker's read-ahead then leaves each item to its own read."""
    nc = await connect_nats(nats_settings, [nats_server.url])
    try:
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await DirectBatch(nc).last("NO_SUCH_STREAM", ["$KV.x.a", "$KV.x.b"], 5.0)
        entries = JetStreamEntryStore(nc, unique_names())  # its bucket was never made
        with pytest.raises(StoreUnavailable):
            await entries.get_many([new_queue_id(), new_queue_id()])
        assert await read_ahead(entries, [new_queue_id(), new_queue_id()]) == {}
    finally:
        await nc.close()


async def test_a_read_ahead_that_hangs_is_given_up_at_once(
    mem_stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's fetch loop waits for the read-ahead of a batch: a read that hangs (an
    outage: a node lost, an election) is given up after READ_AHEAD_TIMEOUT_S, not a whole
    request timeout, and each item is then read by its own task."""
    made = [make_entry() for _ in range(3)]
    for e in made:
        await mem_stores.entries.create(e)
    assert set(await read_ahead(mem_stores.entries, [e.id for e in made])) == {e.id for e in made}

    async def hangs(queue_ids: Sequence[str]) -> list[Versioned | StoreError]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    monkeypatch.setattr(mem_stores.entries, "get_many", hangs)
    started = time.monotonic()
    assert await read_ahead(mem_stores.entries, [e.id for e in made]) == {}
    assert time.monotonic() - started < READ_AHEAD_TIMEOUT_S + 1.0
