"""Incremental decoder for the SMTP DATA stream: pure byte handling, no I/O; it finds the
end of data only at ``<CRLF>.<CRLF>`` (RFC 5321 §4.1.1.4), unstuffs dots (§4.5.2), rejects or
normalises bare CR/LF (§2.3.8), and rejects lines over 998 octets (§4.5.3.1.6) or messages over
the SIZE limit (RFC 1870), and messages with more ``Received:`` fields than a loop-free
path has (RFC 5321 §6.3), with one reply after the terminator, handing back the pipelined
commands that follow it (RFC 2920 §3.1); the rules in full: docs/architecture.md, "DATA
decoding".
"""

from __future__ import annotations

import re

from jsqueue.config import BareLinePolicy
from jsqueue.replies import (
    R500_DATA_LINE_TOO_LONG,
    R550_BARE_LINE_ENDING,
    R552_TOO_BIG,
    R554_TOO_MANY_HOPS,
    Reply,
)

#: RFC 5321 §4.5.3.1.6 / RFC 5322 §2.1.1: longest text line, CRLF excluded.
MAX_LINE_OCTETS = 998
_TERMINATOR = b"\r\n.\r\n"
_BREAK_RE = re.compile(rb"\r\n|\r|\n")


class DataDecoder:
    """Decode one message's DATA bytes as they arrive.

    Attributes:
        error: the rejection reply once the message is rejected (None while acceptable).
        size: decoded octets so far (CRLF line ends, dots unstuffed).
        eight_bit: some decoded octet is outside US-ASCII.
        bare_line_endings: a bare CR or LF was seen (rejected or normalised per policy).
        done: the terminator has been seen.
        received: ``Received:`` header fields counted so far (RFC 5321 §6.3).
    """

    def __init__(
        self,
        *,
        max_size: int,
        bare_line_endings: BareLinePolicy = BareLinePolicy.REJECT,
        max_line: int = MAX_LINE_OCTETS,
        max_received: int | None = None,
    ) -> None:
        """Args:
        max_size: largest acceptable message in decoded octets (RFC 1870 SIZE).
        bare_line_endings: reject, or normalise bare CR/LF to CRLF (RFC 5321 §2.3.8).
        max_line: longest acceptable line in octets, CRLF excluded.
        max_received: most ``Received:`` header fields accepted; one more is a mail loop
            (554 5.4.6, RFC 5321 §6.3, RFC 3463 X.4.6); None = not counted.
        """
        self._max_received = max_received
        self._in_header = max_received is not None  # counting until the header ends
        self.received = 0
        self._max_size = max_size
        self._accept_bare = bare_line_endings == BareLinePolicy.ACCEPT
        self._max_line = max_line
        self._carry = b""  # the partial line after the last complete line break
        self._crlf_before = True  # the carry starts after CRLF (or at the start of data)
        self._tail: bytes | None = None  # last 4 bytes seen, once discarding
        self.error: Reply | None = None
        self.size = 0
        self.eight_bit = False
        self.bare_line_endings = False
        self.done = False

    def feed(self, data: bytes) -> tuple[bytes, bytes | None]:
        """Take the next bytes received after the 354 reply.

        Args:
            data: any number of octets, split anywhere.

        Returns:
            ``(content, rest)``: ``content`` is newly decoded message octets (always empty once
            :attr:`error` is set); ``rest`` is None until the terminator has been seen, then
            the octets that followed it, which belong to the command stream.

        Raises:
            RuntimeError: called again after the terminator.
        """
        if self.done:
            raise RuntimeError("DATA already terminated")
        if self._tail is not None:
            return b"", self._scan_discarding(data)
        buf = self._carry + data if self._carry else data
        if self._crlf_before and buf.startswith(b".\r\n"):
            end, rest_at = 0, 3
        else:
            i = buf.find(_TERMINATOR)
            end, rest_at = (i + 2, i + 5) if i >= 0 else (-1, -1)
        if end >= 0:
            self.done = True
            self._carry = b""
            return self._decode(buf[:end]), buf[rest_at:]
        cut = _last_break(buf)
        region, self._carry = buf[:cut], buf[cut:]
        out = self._decode(region)
        if self.error is None and self._carry_too_long():
            self._fail(R500_DATA_LINE_TOO_LONG)
        if self.error is not None:
            out = b""
            self._tail = buf[-4:]
            self._carry = b""
        return out, None

    def _scan_discarding(self, data: bytes) -> bytes | None:
        assert self._tail is not None
        window = self._tail + data
        i = window.find(_TERMINATOR)
        if i >= 0:
            self.done = True
            return window[i + 5 :]
        self._tail = window[-4:]
        return None

    def _carry_too_long(self) -> bool:
        n = len(self._carry)
        if n <= self._max_line:
            return False
        n -= self._carry.endswith(b"\r") + self._carry.startswith(b".")
        return n > self._max_line

    def _fail(self, reply: Reply) -> None:
        if self.error is None:
            self.error = reply

    def _decode(self, region: bytes) -> bytes:
        """Decode complete lines (``region`` starts at a line start, ends with a break)."""
        if not region or self.error is not None:
            return b""
        # One pass each, no per-line objects beyond ``lines``: region ends with a complete
        # line break, so ``lines`` has one piece per break (CRLF, bare CR or bare LF), and
        # there is no bare one exactly when CRs, LFs and breaks are equally many.
        lines = region.splitlines()
        lf = region.count(b"\n")
        bare = region.count(b"\r") != lf or len(lines) != lf
        if bare:
            self.bare_line_endings = True
            if not self._accept_bare:
                self._fail(R550_BARE_LINE_ENDING)
                return b""
            lines = _BREAK_RE.split(region)
            lines.pop()  # region ends with a line break: the last piece is empty
            out = b"\r\n".join(ln[1:] if ln[:1] == b"." and len(ln) > 1 else ln for ln in lines)
            out += b"\r\n"
        else:
            out = region
            if out[:1] == b"." and not out.startswith(b".\r\n"):
                out = out[1:]
            out = out.replace(b"\r\n.", b"\r\n")
        self._crlf_before = region.endswith(b"\r\n")
        # A raw line within the limit is within it unstuffed too; only a long raw line (rare)
        # needs the exact check on the unstuffed octets.
        if (
            len(out) > self._max_line
            and max(map(len, lines)) > self._max_line
            and max(map(len, out.split(b"\r\n"))) > self._max_line
        ):
            self._fail(R500_DATA_LINE_TOO_LONG)
            return b""
        if self._in_header:
            self._count_received(out)
            if self.error is not None:
                return b""
        self.size += len(out)
        if self.size > self._max_size:
            self._fail(R552_TOO_BIG)
            return b""
        if not self.eight_bit and not out.isascii():
            self.eight_bit = True
        return out

    def _count_received(self, out: bytes) -> None:
        """Count the ``Received:`` fields among the header lines of ``out`` (complete,
        decoded lines) until the empty line that ends the header (RFC 5322 §2.1)."""
        assert self._max_received is not None
        for line in out.split(b"\r\n")[:-1]:
            if not line:
                self._in_header = False
                return
            if is_received_field(line):
                self.received += 1
                if self.received > self._max_received:
                    self._in_header = False
                    self._fail(R554_TOO_MANY_HOPS)
                    return


def is_received_field(line: bytes) -> bool:
    """Whether a header line starts a ``Received:`` field: the name in any case, then
    optional white space before the colon (RFC 5322 §4.5). Pure."""
    return line[:8].lower() == b"received" and line[8:].lstrip(b" \t")[:1] == b":"


def received_count(message: bytes) -> int:
    """The ``Received:`` fields in the header of ``message`` (CRLF lines, up to the empty
    line that ends the header; RFC 5321 §6.3 counts them to find mail loops). Pure."""
    end = message.find(b"\r\n\r\n")  # the header only: no copy of the body
    head = message if end < 0 else message[:end]
    return sum(is_received_field(line) for line in head.split(b"\r\n"))


def _last_break(buf: bytes) -> int:
    """Index just after the last complete line break in ``buf`` (0 if none).

    A trailing CR is not complete: its LF may be in the next read. A CR before it is (it
    is followed by something other than LF: a bare CR, RFC 5321 §2.3.8), so a run of
    bare-CR lines is never carried as one long line.
    """
    end = len(buf) - 1 if buf.endswith(b"\r") else len(buf)
    return max(buf.rfind(b"\n", 0, end), buf.rfind(b"\r", 0, end)) + 1
