"""End to end with an independent DKIM verifier: swaks → jsqueue (``python -m jsqueue up``,
DKIM keys in ``worker.dkim.keys_dir``) → Postfix with OpenDKIM as its milter → Maildir.

One Postfix instance (Debian's package, own config dir) is the MX of two domains on two
loopback addresses sharing one port: ``modern.example.test`` (8BITMIME offered) and
``legacy.example.test`` (``smtpd_discard_ehlo_keywords = 8bitmime``: jsqueue must convert an
8-bit message to 7-bit). OpenDKIM (Debian's package, run by the test in the foreground,
never the system service) verifies every signature and adds ``Authentication-Results``;
it fetches the public keys from the loopback DNS server through libunbound
(:mod:`support.opendkim`). jsqueue signs with an Ed25519 and an RSA key of
``example.test`` (RFC 8463 §4: both).

Checks (RFC 6376; RFC 6152 §3): a 7-bit message, a message converted to 7-bit, and a 12 MB
message each arrive with ``dkim=pass`` for both of our signatures in OpenDKIM's verdict, and
dkimpy agrees on the delivered file; CASE-24's message signed by its author arrives at the
legacy MX converted, our signatures pass and the author's fails (conversion breaks it, as
documented), while at the modern MX it is unchanged and all three pass.

Needs Postfix, swaks and OpenDKIM installed (``make tools``). Nothing leaves 127.0.0.0/8.
"""

from __future__ import annotations

import email
import email.policy
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.cases import case_message
from support.dkim import TestKey, verify
from support.dns import DnsServer
from support.opendkim import AUTHSERV_ID, OpenDkim
from support.postfix import SWAKS, JsqueueProcess, Postfix, make_workdir, require_tools, up_env

MODERN = "modern.example.test"
LEGACY = "legacy.example.test"
ALICE = "alice@example.test"
BOB_MODERN = f"bob@{MODERN}"
BOB_LEGACY = f"bob@{LEGACY}"
USER_MODERN = f"user@{MODERN}"
USER_LEGACY = f"user@{LEGACY}"
OURS = ("jsq-ed", "jsq-rsa")
_QUEUED = re.compile(r"queued as (\S+)")

pytestmark = pytest.mark.timeout(240)


