"""The SMTP front end against broken and hostile clients, over real sockets on loopback:
input sent before the reply it depends on (RFC 5321 §4.3.1, RFC 2920 §3.1), and the
open-relay classics (RFC 5321 §3.6.2, §4.1.1.3: source routes, ``%``, ``!``, quoted ``@``).

Each test names the RFC section it checks.
"""

from __future__ import annotations

import pytest

from jsqueue.store.base import Stores
from jsqueue.store.memory import open_memory
from support.frontend import (
    Wire,
    dot_stuff,
    entries_of,
    frontend_settings,
    queued_id,
    running,
)

MESSAGE = b"From: a@example.test\r\nTo: b@dest.example.test\r\nSubject: hi\r\n\r\nHello.\r\n"
#: A message whose text is a whole mail transaction: what a sender controls when the MTA in
#: front of us relays its message and sends the body without waiting for the DATA reply.
SMUGGLED = (
    b"RSET\r\nMAIL FROM:<ceo@bank.example.test>\r\nRCPT TO:<victim@dest.example.test>\r\n"
    b"DATA\r\nFrom: ceo@bank.example.test\r\nSubject: smuggled\r\n\r\npay now\r\n.\r\nQUIT\r\n"
)


@pytest.fixture
def mem() -> Stores:
    return open_memory()


@pytest.mark.parametrize(
    ("group", "codes"),
    [
        # every RCPT refused (not a mailbox): DATA has no recipient
        (b"MAIL FROM:<a@example.test>\r\nRCPT TO:<not a mailbox>\r\nDATA\r\n", [250, 501, 503]),
        # MAIL refused: the RCPT and DATA of the group are out of sequence
        (b"MAIL FROM:<bad>\r\nRCPT TO:<b@dest.example.test>\r\nDATA\r\n", [501, 503, 503]),
        # DATA itself refused (an argument)
        (b"MAIL FROM:<a@example.test>\r\nRCPT TO:<b@x.test>\r\nDATA x\r\n", [250, 250, 501]),
    ],
    ids=["no-valid-rcpt", "mail-refused", "data-syntax"],
)  # fmt: skip
async def test_message_sent_before_a_refused_data_is_never_executed(
    mem: Stores, group: bytes, codes: list[int]
) -> None:
    """RFC 2920 §3.1 (DATA ends a group: what follows waits for its reply), RFC 5321 §3.3:
    a client that sends its message without waiting for the DATA reply, and DATA is
    refused, must not have the message's lines run as commands (the pipelined-DATA
    desynchronisation): after the refusal the early input gets ``421`` and the session
    ends; nothing of it is queued."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.send(group + SMUGGLED)
        assert [(await w.reply()).code for _ in codes] == codes
        closing = await w.reply()
        assert (closing.code, closing.enhanced) == (421, "4.5.0"), closing
        assert await w.closed() == b""
    assert await entries_of(mem) == []


@pytest.mark.parametrize(
    "first",
    [
        b"Received: from upstream.example.test by relay.example.test; Thu, 3 Dec 2026\r\n",
        b"From: someone@example.test\r\n",
        b"\r\n",  # a message without a header
        b".\r\n",  # an empty message
    ],
    ids=["received", "header", "empty-line", "dot"],
)
async def test_message_arriving_after_a_refused_data_is_never_executed(
    mem: Stores, first: bytes
) -> None:
    """RFC 2920 §3.1, RFC 5321 §3.3: the message of a client that does not wait for the
    DATA reply may arrive only after the refusal went out (another packet). Its first line
    is then no command (a header field, as the trace field an MTA in front of us puts
    first, an empty line, the final dot): the session ends with 421 there, and the
    transaction inside the message is never run."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.send(b"MAIL FROM:<a@example.test>\r\nRCPT TO:<not a mailbox>\r\nDATA\r\n")
        assert [(await w.reply()).code for _ in range(3)] == [250, 501, 503]
        await w.send(first + b"\r\n" + SMUGGLED)
        closing = await w.reply()
        assert (closing.code, closing.enhanced) == (421, "4.5.0"), closing
        assert await w.closed() == b""
    assert await entries_of(mem) == []


async def test_message_sent_before_data_refused_for_lack_of_helo(mem: Stores) -> None:
    """RFC 5321 §4.1.4: DATA before EHLO is refused with 503; a message already sent
    behind it gets 421 and the session ends, its commands never run."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.send(b"DATA\r\n" + SMUGGLED.replace(b"RSET", b"EHLO client.example.test"))
        assert (await w.reply()).code == 503
        assert (await w.reply()).code == 421
        assert await w.closed() == b""
    assert await entries_of(mem) == []


async def test_refused_data_with_nothing_sent_behind_it_keeps_the_session(mem: Stores) -> None:
    """RFC 5321 §3.3: a client that waits for the DATA reply gets the refusal and goes on
    in the same session (no 421 for a well-behaved client)."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.send(b"MAIL FROM:<a@example.test>\r\nRCPT TO:<not a mailbox>\r\nDATA\r\n")
        assert [(await w.reply()).code for _ in range(3)] == [250, 501, 503]
        await w.expect("RSET", 250)
        await w.expect("NOOP", 250)
        await w.expect("QUIT", 221)


