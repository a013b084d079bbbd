"""The SMTP front end with in-memory stores, driven by real clients on loopback: smtplib,
aiosmtplib, swaks and a raw socket client that counts replies (tests/support/frontend.py).

Each test names the RFC section or case (``tests/cases``) it checks.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import logging
import os
import shutil
import smtplib
from email.message import EmailMessage

import aiosmtplib
import pytest

from jsqueue.config import BareLinePolicy
from jsqueue.envelope import Notify
from jsqueue.logs import TextFormatter
from jsqueue.store.base import Stores
from jsqueue.store.memory import MemoryEntryStore, open_memory
from support.cases import CASES, case_file
from support.frontend import (
    FaultyStores,
    Reply,
    Wire,
    body_store_count,
    dot_stuff,
    entries_of,
    frontend_settings,
    memory_body_count,
    queued_id,
    rss_peak_kib,
    running,
    split_body,
    start_child,
    stop_child,
)
from support.nats import read_body

#: ``smtp.inline_body_max`` of the tests that keep bodies inline (opt-in).
INLINE_MAX = 128 * 1024
MESSAGE = (
    b"From: Alice <alice@example.test>\r\nTo: Bob <bob@dest.example.test>\r\n"
    b"Subject: hi\r\n\r\nHello.\r\n"
)


@pytest.fixture
def mem() -> Stores:
    return open_memory()


async def due_domains(stores: Stores) -> list[tuple[str, str]]:
    """(queue id, domain) of every work item due now, settled as they are read."""
    out = []
    for due in await stores.scheduler.fetch(batch=1000, timeout_s=0.05):
        out.append((due.item.queue_id, due.item.domain))
        await due.ack()
    return sorted(out)


# ------------------------------------------------------------------------ acceptance


async def test_smtplib_message_is_queued_with_every_envelope_field(mem: Stores) -> None:
    """DESIGN.md §2.1/§3: body, entry (every envelope field) and one work item per domain
    are stored before ``250 2.0.0 queued as <id>``; RFC 3461 parameters are kept."""
    async with running(frontend_settings(), mem) as server:

        def send() -> tuple[int, bytes]:
            with smtplib.SMTP("127.0.0.1", server.port, local_hostname="client.example.test") as s:
                s.ehlo("client.example.test")
                s.mail("alice@example.test", ["RET=HDRS", "ENVID=QQ314159+2B1", "SIZE=100"])
                s.rcpt(
                    "bob@dest.example.test",
                    ["NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;bob@dest.example.test"],
                )
                s.rcpt("carol@dest.example.test", ["NOTIFY=NEVER"])
                s.rcpt("dave@other.example.test")
                return s.data(MESSAGE)

        code, text = await asyncio.to_thread(send)
    assert code == 250 and text.startswith(b"2.0.0 queued as "), text
    [entry] = await entries_of(mem)
    assert text.decode().endswith(entry.id)
    assert entry.reverse_path == "alice@example.test"
    assert [(r.address, r.domain, r.orcpt, r.notify) for r in entry.recipients] == [
        (
            "bob@dest.example.test",
            "dest.example.test",
            "rfc822;bob@dest.example.test",
            {Notify.SUCCESS, Notify.FAILURE},
        ),
        ("carol@dest.example.test", "dest.example.test", None, {Notify.NEVER}),
        ("dave@other.example.test", "other.example.test", None, None),
    ]
    assert (entry.ret, entry.envid, entry.smtputf8, entry.body_8bit) == (
        "HDRS",
        "QQ314159+1",
        False,
        False,
    )
    assert (entry.helo, entry.client_address) == ("client.example.test", "127.0.0.1")
    body = await read_body(mem, entry.id)
    received, rest = split_body(body)
    assert rest == MESSAGE
    assert (entry.size, entry.digest) == (len(body), hashlib.sha256(body).hexdigest())
    assert b" with ESMTP id " + entry.id.encode() + b";" in received and b"for <" not in received
    assert await due_domains(mem) == [
        (entry.id, "dest.example.test"),
        (entry.id, "other.example.test"),
    ]


async def test_aiosmtplib_and_single_recipient_trace(mem: Stores) -> None:
    """RFC 5321 §4.4: one recipient → ``for <rcpt>`` in the Received: field."""
    msg = EmailMessage()
    msg["From"], msg["To"], msg["Subject"] = "alice@example.test", "bob@dest.example.test", "x"
    msg.set_content("one\n.two\n")
    async with running(frontend_settings(), mem) as server:
        errors, text = await aiosmtplib.send(msg, hostname="127.0.0.1", port=server.port)
    assert errors == {} and "queued as" in text
    [entry] = await entries_of(mem)
    received, rest = split_body(await read_body(mem, entry.id))
    assert b"\tfor <bob@dest.example.test>;\r\n" in received
    assert rest == msg.as_bytes(policy=msg.policy.clone(linesep="\r\n"))


async def test_swaks_sends_through_the_front_end(mem: Stores) -> None:
    """A real third-party client (swaks, a Debian package; ``make tools`` installs it)."""
    swaks = shutil.which("swaks")
    assert swaks, "swaks is not installed: run `make tools` (apt-get install swaks)"
    async with running(frontend_settings(), mem) as server:
        proc = await asyncio.create_subprocess_exec(
            swaks, "--server", "127.0.0.1", "--port", str(server.port),
            "--helo", "swaks.example.test", "--from", "alice@example.test",
            "--to", "bob@dest.example.test,eve@other.example.test",
            "--header", "Subject: from swaks", "--body", "hello from swaks",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    assert b"<-  250 2.0.0 queued as " in out
    [entry] = await entries_of(mem)
    assert [r.address for r in entry.recipients] == [
        "bob@dest.example.test",
        "eve@other.example.test",
    ]
    assert entry.helo == "swaks.example.test"
    assert b"hello from swaks" in await read_body(mem, entry.id)


async def test_ehlo_capabilities_and_enhanced_codes(mem: Stores) -> None:
    """RFC 1870, 2034, 2920, 3461, 6152, 6531; CASE-23 E: SMTPUTF8 only with 8BITMIME;
    no STARTTLS or AUTH without TLS settings; every 2xx/4xx/5xx reply has an enhanced code."""
    async with running(frontend_settings(max_message_size=50_000_000), mem) as server:
        w = await Wire.connect(server.port)
        ehlo = await w.expect("EHLO client.example.test", 250)
        caps = ehlo.lines[1:]
        assert caps == [
            "PIPELINING",
            "SIZE 50000000",
            "8BITMIME",
            "SMTPUTF8",
            "ENHANCEDSTATUSCODES",
            "DSN",
        ]
        for line, code in [("NOOP", 250), ("RSET", 250), ("BOGUS", 500), ("EXPN x", 502),
                           ("VRFY <a@b.test>", 252), ("AUTH PLAIN", 502), ("STARTTLS", 502),
                           ("HELP", 250)]:  # fmt: skip
            r = await w.expect(line, code)
            assert r.enhanced and r.enhanced[0] == str(code)[0], r
        assert (await w.expect("QUIT", 221)).enhanced == "2.0.0"
        assert await w.closed() == b""


async def test_too_many_unknown_commands_end_the_session_with_421(mem: Stores) -> None:
    """A client that sends command after unknown command is cut off after a few; the reply
    that ends the session is 421 (RFC 5321 §3.8: the server closing the channel says so;
    aiosmtpd sent 502, which reads as a refusal of that one command)."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        codes = []
        for i in range(10):
            r = await w.cmd(f"XBOGUS{i}")
            codes.append(r.code)
            if r.code != 500:
                break
        assert codes[-1] == 421 and set(codes[:-1]) == {500}, codes
        assert r.enhanced == "4.7.0"
        assert await w.closed() == b""


