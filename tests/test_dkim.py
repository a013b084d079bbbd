"""DKIM signing at egress (RFC 6376, RFC 8463): which key signs and which fields it covers
(pure), the keys read at start (a bad one is a one-line config error naming the setting),
and the bytes real sessions send to fake MXes on loopback, verified by dkimpy with the public
keys served by the loopback DNS server: 7-bit, converted to 7-bit for a server without
8BITMIME, multi-megabyte, and CASE-24's message that arrives signed by its author."""

from __future__ import annotations

import email
import email.policy
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from jsqueue.cli.render import render_detail
from jsqueue.config import WorkerSettings
from jsqueue.config.dkim import DkimSettings
from jsqueue.delivery import BodySource, DeliveryEnvelope, MxTarget, deliver
from jsqueue.delivery.dkim import DkimSigner, load_keys
from jsqueue.delivery.signing import (
    choose_domain,
    field_names,
    from_domains,
    header_list,
    signature_domains,
)
from jsqueue.envelope import Recipient
from jsqueue.errors import BodyNotFound, ConfigError
from jsqueue.events import Event, EventKind
from jsqueue.views import EntryDetail
from support.cases import case_message
from support.dkim import TestKey, signatures, verify
from support.dns import DnsServer
from support.mx import SmtpdMx, shared_port
from support.queue import Harness, eventually

LEGACY, MODERN = "127.0.2.200", "127.0.2.201"

# --------------------------------------------------------------------------- pure


def test_header_list_oversigns_from_and_singletons_and_skips_trace_fields() -> None:
    """RFC 6376 §5.4.1 fields present, each as often as it occurs, then From and the
    RFC 5322 singletons once more (§8.15); Received, Return-Path, Bcc, DKIM-Signature never
    (§5.4)."""
    names = field_names(
        b"Received: from a\r\n by b\r\nDKIM-Signature: v=1; d=x.test\r\nReturn-Path: <a@x>\r\n"
        b"From: a@x.test\r\nTo: b@y.test,\r\n c@y.test\r\nSubject: s\r\nBcc: z@z.test\r\n"
        b"References: <1@x>\r\nReferences: <2@x>\r\nX-Mailer: m\r\nMIME-Version: 1.0\r\n"
    )
    assert names[:4] == ["received", "dkim-signature", "return-path", "from"]
    assert header_list(names) == [
        "from",
        "to",
        "subject",
        "references",
        "references",
        "mime-version",
        "from",
        "subject",
        "to",
    ]
    assert header_list([]) == ["from"]  # From is always listed: none may be added


def test_from_domains_reads_folded_fields_and_display_names() -> None:
    section = b'Subject: x\r\nFrom: "Doe, Jane" <jane@Mail.Example.TEST>,\r\n\tbob@other.test\r\n'
    assert from_domains(section) == ["mail.example.test", "other.test"]
    assert from_domains(b"Subject: none\r\n") == []
    assert from_domains(b"From: undisclosed\r\n") == []


def test_choose_domain_exact_then_parent_then_none() -> None:
    keys = {"example.test", "mail.other.test"}

    def pick(author: str, reverse: str = "", by_reverse: bool = False) -> str | None:
        return choose_domain(
            keys, author_domains=[author], reverse_path=reverse, by_reverse_path=by_reverse
        )

    assert pick("example.test") == "example.test"
    assert pick("news.example.test") == "example.test"  # relaxed alignment (RFC 7489)
    assert pick("other.test") is None  # never a child domain
    assert pick("unknown.test") is None
    assert pick("example.test", "b@mail.other.test", by_reverse=True) == "mail.other.test"
    assert pick("example.test", "", by_reverse=True) == "example.test"  # <> falls back to From
    assert choose_domain(keys, author_domains=[], reverse_path="", by_reverse_path=False) is None


def test_signature_domains_of_existing_fields() -> None:
    section = case_message("CASE-24", "message-8bit-dkim.eml").split(b"\r\n\r\n")[0] + b"\r\n"
    assert signature_domains(section) == ["example.test"]


# --------------------------------------------------------------------------- keys


