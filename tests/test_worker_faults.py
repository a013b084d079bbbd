"""Workers under faults: crashes at every step (CASE-14), SIGKILL of a worker process,
two workers racing, graceful drain, and a 25 MB message. Real nats-server, DNS and MXes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from test_worker import SENDER_ZONE, dsn_parts, gone, one_mx

from jsqueue.config import NatsSettings
from jsqueue.delivery.base import BodySource
from jsqueue.envelope import Entry, Recipient, RecipientState
from jsqueue.nats_server import EmbeddedNats
from jsqueue.store.jetstream.work import JetStreamDue
from jsqueue.worker import Worker
from support.cases import case_message, case_text
from support.mx import SILENT, ScriptedMx, SmtpdMx
from support.nats import make_settings
from support.queue import Harness, eventually

#: How long the nats-server stays down in the outage tests, seconds: past the stores'
#: own tries (three of 0.5 s).
OUTAGE_S = 4.0


class Crash(BaseException):
    """Stands for SIGKILL inside the process: nothing after the kill point happens."""


async def kill(worker_task: asyncio.Task[None], w: Worker, stop: asyncio.Event) -> None:
    """End a crashed worker once its other in-flight work is over: nothing of the crashed
    item is settled, so it comes back after the ack wait like after SIGKILL."""
    await eventually(lambda: not w._tasks, what="in-flight work of the killed worker")
    stop.set()
    await asyncio.wait_for(worker_task, 10)


async def get_entry(h: Harness, qid: str) -> Entry:
    e = await h.entry(qid)
    assert e is not None
    return e


def recipient(e: Entry, address: str) -> Recipient:
    return next(r for r in e.recipients if r.address == address)


@pytest.mark.parametrize("kill_point", ["K1", "K2", "K3", "K4"])
async def test_restart_mid_delivery_case14(
    queue_harness: Harness,
    nats_server: EmbeddedNats,
    monkeypatch: pytest.MonkeyPatch,
    kill_point: str,
) -> None:
    """CASE-14: a worker dies at K1 (permanent failure decided, no DSN yet), K2 (DSN
    queued, original not yet marked), K3 (remote 250, nothing recorded) or K4 (all
    recorded, not acked; NATS restarted too). Afterwards: one DSN for gone@, ok@ delivered
    once (K3: at most one extra copy, RFC 5321 §6.1), later@ keeps its attempt count and
    schedule."""
    h = queue_harness
    h.dns.add(case_text("CASE-14", "dns.txt") + SENDER_ZONE)
    # a short lease: a claim left by the dead worker (K3) runs out quickly
    h.configure(retry={"base_s": 3.0}, worker={"lease_s": 4.0})
    ok_rcpt, gone_rcpt, later_rcpt = (
        "ok@ok.example.test",
        "gone@nomail.example.test",
        "later@slow.example.test",
    )
    crashed = asyncio.Event()
    w1 = h.worker()

    def crash() -> None:
        crashed.set()
        raise Crash(kill_point)

    if kill_point in ("K1", "K2"):
        enqueue = w1.notifier._enqueue  # type: ignore[attr-defined]

        async def crashing_enqueue(*args: Any) -> None:
            if crashed.is_set():
                return await enqueue(*args)
            if kill_point == "K2":
                await enqueue(*args)
            crash()

        monkeypatch.setattr(w1.notifier, "_enqueue", crashing_enqueue)
    elif kill_point == "K3":
        deliver = w1.deliverer.deliver

        async def crashing_deliver(
            entry: Entry, domain: str, rcpts: Sequence[Recipient], body: BodySource
        ) -> Any:
            result = await deliver(entry, domain, rcpts, body)
            if domain == "ok.example.test" and not crashed.is_set():
                crash()
            return result

        monkeypatch.setattr(w1.deliverer, "deliver", crashing_deliver)
    else:
        ack = JetStreamDue.ack

        async def crashing_ack(self: JetStreamDue) -> None:
            if self.item.domain == "ok.example.test" and not crashed.is_set():
                crash()
            await ack(self)

        monkeypatch.setattr(JetStreamDue, "ack", crashing_ack)

    async with (
        SmtpdMx("127.0.2.100", h.mx_port) as ok,
        SmtpdMx(
            "127.0.2.101", h.mx_port, rcpt_replies={later_rcpt: "451 4.7.0 try again later"}
        ) as slow,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        qid = await h.submit(case_message("CASE-14"), [ok_rcpt, gone_rcpt, later_rcpt])
        stop = asyncio.Event()
        task = asyncio.create_task(w1.run(stop))
        await asyncio.wait_for(crashed.wait(), 15)
        await kill(task, w1, stop)
        if kill_point == "K4":
            nats_server.kill()
            await nats_server.start()
        before = recipient(await get_entry(h, qid), later_rcpt)
        assert before.attempts >= 1
        assert before.next_attempt_at is not None
        async with h.running():
            await eventually(lambda: len(sender_mx.delivered) >= 1, what="the DSN")

            async def later_retried() -> bool:
                e = await h.entry(qid)
                return e is not None and recipient(e, later_rcpt).attempts >= before.attempts + 2

            await eventually(later_retried, 20, what="two more attempts for later@")
        after = recipient(await get_entry(h, qid), later_rcpt)
    dsns = [t for t in sender_mx.delivered if t.mail_from == ""]
    assert len(dsns) == 1, "exactly one DSN for gone@"
    _, groups = dsn_parts(dsns[0].content or b"")
    assert [g["Final-Recipient"] for g in groups] == [f"rfc822; {gone_rcpt}"]
    copies = sum(t.rcpt_to.count(ok_rcpt) for t in ok.delivered)
    assert copies == 1 if kill_point != "K3" else 1 <= copies <= 2
    # later@: no reset to attempt 0, no retry earlier than scheduled before the kill
    assert after.attempts == before.attempts + 2
    assert len(slow.transactions) == 0  # every RCPT was refused: nothing transacted
    first_retry = [s for s in slow.sessions][before.attempts]
    assert first_retry is not None
    assert after.last_attempt_at is not None
    assert after.last_attempt_at >= before.next_attempt_at


async def test_a_crash_between_the_removals_never_leaves_an_entry_without_its_body(
    queue_harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message settled with a bounce (its DSN queued) is removed entry first, then body,
    as the fast path removes a delivered one (one order): a worker killed between the two
    leaves an orphan body for the reconciler's sweep, never an entry without its body."""
    h = queue_harness
    h.dns.add(
        "bounce.example.test. 300 IN MX 10 mx.bounce.example.test.\n"
        "mx.bounce.example.test. 300 IN A 127.0.5.22\n" + SENDER_ZONE
    )
    rcpt = "gone@bounce.example.test"
    w1 = h.worker()
    crashed = asyncio.Event()
    ids: list[str] = []
    removals: list[str] = []

    def crash_at_the_second_removal(store: Any, kind: str) -> None:
        original = store.delete

        async def delete(queue_id: str, *args: Any, **kwargs: Any) -> Any:
            if queue_id in ids and not crashed.is_set():
                removals.append(kind)
                if len(removals) == 2:
                    crashed.set()
                    raise Crash(f"before the {kind} removal")
            return await original(queue_id, *args, **kwargs)

        monkeypatch.setattr(store, "delete", delete)

    crash_at_the_second_removal(w1.stores.entries, "entry")
    crash_at_the_second_removal(w1.stores.bodies, "body")
    async with (
        SmtpdMx("127.0.5.22", h.mx_port, rcpt_replies={rcpt: "550 5.1.1 no such user"}),
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        qid = await h.submit(case_message("CASE-07"), [rcpt])
        ids.append(qid)
        stop = asyncio.Event()
        task = asyncio.create_task(w1.run(stop))
        await asyncio.wait_for(crashed.wait(), 20)
        await kill(task, w1, stop)
        assert removals == ["entry", "body"]
        assert await h.entry(qid) is None
        assert (await h.stores.bodies.info(qid)).size > 0, "an orphan body, for the sweep"
        async with h.running():
            await eventually(lambda: len(sender_mx.delivered) == 1, 20, what="the DSN")
        assert await h.entry(qid) is None
    assert [t.mail_from for t in sender_mx.delivered] == [""]


@pytest.mark.parametrize(
    ("kill_point", "inline_max"),
    [("before body delete", 0), ("before ack", 0), ("before ack", 128 * 1024)],
    ids=["before body delete", "before ack", "before ack, inline body"],
)
async def test_restart_after_the_fast_path_removal(
    queue_harness: Harness,
    nats_server: EmbeddedNats,
    monkeypatch: pytest.MonkeyPatch,
    kill_point: str,
    inline_max: int,
) -> None:
    """CASE-14's K4 for mail that owes no DSN: the worker removes the delivered entry with
    its compare-and-set (jsqueue.worker, one synced write less) and dies before removing the
    body, or before the ack; NATS restarts too. The item comes back after the ack wait,
    finds the entry deleted and is settled at once: one copy at the MX, nothing left to
    work on (a body left behind is an orphan for the reconciler, never delivered). Also
    with the body inline in the entry (``smtp.inline_body_max``), which has no body delete
    of its own, so only the crash before the ack applies."""
    h = queue_harness
    h.settings.smtp.inline_body_max = inline_max
    h.dns.add(case_text("CASE-14", "dns.txt") + SENDER_ZONE)
    crashed = asyncio.Event()
    w1 = h.worker()

    def crash() -> None:
        crashed.set()
        raise Crash(kill_point)

    if kill_point == "before body delete":
        discard = w1.stores.bodies.discard  # the delete of a delivered message's body

        async def crashing_discard(queue_id: str) -> None:
            if not crashed.is_set():
                crash()
            await discard(queue_id)

        monkeypatch.setattr(w1.stores.bodies, "discard", crashing_discard)
    else:
        ack = JetStreamDue.ack

        async def crashing_ack(self: JetStreamDue) -> None:
            if not crashed.is_set():
                crash()
            await ack(self)

        monkeypatch.setattr(JetStreamDue, "ack", crashing_ack)

    async with SmtpdMx("127.0.2.100", h.mx_port) as ok:
        qid = await h.submit(case_message("CASE-14"), ["ok@ok.example.test"])
        submitted = await h.entry(qid)
        assert submitted is not None and (submitted.inline_body is not None) == bool(inline_max)
        stop = asyncio.Event()
        task = asyncio.create_task(w1.run(stop))
        await asyncio.wait_for(crashed.wait(), 15)
        await kill(task, w1, stop)
        assert await gone(h, qid), "removed by the compare-and-set before the crash"
        nats_server.kill()
        await nats_server.start()
        assert await h.stores.scheduler.backlog() == 1, "the item was not settled"
        async with h.running():

            async def settled() -> bool:
                return await h.stores.scheduler.backlog() == 0

            await eventually(settled, 20, what="the redelivered item settled")
    assert sum(t.rcpt_to.count("ok@ok.example.test") for t in ok.delivered) == 1


def log_tail(tmp_path: Path) -> str:
    log = tmp_path / "worker.log"
    return log.read_text()[-2000:] if log.exists() else ""


async def test_sigkilled_worker_process(
    queue_harness: Harness, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """A worker process SIGKILLed in the middle of a delivery: after the ack wait and the
    lease, another worker delivers the message; nothing is lost (DESIGN.md §2.3)."""
    h = queue_harness
    h.dns.add(
        "hang.example.test. 300 IN MX 10 mx.hang.example.test.\n"
        "mx.hang.example.test. 300 IN A 127.0.2.90\n"
    )
    h.configure(worker={"lease_s": 3.0})
    async with ScriptedMx("127.0.2.90", h.mx_port, end_of_data=SILENT) as mx:
        qid = await h.submit(case_message("CASE-07"), ["u@hang.example.test"])
        env = {
            **os.environ,
            "JSQUEUE_NATS__URLS": f'["{nats_server.url}"]',
            "JSQUEUE_NATS__PREFIX": h.settings.nats.prefix,
            "JSQUEUE_NATS__ACK_WAIT_S": str(h.settings.nats.ack_wait_s),
            "JSQUEUE_WORKER__MX_PORT": str(h.mx_port),
            "JSQUEUE_WORKER__NAMESERVERS": f'["{h.dns.host}"]',
            "JSQUEUE_WORKER__NAMESERVER_PORT": str(h.dns.port),
            "JSQUEUE_WORKER__LEASE_S": "3",
            "JSQUEUE_WORKER__BODY_CACHE_DIR": str(tmp_path / "proc-cache"),
            "JSQUEUE_HTTP__ENABLED": "false",
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "jsqueue",
            "worker",
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "worker.log").open("wb"),
        )
        try:
            # the whole message is sent; the worker waits for the reply after the data
            await eventually(
                lambda: any(s.transactions for s in mx.sessions),
                20,
                what=f"the worker process after DATA: {log_tail(tmp_path)}",
            )
            proc.send_signal(signal.SIGKILL)
            await asyncio.wait_for(proc.wait(), 10)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        mx.end_of_data = "250 2.0.0 ok"
        async with h.running():
            await eventually(lambda: gone(h, qid), 20, what="delivered by the second worker")
    print([(t.reply, s.peer, s.closed) for s in mx.sessions for t in s.transactions])
    assert [t.rcpt_to for t in mx.delivered] == [["u@hang.example.test"]]


async def test_two_workers_never_send_twice(queue_harness: Harness) -> None:
    """DESIGN.md §2.3: two workers on one consumer; claims by compare-and-set and leases
    mean every recipient is delivered exactly once."""
    h = queue_harness
    h.dns.add(
        "two.example.test. 300 IN MX 10 mx.two.example.test.\n"
        "mx.two.example.test. 300 IN A 127.0.2.91\n"
        "dos.example.test. 300 IN MX 10 mx.two.example.test.\n"
    )
    async with SmtpdMx("127.0.2.91", h.mx_port) as mx:
        ids = [
            await h.submit(
                case_message("CASE-07"), [f"m{i}@two.example.test", f"m{i}@dos.example.test"]
            )
            for i in range(30)
        ]
        w1, w2 = h.worker(), h.worker()
        async with h.running(w1, w2):
            for qid in ids:
                await eventually(lambda q=qid: gone(h, q), 30, what=f"{qid} delivered")
    got = [r for t in mx.delivered for r in t.rcpt_to]
    assert len(got) == 60
    assert len(set(got)) == 60, "no recipient delivered twice"
    assert w1.handled > 0 and w2.handled > 0, "both workers took part"


async def test_drain_gives_back_unfinished_work(queue_harness: Harness) -> None:
    """STYLE.md habit 10 / SIGTERM: a worker stopped mid-delivery (before the final dot)
    finishes within the drain bound, then releases its lease and hands the item back for
    immediate delivery."""
    h = queue_harness
    h.dns.add(
        "hang.example.test. 300 IN MX 10 mx.hang.example.test.\n"
        "mx.hang.example.test. 300 IN A 127.0.2.92\n"
    )
    h.configure(worker={"drain_timeout_s": 0.5, "lease_s": 600.0})
    async with ScriptedMx("127.0.2.92", h.mx_port, data=SILENT) as mx:
        qid = await h.submit(case_message("CASE-07"), ["u@hang.example.test"])
        w1 = h.worker()
        stop = asyncio.Event()
        task = asyncio.create_task(w1.run(stop))
        await eventually(lambda: any("DATA" in s.verbs() for s in mx.sessions), what="DATA")
        loop = asyncio.get_running_loop()
        started = loop.time()
        stop.set()
        await asyncio.wait_for(task, 10)
        assert loop.time() - started < 5, "drain is bounded"
        e = await h.entry(qid)
        assert e is not None and e.leases == {}, "lease released"
        assert e.recipients[0].state is RecipientState.PENDING
        mx.data = "354 go ahead"
        async with h.running():
            await eventually(lambda: gone(h, qid), 10, what="delivered after the drain")
    assert len(mx.delivered) == 1


async def test_drain_waits_for_the_reply_to_a_final_dot_within_the_bound(
    queue_harness: Harness,
) -> None:
    """RFC 5321 §4.5.3.2.6, §6.1: a worker stopped while it waits for the reply to its
    final dot keeps waiting for it within the drain bound: the reply read then is recorded,
    and the message is never sent again."""
    h = queue_harness
    h.dns.add(
        "slowdot.example.test. 300 IN MX 10 mx.slowdot.example.test.\n"
        "mx.slowdot.example.test. 300 IN A 127.0.5.20\n"
    )
    h.configure(worker={"drain_timeout_s": 30.0, "lease_s": 600.0})
    hold = asyncio.Event()
    async with ScriptedMx("127.0.5.20", h.mx_port, hold=hold) as mx:
        qid = await h.submit(case_message("CASE-07"), ["u@slowdot.example.test"])
        stop = asyncio.Event()
        task = asyncio.create_task(h.worker().run(stop))
        try:
            await mx.wait_for(lambda: mx.held == 1)
            stop.set()
            await asyncio.sleep(0.5)
            assert not task.done(), "the drain waits for the reply to the dot"
            hold.set()
            await asyncio.wait_for(task, 10)
        finally:  # a failure above ends the worker while its nats-server is still up
            stop.set()
            hold.set()
            await asyncio.wait({task}, timeout=40)
        assert await h.entry(qid) is None, "delivered and recorded by the stopped worker"
        async with h.running():
            await asyncio.sleep(1.0)
    assert len(mx.delivered) == 1 and mx.connections == 1


async def test_the_drain_bound_holds_at_full_concurrency_against_silent_final_dots(
    queue_harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM while every delivery slot waits on an MX that never answers the final dot
    (and more mail is due): the stop is seen at once, not when a delivery ends (up to
    ``data_final_timeout_s``), and the worker returns within ``drain_timeout_s``, so a
    rolling update fits the pod's grace period. The cut-off deliveries are given back
    (leases released) and said to be possible duplicates (RFC 5321 §6.1)."""
    h = queue_harness
    h.dns.add(
        "silentdot.example.test. 300 IN MX 10 mx.silentdot.example.test.\n"
        "mx.silentdot.example.test. 300 IN A 127.0.5.21\n"
        "silentdot2.example.test. 300 IN MX 10 mx.silentdot.example.test.\n"
    )
    # two sites: a worker gives one site three quarters of its slots at most
    concurrency, drain_s = 4, 1.0
    rcpts = [f"u{i}@silentdot{d}.example.test" for i in range(3) for d in ("", "2")]
    h.configure(
        worker={
            "concurrency": concurrency,
            "drain_timeout_s": drain_s,
            "data_final_timeout_s": 600.0,
            "lease_s": 600.0,
        }
    )
    async with ScriptedMx("127.0.5.21", h.mx_port, end_of_data=SILENT) as mx:
        ids = [await h.submit(case_message("CASE-07"), [rcpt]) for rcpt in rcpts]
        w = h.worker()
        stop = asyncio.Event()
        task = asyncio.create_task(w.run(stop))
        try:
            await eventually(
                lambda: sum(len(s.transactions) for s in mx.sessions) == concurrency,
                20,
                what="every slot past its final dot",
            )
            assert len(w._tasks) == concurrency
            loop = asyncio.get_running_loop()
            began = loop.time()
            with caplog.at_level(logging.WARNING, logger="jsqueue.worker"):
                stop.set()
                await asyncio.wait_for(asyncio.shield(task), drain_s + 5)
            assert loop.time() - began < drain_s + 5
        finally:
            stop.set()
            await asyncio.wait({task}, timeout=30)
        interrupted = [r for r in caplog.records if "a possible duplicate" in r.getMessage()]
        assert len(interrupted) == concurrency
        assert all("its final dot was sent" in r.getMessage() for r in interrupted)
        for qid in ids:
            e = await h.entry(qid)
            assert e is not None and e.leases == {}, "leases released"
        mx.end_of_data = "250 2.0.0 ok"

        async def all_gone() -> bool:
            return all([await gone(h, q) for q in ids])

        async with h.running():
            await eventually(all_gone, 30, what="delivered")
    assert sorted(r for t in mx.delivered for r in t.rcpt_to) == sorted(rcpts)


class LosesACancellation:
    """Wraps an async call: once armed, its first call holds the caller until a
    cancellation reaches it and then returns its result anyway, as ``asyncio.wait_for``
    does on Python 3.11 when a request's reply arrives in the same event-loop turn as the
    cancellation (every nats-py request; CPython gh-86296). :attr:`task` is the task it
    held; :attr:`reached` is set once it holds one."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.armed = True
        self.reached = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = await self.call(*args, **kwargs)
        if self.armed:
            self.armed = False
            self.task = asyncio.current_task()
            self.reached.set()
            with contextlib.suppress(asyncio.CancelledError):  # lost, as wait_for loses it
                await asyncio.get_running_loop().create_future()
        return result


class _Presence:
    """The real presence store, whose first heartbeat after the start loses a cancellation."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.beats = LosesACancellation(inner.beat)

    async def beat(self, owner: str, instance: str, ttl_s: float, *, first: bool = False) -> bool:
        if first:
            return bool(await self.inner.beat(owner, instance, ttl_s, first=True))
        return bool(await self.beats(owner, instance, ttl_s))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_stopped_worker_returns_though_its_presence_heartbeat_lost_a_cancellation(
    queue_harness: Harness,
) -> None:
    """The worker ends its presence heartbeat by cancelling it. A cancellation that meets
    the reply of the heartbeat's write is lost on Python 3.11 (gh-86296): the heartbeat
    went on beating and the stopped worker never returned (a pytest worker process was
    once lost to it). It is cancelled until it has ended (jsqueue.tasks)."""
    h = queue_harness
    h.configure(worker={"presence_grace_s": 1.0})
    w = h.worker()
    wrapped = _Presence(w.stores.presence)
    w.stores = dataclasses.replace(w.stores, presence=wrapped)
    stop = asyncio.Event()
    task = asyncio.create_task(w.run(stop))
    try:
        await asyncio.wait_for(wrapped.beats.reached.wait(), 10)
        stop.set()
        done, _ = await asyncio.wait({task}, timeout=10)
        assert done, "the stopped worker returned"
        task.result()
        beats = wrapped.beats.task
        assert beats is not None and beats.cancelled()
    finally:
        if not task.done():  # a failure above: end it, though its heartbeat runs on
            task.cancel()
            await asyncio.wait({task}, timeout=10)


async def test_a_lease_heartbeat_that_lost_a_cancellation_ends_with_its_delivery(
    queue_harness: Harness,
) -> None:
    """DESIGN.md §2.3: the heartbeat that renews a delivery's lease is cancelled when the
    delivery ends. A renewal whose reply meets that cancellation (lost on Python 3.11,
    gh-86296) kept the heartbeat running after its delivery, renewing a lease nobody held;
    the delivery now returns only once its heartbeat has ended."""
    h = queue_harness
    h.configure(worker={"lease_s": 1.0})
    domain = "beat.example.test"
    h.dns.add(one_mx(domain, "127.0.5.21"))
    answer = asyncio.Event()
    w = h.worker()
    renew = LosesACancellation(w._renew)
    w._renew = renew  # type: ignore[method-assign]
    async with ScriptedMx("127.0.5.21", h.mx_port, hold=answer) as mx:
        qid = await h.submit(b"Subject: beat\r\n\r\nbody\r\n", [f"u@{domain}"])
        async with h.running(w):
            await asyncio.wait_for(renew.reached.wait(), 15)  # a renewal under way
            answer.set()
            await eventually(lambda: gone(h, qid), what="delivered and removed")
            heartbeat = renew.task
            assert heartbeat is not None
            done, _ = await asyncio.wait({heartbeat}, timeout=5)
            assert done, "the lease heartbeat ended with its delivery"
    assert len(mx.delivered) == 1


async def test_25mb_message_streamed(queue_harness: Harness) -> None:
    """A 25 MB message goes from the body store to the MX without the worker holding
    several copies: traced peak allocation stays below twice the message size."""
    h = queue_harness
    h.dns.add(
        "big.example.test. 300 IN MX 10 mx.big.example.test.\n"
        "mx.big.example.test. 300 IN A 127.0.2.93\n"
    )
    line = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789\r\n"
    body = b"Subject: big\r\n\r\n" + line * (25_000_000 // len(line))
    # The MX runs in this process: a small read buffer keeps its memory out of the count.
    async with ScriptedMx("127.0.2.93", h.mx_port, keep_data=False, read_limit=64 * 1024) as mx:
        qid = await h.submit(body, ["u@big.example.test"])
        tracemalloc.start()
        try:
            async with h.running():
                await eventually(lambda: gone(h, qid), 60, what="25 MB delivered")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 2 * len(body), f"peak {peak} octets for a {len(body)}-octet message"
    # the whole message arrived, plus only our Received: trace header
    assert 0 < mx.delivered[0].size - len(body) < 512


class TestRecordThroughAnOutage:
    """The stores of this class give up on a request after 0.5 s (three tries: 1.5 s)."""

    @pytest.fixture
    def nats_settings(self) -> NatsSettings:
        return make_settings(request_timeout_s=0.5)

    async def test_a_delivery_is_recorded_after_an_outage_at_the_remote_250(
        self, queue_harness: Harness, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
    ) -> None:
        """RFC 5321 §6.1: the nats-server dies while the MX holds the final reply; the MX
        answers 250 and the outage outlasts the store's own tries. The worker keeps
        trying to record the delivery while its lease keeps other workers off: once NATS
        is back the entry is removed, the delivery is logged, and the MX has one copy,
        also after the item comes back. (It used to give up at the store's tries,
        leaving the delivery unlogged, or unrecorded and sent again after the lease.)"""
        caplog.set_level(logging.INFO, logger="jsqueue.worker")
        h = queue_harness
        # The record is tried through an outage for half the presence grace: 20 s, room
        # for the outage and the nats-server's restart on a loaded machine.
        h.configure(worker={"lease_s": 120.0, "presence_grace_s": 40.0})
        domain = "outage.example.test"
        h.dns.add(one_mx(domain, "127.0.2.26"))
        rcpt = f"u@{domain}"
        hold = asyncio.Event()
        async with ScriptedMx("127.0.2.26", h.mx_port, hold=hold) as mx:
            qid = await h.submit(b"Subject: outage\r\n\r\nbody\r\n", [rcpt])
            async with h.running():
                await eventually(lambda: mx.held == 1, what="the MX holding the final reply")
                nats_server.kill()
                hold.set()
                await asyncio.sleep(OUTAGE_S)  # the outage itself: longer than 3 tries
                await nats_server.start()
                await eventually(lambda: gone(h, qid), 30, what="the delivery recorded")
                await eventually(
                    lambda: f"to=<{rcpt}> domain={domain} outcome=delivered" in caplog.text,
                    what="the delivery logged",
                )

                async def settled() -> bool:
                    return await h.stores.scheduler.backlog() == 0

                await eventually(settled, 20, what="the item settled")
        assert len(mx.delivered) == 1
