"""The outbound client against scripted MXes for faults other MTAs had public reports
about: STARTTLS response injection (RFC 3207 §4.2), reply syntax and 421 (RFC 5321 §4.2,
§3.8), capability checks (RFC 6531, 6152, 1870), per-recipient results (RFC 5321 §3.3,
RFC 2920). MX addresses 127.0.5.x."""

from __future__ import annotations

import email

import pytest

from jsqueue.config import WorkerSettings
from jsqueue.delivery import BodySource, DeliveryEnvelope, MxTarget, deliver
from jsqueue.envelope import Notify, Recipient
from support.mx import Certs, ScriptedMx, Session, Transaction, shared_port
from support.queue import Harness, eventually

SENDER_ZONE_5 = """
example.test.        300 IN MX 10 mx.example.test.
mx.example.test.     300 IN A  127.0.5.11
"""


async def _gone(h: Harness, queue_id: str) -> bool:
    return await h.entry(queue_id) is None


MESSAGE = b"From: a@example.test\r\nTo: b@inj.example.test\r\nSubject: t\r\n\r\nhello\r\n"


def settings_for(port: int, **overrides: object) -> WorkerSettings:
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


def envelope(*recipients: Recipient, sender: str = "a@example.test") -> DeliveryEnvelope:
    return DeliveryEnvelope(
        domain=recipients[0].domain, reverse_path=sender, recipients=tuple(recipients)
    )


async def test_starttls_injected_cleartext_is_discarded_and_ehlo_repeated() -> None:
    """RFC 3207 §4.2 (CVE-2011-0411 class): replies a man in the middle appends in
    cleartext to the 220 of STARTTLS are discarded, never read as the replies to EHLO,
    MAIL, RCPT or DATA after the handshake; the client says EHLO again and uses only what
    that EHLO advertised (here: no DSN, no SIZE limit), forgetting the cleartext one's."""
    host = "127.0.5.1"
    port = shared_port([host])
    name = "mx.inj.example.test"
    plain = f"250-{name}\n250-DSN\n250-SIZE 10\n250 STARTTLS"
    secure = f"250-{name}\n250 8BITMIME"

    def ehlo(session: Session, line: str) -> str | None:
        if line.upper().startswith("EHLO"):
            return secure if session.tls else plain
        return None

    injected = "\n".join(["250-evil.example.test", "250 DSN", *["550 5.1.1 injected"] * 4])
    rcpt = Recipient.from_address("b@inj.example.test").model_copy(
        update={"notify": frozenset({Notify.SUCCESS, Notify.FAILURE})}
    )
    certs = Certs()
    async with ScriptedMx(
        host, port, name=name, tls=certs.server_context(name), hook=ehlo, tls_inject=injected
    ) as mx:
        result = await deliver(
            [MxTarget(host=name, address=host)],
            envelope(rcpt),
            BodySource.from_bytes(MESSAGE),
            settings_for(port),
        )
    assert result.delivered == [rcpt.address], result.replies
    assert result.tls and not result.dsn
    assert len(mx.delivered) == 1 and mx.delivered[0].tls
    verbs = [c.split(" ", 1)[0].upper() for c in mx.commands]
    assert verbs[:6] == ["EHLO", "STARTTLS", "EHLO", "MAIL", "RCPT", "DATA"]
    rcpt_lines = [c for c in mx.commands if c.upper().startswith("RCPT")]
    assert rcpt_lines == [f"RCPT TO:<{rcpt.address}>"]  # no NOTIFY: no DSN after TLS
    mail_lines = [c for c in mx.commands if c.upper().startswith("MAIL")]
    assert "SIZE=" not in mail_lines[0]