def test_keys_from_a_directory_in_both_layouts(tmp_path: Path) -> None:
    """``<domain>/<selector>.key`` and ``<selector>._domainkey.<domain>.key``; a mounted
    Secret's hidden ``..data`` entries and other files are skipped."""
    TestKey.ed25519("example.test", "a").write(tmp_path / "example.test" / "ed.key")
    TestKey.rsa("other.test", "r").write(tmp_path / "rsa1._domainkey.other.test.key")
    (tmp_path / "..data").mkdir()
    TestKey.ed25519("x.test", "h").write(tmp_path / "..data" / "h._domainkey.x.test.key")
    (tmp_path / "README").write_text("not a key")
    keys = load_keys(DkimSettings(keys_dir=tmp_path))
    assert [k.describe() for k in keys] == [
        "d=example.test s=ed a=ed25519-sha256",
        "d=other.test s=rsa1 a=rsa-sha256",
    ]


@pytest.mark.parametrize("ktype", ["ed25519", "rsa"])
async def test_keys_made_by_dknewkey_and_their_dns_file_work(tmp_path: Path, ktype: str) -> None:
    """The README's key set-up: dkimpy's ``dknewkey`` writes the private key and the TXT
    record; jsqueue loads the key, and its signature verifies against that record."""
    _dknewkey(tmp_path, ktype)
    [key] = load_keys(DkimSettings(keys_dir=_flat(tmp_path / "sel.key", "sel", "example.test")))
    assert key.algorithm.value == f"{ktype}-sha256"
    txt = (tmp_path / "sel.dns").read_text().strip()
    parts = " ".join(f'"{txt[i : i + 200]}"' for i in range(0, len(txt), 200))
    with DnsServer(f"sel._domainkey.example.test. TXT {parts}\n") as dns:
        signer = DkimSigner([key], DkimSettings())
        signed = await signer.sign(SEVEN_BIT, signer.keys_for(SEVEN_BIT, ""))
        signer.close()
        assert verify(signed.header + SEVEN_BIT, dns)


def _dknewkey(directory: Path, ktype: str) -> None:
    dknewkey = Path(sys.executable).parent / "dknewkey"
    subprocess.run(
        [str(dknewkey), "--ktype", ktype, "sel"], cwd=directory, check=True, capture_output=True
    )


def _flat(key: Path, selector: str, domain: str) -> Path:
    """A keys_dir holding ``key`` under its flat Secret name."""
    directory = key.parent / "keys"
    directory.mkdir()
    (directory / f"{selector}._domainkey.{domain}.key").write_bytes(key.read_bytes())
    return directory


