"""Delivery workers end to end: real nats-server, real DNS server, real (fake) MXes.

Mail enters through the real SMTP front end, workers deliver it to scripted MXes on
127.0.2.x, and the assertions read what the MXes recorded and what the queue holds.
Each test names the case of ``tests/cases`` or the RFC section it checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import email
import email.policy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from email.message import EmailMessage

import pytest

from jsqueue.admin import Admin
from jsqueue.envelope import Entry, Recipient, RecipientState, WorkItem, utcnow
from jsqueue.errors import BodyNotFound, RevisionConflict, StoreError
from jsqueue.events import Event, EventKind
from jsqueue.metrics import Metrics
from jsqueue.names import new_queue_id
from jsqueue.replies import CUT_MARKER, STORED_REPLY_OCTETS
from jsqueue.store.base import Versioned
from jsqueue.store.jetstream.bodies import JetStreamBodyStore
from jsqueue.store.jetstream.entries import JetStreamEntryStore
from jsqueue.views import Outcome
from support.cases import case_message, case_text
from support.frontend import split_body
from support.mx import ScriptedMx, SmtpdMx, ipv6_loopback_available
from support.nats import chunks_of
from support.queue import Harness, eventually

#: ``smtp.inline_body_max`` of the tests that keep bodies inline (opt-in).
INLINE_MAX = 128 * 1024

SENDER_ZONE = """
example.test.        300 IN MX 10 mx.example.test.
mx.example.test.     300 IN A  127.0.2.1
"""


def one_mx(domain: str, address: str) -> str:
    """Zone text: ``domain`` with one MX ``mx.<domain>`` at ``address`` (plus the sender's)."""
    return SENDER_ZONE + f"{domain}. 300 IN MX 10 mx.{domain}.\nmx.{domain}. 300 IN A {address}\n"


async def gone(h: Harness, queue_id: str) -> bool:
    """The entry has been removed (final and cleaned up)."""
    return await h.entry(queue_id) is None


async def tried_once(h: Harness, queue_id: str) -> bool:
    """The first recipient's first attempt has been recorded."""
    e = await h.entry(queue_id)
    return e is not None and e.recipients[0].attempts == 1


def dsn_parts(raw: bytes) -> tuple[EmailMessage, list[EmailMessage]]:
    """Parse a DSN: the message and its per-recipient delivery-status groups."""
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert isinstance(msg, EmailMessage)
    assert msg.get_content_type() == "multipart/report"
    assert msg.get_param("report-type") == "delivery-status"
    status = next(p for p in msg.walk() if p.get_content_type() == "message/delivery-status")
    groups = status.get_payload()
    assert isinstance(groups, list)
    return msg, groups[1:]


async def test_mixed_replies_case07(queue_harness: Harness) -> None:
    """CASE-07: 250 / 450 / 550 in one transaction. a@ once and never again, b@ retried
    alone and delivered, c@ bounced with exactly one DSN listing only c@ (5.1.1)."""
    h = queue_harness
    h.dns.add(case_text("CASE-07", "dns.txt") + SENDER_ZONE)
    replies = {
        "b@mixed.example.test": "450 4.2.1 mailbox temporarily busy, try later",
        "c@mixed.example.test": "550 5.1.1 no such user here",
    }
    async with (
        SmtpdMx("127.0.2.70", h.mx_port, rcpt_replies=replies) as mx,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        rcpts = [f"{x}@mixed.example.test" for x in "abc"]
        qid = await h.submit(case_message("CASE-07"), rcpts)
        async with h.running():
            await eventually(lambda: len(mx.delivered) >= 1, what="attempt 1")
            mx.rcpt_replies.pop("b@mixed.example.test")
            await eventually(lambda: len(mx.delivered) == 2, what="attempt 2")
            await eventually(
                lambda: len(sender_mx.delivered) == 1,
                what=f"the DSN {[s.commands for s in sender_mx.sessions]}",
            )
            await eventually(lambda: gone(h, qid), what="entry removed")
        first, second = mx.delivered
        assert first.rcpt_to == ["a@mixed.example.test"]
        assert second.rcpt_to == ["b@mixed.example.test"]
        assert [n for s in mx.sessions for n in s.rcpt_counts()] == [3, 1], "attempt 2: b@ alone"
        rcpt_lines = [c for s in mx.sessions for c in s.commands if c.upper().startswith("RCPT")]
        assert "b@mixed.example.test" in rcpt_lines[3]
        dsn_tx = sender_mx.delivered[0]
        assert dsn_tx.mail_from == ""
        assert dsn_tx.rcpt_to == ["alice@example.test"]
        _, groups = dsn_parts(dsn_tx.content)
        assert [g["Final-Recipient"] for g in groups] == ["rfc822; c@mixed.example.test"]
        assert groups[0]["Action"] == "failed"
        assert groups[0]["Status"] == "5.1.1"
        assert "550 5.1.1 no such user here" in str(groups[0]["Diagnostic-Code"])


async def test_three_domains_250_450_550(queue_harness: Harness) -> None:
    """RFC 5321 §4.2.1 per recipient across destinations: 250 / 450 / 550 at three domains
    end delivered / deferred / bounced; the 450 recipient alone is retried and delivered."""
    h = queue_harness
    h.dns.add(
        SENDER_ZONE
        + """
ok.example.test.   300 IN MX 10 mx.ok.example.test.
mx.ok.example.test. 300 IN A 127.0.2.10
soft.example.test.  300 IN MX 10 mx.soft.example.test.
mx.soft.example.test. 300 IN A 127.0.2.11
hard.example.test.  300 IN MX 10 mx.hard.example.test.
mx.hard.example.test. 300 IN A 127.0.2.12
"""
    )
    async with (
        SmtpdMx("127.0.2.10", h.mx_port) as ok,
        SmtpdMx(
            "127.0.2.11", h.mx_port, rcpt_replies={"u@soft.example.test": "450 4.2.0 busy"}
        ) as soft,
        SmtpdMx(
            "127.0.2.12", h.mx_port, rcpt_replies={"u@hard.example.test": "550 5.1.1 no"}
        ) as hard,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        rcpts = ["u@ok.example.test", "u@soft.example.test", "u@hard.example.test"]
        qid = await h.submit(case_message("CASE-07"), rcpts)
        async with h.running():
            await eventually(lambda: len(sender_mx.delivered) == 1, what="failure DSN")

            async def states() -> list[RecipientState]:
                e = await h.entry(qid)
                assert e is not None
                return [r.state for r in e.recipients]

            await eventually(
                lambda: states_are(states, ["delivered", "deferred", "bounced"]), what="states"
            )
            soft.rcpt_replies.clear()
            await eventually(lambda: len(soft.delivered) == 1, what="retry of the 450")
            await eventually(lambda: gone(h, qid), what="entry removed")
        assert [t.rcpt_to for t in ok.delivered] == [["u@ok.example.test"]]
        assert [t.rcpt_to for t in soft.delivered] == [["u@soft.example.test"]]
        assert hard.delivered == []
        assert len(sender_mx.delivered) == 1, "no second DSN"


async def states_are(get: object, expected: list[str]) -> bool:
    """Helper for eventually(): the recipients' states equal ``expected``."""
    states = await get()  # type: ignore[operator]
    return [s.value for s in states] == expected


async def test_null_mx_case09(queue_harness: Harness) -> None:
    """CASE-09 / RFC 7505: null MX fails permanently on the first attempt with 5.1.10,
    the trap at the domain's A record is never contacted, exactly one DSN, no retry."""
    h = queue_harness
    h.dns.add(case_text("CASE-09", "dns.txt") + SENDER_ZONE)
    async with (
        ScriptedMx("127.0.2.55", h.mx_port) as trap,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        qid = await h.submit(case_message("CASE-09"), ["nobody@nomail.example.test"])
        async with h.running():
            await eventually(lambda: len(sender_mx.delivered) == 1, what="DSN")
            await eventually(lambda: gone(h, qid), what="entry removed")
        assert trap.connections == 0
        _, groups = dsn_parts(sender_mx.delivered[0].content or b"")
        assert len(groups) == 1
        assert groups[0]["Status"] == "5.1.10"
        assert "null MX" in str(groups[0]["Diagnostic-Code"])
        assert ("nomail.example.test", "A") not in h.dns.queried


async def test_cname_case11(queue_harness: Harness) -> None:
    """CASE-11: CNAME at the domain and at the MX host are followed; the RCPT keeps the
    original domain; a CNAME loop is a temporary failure, not a hang."""
    h = queue_harness
    h.dns.add(case_text("CASE-11", "dns.txt") + SENDER_ZONE)
    async with (
        SmtpdMx("127.0.2.30", h.mx_port) as real,
        SmtpdMx("127.0.2.40", h.mx_port) as provider,
        ScriptedMx("127.0.2.31", h.mx_port) as trap,
    ):
        rcpts = ["user@alias.example.test", "user@cn.example.test", "user@loop.example.test"]
        qid = await h.submit(case_message("CASE-11"), rcpts)
        async with h.running():
            await eventually(lambda: len(real.delivered) == 1 and len(provider.delivered) == 1)

            async def loop_deferred() -> bool:
                e = await h.entry(qid)
                return e is not None and e.recipients[2].state is RecipientState.DEFERRED

            await eventually(loop_deferred, what="loop domain deferred")
        assert real.delivered[0].rcpt_to == ["user@alias.example.test"]
        assert provider.delivered[0].rcpt_to == ["user@cn.example.test"]
        assert trap.connections == 0
        e = await h.entry(qid)
        assert e is not None and e.recipients[2].last_reply is not None
        assert e.recipients[2].last_reply.code == 451


async def test_dns_failure_classes_case12(queue_harness: Harness) -> None:
    """CASE-12: SERVFAIL and timeout defer (traps untouched), NXDOMAIN bounces at once
    (5.1.2), no MX falls back to the A record, AAAA-only to [::1]; a slow lookup does not
    hold up the other destinations."""
    h = queue_harness
    h.dns.add(case_text("CASE-12", "dns.txt") + SENDER_ZONE)
    # a lookup timeout long enough that "nomx is delivered while slow still waits" holds
    # on a busy machine too
    h.configure(worker={"dns_timeout_s": 4.0})
    v6 = ipv6_loopback_available()
    domains = ["servfail", "nx", "nomx", "slow", "v6only"]
    rcpts = [f"user@{d}.example.test" for d in domains]
    async with contextlib.AsyncExitStack() as stack:
        nomx = await stack.enter_async_context(SmtpdMx("127.0.2.50", h.mx_port))
        traps = [
            await stack.enter_async_context(ScriptedMx(a, h.mx_port))
            for a in ("127.0.2.51", "127.0.2.52")
        ]
        sender_mx = await stack.enter_async_context(SmtpdMx("127.0.2.1", h.mx_port))
        six = await stack.enter_async_context(SmtpdMx("::1", h.mx_port)) if v6 else None
        qid = await h.submit(case_message("CASE-12"), rcpts)
        async with h.running():

            async def settled() -> bool:
                e = await h.entry(qid)
                return e is not None and all(r.attempts >= 1 for r in e.recipients)

            await eventually(settled, 30, what="every destination attempted once")
            e = await h.entry(qid)
            assert e is not None
            by = {r.domain.split(".")[0]: r for r in e.recipients}
            # nomx was delivered while the slow lookup was still waiting for its timeout
            nomx_at, slow_at = by["nomx"].last_attempt_at, by["slow"].last_attempt_at
            assert nomx_at is not None and slow_at is not None
            assert nomx_at < slow_at
            assert nomx.delivered, "nomx delivered"
            await eventually(lambda: len(sender_mx.delivered) == 1, what="one DSN (nx)")
        assert by["servfail"].state is RecipientState.DEFERRED
        assert by["slow"].state is RecipientState.DEFERRED
        assert by["nx"].state is RecipientState.BOUNCED
        assert by["nomx"].state is RecipientState.DELIVERED
        if six is not None:
            assert by["v6only"].state is RecipientState.DELIVERED
            assert six.delivered[0].rcpt_to == ["user@v6only.example.test"]
        else:
            assert by["v6only"].state is RecipientState.DEFERRED
        assert all(t.connections == 0 for t in traps)
        _, groups = dsn_parts(sender_mx.delivered[0].content or b"")
        assert [g["Final-Recipient"] for g in groups] == ["rfc822; user@nx.example.test"]
        assert groups[0]["Status"] in ("5.1.2", "5.4.4")


GREY_ZONE = case_text("CASE-17", "dns.txt")


@pytest.mark.parametrize("variant", ["A", "B", "C"])
async def test_greylisting_case17(queue_harness: Harness, variant: str) -> None:
    """CASE-17: greylisting at RCPT (A), at MAIL (B) or after the data (C) is a temporary
    failure: the attempt counter rises, the next attempt waits for the configured backoff,
    a later attempt delivers exactly one copy, and no failure DSN is sent."""
    h = queue_harness
    h.configure(retry={"base_s": 2.0})
    h.dns.add(GREY_ZONE + SENDER_ZONE)
    grey = "451 4.7.1 greylisted, please retry in 300 seconds"
    kwargs: dict[str, object] = {
        "A": {"rcpt_replies": {"user@grey.example.test": grey}},
        "B": {"mail_reply": grey},
        "C": {"data_reply": grey},
    }[variant]
    async with (
        SmtpdMx("127.0.2.130", h.mx_port, **kwargs) as mx,  # type: ignore[arg-type]
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        qid = await h.submit(case_message("CASE-17"), ["user@grey.example.test"])
        async with h.running():
            await eventually(lambda: tried_once(h, qid), what="first refusal recorded")
            first = await h.entry(qid)
            assert first is not None
            r = first.recipients[0]
            assert r.state is RecipientState.DEFERRED
            assert r.last_reply is not None and r.last_reply.code == 451
            assert r.next_attempt_at is not None and r.last_attempt_at is not None
            assert (r.next_attempt_at - r.last_attempt_at).total_seconds() >= 2.0
            mx.rcpt_replies.clear()
            mx.mail_reply = None
            mx.data_reply = None
            await eventually(lambda: gone(h, qid), what="delivered later")
    assert len(mx.delivered) == 1, "exactly one copy"
    assert sender_mx.delivered == [], "no failure DSN"
    if variant == "C":  # the refused data is not counted as delivered
        assert [t.reply[:3] for t in mx.transactions] == ["451", "250"]


async def test_a_deferred_inline_body_moves_to_the_body_store(queue_harness: Harness) -> None:
    """``smtp.inline_body_max``: when a destination is deferred (RFC 5321 §4.2.1, 4yz) the
    inline body moves to the body store, so queued mail keeps metadata only in its entry;
    the other destination, delivered at once, and the later attempt get the same octets,
    and the body is removed at the end."""
    h = queue_harness
    h.settings.smtp.inline_body_max = INLINE_MAX
    h.configure(retry={"base_s": 2.0})
    h.dns.add(
        one_mx("moves.example.test", "127.0.2.16") + one_mx("at-once.example.test", "127.0.2.17")
    )
    busy = {"u@moves.example.test": "450 4.2.1 mailbox busy, try later"}
    message = case_message("CASE-17")
    async with (
        SmtpdMx("127.0.2.16", h.mx_port, rcpt_replies=busy) as later_mx,
        SmtpdMx("127.0.2.17", h.mx_port) as at_once_mx,
    ):
        qid = await h.submit(message, ["u@moves.example.test", "v@at-once.example.test"])
        submitted = await h.entry(qid)
        assert submitted is not None and submitted.inline_body is not None
        async with h.running():

            async def moved() -> bool:
                e = await h.entry(qid)
                return e is not None and e.recipients[0].attempts == 1 and e.inline_body is None

            await eventually(moved, what="deferred, body moved out of the entry")
            info = await h.stores.bodies.info(qid)
            assert (info.size, info.digest) == (submitted.size, submitted.digest)
            later_mx.rcpt_replies.clear()
            await eventually(lambda: gone(h, qid), what="delivered later")
    for mx in (later_mx, at_once_mx):
        [delivered] = mx.delivered
        assert split_body(delivered.content)[1] == message
    with pytest.raises(BodyNotFound):
        await h.stores.bodies.info(qid)


async def test_moving_a_deferred_inline_body_out_survives_another_writer(
    queue_harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compare-and-set that moves a deferred inline body out loses to another write
    (another destination's outcome, an admin action): the entry is read again and the
    move made on it, so the queued entry holds metadata only."""
    h = queue_harness
    h.settings.smtp.inline_body_max = INLINE_MAX
    h.dns.add(one_mx("raced.example.test", "127.0.2.21"))
    entries = h.stores.entries
    update = entries.update
    raced = False

    async def racing_update(entry: Entry, revision: int) -> int:
        nonlocal raced
        if entry.inline_body is None and not raced:  # the move: another writer first
            raced = True
            current = await entries.get(entry.id)
            other = current.entry.model_copy(update={"last_error": "another writer"})
            await update(other, current.revision)
        return await update(entry, revision)

    monkeypatch.setattr(entries, "update", racing_update)
    busy = {"u@raced.example.test": "450 4.2.1 mailbox busy, try later"}
    async with SmtpdMx("127.0.2.21", h.mx_port, rcpt_replies=busy):
        qid = await h.submit(case_message("CASE-17"), ["u@raced.example.test"])
        async with h.running():

            async def moved() -> bool:
                e = await h.entry(qid)
                return e is not None and e.inline_body is None

            await eventually(moved, what="body moved out after a lost compare-and-set")
    e = await h.entry(qid)
    assert raced and e is not None and e.last_error == "another writer"
    assert e.recipients[0].attempts == 1, "moved after the first deferral, not a later one"
    assert (await h.stores.bodies.info(qid)).size == e.size


async def test_an_inline_body_leaves_an_entry_that_its_replies_make_too_large(
    queue_harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``smtp.inline_body_max``: long multi-line 4yz replies (RFC 5321 §4.2.1) recorded on
    an entry with an inline body would take it past what the entry store holds (even kept
    bounded, 11 recipients' worth); the body goes to the body store first, so the outcome is
    recorded (not refused for its size, which would send the message again after the
    lease), and the later attempt delivers it."""
    h = queue_harness
    h.settings.smtp.inline_body_max = INLINE_MAX
    h.configure(retry={"base_s": 1.0})
    h.dns.add(one_mx("long-reply.example.test", "127.0.2.19"))
    limit = 12 * 1024
    monkeypatch.setattr(JetStreamEntryStore, "max_value_size", property(lambda _: limit))
    message = b"Subject: x\r\n\r\n" + b"body line\r\n" * 180  # 2 KB: fits at ingest
    reply = "\n".join(f"450-4.2.1 busy {i:02d} " + "x" * 480 for i in range(20))
    reply += "\n450 4.2.1 try later"
    rcpts = [f"u{i:02d}@long-reply.example.test" for i in range(11)]
    async with ScriptedMx("127.0.2.19", h.mx_port, rcpt=reply) as mx:
        qid = await h.submit(message, rcpts)
        submitted = await h.entry(qid)
        assert submitted is not None and submitted.inline_body is not None
        async with h.running():
            await eventually(lambda: tried_once(h, qid), what="the long replies recorded")
            e = await h.entry(qid)
            assert e is not None and e.inline_body is None
            assert all(r.last_reply is not None for r in e.recipients)
            assert len(e.to_json()) + len(message) > limit, "too large with the body"
            mx.rcpt = "250 2.1.5 ok"
            await eventually(lambda: gone(h, qid), what="delivered later")
    [delivered] = mx.delivered
    assert split_body(delivered.content)[1] == message


async def test_long_replies_to_many_recipients_are_recorded_and_sent_once(
    queue_harness: Harness,
) -> None:
    """DESIGN.md §2.3: 1 000 recipients at one domain in the default layout (body in the
    body store), every RCPT and the end of data answered with a 10-line reply of 400
    characters a line (RFC 5321 §4.2.1). Kept whole, those replies would take the entry
    past what the entry store holds; the recorded replies are bounded, so the outcome is
    recorded after the one transaction and the message is never sent again (a refused
    record used to leave the lease to run out and the message to be sent each cycle)."""
    h = queue_harness
    h.configure(retry={"base_s": 3600.0}, worker={"lease_s": 2.0})
    domain = "many.example.test"
    h.dns.add(one_mx(domain, "127.0.2.24"))

    def long_reply(code: str, enhanced: str) -> str:
        lines = [f"{code}-{enhanced} line {i} " + "y" * 400 for i in range(9)]
        return "\n".join([*lines, f"{code} {enhanced} last " + "z" * 400])

    rcpts = [f"u{i:04d}@{domain}" for i in range(1000)]
    busy = rcpts[-1]  # one 4yz keeps the entry queued, so its record can be read
    async with ScriptedMx(
        "127.0.2.24",
        h.mx_port,
        rcpt=long_reply("250", "2.1.5"),
        rcpt_replies={busy: long_reply("450", "4.2.1")},
        end_of_data=long_reply("250", "2.0.0"),
    ) as mx:
        qid = await h.submit(b"Subject: many\r\n\r\nbody\r\n", rcpts)
        submitted = await h.entry(qid)
        assert submitted is not None and submitted.inline_body is None
        async with h.running():

            async def recorded() -> bool:
                e = await h.entry(qid)
                return e is not None and all(r.attempts == 1 for r in e.recipients)

            await eventually(recorded, timeout_s=30.0, what="the attempt recorded")
            await asyncio.sleep(3 * 2.0)  # past the lease: nothing may start again
        e = await h.entry(qid)
        assert e is not None
        states = [r.state for r in e.recipients]
        assert states.count(RecipientState.DELIVERED) == 999
        assert e.recipients[-1].state is RecipientState.DEFERRED
        assert not e.held
        reply = e.recipients[0].last_reply
        assert reply is not None and reply.code == 250 and reply.text.startswith("line 0 ")
    assert len(mx.delivered) == 1
    assert [c.split(":")[0].upper() for c in mx.commands].count("MAIL FROM") == 1


class _Events:
    """An observer that keeps every event (and counts them as :class:`Metrics` does)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.metrics = Metrics()

    def emit(self, event: Event) -> None:
        self.events.append(event)
        self.metrics.emit(event)

    def kinds(self) -> list[EventKind]:
        return [e.kind for e in self.events]


async def test_an_attempt_the_entry_store_cannot_take_holds_the_entry(
    queue_harness: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """DESIGN.md §2.3: when not even the recipients' states with the replies cut to their
    codes fit in the entry store, the worker holds the entry (as ``queue hold`` does) and
    says why: an error line, ``too_large`` and ``held`` events, the
    ``jsqueue_entry_too_large_total`` counter. The message is never sent again; the log line
    and the delivered event carry the whole reply (the entry keeps it bounded)."""
    caplog.set_level(logging.INFO, logger="jsqueue.worker")
    h = queue_harness
    h.configure(retry={"base_s": 3600.0}, worker={"lease_s": 2.0})
    domain = "tight.example.test"
    h.dns.add(one_mx(domain, "127.0.2.25"))
    whole = "\n".join(f"250-2.0.0 part {i} " + "w" * 300 for i in range(4)) + "\n250 2.0.0 ok"
    rcpts = [f"u{i}@{domain}" for i in range(10)]
    busy = {rcpts[-1]: "450 4.2.1 busy"}  # keeps the entry: recorded, not removed
    async with ScriptedMx("127.0.2.25", h.mx_port, rcpt_replies=busy, end_of_data=whole) as mx:
        qid = await h.submit(b"Subject: tight\r\n\r\nbody\r\n", rcpts)
        submitted = await h.entry(qid)
        assert submitted is not None
        limit = len(submitted.to_json()) + 200  # the claim fits, no record of 10 does
        monkeypatch.setattr(JetStreamEntryStore, "max_value_size", property(lambda _: limit))
        seen = _Events()
        async with h.running(h.worker(observer=seen)):

            async def held() -> bool:
                e = await h.entry(qid)
                return e is not None and e.held

            await eventually(held, what="the entry held")
            await asyncio.sleep(3 * 2.0)  # past the lease: nothing may start again
        e = await h.entry(qid)
        assert e is not None and e.held and not e.leases
        assert e.last_error is not None and "too large" in e.last_error
    assert len(mx.delivered) == 1
    assert [c.split(":")[0].upper() for c in mx.commands].count("MAIL FROM") == 1
    assert EventKind.TOO_LARGE in seen.kinds() and EventKind.HELD in seen.kinds()
    assert seen.metrics.registry.get_sample_value("jsqueue_entry_too_large_total") == 1
    assert any(
        r.levelname == "ERROR" and "held" in r.getMessage() and qid in r.getMessage()
        for r in caplog.records
    )
    assert any("part 3" in r.getMessage() for r in caplog.records), "the whole reply logged"


async def test_events_and_log_lines_carry_the_whole_reply(
    queue_harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """The entry keeps a reply bounded (:data:`~jsqueue.replies.STORED_REPLY_OCTETS`), the
    log line and the event of the attempt get it whole (RFC 5321 §4.2.1 multi-line)."""
    caplog.set_level(logging.INFO, logger="jsqueue.worker")
    h = queue_harness
    h.configure(retry={"base_s": 3600.0})
    domain = "wordy.example.test"
    h.dns.add(one_mx(domain, "127.0.2.26"))
    wordy = "\n".join(f"450-4.2.1 reason {i} " + "v" * 300 for i in range(5)) + "\n450 4.2.1 end"
    async with ScriptedMx("127.0.2.26", h.mx_port, rcpt=wordy):
        qid = await h.submit(b"Subject: wordy\r\n\r\nbody\r\n", [f"u@{domain}"])
        seen = _Events()
        async with h.running(h.worker(observer=seen)):
            await eventually(lambda: tried_once(h, qid), what="the 450 recorded")
    e = await h.entry(qid)
    assert e is not None and e.recipients[0].last_reply is not None
    stored = e.recipients[0].last_reply.text
    assert len(stored.encode()) <= STORED_REPLY_OCTETS and stored.endswith(CUT_MARKER)
    [deferred] = [ev for ev in seen.events if ev.kind is EventKind.DEFERRED]
    assert deferred.reply is not None and deferred.reply.text.endswith("end")
    assert "reason 4" in deferred.reply.text
    assert any("reason 4" in r.getMessage() for r in caplog.records if qid in r.getMessage())


async def test_a_slow_delivery_keeps_its_lease_and_is_sent_once(queue_harness: Harness) -> None:
    """DESIGN.md §2.3, RFC 5321 §4.5.3.2.6 (up to 10 minutes for the final reply): a server
    slower to answer the end of data than ``worker.lease_s`` does not lose the destination
    to a second attempt. The worker renews its lease while it waits, so a flush meanwhile
    leaves the destination to it (it would take over an expired lease and send again) and
    the server sees one transaction."""
    h = queue_harness
    h.configure(worker={"lease_s": 1.0})
    domain = "slow.example.test"
    h.dns.add(one_mx(domain, "127.0.2.23"))
    answer = asyncio.Event()
    async with ScriptedMx("127.0.2.23", h.mx_port, hold=answer) as mx:
        qid = await h.submit(b"Subject: slow\r\n\r\nbody\r\n", [f"u@{domain}"])
        async with h.running():
            await eventually(lambda: mx.held == 1, what="the end of data held by the server")
            e = await h.entry(qid)
            assert e is not None
            first_until = e.leases[domain].until

            async def renewed_past_first_end() -> bool:
                e = await h.entry(qid)
                lease = e.leases.get(domain) if e is not None else None
                return lease is not None and lease.until > first_until + timedelta(seconds=1)

            await eventually(renewed_past_first_end, what="the lease renewed twice")
            flushed = await Admin(h.stores).flush(qid)
            assert flushed.outcome is Outcome.UNCHANGED, flushed
            assert "leased by" in flushed.detail
            await eventually(renewed_past_first_end, what="the lease still held")
            answer.set()
            await eventually(lambda: gone(h, qid), what="delivered and removed")
    assert mx.held == 1 and len(mx.delivered) == 1
    assert [c.split(":")[0] for c in mx.commands].count("MAIL FROM") == 1


async def test_multiline_replies_case19(queue_harness: Harness) -> None:
    """CASE-19: a 3-line greeting and a mixed-case EHLO reply ending in a bare "250" are
    understood (SIZE=35882577 recognised: MAIL carries SIZE=); ok@ is delivered once;
    blocked@'s 5-line 550 is a permanent failure whose DSN keeps all five lines."""
    h = queue_harness
    h.dns.add(case_text("CASE-19", "dns.txt") + SENDER_ZONE)
    blocked = "\n".join(
        [
            "550-5.7.1 The message from this sender was refused by local policy.",
            "550-5.7.1 Policy reference PX-4471; see the postmaster page of",
            "550-5.7.1 ml.example.test for the appeal procedure. Automated",
            "550-5.7.1 requests will be ignored.",
            "550 5.7.1 id=7f3a2c",
        ]
    )
    async with (
        ScriptedMx(
            "127.0.2.150",
            h.mx_port,
            greeting="220-mx.ml.example.test ESMTP service\n"
            "220-Unsolicited bulk mail is not accepted here.\n220 Connections are logged.",
            ehlo="250-mx.ml.example.test greets you\n250-pipelining\n250-Size 35882577\n"
            "250-8BITMIME\n250-ENHANCEDSTATUSCODES\n250",
            rcpt_replies={"blocked@ml.example.test": blocked},
        ) as mx,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        qid = await h.submit(
            case_message("CASE-19"), ["ok@ml.example.test", "blocked@ml.example.test"]
        )
        async with h.running():
            await eventually(lambda: len(sender_mx.delivered) == 1, what="DSN")
            await eventually(lambda: gone(h, qid), what="removed")
    assert [t.rcpt_to for t in mx.delivered] == [["ok@ml.example.test"]]
    assert any(p.startswith("SIZE=") for p in mx.delivered[0].mail_params)
    _, groups = dsn_parts(sender_mx.delivered[0].content or b"")
    assert groups[0]["Status"] == "5.7.1"
    diag = " ".join(str(groups[0]["Diagnostic-Code"]).split())
    for part in ("refused by local policy", "PX-4471", "appeal procedure", "ignored", "id=7f3a2c"):
        assert part in diag


async def test_malformed_ehlo_reply_is_temporary_case19m(queue_harness: Harness) -> None:
    """CASE-19 variant M: an empty line inside the EHLO reply is a temporary protocol
    error: retried later, no DSN, and the worker keeps delivering other mail."""
    h = queue_harness
    h.dns.add(
        case_text("CASE-19", "dns.txt")
        + SENDER_ZONE
        + "fine.example.test. 300 IN MX 10 mx.fine.example.test.\n"
        + "mx.fine.example.test. 300 IN A 127.0.2.151\n"
    )
    async with (
        ScriptedMx("127.0.2.150", h.mx_port, ehlo="250-mx.ml.example.test\n\n250 SIZE 35882577"),
        SmtpdMx("127.0.2.151", h.mx_port) as fine,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        bad = await h.submit(case_message("CASE-19"), ["ok@ml.example.test"])
        good = await h.submit(case_message("CASE-19"), ["ok@fine.example.test"])
        async with h.running():
            await eventually(lambda: gone(h, good), what="other mail delivered")

            async def retried() -> bool:
                e = await h.entry(bad)
                return e is not None and e.recipients[0].attempts >= 2

            await eventually(retried, what="retried")
        e = await h.entry(bad)
        assert e is not None and e.recipients[0].state is RecipientState.DEFERRED
        assert (
            e.recipients[0].last_reply is not None and e.recipients[0].last_reply.code // 100 == 4
        )
        assert len(fine.delivered) == 1
        assert sender_mx.delivered == []


async def test_size_limit_case26a(queue_harness: Harness) -> None:
    """CASE-26 A / RFC 1870: the next hop's SIZE is below the message size: permanent 5.3.4
    on the first attempt, nothing sent after MAIL (no DATA), one DSN, no retries."""
    h = queue_harness
    h.dns.add(case_text("CASE-26", "dns.txt") + SENDER_ZONE)
    body = case_message("CASE-07") + (b"x" * 78 + b"\r\n") * 25_000
    async with (
        SmtpdMx("127.0.2.220", h.mx_port, size=1_000_000) as small,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        qid = await h.submit(body, ["user@small.example.test"])
        async with h.running():
            await eventually(lambda: len(sender_mx.delivered) == 1, what="DSN")
            await eventually(lambda: gone(h, qid), what="removed")
    assert not any("DATA" in s.verbs() for s in small.sessions)
    _, groups = dsn_parts(sender_mx.delivered[0].content or b"")
    assert groups[0]["Status"] == "5.3.4"
    assert small.connections == 1, "no retry"


async def test_smtputf8_case23(queue_harness: Harness) -> None:
    """CASE-23 through the whole queue (RFC 6531 §3.5): A) an ASCII local part at a U-label
    domain reaches the legacy MX as the A-label with no SMTPUTF8 (our Received: field stays
    ASCII); B) a UTF-8 local part is never sent to the legacy MX: 5.6.7 DSN, no retry;
    C) the SMTPUTF8 MX gets MAIL ... SMTPUTF8 and the UTF-8 local part unchanged."""
    h = queue_harness
    h.dns.add(case_text("CASE-23", "dns.txt") + SENDER_ZONE)
    async with (
        SmtpdMx("127.0.2.190", h.mx_port) as legacy,
        SmtpdMx("127.0.2.191", h.mx_port, smtputf8=True) as intl,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        message = case_message("CASE-23")
        a = await h.submit(message, ["user@bücher.example.test"], mail_options=["SMTPUTF8"])
        b = await h.submit(message, ["müller@dest.example.test"], mail_options=["SMTPUTF8"])
        c = await h.submit(message, ["müller@intl.example.test"], mail_options=["SMTPUTF8"])
        async with h.running():
            for qid in (a, b, c):
                await eventually(lambda q=qid: gone(h, q), what=f"{qid} final")
            await eventually(lambda: len(sender_mx.delivered) == 1, what="DSN for B")
    assert [t.rcpt_to for t in legacy.delivered] == [["user@xn--bcher-kva.example.test"]]
    assert "SMTPUTF8" not in legacy.delivered[0].mail_params
    assert all(c.isascii() for s in legacy.sessions for c in "".join(s.commands))
    assert [t.rcpt_to for t in intl.delivered] == [["müller@intl.example.test"]]
    assert "SMTPUTF8" in intl.delivered[0].mail_params
    _, groups = dsn_parts(sender_mx.delivered[0].content or b"")
    assert groups[0]["Status"] == "5.6.7"


async def test_worker_reuses_the_session_and_quits_it_on_stop(queue_harness: Harness) -> None:
    """Connection cache in the worker (worker.connection_cache_s): three messages to one MX
    one after the other travel over one connection, which gets QUIT when the worker stops."""
    h = queue_harness
    h.configure(worker={"connection_cache_s": 30.0})
    h.dns.add(one_mx("cache.example.test", "127.0.2.13"))
    async with SmtpdMx("127.0.2.13", h.mx_port) as mx:
        async with h.running():
            for n in range(3):
                await h.submit(case_message("CASE-07"), [f"u{n}@cache.example.test"])
                await eventually(lambda n=n: len(mx.delivered) == n + 1, what=f"message {n}")
            assert mx.connections == 1
        await mx.wait_for(lambda: mx.sessions[0].closed)
        assert mx.sessions[0].verbs().count("MAIL") == 3
        assert mx.sessions[0].verbs()[-1] == "QUIT"


@pytest.mark.parametrize("inline_max", [0, INLINE_MAX], ids=["body store", "inline"])
async def test_delivered_entry_is_removed_by_the_compare_and_set_that_records_it(
    queue_harness: Harness, inline_max: int
) -> None:
    """DESIGN.md §2.3 with one synced write less: claim, then a CAS *delete* at the claimed
    revision when every recipient is delivered and no DSN is owed, instead of recording the
    outcome and deleting after. The entries stream sees exactly two writes per delivery; the
    object store two at ingest (chunk, meta; the purge adds none), or none for an inline
    body."""
    h = queue_harness
    h.settings.smtp.inline_body_max = inline_max
    h.dns.add(one_mx("writes.example.test", "127.0.2.14"))
    entries, bodies = h.stores.entries, h.stores.bodies
    assert isinstance(entries, JetStreamEntryStore)
    assert isinstance(bodies, JetStreamBodyStore)

    async def last_seq(stream: str) -> int:
        return (await entries.js.stream_info(stream)).state.last_seq

    async with SmtpdMx("127.0.2.14", h.mx_port) as mx:
        body_writes = await last_seq(bodies.stream)
        qid = await h.submit(case_message("CASE-07"), ["u@writes.example.test"])
        created = await last_seq(entries.stream)
        async with h.running():
            await eventually(lambda: gone(h, qid), what="entry removed")
        assert len(mx.delivered) == 1
        assert await last_seq(entries.stream) - created == 2, "claim + delete"
        assert await last_seq(bodies.stream) - body_writes == (0 if inline_max else 2)
        with pytest.raises(BodyNotFound):
            await h.stores.bodies.info(qid)


@dataclass
class EntryCalls:
    """What the worker asked of the entry store (the test's own polls not counted)."""

    single: list[str] = field(default_factory=list)  # get, one id each
    batched: list[list[str]] = field(default_factory=list)  # get_many (the read-ahead)
    refused: list[str] = field(default_factory=list)  # writes a compare-and-set refused

    def reads(self) -> list[str]:
        """Every id read, batched or not, in order."""
        return self.single + [q for batch in self.batched for q in batch]


def count_entry_calls(monkeypatch: pytest.MonkeyPatch, entries: JetStreamEntryStore) -> EntryCalls:
    """Count the reads and refused writes the worker makes on ``entries``."""
    calls = EntryCalls()
    test_task = asyncio.current_task()
    get, get_many, update, delete = entries.get, entries.get_many, entries.update, entries.delete

    async def counted_get(queue_id: str) -> Versioned:
        if asyncio.current_task() is not test_task:  # the worker's, not this test's polls
            calls.single.append(queue_id)
        return await get(queue_id)

    async def counted_get_many(queue_ids: Sequence[str]) -> list[Versioned | StoreError]:
        calls.batched.append(list(queue_ids))
        return await get_many(queue_ids)

    async def counted_update(entry: Entry, revision: int) -> int:
        try:
            return await update(entry, revision)
        except RevisionConflict:
            calls.refused.append(f"update at {revision}")
            raise

    async def counted_delete(queue_id: str, revision: int | None = None) -> None:
        try:
            await delete(queue_id, revision)
        except RevisionConflict:
            calls.refused.append(f"delete at {revision}")
            raise

    monkeypatch.setattr(entries, "get", counted_get)
    monkeypatch.setattr(entries, "get_many", counted_get_many)
    monkeypatch.setattr(entries, "update", counted_update)
    monkeypatch.setattr(entries, "delete", counted_delete)
    return calls


async def test_one_messages_domains_do_not_race_each_other_in_one_worker(
    queue_harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §2.3 without a worker losing compare-and-sets to itself: the work items of
    one message's three domains arrive in one fetch and run side by side; their claims and
    records take turns on the entry (cas.Turns), each on the newest version the others
    wrote. So no write of theirs is refused, the entries stream sees exactly one claim
    and one record per domain (the last record being the removal), and the entry is read
    once: the second and third claims are tried on the version the first left."""
    h = queue_harness
    domains = ["t1.example.test", "t2.example.test", "t3.example.test"]
    h.dns.add("".join(one_mx(d, f"127.0.2.{21 + i}") for i, d in enumerate(domains)))
    entries = h.stores.entries
    assert isinstance(entries, JetStreamEntryStore)
    calls = count_entry_calls(monkeypatch, entries)
    mxes = [SmtpdMx(f"127.0.2.{21 + i}", h.mx_port) for i in range(len(domains))]
    async with contextlib.AsyncExitStack() as stack:
        for mx in mxes:
            await stack.enter_async_context(mx)
        qid = await h.submit(case_message("CASE-07"), [f"u@{d}" for d in domains])
        created = (await entries.js.stream_info(entries.stream)).state.last_seq
        async with h.running() as (worker,):  # all three items are waiting: one fetch
            await eventually(lambda: gone(h, qid), what="delivered and removed")
            await eventually(lambda: worker.handled == 3, what="the items settled")
        assert [len(mx.delivered) for mx in mxes] == [1, 1, 1]
        assert calls.refused == []
        writes = (await entries.js.stream_info(entries.stream)).state.last_seq - created
        assert writes == 6, "a claim and a record per domain"
        assert calls.reads() == [qid], "one read for the three claims"
        assert len(worker._turns) == 0, "nothing kept once the tasks are done"


async def test_a_fetched_batch_reads_its_entries_in_one_request(
    queue_harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five messages waiting when the worker starts arrive in one fetch: their entries are
    read in one batched read (EntryStore.get_many), not a read each, and each claim is
    tried on that version (its compare-and-set checking it): all five are delivered with
    no entry read of their own and no refused write."""
    h = queue_harness
    h.dns.add(one_mx("batch.example.test", "127.0.2.26"))
    entries = h.stores.entries
    assert isinstance(entries, JetStreamEntryStore)
    calls = count_entry_calls(monkeypatch, entries)
    async with SmtpdMx("127.0.2.26", h.mx_port) as mx:
        qids = [await h.submit(case_message("CASE-07"), ["u@batch.example.test"]) for _ in range(5)]
        async with h.running() as (worker,):
            await eventually(lambda: len(mx.delivered) == 5, what="all five delivered")
            await eventually(lambda: worker.handled == 5, what="the items settled")
    assert calls.batched == [qids], "one read for the fetched batch"
    assert calls.single == [] and calls.refused == []


async def test_outcomes_are_recorded_through_many_concurrent_writers(
    queue_harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §2.3: the compare-and-set that records a delivery's outcome loses to 12
    other writes in a row (as when many destinations of one message finish at once) and
    still gets through: the recipient is recorded, one copy is sent, nothing is retried."""
    h = queue_harness
    h.dns.add(one_mx("busy-entry.example.test", "127.0.2.18"))
    entries = h.stores.entries
    update, delete = entries.update, entries.delete
    competing = 0

    async def another_writer(queue_id: str) -> None:
        nonlocal competing
        competing += 1
        current = await entries.get(queue_id)
        bumped = current.entry.model_copy(update={"last_error": f"other writer {competing}"})
        await update(bumped, current.revision)

    async def contended_delete(queue_id: str, revision: int | None = None) -> None:
        # A delivered entry that owes nothing is recorded by its removal (compare-and-set).
        if revision is not None and competing < 12:
            await another_writer(queue_id)
        await delete(queue_id, revision)

    monkeypatch.setattr(entries, "delete", contended_delete)
    async with SmtpdMx("127.0.2.18", h.mx_port) as mx:
        qid = await h.submit(case_message("CASE-07"), ["u@busy-entry.example.test"])
        async with h.running() as (worker,):
            await eventually(lambda: gone(h, qid), what="recorded and removed")
            await eventually(lambda: worker.handled == 1, what="the item settled")
        assert competing == 12
        assert len(mx.delivered) == 1
        assert await h.stores.scheduler.backlog() == 0


@pytest.mark.parametrize("inline_max", [0, INLINE_MAX], ids=["body store", "inline"])
async def test_both_body_layouts_deliver_and_return_the_same_octets(
    queue_harness: Harness, inline_max: int
) -> None:
    """A body kept in the object store or inline in its entry is delivered
    octet for octet, returned whole in the DSN of a recipient refused with 550 (RET=FULL,
    RFC 3461 §4.3, RFC 3464 §2), and leaves nothing in the body store once the entry is
    removed."""
    h = queue_harness
    h.settings.smtp.inline_body_max = inline_max
    h.dns.add(one_mx("layout.example.test", "127.0.2.15"))
    replies = {"no@layout.example.test": "550 5.1.1 no such user here"}
    message = case_message("CASE-07")
    async with (
        SmtpdMx("127.0.2.15", h.mx_port, rcpt_replies=replies) as mx,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        qid = await h.submit(
            message,
            ["yes@layout.example.test", "no@layout.example.test"],
            mail_options=["RET=FULL"],
        )
        entry = await h.entry(qid)
        assert entry is not None and (entry.inline_body is not None) == (inline_max > 0)
        async with h.running():
            await eventually(lambda: len(sender_mx.delivered) == 1, what="the DSN")
            await eventually(lambda: gone(h, qid), what="entry removed")
        [delivered] = mx.delivered
        assert delivered.rcpt_to == ["yes@layout.example.test"]
        received, rest = split_body(delivered.content)
        assert rest == message and f"id {qid}".encode() in received
        dsn, _ = dsn_parts(sender_mx.delivered[0].content)
        [returned] = [p for p in dsn.walk() if p.get_content_type() == "message/rfc822"]
        assert returned.as_bytes().replace(b"\n", b"\r\n").endswith(rest.split(b"\r\n\r\n", 1)[1])
        with pytest.raises(BodyNotFound):
            await h.stores.bodies.info(qid)


async def test_work_item_ahead_of_its_entry_is_delivered_once_the_entry_is_there(
    queue_harness: Harness,
) -> None:
    """The front end stores the entry and publishes the work item at the same time, so a
    worker may get the item first: it is tried again shortly (state.CREATE_GRACE_S), not
    dropped, and the message goes out once the entry is stored."""
    h = queue_harness
    h.dns.add(one_mx("ahead.example.test", "127.0.2.15"))
    message = case_message("CASE-07")
    qid = new_queue_id()
    info = await h.stores.bodies.put(qid, chunks_of(message), fresh=True)
    entry = Entry(
        id=qid,
        reverse_path="alice@example.test",
        recipients=[Recipient.from_address("u@ahead.example.test")],
        created_at=utcnow(),
        size=info.size,
        digest=info.digest,
    )
    async with SmtpdMx("127.0.2.15", h.mx_port) as mx:
        worker = h.worker()
        async with h.running(worker):
            await h.stores.scheduler.schedule(WorkItem(qid, "ahead.example.test"))
            await eventually(lambda: worker.handled >= 1, what="the item, before its entry")
            assert mx.connections == 0
            await h.stores.entries.create(entry)
            await eventually(lambda: len(mx.delivered) == 1, what="delivery")
            await eventually(lambda: gone(h, qid), what="entry removed")
        assert mx.delivered[0].rcpt_to == ["u@ahead.example.test"]


async def test_a_site_limit_holds_when_a_delivery_cannot_reuse_the_idle_session(
    queue_harness: Harness,
) -> None:
    """A site of two MX hosts (a site group), one session allowed: mail to the first
    leaves its session idle in the connection cache; mail to the second needs a session
    of its own, and the idle one is closed (QUIT) before it opens, so the MX never has
    two sessions of the site at once. (The admission counted on the idle session: the
    new one used to open beside it, past the limit.)"""
    h = queue_harness
    h.dns.add(
        "one.grp.example.test. 300 IN MX 10 mx1.grp.example.test.\n"
        "mx1.grp.example.test. 300 IN A 127.0.5.31\n"
        "two.grp.example.test. 300 IN MX 10 mx2.grp.example.test.\n"
        "mx2.grp.example.test. 300 IN A 127.0.5.31\n"
    )
    h.configure(
        destinations={"sessions": 1, "groups": {"grp": ["*.grp.example.test"]}},
        worker={"connection_cache_s": 60.0},
    )
    async with ScriptedMx("127.0.5.31", h.mx_port) as mx, h.running():
        first = await h.submit(b"Subject: one\r\n\r\nx\r\n", ["a@one.grp.example.test"])
        await eventually(lambda: gone(h, first), what="the first delivered")
        second = await h.submit(b"Subject: two\r\n\r\nx\r\n", ["b@two.grp.example.test"])
        await eventually(lambda: gone(h, second), what="the second delivered")
    assert len(mx.delivered) == 2 and mx.connections == 2
    assert mx.sessions[0].verbs()[-1] == "QUIT"
    assert mx.sessions[1].beside == 0, "two sessions of a one-session site at once"


async def test_a_slow_sites_backlog_leaves_room_for_other_sites(queue_harness: Harness) -> None:
    """A worker of concurrency 4 and a slow site of 4 sessions whose end-of-data replies
    are held: 8 messages to it, then one to another site. A quarter of the worker stays
    for other sites (``limits.per_site_cap``: 3 of 4 here), so the other site's message is
    delivered while the slow site's 3 wait; the rest of its backlog is put back. All 4
    used to go to the slow site and nothing else was fetched until one of them ended (a
    fresh message waited for a 400-message backlog: 60 s)."""
    h = queue_harness
    # (the held replies must not time out while the other site's message goes: no retries)
    h.configure(
        worker={"concurrency": 4, "data_final_timeout_s": 120.0}, destinations={"sessions": 4}
    )
    h.dns.add(one_mx("slow.example.test", "127.0.5.32") + one_mx("fast.example.test", "127.0.5.33"))
    answer = asyncio.Event()
    async with (
        ScriptedMx("127.0.5.32", h.mx_port, hold=answer) as slow,
        SmtpdMx("127.0.5.33", h.mx_port) as fast,
    ):
        backlog = [
            await h.submit(b"Subject: slow\r\n\r\nx\r\n", [f"u{i}@slow.example.test"])
            for i in range(8)
        ]
        async with h.running():
            await eventually(lambda: slow.held == 3, what="three held at the slow site")
            fresh = await h.submit(b"Subject: fast\r\n\r\nx\r\n", ["v@fast.example.test"])
            await eventually(lambda: gone(h, fresh), what="the other site's message delivered")
            assert slow.held == 3 and len(fast.delivered) == 1
            answer.set()
            for qid in backlog:
                await eventually(lambda qid=qid: gone(h, qid), 30, what="the backlog delivered")
    assert len(slow.delivered) == 8
