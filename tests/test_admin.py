"""Operator actions (jsqueue.admin) against a real queue: real nats-server, front end,
workers, DNS server and scripted MXes on loopback.

The race tests hold an MX at its RCPT reply (``GatedMx``) so an action lands while a worker
is in the middle of a delivery, then check that neither side's update was lost.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest
from test_worker import SENDER_ZONE, dsn_parts, gone, one_mx

from jsqueue import replies
from jsqueue.admin import Admin, EntryFilter, parse_duration
from jsqueue.cli.render import render_detail, render_stats, summaries_total
from jsqueue.envelope import Entry, EntryState, Lease, Recipient, RecipientState, WorkItem, utcnow
from jsqueue.errors import BodyNotFound, EntryNotFound, InvalidName
from jsqueue.events import Event, EventKind
from jsqueue.names import new_queue_id
from jsqueue.state import claim
from jsqueue.store.base import Stores
from jsqueue.views import Action, Outcome
from support.mx import ScriptedMx, Session, SmtpdMx
from support.nats import backlog_is, read_body
from support.queue import Harness, eventually

DEST_ZONE = """
dest.example.test.     300 IN MX 10 mx.dest.example.test.
mx.dest.example.test.  300 IN A  127.0.2.20
"""
RCPT = "user@dest.example.test"
MESSAGE = (
    b"From: alice@example.test\r\nTo: user@dest.example.test\r\nSubject: admin\r\n"
    b"Message-ID: <admin@example.test>\r\n\r\nHello.\r\n"
)


class Collect:
    """An observer that keeps every event."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def kinds(self) -> list[EventKind]:
        return [e.kind for e in self.events]


class GatedMx(ScriptedMx):
    """A scripted MX that holds its reply to the first RCPT until ``gate`` is set."""

    def __init__(self, host: str, port: int, **kw: object) -> None:
        super().__init__(host, port, **kw)  # type: ignore[arg-type]
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def _send(self, writer: asyncio.StreamWriter, reply: str) -> bool:
        session: Session | None = self.sessions[-1] if self.sessions else None
        if session and session.commands and session.commands[-1].upper().startswith("RCPT"):
            self.waiting.set()
            await self.gate.wait()
        return await super()._send(writer, reply)


async def recipient_is(h: Harness, qid: str, st: RecipientState, attempts: int) -> bool:
    e = await h.entry(qid)
    return e is not None and e.recipients[0].state is st and e.recipients[0].attempts == attempts


# --------------------------------------------------------------------------- races


async def test_flush_delivers_a_message_deferred_for_hours_once(queue_harness: Harness) -> None:
    """DESIGN.md §4: a recipient deferred for three hours is delivered within seconds of a
    flush (not when the NAK delay runs out), exactly once; the old work item is gone."""
    h = queue_harness
    h.configure(retry={"base_s": 3 * 3600.0, "max_age_s": 86400.0})
    h.dns.add(DEST_ZONE)
    events = Collect()
    admin = Admin(h.stores, events)
    async with SmtpdMx("127.0.2.20", h.mx_port, rcpt_replies={RCPT: "450 4.2.0 busy"}) as mx:
        qid = await h.submit(MESSAGE, [RCPT])
        async with h.running():
            await eventually(lambda: recipient_is(h, qid, RecipientState.DEFERRED, 1))
            e = await h.entry(qid)
            assert e is not None and e.recipients[0].next_attempt_at is not None
            assert e.recipients[0].next_attempt_at - utcnow() > timedelta(hours=2)
            mx.rcpt_replies.clear()
            result = await admin.flush(qid)
            assert result.outcome is Outcome.DONE, result
            await eventually(lambda: len(mx.delivered) == 1, timeout_s=10, what="flushed")
            await eventually(lambda: gone(h, qid), what="entry removed")
            await backlog_is(h.stores.scheduler, 0)
        assert [t.rcpt_to for t in mx.delivered] == [[RCPT]]
        assert events.kinds() == [EventKind.FLUSHED]
        assert events.events[0].queue_id == qid