BROKEN = {
    "greeting-codes-differ": {"greeting": "220-mx.bad.example.test\n554 no"},
    "greeting-no-separator": {"greeting": "220mx.bad.example.test"},
    "greeting-554": {"greeting": "554 5.3.2 no service"},
    "greeting-421": {"greeting": "421 4.3.2 busy"},
    "greeting-then-extra": {"greeting": "220 mx.bad.example.test\n250 unsolicited"},
    "ehlo-421": {"ehlo": "421 4.3.2 closing"},
    "ehlo-codes-differ": {"ehlo": "250-mx.bad.example.test\n251 PIPELINING"},
    "ehlo-then-extra": {"ehlo": "250 mx.bad.example.test\n250 again"},
    "mail-421": {"mail": "421 4.3.2 closing"},
    "mail-two-replies": {"extra_replies": {"MAIL": "250 2.1.0 again"}},
    "rcpt-two-replies": {"extra_replies": {"RCPT": "550 5.1.1 not yours"}},
    "rcpt-421": {"rcpt": "421 4.3.2 closing"},
    "rcpt-codes-differ": {"rcpt": "250-ok\n550 5.1.1 no"},
    "data-421": {"data": "421 4.3.2 closing"},
    "helo-too": {"ehlo": "502 5.5.1 no", "helo": "421 4.3.2 bye"},
    "starttls-421": {
        "extensions": ("PIPELINING", "STARTTLS"),
        "hook": lambda _s, line: "421 4.3.2 bye" if line.upper() == "STARTTLS" else None,
    },
    "starttls-codes-differ": {
        "extensions": ("PIPELINING", "STARTTLS"),
        "hook": lambda _s, line: "220-go\n554 no" if line.upper() == "STARTTLS" else None,
    },
}


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("fault", sorted(BROKEN))
async def test_broken_primary_goes_to_the_next_mx(fault: str, pipelining: bool) -> None:
    """RFC 5321 §3.8, §4.2, §5.1: a primary that breaks the protocol before the body went
    out (421 at any stage, a malformed or unsolicited reply) sends the message to the next
    MX; nothing is bounced."""
    bad, good = "127.0.5.2", "127.0.5.3"
    port = shared_port([bad, good])
    rcpt = Recipient.from_address("b@two.example.test")
    kw: dict[str, object] = {"name": "mx.bad.example.test", **BROKEN[fault]}
    async with (
        ScriptedMx(bad, port, **kw) as primary,  # type: ignore[arg-type]
        ScriptedMx(good, port, name="mx2.two.example.test") as backup,
    ):
        result = await deliver(
            [
                MxTarget(host="mx.bad.example.test", address=bad, preference=10),
                MxTarget(host="mx2.two.example.test", address=good, preference=20),
            ],
            envelope(rcpt),
            BodySource.from_bytes(MESSAGE),
            settings_for(port, pipelining=pipelining),
        )
    assert not primary.delivered
    assert result.delivered == [rcpt.address], result.replies
    assert len(backup.delivered) == 1


async def test_pipelined_mixed_rcpts_and_a_554_to_the_dot_one_dsn_then_the_450_alone(
    queue_harness: Harness,
) -> None:
    """RFC 5321 §3.3, RFC 2920: one pipelined group gets 250 / 450 / 550 / 250 to its
    RCPTs and 554 to the final dot: the accepted two and the 550 are bounced in one DSN,
    the 450 is retried alone, gets 250 to its dot, and nothing is offered twice."""
    h = queue_harness
    domain = "mixed5.example.test"
    h.dns.add(
        SENDER_ZONE_5 + f"{domain}. 300 IN MX 10 mx.{domain}.\nmx.{domain}. 300 IN A 127.0.5.10\n"
    )
    a, b, c, d = (f"{x}@{domain}" for x in "abcd")
    dots: list[list[str]] = []

    def end(tx: Transaction) -> str:
        dots.append(list(tx.rcpt_to))
        return "554 5.7.1 content refused" if len(dots) == 1 else "250 2.0.0 queued"

    async with (
        ScriptedMx(
            "127.0.5.10",
            h.mx_port,
            name=f"mx.{domain}",
            rcpt_replies={b: "450 4.2.1 try later", c: "550 5.1.1 no such user"},
            end_of_data=end,
        ) as mx,
        ScriptedMx("127.0.5.11", h.mx_port, name="mx.example.test") as sender_mx,
    ):
        qid = await h.submit(b"Subject: mixed\r\n\r\nbody\r\n", [a, b, c, d])
        async with h.running():
            await eventually(lambda: len(sender_mx.delivered) == 1, what="the failure DSN")
            mx.rcpt_replies.pop(b)
            await eventually(lambda: len(dots) == 2, what="the retry of b@")
            await eventually(lambda: _gone(h, qid), what="entry removed")
        assert dots == [[a, d], [b]]
        assert [n for s in mx.sessions for n in s.rcpt_counts()] == [4, 1]
        assert len(sender_mx.delivered) == 1, "one DSN"
        dsn = email.message_from_bytes(sender_mx.delivered[0].content or b"")
        finals = [
            str(p["Final-Recipient"]) for p in dsn.walk() if p.get("Final-Recipient") is not None
        ]
        statuses = [str(p["Status"]) for p in dsn.walk() if p.get("Status") is not None]
        assert sorted(finals) == sorted(f"rfc822; {x}" for x in (a, c, d)), finals
        assert sorted(statuses) == ["5.1.1", "5.7.1", "5.7.1"]


