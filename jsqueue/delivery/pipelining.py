"""The pipelined transaction (RFC 2920): when the server's EHLO offers PIPELINING (and
``worker.pipelining`` is on), MAIL, every RCPT and DATA go out in one write and their
replies are read back in order, so a transaction costs one round trip before the body
instead of one per command.

aiosmtplib reads one reply per command it sent, so the group's replies are read here
(:class:`GroupReader`, on :attr:`~jsqueue.delivery.sync.GuardedProtocol.tap`, parsed by
:class:`~jsqueue.delivery.replyparser.ReplyParser`). They are matched by position only
when the group is exactly right; otherwise nothing is attributed:

* data received before the group went out, a reply beyond the last expected one, or one
  impossible for its command (a ``354`` to MAIL or RCPT, a ``2xx`` to DATA) raises
  :class:`~jsqueue.delivery.sync.Desync`: the connection is dropped and the transaction's
  recipients go to a fresh connection once, then to the next MX (deferred with
  ``4.5.0`` when none is left);
* too few replies (the connection closed, a reply timed out), a malformed reply or a
  ``421`` raise :class:`~jsqueue.delivery.signals.NextMx`: no body was sent, so no
  recipient can have the message; the next MX is tried and every recipient gets the
  failure when none is left;
* when the DATA reply is not ``354`` an RSET follows (RFC 2920 §3.1), and its reply must
  be ``250`` (or ``421``) with nothing after it, in time: a late extra line shows up there
  before any refusal is recorded;
* when DATA got ``354`` although no recipient was accepted, a lone ``.`` is sent instead of
  a body (RFC 2920 §3.1, RFC 5321 §3.3).

Per-recipient outcomes are recorded as in the one-command-at-a-time path of
:mod:`.session` (same :func:`~jsqueue.delivery.responses.to_reply`, recipient limits of RFC
5321 §4.5.3.1.10 carried to a further transaction).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import aiosmtplib
from aiosmtplib import SMTPResponse

from jsqueue.delivery.base import DeliveryResult
from jsqueue.delivery.commands import Plan, command_line
from jsqueue.delivery.connections import abort_connection
from jsqueue.delivery.replyparser import MalformedReply, ReplyParser
from jsqueue.delivery.responses import rcpt_reply, refused, to_reply, with_detail
from jsqueue.delivery.signals import Failed, NextMx
from jsqueue.delivery.sync import Desync, GuardedProtocol, check_sync, impossible_reply
from jsqueue.envelope import Recipient
from jsqueue.replies import (
    R451_PROTOCOL_ERROR,
    R501_BAD_FORWARD_PATH,
    R501_BAD_REVERSE_PATH,
    Reply,
)

if TYPE_CHECKING:
    from jsqueue.delivery.session import OutboundSession

__all__ = ["RSET_TIMEOUT_S", "GroupReader", "pipelined_transaction"]

log = logging.getLogger(__name__)

RSET_TIMEOUT_S = 20.0
"""Longest wait for the reply to the RSET after a refused DATA, seconds (at most
``worker.mail_timeout_s``); Postfix's ``smtp_rset_timeout`` is 20 s as well."""


