"""The reconciler (jsqueue.reconciler): what it recognises, what it repairs, what it leaves
alone, and its cluster-wide lock. Real nats-server, DNS server and MXes; crash leftovers are
made the way a crash leaves them (a store write that never got its partner, or a front-end
process SIGKILLed mid-DATA)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from jsqueue.config import ReconcilerSettings
from jsqueue.envelope import Entry, Lease, RecipientState, WorkItem, utcnow
from jsqueue.errors import BodyNotFound
from jsqueue.names import Names, new_queue_id
from jsqueue.nats_server import EmbeddedNats
from jsqueue.pacing import cycle_rest
from jsqueue.reconciler import (
    PASS_SHARE,
    Action,
    ActionKind,
    Reconciler,
    Report,
    open_reconciler,
    review,
)
from jsqueue.store.base import Stores
from jsqueue.store.jetstream.entries import JetStreamEntryStore
from jsqueue.store.jetstream.inventory import JetStreamInventory
from jsqueue.store.jetstream.lock import JetStreamLock
from support.cluster import JsqueueProc, free_port, jsqueue_env
from support.mx import SmtpdMx
from support.nats import chunks_of, make_entry
from support.queue import Harness, eventually

DOMAIN = "lost.example.test"
ZONE = f"{DOMAIN}. 300 IN MX 10 mx.{DOMAIN}.\nmx.{DOMAIN}. 300 IN A 127.0.2.120\n"
HOUR = timedelta(hours=1)
SETTINGS = ReconcilerSettings(
    interval_s=0.2,
    lost_trigger_after_s=60.0,
    orphan_after_s=600.0,
    dsn_retention_s=86400.0,
    lock_ttl_s=3.0,
)
NAMES = Names("t")
MakeReconciler = Callable[..., Awaitable[Reconciler]]


def entry(
    *states: RecipientState,
    domain: str = DOMAIN,
    age: timedelta = HOUR,
    **changes: object,
) -> Entry:
    """An entry created ``age`` ago with one recipient per state."""
    e = make_entry(None, *states, domain=domain).model_copy(
        update={"created_at": utcnow() - age, **changes}
    )
    for r in e.recipients:
        if r.state.is_final:
            r.attempts, r.last_attempt_at = 1, utcnow() - age
    return e


def decide(e: Entry, *, subjects: set[str] | None = None, has_body: bool = True) -> list[Action]:
    return review(
        e,
        work_subjects=subjects or set(),
        has_body=has_body,
        names=NAMES,
        now=utcnow(),
        settings=SETTINGS,
    )


# --------------------------------------------------------------------------- pure review


def test_review_requeues_an_overdue_open_domain_without_work_item() -> None:
    e = entry()
    assert decide(e) == [
        Action(ActionKind.REQUEUE, e.id, f"work item for {DOMAIN} lost", WorkItem(e.id, DOMAIN))
    ]
    flushed = e.model_copy(update={"generation": 4})
    assert decide(flushed)[0].item == WorkItem(e.id, DOMAIN, 4)


def test_review_leaves_consistent_or_young_entries_alone() -> None:
    e = entry()
    assert decide(e, subjects={NAMES.work_subject(e.id, DOMAIN)}) == []
    assert decide(entry(age=timedelta(seconds=10))) == []  # the front end may still publish
    assert decide(entry(held=True)) == []  # held items are dropped on purpose
    live = {DOMAIN: Lease(owner="w", until=utcnow() + HOUR)}
    assert decide(entry(leases=live)) == []  # a worker is on it
    dead = {DOMAIN: Lease(owner="w", until=utcnow() - HOUR)}
    assert [a.kind for a in decide(entry(leases=dead))] == [ActionKind.REQUEUE]
    later = entry(RecipientState.DEFERRED)
    later.recipients[0].next_attempt_at = utcnow() + HOUR
    later.recipients[0].attempts = 1
    assert decide(later) == []  # lost or not, it is not due: found once it is overdue


def test_review_checks_each_destination_domain() -> None:
    e = make_entry(None).model_copy(update={"created_at": utcnow() - HOUR})
    e.recipients += [
        r.model_copy(update={"address": "x@b.test", "domain": "b.test"}) for r in e.recipients
    ]
    actions = decide(e, subjects={NAMES.work_subject(e.id, "example.com")})
    assert [a.item for a in actions] == [WorkItem(e.id, "b.test")]


def test_review_final_entries() -> None:
    done = entry(RecipientState.DELIVERED)
    assert [a.kind for a in decide(done)] == [ActionKind.FINISH]  # left behind by a crash
    assert decide(done, subjects={NAMES.work_subject(done.id, DOMAIN)}) == []
    assert decide(entry(RecipientState.DELIVERED, age=timedelta(seconds=5))) == []
    old_dsn = entry(RecipientState.DELIVERED, age=timedelta(days=2), is_dsn=True)
    assert [a.kind for a in decide(old_dsn, has_body=False)] == [ActionKind.REMOVE]
    kept_dsn = entry(RecipientState.DELIVERED, is_dsn=True)
    assert decide(kept_dsn, has_body=False) == []  # kept on purpose (jsqueue.dsn.notifier)
    unfinished = entry(RecipientState.DELIVERED, age=timedelta(hours=2), is_dsn=True)
    assert [a.kind for a in decide(unfinished, has_body=True)] == [ActionKind.FINISH]


def test_review_entry_without_body() -> None:
    old = entry(age=timedelta(hours=2))
    assert [a.kind for a in decide(old, has_body=False)] == [ActionKind.REMOVE]
    tried = entry(RecipientState.DEFERRED, age=timedelta(hours=2))
    tried.recipients[0].attempts = 2
    assert [a.kind for a in decide(tried, has_body=False)] == [ActionKind.REPORT]
    young = entry(age=timedelta(minutes=5))
    assert decide(young, has_body=False) == []  # younger than orphan_after_s
    # An inline body (smtp.inline_body_max) is a stored body: nothing in the body store is expected.
    inline = old.model_copy(update={"inline_body": b"Subject: x\r\n\r\n"})
    assert [a.kind for a in decide(inline, has_body=False)] == [ActionKind.REQUEUE]


# --------------------------------------------------------------------------- against NATS


@pytest.fixture
async def make_reconciler(
    queue_harness: Harness, nats_server: EmbeddedNats
) -> AsyncIterator[MakeReconciler]:
    """Builds reconcilers on the harness's queue; closed at teardown."""
    made: list[Reconciler] = []

    async def make(**changes: object) -> Reconciler:
        settings = queue_harness.settings.model_copy(
            update={"reconciler": SETTINGS.model_copy(update=changes)}
        )
        rec = await open_reconciler(settings, [nats_server.url])
        made.append(rec)
        return rec

    yield make
    for rec in made:
        await rec.close()


