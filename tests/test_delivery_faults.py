"""Delivery faults: an uncertain outcome after the final dot (RFC 5321 §6.1, §4.5.3.2.6),
recipient limits per transaction (§4.5.3.1.10) and replies out of sync (§4.2). The client
against scripted MXes, and workers end to end (real nats-server, DNS server); loopback."""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
from collections.abc import Callable

import aiosmtplib
import pytest
from aiosmtplib.protocol import SMTPProtocol
from test_worker import _Events, dsn_parts, gone, one_mx, tried_once

from jsqueue.config import WorkerSettings
from jsqueue.delivery import (
    BodySource,
    ConnectionCache,
    DeliveryEnvelope,
    DeliveryResult,
    MxTarget,
    deliver,
)
from jsqueue.delivery.sync import GuardedProtocol, GuardedSMTP
from jsqueue.dsn.report import diagnostic_code
from jsqueue.envelope import Recipient
from jsqueue.events import EventKind
from jsqueue.replies import Reply
from support.mx import CLOSE, SILENT, ScriptedMx, Session, SmtpdMx, shared_port
from support.queue import Harness, eventually


@pytest.mark.parametrize("end_of_data", [CLOSE, SILENT])
async def test_no_reply_to_the_final_dot_is_an_uncertain_deferral(
    queue_harness: Harness, caplog: pytest.LogCaptureFixture, end_of_data: str
) -> None:
    """RFC 5321 §4.5.3.2.6, §6.1: the connection dies (or the reply times out) after the
    final dot. The recipient is deferred, and the log line, the deferred event and
    ``jsqueue_delivery_uncertain_total`` say the outcome is uncertain (it may be delivered
    twice); ordinary deferrals stay unmarked."""
    caplog.set_level(logging.INFO, logger="jsqueue.worker")
    h = queue_harness
    h.configure(retry={"base_s": 3600.0}, worker={"data_final_timeout_s": 0.5})
    domain = "dot.example.test"
    h.dns.add(one_mx(domain, "127.0.2.27"))
    rcpt, busy = f"u@{domain}", f"busy@{domain}"
    replies = {busy: "450 4.2.1 busy"}
    async with ScriptedMx(
        "127.0.2.27", h.mx_port, end_of_data=end_of_data, rcpt_replies=replies
    ) as mx:
        qid = await h.submit(b"Subject: dot\r\n\r\nbody\r\n", [rcpt, busy])
        seen = _Events()
        async with h.running(h.worker(observer=seen)):
            await eventually(lambda: tried_once(h, qid), what="the attempt recorded")
            await eventually(lambda: len(seen.events) >= 2, what="the events")
    assert mx.transactions and mx.transactions[0].rcpt_to == [rcpt]
    e = await h.entry(qid)
    assert e is not None
    states = {r.address: r.state.value for r in e.recipients}
    assert states == {rcpt: "deferred", busy: "deferred"}
    deferred = {ev.recipient: ev for ev in seen.events if ev.kind is EventKind.DEFERRED}
    assert deferred[rcpt].uncertain is True
    assert deferred[busy].uncertain is None
    assert b'"uncertain":true' in deferred[rcpt].to_json()
    lines = [r.getMessage() for r in caplog.records if qid in r.getMessage()]
    [line] = [x for x in lines if f"to=<{rcpt}>" in x]
    assert "outcome=deferred" in line and "uncertain=yes" in line
    [other] = [x for x in lines if f"to=<{busy}>" in x]
    assert "uncertain" not in other
    registry = seen.metrics.registry
    assert registry.get_sample_value("jsqueue_delivery_uncertain_total") == 1
    sample = registry.get_sample_value("jsqueue_delivery_attempts_total", {"outcome": "deferred"})
    assert sample == 2


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("answer", ["354 go on", "199 what", "300 huh"])
async def test_an_impossible_reply_to_the_final_dot_is_an_uncertain_deferral(
    pipelining: bool, answer: str
) -> None:
    """RFC 5321 §4.2.1, §6.1: the final dot went out and the server answered with a code no
    final reply has (1yz, 3yz). The next hop may have taken the message: the recipient is
    deferred and marked uncertain, and the connection is not used again (it was deferred
    unmarked, the connection kept)."""
    host = "127.0.2.127"
    port = shared_port([host])
    rcpt = "u@dot.example.test"
    async with ScriptedMx(host, port, end_of_data=answer) as mx:
        cache = ConnectionCache(idle_s=5.0)
        result = await deliver(
            [MxTarget(host="mx.dot.example.test", address=host)],
            envelope_of(rcpt),
            BODY,
            client_settings(port, pipelining=pipelining),
            cache,
        )
        idle = cache.idle
        await cache.close()
    reply = result.replies[rcpt]
    assert reply.is_temporary and reply.enhanced == "4.5.0", reply
    assert result.uncertain == frozenset({rcpt})
    assert len(mx.transactions) == 1 and idle == 0