@pytest.mark.parametrize(
    ("content", "algorithm", "reason"),
    [
        (None, None, "No such file or directory"),
        ("dir", None, "Is a directory"),
        (b"hello", None, "neither a PEM RSA key nor a base64 Ed25519 seed"),
        (b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", None, "not a PEM"),
        ("ed25519", "rsa-sha256", "an ed25519-sha256 key, not rsa-sha256"),
    ],
)
def test_a_bad_key_file_is_one_line_naming_the_setting(
    tmp_path: Path, content: bytes | str | None, algorithm: str | None, reason: str
) -> None:
    path = tmp_path / "k.key"
    if content == "dir":
        path.mkdir()
    elif content == "ed25519":
        TestKey.ed25519("example.test", "s").write(path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    good = tmp_path / "good.key"
    TestKey.ed25519("example.test", "good").write(good)
    settings = DkimSettings.model_validate(
        {
            "keys": [
                {"domain": "example.test", "selector": "good", "key_file": good},
                {
                    "domain": "example.test",
                    "selector": "s",
                    "key_file": path,
                    "algorithm": algorithm,
                },
            ]
        }
    )
    with pytest.raises(ConfigError) as info:
        load_keys(settings)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"worker.dkim.keys[1].key_file {path}: ")
    assert reason in message


def test_the_same_selector_twice_is_refused(tmp_path: Path) -> None:
    TestKey.ed25519("example.test", "s").write(tmp_path / "example.test" / "s.key")
    other = TestKey.ed25519("example.test", "s").write(tmp_path / "other.key")
    settings = DkimSettings.model_validate(
        {
            "keys_dir": tmp_path / "example.test" / "..",
            "keys": [{"domain": "example.test", "selector": "s", "key_file": other}],
        }
    )
    with pytest.raises(ConfigError, match=r"worker.dkim.keys\[0\].key_file: selector s of"):
        load_keys(settings)


def test_worker_with_a_missing_key_file_stops_at_start_with_one_line(tmp_path: Path) -> None:
    """A missing key file stops ``jsqueue worker`` before it connects anywhere: exit 2 and
    one line naming the setting (no NATS is running for this test)."""
    env = {
        **os.environ,
        "JSQUEUE_NATS__URLS": '["nats://127.0.0.1:9"]',
        "JSQUEUE_WORKER__DKIM__KEYS": (
            f'[{{"domain": "example.test", "selector": "s1", "key_file": "{tmp_path}/gone.key"}}]'
        ),
    }
    env.pop("JSQUEUE_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "jsqueue", "worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == (
        "jsqueue: invalid configuration: worker.dkim.keys[0].key_file "
        f"{tmp_path}/gone.key: No such file or directory"
    ), proc.stderr


# --------------------------------------------------------------------------- on the wire


def settings_for(
    port: int, key_files: list[tuple[TestKey, Path]], **dkim: object
) -> WorkerSettings:
    keys = [{"domain": k.domain, "selector": k.selector, "key_file": str(p)} for k, p in key_files]
    return WorkerSettings.model_validate(
        {
            "mx_port": port,
            "ehlo_name": "worker.example.test",
            "connect_timeout_s": 5.0,
            "greeting_timeout_s": 5.0,
            "mail_timeout_s": 5.0,
            "rcpt_timeout_s": 5.0,
            "data_init_timeout_s": 5.0,
            "data_block_timeout_s": 30.0,
            "data_final_timeout_s": 30.0,
            "dkim": {"keys": keys, **dkim},
        }
    )


def envelope(address: str, sender: str = "alice@example.test", **kw: object) -> DeliveryEnvelope:
    r = Recipient.from_address(address)
    return DeliveryEnvelope(domain=r.domain, reverse_path=sender, recipients=(r,), **kw)  # type: ignore[arg-type]


def to(host: str, address: str) -> list[MxTarget]:
    return [MxTarget(host=host, address=address)]


@pytest.fixture
def keys(tmp_path: Path) -> list[tuple[TestKey, Path]]:
    """An Ed25519 and an RSA key of example.test (RFC 8463 §4: both sign)."""
    ed = TestKey.ed25519("example.test", "jsq-ed")
    rs = TestKey.rsa("example.test", "jsq-rsa")
    return [(ed, ed.write(tmp_path / "ed.key")), (rs, rs.write(tmp_path / "rsa.key"))]


def zone(*ks: TestKey) -> str:
    return "".join(k.zone_line() for k in ks)


SEVEN_BIT = (
    b"From: Alice <alice@example.test>\r\nTo: bob@modern.example.test\r\n"
    b"Subject: plain\r\nDate: Mon, 02 Mar 2026 09:00:00 +0000\r\n"
    b"Message-ID: <plain@example.test>\r\n\r\nHello  Bob,\t \r\n.dot line\r\n\r\n\r\n"
)


async def test_7bit_message_signed_by_both_keys_and_verified(
    keys: list[tuple[TestKey, Path]],
) -> None:
    """The bytes the MX received are our fields on top of the message, unchanged; each
    signature verifies with the key the loopback DNS serves; From is oversigned; no l=."""
    port = shared_port([MODERN])
    with DnsServer(zone(*(k for k, _ in keys))) as dns:
        async with SmtpdMx(MODERN, port) as mx:
            result = await deliver(
                to("mx.modern.example.test", MODERN),
                envelope("bob@modern.example.test"),
                BodySource.from_bytes(SEVEN_BIT),
                settings_for(port, keys),
                signer=DkimSigner.from_settings(settings_for(port, keys).dkim),
            )
        assert result.delivered == ["bob@modern.example.test"]
        sent = mx.delivered[0].content
        assert sent is not None
        assert verify(sent, dns, 0) and verify(sent, dns, 1)
    tags = signatures(sent)
    assert [(t[b"s"], t[b"a"]) for t in tags] == [
        (b"jsq-ed", b"ed25519-sha256"),
        (b"jsq-rsa", b"rsa-sha256"),
    ]
    for t in tags:
        assert t[b"d"] == b"example.test" and t[b"c"] == b"relaxed/relaxed"
        assert b"l" not in t
        h = [x.strip() for x in t[b"h"].split(b":")]
        assert h.count(b"from") == 2 and {b"subject", b"date", b"to", b"message-id"} <= set(h)
    fields_end = sent.index(b"From: Alice")
    assert sent[fields_end:] == SEVEN_BIT
    assert result.dkim == (
        "d=example.test s=jsq-ed a=ed25519-sha256, d=example.test s=jsq-rsa a=rsa-sha256"
    )


async def test_a_tampered_message_fails_verification(keys: list[tuple[TestKey, Path]]) -> None:
    """The verification is real: a changed body or Subject fails it."""
    port = shared_port([MODERN])
    with DnsServer(zone(*(k for k, _ in keys))) as dns:
        async with SmtpdMx(MODERN, port) as mx:
            await deliver(
                to("mx.modern.example.test", MODERN),
                envelope("bob@modern.example.test"),
                BodySource.from_bytes(SEVEN_BIT),
                settings_for(port, keys),
                signer=DkimSigner.from_settings(settings_for(port, keys).dkim),
            )
        sent = mx.delivered[0].content
        assert sent is not None and verify(sent, dns)
        assert not verify(sent.replace(b"Hello", b"Jello"), dns)
        assert not verify(sent.replace(b"Subject: plain", b"Subject: plane"), dns)


async def test_no_key_for_the_author_domain_means_unsigned(
    keys: list[tuple[TestKey, Path]],
) -> None:
    port = shared_port([MODERN])
    message = SEVEN_BIT.replace(b"alice@example.test", b"alice@elsewhere.test")
    async with SmtpdMx(MODERN, port) as mx:
        result = await deliver(
            to("mx.modern.example.test", MODERN),
            envelope("bob@modern.example.test"),
            BodySource.from_bytes(message),
            settings_for(port, keys),
            signer=DkimSigner.from_settings(settings_for(port, keys).dkim),
        )
    assert mx.delivered[0].content == message
    assert result.dkim is None


async def test_over_max_sign_octets_goes_unsigned_and_says_so(
    keys: list[tuple[TestKey, Path]],
) -> None:
    port = shared_port([MODERN])
    s = settings_for(port, keys, max_sign_octets=100)
    async with SmtpdMx(MODERN, port) as mx:
        result = await deliver(
            to("mx.modern.example.test", MODERN),
            envelope("bob@modern.example.test"),
            BodySource.from_bytes(SEVEN_BIT),
            s,
            signer=DkimSigner.from_settings(s.dkim),
        )
    assert mx.delivered[0].content == SEVEN_BIT
    assert result.dkim == (f"unsigned: {len(SEVEN_BIT)} octets > worker.dkim.max_sign_octets 100")


async def test_without_keys_the_body_is_read_once_and_sent_as_it_is() -> None:
    """No key configured: no read for signing, the session streams the message once."""
    opened = 0
    plain = BodySource.from_bytes(SEVEN_BIT)

    def counting() -> AsyncIterator[bytes]:
        nonlocal opened
        opened += 1
        return plain.open()

    port = shared_port([MODERN])
    s = settings_for(port, [])
    async with SmtpdMx(MODERN, port) as mx:
        result = await deliver(
            to("mx.modern.example.test", MODERN),
            envelope("bob@modern.example.test"),
            BodySource(open=counting, size=plain.size),
            s,
            signer=DkimSigner.from_settings(s.dkim),
        )
    assert mx.delivered[0].content == SEVEN_BIT
    assert opened == 1 and result.dkim is None


async def test_a_body_gone_before_signing_defers_and_sends_nothing(
    keys: list[tuple[TestKey, Path]],
) -> None:
    """The body is read for the signature before MAIL; if it is gone (an admin delete),
    the transaction ends before its final dot with 451 4.3.0, as for a failure during
    DATA, and nothing is delivered, signed or not."""

    async def gone() -> AsyncIterator[bytes]:
        raise BodyNotFound("q1")
        yield b""

    port = shared_port([MODERN])
    s = settings_for(port, keys)
    async with SmtpdMx(MODERN, port) as mx:
        result = await deliver(
            to("mx.modern.example.test", MODERN),
            envelope("bob@modern.example.test"),
            BodySource(open=gone, size=100),
            s,
            signer=DkimSigner.from_settings(s.dkim),
        )
    reply = result.replies["bob@modern.example.test"]
    assert (reply.code, reply.enhanced) == (451, "4.3.0"), reply
    assert mx.delivered == []


async def test_a_message_dkimpy_cannot_parse_goes_unsigned_and_says_why(
    keys: list[tuple[TestKey, Path]],
) -> None:
    """A header line that is no field (RFC 5322 §2.2) makes dkimpy refuse: the message is
    delivered as it came, unsigned, and the attempt says why (SigningError)."""
    message = b"From: a@example.test\r\nnot a header line\r\nSubject: x\r\n\r\nbody\r\n"
    port = shared_port([MODERN])
    s = settings_for(port, keys)
    async with SmtpdMx(MODERN, port) as mx:
        result = await deliver(
            to("mx.modern.example.test", MODERN),
            envelope("bob@modern.example.test"),
            BodySource.from_bytes(message),
            s,
            signer=DkimSigner.from_settings(s.dkim),
        )
    assert mx.delivered[0].content == message
    assert result.dkim is not None
    assert result.dkim.startswith("unsigned: d=example.test s=jsq-ed a=ed25519-sha256: ")
    assert "not a header line" in result.dkim


def _author_signed_case24(author: TestKey) -> bytes:
    """CASE-24's DKIM variant with a real author signature in place of the placeholder."""
    message = case_message("CASE-24", "message-8bit-dkim.eml")
    unsigned = message[message.index(b"From: ") :]
    return author.sign(unsigned)


async def test_case24_dkim_variant_converted_our_signature_verifies_theirs_may_not(
    keys: list[tuple[TestKey, Path]],
) -> None:
    """CASE-24 item 4: the message arrives signed by its author (d=example.test s=sel1)
    and goes to an MX without 8BITMIME. jsqueue converts it to 7-bit and signs after the
    conversion: our signatures verify on the bytes received. The author's signature covered
    the 8-bit body, so it no longer verifies, and the attempt says it may not (never that it
    does). To the 8BITMIME MX the bytes are unchanged: every signature verifies."""
    author = TestKey.rsa("example.test", "sel1")
    original = _author_signed_case24(author)
    port = shared_port([LEGACY, MODERN])
    s = settings_for(port, keys)
    signer = DkimSigner.from_settings(s.dkim)
    with DnsServer(zone(author, *(k for k, _ in keys))) as dns:
        assert verify(original, dns)  # the author's signature is good on arrival
        async with (
            SmtpdMx(LEGACY, port, eight_bit=False) as legacy,
            SmtpdMx(MODERN, port) as modern,
        ):
            old = await deliver(
                to("mx.legacy.example.test", LEGACY),
                envelope("user@legacy.example.test", body_8bit=True),
                BodySource.from_bytes(original),
                s,
                signer=signer,
            )
            new = await deliver(
                to("mx.modern.example.test", MODERN),
                envelope("user@modern.example.test", body_8bit=True),
                BodySource.from_bytes(original),
                s,
                signer=signer,
            )
        converted = legacy.delivered[0].content
        assert converted is not None and converted.isascii() and old.converted_7bit
        assert "BODY=8BITMIME" not in legacy.delivered[0].mail_params
        assert [t[b"s"] for t in signatures(converted)] == [b"jsq-ed", b"jsq-rsa", b"sel1"]
        assert verify(converted, dns, 0) and verify(converted, dns, 1)
        assert not verify(converted, dns, 2)  # the author's: broken by the conversion
        parsed = email.message_from_bytes(converted, policy=email.policy.default)
        assert parsed["Content-Transfer-Encoding"] == "quoted-printable"
        assert "Grüße aus Köln" in parsed.get_content()
        assert old.dkim is not None
        assert old.dkim.startswith("d=example.test s=jsq-ed a=ed25519-sha256, ")
        assert old.dkim.endswith(
            "7-bit conversion: the message's own DKIM signature(s) d=example.test "
            "may no longer verify"
        )

        unchanged = modern.delivered[0].content
        assert unchanged is not None and unchanged.endswith(original)
        assert "BODY=8BITMIME" in modern.delivered[0].mail_params
        assert all(verify(unchanged, dns, i) for i in range(3))
        assert new.dkim is not None and "may no longer verify" not in new.dkim


async def test_case24_placeholder_signature_without_our_key_is_never_claimed_valid() -> None:
    """CASE-24 item 4 as the case ships it (a placeholder signature, no key of ours): the
    converted message is sent unsigned by us and the attempt says the author's signature
    may no longer verify; nothing says it verifies."""
    port = shared_port([LEGACY])
    s = settings_for(port, [])
    async with SmtpdMx(LEGACY, port, eight_bit=False) as legacy:
        result = await deliver(
            to("mx.legacy.example.test", LEGACY),
            envelope("user@legacy.example.test", body_8bit=True),
            BodySource.from_bytes(case_message("CASE-24", "message-8bit-dkim.eml")),
            s,
            signer=DkimSigner.from_settings(s.dkim),
        )
    sent = legacy.delivered[0].content
    assert sent is not None and sent.isascii()
    assert [t[b"s"] for t in signatures(sent)] == [b"sel1"]
    assert result.dkim == (
        "none of ours; 7-bit conversion: the message's own DKIM signature(s) d=example.test "
        "may no longer verify"
    )


def _big_message(octets: int, eight_bit: bool) -> bytes:
    line = ("Grüße aus Köln, " if eight_bit else "Greetings from Koeln, ") + "x" * 50 + "  \r\n"
    head = (
        b"From: Alice <alice@example.test>\r\nTo: bob@x.example.test\r\nSubject: big\r\n"
        b"Date: Mon, 02 Mar 2026 09:00:00 +0000\r\nMIME-Version: 1.0\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\n"
        + (b"Content-Transfer-Encoding: 8bit\r\n" if eight_bit else b"")
        + b"\r\n"
    )
    data = line.encode()
    return head + data * (octets // len(data))


@pytest.mark.parametrize("eight_bit", [False, True], ids=["7bit-12MB", "8bit-converted-12MB"])
async def test_multi_megabyte_messages_are_signed_and_verify(
    keys: list[tuple[TestKey, Path]], eight_bit: bool
) -> None:
    """12 MB: 7-bit to the 8BITMIME MX, 8-bit converted for the MX without it."""
    message = _big_message(12 * 1024 * 1024, eight_bit)
    host = LEGACY if eight_bit else MODERN
    port = shared_port([host])
    s = settings_for(port, keys)
    with DnsServer(zone(*(k for k, _ in keys))) as dns:
        async with SmtpdMx(host, port, eight_bit=not eight_bit) as mx:
            result = await deliver(
                to("mx.example.test", host),
                envelope("bob@x.example.test", body_8bit=eight_bit),
                BodySource.from_bytes(message),
                s,
                signer=DkimSigner.from_settings(s.dkim),
            )
        assert result.delivered == ["bob@x.example.test"]
        sent = mx.delivered[0].content
        assert sent is not None and len(sent) > 12 * 1000 * 1000
        assert result.converted_7bit is eight_bit
        assert verify(sent, dns, 0) and verify(sent, dns, 1)


# --------------------------------------------------------------------------- worker


class _Events:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


async def test_worker_attempt_log_events_and_queue_show_say_what_signed(
    queue_harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the real front end and a worker: the deferred attempt's log line, its event
    and ``queue show`` say ``d=… s=… a=…``; the delivered message verifies."""
    caplog.set_level(logging.INFO, logger="jsqueue.worker")
    h = queue_harness
    key = TestKey.ed25519("example.test", "jsq")
    dkim = DkimSettings.model_validate(
        {
            "keys": [
                {"domain": "example.test", "selector": "jsq", "key_file": key.write(tmp_path / "k")}
            ]
        }
    )
    h.configure(worker={"dkim": dkim}, retry={"base_s": 1.0})
    h.dns.add(
        key.zone_line()
        + "signed.example.test. 300 IN MX 10 mx.signed.example.test.\n"
        + "mx.signed.example.test. 300 IN A 127.0.2.61\n"
    )
    summary = "d=example.test s=jsq a=ed25519-sha256"
    async with SmtpdMx("127.0.2.61", h.mx_port, data_reply="451 4.3.0 try later") as mx:
        qid = await h.submit(SEVEN_BIT, ["bob@signed.example.test"])
        seen = _Events()
        async with h.running(h.worker(observer=seen)):

            async def deferred() -> bool:
                e = await h.entry(qid)
                return e is not None and e.recipients[0].attempts >= 1

            await eventually(deferred, what="the 451 recorded")
            v = await h.stores.entries.get(qid)
            assert v.entry.dkim == summary
            shown = render_detail(EntryDetail.of_versioned(v))
            assert f"dkim:         {summary}" in shown
            mx.data_reply = None
            await eventually(lambda: bool(mx.delivered), what="delivered")
            await eventually(
                lambda: EventKind.DELIVERED in [e.kind for e in seen.events], what="event"
            )
    by_kind = {e.kind: e for e in seen.events}
    assert by_kind[EventKind.DEFERRED].dkim == summary
    assert by_kind[EventKind.DELIVERED].dkim == summary
    assert any(f"dkim={summary!r}" in r.getMessage() for r in caplog.records)
    sent = mx.delivered[0].content
    assert sent is not None and verify(sent, h.dns)
