"""Reply synchronisation of an outbound SMTP connection (RFC 5321 §4.2, §4.1.1: one reply
per command, in order). Without pipelining every reply must be complete, with nothing after
it, before the next command goes out. A server that sends two replies to one command, or a
line nobody asked for (after the greeting, after EHLO, while a cached session is idle),
would otherwise have its extra line paired with the next command: one recipient's 550
recorded for another, delivered mail bounced.

:class:`GuardedSMTP` is aiosmtplib's client with :class:`GuardedProtocol`, which keeps what
aiosmtplib would drop or leave for the next command: lines received while no reply was
awaited, and lines after a complete reply in the same read. :func:`check_sync` raises
:class:`Desync` when there are any; the session then drops the connection and retries on a
fresh one what no reply in sync confirmed. So does a reply impossible for its command
(:func:`impossible_reply`: a ``1xx`` to RCPT, a ``250`` to DATA), on both paths.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

import aiosmtplib
from aiosmtplib import SMTPResponse, SMTPStatus
from aiosmtplib.protocol import SMTPProtocol

from jsqueue.delivery.replyparser import MalformedReply, ReplyParser
from jsqueue.replies import Reply

__all__ = [
    "STRAY_KEEP_OCTETS",
    "Desync",
    "GuardedProtocol",
    "GuardedSMTP",
    "Tap",
    "check_sync",
    "impossible_reply",
]

STRAY_KEEP_OCTETS = 512
"""Octets of unexpected server data kept for the log line."""


class Desync(Exception):
    """Server data arrived that no outstanding command asked for: the replies of this
    connection may be shifted against the commands. A signal inside the package.

    Attributes:
        stage: the command that was about to be sent (or the step checked), e.g. ``"RCPT"``.
        data: the start of the unexpected data (at most :data:`STRAY_KEEP_OCTETS`).
        replies: replies that stand regardless (the uncertain outcome of a final ``.``).
    """

    def __init__(self, stage: str, data: bytes, replies: dict[str, Reply] | None = None) -> None:
        super().__init__(f"desynchronised reply before {stage}: {data!r}")
        self.stage = stage
        self.data = data
        self.replies = replies or {}


class Tap(Protocol):
    """A reader that takes every octet the server sends while it is set as
    :attr:`GuardedProtocol.tap` (the pipelined group of :mod:`.pipelining`)."""

    def feed(self, data: bytes) -> None:
        """Server data, as received."""

    def lost(self, exc: Exception) -> None:
        """The connection ended (EOF or lost)."""


class GuardedProtocol(SMTPProtocol):
    """aiosmtplib's protocol, also keeping data received while no reply is awaited (which
    aiosmtplib drops) so that :func:`check_sync` can see it, and reading replies with
    :class:`~jsqueue.delivery.replyparser.ReplyParser`, the pipelined group's parser,
    instead of aiosmtplib's: a reply whose lines disagree on the code, or whose code is not
    followed by SP, ``-`` or the end of the line, is a protocol error on both paths (RFC
    5321 §4.2, §4.2.1; aiosmtplib takes the last line's code and any three digits), and an
    overlong line keeps its code (RFC 5321 §4.5.3.1.5). A malformed reply fails the read
    with ``SMTPResponseException(-1, …)``, aiosmtplib's code for an unparsable reply.

    What follows a complete reply stays in aiosmtplib's ``_buffer``, as aiosmtplib leaves
    it (its STARTTLS discards it there, RFC 3207 §4.2). Reads aiosmtplib's private
    ``_buffer``, ``_response_waiter``, ``_response_pending`` and
    ``_set_response_exception`` (checked by a test). While :attr:`tap` is set, every octet
    goes to it instead (aiosmtplib reads nothing). A reply in progress when a read times
    out is never completed by data meant for a later command: aiosmtplib closes the
    connection on a read timeout, and the final dot's read aborts it (checked by a test)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        connection_lost_callback: Callable[[SMTPProtocol], None] | None = None,
    ) -> None:
        super().__init__(loop=loop, connection_lost_callback=connection_lost_callback)
        self.stray = bytearray()
        self.tap: Tap | None = None
        self._parser = ReplyParser()  # the reply being read

    def eof_received(self) -> bool:
        if self.tap is not None:
            self.tap.lost(aiosmtplib.SMTPServerDisconnected("Unexpected EOF received"))
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.tap is not None:
            self.tap.lost(aiosmtplib.SMTPServerDisconnected(f"Connection lost: {exc}"))
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.tap is not None:  # a pipelined group reads its own replies
            self.tap.feed(data)
            return
        waiter = self._response_waiter
        if waiter is None:  # the connection is gone (aiosmtplib drops the data too)
            return
        if not self._response_pending or waiter.done():
            room = STRAY_KEEP_OCTETS - len(self.stray)
            self.stray += data[: max(room, 1)]
            return
        parser = self._parser
        if self._buffer:  # left after the previous reply: read first, as aiosmtplib does
            parser.feed(bytes(self._buffer))
            del self._buffer[:]
        parser.feed(data)
        try:
            response = parser.next_reply()
        except MalformedReply as e:
            error = aiosmtplib.SMTPResponseException(SMTPStatus.invalid_response.value, str(e))
            self._set_response_exception(waiter, error)
        else:
            if response is None:
                return
            waiter.set_result(response)
        self._buffer += parser.pending()
        self._parser = ReplyParser()

    def unread(self) -> bytes:
        """Data received and not part of any reply read so far (empty when in sync)."""
        return bytes(self._buffer[:STRAY_KEEP_OCTETS]) + bytes(self.stray)