@pytest.mark.parametrize("refusal", ["500 5.5.1 unrecognized", "502 5.5.2 not implemented"])
async def test_helo_fallback_sends_no_esmtp_and_converts_an_8bit_body(refusal: str) -> None:
    """RFC 5321 §3.2, §4.1.1.1: EHLO refused with 500/502 is followed by HELO; the session
    has no extensions, so MAIL carries no parameter and an 8-bit body is converted to
    7-bit MIME (RFC 6152 §3), never sent raw."""
    host = "127.0.5.4"
    port = shared_port([host])
    body = (
        b"From: a@example.test\r\nTo: b@helo.example.test\r\nSubject: t\r\nMIME-Version: 1.0\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n\r\n"
        + "gr\u00fc\u00dfe\r\n".encode()
    )
    rcpt = Recipient.from_address("b@helo.example.test")
    env = DeliveryEnvelope(
        domain=rcpt.domain, reverse_path="a@example.test", recipients=(rcpt,), body_8bit=True
    )
    async with ScriptedMx(host, port, name="mx.helo.example.test", ehlo=refusal) as mx:
        result = await deliver(
            [MxTarget(host="mx.helo.example.test", address=host)],
            env,
            BodySource.from_bytes(body),
            settings_for(port),
        )
    assert result.delivered == [rcpt.address], result.replies
    assert result.converted_7bit
    verbs = [c.split(" ", 1)[0].upper() for c in mx.commands]
    assert verbs[:3] == ["EHLO", "HELO", "MAIL"]
    assert [c for c in mx.commands if c.startswith("MAIL")] == ["MAIL FROM:<a@example.test>"]
    content = mx.delivered[0].content or b""
    assert content.isascii() and b"quoted-printable" in content.lower()


async def test_smtputf8_message_to_a_server_without_it_is_never_sent() -> None:
    """RFC 6531 §3.4: a message that needs SMTPUTF8 (UTF-8 local part) is not sent to a
    server that does not advertise it; it fails with 5.6.7 before MAIL."""
    host = "127.0.5.5"
    port = shared_port([host])
    rcpt = Recipient.from_address("j\u00f6rg@utf8.example.test")
    env = DeliveryEnvelope(
        domain=rcpt.domain, reverse_path="a@example.test", recipients=(rcpt,), smtputf8=True
    )
    async with ScriptedMx(host, port, name="mx.utf8.example.test") as mx:
        result = await deliver(
            [MxTarget(host="mx.utf8.example.test", address=host)],
            env,
            BodySource.from_bytes(MESSAGE),
            settings_for(port),
        )
    assert result.replies[rcpt.address].code == 554
    assert result.replies[rcpt.address].enhanced == "5.6.7"
    assert not any(c.upper().startswith(("MAIL", "RCPT", "DATA")) for c in mx.commands)


async def test_smtputf8_without_8bitmime_in_the_ehlo_takes_the_message_as_it_is() -> None:
    """RFC 6531 §3.1: a server offering SMTPUTF8 supports 8BITMIME. One that forgets to
    say so gets a message with UTF-8 in its header under SMTPUTF8, 8-bit as it is (no
    BODY= parameter it did not offer); the 7-bit conversion cannot carry a UTF-8 header,
    so the message used to bounce with 5.6.3."""
    host = "127.0.5.7"
    port = shared_port([host])
    rcpt = Recipient.from_address("j\u00f6rg@utf8.example.test")
    message = "From: J\u00f6rg <a@example.test>\r\nSubject: gr\u00fc\u00dfe\r\n\r\nh\u00e9\r\n"
    env = DeliveryEnvelope(
        domain=rcpt.domain,
        reverse_path="a@example.test",
        recipients=(rcpt,),
        smtputf8=True,
        body_8bit=True,
    )
    extensions = ["PIPELINING", "SMTPUTF8", "ENHANCEDSTATUSCODES"]
    async with ScriptedMx(
        host, port, name="mx.utf8.example.test", extensions=extensions, smtputf8=True
    ) as mx:
        result = await deliver(
            [MxTarget(host="mx.utf8.example.test", address=host)],
            env,
            BodySource.from_bytes(message.encode()),
            settings_for(port),
        )
    assert result.delivered == [rcpt.address], result.replies
    (sent,) = mx.delivered
    assert "SMTPUTF8" in sent.mail_params and not any(
        p.startswith("BODY=") for p in sent.mail_params
    )
    assert sent.content == message.encode()


@pytest.mark.parametrize("pipelining", [True, False])
async def test_split_and_overlong_replies_keep_their_meaning(pipelining: bool) -> None:
    """RFC 5321 §4.2, §4.5.3.1.5: replies split into 3-octet TCP segments are read whole;
    a 550 of 20 000 octets to one RCPT stays that recipient's 550 (its text cut), the
    other recipient is delivered."""
    host = "127.0.5.6"
    port = shared_port([host])
    good, bad = (Recipient.from_address(f"{x}@split.example.test") for x in "gb")
    long_550 = "550 5.1.1 " + "x" * 20000
    async with ScriptedMx(
        host, port, name="mx.split.example.test", rcpt_replies={bad.address: long_550}
    ) as mx:
        overlong = await deliver(
            [MxTarget(host="mx.split.example.test", address=host)],
            envelope(good, bad),
            BodySource.from_bytes(MESSAGE),
            settings_for(port, pipelining=pipelining),
        )
        mx.rcpt_replies.clear()
        mx.trickle = 3
        split = await deliver(
            [MxTarget(host="mx.split.example.test", address=host)],
            envelope(good, bad),
            BodySource.from_bytes(MESSAGE),
            settings_for(port, pipelining=pipelining),
        )
    assert overlong.delivered == [good.address]
    reply = overlong.replies[bad.address]
    assert (reply.code, reply.enhanced) == (550, "5.1.1") and len(reply.text) < 9000
    assert split.delivered == [good.address, bad.address], split.replies
    assert mx.pieces > 20


async def test_421_to_the_final_dot_defers_at_that_mx() -> None:
    """RFC 5321 §3.8, §4.2.5: a 421 to the final dot is a temporary failure of the
    transaction: the recipient is deferred (not bounced) and the next MX is not tried (the
    body went out), nor is the connection kept for reuse."""
    first, second = "127.0.5.7", "127.0.5.8"
    port = shared_port([first, second])
    rcpt = Recipient.from_address("b@dot421.example.test")
    async with (
        ScriptedMx(first, port, end_of_data="421 4.3.0 shutting down") as one,
        ScriptedMx(second, port) as two,
    ):
        result = await deliver(
            [
                MxTarget(host="mx1.dot421.example.test", address=first, preference=10),
                MxTarget(host="mx2.dot421.example.test", address=second, preference=20),
            ],
            envelope(rcpt),
            BodySource.from_bytes(MESSAGE),
            settings_for(port),
        )
    assert result.deferred == [rcpt.address] and result.replies[rcpt.address].code == 421
    assert two.connections == 0 and len(one.transactions) == 1
