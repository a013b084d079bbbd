"""STARTTLS and AUTH at the front end (RFC 3207, RFC 4954, RFC 4616), with a trustme CA and
real clients: smtplib, aiosmtplib, swaks and the raw reply-counting client."""

from __future__ import annotations

import asyncio
import base64
import shutil
import smtplib
from email.message import EmailMessage
from pathlib import Path

import aiosmtplib
import pytest

from jsqueue.frontend.auth import hash_password
from jsqueue.store.base import Stores
from jsqueue.store.memory import open_memory
from support.cases import case_file
from support.frontend import (
    FrontendCerts,
    Wire,
    dot_stuff,
    entries_of,
    frontend_settings,
    queued_id,
    running,
    split_body,
)
from support.nats import read_body

PASSWORD = "correct horse"


@pytest.fixture
def mem() -> Stores:
    return open_memory()


@pytest.fixture
def certs(tmp_path: Path) -> FrontendCerts:
    return FrontendCerts(tmp_path)


@pytest.fixture
def auth_file(tmp_path: Path) -> Path:
    path = tmp_path / "users"
    path.write_text(f"alice:{hash_password(PASSWORD, ln=10)}\n")
    return path


def plain(user: str, password: str, authz: str = "") -> str:
    return base64.b64encode(f"{authz}\0{user}\0{password}".encode()).decode()


async def tls_wire(port: int, certs: FrontendCerts, *, source: str | None = None) -> Wire:
    """Connected, STARTTLS done, EHLO not yet sent inside TLS."""
    w = await Wire.connect(port, source=source)
    ehlo = await w.expect("EHLO client.example.test", 250)
    assert "STARTTLS" in ehlo.lines
    await w.expect("STARTTLS", 220)
    await w.starttls(certs.client_context(), certs.name)
    return w


async def test_starttls_with_smtplib(mem: Stores, certs: FrontendCerts) -> None:
    """RFC 3207: STARTTLS is offered with tls_cert/tls_key; the certificate verifies against
    the test CA; the trace says ``with ESMTPS`` and names the TLS version."""
    async with running(frontend_settings(**certs.settings()), mem) as server:

        def send() -> tuple[int, bytes]:
            with smtplib.SMTP("127.0.0.1", server.port, local_hostname="client.example.test") as s:
                s.ehlo()
                s.starttls(context=certs.client_context())
                s.ehlo()
                assert not s.has_extn("starttls")
                s.mail("alice@example.test")
                s.rcpt("bob@dest.example.test")
                return s.data(b"Subject: tls\r\n\r\nsecret\r\n")

        code, _ = await asyncio.to_thread(send)
    assert code == 250
    [entry] = await entries_of(mem)
    received = split_body(await read_body(mem, entry.id))[0]
    assert b" with ESMTPS id " in received and b"\t(TLSv1." in received


