"""SMTP replies parsed from a byte stream as it arrives (:class:`ReplyParser`): the one
parser of the delivery client, for the pipelined group, which reads several replies from
one stream (RFC 2920 §3.1), and for every reply read one command at a time
(:class:`~jsqueue.delivery.sync.GuardedProtocol`), so no reply can mean one thing on one
path and something else on the other.

A reply is one or more lines, each the same three-digit code, then ``-`` on every line but
the last and a space (or nothing) on the last (RFC 5321 §4.2, §4.2.1); lines end in CRLF (a
bare LF is taken too). Anything else is malformed (:class:`MalformedReply`, a protocol
error). A reply may arrive in any number of pieces, and one piece may hold several replies.

A line over :data:`MAX_LINE_OCTETS` (RFC 5321 §4.5.3.1.5 says 512; servers exceed it) keeps
its code and the start of its text, marked with :data:`CUT_MARK`; the rest of the line is
dropped as it arrives. Lines beyond :data:`MAX_REPLY_OCTETS` of text are dropped the same
way, with a last line saying how many. The code is clear from the first octets, so a long
``550`` stays a ``550`` (as Postfix keeps it), and memory stays bounded. Pure: no I/O.
"""

from __future__ import annotations

from aiosmtplib import SMTPResponse

__all__ = ["CUT_MARK", "MAX_LINE_OCTETS", "MAX_REPLY_OCTETS", "MalformedReply", "ReplyParser"]

MAX_LINE_OCTETS = 8192
"""Longest reply line kept whole, octets (CRLF included); RFC 5321 §4.5.3.1.5 says 512. A
longer line is cut: its first octets are kept (code, enhanced code, start of the text)."""

MAX_REPLY_OCTETS = 4 * MAX_LINE_OCTETS
"""Most text kept of one reply (every line of a multi-line reply), octets; further lines
are dropped."""

CUT_MARK = b" [...]"
"""Appended to the text of a line that was cut at :data:`MAX_LINE_OCTETS`."""

_KEEP = MAX_LINE_OCTETS - 1  # octets of a line before its LF (a CR included)


class MalformedReply(ValueError):
    """The server sent something that is no SMTP reply (no three-digit code followed by SP,
    ``-`` or the end of the line, or a code that changes within a multi-line reply: RFC 5321
    §4.2). A signal inside the package: a protocol error, the session is dropped."""


class ReplyParser:
    """Complete replies out of the octets fed so far, in order.

    ``feed`` the data as it arrives, then take replies with :meth:`next_reply` until it
    returns None (the rest is an incomplete reply, kept for the next ``feed``). Every reply
    is given back as aiosmtplib's :class:`~aiosmtplib.SMTPResponse` with the lines' texts
    joined by ``\\n``, as aiosmtplib gives it, so that every caller records the same
    :class:`~jsqueue.replies.Reply`.

    The reply in progress is parsed as it arrives (an overlong line is cut at once); octets
    after a complete reply that was not taken yet are held unparsed until it is, so take
    the replies after every ``feed`` (both callers do) to keep memory bounded.
    """

    def __init__(self) -> None:
        self._unparsed = bytearray()  # from _at: octets after a complete reply not taken yet
        self._at = 0
        self._raw = bytearray()  # the start of the reply in progress, as received
        self._line = bytearray()  # the line in progress (at most _KEEP octets)
        self._cut = False  # the line in progress is over the bound: the rest is dropped
        self._code: int | None = None  # the code of the reply in progress
        self._texts: list[bytes] = []
        self._kept = 0  # octets of text in _texts
        self._dropped = 0  # lines dropped over MAX_REPLY_OCTETS
        self._ready: SMTPResponse | None = None
        self._error: MalformedReply | None = None

    def feed(self, data: bytes) -> None:
        """Append received octets."""
        if self._ready is not None or self._error is not None:
            self._unparsed += data
        else:
            self._parse(bytes(data))

    def pending(self) -> bytes:
        """Octets received and not part of a reply taken so far (of the reply in progress,
        its first :data:`MAX_LINE_OCTETS` octets as received); empty when there are none."""
        return bytes(self._raw) + bytes(self._unparsed[self._at :])

    def next_reply(self) -> SMTPResponse | None:
        """The next complete reply, removed from the buffer; None while it is incomplete.

        Raises:
            MalformedReply: the next reply is malformed (see the class); it is not removed.
        """
        if self._error is not None:
            raise self._error
        reply = self._ready
        if reply is not None:
            self._ready = None
            self._raw.clear()
            rest, at = self._unparsed, self._at
            self._unparsed, self._at = bytearray(), 0
            self._parse(rest, at)
        return reply

    # -- parsing -------------------------------------------------------------------------

    def _parse(self, data: bytes | bytearray, start: int = 0) -> None:
        """Take ``data[start:]`` into the reply in progress, up to the end of that reply
        (the rest stays unparsed; a bytearray is kept as it is, not copied) or a malformed
        line."""
        while start < len(data):
            end = data.find(b"\n", start)
            stop = len(data) if end < 0 else end + 1
            room = MAX_LINE_OCTETS - len(self._raw)
            if room > 0:
                self._raw += data[start : min(stop, start + room)]
            if not self._cut:  # (the rest of a cut line is not even copied)
                self._take(data[start : stop if end < 0 else end])
            start = stop
            if end >= 0:
                self._end_line()
            if self._error is not None or self._ready is not None:
                if isinstance(data, bytearray):
                    self._unparsed, self._at = data, start
                else:
                    self._unparsed, self._at = bytearray(data[start:]), 0
                return

    def _take(self, part: bytes | bytearray) -> None:
        """Octets of the line in progress (before its LF); past ``_KEEP`` the line is cut
        and the rest of it dropped."""
        room = _KEEP - len(self._line)
        if len(part) <= room:
            self._line += part
            return
        self._line += part[:room]
        self._cut = True
        try:  # the code is clear from the first octets: a line that is no reply fails now
            self._check(bytes(self._line))
        except MalformedReply as e:
            self._error = e

    def _end_line(self) -> None:
        line, cut = bytes(self._line), self._cut
        self._line.clear()
        self._cut = False
        if self._error is not None:
            return
        body = line.rstrip(b"\r")
        try:
            code, last = self._check(body)
        except MalformedReply as e:
            self._error = e
            return
        self._code = code
        text = body[4:].strip(b" \t") + (CUT_MARK if cut else b"")
        if self._dropped or self._kept + len(text) > MAX_REPLY_OCTETS:
            self._dropped += 1
        else:
            self._texts.append(text)
            self._kept += len(text) + 1
        if last:
            if self._dropped:
                self._texts.append(b"[%d more line(s) dropped]" % self._dropped)
            message = b"\n".join(self._texts).decode("utf-8", "surrogateescape")
            self._ready = SMTPResponse(code, message)
            self._code, self._texts, self._kept, self._dropped = None, [], 0, 0

    def _check(self, body: bytes) -> tuple[int, bool]:
        """The code of a reply line and whether it is the reply's last line (RFC 5321 §4.2:
        three digits, then SP, ``-`` or the end of the line; the same code on every line).

        Raises:
            MalformedReply: the line is not a reply line of the reply in progress.
        """
        digits, separator = body[:3], body[3:4]
        if len(digits) != 3 or not digits.isdigit() or separator not in (b"", b" ", b"-"):
            raise MalformedReply(f"not an SMTP reply line: {body[:80]!r}")
        if self._code is not None and int(digits) != self._code:
            raise MalformedReply(f"reply code changed within a reply: {body[:80]!r}")
        return int(digits), separator != b"-"
