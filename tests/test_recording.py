"""Recording an attempt exactly once, by the lease's holder (jsqueue.recording, DESIGN.md
§2.3): a record whose reply was lost after the server applied it is not applied again, and
a lease another worker took over meanwhile is not ended. Real nats-server, DNS and MXes;
where a reply must be lost after the write, the real store's write is made and its answer
replaced by the timeout a lost reply gives."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest
from test_worker import gone, one_mx

from jsqueue import state
from jsqueue.envelope import Entry, RecipientState, utcnow
from jsqueue.errors import BodyNotFound, StoreUnavailable
from jsqueue.worker import Worker
from support.mx import ScriptedMx
from support.queue import Harness, eventually


def lose_reply_of_first(h: Harness, monkeypatch: pytest.MonkeyPatch, method: str) -> list[int]:
    """Make the entry store's ``method`` (``update`` or ``delete``) apply the first write
    that records an attempt and then fail as a timed-out request does (the server applied
    it; its reply was lost). Returns a list that counts the lost replies."""
    entries = h.stores.entries
    real = getattr(entries, method)
    lost: list[int] = []

    async def write(*args: object, **kw: object) -> object:
        result = await real(*args, **kw)
        entry = args[0] if isinstance(args[0], Entry) else None
        recording = entry is None or any(r.attempts for r in entry.recipients)
        if recording and not lost:
            lost.append(1)
            raise StoreUnavailable("request timed out (injected after the write)")
        return result

    monkeypatch.setattr(entries, method, write)
    return lost


async def test_a_record_applied_but_unanswered_counts_the_attempt_once(
    queue_harness: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A 450 recorded by a write that timed out after the server applied it: the next try
    finds the attempt in the entry (the same instant) and does not apply it again. The
    recipient has 1 attempt, not 2, and its retry is where the first write put it (it used
    to count the attempt twice and compute a second, later retry)."""
    caplog.set_level(logging.INFO, logger="jsqueue")
    h = queue_harness
    h.configure(retry={"base_s": 600.0})
    domain = "unanswered.example.test"
    h.dns.add(one_mx(domain, "127.0.2.61"))
    rcpt = f"u@{domain}"
    lost = lose_reply_of_first(h, monkeypatch, "update")
    async with ScriptedMx("127.0.2.61", h.mx_port, rcpt="450 4.2.0 try later") as mx:
        qid = await h.submit(b"Subject: once\r\n\r\nbody\r\n", [rcpt])
        async with h.running():

            async def recorded() -> bool:
                e = await h.entry(qid)
                return bool(lost) and e is not None and not e.leases

            await eventually(recorded, what="the deferral recorded")
            await eventually(lambda: "outcome=deferred" in caplog.text, what="the deferral logged")
    e = await h.entry(qid)
    assert e is not None
    (r,) = e.recipients
    assert (r.state, r.attempts) == (RecipientState.DEFERRED, 1)
    assert r.next_attempt_at is not None and r.last_attempt_at is not None
    assert r.next_attempt_at - r.last_attempt_at == timedelta(seconds=600)
    assert len(mx.sessions) == 1
    assert caplog.text.count("outcome=deferred") == 1