async def test_case05_plaintext_after_starttls_is_discarded(
    mem: Stores, certs: FrontendCerts
) -> None:
    """CASE-05 / RFC 3207 §4.2: commands pipelined in plaintext behind STARTTLS are never
    executed: inside TLS the first reply is EHLO's, MAIL gets 250 (not 503), and exactly one
    message alice → bob is queued; nothing mentions the forged addresses."""
    async with running(frontend_settings(**certs.settings()), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.send(
            b"STARTTLS\r\nMAIL FROM:<forged@example.test>\r\nRCPT TO:<victim@dest.example.test>\r\n"
        )
        assert (await w.reply()).code == 220
        await w.starttls(certs.client_context(), certs.name)
        ehlo = await w.cmd("EHLO client.example.test")
        assert ehlo.code == 250 and ehlo.lines[0] == "mx.jsqueue.test"
        await w.expect("MAIL FROM:<alice@example.test>", 250)
        await w.expect("RCPT TO:<bob@dest.example.test>", 250)
        await w.expect("DATA", 354)
        await w.send(dot_stuff(case_file("CASE-05", "message.eml")))
        queued_id(await w.reply())
        await w.expect("QUIT", 221)
    [entry] = await entries_of(mem)
    assert entry.reverse_path == "alice@example.test"
    assert [r.address for r in entry.recipients] == ["bob@dest.example.test"]
    assert b"forged" not in entry.to_json() and b"victim" not in entry.to_json()


async def test_tls_session_starts_over(mem: Stores, certs: FrontendCerts) -> None:
    """RFC 3207 §4.2: after TLS the client must EHLO again (503 before), STARTTLS is no
    longer offered and a second STARTTLS is refused."""
    async with running(frontend_settings(**certs.settings()), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        await w.expect("STARTTLS", 220)
        await w.starttls(certs.client_context(), certs.name)
        await w.expect("MAIL FROM:<a@example.test>", 503)
        ehlo = await w.expect("EHLO client.example.test", 250)
        assert "STARTTLS" not in ehlo.lines and not any(x.startswith("AUTH") for x in ehlo.lines)
        await w.expect("STARTTLS", 503)
        await w.expect("MAIL FROM:<a@example.test>", 250)


async def test_require_tls_refuses_mail_in_plaintext(mem: Stores, certs: FrontendCerts) -> None:
    """RFC 3207 §4: with require_tls, MAIL before STARTTLS gets 530 5.7.0."""
    async with running(frontend_settings(require_tls=True, **certs.settings()), mem) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        r = await w.expect("MAIL FROM:<a@example.test>", 530)
        assert r.enhanced == "5.7.0"
        await w.expect("STARTTLS", 220)
        await w.starttls(certs.client_context(), certs.name)
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test>", 250)


async def test_auth_only_inside_tls(mem: Stores, certs: FrontendCerts, auth_file: Path) -> None:
    """RFC 4954 §4 + the brief: AUTH is neither offered nor accepted in plaintext
    (538 5.7.11); inside TLS it is offered as PLAIN and LOGIN."""
    settings = frontend_settings(auth_file=auth_file, **certs.settings())
    async with running(settings, mem) as server:
        w = await Wire.connect(server.port)
        ehlo = await w.expect("EHLO client.example.test", 250)
        assert not any(line.startswith("AUTH") for line in ehlo.lines)
        r = await w.expect(f"AUTH PLAIN {plain('alice', PASSWORD)}", 538)
        assert r.enhanced == "5.7.11"
        await w.expect("STARTTLS", 220)
        await w.starttls(certs.client_context(), certs.name)
        ehlo = await w.expect("EHLO client.example.test", 250)
        assert "AUTH PLAIN LOGIN" in ehlo.lines


async def test_auth_over_tls_allows_relay(
    mem: Stores, certs: FrontendCerts, auth_file: Path
) -> None:
    """RFC 4954 + RFC 5321 §3.6.2: from 127.0.0.2 (outside relay_networks) RCPT is refused
    until the client authenticates over TLS; then it may relay (``with ESMTPSA``)."""
    settings = frontend_settings(
        auth_file=auth_file, relay_networks=["127.0.0.1/32"], **certs.settings()
    )
    async with running(settings, mem) as server:
        w = await tls_wire(server.port, certs, source="127.0.0.2")
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<alice@example.test>", 250)
        assert (await w.cmd("RCPT TO:<bob@dest.example.test>")).code == 554
        await w.expect("RSET", 250)
        r = await w.expect(f"AUTH PLAIN {plain('alice', PASSWORD)}", 235)
        assert r.enhanced == "2.7.0"
        reply = await w.transaction(
            "alice@example.test", ["bob@dest.example.test"], dot_stuff(b"Hi\r\n"), ehlo=False
        )
        qid = queued_id(reply)
    received = split_body(await read_body(mem, qid))[0]
    assert b" with ESMTPSA id " in received and b"alice" not in received.split(b" id ")[0]


async def test_aiosmtplib_login_over_starttls(
    mem: Stores, certs: FrontendCerts, auth_file: Path
) -> None:
    """A real client doing STARTTLS + AUTH from a non-relay address (aiosmtplib)."""
    settings = frontend_settings(
        auth_file=auth_file, relay_networks=["127.0.0.1/32"], **certs.settings()
    )
    msg = EmailMessage()
    msg["From"], msg["To"], msg["Subject"] = "alice@example.test", "bob@dest.example.test", "auth"
    msg.set_content("authenticated relay")
    async with running(settings, mem) as server:
        errors, text = await _aiosmtplib_send(msg, server.port, certs)
    assert errors == {} and "queued as" in text
    assert len(await entries_of(mem)) == 1


async def _aiosmtplib_send(
    msg: EmailMessage, port: int, certs: FrontendCerts
) -> tuple[dict[str, object], str]:
    client = aiosmtplib.SMTP(
        hostname="127.0.0.1",
        port=port,
        start_tls=False,
        tls_context=certs.client_context(),
        source_address=("127.0.0.2", 0),
        local_hostname="client.example.test",
    )
    async with client:
        await client.starttls(server_hostname=certs.name)
        await client.login("alice", PASSWORD)
        errors, text = await client.send_message(msg)
    return dict(errors), text


@pytest.mark.parametrize(
    ("lines", "code"),
    [
        ([f"AUTH PLAIN {plain('alice', 'wrong')}"], 535),
        ([f"AUTH PLAIN {plain('mallory', PASSWORD)}"], 535),
        ([f"AUTH PLAIN {plain('alice', PASSWORD, authz='bob')}"], 535),
        (["AUTH PLAIN !!!"], 501),
        (["AUTH PLAIN", "*"], 501),
        (["AUTH CRAM-MD5"], 504),
        (["AUTH"], 501),
        (
            ["AUTH LOGIN", base64.b64encode(b"alice").decode(), base64.b64encode(b"nope").decode()],
            535,
        ),
        (
            [
                "AUTH LOGIN",
                base64.b64encode(b"alice").decode(),
                base64.b64encode(PASSWORD.encode()).decode(),
            ],
            235,
        ),
        (["AUTH PLAIN", plain("alice", PASSWORD)], 235),
    ],
)
async def test_auth_outcomes(
    mem: Stores, certs: FrontendCerts, auth_file: Path, lines: list[str], code: int
) -> None:
    """RFC 4954 §4, §6; RFC 4616 §2: each AUTH exchange gets one final reply; 334 challenges
    in between; failures leave the session usable."""
    settings = frontend_settings(auth_file=auth_file, **certs.settings())
    async with running(settings, mem) as server:
        w = await tls_wire(server.port, certs)
        await w.expect("EHLO client.example.test", 250)
        for line in lines[:-1]:
            await w.expect(line, 334)
        final = await w.cmd(lines[-1])
        assert final.code == code, final
        if code == 235:
            await w.expect(f"AUTH PLAIN {plain('alice', PASSWORD)}", 503)
        else:
            await w.expect("NOOP", 250)


async def test_password_guessing_is_slowed_then_ended(
    mem: Stores, certs: FrontendCerts, auth_file: Path
) -> None:
    """As Postfix's smtpd_soft_error_limit / smtpd_hard_error_limit: 24 wrong passwords
    pipelined, then the right one. Past ``soft_error_limit`` (2 here) each 535 waits
    ``error_delay_s``; at ``hard_error_limit`` (4) the session gets ``421 4.7.0`` and is
    closed, the rest unread: never a 235. Every guess used to get its 535 at once, and the
    right one its 235 in the same session."""
    settings = frontend_settings(
        auth_file=auth_file,
        soft_error_limit=2,
        hard_error_limit=4,
        error_delay_s=0.2,
        **certs.settings(),
    )
    async with running(settings, mem) as server:
        w = await tls_wire(server.port, certs)
        await w.expect("EHLO client.example.test", 250)
        guesses = [f"AUTH PLAIN {plain('alice', f'guess{i}')}" for i in range(24)]
        started = asyncio.get_running_loop().time()
        await w.send("".join(f"{g}\r\n" for g in guesses).encode())
        await w.send(f"AUTH PLAIN {plain('alice', PASSWORD)}\r\n".encode())
        codes = [(await w.reply()).code for _ in range(5)]
        assert codes == [535, 535, 535, 535, 421], codes
        assert asyncio.get_running_loop().time() - started >= 2 * 0.2  # the 3rd and 4th waited
        assert await w.closed() == b""


async def test_auth_disabled_without_auth_file(mem: Stores, certs: FrontendCerts) -> None:
    """No auth_file: AUTH is not offered, even inside TLS, and answers 502."""
    async with running(frontend_settings(**certs.settings()), mem) as server:
        w = await tls_wire(server.port, certs)
        ehlo = await w.expect("EHLO client.example.test", 250)
        assert not any(line.startswith("AUTH") for line in ehlo.lines)
        await w.expect(f"AUTH PLAIN {plain('alice', PASSWORD)}", 502)
        assert "AUTH" not in (await w.expect("HELP", 250)).lines[0].split()
        assert (await w.cmd("HELP AUTH")).code == 501  # as for any command not offered


async def test_help_lists_auth_with_an_auth_file(
    mem: Stores, certs: FrontendCerts, auth_file: Path
) -> None:
    """HELP (RFC 5321 §4.1.1.8) lists AUTH where an auth file is set, and gives its syntax."""
    async with running(frontend_settings(auth_file=auth_file, **certs.settings()), mem) as server:
        w = await tls_wire(server.port, certs)
        await w.expect("EHLO client.example.test", 250)
        assert "AUTH" in (await w.expect("HELP", 250)).lines[0].split()
        assert "AUTH <mechanism>" in (await w.expect("HELP AUTH", 250)).lines[0]


async def test_auth_not_inside_a_transaction(
    mem: Stores, certs: FrontendCerts, auth_file: Path
) -> None:
    """RFC 4954 §4: AUTH is not permitted during a mail transaction (503)."""
    async with running(frontend_settings(auth_file=auth_file, **certs.settings()), mem) as server:
        w = await tls_wire(server.port, certs)
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        await w.expect(f"AUTH PLAIN {plain('alice', PASSWORD)}", 503)


async def test_swaks_starttls_and_auth(mem: Stores, certs: FrontendCerts, auth_file: Path) -> None:
    """swaks (Debian package) doing STARTTLS + AUTH PLAIN from 127.0.0.2, which may only
    relay because it authenticated."""
    swaks = shutil.which("swaks")
    assert swaks, "swaks is not installed: run `make tools` (apt-get install swaks)"
    settings = frontend_settings(
        auth_file=auth_file, relay_networks=["127.0.0.1/32"], **certs.settings()
    )
    async with running(settings, mem) as server:
        proc = await asyncio.create_subprocess_exec(
            swaks, "--server", "127.0.0.1", "--port", str(server.port),
            "--local-interface", "127.0.0.2", "--helo", "swaks.example.test",
            "--from", "alice@example.test", "--to", "bob@dest.example.test",
            "--tls", "--auth", "PLAIN", "--auth-user", "alice", "--auth-password", PASSWORD,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    assert b"235 2.7.0" in out and b"250 2.0.0 queued as " in out
    [entry] = await entries_of(mem)
    assert b" with ESMTPSA id " in split_body(await read_body(mem, entry.id))[0]