# --- recipient limits per transaction (RFC 5321 §4.5.3.1.10) ------------------------------


def limit_of(n: int, reply: str) -> Callable[[Session, str], str | None]:
    """A hook: at most ``n`` RCPTs per transaction are processed, the rest get ``reply``."""

    def hook(session: Session, line: str) -> str | None:
        if line.upper().startswith("RCPT") and session.rcpt_counts()[-1] > n:
            return reply
        return None

    return hook


def client_settings(port: int, **overrides: object) -> WorkerSettings:
    values: dict[str, object] = {"mx_port": port, "ehlo_name": "worker.example.test"}
    values.update(overrides)
    return WorkerSettings.model_validate(values)


def envelope_of(*addresses: str) -> DeliveryEnvelope:
    recipients = tuple(Recipient.from_address(a) for a in addresses)
    return DeliveryEnvelope(
        domain=recipients[0].domain, reverse_path="alice@example.test", recipients=recipients
    )


BODY = BodySource.from_bytes(b"Subject: many\r\n\r\nbody\r\n")


async def to_limit_mx(host: str, port: int, rcpts: list[str], **settings: object) -> DeliveryResult:
    """One attempt for ``rcpts`` to the one MX ``mx.limit.example.test`` at ``host``."""
    target = [MxTarget(host="mx.limit.example.test", address=host)]
    return await deliver(target, envelope_of(*rcpts), BODY, client_settings(port, **settings))


@pytest.mark.parametrize(
    "limit_reply",
    [
        "452 4.5.3 Too many recipients",
        "452 too many recipients",
        "552 5.5.3 Too many recipients",
        "552 too many recipients for this message",
        "552 5.7.1 Recipient limit exceeded",
        "552 Recipient limit reached",
        "552 maximum number of recipients per message reached",
    ],
)
@pytest.mark.parametrize("after_data", ["stay", CLOSE, "421 4.3.2 one message per session"])
async def test_recipient_limit_sends_the_rest_in_further_transactions(
    limit_reply: str, after_data: str
) -> None:
    """RFC 5321 §4.5.3.1.10: a server that takes 2 RCPTs per transaction and answers the
    rest 452 (or 552 "too many recipients", which the client SHOULD treat as temporary)
    gets all 5 recipients in one attempt: further transactions of at most 2, on the same
    session (no RSET after a completed transaction) or, when the server closes after the
    data, on a new one. Every recipient is delivered, none deferred or bounced."""
    host = "127.0.2.120"
    port = shared_port([host])
    rcpts = [f"u{i}@limit.example.test" for i in range(5)]
    limit = limit_of(2, limit_reply)

    def hook(session: Session, line: str) -> str | None:
        if after_data != "stay" and line.upper().startswith("MAIL") and session.transactions:
            return after_data  # the server ends the session after one message
        return limit(session, line)

    async with ScriptedMx(host, port, hook=hook) as mx:
        result = await to_limit_mx(host, port, rcpts)
    assert result.delivered == rcpts, result.replies
    assert result.deferred == [] and result.failed == []
    assert [t.rcpt_to for t in mx.delivered] == [rcpts[0:2], rcpts[2:4], rcpts[4:5]]
    assert "RSET" not in [v for s in mx.sessions for v in s.verbs()]
    assert mx.connections == (1 if after_data == "stay" else 3)


