"""Pure byte transformations the SMTP client applies to a message on its way out: streaming
dot-stuffing and line-ending canonicalisation (:class:`DotStuffer`, RFC 5321 §4.5.2,
§2.3.8) and 8-bit to 7-bit MIME for a next hop without 8BITMIME (:func:`to_7bit`, RFC 6152
§3, which invalidates DKIM body signatures); no I/O. Details in ``docs/architecture.md``
(Delivery, message transformations).
"""

from __future__ import annotations

import base64
import email.policy
import quopri
import re
from email.message import Message
from email.parser import BytesParser

__all__ = ["ConversionError", "DotStuffer", "has_8bit_headers", "to_7bit"]

_BARE_EOL = re.compile(rb"\r\n|\r|\n")
_HIGH = re.compile(rb"[\x80-\xff]")
_MAX_LINE = 998  # RFC 5322 §2.1.1, octets without CRLF
# Headers are written back as they came (refold_source="none"); only lines we add are folded.
_POLICY = email.policy.SMTP.clone(refold_source="none", max_line_length=78)
# RFC 6532 §3.5, RFC 6533 §6: unlike message/rfc822 (RFC 2046 §5.2.1), these message types
# may take a base64 or quoted-printable Content-Transfer-Encoding, so their content (UTF-8
# headers included) can be made 7-bit whole.
_ENCODABLE_MESSAGES = frozenset(
    {
        "message/global",
        "message/global-headers",
        "message/global-delivery-status",
        "message/global-disposition-notification",
    }
)


class ConversionError(ValueError):
    """The message cannot be made 7-bit (8-bit octets in a header, a preamble or epilogue).

    The client answers it with ``554 5.6.3``; it never leaves :mod:`jsqueue.delivery`.
    """


class DotStuffer:
    """Turns raw message chunks into the DATA byte stream (RFC 5321 §4.5.2, §2.3.8).

    Every line that starts with ``.`` gets one more ``.``; bare CR and bare LF become CRLF
    (a canonical CRLF message passes unchanged apart from the stuffing). State is kept
    across chunks, so ``\\r`` | ``\\n.`` split over two chunks is stuffed correctly.
    :meth:`finish` returns the end-of-data sequence: a CRLF if the message did not end with
    one, then ``.\\r\\n``. Call it only after the last chunk was read without error; a
    transaction whose body failed must end without it, so nothing is delivered.
    """

    def __init__(self) -> None:
        self._at_line_start = True
        self._pending_cr = False

    def feed(self, chunk: bytes) -> bytes:
        """Stuff one chunk; returns the bytes to send now (may be empty)."""
        if self._pending_cr:
            chunk = b"\r" + chunk
            self._pending_cr = False
        if chunk.endswith(b"\r"):
            # Might be the first half of a CRLF split across chunks: decide with the next one.
            chunk = chunk[:-1]
            self._pending_cr = True
        if not chunk:
            return b""
        # Line breaks (CRLF, bare CR, bare LF) are one piece each of splitlines(), less the
        # unterminated last piece: none is bare exactly when CRs, LFs and breaks are equally
        # many. Three fast passes instead of counting CRLF pairs (a slow two-octet search).
        lf = chunk.count(b"\n")
        breaks = len(chunk.splitlines()) - (not chunk.endswith((b"\n", b"\r")))
        if chunk.count(b"\r") != lf or breaks != lf:
            chunk = _BARE_EOL.sub(b"\r\n", chunk)
        if self._at_line_start and chunk.startswith(b"."):
            chunk = b"." + chunk
        chunk = chunk.replace(b"\r\n.", b"\r\n..")
        self._at_line_start = chunk.endswith(b"\r\n")
        return chunk

    def finish(self) -> bytes:
        """The final bytes: the held-back CR (as CRLF), a CRLF if needed, and ``.\\r\\n``."""
        tail = b""
        if self._pending_cr:
            self._pending_cr = False
            tail = b"\r\n"
            self._at_line_start = True
        if not self._at_line_start:
            tail += b"\r\n"
        self._at_line_start = True
        return tail + b".\r\n"


def has_8bit_headers(header_section: bytes) -> bool:
    """True when the header section (bytes up to the first empty line) has an octet >= 0x80.

    Such a message needs SMTPUTF8 at the next hop (RFC 6532 §3, RFC 6531 §3.5).
    """
    return _HIGH.search(header_section) is not None


def header_end(data: bytes) -> int:
    """Offset just past the empty line that ends the header section; len(data) if none."""
    if data.startswith(b"\r\n"):
        return 2
    idx = data.find(b"\r\n\r\n")
    return len(data) if idx < 0 else idx + 4


def _needs_encoding(raw: bytes) -> bool:
    if _HIGH.search(raw):
        return True
    return any(len(line) > _MAX_LINE for line in raw.split(b"\r\n"))


def _leaf_needs_encoding(part: Message, cte: str) -> bool:
    if cte in ("quoted-printable", "base64"):
        raw = part.get_payload()
        if not isinstance(raw, str):
            return False
        return not raw.isascii() or any(len(line) > _MAX_LINE for line in raw.splitlines())
    # 7bit / 8bit / binary / unknown: the decoded payload is the raw octets.
    data = part.get_payload(decode=True)
    return isinstance(data, bytes) and _needs_encoding(data)


