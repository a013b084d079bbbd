"""The outbound SMTP client against real fake MX servers on loopback (RFC 5321, 3207, 1870,
6152, 6531, 3461). Each test names its case (``tests/cases``) or RFC section."""

from __future__ import annotations

import asyncio
import email
import email.policy
import hashlib
import logging
import tracemalloc
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from jsqueue.config import SmarthostSettings, TlsPolicy, WorkerSettings
from jsqueue.delivery import (
    BodySource,
    ConnectionCache,
    DeliveryEnvelope,
    DeliveryResult,
    MxTarget,
    deliver,
)
from jsqueue.delivery.base import Attempt
from jsqueue.delivery.deliverer import SmtpDeliverer
from jsqueue.delivery.resolver import DnsResolver
from jsqueue.envelope import Entry, Notify, Recipient, RecipientState
from support.cases import CASES
from support.dns import DnsServer
from support.mx import CLOSE, SILENT, Certs, ScriptedMx, Session, SmtpdMx, shared_port
from support.nats import make_entry


def case_file(case: str, name: str) -> bytes:
    return (CASES / case / name).read_bytes()


def settings_for(port: int, **overrides: object) -> WorkerSettings:
    """Worker settings with short timeouts: a hang fails in seconds, not minutes."""
    values: dict[str, object] = {
        "mx_port": port,
        "ehlo_name": "worker.example.test",
        "connect_timeout_s": 5.0,
        "greeting_timeout_s": 5.0,
        "mail_timeout_s": 5.0,
        "rcpt_timeout_s": 5.0,
        "data_init_timeout_s": 5.0,
        "data_block_timeout_s": 10.0,
        "data_final_timeout_s": 10.0,
    }
    values.update(overrides)
    return WorkerSettings.model_validate(values)


def envelope(*addresses: str, sender: str = "alice@example.test", **kw: object) -> DeliveryEnvelope:
    recipients = tuple(Recipient.from_address(a) for a in addresses)
    return DeliveryEnvelope(
        domain=recipients[0].domain,
        reverse_path=sender,
        recipients=recipients,
        **kw,  # type: ignore[arg-type]
    )


def target(host: str, address: str, **kw: object) -> list[MxTarget]:
    return [MxTarget(host=host, address=address, **kw)]  # type: ignore[arg-type]


def verbs(mx: ScriptedMx | SmtpdMx) -> list[str]:
    return [c.split(" ", 1)[0].upper() for c in mx.commands]


def commands(mx: ScriptedMx | SmtpdMx, verb: str) -> list[str]:
    return [c for c in mx.commands if c.upper().startswith(verb)]


def unopenable(size: int) -> BodySource:
    """A body that must never be read."""

    def fail() -> AsyncIterator[bytes]:
        raise AssertionError("the body must not be read")

    return BodySource(open=fail, size=size)


# --- CASE-07, CASE-17: per-recipient replies and greylisting -------------------------------


async def test_mixed_recipient_replies_one_transaction() -> None:
    """CASE-07 (RFC 5321 §3.3): 250/450/550 per RCPT in one transaction; DATA once for the
    accepted recipient; refusals keep their own reply; attempt 2 offers only b@."""
    host = "127.0.2.70"
    port = shared_port([host])
    message = case_file("CASE-07", "message.eml")
    a, b, c = (f"{x}@mixed.example.test" for x in "abc")
    async with SmtpdMx(
        host,
        port,
        name="mx.mixed.example.test",
        rcpt_replies={
            b: "450 4.2.1 mailbox temporarily busy, try later",
            c: "550 5.1.1 no such user here",
        },
    ) as mx:
        mxs = target("mx.mixed.example.test", host)
        first = await deliver(
            mxs, envelope(a, b, c), BodySource.from_bytes(message), settings_for(port)
        )
        assert first.replies[a].code == 250 and first.replies[a].enhanced == "2.0.0"
        assert first.replies[b].code == 450 and first.replies[b].enhanced == "4.2.1"
        assert first.replies[c].code == 550 and first.replies[c].enhanced == "5.1.1"
        assert first.replies[c].text == "no such user here"
        assert first.replies[c].remote_host == "mx.mixed.example.test"
        assert (first.delivered, first.deferred, first.failed) == ([a], [b], [c])
        assert [t.rcpt_to for t in mx.delivered] == [[a]]
        assert mx.delivered[0].content == message

        mx.rcpt_replies.pop(b)
        second = await deliver(mxs, envelope(b), BodySource.from_bytes(message), settings_for(port))
        assert second.delivered == [b]
        assert [c for c in mx.sessions[1].commands if c.startswith("RCPT")] == [f"RCPT TO:<{b}>"]
        assert [t.rcpt_to for t in mx.delivered] == [[a], [b]]


@pytest.mark.parametrize("variant", ["A", "B", "C"])
async def test_greylisting_is_temporary_then_delivered_once(variant: str) -> None:
    """CASE-17 variants A (451 at RCPT), B (451 at MAIL), C (451 after the data): each is a
    temporary failure, the refused data is not delivered; a later attempt delivers exactly
    one copy."""
    host = "127.0.2.130"
    port = shared_port([host])
    grey = "451 4.7.1 greylisted, please retry in 300 seconds"
    rcpt = "user@grey.example.test"
    kwargs: dict[str, object] = {
        "A": {"rcpt_replies": {rcpt: grey}},
        "B": {"mail_reply": grey},
        "C": {"data_reply": grey},
    }[variant]
    message = case_file("CASE-17", "message.eml")
    async with SmtpdMx(host, port, name="mx.grey.example.test", **kwargs) as mx:  # type: ignore[arg-type]
        mxs = target("mx.grey.example.test", host)
        first = await deliver(
            mxs, envelope(rcpt), BodySource.from_bytes(message), settings_for(port)
        )
        reply = first.replies[rcpt]
        assert reply.is_temporary and reply.enhanced == "4.7.1" and "greylisted" in reply.text
        assert mx.delivered == []
        if variant == "B":
            assert "RCPT" not in verbs(mx)
        if variant in "AB":
            assert "DATA" not in verbs(mx)

        mx.rcpt_replies.clear()
        mx.mail_reply = None
        mx.data_reply = None
        later = await deliver(
            mxs, envelope(rcpt), BodySource.from_bytes(message), settings_for(port)
        )
        assert later.delivered == [rcpt]
        assert len(mx.delivered) == 1


# --- CASE-19: multi-line replies ----------------------------------------------------------

CASE19_GREETING = (
    "220-mx.ml.example.test ESMTP service\n"
    "220-Unsolicited bulk mail is not accepted here.\n"
    "220 Connections are logged."
)
CASE19_EHLO = (
    "250-mx.ml.example.test greets you\n250-pipelining\n250-Size 35882577\n"
    "250-8BITMIME\n250-ENHANCEDSTATUSCODES\n250"
)
CASE19_BLOCKED = (
    "550-5.7.1 The message from this sender was refused by local policy.\n"
    "550-5.7.1 Policy reference PX-4471; see the postmaster page of\n"
    "550-5.7.1 ml.example.test for the appeal procedure. Automated\n"
    "550-5.7.1 requests will be ignored.\n"
    "550 5.7.1 id=7f3a2c"
)


