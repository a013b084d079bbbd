"""The events stream (jsqueue.events): what the front end, workers and operators publish,
read back from a real nats-server, and the guarantee that publishing never blocks or
fails delivery."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from test_admin import DEST_ZONE, MESSAGE, RCPT, entry_at

from jsqueue.admin import Admin
from jsqueue.config import NatsSettings
from jsqueue.envelope import RecipientState, utcnow
from jsqueue.events import (
    Event,
    EventKind,
    Fanout,
    JetStreamPublisher,
    NullObserver,
    open_publisher,
    tail,
)
from jsqueue.frontend.server import SmtpServer
from jsqueue.names import Names, new_queue_id
from jsqueue.nats_server import EmbeddedNats
from jsqueue.replies import Reply
from jsqueue.store.base import Stores
from jsqueue.store.jetstream import connect_nats
from jsqueue.views import Outcome
from support.mx import SmtpdMx
from support.queue import Harness, eventually


@contextlib.asynccontextmanager
async def following(
    settings: NatsSettings, url: str, names: Names, **kw: object
) -> AsyncIterator[list[Event]]:
    """Collect events from :func:`tail` in the background (the consumer exists on entry)."""
    seen: list[Event] = []
    ready = asyncio.Event()

    async def run() -> None:
        stream = tail(settings, [url], names=names, ready=ready, **kw)  # type: ignore[arg-type]
        async with contextlib.aclosing(stream) as events:
            async for event in events:
                seen.append(event)

    task = asyncio.create_task(run())
    await asyncio.wait(
        {task, asyncio.create_task(ready.wait())}, timeout=10, return_when="FIRST_COMPLETED"
    )
    if task.done():
        task.result()
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def stored_events(settings: NatsSettings, url: str, names: Names) -> list[Event]:
    """Every event the stream holds, read to its end (``tail(until_end=True)``), within 30 s:
    no polling for a count that a slow consumer may not have reached yet."""
    async with asyncio.timeout(30):
        stream = tail(settings, [url], names=names, from_start=True, until_end=True)
        return [e async for e in stream]


async def test_publish_and_tail_round_trip(
    js_stores: Stores, nats_server: EmbeddedNats, nats_settings: NatsSettings, names: Names
) -> None:
    """Events are JSON on ``<prefix>.events.<kind>`` in the events stream; a live tail
    filtered by kind sees only that kind; a tail from the start replays all in order."""
    qid = new_queue_id()
    reply = Reply(code=250, enhanced="2.0.0", text="ok", remote_host="mx.example.test")
    sent = [
        Event(kind=EventKind.RECEIVED, queue_id=qid, recipients=["a@example.test"], size=10),
        Event(kind=EventKind.DELIVERED, queue_id=qid, recipient="a@example.test", reply=reply),
        Event(kind=EventKind.HELD, queue_id=qid, source="admin"),
    ]
    async with (
        following(nats_settings, nats_server.url, names, kinds=[EventKind.DELIVERED]) as live,
        open_publisher(nats_settings, [nats_server.url], names) as publisher,
    ):
        for e in sent:
            publisher.emit(e)
        assert await publisher.flush(10)
        assert publisher.published == 3 and publisher.failed == 0
        await eventually(lambda: len(live) == 1, what="live tail")
    assert live == [sent[1]]
    async with following(nats_settings, nats_server.url, names, from_start=True) as replay:
        await eventually(lambda: len(replay) == 3, what="replay")
    assert replay == sent
    nc = await connect_nats(nats_settings, [nats_server.url])
    try:
        raw = await nc.jetstream().get_last_msg(
            names.events_stream, names.event_subject("delivered")
        )
    finally:
        await nc.close()
    data = json.loads(raw.data or b"")
    assert data["queue_id"] == qid and data["recipient"] == "a@example.test"
    assert data["reply"]["code"] == 250 and data["reply"]["remote_host"] == "mx.example.test"
    assert data["at"].endswith("Z") or data["at"].endswith("+00:00")
    assert "next_attempt_at" not in data  # nulls are left out


async def test_queue_publishes_every_state_change(
    queue_harness: Harness, nats_server: EmbeddedNats, names: Names
) -> None:
    """received (front end) → deferred → delivered (worker), each with queue id, recipient,
    reply (and the MX that gave it), attempts and timestamps, in the stream in order."""
    h = queue_harness
    h.dns.add(DEST_ZONE)
    async with (
        open_publisher(h.settings.nats, [nats_server.url], names) as publisher,
        SmtpdMx("127.0.2.20", h.mx_port, rcpt_replies={RCPT: "450 4.2.0 busy"}) as mx,
    ):
        h.frontend = SmtpServer(h.settings.smtp, h.stores, publisher)
        await h.frontend.start()
        qid = await h.submit(MESSAGE, [RCPT])
        async with h.running(h.worker(observer=publisher)):

            async def deferred_once() -> bool:  # (not the connection: its RCPT may be ahead)
                e = await h.entry(qid)
                return e is not None and e.recipients[0].attempts == 1

            await eventually(deferred_once, what="first attempt recorded")
            mx.rcpt_replies.clear()
            await eventually(lambda: len(mx.delivered) == 1, what="retry delivered")

            # the MX has the message; the worker records (and publishes) it just after
            async def gone() -> bool:
                return await h.entry(qid) is None

            await eventually(gone, what="entry removed")
            # the delivered event is emitted just after the removal's compare-and-set
            await eventually(
                lambda: publisher.published + publisher.failed + publisher.dropped >= 3,
                what="three events handled by the publisher",
            )
        assert await publisher.flush(10)
        # every event acknowledged by the stream: a lost one fails here, by its counter
        assert publisher.failed == 0 and publisher.dropped == 0 and publisher.published >= 3
    seen = await stored_events(h.settings.nats, nats_server.url, names)
    mine = [e for e in seen if e.queue_id == qid]
    assert [e.kind for e in mine] == [EventKind.RECEIVED, EventKind.DEFERRED, EventKind.DELIVERED]
    received, deferred, delivered = mine
    assert received.recipients == [RCPT] and received.reverse_path == "alice@example.test"
    assert received.source == "frontend" and received.size and received.size > len(MESSAGE)
    assert deferred.recipient == RCPT and deferred.state is RecipientState.DEFERRED
    assert deferred.reply is not None and str(deferred.reply) == "450 4.2.0 busy"
    assert deferred.reply.remote_host == "mx.dest.example.test"
    assert deferred.next_attempt_at is not None and deferred.attempts == 1
    assert delivered.reply is not None and delivered.reply.code == 250
    assert delivered.attempts == 2 and delivered.duration_s is not None
    assert delivered.source is not None and delivered.source.startswith("worker:")
    assert received.at <= deferred.at <= delivered.at


async def test_admin_actions_are_published(
    js_stores: Stores, nats_server: EmbeddedNats, nats_settings: NatsSettings, names: Names
) -> None:
    """held, released, flushed and deleted events from operator actions, with the actor."""
    e = entry_at(5, "ops.example.test")
    await js_stores.entries.create(e)
    async with open_publisher(nats_settings, [nats_server.url], names) as publisher:
        admin = Admin(js_stores, publisher, source="admin:ops@host")
        for action in (admin.hold, admin.release, admin.flush, admin.delete):
            assert (await action(e.id)).outcome is Outcome.DONE
        assert await publisher.flush(10)
        assert publisher.failed == 0 and publisher.dropped == 0
    seen = await stored_events(nats_settings, nats_server.url, names)
    assert [x.kind for x in seen] == [
        EventKind.HELD,
        EventKind.RELEASED,
        EventKind.FLUSHED,
        EventKind.DELETED,
    ]
    assert {x.queue_id for x in seen} == {e.id}
    assert {x.source for x in seen} == {"admin:ops@host"}


async def test_a_batch_of_events_costs_one_request(
    js_stores: Stores, nats_server: EmbeddedNats, nats_settings: NatsSettings, names: Names
) -> None:
    """Ten events buffered together (a message's recipients delivered in one attempt) go
    out as one batch: nine without a reply subject, the last as a request whose ack
    confirms them all, so the connection receives one reply, not ten; the stream holds
    all ten, in order."""
    qid = new_queue_id()
    reply = Reply(code=250, enhanced="2.0.0", text="ok", remote_host="mx.example.test")
    sent = [
        Event(kind=EventKind.DELIVERED, queue_id=qid, recipient=f"r{i}@example.test", reply=reply)
        for i in range(10)
    ]
    nc = await connect_nats(nats_settings, [nats_server.url])
    try:
        publisher = JetStreamPublisher(nc, names, timeout_s=5.0)
        for e in sent:
            publisher.emit(e)
        replies_before = nc.stats["in_msgs"]
        publisher.start()
        assert await publisher.flush(10)
        assert publisher.published == 10 and publisher.failed == 0
        assert nc.stats["in_msgs"] - replies_before == 1
        await publisher.close()
    finally:
        await nc.close()
    assert await stored_events(nats_settings, nats_server.url, names) == sent


async def test_emit_never_blocks_and_counts_losses(
    js_stores: Stores, nats_server: EmbeddedNats, nats_settings: NatsSettings
) -> None:
    """A full buffer drops the new event; a publish that fails (no stream for the subject)
    is counted, logged and not retried; emit itself never raises or waits."""
    nc = await connect_nats(nats_settings, [nats_server.url])
    try:
        nowhere = Names("nostream")  # no events stream exists under this prefix
        publisher = JetStreamPublisher(nc, nowhere, buffer_size=2, timeout_s=1.0)
        event = Event(kind=EventKind.HELD, queue_id=new_queue_id())
        for _ in range(5):
            publisher.emit(event)
        assert publisher.dropped == 3 and publisher.pending == 2
        publisher.start()
        assert await publisher.flush(10)
        assert publisher.failed == 2 and publisher.published == 0
        await publisher.close()
        publisher.emit(event)  # after close: dropped, no error
        assert publisher.dropped == 4
    finally:
        await nc.close()


def test_fanout_isolates_a_failing_observer() -> None:
    """One observer raising does not stop the others nor reach the caller."""

    class Boom:
        def emit(self, event: Event) -> None:
            raise RuntimeError("observer bug")

    class Keep:
        def __init__(self) -> None:
            self.seen: list[Event] = []

        def emit(self, event: Event) -> None:
            self.seen.append(event)

    keep = Keep()
    fan = Fanout(Boom(), NullObserver(), keep)
    event = Event(kind=EventKind.DELETED, queue_id=new_queue_id(), at=utcnow())
    fan.emit(event)
    assert keep.seen == [event] and fan.errors == 1


def test_event_json_round_trip() -> None:
    """Events parse back from their JSON; timestamps must be aware (UTC)."""
    event = Event(
        kind=EventKind.DEFERRED,
        queue_id=new_queue_id(),
        recipient="a@example.test",
        reply=Reply(code=451, enhanced="4.4.1", text="no answer"),
        attempts=2,
        next_attempt_at=utcnow(),
    )
    assert Event.from_json(event.to_json()) == event
    with pytest.raises(ValueError, match="timezone"):
        Event(kind=EventKind.HELD, queue_id=event.queue_id, at=utcnow().replace(tzinfo=None))