async def test_delete_while_the_mx_answers_the_data_still_logs_the_delivery(
    queue_harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator deletes the message while the worker waits for the reply to the final
    dot; the MX then accepts it. The entry is gone, so nothing is recorded in it, but the
    delivery happened: its per-recipient log line and its ``delivered`` event are still
    written (RFC 5321 §6.1: responsibility passed to the MX), after the ``deleted``."""
    h = queue_harness
    h.dns.add(DEST_ZONE)
    caplog.set_level(logging.INFO, logger="jsqueue.worker")
    gate = asyncio.Event()
    events = Collect()
    async with ScriptedMx("127.0.2.20", h.mx_port, hold=gate) as mx:
        qid = await h.submit(MESSAGE, [RCPT])
        worker = h.worker(observer=events)
        async with h.running(worker):
            await eventually(lambda: mx.held >= 1, timeout_s=15, what="the final-reply wait")
            assert (await Admin(h.stores).delete(qid)).outcome is Outcome.DONE
            gate.set()
            await eventually(lambda: worker.handled == 1, timeout_s=15, what="attempt done")
    assert len(mx.delivered) == 1
    delivered = [e for e in events.events if e.kind is EventKind.DELIVERED]
    assert [(e.queue_id, e.recipient) for e in delivered] == [(qid, RCPT)]
    assert f"queue={qid} to=<{RCPT}>" in caplog.text and "outcome=delivered" in caplog.text


async def test_hold_while_delivering_loses_no_update(queue_harness: Harness) -> None:
    """A hold set while a worker waits for the RCPT reply: the worker's 450 is recorded
    (attempts 1, last reply) and the hold survives it; the retry drops (held) without an
    SMTP session; release delivers."""
    h = queue_harness
    h.dns.add(DEST_ZONE)
    admin = Admin(h.stores)
    async with GatedMx("127.0.2.20", h.mx_port, rcpt="450 4.2.0 busy") as mx:
        qid = await h.submit(MESSAGE, [RCPT])
        async with h.running():
            await asyncio.wait_for(mx.waiting.wait(), 15)
            e = await h.entry(qid)
            assert e is not None and e.state is EntryState.ACTIVE
            result = await admin.hold(qid)
            assert result.outcome is Outcome.DONE
            assert "being delivered" in result.detail
            mx.gate.set()

            async def held_and_recorded() -> bool:
                e = await h.entry(qid)
                return (
                    e is not None
                    and e.held
                    and e.recipients[0].state is RecipientState.DEFERRED
                    and e.recipients[0].attempts == 1
                )

            await eventually(held_and_recorded, what="hold and outcome both stored")
            # The NAKed item comes back after 1 s, finds the entry held and is dropped.
            await backlog_is(h.stores.scheduler, 0)
            assert mx.connections == 1
            e = await h.entry(qid)
            assert e is not None and e.state is EntryState.HELD
            assert e.recipients[0].last_reply is not None
            assert e.recipients[0].last_reply.code == 450
            assert (await admin.hold(qid)).outcome is Outcome.UNCHANGED
            mx.rcpt = "250 2.1.5 ok"
            assert (await admin.release(qid)).outcome is Outcome.DONE
            await eventually(lambda: len(mx.delivered) == 1, what="delivered after release")
            await eventually(lambda: gone(h, qid), what="entry removed")
        assert mx.connections == 2


async def test_delete_while_deferred_means_no_delivery(queue_harness: Harness) -> None:
    """Delete of a deferred entry removes entry, body and work item; a late trigger for it
    (published before the delete) is dropped by the worker without contacting the MX."""
    h = queue_harness
    h.configure(retry={"base_s": 3600.0})
    h.dns.add(DEST_ZONE)
    events = Collect()
    admin = Admin(h.stores, events)
    async with SmtpdMx("127.0.2.20", h.mx_port, rcpt_replies={RCPT: "450 4.2.0 busy"}) as mx:
        qid = await h.submit(MESSAGE, [RCPT])
        worker = h.worker()
        async with h.running(worker):
            await eventually(lambda: recipient_is(h, qid, RecipientState.DEFERRED, 1))
            result = await admin.delete(qid)
            assert result.outcome is Outcome.DONE
            assert await h.entry(qid) is None
            with pytest.raises(BodyNotFound):
                await read_body(h.stores, qid)
            await backlog_is(h.stores.scheduler, 0)
            mx.rcpt_replies.clear()
            handled = worker.handled
            await h.stores.scheduler.flush(WorkItem(qid, "dest.example.test", 0))
            await eventually(lambda: worker.handled > handled, what="late trigger handled")
            await backlog_is(h.stores.scheduler, 0)
        assert mx.delivered == []
        assert mx.connections == 1
        assert (await admin.delete(qid)).outcome is Outcome.NOT_FOUND
        assert events.kinds() == [EventKind.DELETED]


@pytest.mark.parametrize("inline_max", [0, 128 * 1024], ids=["body store", "inline"])
async def test_delete_while_delivering_aborts_before_data(
    queue_harness: Harness, inline_max: int
) -> None:
    """Delete while the worker waits for the RCPT reply: the body is gone before DATA, so
    the transaction is abandoned (RFC 5321 §4.1.1.4: no final dot, nothing delivered) and the
    worker records nothing and retries nothing. An inline body is in the worker's hands
    already: the worker reads the entry again before DATA, with the same effect."""
    h = queue_harness
    h.settings.smtp.inline_body_max = inline_max
    h.dns.add(DEST_ZONE)
    admin = Admin(h.stores)
    async with GatedMx("127.0.2.20", h.mx_port) as mx:
        qid = await h.submit(MESSAGE, [RCPT])
        worker = h.worker()
        async with h.running(worker):
            await asyncio.wait_for(mx.waiting.wait(), 15)
            result = await admin.delete(qid)
            assert result.outcome is Outcome.DONE
            assert "being delivered" in result.detail
            mx.gate.set()
            await eventually(lambda: worker.handled >= 1, what="attempt finished")
            await backlog_is(h.stores.scheduler, 0)
        assert mx.delivered == []
        assert mx.connections == 1
        assert await h.entry(qid) is None


async def test_bounce_sends_one_dsn_with_a_5xx(queue_harness: Harness) -> None:
    """Operator bounce: the deferred recipient fails with 550 5.7.1, the sender gets one
    failure DSN (Status 5.7.1, not the 4.4.7 of an expiry, RFC 3463 §3.8), the entry goes."""
    h = queue_harness
    h.configure(retry={"base_s": 3600.0})
    h.dns.add(DEST_ZONE + SENDER_ZONE)
    events = Collect()
    admin = Admin(h.stores, events)
    async with (
        SmtpdMx("127.0.2.20", h.mx_port, rcpt_replies={RCPT: "450 4.2.0 busy"}),
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        qid = await h.submit(MESSAGE, [RCPT])
        async with h.running():
            await eventually(lambda: recipient_is(h, qid, RecipientState.DEFERRED, 1))
            result = await admin.bounce(qid)
            assert result.outcome is Outcome.DONE
            await eventually(lambda: len(sender_mx.delivered) == 1, what="the DSN")
            await eventually(lambda: gone(h, qid), what="entry removed")
        dsn = sender_mx.delivered[0]
        assert dsn.mail_from == ""
        assert dsn.rcpt_to == ["alice@example.test"]
        _, groups = dsn_parts(dsn.content or b"")
        assert [g["Final-Recipient"] for g in groups] == [f"rfc822; {RCPT}"]
        assert groups[0]["Action"] == "failed"
        assert groups[0]["Status"] == "5.7.1"
        assert "bounced by the postmaster" in str(groups[0]["Diagnostic-Code"])
        assert events.kinds() == [EventKind.BOUNCED]
        assert events.events[0].recipient == RCPT
        assert events.events[0].reply == replies.R550_BOUNCED_BY_POSTMASTER


# --------------------------------------------------------------------------- listing, stats


def entry_at(
    minutes_ago: float,
    domain: str,
    state: RecipientState = RecipientState.PENDING,
    *,
    sender: str = "alice@example.test",
    held_: bool = False,
    is_dsn: bool = False,
) -> Entry:
    created = utcnow() - timedelta(minutes=minutes_ago)
    return Entry(
        id=new_queue_id(int(created.timestamp() * 1000)),
        reverse_path=sender,
        recipients=[Recipient(address=f"u@{domain}", domain=domain, state=state)],
        created_at=created,
        size=1000,
        held=held_,
        is_dsn=is_dsn,
    )


async def store_all(stores: Stores, entries: list[Entry]) -> list[str]:
    for e in entries:
        await stores.entries.create(e)
    return sorted(e.id for e in entries)


async def test_page_filters_and_paging(js_stores: Stores) -> None:
    """``queue ls``: arrival order, done entries hidden by default, every filter, and paging
    with ``next_after`` that neither skips nor repeats an entry."""
    entries = [
        entry_at(300, "a.example.test"),
        entry_at(200, "b.example.test", RecipientState.DEFERRED, sender=""),
        entry_at(100, "b.example.test", RecipientState.DEFERRED, held_=True),
        entry_at(50, "c.example.test", RecipientState.DELIVERED, is_dsn=True),
        entry_at(10, "a.example.test", RecipientState.ACTIVE, sender="bob@example.org"),
        entry_at(1, "xn--bcher-kva.example.test"),
    ]
    ids = await store_all(js_stores, entries)
    admin = Admin(js_stores)
    by_id = {e.id: e for e in entries}
    open_ids = [i for i in ids if not by_id[i].is_final]

    pages, after = [], None
    while True:
        page = await admin.page(after=after, limit=2)
        pages.append([e.id for e in page.entries])
        if page.next_after is None:
            break
        after = page.next_after
    assert [i for p in pages for i in p] == open_ids
    assert all(len(p) <= 2 for p in pages)

    async def ids_of(flt: EntryFilter) -> list[str]:
        return [e.id for e in (await admin.page(flt, limit=100)).entries]

    assert await ids_of(EntryFilter(states=frozenset({EntryState.DONE}))) == [entries[3].id]
    assert await ids_of(EntryFilter(states=frozenset({EntryState.HELD}))) == [entries[2].id]
    assert await ids_of(EntryFilter(domain="A.Example.Test")) == [entries[0].id, entries[4].id]
    assert await ids_of(EntryFilter(domain="bücher.example.test")) == [entries[5].id]
    assert await ids_of(EntryFilter(sender="<>")) == [entries[1].id]
    assert await ids_of(EntryFilter(sender="@EXAMPLE.ORG")) == [entries[4].id]
    assert await ids_of(EntryFilter(min_age_s=150 * 60)) == [entries[0].id, entries[1].id]
    assert await ids_of(EntryFilter(max_age_s=30 * 60)) == [entries[4].id, entries[5].id]
    summary = (await admin.page(EntryFilter(sender="<>"))).entries[0]
    assert summary.reverse_path == "" and summary.state is EntryState.DEFERRED
    assert summary.recipients[0].address == "u@b.example.test"


async def test_stats_counts_states_domains_and_oldest(js_stores: Stores) -> None:
    """``queue stats``: queued entries by state, open recipients per destination, the
    oldest open entry (a kept DSN record is older but does not count), the backlog."""
    entries = [
        entry_at(500, "c.example.test", RecipientState.DELIVERED, is_dsn=True),
        entry_at(300, "a.example.test", RecipientState.DEFERRED),
        entry_at(200, "a.example.test"),
        entry_at(100, "b.example.test", held_=True),
    ]
    await store_all(js_stores, entries)
    await js_stores.scheduler.schedule(WorkItem(entries[2].id, "a.example.test", 0))
    stats = await Admin(js_stores).stats()
    assert stats.entries == 3 and stats.kept == 1
    assert stats.by_state == {
        EntryState.DEFERRED: 1,
        EntryState.PENDING: 1,
        EntryState.HELD: 1,
    }
    assert list(stats.by_domain) == ["a.example.test", "b.example.test"]
    assert stats.by_domain["a.example.test"].recipients == 2
    assert stats.by_domain["a.example.test"].deferred == 1
    assert stats.by_domain["a.example.test"].entries == 2
    assert stats.oldest_id == entries[1].id
    assert stats.oldest_age_s is not None and 299 * 60 < stats.oldest_age_s < 302 * 60
    assert stats.backlog == 1


async def test_stats_and_ls_count_the_same_messages(js_stores: Stores) -> None:
    """``queue stats`` and ``queue ls`` agree on how many messages are queued: a finished
    DSN kept as bookkeeping against a resend (``jsqueue.dsn.notifier``) and a final entry not yet
    removed are not queued messages; stats shows them on their own ``kept`` line, not in
    ``entries`` or the per-state counts."""
    kept_dsn = entry_at(40, "c.example.test", RecipientState.DELIVERED, sender="", is_dsn=True)
    finishing = entry_at(30, "c.example.test", RecipientState.BOUNCED)
    queued = [entry_at(20, "a.example.test"), entry_at(10, "b.example.test", held_=True)]
    await store_all(js_stores, [kept_dsn, finishing, *queued])
    admin = Admin(js_stores)
    listed = (await admin.page()).entries
    stats = await admin.stats()
    assert summaries_total(listed)[0] == len(queued)
    assert stats.entries == len(listed) == sum(stats.by_state.values())
    assert EntryState.DONE not in stats.by_state
    assert stats.kept == 2
    assert stats.oldest_id == queued[0].id
    lines = render_stats(stats)
    assert lines[0] == f"entries:      {len(queued)}"
    assert any(
        line.startswith("kept:         2 ") and "queue ls --state done" in line for line in lines
    ), lines
    assert not any(line.strip().startswith("done") for line in lines), lines


@pytest.mark.parametrize("inline_max", [0, 128 * 1024], ids=["body store", "inline"])
async def test_show_and_body(queue_harness: Harness, inline_max: int) -> None:
    """``queue show``: the stored entry with its envelope and where its body is;
    ``--body`` streams the message as stored (with our Received: trace field prepended,
    RFC 5321 §4.4) from either layout."""
    h = queue_harness
    h.settings.smtp.inline_body_max = inline_max
    admin = Admin(h.stores)
    qid = await h.submit(MESSAGE, [RCPT])
    detail = await admin.show(qid)
    assert detail.body_inline is (inline_max > 0)
    where = "inline in the entry" if inline_max else "in the object store"
    assert any(line.endswith(where) for line in render_detail(detail))
    assert detail.id == qid and detail.reverse_path == "alice@example.test"
    assert detail.recipients[0].address == RCPT
    assert detail.recipients[0].state is RecipientState.PENDING
    assert detail.size > len(MESSAGE) and detail.revision >= 1
    body = b"".join([chunk async for chunk in admin.body(qid)])
    assert body.startswith(b"Received:") and body.endswith(MESSAGE)
    with pytest.raises(EntryNotFound):
        await admin.show(new_queue_id())
    with pytest.raises(InvalidName):
        await admin.show("../etc/passwd")


# --------------------------------------------------------------------------- bulk, concurrency


async def test_bulk_hold_release_delete_with_progress(js_stores: Stores) -> None:
    """Bulk actions by filter: every match acted on once, progress reported per entry,
    missing ids reported as not found (and ``ok`` false)."""
    entries = [entry_at(60 - i, "bulk.example.test") for i in range(6)]
    ids = await store_all(js_stores, entries)
    admin = Admin(js_stores, concurrency=3)
    progress: list[tuple[int, int]] = []
    selected = await admin.select(EntryFilter(domain="bulk.example.test"))
    assert selected == ids
    result = await admin.apply(
        Action.HOLD, selected, progress=lambda done, total: progress.append((done, total))
    )
    assert result.counts == {Outcome.DONE: 6} and result.ok
    assert sorted(progress) == [(i, 6) for i in range(1, 7)]
    assert await admin.select(EntryFilter(states=frozenset({EntryState.HELD}))) == ids
    result = await admin.apply(Action.RELEASE, ids)
    assert result.counts == {Outcome.DONE: 6}
    await backlog_is(js_stores.scheduler, 6)
    missing = new_queue_id()
    result = await admin.apply(Action.DELETE, [*ids, missing])
    assert result.counts == {Outcome.DONE: 6, Outcome.NOT_FOUND: 1}
    assert not result.ok
    assert [r.queue_id for r in result.results] == [*ids, missing]
    assert await admin.select(EntryFilter(states=frozenset(EntryState))) == []
    await backlog_is(js_stores.scheduler, 0)


async def test_concurrent_flushes_leave_a_current_work_item(js_stores: Stores) -> None:
    """Three flushes of one entry at once: every one bumps the generation by CAS, and the
    work stream ends up with an item of the final generation (a later flush's item is never
    purged for good by an earlier one)."""
    e = entry_at(30, "race.example.test", RecipientState.DEFERRED)
    e.recipients[0].next_attempt_at = utcnow() + timedelta(hours=3)
    await js_stores.entries.create(e)
    await js_stores.scheduler.schedule(
        WorkItem(e.id, "race.example.test", 0), at=utcnow() + timedelta(hours=3)
    )
    admin = Admin(js_stores)
    results = await asyncio.gather(*(admin.flush(e.id) for _ in range(3)))
    assert [r.outcome for r in results] == [Outcome.DONE] * 3
    current = (await js_stores.entries.get(e.id)).entry
    assert current.generation == 3
    assert current.recipients[0].next_attempt_at is not None
    assert current.recipients[0].next_attempt_at <= utcnow()
    due = await js_stores.scheduler.fetch(10, 3.0)
    assert any(d.item.generation == 3 for d in due), [d.item for d in due]
    for d in due:
        await d.ack()


async def test_flush_of_one_domain_while_the_worker_delivers_another(
    queue_harness: Harness,
) -> None:
    """A message for two domains: a.example.test is mid-transaction (its MX holds the RCPT
    reply), b.example.test was deferred for hours. A flush gives b a new generation; its
    new work item reaches the worker while the same entry is still in a's turn, which holds
    the version b's deferral wrote (the old generation). The worker claims only on such a
    version, never drops on it: it reads the entry, finds the new generation and delivers
    b at once (DESIGN.md §2.2, §4), while a's transaction is still open."""
    h = queue_harness
    h.configure(retry={"base_s": 3 * 3600.0, "max_age_s": 86400.0})
    h.dns.add(one_mx("a.example.test", "127.0.2.31") + one_mx("b.example.test", "127.0.2.32"))
    admin = Admin(h.stores)
    a, b = "u@a.example.test", "u@b.example.test"
    async with (
        GatedMx("127.0.2.31", h.mx_port) as mx_a,
        SmtpdMx("127.0.2.32", h.mx_port, rcpt_replies={b: "450 4.2.0 busy"}) as mx_b,
    ):
        qid = await h.submit(MESSAGE, [a, b])

        async def b_deferred() -> bool:
            e = await h.entry(qid)
            return e is not None and e.recipients[1].state is RecipientState.DEFERRED

        async with h.running():
            await asyncio.wait_for(mx_a.waiting.wait(), 15)
            await eventually(b_deferred, what="b deferred")
            mx_b.rcpt_replies.clear()
            result = await admin.flush(qid)
            assert result.outcome is Outcome.DONE, result
            await eventually(lambda: len(mx_b.delivered) == 1, timeout_s=10, what="b flushed")
            assert not mx_a.gate.is_set() and len(mx_a.delivered) == 0, "a still open"
            mx_a.gate.set()
            await eventually(lambda: gone(h, qid), what="both delivered, entry removed")
        assert [t.rcpt_to for t in mx_a.delivered + mx_b.delivered] == [[a], [b]]


async def test_flush_of_an_entry_leased_by_a_dead_worker(queue_harness: Harness) -> None:
    """DESIGN.md §2.3: a worker claimed the destination (lease by CAS) and died. While the
    lease runs, flush breaks nothing (the owner may be mid-transaction: a duplicate send)
    and says so: unchanged, leased by whom until when, tried then. Once the lease has run
    out, flush drops it by compare-and-set and the message is delivered within seconds,
    once (``postqueue -f``: try now), not when the old item's delay runs out."""
    h = queue_harness
    h.dns.add(DEST_ZONE)
    admin = Admin(h.stores)
    domain = "dest.example.test"
    async with SmtpdMx("127.0.2.20", h.mx_port) as mx:
        qid = await h.submit(MESSAGE, [RCPT])
        # Its presence mark has not expired yet (within the grace it counts as alive).
        assert h.stores.presence is not None
        await h.stores.presence.beat("dead-worker", "gone-process", 600.0)
        v = await h.stores.entries.get(qid)
        claimed = claim(v.entry, domain, "dead-worker", utcnow(), 600.0)
        revision = await h.stores.entries.update(claimed, v.revision)
        until = claimed.leases[domain].until

        live = await admin.flush(qid)
        assert live.outcome is Outcome.UNCHANGED, live
        assert "dead-worker" in live.detail
        assert until.strftime("%Y-%m-%d %H:%M:%S UTC") in live.detail
        assert "tried then" in live.detail
        after = await h.stores.entries.get(qid)
        assert after.revision == revision and after.entry.leases == claimed.leases

        async with h.running() as (worker,):
            # The worker finds the live lease and puts the item back until it runs out.
            await eventually(lambda: worker.handled >= 1, what="item seen")
            assert mx.connections == 0
            v = await h.stores.entries.get(qid)
            ran_out = v.entry.model_copy(deep=True)
            ran_out.leases[domain] = Lease(owner="dead-worker", until=utcnow())
            await h.stores.entries.update(ran_out, v.revision)

            result = await admin.flush(qid)
            assert result.outcome is Outcome.DONE, result
            assert "dead-worker" in result.detail and "expired" in result.detail
            await eventually(lambda: len(mx.delivered) == 1, timeout_s=10, what="flushed")
            await eventually(lambda: gone(h, qid), what="entry removed")
        assert [t.rcpt_to for t in mx.delivered] == [[RCPT]]


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("90s", 90.0), ("15m", 900.0), ("2h", 7200.0), ("1.5d", 129600.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    """Ages on the command line: a number with an optional unit."""
    assert parse_duration(text) == seconds


def test_parse_duration_rejects_garbage() -> None:
    """A bad age is a ValueError naming the input (the CLI turns it into exit code 2)."""
    with pytest.raises(ValueError, match="2 hours"):
        parse_duration("2 hours")