class GroupReader:
    """Reads the replies of one pipelined group straight from the protocol's data
    (a :class:`~jsqueue.delivery.sync.Tap`): set as ``protocol.tap`` before the group is
    written; takes itself off as soon as ``expected`` replies are complete, a ``421`` came
    (the server closes), a reply is malformed or the connection ended, so that any later
    octet is the protocol's stray data again.

    A reply impossible for its command (:func:`~jsqueue.delivery.sync.impossible_reply`)
    also ends the reading at once: the replies are shifted (one is missing, e.g. the
    ``354`` arrived in an RCPT's place), and waiting for the rest would only end in a
    timeout.

    Args:
        protocol: the connection's protocol.
        rcpts: RCPT commands in the group (after MAIL, before DATA).
    """

    def __init__(self, protocol: GuardedProtocol, rcpts: int) -> None:
        self.protocol = protocol
        self.rcpts = rcpts
        self.expected = rcpts + 2
        self.parser = ReplyParser()
        self.responses: list[SMTPResponse] = []
        self.shifted: str | None = None  # the command a reply impossible for it came to
        self.error: Exception | None = None
        self.done = False
        self._changed = asyncio.Event()

    def attach(self) -> None:
        """Take every octet the server sends from now on."""
        self.protocol.tap = self

    def detach(self) -> None:
        """Hand the connection's data back to the protocol. Idempotent."""
        self.done = True
        if self.protocol.tap is self:
            self.protocol.tap = None
        self._changed.set()

    def feed(self, data: bytes) -> None:
        """Server data: parse what is complete (RFC 5321 §4.2.1)."""
        self.parser.feed(data)
        try:
            while len(self.responses) < self.expected:
                response = self.parser.next_reply()
                if response is None:
                    break
                stage = _stage(len(self.responses), self.rcpts)
                self.responses.append(response)
                if response.code == 421:
                    self.detach()
                    return
                if impossible_reply(stage, response):
                    self.shifted = stage
                    self.detach()
                    return
        except MalformedReply as e:
            self.error = e
            self.detach()
            return
        if len(self.responses) >= self.expected:
            self.detach()
        self._changed.set()

    def lost(self, exc: Exception) -> None:
        """The connection ended before the group was answered."""
        if self.error is None:
            self.error = exc
        self.detach()

    def extra(self) -> bytes:
        """Octets received beyond the replies taken (empty when the group is in sync)."""
        return self.parser.pending()

    async def read(self, timeouts: list[float]) -> list[SMTPResponse]:
        """Wait for the group's replies, each within its command's timeout (seconds, one
        per expected reply: RFC 5321 §4.5.3.2).

        Returns:
            the replies in order: ``expected`` of them, or fewer ending in a ``421`` or in
            a reply impossible for its command (:attr:`shifted` is set then).

        Raises:
            TimeoutError: a reply did not come in time.
            MalformedReply: a reply was malformed.
            aiosmtplib.SMTPServerDisconnected: the connection ended first.
        """
        try:
            while not self.done:
                waiting_for = len(self.responses)
                async with asyncio.timeout(timeouts[min(waiting_for, len(timeouts) - 1)]):
                    while not self.done and len(self.responses) == waiting_for:
                        self._changed.clear()
                        await self._changed.wait()
        finally:
            self.detach()
        if self.error is not None:
            raise self.error
        return self.responses


def _stage(index: int, rcpts: int) -> str:
    """The command whose reply is number ``index`` of a group with ``rcpts`` RCPTs."""
    if index == 0:
        return "MAIL"
    return "RCPT" if index <= rcpts else "DATA"