async def test_message_sent_before_an_accepted_data_is_the_message(mem: Stores) -> None:
    """RFC 5321 §4.1.1.4: a client without PIPELINING that sends its message right behind
    DATA, before the 354: the 354 still comes first and the early octets are the message
    (stored once), not commands."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("HELO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        await w.expect("RCPT TO:<b@dest.example.test>", 250)
        await w.send(b"DATA\r\n" + SMUGGLED)
        assert [(await w.reply()).code for _ in range(2)] == [354, 250]
        # the "QUIT" after the terminator is a command again
        assert (await w.reply()).code == 221
    [entry] = await entries_of(mem)
    assert [r.address for r in entry.recipients] == ["b@dest.example.test"]


@pytest.mark.parametrize("last", [b" LAST", b""])
async def test_a_bdat_chunk_is_never_read_as_commands(mem: Stores, last: bytes) -> None:
    """RFC 3030 §2, §4.2: a BDAT chunk follows its command at once, without a wait for a
    reply. CHUNKING is not offered, so BDAT is an unknown command (500 5.5.2); the chunk
    (exactly its declared octets) is thrown away, never run as commands, and the session
    goes on in step."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        ehlo = await w.expect("EHLO client.example.test", 250)
        assert "CHUNKING" not in ehlo.lines
        await w.expect("MAIL FROM:<a@example.test>", 250)
        await w.expect("RCPT TO:<b@dest.example.test>", 250)
        await w.send(b"BDAT %d%s\r\n" % (len(SMUGGLED), last) + SMUGGLED + b"NOOP\r\n")
        r = await w.reply()
        assert r.code == 500 and "BDAT" in r.text, r
        assert (await w.reply()).code == 250  # the NOOP after the chunk
        await w.expect("QUIT", 221)
    assert await entries_of(mem) == []


#: Forward-paths that name another host in the local part or a route: a relay may only
#: route by the domain after the last ``@`` (RFC 5321 §3.6.2, §4.1.1.3: a source route is
#: ignored), so each is a recipient at ``dest.example.test`` or nothing.
RELAY_CLASSICS = [
    "<u%other.test@dest.example.test>",
    "<other.test!u@dest.example.test>",
    '<"u@other.test"@dest.example.test>',
    "<@other.test:u@dest.example.test>",
    "<@other.test,@more.test:u@dest.example.test>",
]


@pytest.mark.parametrize(
    "path", [*RELAY_CLASSICS, "<u@other.test@dest.example.test>", "<postmaster@other.test>"]
)
async def test_relay_classics_are_refused_outside_relay_networks(mem: Stores, path: str) -> None:
    """RFC 5321 §3.6.2: a client outside ``relay_networks`` gets no recipient through a
    percent hack, a bang path, a quoted ``@``, a source route or a second ``@`` (554 5.7.1,
    or 501 5.1.3 for what is not a path); only this system's postmaster (§4.5.1), also
    behind a source route, is accepted, as the configured address."""
    settings = frontend_settings(relay_networks=["127.0.0.1/32"], postmaster="pm@mx.jsqueue.test")
    async with running(settings, mem) as server:
        w = await Wire.connect(server.port, source="127.0.0.2")
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        r = await w.cmd(f"RCPT TO:{path}")
        assert (r.code, r.enhanced) in ((554, "5.7.1"), (501, "5.1.3")), r
        await w.expect("RCPT TO:<@other.test:postmaster@mx.jsqueue.test>", 250)
        await w.expect("DATA", 354)
        await w.send(dot_stuff(MESSAGE))
        queued_id(await w.reply())
    [entry] = await entries_of(mem)
    assert [(r.address, r.domain) for r in entry.recipients] == [
        ("pm@mx.jsqueue.test", "mx.jsqueue.test")
    ]


async def test_relay_classics_from_a_relay_client_route_by_the_last_domain(mem: Stores) -> None:
    """RFC 5321 §4.1.1.3, §3.6.2: from a relay network each classic is a mailbox at
    ``dest.example.test`` (route dropped, local part kept as sent): no work item for
    ``other.test`` or ``more.test``."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        reply = await w.transaction(
            "a@example.test", [p[1:-1] for p in RELAY_CLASSICS], dot_stuff(MESSAGE)
        )
        queued_id(reply)
    [entry] = await entries_of(mem)
    assert {r.domain for r in entry.recipients} == {"dest.example.test"}
    assert [r.address for r in entry.recipients] == [
        "u%other.test@dest.example.test",
        "other.test!u@dest.example.test",
        '"u@other.test"@dest.example.test',
        "u@dest.example.test",
    ]


@pytest.mark.parametrize(
    ("mailbox", "code"),
    [
        ("a" * 64 + "@example.test", 250),
        # longer local parts are taken (§4.5.3.1: avoid limits; SRS and VERP exceed 64)
        ("a" * 100 + "@example.test", 250),
        ("a" * 241 + "@example.test", 250),  # 254 octets: the longest path
        ("a" * 242 + "@example.test", 553),
        ("a@" + "b" * 64 + ".test", 553),  # a label over 63 octets (RFC 1035 §2.3.4)
    ],
)
async def test_path_length_limits_with_a_readable_reply(
    mem: Stores, mailbox: str, code: int
) -> None:
    """RFC 5321 §4.5.3.1.3: a path is at most 256 octets with its angle brackets; a longer
    one gets 553 5.1.3, and the reply's own words reach the client whole (printable
    US-ASCII, RFC 5321 §4.2: no character of ours replaced by ``?``)."""
    async with running(frontend_settings(), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        r = await w.cmd(f"MAIL FROM:<{mailbox}>")
        assert r.code == code, r
        assert "?" not in r.text, r