async def test_multiline_greeting_ehlo_and_rcpt_reply() -> None:
    """CASE-19 (RFC 5321 §4.2.1, RFC 2034): 3-line greeting and mixed-case EHLO with a bare
    "250" last line are accepted; SIZE 35882577 is recognised and MAIL carries SIZE=<n>;
    ok@ is delivered once; blocked@ fails 5.7.1 with all five lines of the text."""
    host = "127.0.2.150"
    port = shared_port([host])
    message = case_file("CASE-19", "message.eml")
    ok, blocked = "ok@ml.example.test", "blocked@ml.example.test"
    mx = ScriptedMx(
        host,
        port,
        greeting=CASE19_GREETING,
        ehlo=CASE19_EHLO,
        rcpt_replies={blocked: CASE19_BLOCKED},
    )
    async with mx:
        mxs = target("mx.ml.example.test", host)
        result = await deliver(
            mxs, envelope(ok, blocked), BodySource.from_bytes(message), settings_for(port)
        )
        assert result.delivered == [ok]
        reply = result.replies[blocked]
        assert reply.code == 550 and reply.enhanced == "5.7.1"
        lines = reply.text.split("\n")
        assert len(lines) == 5
        assert lines[0] == "The message from this sender was refused by local policy."
        assert "PX-4471" in reply.text and lines[-1] == "id=7f3a2c"
        assert commands(mx, "MAIL") == [f"MAIL FROM:<alice@example.test> SIZE={len(message)}"]
        assert len(mx.delivered) == 1 and mx.delivered[0].rcpt_to == [ok]

        # The parsed limit is exactly 35882577 octets (RFC 1870 §6).
        at_limit = BodySource(open=BodySource.from_bytes(message).open, size=35882577)
        assert (await deliver(mxs, envelope(ok), at_limit, settings_for(port))).delivered == [ok]
        over = await deliver(mxs, envelope(ok), unopenable(35882578), settings_for(port))
        assert over.replies[ok].code == 554 and over.replies[ok].enhanced == "5.3.4"
        assert "MAIL" not in mx.sessions[-1].verbs()


async def test_malformed_ehlo_reply_is_temporary_protocol_error() -> None:
    """CASE-19 variant M: an empty line inside the multi-line EHLO reply is a temporary
    protocol error (no crash, no MAIL); the next MX is tried and delivers."""
    bad_host, good_host = "127.0.2.150", "127.0.2.151"
    port = shared_port([bad_host, good_host])
    message = case_file("CASE-19", "message.eml")
    rcpt = "ok@ml.example.test"
    malformed = "250-mx.ml.example.test\n\n250 SIZE 35882577"
    async with ScriptedMx(bad_host, port, ehlo=malformed) as bad, SmtpdMx(good_host, port) as good:
        only_bad = target("mx.ml.example.test", bad_host)
        result = await deliver(
            only_bad, envelope(rcpt), BodySource.from_bytes(message), settings_for(port)
        )
        reply = result.replies[rcpt]
        assert reply.is_temporary and reply.enhanced == "4.5.0"
        assert "MAIL" not in verbs(bad)

        both = [*only_bad, MxTarget(host="mx2.ml.example.test", address=good_host)]
        result = await deliver(
            both, envelope(rcpt), BodySource.from_bytes(message), settings_for(port)
        )
        assert result.delivered == [rcpt] and result.mx_host == "mx2.ml.example.test"
        assert len(good.delivered) == 1


# --- CASE-20: STARTTLS policies -----------------------------------------------------------

TLS_HOST = "127.0.2.160"
TLS_NAME = "mx.tlsfail.example.test"


@pytest.fixture(scope="module")
def certs() -> Certs:
    return Certs()


def tls_server(certs: Certs, variant: str, port: int) -> ScriptedMx:
    if variant == "A":
        return ScriptedMx(TLS_HOST, port, name=TLS_NAME, tls_abort=True)
    ctx = {
        "B": lambda: certs.server_context("other.invalid", untrusted=True),
        "C": lambda: certs.server_context(TLS_NAME, expired=True),
        "D": lambda: certs.server_context(TLS_NAME, max_tls12=True),
        "OK": lambda: certs.server_context(TLS_NAME),
    }[variant]()
    return ScriptedMx(TLS_HOST, port, name=TLS_NAME, tls=ctx)