@pytest.mark.parametrize("pipelining", [True, False])
async def test_recipient_limit_gives_up_when_a_transaction_accepts_no_one(
    pipelining: bool,
) -> None:
    """The extra transactions are bounded: one that accepts no recipient at all ends them
    on its connection, one new connection is tried for them (the limit may be the
    connection's), and a session whose first transaction accepts no one ends the attempt;
    its recipients are deferred with the 452 (never bounced). Pipelined, the first group
    offers every RCPT (RFC 2920); one at a time, the first 452 ends it."""
    host = "127.0.2.121"
    port = shared_port([host])
    rcpts = [f"u{i}@limit.example.test" for i in range(3)]
    count = 0

    def hook(session: Session, line: str) -> str | None:
        nonlocal count
        if line.upper().startswith("RCPT"):
            count += 1
            if count > 1:  # the first RCPT of the attempt only, then nothing more
                return "452 4.5.3 Too many recipients"
        return None

    async with ScriptedMx(host, port, hook=hook) as mx:
        result = await to_limit_mx(host, port, rcpts, pipelining=pipelining)
    assert result.delivered == rcpts[:1]
    assert result.deferred == rcpts[1:]
    assert all(result.replies[a].code == 452 for a in rcpts[1:])
    assert [t.rcpt_to for t in mx.delivered] == [rcpts[:1]]
    offered = [n for s in mx.sessions for n in s.rcpt_counts()]
    assert offered == ([3, 2, 2] if pipelining else [2, 2, 2])
    assert mx.connections == 2


@pytest.mark.parametrize("pipelining", [True, False])
async def test_a_recipient_limit_per_connection_sends_the_rest_on_new_connections(
    pipelining: bool,
) -> None:
    """RFC 5321 §4.5.3.1.10: a server whose limit counts the recipients of a connection
    (not of a transaction) answers 452 to every RCPT of the further transaction on the
    same connection. The rest are not left for the next retry: a new connection takes
    them, two per connection here, all within one attempt."""
    host = "127.0.2.122"
    port = shared_port([host])
    rcpts = [f"u{i}@limit.example.test" for i in range(5)]

    def two_per_connection(session: Session, line: str) -> str | None:
        if line.upper().startswith("RCPT") and sum(session.rcpt_counts()) > 2:
            return "452 4.5.3 Too many recipients for this connection"
        return None

    async with ScriptedMx(host, port, hook=two_per_connection) as mx:
        result = await to_limit_mx(host, port, rcpts, pipelining=pipelining)
    assert result.delivered == rcpts, result.replies
    assert [t.rcpt_to for t in mx.delivered] == [rcpts[0:2], rcpts[2:4], rcpts[4:]]
    assert mx.connections == 3


@pytest.mark.parametrize("pipelining", [True, False])
async def test_refusals_of_a_follow_up_session_that_then_fails_stand(pipelining: bool) -> None:
    """RFC 5321 §3.3, §4.5.3.1.10: two recipients per connection; the new connection for
    the rest refuses one (550) and then ends the session at its error limit (421). The
    refusal stands (a bounce), the one after the 421 is deferred. The follow-up session's
    refusals used to be dropped: the recipient kept the limit's 452 and was retried."""
    host = "127.0.2.129"
    port = shared_port([host])
    rcpts = [f"u{i}@limit.example.test" for i in range(4)]
    refusal = "550 5.1.1 <u2>: Recipient address rejected: User unknown"

    def hook(session: Session, line: str) -> str | None:
        if not line.upper().startswith("RCPT"):
            return None
        if session is mx.sessions[0]:  # the first connection: two recipients
            limit = sum(session.rcpt_counts()) > 2
            return "452 4.5.3 Too many recipients for this connection" if limit else None
        return refusal if rcpts[2] in line else "421 4.7.0 Error: too many errors"

    async with ScriptedMx(host, port, hook=hook) as mx:
        result = await to_limit_mx(host, port, rcpts, pipelining=pipelining)
    assert [t.rcpt_to for t in mx.delivered] == [rcpts[0:2]]
    assert result.delivered == rcpts[0:2]
    assert (result.replies[rcpts[2]].code, result.replies[rcpts[2]].enhanced) == (550, "5.1.1")
    assert result.deferred == rcpts[3:]


def too_many_errors(bad: set[str], after: int) -> Callable[[Session, str], str | None]:
    """A hook: RCPTs for ``bad`` get ``550 5.1.1``; once ``after`` of them were refused, the
    next RCPT gets ``421 4.7.0 Error: too many errors`` and the connection closes at the
    next command (a server's hard error limit, as Postfix's ``smtpd_hard_error_limit``)."""
    closing: set[int] = set()

    def hook(session: Session, line: str) -> str | None:
        if id(session) in closing:
            return CLOSE
        if not line.upper().startswith("RCPT"):
            return None
        earlier = [c for c in session.commands[:-1] if c.upper().startswith("RCPT")]
        if sum(any(b in c for b in bad) for c in earlier) >= after:
            closing.add(id(session))
            return "421 4.7.0 Error: too many errors"
        if any(b in line for b in bad):
            return "550 5.1.1 <x>: Recipient address rejected: User unknown"
        return None

    return hook


