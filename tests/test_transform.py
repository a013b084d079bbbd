"""Pure transformations of outgoing messages: dot-stuffing (RFC 5321 §4.5.2, §2.3.8) and the
8-bit to 7-bit MIME conversion (RFC 6152 §3, RFC 2045 §6; CASE-24, CASE-25)."""

from __future__ import annotations

import base64
import email
import email.policy
import re
from datetime import UTC, datetime
from email.message import EmailMessage

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jsqueue.delivery.transform import ConversionError, DotStuffer, has_8bit_headers, to_7bit
from jsqueue.dsn.report import Action, build_dsn
from jsqueue.envelope import Entry, Recipient, RecipientState
from jsqueue.replies import Reply
from support.cases import CASES

NOW = datetime(2026, 3, 2, 9, 0, 5, tzinfo=UTC)


def stuff(chunks: list[bytes]) -> bytes:
    stuffer = DotStuffer()
    return b"".join(stuffer.feed(c) for c in chunks) + stuffer.finish()


def canonical(data: bytes) -> bytes:
    data = re.sub(rb"\r\n|\r|\n", b"\r\n", data)
    return data if not data or data.endswith(b"\r\n") else data + b"\r\n"


def unstuff(stream: bytes) -> bytes:
    assert stream.endswith(b".\r\n")
    body = stream[:-3]
    return b"".join(
        line[1:] if line.startswith(b".") else line for line in body.splitlines(keepends=True)
    )


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    pieces, start = [], 0
    for p in points:
        pieces.append(data[start:p])
        start = p
    pieces.append(data[start:])
    return pieces


message_bytes = st.lists(
    st.sampled_from([b".", b"..", b"\r\n", b"\r", b"\n", b"a", b"x y", b"\xc3\xbc", b"\r\n."]),
    max_size=60,
).map(b"".join)


