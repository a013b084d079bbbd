"""The state a front-end session keeps per mail transaction (:class:`Transaction`, RFC
5321 §3.3) and what refuses its DATA (:func:`data_refusal`), the client's address from its
peer name (:func:`client_ip`), the aiosmtpd
handler that turns an unexpected error in a command into a ``451`` (:class:`ExceptionHook`),
and the stream reader that ends the command loop at the client's end of input
(:class:`CommandReader`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable, Collection
from typing import Any, Literal

from aiosmtpd.smtp import Envelope

from jsqueue.envelope import Recipient
from jsqueue.replies import (
    R421_DATA_TOO_SOON,
    R421_TOO_MUCH_JUNK,
    R451_LOCAL_ERROR,
    R501_BAD_PARAMETER,
    R503_NEED_HELO,
    R503_NEED_MAIL,
    R503_NEED_RCPT,
    Reply,
)

log = logging.getLogger("jsqueue.frontend.session")  # the session's name, as before the split


class Transaction(Envelope):
    """One mail transaction (RFC 5321 §3.3): aiosmtpd resets it on RSET/EHLO/STARTTLS."""

    def __init__(self) -> None:
        super().__init__()
        self.reverse_path: str | None = None
        self.recipients: list[Recipient] = []
        self.seen: set[tuple[str, str]] = set()
        self.smtputf8 = False
        self.ret: Literal["FULL", "HDRS"] | None = None
        self.envid: str | None = None


def data_refusal(txn: Transaction, arg: str | None, *, helo: bool) -> Reply | None:
    """The reply that refuses ``DATA`` (its argument ``arg``) in transaction ``txn`` of a
    session that sent EHLO/HELO (``helo``) or not, or None when DATA may go on to 354: no
    EHLO/HELO or no MAIL (``503 5.5.1``, RFC 5321 §4.1.4), no accepted RCPT (``503 5.5.1``;
    §3.3 allows 503 or 554), an argument (``501 5.5.4``, §4.1.1.4). Pure."""
    if not helo:
        return R503_NEED_HELO
    if txn.reverse_path is None:
        return R503_NEED_MAIL
    if not txn.recipients:
        return R503_NEED_RCPT
    if arg:
        return R501_BAD_PARAMETER.model_copy(update={"text": "Syntax: DATA"})
    return None


class ExceptionHook:
    """aiosmtpd handler: turns an unexpected error in a command into a 451 (logged)."""

    async def handle_exception(self, error: Exception) -> str:
        log.error("SMTP command failed unexpectedly", exc_info=error)
        return str(R451_LOCAL_ERROR)


class ErrorCount:
    """The errors a client made since its last accepted message, as Postfix counts them
    for ``smtpd_soft_error_limit`` / ``smtpd_hard_error_limit``: every 4yz/5yz reply sent
    (a refused command, AUTH failure, relay denied, bad syntax ...), except those that are
    no fault of the client (this queue's own trouble, enhanced code ``4.3.x``; a 421,
    which ends the session anyway) and a recipient limit's ``452 4.5.3`` (RFC 5321
    §4.5.3.1.10 asks the client to go on in a further transaction). Pure.

    Args:
        soft: errors answered at once; each further error reply waits ``pause_s`` first
            (a client guessing passwords or addresses slows down); 0: never waits.
        hard: errors a session may make; the next reply after that many ends it with
            ``421 4.7.0`` (:attr:`exceeded`); 0: no limit.
        pause_s: seconds each error reply past ``soft`` waits.
    """

    def __init__(self, soft: int, hard: int, pause_s: float) -> None:
        self.soft, self.hard, self.pause_s = soft, hard, pause_s
        self.count = 0

    def add(self, status: str | bytes) -> float:
        """Count ``status`` (one reply) when it is an error; seconds to wait before it is
        sent (0.0 when none)."""
        text = status if isinstance(status, str) else status.decode("ascii", "replace")
        code, enhanced = text[:3], text[4:10].rstrip()
        if code[:1] not in ("4", "5") or code == "421" or enhanced.startswith("4.3."):
            return 0.0
        if code == "452" and enhanced == "4.5.3":
            return 0.0
        self.count += 1
        return self.pause_s if self.soft and self.count > self.soft else 0.0

    @property
    def exceeded(self) -> bool:
        """The session made ``hard`` errors: it is ended with ``421 4.7.0``."""
        return bool(self.hard) and self.count >= self.hard


#: Commands that move no mail, limited by ``smtp.max_junk_commands`` (:meth:`CommandReader.adopt`).
JUNK = frozenset({"NOOP", "RSET", "VRFY", "EXPN", "HELP", "EHLO", "HELO"})


class CommandReader(asyncio.StreamReader):
    """The session's stream reader: the end of the client's input (it shut down its sending
    side) ends the command loop once the commands received before it are answered, as a
    reset connection does, instead of aiosmtpd's endless ``500`` replies to a read past the
    end; a command line cut off by the end is dropped (never executed). After a refused
    DATA it tells the message of a client that did not wait for the reply from a command
    (:meth:`data_refused`), and the chunk of a BDAT (not offered) is thrown away, never
    read as commands."""

    # Class attributes: aiosmtpd builds a plain StreamReader and the session swaps its class.
    _known_verbs: Collection[str] = ()
    _on_desync: Callable[[Reply], None] | None = None  # set after a refused DATA: check a line
    _junk_limit = 0  # 0: no limit (adopt)
    _junk = 0  # junk commands since the last DATA that went on to the message
    _junk_before_data = 0
    _close: Callable[[Reply], None] | None = None

    @classmethod
    def adopt(
        cls, reader: asyncio.StreamReader, junk_limit: int, close: Callable[[Reply], None]
    ) -> None:
        """Make aiosmtpd's ``reader`` of a session one of this class (it builds its reader
        inline). A session may send ``junk_limit`` commands that move no mail (:data:`JUNK`:
        NOOP, RSET, VRFY, EXPN, HELP, EHLO, HELO) between two messages; the next is
        answered ``421 4.7.0`` by ``close`` and ends the session, as Postfix's
        ``smtpd_junk_command_limit`` does: the idle timeout alone lets a client that
        never sends mail hold a session for ever. 0 is no limit."""
        reader.__class__ = cls
        assert isinstance(reader, CommandReader)
        reader._junk_limit, reader._close = junk_limit, close

    def data_refused(self, commands: Collection[str], close: Callable[[Reply], None]) -> None:
        """DATA was just refused (RFC 5321 §3.3) and its reply sent. A client that sent its
        message without waiting for that reply (RFC 2920 §3.1: DATA ends a group) must not
        have its lines run as commands: input already received is that message, and so is
        a next line that is no command of ``commands`` (a header field such as the trace
        field an MTA in front puts first, an empty line, the final dot). Either way
        ``close`` is called with ``421 4.5.0`` (it answers and closes without yielding),
        the input is thrown away and the command loop ends (ConnectionResetError from
        :meth:`readuntil`). A next line that is a command is read as one.

        Args:
            commands: the verbs the session knows, upper case.
            close: sends a reply and closes the connection, synchronously.
        """
        self._junk = self._junk_before_data + 1  # a refused DATA moved no mail
        if self._buffer:  # type: ignore[attr-defined]  # StreamReader's own buffer
            close(R421_DATA_TOO_SOON)
            self._buffer.clear()  # type: ignore[attr-defined]
        else:
            self._known_verbs, self._on_desync = commands, close

    async def readuntil(self, separator: Any = b"\n") -> bytes:  # typeshed's: private
        """One line, as :meth:`asyncio.StreamReader.readuntil`.

        Raises:
            ConnectionResetError: the input ended before a complete line, the line is
                message text after a refused DATA (:meth:`data_refused`; answered 421), or
                one junk command too many (:meth:`adopt`; answered 421).
            LimitOverrunError: the line is longer than the reader's limit.
        """
        close, self._on_desync = self._on_desync, None
        try:
            line = await super().readuntil(separator)
        except asyncio.IncompleteReadError as e:
            raise ConnectionResetError("the client ended its input") from e
        except asyncio.LimitOverrunError:
            if close is None:
                raise
            line = b""  # a line that long is no command
        verb = line.rstrip(b"\r\n").partition(b" ")[0].upper().decode("ascii", "replace")
        if close is not None and verb not in self._known_verbs:
            close(R421_DATA_TOO_SOON)
            self._buffer.clear()  # type: ignore[attr-defined]
            raise ConnectionResetError("message text after a refused DATA")
        if verb == "DATA":
            self._junk_before_data, self._junk = self._junk, 0
        elif verb in JUNK:
            self._junk += 1
            if self._junk_limit and self._junk > self._junk_limit and self._close is not None:
                self._close(R421_TOO_MUCH_JUNK)
                self._buffer.clear()  # type: ignore[attr-defined]
                raise ConnectionResetError("too many commands without mail")
        if verb == "BDAT":
            await self._skip_chunk(line)
        return line

    async def _skip_chunk(self, line: bytes) -> None:
        """Read and throw away the chunk of a ``BDAT <size> [LAST]`` line (RFC 3030 §2: the
        octets follow at once): CHUNKING is not offered, so the command is answered as
        unknown, and its chunk must not be run as commands. Nothing is skipped when the
        line has no size. The idle timeout bounds a chunk that never ends.

        Raises:
            ConnectionResetError: the input ended inside the chunk.
        """
        words = line.split()
        if len(words) not in (2, 3) or not words[1].isdigit() or len(words[1]) > 20:
            return
        left = int(words[1])
        while left:
            data = await self.read(min(left, 64 * 1024))
            if not data:
                raise ConnectionResetError("the client ended its input inside a BDAT chunk")
            left -= len(data)


#: A client's address.
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def client_ip(peer: Any) -> IPAddress | None:
    """The client's address from a transport's peer name (an IPv4-mapped IPv6 address as
    the IPv4 address, a scope id dropped); None when it has none (a socket pair)."""
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except (TypeError, IndexError, ValueError):
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip
