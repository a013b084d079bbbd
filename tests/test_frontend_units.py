"""Pure parts of the front end: DATA decoding, path/parameter syntax, Received:, AUTH hashes.

Each test names the RFC section or case it checks. No servers here.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jsqueue.config import BareLinePolicy
from jsqueue.delivery.params import orcpt_param
from jsqueue.envelope import Notify, Recipient, xtext_encode
from jsqueue.errors import ConfigError, InvalidName
from jsqueue.frontend.auth import ScryptHash, UserDB, hash_password
from jsqueue.frontend.data import DataDecoder
from jsqueue.frontend.ingest import ingest_key
from jsqueue.frontend.received import received_header
from jsqueue.frontend.syntax import (
    SyntaxProblem,
    parse_envid,
    parse_mail_from,
    parse_notify,
    parse_orcpt,
    parse_rcpt_to,
    parse_ret,
    parse_size,
    xtext_decode,
)
from jsqueue.frontend.wire import with_enhanced_code
from jsqueue.store.memory import MemoryIngestLog
from support.cases import CASES, case_file
from support.frontend import dot_stuff


def decode(
    data: bytes,
    *,
    split: int | None = None,
    policy: BareLinePolicy = BareLinePolicy.REJECT,
    max_size: int = 10**7,
) -> tuple[bytes | None, bytes | None, int | None]:
    """Feed ``data`` in pieces of ``split``; (content or None if rejected, rest, error code)."""
    decoder = DataDecoder(max_size=max_size, bare_line_endings=policy)
    out, rest = b"", None
    step = split or max(1, len(data))
    for i in range(0, len(data), step):
        piece = data[i : i + step]
        if rest is not None:
            rest += piece
            continue
        content, r = decoder.feed(piece)
        out += content
        rest = r
    code = decoder.error.code if decoder.error else None
    return (None if decoder.error else out), rest, code


# ------------------------------------------------------------------------ DATA decoding

LINE = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(LINE, max_size=30), split=st.integers(1, 64))
def test_dot_stuffing_round_trips_at_any_split(lines: list[bytes], split: int) -> None:
    """RFC 5321 §4.5.2: what a correct client stuffs comes back byte-identical, however the
    stream is cut into reads; bytes after the terminator are returned untouched."""
    message = b"".join(ln + b"\r\n" for ln in lines)
    content, rest, code = decode(dot_stuff(message) + b"NOOP\r\n", split=split)
    assert code is None
    assert content == message
    assert rest == b"NOOP\r\n"


@settings(max_examples=150, deadline=None)
@given(
    noise=st.lists(st.sampled_from([b".", b"\r", b"\n", b"x", b"\r\n", b"\n.\n", b"\r.\r"])),
    split=st.integers(1, 16),
)
def test_only_crlf_dot_crlf_ends_data(noise: list[bytes], split: int) -> None:
    """CASE-01 (SMTP smuggling): whatever bare CR/LF/dot sequences come first, the message
    ends exactly at the first ``<CRLF>.<CRLF>`` (or a leading ``.<CRLF>``)."""
    data = b"".join(noise) + b"\r\n.\r\nTAIL"
    first = 0 if data.startswith(b".\r\n") else data.index(b"\r\n.\r\n") + 2
    for policy in BareLinePolicy:
        _, rest, _ = decode(data, split=split, policy=policy)
        assert rest == data[first + 3 :]


@pytest.mark.parametrize("name", sorted(p.name for p in (CASES / "CASE-01").glob("*.bin")))
def test_case01_payloads(name: str) -> None:
    """CASE-01: every payload is one message; reject policy → 550 5.6.11; accept policy keeps
    the smuggled commands as body text."""
    data = case_file("CASE-01", name) + b"QUIT\r\n"
    content, rest, code = decode(data)
    assert (content, rest, code) == (None, b"QUIT\r\n", 550)
    content, rest, code = decode(data, policy=BareLinePolicy.ACCEPT)
    assert code is None and rest == b"QUIT\r\n" and content is not None
    assert b"MAIL FROM:<ceo@trusted.example.test>" in content
    assert b"\r" not in content.replace(b"\r\n", b"") and b"\n" not in content.replace(b"\r\n", b"")


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        (b"a\n\rb\r\n", [b"a", b"", b"b"]),  # LF CR: as many CRs as LFs, none paired
        (b"a\rb\nc\r\n", [b"a", b"b", b"c"]),  # one bare CR and one bare LF
        (b"a\r\r\n\nb\r\n", [b"a", b"", b"", b"b"]),  # bare ones around a CRLF
    ],
)
@pytest.mark.parametrize("split", [1, 3, 64])
def test_bare_line_ends_hidden_by_equal_counts(data: bytes, lines: list[bytes], split: int) -> None:
    """RFC 5321 §2.3.8: a bare CR and a bare LF in one read (equally many CRs and LFs) are
    still bare line ends: 550 5.6.11 under the reject policy, CRLF lines under accept."""
    message = data + b".\r\n"
    assert decode(message, split=split)[2] == 550
    content, _, code = decode(message, split=split, policy=BareLinePolicy.ACCEPT)
    assert code is None and content is not None
    assert content.split(b"\r\n")[:-1] == lines


def test_bare_cr_lines_split_after_a_cr_are_short_lines() -> None:
    """RFC 5321 §2.3.8, §4.5.3.1.6: under the accept policy, 61 bare-CR lines of 21 octets
    are short lines, also when a read ends right after one of their CRs. Only that last
    CR waits for a possible LF; the earlier ones are complete line breaks. They used to be
    carried as one 1 300-octet line: 500 5.5.2 "line too long", or the same message taken
    in one read. Reject policy: 550 5.6.11 either way."""
    body = b"Subject: mac\r" + b"line of old mac text\r" * 60
    wire = body + b"last\r\n.\r\n"
    for split in (None, len(body)):
        content, rest, code = decode(wire, split=split, policy=BareLinePolicy.ACCEPT)
        assert code is None and rest == b""
        assert content == b"Subject: mac\r\n" + b"line of old mac text\r\n" * 60 + b"last\r\n"
        assert decode(wire, split=split)[2] == 550


TEXT = st.binary(min_size=8, max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
BREAKS = st.sampled_from([(b"\r",), (b"\r", b"\r", b"\r", b"\n"), (b"\r\n", b"\r", b"\n")])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), breaks=BREAKS, split=st.integers(1, 2048))
def test_a_read_boundary_never_changes_the_outcome(
    data: st.DataObject, breaks: tuple[bytes, ...], split: int
) -> None:
    """Whatever the line breaks (CRLF, bare CR, bare LF; runs of bare-CR lines longer than
    a line are the hard case) and wherever reads split the stream (every CR among the
    boundaries tried), the content, the rest after the terminator and the reply are those
    of the same bytes in one read, under both policies."""
    lines = data.draw(st.lists(st.tuples(TEXT, st.sampled_from(breaks)), min_size=60, max_size=90))
    wire = b"".join(text + end for text, end in lines) + b"\r\n.\r\nNOOP\r\n"
    cuts = {split, *(i + 1 for i, octet in enumerate(wire) if octet == 13)}
    for policy in BareLinePolicy:
        whole = decode(wire, policy=policy)
        for cut in sorted(cuts):
            assert decode(wire, split=cut, policy=policy) == whole, cut


def test_case03_variant_b_policies() -> None:
    """CASE-03 variant B: reject → 550; accept → the author's lines, unstuffed per LF line."""
    data = case_file("CASE-03", "variant-b-bare-lf.bin")
    assert decode(data)[2] == 550
    content, _, code = decode(data, policy=BareLinePolicy.ACCEPT)
    assert code is None and content is not None
    body = content.split(b"\r\n\r\n", 1)[1]
    assert body.split(b"\r\n") == [
        b".first body line starts with a dot",
        b".",
        b"..",
        b"...",
        b".hidden",
        b"middle line",
        b"",
        b"",
    ]


@pytest.mark.parametrize(
    ("length", "stuffed", "ok"),
    [
        (998, False, True),
        (998, True, True),
        (999, False, False),
        (999, True, False),
        (5000, False, False),
    ],
)
def test_line_length_limit(length: int, stuffed: bool, ok: bool) -> None:
    """RFC 5321 §4.5.3.1.6 / CASE-25: 998 octets (plus a transparency dot) pass, more fail
    with 500 after the terminator."""
    line = b"." + b"B" * (length - 1) if stuffed else b"B" * length
    wire = b"Subject: x\r\n\r\n" + (b"." + line if stuffed else line) + b"\r\n.\r\nNOOP\r\n"
    for split in (None, 1, 7, 1000):
        content, rest, code = decode(wire, split=split)
        assert rest == b"NOOP\r\n"
        assert (code is None) == ok
        if ok:
            assert content == b"Subject: x\r\n\r\n" + line + b"\r\n"
        else:
            assert code == 500


def test_size_limit_discards_with_bounded_state() -> None:
    """RFC 1870 / CASE-26 C2: over the limit → 552; the decoder keeps only a few bytes."""
    decoder = DataDecoder(max_size=1000)
    chunk = b"A" * 70 + b"\r\n"
    for _ in range(100):
        decoder.feed(chunk)
    assert decoder.error is not None and decoder.error.code == 552
    assert len(decoder._carry) == 0 and decoder._tail is not None and len(decoder._tail) <= 4
    content, rest = decoder.feed(b".\r\nNOOP\r\n")
    assert content == b"" and rest == b"NOOP\r\n"


def test_eight_bit_is_detected() -> None:
    """RFC 6152: the entry's body_8bit flag comes from the content itself."""
    decoder = DataDecoder(max_size=1000)
    decoder.feed("Subject: Grüße\r\n.\r\n".encode())
    assert decoder.eight_bit


# ------------------------------------------------------------------------ syntax


@pytest.mark.parametrize(
    ("arg", "address", "domain"),
    [
        ("FROM:<alice@example.test>", "alice@example.test", "example.test"),
        ("from: <alice@Example.TEST>", "alice@Example.TEST", "example.test"),
        ("FROM:<>", "", ""),
        ("FROM:<@relay.test,@hop.test:alice@example.test>", "alice@example.test", "example.test"),
        ('FROM:<"a b>c"@example.test>', '"a b>c"@example.test', "example.test"),
        ("FROM:<a@[127.0.0.1]>", "a@[127.0.0.1]", "[127.0.0.1]"),
        ("FROM:<a@[IPv6:::1]>", "a@[IPv6:::1]", "[ipv6:::1]"),
        (
            "FROM:<müller@bücher.example.test>",
            "müller@bücher.example.test",
            "xn--bcher-kva.example.test",
        ),
    ],
)
def test_reverse_paths_accepted(arg: str, address: str, domain: str) -> None:
    """RFC 5321 §4.1.2 (and §3.3 source routes, §4.1.3 literals, RFC 6531 §3.3 UTF-8)."""
    cmd = parse_mail_from(arg)
    assert (cmd.path.address, cmd.path.domain) == (address, domain)


@pytest.mark.parametrize(
    ("arg", "code"),
    [
        ("FROM:alice@example.test", 501),
        ("FROM:<alice@example.test", 501),
        ("FROM:<alice>", 501),
        ("FROM:<alice@>", 501),
        ("FROM:<al ice@example.test>", 501),
        ("FROM:<alice@exa_mple.test>", 501),
        ("FROM:<alice@example.test>junk", 501),
        ("FROM:<a..b@example.test>", 501),
        ("FROM:<a@[300.1.1.1]>", 553),
        ("FROM:<a@[foo:bar]>", 553),
        ("FROM:<a@[IPv6:::1%eth0]>", 553),  # a zone ID is no part of RFC 5321 §4.1.3
        ("FROM:<a@[127.000.0.1]>", 553),
        ("TO:<alice@example.test>", 501),
        ("FROM:<\udcff@example.test>", 501),
        ("FROM:<" + "a" * 250 + "@example.test>", 553),
        ("FROM:<a@example.test> SIZE", None),
        ("FROM:<a@example.test> =x", 501),
        ("FROM:<a@example.test> RET=FULL RET=HDRS", 501),
    ],
)
def test_reverse_paths_refused(arg: str, code: int | None) -> None:
    """RFC 5321 §4.1.2: malformed paths get 501 (5.1.7), unusable mailboxes 553."""
    if code is None:
        assert parse_mail_from(arg).params == {"SIZE": None}
        return
    with pytest.raises(SyntaxProblem) as e:
        parse_mail_from(arg)
    assert e.value.reply.code == code


def test_forward_path_rules() -> None:
    """RFC 5321 §4.1.1.3: ``<>`` is no recipient; parameters are split off."""
    with pytest.raises(SyntaxProblem) as e:
        parse_rcpt_to("TO:<>")
    assert e.value.reply.code == 501
    cmd = parse_rcpt_to("TO:<bob@dest.example.test> NOTIFY=NEVER ORCPT=rfc822;bob@x.test")
    assert cmd.params == {"NOTIFY": "NEVER", "ORCPT": "rfc822;bob@x.test"}


@pytest.mark.parametrize("smtputf8", [False, True])
def test_a_utf8_orcpt_decodes_its_embedded_unicode_escapes(smtputf8: bool) -> None:
    """RFC 6533 §3: a ``utf-8`` ORCPT writes non-ASCII characters, and ``+``, ``=`` and
    ``\\``, as ``\\x{HEX}`` (utf-8-addr-xtext; with SMTPUTF8 utf-8-addr-unitext may mix
    them with raw UTF-8). They are decoded for the entry, so the next hop gets them encoded
    once (``\\x{F6}``, not ``\\x{5C}x{F6}``); an ``rfc822`` address keeps a backslash as it
    is, and a code point that is no character is 501."""
    got = parse_orcpt("utf-8;j\\x{F6}rg\\x{2B}x\\x{5C}y@example.test", smtputf8=smtputf8)
    assert got == "utf-8;jörg+x\\y@example.test"
    assert orcpt_param(got) == "utf-8;j\\x{F6}rg\\x{2B}x\\x{5C}y@example.test"
    assert parse_orcpt("rfc822;a\\x{41}@x.test", smtputf8=smtputf8) == "rfc822;a\\x{41}@x.test"
    for bad in ("utf-8;a\\x{110000}@x.test", "utf-8;a\\x{D800}@x.test"):
        with pytest.raises(SyntaxProblem):
            parse_orcpt(bad, smtputf8=smtputf8)


def test_dsn_parameters() -> None:
    """RFC 3461 §4.1-4.4: NOTIFY, ORCPT, RET, ENVID validation; xtext decoded for storage."""
    assert parse_notify("success,Failure") == {Notify.SUCCESS, Notify.FAILURE}
    assert parse_notify("NEVER") == {Notify.NEVER}
    for bad in ("", "NEVER,SUCCESS", "SUCCESS,SUCCESS", "SOMETIMES", None):
        with pytest.raises(SyntaxProblem):
            parse_notify(bad)
    assert parse_orcpt("rfc822;bob+2Bx@example.test", smtputf8=False) == "rfc822;bob+x@example.test"
    assert parse_orcpt("utf-8;müller@example.test", smtputf8=True) == "utf-8;müller@example.test"
    for bad in ("rfc822", ";bob@x", "rfc822;", "rfc822;a+0Db", "rfc822;a+zz", "rfc822;müller@x"):
        with pytest.raises(SyntaxProblem):
            parse_orcpt(bad, smtputf8=False)
    assert parse_ret("hdrs") == "HDRS"
    with pytest.raises(SyntaxProblem):
        parse_ret("ALL")
    assert parse_envid("QQ314159+2B1") == "QQ314159+1"
    for bad in ("", "x" * 101, "a+0A", "a+0g"):
        with pytest.raises(SyntaxProblem):
            parse_envid(bad)
    assert parse_size("123") == 123
    for bad in ("", "-1", "1e9", "١٢٣"):
        with pytest.raises(SyntaxProblem):
            parse_size(bad)