class Site:
    def __init__(self, mx: Postfix, jsq: JsqueueProcess, port: int, dns: DnsServer) -> None:
        self.mx = mx
        self.jsq = jsq
        self.smtp_port = port
        self.dns = dns


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    require_tools(SWAKS)
    path = make_workdir("jsqueue-e2e-dkim-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def author() -> TestKey:
    """The author domain's own key (CASE-24's ``s=sel1``), not jsqueue's."""
    return TestKey.rsa("example.test", "sel1")


@pytest.fixture(scope="module")
def site(workdir: Path, author: TestKey) -> Iterator[Site]:
    ed = TestKey.ed25519("example.test", "jsq-ed")
    rsa = TestKey.rsa("example.test", "jsq-rsa")
    keys = workdir / "dkim-keys"  # both layouts of worker.dkim.keys_dir
    ed.write(keys / "example.test" / "jsq-ed.key")
    rsa.write(keys / "jsq-rsa._domainkey.example.test.key")
    legacy_host = "127.0.3.201"
    modern_host = "127.0.3.200"
    zone = (
        ed.zone_line()
        + rsa.zone_line()
        + author.zone_line()
        + f"{MODERN}. MX 10 mx.{MODERN}.\nmx.{MODERN}. A {modern_host}\n"
        + f"{LEGACY}. MX 10 mx.{LEGACY}.\nmx.{LEGACY}. A {legacy_host}\n"
    )
    with DnsServer(zone) as dns, OpenDkim(workdir / "opendkim", dns) as milter:
        mx = Postfix.mx(
            workdir / "postfix",
            [BOB_MODERN, BOB_LEGACY, USER_MODERN, USER_LEGACY],
            host=modern_host,
            extra={
                **milter.postfix_settings(),
                "message_size_limit": "52428800",
                "virtual_mailbox_limit": "0",
            },
            listeners={legacy_host: {"smtpd_discard_ehlo_keywords": "8bitmime"}},
        )
        mx.start()
        env = up_env(workdir, mx, dns, nats__prefix="jsqdkim", worker__dkim__keys_dir=str(keys))
        jsq = JsqueueProcess(["up"], env, workdir / "jsqueue.log").start()
        try:
            port = int(jsq.wait_for_log(r"SMTP front end listening on [\d.]+:(\d+)").group(1))
            jsq.wait_for_log(r"jsqueue running")
            yield Site(mx, jsq, port, dns)
        finally:
            status = jsq.stop()
            mx.remove()
        assert status == 0, f"jsqueue up exited with {status}:\n{jsq.log()[-3000:]}"


# --------------------------------------------------------------------------- helpers


def submit(site: Site, recipients: list[str], message: bytes, path: Path) -> str:
    """swaks ``message`` (CRLF) to the front end; the file is written with LF and without
    the last line end, which swaks adds back."""
    assert message.endswith(b"\r\n")
    path.write_bytes(message.replace(b"\r\n", b"\n")[:-1])
    args = [SWAKS, "--server", "127.0.0.1", "--port", str(site.smtp_port)]
    args += ["--helo", "client.example.test", "--from", ALICE, "--to", ",".join(recipients)]
    args += ["--data", f"@{path}", "--timeout", "60"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"swaks failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
    match = _QUEUED.search(proc.stdout)
    assert match, proc.stdout[-3000:]
    return match.group(1)


def delivered(site: Site, address: str, subject: str, timeout_s: float = 90.0) -> bytes:
    """The one message with ``subject`` in ``address``'s Maildir (waits for it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for path in site.mx.messages(address):
            data = path.read_bytes()
            if f"\nSubject: {subject}\n".encode() in data:
                return data
        if time.monotonic() > deadline:
            pytest.fail(f"no {subject!r} for {address}:\n{site.mx.log_tail()}")
        time.sleep(0.1)


def verdicts(message: bytes) -> dict[str, str]:
    """OpenDKIM's results in the Authentication-Results field it added (RFC 8601):
    selector (``header.s``) → result (``pass``, ``fail`` …)."""
    parsed = email.message_from_bytes(message, policy=email.policy.compat32)
    out: dict[str, str] = {}
    for value in parsed.get_all("Authentication-Results", []):
        text = re.sub(r"\([^)]*\)", "", " ".join(str(value).split()))  # comments
        authserv, _, rest = text.partition(";")
        if authserv.strip() != AUTHSERV_ID:
            continue
        for clause in rest.split(";"):
            m = re.search(r"dkim=(\w+)", clause)
            s = re.search(r"header\.s=(\S+)", clause)
            if m and s:
                out[s.group(1)] = m.group(1)
    return out


def message(subject: str, body: bytes, eight_bit: bool, to: str) -> bytes:
    head = (
        f"From: Alice <{ALICE}>\r\nTo: {to}\r\nSubject: {subject}\r\n"
        f"Date: Mon, 02 Mar 2026 09:00:00 +0000\r\nMessage-ID: <{subject}@example.test>\r\n"
        "MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\n"
        + ("Content-Transfer-Encoding: 8bit\r\n" if eight_bit else "")
        + "\r\n"
    ).encode()
    return head + body


# --------------------------------------------------------------------------- tests


def test_7bit_message_passes_opendkim(site: Site, workdir: Path) -> None:
    body = b"Hello Bob,\r\n.a dotted line\r\ntrailing blanks   \r\n\tindented\r\n"
    submit(site, [BOB_MODERN], message("seven", body, False, BOB_MODERN), workdir / "7.eml")
    got = delivered(site, BOB_MODERN, "seven")
    assert verdicts(got) == {"jsq-ed": "pass", "jsq-rsa": "pass"}, got[:3000].decode()
    assert verify(got, site.dns, 0) and verify(got, site.dns, 1)


def test_8bit_message_converted_for_legacy_mx_passes_opendkim(site: Site, workdir: Path) -> None:
    body = "Grüße aus Köln,\r\nanbei die Übersicht für März.\r\n".encode()
    submit(site, [BOB_LEGACY], message("eight", body, True, BOB_LEGACY), workdir / "8.eml")
    got = delivered(site, BOB_LEGACY, "eight")
    assert got.isascii(), "converted to 7-bit for the MX without 8BITMIME"
    parsed = email.message_from_bytes(got, policy=email.policy.default)
    assert parsed["Content-Transfer-Encoding"] == "quoted-printable"
    assert "Grüße aus Köln" in parsed.get_content()
    assert verdicts(got) == {"jsq-ed": "pass", "jsq-rsa": "pass"}, got[:3000].decode()


@pytest.mark.parametrize(("to", "eight_bit"), [(BOB_MODERN, False), (BOB_LEGACY, True)])
def test_12_megabyte_message_passes_opendkim(
    site: Site, workdir: Path, to: str, eight_bit: bool
) -> None:
    line = ("Grüße aus Köln " if eight_bit else "Greetings, Koeln ") + "x" * 60 + " \r\n"
    data = line.encode()
    body = data * (12 * 1024 * 1024 // len(data))
    subject = f"big-{'8bit' if eight_bit else '7bit'}"
    submit(site, [to], message(subject, body, eight_bit, to), workdir / f"{subject}.eml")
    got = delivered(site, to, subject, timeout_s=150)
    assert len(got) > 12 * 1000 * 1000
    if eight_bit:
        assert got.isascii(), "converted to 7-bit for the MX without 8BITMIME"
    assert verdicts(got) == {"jsq-ed": "pass", "jsq-rsa": "pass"}


def test_case24_author_signature_broken_by_conversion_ours_pass(
    site: Site, workdir: Path, author: TestKey
) -> None:
    """CASE-24 item 4 with a real author signature (d=example.test s=sel1): converted for
    the legacy MX, the author's signature fails at OpenDKIM and ours pass; unchanged at the
    modern MX, all pass."""
    case = case_message("CASE-24", "message-8bit-dkim.eml")
    signed = author.sign(case[case.index(b"From: ") :])
    submit(site, [USER_LEGACY, USER_MODERN], signed, workdir / "case24.eml")
    subject = "Monatsbericht (signiert)"
    legacy = delivered(site, USER_LEGACY, subject)
    modern = delivered(site, USER_MODERN, subject)
    assert legacy.isascii()
    assert verdicts(legacy) == {"jsq-ed": "pass", "jsq-rsa": "pass", "sel1": "fail"}
    assert verdicts(modern) == {"jsq-ed": "pass", "jsq-rsa": "pass", "sel1": "pass"}