def _set_cte(part: Message, value: str) -> None:
    if "Content-Transfer-Encoding" in part:
        part.replace_header("Content-Transfer-Encoding", value)
    else:
        part["Content-Transfer-Encoding"] = value


def _declare_mime(msg: Message) -> None:
    """Label a (top-level or enclosed) message without ``MIME-Version`` as MIME, so that
    the Content-Transfer-Encoding a conversion adds is read (RFC 2045 §4); lacking a
    ``Content-Type`` it is ``text/plain; charset=unknown-8bit`` (RFC 1428)."""
    if "MIME-Version" not in msg:
        msg["MIME-Version"] = "1.0"
        if "Content-Type" not in msg:
            msg["Content-Type"] = "text/plain; charset=unknown-8bit"


def _encode_message(part: Message) -> bool:
    """Base64-encode a message/global (or other RFC 6533 ``message/global-*``) part whose
    content is not 7-bit, as RFC 6532 §3.5 allows; True when it was encoded. The content is
    written back as parsed (headers unfolded as they came), so it decodes to the original
    octets with CRLF line ends."""
    payload = part.get_payload()
    if isinstance(payload, list):
        raw = b"".join(m.as_bytes(policy=_POLICY) for m in payload if isinstance(m, Message))
    elif isinstance(payload, str):
        raw = payload.encode("ascii", "surrogateescape")
    else:  # pragma: no cover - the parser gives a list or a str
        return False
    if not _needs_encoding(raw):
        return False
    encoded = base64.b64encode(raw).decode("ascii")
    _set_cte(part, "base64")
    # A message payload is written out as it is, so its line ends must be CRLF already.
    part.set_payload("".join(encoded[i : i + 76] + "\r\n" for i in range(0, len(encoded), 76)))
    return True


def _encode_leaf(part: Message) -> None:
    data = part.get_payload(decode=True)
    if not isinstance(data, bytes):
        raise ConversionError("part payload could not be decoded")
    if part.get_content_maintype() == "text":
        # Line breaks of text are CRLF on the wire and hard line breaks in QP (RFC 2045 §6.7).
        text = data.replace(b"\r\n", b"\n")
        encoded = quopri.encodestring(text, quotetabs=False)
        _set_cte(part, "quoted-printable")
    else:
        encoded = base64.encodebytes(data)
        _set_cte(part, "base64")
    part.set_payload(encoded.decode("ascii"))


def to_7bit(message: bytes) -> bytes:
    """Re-encode an 8-bit MIME message as 7-bit MIME (RFC 6152 §3, RFC 2045 §6).

    Leaf parts with octets >= 0x80 or lines longer than 998 octets are re-encoded
    (``text/*`` quoted-printable, others base64); a ``message/global`` part (or another
    RFC 6533 ``message/global-*`` part) that holds such octets, UTF-8 headers included, is
    base64-encoded whole (RFC 6532 §3.5 allows it, unlike RFC 2046 §5.2.1 for
    ``message/rfc822``), which is how a DSN returning an internationalised message reaches
    a next hop without 8BITMIME; other multipart and ``message/*`` containers declared
    ``8bit``/``binary`` are relabelled ``7bit``. A message without ``MIME-Version``
    gets ``MIME-Version: 1.0`` and, lacking a ``Content-Type``, ``text/plain;
    charset=unknown-8bit`` (RFC 1428); so does a message enclosed in a ``message/rfc822``
    part whose body is re-encoded (RFC 2045 §4). Invalidates DKIM signatures over the body
    (see the module docstring).

    Args:
        message: the whole raw message, CRLF line ends.

    Returns:
        the converted message: only octets < 0x80, no line over 998 octets, CRLF line ends.

    Raises:
        ConversionError: a header (of the message or of a part), a preamble or an epilogue
            contains 8-bit octets, or the result is still not 7-bit.
    """
    if has_8bit_headers(message[: header_end(message)]):
        raise ConversionError("8-bit octets in the message header")
    msg = BytesParser(policy=_POLICY).parsebytes(message)
    _declare_mime(msg)
    enclosed: set[int] = set()  # messages inside message/rfc822 (or other message/*) parts
    for part in msg.walk():  # a part encoded whole below is not descended into
        for name, value in part.raw_items():
            if isinstance(value, str) and not value.isascii():
                raise ConversionError(f"8-bit octets in the {name} header of a MIME part")
        cte = str(part.get("Content-Transfer-Encoding", "7bit")).strip().lower()
        if part.get_content_type() in _ENCODABLE_MESSAGES and _encode_message(part):
            continue
        if part.is_multipart():
            if cte in ("8bit", "binary"):
                _set_cte(part, "7bit")
            if part.get_content_maintype() == "message":
                enclosed.update(id(m) for m in part.get_payload())
            continue
        if _leaf_needs_encoding(part, cte):
            if id(part) in enclosed:
                _declare_mime(part)  # RFC 2045 §4: an enclosed message says it is MIME
            _encode_leaf(part)
    out = msg.as_bytes(policy=_POLICY)
    if _needs_encoding(out):
        raise ConversionError("8-bit octets outside any MIME part (preamble or epilogue)")
    return out