@given(st.text(max_size=50))
def test_xtext_round_trip(text: str) -> None:
    """RFC 3461 §4: xtext encoding is reversible and yields only xtext characters."""
    encoded = xtext_encode(text)
    assert re.fullmatch(r"(?:[\x21-\x2a\x2c-\x3c\x3e-\x7e]|\+[0-9A-F]{2})*", encoded)
    assert xtext_decode(encoded) == text


# ------------------------------------------------------------------------ replies, trace


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("500 Error: bad syntax", "500 5.5.2 Error: bad syntax"),
        ("221 Bye", "221 2.0.0 Bye"),
        ("250 2.1.0 Sender OK", "250 2.1.0 Sender OK"),
        ("354 End data", "354 End data"),
        (
            "530 Must issue a STARTTLS command first",
            "530 5.7.0 Must issue a STARTTLS command first",
        ),
        ("421", "421 4.0.0"),
    ],
)
def test_enhanced_codes_added(raw: str, expected: str) -> None:
    """RFC 2034 §4: 2xx/4xx/5xx replies carry an enhanced code; 3xx do not."""
    assert with_enhanced_code(raw) == expected


def plain_received(helo: str, client_ip: str) -> bytes:
    """The Received: field of an ESMTP session without TLS, for several recipients."""
    return received_header(
        helo=helo,
        client_ip=client_ip,
        hostname="mx.jsqueue.test",
        protocol="ESMTP",
        queue_id="01abcdefghjkmnpqrstvwxyz01",
        recipient=None,
        tls=None,
        when=datetime(2026, 3, 2, 9, 0, tzinfo=UTC),
    )


def test_received_header_shape() -> None:
    """RFC 5321 §4.4: From-domain with TCP-info, By-domain, With, ID, For (one recipient
    only), date; folded lines, none longer than 78 octets here."""
    when = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
    one = received_header(
        helo="client.example.test",
        client_ip="127.0.0.1",
        hostname="mx.jsqueue.test",
        protocol="ESMTPS",
        queue_id="01abcdefghjkmnpqrstvwxyz01",
        recipient="bob@dest.example.test",
        tls="TLSv1.3 TLS_AES_256_GCM_SHA384",
        when=when,
    )
    assert one == (
        b"Received: from client.example.test ([127.0.0.1])\r\n"
        b"\t(TLSv1.3 TLS_AES_256_GCM_SHA384)\r\n"
        b"\tby mx.jsqueue.test (jsqueue) with ESMTPS id 01abcdefghjkmnpqrstvwxyz01\r\n"
        b"\tfor <bob@dest.example.test>;\r\n"
        b"\tMon, 02 Mar 2026 09:00:00 +0000\r\n"
    )
    many = plain_received("bad helo (x)", "::1")
    assert many.startswith(b"Received: from [IPv6:::1] ([IPv6:::1])\r\n\t(helo=bad helo ?x?)\r\n")
    assert b"for <" not in many
    assert all(len(line) <= 78 for line in many.split(b"\r\n"))


@pytest.mark.parametrize(
    "helo",
    [
        "[IPv6:::1%] (trusted.test [10.0.0.1]) (x]",
        "[IPv6:::1%x(]",
        "[IPv6:::1%x;by.forged.test]",
        "[127.0.0.1] (forged)",
    ],
)
def test_a_helo_that_only_looks_like_an_address_literal_is_a_comment(helo: str) -> None:
    """RFC 5321 §4.1.3, §4.4: an IPv6 literal with a zone ID (which Python's parser takes)
    is no address literal, so the client's text goes into the sanitised ``(helo=...)``
    comment, never raw into the ``from`` clause, where it forged a TCP-info comment or left
    one open to swallow the rest of the field."""
    field = plain_received(helo, "127.0.0.1")
    first, second = field.split(b"\r\n")[:2]
    assert first == b"Received: from [127.0.0.1] ([127.0.0.1])"
    assert second.startswith(b"\t(helo=") and second.count(b"(") == 1 and second.endswith(b")")


