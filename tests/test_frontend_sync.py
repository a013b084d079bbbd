"""The SMTP front end against clients that get out of step with it, over real sockets on
loopback: input sent before the reply it depends on (RFC 5321 §4.3.1, RFC 2920 §3.1).

Each test names the RFC section it checks.
"""

from __future__ import annotations

import pytest

from jsqueue.store.base import Stores
from jsqueue.store.memory import open_memory
from support.frontend import Wire, entries_of, frontend_settings, running

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