@pytest.mark.parametrize("pipelining", [True, False])
async def test_refusals_before_a_421_stand_and_the_rest_go_to_the_next_mx(
    pipelining: bool,
) -> None:
    """RFC 5321 §3.3, §3.8: each RCPT reply is the server's answer for its recipient. A
    server that refuses two recipients (550) and then ends the session at its error limit
    (421, as Postfix's smtpd_hard_error_limit) leaves those two refused; only the others
    go to the next MX. All four used to go on with the 421, so the refused ones were never
    bounced and, retried in the same order, those after the limit never delivered."""
    one, two = "127.0.2.124", "127.0.2.125"
    port = shared_port([one, two])
    bad = [f"bad{i}@limit.example.test" for i in range(3)]
    good = "good@limit.example.test"
    hook = too_many_errors(set(bad), after=2)
    async with ScriptedMx(one, port, hook=hook) as first, ScriptedMx(two, port) as second:
        result = await deliver(
            [
                MxTarget(host="mx1.limit.example.test", address=one),
                MxTarget(host="mx2.limit.example.test", address=two),
            ],
            envelope_of(*bad, good),
            BODY,
            client_settings(port, pipelining=pipelining),
        )
    for address in bad[:2]:
        reply = result.replies[address]
        assert (reply.code, reply.enhanced) == (550, "5.1.1"), reply
        assert reply.remote_host == "mx1.limit.example.test"
    assert first.delivered == []
    assert [t.rcpt_to for t in second.delivered] == [[bad[2], good]]
    assert result.delivered == [bad[2], good]


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("data_reply", ["421 4.7.0 Error: too many errors", CLOSE])
async def test_refusals_before_a_421_to_data_stand(pipelining: bool, data_reply: str) -> None:
    """RFC 5321 §3.3: a RCPT reply is the server's answer for its recipient, also when the
    DATA after it gets 421 or the connection is lost (no body went out). The refused one
    keeps its 550 and is not offered to the next MX; the accepted one goes there. Without
    PIPELINING the refusal used to be replaced by the 421 (or a 451), so the recipient was
    retried until it expired and then reported with a reply that was never its own."""
    one, two = "127.0.2.127", "127.0.2.128"
    port = shared_port([one, two])
    bad, good = "bad@data421.example.test", "good@data421.example.test"
    refusal = "550 5.1.1 <bad>: Recipient address rejected: User unknown"
    async with (
        ScriptedMx(one, port, rcpt_replies={bad: refusal}, data=data_reply) as first,
        ScriptedMx(two, port) as second,
    ):
        result = await deliver(
            [
                MxTarget(host="mx1.data421.example.test", address=one),
                MxTarget(host="mx2.data421.example.test", address=two),
            ],
            envelope_of(bad, good),
            BODY,
            client_settings(port, pipelining=pipelining),
        )
    reply = result.replies[bad]
    assert (reply.code, reply.enhanced, reply.remote_host) == (
        550,
        "5.1.1",
        "mx1.data421.example.test",
    ), reply
    assert first.delivered == []
    assert [t.rcpt_to for t in second.delivered] == [[good]]
    assert result.delivered == [good]