async def test_a_removal_applied_but_unanswered_is_the_delivery(
    queue_harness: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The compare-and-set that removes a delivered entry times out after the server
    applied it: the next try finds the entry gone and knows it was its own removal. The
    delivery is logged as done and the body purged (it used to be taken for an operator's
    delete during delivery, and the body was left for the reconciler's sweep)."""
    caplog.set_level(logging.INFO, logger="jsqueue")
    h = queue_harness
    domain = "removed.example.test"
    h.dns.add(one_mx(domain, "127.0.2.62"))
    lost = lose_reply_of_first(h, monkeypatch, "delete")
    async with ScriptedMx("127.0.2.62", h.mx_port) as mx:
        qid = await h.submit(b"Subject: removal\r\n\r\nbody\r\n", [f"u@{domain}"])
        async with h.running():
            await eventually(lambda: gone(h, qid), what="the entry removed")
            await eventually(
                lambda: f"queue {qid}: done, removed" in caplog.text, what="the removal logged"
            )
    assert lost == [1]
    assert "deleted during delivery" not in caplog.text
    assert len(mx.delivered) == 1
    with pytest.raises(BodyNotFound):
        await h.stores.bodies.info(qid)


@pytest.mark.parametrize("same_name", [False, True], ids=["other worker", "later namesake"])
async def test_a_lease_taken_over_during_delivery_is_left_to_its_holder(
    queue_harness: Harness, caplog: pytest.LogCaptureFixture, same_name: bool
) -> None:
    """DESIGN.md §2.3: while the MX holds the final reply, the destination's lease passes to
    another worker (or to a later process of the same name, as after this one hung past
    its presence grace). When the 250 comes, the first worker records nothing: the other
    lease and its active recipient stay as they are, and the delivery is still logged
    with a warning. (The record used to drop the other lease and mark the recipient
    delivered while its holder was delivering to it.)"""
    caplog.set_level(logging.INFO, logger="jsqueue")
    h = queue_harness
    domain = "takenover.example.test"
    h.dns.add(one_mx(domain, "127.0.2.63"))
    rcpt = f"u@{domain}"
    hold = asyncio.Event()
    w: Worker = h.worker()
    async with ScriptedMx("127.0.2.63", h.mx_port, hold=hold) as mx:
        qid = await h.submit(b"Subject: taken over\r\n\r\nbody\r\n", [rcpt])
        async with h.running(w):
            await eventually(lambda: mx.held == 1, what="the MX holding the final reply")
            v = await h.stores.entries.get(qid)
            owner = w.owner if same_name else "other-worker"
            lease_s = h.settings.worker.lease_s
            taken = state.claim(
                v.entry, domain, owner, utcnow(), lease_s, instance="a-later-process"
            )
            await h.stores.entries.update(taken, v.revision)
            hold.set()
            await eventually(
                lambda: "attempt not recorded" in caplog.text, what="the record refused"
            )
            await eventually(
                lambda: f"to=<{rcpt}> domain={domain} outcome=delivered" in caplog.text,
                what="the delivery logged",
            )
    e = await h.entry(qid)
    assert e is not None
    assert e.leases[domain].owner == owner
    assert e.leases[domain].instance == "a-later-process"
    (r,) = e.recipients
    assert (r.state, r.attempts) == (RecipientState.ACTIVE, 0)
    assert len(mx.delivered) == 1


@pytest.mark.parametrize("lapse", ["lease", "presence"])
async def test_a_worker_paused_past_its_lease_sends_no_final_dot(
    queue_harness: Harness, caplog: pytest.LogCaptureFixture, lapse: str
) -> None:
    """DESIGN.md §2.3, RFC 5321 §4.1.1.4: a worker paused mid-transaction (SIGSTOP, a VM
    pause, its presence beats failing through a NATS outage) wakes past its lease, or past
    its presence grace, while another worker may have taken the destination over and be
    sending the message. It does not send the final dot: the next hop delivers nothing.
    That is the queue's own trouble, not the mail's: no attempt is counted and no backoff
    step taken (``retry.base_s`` is 600 s here); the destination is given back and sent
    within seconds, once. The pause is played at the MX's first DATA: the worker's clock
    jumps past the lease, or its presence is made to look lapsed."""
    caplog.set_level(logging.INFO, logger="jsqueue")
    h = queue_harness
    h.configure(retry={"base_s": 600.0})
    domain = "paused.example.test"
    h.dns.add(one_mx(domain, "127.0.2.64"))
    skew = [timedelta(0)]
    w: Worker = h.worker(clock=lambda: utcnow() + skew[0])
    paused: list[str] = []

    def pause(session: object, line: str) -> None:
        if line.upper().startswith("DATA") and not paused:
            paused.append(line)
            if lapse == "lease":
                skew[0] = timedelta(seconds=h.settings.worker.lease_s + 1)
            else:
                assert w._liveness is not None
                w._liveness.until = 0.0

    async with ScriptedMx("127.0.2.64", h.mx_port, hook=pause) as mx:
        qid = await h.submit(b"Subject: paused\r\n\r\nbody\r\n", [f"u@{domain}"])
        async with h.running(w):
            await eventually(lambda: "before the final dot" in caplog.text, what="the dot withheld")
            await eventually(lambda: len(mx.delivered) == 1, 30, what="sent again, soon")
            await eventually(lambda: gone(h, qid), 10, what="recorded and removed")
    assert "the queue's own trouble, not counted as an attempt" in caplog.text
    assert "outcome=deferred" not in caplog.text
    assert len(mx.transactions) == 1, "the withheld transaction never reached its end"