def shifted(by: timedelta) -> Callable[[], datetime]:
    return lambda: utcnow() + by


async def store(stores: Stores, e: Entry, *, body: bool = True, work: bool = False) -> None:
    """Store what the front end stores; ``work=False`` is a crash before the work item."""
    if body:
        info = await stores.bodies.put(e.id, chunks_of(b"Subject: hi\r\n\r\nhello\r\n"), fresh=True)
        e = e.model_copy(update={"size": info.size, "digest": info.digest})
    await stores.entries.create(e)
    if work:
        for d in e.domains:
            await stores.scheduler.schedule(WorkItem(e.id, d, e.generation))


async def gone(stores: Stores, qid: str) -> bool:
    try:
        await stores.entries.get(qid)
    except Exception:
        return True
    return False


async def test_lost_trigger_is_delivered(
    queue_harness: Harness, make_reconciler: MakeReconciler
) -> None:
    """An entry stored without its work item (crash between the two) is found by the
    running reconciler and delivered once."""
    h = queue_harness
    h.dns.add(ZONE)
    rec: Reconciler = await make_reconciler(lost_trigger_after_s=1.0)
    async with SmtpdMx("127.0.2.120", h.mx_port) as mx:
        e = make_entry(None, domain=DOMAIN)
        await store(h.stores, e)
        async with h.running():
            assert await h.stores.scheduler.backlog() == 0  # nothing would ever deliver it
            stop = asyncio.Event()
            task = asyncio.create_task(rec.run(stop))
            try:
                await eventually(lambda: len(mx.delivered) >= 1, 15, what="delivery")
                await eventually(lambda: gone(h.stores, e.id), 10, what="entry removed")
            finally:
                stop.set()
                await asyncio.wait_for(task, 10)
        assert rec.passes >= 1
    assert [t.rcpt_to for t in mx.delivered] == [[e.recipients[0].address]]