@given(message_bytes, st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_dot_stuffing_round_trips_across_any_chunking(data: bytes, cuts: list[int]) -> None:
    """RFC 5321 §4.5.2: after unstuffing the receiver gets the canonical (CRLF) message;
    the end-of-data line appears only at the end; the chunking never matters."""
    stream = stuff(split_at(data, cuts))
    assert stream == stuff([data])
    assert stream.endswith(b".\r\n")
    body = stream[:-3]
    assert not body.startswith(b".\r\n") and b"\r\n.\r\n" not in body
    assert re.search(rb"\r(?!\n)|(?<!\r)\n", stream) is None  # no bare CR or LF (§2.3.8)
    assert unstuff(stream) == canonical(data)


@pytest.mark.parametrize(
    "chunks",
    [
        [b"aa.\n.\r\r", b"b"],  # bare LF, then a bare CR before the held-back CR
        [b"x\r\r", b"\n.y"],  # the held-back CR completes a CRLF in the next chunk
        [b"\r", b"\r", b".\n"],  # chunks of bare CRs only
    ],
)
def test_bare_line_ends_at_a_chunk_end_are_all_normalised(chunks: list[bytes]) -> None:
    """RFC 5321 §2.3.8, §4.5.2: a chunk that still ends in a bare CR after the possible
    first half of a CRLF is held back has every line break counted; nothing bare is sent."""
    stream = stuff(chunks)
    assert re.search(rb"\r(?!\n)|(?<!\r)\n", stream) is None
    assert unstuff(stream) == canonical(b"".join(chunks))


def test_case03_message_is_stuffed_exactly() -> None:
    """CASE-03 variant A: every line starting with "." gets exactly one more dot."""
    message = (CASES / "CASE-03" / "message.eml").read_bytes()
    stream = stuff([message[i : i + 5] for i in range(0, len(message), 5)])
    body_lines = stream[:-3].split(b"\r\n")
    assert b"..first body line starts with a dot" in body_lines
    assert body_lines.count(b"..") == 2  # the two lone "." lines
    assert b"..." in body_lines and b"...." in body_lines and b"..hidden" in body_lines
    assert unstuff(stream) == message


def test_missing_final_crlf_and_split_crlf() -> None:
    """RFC 5321 §4.1.1.4: a message not ending in CRLF gets one before the terminator; a
    CRLF split across chunks followed by a dot is still stuffed."""
    assert stuff([b"abc"]) == b"abc\r\n.\r\n"
    assert stuff([b"a\r", b"\n.b\r\n"]) == b"a\r\n..b\r\n.\r\n"
    assert stuff([b"a\r"]) == b"a\r\n.\r\n"
    assert stuff([]) == b".\r\n"


@pytest.mark.parametrize("name", ["message-8bit.eml", "message-8bit-dkim.eml"])
def test_case24_conversion_decodes_to_the_original(name: str) -> None:
    """CASE-24 expected 2 and 4: the converted message is 7-bit, quoted-printable, decodes
    to the original UTF-8 text; every header (the DKIM-Signature too) is kept byte for byte
    except Content-Transfer-Encoding, so the body hash of a signature no longer matches."""
    original = (CASES / "CASE-24" / name).read_bytes()
    converted = to_7bit(original)
    assert converted.isascii()
    parsed = email.message_from_bytes(converted, policy=email.policy.default)
    assert parsed["Content-Transfer-Encoding"] == "quoted-printable"
    assert parsed.get_payload(decode=True) == original.split(b"\r\n\r\n", 1)[1]
    head_in = original.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    head_out = converted.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    assert [h for h in head_in if b"Transfer-Encoding" not in h] == [
        h for h in head_out if b"Transfer-Encoding" not in h
    ]


def test_multipart_parts_are_encoded_by_type() -> None:
    """RFC 2045 §6: text parts become quoted-printable, binary parts base64, containers
    declared 8bit become 7bit; each part decodes to its original octets."""
    msg = EmailMessage()
    msg["From"] = "a@example.test"
    msg["Subject"] = "parts"
    msg.set_content("Grüße aus Köln\n" + "lang " * 300 + "\n", cte="8bit")
    blob = bytes(range(256)) * 4
    msg.add_attachment(blob, maintype="application", subtype="octet-stream")
    msg.replace_header("Content-Type", msg["Content-Type"])
    msg["Content-Transfer-Encoding"] = "8bit"
    raw = msg.as_bytes(policy=email.policy.SMTP.clone(cte_type="8bit"))
    assert not raw.isascii()
    converted = to_7bit(raw)
    assert converted.isascii()
    assert max(len(line) for line in converted.split(b"\r\n")) <= 998
    parsed = email.message_from_bytes(converted, policy=email.policy.default)
    assert parsed["Content-Transfer-Encoding"] == "7bit"
    text, attachment = parsed.iter_parts()
    assert text["Content-Transfer-Encoding"] == "quoted-printable"
    # Canonical text line breaks are CRLF (RFC 2045 §6.7 hard line breaks).
    assert text.get_payload(decode=True) == ("Grüße aus Köln\r\n" + "lang " * 300 + "\r\n").encode()
    assert attachment.get_payload(decode=True) == blob


def test_non_mime_8bit_message_gets_mime_headers() -> None:
    """RFC 1428: an 8-bit message without MIME headers is labelled unknown-8bit."""
    converted = to_7bit("Subject: x\r\n\r\nGrüße\r\n".encode())
    parsed = email.message_from_bytes(converted, policy=email.policy.default)
    assert parsed["MIME-Version"] == "1.0"
    assert parsed.get_content_charset() == "unknown-8bit"
    assert parsed.get_payload(decode=True) == "Grüße\r\n".encode()


def test_8bit_headers_cannot_be_converted() -> None:
    """RFC 6532 / RFC 6152 §3: raw UTF-8 in a header (of the message or a part) cannot be
    made 7-bit without rewriting the header: ConversionError (the client answers 5.6.3)."""
    assert has_8bit_headers("Subject: Grüße\r\n".encode())
    assert not has_8bit_headers(b"Subject: =?utf-8?q?Gr=C3=BC=C3=9Fe?=\r\n")
    with pytest.raises(ConversionError):
        to_7bit("Subject: Grüße\r\n\r\nbody\r\n".encode())
    part_header = (
        b"MIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary=b\r\n\r\n"
        b'--b\r\nContent-Type: text/plain; name="\xc3\xbc.txt"\r\n\r\nx\r\n--b--\r\n'
    )
    with pytest.raises(ConversionError):
        to_7bit(part_header)


def test_long_lines_are_reencoded_but_7bit_short_parts_untouched() -> None:
    """CASE-25 expected 3: lines over 998 octets are re-encoded (quoted-printable keeps
    lines <= 76); an already 7-bit part is passed through unchanged."""
    long_line = (CASES / "CASE-25" / "message-5000.eml").read_bytes()
    converted = to_7bit(long_line)
    assert max(len(line) for line in converted.split(b"\r\n")) <= 998
    parsed = email.message_from_bytes(converted, policy=email.policy.default)
    assert parsed.get_payload(decode=True) == long_line.split(b"\r\n\r\n", 1)[1]
    plain = (CASES / "CASE-07" / "message.eml").read_bytes()
    assert to_7bit(plain) == plain


def _returned(converted: bytes) -> EmailMessage:
    """The third part (returned content) of a DSN."""
    parsed = email.message_from_bytes(converted, policy=email.policy.default)
    assert isinstance(parsed, EmailMessage)
    return list(parsed.iter_parts())[2]


def _dsn(original: bytes, ret: str = "FULL") -> bytes:
    r = Recipient.from_address("bob@rej.example.test").model_copy(
        update={
            "state": RecipientState.BOUNCED,
            "last_reply": Reply(code=550, enhanced="5.1.1", text="no", remote_host="mx.test"),
        }
    )
    e = Entry(
        id="01jq0000000000000000000000",
        reverse_path="alice@example.test",
        recipients=[r],
        created_at=NOW,
        size=len(original),
        ret=ret,
        smtputf8=True,
        body_8bit=True,
    )
    return build_dsn(
        e, [r], Action.FAILED, reporting_mta="relay.example.test", now=NOW, original=original
    )


def test_message_global_is_base64_encoded_whole() -> None:
    """RFC 6532 §3.5: a message/global part (UTF-8 headers) may, unlike message/rfc822,
    take a base64 Content-Transfer-Encoding: converted for a next hop without 8BITMIME it
    is base64 and decodes to the enclosed message octet for octet; a 7-bit one is left."""
    inner = "From: jörg@example.test\r\nSubject: Grüße\r\n\r\nGrüße\r\n".encode()
    outer = (
        b"MIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary=b\r\n\r\n"
        b"--b\r\nContent-Type: text/plain\r\n\r\nsee attached\r\n"
        b"--b\r\nContent-Type: message/global\r\nContent-Transfer-Encoding: 8bit\r\n\r\n"
        + inner
        + b"--b--\r\n"
    )
    converted = to_7bit(outer)
    assert converted.isascii() and b"\n" not in converted.replace(b"\r\n", b"")
    parsed = email.message_from_bytes(converted, policy=email.policy.default)
    assert isinstance(parsed, EmailMessage)
    _, attached = parsed.iter_parts()
    assert attached.get_content_type() == "message/global"
    assert attached["Content-Transfer-Encoding"] == "base64"
    encoded = converted.split(b"base64\r\n\r\n", 1)[1].split(b"--b--")[0]
    # The CRLF before a boundary delimiter belongs to it (RFC 2046 §5.1.1), not to the part.
    assert base64.b64decode(encoded) == inner[:-2]
    plain = outer.replace(inner, b"Subject: hi\r\n\r\nhi\r\n")
    assert to_7bit(plain.replace(b"8bit", b"7bit")) == plain.replace(b"8bit", b"7bit")


def test_an_enclosed_message_whose_body_is_encoded_is_declared_mime() -> None:
    """RFC 2045 §4: a message inside message/rfc822 whose 8-bit body gets a
    Content-Transfer-Encoding also gets MIME-Version (and, lacking one, a Content-Type,
    RFC 1428), or no reader would decode it."""
    outer = (
        b"MIME-Version: 1.0\r\nContent-Type: message/rfc822\r\n"
        b"Content-Transfer-Encoding: 8bit\r\n\r\n" + "Subject: x\r\n\r\nGrüße\r\n".encode()
    )
    converted = to_7bit(outer)
    assert converted.isascii()
    parsed = email.message_from_bytes(converted, policy=email.policy.default)
    assert isinstance(parsed, EmailMessage)
    (enclosed,) = parsed.iter_parts()
    assert enclosed["MIME-Version"] == "1.0"
    assert enclosed.get_content_charset() == "unknown-8bit"
    assert enclosed.get_payload(decode=True) == "Grüße\r\n".encode()


UTF8_ORIGINALS = {
    "UTF-8 headers": (
        "From: jörg@example.test\r\nSubject: Grüße\r\nMIME-Version: 1.0\r\n"
        "Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n\r\n"
        "Grüße\r\n"
    ).encode(),
    "8-bit body, no MIME": "From: a@example.test\r\nSubject: x\r\n\r\nGrüße\r\n".encode(),
    "UTF-8 MIME part header": (
        "From: a@example.test\r\nMIME-Version: 1.0\r\n"
        "Content-Type: multipart/mixed; boundary=b\r\n\r\n"
        '--b\r\nContent-Type: text/plain; name="ü.txt"\r\nContent-Transfer-Encoding: 8bit\r\n'
        "\r\nü\r\n--b--\r\n"
    ).encode(),
    "8-bit preamble": (
        "From: a@example.test\r\nMIME-Version: 1.0\r\n"
        "Content-Type: multipart/mixed; boundary=b\r\n\r\nVorwort: Grüße\r\n"
        "--b\r\nContent-Type: text/plain\r\n\r\nx\r\n--b--\r\n"
    ).encode(),
    "enclosed message with UTF-8 headers": (
        "From: a@example.test\r\nMIME-Version: 1.0\r\nContent-Type: message/rfc822\r\n"
        "Content-Transfer-Encoding: 8bit\r\n\r\nSubject: Grüße\r\n\r\nGrüße\r\n"
    ).encode(),
    "over-long header line, 8-bit body": (
        "From: a@example.test\r\nX-Long: " + "a" * 1200 + "\r\n\r\nGrüße\r\n"
    ).encode(),
}


@pytest.mark.parametrize("ret", ["FULL", "HDRS"])
@pytest.mark.parametrize("name", list(UTF8_ORIGINALS))
def test_every_dsn_can_be_made_7bit(name: str, ret: str) -> None:
    """RFC 6152 §3, RFC 6532 §3.5 / §3.7, RFC 3461 §4.3: whatever 8-bit original a DSN
    returns (RET=FULL or headers only), the DSN converts to 7-bit MIME for a sender's MX
    without 8BITMIME or SMTPUTF8, so it is never refused for its encoding (a DSN from <>
    that fails is dropped, RFC 5321 §4.5.5: the sender would never hear of the failure);
    the returned message decodes to the original octets."""
    original = UTF8_ORIGINALS[name]
    converted = to_7bit(_dsn(original, ret))
    assert converted.isascii()
    assert max(len(line) for line in converted.split(b"\r\n")) <= 998
    returned = _returned(converted)
    if ret == "HDRS":
        assert returned.get_content_type() == "text/rfc822-headers"
        assert returned.get_payload(decode=True) == original.split(b"\r\n\r\n", 1)[0] + b"\r\n"
    elif returned.get_content_type() == "message/global":
        assert returned["Content-Transfer-Encoding"] == "base64"
        encoded = converted.split(b"Content-Transfer-Encoding: base64\r\n\r\n")[-1]
        assert base64.b64decode(encoded.split(b"\r\n--")[0]) == original
    else:  # only 8-bit leaf bodies: message/rfc822, its body re-encoded
        assert name == "8-bit body, no MIME"
        assert returned.get_content_type() == "message/rfc822"
        (enclosed,) = returned.iter_parts()
        assert enclosed.get_payload(decode=True) == original.split(b"\r\n\r\n", 1)[1]
