"""Outbound PIPELINING (RFC 2920) against real fake MXes on loopback: one round trip for
MAIL, every RCPT and DATA; one command per read without it; per-recipient outcomes as in the
one-command-at-a-time path (CASE-07, CASE-19); replies out of step with the group (extra,
early, too few, split, malformed) drop the session and are never attributed; and the
reply parser on its own. The last test runs CASE-07 through a real queue (nats-server)."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
from test_smtp_client import (
    CASE19_BLOCKED,
    CASE19_EHLO,
    CASE19_GREETING,
    case_file,
    envelope,
    settings_for,
    target,
)
from test_worker import SENDER_ZONE, dsn_parts, gone

from jsqueue.config import WorkerSettings
from jsqueue.delivery import BodySource, ConnectionCache, DeliveryEnvelope, MxTarget, deliver
from jsqueue.delivery.replyparser import (
    CUT_MARK,
    MAX_LINE_OCTETS,
    MAX_REPLY_OCTETS,
    MalformedReply,
    ReplyParser,
)
from jsqueue.envelope import Notify, Recipient
from support.cases import case_message, case_text
from support.mx import CLOSE, SILENT, ScriptedMx, Session, SmtpdMx, shared_port
from support.queue import Harness, eventually

MESSAGE = case_file("CASE-07", "message.eml")
A, B, C = (f"{x}@mixed.example.test" for x in "abc")
CASE07_REPLIES = {
    B: "450 4.2.1 mailbox temporarily busy, try later",
    C: "550 5.1.1 no such user here",
}
GROUP = ["MAIL", "RCPT", "RCPT", "RCPT", "DATA"]


def body() -> BodySource:
    return BodySource.from_bytes(MESSAGE)


def command_lines(session: Session) -> list[str]:
    return [c.split(" ", 1)[0].upper() for c in session.commands]


# --- round trips --------------------------------------------------------------------------


async def test_one_round_trip_for_mail_rcpts_and_data() -> None:
    """RFC 2920 §3.1: with PIPELINING offered, MAIL, the three RCPTs and DATA reach the MX
    in one read (one write by the client): one round trip before the body."""
    host = "127.0.2.71"
    port = shared_port([host])
    async with SmtpdMx(host, port, pipelining=True) as mx:
        result = await deliver(
            target("mx.p.example.test", host), envelope(A, B, C), body(), settings_for(port)
        )
    assert result.delivered == [A, B, C]
    assert [t.rcpt_to for t in mx.delivered] == [[A, B, C]]
    assert mx.delivered[0].content == MESSAGE
    assert mx.sessions[0].read_verbs() == [["EHLO"], GROUP, ["QUIT"]]


@pytest.mark.parametrize("offered", [False, True])
async def test_one_command_per_read_without_pipelining(offered: bool) -> None:
    """A server that does not offer PIPELINING, or ``worker.pipelining = false``: every
    command waits for the reply to the one before (RFC 5321 §4.1.1)."""
    host = "127.0.2.72"
    port = shared_port([host])
    async with SmtpdMx(host, port, pipelining=offered) as mx:
        result = await deliver(
            target("mx.p.example.test", host),
            envelope(A, B, C),
            body(),
            settings_for(port, pipelining=False),
        )
    assert result.delivered == [A, B, C]
    reads = mx.sessions[0].read_verbs()
    assert reads == [["EHLO"], ["MAIL"], ["RCPT"], ["RCPT"], ["RCPT"], ["DATA"], ["QUIT"]]


async def test_reused_session_pipelines_every_transaction() -> None:
    """A cached session (connection cache) sends each later transaction as one group too."""
    host = "127.0.2.73"
    port = shared_port([host])
    cache = ConnectionCache(idle_s=5.0)
    try:
        async with SmtpdMx(host, port, pipelining=True) as mx:
            mxs = target("mx.p.example.test", host)
            for _ in range(2):
                result = await deliver(mxs, envelope(A, B, C), body(), settings_for(port), cache)
                assert result.delivered == [A, B, C]
            await cache.close()
            await mx.wait_for(lambda: mx.sessions[0].closed)
    finally:
        await cache.close()
    assert mx.connections == 1
    assert mx.sessions[0].read_verbs() == [["EHLO"], GROUP, GROUP, ["QUIT"]]


# --- per-recipient outcomes ---------------------------------------------------------------


async def test_mixed_recipient_outcomes_as_without_pipelining() -> None:
    """CASE-07 pipelined: 250 / 450 / 550 in one group; DATA for a@ only; every reply (code,
    enhanced code, text, host) is exactly the one the unpipelined path records."""
    host = "127.0.2.74"
    port = shared_port([host])
    results = {}
    async with SmtpdMx(
        host, port, name="mx.mixed.example.test", pipelining=True, rcpt_replies=CASE07_REPLIES
    ) as mx:
        mxs = target("mx.mixed.example.test", host)
        for pipelining in (True, False):
            results[pipelining] = await deliver(
                mxs, envelope(A, B, C), body(), settings_for(port, pipelining=pipelining)
            )
    on, off = results[True], results[False]
    assert (on.delivered, on.deferred, on.failed) == ([A], [B], [C])
    assert on.replies == off.replies
    assert on.replies[B].enhanced == "4.2.1" and on.replies[C].enhanced == "5.1.1"
    assert on.replies[C].text == "no such user here"
    assert [t.rcpt_to for t in mx.delivered] == [[A], [A]]
    assert mx.sessions[0].read_verbs() == [["EHLO"], GROUP, ["QUIT"]]


async def test_multiline_and_split_replies_in_a_group() -> None:
    """CASE-19 pipelined, every reply sent in 5-octet pieces (split inside lines and codes,
    RFC 5321 §4.2.1): the five-line 550 is whole, ok@ delivered, as without pipelining."""
    host = "127.0.2.75"
    port = shared_port([host])
    ok, blocked = "ok@ml.example.test", "blocked@ml.example.test"
    message = case_file("CASE-19", "message.eml")
    results = {}
    mx = ScriptedMx(
        host,
        port,
        greeting=CASE19_GREETING,
        ehlo=CASE19_EHLO,
        rcpt_replies={blocked: CASE19_BLOCKED},
        trickle=5,
    )
    async with mx:
        for pipelining in (True, False):
            results[pipelining] = await deliver(
                target("mx.ml.example.test", host),
                envelope(ok, blocked),
                BodySource.from_bytes(message),
                settings_for(port, pipelining=pipelining),
            )
    on = results[True]
    assert on.delivered == [ok] and on.failed == [blocked]
    reply = on.replies[blocked]
    assert reply.enhanced == "5.7.1" and len(reply.text.split("\n")) == 5
    assert "PX-4471" in reply.text and reply.text.endswith("id=7f3a2c")
    assert on.replies == results[False].replies
    assert [t.rcpt_to for t in mx.delivered] == [[ok], [ok]]
    assert mx.pieces > len(CASE19_BLOCKED) // 5  # the replies really went out in pieces


async def test_all_recipients_refused_sends_no_data() -> None:
    """RFC 2920 §3.1, RFC 5321 §3.3: every RCPT refused, DATA gets 503/554: no message data
    goes out (not one line of it reaches the server), RSET follows, the 550s stand."""
    host = "127.0.2.76"
    port = shared_port([host])
    refused = {a: "550 5.1.1 no such user here" for a in (A, B)}
    async with SmtpdMx(host, port, pipelining=True, rcpt_replies=refused) as mx:
        result = await deliver(
            target("mx.p.example.test", host), envelope(A, B), body(), settings_for(port)
        )
    assert result.failed == [A, B]
    assert all(r.enhanced == "5.1.1" for r in result.replies.values())
    assert mx.transactions == []
    session = mx.sessions[0]
    assert session.read_verbs() == [["EHLO"], ["MAIL", "RCPT", "RCPT", "DATA"], ["RSET"], ["QUIT"]]
    assert not any("Subject" in c for c in session.commands)


async def test_354_without_any_recipient_gets_a_lone_dot() -> None:
    """RFC 2920 §3.1: a server that answers DATA with 354 although every RCPT was refused
    gets a single "." and no message data; the refusals stand."""
    host = "127.0.2.77"
    port = shared_port([host])

    def hook(session: Session, line: str) -> str | None:
        return "354 go ahead anyway" if line.upper() == "DATA" else None

    refused = {A: "550 5.1.1 no such user here"}
    async with ScriptedMx(host, port, rcpt_replies=refused, hook=hook) as mx:
        result = await deliver(
            target("mx.p.example.test", host), envelope(A), body(), settings_for(port)
        )
    assert result.failed == [A] and result.replies[A].enhanced == "5.1.1"
    assert mx.sessions[0].commands[-2:] == [".", "QUIT"]
    assert not any("Subject" in c for c in mx.commands)


async def test_recipient_limit_in_a_group_carries_the_rest() -> None:
    """RFC 5321 §4.5.3.1.10 pipelined: a 452 to some RCPTs of the group with others
    accepted: they go in a further transaction, never bounced, each delivered once."""
    host = "127.0.2.78"
    port = shared_port([host])
    accepted: list[str] = []

    def hook(session: Session, line: str) -> str | None:
        if line.upper().startswith("MAIL"):
            accepted.clear()
        if line.upper().startswith("RCPT") and len(accepted) >= 2:
            return "452 4.5.3 Too many recipients"
        if line.upper().startswith("RCPT"):
            accepted.append(line)
        return None

    rcpts = [f"u{i}@limit.example.test" for i in range(5)]
    async with ScriptedMx(host, port, hook=hook) as mx:
        result = await deliver(
            target("mx.limit.example.test", host), envelope(*rcpts), body(), settings_for(port)
        )
    assert result.delivered == rcpts, result.replies
    assert [t.rcpt_to for t in mx.delivered] == [rcpts[0:2], rcpts[2:4], rcpts[4:5]]


async def test_same_commands_and_parameters_with_and_without_pipelining() -> None:
    """SIZE, BODY=8BITMIME, SMTPUTF8, RET, ENVID, NOTIFY and ORCPT (RFC 1870, 6152, 6531,
    3461) go out byte for byte the same in a pipelined group as one at a time."""
    host = "127.0.2.86"
    port = shared_port([host])
    rcpts = (
        Recipient.from_address(
            "bob@dsn.example.test",
            orcpt="rfc822;bob+tag@dsn.example.test",
            notify=frozenset({Notify.FAILURE, Notify.SUCCESS}),
        ),
        Recipient.from_address("jörg@dsn.example.test"),
    )
    env = DeliveryEnvelope(
        domain="dsn.example.test",
        reverse_path="",
        recipients=rcpts,
        envid="id 1+2",
        ret="HDRS",
        smtputf8=True,
        body_8bit=True,
    )
    extensions = ["PIPELINING", "8BITMIME", "SMTPUTF8", "DSN", "SIZE 1000000"]
    sent = {}
    for pipelining in (True, False):
        async with ScriptedMx(host, port, extensions=extensions, smtputf8=True) as mx:
            result = await deliver(
                target("mx.dsn.example.test", host),
                env,
                BodySource.from_bytes("Subject: ü\r\n\r\nx\r\n".encode()),
                settings_for(port, pipelining=pipelining),
            )
        assert sorted(result.delivered) == sorted(r.address for r in rcpts)
        assert result.dsn_accepted == {r.address for r in rcpts}  # RFC 3461 §5.2.1
        sent[pipelining] = mx.commands
    assert sent[True] == sent[False]
    mail = next(c for c in sent[True] if c.startswith("MAIL"))
    assert mail.endswith("BODY=8BITMIME SMTPUTF8 RET=HDRS ENVID=id+201+2B2")


@pytest.mark.parametrize("mail", ["550 5.7.1 sender refused", "451 4.7.1 greylisted"])
async def test_refused_mail_in_a_group(mail: str) -> None:
    """RFC 2920 §3.1: MAIL refused, so the RCPTs and DATA of the group get 503: every
    recipient gets the MAIL reply (not a 503), no data, RSET follows."""
    host = "127.0.2.87"
    port = shared_port([host])
    async with ScriptedMx(host, port, mail=mail) as mx:
        result = await deliver(
            target("mx.p.example.test", host), envelope(A, B), body(), settings_for(port)
        )
    code, enhanced = mail.split(" ")[:2]
    assert all((r.code, r.enhanced) == (int(code), enhanced) for r in result.replies.values()), (
        result.replies
    )
    assert len(result.replies) == 2 and mx.transactions == []
    assert command_lines(mx.sessions[0]) == ["EHLO", "MAIL", "RCPT", "RCPT", "DATA", "RSET", "QUIT"]


# --- replies out of step with the group ---------------------------------------------------


@pytest.mark.parametrize("verb", ["MAIL", "RCPT", "DATA"])
async def test_extra_reply_in_a_group_drops_the_session(verb: str) -> None:
    """An extra reply line (two replies to MAIL or to an RCPT; a reply to the final dot
    before the data was sent) shifts every later reply: the session is dropped, the
    recipients are tried once on a fresh connection and then deferred with 4.5.0; no
    reply is attributed to a recipient (a@ is not delivered, c@ not bounced)."""
    host = "127.0.2.79"
    port = shared_port([host])
    extra = {"MAIL": "250 2.1.0 ok again", "RCPT": "250 2.1.5 ok again", "DATA": "250 2.0.0 ok"}
    async with ScriptedMx(
        host,
        port,
        rcpt_replies={C: "550 5.1.1 no such user here"},
        extra_replies={verb: extra[verb]},
    ) as mx:
        result = await deliver(
            target("mx.p.example.test", host),
            envelope(A, B, C),
            body(),
            settings_for(port, mail_timeout_s=2.0),
        )
    assert sorted(result.deferred) == sorted([A, B, C]), result.replies
    assert all(r.enhanced == "4.5.0" for r in result.replies.values())
    assert mx.connections == 2
    if verb != "DATA":
        assert mx.delivered == []
    assert all(c != "." for c in mx.commands)  # no final dot went out


async def test_unsolicited_line_before_the_group_drops_the_session() -> None:
    """A line the server sends while a cached session is idle is caught before the group is
    written: the recipients go to a fresh connection and are delivered there, once."""
    host = "127.0.2.80"
    port = shared_port([host])
    cache = ConnectionCache(idle_s=5.0)
    try:
        async with ScriptedMx(host, port) as mx:
            mxs = target("mx.p.example.test", host)
            assert (
                await deliver(mxs, envelope(A), body(), settings_for(port), cache)
            ).delivered == [A]
            assert await mx.push("250 2.1.5 nobody asked") == 1
            await mx.wait_for(lambda: cache.idle == 1)
            result = await deliver(mxs, envelope(B, C), body(), settings_for(port), cache)
            assert result.delivered == [B, C]
    finally:
        await cache.close()
    assert [t.rcpt_to for t in mx.delivered] == [[A], [B, C]]
    assert mx.connections == 2
    assert command_lines(mx.sessions[0]).count("MAIL") == 1  # no group on the stale one


@pytest.mark.parametrize("missing", ["close", "silent"])
async def test_too_few_replies_tries_the_next_mx(missing: str) -> None:
    """The connection closes in the middle of the group, or the server never answers DATA:
    no body went out, so the replies read so far are not used; the next MX gets every
    recipient and delivers them in one transaction."""
    bad, good = "127.0.2.81", "127.0.2.82"
    port = shared_port([bad, good])
    faulty = (
        ScriptedMx(bad, port, rcpt_replies={B: CLOSE})
        if missing == "close"
        else ScriptedMx(bad, port, data=SILENT)
    )
    async with (
        faulty as first,
        SmtpdMx(good, port, pipelining=True) as second,
    ):
        result = await deliver(
            [
                MxTarget(host="mx1.p.example.test", address=bad),
                MxTarget(host="mx2.p.example.test", address=good),
            ],
            envelope(A, B, C),
            body(),
            settings_for(port, data_init_timeout_s=1.0),
        )
    assert result.delivered == [A, B, C]
    assert first.delivered == []
    assert [t.rcpt_to for t in second.delivered] == [[A, B, C]]


async def test_a_missing_reply_is_seen_at_the_shifted_354() -> None:
    """The server leaves one RCPT unanswered: the 354 to DATA arrives in that RCPT's place,
    which no RCPT can get; the group stops there (no waiting for a timeout), nothing is
    attributed (a@ is not delivered by the reply meant for b@), all deferred with 4.5.0."""
    host = "127.0.2.85"
    port = shared_port([host])
    async with ScriptedMx(host, port, rcpt_replies={B: SILENT}) as mx:
        result = await deliver(
            target("mx.p.example.test", host),
            envelope(A, B, C),
            body(),
            settings_for(port, rcpt_timeout_s=30.0, data_init_timeout_s=30.0),
        )
    assert sorted(result.deferred) == sorted([A, B, C]), result.replies
    assert all(r.enhanced == "4.5.0" for r in result.replies.values())
    assert mx.connections == 2 and mx.delivered == []


async def test_421_in_a_group_defers_everyone() -> None:
    """A 421 to an RCPT of the group (the server closes the channel, RFC 5321 §3.8): no body,
    no recipient is recorded from the replies before it; all deferred with the 421."""
    host = "127.0.2.83"
    port = shared_port([host])
    async with ScriptedMx(host, port, rcpt_replies={B: "421 4.3.2 shutting down"}) as mx:
        result = await deliver(
            target("mx.p.example.test", host), envelope(A, B, C), body(), settings_for(port)
        )
    assert result.deferred == [A, B, C]
    assert all(r.code == 421 and r.enhanced == "4.3.2" for r in result.replies.values())
    assert mx.delivered == []


async def test_malformed_reply_in_a_group_is_a_protocol_error() -> None:
    """A reply line without a code inside the group: temporary protocol error (4.5.0) for
    every recipient, nothing delivered, no crash."""
    host = "127.0.2.84"
    port = shared_port([host])
    async with ScriptedMx(host, port, rcpt_replies={B: "250-ok\nnot a reply line"}) as mx:
        result = await deliver(
            target("mx.p.example.test", host), envelope(A, B), body(), settings_for(port)
        )
    assert result.deferred == [A, B]
    assert all(r.enhanced == "4.5.0" for r in result.replies.values())
    assert mx.delivered == []


# --- one set of reply rules for both paths (RFC 5321 §4.2, §4.2.1) ------------------------

PATHS = pytest.mark.parametrize("pipelining", [False, True], ids=["one-at-a-time", "pipelined"])


@PATHS
@pytest.mark.parametrize(
    "rcpt",
    [
        "250-2.1.5 ok\n550 5.1.1 no such user",  # the lines disagree on the code
        "550-5.1.1 no such user\n250 2.1.5 ok",
        "2500 ok",  # a fourth digit where SP, "-" or the end of the line must be
        "250ok",
    ],
)
async def test_malformed_reply_is_a_protocol_error_on_both_paths(
    rcpt: str, pipelining: bool
) -> None:
    """RFC 5321 §4.2, §4.2.1: every line of a reply carries the same code, followed by SP,
    "-" or the end of the line. A reply that breaks this is malformed, a protocol error:
    temporary (4.5.0), never delivered, never bounced, whether the RCPT went out in a
    pipelined group (RFC 2920) or alone; both paths read replies with one parser."""
    host = "127.0.2.232"
    port = shared_port([host])
    async with ScriptedMx(host, port, rcpt=rcpt) as mx:
        result = await deliver(
            target("mx.p.example.test", host),
            envelope(A),
            body(),
            settings_for(port, pipelining=pipelining),
        )
    reply = result.replies[A]
    assert result.deferred == [A], str(reply)
    assert (reply.code, reply.enhanced) == (451, "4.5.0")
    assert mx.delivered == []
    verbs = mx.sessions[0].verbs()
    assert verbs[:3] == ["EHLO", "MAIL", "RCPT"]
    assert pipelining or "DATA" not in verbs  # (a pipelined group always holds DATA)


async def next_mx_delivers(
    addresses: tuple[str, str], script: dict[str, Any], settings: WorkerSettings
) -> None:
    """The first MX (scripted with ``script``) fails before any body went out: the second
    (offering PIPELINING as ``settings`` uses it) gets a@ and b@ in one transaction, and
    the first has nothing."""
    bad, good = addresses
    port = shared_port([bad, good])
    async with (
        ScriptedMx(bad, port, **script) as first,
        SmtpdMx(good, port, pipelining=settings.pipelining) as second,
    ):
        result = await deliver(
            [
                MxTarget(host="mx1.p.example.test", address=bad),
                MxTarget(host="mx2.p.example.test", address=good),
            ],
            envelope(A, B),
            body(),
            settings.model_copy(update={"mx_port": port}),
        )
    assert result.delivered == [A, B], result.replies
    assert first.delivered == []
    assert [t.rcpt_to for t in second.delivered] == [[A, B]]


@pytest.mark.parametrize(
    ("b_reply", "pipelining"),
    [
        *((r, p) for r in ("250ok", CLOSE, "421 4.3.2 going down") for p in (False, True)),
        # (pipelined, a reply left out shows as the shifted 354: the test above)
        (SILENT, False),
    ],
)
async def test_rcpt_failure_after_an_accepted_recipient_goes_to_the_next_mx(
    b_reply: str, pipelining: bool
) -> None:
    """a@ is accepted, then b@'s RCPT gets a malformed reply, the connection closes, a 421
    (RFC 5321 §3.8), or (one command at a time) the reply never comes. No body went out,
    so nobody has the message, a@ included: on both paths the next MX gets a@ and b@ in one
    transaction (one command at a time used to defer them on the first MX, while the
    pipelined group went on to it: RFC 2920 §3.1)."""
    await next_mx_delivers(
        ("127.0.2.234", "127.0.2.235"),
        {"rcpt_replies": {B: b_reply}},
        settings_for(25, pipelining=pipelining, rcpt_timeout_s=1.0),
    )


@PATHS
@pytest.mark.parametrize("data_reply", ["421 4.3.2 going down", CLOSE, SILENT])
async def test_a_failed_data_goes_to_the_next_mx_on_both_paths(
    data_reply: str, pipelining: bool
) -> None:
    """A 421 to DATA (RFC 5321 §3.8: the server closes the channel), or no reply to it (the
    connection closes, the reply times out): no body went out, so the next MX gets every
    recipient, pipelined or not (one command at a time used to defer them on the first
    MX)."""
    await next_mx_delivers(
        ("127.0.2.237", "127.0.2.238"),
        {"data": data_reply},
        settings_for(25, pipelining=pipelining, data_init_timeout_s=1.0),
    )


@PATHS
@pytest.mark.parametrize(
    ("verb", "reply"),
    [
        ("RCPT", "150 wait"),
        ("RCPT", "354 go ahead"),
        ("RCPT", "650 what"),
        ("MAIL", "150 wait"),
        ("DATA", "250 2.0.0 ok"),
    ],
)
async def test_impossible_reply_is_out_of_sync_on_both_paths(
    verb: str, reply: str, pipelining: bool
) -> None:
    """RFC 5321 §4.3.2: MAIL and RCPT get 2xx, 4xx or 5xx, DATA gets 354, 4xx or 5xx.
    Anything else (to MAIL, to b@'s RCPT after a@ was accepted, to DATA) is a reply meant
    for another command, the replies are shifted: on both paths nothing of the transaction
    counts, a fresh connection is tried once, then a@ and b@ are deferred with 4.5.0, and
    nothing is delivered. (One command at a time used to record 4.5.0 for b@ alone and
    deliver a@ on the shifted connection.)"""
    host = "127.0.2.236"
    port = shared_port([host])
    script = {"RCPT": {"rcpt_replies": {B: reply}}, "MAIL": {"mail": reply}}
    script["DATA"] = {"data": reply}
    async with ScriptedMx(host, port, **script[verb]) as mx:
        result = await deliver(
            target("mx.p.example.test", host),
            envelope(A, B),
            body(),
            settings_for(port, pipelining=pipelining),
        )
    assert sorted(result.deferred) == [A, B], result.replies
    assert all(r.enhanced == "4.5.0" for r in result.replies.values())
    assert mx.connections == 2 and mx.delivered == []


@PATHS
async def test_overlong_reply_line_keeps_its_code(pipelining: bool) -> None:
    """RFC 5321 §4.5.3.1.5 bounds a reply line at 512 octets, and servers exceed it. A line
    over MAX_LINE_OCTETS says its code in its first octets: A's ``550 5.1.1`` is recorded
    (a bounce, not a 4.5.0 retried for the whole queue lifetime), its text cut and marked;
    the rest of the line, arriving in pieces, is dropped, and B's ``250`` after it is read
    in sync: B is delivered."""
    host = "127.0.2.233"
    port = shared_port([host])
    long = "550 5.1.1 no such user " + "x" * (3 * MAX_LINE_OCTETS)
    async with ScriptedMx(host, port, rcpt_replies={A: long}, trickle=4096) as mx:
        result = await deliver(
            target("mx.p.example.test", host),
            envelope(A, B),
            body(),
            settings_for(port, pipelining=pipelining),
        )
    reply = result.replies[A]
    assert (reply.code, reply.enhanced) == (550, "5.1.1"), str(reply)[:120]
    assert reply.text.startswith("no such user xxx")
    assert reply.text.endswith(CUT_MARK.decode()) and len(reply.text) < MAX_LINE_OCTETS
    assert result.failed == [A] and result.delivered == [B]
    assert [t.rcpt_to for t in mx.delivered] == [[B]]
    assert mx.pieces > 3 * MAX_LINE_OCTETS // 4096


# --- the reply parser ---------------------------------------------------------------------


def test_parser_takes_several_replies_from_one_read() -> None:
    parser = ReplyParser()
    parser.feed(b"250 2.1.0 ok\r\n550-5.1.1 no\r\n550 5.1.1 such user\r\n354 go")
    first, second = parser.next_reply(), parser.next_reply()
    assert first is not None and (first.code, first.message) == (250, "2.1.0 ok")
    assert second is not None and (second.code, second.message) == (
        550,
        "5.1.1 no\n5.1.1 such user",
    )
    assert parser.next_reply() is None and parser.pending() == b"354 go"
    parser.feed(b" ahead\r\n")
    third = parser.next_reply()
    assert third is not None and (third.code, third.message) == (354, "go ahead")
    assert parser.pending() == b""


def test_parser_gives_the_same_replies_split_at_every_octet() -> None:
    stream = (CASE19_BLOCKED.replace("\n", "\r\n") + "\r\n250\r\n221 bye\n").encode()
    whole = ReplyParser()
    whole.feed(stream)
    expected = [whole.next_reply() for _ in range(3)]
    assert all(r is not None for r in expected) and whole.next_reply() is None
    for cut in range(1, len(stream)):
        parser = ReplyParser()
        got = []
        for piece in (stream[:cut], stream[cut:]):
            parser.feed(piece)
            while (r := parser.next_reply()) is not None:
                got.append(r)
        assert got == expected, cut
    assert expected[1] is not None and (expected[1].code, expected[1].message) == (250, "")


@pytest.mark.parametrize(
    "data",
    [b"\r\n", b"ok\r\n", b"25 short\r\n", b"250x\r\n", b"250-a\r\n251 b\r\n", b"2" * 9000],
)
def test_parser_refuses_what_is_no_reply(data: bytes) -> None:
    parser = ReplyParser()
    parser.feed(data)
    with pytest.raises(MalformedReply):
        parser.next_reply()


def test_parser_cuts_an_overlong_line_and_keeps_its_code() -> None:
    """RFC 5321 §4.5.3.1.5: a line over MAX_LINE_OCTETS keeps its code, enhanced code and
    the start of its text, marked with CUT_MARK, however it is split; the reply after it
    is read in sync."""
    line = b"550 5.1.1 " + b"x" * (2 * MAX_LINE_OCTETS) + b"\r\n"
    stream = line + b"250 2.1.5 ok\r\n"
    for size in (1, 1000, MAX_LINE_OCTETS, len(stream)):
        parser = ReplyParser()
        got = []
        for start in range(0, len(stream), size):
            parser.feed(stream[start : start + size])
            while (r := parser.next_reply()) is not None:
                got.append(r)
        assert [r.code for r in got] == [550, 250], size
        text = got[0].message
        assert text.startswith("5.1.1 xxx") and text.endswith(CUT_MARK.decode())
        assert len(text) == MAX_LINE_OCTETS - 1 - 4 + len(CUT_MARK)
        assert parser.pending() == b""


def test_parser_takes_a_line_of_exactly_max_line_octets_whole() -> None:
    line = b"250 " + b"y" * (MAX_LINE_OCTETS - 6) + b"\r\n"
    assert len(line) == MAX_LINE_OCTETS
    parser = ReplyParser()
    parser.feed(line)
    reply = parser.next_reply()
    assert reply is not None and reply.message == "y" * (MAX_LINE_OCTETS - 6)


def test_parser_drops_lines_beyond_max_reply_octets_and_keeps_the_code() -> None:
    """A multi-line reply with more than MAX_REPLY_OCTETS of text: the code and the first
    lines are kept, the further lines dropped and counted (as Postfix caps a reply)."""
    lines = [b"550-5.7.1 " + bytes([ord("a") + i]) * 8000 for i in range(5)]
    parser = ReplyParser()
    parser.feed(b"\r\n".join(lines) + b"\r\n550 5.7.1 last\r\n")
    reply = parser.next_reply()
    assert reply is not None and reply.code == 550
    texts = reply.message.split("\n")
    assert len(reply.message) <= MAX_REPLY_OCTETS + 100
    assert texts[0].startswith("5.7.1 aaa") and texts[-1] == "[2 more line(s) dropped]"
    assert parser.pending() == b""


def test_parser_memory_stays_bounded_for_an_endless_line() -> None:
    """A server that streams one reply line without end: the parser keeps its first
    MAX_LINE_OCTETS octets only (the command's timeout ends the wait)."""
    chunk = b"x" * 65536
    parser = ReplyParser()
    parser.feed(b"550 5.1.1 ")
    tracemalloc.start()
    try:
        for _ in range(256):  # 16 MiB
            parser.feed(chunk)
            assert parser.next_reply() is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(chunk)
    assert len(parser.pending()) == MAX_LINE_OCTETS
    parser.feed(b"\r\n")
    reply = parser.next_reply()
    assert reply is not None and reply.code == 550 and reply.message.endswith(CUT_MARK.decode())


# --- end to end ---------------------------------------------------------------------------


async def test_case07_through_the_queue_pipelined(queue_harness: Harness) -> None:
    """CASE-07 end to end (real nats-server, front end, DNS, worker) against an MX that
    offers PIPELINING: attempt 1 is one group; a@ delivered once, b@ retried alone and
    delivered, c@ bounced with one DSN listing only c@ (5.1.1)."""
    h = queue_harness
    h.dns.add(case_text("CASE-07", "dns.txt") + SENDER_ZONE)
    async with (
        SmtpdMx("127.0.2.70", h.mx_port, pipelining=True, rcpt_replies=dict(CASE07_REPLIES)) as mx,
        SmtpdMx("127.0.2.1", h.mx_port, pipelining=True) as sender_mx,
    ):
        qid = await h.submit(case_message("CASE-07"), [A, B, C])
        async with h.running():
            await eventually(lambda: len(mx.delivered) >= 1, what="attempt 1")
            mx.rcpt_replies.pop(B)
            await eventually(lambda: len(mx.delivered) == 2, what="attempt 2")
            await eventually(lambda: len(sender_mx.delivered) == 1, what="the DSN")
            await eventually(lambda: gone(h, qid), what="entry removed")
    first, second = mx.delivered
    assert (first.rcpt_to, second.rcpt_to) == ([A], [B])
    assert mx.sessions[0].read_verbs()[:2] == [["EHLO"], GROUP]
    assert [n for s in mx.sessions for n in s.rcpt_counts()] == [3, 1]
    _, groups = dsn_parts(sender_mx.delivered[0].content or b"")
    assert [g["Final-Recipient"] for g in groups] == [f"rfc822; {C}"]
    assert groups[0]["Status"] == "5.1.1"
