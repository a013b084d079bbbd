"""Delivery workers end to end: real nats-server, real DNS server, real (fake) MXes.

Mail enters through the real SMTP front end, workers deliver it to scripted MXes on
127.0.2.x, and the assertions read what the MXes recorded and what the queue holds.
Each test names the case of ``tests/cases`` or the RFC section it checks.
"""

from __future__ import annotations

import contextlib
import email
import email.policy
from email.message import EmailMessage

from support.cases import case_message, case_text
from support.mx import ScriptedMx, SmtpdMx, ipv6_loopback_available
from support.queue import Harness, eventually

from jsqueue.envelope import RecipientState

SENDER_ZONE = """
example.test.        300 IN MX 10 mx.example.test.
mx.example.test.     300 IN A  127.0.2.1
"""


async def gone(h: Harness, queue_id: str) -> bool:
    """The entry has been removed (final and cleaned up)."""
    return await h.entry(queue_id) is None


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
        rcpt_lines = [[c for c in s.commands if c.upper().startswith("RCPT")] for s in mx.sessions]
        assert [len(r) for r in rcpt_lines] == [3, 1], "attempt 2 offers b@ alone"
        assert "b@mixed.example.test" in rcpt_lines[1][0]
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

            await eventually(settled, what="every destination attempted once")
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