async def test_consistent_entries_are_left_alone(
    queue_harness: Harness, make_reconciler: MakeReconciler
) -> None:
    h = queue_harness
    rec: Reconciler = await make_reconciler()
    lost = entry()
    with_work = entry()
    held = entry(held=True)
    leased = entry(leases={DOMAIN: Lease(owner="w", until=utcnow() + HOUR)})
    young = entry(age=timedelta(seconds=1))
    for e in (lost, held, leased, young):
        await store(h.stores, e)
    await store(h.stores, with_work, work=True)
    report = await rec.run_once(full=False)
    assert report.requeued == [WorkItem(lost.id, DOMAIN)]
    assert report.entries_listed == 5 and report.entries_read == 4  # not the one with work
    full = await rec.run_once(full=True)
    assert full.requeued == [] and full.entries_read == 5  # the re-queued one has work now
    assert not (full.removed or full.finished or full.orphan_bodies or full.reported)
    assert await h.stores.scheduler.backlog() == 2
    # a deleted entry's key stays listed (marker) for a while: read once, then remembered
    await h.stores.entries.delete(young.id)
    await h.stores.bodies.delete(young.id)
    first = await rec.run_once(full=False)
    again = await rec.run_once(full=False)
    assert (first.entries_listed, first.entries_read) == (5, 3)  # held, leased, deleted
    assert (again.entries_listed, again.entries_read) == (5, 2)  # held, leased
    assert (await rec.run_once(full=True)).entries_read == 5


async def test_delivered_entries_cost_a_pass_no_request_each(
    queue_harness: Harness, make_reconciler: MakeReconciler
) -> None:
    """Under load most ids a pass reads are messages delivered since the last pass (their
    delete markers stay listed): 300 of them are read in two batched requests, not a
    direct get and a leader read each (600), and remembered as gone."""
    h = queue_harness
    rec: Reconciler = await make_reconciler()
    for _ in range(300):
        e = entry()
        await h.stores.entries.delete(e.id, revision=await h.stores.entries.create(e))
    entries = rec.stores.entries
    assert isinstance(entries, JetStreamEntryStore)
    before = entries._nc.stats["out_msgs"]
    report = await rec.run_once(full=False)
    sent = entries._nc.stats["out_msgs"] - before
    assert report.entries_listed == 300 and report.entries_read == 300
    assert sent <= 20, f"{sent} requests for a pass over 300 delete markers"
    assert (await rec.run_once(full=False)).entries_read == 0


async def test_orphan_bodies_and_chunks(
    queue_harness: Harness, nats_server: EmbeddedNats, make_reconciler: MakeReconciler
) -> None:
    """Bodies without entries and chunk sets without a body go once they are older than
    orphan_after_s; bodies with entries and young leftovers stay."""
    h = queue_harness
    rec: Reconciler = await make_reconciler()
    assert isinstance(rec.inventory, JetStreamInventory)
    bodies = rec.inventory.bodies
    orphan = new_queue_id()
    await h.stores.bodies.put(orphan, chunks_of(b"x" * 1000))
    kept = entry()
    await store(h.stores, kept, work=True)
    await bodies.js.publish(bodies.chunk_subject("LEFTOVERNUID"), b"half a message")

    young = await rec.run_once(full=False)
    assert young.orphan_bodies == [] and young.orphan_chunks == []
    rec.clock = shifted(timedelta(seconds=SETTINGS.orphan_after_s + 60))
    old = await rec.run_once(full=False)
    assert old.orphan_bodies == [orphan]
    assert old.orphan_chunks == ["LEFTOVERNUID"]
    with pytest.raises(BodyNotFound):
        await h.stores.bodies.info(orphan)
    assert (await h.stores.bodies.info(kept.id)).size > 0
    assert await rec.inventory.orphan_chunks(utcnow() + HOUR, thorough=True) == []