async def test_a_server_error_limit_does_not_hold_back_the_valid_recipient(
    queue_harness: Harness,
) -> None:
    """A worker, one MX with an error limit of 3: the first attempt has three 550s and then
    the 421. The three bounce (one DSN, 5.1.1), and the next attempt offers only the valid
    recipient, which is delivered. Before, all four were deferred on every attempt."""
    h = queue_harness
    h.configure(retry={"base_s": 1.0, "factor": 1.0, "jitter": 0.0})
    domain = "errlimit.example.test"
    h.dns.add(one_mx(domain, "127.0.2.126"))
    bad = [f"bad{i}@{domain}" for i in range(3)]
    good = f"good@{domain}"
    hook = too_many_errors(set(bad), after=3)
    async with (
        ScriptedMx("127.0.2.126", h.mx_port, hook=hook) as mx,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        qid = await h.submit(b"Subject: limit\r\n\r\nbody\r\n", [*bad, good])
        async with h.running():
            await eventually(lambda: gone(h, qid), 20, what="bounced, delivered and removed")
            await eventually(lambda: len(sender_mx.delivered) == 1, what="the DSN")
    assert [t.rcpt_to for t in mx.delivered] == [[good]]
    _, groups = dsn_parts(sender_mx.delivered[0].content or b"")
    assert sorted(str(g["Final-Recipient"]) for g in groups) == [f"rfc822; {b}" for b in bad]
    assert {str(g["Status"]) for g in groups} == {"5.1.1"}


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize(
    ("full_reply", "enhanced", "text"),
    [
        ("552 5.2.2 mailbox full", "4.2.2", "mailbox full"),
        ("552 quota exceeded", None, "quota exceeded"),
    ],
)
async def test_any_other_552_to_rcpt_defers_its_recipient_only(
    pipelining: bool, full_reply: str, enhanced: str | None, text: str
) -> None:
    """RFC 5321 §4.5.3.1.10: clients SHOULD treat a 552 to RCPT as temporary (RFC 3463
    §3.3: X.2.2 mailbox full is a persistent transient failure), as Postfix does: the
    recipient is deferred with ``452`` (class 4 enhanced code, the server's text kept),
    never bounced at once; not being a recipient limit, it does not hold back the others,
    which are delivered in the same transaction. The server's own codes and text are
    kept: the DSN's Diagnostic-Code is the reply as the server sent it (RFC 3464 §2.3.6),
    also after the reply went through an entry's JSON."""
    host = "127.0.2.122"
    port = shared_port([host])
    a, full, c = "a@limit.example.test", "full@limit.example.test", "c@limit.example.test"
    async with ScriptedMx(host, port, rcpt_replies={full: full_reply}) as mx:
        result = await to_limit_mx(host, port, [a, full, c], pipelining=pipelining)
    assert result.delivered == [a, c] and result.deferred == [full] and result.failed == []
    recorded = result.replies[full]
    assert recorded.code == 452 and recorded.is_temporary
    assert recorded.enhanced == enhanced and recorded.text == text
    assert [t.rcpt_to for t in mx.delivered] == [[a, c]]
    sent = full_reply.split(" ", 2)[0] if enhanced is None else " ".join(full_reply.split()[:2])
    stored = Reply.model_validate_json(recorded.model_dump_json())
    assert stored.sent == sent
    assert diagnostic_code(stored) == [f"smtp; {full_reply}"]


async def test_worker_records_every_recipient_past_a_limit_delivered(
    queue_harness: Harness,
) -> None:
    """A worker attempt against a server taking 2 RCPTs per transaction: all 5 recipients
    are recorded delivered in the one attempt; no deferred or bounced event."""
    h = queue_harness
    domain = "limit.example.test"
    h.dns.add(one_mx(domain, "127.0.2.28"))
    rcpts = [f"u{i}@{domain}" for i in range(5)]
    async with ScriptedMx("127.0.2.28", h.mx_port, hook=limit_of(2, "452 4.5.3 limit")) as mx:
        qid = await h.submit(b"Subject: many\r\n\r\nbody\r\n", rcpts)
        seen = _Events()
        async with h.running(h.worker(observer=seen)):
            await eventually(lambda: gone(h, qid), what="every recipient delivered")
    assert [t.rcpt_to for t in mx.delivered] == [rcpts[0:2], rcpts[2:4], rcpts[4:5]]
    assert sorted(e.recipient or "" for e in seen.events) == rcpts
    assert {e.kind for e in seen.events} == {EventKind.DELIVERED}
    assert all(e.attempts == 1 for e in seen.events)


# --- reply synchronisation (RFC 5321 §4.2: one reply per command) -------------------------

DESYNC = "desynchronised reply detected"


def first_session(verb: str, reply: Callable[[ScriptedMx, Session], str], every: bool = False):  # type: ignore[no-untyped-def]
    """A hook answering ``verb`` with ``reply(mx, session)`` on the first connection (on
    every one with ``every``); bind it with ``hook.mx = mx``."""

    def hook(session: Session, line: str) -> str | None:
        mx = hook.mx  # type: ignore[attr-defined]
        if line.upper().startswith(verb) and (every or mx.sessions[0] is session):
            return reply(mx, session)
        return None

    return hook


def two_lines_to_first_rcpt(mx: ScriptedMx, session: Session) -> str:
    if session.rcpt_counts()[-1] == 1:
        return "250 2.1.5 ok\n550 5.1.1 no such user (not yours)"
    return mx.rcpt


def extra_after_ehlo(mx: ScriptedMx, session: Session) -> str:
    return mx._ehlo_reply(session) + "\n250 2.0.0 and one more line"


@pytest.mark.parametrize(
    "verb,script", [("RCPT", two_lines_to_first_rcpt), ("EHLO", extra_after_ehlo)]
)
@pytest.mark.parametrize("cached", [False, True])
async def test_a_reply_with_extra_lines_is_never_paired_with_a_later_command(
    caplog: pytest.LogCaptureFixture,
    verb: str,
    script: Callable[[ScriptedMx, Session], str],
    cached: bool,
) -> None:
    """RFC 5321 §4.2: a server that answers one RCPT with two lines (an extra 550), or sends
    an extra line after its EHLO reply, on the first connection: the extra line is not
    taken as the next command's reply (no recipient bounced for another's 550); the
    connection is dropped and every recipient is delivered on a fresh one; the log says so."""
    caplog.set_level(logging.INFO, logger="jsqueue.delivery")
    host = "127.0.2.123"
    port = shared_port([host])
    rcpts = [f"{x}@sync.example.test" for x in "abc"]
    hook = first_session(verb, script)
    cache = ConnectionCache(idle_s=30.0) if cached else None
    async with ScriptedMx(host, port, hook=hook) as mx:
        hook.mx = mx  # type: ignore[attr-defined]
        result = await deliver(
            [MxTarget(host="mx.sync.example.test", address=host)],
            envelope_of(*rcpts),
            BODY,
            client_settings(port),
            cache,
        )
    if cache is not None:
        await cache.close()
    assert result.failed == [], result.replies
    assert result.delivered == rcpts
    assert mx.connections == 2
    assert [t.rcpt_to for t in mx.delivered] == [rcpts]
    assert mx.sessions[0].transactions == []
    assert any(DESYNC in r.getMessage() for r in caplog.records)


async def test_a_server_out_of_sync_again_defers_with_4_5_0() -> None:
    """The fresh connection gets out of sync as well: every recipient is deferred with a
    4.5.0 protocol error, never bounced, and nothing is sent."""
    host = "127.0.2.124"
    port = shared_port([host])
    rcpts = [f"{x}@sync.example.test" for x in "abc"]
    hook = first_session("RCPT", two_lines_to_first_rcpt, every=True)
    async with ScriptedMx(host, port, hook=hook) as mx:
        hook.mx = mx  # type: ignore[attr-defined]
        result = await deliver(
            [MxTarget(host="mx.sync.example.test", address=host)],
            envelope_of(*rcpts),
            BODY,
            client_settings(port),
        )
    assert result.deferred == rcpts and result.failed == []
    assert {result.replies[a].enhanced for a in rcpts} == {"4.5.0"}
    assert mx.connections == 2 and mx.transactions == []


async def test_a_line_received_on_an_idle_cached_session_drops_it() -> None:
    """A cached session is checked before reuse: a line the server sent while it was idle
    means its replies may be shifted, so the next delivery uses a fresh connection."""
    host = "127.0.2.125"
    port = shared_port([host])
    cache = ConnectionCache(idle_s=30.0)
    target = [MxTarget(host="mx.sync.example.test", address=host)]
    async with ScriptedMx(host, port) as mx:
        first = await deliver(
            target, envelope_of("a@sync.example.test"), BODY, client_settings(port), cache
        )
        assert first.delivered == ["a@sync.example.test"] and cache.idle == 1
        assert await mx.push("550 5.1.1 unasked") == 1
        await asyncio.sleep(0.2)
        second = await deliver(
            target, envelope_of("b@sync.example.test"), BODY, client_settings(port), cache
        )
        await cache.close()
    assert second.delivered == ["b@sync.example.test"], second.replies
    assert mx.connections == 2
    assert [t.rcpt_to for t in mx.delivered] == [["a@sync.example.test"], ["b@sync.example.test"]]


async def test_extra_lines_after_the_final_reply_make_the_outcome_uncertain() -> None:
    """Two lines answer the final dot: which one answers it is unknown, so the recipient is
    neither recorded delivered nor bounced: deferred with 4.5.0, marked uncertain."""
    host = "127.0.2.126"
    port = shared_port([host])
    rcpt = "a@sync.example.test"
    async with ScriptedMx(host, port, end_of_data="250 2.0.0 ok\n554 5.7.1 no") as mx:
        result = await deliver(
            [MxTarget(host="mx.sync.example.test", address=host)],
            envelope_of(rcpt),
            BODY,
            client_settings(port),
        )
    assert result.deferred == [rcpt] and result.replies[rcpt].enhanced == "4.5.0"
    assert result.uncertain == {rcpt}
    assert mx.connections == 1


async def test_aiosmtplib_private_names_the_reply_guard_relies_on() -> None:
    """jsqueue.delivery.sync overrides ``SMTP._create_connection`` and reads the protocol's
    ``_buffer``, ``_response_waiter`` and ``_response_pending``, and reads replies itself,
    failing a read with ``_set_response_exception`` and leaving what follows a reply in
    ``_buffer``, which aiosmtplib's STARTTLS empties (RFC 3207 §4.2): an aiosmtplib upgrade
    that renames one must fail here, not silently stop detecting shifted replies."""
    assert list(inspect.signature(aiosmtplib.SMTP._create_connection).parameters) == [
        "self",
        "timeout",
    ]
    assert callable(aiosmtplib.SMTP._on_connection_lost)
    protocol = GuardedProtocol(loop=asyncio.get_running_loop())
    for name in ("_buffer", "_response_waiter", "_response_pending", "_set_response_exception"):
        assert hasattr(protocol, name), name
    assert "del self._buffer[:]" in inspect.getsource(SMTPProtocol.start_tls)


async def test_a_timed_out_read_ends_the_connection() -> None:
    """RFC 5321 §4.2: the server sends the first line of a multi-line reply, then nothing
    until the read times out. That part of a reply sits in GuardedProtocol's parser, where
    the next line would complete it as the reply to the next command; no next command can
    be sent, because aiosmtplib closes the connection when a read times out (and the read
    of the final dot's reply aborts it). The reply guard relies on that: an aiosmtplib
    upgrade that keeps the connection must fail here."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 mx ESMTP\r\n")
        await reader.readline()  # NOOP
        writer.write(b"250-first line of the NOOP reply\r\n")
        await reader.read()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    smtp = GuardedSMTP(sock=sock, timeout=5.0, start_tls=False)
    try:
        await smtp.connect()
        with pytest.raises(aiosmtplib.SMTPTimeoutError):
            await smtp.execute_command(b"NOOP", timeout=0.3)
        assert not smtp.is_connected
        with pytest.raises(aiosmtplib.SMTPServerDisconnected):
            await smtp.execute_command(b"RSET", timeout=5.0)
    finally:
        smtp.close()
        server.close()
        await server.wait_closed()


async def test_worker_never_bounces_for_a_shifted_reply(
    queue_harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """End to end: the MX answers the first RCPT of its first connection with two lines (an
    extra 550). The worker records every recipient delivered in the one attempt (on a fresh
    connection): no bounced event, no DSN, and the log names the desynchronised reply."""
    caplog.set_level(logging.INFO, logger="jsqueue")
    h = queue_harness
    domain = "sync.example.test"
    h.dns.add(one_mx(domain, "127.0.2.29"))
    rcpts = [f"{x}@{domain}" for x in "abc"]
    hook = first_session("RCPT", two_lines_to_first_rcpt)
    async with ScriptedMx("127.0.2.29", h.mx_port, hook=hook) as mx:
        hook.mx = mx  # type: ignore[attr-defined]
        qid = await h.submit(b"Subject: sync\r\n\r\nbody\r\n", rcpts)
        seen = _Events()
        async with h.running(h.worker(observer=seen)):
            await eventually(lambda: gone(h, qid), what="every recipient delivered")
    assert [t.rcpt_to for t in mx.delivered] == [rcpts]
    assert {e.kind for e in seen.events} == {EventKind.DELIVERED}
    assert sorted(e.recipient or "" for e in seen.events) == rcpts
    assert any(DESYNC in r.getMessage() for r in caplog.records)