async def test_commands_that_move_no_mail_are_limited_between_messages(mem: Stores) -> None:
    """``smtp.max_junk_commands`` (5 here) commands that move no mail (NOOP, RSET, VRFY,
    HELP, EHLO ...) between two messages; the next gets ``421 4.7.0`` and the session ends
    (RFC 5321 §3.8), as Postfix's junk command limit: the idle timeout alone let a client
    hold a session for ever with a NOOP now and then. A message accepted starts the count
    again (a pooled connection's RSET per message is fine); a refused DATA does not."""
    async with running(frontend_settings(max_junk_commands=5), mem) as server:
        w = await Wire.connect(server.port)
        for command in ["EHLO client.example.test", "NOOP", "RSET", "HELP", "noop"]:
            assert (await w.cmd(command)).code // 100 == 2, command
        r = await w.transaction(
            "a@example.test", ["b@dest.example.test"], b"x\r\n.\r\n", ehlo=False
        )
        assert r.code == 250, r
        for _ in range(4):
            await w.expect("RSET", 250)
        await w.expect("DATA", 503)  # no mail moved: counted, and the count goes on
        r = await w.cmd("NOOP")
        assert (r.code, r.enhanced) == (421, "4.7.0"), r
        assert await w.closed() == b""


async def test_errors_end_a_session_but_not_those_of_a_recipient_limit(mem: Stores) -> None:
    """``smtp.hard_error_limit`` (3 here) error replies since the last accepted message end
    the session with ``421 4.7.0`` (Postfix's smtpd_hard_error_limit: a client sending
    bad commands or harvesting addresses); a recipient limit's ``452 4.5.3`` is no error
    (RFC 5321 §4.5.3.1.10: the client goes on in a further transaction), and a message
    accepted starts the count again. Errors used to be answered without end."""
    settings = frontend_settings(hard_error_limit=3, max_recipients=1)
    async with running(settings, mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        for _ in range(2):
            await w.expect("MAIL FROM:bad", 501)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        await w.expect("RCPT TO:<b@dest.example.test>", 250)
        for _ in range(4):
            r = await w.cmd("RCPT TO:<c@dest.example.test>")
            assert (r.code, r.enhanced) == (452, "4.5.3"), r
        await w.expect("DATA", 354)
        await w.expect(b"x\r\n.", 250)
        for _ in range(2):  # counted from the 250: two errors
            await w.expect("MAIL FROM:bad", 501)
        await w.send(b"RCPT TO:<b@dest.example.test>\r\nNOOP\r\n")  # the third
        assert (await w.reply()).code == 503
        r = await w.reply()
        assert (r.code, r.enhanced) == (421, "4.7.0"), r
        assert await w.closed() == b""  # the NOOP was not run


async def test_a_command_line_cannot_forge_a_log_line(mem: Stores) -> None:
    """An unknown command of a client, which aiosmtpd logs as it came, reaches the text log
    as one line, its control characters (ESC, CR) written as ``\\xNN``: it can neither
    clear the terminal's line and print a forged one nor start a line of its own."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(TextFormatter())
    library = logging.getLogger("mail.log")
    library.addHandler(handler)
    try:
        async with running(frontend_settings(), mem) as server:
            w = await Wire.connect(server.port)
            forged = b"FOO\x1b[2K\rFAKE 2026-12-07 INFO jsqueue: all good"
            assert (await w.cmd(forged)).code == 500
            await w.expect("QUIT", 221)
    finally:
        library.removeHandler(handler)
    logged = out.getvalue()
    assert "\\x1b[2K\\x0dFAKE" in logged, logged
    assert "\x1b" not in logged and "\r" not in logged


async def test_helo_session_uses_plain_smtp(mem: Stores) -> None:
    """RFC 5321 §4.1.1.1: after HELO no extension parameters; Received: says ``with SMTP``."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        helo = await w.expect("HELO client.example.test", 250)
        assert helo.lines == ["mx.jsqueue.test"]
        assert (await w.cmd("MAIL FROM:<a@example.test> BODY=8BITMIME")).code == 555
        reply = await w.transaction(
            "a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE), ehlo=False
        )
        entry = (await entries_of(mem))[0]
        assert entry.id == queued_id(reply)
        assert b" with SMTP id " in split_body(await read_body(mem, entry.id))[0]


@pytest.mark.parametrize(
    ("argument", "stored"),
    [
        (b"\xff\xfe.example", "??.example"),  # not UTF-8
        (b"\x1b]0;pwned\x07evil.example", "?]0;pwned?evil.example"),  # a terminal escape
        ("caf\u00e9.example".encode(), "caf\u00e9.example"),  # UTF-8 is kept
    ],
)
async def test_any_ehlo_argument_is_stored_safely(
    mem: Stores, argument: bytes, stored: str
) -> None:
    """RFC 5321 §4.1.1.1 wants a domain or address literal after EHLO, and clients send
    anything: octets that are not UTF-8, control characters. Neither may make the entry
    unstorable (every message of the session would get 451 for ever) nor reach an
    operator's terminal raw: the message is queued, its entry keeps the argument with
    those characters as ``?``."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect(b"EHLO " + argument, 250)
        reply = await w.transaction(
            "a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE), ehlo=False
        )
        assert reply.code == 250, reply
        entry = (await entries_of(mem))[0]
        assert entry.helo == stored


async def test_rcpt_to_postmaster_without_a_domain_is_accepted(mem: Stores) -> None:
    """RFC 5321 §4.1.1.3, §4.5.1: ``RCPT TO:<Postmaster>`` (no domain, any case), and
    ``postmaster@<smtp.hostname>``, MUST be accepted: they are queued for
    ``smtp.postmaster``, also from a client that may not relay (the postmaster is this
    system's own mailbox). Only those: the same address written out is relayed as any
    other, and another address without a domain is still refused."""
    settings = frontend_settings(relay_networks=["192.0.2.0/24"], postmaster="ops@example.test")
    async with running(settings, mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        await w.expect("RCPT TO:<someone>", 501)
        await w.expect("RCPT TO:<b@dest.example.test>", 554)  # no relaying for it
        await w.expect("RCPT TO:<ops@example.test>", 554)  # nor for the address itself
        await w.expect("RCPT TO:<PostMaster>", 250)
        await w.expect("RCPT TO:<POSTMASTER@MX.jsqueue.test>", 250)  # the same mailbox
        await w.expect("DATA", 354)
        await w.send(dot_stuff(MESSAGE))
        assert (await w.reply()).code == 250
    entry = (await entries_of(mem))[0]
    assert [r.address for r in entry.recipients] == ["ops@example.test"]


async def test_rcpt_to_postmaster_with_none_configured_is_refused_plainly(mem: Stores) -> None:
    """With neither ``smtp.postmaster`` nor ``dsn.postmaster`` set this queue has no
    mailbox of its own to take the postmaster's mail: ``<Postmaster>`` is refused with
    ``550 5.1.1`` saying so, rather than queued for an address that routes back here (a
    loop, then a bounce)."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        refused = await w.expect("RCPT TO:<Postmaster>", 550)
        assert refused.enhanced == "5.1.1" and "smtp.postmaster" in refused.text


async def test_pipelined_transaction_gets_replies_in_order(mem: Stores) -> None:
    """RFC 2920 §3.1: a pipelined group is answered in order, and commands sent right after
    the terminator (in the same packet) are executed after the DATA reply."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.send(
            b"MAIL FROM:<a@example.test>\r\nRCPT TO:<b@dest.example.test>\r\n"
            b"RCPT TO:<c@x.test>\r\nDATA\r\n"
        )
        assert [(await w.reply()).code for _ in range(4)] == [250, 250, 250, 354]
        await w.send(dot_stuff(MESSAGE) + b"MAIL FROM:<a@example.test>\r\nRSET\r\nQUIT\r\n")
        assert queued_id(await w.reply())
        assert [(await w.reply()).code for _ in range(3)] == [250, 250, 221]
        assert await w.closed() == b""
    assert len(await entries_of(mem)) == 1


async def test_null_reverse_path_and_sequence_errors(mem: Stores) -> None:
    """RFC 5321 §4.5.5: ``MAIL FROM:<>`` is accepted; §4.1.4: out-of-order commands → 503."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("MAIL FROM:<a@example.test>", 503)  # before EHLO
        await w.expect("EHLO client.example.test", 250)
        await w.expect("RCPT TO:<b@dest.example.test>", 503)
        await w.expect("DATA", 503)
        await w.expect("MAIL FROM:<>", 250)
        await w.expect("MAIL FROM:<>", 503)
        await w.expect("DATA", 503)
        await w.expect("RCPT TO:<b@dest.example.test>", 250)
        await w.expect("DATA x", 501)
        await w.expect("DATA", 354)
        await w.send(dot_stuff(MESSAGE))
        queued_id(await w.reply())
    [entry] = await entries_of(mem)
    assert entry.reverse_path == ""


@pytest.mark.parametrize(
    ("command", "code", "enhanced"),
    [
        ("MAIL FROM:alice@example.test", 501, "5.1.7"),
        ("MAIL FROM:<alice@exa mple.test>", 501, "5.1.7"),
        ("MAIL FROM:<a@example.test> SIZE=abc", 501, "5.5.4"),
        ("MAIL FROM:<a@example.test> BODY=BINARYMIME", 501, "5.5.4"),
        ("MAIL FROM:<a@example.test> RET=ALL", 501, "5.5.4"),
        ("MAIL FROM:<a@example.test> ENVID=a+0A", 501, "5.5.4"),
        ("MAIL FROM:<a@example.test> SMTPUTF8=yes", 501, "5.5.4"),
        ("MAIL FROM:<a@example.test> XFOO=1", 555, "5.5.4"),
        ("MAIL FROM:<a@[999.1.1.1]>", 553, "5.1.3"),
        ("RCPT TO:<>", 501, "5.1.3"),
        ("RCPT TO:<webmaster>", 501, "5.1.3"),
        ("RCPT TO:<b@dest.example.test> NOTIFY=NEVER,SUCCESS", 501, "5.5.4"),
        ("RCPT TO:<b@dest.example.test> ORCPT=bob", 501, "5.5.4"),
        ("RCPT TO:<b@dest.example.test> XFOO", 555, "5.5.4"),
        ("RCPT TO:<müller@dest.example.test>", 553, "5.6.7"),
    ],
)
async def test_syntax_errors_leave_the_session_usable(
    mem: Stores, command: str, code: int, enhanced: str
) -> None:
    """RFC 5321 §4.1.2, RFC 3461 §4, RFC 6531 §3.4: each bad argument gets its reply; the
    transaction can continue (or start over) and nothing is stored for it."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        if command.startswith("RCPT"):
            await w.expect("MAIL FROM:<a@example.test>", 250)
        r = await w.cmd(command)
        assert (r.code, r.enhanced) == (code, enhanced), r
        await w.expect("RSET", 250)
        reply = await w.transaction(
            "a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE), ehlo=False
        )
        queued_id(reply)
    assert len(await entries_of(mem)) == 1


# ------------------------------------------------------------------------ relay, limits


async def test_relay_denied_outside_relay_networks(mem: Stores) -> None:
    """RFC 5321 §3.6.2: never an open relay. A client at 127.0.0.2 with relay_networks =
    127.0.0.1/32 gets 554 5.7.1 at RCPT; 127.0.0.1 may relay."""
    settings = frontend_settings(relay_networks=["127.0.0.1/32"])
    async with running(settings, mem) as server:
        w = await Wire.connect(server.port, source="127.0.0.2")
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        r = await w.expect("RCPT TO:<b@dest.example.test>", 554)
        assert r.enhanced == "5.7.1"
        await w.expect("DATA", 503)
        ok = await Wire.connect(server.port, source="127.0.0.1")
        queued_id(
            await ok.transaction("a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE))
        )
    assert len(await entries_of(mem)) == 1


async def test_default_relay_networks_are_loopback_only() -> None:
    """Never an open relay by default: the default relay networks are 127/8 and ::1."""
    assert [str(n) for n in frontend_settings().relay_networks] == ["127.0.0.0/8", "::1/128"]


async def test_recipient_limit_and_duplicates(mem: Stores) -> None:
    """RFC 5321 §4.5.3.1.10: RCPT beyond max_recipients → 452 4.5.3; the accepted ones are
    queued. A repeated recipient is acknowledged and stored once."""
    async with running(frontend_settings(max_recipients=3), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        for rcpt in ("b@d.test", "c@d.test", "b@D.TEST", "e@d.test"):
            await w.expect(f"RCPT TO:<{rcpt}>", 250)
        r = await w.expect("RCPT TO:<f@d.test>", 452)
        assert r.enhanced == "4.5.3"
        await w.expect("DATA", 354)
        await w.send(dot_stuff(MESSAGE))
        queued_id(await w.reply())
    [entry] = await entries_of(mem)
    assert [r.address for r in entry.recipients] == ["b@d.test", "c@d.test", "e@d.test"]


async def test_session_cap_refuses_with_421(mem: Stores) -> None:
    """RFC 5321 §3.1: over max_sessions a client gets 421 4.7.0 at the greeting and is
    disconnected; once a session ends a new one is served."""
    async with running(frontend_settings(max_sessions=2), mem) as server:
        a = await Wire.connect(server.port)
        b = await Wire.connect(server.port)
        c = await Wire.connect(server.port, greet=False)
        refused = await c.reply()
        assert (refused.code, refused.enhanced) == (421, "4.7.0")
        assert await c.closed() == b""
        await a.expect("QUIT", 221)
        assert await a.closed() == b""
        d = await Wire.connect(server.port)
        await d.expect("NOOP", 250)
        await b.expect("NOOP", 250)
        assert server.active_sessions == 2


async def test_sessions_per_client_are_limited_outside_relay_networks(mem: Stores) -> None:
    """As Postfix's smtpd_client_connection_count_limit (exempting $mynetworks): a client
    outside ``relay_networks`` gets ``max_sessions_per_client`` (2 here) sessions at once,
    the next ``421 4.7.0`` at the greeting; another client, and one inside
    ``relay_networks``, are not held back; a session that ends frees its place. One
    client could take every one of ``max_sessions`` before."""
    settings = frontend_settings(max_sessions_per_client=2, relay_networks=["127.0.0.1/32"])
    async with running(settings, mem) as server:
        a, b = [await Wire.connect(server.port, source="127.0.0.2") for _ in range(2)]
        c = await Wire.connect(server.port, source="127.0.0.2", greet=False)
        refused = await c.reply()
        assert (refused.code, refused.enhanced) == (421, "4.7.0")
        assert await c.closed() == b""
        other = await Wire.connect(server.port, source="127.0.0.3")
        trusted = [await Wire.connect(server.port) for _ in range(3)]  # 127.0.0.1
        await a.expect("QUIT", 221)
        assert await a.closed() == b""
        again = await Wire.connect(server.port, source="127.0.0.2")
        for w in [again, b, other, *trusted]:
            await w.expect("NOOP", 250)
        assert server.active_sessions == 6


async def test_idle_session_times_out_with_421(mem: Stores) -> None:
    """RFC 5321 §4.5.3.2.7: an idle client is disconnected after the session timeout, with
    421 4.4.2 first."""
    async with running(frontend_settings(session_timeout_s=0.3), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        r = await w.reply(timeout_s=10)
        assert (r.code, r.enhanced) == (421, "4.4.2")
        assert await w.closed() == b""
        assert server.active_sessions == 0


async def test_client_stalling_in_data_times_out(mem: Stores) -> None:
    """RFC 5321 §4.5.3.2.5 (data block timeout): a client that stops sending in the middle
    of DATA is disconnected after the session timeout; nothing is stored."""
    async with running(frontend_settings(session_timeout_s=0.3), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        await w.expect("RCPT TO:<b@dest.example.test>", 250)
        await w.expect("DATA", 354)
        await w.send(b"Subject: half a message\r\n\r\nand then silence")
        r = await w.reply(timeout_s=10)
        assert (r.code, r.enhanced) == (421, "4.4.2")
        assert await w.closed() == b""
    assert await entries_of(mem) == [] and memory_body_count(mem) == 0


@pytest.mark.parametrize("quit_", [True, False], ids=["quit", "no-quit"])
async def test_a_client_that_half_closes_after_its_commands_gets_every_reply(
    mem: Stores, quit_: bool
) -> None:
    """A client that writes its whole session and then shuts down its sending side (``nc
    -N host 25 < session.txt``, a script's socket ``shutdown(SHUT_WR)``) has every command
    it sent before the end of its stream answered, in order, and a complete message is
    stored before its 250 (RFC 5321 §4.1.1.4, §3.8: the session ends at QUIT or at the
    end of the client's input, as Postfix's smtpd does); the EOF must not drop the
    commands still buffered or a message already terminated. The same EOF inside DATA,
    before the terminator, stores nothing and sends no 250."""
    session = (
        b"EHLO client.example.test\r\nMAIL FROM:<a@example.test>\r\n"
        b"RCPT TO:<b@dest.example.test>\r\nDATA\r\n" + dot_stuff(MESSAGE)
    ) + (b"QUIT\r\n" if quit_ else b"")
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.send(session)
        w.writer.write_eof()
        codes = [(await w.reply()).code for _ in range(4)]
        assert codes == [250, 250, 250, 354]
        qid = queued_id(await w.reply())
        if quit_:
            assert (await w.reply()).code == 221
        assert await w.closed() == b""
        [entry] = await entries_of(mem)
        assert entry.id == qid and [r.address for r in entry.recipients] == ["b@dest.example.test"]

        w = await Wire.connect(server.port)
        await w.send(session[: session.index(b"Hello.")])
        w.writer.write_eof()
        assert [(await w.reply()).code for _ in range(4)] == [250, 250, 250, 354]
        assert await w.closed() == b""
    assert len(await entries_of(mem)) == 1 and memory_body_count(mem) == 1


async def test_stop_lets_a_transaction_in_data_finish(mem: Stores) -> None:
    """Graceful drain: a session in DATA when stop() is called still gets its 250 (the
    message is stored), then 421 4.3.2 and the connection is closed."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        await w.expect("RCPT TO:<b@dest.example.test>", 250)
        await w.expect("DATA", 354)
        await w.send(b"Subject: drained\r\n\r\n")
        server.close()
        await w.send(b"body\r\n.\r\n")
        qid = queued_id(await w.reply())
        r = await w.reply()
        assert (r.code, r.enhanced) == (421, "4.3.2")
        assert await w.closed() == b""
        await server.wait_closed(timeout_s=10)
    assert [e.id for e in await entries_of(mem)] == [qid]


async def test_stop_closes_idle_sessions_with_421(mem: Stores) -> None:
    """Graceful drain: stop() closes idle sessions with 421 4.3.2 and refuses new ones."""
    server_cm = running(frontend_settings(), mem)
    server = await server_cm.__aenter__()
    w = await Wire.connect(server.port)
    await w.expect("EHLO client.example.test", 250)
    await server.stop(timeout_s=5)
    r = await w.reply()
    assert (r.code, r.enhanced) == (421, "4.3.2")
    assert await w.closed() == b""
    await server_cm.__aexit__(None, None, None)


# ------------------------------------------------------------------------ size (CASE-26)


async def test_case26_c1_declared_size_over_limit(mem: Stores) -> None:
    """CASE-26 C1 / RFC 1870 §6.1: SIZE=60000000 against a 50 000 000 limit → 552 5.3.4 at
    MAIL, before any DATA; nothing queued; the session goes on."""
    async with running(frontend_settings(max_message_size=50_000_000), mem) as server:
        w = await Wire.connect(server.port)
        ehlo = await w.expect("EHLO client.example.test", 250)
        assert "SIZE 50000000" in ehlo.lines
        r = await w.expect("MAIL FROM:<alice@example.test> SIZE=60000000", 552)
        assert r.enhanced == "5.3.4"
        await w.expect("RCPT TO:<user@nolimit.example.test>", 503)
        await w.expect("MAIL FROM:<alice@example.test> SIZE=49999999", 250)
    assert await entries_of(mem) == []


@pytest.mark.parametrize("size", [150_000, 1_500_000])
async def test_undeclared_oversize_rejected_after_terminator(mem: Stores, size: int) -> None:
    """CASE-26 C2 (scaled): undeclared oversize → 552 5.3.4 after the terminator (not 451,
    no disconnect), NOOP still works, nothing stored, not even the part of the body that
    was already being uploaded (1.5 MB > one body chunk)."""
    limit = size * 2 // 3
    line = b"A" * 76 + b"\r\n"
    message = b"Subject: big\r\n\r\n" + line * (size // len(line))
    async with running(frontend_settings(max_message_size=limit), mem) as server:
        w = await Wire.connect(server.port)
        r = await w.transaction(
            "alice@example.test", ["user@nolimit.example.test"], dot_stuff(message)
        )
        assert (r.code, r.enhanced) == (552, "5.3.4")
        await w.expect("NOOP", 250)
        queued_id(
            await w.transaction(
                "alice@example.test", ["user@x.test"], dot_stuff(MESSAGE), ehlo=False
            )
        )
    assert len(await entries_of(mem)) == 1 and memory_body_count(mem) == 1


async def test_large_message_streams_intact(mem: Stores) -> None:
    """RFC 5321 §4.5.2 across many body chunks: 3 MB with dotted lines arrives byte-exact."""
    lines = [b"." * (i % 5) + b"line %d " % i + b"x" * (i % 70) for i in range(40_000)]
    message = b"Subject: big\r\n\r\n" + b"\r\n".join(lines) + b"\r\n"
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        qid = queued_id(
            await w.transaction("a@example.test", ["b@dest.example.test"], dot_stuff(message))
        )
    assert split_body(await read_body(mem, qid))[1] == message


async def test_small_message_is_kept_inline_in_its_entry(mem: Stores) -> None:
    """A message up to ``smtp.inline_body_max`` octets (opt-in) is stored in its entry (the
    body store is not written) with the size and digest of what was received."""
    async with running(frontend_settings(inline_body_max=INLINE_MAX), mem) as server:
        w = await Wire.connect(server.port)
        qid = queued_id(
            await w.transaction("a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE))
        )
    [entry] = await entries_of(mem)
    assert entry.id == qid and entry.inline_body is not None
    assert split_body(entry.inline_body)[1] == MESSAGE
    assert (entry.size, entry.digest) == (
        len(entry.inline_body),
        hashlib.sha256(entry.inline_body).hexdigest(),
    )
    assert body_store_count(mem) == 0


@pytest.mark.parametrize("inline_max", [None, 0, 1024])
async def test_message_over_the_inline_limit_goes_to_the_body_store(
    mem: Stores, inline_max: int | None
) -> None:
    """DESIGN.md §1/§3: bodies go to the object store (the default); with
    ``smtp.inline_body_max`` set, a larger message still does, and its entry carries no
    inline body."""
    message = b"Subject: over\r\n\r\n" + (b"y" * 70 + b"\r\n") * 20
    settings = frontend_settings(**({} if inline_max is None else {"inline_body_max": inline_max}))
    async with running(settings, mem) as server:
        w = await Wire.connect(server.port)
        qid = queued_id(
            await w.transaction("a@example.test", ["b@dest.example.test"], dot_stuff(message))
        )
    [entry] = await entries_of(mem)
    assert entry.inline_body is None and body_store_count(mem) == 1
    assert split_body(b"".join([c async for c in mem.bodies.open(qid)]))[1] == message


async def test_entry_too_large_for_an_inline_body_keeps_it_in_the_body_store(
    mem: Stores,
) -> None:
    """An entry that would exceed half the entry store's largest value with its body (many
    recipients) gets the body stored apart instead of a refused write and a 451."""
    assert isinstance(mem.entries, MemoryEntryStore)
    mem.entries.max_value_size = 32 * 1024
    rcpts = [f"user{i:03d}@dest.example.test" for i in range(100)]
    async with running(frontend_settings(inline_body_max=INLINE_MAX), mem) as server:
        w = await Wire.connect(server.port)
        big = queued_id(await w.transaction("a@example.test", rcpts, dot_stuff(MESSAGE)))
        small = queued_id(
            await w.transaction(
                "a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE), ehlo=False
            )
        )
    inline = {e.id: e.inline_body is not None for e in await entries_of(mem)}
    assert inline == {big: False, small: True} and body_store_count(mem) == 1
    assert split_body(await read_body(mem, big))[1] == MESSAGE


# ------------------------------------------------------------------------ cases


def _case01_payloads() -> list[str]:
    return sorted(p.name for p in (CASES / "CASE-01").glob("*.bin"))


async def _case01_session(port: int, payload: bytes) -> list[int]:
    """The CASE-01 session with exact bytes; every reply code after the greeting."""
    w = await Wire.connect(port)
    commands = ("EHLO client.example.test", "MAIL FROM:<alice@example.test>",
                "RCPT TO:<bob@dest.example.test>", "DATA")  # fmt: skip
    codes = [(await w.cmd(line)).code for line in commands]
    await w.send(payload)  # one send()
    codes.append((await w.reply()).code)
    await w.send(b"QUIT\r\n")
    codes.append((await w.reply()).code)
    assert await w.closed() == b"", "a reply beyond QUIT's: something was smuggled"
    return codes


@pytest.mark.parametrize("payload", _case01_payloads())
async def test_case01_smuggling_rejected_by_default(mem: Stores, payload: str) -> None:
    """CASE-01, default policy (reject bare CR/LF): exactly one reply (550 5.6.11) for the
    whole payload, QUIT gets 221, nothing queued."""
    async with running(frontend_settings(), mem) as server:
        codes = await _case01_session(server.port, case_file("CASE-01", payload))
    assert codes == [250, 250, 250, 354, 550, 221]
    assert await entries_of(mem) == [] and memory_body_count(mem) == 0


@pytest.mark.parametrize("payload", _case01_payloads())
async def test_case01_smuggling_accepted_as_one_message(mem: Stores, payload: str) -> None:
    """CASE-01, accept policy: one message alice → bob whose body still holds the smuggled
    ``MAIL FROM:<ceo@…>`` as text; never an entry from ceo@trusted.example.test."""
    async with running(frontend_settings(bare_line_endings=BareLinePolicy.ACCEPT), mem) as server:
        codes = await _case01_session(server.port, case_file("CASE-01", payload))
    assert codes == [250, 250, 250, 354, 250, 221]
    [entry] = await entries_of(mem)
    assert entry.reverse_path == "alice@example.test"
    assert [r.address for r in entry.recipients] == ["bob@dest.example.test"]
    body = await read_body(mem, entry.id)
    assert b"MAIL FROM:<ceo@trusted.example.test>" in body
    assert body.count(b"\r") == body.count(b"\n") == body.count(b"\r\n")


async def test_case03_variant_a_dots_byte_identical(mem: Stores) -> None:
    """CASE-03 A / RFC 5321 §4.5.2: smtplib stuffs, we unstuff: stored body == message.eml."""
    message = case_file("CASE-03", "message.eml")
    async with running(frontend_settings(), mem) as server:

        def send() -> tuple[int, bytes]:
            with smtplib.SMTP("127.0.0.1", server.port) as s:
                s.ehlo("client.example.test")
                s.mail("alice@example.test")
                s.rcpt("bob@dest.example.test")
                return s.data(message)

        code, _ = await asyncio.to_thread(send)
    assert code == 250
    [entry] = await entries_of(mem)
    assert split_body(await read_body(mem, entry.id))[1] == message


async def test_case03_variant_b_under_both_policies() -> None:
    """CASE-03 B: reject (default) → 550 5.6.11, nothing queued; accept → the author's lines
    (stuffed per LF line) come out unstuffed once, plus one empty line."""
    data = case_file("CASE-03", "variant-b-bare-lf.bin")
    for policy, code in ((BareLinePolicy.REJECT, 550), (BareLinePolicy.ACCEPT, 250)):
        stores = open_memory()
        async with running(frontend_settings(bare_line_endings=policy), stores) as server:
            w = await Wire.connect(server.port)
            r = await w.transaction("alice@example.test", ["bob@dest.example.test"], data)
            assert r.code == code, r
            await w.expect("NOOP", 250)
        entries = await entries_of(stores)
        if code == 550:
            assert r.enhanced == "5.6.11" and entries == []
            continue
        body = split_body(await read_body(stores, entries[0].id))[1].split(b"\r\n\r\n", 1)[1]
        assert body.split(b"\r\n")[:-1] == [
            b".first body line starts with a dot", b".", b"..", b"...", b".hidden",
            b"middle line", b"",
        ]  # fmt: skip


async def test_case23_utf8_addresses(mem: Stores) -> None:
    """CASE-23 / RFC 6531 §3.4: UTF-8 addresses need SMTPUTF8 on MAIL (else 553 5.6.7 with a
    clear text); with it they are stored unchanged, the domain as an A-label; the 8-bit
    Subject message (D) is queued with smtputf8 and body_8bit set."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<alice@example.test>", 250)
        r = await w.expect("RCPT TO:<user@bücher.example.test>", 553)
        assert r.enhanced == "5.6.7" and "SMTPUTF8" in r.text
        await w.expect("RSET", 250)
        await w.expect("MAIL FROM:<alice@example.test> SMTPUTF8 BODY=8BITMIME", 250)
        for rcpt in (
            "user@bücher.example.test",
            "müller@dest.example.test",
            "müller@intl.example.test",
        ):
            await w.expect(f"RCPT TO:<{rcpt}>", 250)
        await w.expect("DATA", 354)
        await w.send(dot_stuff(case_file("CASE-23", "message-utf8-subject.eml")))
        qid = queued_id(await w.reply())
        queued_id(await _utf8_sender(w))
    entries = {e.id: e for e in await entries_of(mem)}
    entry = entries[qid]
    assert [(r.address, r.domain) for r in entry.recipients] == [
        ("user@bücher.example.test", "xn--bcher-kva.example.test"),
        ("müller@dest.example.test", "dest.example.test"),
        ("müller@intl.example.test", "intl.example.test"),
    ]
    assert entry.smtputf8 and entry.body_8bit
    received = split_body(await read_body(mem, qid))[0]
    assert b" with UTF8SMTP id " in received


async def _utf8_sender(w: Wire) -> Reply:
    """A UTF-8 reverse-path needs SMTPUTF8 too (RFC 6531 §3.4)."""
    r = await w.cmd("MAIL FROM:<müller@example.test>")
    assert (r.code, r.enhanced) == (553, "5.6.7")
    await w.expect("MAIL FROM:<müller@example.test> SMTPUTF8", 250)
    await w.expect("RCPT TO:<plain@dest.example.test>", 250)
    await w.expect("DATA", 354)
    await w.send(dot_stuff(case_file("CASE-23", "message.eml")))
    return await w.reply()


async def test_case25_long_lines_at_ingress(mem: Stores) -> None:
    """CASE-25 / RFC 5321 §4.5.3.1.6: message-998 is accepted byte-exact; 999, 5000 and the
    long References header each get one 5xx reply after the terminator and the next MAIL
    works. Documented choice: reject, never rewrite, at ingress."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        results = {}
        for name in (
            "message-5000.eml",
            "message-long-header.eml",
            "message-998.eml",
            "message-999.eml",
        ):
            r = await w.transaction("alice@example.test", ["user@strict.example.test"],
                                    dot_stuff(case_file("CASE-25", name)), ehlo=False)  # fmt: skip
            results[name] = r
        await w.expect("NOOP", 250)
    for name in ("message-5000.eml", "message-long-header.eml", "message-999.eml"):
        assert (results[name].code, results[name].enhanced) == (500, "5.5.2"), name
    [entry] = await entries_of(mem)
    assert entry.id == queued_id(results["message-998.eml"])
    assert split_body(await read_body(mem, entry.id))[1] == case_file("CASE-25", "message-998.eml")


# ------------------------------------------------------------------------ store failures


@pytest.mark.parametrize(
    ("step", "inline_max"),
    [("put", 0), ("create", 0), ("schedule", 0), ("create", INLINE_MAX), ("schedule", INLINE_MAX)],
)
async def test_store_failure_answers_451_and_cleans_up(step: str, inline_max: int) -> None:
    """DESIGN.md §2.1: a failed store step → 451 4.3.0, never 250; what was stored is deleted;
    the same session can send again once the store is back. Both body layouts (an inline
    body has no put of its own)."""
    faulty = FaultyStores()
    faulty.fault(step).fail = True
    settings = frontend_settings(inline_body_max=inline_max)
    async with running(settings, faulty.stores) as server:
        w = await Wire.connect(server.port)
        r = await w.transaction(
            "a@example.test", ["b@dest.example.test", "c@x.test"], dot_stuff(MESSAGE)
        )
        assert (r.code, r.enhanced) == (451, "4.3.0")
        assert await entries_of(faulty.inner) == [] and memory_body_count(faulty.inner) == 0
        faulty.fault(step).fail = False
        qid = queued_id(
            await w.transaction(
                "a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE), ehlo=False
            )
        )
    assert [e.id for e in await entries_of(faulty.inner)] == [qid]


async def test_store_timeout_answers_451() -> None:
    """A store that does not answer within store_timeout_s → 451 4.3.0 (bounded wait)."""
    faulty = FaultyStores()
    faulty.fault("create").hang = True
    async with running(frontend_settings(store_timeout_s=0.3), faulty.stores) as server:
        w = await Wire.connect(server.port)
        r = await w.transaction("a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE))
        assert (r.code, r.enhanced) == (451, "4.3.0")
        await w.expect("NOOP", 250)
    faulty.released.set()
    assert await entries_of(faulty.inner) == [] and memory_body_count(faulty.inner) == 0


# ------------------------------------------------------------------------ idempotent ingest


async def _send_once(
    port: int, message: bytes, rcpts: list[str] | None = None, *, drop: bool = False
) -> str:
    """One transaction on a new connection, then QUIT, or (``drop``) the connection dropped
    right after the 250, as when the client may not have seen it."""
    w = await Wire.connect(port)
    reply = await w.transaction(
        "a@example.test", rcpts or ["b@dest.example.test"], dot_stuff(message)
    )
    if drop:
        await w.close()
    else:
        await w.expect("QUIT", 221)
    return queued_id(reply)


async def test_resent_message_gets_the_same_queue_id(mem: Stores) -> None:
    """Idempotent ingest: the same envelope + content within dedupe_window_s → 250 with the
    first queue id and no second entry, body or work item; other content → new id."""
    async with running(frontend_settings(dedupe_window_s=60), mem) as server:
        first = await _send_once(server.port, MESSAGE, drop=True)
        again = await _send_once(server.port, MESSAGE)
        other = await _send_once(server.port, MESSAGE + b"P.S.\r\n")
        more_rcpts = await _send_once(
            server.port, MESSAGE, ["b@dest.example.test", "c@dest.example.test"]
        )
    assert first == again and len({first, other, more_rcpts}) == 3
    assert len(await entries_of(mem)) == 3 and memory_body_count(mem) == 3
    assert len(await due_domains(mem)) == 3


@pytest.mark.parametrize(
    "behind",
    [b"QUIT\r\n", b"RSET\r\nQUIT\r\n", b"MAIL FROM:<a@example.test>\r\n", b"NOOP\r\nQU"],
)
async def test_commands_pipelined_behind_the_data_keep_the_resend_protection(
    mem: Stores, behind: bytes
) -> None:
    """RFC 2920 §3.1: the message content may be followed, in the same group, by further
    commands (QUIT, RSET, the next MAIL), sent before the client could see the 250. They
    prove nothing: the client that then loses the replies resends, and gets the first id
    (one copy). A command of a later group does end the protection."""
    async with running(frontend_settings(dedupe_window_s=60), mem) as server:
        w = await Wire.connect(server.port)
        reply = await w.transaction(
            "a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE), behind=behind
        )
        first = queued_id(reply)
        await w.close()  # the client never read that 250
        assert await _send_once(server.port, MESSAGE) == first
        # the resend's session went on to QUIT: that copy's 250 was seen
        assert await _send_once(server.port, MESSAGE) != first
    assert len(await entries_of(mem)) == 2


async def test_two_identical_messages_pipelined_in_one_group_are_both_queued(
    mem: Stores,
) -> None:
    """RFC 2920 §3.1: the second transaction pipelined behind the first one's data, with
    the same envelope and content, is a second message, not a resend of the first (which
    would come on a new connection): two 250s with two ids, two entries."""
    async with running(frontend_settings(dedupe_window_s=60), mem) as server:
        w = await Wire.connect(server.port)
        group = b"MAIL FROM:<a@example.test>\r\nRCPT TO:<b@dest.example.test>\r\nDATA\r\n"
        reply = await w.transaction(
            "a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE), behind=group
        )
        first = queued_id(reply)
        assert [(await w.reply()).code for _ in range(3)] == [250, 250, 354]
        await w.send(dot_stuff(MESSAGE))
        second = queued_id(await w.reply())
        await w.expect("QUIT", 221)
    assert first != second
    assert {e.id for e in await entries_of(mem)} == {first, second}


async def test_resend_after_the_first_copy_was_delivered_gets_its_id(mem: Stores) -> None:
    """RFC 5321 §6.1: the session broke right after the 250, and by the time the client
    resends, the first copy was delivered and its entry removed (the store keeps its
    delete marker). The resend is still answered with the first id and nothing is queued:
    a delivered message is not sent twice."""
    async with running(frontend_settings(dedupe_window_s=60), mem) as server:
        first = await _send_once(server.port, MESSAGE, drop=True)
        await mem.entries.delete(first)  # delivered and removed
        second = await _send_once(server.port, MESSAGE, drop=True)
    assert second == first
    assert await entries_of(mem) == []


async def test_separate_submissions_the_client_saw_accepted_are_never_merged(
    mem: Stores,
) -> None:
    """Resend protection covers one case only: the session broke right after the 250 (the
    client may not have seen it, RFC 5321 §6.1). The same transaction again on the same
    connection, or after a clean QUIT, or after any further command, is a new message."""
    async with running(frontend_settings(dedupe_window_s=60), mem) as server:
        w = await Wire.connect(server.port)
        rcpts = ["b@dest.example.test"]
        one = queued_id(await w.transaction("a@example.test", rcpts, dot_stuff(MESSAGE)))
        two = queued_id(
            await w.transaction("a@example.test", rcpts, dot_stuff(MESSAGE), ehlo=False)
        )
        await w.expect("NOOP", 250)
        await w.close()
        after_quit = await _send_once(server.port, MESSAGE)
        after_noop = await _send_once(server.port, MESSAGE)
        resent = await _send_once(server.port, MESSAGE, drop=True)
        resent_again = await _send_once(server.port, MESSAGE, drop=True)
    assert len({one, two, after_quit, after_noop, resent}) == 5
    assert resent_again == resent  # the session broke right after that 250
    assert len(await entries_of(mem)) == 5 and memory_body_count(mem) == 5


async def test_dedupe_window_zero_queues_every_copy(mem: Stores) -> None:
    """dedupe_window_s = 0 turns idempotent ingest off."""
    async with running(frontend_settings(dedupe_window_s=0), mem) as server:
        ids = {await _send_once(server.port, MESSAGE) for _ in range(2)}
    assert len(ids) == 2


async def test_ingest_log_failures_never_block_mail() -> None:
    """The ingest log is best effort: a failing lookup or record still gives 250."""
    faulty = FaultyStores()
    faulty.fault("lookup").fail = True
    faulty.fault("record").fail = True
    async with running(frontend_settings(), faulty.stores) as server:
        ids = {await _send_once(server.port, MESSAGE) for _ in range(2)}
    assert len(ids) == 2 and len(await entries_of(faulty.inner)) == 2


def _case26_message(random_octets: int) -> bytes:
    """CASE-26 message-spec.txt: multipart/mixed, one base64 application/octet-stream part
    of ``random_octets`` random bytes in 76-character lines."""
    encoded = base64.encodebytes(os.urandom(random_octets)).replace(b"\n", b"\r\n")
    return (
        b"From: Alice <alice@example.test>\r\nTo: user@nolimit.example.test\r\n"
        b"Subject: big\r\nMIME-Version: 1.0\r\n"
        b'Content-Type: multipart/mixed; boundary="b1"\r\n\r\n--b1\r\n'
        b"Content-Type: application/octet-stream\r\nContent-Transfer-Encoding: base64\r\n\r\n"
        + encoded
        + b"--b1--\r\n"
    )


async def test_case26_c2_60mb_discarded_with_bounded_memory() -> None:
    """CASE-26 C2 with the case's numbers: a 50 000 000-octet limit, an undeclared ~60 MB
    message → 552 5.3.4 after the terminator (not 451/421, no disconnect), NOOP works,
    nothing queued, and the front end process's peak RSS grows by far less than the
    message (measured on a front end in its own process whose body store keeps nothing)."""
    message = _case26_message(45_000_000)
    assert len(message) > 60_000_000
    proc, port = await start_child({"host": "127.0.0.1", "port": 0, "max_message_size": 50_000_000})
    try:
        w = await Wire.connect(port)
        queued_id(await w.transaction("alice@example.test", ["user@x.test"], dot_stuff(MESSAGE)))
        baseline_kib = rss_peak_kib(proc.pid)
        await w.expect("MAIL FROM:<alice@example.test>", 250)
        await w.expect("RCPT TO:<user@nolimit.example.test>", 250)
        await w.expect("DATA", 354)
        view = memoryview(dot_stuff(message))
        for i in range(0, len(view), 1 << 20):
            await w.send(view[i : i + (1 << 20)])
        r = await w.reply(timeout_s=60)
        assert (r.code, r.enhanced) == (552, "5.3.4")
        await w.expect("NOOP", 250)
        growth_kib = rss_peak_kib(proc.pid) - baseline_kib
        await w.expect("QUIT", 221)
    finally:
        stats = await stop_child(proc)
    assert stats == {"entries": 1, "bodies": 1}
    assert growth_kib < 32 * 1024, f"peak RSS grew by {growth_kib} KiB while discarding 60 MB"