async def test_a_lost_body_discard_leaves_an_orphan_the_sweep_deletes(
    queue_harness: Harness, make_reconciler: MakeReconciler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a delivery the worker purges the body without awaiting an answer
    (``BodyStore.discard``); a purge the server never got leaves the body without its
    entry, and the sweep deletes it once ``orphan_after_s`` has passed: a lost best-effort
    write costs storage for a while, never a message, and nothing stays for good."""
    h = queue_harness
    h.dns.add(ZONE)
    lost: list[str] = []

    async def lost_discard(queue_id: str) -> None:
        lost.append(queue_id)  # sent, never applied

    monkeypatch.setattr(h.stores.bodies, "discard", lost_discard)
    async with SmtpdMx("127.0.2.120", h.mx_port) as mx:
        e = make_entry(None, domain=DOMAIN)
        await store(h.stores, e, work=True)
        async with h.running():
            await eventually(lambda: gone(h.stores, e.id), 15, what="delivered, entry removed")
    assert lost == [e.id] and len(mx.delivered) == 1
    assert (await h.stores.bodies.info(e.id)).size > 0  # the body outlived its entry
    rec: Reconciler = await make_reconciler()
    assert (await rec.run_once(full=True)).orphan_bodies == []  # young: left alone
    rec.clock = shifted(timedelta(seconds=SETTINGS.orphan_after_s + 60))
    assert (await rec.run_once(full=False)).orphan_bodies == [e.id]  # any pass, not only full
    with pytest.raises(BodyNotFound):
        await h.stores.bodies.info(e.id)


async def test_final_entries_are_finished_or_expire(
    queue_harness: Harness, make_reconciler: MakeReconciler
) -> None:
    """A final entry left behind is handed to a worker, which removes it with its body;
    final DSN entries are kept until dsn_retention_s, then removed."""
    h = queue_harness
    rec: Reconciler = await make_reconciler()
    done = entry(RecipientState.DELIVERED)
    old_dsn = entry(RecipientState.DELIVERED, age=timedelta(days=2), is_dsn=True)
    new_dsn = entry(RecipientState.DELIVERED, is_dsn=True)
    await store(h.stores, done)
    await store(h.stores, old_dsn, body=False)
    await store(h.stores, new_dsn, body=False)
    report = await rec.run_once(full=False)
    assert report.finished == [done.id]
    assert report.removed == [old_dsn.id]
    assert await gone(h.stores, old_dsn.id) and not await gone(h.stores, new_dsn.id)
    async with h.running():
        await eventually(lambda: gone(h.stores, done.id), 10, what="the worker finished it")
    with pytest.raises(BodyNotFound):
        await h.stores.bodies.info(done.id)


async def test_entry_without_body(queue_harness: Harness, make_reconciler: MakeReconciler) -> None:
    """The front end's failed 451 cleanup (body deleted, entry not) is removed; an entry
    that lost its body after delivery attempts is only reported."""
    h = queue_harness
    rec: Reconciler = await make_reconciler()
    never = entry(age=timedelta(hours=2))
    tried = entry(RecipientState.DEFERRED, age=timedelta(hours=2))
    tried.recipients[0].attempts = 3
    await store(h.stores, never, body=False)
    await store(h.stores, tried, body=False, work=True)
    report = await rec.run_once(full=True)
    assert report.removed == [never.id]
    assert report.reported == [tried.id]
    assert await gone(h.stores, never.id) and not await gone(h.stores, tried.id)


async def test_front_end_killed_mid_data_leaves_chunks_the_sweep_removes(
    queue_harness: Harness,
    nats_server: EmbeddedNats,
    make_reconciler: MakeReconciler,
    tmp_path: Path,
) -> None:
    """SIGKILL of a front-end process while a big message is arriving: the chunks already
    stored have no body meta and no entry; the reconciler purges them."""
    h = queue_harness
    settings = h.settings.model_copy(
        update={
            "nats": h.settings.nats.model_copy(update={"urls": [nats_server.url]}),
            "smtp": h.settings.smtp.model_copy(update={"port": free_port()}),
        }
    )
    proc = JsqueueProc(["smtp"], jsqueue_env(settings), tmp_path / "smtp.log")
    match = await proc.start(r"listening on [\d.]+:(\d+)")
    rec: Reconciler = await make_reconciler()
    assert isinstance(rec.inventory, JetStreamInventory)
    inv = rec.inventory
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(match.group(1)))
        for line in (b"EHLO c.test", b"MAIL FROM:<a@c.test>", b"RCPT TO:<b@d.test>", b"DATA"):
            writer.write(line + b"\r\n")
        while not (await reader.readline()).startswith(b"354"):
            pass
        writer.write(b"Subject: big\r\n\r\n" + (b"y" * 998 + b"\r\n") * 1500)
        await writer.drain()

        async def chunks_stored() -> bool:
            return bool(await inv.orphan_chunks(utcnow() + HOUR, thorough=True))

        await eventually(chunks_stored, 15, what="chunks of the message in the store")
        await proc.kill()
        writer.close()
    finally:
        await proc.kill()
    assert await inv.entry_ids() == set() and await inv.body_ids() == set()
    rec.clock = shifted(timedelta(seconds=SETTINGS.orphan_after_s + 60))
    report = await rec.run_once(full=False)
    assert len(report.orphan_chunks) == 1
    assert await inv.orphan_chunks(utcnow() + HOUR, thorough=True) == []


# --------------------------------------------------------------------------- the lock


async def test_lock_is_exclusive_renewed_and_expires(
    queue_harness: Harness, make_reconciler: MakeReconciler
) -> None:
    a: Reconciler = await make_reconciler()
    b: Reconciler = await make_reconciler()
    la, lb = a.lock, b.lock
    assert isinstance(la, JetStreamLock) and isinstance(lb, JetStreamLock)
    assert await la.acquire()
    assert not await lb.acquire()
    assert await la.renew() and await la.acquire()
    await la.release()
    assert await lb.acquire()
    assert not await la.acquire()
    # b dies without releasing: the key's TTL (3 s) runs out on the server
    loop = asyncio.get_running_loop()
    started = loop.time()
    await eventually(la.acquire, 10, what="the lock after b's TTL")
    assert loop.time() - started >= 1.5
    assert not await lb.renew(), "b learns that it lost the lock"
    # a write whose reply was lost: a new handle with the same owner adopts it
    again = JetStreamLock(
        la._nc, Names(queue_harness.settings.nats.prefix), ttl_s=3, owner=la.owner
    )
    assert await again.acquire()


async def test_a_lock_is_released_after_a_renewal_whose_reply_was_not_awaited(
    queue_harness: Harness, make_reconciler: MakeReconciler
) -> None:
    """A pass cancelled at a stop while its renewal was in flight: the renewal lands, the
    handle still knows the revision before it; release gives the lock up all the same, so
    another reconciler (or the next pod) takes it at once, not after the TTL."""
    a: Reconciler = await make_reconciler()
    b: Reconciler = await make_reconciler()
    la, lb = a.lock, b.lock
    assert isinstance(la, JetStreamLock) and isinstance(lb, JetStreamLock)
    assert await la.acquire()
    known = la._rev
    assert known is not None and await la._write(known) is not None  # landed, not recorded
    await la.release()
    assert await lb.acquire()


async def test_only_one_reconciler_sweeps_at_a_time(
    queue_harness: Harness, make_reconciler: MakeReconciler
) -> None:
    a: Reconciler = await make_reconciler()
    b: Reconciler = await make_reconciler()
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    ta = asyncio.create_task(a.run(stop_a))
    tb = asyncio.create_task(b.run(stop_b))
    try:
        await eventually(lambda: a.passes + b.passes >= 5, 10, what="passes")
        holder, other, stop_holder = (a, b, stop_a) if a.passes else (b, a, stop_b)
        assert other.passes == 0, "the other one never swept"
        stop_holder.set()  # releases the lock on the way out
        await eventually(lambda: other.passes >= 1, 10, what="take-over after release")
        assert holder.passes >= 5
    finally:
        stop_a.set()
        stop_b.set()
        await asyncio.gather(ta, tb)


async def test_unreadable_entry_is_reported_and_the_pass_goes_on(
    queue_harness: Harness, make_reconciler: MakeReconciler
) -> None:
    """A KV value that is not an entry stops neither the pass nor the next ones; its body
    is not taken for an orphan."""
    h = queue_harness
    rec = await make_reconciler()
    entries = h.stores.entries
    assert isinstance(entries, JetStreamEntryStore)
    bad = new_queue_id()
    await h.stores.bodies.put(bad, chunks_of(b"Subject: x\r\n\r\nx\r\n"))
    await entries.js.publish(f"$KV.{entries.bucket}.{bad}", b"not an entry")
    lost = entry()
    await store(h.stores, lost)
    rec.clock = shifted(timedelta(seconds=SETTINGS.orphan_after_s + 60))
    report = await rec.run_once(full=True)
    assert report.reported == [bad]
    assert report.requeued == [WorkItem(lost.id, DOMAIN)]
    assert report.orphan_bodies == []
    assert (await h.stores.bodies.info(bad)).size > 0


async def test_recovery_pass_requeues_recent_lost_triggers(
    queue_harness: Harness, make_reconciler: MakeReconciler
) -> None:
    """After a start or a NATS reconnect the margin is ``recovery_margin_s``, not
    ``lost_trigger_after_s``: a work item lost with the last unsynced writes of a crashed
    one-replica server is put back within seconds; a younger entry (its ingest may be under
    way) is left alone."""
    h = queue_harness
    rec: Reconciler = await make_reconciler(recovery_margin_s=5.0)
    recent = entry(age=timedelta(seconds=10))
    young = entry(age=timedelta(seconds=1))
    for e in (recent, young):
        await store(h.stores, e)
    assert (await rec.run_once(full=False)).requeued == []  # 10 s < lost_trigger_after_s
    report = await rec.run_once(full=False, recovery=True)
    assert report.requeued == [WorkItem(recent.id, DOMAIN)]
    assert (await rec.run_once(full=False)).requeued == []  # margins back to normal


async def test_reconnect_asks_for_a_recovery_pass(
    queue_harness: Harness, make_reconciler: MakeReconciler
) -> None:
    """The running reconciler makes a recovery pass ``recovery_margin_s`` after a NATS
    reconnect (and after its start), between its normal passes."""
    h = queue_harness
    rec: Reconciler = await make_reconciler(interval_s=3600.0, recovery_margin_s=0.5)
    stop = asyncio.Event()
    task = asyncio.create_task(rec.run(stop))
    try:
        await eventually(lambda: rec.passes >= 2, 10, what="first pass, then start recovery")
        lost = entry(age=timedelta(seconds=10))
        await store(h.stores, lost)
        rec.nats_reconnected()  # what connect_nats calls after a reconnect
        await eventually(lambda: rec.passes >= 3, 10, what="recovery pass")
        assert rec.last_report is not None
        assert rec.last_report.requeued == [WorkItem(lost.id, DOMAIN)]
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def test_the_pause_after_a_long_pass_keeps_passes_to_a_tenth_of_the_time() -> None:
    """The interval, unless the pass worked so long that passes would take more than
    PASS_SHARE of the time: then nine times its work, less what it already rested."""
    assert PASS_SHARE == 0.1
    assert cycle_rest(60.0, 0.0, 0.0, PASS_SHARE) == 60.0
    assert cycle_rest(60.0, 6.0, 6.0, PASS_SHARE) == 60.0
    assert cycle_rest(60.0, 100.0, 100.0, PASS_SHARE) == pytest.approx(900.0)  # unpaced
    assert cycle_rest(60.0, 100.0, 1000.0, PASS_SHARE) == 60.0  # paced: it rested 900 s
    assert cycle_rest(60.0, 100.0, 400.0, PASS_SHARE) == pytest.approx(600.0)  # rests capped
    took = 3.0
    assert took / (took + cycle_rest(0.2, took, took, PASS_SHARE)) == pytest.approx(PASS_SHARE)


async def test_a_regular_pass_rests_as_it_reads_and_a_recovery_pass_does_not(
    queue_harness: Harness, make_reconciler: MakeReconciler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full pass over many entries (a million in production) rests between its reads, so
    that its work is about PASS_SHARE of its time and the worker sharing the event loop
    keeps delivering; a recovery pass (what a crash left is wanted back soon) never rests."""
    stores = queue_harness.stores
    monkeypatch.setattr("jsqueue.reconciler.READ_BATCH", 50)  # (256 would read all at once)
    for _ in range(150):  # three read batches
        await store(stores, entry(), work=True)
    rec = await make_reconciler()
    rec.slice_s = 1e-6  # rest after every batch (a real pass rests after 50 ms of work)
    began = time.monotonic()
    report = await rec.run_once(full=True)
    wall = time.monotonic() - began
    assert report.entries_read >= 150 and not report.changed
    assert report.rested_s > 0
    assert report.rested_s >= 0.8 * (1 - PASS_SHARE) * wall, (report.rested_s, wall)
    recovery = await rec.run_once(full=True, recovery=True)
    assert recovery.entries_read >= 150 and recovery.rested_s == 0


async def test_a_reconnect_ends_the_rests_of_the_pass_under_way(
    queue_harness: Harness, make_reconciler: MakeReconciler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A regular pass over a large queue rests for long; a NATS reconnect asks for a
    recovery pass (work items may be lost), which must not wait for those rests: the pass
    under way goes on at full speed, and the recovery pass follows."""
    for _ in range(150):
        await store(queue_harness.stores, entry(), work=True)
    rec = await make_reconciler(lock_ttl_s=600.0)  # rests of up to 200 s
    rec.slice_s = 1e-6
    monkeypatch.setattr("jsqueue.reconciler.PASS_SHARE", 1e-4)
    regular = asyncio.create_task(rec.run_once(full=True))
    await eventually(lambda: rec.pacer is not None and rec.pacer.resting, what="a rest")
    rec.nats_reconnected()
    report = await asyncio.wait_for(regular, 10)
    assert report.entries_read >= 150 and rec.pacer is None


async def test_a_long_pass_stretches_the_pause_after_it(
    make_reconciler: MakeReconciler,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pass that takes long (a queue of a million entries) is followed by a pause nine
    times as long, not by the next pass after ``interval_s``: the sweep never keeps its
    process busy. The stretched pause is logged."""
    caplog.set_level(logging.INFO, logger="jsqueue.reconciler")
    rec: Reconciler = await make_reconciler(interval_s=0.05, recovery_margin_s=3600.0)
    run_once = rec.run_once
    times: list[tuple[float, float]] = []

    async def slow_pass(*, full: bool = True, recovery: bool = False) -> Report:
        began = time.monotonic()
        report = await run_once(full=full, recovery=recovery)
        await asyncio.sleep(0.3)  # as if it had read many entries
        times.append((began, time.monotonic()))
        return report

    monkeypatch.setattr(rec, "run_once", slow_pass)
    stop = asyncio.Event()
    task = asyncio.create_task(rec.run(stop))
    try:
        await eventually(lambda: len(times) >= 2, 20, what="two passes")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    (_, first_end), (second_start, _) = times[0], times[1]
    took = first_end - times[0][0]
    assert second_start - first_end >= 9 * took * 0.99, (took, second_start - first_end)
    assert any("the next in" in r.getMessage() for r in caplog.records)
