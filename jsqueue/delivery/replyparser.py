"""SMTP replies parsed from a byte stream as it arrives (:class:`ReplyParser`), for the
pipelined group, which reads several replies from one stream (RFC 2920 §3.1). A reply is one
or more lines, each the same three-digit code, then ``-`` on every line but the last and a
space (or nothing) on the last (RFC 5321 §4.2, §4.2.1); lines end in CRLF (a bare LF is taken
too). A reply may arrive in any number of pieces, and one piece may hold several replies.
Pure: no I/O.
"""

from __future__ import annotations

from aiosmtplib import SMTPResponse

__all__ = ["MAX_LINE_OCTETS", "MAX_REPLY_OCTETS", "MalformedReply", "ReplyParser"]

MAX_LINE_OCTETS = 8192
"""Longest reply line taken, octets (CRLF included); RFC 5321 §4.5.3.1.5 says 512."""

MAX_REPLY_OCTETS = 4 * MAX_LINE_OCTETS
"""Longest reply taken (every line of a multi-line reply), octets."""


class MalformedReply(ValueError):
    """The server sent something that is no SMTP reply (no three-digit code, a code that
    changes within a multi-line reply, a line or reply over the bounds). A signal inside
    the package: the session is dropped."""


class ReplyParser:
    """Complete replies out of the octets fed so far, in order.

    ``feed`` the data as it arrives, then take replies with :meth:`next_reply` until it
    returns None (the rest is an incomplete reply, kept for the next ``feed``). Every reply
    is given back as aiosmtplib's :class:`~aiosmtplib.SMTPResponse` with the lines' texts
    joined by ``\\n``, as aiosmtplib gives it to the one-command-at-a-time path, so both
    paths record the same :class:`~jsqueue.replies.Reply`.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        """Append received octets."""
        self._buffer += data

    def pending(self) -> bytes:
        """Octets received and not part of a reply taken so far."""
        return bytes(self._buffer)

    def next_reply(self) -> SMTPResponse | None:
        """The next complete reply, removed from the buffer; None while it is incomplete.

        Raises:
            MalformedReply: the next reply is malformed (see the class); it is not removed.
        """
        code: int | None = None
        texts: list[bytes] = []
        offset = 0
        while True:
            end = self._buffer.find(b"\n", offset)
            if end < 0:
                if len(self._buffer) - offset > MAX_LINE_OCTETS:
                    raise MalformedReply("reply line too long")
                if len(self._buffer) > MAX_REPLY_OCTETS:
                    raise MalformedReply("reply too long")
                return None
            line = bytes(self._buffer[offset : end + 1])
            offset = end + 1
            if len(line) > MAX_LINE_OCTETS:
                raise MalformedReply("reply line too long")
            if offset > MAX_REPLY_OCTETS:
                raise MalformedReply("reply too long")
            body = line.rstrip(b"\r\n")
            digits, separator = body[:3], body[3:4]
            if len(digits) != 3 or not digits.isdigit() or separator not in (b"", b" ", b"-"):
                raise MalformedReply(f"not an SMTP reply line: {body[:80]!r}")
            if code is not None and int(digits) != code:
                raise MalformedReply(f"reply code changed within a reply: {body[:80]!r}")
            code = int(digits)
            texts.append(body[4:].strip(b" \t"))
            if separator != b"-":
                del self._buffer[:offset]
                text = b"\n".join(texts).decode("utf-8", "surrogateescape")
                return SMTPResponse(code, text)