@pytest.mark.parametrize("variant", ["A", "B", "C", "D"])
async def test_opportunistic_tls_always_delivers_in_the_same_attempt(
    variant: str, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    """CASE-20 A-D (RFC 3207, RFC 7435): opportunistic TLS delivers in the same attempt:
    A (handshake aborted) over a logged plaintext reconnect; B (self-signed, wrong name) and
    C (expired) over TLS without verification; D over TLS 1.2."""
    port = shared_port([TLS_HOST])
    message = case_file("CASE-20", "message.eml")
    rcpt = "user@tlsfail.example.test"
    caplog.set_level(logging.WARNING, logger="jsqueue.delivery.client")
    async with tls_server(certs, variant, port) as mx:
        result = await deliver(
            target(TLS_NAME, TLS_HOST),
            envelope(rcpt),
            BodySource.from_bytes(message),
            settings_for(port),
        )
    assert result.delivered == [rcpt]
    assert len(mx.delivered) == 1
    if variant == "A":
        assert mx.connections == 2
        assert "MAIL" not in mx.sessions[0].verbs()
        assert "STARTTLS" not in mx.sessions[1].verbs()
        assert not result.tls and not mx.delivered[0].tls
        assert any("plaintext" in r.getMessage() for r in caplog.records)
    else:
        assert mx.connections == 1
        assert result.tls and mx.delivered[0].tls
    if variant == "D":
        assert result.tls_version == "TLSv1.2"


@pytest.mark.parametrize("where", ["EHLO", "MAIL", "RCPT"])
async def test_opportunistic_tls_that_breaks_after_the_handshake_delivers_in_plaintext(
    where: str, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    """RFC 7435 §3 (opportunistic security: no worse than plaintext), as Postfix does: the
    handshake succeeds but the server drops the TLS session at the EHLO after it, at MAIL
    or at RCPT, before any recipient was accepted. The same address is tried once more
    in plaintext, in the same attempt. Before, every attempt failed the same way until
    the message expired."""
    port = shared_port([TLS_HOST])
    rcpt = "user@tlsfail.example.test"

    def drop_in_tls(session: Session, line: str) -> str | None:
        return CLOSE if session.tls and line.upper().startswith(where) else None

    caplog.set_level(logging.WARNING, logger="jsqueue.delivery.client")
    ctx = certs.server_context(TLS_NAME)
    async with ScriptedMx(TLS_HOST, port, name=TLS_NAME, tls=ctx, hook=drop_in_tls) as mx:
        result = await deliver(
            target(TLS_NAME, TLS_HOST),
            envelope(rcpt),
            BodySource.from_bytes(b"Subject: t\r\n\r\nx\r\n"),
            settings_for(port),
        )
    assert result.delivered == [rcpt], result.replies
    assert mx.connections == 2
    assert mx.sessions[0].tls and "STARTTLS" not in mx.sessions[1].verbs()
    assert not mx.delivered[0].tls
    assert any("plaintext" in r.getMessage() for r in caplog.records)


async def test_required_tls_that_breaks_after_the_handshake_is_never_plaintext(
    certs: Certs,
) -> None:
    """RFC 3207 §4: with TLS required for the domain, a TLS session dropped at MAIL is a
    deferral; the address is not tried in plaintext."""
    port = shared_port([TLS_HOST])
    rcpt = "user@tlsfail.example.test"

    def drop_in_tls(session: Session, line: str) -> str | None:
        return CLOSE if session.tls and line.upper().startswith("MAIL") else None

    ctx = certs.server_context(TLS_NAME)
    settings = settings_for(port, tls=TlsPolicy.REQUIRED)
    async with ScriptedMx(TLS_HOST, port, name=TLS_NAME, tls=ctx, hook=drop_in_tls) as mx:
        result = await deliver(
            target(TLS_NAME, TLS_HOST),
            envelope(rcpt),
            BodySource.from_bytes(b"Subject: t\r\n\r\nx\r\n"),
            settings,
        )
    assert result.replies[rcpt].is_temporary and result.delivered == []
    assert mx.connections == 1 and mx.delivered == []


async def test_required_tls_never_falls_back_to_plaintext(certs: Certs) -> None:
    """CASE-20 variant E: TLS enforced for the domain (``tls_policies``); the handshake
    fails -> temporary 4.7.x, and the MX never sees MAIL outside TLS."""
    host = "127.0.2.161"
    port = shared_port([host])
    rcpt = "user@strict.example.test"
    settings = settings_for(port, tls_policies={"strict.example.test": TlsPolicy.REQUIRED})
    async with ScriptedMx(host, port, name="mx.strict.example.test", tls_abort=True) as mx:
        result = await deliver(
            target("mx.strict.example.test", host),
            envelope(rcpt),
            BodySource.from_bytes(case_file("CASE-20", "message.eml")),
            settings,
        )
    reply = result.replies[rcpt]
    assert reply.is_temporary and reply.enhanced is not None and reply.enhanced.startswith("4.7.")
    assert "MAIL" not in verbs(mx)
    assert mx.connections == 1


async def test_required_tls_without_starttls_offer_and_with_verification(
    certs: Certs, tmp_path: Path
) -> None:
    """RFC 3207 §4 / CASE-20 E: ``required`` with no STARTTLS offered defers 4.7.5; with
    ``required-with-verification`` a certificate from the trusted CA for the MX name is
    accepted, a wrong-name or expired one is not (no plaintext MAIL either way)."""
    port = shared_port([TLS_HOST])
    rcpt = "user@tlsfail.example.test"
    body = BodySource.from_bytes(case_file("CASE-20", "message.eml"))
    mxs = target(TLS_NAME, TLS_HOST)
    required = settings_for(port, tls=TlsPolicy.REQUIRED)
    async with ScriptedMx(TLS_HOST, port, name=TLS_NAME) as plain:
        result = await deliver(mxs, envelope(rcpt), body, required)
    assert result.replies[rcpt].enhanced == "4.7.5" and "MAIL" not in verbs(plain)

    verify = settings_for(port, tls=TlsPolicy.VERIFY, tls_ca_file=certs.ca_file(tmp_path))
    async with tls_server(certs, "OK", port) as good:
        result = await deliver(mxs, envelope(rcpt), body, verify)
    assert result.delivered == [rcpt] and result.tls and good.delivered[0].tls
    for variant in ("B", "C"):
        async with tls_server(certs, variant, port) as bad:
            result = await deliver(mxs, envelope(rcpt), body, verify)
        assert result.replies[rcpt].enhanced == "4.7.5", variant
        assert "MAIL" not in verbs(bad)


# --- CASE-23: SMTPUTF8 and IDN ------------------------------------------------------------

LEGACY, INTL = "127.0.2.190", "127.0.2.191"


async def test_smtputf8_and_idn_recipients() -> None:
    """CASE-23 A-D (RFC 6531 §3.5, §3.2): A: ASCII local part at a U-label domain goes to
    the legacy MX as the A-label, no SMTPUTF8; B: UTF-8 local part to the legacy MX fails
    5.6.7 with nothing sent; C: the SMTPUTF8 MX gets MAIL ... SMTPUTF8 and the UTF-8 local
    part unchanged; D: raw UTF-8 headers to the legacy MX fail 5.6.7 (documented choice),
    never sent."""
    port = shared_port([LEGACY, INTL])
    ascii_msg = BodySource.from_bytes(case_file("CASE-23", "message.eml"))
    utf8_headers = BodySource.from_bytes(case_file("CASE-23", "message-utf8-subject.eml"))
    s = settings_for(port)
    legacy_mx = target("mx.legacy.example.test", LEGACY)
    async with SmtpdMx(LEGACY, port) as legacy, SmtpdMx(INTL, port, smtputf8=True) as intl:
        a = await deliver(
            legacy_mx, envelope("user@bücher.example.test", smtputf8=True), ascii_msg, s
        )
        assert a.delivered == ["user@bücher.example.test"]
        assert commands(legacy, "RCPT") == ["RCPT TO:<user@xn--bcher-kva.example.test>"]
        assert "SMTPUTF8" not in commands(legacy, "MAIL")[0]

        b = await deliver(
            legacy_mx, envelope("müller@dest.example.test", smtputf8=True), ascii_msg, s
        )
        reply = b.replies["müller@dest.example.test"]
        assert reply.code == 554 and reply.enhanced == "5.6.7"
        assert legacy.connections == 2 and "MAIL" not in legacy.sessions[1].verbs()
        assert all("xn--mller" not in c for c in legacy.commands)

        c = await deliver(
            target("mx.intl.example.test", INTL),
            envelope("müller@intl.example.test", smtputf8=True),
            ascii_msg,
            s,
        )
        assert c.delivered == ["müller@intl.example.test"]
        assert commands(intl, "MAIL")[0].split()[2:] == [f"SIZE={ascii_msg.size}", "SMTPUTF8"]
        assert intl.delivered[0].rcpt_to == ["müller@intl.example.test"]

        d = await deliver(
            legacy_mx,
            envelope("plain@dest.example.test", smtputf8=True, body_8bit=True),
            utf8_headers,
            s,
        )
        assert d.replies["plain@dest.example.test"].enhanced == "5.6.7"
        assert "MAIL" not in legacy.sessions[2].verbs()
        assert len(legacy.delivered) == 1  # only variant A's message
        assert all(c.isascii() for c in legacy.commands)


async def test_utf8_local_part_fails_alone_in_a_mixed_transaction() -> None:
    """RFC 6531 §3.5: only the recipient that needs SMTPUTF8 fails (5.6.7); the others of
    the same domain are delivered in the same transaction."""
    port = shared_port([LEGACY])
    async with SmtpdMx(LEGACY, port) as legacy:
        result = await deliver(
            target("mx.legacy.example.test", LEGACY),
            envelope("müller@dest.example.test", "user@dest.example.test", smtputf8=True),
            BodySource.from_bytes(case_file("CASE-23", "message.eml")),
            settings_for(port),
        )
    assert result.delivered == ["user@dest.example.test"]
    assert result.failed == ["müller@dest.example.test"]
    assert legacy.delivered[0].rcpt_to == ["user@dest.example.test"]


# --- CASE-24: 8-bit body and 8BITMIME -----------------------------------------------------


@pytest.mark.parametrize("name", ["message-8bit.eml", "message-8bit-dkim.eml"])
async def test_8bit_body_converted_for_legacy_and_unchanged_for_modern(name: str) -> None:
    """CASE-24 (RFC 6152 §3): to the MX without 8BITMIME no BODY=8BITMIME and only 7-bit
    octets, a quoted-printable part decoding to the original text (the DKIM variant is
    converted too: the signature is allowed to break, see transform.py); to the 8BITMIME
    MX BODY=8BITMIME and the body byte-identical."""
    legacy_host, modern_host = "127.0.2.200", "127.0.2.201"
    port = shared_port([legacy_host, modern_host])
    original = case_file("CASE-24", name)
    s = settings_for(port)
    async with (
        SmtpdMx(legacy_host, port, eight_bit=False) as legacy,
        SmtpdMx(modern_host, port) as modern,
    ):
        old = await deliver(
            target("mx.legacy.example.test", legacy_host),
            envelope("user@legacy.example.test", body_8bit=True),
            BodySource.from_bytes(original),
            s,
        )
        new = await deliver(
            target("mx.modern.example.test", modern_host),
            envelope("user@modern.example.test", body_8bit=True),
            BodySource.from_bytes(original),
            s,
        )
    assert old.delivered == ["user@legacy.example.test"] and old.converted_7bit
    sent = legacy.delivered[0]
    assert "BODY=8BITMIME" not in sent.mail_params
    assert sent.content is not None and sent.content.isascii()
    parsed = email.message_from_bytes(sent.content, policy=email.policy.default)
    assert parsed["Content-Transfer-Encoding"] == "quoted-printable"
    original_body = original.split(b"\r\n\r\n", 1)[1]
    assert parsed.get_payload(decode=True) == original_body
    original_headers = original.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    sent_headers = sent.content.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    assert [h for h in original_headers if not h.startswith(b"Content-Transfer")] == [
        h for h in sent_headers if not h.startswith(b"Content-Transfer")
    ]

    assert new.delivered == ["user@modern.example.test"] and not new.converted_7bit
    assert "BODY=8BITMIME" in modern.delivered[0].mail_params
    assert modern.delivered[0].content == original


async def test_unconvertible_8bit_message_fails_5_6_3() -> None:
    """CASE-24 (RFC 6152 §3): raw 8-bit octets in a header cannot be made 7-bit: permanent
    5.6.3, nothing sent after EHLO."""
    host = "127.0.2.200"
    port = shared_port([host])
    message = "Subject: Grüße\r\n\r\nGrüße\r\n".encode()
    async with SmtpdMx(host, port, eight_bit=False) as legacy:
        result = await deliver(
            target("mx.legacy.example.test", host),
            envelope("user@legacy.example.test", body_8bit=True),
            BodySource.from_bytes(message),
            settings_for(port),
        )
    assert result.replies["user@legacy.example.test"].enhanced == "5.6.3"
    assert "MAIL" not in verbs(legacy)


# --- CASE-25, CASE-03: byte-exact content and dot transparency ------------------------------


async def test_998_octet_line_arrives_byte_exact() -> None:
    """CASE-25 expected 1 (RFC 5322 §2.1.1): a 998-octet line passes a strict MX unchanged."""
    host = "127.0.2.210"
    port = shared_port([host])
    message = case_file("CASE-25", "message-998.eml")
    async with ScriptedMx(host, port, max_line_length=998) as mx:
        result = await deliver(
            target("mx.strict.example.test", host),
            envelope("user@strict.example.test"),
            BodySource.from_bytes(message, chunk_size=300),
            settings_for(port),
        )
    assert result.delivered == ["user@strict.example.test"]
    assert mx.delivered[0].content == message
    assert mx.delivered[0].longest_line == 998


async def test_dot_stuffing_round_trip() -> None:
    """CASE-03 variant A (RFC 5321 §4.5.2): every line starting with "." is sent with one
    more dot; after unstuffing the message is byte-identical, the lone "." line included;
    chunk boundaries anywhere (here every 7 octets) do not matter."""
    host = "127.0.2.21"
    port = shared_port([host])
    message = case_file("CASE-03", "message.eml")
    expected_raw = b"".join(
        b"." + line if line.startswith(b".") else line for line in message.splitlines(keepends=True)
    )
    async with SmtpdMx(host, port) as mx:
        result = await deliver(
            target("mx.dest.example.test", host),
            envelope("bob@dest.example.test"),
            BodySource.from_bytes(message, chunk_size=7),
            settings_for(port),
        )
    assert result.delivered == ["bob@dest.example.test"]
    assert mx.delivered[0].content == message
    assert mx.delivered[0].raw == expected_raw


# --- CASE-26: SIZE --------------------------------------------------------------------------


async def test_size_limits() -> None:
    """CASE-26 A: SIZE 10485760 < message -> permanent 5.3.4, no MAIL, no DATA (RFC 1870 §6);
    B: "SIZE" without a number -> MAIL carries SIZE=<n>; 552 after the data is permanent
    5.3.4; D: 452 at MAIL -> temporary, delivered once the MX accepts."""
    small, nolimit, full = "127.0.2.220", "127.0.2.221", "127.0.2.222"
    port = shared_port([small, nolimit, full])
    message = case_file("CASE-07", "message.eml")
    body = BodySource.from_bytes(message)
    s = settings_for(port)
    async with (
        SmtpdMx(small, port, size=10485760) as small_mx,
        SmtpdMx(nolimit, port, size=0, data_reply="552 5.3.4 message too big") as nolimit_mx,
        ScriptedMx(full, port, mail="452 4.3.1 insufficient system storage") as full_mx,
    ):
        a = await deliver(
            target("mx.small.example.test", small),
            envelope("user@small.example.test"),
            unopenable(12_800_000),
            s,
        )
        reply = a.replies["user@small.example.test"]
        assert reply.code == 554 and reply.enhanced == "5.3.4" and reply.is_permanent
        assert not {"MAIL", "RCPT", "DATA"} & set(verbs(small_mx))

        b = await deliver(
            target("mx.nolimit.example.test", nolimit),
            envelope("user@nolimit.example.test"),
            body,
            s,
        )
        reply = b.replies["user@nolimit.example.test"]
        assert reply.code == 552 and reply.enhanced == "5.3.4" and reply.is_permanent
        assert f"SIZE={len(message)}" in nolimit_mx.transactions[0].mail_params
        assert nolimit_mx.delivered == []

        mxs = target("mx.full.example.test", full)
        d = await deliver(mxs, envelope("user@full.example.test"), body, s)
        assert d.replies["user@full.example.test"].code == 452
        assert d.replies["user@full.example.test"].is_temporary
        full_mx.mail = "250 2.1.0 ok"
        d2 = await deliver(mxs, envelope("user@full.example.test"), body, s)
        assert d2.delivered == ["user@full.example.test"] and len(full_mx.delivered) == 1


# --- envelope details ------------------------------------------------------------------------


async def test_null_reverse_path_and_dsn_parameters() -> None:
    """RFC 5321 §4.5.5 and RFC 3461 §4: the null reverse-path is exactly ``MAIL FROM:<>``;
    RET/ENVID/NOTIFY/ORCPT are passed (xtext) only to a server advertising DSN, and only
    the recipients it accepted are its to report (RFC 3461 §5.2.1)."""
    host = "127.0.2.80"
    port = shared_port([host])
    body = BodySource.from_bytes(b"Subject: t\r\n\r\nx\r\n")
    rcpt = Recipient.from_address(
        "bob@dsn.example.test",
        orcpt="rfc822;bob+tag@dsn.example.test",
        notify=frozenset({Notify.FAILURE, Notify.SUCCESS}),
    )
    env = DeliveryEnvelope(
        domain="dsn.example.test", reverse_path="", recipients=(rcpt,), envid="id 1+2", ret="HDRS"
    )
    s = settings_for(port)
    mxs = target("mx.dsn.example.test", host)
    async with ScriptedMx(host, port, extensions=["DSN", "SIZE"]) as dsn_mx:
        with_dsn = await deliver(mxs, env, body, s)
    assert with_dsn.delivered == ["bob@dsn.example.test"] and with_dsn.dsn
    assert with_dsn.dsn_accepted == {"bob@dsn.example.test"}  # it reports, RFC 3461 §5.2.1
    assert commands(dsn_mx, "MAIL") == [f"MAIL FROM:<> SIZE={body.size} RET=HDRS ENVID=id+201+2B2"]
    assert commands(dsn_mx, "RCPT") == [
        "RCPT TO:<bob@dsn.example.test> NOTIFY=SUCCESS,FAILURE"
        " ORCPT=rfc822;bob+2Btag@dsn.example.test"
    ]
    assert dsn_mx.delivered[0].mail_from == ""
    async with ScriptedMx(host, port, extensions=[]) as plain_mx:
        without = await deliver(mxs, env, body, s)
    assert without.delivered == ["bob@dsn.example.test"] and not without.dsn
    assert without.dsn_accepted == frozenset()  # jsqueue owes "relayed", RFC 3461 §5.2.2
    assert commands(plain_mx, "MAIL") == ["MAIL FROM:<>"]
    assert commands(plain_mx, "RCPT") == ["RCPT TO:<bob@dsn.example.test>"]


async def test_utf8_orcpt_and_envid_are_encoded_as_their_rfcs_say() -> None:
    """A ``utf-8`` ORCPT goes out as RFC 6533 §3 ``utf-8-addr-xtext``: non-ASCII, ``+``,
    ``=`` and ``\\`` as ``\\x{HEX}`` and never ``+XX`` (which that form does not have: a
    ``+2B`` there would be read as the three characters); an ENVID with non-ASCII text is
    plain RFC 3461 §4 xtext, ``+XX`` per UTF-8 octet, never ``\\x{...}``."""
    host = "127.0.2.82"
    port = shared_port([host])
    rcpt = Recipient.from_address(
        "joerg@dsn.example.test",
        orcpt="utf-8;jörg+x=y\\z@dsn.example.test",
        notify=frozenset({Notify.FAILURE}),
    )
    env = DeliveryEnvelope(
        domain="dsn.example.test",
        reverse_path="alice@example.test",
        recipients=(rcpt,),
        envid="Zürich+1",
    )
    async with ScriptedMx(host, port, extensions=["DSN"]) as mx:
        result = await deliver(
            target("mx.dsn.example.test", host),
            env,
            BodySource.from_bytes(b"Subject: t\r\n\r\nx\r\n"),
            settings_for(port),
        )
    assert result.delivered == ["joerg@dsn.example.test"]
    assert commands(mx, "MAIL") == ["MAIL FROM:<alice@example.test> ENVID=Z+C3+BCrich+2B1"]
    assert commands(mx, "RCPT") == [
        "RCPT TO:<joerg@dsn.example.test> NOTIFY=FAILURE"
        " ORCPT=utf-8;j\\x{F6}rg\\x{2B}x\\x{3D}y\\x{5C}z@dsn.example.test"
    ]


async def test_helo_fallback_when_ehlo_is_refused() -> None:
    """RFC 5321 §4.1.1.1 / §3.2: a 5xx to EHLO -> HELO, then a plain transaction."""
    host = "127.0.2.81"
    port = shared_port([host])
    async with ScriptedMx(host, port, ehlo="502 5.5.1 EHLO not implemented") as mx:
        result = await deliver(
            target("mx.old.example.test", host),
            envelope("bob@old.example.test"),
            BodySource.from_bytes(b"Subject: t\r\n\r\nx\r\n"),
            settings_for(port),
        )
    assert result.delivered == ["bob@old.example.test"]
    assert mx.sessions[0].verbs()[:3] == ["EHLO", "HELO", "MAIL"]
    assert commands(mx, "HELO") == ["HELO worker.example.test"]


def test_envelope_from_entry_takes_open_recipients_of_one_domain() -> None:
    """DESIGN.md §2.4: an attempt offers only the not-yet-final recipients of its domain."""
    done = Recipient.from_address("a@one.example.test").model_copy(
        update={"state": RecipientState.DELIVERED}
    )
    entry = Entry(
        id="0" * 26,
        reverse_path="alice@example.test",
        recipients=[
            done,
            Recipient.from_address("b@one.example.test"),
            Recipient.from_address("c@two.example.test"),
        ],
        created_at=datetime(2026, 3, 2, tzinfo=UTC),
        size=10,
        envid="e1",
        ret="FULL",
        body_8bit=True,
    )
    env = DeliveryEnvelope.from_entry(entry, "one.example.test")
    assert [r.address for r in env.recipients] == ["b@one.example.test"]
    assert (env.envid, env.ret, env.body_8bit, env.smtputf8) == ("e1", "FULL", True, False)


# --- failures: next MX, aborts, timeouts -------------------------------------------------------


async def test_next_mx_on_refused_connection_421_and_554_greeting() -> None:
    """RFC 5321 §5.1/§3.1: connection refused, a 421 greeting and a 554 greeting each move
    on to the next MX; when every MX fails, every recipient is deferred (never bounced).
    A refused greeting is answered with QUIT (§3.1: a server greeting 554 waits for it)."""
    dead, busy, refusing, good = "127.0.2.90", "127.0.2.91", "127.0.2.92", "127.0.2.93"
    port = shared_port([dead, busy, refusing, good])
    body = BodySource.from_bytes(b"Subject: t\r\n\r\nx\r\n")
    s = settings_for(port)
    rcpt = "bob@multi.example.test"
    async with (
        ScriptedMx(busy, port, greeting="421 4.3.2 busy, try later") as busy_mx,
        ScriptedMx(refusing, port, greeting="554 5.7.1 no service for you") as refusing_mx,
        SmtpdMx(good, port, name="mx4.multi.example.test") as good_mx,
    ):
        failing = [
            MxTarget(host="mx1.multi.example.test", address=dead),
            MxTarget(host="mx2.multi.example.test", address=busy),
            MxTarget(host="mx3.multi.example.test", address=refusing),
        ]
        all_fail = await deliver(failing, envelope(rcpt), body, s)
        assert all_fail.replies[rcpt].is_temporary
        assert "554" in all_fail.replies[rcpt].text
        assert busy_mx.connections == refusing_mx.connections == 1
        assert refusing_mx.commands == busy_mx.commands == ["QUIT"]
        ok = await deliver(
            [*failing, MxTarget(host="mx4.multi.example.test", address=good)],
            envelope(rcpt),
            body,
            s,
        )
        assert ok.delivered == [rcpt] and ok.mx_host == "mx4.multi.example.test"
        assert len(good_mx.delivered) == 1


@pytest.mark.parametrize(
    ("greeting", "code", "enhanced"),
    [("421 4.7.0 Error: too many connections", 421, "4.7.0"), ("554 5.7.1 go away", 451, "4.4.1")],
)
async def test_a_refused_greeting_is_the_servers_reply(
    greeting: str, code: int, enhanced: str
) -> None:
    """RFC 5321 §3.1, §4.2.2: a 421 greeting is recorded as the server sent it, a 554 as a
    temporary refusal quoting it; both name the server (``remote_host``), which answered:
    the destination limits throttle on the 421 and do not take the site for dead. A 421
    greeting used to be recorded as "connection lost", with no remote host."""
    host = "127.0.2.95"
    port = shared_port([host])
    async with ScriptedMx(host, port, greeting=greeting):
        result = await deliver(
            target("mx.refusing.example.test", host),
            envelope("bob@refusing.example.test"),
            BodySource.from_bytes(b"Subject: t\r\n\r\nx\r\n"),
            settings_for(port),
        )
    reply = result.replies["bob@refusing.example.test"]
    assert (reply.code, reply.enhanced) == (code, enhanced), reply
    assert reply.remote_host == "mx.refusing.example.test"
    assert greeting.split(" ", 2)[2] in reply.text


async def test_body_failure_aborts_without_terminator() -> None:
    """RFC 5321 §4.1.1.4: when the body source fails mid-stream the transaction is aborted
    without the end-of-data sequence, so nothing is delivered; the result is temporary."""
    host = "127.0.2.94"
    port = shared_port([host])

    async def broken() -> AsyncIterator[bytes]:
        yield b"Subject: t\r\n\r\nfirst part\r\n"
        raise OSError("object store went away")

    async with ScriptedMx(host, port) as mx:
        result = await deliver(
            target("mx.example.test", host),
            envelope("bob@b.example.test"),
            BodySource(open=broken, size=100),
            settings_for(port),
        )
        await mx.wait_for(lambda: mx.sessions[0].closed)
    reply = result.replies["bob@b.example.test"]
    assert reply.is_temporary and reply.enhanced == "4.3.0" and "object store" in reply.text
    assert mx.transactions == []


async def test_connection_lost_after_data_and_timeouts_are_temporary() -> None:
    """RFC 5321 §4.5.3.2 / §6.1: a connection dropped after the end of data, and a server
    that stops answering MAIL, give temporary failures within the configured timeout."""
    host = "127.0.2.95"
    port = shared_port([host])
    body = BodySource.from_bytes(b"Subject: t\r\n\r\nx\r\n")
    rcpt = "bob@b.example.test"
    async with ScriptedMx(host, port, end_of_data=CLOSE):
        lost = await deliver(
            target("mx.example.test", host), envelope(rcpt), body, settings_for(port)
        )
    assert lost.replies[rcpt].is_temporary and lost.replies[rcpt].enhanced == "4.4.2"
    async with ScriptedMx(host, port, mail=SILENT):
        slow = await deliver(
            target("mx.example.test", host),
            envelope(rcpt),
            body,
            settings_for(port, mail_timeout_s=0.3),
        )
    assert slow.replies[rcpt].is_temporary and "timed out" in slow.replies[rcpt].text


async def test_connection_lost_during_rcpt_defers_accepted_recipients() -> None:
    """RFC 5321 §6.1: a recipient already accepted at RCPT is not delivered until the data is
    accepted; when the connection drops at a later RCPT, both are deferred and no DATA is
    sent."""
    host = "127.0.2.98"
    port = shared_port([host])
    a, b = "a@drop.example.test", "b@drop.example.test"
    async with ScriptedMx(host, port, rcpt_replies={b: CLOSE}) as mx:
        result = await deliver(
            target("mx.drop.example.test", host),
            envelope(a, b),
            BodySource.from_bytes(b"Subject: t\r\n\r\nx\r\n"),
            settings_for(port),
        )
    assert result.deferred == [a, b]
    assert "DATA" not in verbs(mx)


async def test_starttls_refused_with_454_continues_in_plaintext() -> None:
    """RFC 3207 §4: a 454 to STARTTLS leaves the plaintext session usable; opportunistic
    TLS carries on in it (one connection), required TLS defers with 4.7.5."""
    host = "127.0.2.99"
    port = shared_port([host])
    body = BodySource.from_bytes(b"Subject: t\r\n\r\nx\r\n")
    rcpt = "bob@tls454.example.test"

    def refuse_tls(session: object, line: str) -> str | None:
        return "454 4.7.0 TLS not available" if line.upper() == "STARTTLS" else None

    extensions = ["8BITMIME", "STARTTLS"]
    async with ScriptedMx(host, port, extensions=extensions, hook=refuse_tls) as mx:
        result = await deliver(
            target("mx.example.test", host), envelope(rcpt), body, settings_for(port)
        )
        assert result.delivered == [rcpt] and not result.tls
        assert mx.connections == 1 and mx.sessions[0].verbs()[:3] == ["EHLO", "STARTTLS", "MAIL"]
        strict = settings_for(port, tls=TlsPolicy.REQUIRED)
        refused = await deliver(target("mx.example.test", host), envelope(rcpt), body, strict)
        assert refused.replies[rcpt].enhanced == "4.7.5"
        assert len(mx.delivered) == 1


async def test_smarthost_auth_after_starttls(certs: Certs) -> None:
    """Smarthost mode (RFC 4954): credentials go only to relay targets and only after
    STARTTLS; wrong credentials defer (4.7.8) instead of bouncing."""
    host = "127.0.2.96"
    port = shared_port([host])
    body = BodySource.from_bytes(b"Subject: t\r\n\r\nx\r\n")
    relay = [MxTarget(host="relay.example.test", address=host, port=port, relay=True)]
    good = settings_for(
        port,
        smarthost=SmarthostSettings(
            host="relay.example.test", port=port, username="u", password="pw"
        ),
    )
    bad = settings_for(
        port,
        smarthost=SmarthostSettings(
            host="relay.example.test", port=port, username="u", password="nope"
        ),
    )
    ctx = certs.server_context("relay.example.test")
    async with SmtpdMx(host, port, tls=ctx, users={"u": "pw"}) as mx:
        ok = await deliver(relay, envelope("bob@far.example.test"), body, good)
        assert ok.delivered == ["bob@far.example.test"] and ok.tls
        assert verbs(mx)[:4] == ["EHLO", "STARTTLS", "EHLO", "AUTH"]
        denied = await deliver(relay, envelope("bob@far.example.test"), body, bad)
        assert denied.replies["bob@far.example.test"].enhanced == "4.7.8"
        assert len(mx.delivered) == 1


async def test_smarthost_connect_failure_names_the_smarthost() -> None:
    """RFC 3463 §3.5 (X.4.1, no answer from host): a smarthost that refuses the connection
    defers every recipient with ``451 4.4.1`` naming the smarthost and its host:port, not
    "any mail exchanger of the domain"; an MX target keeps the MX wording. Both results
    name the host that was tried."""
    dead = "127.0.2.89"  # nothing listens there: the connection is refused
    port = shared_port([dead])
    body = unopenable(10)
    rcpt = "bob@far.example.test"
    relay_settings = settings_for(
        port, smarthost=SmarthostSettings(host="relay.example.test", port=port)
    )
    relay = [MxTarget(host="relay.example.test", address=dead, port=port, relay=True)]
    via_relay = await deliver(relay, envelope(rcpt), body, relay_settings)
    reply = via_relay.replies[rcpt]
    assert (reply.code, reply.enhanced, reply.remote_host) == (451, "4.4.1", None)
    assert reply.text.startswith("No answer from the smarthost (")
    assert f"relay.example.test [{dead}]:{port}" in reply.text
    assert "mail exchanger" not in reply.text
    assert via_relay.mx_host is None and via_relay.tried_host == "relay.example.test"

    via_mx = await deliver(
        target("mx.far.example.test", dead), envelope(rcpt), body, settings_for(port)
    )
    reply = via_mx.replies[rcpt]
    assert (reply.code, reply.enhanced) == (451, "4.4.1")
    assert reply.text.startswith("No answer from any mail exchanger of the domain (")
    assert f"mx.far.example.test [{dead}]:{port}" in reply.text
    assert via_mx.tried_host == "mx.far.example.test"


# --- a big message, streamed --------------------------------------------------------------

BIG_SIZE = 25 * 1024 * 1024


def big_message() -> tuple[Callable[[], AsyncIterator[bytes]], int, str]:
    """A ~25 MB message generated chunk by chunk (never whole in memory): opener, size and
    the SHA-256 of its bytes. Every 10th line starts with a dot."""
    header = b"From: a@example.test\r\nTo: b@big.example.test\r\nSubject: big\r\n\r\n"
    line = b"x" * 94 + b"\r\n"
    dotted = b"." + b"y" * 93 + b"\r\n"
    block = (line * 9 + dotted) * 256  # 245760 octets
    count = (BIG_SIZE - len(header)) // len(block)

    async def chunks() -> AsyncIterator[bytes]:
        yield header
        for _ in range(count):
            yield block

    digest = hashlib.sha256(header)
    for _ in range(count):
        digest.update(block)
    return chunks, len(header) + count * len(block), digest.hexdigest()


async def test_25mb_message_is_streamed_with_bounded_memory() -> None:
    """DESIGN.md (bodies are streamed) / RFC 5321 §4.5.2: a 25 MB body goes out chunk by
    chunk, dot-stuffed, with peak memory growth far below the message size (the fake MX
    only hashes what it receives)."""
    host = "127.0.2.97"
    port = shared_port([host])
    opener, size, sha256 = big_message()
    # The MX runs in this process: a small read buffer keeps its memory out of the count.
    async with ScriptedMx(host, port, keep_data=False, read_limit=64 * 1024) as mx:
        tracemalloc.start()
        try:
            baseline, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            result = await deliver(
                target("mx.big.example.test", host),
                envelope("b@big.example.test"),
                BodySource(open=opener, size=size),
                settings_for(port),
            )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert result.delivered == ["b@big.example.test"]
    assert mx.delivered[0].size == size and mx.delivered[0].sha256 == sha256
    assert size > 25_000_000
    print(f"peak growth {peak - baseline} octets")
    assert peak - baseline < size // 8, f"peak growth {peak - baseline} octets"


# --- connection cache (RFC 5321 §4.1.1.4: a new transaction after end of data) -------------


async def send_via(
    cache: ConnectionCache,
    host: str,
    address: str,
    settings: WorkerSettings,
    rcpt: str,
) -> DeliveryResult:
    """One small message to ``rcpt`` through ``cache`` at the MX ``host`` [``address``]."""
    body = BodySource.from_bytes(b"Subject: x\r\n\r\nhi\r\n")
    return await deliver(target(host, address), envelope(rcpt), body, settings, cache)


async def test_connection_cache_reuses_one_session_for_consecutive_deliveries() -> None:
    """Two deliveries to one MX within the idle time share one connection: one greeting and
    EHLO, two MAIL..DATA transactions, and QUIT only when the cache is closed."""
    host = "127.0.2.90"
    port = shared_port([host])
    cache = ConnectionCache(idle_s=30.0)
    async with SmtpdMx(host, port, name="mx.reuse.example.test") as mx:
        for rcpt in ("a@reuse.example.test", "b@reuse.example.test"):
            result = await send_via(cache, "mx.reuse.example.test", host, settings_for(port), rcpt)
            assert result.replies[rcpt].code == 250
            assert result.mx_host == "mx.reuse.example.test"
        assert mx.connections == 1
        assert [t.rcpt_to for t in mx.delivered] == [
            ["a@reuse.example.test"],
            ["b@reuse.example.test"],
        ]
        assert mx.sessions[0].verbs() == ["EHLO", "MAIL", "RCPT", "DATA", "MAIL", "RCPT", "DATA"]
        assert cache.idle == 1
        await cache.close()
        await mx.wait_for(lambda: mx.sessions[0].closed)
        assert mx.sessions[0].verbs()[-1] == "QUIT"
        assert cache.idle == 0


async def test_idle_session_gets_quit_after_the_idle_time() -> None:
    """An unused cached session is closed with QUIT once ``idle_s`` passed."""
    host = "127.0.2.91"
    port = shared_port([host])
    cache = ConnectionCache(idle_s=0.2)
    async with SmtpdMx(host, port) as mx:
        result = await send_via(
            cache, "mx.example.test", host, settings_for(port), "a@idle.example.test"
        )
        assert result.replies["a@idle.example.test"].code == 250
        assert cache.idle == 1
        await mx.wait_for(lambda: mx.sessions[0].closed)
        assert mx.sessions[0].verbs() == ["EHLO", "MAIL", "RCPT", "DATA", "QUIT"]
        assert cache.idle == 0


async def test_shed_quits_the_idle_sessions_asked_for_and_take_is_reported() -> None:
    """Two idle sessions to one MX; ``shed(1)`` QUITs one of them (the destination limits
    give a slot over a worker's fair share up that way) and keeps the other for reuse,
    whose take calls ``on_take`` (a delivery waiting for a session unit looks again)."""
    host = "127.0.2.93"
    port = shared_port([host])
    taken: list[None] = []
    cache = ConnectionCache(idle_s=30.0, on_take=lambda: taken.append(None))
    settings = settings_for(port)
    async with SmtpdMx(host, port) as mx:
        sends = [
            send_via(cache, "mx.example.test", host, settings, f"{r}@shed.example.test")
            for r in ("a", "b")
        ]
        assert all(r.mx_host for r in await asyncio.gather(*sends))
        assert (cache.idle, mx.connections, taken) == (2, 2, [])
        assert cache.shed(1) == 1
        assert (cache.idle, cache.closing) == (1, 1)
        await mx.wait_for(lambda: sum(s.closed for s in mx.sessions) == 1)
        assert [s.verbs()[-1] for s in mx.sessions if s.closed] == ["QUIT"]
        assert cache.shed(0) == 0 and cache.idle == 1
        await send_via(cache, "mx.example.test", host, settings, "c@shed.example.test")
        assert mx.connections == 2 and len(taken) == 1  # the idle one was reused
        await cache.close()


async def test_a_site_whose_session_is_out_with_a_delivery_keeps_its_cache() -> None:
    """The deliverer forgets the caches of unused sites past 4 × ``worker.concurrency``
    sites; a site whose session is out with a delivery is not unused: that session comes
    back into the site's cache, where the destination limits count it, shed it and QUIT it
    (a forgotten cache object kept it uncounted and open until its idle time ran out)."""
    host = "127.0.2.94"
    port = shared_port([host])
    domains = [f"d{i}.cache.example.test" for i in range(6)]
    zone = "".join(f"{d}. 300 IN MX 10 mx.cache.example.test.\n" for d in domains)
    zone += f"mx.cache.example.test. 300 IN A {host}\n"
    hold = asyncio.Event()
    settings = settings_for(port, concurrency=1, connection_cache_s=30.0)
    with DnsServer(zone) as dns:
        resolver = DnsResolver(dns.nameservers, port=dns.port, timeout_s=5.0)
        deliverer = SmtpDeliverer(resolver, settings)
        body = BodySource.from_bytes(b"Subject: x\r\n\r\nhi\r\n")

        async def send(domain: str) -> Attempt:
            entry = make_entry(None, domain=domain)
            return await deliverer.deliver(entry, domain, entry.recipients, body)

        async with ScriptedMx(host, port, hold=hold) as mx:
            first = asyncio.create_task(send(domains[0]))
            await mx.wait_for(lambda: mx.held == 1)
            mx.hold = None  # the others are answered at once
            for domain in domains[1:]:  # past 4 × concurrency sites: unused ones forgotten
                assert (await send(domain)).replies
            hold.set()
            attempt = await first
            assert attempt.replies["r0@" + domains[0]].code == 250
            assert deliverer.idle_sessions(domains[0]) == (1, 0), "counted where it went"
            deliverer.shed_idle(domains[0], 1)
            assert deliverer.idle_sessions(domains[0]) == (0, 1)
            await mx.wait_for(lambda: mx.sessions[0].closed)
            assert mx.sessions[0].verbs()[-1] == "QUIT"
            await deliverer.close()


@pytest.mark.parametrize("gone", [CLOSE, "421 4.4.2 mx.example.test idle timeout"])
async def test_cached_session_that_died_is_replaced_within_the_attempt(gone: str) -> None:
    """The server dropped (or 421-closed) the idle session: the next delivery reconnects to
    the same MX at once and succeeds; the dead session costs no deferral."""
    host = "127.0.2.92"
    port = shared_port([host])
    cache = ConnectionCache(idle_s=30.0)

    def idle_timeout(session: Session, line: str) -> str | None:
        return gone if line.upper().startswith("MAIL") and session.transactions else None

    async with ScriptedMx(host, port, hook=idle_timeout) as mx:
        for rcpt in ("a@dead.example.test", "b@dead.example.test"):
            result = await send_via(cache, "mx.example.test", host, settings_for(port), rcpt)
            assert result.replies[rcpt].code == 250, result.replies[rcpt]
        assert mx.connections == 2
        assert [len(s.transactions) for s in mx.sessions] == [1, 1]
    await cache.close()


@pytest.mark.parametrize(
    ("script", "code"),
    [
        ({"mail": "450 4.7.1 greylisted"}, 450),  # the transaction never reached DATA
        ({"end_of_data": "421 4.3.2 closing"}, 421),  # the server is going away
    ],
)
async def test_no_reuse_after_an_unfinished_transaction(script: dict[str, str], code: int) -> None:
    """Only a session whose transaction ended with a (non-421) reply to the final "." is
    kept; any other ends with QUIT as before."""
    host = "127.0.2.93"
    port = shared_port([host])
    cache = ConnectionCache(idle_s=30.0)
    async with ScriptedMx(host, port, **script) as mx:  # type: ignore[arg-type]
        result = await send_via(
            cache, "mx.example.test", host, settings_for(port), "a@grey.example.test"
        )
        assert result.replies["a@grey.example.test"].code == code
        assert cache.idle == 0
        await mx.wait_for(lambda: mx.sessions[0].closed)
    await cache.close()


async def test_session_older_than_the_reuse_limit_is_not_kept() -> None:
    """``max_age_s`` bounds a session's life from its connect (RFC 5321 leaves session
    length to the client; a long-lived session pins one MX address)."""
    host = "127.0.2.94"
    port = shared_port([host])
    # 0: every session is past the limit when the transaction ends (a tiny positive limit
    # is not, on a loop whose clock advances in milliseconds per iteration, as uvloop's)
    cache = ConnectionCache(idle_s=30.0, max_age_s=0.0)
    async with SmtpdMx(host, port) as mx:
        await send_via(cache, "mx.example.test", host, settings_for(port), "a@old.example.test")
        assert cache.idle == 0
        await mx.wait_for(lambda: mx.sessions[0].closed)
        assert mx.sessions[0].verbs()[-1] == "QUIT"
    await cache.close()


async def test_cached_plaintext_session_is_not_used_for_a_domain_requiring_tls(
    certs: Certs,
) -> None:
    """The cache key includes the TLS policy: a plaintext session opened for a domain with
    policy ``never`` is not reused for a domain sharing the MX whose policy is
    ``required``; that one gets its own STARTTLS session (RFC 3207)."""
    port = shared_port([TLS_HOST])
    cache = ConnectionCache(idle_s=30.0)
    settings = settings_for(
        port,
        tls=TlsPolicy.OPPORTUNISTIC,
        tls_policies={"plain.example.test": "never", "secure.example.test": "required"},
    )
    async with tls_server(certs, "OK", port) as mx:
        for rcpt in ("a@plain.example.test", "b@secure.example.test", "c@secure.example.test"):
            result = await send_via(cache, TLS_NAME, TLS_HOST, settings, rcpt)
            assert result.replies[rcpt].code == 250
        assert mx.connections == 2
        assert [s.tls for s in mx.sessions] == [False, True]
        assert [len(s.transactions) for s in mx.sessions] == [1, 2]
        assert [t.tls for t in mx.transactions] == [False, True, True]
    await cache.close()


async def test_reply_text_is_recorded_without_control_characters() -> None:
    """A next hop's reply text goes into the entry, DSNs, log lines and operators'
    terminals: C0 controls (ESC, BEL), DEL and the C1 controls (a one-octet CSI) become
    spaces, octets that are not UTF-8 the replacement character; the code and the text
    around them stay (RFC 5321 §4.2: the text is for humans, its codes are what count)."""
    host = "127.0.2.83"
    port = shared_port([host])
    rcpt = "bob@ctl.example.test"
    hostile = "550 5.1.1 no\x1b[2J such\x07 user\x7f here\u009b31m"
    async with ScriptedMx(host, port, rcpt_replies={rcpt: hostile}):
        result = await deliver(
            target("mx.ctl.example.test", host),
            envelope(rcpt),
            BodySource.from_bytes(b"Subject: t\r\n\r\nx\r\n"),
            settings_for(port),
        )
    reply = result.replies[rcpt]
    assert (reply.code, reply.enhanced, reply.is_permanent) == (550, "5.1.1", True)
    assert reply.text == "no [2J such  user  here 31m"