def test_ingest_key_covers_envelope_and_content() -> None:
    """Idempotent ingest: the same envelope and content give the same key; any change
    (content, recipient parameters, sender, authenticated user, client address) gives
    another."""
    rcpt = [Recipient.from_address("bob@dest.example.test")]
    base = {
        "reverse_path": "alice@example.test",
        "recipients": rcpt,
        "ret": None,
        "envid": None,
        "smtputf8": False,
        "auth_user": None,
        "client_address": "192.0.2.1",
        "content_sha256": hashlib.sha256(b"x").digest(),
    }
    key = ingest_key(**base)  # type: ignore[arg-type]
    assert re.fullmatch(r"[0-9a-f]{64}", key) and key == ingest_key(**base)  # type: ignore[arg-type]
    changes = [
        {"content_sha256": hashlib.sha256(b"y").digest()},
        {"reverse_path": ""},
        {"auth_user": "alice"},
        {"client_address": "192.0.2.2"},
        {
            "recipients": [
                Recipient.from_address("bob@dest.example.test", notify=frozenset({Notify.NEVER}))
            ]
        },
    ]
    for change in changes:
        assert ingest_key(**{**base, **change}) != key  # type: ignore[arg-type]


async def test_memory_ingest_log_window() -> None:
    """IngestLog contract (memory): found within the window, not beyond; keys validated."""
    log = MemoryIngestLog()
    key = "a" * 64
    assert await log.lookup(key, 60) is None
    await log.record(key, "01abcdefghjkmnpqrstvwxyz01")
    assert await log.lookup(key, 60) == "01abcdefghjkmnpqrstvwxyz01"
    assert await log.lookup(key, -1) is None
    with pytest.raises(InvalidName):
        await log.lookup("A" * 64, 60)


# ------------------------------------------------------------------------ AUTH file


def test_scrypt_hash_round_trip() -> None:
    """The documented $scrypt$ PHC format: parse(str(h)) == h; right password only."""
    encoded = hash_password("s3cret", ln=10)
    assert encoded.startswith("$scrypt$ln=10,r=8,p=1$")
    parsed = ScryptHash.parse(encoded)
    assert str(parsed) == encoded
    assert parsed.verify(b"s3cret") and not parsed.verify(b"S3cret")


@pytest.mark.parametrize(("args", "status"), [("--help", 0), ("-h", 0), ("-x", 2), ("", 2)])
def test_auth_line_tool_options_prompt_for_nothing(args: str, status: int) -> None:
    """``python -m jsqueue.frontend.auth``: --help prints the usage, an option or no USER
    is a usage error; none of them reads a password (stdin is a pipe that never ends)."""
    run = subprocess.run(
        [sys.executable, "-m", "jsqueue.frontend.auth", *args.split()],
        stdin=subprocess.PIPE,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == status, run.stderr
    assert "usage: python -m jsqueue.frontend.auth USER" in run.stdout + run.stderr
    assert "password" not in run.stderr.lower()


async def test_user_db(tmp_path: Path) -> None:
    """Auth file: comments and blank lines skipped; unknown users fail like bad passwords."""
    path = tmp_path / "users"
    path.write_text(f"# users\n\nalice:{hash_password('pw', ln=10)}\n")
    users = UserDB.load(path)
    assert len(users) == 1
    assert await users.verify("alice", b"pw")
    assert not await users.verify("alice", b"nope")
    assert not await users.verify("mallory", b"pw")


@pytest.mark.parametrize(
    "line",
    [
        "alice",
        ":$scrypt$ln=10,r=8,p=1$AAAAAAAAAAAAAAAAAAAAAA$" + "A" * 43,
        "bob:$2b$12$abc",
        "c:$scrypt$ln=40,r=8,p=1$AAAAAAAAAAAAAAAAAAAAAA$" + "A" * 43,
    ],
)
def test_user_db_rejects_bad_lines(tmp_path: Path, line: str) -> None:
    """A malformed line is a ConfigError naming the file and line, never the hash."""
    path = tmp_path / "users"
    path.write_text(f"# ok\n{line}\n")
    with pytest.raises(ConfigError, match=r"users:2"):
        UserDB.load(path)