async def pipelined_transaction(
    session: OutboundSession, plan: Plan, recipients: list[Recipient]
) -> DeliveryResult:
    """One transaction as a pipelined group (RFC 2920 §3.1); see the module docstring for
    how replies are matched. Not idempotent: it may send the message.

    Args:
        session: the connected session (its EHLO offered PIPELINING).
        plan: the commands, from :func:`~jsqueue.delivery.commands.plan_transaction`, with
            at least one RCPT.
        recipients: the transaction's recipients (for those a recipient limit carries).

    Returns:
        one reply per recipient of ``plan``, as the one-command-at-a-time path records them.

    Raises:
        NextMx: the group was not answered in full (connection lost, timeout, malformed
            reply, 421): no body was sent.
        Desync: a reply out of sync with the group (see the module docstring).
    """
    smtp = session.smtp
    assert smtp is not None and plan.mail is not None and plan.body is not None
    protocol = smtp.protocol
    assert isinstance(protocol, GuardedProtocol)
    s = session.settings
    replies = plan.replies
    mail_line = command_line(plan.mail)
    if mail_line is None:
        for a, _ in plan.rcpts:
            replies[a] = with_detail(R501_BAD_REVERSE_PATH, "control character in the path")
        return session._result(replies)
    lines = [mail_line]
    offered: list[str] = []
    for address, args in plan.rcpts:
        line = command_line(args)
        if line is None:
            replies[address] = with_detail(R501_BAD_FORWARD_PATH, "control character in the path")
            continue
        offered.append(address)
        lines.append(line)
    if not offered:
        return session._result(replies)
    lines.append(b"DATA\r\n")
    timeouts = [s.mail_timeout_s] + [s.rcpt_timeout_s] * len(offered) + [s.data_init_timeout_s]

    await check_sync(smtp, "MAIL")  # nothing may be pending before the group goes out
    reader = GroupReader(protocol, len(offered))
    reader.attach()
    where = session.where()
    try:
        protocol.write(b"".join(lines))  # one write: one segment for a small group
        responses = await reader.read(timeouts)
    except MalformedReply as e:
        abort_connection(smtp)
        stage = _stage(len(reader.responses), len(offered))
        raise NextMx(with_detail(R451_PROTOCOL_ERROR, f"{where}: {stage}: {e}")) from e
    except (aiosmtplib.SMTPException, OSError, TimeoutError) as e:
        abort_connection(smtp)
        stage = f"{_stage(len(reader.responses), len(offered))} (pipelined)"
        reply = session._translate(e, stage).reply
        raise NextMx(reply, _refused(session, offered, reader.responses, replies)) from e
    finally:
        reader.detach()
    log.debug("%s: pipelined group of %d commands answered", where, len(lines))
    if responses[-1].code == 421:  # the server is closing: no body went out
        abort_connection(smtp)
        settled = _refused(session, offered, responses[:-1], replies)
        raise NextMx(to_reply(responses[-1], session.host), settled)
    if reader.shifted is not None:
        last = responses[-1]
        raise Desync(reader.shifted, f"{last.code} {last.message}".encode())
    extra = reader.extra() + protocol.unread()
    if extra:
        raise Desync("the end of the pipelined group", extra)

    host = session.host
    mail = to_reply(responses[0], host)
    accepted: list[str] = []
    if not mail.is_success:
        for a in offered:
            replies[a] = mail
    else:
        limited: list[str] = []
        for address, response in zip(offered, responses[1:-1], strict=True):
            # RFC 5321 §4.5.3.1.10: a limit (or any 552) is never a bounce.
            reply, limit = rcpt_reply(to_reply(response, host), host)
            if limit:
                limited.append(address)
            replies[address] = reply
            if reply.is_success:
                accepted.append(address)
        if accepted and limited:
            by_address = {r.address: r for r in recipients}
            session.carry = [by_address[a] for a in limited]

    data = responses[-1]
    if data.code == 354 and accepted:
        return await session._body(plan.body, accepted, replies)
    if data.code == 354:
        # RFC 2920 §3.1: DATA accepted with no recipient: a lone "." and no message data
        # (RFC 5321 §3.3).
        await _barrier(session, "the lone dot", s.data_final_timeout_s, b".")
        return session._result(replies)
    start = to_reply(data, host)
    for a in accepted:
        replies[a] = start
    await _barrier(session, "RSET", min(s.mail_timeout_s, RSET_TIMEOUT_S), b"RSET")
    return session._result(replies)


def _refused(
    session: OutboundSession,
    offered: list[str],
    responses: Sequence[SMTPResponse],
    replies: dict[str, Reply],
) -> dict[str, Reply]:
    """The recipients refused by the RCPT replies read before the group failed (after an
    accepted MAIL; a ``421`` among them is the server closing, not a refusal), with the
    local refusals in ``replies``: those stand (``NextMx.settled``)."""
    got = dict(replies)
    if responses and 200 <= responses[0].code < 300:
        for address, response in zip(offered, responses[1:], strict=False):
            if response.code != 421:
                got[address] = rcpt_reply(to_reply(response, session.host), session.host)[0]
    return refused(got)


async def _barrier(session: OutboundSession, stage: str, timeout_s: float, *args: bytes) -> None:
    """One more command, answered alone, before the group's refusals are recorded: its
    reply must be the one expected (``250`` or ``421`` to RSET) with nothing after it.

    Raises:
        Desync: data out of sync before or after it, an RSET reply that is no RSET's, or
            no reply in ``timeout_s`` seconds.
    """
    try:
        reply = await session._command(stage, timeout_s, *args)
    except Failed as e:
        abort_connection(session.smtp)
        if isinstance(e.__cause__, TimeoutError | aiosmtplib.SMTPTimeoutError):
            # No answer at all: the server may be reading a body after a 354 that came
            # late, i.e. the replies were shifted. Nothing of the group counts.
            raise Desync(stage, b"(no reply: timed out)") from e
        # The connection ended with nothing more sent: the group's replies stand.
        log.debug("%s: %s after the pipelined group failed: %s", session.where(), stage, e)
        return
    if stage == "RSET" and reply.code not in (250, 421):
        raise Desync(stage, f"{reply.code} {reply.text}".encode())
    await check_sync(session.smtp, "the next command")