#: Longest wait for the reply to the QUIT sent after a refused greeting, seconds.
REFUSAL_QUIT_S = 5.0


class GuardedSMTP(aiosmtplib.SMTP):
    """aiosmtplib's client over a connected socket (``sock=``), with a
    :class:`GuardedProtocol`; otherwise as aiosmtplib's ``_create_connection``, except
    that a greeting other than 220 is answered with QUIT before the connection is closed
    (RFC 5321 §3.1: a server that greets with 554 waits for the client's QUIT; its reply
    is read for up to :data:`REFUSAL_QUIT_S`, best effort)."""

    async def _create_connection(self, timeout: float | None) -> SMTPResponse:  # noqa: ASYNC109 (aiosmtplib's signature)
        loop = self.loop
        if loop is None or self.sock is None:
            raise aiosmtplib.SMTPConnectError("GuardedSMTP needs a connected socket")
        protocol = GuardedProtocol(loop=loop, connection_lost_callback=self._on_connection_lost)
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: protocol, sock=self.sock), timeout=timeout
            )
        except TimeoutError as exc:
            raise aiosmtplib.SMTPConnectTimeoutError("Timed out connecting") from exc
        except OSError as exc:
            raise aiosmtplib.SMTPConnectError(f"Error connecting: {exc}") from exc
        self.protocol = protocol
        self.transport = transport
        try:
            response = await protocol.read_response(timeout=timeout)
        except aiosmtplib.SMTPServerDisconnected as exc:
            raise aiosmtplib.SMTPConnectError(f"Error connecting: {exc}") from exc
        except aiosmtplib.SMTPTimeoutError as exc:
            raise aiosmtplib.SMTPConnectTimeoutError(
                "Timed out waiting for server ready message"
            ) from exc
        if response.code != 220:
            with contextlib.suppress(aiosmtplib.SMTPException, OSError, TimeoutError):
                protocol.write(b"QUIT\r\n")
                await protocol.read_response(timeout=min(timeout or REFUSAL_QUIT_S, REFUSAL_QUIT_S))
            raise aiosmtplib.SMTPConnectResponseError(response.code, response.message)
        return response


async def check_sync(smtp: aiosmtplib.SMTP | None, stage: str) -> None:
    """Before sending ``stage``: let data already received be read (one loop iteration),
    then require that nothing arrived beyond the replies read (RFC 5321 §4.2).

    Raises:
        Desync: unexpected server data is pending.
    """
    await asyncio.sleep(0)
    protocol = smtp.protocol if smtp is not None else None
    if isinstance(protocol, GuardedProtocol):
        data = protocol.unread()
        if data:
            raise Desync(stage, data)


def impossible_reply(stage: str, response: SMTPResponse) -> bool:
    """Whether ``response`` is a reply no server sends to ``stage`` (``"MAIL"``, ``"RCPT"``
    or ``"DATA"``; RFC 5321 §4.3.2: MAIL and RCPT get 2xx, 4xx or 5xx, DATA gets 354, 4xx
    or 5xx): only a reply meant for another command, so the replies of the connection are
    shifted. Both paths treat it as :class:`Desync`, the pipelined group (RFC 2920 §3.1) and
    one command at a time. Pure."""
    code = response.code
    if stage == "DATA":
        return not (code == 354 or 400 <= code < 600)
    return not 200 <= code < 600 or 300 <= code < 400
